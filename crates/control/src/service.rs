//! What the modes' configurations share.

use serde::Deserialize;
use std::net::IpAddr;

/// A protected endpoint (`[[service]]` in a guard's or a replica's configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Service {
    pub addr: IpAddr,
    pub port: u16,
}
