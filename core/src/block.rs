//! Block ids and position-indexed block lists.
//!
//! A leg's block list for one group is *position-indexed*: entry `p` holds the tokens
//! `p*B .. p*B + B - 1` (with `B` the effective block size). Block id [`NULL_BLOCK`] stands for a
//! position whose block the leg freed (a sliding-window group drops blocks that fell out of its
//! window) or never allocated. The null block is never read or written by a transfer.

/// Id of one KV block inside a leg's block pool.
pub type BlockId = u32;

/// The null block: a placeholder for a position whose block was freed or never allocated.
pub const NULL_BLOCK: BlockId = 0;
