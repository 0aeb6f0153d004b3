//! Requests per second and latency through the in-process cluster, with the reference engine's
//! own compute measured apart so the runtime's overhead shows.
//!
//! Run: `cargo run --release -p pdkv-bench --bin cluster_throughput [REQUESTS]`
//!
//! A tiny model (d_model 8, one full and one window layer, B=16, W=32) and 32-token prompts keep
//! the engine's share small. The same requests are then computed by the engine alone (prefill
//! leg: 32 steps; decode leg: 2 steps; no actors, no READ), and the overhead is the difference
//! of the medians. As a baseline from the same run, a bare actix `send().await` round trip to an
//! actor on another arbiter shows what one cross-thread hop costs on this machine, back to back
//! and to a thread that has been idle (parked) for 300 µs; a P/D request makes two such round
//! trips (router to prefill leg and back, router to decode leg and back), each to an idle thread.
//!
//! Last, the same requests through a multi-process cluster (`pdkv launch`: every leg and the
//! router a process, QUIC between them, the client on the router's HTTP API), if the `pdkv`
//! binary sits beside this one (`cargo build --release` first). Its baselines: an HTTP round
//! trip to the router's `/live` on the same keep-alive connection, and the bare QUIC round trip.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdkv_actors::cluster::LocalCluster;
use pdkv_actors::config::{ClusterConfig, ControlThread, LegThreads, LinkKind};
use pdkv_actors::engine::{Model, argmax, prompt_tokens};
use pdkv_actors::memory::LegMemory;
use pdkv_actors::router::Generate;
use pdkv_core::plan::RegionLayout;
use pdkv_core::wire::{Incarnation, NodeId, Role};
use pdkv_transport::codec::PROTOCOL_VERSION;
use pdkv_transport::control::{
    ControlClient, ControlLimits, ControlServer, ControlService, Hello, ServerSetup, TransportRuntime,
};
use pdkv_transport::tls::ClusterCa;

/// The cluster: a tiny model (one full and one window layer), one prefill and one decode leg.
const CONFIG: &str = include_str!("../../tiny-cluster.toml");

const PROMPT_TOKENS: usize = 32;

/// An actor that answers at once: the cross-arbiter baseline.
struct EchoActor;

impl actix::Actor for EchoActor {
    type Context = actix::Context<Self>;
}

#[derive(actix::Message)]
#[rtype(result = "u64")]
struct Ping(u64);

impl actix::Handler<Ping> for EchoActor {
    type Result = u64;

    fn handle(&mut self, msg: Ping, _ctx: &mut Self::Context) -> u64 {
        msg.0
    }
}
const MAX_TOKENS: u32 = 2;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn micros(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e6
}

/// The engine's work for one P/D request, without actors: prefill 32 tokens, then decode 2.
fn engine_only(model: &Model, memory: &LegMemory, prompt: &[u32]) -> (Duration, Duration) {
    let lists = vec![vec![1, 2, 3], vec![1, 2, 3]];
    let started = Instant::now();
    for (position, &token) in prompt.iter().enumerate() {
        model.step(memory, &lists, position as u64, token, true).unwrap();
    }
    let prefilled = Instant::now();
    let mut token = prompt[prompt.len() - 1];
    for position in prompt.len() as u64 - 1..prompt.len() as u64 - 1 + u64::from(MAX_TOKENS) {
        token = argmax(&model.step(memory, &lists, position, token, true).unwrap());
    }
    (prefilled - started, prefilled.elapsed())
}

/// What one cluster run measured.
struct Figures {
    serial_rps: f64,
    concurrent_rps: f64,
    p50: Duration,
    p99: Duration,
    prefill_stage: Duration,
    decode_stage: Duration,
}

/// Rounds of the QUIC comparison. Each runs both QUIC clusters and then the bare round trip, so
/// a slow moment of this shared machine skews one round, not one side of every ratio.
const QUIC_ROUNDS: usize = 5;

/// One round of the QUIC comparison.
struct QuicRound {
    per_leg: Figures,
    shared: Figures,
    /// The same two clusters with QUIC on the transport runtime (`control_thread = "transport"`).
    per_leg_transport: Figures,
    shared_transport: Figures,
    rtt: Duration,
}

/// `requests` P/D requests one after another, then 16 at a time, on `links`.
async fn run_cluster(
    config: &ClusterConfig,
    links: LinkKind,
    leg_threads: LegThreads,
    control_thread: ControlThread,
    prompts: &[Vec<u32>],
) -> (Figures, Arc<Model>) {
    let mut config = config.clone();
    config.transport.links = links;
    config.transport.leg_threads = leg_threads;
    config.transport.control_thread = control_thread;
    let cluster = LocalCluster::start(config).await.expect("cluster starts");
    // Warm up.
    for prompt in prompts.iter().take(50) {
        cluster.generate(prompt.clone(), MAX_TOKENS).await.unwrap();
    }
    let mut latencies = Vec::with_capacity(prompts.len());
    let (mut prefill_stages, mut decode_stages) = (Vec::new(), Vec::new());
    let started = Instant::now();
    for prompt in prompts {
        let sent = Instant::now();
        let output = cluster.generate(prompt.clone(), MAX_TOKENS).await.unwrap();
        latencies.push(sent.elapsed());
        prefill_stages.push(output.prefill_stage);
        decode_stages.push(output.decode_stage);
    }
    let serial_elapsed = started.elapsed();
    latencies.sort();
    prefill_stages.sort();
    decode_stages.sort();
    let in_flight = 16;
    let started = Instant::now();
    for chunk in prompts.chunks(in_flight) {
        let pending: Vec<_> = chunk
            .iter()
            .map(|prompt| {
                cluster.router().send(Generate {
                    prompt: Arc::from(prompt.clone()),
                    max_tokens: MAX_TOKENS,
                    sampling: pdkv_core::sampling::Sampling::default(),
                    stream: None,
                    client: None,
                })
            })
            .collect();
        for request in pending {
            request.await.unwrap().unwrap();
        }
    }
    let concurrent_elapsed = started.elapsed();
    let stats = cluster.wait_idle(Duration::from_secs(2)).await.unwrap();
    assert!(stats.iter().all(|leg| leg.is_idle()), "leak: {stats:?}");
    let model = cluster.model().clone();
    cluster.shutdown();
    let requests = prompts.len() as f64;
    let figures = Figures {
        serial_rps: requests / serial_elapsed.as_secs_f64(),
        concurrent_rps: requests / concurrent_elapsed.as_secs_f64(),
        p50: percentile(&latencies, 0.5),
        p99: percentile(&latencies, 0.99),
        prefill_stage: percentile(&prefill_stages, 0.5),
        decode_stage: percentile(&decode_stages, 0.5),
    };
    (figures, model)
}

/// Answers every request at once: the bare QUIC round trip baseline.
struct Echo;

impl ControlService for Echo {
    type Request = u64;
    type Response = u64;

    async fn handle(&self, _peer: &NodeId, request: u64) -> Result<u64, String> {
        Ok(request)
    }
}

fn echo_hello(node: &str) -> Hello {
    Hello {
        node: NodeId(node.into()),
        role: Role::Decode,
        incarnation: Incarnation(1),
        regions: RegionLayout::default(),
        protocol_version: PROTOCOL_VERSION,
        layout_hash: 1,
        model: pdkv_core::identity::ModelFields::default(),
        engines: vec![],
        host: pdkv_transport::host::host_id(),
    }
}

/// p50 of a bare quinn request/response round trip (one stream per request, as the links use)
/// between two endpoints with mutual TLS on loopback.
async fn quic_round_trip(samples: usize) -> Duration {
    let runtime = TransportRuntime::new(2).expect("runtime");
    let handle = runtime.handle();
    let ca = ClusterCa::generate("bench").expect("ca");
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let names = vec![NodeId("a".into()), NodeId("b".into())];
    let setup = ServerSetup {
        cluster: names,
        hello: echo_hello("b"),
        service: Arc::new(Echo),
        tickets: None,
        limits: ControlLimits::default(),
    };
    let server = ControlServer::start(&handle, loopback, &ca.identity("b").unwrap(), setup).unwrap();
    let client = ControlClient::new(&handle, loopback, &ca.identity("a").unwrap()).unwrap();
    let connection = client
        .connect(
            server.local_addr().unwrap(),
            "b",
            &echo_hello("a"),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    let mut trips = Vec::with_capacity(samples);
    for i in 0..samples as u64 + 50 {
        let sent = Instant::now();
        let echoed: u64 = connection.request(i, Duration::from_secs(5)).await.unwrap();
        assert_eq!(echoed, i);
        if i >= 50 {
            trips.push(sent.elapsed());
        }
    }
    server.close();
    client.close();
    runtime.shutdown_background();
    trips.sort();
    percentile(&trips, 0.5)
}

fn print_figures(
    name: &str,
    figures: &Figures,
    engine: &[Duration],
    engine_prefill: &[Duration],
    engine_decode: &[Duration],
) -> Duration {
    let engine_p50 = percentile(engine, 0.5);
    let overhead = figures.p50.saturating_sub(engine_p50);
    println!(
        "  {name}: serial {:>6.0} req/s, p50 {:>7.1} us, p99 {:>7.1} us; 16 in flight {:>6.0} req/s",
        figures.serial_rps,
        micros(figures.p50),
        micros(figures.p99),
        figures.concurrent_rps
    );
    println!(
        "    runtime overhead p50 {:>7.1} us per request (p50 latency - p50 engine {:.1} us)",
        micros(overhead),
        micros(engine_p50)
    );
    for (stage, at_router, computing) in [
        ("prefill", figures.prefill_stage, percentile(engine_prefill, 0.5)),
        ("decode ", figures.decode_stage, percentile(engine_decode, 0.5)),
    ] {
        println!(
            "    {stage} stage p50 {:>7.1} us at the router, engine {:>6.1} us, overhead {:>6.1} us",
            micros(at_router),
            micros(computing),
            micros(at_router.saturating_sub(computing))
        );
    }
    overhead
}

fn main() {
    let requests: usize = std::env::args()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(2000);
    let config = ClusterConfig::from_toml(CONFIG).expect("bench config is valid");
    let system = actix::System::new();
    system.block_on(async move {
        let prompts: Vec<Vec<u32>> = (0..requests)
            .map(|i| prompt_tokens(i as u64, PROMPT_TOKENS, config.model.vocab))
            .collect();
        let node = ControlThread::Node;
        let (local, model) = run_cluster(&config, LinkKind::Local, LegThreads::PerLeg, node, &prompts).await;
        let (shared, _) = run_cluster(&config, LinkKind::Local, LegThreads::Shared, node, &prompts).await;
        let mut rounds = Vec::with_capacity(QUIC_ROUNDS);
        for _ in 0..QUIC_ROUNDS {
            let quic = |threads, control| run_cluster(&config, LinkKind::Quic, threads, control, &prompts);
            let (per_leg, _) = quic(LegThreads::PerLeg, node).await;
            let (shared, _) = quic(LegThreads::Shared, node).await;
            let (per_leg_transport, _) = quic(LegThreads::PerLeg, ControlThread::Transport).await;
            let (shared_transport, _) = quic(LegThreads::Shared, ControlThread::Transport).await;
            let rtt = quic_round_trip(requests.min(2000)).await;
            rounds.push(QuicRound {
                per_leg,
                shared,
                per_leg_transport,
                shared_transport,
                rtt,
            });
        }

        let arbiter = actix::Arbiter::new();
        let echo = <EchoActor as actix::Actor>::start_in_arbiter(&arbiter.handle(), |_| EchoActor);
        let mut pings = Vec::with_capacity(requests);
        let mut idle_pings = Vec::with_capacity(requests / 4);
        for i in 0..requests as u64 {
            let sent = Instant::now();
            echo.send(Ping(i)).await.unwrap();
            pings.push(sent.elapsed());
        }
        // The same round trip after the echo thread has been idle long enough to park, as a
        // leg's thread is while the other leg computes.
        for i in 0..requests as u64 / 4 {
            std::thread::sleep(Duration::from_micros(300));
            let sent = Instant::now();
            echo.send(Ping(i)).await.unwrap();
            idle_pings.push(sent.elapsed());
        }
        arbiter.stop();
        pings.sort();
        idle_pings.sort();
        let ping_p50 = percentile(&pings, 0.5);
        let idle_ping_p50 = percentile(&idle_pings, 0.5);

        let memory = LegMemory::heap(&model, config.nodes[0].shards, &[4, 4]);
        let split: Vec<(Duration, Duration)> = prompts
            .iter()
            .map(|prompt| engine_only(&model, &memory, prompt))
            .collect();
        let mut engine: Vec<Duration> = split.iter().map(|(prefill, decode)| *prefill + *decode).collect();
        let mut engine_prefill: Vec<Duration> = split.iter().map(|(prefill, _)| *prefill).collect();
        let mut engine_decode: Vec<Duration> = split.iter().map(|(_, decode)| *decode).collect();
        engine.sort();
        engine_prefill.sort();
        engine_decode.sort();
        let engine_p50 = percentile(&engine, 0.5);
        println!(
            "in-process cluster, {requests} requests of {PROMPT_TOKENS} prompt tokens, {MAX_TOKENS} generated"
        );
        let local_overhead = print_figures(
            "local links, a thread per leg",
            &local,
            &engine,
            &engine_prefill,
            &engine_decode,
        );
        print_figures(
            "local links, one shared thread",
            &shared,
            &engine,
            &engine_prefill,
            &engine_decode,
        );
        // A request crosses four links on its critical path (router -> prefill -> router ->
        // decode -> router): two request/response round trips' worth of one-way messages.
        let overhead = |figures: &Figures| figures.p50.saturating_sub(engine_p50);
        let ratio =
            |figures: &Figures, rtt: Duration| overhead(figures).as_secs_f64() / (rtt * 2).as_secs_f64();
        rounds.sort_by(|a, b| ratio(&a.per_leg, a.rtt).total_cmp(&ratio(&b.per_leg, b.rtt)));
        let median = &rounds[rounds.len() / 2];
        print_figures(
            "QUIC links, a thread per leg (the median round)",
            &median.per_leg,
            &engine,
            &engine_prefill,
            &engine_decode,
        );
        print_figures(
            "QUIC links, one shared thread (the same round)",
            &median.shared,
            &engine,
            &engine_prefill,
            &engine_decode,
        );
        println!(
            "  baseline: cross-arbiter send().await round trip p50 {:>6.1} us back to back, {:>6.1} us to an idle thread; thread-per-leg overhead = {:.1} idle round trips",
            micros(ping_p50),
            micros(idle_ping_p50),
            local_overhead.as_secs_f64() / idle_ping_p50.as_secs_f64()
        );
        println!(
            "  QUIC overhead against the protocol's 2 bare quinn request/response round trips, {QUIC_ROUNDS} rounds (each: both clusters, then the bare round trip), sorted:"
        );
        for round in &rounds {
            println!(
                "    bare round trip p50 {:>6.1} us; overhead {:>6.1} us = {:.2}x with a thread per leg, {:>6.1} us = {:.2}x with one shared thread",
                micros(round.rtt),
                micros(overhead(&round.per_leg)),
                ratio(&round.per_leg, round.rtt),
                micros(overhead(&round.shared)),
                ratio(&round.shared, round.rtt),
            );
            println!(
                "      QUIC on the transport runtime: {:>6.1} us = {:.2}x with a thread per leg, {:>6.1} us = {:.2}x shared; 16 in flight {:.0} / {:.0} req/s (on the node's thread: {:.0} / {:.0})",
                micros(overhead(&round.per_leg_transport)),
                ratio(&round.per_leg_transport, round.rtt),
                micros(overhead(&round.shared_transport)),
                ratio(&round.shared_transport, round.rtt),
                round.per_leg_transport.concurrent_rps,
                round.shared_transport.concurrent_rps,
                round.per_leg.concurrent_rps,
                round.shared.concurrent_rps,
            );
        }
        let median_ratio = |pick: fn(&QuicRound) -> &Figures| {
            let mut ratios: Vec<f64> = rounds.iter().map(|round| ratio(pick(round), round.rtt)).collect();
            ratios.sort_by(f64::total_cmp);
            ratios[ratios.len() / 2]
        };
        println!(
            "  QUIC overhead, median round: {:.2}x with a thread per leg, {:.2}x with one shared thread (QUIC on the transport runtime: {:.2}x, {:.2}x)",
            ratio(&median.per_leg, median.rtt),
            median_ratio(|round| &round.shared),
            median_ratio(|round| &round.per_leg_transport),
            median_ratio(|round| &round.shared_transport),
        );
        let (quic, quic_rtt) = (&median.per_leg, median.rtt);
        // The launched cluster twice, alternating, as shipped and with QUIC and the router's
        // HTTP API on runtimes of their own (the placement before `control_thread`).
        let apart = format!("{CONFIG}[transport]\ncontrol_thread = \"transport\"\n[router]\nhttp_threads = 2\n");
        for round in 0..2 {
            println!("multi-process round {}:", round + 1);
            processes(CONFIG, "as shipped", &prompts, quic.p50, quic_rtt, engine_p50);
            processes(&apart, "QUIC and HTTP on threads of their own", &prompts, quic.p50, quic_rtt, engine_p50);
        }
    });
}

/// Serial requests through `pdkv launch` of the same cluster, over HTTP; prints the overhead
/// over the in-process QUIC cluster's p50 and against the round trips the path needs: the
/// latency itself, and the runtime's overhead (latency less the engine's own p50).
fn processes(
    config_text: &str,
    label: &str,
    prompts: &[Vec<u32>],
    in_process_quic_p50: Duration,
    quic_rtt: Duration,
    engine_p50: Duration,
) {
    let Some(pdkv) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join("pdkv")))
        .filter(|path| path.exists())
    else {
        println!("multi-process cluster: skipped (no pdkv binary beside this one: cargo build --release)");
        return;
    };
    let dir = std::env::temp_dir().join(format!("pdkv-bench-processes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("run dir");
    let config = dir.join("cluster.toml");
    std::fs::write(&config, config_text).expect("config");
    let mut launch = std::process::Command::new(pdkv)
        .args(["launch", "--config"])
        .arg(&config)
        .arg("--run-dir")
        .arg(dir.join("run"))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("pdkv launch");
    let mut router = None;
    for line in std::io::BufRead::lines(std::io::BufReader::new(launch.stdout.take().expect("stdout"))) {
        let line = line.expect("launch output");
        if let Some(rest) = line.strip_prefix("READY router=") {
            router = rest.split_whitespace().next().map(str::to_string);
            break;
        }
    }
    let router = router.expect("the cluster came up");
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .into();
    let complete = |prompt: &Vec<u32>| -> serde_json::Value {
        let body = serde_json::json!({"prompt": prompt, "max_tokens": MAX_TOKENS});
        agent
            .post(format!("{router}/v1/completions"))
            .send_json(&body)
            .expect("completion")
            .body_mut()
            .read_json()
            .expect("json")
    };
    for prompt in prompts.iter().take(50) {
        complete(prompt);
    }
    let mut latencies = Vec::with_capacity(prompts.len());
    let (mut prefill_ms, mut decode_ms) = (Vec::new(), Vec::new());
    for prompt in prompts {
        let sent = Instant::now();
        let answer = complete(prompt);
        latencies.push(sent.elapsed());
        prefill_ms.push(answer["pdkv"]["prefill_ms"].as_f64().unwrap_or(0.0));
        decode_ms.push(answer["pdkv"]["decode_ms"].as_f64().unwrap_or(0.0));
    }
    let mut http = Vec::with_capacity(prompts.len());
    for _ in prompts {
        let sent = Instant::now();
        agent.get(format!("{router}/live")).call().expect("live");
        http.push(sent.elapsed());
    }
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(launch.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    );
    let _ = launch.wait();
    let _ = std::fs::remove_dir_all(&dir);
    latencies.sort();
    http.sort();
    prefill_ms.sort_by(f64::total_cmp);
    decode_ms.sort_by(f64::total_cmp);
    let (p50, http_p50) = (percentile(&latencies, 0.5), percentile(&http, 0.5));
    let needed = http_p50 + quic_rtt * 2;
    println!(
        "multi-process cluster over HTTP, a process per leg and the router, {label}: p50 {:>6.1} us, p99 {:>6.1} us (router's stages p50: prefill {:.1} us, decode {:.1} us)",
        micros(p50),
        micros(percentile(&latencies, 0.99)),
        prefill_ms[prefill_ms.len() / 2] * 1e3,
        decode_ms[decode_ms.len() / 2] * 1e3,
    );
    println!(
        "  over the in-process QUIC cluster (a thread per leg): +{:.1} us p50; baseline HTTP round trip to /live p50 {:.1} us; the path's HTTP round trip + 2 QUIC round trips {:.1} us; p50 = {:.2}x that, overhead (p50 - engine {:.1} us) = {:.2}x",
        micros(p50) - micros(in_process_quic_p50),
        micros(http_p50),
        micros(needed),
        p50.as_secs_f64() / needed.as_secs_f64(),
        micros(engine_p50),
        p50.saturating_sub(engine_p50).as_secs_f64() / needed.as_secs_f64()
    );
}
