//! `KvAgent`: one vLLM worker's door to pdkv, the part of the connector that owns memory,
//! connections and READs.
//!
//! A prefill worker's agent serves hand-offs on the control plane (QUIC, mutual TLS): a decode
//! worker claims a finished request's blocks, READs them one-sided through shared memory, checks
//! that their generations did not move, and releases them. The agent bumps a block's generation
//! before vLLM may free it (release, lease expiry, revocation), so a READ that raced a free is
//! caught after the copy and reported as a load error, never decoded from.
//!
//! KV memory is the worker's own: memfds (`os.memfd_create`) holding vLLM's KV tensors, adopted
//! here, so the decode worker's READ lands directly in its tensors and the prefill worker's
//! tensors are read without a copy on its side.

use std::collections::HashMap;
use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::BorrowedFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use futures_util::future::{LocalBoxFuture, join_all};

use pdkv_core::block::BlockId;
use pdkv_core::exchange::{BlockPair, Pairing};
use pdkv_core::heads::{HeadMap, HeadOrder, HeadRead, KvShards, RankBlock, TokenShard, shard_slices};
use pdkv_core::identity::ModelFields;
use pdkv_core::layout::{GroupKind, GroupSpec, KvLayout};
use pdkv_core::leg::GenerationCheck;
use pdkv_core::plan::{self, BlockSlice, LayerRegion, RegionLayout};
use pdkv_core::wire::{GrantId, Incarnation, NodeId, Role};
use pdkv_transport::clock::MonotonicClock;
use pdkv_transport::codec::PROTOCOL_VERSION;
use pdkv_transport::control::{
    ControlClient, ControlError, ControlLimits, ControlServer, ControlService, EngineAdvert, Hello,
    PeerConnection, ServerSetup, TransportRuntime, new_incarnation,
};
use pdkv_transport::engine::{EngineError, EngineKey, EngineKind, ReadEngine};
use pdkv_transport::host;
use pdkv_transport::kv_read::{KvRead, KvReadError, choose_engine};
use pdkv_transport::mapped::MappedEngine;
use pdkv_transport::net::{
    MemoryServer, MemoryServerLimits, NetEngine, ReadAuthorizer, ReadDenied, TicketBook,
};
use pdkv_transport::region::Region;
use pdkv_transport::tls::NodeIdentity;

use crate::handoff::{Ended, Ending, HandoffError, Handoffs};
use crate::protocol::{HandoffRequest, HandoffResponse, PlaneName};

/// Why an agent could not be built or could not load a request's KV. Each kind tells the
/// connector what vLLM should do: a load error always means "recompute", never "decode".
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The agent's settings or memory are wrong (a bug or a misconfiguration, not a fault).
    #[error("{0}")]
    Config(String),
    /// The prefill worker could not be reached, or the connection broke.
    #[error("cannot reach prefill worker {node} at {address}: {reason}")]
    Unreachable {
        /// Its node name.
        node: String,
        /// Its control address.
        address: String,
        /// What failed.
        reason: String,
    },
    /// The prefill worker serves another model, or the same model computed differently (the
    /// handshake names each differing field with both values): its KV is never read.
    #[error("prefill worker {node} at {address} is incompatible: {reason}")]
    Incompatible {
        /// Its node name.
        node: String,
        /// Its control address.
        address: String,
        /// What differs.
        reason: String,
    },
    /// The prefill worker is a different process than the one that computed the KV.
    #[error(
        "prefill worker {node} restarted: the KV was computed by incarnation {expected:#x}, \
         {found:#x} answers"
    )]
    Restarted {
        /// Its node name.
        node: String,
        /// The incarnation in the request's transfer params.
        expected: u64,
        /// The incarnation that answered.
        found: u64,
    },
    /// The prefill worker refused the hand-off (it ended, or another worker owns it).
    #[error("prefill worker {node} refused request {request}: {reason}")]
    HandoffRefused {
        /// Its node name.
        node: String,
        /// The prefill side's request id.
        request: String,
        /// Its reason.
        reason: String,
    },
    /// The hand-off never appeared.
    #[error("prefill worker {node} announced no hand-off of request {request} within {waited_ms} ms")]
    HandoffMissing {
        /// Its node name.
        node: String,
        /// The prefill side's request id.
        request: String,
        /// How long the agent asked.
        waited_ms: u64,
    },
    /// The two legs' layers do not match: a layer this worker holds is held by no prefill
    /// worker (or by two), or in another group there.
    #[error("request {request}: the legs' layers do not match: {reason}")]
    Layers {
        /// The prefill side's request id.
        request: String,
        /// Which layer, and how.
        reason: String,
    },
    /// A pair reads a block the hand-off does not hold.
    #[error("request {request}: block {block} of group {group} is not part of the hand-off")]
    NotHandedOff {
        /// The prefill side's request id.
        request: String,
        /// The group.
        group: usize,
        /// The block.
        block: BlockId,
    },
    /// The data connection to the prefill worker's memory server broke (it closes connections
    /// idle for a minute): dialled again once, the READ is retried.
    #[error("request {request}: READ failed: its data connection broke: {reason}")]
    DataConnection {
        /// The prefill side's request id.
        request: String,
        /// What failed.
        reason: String,
    },
    /// The READ could not be planned or did not complete.
    #[error("request {request}: READ failed: {reason}")]
    Read {
        /// The prefill side's request id.
        request: String,
        /// What failed.
        reason: String,
    },
    /// A source block was freed (its generation moved) while it was read: the bytes may belong
    /// to another request.
    #[error(
        "request {request}: block {block} of group {group} changed generation {expected} -> {found} \
         during the READ; its bytes are not trusted"
    )]
    Stale {
        /// The prefill side's request id.
        request: String,
        /// The group.
        group: usize,
        /// The block.
        block: BlockId,
        /// Generation at claim time.
        expected: u32,
        /// Generation after the copy.
        found: u32,
    },
}

/// The bounds of an agent's waits and tables.
#[derive(Debug, Clone, Copy)]
pub struct AgentLimits {
    /// How long a hand-off stays claimable after its announcement or its last claim.
    pub lease: Duration,
    /// Most live hand-offs (each pins blocks).
    pub max_handoffs: usize,
    /// How long a decode worker waits for a hand-off to be announced.
    pub claim_wait: Duration,
    /// How long dialling a prefill worker may take.
    pub connect: Duration,
    /// How long one control round trip may take.
    pub request: Duration,
    /// How long one request's READ may take.
    pub read: Duration,
    /// How long a prefill worker's memory server keeps a data connection nobody reads over
    /// (none: as long as it is open); a decode worker dials a closed one again.
    pub data_idle: Option<Duration>,
}

/// The part of a leg's KV memory one layer's K or V (or one mamba state tensor) occupies.
#[derive(Debug, Clone)]
pub struct Plane {
    /// Index of the memfd holding it.
    pub region: u32,
    /// Offset of block 0.
    pub offset: u64,
    /// Bytes per block.
    pub bytes_per_block: u64,
    /// The KV-cache group whose block ids index it.
    pub group: usize,
    /// The layer it holds (vLLM's layer name; the names of every layer a block-outermost plane
    /// packs, joined by `|`): a decode plane is read from the prefill plane of the same layer.
    pub layer: String,
    /// Bytes of one layer's page in a block: `bytes_per_block`, or less when a block packs
    /// several layers' pages one after another (a block-outermost layout).
    pub page_bytes: u64,
}

/// How long a data-connection ticket stays valid, and how many may be outstanding.
const TICKET_TTL: Duration = Duration::from_secs(10);
const MAX_TICKETS: usize = 256;

/// What the prefill side's control service shares with the agent.
struct Serving {
    handoffs: Mutex<Handoffs>,
    /// Generation table: one `u32` per block id (vLLM's groups share one block pool).
    generations: Arc<Region>,
    /// Requests vLLM may now free.
    finished: Mutex<Vec<String>>,
    /// Hand-offs whose lease lapsed before a decoder released them, since start.
    expired: std::sync::atomic::AtomicU64,
    clock: MonotonicClock,
}

impl Serving {
    /// Bumps the generations of an ended hand-off's blocks, then lets vLLM free them: a reader
    /// that copied them before the bump sees the new generation after its copy.
    fn finish(&self, ended: Ended) {
        for block in ended.blocks.iter().flatten() {
            match self.generations.atomic_u32(*block as usize) {
                Ok(word) => {
                    word.fetch_add(1, Ordering::SeqCst);
                }
                Err(error) => tracing::error!(block, %error, "generation word out of range"),
            }
        }
        tracing::debug!(request = %ended.request, how = ?ended.how, "hand-off ended");
        if ended.how == Ending::Expired {
            self.expired.fetch_add(1, Ordering::Relaxed);
        }
        lock(&self.finished).push(ended.request);
    }
}

struct HandoffService {
    serving: Arc<Serving>,
    planes: Arc<PlaneTable>,
}

impl ControlService for HandoffService {
    type Request = HandoffRequest;
    type Response = HandoffResponse;

    async fn handle(&self, peer: &NodeId, request: HandoffRequest) -> Result<HandoffResponse, String> {
        let serving = &self.serving;
        match request {
            HandoffRequest::Claim { request, readers } => {
                let now = serving.clock.now_ms();
                let claimed = lock(&serving.handoffs).claim(&request, peer, readers, now);
                match claimed {
                    Ok(claim) => {
                        let generations = claim
                            .blocks
                            .iter()
                            .map(|group| {
                                group
                                    .iter()
                                    .map(|&block| serving.generations.load_u32(block as usize))
                                    .collect::<Result<Vec<u32>, _>>()
                            })
                            .collect::<Result<Vec<_>, _>>()
                            .map_err(|error| error.to_string())?;
                        Ok(HandoffResponse::Claimed {
                            grant: claim.grant,
                            blocks: claim.blocks,
                            generations,
                            lease_left_ms: claim.expires_at_ms.saturating_sub(now),
                        })
                    }
                    Err(HandoffError::Unknown(_)) => Ok(HandoffResponse::NotYet),
                    Err(error) => Err(error.to_string()),
                }
            }
            HandoffRequest::Release { request } => {
                let released = lock(&serving.handoffs).release(&request, peer);
                // The hand-off ends with its last reader's release.
                if let Some(ended) = released.map_err(|error| error.to_string())? {
                    serving.finish(ended);
                }
                Ok(HandoffResponse::Released)
            }
            HandoffRequest::Planes => Ok(HandoffResponse::Planes(self.planes.names.clone())),
        }
    }
}

/// Checks every network READ a prefill worker serves against its hand-offs: the asking node
/// owns the hand-off the READ names, its lease is live, and every byte lies in one of its blocks
/// (or, for generation words, names one of its blocks).
struct HandoffAuthorizer {
    serving: Arc<Serving>,
    regions: RegionLayout,
    layer_groups: Vec<usize>,
    generation_region: u32,
}

impl ReadAuthorizer for HandoffAuthorizer {
    fn authorize_read(
        &self,
        peer: &NodeId,
        grant: GrantId,
        region: u32,
        offset: u64,
        len: u64,
    ) -> Result<(), ReadDenied> {
        let outside = ReadDenied::NotInsideBlock { region, offset, len };
        let end = offset
            .checked_add(len)
            .filter(|_| len > 0)
            .ok_or(outside.clone())?;
        let now = self.serving.clock.now_ms();
        let handoffs = lock(&self.serving.handoffs);
        // vLLM's groups overlay one another in memory (a block id belongs to one group at a
        // time): the range is granted if the planes of one group holding it cover its blocks.
        let mut denied = outside;
        for (layer, placement) in self.regions.layers.iter().enumerate() {
            let plane_end =
                placement.base_offset + placement.bytes_per_block * u64::from(placement.num_blocks);
            if placement.region != region || offset < placement.base_offset || end > plane_end {
                continue;
            }
            let group = self.layer_groups[layer];
            let first = (offset - placement.base_offset) / placement.bytes_per_block;
            let last = (end - 1 - placement.base_offset) / placement.bytes_per_block;
            let granted = (first..=last).try_for_each(|block| {
                let block = u32::try_from(block).map_err(|_| ReadDenied::BlockOutOfRange(block))?;
                handoffs
                    .check_read(grant, peer, group, block, now)
                    .map_err(ReadDenied::from)
            });
            match granted {
                Ok(()) => return Ok(()),
                Err(error) => denied = error,
            }
        }
        Err(denied)
    }

    fn authorize_words(
        &self,
        peer: &NodeId,
        grant: GrantId,
        region: u32,
        indices: &[u32],
    ) -> Result<(), ReadDenied> {
        if region != self.generation_region {
            return Err(ReadDenied::NotGenerationTable(region));
        }
        let handoffs = lock(&self.serving.handoffs);
        for &block in indices {
            handoffs.check_word(grant, peer, block)?;
        }
        Ok(())
    }
}

/// Which READ engine a decode worker uses to reach a prefill worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineChoice {
    /// Shared memory on the same host, the network elsewhere.
    Auto,
    /// Shared memory only (another host is refused).
    Shm,
    /// The network, even on the same host.
    Net,
    /// mori (RDMA), which both workers must offer.
    Mori,
}

/// A prefill worker as a decode worker knows it.
#[derive(Clone)]
struct Peer {
    connection: PeerConnection,
    regions: RegionLayout,
    /// The layer each of its planes holds.
    planes: Arc<PlaneTable>,
    /// The prefill worker's engine, as the chosen engine knows it.
    engine: EngineKey,
    /// The engine that READs from it.
    reader: Arc<dyn ReadEngine>,
    /// Whether READs go over a data connection to its memory server (the network engine), which
    /// can be dialled again.
    dialled: bool,
}

/// A worker's planes, by position and by layer.
struct PlaneTable {
    names: Vec<PlaneName>,
    index: HashMap<String, usize>,
}

impl PlaneTable {
    /// Refuses two planes holding one layer, naming them.
    fn new(names: Vec<PlaneName>) -> Result<Self, String> {
        let mut index = HashMap::with_capacity(names.len());
        for (plane, name) in names.iter().enumerate() {
            if let Some(first) = index.insert(name.layer.clone(), plane) {
                return Err(format!(
                    "planes {first} and {plane} both hold layer {:?}",
                    name.layer
                ));
            }
        }
        Ok(PlaneTable { names, index })
    }
}

/// What a decode worker reads of one prefill pipeline stage: `(prefill rank, readers, the heads
/// read, or None for whole blocks)` per source, and the ranks whose replicas nobody reads that
/// fall to it to give back.
struct StageReads {
    reads: Vec<(u32, u32, Option<Vec<HeadRead>>)>,
    unread: Vec<u32>,
    heads: Option<HeadLoad>,
}

/// One vLLM worker's pdkv agent (prefill or decode).
pub struct Agent {
    node: NodeId,
    role: Role,
    /// The control address peers reach this worker at, when it differs from the bound one.
    advertise: Option<SocketAddr>,
    layout: KvLayout,
    regions: RegionLayout,
    /// The layer each plane holds, and each layer's plane.
    planes: Arc<PlaneTable>,
    engine: Arc<MappedEngine>,
    /// READs over the network (decode), and the descriptor of the memory server (prefill).
    net: Arc<NetEngine>,
    /// mori, when configured.
    mori: Option<Arc<dyn ReadEngine>>,
    choice: EngineChoice,
    /// Serves network READs (prefill); dropped on close.
    memory_server: Mutex<Option<MemoryServer>>,
    hello: Hello,
    identity: NodeIdentity,
    limits: AgentLimits,
    serving: Arc<Serving>,
    /// Taken (and dropped, freeing the port) on close.
    server: Mutex<Option<ControlServer>>,
    clients: Mutex<HashMap<bool, ControlClient>>,
    peers: Mutex<HashMap<(String, String), Peer>>,
    runtime: TransportRuntime,
    /// Keeps the adopted memory mapped as long as the engine may touch it.
    _memory: Vec<Arc<Region>>,
}

/// A prefill worker a decode worker reads from, as a request's transfer params name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// Its node name.
    pub node: String,
    /// Its control address.
    pub address: String,
    /// The incarnation that computed the KV.
    pub incarnation: u64,
}

impl Source {
    /// Its control address, parsed.
    fn socket_address(&self) -> Result<SocketAddr, AgentError> {
        self.address
            .parse()
            .map_err(|error| config(format!("prefill address {:?}: {error}", self.address)))
    }
}

/// How a decode worker holds KV, and how many decode workers read each prefill worker: what a
/// load across the prefill leg's workers needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeSplit {
    /// The model's KV heads.
    pub kv_heads: u32,
    /// This leg's tensor-parallel size.
    pub tp: u32,
    /// This worker's tensor-parallel rank.
    pub rank: u32,
    /// Spreads replicated heads over prefill ranks (any per-request number, the same on every
    /// decode rank).
    pub rotation: u64,
    /// How a block orders heads and tokens (the same on both legs: the handshake compares it);
    /// None where blocks are only copied whole (a prefill stage of another TP size is refused).
    pub order: Option<HeadOrder>,
    /// How many of this leg's pipeline stages read each prefill worker: 1 when decode stage s
    /// reads prefill stage s (one PP size), this leg's PP size when every stage asks every
    /// prefill stage for the layers it holds (legs of different PP sizes).
    pub stage_readers: u32,
    /// How this leg splits a block's tokens over its DCP ranks.
    pub dcp: DcpSplit,
    /// How the prefill leg does.
    pub prefill_dcp: DcpSplit,
}

impl DecodeSplit {
    /// One worker reading one prefill worker's blocks whole.
    pub const WHOLE: DecodeSplit = DecodeSplit {
        kv_heads: 1,
        tp: 1,
        rank: 0,
        rotation: 0,
        order: None,
        stage_readers: 1,
        dcp: DcpSplit::NONE,
        prefill_dcp: DcpSplit::NONE,
    };
}

/// How a leg splits each scheduler block's tokens over its decode-context-parallel (DCP) ranks:
/// vLLM's `decode_context_parallel_size` and `cp_kv_cache_interleave_size` (see
/// [`TokenShard`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DcpSplit {
    /// DCP ranks (1: every rank holds every token).
    pub size: u32,
    /// Consecutive tokens per DCP rank's turn.
    pub interleave: u32,
}

impl DcpSplit {
    /// No DCP.
    pub const NONE: DcpSplit = DcpSplit {
        size: 1,
        interleave: 1,
    };

    /// `tp` ranks holding `kv_heads` KV heads split this way.
    fn shards(self, kv_heads: u32, tp: u32) -> Result<KvShards, AgentError> {
        KvShards::new(kv_heads, tp, self.size)
            .and_then(|shards| shards.with_interleave(self.interleave))
            .map_err(config)
    }
}

/// How a decode worker's leg and the prefill leg split KV when their tensor-parallel or DCP
/// splits differ: which heads and tokens this worker holds, and how a block orders heads and
/// tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadLoad {
    /// The prefill leg's split (its TP size is the number of sources).
    pub prefill: KvShards,
    /// The decode leg's split.
    pub decode: KvShards,
    /// This worker's tensor-parallel rank.
    pub rank: u32,
    /// Spreads replicated heads over prefill ranks (any per-request number, the same on every
    /// decode rank).
    pub rotation: u64,
    /// How a block orders heads and tokens (the same on both legs: the handshake compares it).
    pub order: HeadOrder,
}

/// What one load moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loaded {
    /// Bytes copied.
    pub bytes: u64,
    /// Contiguous runs posted.
    pub runs: usize,
}

/// Memory holding KV tensors.
#[derive(Debug, Clone, Copy)]
pub enum Memory {
    /// An open memfd (readable by a same-host peer through shared memory, and over the network).
    Memfd(i32),
    /// Plain host memory of this process, `len` bytes at address `ptr` (network and mori READs).
    /// The caller keeps it alive and in place while the agent lives.
    Borrowed {
        /// Its address.
        ptr: usize,
        /// Its length.
        len: usize,
    },
    /// Memory of AMD GPU `device` (HIP index) another runtime allocated (mori READs it in place;
    /// the network engine through staging copies). Needs the `hip` feature. The caller keeps it
    /// alive while the agent lives.
    Device {
        /// Its device address.
        ptr: usize,
        /// Its length.
        len: usize,
        /// The HIP device.
        device: u32,
    },
}

/// A worker's mori engine: the address its control plane listens on, and its settings.
#[derive(Debug, Clone)]
pub struct MoriSetup {
    /// The host (IP) mori's own control plane binds (the NIC's host).
    pub host: String,
    /// mori's settings (`[transport.mori]` in a cluster.toml).
    pub settings: pdkv_transport::mori::MoriSettings,
}

/// Everything an agent is built from.
pub struct AgentSetup {
    /// This worker's node name (its certificate's name).
    pub node: String,
    /// Prefill or decode.
    pub role: Role,
    /// Directory holding `ca.pem`, `<node>.pem`, `<node>.key`.
    pub certs_dir: std::path::PathBuf,
    /// Nodes this worker talks to (a prefill worker admits only these).
    pub peers: Vec<String>,
    /// The model's KV groups.
    pub groups: Vec<GroupSpec>,
    /// What defines this worker's KV (model, shapes, dtype, parallel layout): a prefill and a
    /// decode worker that differ in any field refuse each other at their first handshake.
    pub model: ModelFields,
    /// The memory holding the KV tensors.
    pub memory: Vec<Memory>,
    /// Where each K/V/state plane lies in them.
    pub planes: Vec<Plane>,
    /// Blocks in vLLM's pool.
    pub num_blocks: u32,
    /// Control address to serve on (prefill).
    pub listen: Option<SocketAddr>,
    /// Where the prefill worker's memory server listens (default: the control address's host,
    /// any port).
    pub data_listen: Option<SocketAddr>,
    /// The control address peers reach this worker at when it differs from the bound one
    /// (listeners on every interface in a container, a NAT, a relay): put in its handshake
    /// instead of the bound address.
    pub advertise: Option<SocketAddr>,
    /// The same for its memory server, put in its READ engine advertisement.
    pub data_advertise: Option<SocketAddr>,
    /// How a decode worker READs.
    pub engine: EngineChoice,
    /// A mori engine, if this worker offers or uses one.
    pub mori: Option<MoriSetup>,
    /// Bounds.
    pub limits: AgentLimits,
}

fn config(message: impl std::fmt::Display) -> AgentError {
    AgentError::Config(message.to_string())
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The worker's mori engine (the `mori` feature), or why there is none.
fn start_mori(node: &str, mori: &MoriSetup) -> Result<Arc<dyn ReadEngine>, AgentError> {
    #[cfg(feature = "mori")]
    {
        let engine =
            pdkv_transport::mori::MoriEngine::new(EngineKey(node.to_string()), &mori.host, mori.settings)
                .map_err(|error| config(format!("mori engine of {node}: {error}")))?;
        Ok(Arc::new(engine))
    }
    #[cfg(not(feature = "mori"))]
    {
        let _ = (&mori.host, mori.settings);
        Err(config(format!(
            "mori engine of {node}: {}",
            pdkv_transport::mori::MoriError::NotBuilt
        )))
    }
}

/// Adopts an open memfd: duplicates the descriptor (close-on-exec), so the caller's stays its own.
fn adopt(fd: i32) -> Result<Region, AgentError> {
    if fd < 0 {
        return Err(config(format!("KV memory fd {fd} is not a file descriptor")));
    }
    // SAFETY: `fd` is non-negative; it is only borrowed long enough to duplicate it, and a closed
    // or foreign number makes the duplication fail with EBADF rather than touch anything.
    let owned = unsafe { BorrowedFd::borrow_raw(fd) }
        .try_clone_to_owned()
        .map_err(|error| config(format!("KV memory fd {fd}: {error}")))?;
    Region::adopt_shared(File::from(owned)).map_err(|error| config(format!("KV memory: {error}")))
}

impl Agent {
    /// Adopts the worker's KV memory, registers it with the READ engines that can reach it
    /// (shared memory, the network, mori) and, on a prefill worker, starts serving hand-offs on
    /// `setup.listen`.
    pub fn start(setup: AgentSetup) -> Result<Self, AgentError> {
        if setup.num_blocks == 0 {
            return Err(config("the KV cache has no blocks"));
        }
        if setup.memory.is_empty() || setup.planes.is_empty() {
            return Err(config("no KV memory was registered"));
        }
        let layer_groups = setup.planes.iter().map(|plane| plane.group).collect();
        let layout = KvLayout::new(setup.groups, layer_groups).map_err(config)?;
        let names: Vec<PlaneName> = setup
            .planes
            .iter()
            .map(|plane| PlaneName {
                layer: plane.layer.clone(),
                group: plane.group as u32,
                page_bytes: plane.page_bytes,
            })
            .collect();
        for (index, plane) in names.iter().enumerate() {
            if plane.layer.is_empty() {
                return Err(config(format!("plane {index} names no layer")));
            }
            let packed = plane.page_bytes.checked_mul(plane.pages());
            if plane.page_bytes == 0 || packed.is_none_or(|bytes| bytes > setup.planes[index].bytes_per_block)
            {
                return Err(config(format!(
                    "plane {index}: {} pages of {} bytes do not fit its {}-byte blocks",
                    plane.pages(),
                    plane.page_bytes,
                    setup.planes[index].bytes_per_block
                )));
            }
        }
        let planes = Arc::new(PlaneTable::new(names).map_err(config)?);
        let memory = setup
            .memory
            .iter()
            .map(|&memory| match memory {
                Memory::Memfd(fd) => adopt(fd).map(Arc::new),
                // SAFETY: the caller (the connector, which holds the tensors for the agent's
                // life) guarantees the memory stays valid and in place.
                Memory::Borrowed { ptr, len } => unsafe { Region::borrowed(ptr as *mut u8, len) }
                    .map(Arc::new)
                    .map_err(|error| config(format!("KV memory: {error}"))),
                // SAFETY: as above, on the GPU.
                Memory::Device { ptr, len, device } => {
                    unsafe { Region::borrowed_device(ptr as *mut u8, len, device) }
                        .map(Arc::new)
                        .map_err(|error| config(format!("KV memory on GPU {device}: {error}")))
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Shared memory is offered only when every KV region is in a memfd, network READs only
        // when every region is host memory (GPU memory is mori's: the memory server and the
        // network engine reach memory by pointer).
        let shareable = setup
            .memory
            .iter()
            .all(|memory| matches!(memory, Memory::Memfd(_)));
        let host_memory = !setup
            .memory
            .iter()
            .any(|memory| matches!(memory, Memory::Device { .. }));
        for (index, plane) in setup.planes.iter().enumerate() {
            let region = memory.get(plane.region as usize).ok_or_else(|| {
                config(format!(
                    "plane {index} lies in memory region {}, only {} were given",
                    plane.region,
                    memory.len()
                ))
            })?;
            let end = plane
                .bytes_per_block
                .checked_mul(u64::from(setup.num_blocks))
                .and_then(|bytes| bytes.checked_add(plane.offset));
            if plane.bytes_per_block == 0 || end.is_none_or(|end| end > region.len() as u64) {
                return Err(config(format!(
                    "plane {index}: {} blocks of {} bytes at offset {} do not fit memory region {} ({} bytes)",
                    setup.num_blocks,
                    plane.bytes_per_block,
                    plane.offset,
                    plane.region,
                    region.len()
                )));
            }
        }
        let generation_region = memory.len() as u32;
        let generations = Arc::new(
            Region::shared("pdkv-generations", setup.num_blocks as usize * 4)
                .map_err(|error| config(format!("generation table: {error}")))?,
        );
        let regions = RegionLayout {
            layers: setup
                .planes
                .iter()
                .map(|plane| LayerRegion {
                    region: plane.region,
                    base_offset: plane.offset,
                    bytes_per_block: plane.bytes_per_block,
                    num_blocks: setup.num_blocks,
                })
                .collect(),
            generations: vec![generation_region; layout.groups().len()],
            ranks: 1,
            dcp: 1,
        };
        let runtime = TransportRuntime::new(2).map_err(|error| config(format!("runtime: {error}")))?;
        let key = EngineKey(setup.node.clone());
        let engine = Arc::new(MappedEngine::shm(key.clone()).map_err(config)?);
        let handoffs = Handoffs::new(setup.limits.lease.as_millis() as u64, setup.limits.max_handoffs)
            .map_err(config)?;
        let serving = Arc::new(Serving {
            handoffs: Mutex::new(handoffs),
            generations,
            finished: Mutex::new(Vec::new()),
            expired: std::sync::atomic::AtomicU64::new(0),
            clock: MonotonicClock::new(),
        });
        let all: Vec<Arc<Region>> = memory.iter().chain([&serving.generations]).cloned().collect();
        let tickets = Arc::new(TicketBook::new(TICKET_TTL, MAX_TICKETS));
        let memory_server = match (setup.role, setup.data_listen.or(setup.listen)) {
            (Role::Prefill, Some(bind)) if host_memory => {
                let bind = if setup.data_listen.is_some() {
                    bind
                } else {
                    SocketAddr::new(bind.ip(), 0)
                };
                let authorizer = Arc::new(HandoffAuthorizer {
                    serving: serving.clone(),
                    regions: regions.clone(),
                    layer_groups: layout.layer_groups().to_vec(),
                    generation_region,
                });
                let served = all
                    .iter()
                    .enumerate()
                    .map(|(id, region)| (id as u32, region.clone()))
                    .collect();
                Some(
                    MemoryServer::start(
                        &runtime.handle(),
                        bind,
                        served,
                        authorizer,
                        tickets.clone(),
                        MemoryServerLimits {
                            idle_timeout: setup.limits.data_idle,
                            ..MemoryServerLimits::default()
                        },
                    )
                    .map_err(|error| config(format!("cannot serve network READs on {bind}: {error}")))?,
                )
            }
            _ => None,
        };
        let data_address = memory_server
            .as_ref()
            .map(|server| setup.data_advertise.unwrap_or(server.local_addr()).to_string())
            .unwrap_or_default();
        let net = Arc::new(
            NetEngine::new(key, runtime.handle(), data_address).with_connect_wait(setup.limits.connect),
        );
        let mut engines = Vec::with_capacity(2);
        if shareable {
            let mut regions = Vec::with_capacity(all.len());
            for (id, region) in all.iter().enumerate() {
                regions.push(engine.register(id as u32, region.clone()).map_err(config)?);
            }
            engines.push(EngineAdvert {
                engine: engine.descriptor(),
                regions,
            });
        }
        if host_memory {
            let mut regions = Vec::with_capacity(all.len());
            for (id, region) in all.iter().enumerate() {
                regions.push(net.register(id as u32, region.clone()).map_err(config)?);
            }
            engines.push(EngineAdvert {
                engine: net.descriptor(),
                regions,
            });
        }
        let mori = match &setup.mori {
            Some(mori) => {
                let engine = start_mori(&setup.node, mori)?;
                let mut regions = Vec::with_capacity(all.len());
                for (id, region) in all.iter().enumerate() {
                    regions.push(engine.register(id as u32, region.clone()).map_err(config)?);
                }
                engines.push(EngineAdvert {
                    engine: engine.descriptor(),
                    regions,
                });
                Some(engine)
            }
            None => None,
        };
        let identity = NodeIdentity::load(&setup.certs_dir, &setup.node).map_err(|error| {
            config(format!(
                "certificates of {} in {}: {error}",
                setup.node,
                setup.certs_dir.display()
            ))
        })?;
        let incarnation = new_incarnation().map_err(|error| config(format!("incarnation: {error}")))?;
        let hello = Hello {
            node: NodeId(setup.node.clone()),
            role: setup.role,
            incarnation,
            regions: regions.clone(),
            protocol_version: PROTOCOL_VERSION,
            // Layers are matched by name, not position (pipeline stages may split them
            // differently on the two legs): only the groups must agree here.
            layout_hash: layout.groups_hash(),
            model: setup.model.clone(),
            engines,
            host: host::host_id(),
        };
        let server = match (setup.role, setup.listen) {
            (Role::Prefill, Some(listen)) => Some(
                ControlServer::start(
                    &runtime.handle(),
                    listen,
                    &identity,
                    ServerSetup {
                        cluster: setup.peers.iter().cloned().map(NodeId).collect(),
                        hello: hello.clone(),
                        service: Arc::new(HandoffService {
                            serving: serving.clone(),
                            planes: planes.clone(),
                        }),
                        tickets: Some(tickets),
                        limits: ControlLimits::default(),
                    },
                )
                .map_err(|error| config(format!("cannot serve hand-offs on {listen}: {error}")))?,
            ),
            (Role::Prefill, None) => return Err(config("a prefill worker needs a listen address")),
            _ => None,
        };
        Ok(Agent {
            node: NodeId(setup.node),
            role: setup.role,
            advertise: setup.advertise,
            layout,
            regions,
            planes,
            engine,
            net,
            mori,
            choice: setup.engine,
            memory_server: Mutex::new(memory_server),
            hello,
            identity,
            limits: setup.limits,
            serving,
            server: Mutex::new(server),
            clients: Mutex::new(HashMap::new()),
            peers: Mutex::new(HashMap::new()),
            runtime,
            _memory: memory,
        })
    }

    /// This worker's incarnation (a random id per agent start).
    pub fn incarnation(&self) -> u64 {
        self.hello.incarnation.0
    }

    /// Where a prefill worker serves hand-offs, as its peers reach it.
    pub fn address(&self) -> Option<SocketAddr> {
        lock(&self.server)
            .as_ref()
            .and_then(|server| server.local_addr().ok())
            .map(|bound| self.advertise.unwrap_or(bound))
    }

    /// This worker's node name.
    pub fn node(&self) -> &str {
        &self.node.0
    }

    /// Prefill: keeps `blocks` (per group) claimable by one decode worker for a lease.
    pub fn announce(&self, request: &str, blocks: Vec<Vec<BlockId>>) -> Result<(), AgentError> {
        self.require(Role::Prefill, "announce a hand-off")?;
        for block in blocks.iter().flatten() {
            if *block as usize >= self.serving.generations.len() / 4 {
                return Err(config(format!(
                    "request {request}: block {block} is beyond the pool's {} blocks",
                    self.serving.generations.len() / 4
                )));
            }
        }
        let now = self.serving.clock.now_ms();
        lock(&self.serving.handoffs)
            .announce(request, blocks, now)
            .map_err(config)
    }

    /// Prefill: gives up a hand-off (vLLM aborted the request). Its blocks' generations move
    /// and the request is reported finished.
    pub fn revoke(&self, request: &str) -> bool {
        let ended = lock(&self.serving.handoffs).revoke(request);
        let found = ended.is_some();
        if let Some(ended) = ended {
            self.serving.finish(ended);
        }
        found
    }

    /// Prefill: the requests whose blocks vLLM may free now (released, expired or revoked).
    pub fn finished(&self) -> Vec<String> {
        let now = self.serving.clock.now_ms();
        let expired = {
            let mut handoffs = lock(&self.serving.handoffs);
            match handoffs.poll_timeout() {
                Some(due) if due <= now => handoffs.expire(now),
                _ => Vec::new(),
            }
        };
        for ended in expired {
            tracing::warn!(request = %ended.request, "hand-off lease lapsed before any release");
            self.serving.finish(ended);
        }
        std::mem::take(&mut *lock(&self.serving.finished))
    }

    /// Decode: the READ engines this worker uses for the prefill workers it knows
    /// (`"shm"`, `"net"`), sorted and deduplicated.
    pub fn engines_in_use(&self) -> Vec<String> {
        let mut kinds: Vec<String> = lock(&self.peers)
            .values()
            .map(|peer| {
                match peer.reader.descriptor().kind {
                    EngineKind::Shm => "shm",
                    EngineKind::Net => "net",
                    EngineKind::Local => "local",
                    EngineKind::Mori => "mori",
                }
                .to_string()
            })
            .collect();
        kinds.sort();
        kinds.dedup();
        kinds
    }

    /// Prefill: hand-offs whose lease lapsed unreleased, since this agent started.
    pub fn expired_handoffs(&self) -> u64 {
        self.serving.expired.load(Ordering::Relaxed)
    }

    /// Prefill: hand-offs still live.
    pub fn live_handoffs(&self) -> usize {
        lock(&self.serving.handoffs).len()
    }

    /// Decode: READs one request's KV from prefill worker `remote_node` at `remote_address`
    /// (incarnation `remote_incarnation`) into this worker's blocks, as `pairs` say; verifies the
    /// source blocks' generations after the copy and releases the hand-off (also on failure).
    /// The prefill worker must hold every layer this one holds, blocks laid out alike.
    pub fn load(
        &self,
        request: &str,
        remote_node: &str,
        remote_address: &str,
        remote_incarnation: u64,
        pairs: Vec<Vec<BlockPair>>,
    ) -> Result<Loaded, AgentError> {
        let source = Source {
            node: remote_node.to_string(),
            address: remote_address.to_string(),
            incarnation: remote_incarnation,
        };
        self.load_stages(request, vec![vec![source]], DecodeSplit::WHOLE, pairs)
    }

    /// Refuses pairs that do not name one list per KV group.
    fn check_pairs(&self, request: &str, pairs: &[Vec<BlockPair>]) -> Result<(), AgentError> {
        if pairs.len() == self.layout.groups().len() {
            return Ok(());
        }
        Err(config(format!(
            "request {request}: pairs for {} groups, the model has {}",
            pairs.len(),
            self.layout.groups().len()
        )))
    }

    /// Decode: READs request `request`'s KV into this worker's blocks, as `pairs` say, from the
    /// prefill workers holding it. `stages` lists the prefill leg's workers per pipeline stage,
    /// in rank order (one stage: the one holding this worker's layers). Each of this worker's
    /// layers is read from the stage holding it (matched by layer name); within a stage, from
    /// the rank of the same number when the stage runs this leg's TP size and DCP split, else
    /// the heads and tokens this worker holds from the ranks holding them (`pdkv_core::heads`).
    /// Every hand-off this worker
    /// is one of the readers of is claimed and released, read or not (a stage holding none of
    /// its layers, a replica nobody reads, a load that failed), so each ends with its last
    /// reader rather than its lease. Generations are checked after every copy.
    pub fn load_stages(
        &self,
        request: &str,
        stages: Vec<Vec<Source>>,
        split: DecodeSplit,
        pairs: Vec<Vec<BlockPair>>,
    ) -> Result<Loaded, AgentError> {
        self.require(Role::Decode, "load KV")?;
        if stages.is_empty() || stages.iter().any(Vec::is_empty) {
            return Err(config(format!(
                "request {request}: every prefill pipeline stage needs a worker"
            )));
        }
        if split.tp == 0 || split.rank >= split.tp || split.stage_readers == 0 {
            return Err(config(format!(
                "rank {} of {} tensor-parallel ranks, read by {} stages, is not a decode worker",
                split.rank, split.tp, split.stage_readers
            )));
        }
        // Fails on a malformed address before anything else, as a bad setting.
        for source in stages.iter().flatten() {
            source.socket_address()?;
        }
        self.check_pairs(request, &pairs)?;
        let plans = stages
            .iter()
            .map(|stage| self.stage_reads(stage.len(), split))
            .collect::<Result<Vec<_>, _>>()?;
        self.runtime.block_on(async {
            let (owned, mut failure) = match self.plane_owners(request, &stages, &plans).await {
                Ok(owned) => (owned, None),
                Err(error) => (vec![Vec::new(); stages.len()], Some(error)),
            };
            // Every source at once: each claims, reads (or gives back) and releases on its own.
            let mut parts: Vec<LocalBoxFuture<'_, Option<Result<Loaded, AgentError>>>> = Vec::new();
            for ((stage, plan), owned) in stages.iter().zip(&plans).zip(&owned) {
                for (rank, readers, reads) in &plan.reads {
                    let source = &stage[*rank as usize];
                    if owned.is_empty() {
                        // Nothing of it is needed here (or nothing at all: the layers did not
                        // match): take this reader's place and give it back, so the hand-off
                        // ends with its other readers instead of its lease.
                        parts.push(
                            self.give_back_logged(request, source, *readers)
                                .map(|()| None)
                                .boxed_local(),
                        );
                        continue;
                    }
                    let cut = reads
                        .as_deref()
                        .zip(plan.heads)
                        .map(|(reads, heads)| (*rank, reads, heads));
                    let read = self.load_source(request, source, *readers, pairs.clone(), cut, owned);
                    parts.push(read.map(Some).boxed_local());
                }
                for rank in &plan.unread {
                    let source = &stage[*rank as usize];
                    let given = self.give_back_logged(request, source, split.stage_readers);
                    parts.push(given.map(|()| None).boxed_local());
                }
            }
            let mut loaded = Loaded { bytes: 0, runs: 0 };
            for part in join_all(parts).await.into_iter().flatten() {
                match part {
                    Ok(part) => {
                        loaded.bytes += part.bytes;
                        loaded.runs += part.runs;
                    }
                    Err(error) => {
                        failure.get_or_insert(error);
                    }
                }
            }
            match failure {
                Some(error) => Err(error),
                None => Ok(loaded),
            }
        })
    }

    /// What this worker reads of one prefill stage of `ranks` workers.
    fn stage_reads(&self, ranks: usize, split: DecodeSplit) -> Result<StageReads, AgentError> {
        let ranks = u32::try_from(ranks).map_err(|_| config(format!("{ranks} prefill ranks")))?;
        if ranks == split.tp && split.dcp == split.prefill_dcp {
            // One split: rank r's blocks whole.
            return Ok(StageReads {
                reads: vec![(split.rank, split.stage_readers, None)],
                unread: Vec::new(),
                heads: None,
            });
        }
        let order = split.order.ok_or_else(|| {
            config(format!(
                "the prefill leg runs {ranks} tensor-parallel ranks and DCP {}, this leg {} and DCP {}: \
                 KV is resharded only where a layer's page is [heads, tokens, ...] or [tokens, \
                 heads, ...] (LBHNC, LBNHC, BLHNC, BLNHC)",
                split.prefill_dcp.size, split.tp, split.dcp.size
            ))
        })?;
        let heads = HeadLoad {
            prefill: split.prefill_dcp.shards(split.kv_heads, ranks)?,
            decode: split.dcp.shards(split.kv_heads, split.tp)?,
            rank: split.rank,
            rotation: split.rotation,
            order,
        };
        let (prefill, decode) = (heads.prefill, heads.decode);
        // Heads are mapped between head groups (tp / dcp of them per leg); within a head group,
        // a decode rank reads every prefill DCP rank holding a token it holds.
        let map = HeadMap::new(prefill.heads(), decode.heads(), heads.rotation).map_err(config)?;
        let ours = decode.tokens(split.rank);
        // Decode ranks of one head group that read prefill rank `p` (the same for every group).
        let sharers = |p: u32| {
            (0..decode.dcp())
                .filter(|&share| decode.tokens(share).meets(&prefill.tokens(p)))
                .count() as u32
        };
        let mut reads: Vec<(u32, u32, Option<Vec<HeadRead>>)> = Vec::new();
        for read in map.reads(decode.group(split.rank)).map_err(config)? {
            for share in 0..prefill.dcp() {
                let p = prefill.rank(read.prefill_rank, share);
                if !prefill.tokens(p).meets(&ours) {
                    continue;
                }
                match reads.iter_mut().find(|(rank, _, _)| *rank == p) {
                    Some((_, _, Some(list))) => list.push(*read),
                    _ => {
                        // `readers` cannot fail: the head group came from the map.
                        let groups = map.readers(read.prefill_rank).unwrap_or(1);
                        let readers = groups
                            .saturating_mul(sharers(p))
                            .saturating_mul(split.stage_readers);
                        reads.push((p, readers, Some(vec![*read])));
                    }
                }
            }
        }
        // Head groups nobody reads are given back by the first DCP rank of the group they fall
        // to, every rank of them.
        let mut unread = Vec::new();
        if ours.rank == 0 {
            for group in map.releases(decode.group(split.rank)).map_err(config)? {
                unread.extend((0..prefill.dcp()).map(|share| prefill.rank(group, share)));
            }
        }
        Ok(StageReads {
            reads,
            unread,
            heads: Some(heads),
        })
    }

    /// Which of this worker's planes each prefill stage holds, by layer name (asked of a worker
    /// of the stage this one reads, which admits it): every layer must be held by exactly one
    /// stage.
    async fn plane_owners(
        &self,
        request: &str,
        stages: &[Vec<Source>],
        plans: &[StageReads],
    ) -> Result<Vec<Vec<usize>>, AgentError> {
        let layers = |reason: String| AgentError::Layers {
            request: request.to_string(),
            reason,
        };
        let mut owner: Vec<Option<usize>> = vec![None; self.planes.names.len()];
        for (stage, (sources, plan)) in stages.iter().zip(plans).enumerate() {
            // Every decode rank reads some rank of every stage (it holds at least one head).
            let asked = plan.reads.first().map_or(0, |read| read.0 as usize);
            let peer = self.source_peer(&sources[asked]).await?;
            for plane in peer.planes.names.iter() {
                let Some(&local) = self.planes.index.get(&plane.layer) else {
                    continue;
                };
                if let Some(other) = owner[local].replace(stage) {
                    return Err(layers(format!(
                        "layer {:?} is held by prefill stages {other} and {stage}",
                        plane.layer
                    )));
                }
            }
        }
        let mut owned = vec![Vec::new(); stages.len()];
        for (local, stage) in owner.iter().enumerate() {
            match stage {
                Some(stage) => owned[*stage].push(local),
                None => {
                    return Err(layers(format!(
                        "layer {:?}: no prefill worker of the {} pipeline stages holds it",
                        self.planes.names[local].layer,
                        stages.len()
                    )));
                }
            }
        }
        Ok(owned)
    }

    /// Claims one source's hand-off as one of `readers`, READs the paired blocks of the `owned`
    /// planes (whole, or only the given heads of each), verifies their generations and releases
    /// the hand-off (also on failure).
    async fn load_source(
        &self,
        request: &str,
        source: &Source,
        readers: u32,
        pairs: Vec<Vec<BlockPair>>,
        heads: Option<(u32, &[HeadRead], HeadLoad)>,
        owned: &[usize],
    ) -> Result<Loaded, AgentError> {
        let peer = self.source_peer(source).await?;
        let claimed = self.claim(&peer, &source.node, request, readers).await?;
        let result = async {
            let planes = self
                .match_planes(&peer, owned)
                .map_err(|reason| AgentError::Layers {
                    request: request.to_string(),
                    reason: format!("prefill worker {}: {reason}", source.node),
                })?;
            let slices = heads
                .map(|(rank, reads, heads)| self.head_slices(&peer, rank, reads, heads, &planes))
                .transpose()
                .map_err(|reason| AgentError::Read {
                    request: request.to_string(),
                    reason,
                })?;
            match self
                .read(&peer, request, &claimed, pairs.clone(), slices.as_deref(), &planes)
                .await
            {
                // The memory server closed the data connection (idle too long, or it broke):
                // dial it again with a fresh ticket and read once more (a READ only copies into
                // this worker's own blocks, so repeating it is safe).
                Err(AgentError::DataConnection { reason, .. }) if peer.dialled => {
                    tracing::info!(request, node = %source.node, %reason, "data connection broke; dialling again");
                    self.dial(&peer, &source.node).await?;
                    self.read(&peer, request, &claimed, pairs, slices.as_deref(), &planes)
                        .await
                }
                result => result,
            }
        }
        .await;
        if let Err(error) = self.release_claimed(&peer, &source.node, request).await {
            tracing::warn!(request, node = %source.node, %error, "release not acknowledged; the lease will lapse");
        }
        result
    }

    /// `(local plane, the peer's plane of the same layer)` for each of the `owned` planes.
    fn match_planes(&self, peer: &Peer, owned: &[usize]) -> Result<Vec<(usize, usize)>, String> {
        owned
            .iter()
            .map(|&local| {
                let ours = &self.planes.names[local];
                let remote = *peer
                    .planes
                    .index
                    .get(&ours.layer)
                    .ok_or_else(|| format!("it holds no layer {:?}", ours.layer))?;
                let theirs = peer.planes.names[remote].group;
                if theirs != ours.group {
                    return Err(format!(
                        "layer {:?} is in KV group {} here, {theirs} there",
                        ours.layer, ours.group
                    ));
                }
                Ok((local, remote))
            })
            .collect()
    }

    /// [`Self::give_back`], logging a failure: the hand-off's lease then ends it.
    async fn give_back_logged(&self, request: &str, source: &Source, readers: u32) {
        if let Err(error) = self.give_back(request, source, readers).await {
            tracing::info!(request, node = %source.node, %error, "hand-off not given back; its lease will end it");
        }
    }

    /// Claims a source's hand-off as one of `readers` and releases it unread.
    async fn give_back(&self, request: &str, source: &Source, readers: u32) -> Result<(), AgentError> {
        let peer = self.source_peer(source).await?;
        self.claim(&peer, &source.node, request, readers).await?;
        self.release_claimed(&peer, &source.node, request).await
    }

    async fn source_peer(&self, source: &Source) -> Result<Peer, AgentError> {
        self.peer(
            &source.node,
            source.socket_address()?,
            Incarnation(source.incarnation),
        )
        .await
    }

    /// Per matched plane, the byte ranges of a block holding `reads`' heads for the tokens both
    /// prefill rank `prefill_rank` and this worker hold. Planes of a recurrent state cannot be
    /// cut, nor a group split over DCP ranks otherwise than its leg.
    fn head_slices(
        &self,
        peer: &Peer,
        prefill_rank: u32,
        reads: &[HeadRead],
        heads: HeadLoad,
        planes: &[(usize, usize)],
    ) -> Result<Vec<Vec<BlockSlice>>, String> {
        let (remote_heads, local_heads) = (
            heads.prefill.heads().heads_per_rank(),
            heads.decode.heads().heads_per_rank(),
        );
        let (remote_tokens, local_tokens): (TokenShard, TokenShard) = (
            heads.prefill.tokens(prefill_rank),
            heads.decode.tokens(heads.rank),
        );
        let mut slices = Vec::with_capacity(planes.len());
        for &(plane, remote_plane) in planes {
            let group = self.layout.layer_groups()[plane];
            let spec = self.layout.groups()[group];
            let attention = matches!(
                spec.kind(),
                GroupKind::Full | GroupKind::SlidingWindow { .. } | GroupKind::ChunkedLocal { .. }
            );
            if !attention || spec.dcp() != heads.decode.dcp() {
                return Err(format!(
                    "group {group} ({}, dcp {}) cannot be read across different tensor-parallel or \
                     DCP splits: only attention groups split over all of the leg's {} DCP ranks are",
                    spec.kind(),
                    spec.dcp(),
                    heads.decode.dcp()
                ));
            }
            let tokens = u32::try_from(spec.effective_block_size()).map_err(|_| {
                format!(
                    "group {group}: a scheduler block of {} tokens",
                    spec.effective_block_size()
                )
            })?;
            // A block packing several layers holds one page per layer, one after another: each
            // page is cut alike, at its own offset on either side.
            let (local, remote) = (&self.planes.names[plane], &peer.planes.names[remote_plane]);
            let mut plane_slices = Vec::new();
            for page in 0..local.pages() {
                let (local_base, remote_base) = (page * local.page_bytes, page * remote.page_bytes);
                for read in reads {
                    let cut = shard_slices(
                        read,
                        heads.order,
                        tokens,
                        RankBlock {
                            heads: remote_heads,
                            tokens: remote_tokens,
                            block_bytes: remote.page_bytes,
                        },
                        RankBlock {
                            heads: local_heads,
                            tokens: local_tokens,
                            block_bytes: local.page_bytes,
                        },
                    )
                    .map_err(|error| format!("plane {plane}: {error}"))?;
                    plane_slices.extend(cut.into_iter().map(|slice| BlockSlice {
                        local_offset: local_base + slice.local_offset,
                        remote_offset: remote_base + slice.remote_offset,
                        ..slice
                    }));
                }
            }
            slices.push(plane_slices);
        }
        Ok(slices)
    }

    /// Decode: gives back request `request`'s hand-off at prefill worker `remote_node` without
    /// reading it (the decoder needs none of its KV: a one-token prompt, or a prompt its prefix
    /// cache already holds), so the prefill frees the blocks now instead of when the lease lapses.
    /// Waits for the announcement as a load does (`claim_wait`), then claims and releases.
    pub fn release(
        &self,
        request: &str,
        remote_node: &str,
        remote_address: &str,
        remote_incarnation: u64,
    ) -> Result<(), AgentError> {
        self.require(Role::Decode, "release a hand-off")?;
        let source = Source {
            node: remote_node.to_string(),
            address: remote_address.to_string(),
            incarnation: remote_incarnation,
        };
        self.runtime.block_on(self.give_back(request, &source, 1))
    }

    /// Ends a claimed hand-off.
    async fn release_claimed(&self, peer: &Peer, node: &str, request: &str) -> Result<(), AgentError> {
        let released = peer
            .connection
            .request::<_, HandoffResponse>(
                HandoffRequest::Release {
                    request: request.to_string(),
                },
                self.limits.request,
            )
            .await;
        match released {
            Ok(_) => Ok(()),
            Err(ControlError::Refused(reason)) => Err(AgentError::HandoffRefused {
                node: node.to_string(),
                request: request.to_string(),
                reason,
            }),
            Err(error) => Err(AgentError::Unreachable {
                node: node.to_string(),
                address: String::new(),
                reason: error.to_string(),
            }),
        }
    }

    /// Stops serving: every live hand-off is revoked (generations move, requests are finished)
    /// and every connection closes.
    pub fn close(&self) -> Vec<String> {
        let ended = lock(&self.serving.handoffs).revoke_all();
        for ended in ended {
            self.serving.finish(ended);
        }
        if let Some(server) = lock(&self.server).take() {
            server.close();
        }
        drop(lock(&self.memory_server).take());
        for client in lock(&self.clients).values() {
            client.close();
        }
        lock(&self.peers).clear();
        std::mem::take(&mut *lock(&self.serving.finished))
    }

    fn require(&self, role: Role, what: &str) -> Result<(), AgentError> {
        if self.role == role {
            Ok(())
        } else {
            Err(config(format!("a {} worker cannot {what}", self.role)))
        }
    }

    fn client(&self, ipv6: bool) -> Result<ControlClient, AgentError> {
        let mut clients = lock(&self.clients);
        if let Some(client) = clients.get(&ipv6) {
            return Ok(client.clone());
        }
        let bind = if ipv6 {
            SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0)
        } else {
            SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0)
        };
        let client = ControlClient::new(&self.runtime.handle(), bind, &self.identity)
            .map_err(|error| config(format!("control client: {error}")))?;
        clients.insert(ipv6, client.clone());
        Ok(client)
    }

    /// The connection to a prefill worker of incarnation `expected`, dialling it (again) when
    /// there is none, it closed, or it belongs to another incarnation.
    async fn peer(&self, node: &str, address: SocketAddr, expected: Incarnation) -> Result<Peer, AgentError> {
        let key = (node.to_string(), address.to_string());
        let cached = lock(&self.peers).get(&key).cloned();
        if let Some(peer) = cached
            && peer.connection.is_open()
            && peer.connection.peer.incarnation == expected
        {
            return Ok(peer);
        }
        let unreachable = |reason: String| AgentError::Unreachable {
            node: node.to_string(),
            address: address.to_string(),
            reason,
        };
        let connection = self
            .client(address.is_ipv6())?
            .connect(address, node, &self.hello, self.limits.connect)
            .await
            .map_err(|error| match error {
                ControlError::Handshake(error) => AgentError::Incompatible {
                    node: node.to_string(),
                    address: address.to_string(),
                    reason: error.to_string(),
                },
                error => unreachable(error.to_string()),
            })?;
        let theirs = &connection.peer;
        if theirs.incarnation != expected {
            connection.close();
            return Err(AgentError::Restarted {
                node: node.to_string(),
                expected: expected.0,
                found: theirs.incarnation.0,
            });
        }
        let ours = |kind: EngineKind| self.hello.engines.iter().any(|advert| advert.engine.kind == kind);
        let preference: &[EngineKind] = match self.choice {
            EngineChoice::Auto => &[EngineKind::Mori, EngineKind::Shm, EngineKind::Net],
            EngineChoice::Mori => &[EngineKind::Mori],
            EngineChoice::Shm => &[EngineKind::Shm],
            EngineChoice::Net => &[EngineKind::Net],
        };
        // mori reads whatever memory it registered; shm and the network read only KV this
        // worker offers through them (none when the KV is on a GPU).
        let usable: Vec<EngineKind> = preference
            .iter()
            .copied()
            .filter(|&kind| match kind {
                EngineKind::Mori => self.mori.is_some(),
                kind => ours(kind),
            })
            .collect();
        let kind = match choose_engine(&usable, &self.hello.host, theirs) {
            Ok(index) => usable[index],
            Err(error) => {
                connection.close();
                let hint = match self.choice {
                    EngineChoice::Mori => "; read_engine is \"mori\": both workers need a mori engine",
                    EngineChoice::Shm => {
                        "; read_engine is \"shm\", but the prefill worker runs on another host or either \
                         side's KV is not in shared memory"
                    }
                    _ if !ours(EngineKind::Net) && !ours(EngineKind::Shm) => {
                        "; this worker's KV is on a GPU: only mori READs GPU memory"
                    }
                    _ => "",
                };
                return Err(unreachable(format!("{error}{hint}")));
            }
        };
        let Some(advert) = theirs.engines.iter().find(|advert| advert.engine.kind == kind) else {
            connection.close();
            return Err(unreachable(format!("it offers no {kind:?} READ engine")));
        };
        let reader: Arc<dyn ReadEngine> = match (kind, &self.mori) {
            (EngineKind::Mori, Some(mori)) => {
                mori.register_remote(&advert.engine, &advert.regions)
                    .map_err(|error| unreachable(format!("its mori engine: {error}")))?;
                mori.clone()
            }
            (EngineKind::Shm, _) => {
                self.engine
                    .register_remote(&advert.engine, &advert.regions)
                    .map_err(|error| unreachable(format!("its shared memory: {error}")))?;
                self.engine.clone()
            }
            _ => {
                self.net
                    .register_remote(&advert.engine, &advert.regions)
                    .map_err(|error| unreachable(format!("its memory server: {error}")))?;
                let ticket = connection
                    .ticket(self.limits.request)
                    .await
                    .map_err(|error| unreachable(format!("no data ticket: {error}")))?;
                self.net
                    .connect(&advert.engine.key, &self.node, ticket, self.limits.connect)
                    .await
                    .map_err(|error| {
                        unreachable(format!("its memory server at {}: {error}", advert.engine.address))
                    })?;
                self.net.clone()
            }
        };
        let planes = match connection
            .request::<_, HandoffResponse>(HandoffRequest::Planes, self.limits.request)
            .await
        {
            Ok(HandoffResponse::Planes(planes)) if planes.len() == theirs.regions.layers.len() => planes,
            Ok(HandoffResponse::Planes(planes)) => {
                connection.close();
                return Err(unreachable(format!(
                    "it names {} planes and places {}",
                    planes.len(),
                    theirs.regions.layers.len()
                )));
            }
            Ok(_) => {
                connection.close();
                return Err(unreachable(
                    "it answered the plane query with something else".into(),
                ));
            }
            Err(error) => {
                connection.close();
                return Err(unreachable(format!("its planes: {error}")));
            }
        };
        let planes = match PlaneTable::new(planes) {
            Ok(planes) => planes,
            Err(error) => {
                connection.close();
                return Err(unreachable(format!("its planes: {error}")));
            }
        };
        let peer = Peer {
            regions: theirs.regions.clone(),
            planes: Arc::new(planes),
            engine: advert.engine.key.clone(),
            dialled: kind == EngineKind::Net,
            reader,
            connection,
        };
        lock(&self.peers).insert(key, peer.clone());
        Ok(peer)
    }

    /// Opens a new data connection to `peer`'s memory server with a fresh ticket from its control
    /// connection (replacing one the server closed).
    async fn dial(&self, peer: &Peer, node: &str) -> Result<(), AgentError> {
        let unreachable = |reason: String| AgentError::Unreachable {
            node: node.to_string(),
            address: peer.engine.to_string(),
            reason,
        };
        let ticket = peer
            .connection
            .ticket(self.limits.request)
            .await
            .map_err(|error| unreachable(format!("no data ticket: {error}")))?;
        self.net
            .connect(&peer.engine, &self.node, ticket, self.limits.connect)
            .await
            .map_err(|error| unreachable(format!("its memory server: {error}")))
    }

    /// Claims the hand-off as one of `readers` decode workers, asking again (bounded) while the
    /// prefill worker has not announced it.
    async fn claim(
        &self,
        peer: &Peer,
        node: &str,
        request: &str,
        readers: u32,
    ) -> Result<Claimed, AgentError> {
        let started = Instant::now();
        let mut backoff = Duration::from_millis(1);
        loop {
            let answer = peer
                .connection
                .request::<_, HandoffResponse>(
                    HandoffRequest::Claim {
                        request: request.to_string(),
                        readers,
                    },
                    self.limits.request,
                )
                .await;
            match answer {
                Ok(HandoffResponse::Claimed {
                    grant,
                    blocks,
                    generations,
                    ..
                }) => return Claimed::new(request, grant, blocks, generations),
                Ok(HandoffResponse::NotYet) => {
                    let waited = started.elapsed();
                    if waited >= self.limits.claim_wait {
                        return Err(AgentError::HandoffMissing {
                            node: node.to_string(),
                            request: request.to_string(),
                            waited_ms: waited.as_millis() as u64,
                        });
                    }
                    tokio::time::sleep(backoff.min(self.limits.claim_wait - waited)).await;
                    backoff = (backoff * 2).min(Duration::from_millis(50));
                }
                Ok(other @ (HandoffResponse::Released | HandoffResponse::Planes(_))) => {
                    return Err(AgentError::Read {
                        request: request.to_string(),
                        reason: format!("{node} answered a claim with {other:?}"),
                    });
                }
                Err(ControlError::Refused(reason)) => {
                    return Err(AgentError::HandoffRefused {
                        node: node.to_string(),
                        request: request.to_string(),
                        reason,
                    });
                }
                Err(error) => {
                    return Err(AgentError::Unreachable {
                        node: node.to_string(),
                        address: String::new(),
                        reason: error.to_string(),
                    });
                }
            }
        }
    }

    async fn read(
        &self,
        peer: &Peer,
        request: &str,
        claimed: &Claimed,
        pairs: Vec<Vec<BlockPair>>,
        slices: Option<&[Vec<BlockSlice>]>,
        planes: &[(usize, usize)],
    ) -> Result<Loaded, AgentError> {
        let read_error = |reason: String| AgentError::Read {
            request: request.to_string(),
            reason,
        };
        // The matched planes only, in this worker's order: the layers this source holds.
        let layout = KvLayout::new(
            self.layout.groups().to_vec(),
            planes
                .iter()
                .map(|&(local, _)| self.layout.layer_groups()[local])
                .collect(),
        )
        .map_err(|error| read_error(error.to_string()))?;
        let local = RegionLayout {
            layers: planes
                .iter()
                .map(|&(local, _)| self.regions.layers[local])
                .collect(),
            generations: self.regions.generations.clone(),
            ..RegionLayout::default()
        };
        let remote = RegionLayout {
            layers: planes
                .iter()
                .map(|&(_, remote)| peer.regions.layers[remote])
                .collect(),
            generations: peer.regions.generations.clone(),
            ..RegionLayout::default()
        };
        // Every source block must be part of the hand-off; its generation now is the one it
        // must still show after the copy.
        let mut checks = Vec::new();
        for (group, list) in pairs.iter().enumerate() {
            for pair in list {
                let generation =
                    claimed
                        .generation(group, pair.remote)
                        .ok_or_else(|| AgentError::NotHandedOff {
                            request: request.to_string(),
                            group,
                            block: pair.remote,
                        })?;
                checks.push(GenerationCheck {
                    group,
                    block: pair.remote,
                    generation,
                });
            }
        }
        let pairing = Pairing { groups: pairs };
        let plan = match slices {
            None => plan::plan(&layout, &pairing, &local, &remote),
            Some(slices) => plan::plan_slices(&layout, &pairing, &local, &remote, slices),
        }
        .map_err(|error| read_error(error.to_string()))?;
        let read = KvRead {
            engine: peer.reader.as_ref(),
            remote: &peer.engine,
            grant: claimed.grant,
            plan: &plan,
            remote_regions: &peer.regions,
            checks: &checks,
            timeout: self.limits.read,
        };
        let report = read.run().await.map_err(|error| match error {
            KvReadError::Stale {
                group,
                block,
                expected,
                found,
            } => AgentError::Stale {
                request: request.to_string(),
                group,
                block,
                expected,
                found,
            },
            KvReadError::Engine(EngineError::Io(reason)) => AgentError::DataConnection {
                request: request.to_string(),
                reason,
            },
            other => read_error(other.to_string()),
        })?;
        Ok(Loaded {
            bytes: report.bytes,
            runs: report.runs,
        })
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.close();
    }
}

/// A claimed hand-off: each block's generation at claim time.
struct Claimed {
    grant: GrantId,
    generations: Vec<HashMap<BlockId, u32>>,
}

impl Claimed {
    fn new(
        request: &str,
        grant: GrantId,
        blocks: Vec<Vec<BlockId>>,
        generations: Vec<Vec<u32>>,
    ) -> Result<Self, AgentError> {
        if blocks.len() != generations.len()
            || blocks.iter().zip(&generations).any(|(b, g)| b.len() != g.len())
        {
            return Err(AgentError::Read {
                request: request.to_string(),
                reason: "the claim's generations do not match its blocks".into(),
            });
        }
        Ok(Claimed {
            grant,
            generations: blocks
                .into_iter()
                .zip(generations)
                .map(|(blocks, generations)| blocks.into_iter().zip(generations).collect())
                .collect(),
        })
    }

    fn generation(&self, group: usize, block: BlockId) -> Option<u32> {
        self.generations.get(group)?.get(&block).copied()
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use pdkv_core::layout::GroupKind;

    use super::*;

    const BLOCKS: u32 = 8;
    const PAGE: u64 = 256;

    struct Leg {
        agent: Agent,
        memory: File,
    }

    fn certs() -> std::path::PathBuf {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "pdkv-agent-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        ));
        pdkv_transport::tls::write_cluster_certs(
            &dir,
            "pdkv",
            &["p0", "p1", "d0", "d1", "stranger"],
            pdkv_transport::tls::Existing::Replace,
        )
        .unwrap();
        dir
    }

    fn limits() -> AgentLimits {
        AgentLimits {
            lease: Duration::from_secs(30),
            max_handoffs: 16,
            claim_wait: Duration::from_millis(100),
            connect: Duration::from_secs(5),
            request: Duration::from_secs(5),
            read: Duration::from_secs(5),
            data_idle: None,
        }
    }

    /// An agent of one full group (block size 4) whose memory holds two planes (K and V) of
    /// `BLOCKS` pages each; a prefill listens on loopback.
    fn setup(
        dir: &std::path::Path,
        node: &str,
        role: Role,
        peers: &[&str],
        memory: Memory,
        engine: EngineChoice,
        mori: Option<MoriSetup>,
    ) -> AgentSetup {
        AgentSetup {
            node: node.into(),
            role,
            certs_dir: dir.to_path_buf(),
            peers: peers.iter().map(|peer| peer.to_string()).collect(),
            groups: vec![GroupSpec::new(GroupKind::Full, Some(4), 1).unwrap()],
            model: model("float32"),
            memory: vec![memory],
            planes: (0..2)
                .map(|plane| Plane {
                    region: 0,
                    offset: plane * PAGE * u64::from(BLOCKS),
                    bytes_per_block: PAGE,
                    group: 0,
                    layer: format!("layers.{plane}"),
                    page_bytes: PAGE,
                })
                .collect(),
            num_blocks: BLOCKS,
            listen: (role == Role::Prefill).then(|| "127.0.0.1:0".parse().unwrap()),
            data_listen: None,
            advertise: None,
            data_advertise: None,
            engine,
            mori,
            limits: limits(),
        }
    }

    /// A leg with one memfd of two planes (K and V) of `BLOCKS` pages each, one full group.
    fn leg(dir: &std::path::Path, node: &str, role: Role, peers: &[&str]) -> Leg {
        leg_with(dir, node, role, peers, EngineChoice::Auto)
    }

    fn leg_with(dir: &std::path::Path, node: &str, role: Role, peers: &[&str], engine: EngineChoice) -> Leg {
        leg_of_model(dir, node, role, peers, engine, model("float32"))
    }

    fn leg_of_model(
        dir: &std::path::Path,
        node: &str,
        role: Role,
        peers: &[&str],
        engine: EngineChoice,
        model: ModelFields,
    ) -> Leg {
        let (memory, mut setup) = memfd_setup(dir, node, role, peers, 2, engine);
        setup.model = model;
        let agent = Agent::start(setup).unwrap();
        Leg { agent, memory }
    }

    /// A model identity as the connector sends it, differing only in its KV dtype.
    fn model(kv_cache_dtype: &str) -> ModelFields {
        ModelFields::new([
            ("served_model_name".to_string(), "tiny".to_string()),
            ("kv_cache_dtype".to_string(), kv_cache_dtype.to_string()),
        ])
        .unwrap()
    }

    fn page(leg: &Leg, plane: u64, block: u32) -> Vec<u8> {
        use std::os::unix::fs::FileExt;
        let mut bytes = vec![0; PAGE as usize];
        let offset = plane * PAGE * u64::from(BLOCKS) + u64::from(block) * PAGE;
        leg.memory.read_exact_at(&mut bytes, offset).unwrap();
        bytes
    }

    fn fill(leg: &Leg, plane: u64, block: u32, value: u8) {
        use std::os::unix::fs::FileExt;
        let offset = plane * PAGE * u64::from(BLOCKS) + u64::from(block) * PAGE;
        leg.memory
            .write_all_at(&vec![value; PAGE as usize], offset)
            .unwrap();
    }

    fn pairs(list: &[(u32, u32)]) -> Vec<Vec<BlockPair>> {
        vec![
            list.iter()
                .enumerate()
                .map(|(position, &(remote, local))| BlockPair {
                    remote_position: position as u64,
                    local_position: position as u64,
                    remote,
                    local,
                })
                .collect(),
        ]
    }

    fn address(leg: &Leg) -> String {
        leg.agent.address().unwrap().to_string()
    }

    #[test]
    fn a_load_through_shared_memory_copies_exactly_the_paired_blocks_and_releases_the_handoff() {
        load_copies_exactly_the_paired_blocks(EngineChoice::Shm);
    }

    #[test]
    fn a_load_over_the_network_copies_exactly_the_paired_blocks_and_releases_the_handoff() {
        load_copies_exactly_the_paired_blocks(EngineChoice::Net);
    }

    /// The prefill's memory server closes a data connection idle past `data_idle`; the next
    /// load's READ finds it closed, dials again with a fresh ticket and reads, instead of
    /// failing (and failing every load after it).
    #[test]
    fn a_load_after_the_memory_server_closed_an_idle_data_connection_dials_again() {
        let dir = certs();
        let idle = Duration::from_millis(200);
        let (prefill_memory, mut prefill_setup) =
            memfd_setup(&dir, "p0", Role::Prefill, &["d0"], 2, EngineChoice::Net);
        prefill_setup.limits.data_idle = Some(idle);
        let prefill = Leg {
            agent: Agent::start(prefill_setup).unwrap(),
            memory: prefill_memory,
        };
        let decode = leg_with(&dir, "d0", Role::Decode, &["p0"], EngineChoice::Net);
        let incarnation = prefill.agent.incarnation();
        for (round, request) in ["r1", "r2", "r3"].into_iter().enumerate() {
            let value = 10 + round as u8;
            fill(&prefill, 0, 3, value);
            fill(&prefill, 1, 3, value);
            prefill.agent.announce(request, vec![vec![3]]).unwrap();
            let loaded = decode
                .agent
                .load(request, "p0", &address(&prefill), incarnation, pairs(&[(3, 5)]))
                .unwrap_or_else(|error| panic!("round {round}: {error}"));
            assert_eq!(loaded.bytes, 2 * PAGE);
            assert_eq!(page(&decode, 0, 5), vec![value; PAGE as usize], "round {round}");
            // Past the server's idle timeout: it closes the data connection.
            std::thread::sleep(idle * 3);
        }
    }

    fn load_copies_exactly_the_paired_blocks(engine: EngineChoice) {
        let dir = certs();
        let prefill = leg(&dir, "p0", Role::Prefill, &["d0"]);
        let decode = leg_with(&dir, "d0", Role::Decode, &["p0"], engine);
        for block in 1..BLOCKS {
            fill(&prefill, 0, block, block as u8);
            fill(&prefill, 1, block, 100 + block as u8);
        }
        prefill.agent.announce("r1", vec![vec![3, 5]]).unwrap();
        let loaded = decode
            .agent
            .load(
                "r1",
                "p0",
                &address(&prefill),
                prefill.agent.incarnation(),
                pairs(&[(3, 6), (5, 2)]),
            )
            .unwrap();
        assert_eq!(loaded.bytes, 4 * PAGE, "two blocks of two planes");
        for (local, remote) in [(6, 3u8), (2, 5)] {
            assert_eq!(page(&decode, 0, local), vec![remote; PAGE as usize]);
            assert_eq!(page(&decode, 1, local), vec![100 + remote; PAGE as usize]);
        }
        for untouched in [1, 3, 4, 5, 7] {
            assert_eq!(
                page(&decode, 0, untouched),
                vec![0; PAGE as usize],
                "block {untouched}"
            );
        }
        assert_eq!(prefill.agent.finished(), vec!["r1".to_string()]);
        assert_eq!(prefill.agent.live_handoffs(), 0);
        assert_eq!(
            prefill.agent.serving.generations.load_u32(3).unwrap(),
            1,
            "released blocks moved on"
        );
        assert_eq!(prefill.agent.serving.generations.load_u32(4).unwrap(), 0);
        // A second load of the same hand-off is refused: it was released.
        let again = decode.agent.load(
            "r1",
            "p0",
            &address(&prefill),
            prefill.agent.incarnation(),
            pairs(&[(3, 6)]),
        );
        assert!(
            matches!(again, Err(AgentError::HandoffRefused { .. })),
            "{again:?}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A prefill worker bound to every interface advertises the addresses it was given, for its
    /// hand-offs and for its memory server, so a decoder reading over the network reaches it
    /// there (a decoder dialling the bound 0.0.0.0 would reach itself).
    #[test]
    fn a_worker_bound_to_every_interface_is_reached_at_its_advertised_addresses() {
        let dir = certs();
        let (memory, mut prefill_setup) =
            memfd_setup(&dir, "p0", Role::Prefill, &["d0"], 2, EngineChoice::Auto);
        let control = std::net::UdpSocket::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let data = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        prefill_setup.listen = Some(format!("0.0.0.0:{control}").parse().unwrap());
        prefill_setup.data_listen = Some(format!("0.0.0.0:{data}").parse().unwrap());
        prefill_setup.advertise = Some(format!("127.0.0.1:{control}").parse().unwrap());
        prefill_setup.data_advertise = Some(format!("127.0.0.1:{data}").parse().unwrap());
        let prefill = Leg {
            agent: Agent::start(prefill_setup).unwrap(),
            memory,
        };
        let advertised = prefill.agent.address().unwrap();
        assert_eq!(advertised.to_string(), format!("127.0.0.1:{control}"));
        let net = prefill
            .agent
            .hello
            .engines
            .iter()
            .find(|advert| advert.engine.kind == EngineKind::Net)
            .expect("a memory server");
        assert_eq!(net.engine.address, format!("127.0.0.1:{data}"));
        let decode = leg_with(&dir, "d0", Role::Decode, &["p0"], EngineChoice::Net);
        fill(&prefill, 0, 2, 7);
        prefill.agent.announce("r5", vec![vec![2]]).unwrap();
        decode
            .agent
            .load(
                "r5",
                "p0",
                &advertised.to_string(),
                prefill.agent.incarnation(),
                pairs(&[(2, 4)]),
            )
            .unwrap();
        assert_eq!(page(&decode, 0, 4), vec![7; PAGE as usize]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A decoder that needs none of a hand-off's KV gives it back unread: the prefill frees the
    /// blocks (their generations move) at once, nothing is copied, and the hand-off cannot be
    /// claimed again.
    /// A memfd of `planes` planes of `BLOCKS` pages each.
    fn kv_memfd(planes: u64) -> File {
        let memory = memfd::MemfdOptions::default().create("kv").unwrap().into_file();
        memory.set_len(planes * PAGE * u64::from(BLOCKS)).unwrap();
        memory
    }

    /// [`setup`] over a fresh memfd of `planes` planes, which must outlive the agent.
    fn memfd_setup(
        dir: &std::path::Path,
        node: &str,
        role: Role,
        peers: &[&str],
        planes: u64,
        engine: EngineChoice,
    ) -> (File, AgentSetup) {
        let memory = kv_memfd(planes);
        let setup = setup(
            dir,
            node,
            role,
            peers,
            Memory::Memfd(memory.as_raw_fd()),
            engine,
            None,
        );
        (memory, setup)
    }

    /// A leg whose memfd holds one plane of `BLOCKS` pages per layer in `layers`, one full group.
    fn leg_of_layers(dir: &std::path::Path, node: &str, role: Role, peers: &[&str], layers: &[&str]) -> Leg {
        let (memory, mut setup) =
            memfd_setup(dir, node, role, peers, layers.len() as u64, EngineChoice::Auto);
        setup.planes = layers
            .iter()
            .enumerate()
            .map(|(plane, layer)| Plane {
                region: 0,
                offset: plane as u64 * PAGE * u64::from(BLOCKS),
                bytes_per_block: PAGE,
                group: 0,
                layer: layer.to_string(),
                page_bytes: PAGE,
            })
            .collect();
        Leg {
            agent: Agent::start(setup).unwrap(),
            memory,
        }
    }

    fn source(leg: &Leg) -> Source {
        Source {
            node: leg.agent.node().to_string(),
            address: address(leg),
            incarnation: leg.agent.incarnation(),
        }
    }

    /// Two decode stages reading by layer from two prefill stages that split the layers
    /// differently (PP 2 on both legs, stage boundaries apart: the decoder's stages span both
    /// prefill stages).
    #[test]
    fn each_layer_is_read_from_the_pipeline_stage_holding_it_and_every_stage_handoff_ends() {
        let dir = certs();
        let decoders = ["d0", "d1"];
        let stage0 = leg_of_layers(&dir, "p0", Role::Prefill, &decoders, &["l0", "l1"]);
        let stage1 = leg_of_layers(&dir, "p1", Role::Prefill, &decoders, &["l2", "l3"]);
        let d0 = leg_of_layers(&dir, "d0", Role::Decode, &["p0", "p1"], &["l1", "l2"]);
        let d1 = leg_of_layers(&dir, "d1", Role::Decode, &["p0", "p1"], &["l0", "l3"]);
        // Layer l's block b holds 16·l + b on the prefill leg (plane l mod 2 of stage l div 2).
        for (stage, leg) in [&stage0, &stage1].into_iter().enumerate() {
            for plane in 0..2u64 {
                for block in 0..BLOCKS {
                    fill(
                        leg,
                        plane,
                        block,
                        (16 * (2 * stage as u32 + plane as u32) + block) as u8,
                    );
                }
            }
            leg.agent.announce("r1", vec![vec![3, 5]]).unwrap();
        }
        let stages = vec![vec![source(&stage0)], vec![source(&stage1)]];
        let split = DecodeSplit {
            stage_readers: 2,
            ..DecodeSplit::WHOLE
        };
        for decoder in [&d0, &d1] {
            let loaded = decoder
                .agent
                .load_stages("r1", stages.clone(), split, pairs(&[(3, 6), (5, 2)]))
                .unwrap();
            assert_eq!(loaded.bytes, 4 * PAGE, "two layers of two blocks each");
        }
        for (decoder, layers) in [(&d0, [1u32, 2]), (&d1, [0, 3])] {
            for (plane, layer) in layers.into_iter().enumerate() {
                for (local, remote) in [(6, 3u32), (2, 5)] {
                    let expected = (16 * layer + remote) as u8;
                    assert_eq!(
                        page(decoder, plane as u64, local),
                        vec![expected; PAGE as usize],
                        "layer {layer}"
                    );
                }
                assert_eq!(
                    page(decoder, plane as u64, 4),
                    vec![0; PAGE as usize],
                    "unpaired block untouched"
                );
            }
        }
        // Each prefill stage was read by both decode stages: its hand-off ends with the second.
        assert_eq!(stage0.agent.live_handoffs(), 0);
        assert_eq!(stage1.agent.live_handoffs(), 0);
        assert_eq!(stage0.agent.finished(), vec!["r1".to_string()]);
    }

    #[test]
    fn a_layer_no_prefill_stage_holds_fails_the_load_naming_it_and_gives_the_handoffs_back() {
        let dir = certs();
        let stage0 = leg_of_layers(&dir, "p0", Role::Prefill, &["d0"], &["l0", "l1"]);
        let stage1 = leg_of_layers(&dir, "p1", Role::Prefill, &["d0"], &["l2", "l3"]);
        let decoder = leg_of_layers(&dir, "d0", Role::Decode, &["p0", "p1"], &["l1", "l9"]);
        for leg in [&stage0, &stage1] {
            fill(leg, 1, 3, 7);
            leg.agent.announce("r1", vec![vec![3]]).unwrap();
        }
        let stages = vec![vec![source(&stage0)], vec![source(&stage1)]];
        let failed = decoder
            .agent
            .load_stages("r1", stages, DecodeSplit::WHOLE, pairs(&[(3, 6)]));
        match failed {
            Err(AgentError::Layers { request, reason }) => {
                assert_eq!(request, "r1");
                assert!(
                    reason.contains("\"l9\"") && reason.contains("2 pipeline stages"),
                    "{reason}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(page(&decoder, 0, 6), vec![0; PAGE as usize], "nothing read");
        assert_eq!(
            stage0.agent.live_handoffs(),
            0,
            "given back, not left to its lease"
        );
        assert_eq!(stage1.agent.live_handoffs(), 0);
    }

    #[test]
    fn a_layer_two_prefill_stages_hold_fails_the_load_naming_both() {
        let dir = certs();
        let stage0 = leg_of_layers(&dir, "p0", Role::Prefill, &["d0"], &["l0", "l1"]);
        let stage1 = leg_of_layers(&dir, "p1", Role::Prefill, &["d0"], &["l1", "l2"]);
        let decoder = leg_of_layers(&dir, "d0", Role::Decode, &["p0", "p1"], &["l1"]);
        for leg in [&stage0, &stage1] {
            leg.agent.announce("r1", vec![vec![3]]).unwrap();
        }
        let stages = vec![vec![source(&stage0)], vec![source(&stage1)]];
        let failed = decoder
            .agent
            .load_stages("r1", stages, DecodeSplit::WHOLE, pairs(&[(3, 6)]));
        assert!(
            matches!(&failed, Err(AgentError::Layers { reason, .. }) if reason.contains("\"l1\" is held by prefill stages 0 and 1")),
            "{failed:?}"
        );
        assert_eq!(stage0.agent.live_handoffs(), 0);
        assert_eq!(stage1.agent.live_handoffs(), 0);
    }

    #[test]
    fn a_worker_naming_one_layer_twice_is_refused_at_start() {
        let dir = certs();
        let (_memory, mut setup) = memfd_setup(&dir, "d0", Role::Decode, &["p0"], 2, EngineChoice::Auto);
        for plane in &mut setup.planes {
            plane.layer = "l0".into();
        }
        match Agent::start(setup) {
            Err(AgentError::Config(message)) => assert_eq!(message, "planes 0 and 1 both hold layer \"l0\""),
            Err(other) => panic!("{other}"),
            Ok(_) => panic!("started"),
        }
    }

    #[test]
    fn a_handoff_released_unread_frees_its_blocks_and_copies_nothing() {
        let dir = certs();
        let prefill = leg(&dir, "p0", Role::Prefill, &["d0"]);
        let decode = leg_with(&dir, "d0", Role::Decode, &["p0"], EngineChoice::Shm);
        fill(&prefill, 0, 3, 9);
        prefill.agent.announce("r9", vec![vec![3]]).unwrap();
        decode
            .agent
            .release("r9", "p0", &address(&prefill), prefill.agent.incarnation())
            .unwrap();
        assert_eq!(prefill.agent.finished(), vec!["r9".to_string()]);
        assert_eq!(prefill.agent.live_handoffs(), 0);
        assert_eq!(prefill.agent.serving.generations.load_u32(3).unwrap(), 1);
        for block in 0..BLOCKS {
            assert_eq!(page(&decode, 0, block), vec![0; PAGE as usize], "block {block}");
        }
        let again = decode.agent.load(
            "r9",
            "p0",
            &address(&prefill),
            prefill.agent.incarnation(),
            pairs(&[(3, 1)]),
        );
        assert!(
            matches!(again, Err(AgentError::HandoffRefused { .. })),
            "{again:?}"
        );
        // A hand-off another incarnation announced is not this one's to give back.
        let stale = decode
            .agent
            .release("r9", "p0", &address(&prefill), prefill.agent.incarnation() ^ 1);
        assert!(matches!(stale, Err(AgentError::Restarted { .. })), "{stale:?}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_block_freed_under_a_shared_memory_read_is_reported_stale() {
        block_freed_under_the_read_is_reported_stale(EngineChoice::Shm);
    }

    #[test]
    fn a_block_freed_under_a_network_read_is_refused_or_reported_stale() {
        block_freed_under_the_read_is_reported_stale(EngineChoice::Net);
    }

    fn block_freed_under_the_read_is_reported_stale(engine: EngineChoice) {
        let dir = certs();
        let prefill = leg(&dir, "p0", Role::Prefill, &["d0"]);
        let decode = leg_with(&dir, "d0", Role::Decode, &["p0"], engine);
        prefill.agent.announce("r2", vec![vec![4]]).unwrap();
        let address: SocketAddr = address(&prefill).parse().unwrap();
        let incarnation = Incarnation(prefill.agent.incarnation());
        let result = decode.agent.runtime.block_on(async {
            let peer = decode.agent.peer("p0", address, incarnation).await?;
            let claimed = decode.agent.claim(&peer, "p0", "r2", 1).await?;
            // The prefill side gives the blocks up between the claim and the READ.
            assert!(prefill.agent.revoke("r2"));
            decode
                .agent
                .read(&peer, "r2", &claimed, pairs(&[(4, 1)]), None, &[(0, 0), (1, 1)])
                .await
        });
        match engine {
            // One-sided: the bytes arrive; the generation check after the copy catches them.
            EngineChoice::Shm => assert!(
                matches!(
                    result,
                    Err(AgentError::Stale {
                        block: 4,
                        expected: 0,
                        found: 1,
                        ..
                    })
                ),
                "{result:?}"
            ),
            // Served: the memory server refuses the READ of a hand-off that ended.
            _ => assert!(
                matches!(&result, Err(AgentError::Read { reason, .. }) if reason.contains("not live")),
                "{result:?}"
            ),
        }
        assert_eq!(prefill.agent.finished(), vec!["r2".to_string()]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_worker_of_another_model_is_refused_at_the_handshake_naming_what_differs() {
        let dir = certs();
        let prefill = leg(&dir, "p0", Role::Prefill, &["d0"]);
        let decode = leg_of_model(
            &dir,
            "d0",
            Role::Decode,
            &["p0"],
            EngineChoice::Auto,
            model("fp8"),
        );
        fill(&prefill, 0, 2, 9);
        prefill.agent.announce("r1", vec![vec![2]]).unwrap();
        let at = address(&prefill);
        let refused = decode
            .agent
            .load("r1", "p0", &at, prefill.agent.incarnation(), pairs(&[(2, 2)]));
        match refused {
            Err(AgentError::Incompatible { node, reason, .. }) => {
                assert_eq!(node, "p0");
                assert_eq!(
                    reason,
                    "model differs between d0 and p0: kv_cache_dtype: d0 fp8, p0 float32"
                );
            }
            other => panic!("expected an incompatible prefill worker, got {other:?}"),
        }
        assert_eq!(page(&decode, 0, 2), vec![0; PAGE as usize], "nothing was read");
        // The hand-off is untouched: a compatible decoder still reads it.
        let compatible = leg(&dir, "d0", Role::Decode, &["p0"]);
        compatible
            .agent
            .load("r1", "p0", &at, prefill.agent.incarnation(), pairs(&[(2, 2)]))
            .unwrap();
        assert_eq!(page(&compatible, 0, 2), vec![9; PAGE as usize]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn restarted_unknown_and_foreign_handoffs_are_refused_by_kind() {
        let dir = certs();
        let prefill = leg(&dir, "p0", Role::Prefill, &["d0"]);
        let decode = leg(&dir, "d0", Role::Decode, &["p0"]);
        let stranger = leg(&dir, "stranger", Role::Decode, &["p0"]);
        prefill.agent.announce("r3", vec![vec![2]]).unwrap();
        let at = address(&prefill);
        let wrong = prefill.agent.incarnation().wrapping_add(1);
        let restarted = decode.agent.load("r3", "p0", &at, wrong, pairs(&[(2, 2)]));
        assert!(
            matches!(restarted, Err(AgentError::Restarted { .. })),
            "{restarted:?}"
        );
        let missing = decode
            .agent
            .load("nope", "p0", &at, prefill.agent.incarnation(), pairs(&[(2, 2)]));
        assert!(
            matches!(missing, Err(AgentError::HandoffMissing { .. })),
            "{missing:?}"
        );
        let foreign = stranger
            .agent
            .load("r3", "p0", &at, prefill.agent.incarnation(), pairs(&[(2, 2)]));
        assert!(
            matches!(foreign, Err(AgentError::Unreachable { .. })),
            "{foreign:?}"
        );
        let outside = decode
            .agent
            .load("r3", "p0", &at, prefill.agent.incarnation(), pairs(&[(3, 2)]));
        assert!(
            matches!(outside, Err(AgentError::NotHandedOff { block: 3, .. })),
            "{outside:?}"
        );
        assert_eq!(
            prefill.agent.finished(),
            vec!["r3".to_string()],
            "released after the refusal"
        );
        let wrong_role = decode.agent.announce("x", vec![vec![1]]);
        assert!(matches!(wrong_role, Err(AgentError::Config(_))));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_memory_server_serves_only_the_owner_of_a_live_handoff_and_only_its_blocks() {
        let dir = certs();
        let prefill = leg(&dir, "p0", Role::Prefill, &["d0", "stranger"]);
        let owner = leg_with(&dir, "d0", Role::Decode, &["p0"], EngineChoice::Net);
        let other = leg_with(&dir, "stranger", Role::Decode, &["p0"], EngineChoice::Net);
        prefill.agent.announce("r4", vec![vec![2, 3]]).unwrap();
        let address: SocketAddr = address(&prefill).parse().unwrap();
        let incarnation = Incarnation(prefill.agent.incarnation());
        let read = |agent: &Agent, grant: GrantId, block: u64| {
            agent.runtime.block_on(async {
                let peer = agent.peer("p0", address, incarnation).await.unwrap();
                let op = pdkv_transport::engine::ReadOp {
                    grant,
                    local_region: 0,
                    remote_engine: peer.engine.clone(),
                    remote_region: 0,
                    runs: vec![pdkv_core::plan::ReadRun {
                        local_offset: 0,
                        remote_offset: block * PAGE,
                        len_bytes: PAGE,
                    }],
                };
                peer.reader
                    .batch_read(vec![op])?
                    .wait(Duration::from_secs(5))
                    .await
            })
        };
        let claimed = owner.agent.runtime.block_on(async {
            let peer = owner.agent.peer("p0", address, incarnation).await.unwrap();
            owner.agent.claim(&peer, "p0", "r4", 1).await.unwrap()
        });
        assert!(
            read(&owner.agent, claimed.grant, 3).is_ok(),
            "the owner reads its block"
        );
        let outside = read(&owner.agent, claimed.grant, 4).unwrap_err().to_string();
        assert!(outside.contains("does not cover block 4"), "{outside}");
        let foreign = read(&other.agent, claimed.grant, 3).unwrap_err().to_string();
        assert!(foreign.contains("does not belong to peer stranger"), "{foreign}");
        let forged = read(&owner.agent, GrantId(999), 3).unwrap_err().to_string();
        assert!(forged.contains("not live"), "{forged}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn plain_memory_is_read_over_the_network_and_never_through_shared_memory() {
        let dir = certs();
        let prefill = leg(&dir, "p0", Role::Prefill, &["d0", "stranger"]);
        fill(&prefill, 1, 6, 42);
        prefill.agent.announce("r5", vec![vec![6]]).unwrap();
        prefill.agent.announce("r6", vec![vec![6]]).unwrap();
        let mut plain = vec![0u8; 2 * (PAGE * u64::from(BLOCKS)) as usize];
        let (ptr, len) = (plain.as_mut_ptr() as usize, plain.len());
        let start = |engine| {
            let node = if engine == EngineChoice::Shm {
                "stranger"
            } else {
                "d0"
            };
            Agent::start(setup(
                &dir,
                node,
                Role::Decode,
                &["p0"],
                Memory::Borrowed { ptr, len },
                engine,
                None,
            ))
            .unwrap()
        };
        let auto = start(EngineChoice::Auto);
        auto.load(
            "r5",
            "p0",
            &address(&prefill),
            prefill.agent.incarnation(),
            pairs(&[(6, 1)]),
        )
        .unwrap();
        assert_eq!(auto.engines_in_use(), vec!["net".to_string()]);
        drop(auto);
        let offset = (PAGE * u64::from(BLOCKS) + PAGE) as usize;
        assert!(
            plain[offset..offset + PAGE as usize]
                .iter()
                .all(|&byte| byte == 42)
        );
        let shm_only = start(EngineChoice::Shm);
        let refused = shm_only.load(
            "r6",
            "p0",
            &address(&prefill),
            prefill.agent.incarnation(),
            pairs(&[(6, 1)]),
        );
        assert!(
            matches!(&refused, Err(AgentError::Unreachable { reason, .. }) if reason.contains("not in shared memory")),
            "{refused:?}"
        );
        drop(shm_only);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// GPU KV registered by device pointer, READ by mori: over the loopback stand-in of pdkv's
    /// mori shim (a READ is a copy in this process) and a HIP stand-in whose GPU is host memory,
    /// so everything of the connector's mori path runs except mori and the hardware.
    #[cfg(all(feature = "mori", feature = "hip"))]
    #[test]
    fn gpu_kv_is_read_by_mori_when_both_workers_offer_it() {
        static ONCE: std::sync::Once = std::sync::Once::new();
        // SAFETY: set once, before any shim is loaded; the other tests load no shim.
        ONCE.call_once(|| unsafe {
            std::env::set_var("PDKV_MORI_SHIM", pdkv_transport::mori::LOOPBACK_SHIM);
            std::env::set_var("PDKV_HIP_SHIM", pdkv_transport::gpu::HOST_MEMORY_SHIM);
        });
        let dir = certs();
        let bytes = 2 * (PAGE * u64::from(BLOCKS)) as usize;
        let v_plane = PAGE * u64::from(BLOCKS);
        let on_gpu = |region: &Region| Memory::Device {
            ptr: region.as_ptr() as usize,
            len: bytes,
            device: 0,
        };
        let start = |node: &str, role: Role, memory: Memory, engine: EngineChoice| {
            let peer = if role == Role::Prefill { "d0" } else { "p0" };
            let mori = MoriSetup {
                host: "127.0.0.1".into(),
                settings: Default::default(),
            };
            Agent::start(setup(&dir, node, role, &[peer], memory, engine, Some(mori))).unwrap()
        };
        let prefill_memory = Region::gpu(0, bytes).unwrap();
        let decode_memory = Region::gpu(0, bytes).unwrap();
        prefill_memory.write(5 * PAGE, &[11; PAGE as usize]).unwrap();
        prefill_memory
            .write(v_plane + 5 * PAGE, &[22; PAGE as usize])
            .unwrap();
        let prefill = start("p0", Role::Prefill, on_gpu(&prefill_memory), EngineChoice::Auto);
        let decode = start("d0", Role::Decode, on_gpu(&decode_memory), EngineChoice::Auto);
        prefill.announce("r7", vec![vec![5]]).unwrap();
        let at = prefill.address().unwrap().to_string();
        decode
            .load("r7", "p0", &at, prefill.incarnation(), pairs(&[(5, 3)]))
            .unwrap();
        assert_eq!(
            decode.engines_in_use(),
            vec!["mori".to_string()],
            "both offer mori: mori is chosen"
        );
        let mut page = vec![0u8; PAGE as usize];
        decode_memory.read(3 * PAGE, &mut page).unwrap();
        assert!(page.iter().all(|&byte| byte == 11));
        decode_memory.read(v_plane + 3 * PAGE, &mut page).unwrap();
        assert!(page.iter().all(|&byte| byte == 22));
        decode_memory.read(5 * PAGE, &mut page).unwrap();
        assert!(page.iter().all(|&byte| byte == 0), "only the paired block");
        assert_eq!(prefill.finished(), vec!["r7".to_string()]);
        drop(decode);
        // GPU memory is mori's alone: a decoder asking for network READs is refused by name.
        prefill.announce("r8", vec![vec![5]]).unwrap();
        let mut host = vec![0u8; bytes];
        let plain = Memory::Borrowed {
            ptr: host.as_mut_ptr() as usize,
            len: bytes,
        };
        let net = start("d0", Role::Decode, plain, EngineChoice::Net);
        let refused = net.load("r8", "p0", &at, prefill.incarnation(), pairs(&[(5, 6)]));
        assert!(
            matches!(&refused, Err(AgentError::Unreachable { reason, .. })
                if reason.contains("offers READ engines [Mori], this side reads with [Net]")),
            "{refused:?}"
        );
        drop((net, prefill));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[cfg(not(feature = "mori"))]
    #[test]
    fn a_mori_engine_without_the_feature_is_refused_naming_it() {
        let dir = certs();
        let memory = kv_memfd(2);
        let mori = MoriSetup {
            host: "127.0.0.1".into(),
            settings: Default::default(),
        };
        let memory = Memory::Memfd(memory.as_raw_fd());
        let refused = Agent::start(setup(
            &dir,
            "p0",
            Role::Prefill,
            &["d0"],
            memory,
            EngineChoice::Auto,
            Some(mori),
        ));
        assert!(
            matches!(&refused, Err(AgentError::Config(message)) if message.contains("--features mori")),
            "{:?}",
            refused.err()
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
