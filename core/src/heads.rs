//! Tensor-parallel KV heads: which heads each rank of a leg holds, and where a decode rank reads
//! each of its heads when the two legs run different tensor-parallel sizes.
//!
//! A model has `H` KV heads per layer. A leg with TP size `T` shards them the way vLLM does: with
//! `T <= H` rank `r` holds heads `r·H/T .. (r+1)·H/T`; with `T > H` every head is replicated on
//! `T/H` consecutive ranks (rank `r` holds head `r / (T/H)`). MLA keeps one latent per token that
//! every rank replicates: `H = 1`.
//!
//! A [`HeadMap`] pairs a prefill sharding with a decode sharding. Every head a decode rank holds
//! is read exactly once, from one prefill rank holding it; where several prefill ranks hold a
//! head (replicated heads, MLA) the decode ranks needing it are spread over them round-robin,
//! shifted by a per-request `rotation` so consecutive requests load different prefill ranks.
//! Each prefill rank learns how many decode ranks read it ([`HeadMap::readers`]) so its hand-off
//! ends only after the last of them; a prefill rank nobody reads is given back by one decode rank
//! ([`HeadMap::releases`]).
//!
//! [`head_slices`] turns one [`HeadRead`] into byte ranges within a block, for the two orders a
//! block's heads and tokens may take in memory.

use serde::{Deserialize, Serialize};

use crate::plan::BlockSlice;
use crate::wire::Role;

/// How a leg's ranks share a layer's KV heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeadSharding {
    total: u32,
    tp: u32,
}

impl HeadSharding {
    /// `total` KV heads over `tp` ranks; one must divide the other (as vLLM requires).
    pub fn new(total: u32, tp: u32) -> Result<Self, HeadError> {
        if total == 0 {
            return Err(HeadError::NoHeads);
        }
        if tp == 0 {
            return Err(HeadError::NoRanks);
        }
        let divides = if tp <= total {
            total.is_multiple_of(tp)
        } else {
            tp.is_multiple_of(total)
        };
        if !divides {
            return Err(HeadError::Indivisible { heads: total, tp });
        }
        Ok(HeadSharding { total, tp })
    }

    /// KV heads of the model.
    pub fn total(&self) -> u32 {
        self.total
    }

    /// Ranks the heads are spread over.
    pub fn tp(&self) -> u32 {
        self.tp
    }

    /// Heads one rank holds (1 when heads are replicated).
    pub fn heads_per_rank(&self) -> u32 {
        (self.total / self.tp).max(1)
    }

    /// The first (global) head rank `rank` holds.
    pub fn first_head(&self, rank: u32) -> u32 {
        if self.tp <= self.total {
            rank * self.heads_per_rank()
        } else {
            rank / (self.tp / self.total)
        }
    }

    /// The ranks holding global head `head`, consecutive.
    pub fn holders(&self, head: u32) -> std::ops::Range<u32> {
        if self.tp <= self.total {
            let rank = head / self.heads_per_rank();
            rank..rank + 1
        } else {
            let replicas = self.tp / self.total;
            head * replicas..(head + 1) * replicas
        }
    }

    fn check_rank(&self, rank: u32, side: Role) -> Result<(), HeadError> {
        if rank < self.tp {
            Ok(())
        } else {
            Err(HeadError::RankOutOfRange {
                side,
                rank,
                tp: self.tp,
            })
        }
    }
}

/// Heads one decode rank reads from one prefill rank: `count` heads starting at the prefill
/// rank's local head `remote_first`, into the decode rank's local heads from `local_first`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeadRead {
    /// The prefill rank holding them.
    pub prefill_rank: u32,
    /// First head, counted within the prefill rank's heads.
    pub remote_first: u32,
    /// First head, counted within the decode rank's heads.
    pub local_first: u32,
    /// Consecutive heads.
    pub count: u32,
}

/// Which prefill rank serves which heads of every decode rank, for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadMap {
    prefill: HeadSharding,
    decode: HeadSharding,
    /// `reads[d]`: the reads of decode rank `d`, in local head order.
    reads: Vec<Vec<HeadRead>>,
    /// `readers[p]`: how many decode ranks read prefill rank `p`.
    readers: Vec<u32>,
}

impl HeadMap {
    /// The map between two legs' shardings of the same heads; `rotation` (any number, e.g. a
    /// request serial) picks which replica serves first.
    pub fn new(prefill: HeadSharding, decode: HeadSharding, rotation: u64) -> Result<Self, HeadError> {
        if prefill.total != decode.total {
            return Err(HeadError::TotalMismatch {
                prefill: prefill.total,
                decode: decode.total,
            });
        }
        let mut reads = Vec::with_capacity(decode.tp as usize);
        let mut readers = vec![0u32; prefill.tp as usize];
        for rank in 0..decode.tp {
            let first = decode.first_head(rank);
            let mut list: Vec<HeadRead> = Vec::new();
            for local in 0..decode.heads_per_rank() {
                let head = first + local;
                let holders = prefill.holders(head);
                let replicas = u64::from(holders.end - holders.start);
                // This rank's place among the decode ranks holding the head.
                let index = u64::from(rank - decode.holders(head).start);
                let prefill_rank = holders.start + ((index + rotation) % replicas) as u32;
                let remote_first = head - prefill.first_head(prefill_rank);
                match list.last_mut() {
                    Some(last)
                        if last.prefill_rank == prefill_rank
                            && last.remote_first + last.count == remote_first
                            && last.local_first + last.count == local =>
                    {
                        last.count += 1
                    }
                    _ => list.push(HeadRead {
                        prefill_rank,
                        remote_first,
                        local_first: local,
                        count: 1,
                    }),
                }
            }
            let mut sources: Vec<u32> = list.iter().map(|read| read.prefill_rank).collect();
            sources.sort_unstable();
            sources.dedup();
            for source in sources {
                readers[source as usize] += 1;
            }
            reads.push(list);
        }
        Ok(HeadMap {
            prefill,
            decode,
            reads,
            readers,
        })
    }

    /// The prefill sharding.
    pub fn prefill(&self) -> HeadSharding {
        self.prefill
    }

    /// The decode sharding.
    pub fn decode(&self) -> HeadSharding {
        self.decode
    }

    /// What decode rank `rank` reads, in local head order.
    pub fn reads(&self, rank: u32) -> Result<&[HeadRead], HeadError> {
        self.decode.check_rank(rank, Role::Decode)?;
        Ok(&self.reads[rank as usize])
    }

    /// How many decode ranks read prefill rank `rank` (its hand-off ends after that many
    /// releases; 0: nobody reads it).
    pub fn readers(&self, rank: u32) -> Result<u32, HeadError> {
        self.prefill.check_rank(rank, Role::Prefill)?;
        Ok(self.readers[rank as usize])
    }

    /// The prefill ranks nobody reads whose hand-off decode rank `rank` gives back (prefill rank
    /// `p` falls to decode rank `p mod decode TP`).
    pub fn releases(&self, rank: u32) -> Result<Vec<u32>, HeadError> {
        self.decode.check_rank(rank, Role::Decode)?;
        Ok((0..self.prefill.tp)
            .filter(|&p| self.readers[p as usize] == 0 && p % self.decode.tp == rank)
            .collect())
    }
}

/// The order of a block's heads and tokens in memory (vLLM's `KVCacheLayout` inside a page).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeadOrder {
    /// `[H, N, C]`: a head's tokens are one run (vLLM's `..HNC` layouts).
    HeadsOuter,
    /// `[N, H, C]`: each token holds every head (vLLM's `..NHC` layouts).
    TokensOuter,
}

/// The tokens of every block one rank holds under decode context parallelism (DCP), as vLLM
/// places them (`compute_slot_mapping`): runs of `interleave` tokens go to DCP ranks in turn, so
/// token `i` of a block sits on DCP rank `(i div interleave) mod dcp`, in that rank's slot
/// `(i div (dcp * interleave)) * interleave + i mod interleave`. `interleave` is vLLM's
/// `cp_kv_cache_interleave_size`: 1 spreads single tokens, a rank's block size gives each rank
/// whole runs of a block. A leg without DCP holds every token ([`TokenShard::WHOLE`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenShard {
    /// The leg's DCP size.
    pub dcp: u32,
    /// This rank's place among them.
    pub rank: u32,
    /// Consecutive tokens one DCP rank holds before the next rank's turn.
    pub interleave: u32,
}

impl TokenShard {
    /// Every token of the block, in order.
    pub const WHOLE: TokenShard = TokenShard {
        dcp: 1,
        rank: 0,
        interleave: 1,
    };

    /// Slots one rank's block holds for a block of `tokens` tokens: the block must split into
    /// whole turns of every DCP rank.
    fn slots(&self, tokens: u32) -> Result<u32, HeadError> {
        if self.dcp == 0 || self.rank >= self.dcp || self.interleave == 0 {
            return Err(HeadError::NoTokenShard {
                dcp: self.dcp,
                rank: self.rank,
                interleave: self.interleave,
            });
        }
        if !tokens.is_multiple_of(self.dcp.saturating_mul(self.interleave)) {
            return Err(HeadError::TokensNotSplit {
                tokens,
                dcp: self.dcp,
                interleave: self.interleave,
            });
        }
        Ok(tokens / self.dcp)
    }

    /// Whether this rank holds token `token` of a block.
    pub fn holds(&self, token: u32) -> bool {
        (token / self.interleave) % self.dcp == self.rank
    }

    /// The slot of this rank's block holding token `token` (one it [holds](Self::holds)).
    pub fn slot(&self, token: u32) -> u32 {
        (token / (self.dcp * self.interleave)) * self.interleave + token % self.interleave
    }

    /// Whether this rank and `other` hold a token in common in blocks of any size both split:
    /// their placements repeat every `dcp * interleave` tokens.
    pub fn meets(&self, other: &TokenShard) -> bool {
        let period = |shard: &TokenShard| u64::from(shard.dcp) * u64::from(shard.interleave);
        let (a, b) = (period(self), period(other));
        if a == 0 || b == 0 {
            return false;
        }
        let span = a / gcd(a, b) * b;
        (0..span).any(|token| u32::try_from(token).is_ok_and(|token| self.holds(token) && other.holds(token)))
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// One side of a read within a block: the heads and tokens the rank's block holds, in
/// `block_bytes` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankBlock {
    /// KV heads the rank holds.
    pub heads: u32,
    /// Tokens the rank holds.
    pub tokens: TokenShard,
    /// Bytes of one of its blocks.
    pub block_bytes: u64,
}

/// How a leg's ranks split its KV: the model's KV heads over `tp / dcp` head groups
/// ([`HeadSharding`]), and each group's block tokens over `dcp` consecutive ranks (vLLM takes
/// DCP groups of consecutive ranks out of the TP group). Rank `r` is head group `r / dcp` and
/// DCP rank `r mod dcp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvShards {
    heads: HeadSharding,
    dcp: u32,
    interleave: u32,
}

impl KvShards {
    /// `kv_heads` KV heads over `tp` ranks of which each `dcp` consecutive split tokens; `dcp`
    /// must divide `tp`, and the heads must shard over the `tp / dcp` groups.
    pub fn new(kv_heads: u32, tp: u32, dcp: u32) -> Result<Self, HeadError> {
        if tp == 0 || dcp == 0 {
            return Err(HeadError::NoRanks);
        }
        if !tp.is_multiple_of(dcp) {
            return Err(HeadError::DcpNotInTp { tp, dcp });
        }
        Ok(KvShards {
            heads: HeadSharding::new(kv_heads, tp / dcp)?,
            dcp,
            interleave: 1,
        })
    }

    /// The same split with `interleave` consecutive tokens per DCP rank's turn (vLLM's
    /// `cp_kv_cache_interleave_size`; [`KvShards::new`] takes 1).
    pub fn with_interleave(self, interleave: u32) -> Result<Self, HeadError> {
        if interleave == 0 {
            return Err(HeadError::NoTokenShard {
                dcp: self.dcp,
                rank: 0,
                interleave,
            });
        }
        Ok(KvShards { interleave, ..self })
    }

    /// Ranks of the leg (its TP size).
    pub fn tp(&self) -> u32 {
        self.heads.tp() * self.dcp
    }

    /// Its DCP size.
    pub fn dcp(&self) -> u32 {
        self.dcp
    }

    /// The KV heads over the head groups.
    pub fn heads(&self) -> HeadSharding {
        self.heads
    }

    /// The head group of rank `rank`.
    pub fn group(&self, rank: u32) -> u32 {
        rank / self.dcp
    }

    /// The tokens rank `rank` holds.
    pub fn tokens(&self, rank: u32) -> TokenShard {
        TokenShard {
            dcp: self.dcp,
            rank: rank % self.dcp,
            interleave: self.interleave,
        }
    }

    /// The rank of head group `group` holding DCP share `share`.
    pub fn rank(&self, group: u32, share: u32) -> u32 {
        group * self.dcp + share
    }
}

/// The byte ranges within one block that carry `read`'s heads for the tokens both ranks hold,
/// for blocks of `tokens` tokens (the scheduler's block). Each side's block holds its heads for
/// its share of the tokens; both legs must store a token of a head in the same number of bytes.
/// Ranges that run on in both blocks are merged; no common token gives no range.
pub fn shard_slices(
    read: &HeadRead,
    order: HeadOrder,
    tokens: u32,
    remote: RankBlock,
    local: RankBlock,
) -> Result<Vec<BlockSlice>, HeadError> {
    let (remote_slots, local_slots) = (remote.tokens.slots(tokens)?, local.tokens.slots(tokens)?);
    let unit = |side: &RankBlock, slots: u32| -> Option<u64> {
        let cells = u64::from(side.heads) * u64::from(slots);
        (cells > 0 && side.block_bytes.is_multiple_of(cells)).then(|| side.block_bytes / cells)
    };
    let (Some(remote_unit), Some(local_unit)) = (unit(&remote, remote_slots), unit(&local, local_slots))
    else {
        return Err(HeadError::BlockNotHeads {
            remote: (remote.heads, remote.block_bytes),
            local: (local.heads, local.block_bytes),
            tokens,
        });
    };
    if remote_unit != local_unit {
        return Err(HeadError::HeadBytesMismatch {
            remote: remote_unit,
            local: local_unit,
        });
    }
    if read.remote_first + read.count > remote.heads || read.local_first + read.count > local.heads {
        return Err(HeadError::ReadOutsideBlock(*read));
    }
    let cell = |heads: u32, slots: u32, head: u32, slot: u32| -> u64 {
        let index = match order {
            HeadOrder::HeadsOuter => u64::from(head) * u64::from(slots) + u64::from(slot),
            HeadOrder::TokensOuter => u64::from(slot) * u64::from(heads) + u64::from(head),
        };
        index * remote_unit
    };
    let mut cells: Vec<BlockSlice> = (0..tokens)
        .filter(|&token| remote.tokens.holds(token) && local.tokens.holds(token))
        .flat_map(|token| {
            (0..read.count).map(move |head| BlockSlice {
                remote_offset: cell(
                    remote.heads,
                    remote_slots,
                    read.remote_first + head,
                    remote.tokens.slot(token),
                ),
                local_offset: cell(
                    local.heads,
                    local_slots,
                    read.local_first + head,
                    local.tokens.slot(token),
                ),
                len: remote_unit,
            })
        })
        .collect();
    cells.sort_by_key(|slice| slice.local_offset);
    let mut slices: Vec<BlockSlice> = Vec::new();
    for next in cells {
        match slices.last_mut() {
            Some(last)
                if last.local_offset + last.len == next.local_offset
                    && last.remote_offset + last.len == next.remote_offset =>
            {
                last.len += next.len;
            }
            _ => slices.push(next),
        }
    }
    Ok(slices)
}

/// [`shard_slices`] for legs without DCP: the byte ranges within one block that carry `read`'s
/// heads, for a block of `tokens` tokens holding `remote_heads` heads on the prefill rank
/// (`remote_block_bytes` bytes) and `local_heads` on the decode rank (`local_block_bytes`).
pub fn head_slices(
    read: &HeadRead,
    order: HeadOrder,
    tokens: u32,
    (remote_heads, remote_block_bytes): (u32, u64),
    (local_heads, local_block_bytes): (u32, u64),
) -> Result<Vec<BlockSlice>, HeadError> {
    let side = |heads: u32, block_bytes: u64| RankBlock {
        heads,
        tokens: TokenShard::WHOLE,
        block_bytes,
    };
    shard_slices(
        read,
        order,
        tokens,
        side(remote_heads, remote_block_bytes),
        side(local_heads, local_block_bytes),
    )
}

/// Why heads cannot be mapped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum HeadError {
    /// A model without KV heads.
    #[error("a model needs at least one KV head")]
    NoHeads,
    /// A leg without ranks.
    #[error("a tensor-parallel size must be at least 1")]
    NoRanks,
    /// Neither the heads nor the ranks divide the other.
    #[error("{heads} KV heads cannot be sharded over {tp} tensor-parallel ranks (one must divide the other)")]
    Indivisible {
        /// KV heads.
        heads: u32,
        /// Ranks.
        tp: u32,
    },
    /// The legs disagree on the model's KV heads.
    #[error("the prefill leg has {prefill} KV heads, the decode leg {decode}")]
    TotalMismatch {
        /// Prefill's heads.
        prefill: u32,
        /// Decode's heads.
        decode: u32,
    },
    /// A rank beyond the leg's TP size.
    #[error("{side} rank {rank} is beyond its tensor-parallel size {tp}")]
    RankOutOfRange {
        /// Which leg.
        side: Role,
        /// The rank asked for.
        rank: u32,
        /// The leg's TP size.
        tp: u32,
    },
    /// A block's bytes are not a whole number of per-token head cells.
    #[error(
        "a block of {tokens} tokens is not whole heads: prefill {} heads in {} bytes, decode {} heads in {} bytes",
        remote.0, remote.1, local.0, local.1
    )]
    BlockNotHeads {
        /// Prefill (heads, block bytes).
        remote: (u32, u64),
        /// Decode (heads, block bytes).
        local: (u32, u64),
        /// Tokens per block.
        tokens: u32,
    },
    /// The legs store a token of a head in different sizes (another dtype or head size).
    #[error("a head's token takes {remote} bytes on the prefill leg and {local} on the decode leg")]
    HeadBytesMismatch {
        /// Prefill bytes.
        remote: u64,
        /// Decode bytes.
        local: u64,
    },
    /// DCP must divide TP: DCP ranks are taken out of the TP group.
    #[error("a DCP size of {dcp} does not divide the tensor-parallel size {tp}")]
    DcpNotInTp {
        /// TP size.
        tp: u32,
        /// DCP size.
        dcp: u32,
    },
    /// A DCP share that does not exist.
    #[error("DCP rank {rank} of {dcp} with an interleave of {interleave} tokens does not exist")]
    NoTokenShard {
        /// DCP size.
        dcp: u32,
        /// DCP rank asked for.
        rank: u32,
        /// Tokens per DCP rank's turn.
        interleave: u32,
    },
    /// A block's tokens do not split evenly over the DCP ranks.
    #[error("a block of {tokens} tokens does not split over {dcp} DCP ranks in turns of {interleave} tokens")]
    TokensNotSplit {
        /// Tokens per block.
        tokens: u32,
        /// DCP size.
        dcp: u32,
        /// Tokens per DCP rank's turn.
        interleave: u32,
    },
    /// A read names heads past a rank's heads.
    #[error("head read {0:?} lies outside a rank's heads")]
    ReadOutsideBlock(HeadRead),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sharding(total: u32, tp: u32) -> HeadSharding {
        HeadSharding::new(total, tp).unwrap()
    }

    #[test]
    fn shardings_follow_vllm() {
        let split = sharding(8, 4);
        assert_eq!(split.heads_per_rank(), 2);
        assert_eq!(split.first_head(3), 6);
        assert_eq!(split.holders(5), 2..3);
        let replicated = sharding(2, 8);
        assert_eq!(replicated.heads_per_rank(), 1);
        assert_eq!(replicated.first_head(5), 1);
        assert_eq!(replicated.holders(1), 4..8);
        assert_eq!(
            HeadSharding::new(6, 4),
            Err(HeadError::Indivisible { heads: 6, tp: 4 })
        );
        assert_eq!(HeadSharding::new(0, 1), Err(HeadError::NoHeads));
        assert_eq!(HeadSharding::new(4, 0), Err(HeadError::NoRanks));
    }

    #[test]
    fn two_prefill_ranks_into_one_decode_rank_and_back() {
        let merge = HeadMap::new(sharding(4, 2), sharding(4, 1), 0).unwrap();
        assert_eq!(
            merge.reads(0).unwrap(),
            &[
                HeadRead {
                    prefill_rank: 0,
                    remote_first: 0,
                    local_first: 0,
                    count: 2
                },
                HeadRead {
                    prefill_rank: 1,
                    remote_first: 0,
                    local_first: 2,
                    count: 2
                },
            ]
        );
        assert_eq!((merge.readers(0), merge.readers(1)), (Ok(1), Ok(1)));
        let split = HeadMap::new(sharding(4, 1), sharding(4, 2), 0).unwrap();
        assert_eq!(
            split.reads(1).unwrap(),
            &[HeadRead {
                prefill_rank: 0,
                remote_first: 2,
                local_first: 0,
                count: 2
            }]
        );
        assert_eq!(
            split.readers(0),
            Ok(2),
            "both decode ranks read the one prefill rank"
        );
        assert_eq!(
            split.reads(2),
            Err(HeadError::RankOutOfRange {
                side: Role::Decode,
                rank: 2,
                tp: 2
            })
        );
    }

    #[test]
    fn a_replicated_latent_is_read_once_per_rank_spread_by_rotation() {
        // MLA: one latent head replicated on 4 prefill ranks, 2 decode ranks.
        let map = HeadMap::new(sharding(1, 4), sharding(1, 2), 1).unwrap();
        assert_eq!(map.reads(0).unwrap()[0].prefill_rank, 1);
        assert_eq!(map.reads(1).unwrap()[0].prefill_rank, 2);
        assert_eq!(
            (0..4).map(|p| map.readers(p).unwrap()).collect::<Vec<_>>(),
            vec![0, 1, 1, 0]
        );
        // Unread prefill ranks 0 and 3 fall to decode ranks 0 and 1.
        assert_eq!(map.releases(0), Ok(vec![0]));
        assert_eq!(map.releases(1), Ok(vec![3]));
        let next = HeadMap::new(sharding(1, 4), sharding(1, 1), 2).unwrap();
        assert_eq!(next.reads(0).unwrap()[0].prefill_rank, 2);
        assert_eq!(next.releases(0), Ok(vec![0, 1, 3]));
    }

    #[test]
    fn slices_cut_a_head_range_out_of_either_order() {
        // 4 tokens, 8 bytes per head-token; prefill holds 4 heads, decode 2 (heads 2, 3).
        let read = HeadRead {
            prefill_rank: 0,
            remote_first: 2,
            local_first: 0,
            count: 2,
        };
        let outer = head_slices(&read, HeadOrder::HeadsOuter, 4, (4, 128), (2, 64)).unwrap();
        assert_eq!(
            outer,
            vec![BlockSlice {
                remote_offset: 64,
                local_offset: 0,
                len: 64
            }]
        );
        let inner = head_slices(&read, HeadOrder::TokensOuter, 4, (4, 128), (2, 64)).unwrap();
        assert_eq!(
            inner,
            (0..4)
                .map(|t| BlockSlice {
                    remote_offset: t * 32 + 16,
                    local_offset: t * 16,
                    len: 16
                })
                .collect::<Vec<_>>()
        );
        assert_eq!(
            head_slices(&read, HeadOrder::HeadsOuter, 4, (4, 128), (2, 32)),
            Err(HeadError::HeadBytesMismatch { remote: 8, local: 4 })
        );
        assert!(matches!(
            head_slices(&read, HeadOrder::HeadsOuter, 3, (4, 128), (2, 64)),
            Err(HeadError::BlockNotHeads { .. })
        ));
        let past = HeadRead {
            remote_first: 3,
            ..read
        };
        assert_eq!(
            head_slices(&past, HeadOrder::HeadsOuter, 4, (4, 128), (2, 64)),
            Err(HeadError::ReadOutsideBlock(past))
        );
    }

    /// Where each token of a block lands, by vLLM's definition of the interleave: runs of
    /// `interleave` tokens go to DCP ranks in turn, each rank filling its slots in order.
    fn placed(tokens: u32, dcp: u32, interleave: u32) -> Vec<(u32, u32)> {
        let mut next_slot = vec![0; dcp as usize];
        (0..tokens)
            .map(|token| {
                let rank = (token / interleave) % dcp;
                let slot = next_slot[rank as usize];
                next_slot[rank as usize] += 1;
                (rank, slot)
            })
            .collect()
    }

    #[test]
    fn token_shards_place_tokens_as_vllm_interleaves_them() {
        for dcp in 1..=4 {
            for interleave in [1, 2, 4, 8] {
                let tokens = 8 * dcp;
                let placed = placed(tokens, dcp, interleave);
                for rank in 0..dcp {
                    let shard = TokenShard {
                        dcp,
                        rank,
                        interleave,
                    };
                    assert_eq!(shard.slots(tokens), Ok(8));
                    for (token, &(owner, slot)) in (0..tokens).zip(&placed) {
                        assert_eq!(
                            shard.holds(token),
                            owner == rank,
                            "dcp {dcp} interleave {interleave} token {token}"
                        );
                        if owner == rank {
                            assert_eq!(
                                shard.slot(token),
                                slot,
                                "dcp {dcp} interleave {interleave} token {token}"
                            );
                        }
                    }
                }
            }
        }
        let shard = TokenShard {
            dcp: 2,
            rank: 0,
            interleave: 16,
        };
        assert_eq!(
            shard.slots(48),
            Err(HeadError::TokensNotSplit {
                tokens: 48,
                dcp: 2,
                interleave: 16
            })
        );
        assert_eq!(
            TokenShard {
                dcp: 2,
                rank: 2,
                interleave: 1
            }
            .slots(4),
            Err(HeadError::NoTokenShard {
                dcp: 2,
                rank: 2,
                interleave: 1
            })
        );
    }

    #[test]
    fn token_shards_meet_where_they_hold_a_token_in_common() {
        let shard = |dcp, rank, interleave| TokenShard {
            dcp,
            rank,
            interleave,
        };
        // Two ranks by single tokens against four by single tokens: even tokens only meet even.
        assert!(shard(2, 0, 1).meets(&shard(4, 2, 1)));
        assert!(!shard(2, 0, 1).meets(&shard(4, 1, 1)));
        // Runs of 4 over 2 ranks against single tokens over 2: every rank meets every rank.
        assert!(shard(2, 1, 4).meets(&shard(2, 0, 1)));
        // Runs of 8 over 2 against runs of 4 over 4: rank 0's first run is ranks 0 and 1's.
        assert!(shard(2, 0, 8).meets(&shard(4, 1, 4)));
        assert!(!shard(2, 0, 8).meets(&shard(4, 2, 4)));
        assert!(TokenShard::WHOLE.meets(&shard(4, 3, 2)));
    }

    #[test]
    fn a_whole_block_splits_into_the_runs_each_interleaved_rank_holds() {
        // Prefill holds all 8 tokens of a block ([H=1, N=8, C]); decode DCP 2 in runs of 2:
        // rank 1 holds tokens 2, 3, 6, 7 in its slots 0 .. 4.
        let read = HeadRead {
            prefill_rank: 0,
            remote_first: 0,
            local_first: 0,
            count: 1,
        };
        let slices = shard_slices(
            &read,
            HeadOrder::HeadsOuter,
            8,
            RankBlock {
                heads: 1,
                tokens: TokenShard::WHOLE,
                block_bytes: 8 * 4,
            },
            RankBlock {
                heads: 1,
                tokens: TokenShard {
                    dcp: 2,
                    rank: 1,
                    interleave: 2,
                },
                block_bytes: 4 * 4,
            },
        )
        .unwrap();
        assert_eq!(
            slices,
            vec![
                BlockSlice {
                    remote_offset: 2 * 4,
                    local_offset: 0,
                    len: 2 * 4
                },
                BlockSlice {
                    remote_offset: 6 * 4,
                    local_offset: 2 * 4,
                    len: 2 * 4
                },
            ]
        );
    }
}
