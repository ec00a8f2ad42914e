//! Object mode (TRODS-KV): the agent beside each server, the load balancer in front of them
//! and the store behind. The agent's core, every decision and no I/O ([`agentcore`]), and its
//! I/O ([`agent`]: the queue, the store client, sock_diag, socket rebuilds); the records it
//! seals and opens ([`records`]); the store ([`store`]: the Redis client, [`kv`]: the trait
//! the agent uses, with an in-memory store for tests); the load balancer ([`lb`]: its I/O,
//! [`detector`]: its I/O-free failure detector) and the heartbeat protocol between agents and
//! balancer ([`hbproto`]); the agent's fast-path half ([`agentfast`]: which connections the
//! kernel carries, and the hand-off), decided beside its core.

pub mod agent;
pub mod agentcore;
pub mod agentfast;
pub mod detector;
pub mod hbproto;
pub mod kv;
pub mod lb;
pub mod records;
pub mod store;
