//! pdkv-transport: how bytes and messages move between legs.
//!
//! - [`region`]: registered memory regions that READ engines copy between.
//! - [`copy`]: a bounded worker thread for large copies.
//! - [`engine`]: the READ engine trait (shaped like mori's IO engine) and its error kinds.
//! - [`local`]: the in-process engine (both legs in one process).
//!
//! Never imports the actors crate: the wire types and the READ engine trait are the boundary.
#![warn(missing_docs)]

pub mod copy;
pub mod engine;
pub mod local;
pub mod region;
