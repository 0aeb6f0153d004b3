//! `cluster.toml`: the model, the legs and the limits of a pdkv cluster.
//!
//! [`ClusterConfig::from_toml`] parses and checks a file in one go: unknown keys, missing keys,
//! zero sizes, windows without block sizes and duplicate node names are refused with an error that
//! names the key. Defaults live here and nowhere else. `docs/cluster-toml.md` documents every key.

use std::collections::HashSet;

use pdkv_core::exchange::PairingMode;
use pdkv_core::layout::KvLayout;
use pdkv_core::scenario::GroupEntry;
use pdkv_core::wire::NodeId;
use serde::{Deserialize, Serialize};

use crate::engine::ModelParams;

/// The shipped default cluster, embedded so `pdkv demo` runs with no file.
pub const DEFAULT_CLUSTER_TOML: &str = include_str!("../../cluster.toml");

/// A node's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Computes prompts and grants READs of their KV.
    Prefill,
    /// READs KV and decodes.
    Decode,
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        })
    }
}

/// How much of a prompt a prefill leg computes and keeps.
///
/// The decode leg recomputes the last prompt token either way, so both pair and give the same
/// output; `AllButLast` is how vLLM's hybrid (mamba) prefill behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillTokens {
    /// Every prompt token; the mamba state is kept as it stood after `N - 1` tokens.
    #[default]
    All,
    /// The first `N - 1` tokens only (none for a one-token prompt).
    AllButLast,
}

impl PrefillTokens {
    /// Tokens a prefill leg computes for a `num_prompt_tokens`-token prompt.
    pub fn computed(self, num_prompt_tokens: u64) -> u64 {
        match self {
            PrefillTokens::All => num_prompt_tokens,
            PrefillTokens::AllButLast => num_prompt_tokens.saturating_sub(1),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterFile {
    model: ModelSection,
    #[serde(default)]
    exchange: ExchangeConfig,
    #[serde(default)]
    transport: TransportConfig,
    #[serde(default)]
    limits: Limits,
    nodes: Vec<NodeSection>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelSection {
    seed: u64,
    d_model: u32,
    vocab: u32,
    layer_groups: Vec<usize>,
    groups: Vec<GroupEntry>,
}

/// `[exchange]`: how legs pair block lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExchangeConfig {
    /// `anchored` (default) or `legacy` (diagnosis only).
    pub pairing: PairingMode,
    /// Legacy only: decode tail blocks the head alignment may drop.
    pub max_decode_tail_blocks: u64,
}

impl Default for ExchangeConfig {
    fn default() -> Self {
        ExchangeConfig {
            pairing: PairingMode::Anchored,
            max_decode_tail_blocks: 1,
        }
    }
}

/// Which READ engine legs in one process use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReadEngineKind {
    /// Heap memory, direct copies inside the process.
    Local,
    /// Shared memory (memfd): each leg's regions are mapped read-only by the legs reading them,
    /// exactly as legs in separate processes on one host do.
    #[default]
    Shm,
}

/// `[transport]`: how legs move KV bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransportConfig {
    /// READ engine for legs in one process: `shm` (default) or `local`.
    pub read_engine: ReadEngineKind,
}

/// `[limits]`: every wait and queue bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Router bound on one whole request (prefill + decode). Default 30 000.
    pub request_timeout_ms: u64,
    /// How long a grant pins blocks without renewal. Default 10 000.
    pub lease_ms: u64,
    /// Longest wait for free blocks before a request fails. Default 5 000.
    pub alloc_wait_ms: u64,
    /// Requests that may wait for blocks per leg; more fail at once. Default 64.
    pub wait_queue: usize,
    /// Live grants per prefill leg (each pins blocks). Default 256.
    pub max_grants: usize,
    /// Actor mailbox capacity. Default 64.
    pub mailbox: usize,
    /// Largest KV memory one leg may register (all layers' regions), in bytes; a node whose
    /// `blocks_per_group` would need more is refused at load. Default 8 GiB.
    pub max_leg_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            request_timeout_ms: 30_000,
            lease_ms: 10_000,
            alloc_wait_ms: 5_000,
            wait_queue: 64,
            max_grants: 256,
            mailbox: 64,
            max_leg_bytes: 8 << 30,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeSection {
    name: String,
    role: Role,
    #[serde(default)]
    lookahead_tokens: u64,
    blocks_per_group: u32,
    #[serde(default)]
    prefix_caching: bool,
    #[serde(default)]
    prefill_tokens: Option<PrefillTokens>,
}

/// One node (one leg) of the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeConfig {
    /// Unique name.
    pub name: NodeId,
    /// Prefill or decode.
    pub role: Role,
    /// Slots reserved beyond the prompt (speculative decoding, first decode steps).
    pub lookahead_tokens: u64,
    /// Blocks per group in the leg's pools.
    pub blocks_per_group: u32,
    /// Whether full-attention groups reuse cached prompt blocks.
    pub prefix_caching: bool,
    /// How much of a prompt a prefill leg computes (`all` on decode legs).
    pub prefill_tokens: PrefillTokens,
}

/// A checked cluster description.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// The model's KV layout.
    pub layout: KvLayout,
    /// Model sizes and seed.
    pub model: ModelParams,
    /// Pairing mode.
    pub exchange: ExchangeConfig,
    /// READ engine.
    pub transport: TransportConfig,
    /// Bounds.
    pub limits: Limits,
    /// Nodes in file order.
    pub nodes: Vec<NodeConfig>,
}

impl ClusterConfig {
    /// The embedded default cluster.
    pub fn embedded_default() -> Self {
        // The shipped file is checked by a test, so this cannot fail in a released build.
        Self::from_toml(DEFAULT_CLUSTER_TOML).expect("the shipped cluster.toml is valid")
    }

    /// Parses and checks a `cluster.toml`.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let file: ClusterFile =
            toml::from_str(text).map_err(|error| ConfigError::Parse(error.to_string()))?;
        let groups = file
            .model
            .groups
            .iter()
            .enumerate()
            .map(|(index, entry)| {
                entry
                    .to_spec(index)
                    .map_err(|error| ConfigError::Invalid(format!("model.{error}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if file.model.layer_groups.is_empty() {
            return Err(ConfigError::Invalid(
                "model.layer_groups: at least one layer is required".into(),
            ));
        }
        let layout = KvLayout::new(groups, file.model.layer_groups.clone())
            .map_err(|error| ConfigError::Invalid(format!("model.layer_groups: {error}")))?;
        if file.model.d_model == 0 || file.model.d_model > 4096 {
            return Err(ConfigError::Invalid(format!(
                "model.d_model: must be 1..=4096, got {}",
                file.model.d_model
            )));
        }
        if file.model.vocab < 2 {
            return Err(ConfigError::Invalid(format!(
                "model.vocab: must be at least 2, got {}",
                file.model.vocab
            )));
        }
        let weights = reference_weight_count(
            &layout,
            u64::from(file.model.d_model),
            u64::from(file.model.vocab),
        );
        if weights.is_none_or(|count| count > MAX_REFERENCE_WEIGHTS) {
            return Err(ConfigError::Invalid(format!(
                "model: d_model {} with vocab {} and {} layers needs more than the reference engine's {} weights",
                file.model.d_model,
                file.model.vocab,
                layout.num_layers(),
                MAX_REFERENCE_WEIGHTS
            )));
        }
        let limits = file.limits;
        for (key, value) in [
            ("request_timeout_ms", limits.request_timeout_ms),
            ("lease_ms", limits.lease_ms),
            ("alloc_wait_ms", limits.alloc_wait_ms),
            ("wait_queue", limits.wait_queue as u64),
            ("max_grants", limits.max_grants as u64),
            ("mailbox", limits.mailbox as u64),
            ("max_leg_bytes", limits.max_leg_bytes),
        ] {
            if value == 0 {
                return Err(ConfigError::Invalid(format!("limits.{key}: must be at least 1")));
            }
        }
        if file.nodes.len() > MAX_NODES {
            return Err(ConfigError::Invalid(format!(
                "nodes: {} nodes, at most {MAX_NODES} are supported (each runs its own threads)",
                file.nodes.len()
            )));
        }
        let mut names = HashSet::new();
        let mut nodes = Vec::with_capacity(file.nodes.len());
        for (index, node) in file.nodes.into_iter().enumerate() {
            if !is_dns_name(&node.name) {
                return Err(ConfigError::Invalid(format!(
                    "nodes[{index}].name: {:?} is not a valid node name (letters, digits, '-' and '.', \
                     as in a DNS name: it goes into the node's certificate)",
                    node.name
                )));
            }
            if !names.insert(node.name.clone()) {
                return Err(ConfigError::Invalid(format!(
                    "nodes[{index}].name: duplicate node name {:?}",
                    node.name
                )));
            }
            let leg_bytes = leg_kv_bytes(&layout, u64::from(file.model.d_model), node.blocks_per_group);
            if leg_bytes.is_none_or(|bytes| bytes > limits.max_leg_bytes) {
                return Err(ConfigError::Invalid(format!(
                    "nodes[{index}].blocks_per_group: {} blocks per group need {} of KV memory, above limits.max_leg_bytes ({} bytes)",
                    node.blocks_per_group,
                    leg_bytes.map_or("more than 2^64 bytes".to_string(), |bytes| format!(
                        "{bytes} bytes"
                    )),
                    limits.max_leg_bytes
                )));
            }
            if node.blocks_per_group == 0 {
                return Err(ConfigError::Invalid(format!(
                    "nodes[{index}].blocks_per_group: must be at least 1"
                )));
            }
            if node.role == Role::Decode && node.prefill_tokens.is_some() {
                return Err(ConfigError::Invalid(format!(
                    "nodes[{index}].prefill_tokens: only prefill nodes take this key, {:?} is a decode node",
                    node.name
                )));
            }
            nodes.push(NodeConfig {
                name: NodeId(node.name),
                role: node.role,
                lookahead_tokens: node.lookahead_tokens,
                blocks_per_group: node.blocks_per_group,
                prefix_caching: node.prefix_caching,
                prefill_tokens: node.prefill_tokens.unwrap_or_default(),
            });
        }
        for role in [Role::Prefill, Role::Decode] {
            if !nodes.iter().any(|node| node.role == role) {
                return Err(ConfigError::Invalid(format!(
                    "nodes: at least one {role} node is required"
                )));
            }
        }
        Ok(ClusterConfig {
            layout,
            model: ModelParams {
                seed: file.model.seed,
                d_model: file.model.d_model as usize,
                vocab: file.model.vocab,
            },
            exchange: file.exchange,
            transport: file.transport,
            limits,
            nodes,
        })
    }

    /// Reads and checks a `cluster.toml` file.
    pub fn from_file(path: &std::path::Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|error| ConfigError::Read(format!("{}: {error}", path.display())))?;
        Self::from_toml(&text)
    }

    /// Nodes of one role.
    pub fn nodes_with_role(&self, role: Role) -> impl Iterator<Item = &NodeConfig> {
        self.nodes.iter().filter(move |node| node.role == role)
    }
}

/// Most nodes one cluster.toml may describe.
const MAX_NODES: usize = 256;

/// The reference engine's largest model: 256 Mi f32 weights (1 GiB).
const MAX_REFERENCE_WEIGHTS: u64 = 256 << 20;

/// Weights of the reference engine: embeddings and head (`vocab * d` each), four `d * d`
/// matrices per attention layer, two (plus a vector) per mamba layer; `None` on overflow.
fn reference_weight_count(layout: &KvLayout, d_model: u64, vocab: u64) -> Option<u64> {
    let per_layer = d_model
        .checked_mul(d_model)?
        .checked_mul(4)?
        .checked_add(d_model)?;
    let layers = per_layer.checked_mul(layout.num_layers() as u64)?;
    vocab.checked_mul(d_model)?.checked_mul(2)?.checked_add(layers)
}

/// KV bytes a leg registers: every layer's region of `blocks + 1` blocks (the same sizes as
/// `engine::Model::bytes_per_block`), plus the generation tables; `None` on overflow.
fn leg_kv_bytes(layout: &KvLayout, d_model: u64, blocks: u32) -> Option<u64> {
    let blocks = u64::from(blocks) + 1;
    let mut total = blocks.checked_mul(4)?.checked_mul(layout.groups().len() as u64)?;
    for &group in layout.layer_groups() {
        let spec = layout.groups()[group];
        let block_bytes = match spec.kind() {
            pdkv_core::layout::GroupKind::Mamba => d_model.checked_mul(4)?,
            _ => spec.effective_block_size().checked_mul(d_model)?.checked_mul(8)?,
        };
        total = total.checked_add(blocks.checked_mul(block_bytes)?)?;
    }
    Some(total)
}

/// Whether `name` can be a DNS name in a certificate: dot-separated labels of 1..=63 letters,
/// digits and inner hyphens, at most 253 characters.
fn is_dns_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        })
}

/// Why a cluster description was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read cluster config {0}")]
    Read(String),
    /// TOML syntax, unknown keys, missing keys or wrong types.
    #[error("cluster.toml: {0}")]
    Parse(String),
    /// A value is out of range or inconsistent.
    #[error("cluster.toml: {0}")]
    Invalid(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_cluster_toml_mirrors_the_seed() {
        let config = ClusterConfig::embedded_default();
        let window = config.layout.groups()[1];
        assert_eq!((window.block_size(), window.kind().window()), (64, Some(128)));
        let lookahead: Vec<_> = config
            .nodes
            .iter()
            .map(|n| (n.role, n.lookahead_tokens))
            .collect();
        assert_eq!(lookahead, vec![(Role::Prefill, 0), (Role::Decode, 9)]);
        assert_eq!(config.exchange.pairing, PairingMode::Anchored);
    }

    /// Each broken variant of the shipped file is refused with an error naming the key.
    #[test]
    fn bad_cluster_toml_names_the_key() {
        let base = DEFAULT_CLUSTER_TOML;
        let with = |from: &str, to: &str| {
            assert!(base.contains(from), "{from}");
            base.replacen(from, to, 1)
        };
        let cases = [
            (
                with("seed = 7", "seed = 7\nflavour = 1"),
                "unknown field `flavour`",
            ),
            (
                with("blocks_per_group = 64", "blocks_per_group = 0"),
                "nodes[0].blocks_per_group: must be at least 1",
            ),
            (
                with("block_size = 64\nwindow = 128", "window = 128"),
                "model.groups[1]: sliding_window group needs a block_size",
            ),
            (
                with("name = \"decode-0\"", "name = \"prefill-0\""),
                "nodes[1].name: duplicate node name \"prefill-0\"",
            ),
            (
                with("role = \"decode\"", "role = \"spectator\""),
                "unknown variant `spectator`",
            ),
            (
                with("role = \"decode\"", "role = \"prefill\""),
                "nodes: at least one decode node is required",
            ),
            (
                with("layer_groups = [0, 1, 0, 1]", "layer_groups = [0, 2]"),
                "model.layer_groups: layer 1 names group 2",
            ),
            (
                with("window = 128", "window = 0"),
                "model.groups[1]: sliding_window window must be at least 1 token",
            ),
            (
                with("lease_ms = 10000", "lease_ms = 0"),
                "limits.lease_ms: must be at least 1",
            ),
            (with("d_model = 32", "d_model = -3"), "d_model"),
            (with("seed = 7\n", ""), "missing field `seed`"),
            (
                with("blocks_per_group = 64", "blocks_per_group = 4000000000"),
                "nodes[0].blocks_per_group: 4000000000 blocks per group need",
            ),
            (
                with("vocab = 256", "vocab = 4000000000"),
                "needs more than the reference engine's",
            ),
            (
                with("d_model = 32", "d_model = 4096"),
                "needs more than the reference engine's",
            ),
            (
                with("name = \"decode-0\"", "name = \"decode 0\""),
                "nodes[1].name: \"decode 0\" is not a valid node name",
            ),
            (
                with("name = \"decode-0\"", "name = \"\""),
                "nodes[1].name: \"\" is not a valid node name",
            ),
            (
                with("pairing = \"anchored\"", "pairing = \"sideways\""),
                "unknown variant `sideways`",
            ),
            (
                with(
                    "lookahead_tokens = 9",
                    "lookahead_tokens = 9\nprefill_tokens = \"all_but_last\"",
                ),
                "nodes[1].prefill_tokens: only prefill nodes take this key",
            ),
            (
                with(
                    "lookahead_tokens = 0",
                    "lookahead_tokens = 0\nprefill_tokens = \"most\"",
                ),
                "unknown variant `most`, expected `all` or `all_but_last`",
            ),
        ];
        for (text, expected) in cases {
            let error = ClusterConfig::from_toml(&text).unwrap_err().to_string();
            assert!(error.contains(expected), "{error:?} should contain {expected:?}");
        }
    }
}
