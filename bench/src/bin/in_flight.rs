//! Requests per second through the in-process cluster with requests in flight, counted two ways:
//! in batches (send 16, wait for all 16, repeat: the figure `cluster_throughput` has always
//! printed) and as a closed loop (16 requests outstanding at every moment: a new one is sent as
//! soon as any finishes). A batch drains to zero before the next starts, so its legs idle while
//! its last requests finish; the closed loop is what 16 concurrent clients see.
//!
//! Run: `cargo run --release -p pdkv-bench --bin in_flight [REQUESTS] [ROUNDS]`
//!
//! It uses only the cluster API that builds before the leg became one `core::node` object have
//! too, so `bench/compare-builds.sh OLD_REV` runs this same file against an old build,
//! alternating with this one in one session, and prints the ratios.

use std::sync::Arc;
use std::time::Instant;

use futures_util::stream::{FuturesUnordered, StreamExt};
use pdkv_actors::cluster::LocalCluster;
use pdkv_actors::config::{ClusterConfig, LegThreads, LinkKind};
use pdkv_actors::engine::prompt_tokens;
use pdkv_actors::router::Generate;

/// The model and legs of `cluster_throughput`: a tiny model, one full and one window layer.
const CONFIG: &str = include_str!("../../tiny-cluster.toml");

const PROMPT_TOKENS: usize = 32;
const MAX_TOKENS: u32 = 2;
const IN_FLIGHT: usize = 16;

fn generate(prompt: &[u32]) -> Generate {
    Generate {
        prompt: Arc::from(prompt.to_vec()),
        max_tokens: MAX_TOKENS,
        sampling: pdkv_core::sampling::Sampling::default(),
        stream: None,
        client: None,
    }
}

/// Requests per second in batches of [`IN_FLIGHT`], then with [`IN_FLIGHT`] always outstanding.
async fn measure(cluster: &LocalCluster, prompts: &[Vec<u32>]) -> (f64, f64) {
    let started = Instant::now();
    for chunk in prompts.chunks(IN_FLIGHT) {
        let pending: Vec<_> = chunk
            .iter()
            .map(|prompt| cluster.router().send(generate(prompt)))
            .collect();
        for request in pending {
            request.await.expect("router").expect("request");
        }
    }
    let batches = prompts.len() as f64 / started.elapsed().as_secs_f64();
    let started = Instant::now();
    let mut next = prompts.iter();
    let mut pending = FuturesUnordered::new();
    loop {
        while pending.len() < IN_FLIGHT {
            let Some(prompt) = next.next() else { break };
            pending.push(cluster.router().send(generate(prompt)));
        }
        match pending.next().await {
            Some(request) => {
                request.expect("router").expect("request");
            }
            None => break,
        }
    }
    let closed_loop = prompts.len() as f64 / started.elapsed().as_secs_f64();
    (batches, closed_loop)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let requests: usize = args.next().and_then(|n| n.parse().ok()).unwrap_or(3000);
    let rounds: usize = args.next().and_then(|n| n.parse().ok()).unwrap_or(3);
    let system = actix::System::new();
    system.block_on(async move {
        let prompts: Vec<Vec<u32>> = (0..requests as u64)
            .map(|i| prompt_tokens(i, PROMPT_TOKENS, 64))
            .collect();
        for (name, threads) in [
            ("a thread per leg", LegThreads::PerLeg),
            ("one shared thread", LegThreads::Shared),
        ] {
            let mut config = ClusterConfig::from_toml(CONFIG).expect("bench config is valid");
            config.transport.links = LinkKind::Local;
            config.transport.leg_threads = threads;
            let cluster = LocalCluster::start(config).await.expect("cluster starts");
            for prompt in prompts.iter().take(100) {
                cluster
                    .generate(prompt.clone(), MAX_TOKENS)
                    .await
                    .expect("warm-up");
            }
            for round in 0..rounds {
                let (batches, closed_loop) = measure(&cluster, &prompts).await;
                // One line per figure, for scripts: `in_flight <threads> <how> <req/s>`.
                println!("in_flight {name:?} batches round {round}: {batches:.0} req/s");
                println!("in_flight {name:?} closed_loop round {round}: {closed_loop:.0} req/s");
            }
            cluster.shutdown();
        }
    });
}
