//! What a decode worker asks a prefill worker over the control plane (QUIC, mutual TLS), and the
//! answers. Bincode through `pdkv_transport`'s codec, like every other control message.

use pdkv_core::block::BlockId;
use pdkv_core::wire::GrantId;
use serde::{Deserialize, Serialize};

/// A decode worker's request about one hand-off, named by vLLM's request id on the prefill side.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum HandoffRequest {
    /// Take the hand-off (first claim) or renew its lease; answered with its blocks and their
    /// generations now.
    Claim {
        /// The prefill side's request id.
        request: String,
        /// How many decode workers read this hand-off (1, or more when the legs shard KV heads
        /// over different tensor-parallel sizes): it ends after the last one's release.
        readers: u32,
    },
    /// Reading is over (done or given up): once every reader released it, the prefill side may
    /// free the blocks.
    Release {
        /// The prefill side's request id.
        request: String,
    },
    /// Which layer each of the worker's planes holds, asked once per connection: a decode worker
    /// matches its planes to the prefill worker's by layer, so legs that split the layers over
    /// pipeline stages differently still read each layer from the worker holding it.
    Planes,
}

/// The layer one K, V or state plane holds, and the KV group whose block ids index it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlaneName {
    /// vLLM's layer name (the names of every layer a block-outermost plane packs, joined by `|`).
    pub layer: String,
    /// Its KV group.
    pub group: u32,
    /// Bytes of one layer's page in a block (the block's bytes unless it packs several layers,
    /// one page after another).
    pub page_bytes: u64,
}

impl PlaneName {
    /// How many layers' pages a block of the plane packs.
    pub fn pages(&self) -> u64 {
        self.layer.split('|').count() as u64
    }
}

/// The prefill worker's answer. Refusals (an ended hand-off, another owner) travel as the
/// control plane's refusal text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum HandoffResponse {
    /// The hand-off is yours until the lease lapses.
    Claimed {
        /// The grant its READs name (the network engine's memory server checks it).
        grant: GrantId,
        /// Its blocks per group.
        blocks: Vec<Vec<BlockId>>,
        /// `generations[g][i]` is the generation of `blocks[g][i]` now: a READ whose blocks still
        /// show these generations after the copy read what the prefill wrote.
        generations: Vec<Vec<u32>>,
        /// Milliseconds left on the lease.
        lease_left_ms: u64,
    },
    /// Nothing is announced under that id yet (vLLM announces it on its next step): ask again.
    NotYet,
    /// Released.
    Released,
    /// The worker's planes, in its registration order.
    Planes(Vec<PlaneName>),
}
