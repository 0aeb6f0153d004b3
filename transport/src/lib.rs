//! pdkv-transport: how bytes and messages move between legs.
//!
//! - [`region`]: registered memory regions that READ engines copy between.
//! - [`engine`]: the READ engine trait (shaped like mori's IO engine) and its error kinds.
//! - [`local`]: the in-process engine (both legs in one process).
//!
//! Never imports the actors crate: the wire types and the READ engine trait are the boundary.
#![warn(missing_docs)]

pub mod engine;
pub mod local;
pub mod region;
