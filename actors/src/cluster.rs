//! A whole P/D cluster of actors in one process, built from a [`ClusterConfig`], on in-process
//! or QUIC links (`[transport] links`).
//!
//! By default each leg gets its own arbiter (one thread) for its scheduler, allocator, exchange
//! and transfer actors, as separate processes would; with `leg_threads = "shared"` every leg and
//! the router run on the thread that starts the cluster, and no request waits for a thread to
//! wake. Either way READs and long computations do not block an arbiter: engines copy large
//! batches on their own workers, and the reference engine runs on each leg's compute workers. Legs share one
//! read-only [`Model`] and reach each other's memory through an in-process READ engine, exactly
//! as separate processes would: with `read_engine = "shm"` (the default) every leg's KV lives in
//! shared memory and readers map it read-only, with `"local"` in heap memory. Must be started
//! inside an actix `System`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix::{Actor, Addr, Arbiter, ArbiterHandle, AsyncContext, Context, Recipient};
use pdkv_core::allocator::Allocator;
use pdkv_core::grant::GrantTable;
use pdkv_core::leg::LegConfig;
use pdkv_core::node::LegNode;
use pdkv_core::plan::RegionLayout;
use pdkv_core::wire::{Incarnation, NodeId, RequestId, Role};
use pdkv_transport::clock::MonotonicClock;
use pdkv_transport::codec::PROTOCOL_VERSION;
use pdkv_transport::control::{
    ControlClient, ControlLimits, ControlServer, EngineAdvert, Hello, ServerSetup, TransportRuntime,
    new_incarnation,
};
use pdkv_transport::engine::{EngineKey, ReadEngine};
use pdkv_transport::host::host_id;
use pdkv_transport::mapped::{LocalFabric, MappedEngine};
use pdkv_transport::tls::{ClusterCa, NodeIdentity};
use tokio::sync::watch;

use crate::Stop;
use crate::compute::ComputePool;
use crate::config::{
    ClusterConfig, ControlThread, LegThreads, LinkKind, NodeConfig, ROUTER_NODE, ReadEngineKind,
};
use crate::engine::Model;
use crate::error::{RequestError, StartError, ask};
use crate::exchange::ExchangeActor;
use crate::hardware;
use crate::link::{Admit, DoorService, Inbound, Link, LinkLost, LocalLink, QuicLink, SetLink};
use crate::memory::LegMemory;
use crate::router::Output;
use crate::router::{Generate, Router};
use crate::scheduler::{Direct, LegContext, LegStats, Scheduler, Stats};
use crate::transfer::TransferActor;

/// Where Linux states how many memory mappings one process may hold.
const MAX_MAP_COUNT_PATH: &str = "/proc/sys/vm/max_map_count";

/// Linux's default `vm.max_map_count`, assumed when the file cannot be read.
const DEFAULT_MAX_MAP_COUNT: u64 = 65_530;

fn read_max_map_count() -> u64 {
    std::fs::read_to_string(MAX_MAP_COUNT_PATH)
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(DEFAULT_MAX_MAP_COUNT)
}

/// Refuses, before any region is created, a shared-memory cluster in one process whose legs
/// would map more regions than `max_map_count` leaves room for: every leg maps its own regions,
/// and every decode leg maps every prefill leg's regions read-only.
pub fn check_map_count(config: &ClusterConfig, max_map_count: u64) -> Result<(), StartError> {
    let regions = (config.layout.num_layers() + config.layout.groups().len()) as u64;
    let prefill = config.nodes_with_role(Role::Prefill).count() as u64;
    let decode = config.nodes_with_role(Role::Decode).count() as u64;
    let nodes = config.nodes.len() as u64;
    let needed = regions * nodes + regions * prefill * decode;
    // Libraries, heap arenas, and a stack plus guard for each leg's threads.
    let reserved = 4096 + 16 * nodes;
    let usable = max_map_count.saturating_sub(reserved);
    if needed > usable {
        return Err(StartError::MapLimit {
            needed,
            decode,
            prefill,
            regions,
            limit: max_map_count,
            reserved,
            usable,
        });
    }
    Ok(())
}

/// How long a link between two nodes of one process may take to set up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Request ids of direct (one-leg, reference) runs start here, far from the router's.
const DIRECT_REQUEST_BASE: u64 = 1 << 62;

fn incarnation() -> Result<Incarnation, StartError> {
    new_incarnation().map_err(|error| StartError::NoRandomness(error.to_string()))
}

fn link_error(peer: &NodeId, detail: impl std::fmt::Display) -> StartError {
    StartError::Link {
        peer: peer.to_string(),
        detail: detail.to_string(),
    }
}

/// Handles to one running leg.
pub struct LegHandle {
    /// The node's configuration.
    pub node: NodeConfig,
    /// Its incarnation.
    pub incarnation: Incarnation,
    /// Its scheduler.
    pub scheduler: Addr<Scheduler>,
    /// Its door to its peers.
    pub exchange: Addr<ExchangeActor>,
    /// Its transfer actor (decode legs).
    pub transfer: Option<Addr<TransferActor>>,
    /// Its in-process or shared-memory READ engine (tests arm faults on it).
    pub engine: Arc<MappedEngine>,
    /// All its READ engines, in preference order.
    pub engines: Vec<Arc<dyn ReadEngine>>,
    /// Its KV memory.
    pub memory: Arc<LegMemory>,
}

/// One node's door as the cluster wires it: what it says, and where its messages go.
#[derive(Clone)]
pub struct Door {
    /// What the node says at handshake.
    pub hello: Hello,
    /// Admits a peer's hello.
    pub admit: Recipient<Admit>,
    /// Takes a peer's envelopes.
    pub inbound: Recipient<Inbound>,
    /// Takes a link to a peer.
    pub set_link: Recipient<SetLink>,
    /// Told when a link to a peer went down.
    pub lost: Recipient<LinkLost>,
}

/// The QUIC side of a cluster on QUIC links: one control server and client per node.
struct QuicNodes {
    runtime: Option<TransportRuntime>,
    servers: Vec<ControlServer>,
    clients: Vec<ControlClient>,
    /// Per node: its endpoints run on the thread that shuts the cluster down, so they are closed
    /// without waiting (that thread could not drive the close while it waits).
    on_this_thread: Vec<bool>,
    addresses: HashMap<NodeId, SocketAddr>,
    ca: ClusterCa,
    runtime_handle: tokio::runtime::Handle,
}

/// How long closing the links may take at shutdown.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(1);

impl Drop for QuicNodes {
    fn drop(&mut self) {
        let mut idle: Vec<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>> = Vec::new();
        for ((server, client), here) in self.servers.iter().zip(&self.clients).zip(&self.on_this_thread) {
            server.close();
            client.close();
            if !here {
                idle.push(Box::pin(server.wait_idle()));
                idle.push(Box::pin(client.wait_idle()));
            }
        }
        let Some(runtime) = self.runtime.take() else {
            return;
        };
        // Let the peers see a clean close before the runtime stops (bounded).
        let (closed_tx, closed_rx) = std::sync::mpsc::sync_channel(1);
        runtime.handle().spawn(async move {
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, wait_all(idle)).await;
            let _ = closed_tx.send(());
        });
        let _ = closed_rx.recv_timeout(CLOSE_TIMEOUT * 2);
        runtime.shutdown_background();
    }
}

async fn wait_all(futures: Vec<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>>) {
    for future in futures {
        future.await;
    }
}

/// A running in-process cluster.
pub struct LocalCluster {
    config: ClusterConfig,
    model: Arc<Model>,
    router: Addr<Router>,
    router_incarnation: Incarnation,
    legs: Vec<LegHandle>,
    arbiters: Vec<Arbiter>,
    quic: Option<QuicNodes>,
    next_direct: AtomicU64,
}

impl LocalCluster {
    /// Starts every leg and the router, and links them as `[transport] links` says. Call inside
    /// a running actix `System`.
    pub async fn start(config: ClusterConfig) -> Result<Self, StartError> {
        if config.transport.read_engine == ReadEngineKind::Shm {
            check_map_count(&config, read_max_map_count())?;
        }
        let model = Arc::new(Model::new(config.model, config.layout.clone()));
        let fabric = LocalFabric::new();
        let mut legs = Vec::with_capacity(config.nodes.len());
        let mut arbiters = Vec::with_capacity(config.nodes.len());
        let mut doors = Vec::with_capacity(config.nodes.len() + 1);
        // The thread each door's actors run on (`None`: this one), for QUIC on the node's thread.
        let mut threads: Vec<Option<ArbiterHandle>> = Vec::with_capacity(config.nodes.len() + 1);
        for node in &config.nodes {
            let placement = match config.transport.leg_threads {
                LegThreads::PerLeg => {
                    let arbiter = Arbiter::new();
                    let handle = arbiter.handle();
                    arbiters.push(arbiter);
                    threads.push(Some(handle.clone()));
                    Placement::Own(handle)
                }
                LegThreads::Shared => {
                    threads.push(None);
                    Placement::Current
                }
            };
            let parts = in_process_parts(&config, node, &model, &fabric)?;
            let (leg, door) = start_leg(&config, node, &model, parts, placement)?;
            legs.push(leg);
            doors.push(door);
        }
        let (router, router_door) = start_router(&config)?;
        let router_incarnation = router_door.hello.incarnation;
        doors.push(router_door);
        threads.push(None);
        let quic = match config.transport.links {
            LinkKind::Local => {
                link_locally(&doors).await?;
                None
            }
            LinkKind::Quic => Some(link_over_quic(&config, &doors, &threads).await?),
        };
        Ok(LocalCluster {
            config,
            model,
            router,
            router_incarnation,
            legs,
            arbiters,
            quic,
            next_direct: AtomicU64::new(DIRECT_REQUEST_BASE),
        })
    }

    /// The configuration the cluster runs.
    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    /// The shared model.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The router (to send requests without waiting for each).
    pub fn router(&self) -> &Addr<Router> {
        &self.router
    }

    /// The router's incarnation (what it says in its hello).
    pub fn router_incarnation(&self) -> Incarnation {
        self.router_incarnation
    }

    /// The running legs.
    pub fn legs(&self) -> &[LegHandle] {
        &self.legs
    }

    /// One leg by name.
    pub fn leg(&self, name: &str) -> Option<&LegHandle> {
        self.legs.iter().find(|leg| leg.node.name.0 == name)
    }

    /// The control-plane address of a node, on QUIC links.
    pub fn control_addr(&self, name: &str) -> Option<SocketAddr> {
        self.quic
            .as_ref()
            .and_then(|quic| quic.addresses.get(&NodeId(name.into())).copied())
    }

    /// On QUIC links: a certificate for node `name` from the cluster's throwaway CA, and the
    /// runtime the links run on, so a test can dial a node as one of its peers.
    pub fn quic_identity(&self, name: &str) -> Option<(NodeIdentity, tokio::runtime::Handle)> {
        let quic = self.quic.as_ref()?;
        let identity = quic.ca.identity(name).ok()?;
        Some((identity, quic.runtime_handle.clone()))
    }

    /// Serves a request P/D, greedily.
    pub async fn generate(&self, prompt: Vec<u32>, max_tokens: u32) -> Result<Output, RequestError> {
        self.generate_sampled(prompt, max_tokens, pdkv_core::sampling::Sampling::default())
            .await
    }

    /// Serves a request P/D with the tokens chosen by `sampling`.
    pub async fn generate_sampled(
        &self,
        prompt: Vec<u32>,
        max_tokens: u32,
        sampling: pdkv_core::sampling::Sampling,
    ) -> Result<Output, RequestError> {
        let message = Generate {
            prompt: prompt.into(),
            max_tokens,
            sampling,
            stream: None,
            client: None,
        };
        ask(&self.router, message, "router").await?
    }

    /// Serves a request on one leg alone (by default the first prefill leg), greedily: the
    /// reference.
    pub async fn direct(
        &self,
        prompt: Vec<u32>,
        max_tokens: u32,
        node: Option<NodeId>,
    ) -> Result<Output, RequestError> {
        self.direct_sampled(prompt, max_tokens, pdkv_core::sampling::Sampling::default(), node)
            .await
    }

    /// [`Cluster::direct`] with the tokens chosen by `sampling`.
    pub async fn direct_sampled(
        &self,
        prompt: Vec<u32>,
        max_tokens: u32,
        sampling: pdkv_core::sampling::Sampling,
        node: Option<NodeId>,
    ) -> Result<Output, RequestError> {
        let leg = match &node {
            Some(node) => self.legs.iter().find(|leg| leg.node.name == *node),
            None => self.legs.iter().find(|leg| leg.node.role == Role::Prefill),
        }
        .ok_or_else(|| {
            RequestError::UnknownNode(node.map_or("no prefill leg".into(), |node| node.to_string()))
        })?;
        let message = Direct {
            request: RequestId(self.next_direct.fetch_add(1, Ordering::Relaxed)),
            prompt: prompt.into(),
            max_tokens,
            sampling,
        };
        let timeout_ms = self.config.limits.request_timeout_ms;
        tokio::time::timeout(
            Duration::from_millis(timeout_ms),
            ask(&leg.scheduler, message, "scheduler"),
        )
        .await
        .map_err(|_| RequestError::Timeout {
            stage: "direct",
            after_ms: timeout_ms,
        })??
    }

    /// Every leg's block accounting.
    pub async fn stats(&self) -> Result<Vec<LegStats>, RequestError> {
        let mut stats = Vec::with_capacity(self.legs.len());
        for leg in &self.legs {
            stats.push(ask(&leg.scheduler, Stats, "scheduler").await?);
        }
        Ok(stats)
    }

    /// Waits (at most `timeout`, polling every few ms) until every leg is idle; returns the last
    /// stats either way.
    pub async fn wait_idle(&self, timeout: Duration) -> Result<Vec<LegStats>, RequestError> {
        let deadline = Instant::now() + timeout;
        loop {
            let stats = self.stats().await?;
            if stats.iter().all(LegStats::is_idle) || Instant::now() >= deadline {
                return Ok(stats);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Closes the links, stops every actor and every arbiter the cluster started, waiting for
    /// their threads.
    pub fn shutdown(mut self) {
        drop(self.quic.take());
        let _ = self.router.try_send(Stop);
        for leg in &self.legs {
            let _ = leg.scheduler.try_send(Stop);
            let _ = leg.exchange.try_send(Stop);
            if let Some(transfer) = &leg.transfer {
                let _ = transfer.try_send(Stop);
            }
        }
        for arbiter in &self.arbiters {
            arbiter.stop();
        }
        for arbiter in std::mem::take(&mut self.arbiters) {
            let _ = arbiter.join();
        }
    }
}

/// Starts the router actor of `config` on this thread, and its door.
pub(crate) fn start_router(config: &ClusterConfig) -> Result<(Addr<Router>, Door), StartError> {
    let hello = Hello {
        node: NodeId(ROUTER_NODE.into()),
        role: Role::Router,
        incarnation: incarnation()?,
        regions: RegionLayout::default(),
        protocol_version: PROTOCOL_VERSION,
        layout_hash: config.layout.compat_hash(),
        model: config.model_fields(),
        engines: Vec::new(),
        host: host_id(),
    };
    let router = Router::new(
        hello.clone(),
        config.limits.request_timeout_ms,
        config.prompt_limit(),
        config.router.selection,
        config.limits.mailbox,
    )
    .with_retries(config.failure.max_retries)
    .start();
    let door = Door {
        hello,
        admit: router.clone().recipient(),
        inbound: router.clone().recipient(),
        set_link: router.clone().recipient(),
        lost: router.clone().recipient(),
    };
    Ok((router, door))
}

/// Where a leg's actors run.
pub enum Placement {
    /// On an arbiter of the leg's own.
    Own(ArbiterHandle),
    /// On the arbiter that starts the cluster.
    Current,
}

/// What a leg is built from besides its configuration: its KV memory, the engines its readers
/// reach it through, and the grant table and clock its allocator shares with a memory server.
pub struct LegParts {
    /// The leg's KV memory.
    pub memory: Arc<LegMemory>,
    /// Its in-process or shared-memory engine (preferred where it reaches).
    pub mapped: Arc<MappedEngine>,
    /// Further engines, in preference order (the network engine across hosts).
    pub more_engines: Vec<Arc<dyn ReadEngine>>,
    /// The one grant table.
    pub grants: Arc<Mutex<GrantTable>>,
    /// The clock leases are measured on.
    pub clock: MonotonicClock,
}

/// A leg's memory and engine inside one process, as `[transport] read_engine` says.
fn in_process_parts(
    config: &ClusterConfig,
    node: &NodeConfig,
    model: &Model,
    fabric: &LocalFabric,
) -> Result<LegParts, StartError> {
    let capacity = vec![node.blocks_per_group; config.layout.groups().len()];
    let key = EngineKey(node.name.0.clone());
    let mut more_engines = Vec::new();
    let (memory, engine) = match config.transport.read_engine {
        ReadEngineKind::Local => (
            LegMemory::heap(model, node.shards, &capacity),
            MappedEngine::local(key, fabric.clone())?,
        ),
        ReadEngineKind::Shm | ReadEngineKind::Net => (
            LegMemory::shared(model, node.shards, &capacity, &node.name.0).map_err(|source| {
                StartError::Memory {
                    node: node.name.0.clone(),
                    source,
                }
            })?,
            MappedEngine::shm(key)?,
        ),
        ReadEngineKind::Mori => {
            more_engines.push(hardware::mori_engine(config, node)?);
            (
                hardware::leg_memory(config, node, model)?,
                MappedEngine::shm(key)?,
            )
        }
    };
    Ok(LegParts {
        memory: Arc::new(memory),
        mapped: Arc::new(engine),
        more_engines,
        grants: Arc::new(Mutex::new(GrantTable::new(config.limits.max_grants))),
        clock: MonotonicClock::new(),
    })
}

/// Builds one leg where `placement` says: memory registered with its READ engines, allocator,
/// transfer (decode legs), scheduler and exchange.
pub(crate) fn start_leg(
    config: &ClusterConfig,
    node: &NodeConfig,
    model: &Arc<Model>,
    parts: LegParts,
    placement: Placement,
) -> Result<(LegHandle, Door), StartError> {
    let arbiter = match &placement {
        Placement::Own(handle) => handle.clone(),
        Placement::Current => Arbiter::current(),
    };
    let limits = config.limits;
    let capacity = vec![node.blocks_per_group; config.layout.groups().len()];
    let LegParts {
        memory,
        mapped,
        more_engines,
        grants,
        clock,
    } = parts;
    // Readers choose the first engine that reaches a peer: the mapped one unless the network
    // engine is asked for (`read_engine = "net"`). mori is the only engine of a mori leg: its
    // KV may be GPU memory, which no other engine reaches.
    let engines: Vec<Arc<dyn ReadEngine>> = match config.transport.read_engine {
        ReadEngineKind::Mori => more_engines,
        ReadEngineKind::Net => more_engines
            .into_iter()
            .chain([mapped.clone() as Arc<dyn ReadEngine>])
            .collect(),
        ReadEngineKind::Local | ReadEngineKind::Shm => [mapped.clone() as Arc<dyn ReadEngine>]
            .into_iter()
            .chain(more_engines)
            .collect(),
    };
    let mut adverts = Vec::with_capacity(engines.len());
    for engine in &engines {
        let mut descriptors = Vec::new();
        for (id, region) in memory.registered_regions() {
            descriptors.push(engine.register(id, region.clone())?);
        }
        adverts.push(EngineAdvert {
            engine: engine.descriptor(),
            regions: descriptors,
        });
    }
    let incarnation = incarnation()?;
    let host = host_id();
    let hello = Hello {
        node: node.name.clone(),
        role: node.role,
        incarnation,
        regions: memory.regions.clone(),
        protocol_version: PROTOCOL_VERSION,
        layout_hash: config.layout.compat_hash(),
        model: config.model_fields(),
        engines: adverts,
        host: host.clone(),
    };
    let allocator = Allocator::new(&config.layout, &capacity, node.prefix_caching)?;
    let (freed_tx, freed_rx) = watch::channel(0u64);
    let transfer = (node.role == Role::Decode).then(|| {
        let (layout, local_regions) = (config.layout.clone(), memory.regions.clone());
        let heads = config.head_layout();
        let read_timeout = Duration::from_millis(limits.request_timeout_ms);
        let engines = engines.clone();
        TransferActor::start_in_arbiter(&arbiter, move |_| {
            TransferActor::new(
                engines,
                host,
                layout,
                heads,
                local_regions,
                read_timeout,
                limits.mailbox,
            )
        })
    });
    let leg_config = LegConfig {
        node: node.name.clone(),
        incarnation,
        layout: config.layout.clone(),
        lookahead_tokens: node.lookahead_tokens,
        prefill_tokens: node.prefill_tokens,
        pairing: config.exchange.pairing,
        max_decode_tail_blocks: config.exchange.max_decode_tail_blocks,
        alloc_wait_ms: limits.alloc_wait_ms,
    };
    let leg_node = LegNode::new(
        pdkv_core::node::NodeConfig {
            leg: leg_config.clone(),
            role: node.role,
            lease_ms: limits.lease_ms,
            wait_queue: limits.wait_queue,
        },
        allocator,
        grants,
    );
    let context = Arc::new(LegContext {
        config: leg_config,
        limits,
        model: model.clone(),
        memory: memory.clone(),
        transfer: transfer.clone(),
        compute: ComputePool::new(
            limits.compute_workers,
            Duration::from_micros(limits.inline_compute_us),
        ),
        freed: freed_rx,
        clock,
    });
    // The scheduler and its exchange name each other: the exchange starts inside the
    // scheduler's constructor, on the same arbiter, and its address comes back here.
    let (exchange_tx, exchange_rx) = std::sync::mpsc::sync_channel(1);
    let (door_hello, door_transfer) = (hello.clone(), transfer.clone());
    let build = move |ctx: &mut Context<Scheduler>| {
        let exchange = ExchangeActor::new(door_hello, ctx.address(), door_transfer, limits.mailbox).start();
        // The receiver below waits for exactly this send.
        let _ = exchange_tx.send(exchange.clone());
        Scheduler::new(context, leg_node, exchange, freed_tx)
    };
    let scheduler = match placement {
        Placement::Own(handle) => Scheduler::start_in_arbiter(&handle, build),
        // On this thread the constructor must run now: waiting for it would block it.
        Placement::Current => Scheduler::create(build),
    };
    let exchange = exchange_rx
        .recv_timeout(CONNECT_TIMEOUT)
        .map_err(|error| link_error(&node.name, format!("leg actors did not start: {error}")))?;
    let door = Door {
        hello,
        admit: exchange.clone().recipient(),
        inbound: exchange.clone().recipient(),
        set_link: exchange.clone().recipient(),
        lost: exchange.clone().recipient(),
    };
    let leg = LegHandle {
        node: node.clone(),
        incarnation,
        scheduler,
        exchange,
        transfer,
        engine: mapped,
        engines,
        memory,
    };
    Ok((leg, door))
}

/// Which nodes talk to which: the router with every leg, every decode leg with every prefill
/// leg, both ways.
fn linked_pairs(doors: &[Door]) -> Vec<(usize, usize)> {
    let role = |index: usize| doors[index].hello.role;
    let mut pairs = Vec::new();
    for a in 0..doors.len() {
        for b in 0..doors.len() {
            let talk = matches!(
                (role(a), role(b)),
                (Role::Router, Role::Prefill | Role::Decode)
                    | (Role::Prefill | Role::Decode, Role::Router)
                    | (Role::Prefill, Role::Decode)
                    | (Role::Decode, Role::Prefill)
            );
            if talk {
                pairs.push((a, b));
            }
        }
    }
    pairs
}

async fn admit(door: &Door, hello: &Hello, dialed_in: bool) -> Result<(), StartError> {
    let message = Admit {
        hello: hello.clone(),
        dialed_in,
    };
    door.admit
        .send(message)
        .await
        .map_err(|error| link_error(&door.hello.node, error))?
        .map_err(|refusal| link_error(&hello.node, refusal))
}

/// Links nodes through their mailboxes, after each side admitted the other's hello.
async fn link_locally(doors: &[Door]) -> Result<(), StartError> {
    let pairs = linked_pairs(doors);
    // Links are both ways, so every node of a pair admits the other here.
    for &(a, b) in &pairs {
        admit(&doors[b], &doors[a].hello, true).await?;
    }
    for (a, b) in pairs {
        let (from, to) = (&doors[a], &doors[b]);
        let link = LocalLink::new(from.hello.node.clone(), to.hello.node.clone(), to.inbound.clone());
        set_link(from, to, Arc::new(link)).await?;
    }
    Ok(())
}

/// Gives `from` its link to `to`.
async fn set_link(from: &Door, to: &Door, link: Arc<dyn Link>) -> Result<(), StartError> {
    let message = SetLink {
        peer: to.hello.node.clone(),
        link,
    };
    from.set_link
        .send(message)
        .await
        .map_err(|error| link_error(&to.hello.node, error))
}

/// The tokio runtime of the arbiter behind `thread` (`None`: this thread's).
async fn runtime_of(thread: Option<&ArbiterHandle>) -> Result<tokio::runtime::Handle, StartError> {
    let Some(arbiter) = thread else {
        return Ok(tokio::runtime::Handle::current());
    };
    let (sender, receiver) = tokio::sync::oneshot::channel();
    let asked = arbiter.spawn(async move {
        let _ = sender.send(tokio::runtime::Handle::current());
    });
    let stopped = || {
        link_error(
            &NodeId("cluster".into()),
            "a leg's arbiter stopped while starting",
        )
    };
    if !asked {
        return Err(stopped());
    }
    receiver.await.map_err(|_| stopped())
}

/// Gives every node a control server on loopback with a certificate from a throwaway cluster CA,
/// and dials every linked pair: the handshake admits each side's hello. `threads[i]` is the
/// arbiter `doors[i]`'s actors run on (`None`: this thread): with `control_thread = "node"` its
/// QUIC endpoints run there too.
async fn link_over_quic(
    config: &ClusterConfig,
    doors: &[Door],
    threads: &[Option<ArbiterHandle>],
) -> Result<QuicNodes, StartError> {
    let setup = |detail: String| link_error(&NodeId("cluster".into()), detail);
    let runtime = TransportRuntime::new(2).map_err(|error| setup(format!("transport runtime: {error}")))?;
    let handle = runtime.handle();
    let ca = ClusterCa::generate("pdkv-local").map_err(|error| setup(error.to_string()))?;
    let names: Vec<NodeId> = doors.iter().map(|door| door.hello.node.clone()).collect();
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let mut quic = QuicNodes {
        runtime: None,
        servers: Vec::new(),
        clients: Vec::new(),
        on_this_thread: Vec::new(),
        addresses: HashMap::new(),
        ca,
        runtime_handle: handle.clone(),
    };
    for (door, thread) in doors.iter().zip(threads) {
        let node = &door.hello.node;
        let (handle, closes_here) = match config.transport.control_thread {
            ControlThread::Transport => (handle.clone(), false),
            ControlThread::Node => (runtime_of(thread.as_ref()).await?, thread.is_none()),
        };
        let identity = quic
            .ca
            .identity(&node.0)
            .map_err(|error| link_error(node, error))?;
        let service = DoorService::new(door.admit.clone(), door.inbound.clone());
        let server_setup = ServerSetup {
            cluster: names.clone(),
            hello: door.hello.clone(),
            service: Arc::new(service),
            tickets: None,
            limits: ControlLimits::default(),
        };
        let server = ControlServer::start(&handle, loopback, &identity, server_setup)
            .map_err(|error| link_error(node, error))?;
        let addr = server.local_addr().map_err(|error| link_error(node, error))?;
        quic.addresses.insert(node.clone(), addr);
        quic.servers.push(server);
        quic.clients
            .push(ControlClient::new(&handle, loopback, &identity).map_err(|error| link_error(node, error))?);
        quic.on_this_thread.push(closes_here);
    }
    let message_timeout = Duration::from_millis(config.limits.request_timeout_ms);
    for (a, b) in linked_pairs(doors) {
        let (from, to) = (&doors[a], &doors[b]);
        let addr = quic.addresses[&to.hello.node];
        let connection = quic.clients[a]
            .connect(addr, &to.hello.node.0, &from.hello, CONNECT_TIMEOUT)
            .await
            .map_err(|error| link_error(&to.hello.node, error))?;
        admit(from, &connection.peer, false).await?;
        let frames = connection
            .open_frames(CONNECT_TIMEOUT)
            .await
            .map_err(|error| link_error(&to.hello.node, error))?;
        let link = QuicLink::new(
            to.hello.node.clone(),
            frames,
            config.limits.link_in_flight,
            message_timeout,
        );
        set_link(from, to, Arc::new(link)).await?;
    }
    quic.runtime = Some(runtime);
    Ok(quic)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DEFAULT_CLUSTER_TOML;

    fn cluster(prefill: usize, decode: usize) -> ClusterConfig {
        let base = DEFAULT_CLUSTER_TOML;
        let mut text = base[..base.find("[[nodes]]").unwrap()].to_string();
        for (role, count) in [("prefill", prefill), ("decode", decode)] {
            for index in 0..count {
                text.push_str(&format!(
                    "[[nodes]]\nname = \"{role}-{index}\"\nrole = \"{role}\"\nblocks_per_group = 8\n"
                ));
            }
        }
        ClusterConfig::from_toml(&text).unwrap()
    }

    /// 4 layers + 2 generation tables = 6 regions a leg. 112 x 112 legs need
    /// 6 * 224 + 6 * 112 * 112 = 76 608 mappings, more than Linux's default 65 530 allows; 96 x 96
    /// need 56 448, which fit (and run: `pdkv sweep` on such a cluster was tried by hand).
    #[test]
    fn shm_clusters_beyond_max_map_count_are_refused_with_the_limit_named() {
        assert!(check_map_count(&cluster(1, 1), 65_530).is_ok());
        assert!(check_map_count(&cluster(96, 96), 65_530).is_ok());
        let error = check_map_count(&cluster(112, 112), 65_530).unwrap_err();
        assert!(
            matches!(
                error,
                StartError::MapLimit {
                    needed: 76_608,
                    decode: 112,
                    prefill: 112,
                    regions: 6,
                    limit: 65_530,
                    reserved,
                    usable,
                } if reserved == 4096 + 16 * 224 && usable == 65_530 - 4096 - 16 * 224
            ),
            "{error:?}"
        );
        assert!(error.to_string().contains("vm.max_map_count = 65530"), "{error}");
        assert!(check_map_count(&cluster(112, 112), 1 << 20).is_ok());
    }
}
