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
//!
//! The budget also bounds the work queued behind the arbiter: when the jobs ready to start beside
//! a short one (a burst of requests reached the leg together) would keep the arbiter busy past
//! `inline_budget`, the short job goes to a free worker instead, so the arbiter and the workers
//! compute side by side; with every worker busy it runs inline after all, so the arbiter never
//! idles while jobs wait. A few jobs ready together stay inline: a hand-off costs more than they
//! gain.

use std::future::Future;
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
    /// Token steps of the jobs created and not yet started (first polled).
    ready_steps: Arc<AtomicU64>,
}

impl ComputePool {
    /// A pool running at most `workers` jobs at once on its threads; jobs expected to take at
    /// most `inline_budget` run on the caller's thread.
    pub fn new(workers: usize, inline_budget: Duration) -> Self {
        ComputePool {
            permits: Arc::new(Semaphore::new(workers.max(1))),
            inline_budget_ns: inline_budget.as_nanos() as u64,
            step_ns: Arc::new(AtomicU64::new(0)),
            ready_steps: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Whether a job of `steps` token steps is expected to fit the inline budget.
    pub fn runs_inline(&self, steps: u64) -> bool {
        let per_step = self.step_ns.load(Ordering::Relaxed);
        per_step != 0 && per_step.saturating_mul(steps) <= self.inline_budget_ns
    }

    /// Whether the jobs ready to start would keep the arbiter busy past the inline budget.
    fn backlog_exceeds_budget(&self) -> bool {
        let per_step = self.step_ns.load(Ordering::Relaxed);
        per_step.saturating_mul(self.ready_steps.load(Ordering::Relaxed)) > self.inline_budget_ns
    }

    /// A job, `steps` token steps long, that runs `job` when awaited and yields its result. It
    /// counts as ready to start from this call until it is first polled, so jobs created together
    /// (before any of them runs) see each other and share the leg's thread and the workers.
    pub fn run<T, F>(&self, steps: u64, job: F) -> impl Future<Output = Result<T, Failure>> + use<T, F>
    where
        F: FnOnce() -> Result<T, Failure> + Send + 'static,
        T: Send + 'static,
    {
        let pool = self.clone();
        let ready = Ready::new(self.ready_steps.clone(), steps);
        async move {
            drop(ready);
            let step_ns = pool.step_ns.clone();
            let timed = move || {
                let started = Instant::now();
                let result = job();
                observe(&step_ns, steps, started.elapsed());
                result
            };
            let permit = if pool.runs_inline(steps) {
                if !pool.backlog_exceeds_budget() {
                    return timed();
                }
                match pool.permits.clone().try_acquire_owned() {
                    Ok(permit) => permit,
                    // Every worker is busy: this thread computes too.
                    Err(_) => return timed(),
                }
            } else {
                pool.permits
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(|_| Failure::Engine("compute pool closed".into()))?
            };
            let joined = tokio::task::spawn_blocking(move || {
                let _permit = permit;
                timed()
            })
            .await;
            joined.map_err(|error| Failure::Engine(format!("compute job died: {error}")))?
        }
    }
}

/// A job's steps counted as ready to start until this is dropped (when the job starts, or is
/// dropped unrun).
#[derive(Debug)]
struct Ready {
    ready_steps: Arc<AtomicU64>,
    steps: u64,
}

impl Ready {
    fn new(ready_steps: Arc<AtomicU64>, steps: u64) -> Self {
        ready_steps.fetch_add(steps, Ordering::Relaxed);
        Ready { ready_steps, steps }
    }
}

impl Drop for Ready {
    fn drop(&mut self) {
        self.ready_steps.fetch_sub(self.steps, Ordering::Relaxed);
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

    /// A pool with a 100 µs inline budget whose engine is known to take 1 µs a step.
    fn primed(workers: usize) -> ComputePool {
        let pool = ComputePool::new(workers, Duration::from_micros(100));
        observe(&pool.step_ns, 1, Duration::from_micros(1));
        pool
    }

    /// A 60-step job (60 µs: within the budget) that says which thread ran it.
    fn thread_of_job(pool: &ComputePool) -> impl Future<Output = Result<std::thread::ThreadId, Failure>> {
        pool.run(60, || Ok(std::thread::current().id()))
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
    }

    #[test]
    fn a_job_alone_runs_inline() {
        runtime().block_on(async {
            let pool = primed(2);
            let here = std::thread::current().id();
            assert_eq!(thread_of_job(&pool).await.unwrap(), here);
            // Jobs created and dropped unrun no longer count as ready.
            drop((thread_of_job(&pool), thread_of_job(&pool)));
            assert_eq!(thread_of_job(&pool).await.unwrap(), here);
        });
    }

    #[test]
    fn a_few_short_jobs_ready_together_stay_inline() {
        runtime().block_on(async {
            let pool = primed(2);
            let here = std::thread::current().id();
            // The other job ready (60 µs) fits the budget beside this one.
            let (first, second) = tokio::join!(thread_of_job(&pool), thread_of_job(&pool));
            assert_eq!(first.unwrap(), here);
            assert_eq!(second.unwrap(), here);
        });
    }

    #[test]
    fn a_backlog_past_the_budget_sends_a_short_job_to_a_free_worker() {
        runtime().block_on(async {
            let pool = primed(1);
            let here = std::thread::current().id();
            // Three created before any runs: the first sees 120 µs ready beside it (past the
            // 100 µs budget) and takes the free worker; the second sees 60 µs and stays.
            let (first, second, third) = (thread_of_job(&pool), thread_of_job(&pool), thread_of_job(&pool));
            let (first, second, third) = tokio::join!(first, second, third);
            assert_ne!(first.unwrap(), here, "a backlog past the budget: to the worker");
            assert_eq!(second.unwrap(), here, "what is left fits the budget: inline");
            assert_eq!(third.unwrap(), here);
        });
    }

    #[test]
    fn with_every_worker_busy_a_job_runs_inline_whatever_the_backlog() {
        runtime().block_on(async {
            let pool = primed(1);
            let here = std::thread::current().id();
            let busy = pool.permits.clone().try_acquire_owned().unwrap();
            let jobs = (thread_of_job(&pool), thread_of_job(&pool), thread_of_job(&pool));
            // Bounded: a job that waited for the held worker would wait forever.
            let all = tokio::time::timeout(Duration::from_secs(10), async {
                tokio::join!(jobs.0, jobs.1, jobs.2)
            });
            let (first, second, third) = all.await.expect("no job waits for a busy worker");
            assert_eq!(first.unwrap(), here, "no free worker: inline, not waiting");
            assert_eq!(second.unwrap(), here);
            assert_eq!(third.unwrap(), here);
            drop(busy);
        });
    }

    #[test]
    fn the_average_moves_an_eighth_toward_each_sample() {
        let step_ns = AtomicU64::new(0);
        observe(&step_ns, 1, Duration::from_nanos(800));
        observe(&step_ns, 1, Duration::from_nanos(1_600));
        assert_eq!(step_ns.load(Ordering::Relaxed), 800 - 100 + 200);
    }
}
