//! The control plane: bincode frames over quinn QUIC streams, mutual TLS, a handshake that
//! refuses incompatible peers.
//!
//! quinn runs on the tokio runtime its caller names: a node's own thread (an actix arbiter's
//! runtime, so a frame read is handed to the actors without a thread wake-up) or the
//! multi-thread [`TransportRuntime`] beside the network READ engine. A connection starts with one
//! bidirectional stream carrying each side's [`Hello`]: node name, role, protocol version, the
//! layout's compatibility hash and the READ engines' descriptors. The server admits a client only
//! if its certificate chains to the cluster CA (TLS), is valid for the node name it claims, that
//! name is a node of the cluster, and the hellos agree ([`check_compat`]); otherwise it answers
//! with a reason and closes. Every later stream is one request and one response. A malformed
//! frame closes that connection, never the node.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use pdkv_core::identity::{FieldDifference, ModelFields};
use pdkv_core::plan::RegionLayout;
use pdkv_core::wire::{Incarnation, NodeId, Role};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use crate::codec::{self, CodecError, MAX_FRAME_BYTES};
use crate::engine::{EngineDescriptor, MemoryDescriptor};
use crate::heartbeat;
use crate::net::{Ticket, TicketBook};
use crate::tls::{NodeIdentity, TlsError, verify_peer_name};

/// Application error code sent when a connection is closed for a protocol violation.
const CLOSE_PROTOCOL: u32 = 1;
/// Application error code sent when a peer is refused at handshake.
const CLOSE_REFUSED: u32 = 2;
/// Application error code sent when the peer went silent ([`heartbeat`]).
pub(crate) const CLOSE_SILENT: u32 = 3;

/// A multi-thread tokio runtime for the network READ engine (and quinn, where a node keeps it
/// off its actors' thread).
#[derive(Debug)]
pub struct TransportRuntime {
    runtime: tokio::runtime::Runtime,
}

impl TransportRuntime {
    /// A runtime with `threads` worker threads.
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name("pdkv-transport")
            .enable_all()
            .build()?;
        Ok(TransportRuntime { runtime })
    }

    /// A handle to spawn on or enter.
    pub fn handle(&self) -> tokio::runtime::Handle {
        self.runtime.handle().clone()
    }

    /// Stops the runtime without waiting for its tasks (safe inside another runtime).
    pub fn shutdown_background(self) {
        self.runtime.shutdown_background();
    }

    /// Runs a future to completion on this runtime (for callers outside any runtime).
    pub fn block_on<F: std::future::Future>(&self, future: F) -> F::Output {
        self.runtime.block_on(future)
    }
}

/// One READ engine as advertised at handshake: its descriptor and its registered regions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineAdvert {
    /// The engine.
    pub engine: EngineDescriptor,
    /// Its regions.
    pub regions: Vec<MemoryDescriptor>,
}

/// What a node says about itself when a connection opens: everything a peer learns about it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Node name (must match the node's certificate).
    pub node: NodeId,
    /// Its role.
    pub role: Role,
    /// Its process start: a peer that restarts says hello with a new one.
    pub incarnation: Incarnation,
    /// Where its KV blocks sit in its registered regions (a reader's transfer plans need it).
    pub regions: RegionLayout,
    /// [`crate::codec::PROTOCOL_VERSION`] of the sender.
    pub protocol_version: u32,
    /// `KvLayout::compat_hash` of the sender's model.
    pub layout_hash: u64,
    /// What defines the sender's KV, by name (model, shapes, dtype, groups, parallel layout):
    /// two nodes that both describe a model must agree on every field. Empty for a node that
    /// makes and reads no KV.
    pub model: ModelFields,
    /// READ engines the sender offers.
    pub engines: Vec<EngineAdvert>,
    /// Where the sender runs ([`crate::host::host_id`]): shared memory is offered only between
    /// equal ids.
    pub host: String,
}

/// A fresh random incarnation for a node starting now.
pub fn new_incarnation() -> Result<Incarnation, getrandom::Error> {
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes)?;
    Ok(Incarnation(u64::from_le_bytes(bytes)))
}

/// Checks that two nodes can work together; the error says what differs.
pub fn check_compat(ours: &Hello, theirs: &Hello) -> Result<(), HandshakeError> {
    if ours.protocol_version != theirs.protocol_version {
        return Err(HandshakeError::ProtocolVersion {
            ours: ours.protocol_version,
            theirs: theirs.protocol_version,
        });
    }
    if let Err(differences) = ours.model.compatible(&theirs.model) {
        return Err(HandshakeError::Model {
            ours: ours.node.clone(),
            theirs: theirs.node.clone(),
            differences,
        });
    }
    if ours.layout_hash != theirs.layout_hash {
        return Err(HandshakeError::LayoutHash {
            ours: ours.layout_hash,
            theirs: theirs.layout_hash,
        });
    }
    if ours.node == theirs.node {
        return Err(HandshakeError::SameNode(theirs.node.to_string()));
    }
    Ok(())
}

/// A frame of a control stream: what a peer may send.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Frame<R> {
    Hello(Hello),
    Ticket,
    Request(R),
}

#[derive(Debug, Serialize, Deserialize)]
enum Reply<S> {
    Hello(Hello),
    Refused(String),
    Ticket(Ticket),
    Response(S),
    /// The hellos disagree: what differs, as the server saw it.
    Incompatible(HandshakeError),
}

/// Application requests a node serves over the control plane.
pub trait ControlService: Send + Sync + 'static {
    /// Request type.
    type Request: Serialize + DeserializeOwned + Send + Sync + 'static;
    /// Response type.
    type Response: Serialize + DeserializeOwned + Send + Sync + 'static;

    /// Decides whether an authenticated, compatible peer that said `hello` may connect (a
    /// node learns its peers' incarnations, engines and regions here). The error is the
    /// refusal the peer sees. Admits everyone by default.
    fn admit(&self, hello: &Hello) -> impl std::future::Future<Output = Result<(), String>> + Send {
        let _ = hello;
        async { Ok(()) }
    }

    /// Answers one request from an authenticated, compatible `peer`; may await the node's
    /// actors. The error is a refusal the peer sees as text.
    fn handle(
        &self,
        peer: &NodeId,
        request: Self::Request,
    ) -> impl std::future::Future<Output = Result<Self::Response, String>> + Send;

    /// Takes one frame of a peer's one-way stream of requests. Nobody waits for an answer, so a
    /// refusal is only logged. By default the frame is handled as a request; a service that can
    /// hand a message on without awaiting its outcome overrides this, so the stream's next frame
    /// is read at once.
    fn deliver(&self, peer: &NodeId, request: Self::Request) -> impl std::future::Future<Output = ()> + Send {
        async move {
            if let Err(reason) = self.handle(peer, request).await {
                tracing::warn!(%peer, %reason, "refused a message");
            }
        }
    }
}

/// Bounds of a control server.
#[derive(Debug, Clone, Copy)]
pub struct ControlLimits {
    /// Concurrent connections; more are refused.
    pub max_connections: usize,
    /// Concurrent request streams per connection.
    pub max_streams: u32,
    /// Concurrent one-way streams of frames per connection (a link keeps one open).
    pub max_frame_streams: u32,
    /// Time a client has to send its hello.
    pub handshake_timeout: Duration,
    /// A connection with no traffic for this long is closed: the peer is taken for down.
    pub idle_timeout: Duration,
    /// How often an idle connection sends a keep-alive (the heartbeat); several must fit in
    /// `idle_timeout`.
    pub keep_alive: Duration,
}

impl ControlLimits {
    /// Limits whose heartbeat is `heartbeat` and that take a peer for down after `misses` of
    /// them go unanswered.
    pub fn with_heartbeat(heartbeat: Duration, misses: u32) -> Self {
        ControlLimits {
            idle_timeout: heartbeat.saturating_mul(misses.max(1)),
            keep_alive: heartbeat,
            ..ControlLimits::default()
        }
    }
}

impl Default for ControlLimits {
    fn default() -> Self {
        ControlLimits {
            max_connections: 256,
            max_streams: 64,
            max_frame_streams: 4,
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(30),
            keep_alive: Duration::from_secs(10),
        }
    }
}

/// How many ack-eliciting packets a peer may take in before it must acknowledge them (QUIC's
/// ACK frequency extension, which quinn speaks on both ends). A link carries frames one way
/// (each node sends on the connection it dialled), so no answer carries the acknowledgement:
/// QUIC's default, an acknowledgement-only packet for every second packet, costs each message
/// of a request half a datagram more — a send on one side, a wake-up on the other. Larger
/// thresholds leave the rest to the peer's `max_ack_delay` (25 ms); a packet out of order is
/// still acknowledged at once, so losses are found as quickly as before. README ("Benchmarks",
/// "ACK frequency") shows what it saves on the launched cluster's serial path.
const ACK_ELICITING_THRESHOLD: u32 = 16;

fn transport_config(limits: &ControlLimits) -> Result<quinn::TransportConfig, ControlError> {
    let mut transport = quinn::TransportConfig::default();
    let idle = quinn::IdleTimeout::try_from(limits.idle_timeout)
        .map_err(|error| ControlError::Config(error.to_string()))?;
    transport
        .max_idle_timeout(Some(idle))
        .keep_alive_interval(Some(limits.keep_alive.min(limits.idle_timeout)))
        .max_concurrent_bidi_streams(limits.max_streams.into())
        .max_concurrent_uni_streams(limits.max_frame_streams.into());
    let mut acks = quinn::AckFrequencyConfig::default();
    acks.ack_eliciting_threshold(quinn::VarInt::from_u32(ACK_ELICITING_THRESHOLD));
    transport.ack_frequency_config(Some(acks));
    Ok(transport)
}

/// A running control-plane server.
#[derive(Debug)]
pub struct ControlServer {
    endpoint: quinn::Endpoint,
}

impl ControlServer {
    /// Binds `bind` on `runtime` and serves `setup.service` to the nodes of `setup.cluster`.
    pub fn start<S: ControlService>(
        runtime: &tokio::runtime::Handle,
        bind: SocketAddr,
        identity: &NodeIdentity,
        setup: ServerSetup<S>,
    ) -> Result<Self, ControlError> {
        let ServerSetup {
            cluster,
            hello,
            service,
            tickets,
            limits,
        } = setup;
        let mut config = identity.server_config()?;
        config.transport_config(Arc::new(transport_config(&limits)?));
        let _guard = runtime.enter();
        let endpoint =
            quinn::Endpoint::server(config, bind).map_err(|error| ControlError::Io(error.to_string()))?;
        let accept = endpoint.clone();
        let shared = Arc::new(ServerShared {
            cluster,
            hello,
            service,
            tickets,
            limits,
        });
        runtime.spawn(async move {
            let slots = Arc::new(Semaphore::new(limits.max_connections));
            while let Some(incoming) = accept.accept().await {
                let Ok(permit) = slots.clone().try_acquire_owned() else {
                    incoming.refuse();
                    continue;
                };
                let shared = shared.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    let remote = incoming.remote_address();
                    match incoming.await {
                        Ok(connection) => {
                            if let Err(error) = serve_connection(connection, shared).await {
                                tracing::warn!(%remote, %error, "control connection ended");
                            }
                        }
                        Err(error) => tracing::warn!(%remote, %error, "control handshake failed"),
                    }
                });
            }
        });
        Ok(ControlServer { endpoint })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> Result<SocketAddr, ControlError> {
        self.endpoint
            .local_addr()
            .map_err(|error| ControlError::Io(error.to_string()))
    }

    /// Stops accepting and closes every connection.
    pub fn close(&self) {
        self.endpoint.close(0u32.into(), b"shutdown");
    }

    /// Waits until every connection has finished closing (after [`Self::close`]).
    pub fn wait_idle(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let endpoint = self.endpoint.clone();
        async move { endpoint.wait_idle().await }
    }
}

/// What a control server serves, and to whom.
pub struct ServerSetup<S> {
    /// Node names admitted (each must also present a matching certificate).
    pub cluster: Vec<NodeId>,
    /// This node's hello.
    pub hello: Hello,
    /// Application requests.
    pub service: Arc<S>,
    /// Tickets for network data connections, if this node serves network reads.
    pub tickets: Option<Arc<TicketBook>>,
    /// Bounds.
    pub limits: ControlLimits,
}

struct ServerShared<S> {
    cluster: Vec<NodeId>,
    hello: Hello,
    service: Arc<S>,
    tickets: Option<Arc<TicketBook>>,
    limits: ControlLimits,
}

async fn serve_connection<S: ControlService>(
    connection: quinn::Connection,
    shared: Arc<ServerShared<S>>,
) -> Result<(), ControlError> {
    let _silence = heartbeat::watch(connection.clone(), shared.limits.idle_timeout);
    let (mut send, mut recv) = tokio::time::timeout(shared.limits.handshake_timeout, connection.accept_bi())
        .await
        .map_err(|_| ControlError::Timeout("hello"))?
        .map_err(|error| ControlError::Closed(error.to_string()))?;
    let theirs = match tokio::time::timeout(
        shared.limits.handshake_timeout,
        codec::read_message::<_, Frame<S::Request>>(&mut recv, MAX_FRAME_BYTES),
    )
    .await
    {
        Ok(Ok(Frame::Hello(hello))) => hello,
        Ok(Ok(_)) => return Err(refuse(&connection, &mut send, "expected a hello first".into()).await),
        Ok(Err(error)) => return Err(refuse(&connection, &mut send, format!("bad hello: {error}")).await),
        Err(_) => return Err(refuse(&connection, &mut send, "no hello in time".into()).await),
    };
    let admitted = if !shared.cluster.contains(&theirs.node) {
        Err(format!("node {} is not part of this cluster", theirs.node))
    } else if let Err(error) = verify_peer_name(&connection, &theirs.node.0) {
        Err(error.to_string())
    } else if let Err(error) = check_compat(&shared.hello, &theirs) {
        // Typed, so the peer can name what differs from its own side.
        let reason = error.to_string();
        return Err(refuse_with(&connection, &mut send, Reply::Incompatible(error), reason).await);
    } else {
        shared.service.admit(&theirs).await
    };
    if let Err(reason) = admitted {
        return Err(refuse(&connection, &mut send, reason).await);
    }
    codec::write_message(&mut send, &Reply::<S::Response>::Hello(shared.hello.clone())).await?;
    let _ = send.finish();
    let peer = theirs.node;
    tracing::info!(peer = %peer, "control peer admitted");
    loop {
        let accepted = tokio::select! {
            bi = connection.accept_bi() => bi.map(Some),
            uni = connection.accept_uni() => uni.map(|recv| {
                tokio::spawn(serve_frames(recv, shared.clone(), peer.clone(), connection.clone()));
                None
            }),
        };
        let (mut send, mut recv) = match accepted {
            Ok(Some(stream)) => stream,
            Ok(None) => continue,
            Err(quinn::ConnectionError::ApplicationClosed(_) | quinn::ConnectionError::LocallyClosed) => {
                return Ok(());
            }
            Err(error) => return Err(ControlError::Closed(error.to_string())),
        };
        let shared = shared.clone();
        let peer = peer.clone();
        let connection = connection.clone();
        tokio::spawn(async move {
            let frame = codec::read_message::<_, Frame<S::Request>>(&mut recv, MAX_FRAME_BYTES).await;
            let reply = match frame {
                Ok(Frame::Request(request)) => match shared.service.handle(&peer, request).await {
                    Ok(response) => Reply::Response(response),
                    Err(reason) => Reply::Refused(reason),
                },
                Ok(Frame::Ticket) => match &shared.tickets {
                    Some(tickets) => match tickets.issue(&peer) {
                        Ok(ticket) => Reply::Ticket(ticket),
                        Err(error) => Reply::Refused(error.to_string()),
                    },
                    None => Reply::Refused("this node serves no network reads".into()),
                },
                Ok(Frame::Hello(_)) => Reply::Refused("hello sent twice".into()),
                Err(error) => {
                    tracing::warn!(%peer, %error, "malformed control frame, closing the connection");
                    connection.close(CLOSE_PROTOCOL.into(), error.to_string().as_bytes());
                    return;
                }
            };
            if codec::write_message(&mut send, &reply).await.is_ok() {
                let _ = send.finish();
            }
        });
    }
}

/// Serves a one-way stream of request frames in order ([`ControlService::deliver`]); a malformed
/// frame closes the connection.
async fn serve_frames<S: ControlService>(
    mut recv: quinn::RecvStream,
    shared: Arc<ServerShared<S>>,
    peer: NodeId,
    connection: quinn::Connection,
) {
    loop {
        let frame = match codec::read_next_frame(&mut recv, MAX_FRAME_BYTES).await {
            Ok(Some(payload)) => codec::decode::<Frame<S::Request>>(&payload),
            Ok(None) => return,
            Err(error) => Err(error),
        };
        match frame {
            Ok(Frame::Request(request)) => shared.service.deliver(&peer, request).await,
            Ok(_) => {
                tracing::warn!(%peer, "only requests travel on a stream of frames, closing the connection");
                connection.close(CLOSE_PROTOCOL.into(), b"unexpected frame on a stream of frames");
                return;
            }
            Err(codec::CodecError::Io(error)) if connection.close_reason().is_some() => {
                tracing::debug!(%peer, %error, "stream of frames ended with its connection");
                return;
            }
            Err(error) => {
                tracing::warn!(%peer, %error, "malformed frame, closing the connection");
                connection.close(CLOSE_PROTOCOL.into(), error.to_string().as_bytes());
                return;
            }
        }
    }
}

async fn refuse(
    connection: &quinn::Connection,
    send: &mut quinn::SendStream,
    reason: String,
) -> ControlError {
    refuse_with(connection, send, Reply::Refused(reason.clone()), reason).await
}

/// Answers a hello with `reply` (a refusal) and closes the connection with `reason`.
async fn refuse_with(
    connection: &quinn::Connection,
    send: &mut quinn::SendStream,
    reply: Reply<()>,
    reason: String,
) -> ControlError {
    tracing::warn!(remote = %connection.remote_address(), %reason, "refusing control peer");
    let _ = codec::write_message(send, &reply).await;
    let _ = send.finish();
    // Give the refusal a moment to leave before the close overtakes it.
    let _ = tokio::time::timeout(Duration::from_millis(200), send.stopped()).await;
    connection.close(CLOSE_REFUSED.into(), reason.as_bytes());
    ControlError::Refused(reason)
}

/// A client endpoint that dials other nodes; clones share the endpoint.
#[derive(Debug, Clone)]
pub struct ControlClient {
    endpoint: quinn::Endpoint,
    runtime: tokio::runtime::Handle,
    /// The peer is taken for down once silent this long ([`heartbeat`]).
    idle_timeout: Duration,
}

impl ControlClient {
    /// A client bound to `bind` (port 0 picks one), presenting `identity`.
    pub fn new(
        runtime: &tokio::runtime::Handle,
        bind: SocketAddr,
        identity: &NodeIdentity,
    ) -> Result<Self, ControlError> {
        Self::with_limits(runtime, bind, identity, &ControlLimits::default())
    }

    /// A client whose connections heartbeat and time out as `limits` say.
    pub fn with_limits(
        runtime: &tokio::runtime::Handle,
        bind: SocketAddr,
        identity: &NodeIdentity,
        limits: &ControlLimits,
    ) -> Result<Self, ControlError> {
        Self::configured(runtime, bind, identity.client_config()?, limits)
    }

    /// A client with an explicit QUIC client config (tests use one without a certificate).
    pub fn with_config(
        runtime: &tokio::runtime::Handle,
        bind: SocketAddr,
        config: quinn::ClientConfig,
    ) -> Result<Self, ControlError> {
        Self::configured(runtime, bind, config, &ControlLimits::default())
    }

    fn configured(
        runtime: &tokio::runtime::Handle,
        bind: SocketAddr,
        mut config: quinn::ClientConfig,
        limits: &ControlLimits,
    ) -> Result<Self, ControlError> {
        config.transport_config(Arc::new(transport_config(limits)?));
        let _guard = runtime.enter();
        let mut endpoint =
            quinn::Endpoint::client(bind).map_err(|error| ControlError::Io(error.to_string()))?;
        endpoint.set_default_client_config(config);
        Ok(ControlClient {
            endpoint,
            runtime: runtime.clone(),
            idle_timeout: limits.idle_timeout,
        })
    }

    /// Closes every connection this client opened.
    pub fn close(&self) {
        self.endpoint.close(0u32.into(), b"shutdown");
    }

    /// Waits until every connection has finished closing (after [`Self::close`]).
    pub fn wait_idle(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let endpoint = self.endpoint.clone();
        async move { endpoint.wait_idle().await }
    }

    /// Dials node `peer` at `addr`, exchanges hellos and checks compatibility, within `timeout`.
    pub async fn connect(
        &self,
        addr: SocketAddr,
        peer: &str,
        hello: &Hello,
        timeout: Duration,
    ) -> Result<PeerConnection, ControlError> {
        let (endpoint, idle_timeout) = (self.endpoint.clone(), self.idle_timeout);
        let (peer, hello) = (peer.to_string(), hello.clone());
        let task = self.runtime.spawn(async move {
            tokio::time::timeout(timeout, dial(endpoint, addr, &peer, &hello, idle_timeout))
                .await
                .map_err(|_| ControlError::Timeout("connect"))?
        });
        task.await
            .map_err(|error| ControlError::Closed(error.to_string()))?
    }
}

async fn dial(
    endpoint: quinn::Endpoint,
    addr: SocketAddr,
    peer: &str,
    hello: &Hello,
    idle_timeout: Duration,
) -> Result<PeerConnection, ControlError> {
    let connecting = endpoint
        .connect(addr, peer)
        .map_err(|error| ControlError::Connect(error.to_string()))?;
    let connection = connecting
        .await
        .map_err(|error| ControlError::Connect(error.to_string()))?;
    let silence = Arc::new(heartbeat::watch(connection.clone(), idle_timeout));
    let (mut send, mut recv) = connection
        .open_bi()
        .await
        .map_err(|error| ControlError::Connect(error.to_string()))?;
    let hello_round_trip = async {
        codec::write_message(&mut send, &Frame::<()>::Hello(hello.clone())).await?;
        let _ = send.finish();
        codec::read_message::<_, Reply<()>>(&mut recv, MAX_FRAME_BYTES).await
    };
    // A peer that refuses us closes the connection with its reason, which can arrive while our
    // hello is still being written (TLS 1.3 lets the client finish its handshake before the
    // server has checked the client's certificate): either half failing reports that reason.
    let reply = hello_round_trip
        .await
        .map_err(|error| match connection.close_reason() {
            Some(reason) => ControlError::Refused(close_reason(&reason)),
            None => ControlError::Codec(error),
        })?;
    let theirs = match reply {
        Reply::Hello(theirs) => theirs,
        Reply::Refused(reason) => return Err(ControlError::Refused(reason)),
        Reply::Incompatible(error) => return Err(ControlError::Handshake(error.seen_from_the_peer())),
        _ => return Err(ControlError::Protocol("expected a hello".into())),
    };
    if theirs.node.0 != peer {
        return Err(ControlError::Refused(format!(
            "dialled {peer}, {} answered",
            theirs.node
        )));
    }
    check_compat(hello, &theirs)?;
    Ok(PeerConnection {
        connection,
        silence,
        peer: theirs,
    })
}

fn close_reason(error: &quinn::ConnectionError) -> String {
    match error {
        quinn::ConnectionError::ApplicationClosed(close) => {
            String::from_utf8_lossy(&close.reason).into_owned()
        }
        other => other.to_string(),
    }
}

/// An admitted connection to a peer node.
#[derive(Debug, Clone)]
pub struct PeerConnection {
    connection: quinn::Connection,
    /// The heartbeat check, shared by the clones (the last one dropped stops it).
    silence: Arc<heartbeat::Watch>,
    /// The peer's hello (its engines and regions).
    pub peer: Hello,
}

impl PeerConnection {
    /// Sends one request and waits at most `timeout` for its response.
    pub async fn request<R: Serialize, S: DeserializeOwned>(
        &self,
        request: R,
        timeout: Duration,
    ) -> Result<S, ControlError> {
        match self.exchange::<R, S>(Frame::Request(request), timeout).await? {
            Reply::Response(response) => Ok(response),
            Reply::Refused(reason) => Err(ControlError::Refused(reason)),
            _ => Err(ControlError::Protocol("unexpected reply".into())),
        }
    }

    /// Opens a one-way stream of request frames: the peer handles them in order and answers
    /// none (for messages whose sender does not wait).
    pub async fn open_frames(&self, timeout: Duration) -> Result<FrameSender, ControlError> {
        let send = tokio::time::timeout(timeout, self.connection.open_uni())
            .await
            .map_err(|_| ControlError::Timeout("open stream"))?
            .map_err(|error| ControlError::Closed(error.to_string()))?;
        Ok(FrameSender { send })
    }

    /// Asks the peer for a one-time ticket to open a network data connection.
    pub async fn ticket(&self, timeout: Duration) -> Result<Ticket, ControlError> {
        match self.exchange::<(), ()>(Frame::Ticket, timeout).await? {
            Reply::Ticket(ticket) => Ok(ticket),
            Reply::Refused(reason) => Err(ControlError::Refused(reason)),
            _ => Err(ControlError::Protocol("unexpected reply".into())),
        }
    }

    /// Sends raw bytes as one request frame (tests prove garbage closes the connection).
    pub async fn send_raw(&self, payload: &[u8], timeout: Duration) -> Result<Vec<u8>, ControlError> {
        self.round_trip(payload, timeout, "raw request").await
    }

    /// Waits until the connection is closed (by either side, or lost), and says why.
    pub async fn closed(&self) -> String {
        let error = self.connection.closed().await;
        match self.silence.reason() {
            Some(silent) => silent.to_string(),
            None => close_reason(&error),
        }
    }

    /// Whether the connection is still open.
    pub fn is_open(&self) -> bool {
        self.connection.close_reason().is_none()
    }

    /// Closes the connection.
    pub fn close(&self) {
        self.connection.close(0u32.into(), b"bye");
    }

    async fn exchange<R: Serialize, S: DeserializeOwned>(
        &self,
        frame: Frame<R>,
        timeout: Duration,
    ) -> Result<Reply<S>, ControlError> {
        let reply = self
            .round_trip(&codec::encode(&frame)?, timeout, "request")
            .await?;
        Ok(codec::decode(&reply)?)
    }

    /// One stream: a frame holding `payload` out, one frame back, within `timeout`.
    async fn round_trip(
        &self,
        payload: &[u8],
        timeout: Duration,
        what: &'static str,
    ) -> Result<Vec<u8>, ControlError> {
        tokio::time::timeout(timeout, async {
            let (mut send, mut recv) = self
                .connection
                .open_bi()
                .await
                .map_err(|error| ControlError::Closed(error.to_string()))?;
            tokio::io::AsyncWriteExt::write_all(&mut send, &codec::frame(payload))
                .await
                .map_err(|error| ControlError::Closed(error.to_string()))?;
            let _ = send.finish();
            Ok(codec::read_frame(&mut recv, MAX_FRAME_BYTES).await?)
        })
        .await
        .map_err(|_| ControlError::Timeout(what))?
    }
}

/// The sending end of a one-way stream of request frames.
#[derive(Debug)]
pub struct FrameSender {
    send: quinn::SendStream,
}

impl FrameSender {
    /// Writes one request frame (waits only for flow-control credit).
    pub async fn send<R: Serialize>(&mut self, request: R) -> Result<(), ControlError> {
        codec::write_message(&mut self.send, &Frame::Request(request)).await?;
        Ok(())
    }

    /// Writes raw bytes as one frame's payload (tests prove garbage closes the connection).
    pub async fn send_raw(&mut self, payload: &[u8]) -> Result<(), ControlError> {
        tokio::io::AsyncWriteExt::write_all(&mut self.send, &codec::frame(payload))
            .await
            .map_err(|error| ControlError::Closed(error.to_string()))
    }

    /// Ends the stream after the frames written so far.
    pub fn finish(&mut self) {
        let _ = self.send.finish();
    }
}

/// Why two nodes refused each other at handshake. Travels to the refused peer, which sees it
/// from its own side ([`HandshakeError::seen_from_the_peer`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum HandshakeError {
    /// Different wire protocol versions.
    #[error("protocol version differs: ours {ours}, theirs {theirs}")]
    ProtocolVersion {
        /// Ours.
        ours: u32,
        /// Theirs.
        theirs: u32,
    },
    /// Different KV layouts (groups, block sizes, windows, DCP, layers).
    #[error("KV layout differs: our layout hash {ours:#018x}, theirs {theirs:#018x}")]
    LayoutHash {
        /// Ours.
        ours: u64,
        /// Theirs.
        theirs: u64,
    },
    /// The two nodes describe different models (or the same model computed differently).
    #[error(
        "model differs between {ours} and {theirs}: {}",
        describe_differences(differences, ours, theirs)
    )]
    Model {
        /// The node that found the difference.
        ours: NodeId,
        /// The peer.
        theirs: NodeId,
        /// Every differing field, with both values.
        differences: Vec<FieldDifference>,
    },
    /// A node dialled itself, or two nodes share a name.
    #[error("peer claims our own node name {0}")]
    SameNode(String),
}

impl HandshakeError {
    /// The same disagreement with "ours" and "theirs" swapped: how the node that was refused
    /// reports it.
    pub fn seen_from_the_peer(self) -> Self {
        match self {
            HandshakeError::ProtocolVersion { ours, theirs } => HandshakeError::ProtocolVersion {
                ours: theirs,
                theirs: ours,
            },
            HandshakeError::LayoutHash { ours, theirs } => HandshakeError::LayoutHash {
                ours: theirs,
                theirs: ours,
            },
            HandshakeError::Model {
                ours,
                theirs,
                differences,
            } => HandshakeError::Model {
                ours: theirs,
                theirs: ours,
                differences: differences
                    .into_iter()
                    .map(|difference| FieldDifference {
                        ours: difference.theirs,
                        theirs: difference.ours,
                        ..difference
                    })
                    .collect(),
            },
            same @ HandshakeError::SameNode(_) => same,
        }
    }
}

fn describe_differences(differences: &[FieldDifference], ours: &NodeId, theirs: &NodeId) -> String {
    let describe = |difference: &FieldDifference| difference.describe(&ours.0, &theirs.0);
    differences.iter().map(describe).collect::<Vec<_>>().join("; ")
}

/// Why a control-plane operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    /// The connection could not be made (TLS refusal included).
    #[error("cannot connect: {0}")]
    Connect(String),
    /// The peer refused, with its reason.
    #[error("refused: {0}")]
    Refused(String),
    /// The hellos disagree.
    #[error("incompatible peer: {0}")]
    Handshake(#[from] HandshakeError),
    /// Certificates or TLS configuration.
    #[error("{0}")]
    Tls(#[from] TlsError),
    /// A frame could not be read or decoded.
    #[error("{0}")]
    Codec(#[from] CodecError),
    /// A bound passed.
    #[error("{0} timed out")]
    Timeout(&'static str),
    /// The connection closed.
    #[error("connection closed: {0}")]
    Closed(String),
    /// The peer broke the protocol.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// Socket setup failed.
    #[error("{0}")]
    Io(String),
    /// A configuration value was refused.
    #[error("configuration: {0}")]
    Config(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::ClusterCa;

    fn hello(node: &str) -> Hello {
        Hello {
            node: NodeId(node.into()),
            role: Role::Decode,
            incarnation: Incarnation(1),
            regions: RegionLayout::default(),
            protocol_version: codec::PROTOCOL_VERSION,
            layout_hash: 0,
            model: ModelFields::default(),
            engines: vec![],
            host: "test".into(),
        }
    }

    /// A server that closes a connection with its reason while the client is still writing its
    /// hello: the client is stuck behind an 8-byte stream window, so its write (not its read)
    /// is what fails. The refusal must still reach the dialler with the reason, the way a TLS
    /// refusal of a missing client certificate can land mid-hello.
    #[test]
    fn a_close_during_the_hello_write_reports_the_peers_reason() {
        let runtime = TransportRuntime::new(1).unwrap();
        let ca = ClusterCa::generate("race").unwrap();
        let server_identity = ca.identity("prefill-0").unwrap();
        let mut server_config = server_identity.server_config().unwrap();
        let mut transport = quinn::TransportConfig::default();
        transport.stream_receive_window(8u32.into());
        server_config.transport_config(Arc::new(transport));
        let server = {
            let _guard = runtime.handle().enter();
            quinn::Endpoint::server(server_config, "127.0.0.1:0".parse().unwrap()).unwrap()
        };
        let addr = server.local_addr().unwrap();
        let accept = server.clone();
        runtime.handle().spawn(async move {
            let connection = accept.accept().await.unwrap().await.unwrap();
            // The client's stream shows up once its first 8 bytes arrive; it is blocked then.
            let _streams = connection.accept_bi().await.unwrap();
            connection.close(CLOSE_REFUSED.into(), b"go away");
            connection.closed().await;
        });
        let client = ControlClient::new(
            &runtime.handle(),
            "127.0.0.1:0".parse().unwrap(),
            &ca.identity("decode-0").unwrap(),
        )
        .unwrap();
        let result =
            runtime.block_on(client.connect(addr, "prefill-0", &hello("decode-0"), Duration::from_secs(10)));
        assert_eq!(result.unwrap_err(), ControlError::Refused("go away".into()));
    }

    /// Frames sent one way, one packet each, are acknowledged in batches of
    /// `ACK_ELICITING_THRESHOLD` rather than every second packet (QUIC's default): the
    /// receiver sends few acknowledgement-only datagrams.
    #[test]
    fn one_way_frames_are_acknowledged_in_batches() {
        const FRAMES: u64 = 64;
        let runtime = TransportRuntime::new(1).unwrap();
        let ca = ClusterCa::generate("acks").unwrap();
        let transport = Arc::new(transport_config(&ControlLimits::default()).unwrap());
        let mut server_config = ca.identity("prefill-0").unwrap().server_config().unwrap();
        server_config.transport_config(transport.clone());
        let mut client_config = ca.identity("decode-0").unwrap().client_config().unwrap();
        client_config.transport_config(transport);
        let (server, client) = {
            let _guard = runtime.handle().enter();
            let server = quinn::Endpoint::server(server_config, "127.0.0.1:0".parse().unwrap()).unwrap();
            let mut client = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
            client.set_default_client_config(client_config);
            (server, client)
        };
        let addr = server.local_addr().unwrap();
        let acks_sent = runtime.block_on(async move {
            let (read_tx, mut read_rx) = tokio::sync::mpsc::channel::<()>(1);
            let receiver = tokio::spawn(async move {
                let connection = server.accept().await.unwrap().await.unwrap();
                let mut stream = connection.accept_uni().await.unwrap();
                let mut frame = [0u8; 8];
                for _ in 0..FRAMES {
                    stream.read_exact(&mut frame).await.unwrap();
                    read_tx.send(()).await.unwrap();
                }
                connection.stats().frame_tx.acks
            });
            let connection = client.connect(addr, "prefill-0").unwrap().await.unwrap();
            let mut stream = connection.open_uni().await.unwrap();
            // One frame in flight at a time: each goes out in a packet of its own.
            for frame in 0..FRAMES {
                stream.write_all(&frame.to_le_bytes()).await.unwrap();
                read_rx.recv().await.unwrap();
            }
            let acks = receiver.await.unwrap();
            connection.close(0u32.into(), b"done");
            acks
        });
        // QUIC's default would acknowledge every second packet: FRAMES / 2 = 32 and more (the
        // handshake's). An acknowledgement once more than 16 are pending makes 3 (after the
        // 17th, 34th and 51st), plus one per `max_ack_delay` the run lasts and the handshake's
        // few; 24 leaves room for a slow machine.
        assert!(
            acks_sent < 24,
            "{acks_sent} acknowledgements for {FRAMES} one-way frames"
        );
    }

    /// Answers with the name of the thread that handled the request.
    struct WhichThread;

    impl ControlService for WhichThread {
        type Request = ();
        type Response = String;

        async fn handle(&self, _peer: &NodeId, _request: ()) -> Result<String, String> {
            Ok(std::thread::current().name().unwrap_or("unnamed").to_string())
        }
    }

    /// prefill-0 serving [`WhichThread`] to decode-0 under `limits`.
    fn which_thread_setup(limits: ControlLimits) -> ServerSetup<WhichThread> {
        ServerSetup {
            cluster: vec![NodeId("prefill-0".into()), NodeId("decode-0".into())],
            hello: Hello {
                role: Role::Prefill,
                ..hello("prefill-0")
            },
            service: Arc::new(WhichThread),
            tickets: None,
            limits,
        }
    }

    /// A server started on a node's own single-thread runtime serves its peers on that thread
    /// (no hop through the transport runtime), and one started on the transport runtime on
    /// the latter's threads.
    #[test]
    fn a_server_serves_on_the_runtime_it_was_started_on() {
        let ca = ClusterCa::generate("threads").unwrap();
        let transport = TransportRuntime::new(1).unwrap();
        let (node_tx, node_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        let node = std::thread::Builder::new()
            .name("the-node".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                node_tx.send(runtime.handle().clone()).unwrap();
                // Drive the runtime until the test is done with it.
                let _ = runtime.block_on(done_rx);
            })
            .unwrap();
        let node_runtime = node_rx.recv().unwrap();
        let client = ControlClient::new(
            &transport.handle(),
            "127.0.0.1:0".parse().unwrap(),
            &ca.identity("decode-0").unwrap(),
        )
        .unwrap();
        for (runtime, expected) in [
            (&node_runtime, "the-node"),
            (&transport.handle(), "pdkv-transport"),
        ] {
            let setup = which_thread_setup(ControlLimits::default());
            let server = ControlServer::start(
                runtime,
                "127.0.0.1:0".parse().unwrap(),
                &ca.identity("prefill-0").unwrap(),
                setup,
            )
            .unwrap();
            let addr = server.local_addr().unwrap();
            let answered: String = transport
                .block_on(async {
                    let connection = client
                        .connect(addr, "prefill-0", &hello("decode-0"), Duration::from_secs(10))
                        .await?;
                    connection.request((), Duration::from_secs(10)).await
                })
                .unwrap();
            assert_eq!(answered, expected);
            server.close();
        }
        done_tx.send(()).unwrap();
        node.join().unwrap();
    }

    /// What [`Relay`] does with datagrams.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Pass {
        Forward,
        /// Queue them, in order, until the next `Forward` (a stalled peer's socket buffer).
        Hold,
        Drop,
    }

    /// A UDP relay on loopback between one client and `server`, told what to do with datagrams.
    struct Relay {
        addr: SocketAddr,
        pass: tokio::sync::watch::Sender<Pass>,
    }

    impl Relay {
        async fn start(server: SocketAddr) -> Relay {
            let front = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
            let back = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap());
            back.connect(server).await.unwrap();
            let (pass, mut told) = tokio::sync::watch::channel(Pass::Forward);
            let addr = front.local_addr().unwrap();
            tokio::spawn(async move {
                let (mut client, mut held) = (None::<SocketAddr>, Vec::<(bool, Vec<u8>)>::new());
                let (mut up, mut down) = ([0u8; 65_536], [0u8; 65_536]);
                loop {
                    // (towards the server, datagram)
                    let datagram = tokio::select! {
                        changed = told.changed() => {
                            if changed.is_err() {
                                return;
                            }
                            if *told.borrow() == Pass::Forward {
                                for (upward, datagram) in held.drain(..) {
                                    if upward {
                                        let _ = back.send(&datagram).await;
                                    } else if let Some(client) = client {
                                        let _ = front.send_to(&datagram, client).await;
                                    }
                                }
                            }
                            continue;
                        }
                        received = front.recv_from(&mut up) => match received {
                            Ok((length, from)) => {
                                client = Some(from);
                                (true, up[..length].to_vec())
                            }
                            Err(error) => panic!("relay: {error}"),
                        },
                        received = back.recv(&mut down) => match received {
                            Ok(length) => (false, down[..length].to_vec()),
                            Err(error) => panic!("relay: {error}"),
                        },
                    };
                    let pass = *told.borrow();
                    match (pass, datagram) {
                        (Pass::Forward, (true, datagram)) => {
                            let _ = back.send(&datagram).await;
                        }
                        (Pass::Forward, (false, datagram)) => {
                            if let Some(client) = client {
                                let _ = front.send_to(&datagram, client).await;
                            }
                        }
                        (Pass::Hold, datagram) => held.push(datagram),
                        (Pass::Drop, _) => {}
                    }
                }
            });
            Relay { addr, pass }
        }
    }

    /// A dialler whose handshake waited on a stalled peer starts with a round-trip estimate as
    /// long as the stall, which stretches QUIC's own idle timer (three probe timeouts) to
    /// seconds. If the peer stalls again right after, the heartbeat check must still take it
    /// for down within the idle timeout, as `pdkv chaos` found it did not (two pauses 11 ms
    /// apart: the second went unseen for its whole 1.1 s).
    #[test]
    fn a_peer_that_stalls_again_after_a_stalled_handshake_is_taken_for_down_in_time() {
        let runtime = TransportRuntime::new(1).unwrap();
        let ca = ClusterCa::generate("stall").unwrap();
        let limits = ControlLimits::with_heartbeat(Duration::from_millis(50), 4);
        let setup = which_thread_setup(limits);
        let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let server = ControlServer::start(
            &runtime.handle(),
            loopback,
            &ca.identity("prefill-0").unwrap(),
            setup,
        )
        .unwrap();
        let client = ControlClient::with_limits(
            &runtime.handle(),
            loopback,
            &ca.identity("decode-0").unwrap(),
            &limits,
        )
        .unwrap();
        let server_addr = server.local_addr().unwrap();
        let (rtt, closed_after, relay) = runtime.block_on(async move {
            let relay = Relay::start(server_addr).await;
            // The peer stalls while the dialler's first Initial waits in its socket buffer.
            relay.pass.send(Pass::Hold).unwrap();
            let dialled = tokio::spawn({
                let client = client.clone();
                async move {
                    client
                        .connect(
                            relay.addr,
                            "prefill-0",
                            &hello("decode-0"),
                            Duration::from_secs(10),
                        )
                        .await
                }
            });
            tokio::time::sleep(Duration::from_millis(800)).await;
            relay.pass.send(Pass::Forward).unwrap();
            let connection = dialled.await.unwrap().unwrap();
            let rtt = connection.connection.rtt();
            // It stalls again, for good.
            relay.pass.send(Pass::Drop).unwrap();
            let stalled = tokio::time::Instant::now();
            let closed = tokio::time::timeout(Duration::from_secs(5), connection.closed()).await;
            (rtt, closed.map(|reason| (stalled.elapsed(), reason)).ok(), relay)
        });
        drop(relay);
        assert!(
            rtt >= Duration::from_millis(400),
            "the stall set the round-trip estimate: {rtt:?}"
        );
        let (after, reason) = closed_after.expect("the silent peer's connection closes");
        // Idle timeout 200 ms, looked at every 50 ms; QUIC's own timer: at least 3 × (rtt + ...).
        assert!(
            after < Duration::from_millis(1_000),
            "taken for down after {after:?}: {reason}"
        );
        assert!(reason.contains("silent"), "{reason}");
        server.close();
    }

    /// A client that connects and never says hello is dropped after the handshake timeout,
    /// heartbeats or not: the heartbeat check must not keep open a connection its owner let go
    /// (quinn closes a connection when its last handle drops, and the check holds one).
    #[test]
    fn a_connection_dropped_by_the_server_is_closed_though_its_heartbeat_check_held_it() {
        let runtime = TransportRuntime::new(1).unwrap();
        let ca = ClusterCa::generate("mute").unwrap();
        let limits = ControlLimits {
            handshake_timeout: Duration::from_millis(200),
            ..ControlLimits::with_heartbeat(Duration::from_millis(50), 4)
        };
        let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let server = ControlServer::start(
            &runtime.handle(),
            loopback,
            &ca.identity("prefill-0").unwrap(),
            which_thread_setup(limits),
        )
        .unwrap();
        let mut client_config = ca.identity("decode-0").unwrap().client_config().unwrap();
        // Keep-alives every 50 ms: only the server's close can end this connection.
        client_config.transport_config(Arc::new(transport_config(&limits).unwrap()));
        let client = {
            let _guard = runtime.handle().enter();
            let mut client = quinn::Endpoint::client(loopback).unwrap();
            client.set_default_client_config(client_config);
            client
        };
        let addr = server.local_addr().unwrap();
        let closed = runtime.block_on(async move {
            let connection = client.connect(addr, "prefill-0").unwrap().await.unwrap();
            tokio::time::timeout(Duration::from_secs(3), connection.closed()).await
        });
        let closed = closed.expect("the server closes a connection that sent no hello");
        assert!(
            matches!(closed, quinn::ConnectionError::ApplicationClosed(_)),
            "{closed:?}"
        );
        server.close();
    }
}
