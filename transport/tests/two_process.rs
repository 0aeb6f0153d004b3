//! Two processes on one machine: a prefill-side peer (`pdkv-transport-peer`) and this test as the
//! decode side. They authenticate each other with mutual TLS over QUIC, exchange descriptors in
//! the handshake and move KV ranges with the shared-memory and network READ engines; strangers,
//! out-of-grant reads and malformed frames are refused. All traffic stays on 127.0.0.1.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdkv_core::plan::{ReadRun, RegionLayout};
use pdkv_core::wire::{GrantId, Incarnation, NodeId, Role};
use pdkv_transport::codec::PROTOCOL_VERSION;
use pdkv_transport::codec::decode as decode_frame;
use pdkv_transport::control::{
    ControlClient, ControlError, EngineAdvert, HandshakeError, Hello, PeerConnection, TransportRuntime,
};
use pdkv_transport::engine::{EngineError, EngineKey, EngineKind, ReadEngine, ReadOp};
use pdkv_transport::mapped::MappedEngine;
use pdkv_transport::net::{DataReply, NetEngine};
use pdkv_transport::region::Region;
use pdkv_transport::tls::{ClusterCa, Existing, NodeIdentity, write_cluster_certs};

#[path = "support/peer_protocol.rs"]
mod peer_protocol;

use peer_protocol::{BLOCK_BYTES, BLOCKS, LAYERS, PeerRequest, PeerResponse, layout, pattern_byte};

const TIMEOUT: Duration = Duration::from_secs(5);

/// A running peer process; killed when dropped.
struct Peer {
    child: Child,
    address: SocketAddr,
    certs: PathBuf,
}

impl Peer {
    fn spawn(test: &str) -> Peer {
        let certs = std::env::temp_dir().join(format!("pdkv-two-process-{test}-{}", std::process::id()));
        write_cluster_certs(
            &certs,
            "test",
            &["prefill-0", "decode-0", "decode-1", "outsider"],
            Existing::Replace,
        )
        .unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_pdkv-transport-peer"))
            .args([
                "--certs",
                certs.to_str().unwrap(),
                "--name",
                "prefill-0",
                "--cluster",
                "prefill-0,decode-0,decode-1",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("peer prints READY in time");
        let address = line
            .trim()
            .strip_prefix("READY ")
            .expect("READY line")
            .parse()
            .unwrap();
        Peer {
            child,
            address,
            certs,
        }
    }

    fn identity(&self, name: &str) -> NodeIdentity {
        NodeIdentity::load(&self.certs, name).unwrap()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Some(mut stdin) = self.child.stdin.take() {
            let _ = stdin.flush();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.certs);
    }
}

fn hello(node: &str) -> Hello {
    Hello {
        node: NodeId(node.into()),
        role: Role::Decode,
        incarnation: Incarnation(7),
        regions: RegionLayout::default(),
        protocol_version: PROTOCOL_VERSION,
        layout_hash: layout().compat_hash(),
        model: pdkv_core::identity::ModelFields::new(layout().identity_fields()).unwrap(),
        engines: vec![],
        host: pdkv_transport::host::host_id(),
    }
}

struct Decode {
    name: &'static str,
    runtime: TransportRuntime,
    connection: PeerConnection,
}

fn connect(peer: &Peer) -> Decode {
    connect_as(peer, "decode-0")
}

/// Connects to the peer as cluster member `name`.
fn connect_as(peer: &Peer, name: &'static str) -> Decode {
    let runtime = TransportRuntime::new(2).unwrap();
    let client = ControlClient::new(
        &runtime.handle(),
        "127.0.0.1:0".parse().unwrap(),
        &peer.identity(name),
    )
    .unwrap();
    let connection = runtime
        .block_on(client.connect(peer.address, "prefill-0", &hello(name), TIMEOUT))
        .unwrap();
    Decode {
        name,
        runtime,
        connection,
    }
}

impl Decode {
    fn advert(&self, kind: EngineKind) -> EngineAdvert {
        self.connection
            .peer
            .engines
            .iter()
            .find(|advert| advert.engine.kind == kind)
            .cloned()
            .expect("peer advertises the engine")
    }

    fn ask(&self, request: PeerRequest) -> Result<PeerResponse, ControlError> {
        self.runtime.block_on(self.connection.request(request, TIMEOUT))
    }

    fn grant(&self, blocks: Vec<u32>, lease_ms: u64) -> (GrantId, Vec<u32>) {
        match self.ask(PeerRequest::Grant { blocks, lease_ms }).unwrap() {
            PeerResponse::Granted { grant, generations } => (grant, generations),
            other => panic!("unexpected {other:?}"),
        }
    }

    fn net_engine(&self) -> (NetEngine, Arc<Region>) {
        let (engine, destination) = self.unconnected_net_engine(pdkv_transport::net::DEFAULT_CONNECT_WAIT);
        self.connect_data(&engine);
        (engine, destination)
    }

    /// A net engine that knows the peer's regions but has no data connection yet; its READs
    /// wait at most `wait` for one.
    fn unconnected_net_engine(&self, wait: Duration) -> (NetEngine, Arc<Region>) {
        let engine = NetEngine::new(EngineKey(self.name.into()), self.runtime.handle(), String::new())
            .with_connect_wait(wait);
        let destination = Arc::new(Region::heap(((BLOCKS + 1) as u64 * BLOCK_BYTES) as usize));
        engine.register(0, destination.clone()).unwrap();
        let advert = self.advert(EngineKind::Net);
        engine.register_remote(&advert.engine, &advert.regions).unwrap();
        (engine, destination)
    }

    /// Opens `engine`'s data connection to the peer with a fresh ticket.
    fn connect_data(&self, engine: &NetEngine) {
        let advert = self.advert(EngineKind::Net);
        let ticket = self.runtime.block_on(self.connection.ticket(TIMEOUT)).unwrap();
        self.runtime
            .block_on(engine.connect(&advert.engine.key, &NodeId(self.name.into()), ticket, TIMEOUT))
            .unwrap();
    }
}

/// Reads blocks `first .. first + count` of `layer` into the destination at the same offsets.
fn read_blocks(
    engine: &dyn ReadEngine,
    grant: GrantId,
    layer: u32,
    first: u32,
    count: u32,
) -> Result<u64, EngineError> {
    let op = ReadOp {
        grant,
        local_region: 0,
        remote_engine: EngineKey("prefill-0".into()),
        remote_region: layer,
        runs: vec![ReadRun {
            local_offset: u64::from(first) * BLOCK_BYTES,
            remote_offset: u64::from(first) * BLOCK_BYTES,
            len_bytes: u64::from(count) * BLOCK_BYTES,
        }],
    };
    engine
        .batch_read(vec![op])?
        .wait_blocking(TIMEOUT)
        .map(|report| report.bytes)
}

fn assert_holds_pattern(region: &Region, layer: usize, first: u32, count: u32) {
    let start = u64::from(first) * BLOCK_BYTES;
    let mut bytes = vec![0u8; (u64::from(count) * BLOCK_BYTES) as usize];
    region.read(start, &mut bytes).unwrap();
    for (index, byte) in bytes.iter().enumerate() {
        assert_eq!(
            *byte,
            pattern_byte(layer, start + index as u64),
            "layer {layer} offset {}",
            start + index as u64
        );
    }
}

fn is_zero(region: &Region, block: u32) -> bool {
    let mut bytes = vec![1u8; BLOCK_BYTES as usize];
    region.read(u64::from(block) * BLOCK_BYTES, &mut bytes).unwrap();
    bytes.iter().all(|&byte| byte == 0)
}

/// Reads blocks 3..6 of every layer through `engine`: the peer's bytes land at the same offsets,
/// the guard blocks around them stay zero, and the generation words match the grant's.
fn moves_blocks_3_to_5(
    decode: &Decode,
    engine: &dyn ReadEngine,
    destination: &Region,
    grant: GrantId,
    generations: &[u32],
) {
    for layer in 0..LAYERS as u32 {
        assert_eq!(read_blocks(engine, grant, layer, 3, 3).unwrap(), 3 * BLOCK_BYTES);
        assert_holds_pattern(destination, layer as usize, 3, 3);
    }
    assert!(
        is_zero(destination, 2) && is_zero(destination, 6),
        "guard blocks untouched"
    );
    let words = decode
        .runtime
        .block_on(engine.read_remote_words(&EngineKey("prefill-0".into()), grant, LAYERS as u32, &[3, 4, 5]))
        .unwrap();
    assert_eq!(words, generations);
}

#[test]
fn nodes_authenticate_and_move_kv_with_shm_and_net_engines() {
    let peer = Peer::spawn("move");
    let decode = connect(&peer);
    assert_eq!(decode.connection.peer.node, NodeId("prefill-0".into()));
    assert_eq!(decode.connection.peer.layout_hash, layout().compat_hash());
    let (grant, generations) = decode.grant(vec![3, 4, 5], 10_000);
    assert_eq!(generations, vec![0, 0, 0]);

    // Shared memory: map the peer's memfds read-only and copy directly.
    let shm = MappedEngine::shm(EngineKey("decode-0".into())).unwrap();
    let destination =
        Arc::new(Region::shared("decode", ((BLOCKS + 1) as u64 * BLOCK_BYTES) as usize).unwrap());
    shm.register(0, destination.clone()).unwrap();
    let advert = decode.advert(EngineKind::Shm);
    assert_ne!(advert.engine.pid, std::process::id(), "a second process");
    shm.register_remote(&advert.engine, &advert.regions).unwrap();
    moves_blocks_3_to_5(&decode, &shm, &destination, grant, &generations);

    // Network: a ticket from the control plane opens the data connection.
    let (net, destination) = decode.net_engine();
    moves_blocks_3_to_5(&decode, &net, &destination, grant, &generations);
}

#[test]
fn reads_outside_a_live_grant_are_refused_and_move_no_bytes() {
    let peer = Peer::spawn("grants");
    let decode = connect(&peer);
    let (net, destination) = decode.net_engine();
    let (grant, _) = decode.grant(vec![3], 10_000);
    let error = read_blocks(&net, grant, 0, 3, 2).unwrap_err();
    assert_eq!(
        error.to_string(),
        "remote refused the read: grant 1 does not cover block 4 of group 0"
    );
    assert!(
        is_zero(&destination, 3) && is_zero(&destination, 4),
        "a refused read lands nothing"
    );
    assert_eq!(
        read_blocks(&net, GrantId(99), 0, 3, 1).unwrap_err(),
        EngineError::Refused("grant 99 is not live: it was never issued".into())
    );
    assert_eq!(read_blocks(&net, grant, 0, 3, 1).unwrap(), BLOCK_BYTES);

    // Release revokes.
    decode.ask(PeerRequest::Release { grant }).unwrap();
    assert_eq!(
        read_blocks(&net, grant, 0, 3, 1).unwrap_err(),
        EngineError::Refused(format!("grant {} is not live: it was released", grant.0))
    );

    // Expiry revokes: a 50 ms lease, polled for at most 5 s.
    let (short, _) = decode.grant(vec![7], 50);
    let deadline = Instant::now() + Duration::from_secs(5);
    let error = loop {
        match read_blocks(&net, short, 0, 7, 1) {
            Err(error) => break error,
            Ok(_) => assert!(Instant::now() < deadline, "lease never expired"),
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(
        error,
        EngineError::Refused(format!("grant {} is not live: its lease expired", short.0))
    );

    // One-sided shm reads cannot be refused; reuse is caught by the generation word instead.
    let (grant, generations) = decode.grant(vec![9], 10_000);
    let shm = MappedEngine::shm(EngineKey("decode-0".into())).unwrap();
    let advert = decode.advert(EngineKind::Shm);
    shm.register_remote(&advert.engine, &advert.regions).unwrap();
    let reused = match decode.ask(PeerRequest::Reuse { block: 9 }).unwrap() {
        PeerResponse::Reused { generation } => generation,
        other => panic!("unexpected {other:?}"),
    };
    let words = decode
        .runtime
        .block_on(shm.read_remote_words(&EngineKey("prefill-0".into()), grant, LAYERS as u32, &[9]))
        .unwrap();
    assert_eq!(words, vec![reused]);
    assert_ne!(words, generations, "a reader sees the block changed under it");
}

#[test]
fn strangers_and_incompatible_peers_are_refused() {
    let peer = Peer::spawn("strangers");
    let runtime = TransportRuntime::new(2).unwrap();
    let bind: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let dial = |identity: &NodeIdentity, hello: Hello| {
        let client = ControlClient::new(&runtime.handle(), bind, identity).unwrap();
        runtime.block_on(client.connect(peer.address, "prefill-0", &hello, TIMEOUT))
    };

    // A certificate from another CA: the TLS handshake fails.
    let foreign = ClusterCa::generate("other")
        .unwrap()
        .identity("decode-0")
        .unwrap();
    // The client refuses the server's certificate first: it does not chain to its CA either.
    match dial(&foreign, hello("decode-0")) {
        Err(ControlError::Connect(reason)) => {
            assert!(
                reason.ends_with("invalid peer certificate: UnknownIssuer"),
                "{reason}"
            )
        }
        other => panic!("a foreign CA's certificate: {other:?}"),
    }

    // No client certificate at all.
    let anonymous = ControlClient::with_config(
        &runtime.handle(),
        bind,
        peer.identity("decode-0").anonymous_client_config().unwrap(),
    )
    .unwrap();
    let result = runtime.block_on(anonymous.connect(peer.address, "prefill-0", &hello("decode-0"), TIMEOUT));
    // The server aborts the handshake; the client sees it while connecting or on its hello.
    match result {
        Err(ControlError::Connect(reason) | ControlError::Refused(reason)) => {
            assert!(reason.ends_with("peer sent no certificates"), "{reason}")
        }
        other => panic!("a peer without a certificate: {other:?}"),
    }

    // A valid certificate for a node that is not part of the cluster.
    let error = dial(&peer.identity("outsider"), hello("outsider")).unwrap_err();
    assert_eq!(
        error,
        ControlError::Refused("node outsider is not part of this cluster".into())
    );

    // A valid certificate, but the hello claims another node's name.
    let mut impostor = hello("decode-0");
    impostor.node = NodeId("prefill-0".into());
    let error = dial(&peer.identity("decode-0"), impostor).unwrap_err();
    assert_eq!(
        error,
        ControlError::Refused("peer certificate is not valid for node \"prefill-0\"".into())
    );

    // Incompatible layout, model or protocol: refused, saying what differs, seen from the
    // dialler's side.
    let mut other_layout = hello("decode-0");
    other_layout.layout_hash ^= 1;
    let error = dial(&peer.identity("decode-0"), other_layout).unwrap_err();
    assert_eq!(
        error,
        ControlError::Handshake(HandshakeError::LayoutHash {
            ours: layout().compat_hash() ^ 1,
            theirs: layout().compat_hash(),
        })
    );
    let mut other_model = hello("decode-0");
    let mut fields: Vec<(String, String)> = layout()
        .identity_fields()
        .into_iter()
        .filter(|(name, _)| name != "layer_groups")
        .collect();
    fields.push(("kv_cache_dtype".into(), "fp8".into()));
    other_model.model = pdkv_core::identity::ModelFields::new(fields).unwrap();
    let error = dial(&peer.identity("decode-0"), other_model).unwrap_err();
    let layer_groups = format!("{:?}", layout().layer_groups());
    assert_eq!(
        error.to_string(),
        format!(
            "incompatible peer: model differs between decode-0 and prefill-0: kv_cache_dtype: \
             decode-0 fp8, prefill-0 (not set); layer_groups: decode-0 (not set), prefill-0 {layer_groups}"
        )
    );
    let mut other_version = hello("decode-0");
    other_version.protocol_version = 99;
    let error = dial(&peer.identity("decode-0"), other_version).unwrap_err();
    assert_eq!(
        error,
        ControlError::Handshake(HandshakeError::ProtocolVersion {
            ours: 99,
            theirs: pdkv_transport::codec::PROTOCOL_VERSION,
        })
    );

    // And the rightful node still gets in.
    assert!(dial(&peer.identity("decode-0"), hello("decode-0")).is_ok());
}

#[test]
fn malformed_frames_close_the_connection_not_the_node() {
    let peer = Peer::spawn("frames");
    let decode = connect(&peer);
    // Garbage on the control plane closes that connection.
    let garbage = decode
        .runtime
        .block_on(decode.connection.send_raw(&[0xFF; 64], TIMEOUT));
    // The node closes the connection rather than answer: the request's reply never comes.
    assert_eq!(
        garbage,
        Err(ControlError::Codec(pdkv_transport::codec::CodecError::Io(
            "connection lost".into()
        ))),
        "garbage got an answer"
    );
    let deadline = Instant::now() + TIMEOUT;
    while decode.connection.is_open() {
        assert!(Instant::now() < deadline, "connection not closed after garbage");
        std::thread::sleep(Duration::from_millis(5));
    }

    // Garbage and oversize lengths on a data connection, and a forged ticket.
    use std::io::Read;
    let fresh = connect(&peer);
    let data_address: SocketAddr = fresh.advert(EngineKind::Net).engine.address.parse().unwrap();
    let cases: [(Vec<u8>, &str); 4] = [
        (
            vec![0xFF, 0xFF, 0xFF, 0xFF, 1, 2, 3],
            "bad data hello: frame of 4294967295 bytes exceeds the 4096-byte limit",
        ),
        (vec![5, 0, 0, 0, 9], "bad data hello: stream ended inside a frame"),
        (vec![], "bad data hello: stream ended inside a frame"),
        (vec![3, 0, 0, 0, 9, 9, 9], "bad data hello: malformed message"),
    ];
    for (bytes, expected) in cases {
        let mut stream = std::net::TcpStream::connect(data_address).unwrap();
        stream.set_read_timeout(Some(TIMEOUT)).unwrap();
        // The server may close as soon as it sees a bad length, before we finish writing.
        let _ = stream.write_all(&bytes);
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let mut reply = Vec::new();
        let _ = stream.read_to_end(&mut reply);
        assert!(reply.len() > 4, "{bytes:?}: a refusal frame, got {reply:?}");
        match decode_frame::<DataReply>(&reply[4..]) {
            Ok(DataReply::Refused(reason)) => {
                assert!(reason.starts_with(expected), "{bytes:?}: {reason}")
            }
            other => panic!("{bytes:?}: expected a refusal, got {other:?}"),
        }
    }
    let forged_engine = NetEngine::new(
        EngineKey("decode-0".into()),
        fresh.runtime.handle(),
        String::new(),
    );
    let advert = fresh.advert(EngineKind::Net);
    forged_engine
        .register_remote(&advert.engine, &advert.regions)
        .unwrap();
    let forged = pdkv_transport::net::Ticket([7; 32]);
    let error = fresh
        .runtime
        .block_on(forged_engine.connect(&advert.engine.key, &NodeId("decode-0".into()), forged, TIMEOUT))
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "remote refused the read: data connection refused: unknown or used ticket"
    );

    // The node still serves: a new connection moves bytes.
    let (net, destination) = fresh.net_engine();
    let (grant, _) = fresh.grant(vec![1, 2], 10_000);
    assert_eq!(read_blocks(&net, grant, 1, 1, 2).unwrap(), 2 * BLOCK_BYTES);
    assert_holds_pattern(&destination, 1, 1, 2);
}

/// Fills a region with 0xAA so that any byte a refused READ landed would show.
fn poison(region: &Region) {
    region.write(0, &vec![0xAA; region.len()]).unwrap();
}

fn is_poisoned(region: &Region) -> bool {
    let mut bytes = vec![0u8; region.len()];
    region.read(0, &mut bytes).unwrap();
    bytes.iter().all(|&byte| byte == 0xAA)
}

/// A cluster member cannot read under another member's grant: data and generation words are
/// both refused, nothing lands, and the grant still serves its owner.
#[test]
fn a_members_grant_is_refused_to_another_member() {
    let peer = Peer::spawn("foreign");
    let owner = connect(&peer);
    let (grant, generations) = owner.grant(vec![3, 4, 5], 10_000);
    let other = connect_as(&peer, "decode-1");
    let (net, destination) = other.net_engine();
    poison(&destination);
    assert_eq!(
        read_blocks(&net, grant, 0, 3, 2).unwrap_err(),
        EngineError::Refused(format!("grant {} does not belong to peer decode-1", grant.0))
    );
    assert!(is_poisoned(&destination), "a refused read lands nothing");
    let words = other.runtime.block_on(net.read_remote_words(
        &EngineKey("prefill-0".into()),
        grant,
        LAYERS as u32,
        &[3, 4],
    ));
    assert_eq!(
        words,
        Err(EngineError::Refused(format!(
            "grant {} does not belong to peer decode-1",
            grant.0
        )))
    );
    let (owned, owner_destination) = owner.net_engine();
    moves_blocks_3_to_5(&owner, &owned, &owner_destination, grant, &generations);
}

/// A READ of several runs is checked run by run before any byte is sent: one run outside the
/// grant (here the last) refuses the whole READ and the destination stays as it was.
#[test]
fn a_multi_run_read_with_one_run_outside_the_grant_lands_nothing() {
    let peer = Peer::spawn("multirun");
    let decode = connect(&peer);
    let (grant, _) = decode.grant(vec![3, 4, 5], 10_000);
    let (net, destination) = decode.net_engine();
    poison(&destination);
    let run = |block: u64| ReadRun {
        local_offset: block * BLOCK_BYTES,
        remote_offset: block * BLOCK_BYTES,
        len_bytes: BLOCK_BYTES,
    };
    for outside in [9u64, 2, 6] {
        let op = ReadOp {
            grant,
            local_region: 0,
            remote_engine: EngineKey("prefill-0".into()),
            remote_region: 1,
            runs: vec![run(3), run(4), run(5), run(outside)],
        };
        let error = net
            .batch_read(vec![op])
            .and_then(|handle| handle.wait_blocking(TIMEOUT))
            .unwrap_err();
        assert_eq!(
            error,
            EngineError::Refused(format!(
                "grant {} does not cover block {outside} of group 0",
                grant.0
            ))
        );
        assert!(is_poisoned(&destination), "run {outside}: nothing lands");
    }
}

/// The data hello is read with a 4096-byte limit: a hello claiming 4097 bytes is refused with
/// that reason, and the node keeps serving.
#[test]
fn an_oversize_data_hello_is_refused_with_the_limit_named() {
    use std::io::Read;
    let peer = Peer::spawn("hello-limit");
    let decode = connect(&peer);
    let data_address: SocketAddr = decode.advert(EngineKind::Net).engine.address.parse().unwrap();
    let mut stream = std::net::TcpStream::connect(data_address).unwrap();
    stream.set_read_timeout(Some(TIMEOUT)).unwrap();
    stream.write_all(&4097u32.to_le_bytes()).unwrap();
    let mut reply = Vec::new();
    let _ = stream.read_to_end(&mut reply);
    assert!(reply.len() > 4, "a refusal frame: {reply:?}");
    let refusal: DataReply = decode_frame(&reply[4..]).unwrap();
    assert_eq!(
        refusal,
        DataReply::Refused("bad data hello: frame of 4097 bytes exceeds the 4096-byte limit".into())
    );
    let (net, _) = decode.net_engine();
    let (grant, _) = decode.grant(vec![1], 10_000);
    assert_eq!(read_blocks(&net, grant, 0, 1, 1).unwrap(), BLOCK_BYTES);
}

/// Idle connections that never send a hello cannot lock a real peer out of the data port: the
/// oldest of them is dropped when a new one arrives, and the peer gets in at once (well inside
/// the 2 s hello timeout that would otherwise free their slots).
#[test]
fn idle_unauthenticated_connections_cannot_fill_the_data_port() {
    use std::io::Read;
    let peer = Peer::spawn("preauth");
    let decode = connect(&peer);
    let data_address: SocketAddr = decode.advert(EngineKind::Net).engine.address.parse().unwrap();
    // More idle strangers than the 64 authenticated slots and the 16 pre-auth slots together.
    let idle: Vec<std::net::TcpStream> = (0..100)
        .map(|_| std::net::TcpStream::connect(data_address).unwrap())
        .collect();
    let started = Instant::now();
    let (net, destination) = decode.net_engine();
    let (grant, _) = decode.grant(vec![2], 10_000);
    assert_eq!(read_blocks(&net, grant, 1, 2, 1).unwrap(), BLOCK_BYTES);
    assert_holds_pattern(&destination, 1, 2, 1);
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "admitted before any hello timeout freed a slot ({:?})",
        started.elapsed()
    );
    // All but the newest 16 idle connections were closed by the server (evicted) as newer ones
    // arrived, long before the 2 s hello timeout could have closed them.
    for stream in &idle {
        stream.set_nonblocking(true).unwrap();
    }
    let closed = || {
        idle.iter()
            .filter(|stream| {
                let mut byte = [0u8; 1];
                matches!((&**stream).read(&mut byte), Ok(0))
            })
            .count()
    };
    let mut seen = closed();
    while seen < 100 - 16 && started.elapsed() < Duration::from_millis(1500) {
        std::thread::sleep(Duration::from_millis(10));
        seen = closed();
    }
    assert!(
        seen >= 100 - 16,
        "only {seen} of 100 idle connections were closed within {:?}",
        started.elapsed()
    );
}

/// A READ posted while the data connection to its peer is still being opened (a prefill leg
/// that just restarted) waits for it, bounded: it completes once the connection is up, and
/// fails naming the peer and the bound when none comes.
#[test]
fn a_read_waits_for_a_data_connection_being_opened_bounded() {
    let peer = Peer::spawn("connect-wait");
    let decode = connect(&peer);
    let (grant, _) = decode.grant(vec![1, 2], 10_000);
    // Never connected: refused after the bound, naming it.
    let (lonely, _) = decode.unconnected_net_engine(Duration::from_millis(100));
    let started = std::time::Instant::now();
    assert_eq!(
        read_blocks(&lonely, grant, 1, 1, 2).unwrap_err(),
        EngineError::Refused("no data connection to prefill-0 within 100 ms".into())
    );
    assert!(started.elapsed() >= Duration::from_millis(100));
    // Connected while the READ waits: the READ completes with the right bytes.
    let (engine, destination) = decode.unconnected_net_engine(Duration::from_secs(10));
    let op = ReadOp {
        grant,
        local_region: 0,
        remote_engine: EngineKey("prefill-0".into()),
        remote_region: 1,
        runs: vec![ReadRun {
            local_offset: BLOCK_BYTES,
            remote_offset: BLOCK_BYTES,
            len_bytes: 2 * BLOCK_BYTES,
        }],
    };
    let handle = engine.batch_read(vec![op]).unwrap();
    decode.connect_data(&engine);
    assert_eq!(handle.wait_blocking(TIMEOUT).unwrap().bytes, 2 * BLOCK_BYTES);
    assert_holds_pattern(&destination, 1, 1, 2);
}
