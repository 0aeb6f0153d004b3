//! pdkv-core: the sans-IO heart of pdkv.
//!
//! Everything here is a pure function of its inputs: no sockets, clocks, threads, actors or
//! unseeded randomness. The actors and transports of the other crates are thin shells that own
//! state and call into this crate.
//!
//! - [`layout`]: KV-cache groups (full, sliding window, mamba), block sizes, DCP, compat hash.
//! - [`block`]: block ids and the null block.
//! - [`codec`]: the one bincode encoding of wire messages, bounded.
//! - [`exchange`]: trim, clip, anchor and pair per-group block lists; the legacy pairing.
//! - [`allocator`]: one leg's block pools, prefix cache, pins and generations.
//! - [`grant`]: READ grants with leases, read by one peer or a known number of them.
//! - [`heads`]: tensor-parallel KV heads: which prefill rank serves which heads of a decode rank.
//! - [`identity`]: the model fields two nodes must agree on, compared by name at handshake.
//! - [`leg`]: the leg protocol as sans-IO request machines (prefill, decode, router).
//! - [`node`]: a leg as one sans-IO object: allocator, grant table, machines and the rules between them.
//! - [`plan`]: block pairs to coalesced per-layer byte ranges.
//! - [`router`]: the router's rules across a client request's attempts (retries, streamed-token skip).
//! - [`proxy`]: the router's rules in front of engine legs (vLLM's P/D protocol over HTTP).
//! - [`wire`]: the serde types that cross the network.
//! - [`scenario`]: the input format of `pdkv plan`.
//! - `testing` (feature `testing`): a deterministic simulation of the leg protocol.
//!
//! Non-goals: framing and I/O (the transport owns them), scheduling, memory.
#![warn(missing_docs)]

pub mod allocator;
pub mod block;
pub mod codec;
pub mod exchange;
pub mod grant;
pub mod heads;
pub mod identity;
pub mod layout;
pub mod leg;
pub mod node;
pub mod plan;
pub mod proxy;
pub mod router;
pub mod sampling;
pub mod scenario;
#[cfg(feature = "testing")]
pub mod testing;
pub mod wire;
