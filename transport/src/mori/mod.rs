//! mori, AMD's RDMA IO engine, as a pdkv READ engine.
//!
//! mori has a C++ API only. A small C++ shim (`transport/mori/pdkv_mori_shim.cpp`) gives it a C
//! surface; the `mori` feature builds the shim as a shared library (`build.rs`) that
//! [`MoriEngine`] loads at node start, so a binary built with the feature runs on any host and
//! names what is missing where mori cannot run.
//!
//! What needs no library is always built and tested: run batching ([`runs`]), the settings
//! ([`settings`]) and the error kinds ([`error`]).

pub mod error;
pub mod runs;
pub mod settings;

#[cfg(feature = "mori")]
mod engine;
#[cfg(feature = "mori")]
mod ffi;

#[cfg(feature = "mori")]
pub use engine::MoriEngine;
pub use error::MoriError;
pub use settings::{MoriSettings, PollMode};

/// Whether this build has the mori engine.
pub const BUILT: bool = cfg!(feature = "mori");
