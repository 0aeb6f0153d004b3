//! The compute pool: where a leg's reference engine runs, mostly off the arbiter.
//!
//! An arbiter is one thread that also serves grant renewals, releases and every other control
//! message of the leg; a 10k-token prefill computed there would stall them all. Jobs run on
//! tokio's blocking threads instead, at most `workers` at a time per leg; further jobs wait for
//! a permit (their number is bounded by the leg's requests in flight, which its blocks and wait
//! queue bound).
//!
//! Handing a job to another thread costs a wake-up (about 15 µs to a parked thread on a small
//! VM), more than a few steps of a small model. So the pool learns the engine's cost per token
//! step (a moving average of what it measures) and runs a job on the caller's thread when it is
//! expected to finish within `inline_budget`: a few steps of a small model stay inline, a long
//! prompt never does. An inline budget of zero sends every job to the pool.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pdkv_core::wire::Failure;
use tokio::sync::Semaphore;

/// A bounded pool of compute threads for one leg.
#[derive(Debug, Clone)]
pub struct ComputePool {
    permits: Arc<Semaphore>,
    inline_budget_ns: u64,
    /// Moving average of nanoseconds per token step; 0 until a job has been measured.
    step_ns: Arc<AtomicU64>,
}

impl ComputePool {
    /// A pool running at most `workers` jobs at once on its threads; jobs expected to take at
    /// most `inline_budget` run on the caller's thread.
    pub fn new(workers: usize, inline_budget: Duration) -> Self {
        ComputePool {
            permits: Arc::new(Semaphore::new(workers.max(1))),
            inline_budget_ns: inline_budget.as_nanos() as u64,
            step_ns: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Whether a job of `steps` token steps is expected to fit the inline budget.
    pub fn runs_inline(&self, steps: u64) -> bool {
        let per_step = self.step_ns.load(Ordering::Relaxed);
        per_step != 0 && per_step.saturating_mul(steps) <= self.inline_budget_ns
    }

    /// Runs `job`, `steps` token steps long, and returns its result.
    pub async fn run<T, F>(&self, steps: u64, job: F) -> Result<T, Failure>
    where
        F: FnOnce() -> Result<T, Failure> + Send + 'static,
        T: Send + 'static,
    {
        let step_ns = self.step_ns.clone();
        let timed = move || {
            let started = Instant::now();
            let result = job();
            observe(&step_ns, steps, started.elapsed());
            result
        };
        if self.runs_inline(steps) {
            return timed();
        }
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Failure::Engine("compute pool closed".into()))?;
        let joined = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            timed()
        })
        .await;
        joined.map_err(|error| Failure::Engine(format!("compute job died: {error}")))?
    }
}

/// Folds one measured job into the per-step average (weight 1/8 for the new sample).
fn observe(step_ns: &AtomicU64, steps: u64, took: Duration) {
    if steps == 0 {
        return;
    }
    let sample = (took.as_nanos() as u64 / steps).max(1);
    let old = step_ns.load(Ordering::Relaxed);
    let new = if old == 0 {
        sample
    } else {
        old - old / 8 + sample / 8
    };
    step_ns.store(new.max(1), Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_runs_inline_only_once_its_cost_is_known_to_fit() {
        let pool = ComputePool::new(1, Duration::from_micros(100));
        assert!(!pool.runs_inline(1), "unknown cost: off the caller's thread");
        observe(&pool.step_ns, 10, Duration::from_micros(20));
        assert_eq!(pool.step_ns.load(Ordering::Relaxed), 2_000);
        assert!(pool.runs_inline(50));
        assert!(!pool.runs_inline(51));
        let never = ComputePool::new(1, Duration::ZERO);
        observe(&never.step_ns, 10, Duration::from_micros(20));
        assert!(!never.runs_inline(1));
    }

    #[test]
    fn the_average_moves_an_eighth_toward_each_sample() {
        let step_ns = AtomicU64::new(0);
        observe(&step_ns, 1, Duration::from_nanos(800));
        observe(&step_ns, 1, Duration::from_nanos(1_600));
        assert_eq!(step_ns.load(Ordering::Relaxed), 800 - 100 + 200);
    }
}
