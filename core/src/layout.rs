//! KV-cache layout: the groups a model's layers fall into, and what each group's block means.
//!
//! A *group* is a set of layers sharing one block table and one kind: full attention, sliding
//! window attention (window `W` tokens), chunked local attention (chunks of `C` tokens, Llama 4's)
//! or a mamba-style recurrent state. Each attention group has
//! its own block size `B` (tokens per block) and a decode-context-parallel factor `d`; a scheduler
//! block of a DCP-sharded group holds `B * d` tokens, the *effective* block size every block count
//! in the exchange must use.
//!
//! A [`KvLayout`] is validated once when built (parse, don't validate): everything downstream may
//! rely on non-zero block sizes, non-zero windows and layers that name existing groups.
//! [`KvLayout::compat_hash`] condenses everything two legs must agree on into 64 bits so that a
//! handshake can refuse a peer with a different layout before any block is paired.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The kind of one KV-cache group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupKind {
    /// Full attention: every prompt position is needed by the last token.
    Full,
    /// Sliding-window attention: a token attends to itself and the `window - 1` tokens before it.
    SlidingWindow {
        /// Window length in tokens, including the attending token itself.
        window: u32,
    },
    /// A fixed-size recurrent state (one state block per request, plus scratch slots).
    Mamba,
    /// A recurrent state checkpointed every `block_size` tokens (vLLM's
    /// `mamba_cache_mode = "align"`, its mamba prefix caching): the block list is indexed by
    /// token position like an attention group's, and the running state after `t` tokens sits at
    /// position `(t - 1) / block_size`, the earlier positions holding cached checkpoints or the
    /// null block.
    MambaAlign,
    /// Chunked local attention (Llama 4's, vLLM's `ChunkedLocalAttentionSpec`): positions are cut
    /// into chunks of `chunk` tokens and a token attends to itself and the tokens before it in
    /// its own chunk, so the blocks of earlier chunks fall out as a window's do. (Last, so the
    /// wire encoding of the kinds before it is what it was.)
    ChunkedLocal {
        /// Chunk length in tokens.
        chunk: u32,
    },
}

impl std::fmt::Display for GroupKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl GroupKind {
    /// Short name used in error messages and tables.
    pub fn name(&self) -> &'static str {
        match self {
            GroupKind::Full => "full",
            GroupKind::SlidingWindow { .. } => "sliding_window",
            GroupKind::Mamba => "mamba",
            GroupKind::MambaAlign => "mamba_align",
            GroupKind::ChunkedLocal { .. } => "chunked_local",
        }
    }

    /// The oldest token that token `token` attends to, for the kinds that attend to a suffix of
    /// the positions only (a sliding window, a chunk); `None` for full attention and recurrent
    /// state. Blocks wholly below it hold nothing the token reads.
    pub fn attended_floor(&self, token: u64) -> Option<u64> {
        match self {
            GroupKind::SlidingWindow { window } => Some((token + 1).saturating_sub(u64::from(*window))),
            GroupKind::ChunkedLocal { chunk } => Some(token / u64::from(*chunk) * u64::from(*chunk)),
            GroupKind::Full | GroupKind::Mamba | GroupKind::MambaAlign => None,
        }
    }

    /// Whether tokens attend to a suffix only (a sliding window or a chunk): blocks fall out of
    /// use as decoding moves on.
    pub fn is_local_attention(&self) -> bool {
        self.attended_floor(0).is_some()
    }

    /// The chunk in tokens, for chunked local groups.
    pub fn chunk(&self) -> Option<u32> {
        match self {
            GroupKind::ChunkedLocal { chunk } => Some(*chunk),
            _ => None,
        }
    }

    /// The window in tokens, for sliding-window groups.
    pub fn window(&self) -> Option<u32> {
        match self {
            GroupKind::SlidingWindow { window } => Some(*window),
            _ => None,
        }
    }
}

/// One validated KV-cache group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GroupSpec {
    kind: GroupKind,
    /// Tokens per block on one DCP rank; `1` for mamba groups, whose block is a state, not tokens.
    block_size: u32,
    /// Decode-context-parallel factor; the scheduler block covers `block_size * dcp` tokens.
    dcp: u32,
}

impl GroupSpec {
    /// A full-attention group.
    pub fn full(block_size: u32, dcp: u32) -> Result<Self, LayoutError> {
        Self::new(GroupKind::Full, Some(block_size), dcp)
    }

    /// A sliding-window group with a window of `window` tokens.
    pub fn sliding_window(block_size: u32, window: u32, dcp: u32) -> Result<Self, LayoutError> {
        Self::new(GroupKind::SlidingWindow { window }, Some(block_size), dcp)
    }

    /// A chunked local attention group with chunks of `chunk` tokens.
    pub fn chunked_local(block_size: u32, chunk: u32, dcp: u32) -> Result<Self, LayoutError> {
        Self::new(GroupKind::ChunkedLocal { chunk }, Some(block_size), dcp)
    }

    /// A mamba (recurrent state) group.
    pub fn mamba() -> Self {
        GroupSpec {
            kind: GroupKind::Mamba,
            block_size: 1,
            dcp: 1,
        }
    }

    /// Checks one group's parameters; attention groups need a block size, mamba groups take none.
    pub fn new(kind: GroupKind, block_size: Option<u32>, dcp: u32) -> Result<Self, LayoutError> {
        if dcp == 0 {
            return Err(LayoutError::ZeroDcp);
        }
        match kind {
            GroupKind::Mamba => {
                if dcp != 1 {
                    return Err(LayoutError::DcpNotSupported { kind: "mamba", dcp });
                }
                Ok(Self::mamba())
            }
            GroupKind::MambaAlign => {
                // vLLM refuses DCP with mamba layers; the checkpoints sit on unsharded positions.
                if dcp != 1 {
                    return Err(LayoutError::DcpNotSupported {
                        kind: "mamba_align",
                        dcp,
                    });
                }
                let block_size = block_size.ok_or(LayoutError::MissingBlockSize { kind: kind.name() })?;
                if block_size == 0 {
                    return Err(LayoutError::ZeroBlockSize);
                }
                Ok(GroupSpec {
                    kind,
                    block_size,
                    dcp,
                })
            }
            GroupKind::Full | GroupKind::SlidingWindow { .. } | GroupKind::ChunkedLocal { .. } => {
                let block_size = block_size.ok_or(LayoutError::MissingBlockSize { kind: kind.name() })?;
                if block_size == 0 {
                    return Err(LayoutError::ZeroBlockSize);
                }
                match kind {
                    GroupKind::SlidingWindow { window: 0 } => return Err(LayoutError::ZeroWindow),
                    GroupKind::ChunkedLocal { chunk: 0 } => return Err(LayoutError::ZeroChunk),
                    _ => {}
                }
                // vLLM asserts dcp == 1 for sliding-window and chunked local attention; so do we,
                // because the window and the chunks are cut on unsharded token positions.
                if kind.is_local_attention() && dcp != 1 {
                    return Err(LayoutError::DcpNotSupported {
                        kind: kind.name(),
                        dcp,
                    });
                }
                block_size
                    .checked_mul(dcp)
                    .ok_or(LayoutError::EffectiveBlockSizeOverflow { block_size, dcp })?;
                Ok(GroupSpec {
                    kind,
                    block_size,
                    dcp,
                })
            }
        }
    }

    /// The group's kind.
    pub fn kind(&self) -> GroupKind {
        self.kind
    }

    /// Tokens per block on one DCP rank (1 for mamba groups).
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The decode-context-parallel factor.
    pub fn dcp(&self) -> u32 {
        self.dcp
    }

    /// Tokens per scheduler block: `block_size * dcp`. The exchange counts blocks with this.
    pub fn effective_block_size(&self) -> u64 {
        u64::from(self.block_size) * u64::from(self.dcp)
    }

    /// Whether a leg of this group and a leg of `other` can pair block for block: the same kind
    /// and window, and scheduler blocks of the same tokens. How each leg splits a block over its
    /// DCP ranks (`block_size` per rank times `dcp`) is its own, as its TP split is.
    pub fn pairs_with(&self, other: &GroupSpec) -> bool {
        self.kind == other.kind && self.effective_block_size() == other.effective_block_size()
    }

    /// Blocks a leg holds for `tokens` tokens in this group (`cdiv(tokens, B_eff)`); mamba: 1.
    pub fn blocks_for_tokens(&self, tokens: u64) -> u64 {
        match self.kind {
            GroupKind::Mamba => 1,
            _ => tokens.div_ceil(self.effective_block_size()),
        }
    }
}

/// A validated model KV layout: groups, and which group each layer belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    groups: Vec<GroupSpec>,
    /// `layer_groups[l]` is the group index of layer `l`.
    layer_groups: Vec<usize>,
}

impl KvLayout {
    /// Builds a layout; every layer must name an existing group and every group needs a layer.
    pub fn new(groups: Vec<GroupSpec>, layer_groups: Vec<usize>) -> Result<Self, LayoutError> {
        if groups.is_empty() {
            return Err(LayoutError::NoGroups);
        }
        for (layer, &group) in layer_groups.iter().enumerate() {
            if group >= groups.len() {
                return Err(LayoutError::LayerGroupOutOfRange {
                    layer,
                    group,
                    groups: groups.len(),
                });
            }
        }
        if !layer_groups.is_empty() {
            for group in 0..groups.len() {
                if !layer_groups.contains(&group) {
                    return Err(LayoutError::GroupWithoutLayers { group });
                }
            }
        }
        Ok(KvLayout { groups, layer_groups })
    }

    /// A layout with one layer per group, for callers that only pair block lists.
    pub fn one_layer_per_group(groups: Vec<GroupSpec>) -> Result<Self, LayoutError> {
        let layers = (0..groups.len()).collect();
        Self::new(groups, layers)
    }

    /// The groups, in exchange order.
    pub fn groups(&self) -> &[GroupSpec] {
        &self.groups
    }

    /// One group.
    pub fn group(&self, index: usize) -> Option<&GroupSpec> {
        self.groups.get(index)
    }

    /// Group index per layer.
    pub fn layer_groups(&self) -> &[usize] {
        &self.layer_groups
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.layer_groups.len()
    }

    /// The layout as named model-identity fields ([`crate::identity::ModelFields`]): the groups
    /// (kind, window, block size, DCP) and the layer-to-group map, so a handshake refusing
    /// another layout can show both.
    pub fn identity_fields(&self) -> [(String, String); 2] {
        let groups: Vec<String> = self
            .groups
            .iter()
            .map(|group| {
                let kind = match group.kind {
                    GroupKind::SlidingWindow { window } => format!("sliding_window({window})"),
                    GroupKind::ChunkedLocal { chunk } => format!("chunked_local({chunk})"),
                    kind => kind.name().to_string(),
                };
                format!("{kind} block {} dcp {}", group.block_size, group.dcp)
            })
            .collect();
        [
            ("kv_groups".to_string(), groups.join(", ")),
            ("layer_groups".to_string(), format!("{:?}", self.layer_groups)),
        ]
    }

    /// A 64-bit digest of everything two legs must agree on (kinds, block sizes, windows, DCP
    /// factors, layer-to-group map). Stable across runs and platforms.
    pub fn compat_hash(&self) -> u64 {
        self.digest(true)
    }

    /// The digest of the groups as the exchange pairs them (kinds, windows, tokens per scheduler
    /// block), without the layer-to-group map or how a leg splits a block over its DCP ranks:
    /// what two workers agree on when they match layers by name instead of by position
    /// (pipeline stages that split a model's layers differently) and may split blocks over
    /// different DCP sizes ([`GroupSpec::pairs_with`]).
    pub fn groups_hash(&self) -> u64 {
        self.digest(false)
    }

    fn digest(&self, with_layers: bool) -> u64 {
        let mut hasher = Sha256::new();
        hasher.update(if with_layers {
            &b"pdkv-layout-v1"[..]
        } else {
            &b"pdkv-groups-v2"[..]
        });
        hasher.update((self.groups.len() as u64).to_le_bytes());
        for group in &self.groups {
            let (tag, window) = match group.kind {
                GroupKind::Full => (0u8, 0u32),
                GroupKind::SlidingWindow { window } => (1, window),
                GroupKind::Mamba => (2, 0),
                GroupKind::MambaAlign => (3, 0),
                GroupKind::ChunkedLocal { chunk } => (4, chunk),
            };
            hasher.update([tag]);
            hasher.update(window.to_le_bytes());
            if with_layers {
                hasher.update(group.block_size.to_le_bytes());
                hasher.update(group.dcp.to_le_bytes());
            } else {
                hasher.update(group.effective_block_size().to_le_bytes());
            }
        }
        if with_layers {
            hasher.update((self.layer_groups.len() as u64).to_le_bytes());
            for &group in &self.layer_groups {
                hasher.update((group as u64).to_le_bytes());
            }
        }
        let digest = hasher.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        u64::from_le_bytes(first)
    }
}

/// Why a layout was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A layout needs at least one group.
    #[error("layout has no groups: at least one group is required")]
    NoGroups,
    /// Attention groups must say how many tokens a block holds.
    #[error("{kind} group needs a block_size")]
    MissingBlockSize {
        /// Kind of the offending group.
        kind: &'static str,
    },
    /// A block must hold at least one token.
    #[error("block_size must be at least 1, got 0")]
    ZeroBlockSize,
    /// A window must cover at least the attending token.
    #[error("sliding_window window must be at least 1 token, got 0")]
    ZeroWindow,
    /// A chunk must hold at least the attending token.
    #[error("chunked_local chunk must be at least 1 token, got 0")]
    ZeroChunk,
    /// DCP factor 0 is meaningless.
    #[error("dcp must be at least 1, got 0")]
    ZeroDcp,
    /// Window and mamba groups are never DCP-sharded (vLLM asserts the same).
    #[error("{kind} groups do not support dcp > 1, got dcp {dcp}")]
    DcpNotSupported {
        /// Kind of the offending group.
        kind: &'static str,
        /// The DCP factor given.
        dcp: u32,
    },
    /// `block_size * dcp` must fit in 32 bits.
    #[error("block_size {block_size} * dcp {dcp} overflows")]
    EffectiveBlockSizeOverflow {
        /// Block size given.
        block_size: u32,
        /// DCP factor given.
        dcp: u32,
    },
    /// A layer names a group that does not exist.
    #[error("layer {layer} names group {group}, but the layout has {groups} groups")]
    LayerGroupOutOfRange {
        /// Layer index.
        layer: usize,
        /// Group index it named.
        group: usize,
        /// Number of groups.
        groups: usize,
    },
    /// Every group must hold at least one layer, or its blocks would carry nothing.
    #[error("group {group} has no layers")]
    GroupWithoutLayers {
        /// Group index.
        group: usize,
    },
}

/// One group as a user writes it, in `cluster.toml` or a `pdkv plan` scenario.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupEntry {
    /// `full`, `sliding_window`, `chunked_local`, `mamba` or `mamba_align`.
    pub kind: String,
    /// Tokens per block; required for attention groups, refused for mamba.
    #[serde(default)]
    pub block_size: Option<u32>,
    /// Window in tokens; required for `sliding_window`, refused elsewhere.
    #[serde(default)]
    pub window: Option<u32>,
    /// Chunk in tokens (a model's `attention_chunk_size`); required for `chunked_local`,
    /// refused elsewhere.
    #[serde(default)]
    pub chunk: Option<u32>,
    /// DCP factor, default 1.
    #[serde(default)]
    pub dcp: Option<u32>,
}

impl GroupEntry {
    /// Checks the entry and builds its [`GroupSpec`]; `index` names it in errors.
    pub fn to_spec(&self, index: usize) -> Result<GroupSpec, GroupEntryError> {
        let at = |source: LayoutError| GroupEntryError::Invalid { index, source };
        let kind = match self.kind.as_str() {
            "full" => GroupKind::Full,
            "mamba" => GroupKind::Mamba,
            "mamba_align" => GroupKind::MambaAlign,
            "sliding_window" => GroupKind::SlidingWindow {
                window: self.window.ok_or(GroupEntryError::MissingWindow { index })?,
            },
            "chunked_local" => GroupKind::ChunkedLocal {
                chunk: self.chunk.ok_or(GroupEntryError::MissingChunk { index })?,
            },
            other => {
                return Err(GroupEntryError::UnknownKind {
                    index,
                    kind: other.to_string(),
                });
            }
        };
        if self.window.is_some() && kind.window().is_none() {
            return Err(GroupEntryError::WindowOnNonWindowGroup {
                index,
                kind: kind.name(),
            });
        }
        if self.chunk.is_some() && kind.chunk().is_none() {
            return Err(GroupEntryError::ChunkOnNonChunkedGroup {
                index,
                kind: kind.name(),
            });
        }
        if kind == GroupKind::Mamba && self.block_size.is_some() {
            return Err(GroupEntryError::BlockSizeOnMamba { index });
        }
        GroupSpec::new(kind, self.block_size, self.dcp.unwrap_or(1)).map_err(at)
    }
}

/// Why a [`GroupEntry`] is refused; each names the group by index.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupEntryError {
    /// `kind` is not one pdkv knows.
    #[error(
        "groups[{index}]: unknown kind {kind:?}, expected \"full\", \"sliding_window\", \"chunked_local\", \"mamba\" or \"mamba_align\""
    )]
    UnknownKind {
        /// Group index.
        index: usize,
        /// Kind given.
        kind: String,
    },
    /// A sliding-window group without a window.
    #[error("groups[{index}]: sliding_window group needs a window")]
    MissingWindow {
        /// Group index.
        index: usize,
    },
    /// A chunked local group without a chunk.
    #[error("groups[{index}]: chunked_local group needs a chunk")]
    MissingChunk {
        /// Group index.
        index: usize,
    },
    /// A chunk on a group that has none.
    #[error("groups[{index}]: chunk only applies to chunked_local groups, not {kind}")]
    ChunkOnNonChunkedGroup {
        /// Group index.
        index: usize,
        /// The group's kind.
        kind: &'static str,
    },
    /// A window on a group that has none.
    #[error("groups[{index}]: window only applies to sliding_window groups, not {kind}")]
    WindowOnNonWindowGroup {
        /// Group index.
        index: usize,
        /// The group's kind.
        kind: &'static str,
    },
    /// A block size on a mamba group.
    #[error("groups[{index}]: mamba groups take no block_size")]
    BlockSizeOnMamba {
        /// Group index.
        index: usize,
    },
    /// A group's parameters are invalid.
    #[error("groups[{index}]: {source}")]
    Invalid {
        /// Group index.
        index: usize,
        /// What is wrong.
        source: LayoutError,
    },
}

impl GroupEntryError {
    /// The index of the group at fault.
    pub fn index(&self) -> usize {
        match self {
            GroupEntryError::UnknownKind { index, .. }
            | GroupEntryError::MissingWindow { index }
            | GroupEntryError::MissingChunk { index }
            | GroupEntryError::ChunkOnNonChunkedGroup { index, .. }
            | GroupEntryError::WindowOnNonWindowGroup { index, .. }
            | GroupEntryError::BlockSizeOnMamba { index }
            | GroupEntryError::Invalid { index, .. } => *index,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_found_by_index() {
        let layout =
            KvLayout::one_layer_per_group(vec![GroupSpec::full(4, 1).unwrap(), GroupSpec::mamba()]).unwrap();
        assert_eq!(layout.group(1), Some(&GroupSpec::mamba()));
        assert_eq!(layout.group(0).map(GroupSpec::block_size), Some(4));
        assert_eq!(layout.group(2), None);
    }

    #[test]
    fn effective_block_size_multiplies_dcp() {
        let group = GroupSpec::full(64, 4).unwrap();
        assert_eq!(group.effective_block_size(), 256);
        assert_eq!(group.blocks_for_tokens(257), 2);
        assert_eq!(group.blocks_for_tokens(256), 1);
        assert_eq!(GroupSpec::mamba().blocks_for_tokens(10_000), 1);
    }

    #[test]
    fn invalid_groups_name_what_is_wrong() {
        let cases: Vec<(Result<GroupSpec, LayoutError>, &str)> = vec![
            (GroupSpec::full(0, 1), "block_size must be at least 1"),
            (GroupSpec::full(64, 0), "dcp must be at least 1"),
            (GroupSpec::sliding_window(64, 0, 1), "window must be at least 1"),
            (
                GroupSpec::sliding_window(64, 128, 2),
                "sliding_window groups do not support dcp > 1",
            ),
            (
                GroupSpec::new(GroupKind::Full, None, 1),
                "full group needs a block_size",
            ),
            (
                GroupSpec::new(GroupKind::Mamba, None, 2),
                "mamba groups do not support dcp > 1",
            ),
            (GroupSpec::full(u32::MAX, 2), "overflows"),
        ];
        for (result, expected) in cases {
            let message = result.unwrap_err().to_string();
            assert!(
                message.contains(expected),
                "{message:?} should contain {expected:?}"
            );
        }
    }

    #[test]
    fn layouts_check_layer_to_group_map() {
        let full = GroupSpec::full(64, 1).unwrap();
        assert_eq!(KvLayout::new(vec![], vec![]), Err(LayoutError::NoGroups));
        assert!(matches!(
            KvLayout::new(vec![full], vec![0, 1]),
            Err(LayoutError::LayerGroupOutOfRange {
                layer: 1,
                group: 1,
                groups: 1
            })
        ));
        assert!(matches!(
            KvLayout::new(vec![full, full], vec![0, 0]),
            Err(LayoutError::GroupWithoutLayers { group: 1 })
        ));
    }

    #[test]
    fn groups_hash_ignores_which_layers_a_worker_holds_but_not_the_groups() {
        let groups = || {
            vec![
                GroupSpec::full(64, 1).unwrap(),
                GroupSpec::sliding_window(64, 128, 1).unwrap(),
            ]
        };
        // Two pipeline stages of one model: different layers, one set of groups.
        let stage0 = KvLayout::new(groups(), vec![0, 1]).unwrap();
        let stage1 = KvLayout::new(groups(), vec![0, 1, 0, 1]).unwrap();
        assert_eq!(stage0.groups_hash(), stage1.groups_hash());
        assert_ne!(stage0.compat_hash(), stage1.compat_hash());
        let other_window = KvLayout::new(
            vec![
                GroupSpec::full(64, 1).unwrap(),
                GroupSpec::sliding_window(64, 256, 1).unwrap(),
            ],
            vec![0, 1],
        )
        .unwrap();
        assert_ne!(stage0.groups_hash(), other_window.groups_hash());
        let one_group = KvLayout::new(vec![GroupSpec::full(64, 1).unwrap()], vec![0, 0]).unwrap();
        assert_ne!(stage0.groups_hash(), one_group.groups_hash());
        // Not the full digest of a layout that happens to have no per-layer part.
        assert_ne!(one_group.groups_hash(), one_group.compat_hash());
        // Scheduler blocks of 64 tokens, whole or split over 4 DCP ranks: one pairing; blocks of
        // 128 tokens: another.
        let split = KvLayout::new(vec![GroupSpec::full(16, 4).unwrap()], vec![0, 0]).unwrap();
        assert_eq!(split.groups_hash(), one_group.groups_hash());
        assert_ne!(split.compat_hash(), one_group.compat_hash());
        let wider = KvLayout::new(vec![GroupSpec::full(64, 2).unwrap()], vec![0, 0]).unwrap();
        assert_ne!(wider.groups_hash(), one_group.groups_hash());
    }

    #[test]
    fn compat_hash_differs_when_any_parameter_differs() {
        let base = KvLayout::new(
            vec![
                GroupSpec::full(64, 1).unwrap(),
                GroupSpec::sliding_window(64, 128, 1).unwrap(),
            ],
            vec![0, 1, 0],
        )
        .unwrap();
        let variants = [
            KvLayout::new(
                vec![
                    GroupSpec::full(32, 1).unwrap(),
                    GroupSpec::sliding_window(64, 128, 1).unwrap(),
                ],
                vec![0, 1, 0],
            ),
            KvLayout::new(
                vec![
                    GroupSpec::full(64, 2).unwrap(),
                    GroupSpec::sliding_window(64, 128, 1).unwrap(),
                ],
                vec![0, 1, 0],
            ),
            KvLayout::new(
                vec![
                    GroupSpec::full(64, 1).unwrap(),
                    GroupSpec::sliding_window(64, 256, 1).unwrap(),
                ],
                vec![0, 1, 0],
            ),
            KvLayout::new(
                vec![
                    GroupSpec::full(64, 1).unwrap(),
                    GroupSpec::sliding_window(64, 128, 1).unwrap(),
                ],
                vec![0, 1, 1],
            ),
        ];
        for variant in variants {
            assert_ne!(base.compat_hash(), variant.unwrap().compat_hash());
        }
        assert_eq!(base.compat_hash(), base.clone().compat_hash());
    }
}
