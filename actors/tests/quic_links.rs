//! Bad wire input on a QUIC link: an authenticated peer that sends garbage, forges an
//! incarnation, impersonates another node, asks for what its role may not, or names requests
//! and grants that do not exist gets a clear refusal; the node keeps serving and leaks nothing.
//! A link delivers what it is given, in order, past its stream's flow-control credit.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use pdkv_actors::cluster::LocalCluster;
use pdkv_actors::config::{ClusterConfig, ControlThread, LegThreads, LinkKind};
use pdkv_actors::link::{Link, QuicLink};
use pdkv_actors::sweep;
use pdkv_core::wire::{Body, Envelope, GrantId, Incarnation, NodeId, RequestId, Role};
use pdkv_transport::codec::PROTOCOL_VERSION;
use pdkv_transport::control::{
    ControlClient, ControlError, ControlLimits, ControlServer, ControlService, Hello, PeerConnection,
    ServerSetup, TransportRuntime,
};
use pdkv_transport::tls::ClusterCa;

const TIMEOUT: Duration = Duration::from_secs(5);

async fn quic_cluster() -> LocalCluster {
    let mut config = ClusterConfig::embedded_default();
    config.transport.links = LinkKind::Quic;
    LocalCluster::start(config).await.unwrap()
}

/// Dials `to` as node `name` with a certificate from the cluster's CA, saying the hello of
/// incarnation `incarnation`.
async fn dial_as(
    cluster: &LocalCluster,
    name: &str,
    role: Role,
    incarnation: Incarnation,
    to: &str,
) -> (ControlClient, PeerConnection) {
    let (identity, runtime) = cluster.quic_identity(name).unwrap();
    let hello = Hello {
        node: NodeId(name.into()),
        role,
        incarnation,
        regions: cluster
            .leg(name)
            .map_or_else(pdkv_core::plan::RegionLayout::default, |leg| {
                leg.memory.regions.clone()
            }),
        protocol_version: PROTOCOL_VERSION,
        layout_hash: cluster.config().layout.compat_hash(),
        model: cluster.config().model_fields(),
        engines: vec![],
        host: pdkv_transport::host::host_id(),
    };
    let client = ControlClient::new(&runtime, SocketAddr::from(([127, 0, 0, 1], 0)), &identity).unwrap();
    let addr = cluster.control_addr(to).unwrap();
    let connection = client.connect(addr, to, &hello, TIMEOUT).await.unwrap();
    (client, connection)
}

fn envelope(from: &str, incarnation: Incarnation, request: u64, body: Body) -> Envelope {
    Envelope {
        request: RequestId(request),
        from: NodeId(from.into()),
        incarnation,
        budget_ms: 1000,
        body,
    }
}

async fn refusal(connection: &PeerConnection, envelope: Envelope) -> String {
    match connection.request::<_, ()>(envelope, TIMEOUT).await {
        Err(ControlError::Refused(reason)) => reason,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

async fn assert_serves_and_is_idle(cluster: &LocalCluster) {
    for length in [1, 129, 449] {
        let result = sweep::compare(cluster, length, 3).await;
        assert!(result.matched, "prompt length {length}: {result:?}");
    }
    let stats = cluster.wait_idle(Duration::from_secs(2)).await.unwrap();
    assert!(stats.iter().all(|leg| leg.is_idle()), "blocks leaked: {stats:?}");
}

#[actix_rt::test]
async fn forged_misrouted_and_unknown_messages_are_refused_by_name() {
    let cluster = quic_cluster().await;
    let decode = cluster.leg("decode-0").unwrap().incarnation;
    let prefill = cluster.leg("prefill-0").unwrap().incarnation;
    // decode-0 re-dials prefill-0 with its real incarnation: admitted, nothing changes.
    let (_client, to_prefill) = dial_as(&cluster, "decode-0", Role::Decode, decode, "prefill-0").await;
    assert_eq!(to_prefill.peer.incarnation, prefill);
    let release = |grant| Body::Release {
        grant: GrantId(grant),
        issuer: prefill,
    };

    let forged = Incarnation(decode.0 ^ 1);
    assert_eq!(
        refusal(&to_prefill, envelope("decode-0", forged, 7, release(1))).await,
        format!("decode-0 incarnation {forged} is not the incarnation {decode} that said hello")
    );
    assert_eq!(
        refusal(&to_prefill, envelope("router", decode, 7, Body::Abort)).await,
        "envelope claims to come from router, but arrived on the link of decode-0"
    );
    let prefill_request = Body::Prefill {
        prompt: vec![1, 2, 3],
        decode: NodeId("decode-0".into()),
    };
    assert_eq!(
        refusal(&to_prefill, envelope("decode-0", decode, 7, prefill_request)).await,
        "decode-0 may not send prefill: only a router may"
    );
    assert_eq!(
        refusal(&to_prefill, envelope("decode-0", decode, 7, release(999))).await,
        "prefill-0: grant 999 is not live: it was never issued"
    );
    let other_issuer = Body::Release {
        grant: GrantId(1),
        issuer: Incarnation(prefill.0 ^ 1),
    };
    assert_eq!(
        refusal(&to_prefill, envelope("decode-0", decode, 7, other_issuer)).await,
        format!(
            "prefill-0: the grant was issued by incarnation {}, this node is incarnation {prefill}",
            Incarnation(prefill.0 ^ 1)
        )
    );

    // The router asks the decode leg about what it may not send, or about requests it does
    // not run (dialled with the router's real incarnation, so the real router stays admitted).
    let router = cluster.router_incarnation();
    let (_router_client, to_decode) = dial_as(&cluster, "router", Role::Router, router, "decode-0").await;
    let renewed = Body::Renewed {
        grant: GrantId(1),
        lease_ms: 10,
    };
    assert_eq!(
        refusal(&to_decode, envelope("router", router, 424_242, renewed)).await,
        "router may not send renewed: only a prefill may"
    );
    let output = Body::Output(pdkv_core::wire::DecodeOutput {
        tokens: vec![],
        logits_digest: 0,
        read_bytes: 0,
        read_runs: 0,
        cached_blocks: 0,
        finish: pdkv_core::sampling::Finish::Length,
        logprobs: Vec::new(),
    });
    assert_eq!(
        refusal(&to_decode, envelope("router", router, 424_242, output)).await,
        "decode-0 (a decode leg) does not accept output"
    );
    // An abort of a request that is not running is accepted and changes nothing.
    to_decode
        .request::<_, ()>(envelope("router", router, 424_242, Body::Abort), TIMEOUT)
        .await
        .unwrap();
    // A request reordered past its own abort is refused, not started.
    let (_router_to_prefill, router_to_prefill) =
        dial_as(&cluster, "router", Role::Router, router, "prefill-0").await;
    router_to_prefill
        .request::<_, ()>(envelope("router", router, 515_151, Body::Abort), TIMEOUT)
        .await
        .unwrap();
    let late = Body::Prefill {
        prompt: vec![1, 2, 3],
        decode: NodeId("decode-0".into()),
    };
    assert_eq!(
        refusal(&router_to_prefill, envelope("router", router, 515_151, late)).await,
        "prefill-0: req-515151 was aborted"
    );

    // A request that started here is not started again: a duplicated (or late) copy is refused
    // by name. The router's abort then ends the first copy's hand-off.
    let prefill = || Body::Prefill {
        prompt: vec![4, 5, 6, 7],
        decode: NodeId("decode-0".into()),
    };
    router_to_prefill
        .request::<_, ()>(envelope("router", router, 616_161, prefill()), TIMEOUT)
        .await
        .unwrap();
    assert_eq!(
        refusal(&router_to_prefill, envelope("router", router, 616_161, prefill())).await,
        "prefill-0: req-616161 already started here (a duplicated or late message)"
    );
    router_to_prefill
        .request::<_, ()>(envelope("router", router, 616_161, Body::Abort), TIMEOUT)
        .await
        .unwrap();

    assert_serves_and_is_idle(&cluster).await;
    cluster.shutdown();
}

#[actix_rt::test]
async fn garbage_closes_only_the_sending_connection() {
    let cluster = quic_cluster().await;
    let decode = cluster.leg("decode-0").unwrap().incarnation;
    let (_client, connection) = dial_as(&cluster, "decode-0", Role::Decode, decode, "prefill-0").await;
    let garbage: Vec<u8> = (0..=255u8).cycle().take(4096).collect();
    assert!(connection.send_raw(&garbage, TIMEOUT).await.is_err());
    assert!(
        !connection.is_open(),
        "the connection that sent garbage is closed"
    );
    // The cluster's own links are untouched.
    assert_serves_and_is_idle(&cluster).await;
    cluster.shutdown();
}

#[actix_rt::test]
async fn a_decode_request_whose_params_name_another_request_fails_cleanly() {
    let cluster = quic_cluster().await;
    let params = cluster
        .router()
        .send(pdkv_actors::router::PrefillOnly {
            prefill: NodeId("prefill-0".into()),
            decode: NodeId("decode-0".into()),
            prompt: pdkv_actors::engine::prompt_tokens(2, 100, 256),
        })
        .await
        .unwrap()
        .unwrap();
    let mut other = params.clone();
    other.request = RequestId(params.request.0 + 1_000);
    let router = cluster.router_incarnation();
    let (_client, to_decode) = dial_as(&cluster, "router", Role::Router, router, "decode-0").await;
    let mismatched = envelope(
        "router",
        router,
        params.request.0,
        Body::Decode {
            prompt: pdkv_actors::engine::prompt_tokens(2, 100, 256),
            params: other,
            max_tokens: 2,
            stream: false,
            sampling: pdkv_core::sampling::Sampling::default(),
        },
    );
    assert_eq!(
        refusal(&to_decode, mismatched).await,
        format!(
            "decode-0: bad message: kv params are for {}, the message for {}",
            RequestId(params.request.0 + 1_000),
            params.request
        )
    );
    // Sampling the leg cannot honour is refused by name before anything is allocated.
    let hot = envelope(
        "router",
        router,
        params.request.0,
        Body::Decode {
            prompt: pdkv_actors::engine::prompt_tokens(2, 100, 256),
            params: params.clone(),
            max_tokens: 2,
            stream: false,
            sampling: pdkv_core::sampling::Sampling {
                temperature: -1.0,
                ..pdkv_core::sampling::Sampling::default()
            },
        },
    );
    assert_eq!(
        refusal(&to_decode, hot).await,
        "decode-0: bad message: sampling: temperature must be a finite number of at least 0, not -1"
    );
    // Nothing was allocated, read or released: the prefill-only grant is still held.
    let stats = cluster.stats().await.unwrap();
    let leg = |name: &str| stats.iter().find(|leg| leg.node.0 == name).unwrap().clone();
    assert!(leg("decode-0").is_idle(), "{:?}", leg("decode-0"));
    assert_eq!(leg("prefill-0").load.grants, 1);
    cluster.shutdown();
}

/// Takes a link's envelopes and passes on their request ids, in the order they arrive.
struct Recorder(tokio::sync::mpsc::Sender<u64>);

impl ControlService for Recorder {
    type Request = Envelope;
    type Response = ();

    async fn handle(&self, _peer: &NodeId, envelope: Envelope) -> Result<(), String> {
        self.0
            .send(envelope.request.0)
            .await
            .map_err(|_| "the test stopped listening".to_string())
    }
}

fn plain_hello(name: &str) -> Hello {
    Hello {
        node: NodeId(name.into()),
        role: Role::Prefill,
        incarnation: Incarnation(1),
        regions: pdkv_core::plan::RegionLayout::default(),
        protocol_version: PROTOCOL_VERSION,
        layout_hash: 1,
        model: pdkv_core::identity::ModelFields::default(),
        engines: vec![],
        host: pdkv_transport::host::host_id(),
    }
}

/// A link writes a frame from the sender's own thread when the stream can take it, and queues it
/// when the stream is out of credit. Either way every envelope arrives, in send order: 600
/// envelopes of 16 KiB, sent without yielding, overrun the stream's 1.25 MB flow-control window,
/// so frames written at once and frames queued behind them interleave.
#[actix_rt::test]
async fn a_link_delivers_every_envelope_in_send_order_past_its_stream_credit() {
    const ENVELOPES: u64 = 600;
    let runtime = TransportRuntime::new(2).unwrap();
    let handle = runtime.handle();
    let ca = ClusterCa::generate("link-order").unwrap();
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let (arrived, mut arrivals) = tokio::sync::mpsc::channel(ENVELOPES as usize);
    let setup = ServerSetup {
        cluster: vec![NodeId("a".into()), NodeId("b".into())],
        hello: plain_hello("b"),
        service: Arc::new(Recorder(arrived)),
        tickets: None,
        limits: ControlLimits::default(),
    };
    let server = ControlServer::start(&handle, loopback, &ca.identity("b").unwrap(), setup).unwrap();
    let client = ControlClient::new(&handle, loopback, &ca.identity("a").unwrap()).unwrap();
    let connection = client
        .connect(server.local_addr().unwrap(), "b", &plain_hello("a"), TIMEOUT)
        .await
        .unwrap();
    let frames = connection.open_frames(TIMEOUT).await.unwrap();
    let link = QuicLink::new(NodeId("b".into()), frames, ENVELOPES as usize, TIMEOUT);
    for request in 0..ENVELOPES {
        let tokens = vec![request as u32; 4096];
        link.send(envelope("a", Incarnation(1), request, Body::Tokens { tokens }))
            .unwrap();
    }
    let mut order = Vec::new();
    while order.len() < ENVELOPES as usize {
        match tokio::time::timeout(TIMEOUT, arrivals.recv()).await {
            Ok(Some(request)) => order.push(request),
            other => panic!("{} of {ENVELOPES} envelopes arrived, then {other:?}", order.len()),
        }
    }
    assert_eq!(order, (0..ENVELOPES).collect::<Vec<_>>());
    server.close();
    client.close();
    runtime.shutdown_background();
}

/// QUIC on the transport runtime instead of the nodes' threads, with a thread per leg and with
/// one shared thread: the same answers, nothing held after.
#[actix_rt::test]
async fn quic_on_the_transport_runtime_serves_as_on_the_nodes_threads() {
    for leg_threads in [LegThreads::PerLeg, LegThreads::Shared] {
        for control_thread in [ControlThread::Node, ControlThread::Transport] {
            let mut config = ClusterConfig::embedded_default();
            config.transport.links = LinkKind::Quic;
            config.transport.leg_threads = leg_threads;
            config.transport.control_thread = control_thread;
            let cluster = LocalCluster::start(config).await.unwrap();
            assert_serves_and_is_idle(&cluster).await;
            cluster.shutdown();
        }
    }
}
