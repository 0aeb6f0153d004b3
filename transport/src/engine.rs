//! The READ engine trait, shaped like mori's IO engine.
//!
//! mori's flow (see `shared/reference/mori-rocm.md` §1): each side creates an engine; memory is
//! registered and yields a serializable descriptor; peers exchange engine and memory descriptors
//! out of band; the reader posts a batch of `(local offset, remote offset, length)` runs between a
//! local and a remote region and polls or waits for completion. pdkv's engines (in-process,
//! shared memory, network, mori) all fit this trait, so the transfer actor never knows which one
//! moves the bytes.
//!
//! Generation words (one `u32` per block, bumped when the prefill leg frees a block) are read
//! with [`ReadEngine::read_remote_words`] after the data, so a READ that raced a free-and-reuse is
//! caught (seqlock style) rather than returned as good.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use pdkv_core::plan::ReadRun;
use pdkv_core::wire::GrantId;
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::region::{Region, RegionError};

/// Names one engine (one per leg) within a cluster.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EngineKey(pub String);

impl std::fmt::Display for EngineKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Which engine implementation produced a descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    /// Both legs in one process.
    Local,
    /// Same host, shared memory.
    Shm,
    /// Over the network, served by the prefill leg's memory server.
    Net,
    /// AMD GPUs over RDMA through mori.
    Mori,
}

/// What a peer needs to know about an engine before reading from it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineDescriptor {
    /// The engine's key.
    pub key: EngineKey,
    /// Its implementation.
    pub kind: EngineKind,
    /// Process id of the owner (same-host engines check it).
    pub pid: u32,
    /// Engine-specific address (memory server address for `net`), empty otherwise.
    pub address: String,
    /// Engine-specific descriptor bytes, opaque to pdkv: mori's packed `EngineDesc` for `mori`,
    /// empty otherwise.
    pub packed: Vec<u8>,
}

/// Engine-specific part of a memory descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RegionHandle {
    /// In-process: the region is found by (engine, region id).
    Local,
    /// Shared memory: a memfd of the owning process, opened read-only by the peer.
    Shm {
        /// Owning process.
        pid: u32,
        /// File descriptor number in the owner.
        fd: i32,
    },
    /// Served by the owner's memory server.
    Net,
    /// Registered with the owner's mori engine: mori's packed `MemoryDesc` (its address, size,
    /// device and location; the rkey is fetched by mori from the owner on first use).
    Mori {
        /// The msgpack bytes mori produced.
        packed: Vec<u8>,
    },
}

/// A registered region, as a peer sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryDescriptor {
    /// Owning engine.
    pub engine: EngineKey,
    /// Region id within the engine.
    pub region: u32,
    /// Length in bytes.
    pub len_bytes: u64,
    /// How to reach it.
    pub handle: RegionHandle,
}

/// One batch of runs between one local and one remote region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadOp {
    /// The grant the READ claims (network engines send it; one-sided engines rely on the
    /// generation check instead, as RDMA relies on the rkey).
    pub grant: GrantId,
    /// Local destination region id.
    pub local_region: u32,
    /// Remote engine.
    pub remote_engine: EngineKey,
    /// Remote source region id.
    pub remote_region: u32,
    /// Runs to copy.
    pub runs: Vec<ReadRun>,
}

/// What a completed READ moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReadReport {
    /// Bytes copied.
    pub bytes: u64,
    /// Runs (descriptors) posted.
    pub runs: usize,
}

/// A posted batch: poll it or wait for it with a bound.
#[derive(Debug)]
pub struct ReadHandle {
    state: HandleState,
}

#[derive(Debug)]
enum HandleState {
    Done(Option<Result<ReadReport, EngineError>>),
    Pending(oneshot::Receiver<Result<ReadReport, EngineError>>),
}

/// Completes a pending [`ReadHandle`]; dropping it unsent abandons the READ.
#[derive(Debug)]
pub struct ReadCompleter {
    tx: oneshot::Sender<Result<ReadReport, EngineError>>,
}

impl ReadCompleter {
    /// Reports the READ's outcome (ignored if the handle was dropped).
    pub fn complete(self, result: Result<ReadReport, EngineError>) {
        let _ = self.tx.send(result);
    }
}

impl ReadHandle {
    /// A handle that completed when it was posted.
    pub fn completed(result: Result<ReadReport, EngineError>) -> Self {
        ReadHandle {
            state: HandleState::Done(Some(result)),
        }
    }

    /// A handle completed later through the returned completer.
    pub fn pending() -> (ReadCompleter, Self) {
        let (tx, rx) = oneshot::channel();
        (
            ReadCompleter { tx },
            ReadHandle {
                state: HandleState::Pending(rx),
            },
        )
    }

    /// The result if the READ finished, without blocking.
    pub fn poll(&mut self) -> Option<Result<ReadReport, EngineError>> {
        match &mut self.state {
            HandleState::Done(result) => result.take(),
            HandleState::Pending(rx) => match rx.try_recv() {
                Ok(result) => Some(result),
                Err(oneshot::error::TryRecvError::Empty) => None,
                Err(oneshot::error::TryRecvError::Closed) => Some(Err(EngineError::Abandoned)),
            },
        }
    }

    /// Waits at most `timeout` for the READ to finish (async; needs a tokio timer).
    pub async fn wait(self, timeout: Duration) -> Result<ReadReport, EngineError> {
        match self.state {
            HandleState::Done(Some(result)) => result,
            HandleState::Done(None) => Err(EngineError::Abandoned),
            HandleState::Pending(rx) => match tokio::time::timeout(timeout, rx).await {
                Ok(Ok(result)) => result,
                Ok(Err(_)) => Err(EngineError::Abandoned),
                Err(_) => Err(EngineError::Timeout {
                    after_ms: timeout.as_millis() as u64,
                }),
            },
        }
    }

    /// Blocks the calling thread at most `timeout` for the READ (for callers outside a runtime).
    pub fn wait_blocking(mut self, timeout: Duration) -> Result<ReadReport, EngineError> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(result) = self.poll() {
                return result;
            }
            if std::time::Instant::now() >= deadline {
                return Err(EngineError::Timeout {
                    after_ms: timeout.as_millis() as u64,
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// Refuses a peer's descriptor made by another kind of engine than `expected`.
pub(crate) fn check_kind(engine: &EngineDescriptor, expected: EngineKind) -> Result<(), EngineError> {
    if engine.kind == expected {
        return Ok(());
    }
    Err(EngineError::WrongKind {
        engine: engine.key.clone(),
        found: engine.kind,
        expected,
    })
}

/// Refuses a batch with any run outside its local (`local_len` bytes) or remote (`remote_len`
/// bytes) region before a byte moves.
pub(crate) fn check_runs(op: &ReadOp, local_len: u64, remote_len: u64) -> Result<(), EngineError> {
    for run in &op.runs {
        for (side, region, offset, region_len) in [
            ("local", op.local_region, run.local_offset, local_len),
            ("remote", op.remote_region, run.remote_offset, remote_len),
        ] {
            if offset
                .checked_add(run.len_bytes)
                .is_none_or(|end| end > region_len)
            {
                return Err(EngineError::Bounds {
                    side,
                    region,
                    source: RegionError::OutOfBounds {
                        offset,
                        len: run.len_bytes,
                        region_len,
                    },
                });
            }
        }
    }
    Ok(())
}

/// The regions an engine registered, by id: what every engine keeps on its own side.
#[derive(Debug, Default)]
pub struct LocalRegions {
    regions: Mutex<HashMap<u32, Arc<Region>>>,
}

impl LocalRegions {
    /// Registers `region` under `region_id`; an id is registered once.
    pub fn insert(&self, region_id: u32, region: Arc<Region>) -> Result<(), EngineError> {
        let mut regions = self.regions.lock().unwrap_or_else(PoisonError::into_inner);
        if regions.contains_key(&region_id) {
            return Err(EngineError::DuplicateRegion(region_id));
        }
        regions.insert(region_id, region);
        Ok(())
    }

    /// The region registered under `region_id`.
    pub fn get(&self, region_id: u32) -> Result<Arc<Region>, EngineError> {
        self.regions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&region_id)
            .cloned()
            .ok_or(EngineError::UnknownLocalRegion(region_id))
    }
}

/// A one-sided READ engine.
pub trait ReadEngine: Send + Sync {
    /// This engine's key.
    fn key(&self) -> &EngineKey;

    /// What a peer needs to reach this engine.
    fn descriptor(&self) -> EngineDescriptor;

    /// Registers local memory under `region_id` so peers may read it and this engine may write
    /// into it.
    fn register(&self, region_id: u32, region: Arc<Region>) -> Result<MemoryDescriptor, EngineError>;

    /// Learns a remote engine and its regions (from the peer's handshake).
    fn register_remote(
        &self,
        engine: &EngineDescriptor,
        regions: &[MemoryDescriptor],
    ) -> Result<(), EngineError>;

    /// Posts READs of remote runs into local regions.
    fn batch_read(&self, ops: Vec<ReadOp>) -> Result<ReadHandle, EngineError>;

    /// Reads 32-bit words (generations) of a remote region, each with acquire ordering.
    fn read_remote_words<'a>(
        &'a self,
        remote_engine: &'a EngineKey,
        grant: GrantId,
        remote_region: u32,
        indices: &'a [u32],
    ) -> WordsFuture<'a>;
}

/// The future [`ReadEngine::read_remote_words`] returns.
pub type WordsFuture<'a> = Pin<Box<dyn Future<Output = Result<Vec<u32>, EngineError>> + Send + 'a>>;

/// Why a READ engine refused or failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// The local region id was never registered.
    #[error("local region {0} is not registered")]
    UnknownLocalRegion(u32),
    /// The remote region is not known (no handshake yet, or wrong id).
    #[error("region {region} of engine {engine} is not registered here")]
    UnknownRemoteRegion {
        /// Remote engine.
        engine: EngineKey,
        /// Region id.
        region: u32,
    },
    /// A region id was registered twice.
    #[error("region {0} is already registered")]
    DuplicateRegion(u32),
    /// The descriptor belongs to another kind of engine.
    #[error("engine {engine} is {found:?}, this engine reads {expected:?}")]
    WrongKind {
        /// Remote engine.
        engine: EngineKey,
        /// Its kind.
        found: EngineKind,
        /// Ours.
        expected: EngineKind,
    },
    /// A run lies outside a region.
    #[error("{side} region {region}: {source}")]
    Bounds {
        /// `local` or `remote`.
        side: &'static str,
        /// Region id.
        region: u32,
        /// The bounds error.
        source: RegionError,
    },
    /// The READ did not finish in time.
    #[error("read did not complete within {after_ms} ms")]
    Timeout {
        /// The bound that passed.
        after_ms: u64,
    },
    /// The engine dropped the READ (shut down, or the worker died).
    #[error("read abandoned by the engine")]
    Abandoned,
    /// A fault injected by a test or chaos run.
    #[error("injected fault after {after_bytes} bytes")]
    InjectedFault {
        /// Bytes copied before the fault.
        after_bytes: u64,
    },
    /// The remote side refused the READ.
    #[error("remote refused the read: {0}")]
    Refused(String),
    /// An OS or network error.
    #[error("{0}")]
    Io(String),
    /// mori could not start, reach the peer or complete the READ.
    #[error(transparent)]
    Mori(#[from] crate::mori::MoriError),
}

impl From<RegionError> for EngineError {
    fn from(error: RegionError) -> Self {
        EngineError::Io(error.to_string())
    }
}
