//! One node of a cluster in its own process: a leg (`pdkv node`) or the router (`pdkv router`),
//! reached over QUIC with mutual TLS at the address `cluster.toml` gives it.
//!
//! A node starts its actors, serves its control plane, and dials every peer it talks to (the
//! router dials every leg; every leg dials the router and every leg of the other role), again
//! and again with a capped backoff until the link is up, and again whenever it drops (a peer
//! that restarts is re-linked under its new incarnation). A leg's memory lives in shared memory
//! and is offered to readers through two engines: shared memory (chosen by a reader on the same
//! host, compared by host id in the hello) and the network engine (its memory server on
//! `data_port`, checking every READ against the leg's grant table). Each peer's state — linked,
//! or why not — is kept on a [`PeerBoard`] that `/ready` reports.

use std::collections::{BTreeMap, HashMap};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use actix::Addr;
use pdkv_core::grant::GrantTable;
use pdkv_core::wire::{NodeId, Role};
use pdkv_transport::clock::MonotonicClock;
use pdkv_transport::control::{
    ControlClient, ControlLimits, ControlServer, PeerConnection, ServerSetup, TransportRuntime,
};
use pdkv_transport::engine::{EngineKey, EngineKind, ReadEngine};
use pdkv_transport::mapped::MappedEngine;
use pdkv_transport::net::{GrantAuthorizer, MemoryServer, MemoryServerLimits, NetEngine, TicketBook};
use pdkv_transport::tls::NodeIdentity;
use serde::Serialize;

use crate::cluster::{Door, LegHandle, LegParts, Placement, start_leg, start_router};
use crate::config::{ClusterConfig, ControlThread, NodeConfig, ROUTER_NODE, ReadEngineKind};
use crate::engine::Model;
use crate::error::StartError;
use crate::hardware;
use crate::link::{Admit, DoorService, LinkLost, QuicLink, SetLink};
use crate::router::Router;
use pdkv_transport::kv_read::choose_engine;

/// How long one dial (connect, handshake, ticket, stream) may take.
const DIAL_TIMEOUT: Duration = Duration::from_secs(5);

/// First pause between failed dials; doubled after each failure up to [`MAX_REDIAL`].
const FIRST_REDIAL: Duration = Duration::from_millis(50);

/// Longest pause between dials of a peer that is down.
const MAX_REDIAL: Duration = Duration::from_secs(1);

/// Network tickets a prefill leg's memory server holds unredeemed at once.
const MAX_TICKETS: usize = 256;

/// How long a network ticket stays redeemable.
const TICKET_TTL: Duration = Duration::from_secs(30);

/// Threads of the transport runtime: the network READ engine, and quinn with `control_thread = "transport"`.
const TRANSPORT_THREADS: usize = 2;

/// How long a node stopping waits for its peers to see its connections close.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(1);

fn setup_error(node: &NodeId, detail: impl std::fmt::Display) -> StartError {
    StartError::Link {
        peer: node.to_string(),
        detail: detail.to_string(),
    }
}

/// One peer as a node sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PeerState {
    /// The peer's role.
    pub role: Role,
    /// Linked both ways: this node's link to it is up, and that incarnation of it dialled this
    /// node (so it can answer).
    pub linked: bool,
    /// This node's link to it is up.
    pub dialed_out: bool,
    /// Its incarnation, once it said hello.
    pub incarnation: Option<u64>,
    /// The incarnation that last dialled this node.
    pub dialed_in: Option<u64>,
    /// Why the last dial failed or the link dropped.
    pub last_error: Option<String>,
    /// Dials so far.
    pub dials: u64,
    /// Times a link to it came up.
    pub links: u64,
    /// Unix seconds of the last change.
    pub since_unix_s: u64,
}

/// Every peer's state, shared between the dialers and the admin endpoint.
#[derive(Debug, Default)]
pub struct PeerBoard {
    peers: Mutex<BTreeMap<String, PeerState>>,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

impl PeerBoard {
    fn add(&self, node: &NodeId, role: Role) {
        let state = PeerState {
            role,
            linked: false,
            dialed_out: false,
            incarnation: None,
            dialed_in: None,
            last_error: None,
            dials: 0,
            links: 0,
            since_unix_s: unix_now(),
        };
        self.peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(node.0.clone(), state);
    }

    fn update(&self, node: &NodeId, change: impl FnOnce(&mut PeerState)) {
        if let Some(state) = self
            .peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(&node.0)
        {
            change(state);
            state.linked =
                state.dialed_out && state.incarnation.is_some() && state.dialed_in == state.incarnation;
        }
    }

    /// `node` (of `incarnation`) dialled this node and was admitted.
    fn dialed_in(&self, node: &NodeId, incarnation: u64) {
        self.update(node, |state| state.dialed_in = Some(incarnation));
    }

    /// A snapshot of every peer.
    pub fn snapshot(&self) -> BTreeMap<String, PeerState> {
        self.peers.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Whether a link is up to at least one peer of `role`.
    pub fn any_linked(&self, role: Role) -> bool {
        self.snapshot()
            .values()
            .any(|peer| peer.role == role && peer.linked)
    }

    /// Whether every peer is linked.
    pub fn all_linked(&self) -> bool {
        self.snapshot().values().all(|peer| peer.linked)
    }
}

/// What a node's `/ready` reports.
#[derive(Debug, Clone, Serialize)]
pub struct Readiness {
    /// The node.
    pub node: String,
    /// Its role.
    pub role: Role,
    /// It can serve: a leg has a link to the router and to a leg of the other role; the router
    /// has a link to a prefill and a decode leg; and it is not draining.
    pub ready: bool,
    /// Every peer is linked.
    pub all_peers_linked: bool,
    /// It is shutting down.
    pub draining: bool,
    /// Per peer.
    pub peers: BTreeMap<String, PeerState>,
}

/// Where a node of `config` is dialled: its host and control port, which must be fixed.
pub fn control_address(config: &ClusterConfig, node: &str) -> Result<SocketAddr, StartError> {
    let (key, host, port) = if node == ROUTER_NODE {
        (
            "router.control_port".to_string(),
            &config.router.host,
            config.router.control_port,
        )
    } else {
        let index = config
            .nodes
            .iter()
            .position(|candidate| candidate.name.0 == node)
            .ok_or_else(|| StartError::UnknownNode(node.to_string()))?;
        let address = &config.nodes[index].address;
        (
            format!("nodes[{index}].control_port"),
            &address.host,
            address.control_port,
        )
    };
    if port == 0 {
        return Err(setup_error(
            &NodeId(node.into()),
            format!(
                "{key} is 0: nodes in separate processes need fixed ports (`pdkv launch` picks free ones)"
            ),
        ));
    }
    resolve(host, port).map_err(|detail| setup_error(&NodeId(node.into()), detail))
}

/// Where `config` says leg `node`'s memory server is dialled (`host:data_port`), when its
/// data port is fixed; the router and unknown names have none.
fn data_address(config: &ClusterConfig, node: &NodeId) -> Option<String> {
    let address = &config
        .nodes
        .iter()
        .find(|candidate| candidate.name == *node)?
        .address;
    (address.data_port != 0).then(|| host_port(&address.host, address.data_port))
}

/// `host:port`, with an IPv6 host in brackets.
pub fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Resolves `host:port` to its first address.
pub fn resolve(host: &str, port: u16) -> Result<SocketAddr, String> {
    (host, port)
        .to_socket_addrs()
        .map_err(|error| format!("cannot resolve {host}: {error}"))?
        .next()
        .ok_or_else(|| format!("{host} resolves to no address"))
}

/// The peers a node talks to: the router talks to every leg; a leg to the router and to every
/// leg of the other role.
pub fn peers_of(config: &ClusterConfig, role: Role) -> Vec<(NodeId, Role)> {
    let mut peers = Vec::new();
    if role != Role::Router {
        peers.push((NodeId(ROUTER_NODE.into()), Role::Router));
    }
    for node in &config.nodes {
        let talks = match role {
            Role::Router => true,
            Role::Prefill => node.role == Role::Decode,
            Role::Decode => node.role == Role::Prefill,
        };
        if talks {
            peers.push((node.name.clone(), node.role));
        }
    }
    peers
}

/// Every name that may hold a certificate of the cluster (the router included).
fn cluster_names(config: &ClusterConfig) -> Vec<NodeId> {
    let mut names: Vec<NodeId> = config.nodes.iter().map(|node| node.name.clone()).collect();
    names.push(NodeId(ROUTER_NODE.into()));
    names
}

/// What a node runs besides its door: a leg's handles or the router's address.
enum Actors {
    Leg(Box<LegHandle>),
    Router(Addr<Router>),
}

/// A running node: its actors, control plane and dialers. Start inside an actix `System`.
pub struct NodeProcess {
    name: NodeId,
    role: Role,
    actors: Actors,
    board: Arc<PeerBoard>,
    draining: Arc<std::sync::atomic::AtomicBool>,
    server: ControlServer,
    client: ControlClient,
    memory_server: Option<MemoryServer>,
    dialers: Vec<tokio::task::JoinHandle<()>>,
    runtime: Option<TransportRuntime>,
}

/// The transport runtime of a node still starting: if the start fails, it is shut down in the
/// background (dropping a runtime inside the actix system's async context would panic and hide
/// the error).
struct StartingRuntime(Option<TransportRuntime>);

impl StartingRuntime {
    fn handle(&self) -> tokio::runtime::Handle {
        self.0.as_ref().expect("taken only on success").handle()
    }
}

impl Drop for StartingRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

impl NodeProcess {
    /// Starts node `name` of `config` (a leg, or the router when `name` is `router`) with
    /// `identity` as its certificate.
    pub async fn start(
        config: ClusterConfig,
        name: &str,
        identity: NodeIdentity,
    ) -> Result<Self, StartError> {
        let node_id = NodeId(name.into());
        let mut runtime = StartingRuntime(Some(
            TransportRuntime::new(TRANSPORT_THREADS).map_err(|error| setup_error(&node_id, error))?,
        ));
        let handle = runtime.handle();
        // QUIC runs where `control_thread` says: on this thread, beside the node's actors, or on
        // the transport runtime with the network READ engine.
        let control = match config.transport.control_thread {
            ControlThread::Node => tokio::runtime::Handle::current(),
            ControlThread::Transport => handle.clone(),
        };
        let (role, bind, actors, door, memory_server, tickets, net) = if name == ROUTER_NODE {
            let bind = resolve(config.router.bind_host(), config.router.control_port)
                .map_err(|detail| setup_error(&node_id, detail))?;
            let (router, door) = start_router(&config)?;
            (Role::Router, bind, Actors::Router(router), door, None, None, None)
        } else {
            let node = config
                .nodes
                .iter()
                .find(|node| node.name.0 == name)
                .ok_or_else(|| StartError::UnknownNode(name.to_string()))?
                .clone();
            if config.transport.read_engine == ReadEngineKind::Local {
                return Err(setup_error(
                    &node_id,
                    "[transport] read_engine = \"local\" works only in one process; use \"shm\" or \"net\"",
                ));
            }
            let bind = resolve(node.address.bind_host(), node.address.control_port)
                .map_err(|detail| setup_error(&node_id, detail))?;
            let started = start_process_leg(&config, &node, &handle)?;
            (
                node.role,
                bind,
                Actors::Leg(Box::new(started.leg)),
                started.door,
                started.memory_server,
                started.tickets,
                Some(started.net),
            )
        };
        // A peer that dials us is up: dial it back now rather than at the next backoff.
        let peers = peers_of(&config, role);
        let wake: HashMap<NodeId, Arc<tokio::sync::Notify>> = peers
            .iter()
            .map(|(peer, _)| (peer.clone(), Arc::new(tokio::sync::Notify::new())))
            .collect();
        // Every peer is on the board before the server can admit one.
        let board = Arc::new(PeerBoard::default());
        for (peer, peer_role) in &peers {
            board.add(peer, *peer_role);
        }
        let (on_admit_wake, on_admit_board) = (wake.clone(), board.clone());
        // Heartbeats on every connection: a peer silent for `peer_timeout` is down.
        let limits = ControlLimits::with_heartbeat(
            Duration::from_millis(config.failure.heartbeat_ms),
            config.failure.heartbeat_misses,
        );
        let service = DoorService::new(door.admit.clone(), door.inbound.clone()).with_on_admit(Arc::new(
            move |hello: &pdkv_transport::control::Hello| {
                on_admit_board.dialed_in(&hello.node, hello.incarnation.0);
                if let Some(wake) = on_admit_wake.get(&hello.node) {
                    wake.notify_one();
                }
            },
        ));
        let setup = ServerSetup {
            cluster: cluster_names(&config),
            hello: door.hello.clone(),
            service: Arc::new(service),
            tickets,
            limits,
        };
        let started = peers
            .iter()
            .map(|(peer, _)| control_address(&config, &peer.0))
            .collect::<Result<Vec<SocketAddr>, _>>()
            .and_then(|addresses| {
                let server = ControlServer::start(&control, bind, &identity, setup)
                    .map_err(|error| setup_error(&node_id, format!("control server on {bind}: {error}")))?;
                let client_bind = SocketAddr::new(bind.ip(), 0);
                let client = ControlClient::with_limits(&control, client_bind, &identity, &limits)
                    .map_err(|error| setup_error(&node_id, error))?;
                Ok((server, client, addresses))
            });
        let (server, client, addresses) = match started {
            Ok(started) => started,
            Err(error) => {
                // Stop the actors while the system runs: an actor never polled would start
                // (and panic) when the system drops it.
                actors.stop();
                tokio::time::sleep(Duration::from_millis(20)).await;
                return Err(error);
            }
        };
        let engine_kinds: Vec<EngineKind> = match &actors {
            Actors::Leg(leg) => leg
                .engines
                .iter()
                .map(|engine| engine.descriptor().kind)
                .collect(),
            Actors::Router(_) => Vec::new(),
        };
        let mut dialers = Vec::new();
        for ((peer, peer_role), address) in peers.into_iter().zip(addresses) {
            let data_address = data_address(&config, &peer);
            let dialer = Dialer {
                wake: wake[&peer].clone(),
                door: door.clone(),
                client: client.clone(),
                peer,
                address,
                board: board.clone(),
                net: net.clone(),
                engine_kinds: engine_kinds.clone(),
                reads: role == Role::Decode && peer_role == Role::Prefill,
                data_address,
                link_in_flight: config.limits.link_in_flight,
                message_timeout: Duration::from_millis(config.limits.request_timeout_ms),
            };
            dialers.push(handle.spawn(dialer.run()));
        }
        tracing::info!(node = %node_id, %role, control = %bind, "node started");
        Ok(NodeProcess {
            name: node_id,
            role,
            actors,
            board,
            draining: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            server,
            client,
            memory_server,
            dialers,
            runtime: runtime.0.take(),
        })
    }

    /// The node's name.
    pub fn name(&self) -> &NodeId {
        &self.name
    }

    /// The node's role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The router's address (router nodes).
    pub fn router(&self) -> Option<&Addr<Router>> {
        match &self.actors {
            Actors::Router(router) => Some(router),
            Actors::Leg(_) => None,
        }
    }

    /// The leg's handles (legs).
    pub fn leg(&self) -> Option<&LegHandle> {
        match &self.actors {
            Actors::Leg(leg) => Some(leg),
            Actors::Router(_) => None,
        }
    }

    /// The control plane's bound address.
    pub fn control_addr(&self) -> Option<SocketAddr> {
        self.server.local_addr().ok()
    }

    /// The network memory server's bound address (prefill legs).
    pub fn data_addr(&self) -> Option<SocketAddr> {
        self.memory_server.as_ref().map(MemoryServer::local_addr)
    }

    /// The peer board (for `/ready`).
    pub fn board(&self) -> Arc<PeerBoard> {
        self.board.clone()
    }

    /// A handle that tells whether the node is draining.
    pub fn draining_flag(&self) -> Arc<std::sync::atomic::AtomicBool> {
        self.draining.clone()
    }

    /// What `/ready` reports now.
    pub fn readiness(&self) -> Readiness {
        readiness(&self.name, self.role, &self.board, &self.draining)
    }

    /// Stops taking requests: a leg refuses new ones (the router is told at once); in-flight
    /// requests go on.
    pub fn drain(&self) {
        self.draining.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Actors::Leg(leg) = &self.actors {
            let _ = leg.scheduler.try_send(crate::scheduler::Drain);
        }
    }

    /// Closes the control plane and the memory server and stops the actors; peers see the
    /// close (waited for at most [`CLOSE_TIMEOUT`]) before the transport runtime goes. Await it
    /// on the thread that started the node: QUIC may run there.
    pub async fn shutdown(mut self) {
        for dialer in &self.dialers {
            dialer.abort();
        }
        self.server.close();
        self.client.close();
        drop(self.memory_server.take());
        self.actors.stop();
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, async {
            self.server.wait_idle().await;
            self.client.wait_idle().await;
        })
        .await;
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// Readiness of node `name` from its board.
pub fn readiness(
    name: &NodeId,
    role: Role,
    board: &PeerBoard,
    draining: &std::sync::atomic::AtomicBool,
) -> Readiness {
    let draining = draining.load(std::sync::atomic::Ordering::SeqCst);
    let serving = match role {
        Role::Router => board.any_linked(Role::Prefill) && board.any_linked(Role::Decode),
        Role::Prefill => board.any_linked(Role::Router) && board.any_linked(Role::Decode),
        Role::Decode => board.any_linked(Role::Router) && board.any_linked(Role::Prefill),
    };
    Readiness {
        node: name.0.clone(),
        role,
        ready: serving && !draining,
        all_peers_linked: board.all_linked(),
        draining,
        peers: board.snapshot(),
    }
}

impl Actors {
    /// Asks every actor to stop.
    fn stop(&self) {
        match self {
            Actors::Router(router) => {
                let _ = router.try_send(crate::Stop);
            }
            Actors::Leg(leg) => {
                let _ = leg.scheduler.try_send(crate::Stop);
                let _ = leg.exchange.try_send(crate::Stop);
                if let Some(transfer) = &leg.transfer {
                    let _ = transfer.try_send(crate::Stop);
                }
            }
        }
    }
}

struct ProcessLeg {
    leg: LegHandle,
    door: Door,
    net: Arc<NetEngine>,
    memory_server: Option<MemoryServer>,
    tickets: Option<Arc<TicketBook>>,
}

/// A leg of its own process: memory in shared memory, offered through the shm engine and the
/// network engine (a prefill leg serves its memory on `data_port`).
fn start_process_leg(
    config: &ClusterConfig,
    node: &NodeConfig,
    runtime: &tokio::runtime::Handle,
) -> Result<ProcessLeg, StartError> {
    let model = Arc::new(Model::new(config.model, config.layout.clone()));
    let memory = Arc::new(hardware::leg_memory(config, node, &model)?);
    let key = EngineKey(node.name.0.clone());
    let grants = Arc::new(Mutex::new(GrantTable::new(config.limits.max_grants)));
    let clock = MonotonicClock::new();
    // A prefill leg serves its regions over the network engine, unless mori is its one engine
    // (mori reads registered memory directly; GPU memory could not be served anyway).
    let serves = node.role == Role::Prefill && config.transport.read_engine != ReadEngineKind::Mori;
    let (memory_server, tickets, address) = if serves {
        let bind = resolve(node.address.bind_host(), node.address.data_port)
            .map_err(|detail| setup_error(&node.name, detail))?;
        let tickets = Arc::new(TicketBook::new(TICKET_TTL, MAX_TICKETS));
        let authorizer = Arc::new(GrantAuthorizer::new(
            grants.clone(),
            config.layout.clone(),
            memory.regions.clone(),
            clock,
        ));
        let served: HashMap<u32, Arc<pdkv_transport::region::Region>> = memory
            .registered_regions()
            .map(|(id, region)| (id, region.clone()))
            .collect();
        let server = MemoryServer::start(
            runtime,
            bind,
            served,
            authorizer,
            tickets.clone(),
            MemoryServerLimits::default(),
        )
        .map_err(|error| setup_error(&node.name, format!("memory server on {bind}: {error}")))?;
        // Readers dial what the hello says: the bound address, or the node's host when it
        // binds every interface.
        let bound = server.local_addr();
        let address = if bound.ip().is_unspecified() {
            resolve(&node.address.host, bound.port()).map_err(|detail| setup_error(&node.name, detail))?
        } else {
            bound
        };
        (Some(server), Some(tickets), address.to_string())
    } else {
        (None, None, String::new())
    };
    let net = Arc::new(NetEngine::new(key.clone(), runtime.clone(), address));
    let parts = LegParts {
        memory,
        mapped: Arc::new(MappedEngine::shm(key)?),
        more_engines: match config.transport.read_engine {
            ReadEngineKind::Mori => vec![hardware::mori_engine(config, node)?],
            _ => vec![net.clone() as Arc<dyn ReadEngine>],
        },
        grants,
        clock,
    };
    let (leg, door) = start_leg(config, node, &model, parts, Placement::Current)?;
    Ok(ProcessLeg {
        leg,
        door,
        net,
        memory_server,
        tickets,
    })
}

/// Keeps one link to one peer up: dials, admits the peer's hello, opens the network data
/// connection when this decode leg reads the peer over the net engine, opens the stream of
/// frames and hands the link to the door; when the connection drops, starts over.
struct Dialer {
    /// Notified when the peer dials this node.
    wake: Arc<tokio::sync::Notify>,
    door: Door,
    client: ControlClient,
    peer: NodeId,
    address: SocketAddr,
    board: Arc<PeerBoard>,
    net: Option<Arc<NetEngine>>,
    /// This leg's engines in its transfer actor's order of preference.
    engine_kinds: Vec<EngineKind>,
    reads: bool,
    /// Where this node's configuration says the peer's memory server is (`host:data_port`);
    /// dialled instead of the address the peer advertises, so relays and NAT work.
    data_address: Option<String>,
    link_in_flight: usize,
    message_timeout: Duration,
}

impl Dialer {
    async fn run(self) {
        let mut pause = FIRST_REDIAL;
        let mut failures = 0u64;
        loop {
            self.board.update(&self.peer, |state| state.dials += 1);
            match self.link().await {
                Ok(connection) => {
                    failures = 0;
                    pause = FIRST_REDIAL;
                    let incarnation = connection.peer.incarnation.0;
                    self.board.update(&self.peer, |state| {
                        state.dialed_out = true;
                        state.links += 1;
                        state.incarnation = Some(incarnation);
                        state.last_error = None;
                        state.since_unix_s = unix_now();
                    });
                    tracing::info!(peer = %self.peer, incarnation, "linked");
                    metrics::gauge!("pdkv_peer_up", "peer" => self.peer.0.clone()).set(1.0);
                    let reason = connection.closed().await;
                    tracing::warn!(peer = %self.peer, %reason, "link lost");
                    let lost = LinkLost {
                        peer: self.peer.clone(),
                        incarnation: connection.peer.incarnation,
                        reason: reason.clone(),
                    };
                    if let Err(error) = self.door.lost.send(lost).await {
                        tracing::error!(peer = %self.peer, %error, "door unreachable");
                    }
                    metrics::gauge!("pdkv_peer_up", "peer" => self.peer.0.clone()).set(0.0);
                    self.board.update(&self.peer, |state| {
                        state.dialed_out = false;
                        state.last_error = Some(format!("link lost: {reason}"));
                        state.since_unix_s = unix_now();
                    });
                }
                Err(error) => {
                    failures += 1;
                    metrics::gauge!("pdkv_peer_up", "peer" => self.peer.0.clone()).set(0.0);
                    // The first failure and then every 20th: a peer still starting is normal.
                    if failures == 1 || failures.is_multiple_of(20) {
                        tracing::warn!(peer = %self.peer, address = %self.address, %error, failures, "dial failed");
                    }
                    self.board.update(&self.peer, |state| {
                        state.dialed_out = false;
                        state.last_error = Some(error.to_string());
                        state.since_unix_s = unix_now();
                    });
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = self.wake.notified() => {}
            }
            pause = (pause * 2).min(MAX_REDIAL);
        }
    }

    async fn link(&self) -> Result<PeerConnection, StartError> {
        let failed = |detail: String| setup_error(&self.peer, detail);
        let connection = self
            .client
            .connect(self.address, &self.peer.0, &self.door.hello, DIAL_TIMEOUT)
            .await
            .map_err(|error| failed(format!("dial {}: {error}", self.address)))?;
        let admit = Admit {
            hello: connection.peer.clone(),
            dialed_in: false,
        };
        self.door
            .admit
            .send(admit)
            .await
            .map_err(|error| failed(format!("this node's door: {error}")))?
            .map_err(|refusal| failed(format!("refused its hello: {refusal}")))?;
        if self.reads {
            self.connect_data(&connection).await?;
        }
        let frames = connection
            .open_frames(DIAL_TIMEOUT)
            .await
            .map_err(|error| failed(format!("open stream: {error}")))?;
        let link = QuicLink::new(
            self.peer.clone(),
            frames,
            self.link_in_flight,
            self.message_timeout,
        );
        self.door
            .set_link
            .send(SetLink {
                peer: self.peer.clone(),
                link: Arc::new(link),
            })
            .await
            .map_err(|error| failed(format!("this node's door: {error}")))?;
        Ok(connection)
    }

    /// Opens the network data connection to a prefill leg this decode leg reads over the net
    /// engine (the same choice its transfer actor made at admission).
    async fn connect_data(&self, connection: &PeerConnection) -> Result<(), StartError> {
        let Some(net) = &self.net else {
            return Ok(());
        };
        let chosen = choose_engine(&self.engine_kinds, &self.door.hello.host, &connection.peer)
            .map_err(|detail| setup_error(&self.peer, detail))?;
        if self.engine_kinds[chosen] != EngineKind::Net {
            return Ok(());
        }
        let ticket = connection
            .ticket(DIAL_TIMEOUT)
            .await
            .map_err(|error| setup_error(&self.peer, format!("network ticket: {error}")))?;
        net.connect_via(
            &EngineKey(self.peer.0.clone()),
            self.data_address.clone(),
            &self.door.hello.node,
            ticket,
            DIAL_TIMEOUT,
        )
        .await
        .map_err(|error| setup_error(&self.peer, format!("data connection: {error}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `/ready` counts a peer linked only when both directions reach the same incarnation: this
    /// node's link to it, and its own dial here.
    #[test]
    fn a_peer_is_linked_when_both_directions_reach_one_incarnation() {
        let board = PeerBoard::default();
        let leg = NodeId("decode-0".into());
        board.add(&leg, Role::Decode);
        let linked = || board.snapshot()["decode-0"].linked;
        board.update(&leg, |state| {
            state.dialed_out = true;
            state.incarnation = Some(7);
        });
        assert!(!linked(), "it has not dialled in: it could not answer");
        assert!(!board.any_linked(Role::Decode));
        board.dialed_in(&leg, 7);
        assert!(linked());
        assert!(board.any_linked(Role::Decode) && board.all_linked());
        // It restarted and dialled in as 8; this node's link still leads to 7.
        board.dialed_in(&leg, 8);
        assert!(!linked());
        board.update(&leg, |state| state.incarnation = Some(8));
        assert!(linked());
        board.update(&leg, |state| state.dialed_out = false);
        assert!(!linked() && !board.all_linked());
    }
}
