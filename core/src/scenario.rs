//! Pairing scenarios: the input of `pdkv plan`.
//!
//! A scenario gives a layout, a prompt length and both legs' full position-indexed block lists;
//! [`Scenario::run`] pairs them with the chosen [`PairingMode`]. The serde types mirror the JSON a
//! user writes; [`ScenarioFile::validate`] turns them into checked values with errors that name
//! the field at fault.

use serde::{Deserialize, Serialize};

use crate::block::{BlockId, NULL_BLOCK};
use crate::exchange::{self, ExchangeError, Pairing, PairingMode};
use crate::layout::{GroupEntry, GroupEntryError, KvLayout, LayoutError};
use crate::wire::Role;

/// The prefill leg in a scenario.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillEntry {
    /// Full position-indexed list per group, lookahead tail included.
    pub blocks: Vec<Vec<BlockId>>,
}

/// The decode leg in a scenario.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeEntry {
    /// Full position-indexed list per group, lookahead tail included.
    pub blocks: Vec<Vec<BlockId>>,
    /// Leading blocks per group the decode leg holds already (prefix hits); default none.
    #[serde(default)]
    pub cached_blocks: Vec<u64>,
}

fn default_max_decode_tail_blocks() -> u64 {
    1
}

/// A scenario as written by a user.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScenarioFile {
    /// The layout's groups (one layer each).
    pub groups: Vec<GroupEntry>,
    /// Prompt length N.
    pub num_prompt_tokens: u64,
    /// Prefill leg's lists.
    pub prefill: PrefillEntry,
    /// Decode leg's lists and prefix hits.
    pub decode: DecodeEntry,
    /// `anchored` (default) or `legacy`.
    #[serde(default)]
    pub pairing: PairingMode,
    /// Legacy only: decode tail blocks the head alignment may drop (default 1).
    #[serde(default = "default_max_decode_tail_blocks")]
    pub max_decode_tail_blocks: u64,
}

impl ScenarioFile {
    /// Checks the scenario and builds its layout.
    pub fn validate(self) -> Result<Scenario, ScenarioError> {
        let groups = self
            .groups
            .iter()
            .enumerate()
            .map(|(index, entry)| entry.to_spec(index))
            .collect::<Result<Vec<_>, _>>()?;
        let layout = KvLayout::one_layer_per_group(groups).map_err(ScenarioError::Layout)?;
        for (leg, lists) in [
            (Role::Prefill, &self.prefill.blocks),
            (Role::Decode, &self.decode.blocks),
        ] {
            for (group, list) in lists.iter().enumerate() {
                let real: Vec<(usize, BlockId)> = list
                    .iter()
                    .copied()
                    .enumerate()
                    .filter(|&(_, id)| id != NULL_BLOCK)
                    .collect();
                let ids: Vec<BlockId> = real.iter().map(|&(_, id)| id).collect();
                if let Some((first, second)) = exchange::duplicate_positions(&ids) {
                    return Err(ScenarioError::DuplicateBlock {
                        leg,
                        group,
                        block: ids[first],
                        first: real[first].0,
                        second: real[second].0,
                    });
                }
            }
        }
        Ok(Scenario {
            layout,
            num_prompt_tokens: self.num_prompt_tokens,
            prefill_blocks: self.prefill.blocks,
            decode_blocks: self.decode.blocks,
            cached_blocks: self.decode.cached_blocks,
            pairing: self.pairing,
            max_decode_tail_blocks: self.max_decode_tail_blocks,
        })
    }
}

/// A checked scenario.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scenario {
    /// The layout, one layer per group.
    pub layout: KvLayout,
    /// Prompt length N.
    pub num_prompt_tokens: u64,
    /// Prefill leg's lists.
    pub prefill_blocks: Vec<Vec<BlockId>>,
    /// Decode leg's lists.
    pub decode_blocks: Vec<Vec<BlockId>>,
    /// Decode leg's prefix hits per group (empty: none).
    pub cached_blocks: Vec<u64>,
    /// Pairing algorithm.
    pub pairing: PairingMode,
    /// Legacy decode-tail allowance.
    pub max_decode_tail_blocks: u64,
}

impl Scenario {
    /// Pairs the two legs' lists.
    pub fn run(&self) -> Result<Pairing, ExchangeError> {
        match self.pairing {
            PairingMode::Anchored => {
                let offer = exchange::offer(&self.layout, self.num_prompt_tokens, &self.prefill_blocks)?;
                let need = exchange::need(
                    &self.layout,
                    self.num_prompt_tokens,
                    &self.decode_blocks,
                    &self.cached_blocks,
                )?;
                exchange::pair(&self.layout, &offer, &need)
            }
            PairingMode::Legacy => exchange::legacy_pair(
                &self.layout,
                &self.prefill_blocks,
                &self.decode_blocks,
                self.max_decode_tail_blocks,
            ),
        }
    }
}

/// Why a scenario was refused before pairing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScenarioError {
    /// A group entry is invalid.
    #[error(transparent)]
    Group(#[from] GroupEntryError),
    /// The layout as a whole is invalid.
    #[error("{0}")]
    Layout(LayoutError),
    /// One leg's list holds a block id twice: it would be read or written twice.
    #[error("{leg}.blocks[{group}]: block {block} appears at both index {first} and {second}")]
    DuplicateBlock {
        /// Leg whose list it is.
        leg: Role,
        /// Group index.
        group: usize,
        /// The repeated id.
        block: BlockId,
        /// First index holding it.
        first: usize,
        /// Second index holding it.
        second: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::GroupSpec;

    fn entry(kind: &str, block_size: Option<u32>, window: Option<u32>) -> GroupEntry {
        GroupEntry {
            kind: kind.into(),
            block_size,
            window,
            chunk: None,
            dcp: None,
        }
    }

    #[test]
    fn group_entries_refuse_keys_their_kind_does_not_take() {
        let cases = [
            (
                entry("full", Some(4), Some(8)),
                "groups[0]: window only applies to sliding_window groups, not full",
            ),
            (
                entry("mamba", None, Some(8)),
                "groups[0]: window only applies to sliding_window groups, not mamba",
            ),
            (
                entry("mamba", Some(4), None),
                "groups[0]: mamba groups take no block_size",
            ),
            (
                entry("sliding_window", Some(4), None),
                "groups[0]: sliding_window group needs a window",
            ),
        ];
        for (entry, expected) in cases {
            assert_eq!(entry.to_spec(0).unwrap_err().to_string(), expected);
        }
        assert_eq!(entry("mamba", None, None).to_spec(0), Ok(GroupSpec::mamba()));
        assert_eq!(
            entry("mamba_align", Some(16), None).to_spec(0),
            GroupSpec::new(crate::layout::GroupKind::MambaAlign, Some(16), 1)
                .map_err(|source| { crate::layout::GroupEntryError::Invalid { index: 0, source } })
        );
        assert_eq!(
            entry("mamba_align", None, None)
                .to_spec(0)
                .unwrap_err()
                .to_string(),
            entry("full", None, None)
                .to_spec(0)
                .unwrap_err()
                .to_string()
                .replace("full", "mamba_align"),
            "an aligned mamba group needs its block size, as an attention group does"
        );
        assert_eq!(
            entry("sliding_window", Some(4), Some(8)).to_spec(0),
            Ok(GroupSpec::sliding_window(4, 8, 1).unwrap())
        );
    }

    /// A chunked local group takes a chunk and a block size; no other kind takes a chunk; a
    /// zero chunk and DCP are refused by name.
    #[test]
    fn chunked_local_entries_take_a_chunk_and_only_they_do() {
        let chunked = |block_size, chunk, dcp| GroupEntry {
            kind: "chunked_local".into(),
            block_size,
            window: None,
            chunk,
            dcp,
        };
        let with_chunk = |kind: &str| GroupEntry {
            chunk: Some(64),
            ..entry(kind, Some(16), None)
        };
        assert_eq!(
            chunked(Some(32), Some(64), None).to_spec(2),
            Ok(GroupSpec::chunked_local(32, 64, 1).unwrap())
        );
        assert_eq!(
            GroupSpec::chunked_local(32, 64, 1).unwrap().kind(),
            crate::layout::GroupKind::ChunkedLocal { chunk: 64 }
        );
        let cases = [
            (
                chunked(Some(32), None, None),
                "groups[2]: chunked_local group needs a chunk",
            ),
            (
                chunked(None, Some(64), None),
                "groups[2]: chunked_local group needs a block_size",
            ),
            (
                chunked(Some(32), Some(0), None),
                "groups[2]: chunked_local chunk must be at least 1 token, got 0",
            ),
            (
                chunked(Some(32), Some(64), Some(2)),
                "groups[2]: chunked_local groups do not support dcp > 1, got dcp 2",
            ),
            (
                with_chunk("full"),
                "groups[2]: chunk only applies to chunked_local groups, not full",
            ),
            (
                with_chunk("sliding_window"),
                "groups[2]: sliding_window group needs a window",
            ),
            (
                GroupEntry {
                    window: Some(8),
                    ..with_chunk("sliding_window")
                },
                "groups[2]: chunk only applies to chunked_local groups, not sliding_window",
            ),
            (
                GroupEntry {
                    window: Some(8),
                    ..chunked(Some(32), Some(64), None)
                },
                "groups[2]: window only applies to sliding_window groups, not chunked_local",
            ),
        ];
        for (entry, expected) in cases {
            let error = entry.to_spec(2).unwrap_err();
            assert_eq!(error.index(), 2);
            assert_eq!(error.to_string(), expected, "{entry:?}");
        }
    }

    fn file(json: &str) -> ScenarioFile {
        serde_json::from_str(json).unwrap()
    }

    /// Null blocks may repeat (they are placeholders); real ids may not. Defaults: anchored
    /// pairing, a one-block legacy tail allowance.
    #[test]
    fn validation_keeps_nulls_and_defaults() {
        let scenario = file(
            r#"{"groups": [{"kind": "sliding_window", "block_size": 4, "window": 4}],
                "num_prompt_tokens": 12,
                "prefill": {"blocks": [[0, 0, 7]]},
                "decode": {"blocks": [[0, 0, 9, 10]]}}"#,
        )
        .validate()
        .unwrap();
        assert_eq!(scenario.pairing, PairingMode::Anchored);
        assert_eq!(scenario.max_decode_tail_blocks, 1);
        let pairing = scenario.run().unwrap();
        let pairs: Vec<(BlockId, BlockId)> = pairing.groups[0]
            .iter()
            .map(|pair| (pair.remote, pair.local))
            .collect();
        // Tokens 8..=10 are read: block 2 only.
        assert_eq!(pairs, vec![(7, 9)]);
        let legacy = ScenarioFile {
            pairing: PairingMode::Legacy,
            ..file(
                r#"{"groups": [{"kind": "full", "block_size": 4}], "num_prompt_tokens": 8,
                    "prefill": {"blocks": [[1, 2]]}, "decode": {"blocks": [[3, 4, 5]]}}"#,
            )
        };
        let pairing = legacy.validate().unwrap().run().unwrap();
        assert_eq!(pairing.num_pairs(), 2, "legacy drops the one-block decode tail");
    }
}
