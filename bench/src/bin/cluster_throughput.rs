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

use std::sync::Arc;
use std::time::{Duration, Instant};

use pdkv_actors::cluster::LocalCluster;
use pdkv_actors::config::ClusterConfig;
use pdkv_actors::engine::{Model, argmax, prompt_tokens};
use pdkv_actors::memory::LegMemory;
use pdkv_actors::router::Generate;

const CONFIG: &str = r#"
[model]
seed = 1
d_model = 8
vocab = 64
layer_groups = [0, 1]
[[model.groups]]
kind = "full"
block_size = 16
[[model.groups]]
kind = "sliding_window"
block_size = 16
window = 32
[[nodes]]
name = "prefill-0"
role = "prefill"
blocks_per_group = 1024
[[nodes]]
name = "decode-0"
role = "decode"
lookahead_tokens = 2
blocks_per_group = 1024
"#;

const PROMPT_TOKENS: usize = 32;

/// An actor that answers at once: the cross-arbiter baseline.
struct Echo;

impl actix::Actor for Echo {
    type Context = actix::Context<Self>;
}

#[derive(actix::Message)]
#[rtype(result = "u64")]
struct Ping(u64);

impl actix::Handler<Ping> for Echo {
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

/// The engine's work for one P/D request, without actors: prefill 32 tokens, decode 2.
fn engine_only(model: &Model, memory: &LegMemory, prompt: &[u32]) -> Duration {
    let lists = vec![vec![1, 2, 3], vec![1, 2, 3]];
    let started = Instant::now();
    for (position, &token) in prompt.iter().enumerate() {
        model.step(memory, &lists, position as u64, token, true).unwrap();
    }
    let mut token = prompt[prompt.len() - 1];
    for position in prompt.len() as u64 - 1..prompt.len() as u64 - 1 + u64::from(MAX_TOKENS) {
        token = argmax(&model.step(memory, &lists, position, token, true).unwrap());
    }
    started.elapsed()
}

fn main() {
    let requests: usize = std::env::args()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(2000);
    let config = ClusterConfig::from_toml(CONFIG).expect("bench config is valid");
    let system = actix::System::new();
    system.block_on(async move {
        let cluster = LocalCluster::start(config.clone()).await.expect("cluster starts");
        let prompts: Vec<Vec<u32>> = (0..requests)
            .map(|i| prompt_tokens(i as u64, PROMPT_TOKENS, config.model.vocab))
            .collect();
        // Warm up.
        for prompt in prompts.iter().take(50) {
            cluster.generate(prompt.clone(), MAX_TOKENS).await.unwrap();
        }
        let mut latencies = Vec::with_capacity(requests);
        let started = Instant::now();
        for prompt in &prompts {
            let sent = Instant::now();
            cluster.generate(prompt.clone(), MAX_TOKENS).await.unwrap();
            latencies.push(sent.elapsed());
        }
        let serial_elapsed = started.elapsed();
        latencies.sort();
        let in_flight = 16;
        let started = Instant::now();
        for chunk in prompts.chunks(in_flight) {
            let pending: Vec<_> = chunk
                .iter()
                .map(|prompt| {
                    cluster.router().send(Generate {
                        prompt: Arc::from(prompt.clone()),
                        max_tokens: MAX_TOKENS,
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

        let arbiter = actix::Arbiter::new();
        let echo = <Echo as actix::Actor>::start_in_arbiter(&arbiter.handle(), |_| Echo);
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

        let memory = LegMemory::heap(&model, &[4, 4]);
        let mut engine: Vec<Duration> = prompts
            .iter()
            .map(|prompt| engine_only(&model, &memory, prompt))
            .collect();
        engine.sort();
        let (p50, p99) = (percentile(&latencies, 0.5), percentile(&latencies, 0.99));
        let engine_p50 = percentile(&engine, 0.5);
        println!(
            "in-process cluster, {requests} requests of {PROMPT_TOKENS} prompt tokens, {MAX_TOKENS} generated"
        );
        println!(
            "  serial:      {:>9.0} req/s  p50 {:>7.1} us  p99 {:>7.1} us",
            requests as f64 / serial_elapsed.as_secs_f64(),
            micros(p50),
            micros(p99)
        );
        println!(
            "  {in_flight} in flight: {:>9.0} req/s",
            requests as f64 / concurrent_elapsed.as_secs_f64()
        );
        println!("  engine alone: p50 {:>7.1} us per request", micros(engine_p50));
        let overhead = p50.saturating_sub(engine_p50);
        println!(
            "  runtime overhead p50: {:>7.1} us per request (p50 serial latency - p50 engine)",
            micros(overhead)
        );
        println!(
            "  baseline: cross-arbiter send().await round trip p50 {:>6.1} us back to back, {:>6.1} us to an idle thread; overhead = {:.1} idle round trips",
            micros(ping_p50),
            micros(idle_ping_p50),
            overhead.as_secs_f64() / idle_ping_p50.as_secs_f64()
        );
    });
}
