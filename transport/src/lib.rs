//! pdkv-transport: how bytes and messages move between legs.
//!
//! - [`clock`]: the monotonic millisecond clock leases and tickets are measured with.
//! - [`codec`]: length-prefixed frames of `pdkv_core::codec` payloads.
//! - [`tls`]: the cluster CA, node certificates, mutual-TLS configs.
//! - [`control`]: the QUIC control plane (its own tokio runtime), handshake, requests.
//! - [`heartbeat`]: the check that closes a control connection whose peer went silent.
//! - [`region`]: registered memory regions (heap, shared memory, peer mappings, GPU memory).
//! - [`gpu`]: AMD GPU memory through HIP (behind the `hip` feature).
//! - [`engine`]: the READ engine trait (shaped like mori's IO engine) and its error kinds.
//! - [`mapped`]: in-process and shared-memory READ engines (one-sided copies).
//! - [`net`]: the network READ engine (memory server, tickets, grant checks).
//! - [`copy`]: a bounded worker thread for large copies.
//! - [`mori`]: mori's RDMA READ engine (the engine itself behind the `mori` feature).
//!
//! Never imports the actors crate: the wire types and the READ engine trait are the boundary.
#![warn(missing_docs)]

pub mod clock;
pub mod codec;
pub mod control;
pub mod copy;
pub mod engine;
pub mod fuzzing;
pub mod gpu;
pub mod heartbeat;
pub mod host;
pub mod kv_read;
pub mod mapped;
pub mod mori;
mod native;
pub mod net;
pub mod region;
pub mod tls;
