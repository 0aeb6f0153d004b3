//! The protocol of `pdkv-transport-peer`, the prefill-side peer process the transport tests and
//! benches talk to. Shared by the peer binary and the tests (included with `#[path]`).

use pdkv_core::layout::{GroupSpec, KvLayout};
use pdkv_core::wire::GrantId;
use serde::{Deserialize, Serialize};

/// Layers the peer registers (one region each), all in one full-attention group.
pub const LAYERS: usize = 2;
/// Blocks per layer, besides the null block 0.
pub const BLOCKS: u32 = 32;
/// Bytes of one block of one layer.
pub const BLOCK_BYTES: u64 = 4096;

/// The peer's KV layout (its compat hash goes into the hello).
pub fn layout() -> KvLayout {
    KvLayout::new(
        vec![GroupSpec::full(16, 1).expect("valid group")],
        vec![0; LAYERS],
    )
    .expect("valid layout")
}

/// The byte the peer holds at `offset` of layer `layer` (before any reuse).
pub fn pattern_byte(layer: usize, offset: u64) -> u8 {
    ((offset.wrapping_mul(31) ^ (layer as u64).wrapping_mul(131)) % 251) as u8
}

/// Requests a decode node sends the peer.
#[derive(Debug, Serialize, Deserialize)]
pub enum PeerRequest {
    /// Grant the caller a READ of these blocks (group 0) for `lease_ms`.
    Grant {
        /// Block ids.
        blocks: Vec<u32>,
        /// Lease length.
        lease_ms: u64,
    },
    /// End a grant.
    Release {
        /// The grant.
        grant: GrantId,
    },
    /// Free and reuse a block: bump its generation and overwrite its bytes.
    Reuse {
        /// Block id.
        block: u32,
    },
}

/// The peer's answers.
#[derive(Debug, Serialize, Deserialize)]
pub enum PeerResponse {
    /// A grant and the generation of each block.
    Granted {
        /// The grant.
        grant: GrantId,
        /// Generations, parallel to the blocks.
        generations: Vec<u32>,
    },
    /// The grant ended.
    Released,
    /// The block's new generation.
    Reused {
        /// New generation.
        generation: u32,
    },
}
