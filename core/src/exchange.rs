//! The exchange: which prefill block feeds which decode block.
//!
//! Both legs describe each group of a request as a position-indexed block list. The decode leg
//! recomputes the last prompt token (position `N - 1`) itself, so the only remote KV it ever uses
//! is that of tokens `0 ..= N - 2` (full groups) or `max(0, N - W) ..= N - 2` (window groups; the
//! window counts the attending token). The exchange runs four steps, each a pure function of the
//! prompt length, the layout and the lists:
//!
//! 1. **Trim** every group to the blocks holding those tokens, counted with the effective block
//!    size `B_eff = B * dcp`, so a lookahead tail on either leg (speculative slots, first decode
//!    steps) can never move anything, and a prefill leg that computed all `N` tokens pairs exactly
//!    like one that computed only the first `N - 1` (vLLM's hybrid prefill).
//! 2. **Clip** window groups to the positions the last prompt token's window needs:
//!    `floor(max(0, N - W) / B_eff) ..= floor((N - 2) / B_eff)`; nothing when `N = 1` or `W = 1`.
//! 3. **Anchor**: every [`ExchangeList`] says which position its first entry holds, and
//!    [`pair`] joins entries by absolute position. A position one side needs and the other lacks
//!    (or holds as the null block) is an error naming the group and position, never a shift.
//! 4. **Mamba** groups exchange their running state (entry 0): the prefill leg stores the state
//!    after `N - 1` tokens and the decode leg recomputes the last prompt token. **Aligned mamba**
//!    groups (vLLM's mamba prefix caching) keep that state at position `(N - 2) / B` of a
//!    position-indexed list on both legs, so they pair like a window group whose window holds
//!    token `N - 2` only.
//!
//! Prefix hits on the decode leg are leading positions it already holds; [`need`] leaves them out
//! so only the rest is read.
//!
//! [`legacy_pair`] reproduces vLLM MoRIIO's pairing before the fix (clip from the end with no
//! trim, align from the head) so that the old failure can be shown and diagnosed. It is never the
//! default.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::block::{BlockId, NULL_BLOCK};
use crate::layout::{GroupKind, GroupSpec, KvLayout};
use crate::wire::Role;

/// The positions of one group whose remote KV a decode leg uses for an `num_prompt_tokens`-token
/// prompt: the blocks holding the tokens it does not recompute itself.
///
/// Full groups: the blocks holding tokens `0 ..= N - 2`. Window groups: the blocks holding tokens
/// `max(0, N - W) ..= N - 2` (the last prompt token's window, minus that token). Chunked local
/// groups: the blocks holding tokens `C * floor((N - 1) / C) ..= N - 2` (the last prompt token's
/// chunk, minus that token). All are empty (`0..0`) when there is no such token (`N = 1`,
/// `W = 1`, or the last prompt token opens its chunk). Mamba groups: their state,
/// position 0, always. Aligned mamba groups: the position holding the state after `N - 1`
/// tokens, `(N - 2) / B` (none when `N = 1`: the decoder starts from the empty state).
pub fn needed_positions(group: &GroupSpec, num_prompt_tokens: u64) -> Range<u64> {
    // Tokens `first .. end` (end exclusive) are read; token N - 1 is recomputed locally.
    let end = num_prompt_tokens.saturating_sub(1);
    let first = match group.kind() {
        GroupKind::Mamba => return 0..1,
        // The state after tokens 0 ..= N - 2 is stored with the last of them.
        GroupKind::MambaAlign => end.saturating_sub(1),
        GroupKind::Full => 0,
        // The oldest token the last prompt token (N - 1) attends to.
        kind @ (GroupKind::SlidingWindow { .. } | GroupKind::ChunkedLocal { .. }) => {
            kind.attended_floor(end).unwrap_or(0)
        }
    };
    if first >= end {
        return 0..0;
    }
    let block_tokens = group.effective_block_size();
    first / block_tokens..(end - 1) / block_tokens + 1
}

/// What one leg offers or needs of one group for one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExchangeList {
    /// The group's spec as the sending leg sees it, so a mismatch is caught before pairing.
    pub spec: GroupSpec,
    /// Absolute block position held by `blocks[0]`.
    pub first_position: u64,
    /// Block ids for positions `first_position ..`.
    pub blocks: Vec<BlockId>,
}

impl ExchangeList {
    /// The absolute positions this list covers.
    pub fn positions(&self) -> Range<u64> {
        self.first_position..self.first_position + self.blocks.len() as u64
    }

    /// The block at absolute position `position`, if the list covers it.
    pub fn block_at(&self, position: u64) -> Option<BlockId> {
        let index = position.checked_sub(self.first_position)?;
        self.blocks.get(usize::try_from(index).ok()?).copied()
    }
}

/// A prefill leg's offer for one request: per group, the blocks a decode leg may read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offer {
    /// Prompt length the offer was computed for.
    pub num_prompt_tokens: u64,
    /// One list per group, in layout order.
    pub groups: Vec<ExchangeList>,
}

/// A decode leg's need for one request: per group, where each needed position lands locally.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Need {
    /// Prompt length the need was computed for.
    pub num_prompt_tokens: u64,
    /// One list per group, in layout order; a group with nothing to read has an empty list.
    pub groups: Vec<ExchangeList>,
}

/// One READ unit: the prefill block at `remote_position` lands in the decode block at
/// `local_position`. Anchored pairing always has equal positions; legacy pairing may not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockPair {
    /// Position of the block on the prefill leg.
    pub remote_position: u64,
    /// Position of the block on the decode leg.
    pub local_position: u64,
    /// Prefill leg's block id (the READ source).
    pub remote: BlockId,
    /// Decode leg's block id (the READ destination).
    pub local: BlockId,
}

/// The pairs of every group of one request, in layout order.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Pairing {
    /// `groups[g]` holds group `g`'s pairs in ascending position order.
    pub groups: Vec<Vec<BlockPair>>,
}

impl Pairing {
    /// Total number of block pairs over all groups.
    pub fn num_pairs(&self) -> usize {
        self.groups.iter().map(Vec::len).sum()
    }
}

/// Which pairing algorithm to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PairingMode {
    /// Trim, clip, anchor: the correct pairing, and the default.
    #[default]
    Anchored,
    /// vLLM MoRIIO before the fix: clip from the end without a trim, align from the head. Only to
    /// reproduce and diagnose the old behaviour.
    Legacy,
}

impl std::str::FromStr for PairingMode {
    type Err = ExchangeError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "anchored" => Ok(PairingMode::Anchored),
            "legacy" => Ok(PairingMode::Legacy),
            other => Err(ExchangeError::UnknownPairingMode(other.to_string())),
        }
    }
}

/// Builds the prefill leg's offer: per group, exactly the [`needed_positions`] (trimmed to the
/// tokens a decode leg reads, window groups clipped to the last token's window), anchored at the
/// first of them.
///
/// `prefill_blocks[g]` is group `g`'s full position-indexed list, lookahead tail included. It may
/// end at the prompt's last block (`cdiv(N, B_eff)`, every token computed) or one token earlier
/// (`cdiv(N - 1, B_eff)`, a prefill that stops at `N - 1`): both cover every needed position.
pub fn offer(
    layout: &KvLayout,
    num_prompt_tokens: u64,
    prefill_blocks: &[Vec<BlockId>],
) -> Result<Offer, ExchangeError> {
    check_request(layout, num_prompt_tokens, Role::Prefill, prefill_blocks.len())?;
    let groups = layout
        .groups()
        .iter()
        .zip(prefill_blocks)
        .enumerate()
        .map(|(group, (spec, blocks))| {
            let range = needed_positions(spec, num_prompt_tokens);
            anchored_list(Role::Prefill, group, spec, blocks, range)
        })
        .collect::<Result<_, _>>()?;
    Ok(Offer {
        num_prompt_tokens,
        groups,
    })
}

/// Builds the decode leg's need: the same positions as [`offer`], minus the leading
/// `cached_blocks[g]` positions of each group that the decode leg holds already (prefix hits).
///
/// `cached_blocks` may be empty (no hits); otherwise it has one count per group.
pub fn need(
    layout: &KvLayout,
    num_prompt_tokens: u64,
    decode_blocks: &[Vec<BlockId>],
    cached_blocks: &[u64],
) -> Result<Need, ExchangeError> {
    check_request(layout, num_prompt_tokens, Role::Decode, decode_blocks.len())?;
    if !cached_blocks.is_empty() && cached_blocks.len() != layout.groups().len() {
        return Err(ExchangeError::CachedCountMismatch {
            given: cached_blocks.len(),
            groups: layout.groups().len(),
        });
    }
    let groups = layout
        .groups()
        .iter()
        .zip(decode_blocks)
        .enumerate()
        .map(|(group, (spec, blocks))| {
            let cached = cached_blocks.get(group).copied().unwrap_or(0);
            if cached > blocks.len() as u64 {
                return Err(ExchangeError::CachedBeyondList {
                    group,
                    cached,
                    len: blocks.len(),
                });
            }
            if cached > 0 && spec.kind() == GroupKind::Mamba {
                return Err(ExchangeError::CachedMamba { group, cached });
            }
            let range = needed_positions(spec, num_prompt_tokens);
            let start = range.start.max(cached).min(range.end);
            anchored_list(Role::Decode, group, spec, blocks, start..range.end)
        })
        .collect::<Result<_, _>>()?;
    Ok(Need {
        num_prompt_tokens,
        groups,
    })
}

/// Joins a need with an offer by absolute position, group by group.
///
/// Fails closed: a needed position the offer does not cover, or covers with the null block, is an
/// error; so is any disagreement about the prompt length or a group's spec.
pub fn pair(layout: &KvLayout, offer: &Offer, need: &Need) -> Result<Pairing, ExchangeError> {
    if offer.num_prompt_tokens != need.num_prompt_tokens {
        return Err(ExchangeError::PromptLengthMismatch {
            prefill: offer.num_prompt_tokens,
            decode: need.num_prompt_tokens,
        });
    }
    let groups = layout.groups().len();
    for (leg, count) in [
        (Role::Prefill, offer.groups.len()),
        (Role::Decode, need.groups.len()),
    ] {
        if count != groups {
            return Err(ExchangeError::GroupCountMismatch {
                leg,
                given: count,
                groups,
            });
        }
    }
    let mut pairing = Pairing {
        groups: Vec::with_capacity(groups),
    };
    for (group, ((spec, remote), local)) in layout
        .groups()
        .iter()
        .zip(&offer.groups)
        .zip(&need.groups)
        .enumerate()
    {
        for (leg, list) in [(Role::Prefill, remote), (Role::Decode, local)] {
            if !list.spec.pairs_with(spec) {
                return Err(ExchangeError::GroupSpecMismatch {
                    group,
                    leg,
                    detail: describe_spec_difference(spec, &list.spec),
                });
            }
        }
        let mut pairs = Vec::with_capacity(local.blocks.len());
        for (position, &local_block) in local.positions().zip(&local.blocks) {
            let remote_block = match remote.block_at(position) {
                Some(NULL_BLOCK) => {
                    return Err(ExchangeError::NullAtNeededPosition {
                        group,
                        kind: spec.kind(),
                        leg: Role::Prefill,
                        position,
                    });
                }
                Some(id) => id,
                None => {
                    return Err(ExchangeError::MissingPosition {
                        group,
                        kind: spec.kind(),
                        position,
                        offered: remote.positions(),
                    });
                }
            };
            pairs.push(BlockPair {
                remote_position: position,
                local_position: position,
                remote: remote_block,
                local: local_block,
            });
        }
        pairing.groups.push(pairs);
    }
    Ok(pairing)
}

/// The offer vLLM MoRIIO's prefill leg sent before the fix: every group's whole list, untrimmed,
/// anchored at position 0 ([`legacy_pair`] clips it from the end). Diagnosis only.
pub fn legacy_offer(layout: &KvLayout, num_prompt_tokens: u64, prefill_blocks: Vec<Vec<BlockId>>) -> Offer {
    Offer {
        num_prompt_tokens,
        groups: layout
            .groups()
            .iter()
            .zip(prefill_blocks)
            .map(|(spec, blocks)| ExchangeList {
                spec: *spec,
                first_position: 0,
                blocks,
            })
            .collect(),
    }
}

/// vLLM MoRIIO's READ pairing before the fix, kept only to reproduce and diagnose it.
///
/// Window groups are clipped to their last `cdiv(W, B) + 1` entries on both legs with no trim;
/// then each group is aligned from the head as `_align_read_blocks` did: a longer decode list may
/// drop up to `max_decode_tail_blocks` entries from its end (more is an error), a shorter decode
/// list pairs with the prefill list's suffix. Prefix hits are ignored (vLLM read full lists).
pub fn legacy_pair(
    layout: &KvLayout,
    prefill_blocks: &[Vec<BlockId>],
    decode_blocks: &[Vec<BlockId>],
    max_decode_tail_blocks: u64,
) -> Result<Pairing, ExchangeError> {
    let groups = layout.groups().len();
    for (leg, count) in [
        (Role::Prefill, prefill_blocks.len()),
        (Role::Decode, decode_blocks.len()),
    ] {
        if count != groups {
            return Err(ExchangeError::GroupCountMismatch {
                leg,
                given: count,
                groups,
            });
        }
    }
    let mut pairing = Pairing::default();
    for (group, ((spec, remote), local)) in layout
        .groups()
        .iter()
        .zip(prefill_blocks)
        .zip(decode_blocks)
        .enumerate()
    {
        let (remote_start, local_start, remote, local) = match spec.kind() {
            GroupKind::Mamba | GroupKind::MambaAlign => {
                (0, 0, &remote[..remote.len().min(1)], &local[..local.len().min(1)])
            }
            // MoRIIO clips window groups only; a chunked group's lists are paired whole.
            GroupKind::Full | GroupKind::ChunkedLocal { .. } => (0, 0, &remote[..], &local[..]),
            GroupKind::SlidingWindow { window } => {
                let keep = u64::from(window).div_ceil(u64::from(spec.block_size())) + 1;
                let keep = usize::try_from(keep).unwrap_or(usize::MAX);
                let remote_start = remote.len().saturating_sub(keep);
                let local_start = local.len().saturating_sub(keep);
                (
                    remote_start,
                    local_start,
                    &remote[remote_start..],
                    &local[local_start..],
                )
            }
        };
        let (remote_start, remote, local) = if local.len() > remote.len() {
            let extra = (local.len() - remote.len()) as u64;
            if extra > max_decode_tail_blocks {
                return Err(ExchangeError::LegacyTailTooLong {
                    group,
                    extra,
                    allowed: max_decode_tail_blocks,
                });
            }
            (remote_start, remote, &local[..remote.len()])
        } else {
            let skip = remote.len() - local.len();
            (remote_start + skip, &remote[skip..], local)
        };
        let pairs = remote
            .iter()
            .zip(local)
            .enumerate()
            .map(|(index, (&remote_block, &local_block))| BlockPair {
                remote_position: (remote_start + index) as u64,
                local_position: (local_start + index) as u64,
                remote: remote_block,
                local: local_block,
            })
            .collect();
        pairing.groups.push(pairs);
    }
    Ok(pairing)
}

fn check_request(
    layout: &KvLayout,
    num_prompt_tokens: u64,
    leg: Role,
    lists: usize,
) -> Result<(), ExchangeError> {
    if num_prompt_tokens == 0 {
        return Err(ExchangeError::EmptyPrompt);
    }
    if lists != layout.groups().len() {
        return Err(ExchangeError::GroupCountMismatch {
            leg,
            given: lists,
            groups: layout.groups().len(),
        });
    }
    Ok(())
}

/// Cuts `range` out of a position-indexed list, refusing a short list, a null in the range or a
/// block id that appears twice in it (it would be paired twice).
fn anchored_list(
    leg: Role,
    group: usize,
    spec: &GroupSpec,
    blocks: &[BlockId],
    range: Range<u64>,
) -> Result<ExchangeList, ExchangeError> {
    if (blocks.len() as u64) < range.end {
        return Err(ExchangeError::ListTooShort {
            group,
            kind: spec.kind(),
            leg,
            len: blocks.len(),
            needed: range.end,
        });
    }
    // Both bounds are at most `blocks.len()`, so they fit in usize.
    let slice = &blocks[range.start as usize..range.end as usize];
    if let Some(offset) = slice.iter().position(|&id| id == NULL_BLOCK) {
        return Err(ExchangeError::NullAtNeededPosition {
            group,
            kind: spec.kind(),
            leg,
            position: range.start + offset as u64,
        });
    }
    if let Some((first, second)) = duplicate_positions(slice) {
        return Err(ExchangeError::DuplicateBlock {
            group,
            kind: spec.kind(),
            leg,
            block: slice[first],
            first: range.start + first as u64,
            second: range.start + second as u64,
        });
    }
    Ok(ExchangeList {
        spec: *spec,
        first_position: range.start,
        blocks: slice.to_vec(),
    })
}

/// The indices of the first block id that appears twice in `blocks`, if any.
///
/// Allocators hand out ascending runs, so the common case is one pass; anything else is sorted.
pub fn duplicate_positions(blocks: &[BlockId]) -> Option<(usize, usize)> {
    if blocks.windows(2).all(|pair| pair[0] < pair[1]) {
        return None;
    }
    let mut sorted: Vec<(BlockId, usize)> = blocks.iter().copied().zip(0..).collect();
    sorted.sort_unstable();
    sorted
        .windows(2)
        .filter(|pair| pair[0].0 == pair[1].0)
        .map(|pair| (pair[0].1, pair[1].1))
        .min()
}

fn describe_spec_difference(ours: &GroupSpec, theirs: &GroupSpec) -> String {
    if ours.kind().name() != theirs.kind().name() {
        format!("kind {} vs {}", ours.kind().name(), theirs.kind().name())
    } else if ours.kind().window() != theirs.kind().window() {
        format!(
            "window {} vs {}",
            ours.kind().window().unwrap_or(0),
            theirs.kind().window().unwrap_or(0)
        )
    } else if ours.kind().chunk() != theirs.kind().chunk() {
        format!(
            "chunk {} vs {}",
            ours.kind().chunk().unwrap_or(0),
            theirs.kind().chunk().unwrap_or(0)
        )
    } else {
        format!(
            "scheduler block of {} tokens (block_size {} x dcp {}) vs {} (block_size {} x dcp {})",
            ours.effective_block_size(),
            ours.block_size(),
            ours.dcp(),
            theirs.effective_block_size(),
            theirs.block_size(),
            theirs.dcp()
        )
    }
}

/// Why an exchange was refused. Every variant names the group, leg and position at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum ExchangeError {
    /// A request needs at least one prompt token (the decode leg recomputes the last one).
    #[error("num_prompt_tokens must be at least 1, got 0")]
    EmptyPrompt,
    /// A leg sent a different number of group lists than the layout has.
    #[error("{leg} leg gave {given} group lists, the layout has {groups}")]
    GroupCountMismatch {
        /// Leg at fault.
        leg: Role,
        /// Lists given.
        given: usize,
        /// Groups in the layout.
        groups: usize,
    },
    /// A leg's list ends before the last needed position.
    #[error("group {group} ({kind}): {leg} leg holds {len} blocks, the exchange needs {needed}")]
    ListTooShort {
        /// Group index.
        group: usize,
        /// Group kind.
        kind: GroupKind,
        /// Leg at fault.
        leg: Role,
        /// Blocks held.
        len: usize,
        /// Blocks the list must hold (one past the last needed position).
        needed: u64,
    },
    /// A leg holds the null block where a real one is needed.
    #[error("group {group} ({kind}): {leg} leg holds the null block at needed position {position}")]
    NullAtNeededPosition {
        /// Group index.
        group: usize,
        /// Group kind.
        kind: GroupKind,
        /// Leg at fault.
        leg: Role,
        /// Block position.
        position: u64,
    },
    /// One leg's list holds the same block at two needed positions.
    #[error("group {group} ({kind}): {leg} leg holds block {block} at both position {first} and {second}")]
    DuplicateBlock {
        /// Group index.
        group: usize,
        /// Group kind.
        kind: GroupKind,
        /// Leg at fault.
        leg: Role,
        /// The repeated block id.
        block: BlockId,
        /// First position holding it.
        first: u64,
        /// Second position holding it.
        second: u64,
    },
    /// The decode leg needs a position the offer does not cover.
    #[error(
        "group {group} ({kind}): decode needs position {position}, offer covers {}..{}",
        offered.start, offered.end
    )]
    MissingPosition {
        /// Group index.
        group: usize,
        /// Group kind.
        kind: GroupKind,
        /// Block position needed.
        position: u64,
        /// Positions the offer covers.
        offered: Range<u64>,
    },
    /// Offer and need were computed for different prompts.
    #[error("prefill offer is for {prefill} prompt tokens, decode need for {decode}")]
    PromptLengthMismatch {
        /// Prefill leg's prompt length.
        prefill: u64,
        /// Decode leg's prompt length.
        decode: u64,
    },
    /// The legs disagree on a group's kind, window, block size or DCP factor.
    #[error("group {group}: {leg} leg's spec differs from the layout: {detail}")]
    GroupSpecMismatch {
        /// Group index.
        group: usize,
        /// Leg whose spec differs.
        leg: Role,
        /// What differs (ours vs theirs).
        detail: String,
    },
    /// Prefix-hit counts must come one per group.
    #[error("cached_blocks has {given} entries, the layout has {groups} groups")]
    CachedCountMismatch {
        /// Entries given.
        given: usize,
        /// Groups in the layout.
        groups: usize,
    },
    /// A prefix hit cannot cover more blocks than the decode leg holds.
    #[error("group {group}: cached_blocks {cached} exceeds the decode list's {len} blocks")]
    CachedBeyondList {
        /// Group index.
        group: usize,
        /// Cached count given.
        cached: u64,
        /// Decode list length.
        len: usize,
    },
    /// A recurrent state cannot be a prefix hit.
    #[error("group {group} (mamba): cached_blocks must be 0, got {cached}")]
    CachedMamba {
        /// Group index.
        group: usize,
        /// Cached count given.
        cached: u64,
    },
    /// Legacy alignment refuses a decode tail longer than allowed, as vLLM did.
    #[error(
        "group {group}: legacy pairing found a decode tail of {extra} blocks, allowed local tail is {allowed}"
    )]
    LegacyTailTooLong {
        /// Group index.
        group: usize,
        /// Extra decode blocks.
        extra: u64,
        /// `max_decode_tail_blocks`.
        allowed: u64,
    },
    /// `pairing` must be `anchored` or `legacy`.
    #[error("unknown pairing mode {0:?}, expected \"anchored\" or \"legacy\"")]
    UnknownPairingMode(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairing_modes_parse_by_name() {
        assert_eq!("anchored".parse::<PairingMode>(), Ok(PairingMode::Anchored));
        assert_eq!("legacy".parse::<PairingMode>(), Ok(PairingMode::Legacy));
        assert_eq!(
            "Legacy".parse::<PairingMode>().unwrap_err().to_string(),
            "unknown pairing mode \"Legacy\", expected \"anchored\" or \"legacy\""
        );
    }

    #[test]
    fn num_pairs_counts_every_group() {
        let pair = BlockPair {
            remote_position: 0,
            local_position: 0,
            remote: 1,
            local: 2,
        };
        let pairing = Pairing {
            groups: vec![vec![pair; 3], vec![], vec![pair; 2]],
        };
        assert_eq!(pairing.num_pairs(), 5);
    }
}
