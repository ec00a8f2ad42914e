//! Shared scaffolding of this crate's integration tests.
#![allow(dead_code)]

pub mod emu;
