//! The `unbroken` toolkit's top floor: the unmodified peer used by demos and tests, and the
//! lab scenarios that drive guard, application and peer in network namespaces.

pub mod bench;
pub mod ckptchaos;
pub mod detbench;
pub mod lbcmd;
pub mod objbench;
pub mod objchaos;
pub mod objdemo;
pub mod peer;
pub mod repchaos;
pub mod repclient;
pub mod repdemo;
pub mod replbench;
pub mod scenario;
