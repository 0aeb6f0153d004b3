//! The compute pool: where a leg's reference engine runs, off the arbiter.
//!
//! An arbiter is one thread that also serves grant renewals, releases and every other control
//! message of the leg; a 10k-token prefill computed there would stall them all. Jobs run on
//! tokio's blocking threads instead, at most `workers` at a time per leg; further jobs wait for
//! a permit (their number is bounded by the leg's requests in flight, which its blocks and wait
//! queue bound).

use std::sync::Arc;

use pdkv_core::wire::Failure;
use tokio::sync::Semaphore;

/// A bounded pool of compute threads for one leg.
#[derive(Debug, Clone)]
pub struct ComputePool {
    permits: Arc<Semaphore>,
}

impl ComputePool {
    /// A pool running at most `workers` jobs at once.
    pub fn new(workers: usize) -> Self {
        ComputePool {
            permits: Arc::new(Semaphore::new(workers.max(1))),
        }
    }

    /// Runs `job` on a compute thread and returns its result.
    pub async fn run<T, F>(&self, job: F) -> Result<T, Failure>
    where
        F: FnOnce() -> Result<T, Failure> + Send + 'static,
        T: Send + 'static,
    {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Failure::Engine("compute pool closed".into()))?;
        let joined = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            job()
        })
        .await;
        joined.map_err(|error| Failure::Engine(format!("compute job died: {error}")))?
    }
}
