//! Bulk copies off the caller's thread.
//!
//! A READ engine copies small batches inline (a thread wake-up costs more than the copy) and
//! hands large ones to a [`CopyWorker`], as mori hands work to its backend threads, so the
//! caller's actor thread stays free. The worker's queue is bounded: when it is full the job comes
//! back to the caller, which runs it inline (backpressure, never an unbounded queue).

use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::thread::JoinHandle;

/// Batches at or below this many bytes are copied inline.
pub const INLINE_READ_BYTES: u64 = 256 * 1024;

/// One unit of work for the worker.
pub type CopyJob = Box<dyn FnOnce() + Send + 'static>;

/// A thread that runs copy jobs from a bounded queue.
#[derive(Debug)]
pub struct CopyWorker {
    tx: Option<SyncSender<CopyJob>>,
    thread: Option<JoinHandle<()>>,
}

impl CopyWorker {
    /// Starts a worker named `name` whose queue holds `queue` jobs.
    pub fn new(name: &str, queue: usize) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::sync_channel::<CopyJob>(queue);
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                for job in rx {
                    job();
                }
            })?;
        Ok(CopyWorker {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Queues `job`; hands it back if the queue is full or the worker is gone.
    pub fn submit(&self, job: CopyJob) -> Result<(), CopyJob> {
        match &self.tx {
            Some(tx) => tx.try_send(job).map_err(|error| match error {
                TrySendError::Full(job) | TrySendError::Disconnected(job) => job,
            }),
            None => Err(job),
        }
    }
}

impl Drop for CopyWorker {
    fn drop(&mut self) {
        // Closing the queue ends the thread after the jobs already queued.
        self.tx.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
