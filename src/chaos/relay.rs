//! Userspace relays that sit on one directed link of a launched cluster and inject network
//! faults into it: a UDP relay for a QUIC control link, a TCP relay for a data connection.
//!
//! A relay listens where the dialling node's view of the cluster says its peer is, and
//! forwards to where the peer really listens. Its [`LinkFaults`] can be changed while traffic
//! flows: delay every packet or chunk, lose a share of them, blackhole the link (a partition),
//! and heal. A TCP stream cannot lose bytes, so "loss" on a TCP relay stalls the chunk for a
//! retransmission timeout, as a lost segment does in the kernel's TCP. A TCP relay can also be
//! armed to call a trigger the moment the reader's next request arrives: `pdkv chaos` uses it
//! to kill the prefill leg exactly when the decode leg posts its READ.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

/// Largest UDP datagram forwarded (QUIC's are at most ~1.5 KB; this is the UDP maximum).
const DATAGRAM: usize = 65_536;

/// Packets waiting for their delay per direction of a UDP relay; beyond it, packets are lost
/// (as a full router queue loses them).
const UDP_QUEUE: usize = 4096;

/// Clients one UDP relay tracks at once (a node's dialler restarts with a new source port).
const UDP_CLIENTS: usize = 64;

/// A UDP client silent this long is forgotten.
const UDP_IDLE: Duration = Duration::from_secs(60);

/// Bytes a TCP relay reads and forwards as one chunk.
const TCP_CHUNK: usize = 64 * 1024;

/// How long a "lost" TCP chunk stalls: the kernel's minimum retransmission timeout.
const TCP_RETRANSMIT: Duration = Duration::from_millis(200);

/// The faults on one link, changed while it carries traffic.
#[derive(Default)]
pub struct LinkFaults {
    blackhole: AtomicBool,
    /// Share of packets (UDP) or chunks (TCP) lost, in millionths.
    loss_ppm: AtomicU32,
    delay_us: AtomicU64,
    healed: Notify,
    /// Called once, on the next chunk from the client (TCP relays).
    trigger: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    forwarded: AtomicU64,
    dropped: AtomicU64,
}

impl std::fmt::Debug for LinkFaults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkFaults")
            .field("blackhole", &self.is_blackholed())
            .field("loss_ppm", &self.loss_ppm.load(Ordering::Relaxed))
            .field("delay", &self.current_delay())
            .field("armed", &self.armed())
            .finish_non_exhaustive()
    }
}

impl LinkFaults {
    /// Drops everything until [`LinkFaults::heal`] (TCP: holds it).
    pub fn blackhole(&self) {
        self.blackhole.store(true, Ordering::SeqCst);
    }

    /// Loses `share` (0..=1) of the packets.
    pub fn lose(&self, share: f64) {
        self.loss_ppm
            .store((share.clamp(0.0, 1.0) * 1e6) as u32, Ordering::SeqCst);
    }

    /// Delays every packet by `delay`.
    pub fn delay(&self, delay: Duration) {
        self.delay_us.store(delay.as_micros() as u64, Ordering::SeqCst);
    }

    /// Removes every fault.
    pub fn heal(&self) {
        self.blackhole.store(false, Ordering::SeqCst);
        self.loss_ppm.store(0, Ordering::SeqCst);
        self.delay_us.store(0, Ordering::SeqCst);
        self.healed.notify_waiters();
    }

    /// Calls `trigger` when the next chunk from the client arrives (before forwarding it).
    pub fn arm(&self, trigger: Box<dyn FnOnce() + Send>) {
        *self.trigger.lock().unwrap_or_else(PoisonError::into_inner) = Some(trigger);
    }

    /// Whether an armed trigger has not fired yet.
    pub fn armed(&self) -> bool {
        self.trigger
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    /// Disarms the trigger without calling it.
    pub fn disarm(&self) {
        self.trigger.lock().unwrap_or_else(PoisonError::into_inner).take();
    }

    /// Packets or chunks forwarded and dropped so far.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.forwarded.load(Ordering::Relaxed),
            self.dropped.load(Ordering::Relaxed),
        )
    }

    fn is_blackholed(&self) -> bool {
        self.blackhole.load(Ordering::SeqCst)
    }

    fn current_delay(&self) -> Duration {
        Duration::from_micros(self.delay_us.load(Ordering::SeqCst))
    }

    fn loses(&self, rng: &mut ChaCha8Rng) -> bool {
        let ppm = self.loss_ppm.load(Ordering::SeqCst);
        ppm > 0 && (rng.next_u32() % 1_000_000) < ppm
    }

    fn fire_trigger(&self) {
        let trigger = self.trigger.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(trigger) = trigger {
            trigger();
        }
    }

    /// Waits while the link is blackholed.
    async fn wait_open(&self) {
        while self.is_blackholed() {
            let healed = self.healed.notified();
            if !self.is_blackholed() {
                break;
            }
            // Bounded: a heal between the check and the wait is seen at the next tick.
            let _ = tokio::time::timeout(Duration::from_millis(50), healed).await;
        }
    }
}

/// A running relay; dropping it stops it.
#[derive(Debug)]
pub struct Relay {
    /// Where clients dial.
    pub listen: SocketAddr,
    /// Its faults.
    pub faults: Arc<LinkFaults>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Relay {
    /// A UDP relay on `listen` (port 0 picks one) to `target`, on `runtime`.
    pub fn udp(
        runtime: &tokio::runtime::Handle,
        listen: SocketAddr,
        target: SocketAddr,
        seed: u64,
    ) -> std::io::Result<Relay> {
        let socket = runtime.block_on(UdpSocket::bind(listen))?;
        let listen = socket.local_addr()?;
        let faults = Arc::new(LinkFaults::default());
        let task = runtime.spawn(udp_relay(Arc::new(socket), target, faults.clone(), seed));
        Ok(Relay { listen, faults, task })
    }

    /// A TCP relay on `listen` (port 0 picks one) to `target`, on `runtime`.
    pub fn tcp(
        runtime: &tokio::runtime::Handle,
        listen: SocketAddr,
        target: SocketAddr,
        seed: u64,
    ) -> std::io::Result<Relay> {
        let listener = runtime.block_on(TcpListener::bind(listen))?;
        let listen = listener.local_addr()?;
        let faults = Arc::new(LinkFaults::default());
        let task = runtime.spawn(tcp_relay(listener, target, faults.clone(), seed));
        Ok(Relay { listen, faults, task })
    }
}

/// One packet waiting for its delay.
struct Delayed {
    due: Instant,
    bytes: Vec<u8>,
}

/// Sends packets from `queue` on `socket` (to `to`, or the connected peer), each at its due time.
async fn send_due(socket: Arc<UdpSocket>, to: Option<SocketAddr>, mut queue: mpsc::Receiver<Delayed>) {
    while let Some(packet) = queue.recv().await {
        tokio::time::sleep_until(packet.due).await;
        let sent = match to {
            Some(to) => socket.send_to(&packet.bytes, to).await,
            None => socket.send(&packet.bytes).await,
        };
        if let Err(error) = sent {
            tracing::debug!(%error, "relay send failed");
        }
    }
}

/// Queues `bytes` for sending after the link's delay, unless the link loses it.
fn pass(faults: &LinkFaults, rng: &mut ChaCha8Rng, queue: &mpsc::Sender<Delayed>, bytes: &[u8]) {
    if faults.is_blackholed() || faults.loses(rng) {
        faults.dropped.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let packet = Delayed {
        due: Instant::now() + faults.current_delay(),
        bytes: bytes.to_vec(),
    };
    if queue.try_send(packet).is_ok() {
        faults.forwarded.fetch_add(1, Ordering::Relaxed);
    } else {
        faults.dropped.fetch_add(1, Ordering::Relaxed);
    }
}

/// One client of a UDP relay: its own upstream socket, so the target's answers find it.
struct UdpClient {
    to_target: mpsc::Sender<Delayed>,
    last_seen: Instant,
    tasks: [tokio::task::JoinHandle<()>; 2],
}

impl Drop for UdpClient {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

async fn udp_relay(socket: Arc<UdpSocket>, target: SocketAddr, faults: Arc<LinkFaults>, seed: u64) {
    let mut clients: HashMap<SocketAddr, UdpClient> = HashMap::new();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut buffer = vec![0u8; DATAGRAM];
    loop {
        let (len, from) = match socket.recv_from(&mut buffer).await {
            Ok(received) => received,
            Err(error) => {
                // ICMP errors surface here on Linux; the socket itself stays usable.
                tracing::debug!(%error, "relay receive failed");
                continue;
            }
        };
        if !clients.contains_key(&from) {
            if clients.len() >= UDP_CLIENTS {
                let now = Instant::now();
                clients.retain(|_, client| now.duration_since(client.last_seen) < UDP_IDLE);
            }
            if clients.len() >= UDP_CLIENTS {
                faults.dropped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let bind: SocketAddr = if target.is_ipv4() {
                ([127, 0, 0, 1], 0).into()
            } else {
                (std::net::Ipv6Addr::LOCALHOST, 0).into()
            };
            let upstream = match UdpSocket::bind(bind).await {
                Ok(upstream) => upstream,
                Err(error) => {
                    tracing::warn!(%error, "relay cannot bind an upstream socket");
                    continue;
                }
            };
            if let Err(error) = upstream.connect(target).await {
                tracing::warn!(%error, %target, "relay cannot connect upstream");
                continue;
            }
            let upstream = Arc::new(upstream);
            let (to_target, to_target_queue) = mpsc::channel(UDP_QUEUE);
            let (to_client, to_client_queue) = mpsc::channel(UDP_QUEUE);
            let sender = tokio::spawn(send_due(upstream.clone(), None, to_target_queue));
            let back = tokio::spawn(send_due(socket.clone(), Some(from), to_client_queue));
            let answers = {
                let (upstream, faults) = (upstream.clone(), faults.clone());
                let mut rng = ChaCha8Rng::seed_from_u64(seed ^ u64::from(from.port()));
                tokio::spawn(async move {
                    let mut buffer = vec![0u8; DATAGRAM];
                    loop {
                        match upstream.recv(&mut buffer).await {
                            Ok(len) => pass(&faults, &mut rng, &to_client, &buffer[..len]),
                            // The target is gone (ICMP refused); it may come back.
                            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
                        }
                    }
                })
            };
            // The sender task ends with the client's queue; the two others are aborted.
            drop(sender);
            clients.insert(
                from,
                UdpClient {
                    to_target,
                    last_seen: Instant::now(),
                    tasks: [answers, back],
                },
            );
        }
        let client = clients.get_mut(&from).expect("inserted above");
        client.last_seen = Instant::now();
        pass(&faults, &mut rng, &client.to_target, &buffer[..len]);
    }
}

async fn tcp_relay(listener: TcpListener, target: SocketAddr, faults: Arc<LinkFaults>, seed: u64) {
    let mut connections = 0u64;
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        connections += 1;
        let faults = faults.clone();
        let seed = seed ^ connections.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        tokio::spawn(async move {
            let Ok(Ok(upstream)) =
                tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(target)).await
            else {
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = upstream.set_nodelay(true);
            let (client_read, client_write) = client.into_split();
            let (upstream_read, upstream_write) = upstream.into_split();
            let forward = pump(client_read, upstream_write, faults.clone(), seed, true);
            let backward = pump(upstream_read, client_write, faults, seed ^ 1, false);
            // Either side closing ends both: a killed peer resets the reader's connection.
            tokio::select! {
                _ = forward => {}
                _ = backward => {}
            }
        });
    }
}

/// Copies one direction of a TCP relay chunk by chunk, applying the link's faults.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    faults: Arc<LinkFaults>,
    seed: u64,
    from_client: bool,
) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut buffer = vec![0u8; TCP_CHUNK];
    loop {
        let len = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(len) => len,
        };
        if from_client {
            faults.fire_trigger();
        }
        faults.wait_open().await;
        let delay = faults.current_delay();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if faults.loses(&mut rng) {
            faults.dropped.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(TCP_RETRANSMIT).await;
        }
        if to.write_all(&buffer[..len]).await.is_err() {
            return;
        }
        faults.forwarded.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime")
    }

    fn loopback() -> SocketAddr {
        ([127, 0, 0, 1], 0).into()
    }

    /// An echo server on loopback for UDP.
    async fn udp_echo() -> SocketAddr {
        let socket = UdpSocket::bind(loopback()).await.expect("bind");
        let address = socket.local_addr().expect("address");
        tokio::spawn(async move {
            let mut buffer = vec![0u8; DATAGRAM];
            while let Ok((len, from)) = socket.recv_from(&mut buffer).await {
                let _ = socket.send_to(&buffer[..len], from).await;
            }
        });
        address
    }

    /// Sends `count` numbered datagrams through the relay and counts the echoes within `wait`.
    async fn echoes(relay: SocketAddr, count: u32, wait: Duration) -> u32 {
        let client = UdpSocket::bind(loopback()).await.expect("bind");
        client.connect(relay).await.expect("connect");
        for index in 0..count {
            client.send(&index.to_le_bytes()).await.expect("send");
        }
        let mut seen = 0;
        let mut buffer = [0u8; 16];
        let deadline = Instant::now() + wait;
        while seen < count {
            match tokio::time::timeout_at(deadline, client.recv(&mut buffer)).await {
                Ok(Ok(_)) => seen += 1,
                _ => break,
            }
        }
        seen
    }

    #[test]
    fn a_udp_relay_forwards_both_ways_and_its_faults_change_what_passes() {
        let runtime = runtime();
        let echo = runtime.block_on(udp_echo());
        let relay = Relay::udp(runtime.handle(), loopback(), echo, 7).expect("relay");
        let all = runtime.block_on(echoes(relay.listen, 100, Duration::from_secs(2)));
        assert_eq!(all, 100, "a healthy loopback relay loses nothing");
        relay.faults.blackhole();
        let none = runtime.block_on(echoes(relay.listen, 20, Duration::from_millis(200)));
        assert_eq!(none, 0, "a blackholed link passes nothing");
        relay.faults.heal();
        relay.faults.lose(0.5);
        // Each echo crosses the relay twice: about a quarter come back.
        let some = runtime.block_on(echoes(relay.listen, 400, Duration::from_millis(500)));
        assert!((40..=170).contains(&some), "{some} of 400 with 50% loss each way");
        relay.faults.heal();
        relay.faults.delay(Duration::from_millis(150));
        let started = std::time::Instant::now();
        let delayed = runtime.block_on(echoes(relay.listen, 1, Duration::from_secs(2)));
        assert_eq!(delayed, 1);
        assert!(
            started.elapsed() >= Duration::from_millis(300),
            "two crossings of 150 ms took {:?}",
            started.elapsed()
        );
    }

    #[test]
    fn a_tcp_relay_holds_bytes_across_a_partition_and_fires_its_trigger_on_the_next_request() {
        let runtime = runtime();
        let (target, fired) = runtime.block_on(async {
            let server = TcpListener::bind(loopback()).await.expect("bind");
            let target = server.local_addr().expect("address");
            tokio::spawn(async move {
                while let Ok((mut stream, _)) = server.accept().await {
                    tokio::spawn(async move {
                        let mut buffer = [0u8; 1024];
                        while let Ok(len) = stream.read(&mut buffer).await {
                            if len == 0 || stream.write_all(&buffer[..len]).await.is_err() {
                                break;
                            }
                        }
                    });
                }
            });
            let fired = Arc::new(AtomicBool::new(false));
            (target, fired)
        });
        let relay = Relay::tcp(runtime.handle(), loopback(), target, 3).expect("relay");
        let faults = relay.faults.clone();
        let flag = fired.clone();
        runtime.block_on(async {
            let mut stream = TcpStream::connect(relay.listen).await.expect("connect");
            let mut buffer = [0u8; 5];
            stream.write_all(b"hello").await.expect("write");
            stream.read_exact(&mut buffer).await.expect("echo");
            assert_eq!(&buffer, b"hello");
            faults.blackhole();
            stream.write_all(b"world").await.expect("write");
            let held = tokio::time::timeout(Duration::from_millis(200), stream.read_exact(&mut buffer)).await;
            assert!(held.is_err(), "a partitioned link delivered bytes");
            faults.heal();
            tokio::time::timeout(Duration::from_secs(2), stream.read_exact(&mut buffer))
                .await
                .expect("healed link delivers the held bytes")
                .expect("read");
            assert_eq!(&buffer, b"world", "nothing lost across the partition");
            faults.arm(Box::new(move || flag.store(true, Ordering::SeqCst)));
            assert!(faults.armed());
            stream.write_all(b"again").await.expect("write");
            stream.read_exact(&mut buffer).await.expect("echo");
        });
        assert!(
            fired.load(Ordering::SeqCst),
            "the trigger fired on the next request"
        );
        assert!(!relay.faults.armed(), "a trigger fires once");
    }
}
