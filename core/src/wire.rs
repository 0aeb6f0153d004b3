//! Wire types: what crosses the network between nodes.
//!
//! These are plain serde types; the transport crate owns their encoding (one codec module) and
//! framing. Everything here is also what the in-process actors exchange, so a cluster in one
//! process and a cluster across hosts run the same protocol.

use serde::{Deserialize, Serialize};

use crate::exchange::Offer;

/// A request's id, unique within a cluster run (assigned by the router).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "req-{}", self.0)
    }
}

/// A node's name as written in `cluster.toml`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeId(pub String);

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Id of a grant: the prefill leg's permission for one decode leg to READ one request's blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GrantId(pub u64);

/// What the prefill leg hands the router when a request's KV is ready: the offer and the grant
/// under which the decode leg may READ it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvParams {
    /// The request.
    pub request: RequestId,
    /// The prefill node holding the KV.
    pub prefill_node: NodeId,
    /// Per-group blocks the decode leg may read.
    pub offer: Offer,
    /// Generation of every offered block when it was granted, parallel to `offer.groups[g].blocks`;
    /// a READ that finds another generation afterwards raced a free and fails.
    pub generations: Vec<Vec<u32>>,
    /// The grant covering those blocks.
    pub grant: GrantId,
    /// How long the grant lives unless renewed, in milliseconds.
    pub lease_ms: u64,
    /// The prompt's token ids (the decode leg needs them for prefix hits and the last token).
    pub prompt: Vec<u32>,
}
