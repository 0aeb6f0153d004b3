//! A whole cluster in one process reading through pdkv's mori engine, over the loopback stand-in
//! of the mori shim (a READ is a memcpy in this process, completed on its own thread), with KV in
//! host memory and, with the `hip` feature, in "GPU" memory of a HIP stand-in whose device is
//! host memory. P/D must equal direct and nothing may leak: everything of pdkv's mori path runs
//! (config, engine choice, descriptors in the hello, sessions, batching, completion, generation
//! reads, GPU regions through staging copies) except mori and the hardware themselves.
#![cfg(feature = "mori")]

use std::time::Duration;

use pdkv_actors::cluster::LocalCluster;
use pdkv_actors::config::{ClusterConfig, DEFAULT_CLUSTER_TOML, LinkKind};
use pdkv_actors::sweep;

fn use_stand_ins() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: set once, before any engine or GPU region loads a shim.
    ONCE.call_once(|| unsafe {
        std::env::set_var("PDKV_MORI_SHIM", pdkv_transport::mori::LOOPBACK_SHIM);
        #[cfg(feature = "hip")]
        std::env::set_var("PDKV_HIP_SHIM", pdkv_transport::gpu::HOST_MEMORY_SHIM);
    });
}

/// Lengths around the shipped layout's block (64) and window (128) boundaries, and the seed's
/// failing ones.
const LENGTHS: &[u64] = &[1, 2, 63, 64, 65, 127, 128, 129, 184, 191, 192, 193, 256, 257, 449];

async fn pd_equals_direct(kv_memory: &str, links: LinkKind) {
    use_stand_ins();
    let text = DEFAULT_CLUSTER_TOML
        .replacen(
            "read_engine = \"shm\"",
            &format!("read_engine = \"mori\"\nkv_memory = \"{kv_memory}\""),
            1,
        )
        .replacen("lookahead_tokens = 0", "lookahead_tokens = 2", 1);
    let mut config = ClusterConfig::from_toml(&text).unwrap();
    config.transport.links = links;
    let cluster = LocalCluster::start(config).await.unwrap();
    for &length in LENGTHS {
        let result = sweep::compare(&cluster, length, 3).await;
        assert!(result.matched, "{kv_memory}, prompt length {length}: {result:?}");
    }
    let stats = cluster.wait_idle(Duration::from_secs(2)).await.unwrap();
    assert!(stats.iter().all(|leg| leg.is_idle()), "blocks leaked: {stats:?}");
    cluster.shutdown();
}

/// Fails every other mori READ half way (the stand-in copies half the runs, then reports
/// ERR_RDMA_OP): each request either matches direct or fails with mori's error, never answers
/// from partial KV, and nothing leaks.
async fn half_way_failures_fail_closed() {
    let text = DEFAULT_CLUSTER_TOML.replacen("read_engine = \"shm\"", "read_engine = \"mori\"", 1);
    let cluster = LocalCluster::start(ClusterConfig::from_toml(&text).unwrap())
        .await
        .unwrap();
    // SAFETY: the tests of this binary run one after another in one test function.
    unsafe { std::env::set_var("PDKV_LOOPBACK_FAIL_EVERY", "2") };
    let (mut matched, mut failed) = (0, 0);
    for &length in LENGTHS {
        let result = sweep::compare(&cluster, length, 3).await;
        match (&result.matched, &result.error) {
            (true, _) => matched += 1,
            (false, Some(error)) if error.contains("mori READ failed with RdmaOp") => failed += 1,
            _ => panic!("prompt length {length}: neither a match nor mori's error: {result:?}"),
        }
    }
    // SAFETY: as above.
    unsafe { std::env::remove_var("PDKV_LOOPBACK_FAIL_EVERY") };
    assert!(failed > 0, "the stand-in failed no READ");
    assert!(matched + failed == LENGTHS.len());
    let stats = cluster.wait_idle(Duration::from_secs(2)).await.unwrap();
    assert!(stats.iter().all(|leg| leg.is_idle()), "blocks leaked: {stats:?}");
    cluster.shutdown();
}

/// One test: the stand-in's knobs are process-wide environment variables.
#[actix_rt::test]
async fn pd_equals_direct_over_mori_and_failed_reads_fail_closed() {
    pd_equals_direct("host", LinkKind::Local).await;
    pd_equals_direct("host", LinkKind::Quic).await;
    #[cfg(feature = "hip")]
    pd_equals_direct("gpu", LinkKind::Local).await;
    half_way_failures_fail_closed().await;
}
