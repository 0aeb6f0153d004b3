//! The HTTP server every pdkv process runs (the router's API, each node's admin port), bounded
//! so that clients which hold connections open cannot lock others out.
//!
//! - A request's header must arrive within `header_timeout` of the connection's start or of
//!   the previous answer (hyper's header read timeout, which is also the keep-alive idle bound).
//! - Its body must arrive within `body_timeout` ([`read_body`]).
//! - A write that the client does not take within `stall_timeout` closes the connection (a
//!   write timeout on the socket), which cancels a streamed request whose reader stopped.
//! - At most `cap` connections are open, below the process's file limit: at the cap the
//!   connection idle the longest (waiting for a header) is closed to make room, as nginx
//!   reuses keep-alive connections; with none idle, the new one gets a 503 and is closed.
//!   Both are counted and logged.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::Router;
use axum::body::{Body, Bytes};
use http_body_util::BodyExt;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use pdkv_actors::deployment::HttpConfig;
use tokio::sync::Notify;
use tower::ServiceExt;

/// The most connections a server chooses by itself, whatever the file limit.
const AUTO_CAP_MAX: usize = 16_384;

/// The fewest connections a server holds, whatever the file limit.
const CAP_MIN: usize = 8;

/// File descriptors left for everything but HTTP connections (QUIC sockets, shared memory,
/// logs, the READ engine) when the cap is chosen from the file limit.
const RESERVED_FDS: u64 = 64;

/// Connections the kernel may queue before the server accepts them.
const LISTEN_BACKLOG: u32 = 1024;

/// How often at most a refused or failed accept is logged (the counters count every one).
const LOG_EVERY: Duration = Duration::from_secs(1);

/// What is answered to a connection beyond the cap before it is closed.
static REFUSED: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
    let body = r#"{"error":{"message":"too many open connections","type":"unavailable_error","code":503}}"#;
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n\
         retry-after: 1\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
});

/// The bounds one server applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Header deadline, also the keep-alive idle bound.
    pub header_timeout: Duration,
    /// Body deadline, from the end of the header.
    pub body_timeout: Duration,
    /// Longest a write may wait for the client.
    pub stall_timeout: Duration,
    /// Open connections.
    pub cap: usize,
}

impl HttpLimits {
    /// The bounds `[http]` asks for, with the connection cap chosen below `file_limit` (the
    /// soft open-files limit in force) when `max_connections` is 0 or too large for it.
    pub fn new(config: &HttpConfig, file_limit: u64) -> Self {
        let room = usize::try_from(file_limit.saturating_sub(RESERVED_FDS)).unwrap_or(usize::MAX);
        let auto = (room / 4 * 3).min(AUTO_CAP_MAX);
        let cap = match config.max_connections {
            0 => auto,
            asked if asked > room => {
                tracing::warn!(
                    asked,
                    file_limit,
                    chosen = auto,
                    "http.max_connections is above what the open-files limit allows"
                );
                auto
            }
            asked => asked,
        };
        HttpLimits {
            header_timeout: Duration::from_millis(config.header_timeout_ms),
            body_timeout: Duration::from_millis(config.body_timeout_ms),
            stall_timeout: Duration::from_millis(config.stall_timeout_ms),
            cap: cap.max(CAP_MIN),
        }
    }
}

/// Raises the soft open-files limit to the hard one and returns the soft limit in force.
pub fn raise_file_limit() -> u64 {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => limit,
        Err(error) => {
            tracing::warn!(%error, "cannot raise the open-files limit");
            rlimit::getrlimit(rlimit::Resource::NOFILE).map_or(1024, |(soft, _)| soft)
        }
    }
}

/// Why a request body could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    /// More than the limit.
    #[error("body: larger than {0} bytes")]
    TooLarge(usize),
    /// Not all there by the deadline.
    #[error("body: not received within {} ms", .0.as_millis())]
    TimedOut(Duration),
    /// The connection failed while it was read.
    #[error("body: the connection failed while it was read")]
    Failed,
}

impl BodyError {
    /// The status a client gets for it: 413, 408, or 400.
    pub fn status(&self) -> axum::http::StatusCode {
        use axum::http::StatusCode;
        match self {
            BodyError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            BodyError::TimedOut(_) => StatusCode::REQUEST_TIMEOUT,
            BodyError::Failed => StatusCode::BAD_REQUEST,
        }
    }
}

/// Reads a whole request body of at most `limit` bytes within `deadline`.
pub async fn read_body(body: Body, limit: usize, deadline: Duration) -> Result<Bytes, BodyError> {
    let limited = http_body_util::Limited::new(body, limit);
    match tokio::time::timeout(deadline, limited.collect()).await {
        Err(_) => Err(BodyError::TimedOut(deadline)),
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(error)) if error.is::<http_body_util::LengthLimitError>() => Err(BodyError::TooLarge(limit)),
        Ok(Err(_)) => Err(BodyError::Failed),
    }
}

/// One open connection as the cap sees it.
#[derive(Debug)]
struct Slot {
    /// Requests being answered on it (an answer ends when its body is dropped).
    busy: u32,
    /// When it last became idle (or opened).
    idle_since: Instant,
    /// Closes it.
    close: Arc<Notify>,
}

/// What [`Connections::admit`] decided.
#[derive(Debug)]
enum Admission {
    /// Serve it as connection `id`; `evicted` says whether an idle one was closed for it.
    Admitted {
        id: u64,
        close: Arc<Notify>,
        evicted: bool,
    },
    /// Every slot is busy.
    Refused,
}

/// The open connections of one server, and the rule that keeps them under the cap.
#[derive(Debug)]
struct Connections {
    slots: Mutex<HashMap<u64, Slot>>,
    next: AtomicU64,
    cap: usize,
}

impl Connections {
    fn new(cap: usize) -> Self {
        Connections {
            slots: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
            cap,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Slot>> {
        self.slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new connection at `now`: admitted (closing the longest-idle one if at the cap) or
    /// refused.
    fn admit(&self, now: Instant) -> Admission {
        let mut slots = self.lock();
        let mut evicted = false;
        if slots.len() >= self.cap {
            let oldest = slots
                .iter()
                .filter(|(_, slot)| slot.busy == 0)
                .min_by_key(|(id, slot)| (slot.idle_since, **id))
                .map(|(&id, _)| id);
            let Some(oldest) = oldest else {
                return Admission::Refused;
            };
            if let Some(slot) = slots.remove(&oldest) {
                // A stored permit: the connection closes even if it is not waiting yet.
                slot.close.notify_one();
            }
            evicted = true;
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let close = Arc::new(Notify::new());
        slots.insert(
            id,
            Slot {
                busy: 0,
                idle_since: now,
                close: close.clone(),
            },
        );
        Admission::Admitted { id, close, evicted }
    }

    /// A request started on `id`.
    fn begin(&self, id: u64) {
        if let Some(slot) = self.lock().get_mut(&id) {
            slot.busy += 1;
        }
    }

    /// A request's answer on `id` ended at `now`.
    fn end(&self, id: u64, now: Instant) {
        if let Some(slot) = self.lock().get_mut(&id) {
            slot.busy = slot.busy.saturating_sub(1);
            if slot.busy == 0 {
                slot.idle_since = now;
            }
        }
    }

    /// `id` closed.
    fn remove(&self, id: u64) {
        self.lock().remove(&id);
    }

    fn open(&self) -> usize {
        self.lock().len()
    }
}

/// Marks a connection busy while one answer lives.
struct Busy {
    connections: Arc<Connections>,
    id: u64,
}

impl Busy {
    fn new(connections: Arc<Connections>, id: u64) -> Self {
        connections.begin(id);
        Busy { connections, id }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.connections.end(self.id, Instant::now());
    }
}

/// Logs an event at most once per [`LOG_EVERY`], with how many happened since the last line.
struct Throttled {
    last: Mutex<Option<Instant>>,
    since: AtomicU64,
}

impl Throttled {
    fn new() -> Self {
        Throttled {
            last: Mutex::new(None),
            since: AtomicU64::new(0),
        }
    }

    /// Counts one event; `Some(count)` when it is time to log `count` of them.
    fn tick(&self) -> Option<u64> {
        let count = self.since.fetch_add(1, Ordering::Relaxed) + 1;
        let mut last = self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        if last.is_some_and(|at| now.duration_since(at) < LOG_EVERY) {
            return None;
        }
        *last = Some(now);
        self.since.store(0, Ordering::Relaxed);
        Some(count)
    }
}

/// An HTTP server on its own runtime; stops when dropped.
pub struct HttpServer {
    local_addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    runtime: Option<tokio::runtime::Runtime>,
}

/// A server's socket, bound but not yet serving: bind first, so that a taken port is an error
/// before anything that must be torn down (a node's links, runtimes) is started.
pub struct HttpListener {
    socket: tokio::net::TcpSocket,
    bind: SocketAddr,
    local_addr: SocketAddr,
    name: &'static str,
}

impl HttpListener {
    /// Binds `bind` for the server called `name` (`router`, `admin`: it labels metrics, logs
    /// and errors).
    pub fn bind(bind: SocketAddr, name: &'static str) -> anyhow::Result<Self> {
        let socket = match bind {
            SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
            SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
        }
        .with_context(|| format!("cannot open a socket for the {name} HTTP server"))?;
        socket
            .set_reuseaddr(true)
            .with_context(|| format!("cannot set up the {name} HTTP socket"))?;
        socket
            .bind(bind)
            .with_context(|| format!("cannot bind the {name} HTTP server to {bind}"))?;
        let local_addr = socket.local_addr()?;
        Ok(HttpListener {
            socket,
            bind,
            local_addr,
            name,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves `app` with `threads` worker threads of its own within `limits`.
    pub fn serve(self, app: Router, threads: usize, limits: HttpLimits) -> anyhow::Result<HttpServer> {
        let name = self.name;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name(format!("pdkv-{name}-http"))
            .enable_all()
            .build()
            .with_context(|| format!("cannot start the {name} HTTP runtime"))?;
        let handle = runtime.handle().clone();
        self.serve_on(app, handle, Some(runtime), limits)
    }

    /// Serves `app` within `limits` on the runtime of the calling thread (inside an actix
    /// system: the thread its actors run on, so a request reaches them without a thread
    /// hand-off).
    pub fn serve_here(self, app: Router, limits: HttpLimits) -> anyhow::Result<HttpServer> {
        self.serve_on(app, tokio::runtime::Handle::current(), None, limits)
    }

    fn serve_on(
        self,
        app: Router,
        handle: tokio::runtime::Handle,
        runtime: Option<tokio::runtime::Runtime>,
        limits: HttpLimits,
    ) -> anyhow::Result<HttpServer> {
        let HttpListener {
            socket,
            bind,
            local_addr,
            name,
        } = self;
        let listener = {
            let _entered = handle.enter();
            // A backlog for bursts of connections (the kernel caps it at somaxconn).
            socket.listen(LISTEN_BACKLOG)
        };
        let listener = match listener {
            Ok(listener) => listener,
            Err(error) => {
                if let Some(runtime) = runtime {
                    runtime.shutdown_background();
                }
                return Err(error).with_context(|| format!("cannot listen on {bind}"));
            }
        };
        describe_metrics();
        metrics::counter!("pdkv_http_connections_refused_total", "server" => name).absolute(0);
        metrics::counter!("pdkv_http_connections_evicted_total", "server" => name).absolute(0);
        metrics::gauge!("pdkv_http_connections_open", "server" => name).set(0.0);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        handle.spawn(serve(listener, app, name, limits, stopped));
        tracing::info!(%local_addr, cap = limits.cap, "{name} HTTP server listening");
        Ok(HttpServer {
            local_addr,
            stop: Some(stop),
            runtime,
        })
    }
}

impl HttpServer {
    /// Binds `bind` and serves `app` there ([`HttpListener`]).
    pub fn start(
        bind: SocketAddr,
        app: Router,
        threads: usize,
        name: &'static str,
        limits: HttpLimits,
    ) -> anyhow::Result<Self> {
        HttpListener::bind(bind, name)?.serve(app, threads, limits)
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(runtime) = self.runtime.take() {
            // Callable from inside another runtime (the actix system), unlike a blocking wait.
            runtime.shutdown_background();
        }
    }
}

fn describe_metrics() {
    metrics::describe_counter!(
        "pdkv_http_connections_refused_total",
        "HTTP connections refused because every connection slot was busy"
    );
    metrics::describe_counter!(
        "pdkv_http_connections_evicted_total",
        "Idle HTTP connections closed to make room for a new one"
    );
    metrics::describe_gauge!("pdkv_http_connections_open", "Open HTTP connections");
}

/// The accept loop, until `stopped`.
async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    name: &'static str,
    limits: HttpLimits,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let connections = Arc::new(Connections::new(limits.cap));
    let (refused, failed) = (Throttled::new(), Throttled::new());
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = &mut stopped => return,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of file descriptors (or another process's limit): wait a little instead
                // of spinning on the same error.
                if let Some(count) = failed.tick() {
                    tracing::warn!(%error, count, "{name} HTTP server cannot accept connections");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        match connections.admit(Instant::now()) {
            Admission::Refused => {
                metrics::counter!("pdkv_http_connections_refused_total", "server" => name).increment(1);
                if let Some(count) = refused.tick() {
                    tracing::warn!(
                        cap = limits.cap,
                        count,
                        "{name} HTTP server refused connections: all {} are busy",
                        limits.cap
                    );
                }
                // Best effort: the socket's buffer takes this at once or the client gets a reset.
                let _ = stream.try_write(&REFUSED);
            }
            Admission::Admitted { id, close, evicted } => {
                if evicted {
                    metrics::counter!("pdkv_http_connections_evicted_total", "server" => name).increment(1);
                }
                metrics::gauge!("pdkv_http_connections_open", "server" => name)
                    .set(connections.open() as f64);
                tokio::spawn(connection(
                    stream,
                    peer,
                    app.clone(),
                    connections.clone(),
                    id,
                    close,
                    limits,
                    name,
                ));
            }
        }
    }
}

/// Serves one connection until it ends, is closed for room, or breaks a bound.
#[allow(clippy::too_many_arguments)]
async fn connection(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    app: Router,
    connections: Arc<Connections>,
    id: u64,
    close: Arc<Notify>,
    limits: HttpLimits,
    name: &'static str,
) {
    // Streamed answers are many small writes: without TCP_NODELAY, Nagle's algorithm holds
    // each one until the client's (delayed) ACK of the last, tens of milliseconds.
    if let Err(error) = stream.set_nodelay(true) {
        tracing::debug!(%error, "cannot set TCP_NODELAY");
    }
    let mut stream = tokio_io_timeout::TimeoutStream::new(stream);
    stream.set_write_timeout(Some(limits.stall_timeout));
    let io = TokioIo::new(Box::pin(stream));
    let service = {
        let connections = connections.clone();
        tower::service_fn(move |request: axum::http::Request<hyper::body::Incoming>| {
            let busy = Busy::new(connections.clone(), id);
            let app = app.clone();
            async move {
                let response = app.oneshot(request.map(Body::new)).await?;
                // The connection is busy until the answer's body is done (or dropped).
                Ok::<_, std::convert::Infallible>(response.map(|body| {
                    Body::new(body.map_err(move |error| {
                        let _holds = &busy;
                        error
                    }))
                }))
            }
        })
    };
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    let served = builder.serve_connection(io, TowerToHyperService::new(service));
    tokio::select! {
        result = served => {
            if let Err(error) = result {
                tracing::debug!(%peer, %error, "{name} HTTP connection ended");
            }
        }
        () = close.notified() => tracing::debug!(%peer, "{name} HTTP connection closed for room"),
    }
    connections.remove(id);
    metrics::gauge!("pdkv_http_connections_open", "server" => name).set(connections.open() as f64);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admitted(admission: Admission) -> (u64, Arc<Notify>, bool) {
        match admission {
            Admission::Admitted { id, close, evicted } => (id, close, evicted),
            Admission::Refused => panic!("refused"),
        }
    }

    #[test]
    fn at_the_cap_the_longest_idle_connection_makes_room_and_busy_ones_never_do() {
        let connections = Connections::new(3);
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        let (a, a_close, _) = admitted(connections.admit(at(0)));
        let (b, _, _) = admitted(connections.admit(at(1)));
        let (c, _, _) = admitted(connections.admit(at(2)));
        // a serves a request and goes idle again after b and c opened: b is the longest idle.
        connections.begin(a);
        connections.end(a, at(10));
        connections.begin(b);
        let (d, _, evicted) = admitted(connections.admit(at(11)));
        assert!(evicted);
        assert_eq!(connections.open(), 3);
        // c (idle since 2) went, not b (busy) nor a (idle since 10).
        let open: Vec<u64> = {
            let mut ids: Vec<u64> = connections.lock().keys().copied().collect();
            ids.sort_unstable();
            ids
        };
        assert_eq!(open, vec![a, b, d]);
        assert!(!open.contains(&c));
        // Now a is the longest idle; once it is busy too, only d is idle.
        connections.begin(a);
        let (e, _, _) = admitted(connections.admit(at(12)));
        assert!(!connections.lock().contains_key(&d));
        // a, b, e: e idle. Make e busy: a new connection is refused.
        connections.begin(e);
        assert!(matches!(connections.admit(at(13)), Admission::Refused));
        // The evicted connection's close signal was stored even though nothing waited.
        let _ = a_close;
    }

    #[tokio::test]
    async fn an_evicted_connection_is_told_to_close() {
        let connections = Connections::new(1);
        let (_, close, _) = admitted(connections.admit(Instant::now()));
        let (_, _, evicted) = admitted(connections.admit(Instant::now()));
        assert!(evicted);
        tokio::time::timeout(Duration::from_secs(5), close.notified())
            .await
            .expect("the stored permit wakes the evicted connection");
    }

    #[test]
    fn the_cap_stays_below_the_file_limit() {
        let auto = HttpConfig::default();
        assert_eq!(HttpLimits::new(&auto, 1024).cap, (1024 - 64) / 4 * 3);
        assert_eq!(HttpLimits::new(&auto, 1 << 30).cap, AUTO_CAP_MAX);
        assert_eq!(HttpLimits::new(&auto, 10).cap, CAP_MIN);
        let asked = HttpConfig {
            max_connections: 100,
            ..HttpConfig::default()
        };
        assert_eq!(HttpLimits::new(&asked, 1024).cap, 100);
        let too_many = HttpConfig {
            max_connections: 5000,
            ..HttpConfig::default()
        };
        assert_eq!(HttpLimits::new(&too_many, 1024).cap, (1024 - 64) / 4 * 3);
    }

    /// Sets its flag when dropped.
    struct Dropped(Arc<std::sync::atomic::AtomicBool>);

    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn limits(stall_ms: u64, cap: usize) -> HttpLimits {
        HttpLimits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
            stall_timeout: Duration::from_millis(stall_ms),
            cap,
        }
    }

    /// Waits (bounded) for `done`.
    fn wait_until(what: &str, done: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !done() {
            assert!(Instant::now() < deadline, "{what}: not within 20 s");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn a_client_that_stops_reading_a_stream_is_cut_off_and_its_answer_dropped() {
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = dropped.clone();
        let app = Router::new().route(
            "/endless",
            axum::routing::get(move || {
                let guard = Dropped(flag.clone());
                async move {
                    let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
                    let stream = futures_util::stream::repeat_with(move || {
                        let _holds = &guard;
                        Ok::<_, std::convert::Infallible>(chunk.clone())
                    });
                    Body::from_stream(stream)
                }
            }),
        );
        let server =
            HttpServer::start("127.0.0.1:0".parse().unwrap(), app, 1, "test", limits(300, 8)).unwrap();
        let mut client = std::net::TcpStream::connect(server.local_addr()).unwrap();
        std::io::Write::write_all(&mut client, b"GET /endless HTTP/1.1\r\nhost: x\r\n\r\n").unwrap();
        // The client never reads: buffers fill, the server's write waits past its bound.
        wait_until("the stalled answer dropped", || dropped.load(Ordering::SeqCst));
    }

    #[test]
    fn a_taken_port_is_an_error_naming_the_address_not_a_panic() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = taken.local_addr().unwrap();
        let error = HttpServer::start(address, Router::new(), 1, "router", limits(300, 8))
            .err()
            .expect("the port is taken");
        let text = format!("{error:#}");
        assert!(
            text.contains(&address.to_string()) && text.contains("in use"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn bodies_are_bounded_in_size_and_time() {
        let body = Body::from("0123456789");
        assert_eq!(
            read_body(body, 4, Duration::from_secs(5)).await,
            Err(BodyError::TooLarge(4))
        );
        let body = Body::from("0123");
        assert_eq!(
            read_body(body, 4, Duration::from_secs(5)).await.as_deref(),
            Ok(&b"0123"[..])
        );
        // A body that never ends.
        let (_sender, receiver) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
        let stream = futures_util::stream::unfold(receiver, |mut receiver| async move {
            receiver.recv().await.map(|item| (item, receiver))
        });
        let body = Body::from_stream(stream);
        assert_eq!(
            read_body(body, 4, Duration::from_millis(20)).await,
            Err(BodyError::TimedOut(Duration::from_millis(20)))
        );
    }
}
