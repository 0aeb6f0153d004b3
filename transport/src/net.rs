//! The network READ engine, for hosts without RDMA or shared memory.
//!
//! The prefill leg runs a [`MemoryServer`]: plain TCP data connections that serve reads of
//! granted byte ranges straight out of its registered regions, and land straight in the decode
//! leg's region (no intermediate buffer on either side). Why TCP and not QUIC streams: on
//! loopback and datacenter links TCP moves bulk bytes about 5x faster than QUIC with TLS on this
//! machine class (`shared/reference/ecosystem.md` §2), and KV bytes, like RDMA traffic, travel on
//! the cluster's backend network. What TCP lacks is authentication, so a data connection must
//! open with a one-time [`Ticket`] the prefill leg issued over the mutually authenticated QUIC
//! control plane to that very node; and every read names a grant that the server checks range by
//! range ([`ReadAuthorizer`]) before a byte leaves. A refused read sends no bytes. A malformed
//! request closes that data connection.
//!
//! The bytes are not encrypted (neither are RDMA READs); the control plane is.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use pdkv_core::grant::{GrantError, GrantTable};
use pdkv_core::layout::KvLayout;
use pdkv_core::plan::RegionLayout;
use pdkv_core::wire::{GrantId, NodeId};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};

use crate::clock::MonotonicClock;
use crate::codec::{self, PROTOCOL_VERSION};
use crate::engine::{
    EngineDescriptor, EngineError, EngineKey, EngineKind, LocalRegions, MemoryDescriptor, ReadEngine,
    ReadHandle, ReadOp, ReadReport, RegionHandle, WordsFuture, check_kind, check_runs,
};
use crate::region::Region;

/// A one-time secret that lets one node open one data connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Ticket(pub [u8; 32]);

/// Tickets issued and not yet redeemed or expired.
#[derive(Debug)]
pub struct TicketBook {
    tickets: Mutex<HashMap<Ticket, (NodeId, Instant)>>,
    ttl: Duration,
    max_outstanding: usize,
}

impl TicketBook {
    /// A book whose tickets live `ttl` and of which at most `max_outstanding` are outstanding.
    pub fn new(ttl: Duration, max_outstanding: usize) -> Self {
        TicketBook {
            tickets: Mutex::new(HashMap::new()),
            ttl,
            max_outstanding,
        }
    }

    /// Issues a ticket for `peer` (called over the authenticated control plane).
    pub fn issue(&self, peer: &NodeId) -> Result<Ticket, NetError> {
        let mut secret = [0u8; 32];
        getrandom::fill(&mut secret).map_err(|error| NetError::Io(error.to_string()))?;
        let ticket = Ticket(secret);
        let now = Instant::now();
        let mut tickets = self.tickets.lock().unwrap_or_else(PoisonError::into_inner);
        tickets.retain(|_, (_, expires)| *expires > now);
        if tickets.len() >= self.max_outstanding {
            return Err(NetError::TooManyTickets(self.max_outstanding));
        }
        tickets.insert(ticket, (peer.clone(), now + self.ttl));
        Ok(ticket)
    }

    /// Redeems a ticket presented by a data connection claiming to be `peer`; one use only.
    pub fn redeem(&self, ticket: &Ticket, peer: &NodeId) -> Result<(), NetError> {
        let entry = self
            .tickets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(ticket);
        match entry {
            Some((owner, expires)) if owner == *peer && expires > Instant::now() => Ok(()),
            Some((owner, _)) if owner != *peer => {
                Err(NetError::BadTicket(format!("ticket was issued to {owner}")))
            }
            Some(_) => Err(NetError::BadTicket("ticket expired".into())),
            None => Err(NetError::BadTicket("unknown or used ticket".into())),
        }
    }
}

/// Why a memory server refuses a READ.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadDenied {
    /// The server registered no region with that id.
    #[error("no region {0}")]
    NoRegion(u32),
    /// The region holds no KV layer (it may be a generation table).
    #[error("region {0} holds no KV layer")]
    NotKvRegion(u32),
    /// The region is not a generation table.
    #[error("region {0} is not a generation table")]
    NotGenerationTable(u32),
    /// The byte range leaves the region.
    #[error("range {offset}+{len} is outside region {region}")]
    OutsideRegion {
        /// Region id.
        region: u32,
        /// Start offset.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// The byte range is empty or starts before the region's first block.
    #[error("range {offset}+{len} of region {region} is not inside a block")]
    NotInsideBlock {
        /// Region id.
        region: u32,
        /// Start offset.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// A block index does not fit a block id.
    #[error("block {0} out of range")]
    BlockOutOfRange(u64),
    /// The grant refuses (unknown, ended, another peer's, not covering the block).
    #[error(transparent)]
    Grant(#[from] GrantError),
    /// The grant does not cover a block whose generation was asked for.
    #[error("grant {grant} does not cover block {block} of group {group}")]
    NotCovered {
        /// The grant.
        grant: u64,
        /// Group index.
        group: usize,
        /// Block id.
        block: u32,
    },
}

/// Decides whether a peer may read a byte range (or generation words) under a grant.
pub trait ReadAuthorizer: Send + Sync + 'static {
    /// May `peer` read `len` bytes at `offset` of region `region` under `grant`?
    fn authorize_read(
        &self,
        peer: &NodeId,
        grant: GrantId,
        region: u32,
        offset: u64,
        len: u64,
    ) -> Result<(), ReadDenied>;
    /// May `peer` read the generation words `indices` of region `region` under `grant`?
    fn authorize_words(
        &self,
        peer: &NodeId,
        grant: GrantId,
        region: u32,
        indices: &[u32],
    ) -> Result<(), ReadDenied>;
}

/// The grant table of a prefill leg as a [`ReadAuthorizer`]: a byte range is readable when every
/// block it touches is in a live grant held by the reader, for that block's group.
#[derive(Debug, Clone)]
pub struct GrantAuthorizer {
    grants: Arc<Mutex<GrantTable>>,
    layout: KvLayout,
    regions: RegionLayout,
    clock: MonotonicClock,
}

impl GrantAuthorizer {
    /// An authorizer over `grants` for memory placed as `regions` (layers and generation
    /// tables).
    pub fn new(
        grants: Arc<Mutex<GrantTable>>,
        layout: KvLayout,
        regions: RegionLayout,
        clock: MonotonicClock,
    ) -> Self {
        GrantAuthorizer {
            grants,
            layout,
            regions,
            clock,
        }
    }
}

impl ReadAuthorizer for GrantAuthorizer {
    fn authorize_read(
        &self,
        peer: &NodeId,
        grant: GrantId,
        region: u32,
        offset: u64,
        len: u64,
    ) -> Result<(), ReadDenied> {
        let (layer, placement) = self
            .regions
            .placement(region)
            .ok_or(ReadDenied::NotKvRegion(region))?;
        let group = *self
            .layout
            .layer_groups()
            .get(layer)
            .ok_or(ReadDenied::NotKvRegion(region))?;
        if len == 0 || offset < placement.base_offset {
            return Err(ReadDenied::NotInsideBlock { region, offset, len });
        }
        let first = (offset - placement.base_offset) / placement.bytes_per_block;
        let last = (offset - placement.base_offset + len - 1) / placement.bytes_per_block;
        let now = self.clock.now_ms();
        let grants = self.grants.lock().unwrap_or_else(PoisonError::into_inner);
        for block in first..=last {
            let block = u32::try_from(block).map_err(|_| ReadDenied::BlockOutOfRange(block))?;
            grants.check_read(grant, peer, group, block, now)?;
        }
        Ok(())
    }

    fn authorize_words(
        &self,
        peer: &NodeId,
        grant: GrantId,
        region: u32,
        indices: &[u32],
    ) -> Result<(), ReadDenied> {
        let group = self
            .regions
            .generation_group(region)
            .filter(|&group| group < self.layout.groups().len())
            .ok_or(ReadDenied::NotGenerationTable(region))?;
        let grants = self.grants.lock().unwrap_or_else(PoisonError::into_inner);
        let grant = grants.held(grant, peer)?;
        // Generations are read after the data, also after the grant ended, to detect reuse;
        // they may be read for any block the grant covered.
        for &block in indices {
            if !grant.covers(group, block) {
                return Err(ReadDenied::NotCovered {
                    grant: grant.id.0,
                    group,
                    block,
                });
            }
        }
        Ok(())
    }
}

/// First frame of a data connection.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct DataHello {
    pub(crate) node: NodeId,
    pub(crate) protocol_version: u32,
    pub(crate) ticket: Ticket,
}

#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum DataRequest {
    /// Read `runs` (remote offset, length) of `region`, concatenated.
    Read {
        grant: GrantId,
        region: u32,
        runs: Vec<(u64, u64)>,
    },
    /// Read generation words.
    Words {
        grant: GrantId,
        region: u32,
        indices: Vec<u32>,
    },
}

/// A memory server's answer on a data connection (part of the data-plane protocol).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DataReply {
    /// The hello was accepted.
    Welcome,
    /// `skip` padding bytes follow, then `len` raw bytes.
    Data {
        /// Bytes of data after the padding.
        len: u64,
        /// Zero bytes between this frame and the data (fewer than [`DATA_ALIGN`]), so the data
        /// starts at an aligned offset of the stream.
        skip: u8,
    },
    /// Generation words, in the order asked for.
    Words(Vec<u32>),
    /// The request (or the hello) was refused, and why.
    Refused(String),
}

/// Where bulk data starts on a data connection: at a multiple of this many bytes from the start
/// of the stream. The kernel copies a socket's bytes into and out of its buffers in stream
/// order; a small frame before the data left every later copy misaligned, which halved loopback
/// throughput for 16–256 KiB runs (measured with `read_throughput --processes`).
pub const DATA_ALIGN: u64 = 64;

/// Largest request frame a memory server accepts (64 Ki runs).
pub(crate) const MAX_REQUEST_BYTES: usize = 1 << 20;

/// Largest data hello (protocol version, node name, ticket) a memory server reads.
pub const MAX_HELLO_BYTES: usize = 4096;

/// Bounds of a memory server.
#[derive(Debug, Clone, Copy)]
pub struct MemoryServerLimits {
    /// Concurrent authenticated data connections (default 64); one more is refused after its
    /// hello with "memory server full".
    pub max_connections: usize,
    /// Connections that have not yet presented a ticket (default 16). When one more arrives,
    /// the oldest of them is dropped, so idle or slow strangers can delay a real peer by at most
    /// the time it takes to send its hello, never lock it out.
    pub max_unauthenticated: usize,
    /// Time a new connection has to present its ticket (default 2 s).
    pub hello_timeout: Duration,
    /// An authenticated connection idle this long is closed; none by default. A ticket holder
    /// is a cluster member whose READs come in bursts, its connection its only way in (a new one
    /// needs a new ticket from the control plane): closing it while idle failed the next READ
    /// after every quiet minute. A peer whose host vanished is found by TCP keepalive
    /// ([`KEEPALIVE`]) instead, on both ends.
    pub idle_timeout: Option<Duration>,
}

/// TCP keepalive of data connections: probes after this long idle, then every third of it,
/// three unanswered probes closing the connection (a peer whose host vanished frees its slot
/// within twice this).
pub const KEEPALIVE: Duration = Duration::from_secs(30);

/// Turns on [`KEEPALIVE`] for a data connection.
fn keep_alive(stream: &TcpStream) -> std::io::Result<()> {
    let probes = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE)
        .with_interval(KEEPALIVE / 3)
        .with_retries(3);
    socket2::SockRef::from(stream).set_tcp_keepalive(&probes)
}

impl Default for MemoryServerLimits {
    fn default() -> Self {
        MemoryServerLimits {
            max_connections: 64,
            max_unauthenticated: 16,
            hello_timeout: Duration::from_secs(2),
            idle_timeout: None,
        }
    }
}

/// Serves granted reads of a prefill leg's regions over TCP.
#[derive(Debug)]
pub struct MemoryServer {
    local_addr: SocketAddr,
    accept_task: tokio::task::JoinHandle<()>,
}

impl MemoryServer {
    /// Binds `bind` on `runtime` and serves `regions` to ticket holders, as `authorizer` allows.
    pub fn start(
        runtime: &tokio::runtime::Handle,
        bind: SocketAddr,
        regions: HashMap<u32, Arc<Region>>,
        authorizer: Arc<dyn ReadAuthorizer>,
        tickets: Arc<TicketBook>,
        limits: MemoryServerLimits,
    ) -> Result<Self, NetError> {
        let listener = {
            let _guard = runtime.enter();
            let socket =
                std::net::TcpListener::bind(bind).map_err(|error| NetError::Io(error.to_string()))?;
            socket
                .set_nonblocking(true)
                .map_err(|error| NetError::Io(error.to_string()))?;
            TcpListener::from_std(socket).map_err(|error| NetError::Io(error.to_string()))?
        };
        let local_addr = listener
            .local_addr()
            .map_err(|error| NetError::Io(error.to_string()))?;
        let shared = Arc::new(ServerState {
            regions,
            authorizer,
            tickets,
            limits,
        });
        let accept_task = runtime.spawn(async move {
            let slots = Arc::new(Semaphore::new(limits.max_connections));
            let mut unauthenticated = Unauthenticated::new(limits.max_unauthenticated);
            loop {
                let (stream, remote) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        // Out of descriptors or similar: back off rather than spin.
                        tracing::warn!(%error, "memory server accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let evicted = unauthenticated.admit();
                let (shared, slots) = (shared.clone(), slots.clone());
                tokio::spawn(async move {
                    if let Err(error) = serve_data(stream, shared, evicted, slots).await {
                        tracing::warn!(%remote, %error, "data connection closed");
                    }
                });
            }
        });
        Ok(MemoryServer {
            local_addr,
            accept_task,
        })
    }

    /// The address data connections dial.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for MemoryServer {
    fn drop(&mut self) {
        self.accept_task.abort();
    }
}

/// Connections still in their hello, oldest first: at most `max`; admitting one more evicts the
/// oldest. Each is held as the sender of a one-shot channel its connection task watches:
/// dropping the sender evicts it, and a connection past its hello drops its receiver, which
/// takes it out of the count.
#[derive(Debug)]
struct Unauthenticated {
    pending: VecDeque<oneshot::Sender<()>>,
    max: usize,
}

impl Unauthenticated {
    fn new(max: usize) -> Self {
        Unauthenticated {
            pending: VecDeque::new(),
            max: max.max(1),
        }
    }

    /// Admits a new connection; its receiver resolves when it is evicted.
    fn admit(&mut self) -> oneshot::Receiver<()> {
        self.pending.retain(|evict| !evict.is_closed());
        while self.pending.len() >= self.max {
            tracing::debug!("dropping the oldest data connection still in its hello");
            self.pending.pop_front();
        }
        let (evict, evicted) = oneshot::channel();
        self.pending.push_back(evict);
        evicted
    }
}

pub(crate) struct ServerState {
    pub(crate) regions: HashMap<u32, Arc<Region>>,
    pub(crate) authorizer: Arc<dyn ReadAuthorizer>,
    pub(crate) tickets: Arc<TicketBook>,
    pub(crate) limits: MemoryServerLimits,
}

async fn serve_data(
    mut stream: TcpStream,
    state: Arc<ServerState>,
    mut evicted: oneshot::Receiver<()>,
    slots: Arc<Semaphore>,
) -> Result<(), NetError> {
    stream
        .set_nodelay(true)
        .map_err(|error| NetError::Io(error.to_string()))?;
    let hello = tokio::time::timeout(
        state.limits.hello_timeout,
        codec::read_message::<_, DataHello>(&mut stream, MAX_HELLO_BYTES),
    );
    let hello = tokio::select! {
        hello = hello => hello.map_err(|_| NetError::Timeout("data hello"))?,
        _ = &mut evicted => return Err(NetError::Evicted),
    };
    let hello = match hello {
        Ok(hello) => hello,
        Err(error) => {
            // Say why before closing (best effort: the peer may be gone already).
            let reason = format!("bad data hello: {error}");
            let _ = codec::write_message(&mut stream, &DataReply::Refused(reason)).await;
            return Err(error.into());
        }
    };
    // Out of the unauthenticated set: its sender now reports closed.
    drop(evicted);
    if hello.protocol_version != PROTOCOL_VERSION {
        let reason = format!(
            "protocol version differs: ours {PROTOCOL_VERSION}, theirs {}",
            hello.protocol_version
        );
        codec::write_message(&mut stream, &DataReply::Refused(reason.clone())).await?;
        return Err(NetError::BadTicket(reason));
    }
    // A slot is taken before the ticket is spent, so a peer refused for lack of room keeps it.
    let _permit: OwnedSemaphorePermit = match slots.try_acquire_owned() {
        Ok(permit) => permit,
        Err(_) => {
            let error = NetError::Full(state.limits.max_connections);
            codec::write_message(&mut stream, &DataReply::Refused(error.to_string())).await?;
            return Err(error);
        }
    };
    if let Err(error) = state.tickets.redeem(&hello.ticket, &hello.node) {
        codec::write_message(&mut stream, &DataReply::Refused(error.to_string())).await?;
        return Err(error);
    }
    let peer = hello.node;
    // Bytes written to the stream so far (the data's alignment is counted from here).
    let mut sent = reply(&mut stream, &DataReply::Welcome, 0).await? as u64;
    keep_alive(&stream).map_err(|error| NetError::Io(error.to_string()))?;
    loop {
        let next = codec::read_message(&mut stream, MAX_REQUEST_BYTES);
        let next = match state.limits.idle_timeout {
            Some(idle) => match tokio::time::timeout(idle, next).await {
                Err(_) => return Ok(()),
                Ok(next) => next,
            },
            None => next.await,
        };
        let request: DataRequest = match next {
            Err(codec::CodecError::Truncated) => return Ok(()),
            Err(error) => return Err(error.into()),
            Ok(request) => request,
        };
        match answer(&state, &peer, request) {
            Answer::Refused(reason) => {
                sent += reply(&mut stream, &DataReply::Refused(reason), 0).await? as u64
            }
            Answer::Words(words) => sent += reply(&mut stream, &DataReply::Words(words), 0).await? as u64,
            Answer::Data { memory, runs } => {
                let total: u64 = runs.iter().map(|(_, len)| len).sum();
                // The frame's size does not depend on `skip` (one varint byte below 251).
                let frame =
                    codec::frame(&codec::encode(&DataReply::Data { len: total, skip: 0 })?).len() as u64;
                let skip = ((DATA_ALIGN - (sent + frame) % DATA_ALIGN) % DATA_ALIGN) as u8;
                sent += reply(&mut stream, &DataReply::Data { len: total, skip }, skip).await? as u64;
                sent += total;
                for (offset, len) in runs {
                    // SAFETY: the grant pins these blocks; their owner does not write them while
                    // the grant lives (a lapse is caught by the reader's generation check).
                    let bytes = unsafe { memory.bytes(offset, len as usize) }
                        .map_err(|error| NetError::Io(error.to_string()))?;
                    stream
                        .write_all(bytes)
                        .await
                        .map_err(|error| NetError::Io(error.to_string()))?;
                }
            }
        }
    }
}

/// Writes `message` as one frame followed by `padding` zero bytes, in one write; returns the
/// bytes written.
async fn reply(stream: &mut TcpStream, message: &DataReply, padding: u8) -> Result<usize, NetError> {
    let mut bytes = codec::frame(&codec::encode(message)?);
    bytes.resize(bytes.len() + usize::from(padding), 0);
    stream
        .write_all(&bytes)
        .await
        .map_err(|error| NetError::Io(error.to_string()))?;
    Ok(bytes.len())
}

/// What a memory server does with one decoded request from `peer`.
pub(crate) enum Answer {
    /// Refuse it, saying why.
    Refused(String),
    /// Send these runs of `memory`, which the authorizer allowed.
    Data {
        memory: Arc<Region>,
        runs: Vec<(u64, u64)>,
    },
    /// Send these generation words.
    Words(Vec<u32>),
}

/// Decides a request: every run inside its region and allowed by the authorizer, every word
/// index inside its table; anything else is refused with the reason.
pub(crate) fn answer(state: &ServerState, peer: &NodeId, request: DataRequest) -> Answer {
    match request {
        DataRequest::Read { grant, region, runs } => {
            match authorize_runs(state, peer, grant, region, &runs) {
                Err(reason) => Answer::Refused(reason.to_string()),
                Ok(memory) => Answer::Data { memory, runs },
            }
        }
        DataRequest::Words {
            grant,
            region,
            indices,
        } => match (
            state.regions.get(&region),
            state.authorizer.authorize_words(peer, grant, region, &indices),
        ) {
            (None, _) => Answer::Refused(format!("no region {region}")),
            (_, Err(denied)) => Answer::Refused(denied.to_string()),
            (Some(memory), Ok(())) => match indices
                .iter()
                .map(|&i| memory.load_u32(i as usize))
                .collect::<Result<Vec<_>, _>>()
            {
                Ok(words) => Answer::Words(words),
                Err(error) => Answer::Refused(error.to_string()),
            },
        },
    }
}

fn authorize_runs(
    state: &ServerState,
    peer: &NodeId,
    grant: GrantId,
    region: u32,
    runs: &[(u64, u64)],
) -> Result<Arc<Region>, ReadDenied> {
    let memory = state.regions.get(&region).ok_or(ReadDenied::NoRegion(region))?;
    for &(offset, len) in runs {
        if offset
            .checked_add(len)
            .is_none_or(|end| end > memory.len() as u64)
        {
            return Err(ReadDenied::OutsideRegion { region, offset, len });
        }
        state
            .authorizer
            .authorize_read(peer, grant, region, offset, len)?;
    }
    Ok(memory.clone())
}

struct RemoteEngine {
    address: String,
    /// The serving process (a restarted peer is a new one).
    pid: u32,
    regions: HashMap<u32, u64>,
    connection: Option<Arc<tokio::sync::Mutex<TcpStream>>>,
}

/// The decode side of the network engine.
pub struct NetEngine {
    key: EngineKey,
    runtime: tokio::runtime::Handle,
    local: LocalRegions,
    remotes: Arc<Mutex<HashMap<EngineKey, RemoteEngine>>>,
    /// The memory server address this engine advertises (prefill legs), empty otherwise.
    address: String,
    /// How long a READ waits for the data connection to a peer that has none yet.
    connect_wait: Duration,
}

/// How long a READ waits for a data connection being opened (a prefill leg that just restarted
/// is linked to the router a moment before its reader's data connection to it is up).
pub const DEFAULT_CONNECT_WAIT: Duration = Duration::from_millis(1000);

impl std::fmt::Debug for NetEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetEngine")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl NetEngine {
    /// An engine named `key` running its I/O on `runtime`; `address` is the memory server this
    /// engine's regions are served from (empty for an engine that only reads).
    pub fn new(key: EngineKey, runtime: tokio::runtime::Handle, address: String) -> Self {
        NetEngine {
            key,
            runtime,
            local: LocalRegions::default(),
            remotes: Arc::default(),
            address,
            connect_wait: DEFAULT_CONNECT_WAIT,
        }
    }

    /// The same engine, whose READs wait at most `wait` for a data connection being opened.
    pub fn with_connect_wait(mut self, wait: Duration) -> Self {
        self.connect_wait = wait;
        self
    }

    /// Opens the data connection to `engine`, at the address its descriptor advertises, with a
    /// ticket it issued to this node (`node`), within `timeout`.
    pub async fn connect(
        &self,
        engine: &EngineKey,
        node: &NodeId,
        ticket: Ticket,
        timeout: Duration,
    ) -> Result<(), EngineError> {
        self.connect_via(engine, None, node, ticket, timeout).await
    }

    /// As [`NetEngine::connect`], but dials `address` when given instead of the advertised one:
    /// the address this node's configuration says the peer is reached at (through a relay, a
    /// NAT or a proxy, which the peer itself cannot know).
    pub async fn connect_via(
        &self,
        engine: &EngineKey,
        address: Option<String>,
        node: &NodeId,
        ticket: Ticket,
        timeout: Duration,
    ) -> Result<(), EngineError> {
        let advertised = self
            .remotes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(engine)
            .map(|remote| remote.address.clone())
            .ok_or_else(|| EngineError::Refused(format!("engine {engine} is not registered")))?;
        let address = address.unwrap_or(advertised);
        let hello = DataHello {
            node: node.clone(),
            protocol_version: PROTOCOL_VERSION,
            ticket,
        };
        let task = self.runtime.spawn(async move {
            tokio::time::timeout(timeout, async move {
                let mut stream = TcpStream::connect(&address).await.map_err(io_error)?;
                stream.set_nodelay(true).map_err(io_error)?;
                keep_alive(&stream).map_err(io_error)?;
                codec::write_message(&mut stream, &hello)
                    .await
                    .map_err(codec_error)?;
                match codec::read_message::<_, DataReply>(&mut stream, 4096)
                    .await
                    .map_err(codec_error)?
                {
                    DataReply::Welcome => Ok(stream),
                    DataReply::Refused(reason) => Err(EngineError::Refused(reason)),
                    _ => Err(EngineError::Refused("unexpected reply to hello".into())),
                }
            })
            .await
            .map_err(|_| EngineError::Timeout {
                after_ms: timeout.as_millis() as u64,
            })?
        });
        let stream = task.await.map_err(|error| EngineError::Io(error.to_string()))??;
        let mut remotes = self.remotes.lock().unwrap_or_else(PoisonError::into_inner);
        let remote = remotes
            .get_mut(engine)
            .ok_or_else(|| EngineError::Refused(format!("engine {engine} is not registered")))?;
        remote.connection = Some(Arc::new(tokio::sync::Mutex::new(stream)));
        Ok(())
    }

    fn connection(&self, engine: &EngineKey) -> Result<Arc<tokio::sync::Mutex<TcpStream>>, EngineError> {
        self.remotes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(engine)
            .and_then(|remote| remote.connection.clone())
            .ok_or_else(|| EngineError::Refused(format!("no data connection to {engine}")))
    }
}

/// The data connection to `engine` once it is up, waiting at most `wait` (checked every 5 ms).
async fn connection_within(
    remotes: &Mutex<HashMap<EngineKey, RemoteEngine>>,
    engine: &EngineKey,
    wait: Duration,
) -> Result<Arc<tokio::sync::Mutex<TcpStream>>, EngineError> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let connection = remotes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(engine)
            .and_then(|remote| remote.connection.clone());
        if let Some(connection) = connection {
            return Ok(connection);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(EngineError::Refused(format!(
                "no data connection to {engine} within {} ms",
                wait.as_millis()
            )));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn io_error(error: std::io::Error) -> EngineError {
    EngineError::Io(error.to_string())
}

fn codec_error(error: codec::CodecError) -> EngineError {
    EngineError::Io(error.to_string())
}

impl ReadEngine for NetEngine {
    fn key(&self) -> &EngineKey {
        &self.key
    }

    fn descriptor(&self) -> EngineDescriptor {
        EngineDescriptor {
            key: self.key.clone(),
            kind: EngineKind::Net,
            pid: std::process::id(),
            address: self.address.clone(),
            packed: Vec::new(),
        }
    }

    fn register(&self, region_id: u32, region: Arc<Region>) -> Result<MemoryDescriptor, EngineError> {
        let len_bytes = region.len() as u64;
        self.local.insert(region_id, region)?;
        Ok(MemoryDescriptor {
            engine: self.key.clone(),
            region: region_id,
            len_bytes,
            handle: RegionHandle::Net,
        })
    }

    fn register_remote(
        &self,
        engine: &EngineDescriptor,
        regions: &[MemoryDescriptor],
    ) -> Result<(), EngineError> {
        check_kind(engine, EngineKind::Net)?;
        if engine.address.parse::<SocketAddr>().is_err() {
            return Err(EngineError::Refused(format!(
                "engine {} advertises no memory server address ({:?})",
                engine.key, engine.address
            )));
        }
        let regions: HashMap<u32, u64> = regions
            .iter()
            .map(|region| (region.region, region.len_bytes))
            .collect();
        let mut remotes = self.remotes.lock().unwrap_or_else(PoisonError::into_inner);
        // The same process said hello again (each side of a link admits the other): keep its
        // data connection. Anything else starts without one.
        let connection = remotes
            .get(&engine.key)
            .filter(|known| {
                known.address == engine.address && known.pid == engine.pid && known.regions == regions
            })
            .and_then(|known| known.connection.clone());
        remotes.insert(
            engine.key.clone(),
            RemoteEngine {
                address: engine.address.clone(),
                pid: engine.pid,
                regions,
                connection,
            },
        );
        Ok(())
    }

    fn batch_read(&self, ops: Vec<ReadOp>) -> Result<ReadHandle, EngineError> {
        let mut prepared = Vec::with_capacity(ops.len());
        for op in ops {
            let local = self.local.get(op.local_region)?;
            let remote_len = self
                .remotes
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&op.remote_engine)
                .and_then(|remote| remote.regions.get(&op.remote_region).copied())
                .ok_or_else(|| EngineError::UnknownRemoteRegion {
                    engine: op.remote_engine.clone(),
                    region: op.remote_region,
                })?;
            check_runs(&op, local.len() as u64, remote_len)?;
            let connection = self.connection(&op.remote_engine).ok();
            prepared.push((op, local, connection));
        }
        let (completer, handle) = ReadHandle::pending();
        let (remotes, wait) = (self.remotes.clone(), self.connect_wait);
        self.runtime.spawn(async move {
            let mut report = ReadReport::default();
            for (op, local, connection) in prepared {
                let connection = match connection {
                    Some(connection) => connection,
                    None => match connection_within(&remotes, &op.remote_engine, wait).await {
                        Ok(connection) => connection,
                        Err(error) => {
                            completer.complete(Err(error));
                            return;
                        }
                    },
                };
                let mut connection = connection.lock().await;
                match read_op(&mut connection, &op, &local).await {
                    Ok(bytes) => {
                        report.bytes += bytes;
                        report.runs += op.runs.len();
                    }
                    Err(error) => {
                        completer.complete(Err(error));
                        return;
                    }
                }
            }
            completer.complete(Ok(report));
        });
        Ok(handle)
    }

    fn read_remote_words<'a>(
        &'a self,
        remote_engine: &'a EngineKey,
        grant: GrantId,
        remote_region: u32,
        indices: &'a [u32],
    ) -> WordsFuture<'a> {
        let connection = self.connection(remote_engine);
        let indices = indices.to_vec();
        let runtime = self.runtime.clone();
        Box::pin(async move {
            let connection = connection?;
            let task = runtime.spawn(async move {
                let mut connection = connection.lock().await;
                let request = DataRequest::Words {
                    grant,
                    region: remote_region,
                    indices,
                };
                codec::write_message(&mut *connection, &request)
                    .await
                    .map_err(codec_error)?;
                match codec::read_message::<_, DataReply>(&mut *connection, MAX_REQUEST_BYTES)
                    .await
                    .map_err(codec_error)?
                {
                    DataReply::Words(words) => Ok(words),
                    DataReply::Refused(reason) => Err(EngineError::Refused(reason)),
                    _ => Err(EngineError::Refused("unexpected reply to a words request".into())),
                }
            });
            task.await.map_err(|error| EngineError::Io(error.to_string()))?
        })
    }
}

/// Sends one read request and lands the reply's bytes in `local`.
async fn read_op(stream: &mut TcpStream, op: &ReadOp, local: &Region) -> Result<u64, EngineError> {
    let request = DataRequest::Read {
        grant: op.grant,
        region: op.remote_region,
        runs: op
            .runs
            .iter()
            .map(|run| (run.remote_offset, run.len_bytes))
            .collect(),
    };
    codec::write_message(stream, &request)
        .await
        .map_err(codec_error)?;
    let expected: u64 = op.runs.iter().map(|run| run.len_bytes).sum();
    match codec::read_message::<_, DataReply>(stream, MAX_REQUEST_BYTES)
        .await
        .map_err(codec_error)?
    {
        DataReply::Data { len, skip } if len == expected && u64::from(skip) < DATA_ALIGN => {
            let mut padding = [0u8; DATA_ALIGN as usize];
            stream
                .read_exact(&mut padding[..usize::from(skip)])
                .await
                .map_err(io_error)?;
        }
        DataReply::Data { len, skip } if len == expected => {
            return Err(EngineError::Refused(format!(
                "server pads its data with {skip} bytes, fewer than {DATA_ALIGN} expected"
            )));
        }
        DataReply::Data { len, .. } => {
            return Err(EngineError::Refused(format!(
                "server sends {len} bytes, {expected} were asked"
            )));
        }
        DataReply::Refused(reason) => return Err(EngineError::Refused(reason)),
        _ => return Err(EngineError::Refused("unexpected reply to a read".into())),
    }
    for run in &op.runs {
        // SAFETY: the decode leg owns the destination blocks of its READ until it completes.
        let destination =
            unsafe { local.bytes_mut(run.local_offset, run.len_bytes as usize) }.map_err(|source| {
                EngineError::Bounds {
                    side: "local",
                    region: op.local_region,
                    source,
                }
            })?;
        stream.read_exact(destination).await.map_err(io_error)?;
    }
    Ok(expected)
}

/// Why a network-engine operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NetError {
    /// The ticket was unknown, used, expired or issued to another node.
    #[error("data connection refused: {0}")]
    BadTicket(String),
    /// Too many tickets outstanding.
    #[error("too many outstanding tickets ({0})")]
    TooManyTickets(usize),
    /// A frame was malformed.
    #[error("{0}")]
    Codec(#[from] codec::CodecError),
    /// A bound passed.
    #[error("{0} timed out")]
    Timeout(&'static str),
    /// A socket failed.
    #[error("{0}")]
    Io(String),
    /// Newer connections arrived while this one had not presented its ticket.
    #[error("dropped before its hello: newer unauthenticated connections arrived")]
    Evicted,
    /// Every authenticated data connection slot is taken.
    #[error("memory server full: {0} data connections")]
    Full(usize),
}

#[cfg(test)]
mod tests {
    use pdkv_core::layout::GroupSpec;
    use pdkv_core::plan::LayerRegion;
    use pdkv_core::wire::RequestId;

    use super::*;

    fn node(name: &str) -> NodeId {
        NodeId(name.into())
    }

    /// A ticket opens one data connection, for the node it was issued to, while it lives.
    #[test]
    fn tickets_are_single_use_personal_and_expire() {
        let book = TicketBook::new(Duration::from_secs(60), 2);
        let ticket = book.issue(&node("decode-0")).unwrap();
        let refusal = |result: Result<(), NetError>| match result {
            Err(NetError::BadTicket(reason)) => reason,
            other => panic!("expected a refusal, got {other:?}"),
        };
        assert_eq!(
            refusal(book.redeem(&ticket, &node("decode-1"))),
            "ticket was issued to decode-0"
        );
        let ticket = book.issue(&node("decode-0")).unwrap();
        assert!(book.redeem(&ticket, &node("decode-0")).is_ok());
        assert_eq!(
            refusal(book.redeem(&ticket, &node("decode-0"))),
            "unknown or used ticket"
        );
        let expired = TicketBook::new(Duration::ZERO, 2);
        let ticket = expired.issue(&node("decode-0")).unwrap();
        assert_eq!(
            refusal(expired.redeem(&ticket, &node("decode-0"))),
            "ticket expired"
        );
    }

    /// At most `max_outstanding` tickets wait to be redeemed; expired ones do not count.
    #[test]
    fn outstanding_tickets_are_bounded_and_expired_ones_pruned() {
        let book = TicketBook::new(Duration::from_secs(60), 2);
        book.issue(&node("d")).unwrap();
        book.issue(&node("d")).unwrap();
        assert!(matches!(book.issue(&node("d")), Err(NetError::TooManyTickets(2))));
        let short = TicketBook::new(Duration::ZERO, 1);
        for _ in 0..3 {
            short.issue(&node("d")).unwrap();
        }
    }

    /// The oldest connection still in its hello is evicted when one more arrives; one that got
    /// past its hello no longer counts.
    #[test]
    fn the_oldest_unauthenticated_connection_is_evicted() {
        use tokio::sync::oneshot::error::TryRecvError;
        let mut pending = Unauthenticated::new(2);
        let first = pending.admit();
        let mut second = pending.admit();
        drop(first); // authenticated: out of the count
        let mut third = pending.admit();
        assert_eq!(
            second.try_recv(),
            Err(TryRecvError::Empty),
            "room was left by the first"
        );
        let _fourth = pending.admit();
        assert_eq!(
            second.try_recv(),
            Err(TryRecvError::Closed),
            "the oldest is evicted"
        );
        assert_eq!(third.try_recv(), Err(TryRecvError::Empty));
    }

    /// Allows every read: for tests of what the server checks besides grants.
    struct Everything;

    impl ReadAuthorizer for Everything {
        fn authorize_read(&self, _: &NodeId, _: GrantId, _: u32, _: u64, _: u64) -> Result<(), ReadDenied> {
            Ok(())
        }
        fn authorize_words(&self, _: &NodeId, _: GrantId, _: u32, _: &[u32]) -> Result<(), ReadDenied> {
            Ok(())
        }
    }

    /// A read may end exactly at the end of its region, not one byte past it.
    #[test]
    fn runs_are_bounded_by_their_region() {
        let state = ServerState {
            regions: HashMap::from([(0, Arc::new(Region::heap(256)))]),
            authorizer: Arc::new(Everything),
            tickets: Arc::new(TicketBook::new(Duration::from_secs(1), 1)),
            limits: MemoryServerLimits::default(),
        };
        let check = |runs: &[(u64, u64)]| authorize_runs(&state, &node("d"), GrantId(1), 0, runs).map(drop);
        assert_eq!(check(&[(0, 64), (192, 64)]), Ok(()));
        assert_eq!(
            check(&[(0, 64), (193, 64)]),
            Err(ReadDenied::OutsideRegion {
                region: 0,
                offset: 193,
                len: 64
            })
        );
        assert_eq!(
            check(&[(u64::MAX, 2)]),
            Err(ReadDenied::OutsideRegion {
                region: 0,
                offset: u64::MAX,
                len: 2
            })
        );
        assert_eq!(
            authorize_runs(&state, &node("d"), GrantId(1), 3, &[(0, 1)]).map(drop),
            Err(ReadDenied::NoRegion(3))
        );
    }

    /// Every READ's data starts at a multiple of [`DATA_ALIGN`] bytes from the start of the
    /// stream, whatever replies of other sizes came before it, and is the region's bytes.
    #[test]
    fn read_data_starts_aligned_in_the_stream() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let region = Arc::new(Region::heap(4096));
        let pattern: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
        region.write(0, &pattern).unwrap();
        let tickets = Arc::new(TicketBook::new(Duration::from_secs(60), 4));
        let ticket = tickets.issue(&node("d")).unwrap();
        let server = MemoryServer::start(
            runtime.handle(),
            "127.0.0.1:0".parse().unwrap(),
            HashMap::from([(0, region)]),
            Arc::new(Everything),
            tickets,
            MemoryServerLimits::default(),
        )
        .unwrap();
        runtime.block_on(async {
            let mut stream = TcpStream::connect(server.local_addr()).await.unwrap();
            let hello = DataHello {
                node: node("d"),
                protocol_version: PROTOCOL_VERSION,
                ticket,
            };
            codec::write_message(&mut stream, &hello).await.unwrap();
            // Bytes of the server's stream read so far.
            let mut offset = 0u64;
            let next = async |stream: &mut TcpStream, offset: &mut u64| -> DataReply {
                let payload = codec::read_frame(stream, 4096).await.unwrap();
                *offset += 4 + payload.len() as u64;
                codec::decode(&payload).unwrap()
            };
            assert!(matches!(next(&mut stream, &mut offset).await, DataReply::Welcome));
            let reads: [&[(u64, u64)]; 3] = [&[(0, 100)], &[(64, 200), (1000, 3)], &[(7, 1)]];
            for (index, runs) in reads.into_iter().enumerate() {
                let request = DataRequest::Read {
                    grant: GrantId(1),
                    region: 0,
                    runs: runs.to_vec(),
                };
                codec::write_message(&mut stream, &request).await.unwrap();
                let DataReply::Data { len, skip } = next(&mut stream, &mut offset).await else {
                    panic!("not a data reply");
                };
                assert_eq!(len, runs.iter().map(|(_, len)| len).sum::<u64>());
                assert!(u64::from(skip) < DATA_ALIGN);
                assert_eq!(
                    (offset + u64::from(skip)) % DATA_ALIGN,
                    0,
                    "read {index} starts unaligned"
                );
                let mut bytes = vec![0u8; usize::from(skip) + len as usize];
                stream.read_exact(&mut bytes).await.unwrap();
                offset += bytes.len() as u64;
                let expected: Vec<u8> = runs
                    .iter()
                    .flat_map(|&(at, len)| pattern[at as usize..(at + len) as usize].to_vec())
                    .collect();
                assert_eq!(&bytes[usize::from(skip)..], &expected[..]);
                // A reply of another size between reads.
                let words = DataRequest::Words {
                    grant: GrantId(1),
                    region: 0,
                    indices: vec![1; index + 1],
                };
                codec::write_message(&mut stream, &words).await.unwrap();
                assert!(matches!(
                    next(&mut stream, &mut offset).await,
                    DataReply::Words(_)
                ));
            }
        });
    }

    /// Generation words may be read only from a generation table region.
    #[test]
    fn words_are_read_only_from_generation_tables() {
        let layout =
            KvLayout::one_layer_per_group(vec![GroupSpec::full(4, 1).unwrap(), GroupSpec::mamba()]).unwrap();
        let grants = Arc::new(Mutex::new(GrantTable::new(4)));
        let grant = grants
            .lock()
            .unwrap()
            .issue(RequestId(1), node("d"), vec![vec![2], vec![1]], 60_000, 0)
            .unwrap();
        let regions = RegionLayout::region_per_layer(&[64, 4], 8);
        let authorizer = GrantAuthorizer::new(
            grants,
            layout,
            regions.with_generation_tables(2),
            MonotonicClock::new(),
        );
        assert_eq!(authorizer.authorize_words(&node("d"), grant, 2, &[2]), Ok(()));
        assert_eq!(authorizer.authorize_words(&node("d"), grant, 3, &[1]), Ok(()));
        assert_eq!(
            authorizer.authorize_words(&node("d"), grant, 4, &[1]),
            Err(ReadDenied::NotGenerationTable(4))
        );
        assert_eq!(
            authorizer.authorize_words(&node("d"), grant, 1, &[1]),
            Err(ReadDenied::NotGenerationTable(1))
        );
    }

    /// Dropping a memory server stops it: its port refuses new connections.
    #[test]
    fn a_dropped_memory_server_stops_listening() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let server = MemoryServer::start(
            runtime.handle(),
            "127.0.0.1:0".parse().unwrap(),
            HashMap::new(),
            Arc::new(GrantAuthorizer::new(
                Arc::new(Mutex::new(GrantTable::new(1))),
                KvLayout::one_layer_per_group(vec![GroupSpec::mamba()]).unwrap(),
                RegionLayout::default(),
                MonotonicClock::new(),
            )),
            Arc::new(TicketBook::new(Duration::from_secs(1), 1)),
            MemoryServerLimits::default(),
        )
        .unwrap();
        let address = server.local_addr();
        assert!(std::net::TcpStream::connect(address).is_ok());
        drop(server);
        // The accept task ends at its next poll; give it at most 2 s.
        let deadline = Instant::now() + Duration::from_secs(2);
        while std::net::TcpStream::connect(address).is_ok() {
            assert!(
                Instant::now() < deadline,
                "still listening after the server was dropped"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Two layers in two regions, the second placed 100 bytes into its region: a range is checked
    /// against the grant of the layer's own group, and must lie inside that layer's blocks.
    #[test]
    fn reads_are_checked_against_the_layers_own_group_and_placement() {
        let layout = KvLayout::new(
            vec![GroupSpec::full(4, 1).unwrap(), GroupSpec::full(4, 1).unwrap()],
            vec![0, 1],
        )
        .unwrap();
        let regions = RegionLayout {
            layers: vec![
                LayerRegion {
                    region: 0,
                    base_offset: 0,
                    bytes_per_block: 64,
                    num_blocks: 8,
                },
                LayerRegion {
                    region: 1,
                    base_offset: 100,
                    bytes_per_block: 64,
                    num_blocks: 8,
                },
            ],
            generations: vec![2, 3],
            ranks: 1,
            dcp: 1,
        };
        let grants = Arc::new(Mutex::new(GrantTable::new(4)));
        // Block 2 of group 0 and block 5 of group 1.
        let grant = grants
            .lock()
            .unwrap()
            .issue(RequestId(1), node("d"), vec![vec![2], vec![5]], 60_000, 0)
            .unwrap();
        let authorizer = GrantAuthorizer::new(
            grants,
            layout,
            regions.with_generation_tables(2),
            MonotonicClock::new(),
        );
        let read = |region, offset, len| {
            authorizer
                .authorize_read(&node("d"), grant, region, offset, len)
                .map_err(|denied| denied.to_string())
        };
        assert_eq!(read(0, 2 * 64, 64), Ok(()));
        assert_eq!(read(1, 100 + 5 * 64, 64), Ok(()));
        assert_eq!(
            read(1, 100 + 2 * 64, 64),
            Err("grant 1 does not cover block 2 of group 1".into())
        );
        assert_eq!(
            read(0, 5 * 64, 64),
            Err("grant 1 does not cover block 5 of group 0".into())
        );
        assert_eq!(
            read(1, 99, 1),
            Err("range 99+1 of region 1 is not inside a block".into())
        );
        assert_eq!(
            read(1, 100, 64),
            Err("grant 1 does not cover block 0 of group 1".into()),
            "the first byte of the layer is inside block 0"
        );
        assert_eq!(
            read(0, 2 * 64, 0),
            Err("range 128+0 of region 0 is not inside a block".into())
        );
        assert_eq!(read(7, 0, 64), Err("region 7 holds no KV layer".into()));
        // A range running from a granted block into the next one is refused.
        assert_eq!(
            read(0, 2 * 64, 65),
            Err("grant 1 does not cover block 3 of group 0".into())
        );
    }
}
