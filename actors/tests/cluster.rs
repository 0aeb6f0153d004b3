//! A whole P/D cluster of real actors in one process: P/D output must equal one-leg output, or
//! the request must fail with a clear error; and every leg's free-block count must come back to
//! its capacity.

use std::sync::Arc;
use std::time::Duration;

use pdkv_actors::cluster::LocalCluster;
use pdkv_actors::config::{ClusterConfig, DEFAULT_CLUSTER_TOML, LinkKind};
use pdkv_actors::engine::prompt_tokens;
use pdkv_actors::error::RequestError;
use pdkv_actors::router::{DecodeOnly, Generate, LegLoads, PrefillOnly};
use pdkv_actors::scheduler::{DirectAllocate, DirectFinish, Stats};
use pdkv_actors::sweep::{self, legacy_predicted_failure};
use pdkv_core::wire::{Failure, NodeId, RequestId, Stage};

/// Starts `config` on `links`.
async fn start(mut config: ClusterConfig, links: LinkKind) -> LocalCluster {
    config.transport.links = links;
    LocalCluster::start(config).await.unwrap()
}

/// The shipped cluster.toml with `(from, to)` replacements applied.
fn config(edits: &[(&str, &str)]) -> ClusterConfig {
    let mut text = DEFAULT_CLUSTER_TOML.to_string();
    for (from, to) in edits {
        assert!(text.contains(from), "cluster.toml has no {from:?}");
        text = text.replacen(from, to, 1);
    }
    ClusterConfig::from_toml(&text).unwrap()
}

/// Lengths around every block and window boundary of B=64, W=128, plus the seed's failures.
const BOUNDARY_LENGTHS: &[u64] = &[
    1, 2, 55, 56, 63, 64, 65, 119, 120, 127, 128, 129, 130, 183, 184, 191, 192, 193, 251, 256, 257, 377, 384,
    440, 447, 448, 449,
];

async fn assert_all_match(cluster: &LocalCluster, lengths: &[u64]) {
    for &length in lengths {
        let result = sweep::compare(cluster, length, 4).await;
        assert!(result.matched, "prompt length {length}: {result:?}");
    }
    assert_idle(cluster).await;
}

async fn assert_idle(cluster: &LocalCluster) {
    let stats = cluster.wait_idle(Duration::from_secs(2)).await.unwrap();
    assert!(stats.iter().all(|leg| leg.is_idle()), "blocks leaked: {stats:?}");
}

/// The request id a test uses to hold blocks outside any real request.
const HOG: RequestId = RequestId(1_000_000);

/// Takes every block of the shipped decode leg (64 per group) under [`HOG`], so requests wait.
async fn hold_every_decode_block(cluster: &LocalCluster) {
    let hog = DirectAllocate {
        request: HOG,
        prompt: Arc::from(vec![0u32; 64 * 64]),
        slots: 64 * 64,
    };
    let decode = cluster.leg("decode-0").unwrap();
    decode.scheduler.send(hog).await.unwrap().unwrap();
}

/// Gives back what [`hold_every_decode_block`] took.
async fn release_decode_blocks(cluster: &LocalCluster) {
    let decode = cluster.leg("decode-0").unwrap();
    decode
        .scheduler
        .send(DirectFinish { request: HOG })
        .await
        .unwrap()
        .unwrap();
}

async fn pd_equals_direct_for_every_tail_combination(links: LinkKind) {
    for (prefill, decode) in [(0, 0), (0, 9), (9, 0), (9, 9)] {
        let prefill_edit = format!("lookahead_tokens = {prefill}");
        let decode_edit = format!("lookahead_tokens = {decode}");
        let cluster = start(
            config(&[
                ("lookahead_tokens = 0", &prefill_edit),
                ("lookahead_tokens = 9", &decode_edit),
            ]),
            links,
        )
        .await;
        assert_all_match(&cluster, BOUNDARY_LENGTHS).await;
        cluster.shutdown();
    }
}

/// The same with every leg and the router on one thread.
async fn pd_equals_direct_with_every_leg_on_one_thread(links: LinkKind) {
    let mut config = config(&[("lookahead_tokens = 0", "lookahead_tokens = 3")]);
    config.transport.leg_threads = pdkv_actors::config::LegThreads::Shared;
    let cluster = start(config, links).await;
    assert_all_match(&cluster, BOUNDARY_LENGTHS).await;
    cluster.shutdown();
}

/// The same through the heap-memory engine (the default engine is shared memory).
async fn pd_equals_direct_through_the_local_engine_too(links: LinkKind) {
    let cluster = start(
        config(&[
            ("read_engine = \"shm\"", "read_engine = \"local\""),
            ("lookahead_tokens = 0", "lookahead_tokens = 5"),
        ]),
        links,
    )
    .await;
    assert_all_match(&cluster, BOUNDARY_LENGTHS).await;
    cluster.shutdown();
}

async fn pd_equals_direct_with_a_mamba_group_and_dcp(links: LinkKind) {
    let text = r#"
        [model]
        seed = 11
        d_model = 16
        vocab = 64
        layer_groups = [0, 1, 2, 0, 2, 1]
        [[model.groups]]
        kind = "full"
        block_size = 8
        dcp = 2
        [[model.groups]]
        kind = "sliding_window"
        block_size = 16
        window = 40
        [[model.groups]]
        kind = "mamba"
        [[nodes]]
        name = "p"
        role = "prefill"
        lookahead_tokens = 3
        blocks_per_group = 32
        [[nodes]]
        name = "d"
        role = "decode"
        lookahead_tokens = 7
        blocks_per_group = 32
        prefix_caching = true
    "#;
    let cluster = start(ClusterConfig::from_toml(text).unwrap(), links).await;
    let lengths: Vec<u64> = (1..=90).chain([127, 128, 129, 200, 255]).collect();
    assert_all_match(&cluster, &lengths).await;
    cluster.shutdown();
}

/// After a first request, a second prompt sharing its first 300 tokens hits 4 full blocks
/// (300 / 64) on the decode leg, and only the other positions are read: counted in bytes.
async fn decode_prefix_hit_reads_only_the_suffix(links: LinkKind) {
    let cluster = start(config(&[]), links).await;
    let first = prompt_tokens(5, 300, 256);
    let mut second = first.clone();
    second.extend(prompt_tokens(6, 100, 256));
    let output = cluster.generate(first, 4).await.unwrap();
    assert_eq!(output.cached_blocks, 0);
    let hit = cluster.generate(second.clone(), 4).await.unwrap();
    let direct = cluster.direct(second, 4, None).await.unwrap();
    assert_eq!(
        (hit.tokens.clone(), hit.logits_digest),
        (direct.tokens, direct.logits_digest)
    );
    assert_eq!(hit.cached_blocks, 4);
    // Two full-attention and two window layers; a block is 64 slots of K and V, 32 f32 each.
    let block_bytes = 64 * 2 * 32 * 4;
    let full_read = 7 - 4; // cdiv(400, 64) = 7 prompt blocks, 4 held already
    let window_read = 7 - (400 - 128) / 64; // positions 4..7
    assert_eq!(hit.read_bytes, (full_read + window_read) * 2 * block_bytes);
    assert_idle(&cluster).await;
    cluster.shutdown();
}

/// With legacy pairing, P/D differs from direct exactly where the seed predicts: prompts longer
/// than the window whose decode-side lookahead tail adds a block; everywhere else it matches.
async fn legacy_pairing_fails_exactly_on_predicted_lengths(links: LinkKind) {
    let cluster = start(
        config(&[("pairing = \"anchored\"", "pairing = \"legacy\"")]),
        links,
    )
    .await;
    let mut failures = Vec::new();
    let mut predicted = Vec::new();
    for length in 1..=460u64 {
        let result = sweep::compare(&cluster, length, 2).await;
        assert_eq!(
            result.error, None,
            "legacy runs complete; only their output is wrong"
        );
        if !result.matched {
            failures.push(length);
        }
        if legacy_predicted_failure(length, 64, 128, 9) {
            predicted.push(length);
        }
    }
    assert_eq!(failures, predicted);
    assert_eq!(failures.len(), 45);
    assert_idle(&cluster).await;
    cluster.shutdown();
}

const DECODE_BLOCKS: &str = "blocks_per_group = 64\nprefix_caching = true";

async fn a_leg_too_small_for_a_prompt_fails_clearly_and_leaks_nothing(links: LinkKind) {
    let cluster = start(
        config(&[(DECODE_BLOCKS, "blocks_per_group = 4\nprefix_caching = true")]),
        links,
    )
    .await;
    let error = cluster.generate(prompt_tokens(1, 300, 256), 4).await.unwrap_err();
    assert!(matches!(error, RequestError::PromptTooLong(_)), "{error}");
    assert_eq!(
        error.to_string(),
        "prompt of 300 tokens is longer than the cluster's limit of 247 tokens: node decode-0 holds 256 token slots (4 blocks of 64 tokens in group 0) and reserves 9 for lookahead"
    );
    // Refused at the router, before any leg allocated or granted anything.
    assert_idle(&cluster).await;
    assert!(sweep::compare(&cluster, 100, 4).await.matched);
    cluster.shutdown();
}

/// Six concurrent requests on a decode leg that fits two at a time: the rest wait for blocks
/// and all complete with the right output.
async fn requests_wait_for_blocks_and_all_complete(links: LinkKind) {
    let cluster = start(
        config(&[(DECODE_BLOCKS, "blocks_per_group = 12\nprefix_caching = true")]),
        links,
    )
    .await;
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt_tokens(100 + i, 250, 256)).collect();
    let pending: Vec<_> = prompts
        .iter()
        .map(|prompt| {
            cluster.router().send(Generate {
                prompt: prompt.clone().into(),
                max_tokens: 3,
                sampling: pdkv_core::sampling::Sampling::default(),
                stream: None,
                client: None,
            })
        })
        .collect();
    for (prompt, request) in prompts.iter().zip(pending) {
        let pd = request.await.unwrap().unwrap();
        let direct = cluster.direct(prompt.clone(), 3, None).await.unwrap();
        assert_eq!(
            (pd.tokens, pd.logits_digest),
            (direct.tokens, direct.logits_digest)
        );
    }
    assert_idle(&cluster).await;
    cluster.shutdown();
}

/// With two decode legs, the router sends new requests to the one with fewer in flight: while a
/// request waits for blocks on decode-0, the next three all go to decode-1 and complete (in turn
/// they would alternate, and the third would wait on decode-0 until `alloc_wait_ms`).
async fn the_router_prefers_the_least_loaded_leg(links: LinkKind) {
    let second_decode =
        "[[nodes]]\nname = \"decode-1\"\nrole = \"decode\"\nlookahead_tokens = 9\nblocks_per_group = 64\n";
    let mut text = DEFAULT_CLUSTER_TOML.replacen("alloc_wait_ms = 5000", "alloc_wait_ms = 2000", 1);
    text.push_str(second_decode);
    let cluster = start(ClusterConfig::from_toml(&text).unwrap(), links).await;
    hold_every_decode_block(&cluster).await;
    let waiting_prompt = prompt_tokens(40, 100, 256);
    let waiting = cluster.router().send(Generate {
        prompt: waiting_prompt.clone().into(),
        max_tokens: 2,
        sampling: pdkv_core::sampling::Sampling::default(),
        stream: None,
        client: None,
    });
    for seed in 41..44 {
        let prompt = prompt_tokens(seed, 100, 256);
        let pd = cluster.generate(prompt.clone(), 2).await.unwrap();
        let direct = cluster.direct(prompt, 2, None).await.unwrap();
        assert_eq!(
            (pd.tokens, pd.logits_digest),
            (direct.tokens, direct.logits_digest)
        );
    }
    release_decode_blocks(&cluster).await;
    let pd = waiting.await.unwrap().unwrap();
    let direct = cluster.direct(waiting_prompt, 2, None).await.unwrap();
    assert_eq!(
        (pd.tokens, pd.logits_digest),
        (direct.tokens, direct.logits_digest)
    );
    assert_idle(&cluster).await;
    cluster.shutdown();
}

/// The router reads the legs' load reports: a decode leg whose blocks are all held (by nothing
/// the router sent) says so, and the router sends every request to the other one. Counting only
/// its own requests in flight it would alternate, and every second request would wait on
/// decode-0 until `alloc_wait_ms` and fail.
async fn the_router_avoids_a_leg_that_reports_its_blocks_taken(links: LinkKind) {
    let second_decode =
        "[[nodes]]\nname = \"decode-1\"\nrole = \"decode\"\nlookahead_tokens = 9\nblocks_per_group = 64\n";
    let mut text = DEFAULT_CLUSTER_TOML.replacen("alloc_wait_ms = 5000", "alloc_wait_ms = 300", 1);
    text.push_str(second_decode);
    let cluster = start(ClusterConfig::from_toml(&text).unwrap(), links).await;
    hold_every_decode_block(&cluster).await;
    // Bounded wait for decode-0's next report (one every LOAD_REPORT_INTERVAL).
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let loads = cluster.router().send(LegLoads).await.unwrap();
        if loads
            .get(&NodeId("decode-0".into()))
            .is_some_and(|load| load.requests == 1 && load.free_share() == 0.0)
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no load report from decode-0: {loads:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for seed in 61..65 {
        let prompt = prompt_tokens(seed, 100, 256);
        let pd = cluster.generate(prompt.clone(), 2).await.unwrap();
        let direct = cluster.direct(prompt, 2, None).await.unwrap();
        assert_eq!(
            (pd.tokens, pd.logits_digest),
            (direct.tokens, direct.logits_digest)
        );
    }
    release_decode_blocks(&cluster).await;
    assert_idle(&cluster).await;
    cluster.shutdown();
}

/// A long prefill computes on the prefill leg's workers, not on the arbiter that serves the
/// leg's control messages: a short request sent while a 4 000-token prompt computes on the same
/// prefill leg gets its KV parameters long before the long prompt does. (Computed on the
/// arbiter, the long prompt would hold up the short one's allocation and grant, and every lease
/// renewal, until it finished: both prefill stages would then take about as long; measured so
/// when the pool is bypassed.)
async fn a_long_prefill_computes_off_the_arbiter(links: LinkKind) {
    let cluster = start(config(&[]), links).await;
    let long_prompt = prompt_tokens(51, 4_000, 256);
    let long = cluster.router().send(Generate {
        prompt: long_prompt.clone().into(),
        max_tokens: 1,
        sampling: pdkv_core::sampling::Sampling::default(),
        stream: None,
        client: None,
    });
    // Give the long prompt time to reach the prefill leg and start computing.
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_millis(20) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let short_prompt = prompt_tokens(52, 20, 256);
    let short_pd = cluster.generate(short_prompt.clone(), 2).await.unwrap();
    let long_pd = long.await.unwrap().unwrap();
    assert!(
        short_pd.prefill_stage * 4 < long_pd.prefill_stage,
        "the short prefill waited for the long one: {:?} vs {:?}",
        short_pd.prefill_stage,
        long_pd.prefill_stage
    );
    for (pd, prompt, max_tokens) in [(short_pd, short_prompt, 2), (long_pd, long_prompt, 1)] {
        let direct = cluster.direct(prompt, max_tokens, None).await.unwrap();
        assert_eq!(
            (pd.tokens, pd.logits_digest),
            (direct.tokens, direct.logits_digest)
        );
    }
    assert_idle(&cluster).await;
    cluster.shutdown();
}

/// A full wait queue refuses at once; a wait past `alloc_wait_ms` fails with the last refusal.
async fn waits_for_blocks_are_bounded_in_count_and_time(links: LinkKind) {
    let cluster = start(
        config(&[
            ("alloc_wait_ms = 5000", "alloc_wait_ms = 1000"),
            ("wait_queue = 64", "wait_queue = 1"),
        ]),
        links,
    )
    .await;
    hold_every_decode_block(&cluster).await;
    let pending: Vec<_> = (0..3)
        .map(|i| {
            cluster.router().send(Generate {
                prompt: prompt_tokens(i, 100, 256).into(),
                max_tokens: 2,
                sampling: pdkv_core::sampling::Sampling::default(),
                stream: None,
                client: None,
            })
        })
        .collect();
    let mut errors = Vec::new();
    for request in pending {
        errors.push(request.await.unwrap().unwrap_err());
    }
    let timeouts = errors
        .iter()
        .filter(|error| {
            matches!(
                error,
                RequestError::Failed {
                    stage: Stage::Decode,
                    failure: Failure::NoFreeBlocks { waited_ms: 1000, .. }
                }
            )
        })
        .count();
    let refused = errors
        .iter()
        .filter(|error| {
            matches!(
                error,
                RequestError::Failed {
                    stage: Stage::Decode,
                    failure: Failure::QueueFull { capacity: 1, .. }
                }
            )
        })
        .count();
    assert_eq!((timeouts, refused), (1, 2), "{errors:?}");
    assert!(
        errors
            .iter()
            .any(|error| error.to_string().starts_with("no free blocks within"))
    );
    release_decode_blocks(&cluster).await;
    assert_idle(&cluster).await;
    assert!(sweep::compare(&cluster, 100, 2).await.matched);
    cluster.shutdown();
}

/// A READ that stops half-way fails the request (fail closed), frees everything, and the next
/// request is served correctly.
async fn a_partial_read_fails_closed_and_leaks_nothing(links: LinkKind) {
    let cluster = start(config(&[]), links).await;
    cluster
        .leg("decode-0")
        .unwrap()
        .engine
        .fail_next_read_after(10_000);
    let error = cluster.generate(prompt_tokens(3, 400, 256), 4).await.unwrap_err();
    assert_eq!(error.to_string(), "read failed: injected fault after 10000 bytes");
    assert_idle(&cluster).await;
    assert!(sweep::compare(&cluster, 400, 4).await.matched);
    cluster.shutdown();
}

fn prefill_only() -> PrefillOnly {
    PrefillOnly {
        prefill: NodeId("prefill-0".into()),
        decode: NodeId("decode-0".into()),
        prompt: prompt_tokens(1, 300, 256),
    }
}

/// A grant nobody reads expires with its lease and its blocks come back.
async fn an_unread_grant_expires_and_frees_its_blocks(links: LinkKind) {
    let cluster = start(config(&[("lease_ms = 10000", "lease_ms = 30")]), links).await;
    let prefill = cluster.leg("prefill-0").unwrap();
    cluster.router().send(prefill_only()).await.unwrap().unwrap();
    let held = prefill.scheduler.send(Stats).await.unwrap();
    assert_eq!(held.load.grants, 1);
    assert!(!held.is_idle());
    assert_idle(&cluster).await;
    cluster.shutdown();
}

/// A decode leg that reads after the grant's lease lapsed (its blocks freed and reused) fails
/// with a stale-block error instead of decoding from someone else's KV.
async fn a_read_after_the_lease_lapsed_fails_closed(links: LinkKind) {
    let cluster = start(config(&[("lease_ms = 10000", "lease_ms = 30")]), links).await;
    let prefill = cluster.leg("prefill-0").unwrap();
    let params = cluster.router().send(prefill_only()).await.unwrap().unwrap();
    assert_eq!(params.prefill_incarnation, prefill.incarnation);
    assert_idle(&cluster).await;
    // Reuse the freed blocks for another prompt.
    assert!(sweep::compare(&cluster, 300, 2).await.matched);
    let error = cluster
        .router()
        .send(DecodeOnly {
            decode: NodeId("decode-0".into()),
            prompt: prefill_only().prompt,
            params,
            max_tokens: 4,
        })
        .await
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(
            error,
            RequestError::Failed {
                stage: Stage::Read,
                failure: Failure::StaleBlock { .. }
            }
        ),
        "{error}"
    );
    assert_idle(&cluster).await;
    cluster.shutdown();
}

/// A decode leg that waits for blocks several leases long renews the grant meanwhile, so the
/// prefill leg keeps the KV and the request still decodes correctly.
async fn a_decode_leg_waiting_longer_than_the_lease_keeps_its_grant(links: LinkKind) {
    // Long enough that a loaded CI machine cannot delay one renewal (every 100 ms) past it.
    let lease_ms = 300;
    let lease_edit = format!("lease_ms = {lease_ms}");
    let cluster = start(config(&[("lease_ms = 10000", &lease_edit)]), links).await;
    hold_every_decode_block(&cluster).await;
    let prompt = prompt_tokens(4, 300, 256);
    let pending = cluster.router().send(Generate {
        prompt: prompt.clone().into(),
        max_tokens: 3,
        sampling: pdkv_core::sampling::Sampling::default(),
        stream: None,
        client: None,
    });
    // The scenario is the passing of time: five leases while the decode leg waits for blocks.
    tokio::time::sleep(Duration::from_millis(5 * lease_ms)).await;
    let prefill = cluster
        .leg("prefill-0")
        .unwrap()
        .scheduler
        .send(Stats)
        .await
        .unwrap();
    assert_eq!(
        prefill.load.grants, 1,
        "the grant outlived five leases through renewals"
    );
    release_decode_blocks(&cluster).await;
    let pd = pending.await.unwrap().unwrap();
    let direct = cluster.direct(prompt, 3, None).await.unwrap();
    assert_eq!(
        (pd.tokens, pd.logits_digest),
        (direct.tokens, direct.logits_digest)
    );
    assert_idle(&cluster).await;
    cluster.shutdown();
}

/// Bytes a decode leg must read for an `n`-token prompt, from the definition (docs/ARCHITECTURE.md, "The
/// exchange"): per layer, one block per position holding a token it does not recompute
/// (`0 ..= n - 2`, `max(0, n - W) ..= n - 2` in a window group, or from the start of token
/// `n - 1`'s chunk in a chunked local group), minus prefix hits; one state per mamba layer.
/// Counted token by token, not through the exchange code.
fn expected_read_bytes(config: &ClusterConfig, n: u64, cached: &[u64]) -> u64 {
    use pdkv_core::layout::GroupKind;
    let d = config.model.d_model as u64;
    let mut total = 0;
    for &group in config.layout.layer_groups() {
        let spec = config.layout.groups()[group];
        let block_tokens = u64::from(spec.block_size()) * u64::from(spec.dcp());
        let (first, bytes_per_block) = match spec.kind() {
            GroupKind::Mamba => {
                total += d * 4;
                continue;
            }
            GroupKind::MambaAlign => unreachable!("cluster.toml refuses aligned mamba groups"),
            GroupKind::Full => (0, block_tokens * 2 * d * 4),
            GroupKind::SlidingWindow { window } => {
                (n.saturating_sub(u64::from(window)), block_tokens * 2 * d * 4)
            }
            GroupKind::ChunkedLocal { chunk } => {
                let last = n.saturating_sub(1);
                (last - last % u64::from(chunk), block_tokens * 2 * d * 4)
            }
        };
        let positions: std::collections::BTreeSet<u64> = (first..n.saturating_sub(1))
            .map(|token| token / block_tokens)
            .filter(|&position| position >= cached.get(group).copied().unwrap_or(0))
            .collect();
        total += positions.len() as u64 * bytes_per_block;
    }
    total
}

/// Runs every length P/D and direct, checks equality, the exact bytes read and no leak.
async fn assert_all_match_reading_exactly(cluster: &LocalCluster, lengths: impl IntoIterator<Item = u64>) {
    for length in lengths {
        let result = sweep::compare(cluster, length, 3).await;
        assert!(result.matched, "prompt length {length}: {result:?}");
        assert_eq!(
            result.read_bytes,
            expected_read_bytes(cluster.config(), length, &[]),
            "prompt length {length}"
        );
    }
    assert_idle(cluster).await;
}

const HYBRID_ALL_BUT_LAST: &str = r#"
    [model]
    seed = 5
    d_model = 8
    vocab = 64
    layer_groups = [0, 1, 2, 1]
    [[model.groups]]
    kind = "full"
    block_size = 16
    [[model.groups]]
    kind = "sliding_window"
    block_size = 8
    window = 20
    [[model.groups]]
    kind = "mamba"
    [[nodes]]
    name = "p"
    role = "prefill"
    lookahead_tokens = 0
    blocks_per_group = 48
    prefill_tokens = "all_but_last"
    [[nodes]]
    name = "d"
    role = "decode"
    lookahead_tokens = 9
    blocks_per_group = 48
"#;

/// A prefill leg that computes only the first N - 1 tokens (vLLM's hybrid prefill) pairs with
/// the decode leg at every length 1..=300 of a full + window + mamba layout: P/D equals direct,
/// the decode leg reads exactly the blocks holding tokens up to N - 2, nothing leaks.
async fn a_prefill_leg_stopping_at_n_minus_1_serves_a_hybrid_layout(links: LinkKind) {
    let config = ClusterConfig::from_toml(HYBRID_ALL_BUT_LAST).unwrap();
    let cluster = start(config, links).await;
    assert_all_match_reading_exactly(&cluster, 1..=300).await;
    cluster.shutdown();
}

/// The same with a DCP = 2 full group (blocks of 2 x 8 tokens) and a decode-side tail.
async fn a_prefill_leg_stopping_at_n_minus_1_serves_a_dcp_layout(links: LinkKind) {
    let text = r#"
        [model]
        seed = 9
        d_model = 8
        vocab = 64
        layer_groups = [0, 0]
        [[model.groups]]
        kind = "full"
        block_size = 8
        dcp = 2
        [[nodes]]
        name = "p"
        role = "prefill"
        lookahead_tokens = 3
        blocks_per_group = 48
        prefill_tokens = "all_but_last"
        [[nodes]]
        name = "d"
        role = "decode"
        lookahead_tokens = 5
        blocks_per_group = 48
    "#;
    let cluster = start(ClusterConfig::from_toml(text).unwrap(), links).await;
    assert_all_match_reading_exactly(&cluster, 1..=300).await;
    cluster.shutdown();
}

/// Llama 4's shape: chunked local attention layers (chunks of 20 tokens, not a whole number of
/// 8-token blocks) beside a full-attention layer, lookahead tails on both legs. P/D equals direct
/// at every length 1..=200, reading exactly the blocks of the last prompt token's chunk; then
/// generations of 45 tokens, whose attending token crosses chunk boundaries (the decode leg frees
/// the blocks of the chunks it left), still equal direct.
async fn a_chunked_local_attention_layout_serves_pd_equal_to_direct(links: LinkKind) {
    let text = r#"
        [model]
        seed = 11
        d_model = 8
        vocab = 64
        layer_groups = [1, 1, 1, 0]
        [[model.groups]]
        kind = "full"
        block_size = 8
        [[model.groups]]
        kind = "chunked_local"
        block_size = 8
        chunk = 20
        [[nodes]]
        name = "p"
        role = "prefill"
        lookahead_tokens = 5
        blocks_per_group = 64
        [[nodes]]
        name = "d"
        role = "decode"
        lookahead_tokens = 9
        blocks_per_group = 64
    "#;
    let cluster = start(ClusterConfig::from_toml(text).unwrap(), links).await;
    assert_all_match_reading_exactly(&cluster, 1..=200).await;
    for length in [1, 19, 20, 21, 40, 41, 77, 160] {
        let result = sweep::compare(&cluster, length, 45).await;
        assert!(result.matched, "prompt length {length}, 45 tokens: {result:?}");
    }
    assert_idle(&cluster).await;
    cluster.shutdown();
}

/// Whether the prefill leg computes every token or stops at N - 1, the default shipped layout
/// reads the same bytes and decodes the same output at its boundary lengths.
async fn both_prefill_token_settings_read_the_same_bytes(links: LinkKind) {
    for setting in ["all", "all_but_last"] {
        let edit = format!("lookahead_tokens = 0\nprefill_tokens = \"{setting}\"");
        let cluster = start(config(&[("lookahead_tokens = 0", &edit)]), links).await;
        assert_all_match_reading_exactly(&cluster, BOUNDARY_LENGTHS.iter().copied()).await;
        cluster.shutdown();
    }
}

/// A decode leg whose prefix cache holds every block it needs reads no attention bytes: with
/// N = 129 and B = 64 the needed tokens 0..=127 fill blocks 0 and 1, both cached by the first
/// request; only the mamba state is read.
async fn a_prefix_hit_covering_every_needed_block_reads_no_attention_bytes(links: LinkKind) {
    let text = r#"
        [model]
        seed = 3
        d_model = 8
        vocab = 64
        layer_groups = [0, 1, 0]
        [[model.groups]]
        kind = "full"
        block_size = 64
        [[model.groups]]
        kind = "mamba"
        [[nodes]]
        name = "p"
        role = "prefill"
        blocks_per_group = 16
        [[nodes]]
        name = "d"
        role = "decode"
        lookahead_tokens = 9
        blocks_per_group = 16
        prefix_caching = true
    "#;
    let config = ClusterConfig::from_toml(text).unwrap();
    let mamba_state_bytes = 8 * 4;
    let cluster = start(config.clone(), links).await;
    let prompt = prompt_tokens(21, 129, 64);
    let first = cluster.generate(prompt.clone(), 2).await.unwrap();
    assert_eq!(first.read_bytes, expected_read_bytes(&config, 129, &[]));
    let again = cluster.generate(prompt.clone(), 2).await.unwrap();
    assert_eq!(again.cached_blocks, 2);
    assert_eq!(again.read_bytes, mamba_state_bytes);
    assert_eq!(again.read_bytes, expected_read_bytes(&config, 129, &[2, 0]));
    let direct = cluster.direct(prompt, 2, None).await.unwrap();
    assert_eq!(
        (again.tokens, again.logits_digest),
        (direct.tokens, direct.logits_digest)
    );
    assert_idle(&cluster).await;
    cluster.shutdown();
}

/// `all_but_last` really stops at N - 1: a prefill leg with one 16-token block per group serves
/// a 17-token prompt that way, and refuses it when it must compute all 17 tokens.
async fn a_prefill_leg_stopping_at_n_minus_1_holds_one_block_fewer(links: LinkKind) {
    let one_block = HYBRID_ALL_BUT_LAST
        .replacen("window = 20", "window = 32", 1)
        .replacen("block_size = 8", "block_size = 16", 1)
        .replacen("blocks_per_group = 48", "blocks_per_group = 1", 1);
    let config = ClusterConfig::from_toml(&one_block).unwrap();
    let cluster = start(config.clone(), links).await;
    let prompt = prompt_tokens(1, 17, 64);
    let pd = cluster.generate(prompt.clone(), 2).await.unwrap();
    // The prefill leg cannot run the prompt alone, so the reference runs on the decode leg.
    let direct = cluster.direct(prompt, 2, Some(NodeId("d".into()))).await.unwrap();
    assert_eq!(
        (pd.tokens, pd.logits_digest),
        (direct.tokens, direct.logits_digest)
    );
    assert_eq!(pd.read_bytes, expected_read_bytes(&config, 17, &[]));
    assert_idle(&cluster).await;
    cluster.shutdown();
    let all = one_block.replacen("prefill_tokens = \"all_but_last\"", "prefill_tokens = \"all\"", 1);
    let cluster = start(ClusterConfig::from_toml(&all).unwrap(), links).await;
    let error = cluster.generate(prompt_tokens(1, 17, 64), 2).await.unwrap_err();
    assert_eq!(
        error.to_string(),
        "prompt of 17 tokens is longer than the cluster's limit of 16 tokens: node p holds 16 token slots (1 blocks of 16 tokens in group 0) and reserves 0 for lookahead"
    );
    assert_idle(&cluster).await;
    cluster.shutdown();
}

/// A request that times out in its prefill stage releases the grant at once: the prefill leg
/// grants nothing past the deadline, and a grant already on its way is released by the router.
/// The lease is a minute long, so only an explicit release frees the blocks within the wait.
async fn a_request_timing_out_in_prefill_leaves_no_grant_pinned(links: LinkKind) {
    let cluster = start(
        config(&[
            ("request_timeout_ms = 30000", "request_timeout_ms = 1"),
            ("lease_ms = 10000", "lease_ms = 60000"),
        ]),
        links,
    )
    .await;
    for length in [300, 1000] {
        let error = cluster
            .generate(prompt_tokens(8, length, 256), 2)
            .await
            .unwrap_err();
        // Within 1 ms the deadline may also pass before the router sends the request at all
        // (a loaded machine): then no leg ever saw it, and there is nothing to pin either.
        assert!(
            matches!(
                error,
                RequestError::Timeout {
                    stage: "prefill" | "router",
                    after_ms: 1
                }
            ),
            "{error:?}"
        );
    }
    assert_idle(&cluster).await;
    cluster.shutdown();
}

/// A decode leg still waiting for blocks when the deadline passes stops waiting, releases the
/// grant and fails with the stage named, instead of renewing the lease until `alloc_wait_ms`.
async fn a_request_timing_out_in_decode_releases_its_grant_by_the_deadline(links: LinkKind) {
    // A 20-token prefill takes milliseconds even on a loaded machine, far inside the 1 s budget.
    let cluster = start(
        config(&[
            ("request_timeout_ms = 30000", "request_timeout_ms = 1000"),
            ("lease_ms = 10000", "lease_ms = 60000"),
            ("alloc_wait_ms = 5000", "alloc_wait_ms = 60000"),
        ]),
        links,
    )
    .await;
    hold_every_decode_block(&cluster).await;
    let error = cluster.generate(prompt_tokens(9, 20, 256), 2).await.unwrap_err();
    assert_eq!(
        error,
        RequestError::Timeout {
            stage: "decode",
            after_ms: 1000
        }
    );
    // The decode leg gives up at the same deadline; only its grant release is left in flight.
    let prefill = cluster.leg("prefill-0").unwrap();
    let stats = cluster.wait_idle(Duration::from_secs(2)).await.unwrap();
    let prefill_stats = stats.iter().find(|leg| leg.node == prefill.node.name).unwrap();
    assert!(prefill_stats.is_idle(), "grant still pinned: {prefill_stats:?}");
    release_decode_blocks(&cluster).await;
    assert_idle(&cluster).await;
    assert!(sweep::compare(&cluster, 100, 2).await.matched);
    cluster.shutdown();
}

/// The largest time limits a cluster.toml may set (a day) serve on every path, P/D and one leg
/// alone: no deadline wraps around into the past.
async fn the_largest_time_limits_serve(links: LinkKind) {
    let most = pdkv_actors::config::MAX_TIME_LIMIT_MS.to_string();
    let cluster = start(
        config(&[
            (
                "request_timeout_ms = 30000",
                &format!("request_timeout_ms = {most}"),
            ),
            ("lease_ms = 10000", &format!("lease_ms = {most}")),
            ("alloc_wait_ms = 5000", &format!("alloc_wait_ms = {most}")),
        ]),
        links,
    )
    .await;
    assert_all_match(&cluster, &[1, 65, 129, 449]).await;
    cluster.shutdown();
}

/// Every scenario above, once on in-process links and once on QUIC links.
macro_rules! on_both_links {
    ($($name:ident),* $(,)?) => {
        mod local_links {
            $(
                #[actix_rt::test]
                async fn $name() {
                    super::$name(super::LinkKind::Local).await;
                }
            )*
        }
        mod quic_links {
            $(
                #[actix_rt::test]
                async fn $name() {
                    super::$name(super::LinkKind::Quic).await;
                }
            )*
        }
    };
}

on_both_links!(
    a_long_prefill_computes_off_the_arbiter,
    the_router_prefers_the_least_loaded_leg,
    the_router_avoids_a_leg_that_reports_its_blocks_taken,
    pd_equals_direct_with_every_leg_on_one_thread,
    pd_equals_direct_for_every_tail_combination,
    pd_equals_direct_through_the_local_engine_too,
    pd_equals_direct_with_a_mamba_group_and_dcp,
    decode_prefix_hit_reads_only_the_suffix,
    legacy_pairing_fails_exactly_on_predicted_lengths,
    a_leg_too_small_for_a_prompt_fails_clearly_and_leaks_nothing,
    requests_wait_for_blocks_and_all_complete,
    waits_for_blocks_are_bounded_in_count_and_time,
    a_partial_read_fails_closed_and_leaks_nothing,
    an_unread_grant_expires_and_frees_its_blocks,
    a_read_after_the_lease_lapsed_fails_closed,
    a_decode_leg_waiting_longer_than_the_lease_keeps_its_grant,
    a_prefill_leg_stopping_at_n_minus_1_serves_a_hybrid_layout,
    a_prefill_leg_stopping_at_n_minus_1_serves_a_dcp_layout,
    a_chunked_local_attention_layout_serves_pd_equal_to_direct,
    both_prefill_token_settings_read_the_same_bytes,
    a_prefix_hit_covering_every_needed_block_reads_no_attention_bytes,
    a_prefill_leg_stopping_at_n_minus_1_holds_one_block_fewer,
    a_request_timing_out_in_prefill_leaves_no_grant_pinned,
    a_request_timing_out_in_decode_releases_its_grant_by_the_deadline,
    the_largest_time_limits_serve,
);

/// Sampled requests: P/D equals direct for every setting, a seed repeats its tokens, a stop
/// sequence ends generation where it first appears, and log-probabilities come from the logits.
async fn sampled_requests_match_direct_and_stop_where_asked(links: LinkKind) {
    use pdkv_core::sampling::{Finish, Sampling};
    let cluster = start(ClusterConfig::embedded_default(), links).await;
    let params = cluster.config().model;
    let prompt = prompt_tokens(params.seed, 130, params.vocab);
    for (temperature, top_k, top_p, seed) in [(0.7, 0, 1.0, 1), (1.3, 40, 0.9, 2), (0.2, 5, 0.5, 3)] {
        let sampling = Sampling {
            temperature,
            top_k,
            top_p,
            seed,
            ..Sampling::default()
        };
        let pd = cluster
            .generate_sampled(prompt.clone(), 24, sampling.clone())
            .await
            .unwrap();
        let direct = cluster
            .direct_sampled(prompt.clone(), 24, sampling.clone(), None)
            .await
            .unwrap();
        assert_eq!(
            (&pd.tokens, pd.logits_digest),
            (&direct.tokens, direct.logits_digest),
            "{sampling:?}"
        );
        let again = cluster
            .generate_sampled(prompt.clone(), 24, sampling.clone())
            .await
            .unwrap();
        assert_eq!(again.tokens, pd.tokens, "the same seed, the same tokens");
    }
    let hot = |seed| Sampling {
        temperature: 1.5,
        seed,
        ..Sampling::default()
    };
    let first = cluster
        .generate_sampled(prompt.clone(), 24, hot(10))
        .await
        .unwrap();
    let second = cluster
        .generate_sampled(prompt.clone(), 24, hot(11))
        .await
        .unwrap();
    assert_ne!(first.tokens, second.tokens, "another seed draws other tokens");

    // A stop sequence taken from the greedy answer: generation ends where it first appears.
    let greedy = cluster.generate(prompt.clone(), 30).await.unwrap();
    let stop = greedy.tokens[5..7].to_vec();
    let end = (0..greedy.tokens.len())
        .find(|&i| greedy.tokens[..=i].ends_with(&stop))
        .unwrap();
    let stopped = Sampling {
        stop_sequences: vec![stop],
        ..Sampling::default()
    };
    let pd = cluster
        .generate_sampled(prompt.clone(), 30, stopped.clone())
        .await
        .unwrap();
    assert_eq!(pd.tokens, greedy.tokens[..=end].to_vec());
    assert_eq!(pd.finish, Finish::StopSequence(0));
    assert_eq!(greedy.finish, Finish::Length);
    let direct = cluster
        .direct_sampled(prompt.clone(), 30, stopped, None)
        .await
        .unwrap();
    assert_eq!((direct.tokens, direct.finish), (pd.tokens, pd.finish));
    let by_token = Sampling {
        stop_token_ids: vec![greedy.tokens[3]],
        ..Sampling::default()
    };
    let pd = cluster
        .generate_sampled(prompt.clone(), 30, by_token)
        .await
        .unwrap();
    let first_stop = greedy
        .tokens
        .iter()
        .position(|&token| token == greedy.tokens[3])
        .unwrap();
    assert_eq!(pd.tokens, greedy.tokens[..=first_stop].to_vec());
    assert_eq!(pd.finish, Finish::StopToken);

    // Greedy with logprobs: the chosen token is the most likely one.
    let with_logprobs = Sampling {
        logprobs: Some(3),
        ..Sampling::default()
    };
    let pd = cluster
        .generate_sampled(prompt.clone(), 6, with_logprobs.clone())
        .await
        .unwrap();
    let direct = cluster
        .direct_sampled(prompt.clone(), 6, with_logprobs, None)
        .await
        .unwrap();
    assert_eq!(
        pd.logprobs, direct.logprobs,
        "P/D's log-probabilities are direct's"
    );
    assert_eq!(pd.logprobs.len(), 6);
    for (entry, &token) in pd.logprobs.iter().zip(&pd.tokens) {
        assert_eq!(entry.token, token);
        assert_eq!(entry.top.len(), 3);
        assert_eq!(entry.top[0].0, token, "greedy takes the most likely token");
        assert!(entry.logprob <= 0.0 && entry.top[0].1 >= entry.top[1].1);
    }
    assert_idle(&cluster).await;
    cluster.shutdown();
}

#[actix_rt::test]
async fn sampled_requests_match_direct_and_stop_where_asked_on_local_links() {
    sampled_requests_match_direct_and_stop_where_asked(LinkKind::Local).await;
}

#[actix_rt::test]
async fn sampled_requests_match_direct_and_stop_where_asked_on_quic_links() {
    sampled_requests_match_direct_and_stop_where_asked(LinkKind::Quic).await;
}
