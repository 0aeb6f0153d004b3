//! What every pdkv process serves over HTTP for operators: `/live` (always 200), `/ready` (200
//! once the node can serve, 503 before and while draining, a JSON body naming every peer's
//! state) and Prometheus `/metrics`. The HTTP server runs on its own small tokio runtime beside
//! the actix system.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use pdkv_actors::node::Readiness;

/// Histogram buckets, in each metric's unit: seconds from 100 µs to 60 s.
const SECONDS_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0,
];

/// Bytes from 4 KiB to 1 GiB, by powers of 4.
const BYTES_BUCKETS: &[f64] = &[
    4096.0,
    16384.0,
    65536.0,
    262144.0,
    1048576.0,
    4194304.0,
    16777216.0,
    67108864.0,
    268435456.0,
    1073741824.0,
];

/// READ runs per transfer.
const RUNS_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0];

/// Installs the process's Prometheus recorder with explicit buckets (histograms, not
/// summaries), keeps its upkeep running, and describes the families a process of `kind`
/// exports, its counters present at 0 from the start.
pub fn install_metrics(kind: ProcessKind) -> anyhow::Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full("pdkv_kv_transfer_bytes".into()), BYTES_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full("pdkv_kv_transfer_runs".into()), RUNS_BUCKETS)?
        .install_recorder()
        .context("cannot install the metrics recorder")?;
    let upkeep = handle.clone();
    std::thread::Builder::new()
        .name("pdkv-metrics-upkeep".into())
        .spawn(move || {
            loop {
                std::thread::sleep(Duration::from_secs(5));
                upkeep.run_upkeep();
            }
        })
        .context("cannot start the metrics upkeep thread")?;
    describe(kind);
    Ok(handle)
}

/// Which metric families a process exports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessKind {
    /// A prefill or decode leg of the reference engine.
    Leg,
    /// A router (in front of reference-engine or vLLM legs).
    Router,
}

/// Outcomes of a request at the router (`pdkv_requests_total{outcome}`,
/// `pdkv_request_seconds{stage="total",outcome}`).
pub const OUTCOMES: &[&str] = &["ok", "bad_request", "unavailable", "timeout", "error"];

/// Reasons a decode leg's READ failed (`pdkv_kv_transfer_failures_total{reason}`).
pub const TRANSFER_FAILURES: &[&str] = &["stale_block", "plan", "read", "other"];

/// Describes every family a process of `kind` exports (`# HELP`, units) and sets its counters
/// to 0, so a scrape shows them before their first event.
fn describe(kind: ProcessKind) {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_gauge!("pdkv_build_info", "pdkv's version (the value is always 1)");
    metrics::gauge!("pdkv_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    describe_gauge!(
        "pdkv_peer_up",
        "1 while the peer's link (or a vLLM leg's health) is up, else 0"
    );
    metrics_process::Collector::default().describe();
    match kind {
        ProcessKind::Router => {
            describe_counter!(
                "pdkv_requests_total",
                "Requests answered by the router, by outcome"
            );
            for &outcome in OUTCOMES {
                metrics::counter!("pdkv_requests_total", "outcome" => outcome).absolute(0);
            }
            describe_histogram!(
                "pdkv_request_seconds",
                Unit::Seconds,
                "Request latency at the router: stage prefill or decode (successes), total (by outcome)"
            );
            describe_counter!(
                "pdkv_retries_total",
                "Requests started over on other legs after a failure"
            );
            metrics::counter!("pdkv_retries_total").absolute(0);
        }
        ProcessKind::Leg => {
            describe_histogram!(
                "pdkv_kv_transfer_seconds",
                Unit::Seconds,
                "Time of one request's KV READ"
            );
            describe_histogram!(
                "pdkv_kv_transfer_bytes",
                Unit::Bytes,
                "Bytes of one request's KV READ"
            );
            describe_histogram!("pdkv_kv_transfer_runs", "READ runs posted for one request");
            describe_counter!(
                "pdkv_kv_transfer_failures_total",
                "KV READs that failed, by reason"
            );
            for &reason in TRANSFER_FAILURES {
                metrics::counter!("pdkv_kv_transfer_failures_total", "reason" => reason).absolute(0);
            }
            describe_counter!(
                "pdkv_lease_expired_total",
                "Grants whose lease ran out before the decode released them"
            );
            metrics::counter!("pdkv_lease_expired_total").absolute(0);
            describe_gauge!("pdkv_grants_active", "Live grants (blocks pinned for a READ)");
            describe_gauge!("pdkv_blocks_free", "Free KV blocks, by group");
            describe_gauge!("pdkv_blocks_capacity", "KV blocks, by group");
            describe_gauge!("pdkv_requests_active", "Requests holding blocks on this leg");
            describe_counter!("pdkv_leg_requests_total", "Requests a leg started, by stage");
            for stage in ["prefill", "decode"] {
                metrics::counter!("pdkv_leg_requests_total", "stage" => stage).absolute(0);
            }
            describe_counter!("pdkv_generated_tokens_total", "Tokens decoded by this leg");
            metrics::counter!("pdkv_generated_tokens_total").absolute(0);
        }
    }
}

/// Reads the process's CPU, memory, threads and open files into its `process_*` gauges.
pub fn collect_process_metrics() {
    metrics_process::Collector::default().collect();
}

/// The GPU telemetry a node exports at each scrape (`pdkv_gpu_*` gauges, labelled by device).
///
/// The backend is chosen at the first scrape, as `pdkv gpus` chooses it (rocm_smi_lib when built
/// with it and it finds a GPU, else sysfs) and kept, so a host without GPUs asks rocm_smi once.
/// The sysfs root is `$PDKV_SYSFS_ROOT`, default `/sys` (a container may mount it elsewhere).
pub struct GpuTelemetry {
    sysfs: pdkv_rocm::Sysfs,
    backend: std::sync::OnceLock<pdkv_rocm::BackendChoice>,
}

/// The longest a scrape waits for GPU readings.
const GPU_READ_BOUND: Duration = Duration::from_secs(1);

impl GpuTelemetry {
    /// Telemetry from this host's GPUs.
    pub fn from_environment() -> Arc<Self> {
        let root = std::env::var_os("PDKV_SYSFS_ROOT").unwrap_or_else(|| "/sys".into());
        Arc::new(GpuTelemetry {
            sysfs: pdkv_rocm::Sysfs::new(std::path::PathBuf::from(root)),
            backend: std::sync::OnceLock::new(),
        })
    }

    fn read(&self) -> Result<Vec<pdkv_rocm::Reading>, pdkv_rocm::RocmError> {
        if let Some(&choice) = self.backend.get() {
            return pdkv_rocm::read_gpus(choice, &self.sysfs).map(|(_, readings)| readings);
        }
        // The first scrape chooses, and its readings are this scrape's.
        let first = pdkv_rocm::read_gpus(pdkv_rocm::BackendChoice::Auto, &self.sysfs);
        let _ = self.backend.set(match &first {
            Ok((pdkv_rocm::Backend::Smi, _)) => pdkv_rocm::BackendChoice::Smi,
            _ => pdkv_rocm::BackendChoice::Sysfs,
        });
        first.map(|(_, readings)| readings)
    }

    /// Reads every GPU (at most [`GPU_READ_BOUND`]) and sets its gauges; a failed read is
    /// logged and leaves the last values.
    pub async fn export(self: &Arc<Self>) {
        let this = self.clone();
        let read =
            tokio::time::timeout(GPU_READ_BOUND, tokio::task::spawn_blocking(move || this.read())).await;
        match read {
            Ok(Ok(Ok(readings))) => {
                for gauge in pdkv_rocm::gauges(&readings) {
                    let labels: Vec<metrics::Label> = gauge
                        .labels
                        .into_iter()
                        .map(|(key, value)| metrics::Label::new(key, value))
                        .collect();
                    metrics::gauge!(gauge.name, labels).set(gauge.value);
                }
            }
            Ok(Ok(Err(error))) => tracing::warn!(%error, "GPU telemetry"),
            Ok(Err(error)) => tracing::warn!(%error, "GPU telemetry reader failed"),
            Err(_) => tracing::warn!(
                bound_ms = GPU_READ_BOUND.as_millis() as u64,
                "GPU telemetry took too long"
            ),
        }
    }
}

/// Updates gauges that are read at scrape time (a leg's block accounting).
pub type Refresh = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// What the admin routes read.
#[derive(Clone)]
pub struct AdminState {
    /// The node's readiness, computed on each call.
    pub readiness: Arc<dyn Fn() -> Readiness + Send + Sync>,
    /// The metrics recorder.
    pub metrics: PrometheusHandle,
    /// Run before each scrape.
    pub refresh: Option<Refresh>,
}

/// The admin routes, to serve alone or merged into the router's API.
pub fn routes(state: AdminState) -> Router {
    let (ready_state, metrics, refresh) = (state.clone(), state.metrics.clone(), state.refresh.clone());
    Router::new()
        .route("/live", get(|| async { "live\n" }))
        .route(
            "/ready",
            get(move || {
                let readiness = (ready_state.readiness)();
                async move {
                    let status = if readiness.ready {
                        StatusCode::OK
                    } else {
                        StatusCode::SERVICE_UNAVAILABLE
                    };
                    (status, axum::Json(readiness)).into_response()
                }
            }),
        )
        .route(
            "/metrics",
            get(move || {
                let (metrics, refresh) = (metrics.clone(), refresh.clone());
                async move {
                    if let Some(refresh) = refresh {
                        refresh().await;
                    }
                    collect_process_metrics();
                    let text = metrics.render();
                    Response::builder()
                        .header(header::CONTENT_TYPE, "text/plain; version=0.0.4")
                        .body(axum::body::Body::from(text))
                        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
                }
            }),
        )
}
