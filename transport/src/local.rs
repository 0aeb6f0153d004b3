//! The in-process READ engine: both legs live in one process and the READ is a direct copy from
//! the prefill leg's registered region into the decode leg's.
//!
//! Engines of one process find each other's regions through a shared [`LocalFabric`], the way mori
//! engines find each other through exchanged descriptors. A test can make the next READ fail
//! half-way ([`LocalEngine::fail_next_read_after`]) to prove that partial transfers fail closed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use pdkv_core::plan::ReadRun;

use crate::copy::{CopyJob, CopyWorker, INLINE_READ_BYTES};
use crate::engine::{
    EngineDescriptor, EngineError, EngineKey, EngineKind, MemoryDescriptor, ReadEngine, ReadHandle, ReadOp,
    ReadReport, RegionHandle,
};
use crate::region::Region;

type RegionMap = HashMap<(EngineKey, u32), Arc<Region>>;

/// The regions of every local engine in this process.
#[derive(Debug, Default, Clone)]
pub struct LocalFabric {
    regions: Arc<Mutex<RegionMap>>,
}

impl LocalFabric {
    /// An empty fabric.
    pub fn new() -> Self {
        Self::default()
    }
}

/// Sentinel meaning "no fault armed".
const NO_FAULT: u64 = u64::MAX;

/// An in-process READ engine.
#[derive(Debug)]
pub struct LocalEngine {
    key: EngineKey,
    fabric: LocalFabric,
    local: Mutex<HashMap<u32, Arc<Region>>>,
    remote: Mutex<RegionMap>,
    fail_after_bytes: AtomicU64,
    worker: CopyWorker,
}

impl LocalEngine {
    /// An engine named `key` on `fabric`.
    pub fn new(key: EngineKey, fabric: LocalFabric) -> Result<Self, EngineError> {
        let worker = CopyWorker::new(&format!("pdkv-copy-{key}"), 64)
            .map_err(|error| EngineError::Io(error.to_string()))?;
        Ok(LocalEngine {
            key,
            fabric,
            local: Mutex::new(HashMap::new()),
            remote: Mutex::new(HashMap::new()),
            fail_after_bytes: AtomicU64::new(NO_FAULT),
            worker,
        })
    }

    /// Makes the next READ stop with an error after copying `bytes` bytes (chaos and tests).
    pub fn fail_next_read_after(&self, bytes: u64) {
        self.fail_after_bytes.store(bytes, Ordering::SeqCst);
    }

    fn remote_region(&self, engine: &EngineKey, region: u32) -> Result<Arc<Region>, EngineError> {
        self.remote
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(engine.clone(), region))
            .cloned()
            .ok_or_else(|| EngineError::UnknownRemoteRegion {
                engine: engine.clone(),
                region,
            })
    }
}

impl ReadEngine for LocalEngine {
    fn key(&self) -> &EngineKey {
        &self.key
    }

    fn descriptor(&self) -> EngineDescriptor {
        EngineDescriptor {
            key: self.key.clone(),
            kind: EngineKind::Local,
            pid: std::process::id(),
            address: String::new(),
        }
    }

    fn register(&self, region_id: u32, region: Arc<Region>) -> Result<MemoryDescriptor, EngineError> {
        let mut local = self.local.lock().unwrap_or_else(PoisonError::into_inner);
        if local.contains_key(&region_id) {
            return Err(EngineError::DuplicateRegion(region_id));
        }
        let len_bytes = region.len() as u64;
        local.insert(region_id, region.clone());
        self.fabric
            .regions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((self.key.clone(), region_id), region);
        Ok(MemoryDescriptor {
            engine: self.key.clone(),
            region: region_id,
            len_bytes,
            handle: RegionHandle::Local,
        })
    }

    fn register_remote(
        &self,
        engine: &EngineDescriptor,
        regions: &[MemoryDescriptor],
    ) -> Result<(), EngineError> {
        if engine.kind != EngineKind::Local {
            return Err(EngineError::WrongKind {
                engine: engine.key.clone(),
                found: engine.kind,
                expected: EngineKind::Local,
            });
        }
        let fabric = self.fabric.regions.lock().unwrap_or_else(PoisonError::into_inner);
        let mut remote = self.remote.lock().unwrap_or_else(PoisonError::into_inner);
        for descriptor in regions {
            let key = (descriptor.engine.clone(), descriptor.region);
            let region = fabric.get(&key).ok_or_else(|| EngineError::UnknownRemoteRegion {
                engine: descriptor.engine.clone(),
                region: descriptor.region,
            })?;
            remote.insert(key, region.clone());
        }
        Ok(())
    }

    fn batch_read(&self, ops: Vec<ReadOp>) -> Result<ReadHandle, EngineError> {
        let fail_after = self.fail_after_bytes.swap(NO_FAULT, Ordering::SeqCst);
        let mut batches = Vec::with_capacity(ops.len());
        let mut total = 0u64;
        for op in ops {
            let local = self
                .local
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&op.local_region)
                .cloned()
                .ok_or(EngineError::UnknownLocalRegion(op.local_region))?;
            let remote = self.remote_region(&op.remote_engine, op.remote_region)?;
            check_runs(&op, &local, &remote)?;
            total += op.runs.iter().map(|run| run.len_bytes).sum::<u64>();
            batches.push((local, remote, op.runs));
        }
        if total <= INLINE_READ_BYTES {
            return Ok(ReadHandle::completed(copy_batches(&batches, fail_after)));
        }
        let (completer, handle) = ReadHandle::pending();
        let job: CopyJob = Box::new(move || completer.complete(copy_batches(&batches, fail_after)));
        if let Err(job) = self.worker.submit(job) {
            job();
        }
        Ok(handle)
    }

    fn read_remote_words(
        &self,
        remote_engine: &EngineKey,
        remote_region: u32,
        indices: &[u32],
    ) -> Result<Vec<u32>, EngineError> {
        let region = self.remote_region(remote_engine, remote_region)?;
        indices
            .iter()
            .map(|&index| {
                region
                    .load_u32(index as usize)
                    .map_err(|source| EngineError::Bounds {
                        side: "remote",
                        region: remote_region,
                        source,
                    })
            })
            .collect()
    }
}

type Batch = (Arc<Region>, Arc<Region>, Vec<ReadRun>);

/// Refuses a batch with any run outside its regions before a byte moves.
fn check_runs(op: &ReadOp, local: &Region, remote: &Region) -> Result<(), EngineError> {
    for run in &op.runs {
        let fits = |offset: u64, region: &Region| {
            offset
                .checked_add(run.len_bytes)
                .is_some_and(|end| end <= region.len() as u64)
        };
        for (side, region_id, offset, region) in [
            ("local", op.local_region, run.local_offset, local),
            ("remote", op.remote_region, run.remote_offset, remote),
        ] {
            if !fits(offset, region) {
                return Err(EngineError::Bounds {
                    side,
                    region: region_id,
                    source: crate::region::RegionError::OutOfBounds {
                        offset,
                        len: run.len_bytes,
                        region_len: region.len() as u64,
                    },
                });
            }
        }
    }
    Ok(())
}

/// Copies every run; with a fault armed, stops after `fail_after` bytes with an error.
fn copy_batches(batches: &[Batch], fail_after: u64) -> Result<ReadReport, EngineError> {
    let mut report = ReadReport::default();
    for (local, remote, runs) in batches {
        for run in runs {
            let len = run.len_bytes.min(fail_after.saturating_sub(report.bytes));
            local
                .copy_from(run.local_offset, remote, run.remote_offset, len)
                .map_err(|source| EngineError::Bounds {
                    side: "local",
                    region: 0,
                    source,
                })?;
            report.bytes += len;
            if len < run.len_bytes {
                return Err(EngineError::InjectedFault {
                    after_bytes: report.bytes,
                });
            }
            report.runs += 1;
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn pair() -> (LocalEngine, LocalEngine, Arc<Region>, Arc<Region>) {
        let fabric = LocalFabric::new();
        let prefill = LocalEngine::new(EngineKey("p".into()), fabric.clone()).unwrap();
        let decode = LocalEngine::new(EngineKey("d".into()), fabric).unwrap();
        let source = Arc::new(Region::heap(1024));
        let destination = Arc::new(Region::heap(1024));
        let descriptor = prefill.register(0, source.clone()).unwrap();
        decode.register(0, destination.clone()).unwrap();
        decode
            .register_remote(&prefill.descriptor(), &[descriptor])
            .unwrap();
        (prefill, decode, source, destination)
    }

    fn op(runs: Vec<ReadRun>) -> ReadOp {
        ReadOp {
            local_region: 0,
            remote_engine: EngineKey("p".into()),
            remote_region: 0,
            runs,
        }
    }

    #[test]
    fn batch_read_copies_every_run() {
        let (_, decode, source, destination) = pair();
        source.write(100, &[7; 32]).unwrap();
        source.write(500, &[9; 16]).unwrap();
        let runs = vec![
            ReadRun {
                local_offset: 0,
                remote_offset: 100,
                len_bytes: 32,
            },
            ReadRun {
                local_offset: 64,
                remote_offset: 500,
                len_bytes: 16,
            },
        ];
        let report = decode
            .batch_read(vec![op(runs)])
            .unwrap()
            .wait_blocking(Duration::from_secs(1))
            .unwrap();
        assert_eq!(report, ReadReport { bytes: 48, runs: 2 });
        let mut out = [0u8; 80];
        destination.read(0, &mut out).unwrap();
        assert_eq!(&out[..32], &[7; 32]);
        assert_eq!(&out[64..80], &[9; 16]);
        assert_eq!(&out[32..64], &[0; 32], "bytes between runs stay untouched");
    }

    #[test]
    fn large_batches_complete_on_the_copy_worker() {
        let fabric = LocalFabric::new();
        let prefill = LocalEngine::new(EngineKey("p".into()), fabric.clone()).unwrap();
        let decode = LocalEngine::new(EngineKey("d".into()), fabric).unwrap();
        let size = 4 * INLINE_READ_BYTES as usize;
        let source = Arc::new(Region::heap(size));
        let destination = Arc::new(Region::heap(size));
        let pattern: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        source.write(0, &pattern).unwrap();
        let descriptor = prefill.register(0, source).unwrap();
        decode.register(0, destination.clone()).unwrap();
        decode
            .register_remote(&prefill.descriptor(), &[descriptor])
            .unwrap();
        let runs = vec![ReadRun {
            local_offset: 0,
            remote_offset: 0,
            len_bytes: size as u64,
        }];
        let report = decode
            .batch_read(vec![op(runs)])
            .unwrap()
            .wait_blocking(Duration::from_secs(5))
            .unwrap();
        assert_eq!(report.bytes, size as u64);
        let mut copied = vec![0u8; size];
        destination.read(0, &mut copied).unwrap();
        assert!(copied == pattern);
    }

    #[test]
    fn injected_fault_stops_half_way_with_an_error() {
        let (_, decode, _, _) = pair();
        decode.fail_next_read_after(40);
        let runs = vec![
            ReadRun {
                local_offset: 0,
                remote_offset: 0,
                len_bytes: 32,
            },
            ReadRun {
                local_offset: 32,
                remote_offset: 32,
                len_bytes: 32,
            },
        ];
        let error = decode
            .batch_read(vec![op(runs.clone())])
            .unwrap()
            .wait_blocking(Duration::from_secs(1))
            .unwrap_err();
        assert_eq!(error, EngineError::InjectedFault { after_bytes: 40 });
        assert!(
            decode
                .batch_read(vec![op(runs)])
                .unwrap()
                .wait_blocking(Duration::from_secs(1))
                .is_ok()
        );
    }

    #[test]
    fn unknown_regions_and_out_of_bounds_runs_are_refused() {
        let (_, decode, _, _) = pair();
        let mut bad = op(vec![ReadRun {
            local_offset: 0,
            remote_offset: 1000,
            len_bytes: 64,
        }]);
        assert!(matches!(
            decode.batch_read(vec![bad.clone()]),
            Err(EngineError::Bounds { .. })
        ));
        bad.remote_region = 9;
        assert!(matches!(
            decode.batch_read(vec![bad]),
            Err(EngineError::UnknownRemoteRegion { .. })
        ));
    }
}
