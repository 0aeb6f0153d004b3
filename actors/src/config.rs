//! `cluster.toml`: the model, the legs and the limits of a pdkv cluster.
//!
//! [`ClusterConfig::from_toml`] parses and checks a file in one go: unknown keys, missing keys,
//! zero sizes, windows without block sizes and duplicate node names are refused with an error that
//! names the key. Defaults live here and nowhere else. `docs/cluster-toml.md` documents every key.

use std::collections::HashSet;

use pdkv_core::exchange::PairingMode;
use pdkv_core::heads::{HeadOrder, KvShards};
use pdkv_core::identity::ModelFields;
use pdkv_core::layout::{GroupEntry, GroupEntryError};
use pdkv_core::layout::{GroupKind, KvLayout};
use pdkv_core::plan::{HeadLayout, check_sharding};

use crate::deployment::{
    HttpConfig, Launch, LaunchKind, LoggingConfig, NodeAddress, NodePlacement, RouterConfig, TlsConfig,
    check_address_families, check_host, check_ports, node_deployment,
};
use crate::engines::{EngineKind, EnginesSection, Parallel, VllmCluster, VllmEngine, VllmNode, VllmNodeKeys};
pub use pdkv_core::leg::PrefillTokens;
use pdkv_core::wire::NodeId;
use pdkv_transport::mori::MoriSettings;
use serde::{Deserialize, Serialize};

use crate::engine::{ModelParams, rank_block_bytes};

/// The shipped default cluster, embedded so `pdkv demo` runs with no file.
pub const DEFAULT_CLUSTER_TOML: &str = include_str!("../../cluster.toml");

pub use pdkv_core::wire::Role;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterFile {
    #[serde(default)]
    model: Option<ModelSection>,
    #[serde(default)]
    engines: EnginesSection,
    #[serde(default)]
    exchange: Option<ExchangeConfig>,
    #[serde(default)]
    transport: Option<TransportConfig>,
    #[serde(default)]
    limits: Limits,
    #[serde(default)]
    failure: FailureConfig,
    #[serde(default)]
    router: RouterConfig,
    #[serde(default)]
    http: HttpConfig,
    #[serde(default)]
    tls: Option<TlsConfig>,
    #[serde(default)]
    logging: LoggingConfig,
    nodes: Vec<NodeSection>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelSection {
    seed: u64,
    d_model: u32,
    vocab: u32,
    #[serde(default)]
    heads: Option<u32>,
    #[serde(default)]
    kv_heads: Option<u32>,
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
    /// exactly as legs in separate processes on one host do. Legs on different hosts (separate
    /// processes only) read over the network engine.
    #[default]
    Shm,
    /// The network engine even between legs on one host (separate processes only; a cluster
    /// in one process reads through shared memory).
    Net,
    /// RDMA READ through AMD's mori (`[transport.mori]`), host or GPU memory
    /// (`kv_memory`). Needs a pdkv built with the `mori` feature, ROCm 7 and an RDMA NIC; a
    /// node that lacks one says which at start.
    Mori,
}

/// Where a leg's KV blocks live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvMemory {
    /// Host memory (shared memory, so same-host peers can map it).
    #[default]
    Host,
    /// The node's AMD GPU (`[[nodes]] gpu`), allocated with hipMalloc; the reference engine
    /// reaches it through staging copies. Needs `read_engine = "mori"` and a pdkv built with
    /// the `hip` feature.
    Gpu,
}

/// How the router and the legs carry protocol messages to each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkKind {
    /// Actor mailboxes inside one process.
    #[default]
    Local,
    /// QUIC with mutual TLS (the control plane), on loopback for a cluster in one process.
    Quic,
}

impl std::fmt::Display for LinkKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LinkKind::Local => "local",
            LinkKind::Quic => "quic",
        })
    }
}

/// Which threads the actors of a cluster in one process run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LegThreads {
    /// Each leg on its own arbiter thread, as legs in separate processes would run.
    #[default]
    PerLeg,
    /// Every leg and the router on the thread that starts the cluster: no thread wake-up on a
    /// request's path (long computations still go to each leg's compute workers).
    Shared,
}

/// Which threads run a node's QUIC endpoints (its control server and client: the protocol
/// messages and heartbeats, never KV bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ControlThread {
    /// The node's own thread, the one its actors run on: a message arriving is read and handed
    /// to the actors without waking another thread.
    #[default]
    Node,
    /// The node's transport runtime, beside the network READ engine: encryption and packet I/O
    /// never share a thread with the actors, at the cost of a thread hand-off per message.
    Transport,
}

/// `[transport]`: how legs move KV bytes and protocol messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransportConfig {
    /// READ engine for legs in one process: `shm` (default) or `local`.
    pub read_engine: ReadEngineKind,
    /// Links between router and legs: `local` (default) or `quic`.
    pub links: LinkKind,
    /// Threads of a cluster in one process: `per_leg` (default) or `shared`.
    pub leg_threads: LegThreads,
    /// Threads that run QUIC: `node` (default) or `transport`.
    pub control_thread: ControlThread,
    /// Where KV blocks live: `host` (default) or `gpu`.
    pub kv_memory: KvMemory,
    /// `[transport.mori]`: the mori engine's settings.
    pub mori: MoriSettings,
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
    /// Threads per leg that run the reference engine, off the arbiter that serves control
    /// messages. Default 2.
    pub compute_workers: usize,
    /// A computation expected (from the engine's measured cost per token) to take at most this
    /// many microseconds runs on the leg's arbiter instead, saving a thread hand-off; 0 sends
    /// every computation to the workers. Default 100.
    pub inline_compute_us: u64,
    /// Protocol messages one link may have in flight; more are refused. Default 1024.
    pub link_in_flight: usize,
    /// Largest KV memory one leg may register (all layers' regions), in bytes; a node whose
    /// `blocks_per_group` would need more is refused at load. Default 8 GiB.
    pub max_leg_bytes: u64,
}

/// `[failure]`: how a lost peer is detected and what the router retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FailureConfig {
    /// Heartbeat period of every link between processes (QUIC keep-alives). Default 1000.
    pub heartbeat_ms: u64,
    /// Heartbeats missed before a peer is down and its link closed. Default 3.
    pub heartbeat_misses: u32,
    /// Times the router starts a request over on another prefill leg when its prefill leg is
    /// lost, unreachable or refuses it (draining) before the KV parameters came. Default 1.
    pub max_retries: u32,
}

impl Default for FailureConfig {
    fn default() -> Self {
        FailureConfig {
            heartbeat_ms: 1000,
            heartbeat_misses: 3,
            max_retries: 1,
        }
    }
}

/// Bounds of `[failure]`.
const HEARTBEAT_MS: std::ops::RangeInclusive<u64> = 10..=60_000;
const HEARTBEAT_MISSES: std::ops::RangeInclusive<u32> = 1..=100;
const MAX_RETRIES: u32 = 8;

impl FailureConfig {
    /// How long a silent peer stays up: `heartbeat_ms` × `heartbeat_misses`.
    pub fn peer_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.heartbeat_ms.saturating_mul(u64::from(self.heartbeat_misses)))
    }

    fn check(&self) -> Result<(), ConfigError> {
        if !HEARTBEAT_MS.contains(&self.heartbeat_ms) {
            return Err(ConfigError::invalid(
                "failure.heartbeat_ms",
                format!(
                    "{} is outside {}..={}",
                    self.heartbeat_ms,
                    HEARTBEAT_MS.start(),
                    HEARTBEAT_MS.end()
                ),
            ));
        }
        if !HEARTBEAT_MISSES.contains(&self.heartbeat_misses) {
            return Err(ConfigError::invalid(
                "failure.heartbeat_misses",
                format!(
                    "{} is outside {}..={}",
                    self.heartbeat_misses,
                    HEARTBEAT_MISSES.start(),
                    HEARTBEAT_MISSES.end()
                ),
            ));
        }
        if self.max_retries > MAX_RETRIES {
            return Err(ConfigError::invalid(
                "failure.max_retries",
                format!("{} is more than {MAX_RETRIES}", self.max_retries),
            ));
        }
        Ok(())
    }
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
            compute_workers: 2,
            inline_compute_us: 100,
            link_in_flight: 1024,
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
    engine: Option<EngineKind>,
    #[serde(default)]
    lookahead_tokens: Option<u64>,
    #[serde(default)]
    blocks_per_group: Option<u32>,
    #[serde(default)]
    prefix_caching: Option<bool>,
    #[serde(default)]
    prefill_tokens: Option<PrefillTokens>,
    #[serde(default)]
    tp: Option<u32>,
    #[serde(default)]
    dcp: Option<u32>,
    #[serde(default)]
    host: Option<String>,
    #[serde(default)]
    bind: Option<String>,
    #[serde(default)]
    control_port: Option<u16>,
    #[serde(default)]
    data_port: Option<u16>,
    #[serde(default)]
    admin_port: Option<u16>,
    #[serde(default)]
    launch: Option<LaunchKind>,
    #[serde(default)]
    ssh: Option<String>,
    #[serde(default)]
    gpu: Option<u32>,
    #[serde(default)]
    gpus: Option<Vec<u32>>,
    #[serde(default)]
    cpus: Option<String>,
    #[serde(default)]
    engine_args: Option<Vec<String>>,
    #[serde(default)]
    advertise_control_port: Option<u16>,
    #[serde(default)]
    advertise_data_port: Option<u16>,
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
    /// Where the node listens and is dialled.
    pub address: NodeAddress,
    /// How `pdkv launch` starts it.
    pub launch: Launch,
    /// The AMD GPU (HIP device index) its KV lives on with `kv_memory = "gpu"`. Default 0.
    pub gpu: u32,
    /// How its `tp` ranks split the model's KV: heads over `tp / dcp` head groups, each block's
    /// tokens over a group's `dcp` ranks. The leg keeps each layer's KV once per rank, each rank
    /// the heads and tokens vLLM would give it.
    pub shards: KvShards,
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
    /// How lost peers are detected and what is retried.
    pub failure: FailureConfig,
    /// The router's front door.
    pub router: RouterConfig,
    /// Bounds of every HTTP server.
    pub http: HttpConfig,
    /// Certificates made by `pdkv certs init` (`None`: a launcher makes throwaway ones).
    pub tls: Option<TlsConfig>,
    /// Log level and format.
    pub logging: LoggingConfig,
    /// Nodes in file order.
    pub nodes: Vec<NodeConfig>,
}

impl ClusterConfig {
    /// The embedded default cluster.
    pub fn embedded_default() -> Self {
        // The shipped file is checked by a test, so this cannot fail in a released build.
        Self::from_toml(DEFAULT_CLUSTER_TOML).expect("the shipped cluster.toml is valid")
    }

    /// What defines the KV this cluster's legs compute, by name ([`ModelFields`]): the
    /// reference engine's model (seed, sizes) and the KV layout. Nodes started from different
    /// files that disagree on any of it refuse each other at the handshake, naming the fields.
    pub fn model_fields(&self) -> ModelFields {
        let model = [
            ("engine".to_string(), "pdkv-reference".to_string()),
            ("seed".to_string(), self.model.seed.to_string()),
            ("d_model".to_string(), self.model.d_model.to_string()),
            ("vocab".to_string(), self.model.vocab.to_string()),
            ("heads".to_string(), self.model.heads.to_string()),
            ("kv_heads".to_string(), self.model.kv_heads.to_string()),
        ];
        ModelFields::new(model.into_iter().chain(self.layout.identity_fields()))
            .expect("a handful of short fixed names")
    }

    /// How every leg's blocks hold the model's KV heads (heads outside tokens, as the reference
    /// engine writes them).
    pub fn head_layout(&self) -> HeadLayout {
        reference_head_layout(self.model.kv_heads)
    }

    /// Parses and checks a `cluster.toml` of reference-engine legs; a cluster of vLLM legs is
    /// refused by name (see [`AnyCluster`] for both).
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        match AnyCluster::from_toml(text)? {
            AnyCluster::Reference(config) => Ok(config),
            AnyCluster::Vllm(_) => Err(ConfigError::invalid(
                "nodes",
                "the legs are vLLM engines (engine = \"vllm\"); this command needs reference-engine legs (pdkv launch and pdkv router serve vLLM legs)",
            )),
        }
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

    /// The longest prompt every node can hold with its lookahead tail, and the node that sets it.
    /// A longer prompt could never be served, so it is refused before any work. A prefill node
    /// with `prefill_tokens = "all_but_last"` holds one prompt token fewer.
    pub fn prompt_limit(&self) -> PromptLimit {
        self.nodes
            .iter()
            .map(|node| {
                let capacity = token_capacity(&self.layout, node.blocks_per_group);
                let skips_last =
                    node.role == Role::Prefill && node.prefill_tokens == PrefillTokens::AllButLast;
                PromptLimit {
                    // Checked at load: lookahead < capacity.
                    max_tokens: capacity.tokens - node.lookahead_tokens + u64::from(skips_last),
                    node: node.name.clone(),
                    capacity,
                    lookahead_tokens: node.lookahead_tokens,
                }
            })
            .min_by_key(|limit| limit.max_tokens)
            // Checked at load: at least one prefill and one decode node.
            .expect("a cluster has nodes")
    }

    /// The most token slots (prompt plus generated tokens) a request may hold on every decode
    /// leg with its lookahead tail, and the leg that sets it: a request asking for more could
    /// never finish, so the router refuses it before any work.
    pub fn context_limit(&self) -> PromptLimit {
        self.nodes_with_role(Role::Decode)
            .map(|node| {
                let capacity = token_capacity(&self.layout, node.blocks_per_group);
                PromptLimit {
                    // Checked at load: lookahead < capacity.
                    max_tokens: capacity.tokens - node.lookahead_tokens,
                    node: node.name.clone(),
                    capacity,
                    lookahead_tokens: node.lookahead_tokens,
                }
            })
            .min_by_key(|limit| limit.max_tokens)
            // Checked at load: at least one decode node.
            .expect("a cluster has a decode node")
    }

    /// Refuses a prompt length no node could hold, saying which node limits it and why.
    pub fn check_prompt_tokens(&self, num_prompt_tokens: u64) -> Result<(), PromptTooLong> {
        let limit = self.prompt_limit();
        if num_prompt_tokens > limit.max_tokens {
            return Err(PromptTooLong {
                num_prompt_tokens,
                limit,
            });
        }
        Ok(())
    }
}

/// A checked `cluster.toml`: legs of pdkv's reference engine, or vLLM engines.
#[derive(Debug, Clone)]
pub enum AnyCluster {
    /// Every leg runs pdkv's reference engine (`pdkv node`).
    Reference(ClusterConfig),
    /// Every leg is a vLLM server with `PdkvConnector` (`engine = "vllm"`).
    Vllm(VllmCluster),
}

/// A node of either kind, as the multi-process commands see it: who runs where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed<'a> {
    /// Node name.
    pub name: &'a NodeId,
    /// Its role.
    pub role: Role,
    /// Its engine.
    pub engine: EngineKind,
    /// Where it listens.
    pub address: &'a NodeAddress,
    /// How it is started.
    pub launch: &'a Launch,
}

/// The checks every cluster.toml passes, whatever its legs run: bounds, failure detection, node
/// names, roles and placements, the router's host, ports, certificates. Returns each node's
/// name, role, address and launch, in file order.
fn check_common(file: &ClusterFile) -> Result<Vec<(NodeId, Role, NodeAddress, Launch)>, ConfigError> {
    let limits = file.limits;
    file.failure.check()?;
    file.http.check()?;
    if let Err(error) = tracing_subscriber::EnvFilter::try_new(&file.logging.level) {
        return Err(ConfigError::invalid(
            "logging.level",
            format!(
                "{:?} is not a log filter (e.g. \"warn\" or \"pdkv_actors=debug\"): {error}",
                file.logging.level
            ),
        ));
    }
    for (key, value) in [
        ("request_timeout_ms", limits.request_timeout_ms),
        ("lease_ms", limits.lease_ms),
        ("alloc_wait_ms", limits.alloc_wait_ms),
        ("wait_queue", limits.wait_queue as u64),
        ("max_grants", limits.max_grants as u64),
        ("mailbox", limits.mailbox as u64),
        ("compute_workers", limits.compute_workers as u64),
        ("link_in_flight", limits.link_in_flight as u64),
        ("max_leg_bytes", limits.max_leg_bytes),
    ] {
        if value == 0 {
            return Err(ConfigError::invalid(
                format!("limits.{key}"),
                "must be at least 1",
            ));
        }
    }
    for (key, value_ms) in [
        ("request_timeout_ms", limits.request_timeout_ms),
        ("lease_ms", limits.lease_ms),
        ("alloc_wait_ms", limits.alloc_wait_ms),
    ] {
        if value_ms > MAX_TIME_LIMIT_MS {
            return Err(ConfigError::invalid(
                format!("limits.{key}"),
                format!("{value_ms} ms is more than a day ({MAX_TIME_LIMIT_MS} ms)"),
            ));
        }
    }
    if limits.inline_compute_us > MAX_INLINE_COMPUTE_US {
        return Err(ConfigError::invalid(
            "limits.inline_compute_us",
            format!(
                "{} would let one computation hold a leg's arbiter for more than {MAX_INLINE_COMPUTE_US} us",
                limits.inline_compute_us
            ),
        ));
    }
    if limits.compute_workers > MAX_COMPUTE_WORKERS {
        return Err(ConfigError::invalid(
            "limits.compute_workers",
            format!(
                "{} is more than the {MAX_COMPUTE_WORKERS} threads a leg may run",
                limits.compute_workers
            ),
        ));
    }
    if file.nodes.len() > MAX_NODES {
        return Err(ConfigError::invalid(
            "nodes",
            format!(
                "{} nodes, at most {MAX_NODES} are supported (each runs its own threads)",
                file.nodes.len()
            ),
        ));
    }
    let mut names = HashSet::new();
    let mut placed = Vec::with_capacity(file.nodes.len());
    for (index, node) in file.nodes.iter().enumerate() {
        if !is_dns_name(&node.name) {
            return Err(ConfigError::invalid(
                format!("nodes[{index}].name"),
                format!(
                    "{:?} is not a valid node name (letters, digits, '-' and '.', \
                 as in a DNS name: it goes into the node's certificate)",
                    node.name
                ),
            ));
        }
        if RESERVED_NODE_NAMES.contains(&node.name.as_str()) {
            return Err(ConfigError::invalid(
                format!("nodes[{index}].name"),
                format!(
                    "{:?} is reserved (pdkv certs init writes the cluster CA as ca.pem and ca.key)",
                    node.name
                ),
            ));
        }
        if !names.insert(node.name.clone()) {
            return Err(ConfigError::invalid(
                format!("nodes[{index}].name"),
                format!("duplicate node name {:?}", node.name),
            ));
        }
        if node.role == Role::Router {
            return Err(ConfigError::invalid(
                format!("nodes[{index}].role"),
                "\"router\" is not a leg role: use \"prefill\" or \"decode\" (the router is not a [[nodes]] entry)",
            ));
        }
        let placement = NodePlacement {
            host: node.host.clone(),
            bind: node.bind.clone(),
            control_port: node.control_port,
            data_port: node.data_port,
            admin_port: node.admin_port,
            launch: node.launch,
            ssh: node.ssh.clone(),
        };
        let (address, launch) = node_deployment(&format!("nodes[{index}]"), placement)?;
        placed.push((NodeId(node.name.clone()), node.role, address, launch));
    }
    for role in [Role::Prefill, Role::Decode] {
        if !placed.iter().any(|(_, node_role, _, _)| *node_role == role) {
            return Err(ConfigError::invalid(
                "nodes",
                format!("at least one {role} node is required"),
            ));
        }
    }
    if !(1..=MAX_TIME_LIMIT_MS).contains(&file.router.prefill_timeout_ms) {
        return Err(ConfigError::invalid(
            "router.prefill_timeout_ms",
            format!(
                "{} is outside 1..={MAX_TIME_LIMIT_MS}",
                file.router.prefill_timeout_ms
            ),
        ));
    }
    if file.router.http_threads > MAX_HTTP_THREADS {
        return Err(ConfigError::invalid(
            "router.http_threads",
            format!(
                "{} is more than {MAX_HTTP_THREADS} (0 serves the API on the router's own thread)",
                file.router.http_threads
            ),
        ));
    }
    check_host("router.host", &file.router.host)?;
    if let Some(bind) = &file.router.bind {
        check_host("router.bind", bind)?;
    }
    let router_listeners = [
        (
            "router.http_port".to_string(),
            file.router.host.as_str(),
            file.router.http_port,
        ),
        (
            "router.control_port".to_string(),
            file.router.host.as_str(),
            file.router.control_port,
        ),
    ];
    let node_listeners = placed.iter().enumerate().flat_map(|(index, (_, _, address, _))| {
        let host = address.host.as_str();
        [
            (format!("nodes[{index}].control_port"), host, address.control_port),
            (format!("nodes[{index}].data_port"), host, address.data_port),
            (format!("nodes[{index}].admin_port"), host, address.admin_port),
        ]
    });
    check_ports(router_listeners.into_iter().chain(node_listeners))?;
    let router_hosts = [("router.host".to_string(), file.router.host.as_str())]
        .into_iter()
        .chain(
            file.router
                .bind
                .as_deref()
                .map(|bind| ("router.bind".to_string(), bind)),
        );
    let node_hosts = placed.iter().enumerate().flat_map(|(index, (_, _, address, _))| {
        [
            (format!("nodes[{index}].host"), Some(address.host.as_str())),
            (format!("nodes[{index}].bind"), address.bind.as_deref()),
        ]
        .into_iter()
        .filter_map(|(key, host)| host.map(|host| (key, host)))
    });
    check_address_families(node_hosts.chain(router_hosts))?;
    if let Some(tls) = &file.tls
        && tls.dir.as_os_str().is_empty()
    {
        return Err(ConfigError::invalid(
            "tls.dir",
            "must name the directory pdkv certs init wrote",
        ));
    }
    Ok(placed)
}

/// Refuses `key` of node `index` when it is set: it belongs to the other kind of leg.
fn refuse_key<T>(index: usize, key: &str, value: &Option<T>, why: &str) -> Result<(), ConfigError> {
    match value {
        Some(_) => Err(ConfigError::invalid(
            format!("nodes[{index}].{key}"),
            why.to_string(),
        )),
        None => Ok(()),
    }
}

impl AnyCluster {
    /// Parses and checks a `cluster.toml`: unknown keys, missing keys, values out of range,
    /// keys of the other kind of leg, and a mix of reference and vLLM legs are refused, naming
    /// the key.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let file: ClusterFile =
            toml::from_str(text).map_err(|error| ConfigError::Parse(error.to_string()))?;
        let engine_of = |node: &NodeSection| node.engine.unwrap_or_default();
        let first_vllm = file
            .nodes
            .iter()
            .position(|node| engine_of(node) == EngineKind::Vllm);
        let first_reference = file
            .nodes
            .iter()
            .position(|node| engine_of(node) == EngineKind::Reference);
        match (first_vllm, first_reference) {
            (None, _) => reference_cluster(file).map(AnyCluster::Reference),
            (Some(_), None) => vllm_cluster(file).map(AnyCluster::Vllm),
            (Some(vllm), Some(reference)) => Err(ConfigError::invalid(
                format!("nodes[{}].engine", vllm.max(reference)),
                format!(
                    "{} is a vLLM leg and {} a reference-engine leg: one cannot read the other's KV, so a cluster's legs are all one engine",
                    file.nodes[vllm].name, file.nodes[reference].name
                ),
            )),
        }
    }

    /// Reads and checks a `cluster.toml` file.
    pub fn from_file(path: &std::path::Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|error| ConfigError::Read(format!("{}: {error}", path.display())))?;
        Self::from_toml(&text)
    }

    /// Every node: name, role, engine, address and launch, in file order.
    pub fn placed(&self) -> Vec<Placed<'_>> {
        match self {
            AnyCluster::Reference(config) => config
                .nodes
                .iter()
                .map(|node| Placed {
                    name: &node.name,
                    role: node.role,
                    engine: EngineKind::Reference,
                    address: &node.address,
                    launch: &node.launch,
                })
                .collect(),
            AnyCluster::Vllm(cluster) => cluster
                .nodes
                .iter()
                .map(|node| Placed {
                    name: &node.name,
                    role: node.role,
                    engine: EngineKind::Vllm,
                    address: &node.address,
                    launch: &node.launch,
                })
                .collect(),
        }
    }

    /// `[router]`.
    pub fn router(&self) -> &RouterConfig {
        match self {
            AnyCluster::Reference(config) => &config.router,
            AnyCluster::Vllm(cluster) => &cluster.router,
        }
    }

    /// `[tls]`.
    pub fn tls(&self) -> Option<&TlsConfig> {
        match self {
            AnyCluster::Reference(config) => config.tls.as_ref(),
            AnyCluster::Vllm(cluster) => cluster.tls.as_ref(),
        }
    }

    /// `[logging]`.
    pub fn logging(&self) -> &LoggingConfig {
        match self {
            AnyCluster::Reference(config) => &config.logging,
            AnyCluster::Vllm(cluster) => &cluster.logging,
        }
    }

    /// `[http]`.
    pub fn http(&self) -> &HttpConfig {
        match self {
            AnyCluster::Reference(config) => &config.http,
            AnyCluster::Vllm(cluster) => &cluster.http,
        }
    }

    /// `[limits]`.
    pub fn limits(&self) -> &Limits {
        match self {
            AnyCluster::Reference(config) => &config.limits,
            AnyCluster::Vllm(cluster) => &cluster.limits,
        }
    }
}

/// The checks of a cluster of reference-engine legs, after [`check_common`].
fn reference_cluster(file: ClusterFile) -> Result<ClusterConfig, ConfigError> {
    if file.engines.vllm.is_some() {
        return Err(ConfigError::invalid(
            "engines.vllm",
            "no node has engine = \"vllm\"",
        ));
    }
    let Some(model) = &file.model else {
        return Err(ConfigError::Parse(
            "missing field `model` (the reference engine's [model]; vLLM legs take engine = \"vllm\")".into(),
        ));
    };
    let groups = model
        .groups
        .iter()
        .enumerate()
        .map(|(index, entry)| {
            entry
                .to_spec(index)
                .map_err(|error: GroupEntryError| ConfigError::Group(error))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(index) = groups
        .iter()
        .position(|group| group.kind() == GroupKind::MambaAlign)
    {
        return Err(ConfigError::invalid(
            format!("model.groups[{index}].kind"),
            "mamba_align is vLLM's mamba prefix caching (mamba_cache_mode = \"align\"); the reference engine keeps one state per request: use kind = \"mamba\"",
        ));
    }
    if model.layer_groups.is_empty() {
        return Err(ConfigError::invalid(
            "model.layer_groups",
            "at least one layer is required",
        ));
    }
    let layout = KvLayout::new(groups, model.layer_groups.clone())
        .map_err(|error| ConfigError::invalid("model.layer_groups", error.to_string()))?;
    if model.d_model == 0 || model.d_model > 4096 {
        return Err(ConfigError::invalid(
            "model.d_model",
            format!("must be 1..=4096, got {}", model.d_model),
        ));
    }
    if model.vocab < 2 {
        return Err(ConfigError::invalid(
            "model.vocab",
            format!("must be at least 2, got {}", model.vocab),
        ));
    }
    let heads = model.heads.unwrap_or(1);
    if heads == 0 || !model.d_model.is_multiple_of(heads) {
        return Err(ConfigError::invalid(
            "model.heads",
            format!(
                "must divide d_model ({}) into whole heads, got {heads}",
                model.d_model
            ),
        ));
    }
    let kv_heads = model.kv_heads.unwrap_or(heads);
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(ConfigError::invalid(
            "model.kv_heads",
            format!(
                "must divide heads ({heads}): each KV head serves a group of query heads, got {kv_heads}"
            ),
        ));
    }
    let params = ModelParams {
        seed: model.seed,
        d_model: model.d_model as usize,
        vocab: model.vocab,
        heads,
        kv_heads,
    };
    let weights = reference_weight_count(&layout, u64::from(model.d_model), u64::from(model.vocab));
    if weights.is_none_or(|count| count > MAX_REFERENCE_WEIGHTS) {
        return Err(ConfigError::invalid(
            "model",
            format!(
                "d_model {} with vocab {} and {} layers needs more than the reference engine's {} weights",
                model.d_model,
                model.vocab,
                layout.num_layers(),
                MAX_REFERENCE_WEIGHTS
            ),
        ));
    }
    let placed = check_common(&file)?;
    let limits = file.limits;
    let vllm_only = "a vLLM leg's key (engine = \"vllm\"); reference-engine legs do not take it";
    let mut nodes = Vec::with_capacity(file.nodes.len());
    for (index, (node, (name, role, address, launch))) in file.nodes.into_iter().zip(placed).enumerate() {
        refuse_key(index, "gpus", &node.gpus, vllm_only)?;
        refuse_key(index, "cpus", &node.cpus, vllm_only)?;
        refuse_key(index, "engine_args", &node.engine_args, vllm_only)?;
        refuse_key(
            index,
            "advertise_control_port",
            &node.advertise_control_port,
            vllm_only,
        )?;
        refuse_key(index, "advertise_data_port", &node.advertise_data_port, vllm_only)?;
        let Some(blocks_per_group) = node.blocks_per_group else {
            return Err(ConfigError::invalid(
                format!("nodes[{index}].blocks_per_group"),
                "required: the blocks in each group's pool",
            ));
        };
        let lookahead_tokens = node.lookahead_tokens.unwrap_or(0);
        let shards = node_shards(index, &node, &layout, heads, kv_heads)?;
        let leg_bytes = leg_memory_bytes(&layout, &params, shards, blocks_per_group);
        if leg_bytes.is_none_or(|bytes| bytes > limits.max_leg_bytes) {
            return Err(ConfigError::invalid(
                format!("nodes[{index}].blocks_per_group"),
                format!(
                    "{} blocks per group need {} of KV memory and block bookkeeping, above limits.max_leg_bytes ({} bytes)",
                    blocks_per_group,
                    leg_bytes.map_or("more than 2^64 bytes".to_string(), |bytes| format!(
                        "{bytes} bytes"
                    )),
                    limits.max_leg_bytes
                ),
            ));
        }
        if blocks_per_group == 0 {
            return Err(ConfigError::invalid(
                format!("nodes[{index}].blocks_per_group"),
                "must be at least 1",
            ));
        }
        let capacity = token_capacity(&layout, blocks_per_group);
        if lookahead_tokens >= capacity.tokens {
            return Err(ConfigError::invalid(
                format!("nodes[{index}].lookahead_tokens"),
                format!(
                    "{} tokens leave no room for a prompt: the node holds {}",
                    lookahead_tokens, capacity
                ),
            ));
        }
        if role == Role::Decode && node.prefill_tokens.is_some() {
            return Err(ConfigError::invalid(
                format!("nodes[{index}].prefill_tokens"),
                format!(
                    "only prefill nodes take this key, {:?} is a decode node",
                    node.name
                ),
            ));
        }
        nodes.push(NodeConfig {
            name,
            role,
            lookahead_tokens,
            blocks_per_group,
            prefix_caching: node.prefix_caching.unwrap_or(false),
            prefill_tokens: node.prefill_tokens.unwrap_or_default(),
            address,
            launch,
            gpu: node.gpu.unwrap_or(0),
            shards,
        });
    }
    check_pairs_shard(&layout, kv_heads, &nodes)?;
    let transport = file.transport.unwrap_or_default();
    transport.mori.validate().map_err(|error| {
        ConfigError::invalid(
            format!("transport.mori.{}", error.field),
            format!("{} is out of range {}", error.value, error.range),
        )
    })?;
    if transport.kv_memory == KvMemory::Gpu && transport.read_engine != ReadEngineKind::Mori {
        return Err(ConfigError::invalid(
            "transport.kv_memory",
            "\"gpu\" needs read_engine = \"mori\": no other READ engine reaches GPU memory",
        ));
    }
    Ok(ClusterConfig {
        layout,
        model: params,
        exchange: file.exchange.unwrap_or_default(),
        transport,
        limits,
        failure: file.failure,
        router: file.router,
        http: file.http,
        tls: file.tls,
        logging: file.logging,
        nodes,
    })
}

/// The checks of a cluster of vLLM legs, after [`check_common`].
fn vllm_cluster(file: ClusterFile) -> Result<VllmCluster, ConfigError> {
    let Some(section) = file.engines.vllm.clone() else {
        return Err(ConfigError::invalid(
            "engines.vllm",
            "required when nodes have engine = \"vllm\": the Python and the model to run",
        ));
    };
    if file.model.is_some() {
        return Err(ConfigError::invalid(
            "model",
            "is the reference engine's; vLLM legs serve [engines.vllm] model",
        ));
    }
    if file.exchange.is_some() {
        return Err(ConfigError::invalid(
            "exchange",
            "vLLM legs always pair anchored, inside PdkvConnector",
        ));
    }
    let transport = file.transport.unwrap_or_default();
    let defaults = TransportConfig::default();
    if transport.links != defaults.links
        || transport.leg_threads != defaults.leg_threads
        || transport.control_thread != defaults.control_thread
        || transport.kv_memory != defaults.kv_memory
        || transport.mori != defaults.mori
    {
        return Err(ConfigError::invalid(
            "transport",
            "vLLM legs take only read_engine here (links, leg_threads, control_thread, kv_memory and [transport.mori] are the reference engine's)",
        ));
    }
    if transport.read_engine == ReadEngineKind::Local {
        return Err(ConfigError::invalid(
            "transport.read_engine",
            "\"local\" is for legs in one process; vLLM legs are processes of their own",
        ));
    }
    let engine = VllmEngine::from_section(section)?;
    let placed = check_common(&file)?;
    let reference_only = "a reference-engine leg's key; a vLLM leg sizes and schedules its own KV cache";
    let mut nodes = Vec::with_capacity(file.nodes.len());
    for (index, (node, (name, role, address, launch))) in file.nodes.into_iter().zip(placed).enumerate() {
        refuse_key(index, "blocks_per_group", &node.blocks_per_group, reference_only)?;
        refuse_key(index, "lookahead_tokens", &node.lookahead_tokens, reference_only)?;
        refuse_key(index, "prefill_tokens", &node.prefill_tokens, reference_only)?;
        refuse_key(
            index,
            "tp",
            &node.tp,
            "a reference-engine leg's key; a vLLM leg takes its tensor-parallel size from engine_args (-tp)",
        )?;
        refuse_key(
            index,
            "dcp",
            &node.dcp,
            "a reference-engine leg's key; a vLLM leg takes its DCP size from engine_args (-dcp)",
        )?;
        refuse_key(
            index,
            "gpu",
            &node.gpu,
            "the reference engine's KV device; a vLLM leg takes gpus",
        )?;
        let keys = VllmNodeKeys {
            prefix_caching: node.prefix_caching,
            gpus: node.gpus,
            cpus: node.cpus,
            engine_args: node.engine_args,
            advertise_control_port: node.advertise_control_port,
            advertise_data_port: node.advertise_data_port,
        };
        nodes.push(VllmNode::new(
            index,
            name,
            role,
            address,
            launch,
            keys,
            engine.device,
        )?);
    }
    // A connector reads one tensor-parallel, pipeline-parallel and DCP size on the other side
    // (`peer_tp`, `peer_pp`, `peer_dcp`).
    for role in [Role::Prefill, Role::Decode] {
        let legs: Vec<(&str, Parallel)> = nodes
            .iter()
            .filter(|node| node.role == role)
            .map(|node| (node.name.0.as_str(), node.parallel(&engine)))
            .collect();
        one_size(
            role,
            "tensor",
            legs.iter().map(|(name, parallel)| (*name, parallel.tp)),
        )?;
        one_size(
            role,
            "pipeline",
            legs.iter().map(|(name, parallel)| (*name, parallel.pp)),
        )?;
        one_size(
            role,
            "decode-context",
            legs.iter().map(|(name, parallel)| (*name, parallel.dcp)),
        )?;
    }
    Ok(VllmCluster {
        engine,
        nodes,
        read_engine: transport.read_engine,
        limits: file.limits,
        failure: file.failure,
        router: file.router,
        http: file.http,
        tls: file.tls,
        logging: file.logging,
    })
}

/// The longest prompt the reference engine takes whatever the memory: it computes token by token
/// with O(N^2) attention, so longer prompts would run for hours.
pub const MAX_PROMPT_TOKENS: u64 = 1 << 20;

/// How many tokens one node can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenCapacity {
    /// Token slots (prompt plus lookahead) a request can have on the node.
    pub tokens: u64,
    /// The group that bounds it (`None`: the reference engine's [`MAX_PROMPT_TOKENS`]).
    pub group: Option<usize>,
    /// Blocks per group.
    pub blocks: u32,
    /// Tokens per block of that group.
    pub block_tokens: u64,
}

impl std::fmt::Display for TokenCapacity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.group {
            Some(group) => write!(
                f,
                "{} token slots ({} blocks of {} tokens in group {group})",
                self.tokens, self.blocks, self.block_tokens
            ),
            None => write!(f, "{} token slots (the reference engine's limit)", self.tokens),
        }
    }
}

/// Token slots a node with `blocks` blocks per group holds: the smallest attention group's
/// `blocks * B_eff`, at most [`MAX_PROMPT_TOKENS`] (mamba groups hold a state, not tokens).
pub fn token_capacity(layout: &KvLayout, blocks: u32) -> TokenCapacity {
    let engine_limit = TokenCapacity {
        tokens: MAX_PROMPT_TOKENS,
        group: None,
        blocks,
        block_tokens: 0,
    };
    layout
        .groups()
        .iter()
        .enumerate()
        .filter(|(_, spec)| spec.kind() != GroupKind::Mamba)
        .map(|(group, spec)| TokenCapacity {
            tokens: u64::from(blocks) * spec.effective_block_size(),
            group: Some(group),
            blocks,
            block_tokens: spec.effective_block_size(),
        })
        .chain(std::iter::once(engine_limit))
        .min_by_key(|capacity| capacity.tokens)
        .unwrap_or(engine_limit)
}

/// The longest prompt a cluster serves and where that limit comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptLimit {
    /// Longest prompt, in tokens.
    pub max_tokens: u64,
    /// The node that sets the limit.
    pub node: NodeId,
    /// That node's token capacity.
    pub capacity: TokenCapacity,
    /// That node's lookahead tail.
    pub lookahead_tokens: u64,
}

/// A prompt longer than any node of the cluster can hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "prompt of {num_prompt_tokens} tokens is longer than the cluster's limit of {} tokens: node {} holds {} and reserves {} for lookahead",
    limit.max_tokens, limit.node, limit.capacity, limit.lookahead_tokens
)]
pub struct PromptTooLong {
    /// Prompt length asked for.
    pub num_prompt_tokens: u64,
    /// The limit it exceeds.
    pub limit: PromptLimit,
}

/// Names a node may not take: `pdkv certs init` writes files under these names.
pub const RESERVED_NODE_NAMES: &[&str] = &["ca", ROUTER_NODE];

/// Most reference-engine threads one leg may run.
pub const MAX_COMPUTE_WORKERS: usize = 256;

/// Longest computation a leg may run on its arbiter, in microseconds: lease renewals and
/// releases wait behind it.
pub const MAX_INLINE_COMPUTE_US: u64 = 10_000;

/// Most threads the router's HTTP API may be given.
pub const MAX_HTTP_THREADS: usize = 256;

/// Longest request timeout, lease or wait for blocks a cluster.toml may set: a day. Longer ones
/// are mistakes (a unit slip, a "never"), and deadlines this far out stay clear of overflow.
pub const MAX_TIME_LIMIT_MS: u64 = 86_400_000;

/// The router's node name on links, in certificates and in logs.
pub const ROUTER_NODE: &str = "router";

/// Most nodes one cluster.toml may describe.
const MAX_NODES: usize = 256;

/// The reference engine's largest model: 256 Mi f32 weights (1 GiB).
const MAX_REFERENCE_WEIGHTS: u64 = 256 << 20;

/// The largest tensor-parallel size a reference leg takes.
pub const MAX_TP: u32 = 64;

/// A reference node's `tp` and `dcp`, checked against the model: `tp / dcp` head groups that
/// divide the query heads and shard the KV heads, `dcp` dividing `tp` and every attention
/// block, and no DCP over a recurrent state.
fn node_shards(
    index: usize,
    node: &NodeSection,
    layout: &KvLayout,
    heads: u32,
    kv_heads: u32,
) -> Result<KvShards, ConfigError> {
    let (tp, dcp) = (node.tp.unwrap_or(1), node.dcp.unwrap_or(1));
    let key = |name: &str| format!("nodes[{index}].{name}");
    if tp == 0 || tp > MAX_TP {
        return Err(ConfigError::invalid(
            key("tp"),
            format!("must be 1..={MAX_TP}, got {tp}"),
        ));
    }
    if dcp == 0 || !tp.is_multiple_of(dcp) {
        return Err(ConfigError::invalid(
            key("dcp"),
            format!(
                "must be at least 1 and divide tp ({tp}): DCP ranks are taken out of the TP ranks, got {dcp}"
            ),
        ));
    }
    let head_groups = tp / dcp;
    if !heads.is_multiple_of(head_groups) {
        return Err(ConfigError::invalid(
            key("tp"),
            format!(
                "tp / dcp = {head_groups} head groups must divide model.heads ({heads}): each group computes whole query heads"
            ),
        ));
    }
    for (group, spec) in layout.groups().iter().enumerate() {
        let state = matches!(spec.kind(), GroupKind::Mamba | GroupKind::MambaAlign);
        if dcp > 1 && state {
            return Err(ConfigError::invalid(
                key("dcp"),
                format!(
                    "model.groups[{group}] is a recurrent state, which DCP does not split by tokens: dcp must be 1, got {dcp}"
                ),
            ));
        }
        if !state && !spec.effective_block_size().is_multiple_of(u64::from(dcp)) {
            return Err(ConfigError::invalid(
                key("dcp"),
                format!(
                    "must divide every attention block: model.groups[{group}] has blocks of {} tokens, got {dcp}",
                    spec.effective_block_size()
                ),
            ));
        }
    }
    KvShards::new(kv_heads, tp, dcp).map_err(|error| {
        ConfigError::invalid(
            key("tp"),
            format!("{error} (model.kv_heads over tp / dcp head groups)"),
        )
    })
}

/// Refuses legs of `role` whose `what`-parallel sizes differ, naming the first two.
fn one_size<'a>(
    role: Role,
    what: &str,
    mut sizes: impl Iterator<Item = (&'a str, u32)>,
) -> Result<(), ConfigError> {
    let Some((first, size)) = sizes.next() else {
        return Ok(());
    };
    match sizes.find(|(_, other)| *other != size) {
        Some((other, other_size)) => Err(ConfigError::invalid(
            "nodes",
            format!(
                "{role} legs run different {what}-parallel sizes ({first}: {size}, {other}: {other_size}); a leg of the other role reads one size"
            ),
        )),
        None => Ok(()),
    }
}

/// How the reference engine's blocks hold `kv_heads` KV heads: heads outside tokens.
fn reference_head_layout(kv_heads: u32) -> HeadLayout {
    HeadLayout {
        kv_heads,
        order: HeadOrder::HeadsOuter,
    }
}

/// Refuses a cluster where some prefill leg and some decode leg shard KV so differently that no
/// READ could reshard it (a recurrent state across TP sizes), naming both nodes.
fn check_pairs_shard(layout: &KvLayout, kv_heads: u32, nodes: &[NodeConfig]) -> Result<(), ConfigError> {
    let heads = reference_head_layout(kv_heads);
    for prefill in nodes.iter().filter(|node| node.role == Role::Prefill) {
        for decode in nodes.iter().filter(|node| node.role == Role::Decode) {
            let split = |node: &NodeConfig| (node.shards.tp(), node.shards.dcp());
            let (prefill_split, decode_split) = (split(prefill), split(decode));
            check_sharding(layout, heads, prefill_split, decode_split).map_err(|error| {
                ConfigError::invalid(
                    "nodes",
                    format!(
                        "prefill node {:?} (tp {} dcp {}) and decode node {:?} (tp {} dcp {}): {error}",
                        prefill.name.0,
                        prefill_split.0,
                        prefill_split.1,
                        decode.name.0,
                        decode_split.0,
                        decode_split.1
                    ),
                )
            })?;
        }
    }
    Ok(())
}

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

/// Bookkeeping the allocator keeps per block of each group: reference count, generation, prefix
/// hash, LRU tick, free-set and cache-map entries. Measured at 117 bytes per block with every
/// block cached (the worst case); rounded up.
pub const ALLOCATOR_BYTES_PER_BLOCK: u64 = 128;

/// Memory a leg split as `shards` needs for `blocks` blocks per group: every layer's region
/// of `blocks + 1` blocks on every rank ([`rank_block_bytes`], as the engine lays them out),
/// the generation tables, and the allocator's bookkeeping; `None` on overflow.
pub fn leg_memory_bytes(
    layout: &KvLayout,
    model: &ModelParams,
    shards: KvShards,
    blocks: u32,
) -> Option<u64> {
    let ranks = u64::from(shards.tp());
    let blocks = u64::from(blocks) + 1;
    let per_group_block = 4 + ALLOCATOR_BYTES_PER_BLOCK;
    let mut total = blocks
        .checked_mul(per_group_block)?
        .checked_mul(layout.groups().len() as u64)?;
    for &group in layout.layer_groups() {
        let block_bytes = rank_block_bytes(model, &layout.groups()[group], shards)?.checked_mul(ranks)?;
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
    /// A model group is invalid.
    #[error("cluster.toml: model.{0}")]
    Group(GroupEntryError),
    /// A value is out of range or inconsistent with another.
    #[error("cluster.toml: {key}: {reason}")]
    Invalid {
        /// The key at fault, as a path (`limits.lease_ms`, `nodes[1].name`).
        key: String,
        /// What is wrong with it.
        reason: String,
    },
}

impl ConfigError {
    /// The value at `key` is refused for `reason`.
    pub fn invalid(key: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError::Invalid {
            key: key.into(),
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_aligned_mamba_group_is_refused_for_the_reference_engine() {
        let text = DEFAULT_CLUSTER_TOML.replacen(
            "kind = \"sliding_window\"\nblock_size = 64\nwindow = 128",
            "kind = \"mamba_align\"\nblock_size = 64",
            1,
        );
        assert_ne!(
            text, DEFAULT_CLUSTER_TOML,
            "the shipped file has the window group"
        );
        match ClusterConfig::from_toml(&text) {
            Err(ConfigError::Invalid { key, reason }) => {
                assert_eq!(key, "model.groups[1].kind");
                assert!(reason.contains("use kind = \"mamba\""), "{reason}");
            }
            other => panic!("expected the aligned mamba group refused, got {other:?}"),
        }
    }

    /// The shipped file with KV heads and per-node TP sizes.
    fn sharded(heads: u32, kv_heads: u32, prefill_tp: u32, decode_tp: u32) -> String {
        let text = DEFAULT_CLUSTER_TOML
            .replacen(
                "vocab = 256\n",
                &format!("vocab = 256\nheads = {heads}\nkv_heads = {kv_heads}\n"),
                1,
            )
            .replacen(
                "role = \"prefill\"\n",
                &format!("role = \"prefill\"\ntp = {prefill_tp}\n"),
                1,
            )
            .replacen(
                "role = \"decode\"\n",
                &format!("role = \"decode\"\ntp = {decode_tp}\n"),
                1,
            );
        assert_eq!(
            text.matches("tp = ").count(),
            2,
            "the shipped file has one leg of each role"
        );
        text
    }

    /// `text` with `dcp` on the prefill and decode nodes (after their `tp` lines).
    fn with_dcp(text: &str, prefill_dcp: u32, decode_dcp: u32) -> String {
        let (prefill, decode) = text
            .split_once("role = \"decode\"\ntp = ")
            .expect("a sharded file");
        let (decode_tp, rest) = decode.split_once('\n').unwrap();
        let prefill = prefill.replacen("\ntp = ", &format!("\ndcp = {prefill_dcp}\ntp = "), 1);
        format!("{prefill}role = \"decode\"\ntp = {decode_tp}\ndcp = {decode_dcp}\n{rest}")
    }

    #[test]
    fn legs_shard_the_models_kv_heads_over_their_own_tp_sizes() {
        let config = ClusterConfig::from_toml(&sharded(8, 2, 1, 4)).unwrap();
        assert_eq!((config.model.heads, config.model.kv_heads), (8, 2));
        let sizes = |config: &ClusterConfig| -> Vec<(u32, u32, u32, u32)> {
            config
                .nodes
                .iter()
                .map(|node| {
                    let shards = node.shards;
                    (
                        shards.tp(),
                        shards.dcp(),
                        shards.heads().tp(),
                        shards.heads().heads_per_rank(),
                    )
                })
                .collect()
        };
        assert_eq!(sizes(&config), [(1, 1, 1, 2), (4, 1, 4, 1)]);
        let dcp = ClusterConfig::from_toml(&with_dcp(&sharded(8, 2, 4, 2), 2, 1)).unwrap();
        assert_eq!(sizes(&dcp), [(4, 2, 2, 1), (2, 1, 2, 1)]);
        // Defaults: one head, as many KV heads as heads, TP 1.
        let shipped = ClusterConfig::embedded_default();
        assert_eq!((shipped.model.heads, shipped.model.kv_heads), (1, 1));
        assert!(shipped.nodes.iter().all(|node| node.shards.tp() == 1));
        let gqa = ClusterConfig::from_toml(&DEFAULT_CLUSTER_TOML.replacen(
            "vocab = 256\n",
            "vocab = 256\nheads = 4\n",
            1,
        ))
        .unwrap();
        assert_eq!(gqa.model.kv_heads, 4, "kv_heads defaults to heads");
    }

    #[test]
    fn heads_and_tp_sizes_that_cannot_shard_are_refused_naming_the_key() {
        for (text, key, words) in [
            (sharded(3, 3, 1, 1), "model.heads", "must divide d_model (32)"),
            (sharded(0, 1, 1, 1), "model.heads", "got 0"),
            (sharded(4, 3, 1, 1), "model.kv_heads", "must divide heads (4)"),
            (sharded(4, 0, 1, 1), "model.kv_heads", "got 0"),
            (sharded(4, 4, 8, 1), "nodes[0].tp", "divide model.heads (4)"),
            (sharded(4, 4, 1, 0), "nodes[1].tp", "got 0"),
            (sharded(32, 32, 1, 128), "nodes[1].tp", "must be 1..=64"),
            (
                with_dcp(&sharded(4, 4, 4, 1), 3, 1),
                "nodes[0].dcp",
                "must be at least 1 and divide tp (4)",
            ),
            (with_dcp(&sharded(4, 4, 4, 1), 1, 0), "nodes[1].dcp", "got 0"),
            (
                with_dcp(&sharded(2, 2, 4, 1), 1, 1),
                "nodes[0].tp",
                "tp / dcp = 4 head groups must divide model.heads (2)",
            ),
            (
                with_dcp(&sharded(1, 1, 3, 1), 3, 1),
                "nodes[0].dcp",
                "must divide every attention block: model.groups[0] has blocks of 64 tokens, got 3",
            ),
            (
                with_dcp(&sharded(4, 4, 2, 1), 2, 1).replacen(
                    "kind = \"sliding_window\"\nblock_size = 64\nwindow = 128",
                    "kind = \"mamba\"",
                    1,
                ),
                "nodes[0].dcp",
                "model.groups[1] is a recurrent state, which DCP does not split by tokens",
            ),
            (
                sharded(12, 6, 1, 4).replacen("d_model = 32", "d_model = 48", 1),
                "nodes[1].tp",
                "6 KV heads cannot be sharded over 4 tensor-parallel ranks",
            ),
        ] {
            match ClusterConfig::from_toml(&text) {
                Err(ConfigError::Invalid { key: found, reason }) => {
                    assert_eq!(found, key, "{reason}");
                    assert!(reason.contains(words), "{key}: {reason}");
                }
                other => panic!("expected {key} refused, got {other:?}"),
            }
        }
    }

    #[test]
    fn a_recurrent_state_between_legs_of_different_tp_sizes_is_refused_naming_both() {
        let text = sharded(4, 2, 2, 1).replacen(
            "kind = \"sliding_window\"\nblock_size = 64\nwindow = 128",
            "kind = \"mamba\"",
            1,
        );
        match ClusterConfig::from_toml(&text) {
            Err(ConfigError::Invalid { key, reason }) => {
                assert_eq!(key, "nodes");
                assert!(
                    reason.contains(
                        "prefill node \"prefill-0\" (tp 2 dcp 1) and decode node \"decode-0\" (tp 1 dcp 1)"
                    ) && reason.contains("group 1 is a recurrent state"),
                    "{reason}"
                );
            }
            other => panic!("expected the pair refused, got {other:?}"),
        }
        let equal = sharded(4, 2, 2, 2).replacen(
            "kind = \"sliding_window\"\nblock_size = 64\nwindow = 128",
            "kind = \"mamba\"",
            1,
        );
        assert!(
            ClusterConfig::from_toml(&equal).is_ok(),
            "equal sizes share a state"
        );
    }

    #[test]
    fn sharded_legs_size_their_kv_memory_by_the_heads_each_rank_holds() {
        let layout = ClusterConfig::embedded_default().layout;
        let model = |heads: u32, kv_heads: u32| ModelParams {
            seed: 1,
            d_model: 32,
            vocab: 256,
            heads,
            kv_heads,
        };
        let bookkeeping = 2 * 65 * (4 + ALLOCATOR_BYTES_PER_BLOCK);
        // Four layers of 65 blocks of 64 tokens; K and V of 4-byte values: 32 values per token
        // for all heads, times the replicas a rank adds above kv_heads ranks.
        let kv = |values_per_token: u64| 4 * 65 * 64 * 2 * 4 * values_per_token;
        for (heads, kv_heads, tp, values) in [
            (1, 1, 1, 32),
            (4, 4, 2, 32),
            (4, 2, 1, 16),
            (4, 1, 4, 32),
            (4, 2, 4, 32),
        ] {
            assert_eq!(
                leg_memory_bytes(
                    &layout,
                    &model(heads, kv_heads),
                    KvShards::new(kv_heads, tp, 1).unwrap(),
                    64
                ),
                Some(kv(values) + bookkeeping),
                "{heads}/{kv_heads} heads over {tp}"
            );
        }
    }

    #[test]
    fn nodes_of_files_that_compute_kv_differently_differ_in_their_model_fields() {
        let shipped = DEFAULT_CLUSTER_TOML;
        let base = ClusterConfig::embedded_default().model_fields();
        assert_eq!(base.get("seed"), Some("7"));
        assert_eq!(
            base.get("kv_groups"),
            Some("full block 64 dcp 1, sliding_window(128) block 64 dcp 1")
        );
        for (from, to, field) in [
            ("seed = 7", "seed = 8", "seed"),
            ("d_model = 32", "d_model = 16", "d_model"),
            ("vocab = 256", "vocab = 255", "vocab"),
            ("vocab = 256", "vocab = 256\nheads = 4\nkv_heads = 1", "heads"),
            ("window = 128", "window = 96", "kv_groups"),
            (
                "layer_groups = [0, 1, 0, 1]",
                "layer_groups = [1, 0, 1, 0]",
                "layer_groups",
            ),
        ] {
            assert!(shipped.contains(from), "{from}");
            let other = ClusterConfig::from_toml(&shipped.replacen(from, to, 1))
                .unwrap()
                .model_fields();
            let names: Vec<String> = base.differences(&other).into_iter().map(|d| d.name).collect();
            assert_eq!(names, [field], "{from} -> {to}");
        }
        let grouped = |kv_heads: u32| {
            ClusterConfig::from_toml(&sharded(4, kv_heads, 1, 1))
                .unwrap()
                .model_fields()
        };
        let names: Vec<String> = grouped(4)
            .differences(&grouped(2))
            .into_iter()
            .map(|d| d.name)
            .collect();
        assert_eq!(names, ["kv_heads"]);
        // A leg's TP size is not the model's: legs of different sizes read each other.
        assert!(
            grouped(2)
                .differences(
                    &ClusterConfig::from_toml(&sharded(4, 2, 4, 2))
                        .unwrap()
                        .model_fields()
                )
                .is_empty()
        );
        // Settings that do not change the KV (limits, nodes) do not differ.
        let limits = shipped.replacen("lease_ms = 10000", "lease_ms = 20000", 1);
        assert!(limits != shipped, "the shipped file sets lease_ms");
        assert!(
            base.differences(&ClusterConfig::from_toml(&limits).unwrap().model_fields())
                .is_empty()
        );
    }

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

    #[test]
    fn transport_and_compute_keys_parse_with_their_defaults() {
        let config = ClusterConfig::embedded_default();
        assert_eq!(config.transport.links, LinkKind::Local);
        assert_eq!(config.transport.leg_threads, LegThreads::PerLeg);
        assert_eq!(config.transport.control_thread, ControlThread::Node);
        assert_eq!(config.router.http_threads, 0);
        assert_eq!(
            (config.limits.compute_workers, config.limits.inline_compute_us),
            (2, 100)
        );
        let text = DEFAULT_CLUSTER_TOML
            .replacen(
                "read_engine = \"shm\"",
                "read_engine = \"shm\"\nlinks = \"quic\"\nleg_threads = \"shared\"\ncontrol_thread = \"transport\"",
                1,
            )
            .replacen(
                "mailbox = 64",
                "mailbox = 64\ncompute_workers = 3\ninline_compute_us = 0",
                1,
            );
        let config = ClusterConfig::from_toml(&text).unwrap();
        assert_eq!(config.transport.links, LinkKind::Quic);
        assert_eq!(config.transport.leg_threads, LegThreads::Shared);
        assert_eq!(config.transport.control_thread, ControlThread::Transport);
        assert_eq!(
            (config.limits.compute_workers, config.limits.inline_compute_us),
            (3, 0)
        );
        let threads = |n: usize| {
            ClusterConfig::from_toml(&format!("{DEFAULT_CLUSTER_TOML}\n[router]\nhttp_threads = {n}\n"))
        };
        assert_eq!(
            threads(MAX_HTTP_THREADS).unwrap().router.http_threads,
            MAX_HTTP_THREADS
        );
        let refused = threads(MAX_HTTP_THREADS + 1).unwrap_err();
        assert!(
            refused.to_string().contains("router.http_threads") && refused.to_string().contains("257"),
            "{refused}"
        );
        let unknown = ClusterConfig::from_toml(&DEFAULT_CLUSTER_TOML.replacen(
            "read_engine = \"shm\"",
            "read_engine = \"shm\"\ncontrol_thread = \"router\"",
            1,
        ))
        .unwrap_err();
        assert!(unknown.to_string().contains("control_thread"), "{unknown}");
    }

    /// `read_engine = "mori"`, `kv_memory`, `[transport.mori]` and `[[nodes]] gpu` parse to what
    /// they say; each bound is refused naming its key.
    #[test]
    fn mori_and_gpu_keys_parse_and_their_bounds_are_named() {
        let config = ClusterConfig::embedded_default();
        assert_eq!(config.transport.kv_memory, KvMemory::Host);
        assert_eq!(config.transport.mori, MoriSettings::default());
        assert!(config.nodes.iter().all(|node| node.gpu == 0));
        let text = DEFAULT_CLUSTER_TOML
            .replacen(
                "read_engine = \"shm\"",
                "read_engine = \"mori\"\nkv_memory = \"gpu\"\n\n[transport.mori]\nport = 7400\nqp_per_transfer = 2\npoll_mode = \"event\"\nmax_outstanding = 8",
                1,
            )
            .replacen("name = \"decode-0\"", "name = \"decode-0\"\ngpu = 3", 1);
        let config = ClusterConfig::from_toml(&text).unwrap();
        assert_eq!(config.transport.read_engine, ReadEngineKind::Mori);
        assert_eq!(config.transport.kv_memory, KvMemory::Gpu);
        let mori = config.transport.mori;
        assert_eq!(
            (
                mori.port,
                mori.qp_per_transfer,
                mori.poll_mode,
                mori.max_outstanding,
                mori.workers
            ),
            (7400, 2, pdkv_transport::mori::PollMode::Event, 8, 8)
        );
        assert_eq!(
            config.nodes.iter().map(|node| node.gpu).collect::<Vec<_>>(),
            vec![0, 3]
        );
        let refused = |from: &str, to: &str| {
            ClusterConfig::from_toml(&DEFAULT_CLUSTER_TOML.replacen(from, to, 1))
                .unwrap_err()
                .to_string()
        };
        let error = refused(
            "read_engine = \"shm\"",
            "read_engine = \"mori\"\n[transport.mori]\nworkers = 0",
        );
        assert!(
            error.contains("transport.mori.workers") && error.contains("0 is out of range 1..=64"),
            "{error}"
        );
        let error = refused(
            "read_engine = \"shm\"",
            "read_engine = \"net\"\nkv_memory = \"gpu\"",
        );
        assert!(
            error.contains("transport.kv_memory") && error.contains("needs read_engine = \"mori\""),
            "{error}"
        );
        let error = refused(
            "read_engine = \"shm\"",
            "read_engine = \"mori\"\n[transport.mori]\nrkey = 1",
        );
        assert!(error.contains("unknown field `rkey`"), "{error}");
    }

    /// A cluster.toml v2: addresses, launch, router, TLS and logging parse to what they say; a
    /// file without them (the shipped one) gets loopback, free ports and local launch.
    #[test]
    fn deployment_keys_parse_and_default_to_loopback() {
        use crate::deployment::{Launch, LogFormat, NodeAddress, Selection};
        let config = ClusterConfig::embedded_default();
        assert!(
            config
                .nodes
                .iter()
                .all(|node| node.address == NodeAddress::default())
        );
        assert!(config.nodes.iter().all(|node| node.launch == Launch::Local));
        assert_eq!(config.tls, None);
        assert_eq!(config.router.selection, Selection::LeastLoaded);
        let text = DEFAULT_CLUSTER_TOML
            .replacen(
                "blocks_per_group = 64\nprefix_caching = false",
                "blocks_per_group = 64\nprefix_caching = false\nhost = \"10.0.0.7\"\nbind = \"0.0.0.0\"\ncontrol_port = 7100\n\
                 data_port = 7101\nadmin_port = 7102\nlaunch = \"ssh\"\nssh = \"pdkv@gpu7\"",
                1,
            )
            .replacen(
                "[[nodes]]",
                "[router]\nhttp_port = 8000\nselection = \"round_robin\"\n\
                 [tls]\ndir = \"certs\"\n[logging]\nlevel = \"info\"\nformat = \"json\"\n\n[[nodes]]",
                1,
            );
        let config = ClusterConfig::from_toml(&text).unwrap();
        let prefill = &config.nodes[0];
        assert_eq!(
            prefill.address,
            NodeAddress {
                host: "10.0.0.7".into(),
                bind: Some("0.0.0.0".into()),
                control_port: 7100,
                data_port: 7101,
                admin_port: 7102
            }
        );
        assert_eq!(
            prefill.launch,
            Launch::Ssh {
                target: "pdkv@gpu7".into()
            }
        );
        assert_eq!(config.nodes[1].address, NodeAddress::default());
        assert_eq!(
            (config.router.http_port, config.router.selection),
            (8000, Selection::RoundRobin)
        );
        assert_eq!(config.tls.unwrap().dir, std::path::PathBuf::from("certs"));
        assert_eq!(
            (config.logging.level.as_str(), config.logging.format),
            ("info", LogFormat::Json)
        );
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
            (
                format!("{base}\n[logging]\nlevel = \"[{{{{{{==\"\n"),
                "logging.level: \"[{{{==\" is not a log filter",
            ),
            (
                format!("{base}\n[http]\nheader_timeout_ms = 0\n"),
                "http.header_timeout_ms: 0 is outside 1..=86400000",
            ),
            (
                format!("{base}\n[http]\nmax_connections = 2000000\n"),
                "http.max_connections: 2000000 is more than 1048576",
            ),
            (with("seed = 7\n", ""), "missing field `seed`"),
            (
                with("blocks_per_group = 64", "blocks_per_group = 4000000000"),
                "nodes[0].blocks_per_group: 4000000000 blocks per group need",
            ),
            (
                with("lookahead_tokens = 9", "lookahead_tokens = 18446744073709551566"),
                "nodes[1].lookahead_tokens: 18446744073709551566 tokens leave no room for a prompt: the node holds 4096 token slots (64 blocks of 64 tokens in group 0)",
            ),
            (
                with("lookahead_tokens = 9", "lookahead_tokens = 4096"),
                "nodes[1].lookahead_tokens: 4096 tokens leave no room for a prompt",
            ),
            (
                with("lookahead_tokens = 0", "lookahead_tokens = 18446744073709551615"),
                "nodes[0].lookahead_tokens: 18446744073709551615 tokens leave no room for a prompt: the node holds 4096 token slots",
            ),
            (
                with("name = \"decode-0\"", "name = \"ca\""),
                "nodes[1].name: \"ca\" is reserved",
            ),
            (
                with("name = \"decode-0\"", "name = \"router\""),
                "nodes[1].name: \"router\" is reserved",
            ),
            (
                with("role = \"decode\"", "role = \"router\""),
                "nodes[1].role: \"router\" is not a leg role",
            ),
            (
                with(
                    "read_engine = \"shm\"",
                    "read_engine = \"shm\"\nlinks = \"carrier-pigeon\"",
                ),
                "unknown variant `carrier-pigeon`, expected `local` or `quic`",
            ),
            (
                with(
                    "read_engine = \"shm\"",
                    "read_engine = \"shm\"\nleg_threads = \"many\"",
                ),
                "unknown variant `many`, expected `per_leg` or `shared`",
            ),
            (
                with("[[nodes]]", "[failure]\nheartbeat_ms = 5\n[[nodes]]"),
                "failure.heartbeat_ms: 5 is outside 10..=60000",
            ),
            (
                with("[[nodes]]", "[failure]\nheartbeat_misses = 0\n[[nodes]]"),
                "failure.heartbeat_misses: 0 is outside 1..=100",
            ),
            (
                with("[[nodes]]", "[failure]\nmax_retries = 9\n[[nodes]]"),
                "failure.max_retries: 9 is more than 8",
            ),
            (
                with("[[nodes]]", "[failure]\nheartbeats = 3\n[[nodes]]"),
                "unknown field `heartbeats`",
            ),
            (
                with("mailbox = 64", "mailbox = 64\ncompute_workers = 0"),
                "limits.compute_workers: must be at least 1",
            ),
            (
                with("mailbox = 64", "mailbox = 64\ncompute_workers = 257"),
                "limits.compute_workers: 257 is more than the 256 threads a leg may run",
            ),
            (
                with("mailbox = 64", "mailbox = 64\ninline_compute_us = 10001"),
                "limits.inline_compute_us: 10001 would let one computation hold a leg's arbiter for more than 10000 us",
            ),
            (
                with(
                    "request_timeout_ms = 30000",
                    "request_timeout_ms = 18446744073709551615",
                ),
                "limits.request_timeout_ms: 18446744073709551615 ms is more than a day (86400000 ms)",
            ),
            (
                with("lease_ms = 10000", "lease_ms = 86400001"),
                "limits.lease_ms: 86400001 ms is more than a day (86400000 ms)",
            ),
            (
                with("alloc_wait_ms = 5000", "alloc_wait_ms = 100000000"),
                "limits.alloc_wait_ms: 100000000 ms is more than a day (86400000 ms)",
            ),
            (
                with("mailbox = 64", "mailbox = 64\nlink_in_flight = 0"),
                "limits.link_in_flight: must be at least 1",
            ),
            (
                with(
                    "prefix_caching = true",
                    "prefix_caching = true\nhost = \"not a host\"",
                ),
                "nodes[1].host: \"not a host\" is neither an IP address nor a DNS name",
            ),
            (
                with(
                    "prefix_caching = false",
                    "prefix_caching = false\ncontrol_port = 7000\nadmin_port = 7000",
                ),
                "nodes[0].admin_port: port 7000 on 127.0.0.1 is already taken by nodes[0].control_port",
            ),
            (
                with("prefix_caching = true", "prefix_caching = true\nlaunch = \"ssh\""),
                "nodes[1].ssh: launch = \"ssh\" needs an ssh target",
            ),
            (
                with(
                    "prefix_caching = true",
                    "prefix_caching = true\nlaunch = \"teleport\"",
                ),
                "unknown variant `teleport`, expected `local` or `ssh`",
            ),
            (
                with("[[nodes]]", "[router]\nport = 80\n\n[[nodes]]"),
                "unknown field `port`",
            ),
            (
                with("[[nodes]]", "[tls]\ndir = \"\"\n\n[[nodes]]"),
                "tls.dir: must name the directory pdkv certs init wrote",
            ),
            (
                with("[[nodes]]", "[logging]\nformat = \"xml\"\n\n[[nodes]]"),
                "unknown variant `xml`, expected `text` or `json`",
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

    /// The allocator's per-block bookkeeping counts against `max_leg_bytes`: one byte-sized
    /// block of a one-float model is 8 bytes of KV, but 700 million of them also need 90 GB of
    /// bookkeeping, so the node is refused at load instead of aborting at 7 GB RSS.
    #[test]
    fn block_bookkeeping_counts_against_max_leg_bytes() {
        let text = |blocks: u32| {
            format!(
                "[model]\nseed = 1\nd_model = 1\nvocab = 2\nlayer_groups = [0]\n\
                 [[model.groups]]\nkind = \"full\"\nblock_size = 1\n\
                 [[nodes]]\nname = \"p\"\nrole = \"prefill\"\nblocks_per_group = {blocks}\n\
                 [[nodes]]\nname = \"d\"\nrole = \"decode\"\nblocks_per_group = 8\n"
            )
        };
        let error = ClusterConfig::from_toml(&text(700_000_000))
            .unwrap_err()
            .to_string();
        let expected = (700_000_000u64 + 1) * (8 + 4 + ALLOCATOR_BYTES_PER_BLOCK);
        assert_eq!(
            error,
            format!(
                "cluster.toml: nodes[0].blocks_per_group: 700000000 blocks per group need {expected} bytes of KV memory and block bookkeeping, above limits.max_leg_bytes (8589934592 bytes)"
            )
        );
        assert!(ClusterConfig::from_toml(&text(1000)).is_ok());
    }

    /// The shipped cluster serves prompts up to 4096 - 9 tokens: the decode leg's 64 blocks of
    /// 64 tokens, minus its 9-token lookahead.
    #[test]
    fn prompt_limit_names_the_node_that_sets_it() {
        let config = ClusterConfig::embedded_default();
        assert_eq!(config.prompt_limit().max_tokens, 4087);
        assert!(config.check_prompt_tokens(4087).is_ok());
        let error = config.check_prompt_tokens(u64::MAX).unwrap_err();
        assert_eq!(error.num_prompt_tokens, u64::MAX);
        assert_eq!(
            error.to_string(),
            "prompt of 18446744073709551615 tokens is longer than the cluster's limit of 4087 tokens: node decode-0 holds 4096 token slots (64 blocks of 64 tokens in group 0) and reserves 9 for lookahead"
        );
        let mamba_only = "[model]\nseed = 1\nd_model = 2\nvocab = 4\nlayer_groups = [0]\n\
            [[model.groups]]\nkind = \"mamba\"\n\
            [[nodes]]\nname = \"p\"\nrole = \"prefill\"\nblocks_per_group = 2\n\
            [[nodes]]\nname = \"d\"\nrole = \"decode\"\nblocks_per_group = 2\n";
        let config = ClusterConfig::from_toml(mamba_only).unwrap();
        assert_eq!(config.prompt_limit().max_tokens, MAX_PROMPT_TOKENS);
    }
}
