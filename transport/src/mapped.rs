//! READ engines over mapped memory: both legs in one process (`local`), or on one host through
//! shared memory (`shm`).
//!
//! Either way the READ is a direct copy out of the prefill leg's registered region into the
//! decode leg's: truly one-sided, the prefill leg's threads never take part. In-process engines
//! find each other's regions through a shared [`LocalFabric`]. Shared-memory engines register
//! memfd-backed regions and advertise `(pid, fd)`; a peer that learned the descriptor through the
//! authenticated control plane opens `/proc/<pid>/fd/<fd>` and maps it read-only. Because a mapped
//! region can be read at any time, reuse safety comes from the generation words the transfer
//! actor reads after the copy.
//!
//! Small batches are copied inline; large ones on the engine's [`CopyWorker`]. A test can make the
//! next READ fail half-way ([`MappedEngine::fail_next_read_after`]) to prove partial transfers
//! fail closed.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use pdkv_core::plan::ReadRun;
use pdkv_core::wire::GrantId;

use crate::copy::{CopyJob, CopyWorker, INLINE_READ_BYTES};
use crate::engine::{
    EngineDescriptor, EngineError, EngineKey, EngineKind, LocalRegions, MemoryDescriptor, ReadEngine,
    ReadHandle, ReadOp, ReadReport, RegionHandle, WordsFuture, check_runs,
};
use crate::region::Region;

type RegionMap = HashMap<(EngineKey, u32), Arc<Region>>;

/// The regions of every in-process engine of this process.
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

/// Queue length of the copy worker (large READs waiting to be copied).
const COPY_QUEUE: usize = 64;

/// A READ engine over memory mapped into this process.
#[derive(Debug)]
pub struct MappedEngine {
    key: EngineKey,
    kind: EngineKind,
    /// In-process engines only.
    fabric: Option<LocalFabric>,
    local: LocalRegions,
    remote: Mutex<RegionMap>,
    fail_after_bytes: AtomicU64,
    worker: CopyWorker,
}

impl MappedEngine {
    /// An in-process engine named `key` on `fabric`.
    pub fn local(key: EngineKey, fabric: LocalFabric) -> Result<Self, EngineError> {
        Self::new(key, EngineKind::Local, Some(fabric))
    }

    /// A shared-memory engine named `key`; it registers only [`Region::shared`] regions.
    pub fn shm(key: EngineKey) -> Result<Self, EngineError> {
        Self::new(key, EngineKind::Shm, None)
    }

    fn new(key: EngineKey, kind: EngineKind, fabric: Option<LocalFabric>) -> Result<Self, EngineError> {
        let worker = CopyWorker::new(&format!("pdkv-copy-{key}"), COPY_QUEUE)
            .map_err(|error| EngineError::Io(error.to_string()))?;
        Ok(MappedEngine {
            key,
            kind,
            fabric,
            local: LocalRegions::default(),
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

    fn map_remote(
        &self,
        engine: &EngineDescriptor,
        descriptor: &MemoryDescriptor,
    ) -> Result<Arc<Region>, EngineError> {
        match (&self.fabric, &descriptor.handle) {
            (Some(fabric), RegionHandle::Local) => fabric
                .regions
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&(descriptor.engine.clone(), descriptor.region))
                .cloned()
                .ok_or_else(|| EngineError::UnknownRemoteRegion {
                    engine: descriptor.engine.clone(),
                    region: descriptor.region,
                }),
            (None, RegionHandle::Shm { pid, fd }) => {
                if *pid != engine.pid {
                    return Err(EngineError::Refused(format!(
                        "region {} claims pid {pid}, its engine runs as pid {}",
                        descriptor.region, engine.pid
                    )));
                }
                let path = PathBuf::from(format!("/proc/{pid}/fd/{fd}"));
                let len = usize::try_from(descriptor.len_bytes).map_err(|_| {
                    EngineError::Refused(format!("region {} is too large", descriptor.region))
                })?;
                Region::map_peer(&path, len)
                    .map(Arc::new)
                    .map_err(|source| EngineError::Bounds {
                        side: "remote",
                        region: descriptor.region,
                        source,
                    })
            }
            _ => Err(EngineError::Refused(format!(
                "region {} of {} has a {:?} handle, this engine reads {:?}",
                descriptor.region, descriptor.engine, descriptor.handle, self.kind
            ))),
        }
    }
}

impl ReadEngine for MappedEngine {
    fn key(&self) -> &EngineKey {
        &self.key
    }

    fn descriptor(&self) -> EngineDescriptor {
        EngineDescriptor {
            key: self.key.clone(),
            kind: self.kind,
            pid: std::process::id(),
            address: String::new(),
            packed: Vec::new(),
        }
    }

    fn register(&self, region_id: u32, region: Arc<Region>) -> Result<MemoryDescriptor, EngineError> {
        let handle = match (&self.fabric, region.shared_fd()) {
            (Some(_), _) => RegionHandle::Local,
            (None, Some(fd)) => RegionHandle::Shm {
                pid: std::process::id(),
                fd,
            },
            (None, None) => {
                return Err(EngineError::Refused(format!(
                    "region {region_id} is not in shared memory; shm engines register Region::shared regions"
                )));
            }
        };
        let len_bytes = region.len() as u64;
        self.local.insert(region_id, region.clone())?;
        if let Some(fabric) = &self.fabric {
            fabric
                .regions
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert((self.key.clone(), region_id), region);
        }
        Ok(MemoryDescriptor {
            engine: self.key.clone(),
            region: region_id,
            len_bytes,
            handle,
        })
    }

    fn register_remote(
        &self,
        engine: &EngineDescriptor,
        regions: &[MemoryDescriptor],
    ) -> Result<(), EngineError> {
        if engine.kind != self.kind {
            return Err(EngineError::WrongKind {
                engine: engine.key.clone(),
                found: engine.kind,
                expected: self.kind,
            });
        }
        let mut mapped = Vec::with_capacity(regions.len());
        for descriptor in regions {
            if descriptor.engine != engine.key {
                return Err(EngineError::Refused(format!(
                    "region {} belongs to {}, not {}",
                    descriptor.region, descriptor.engine, engine.key
                )));
            }
            mapped.push((
                (descriptor.engine.clone(), descriptor.region),
                self.map_remote(engine, descriptor)?,
            ));
        }
        self.remote
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(mapped);
        Ok(())
    }

    fn batch_read(&self, ops: Vec<ReadOp>) -> Result<ReadHandle, EngineError> {
        let fail_after = self.fail_after_bytes.swap(NO_FAULT, Ordering::SeqCst);
        let mut batches = Vec::with_capacity(ops.len());
        let mut total = 0u64;
        for op in ops {
            let local = self.local.get(op.local_region)?;
            let remote = self.remote_region(&op.remote_engine, op.remote_region)?;
            check_runs(&op, local.len() as u64, remote.len() as u64)?;
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

    fn read_remote_words<'a>(
        &'a self,
        remote_engine: &'a EngineKey,
        _grant: GrantId,
        remote_region: u32,
        indices: &'a [u32],
    ) -> WordsFuture<'a> {
        let result = self
            .remote_region(remote_engine, remote_region)
            .and_then(|region| {
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
            });
        Box::pin(std::future::ready(result))
    }
}

type Batch = (Arc<Region>, Arc<Region>, Vec<ReadRun>);

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

    fn local_pair() -> (MappedEngine, MappedEngine, Arc<Region>, Arc<Region>) {
        let fabric = LocalFabric::new();
        let prefill = MappedEngine::local(EngineKey("p".into()), fabric.clone()).unwrap();
        let decode = MappedEngine::local(EngineKey("d".into()), fabric).unwrap();
        connect(prefill, decode, Region::heap(1024), Region::heap(1024))
    }

    fn connect(
        prefill: MappedEngine,
        decode: MappedEngine,
        source: Region,
        destination: Region,
    ) -> (MappedEngine, MappedEngine, Arc<Region>, Arc<Region>) {
        let (source, destination) = (Arc::new(source), Arc::new(destination));
        let descriptor = prefill.register(0, source.clone()).unwrap();
        decode.register(0, destination.clone()).unwrap();
        decode
            .register_remote(&prefill.descriptor(), &[descriptor])
            .unwrap();
        (prefill, decode, source, destination)
    }

    fn op(runs: Vec<ReadRun>) -> ReadOp {
        ReadOp {
            grant: GrantId(1),
            local_region: 0,
            remote_engine: EngineKey("p".into()),
            remote_region: 0,
            runs,
        }
    }

    fn run(local_offset: u64, remote_offset: u64, len_bytes: u64) -> ReadRun {
        ReadRun {
            local_offset,
            remote_offset,
            len_bytes,
        }
    }

    #[test]
    fn batch_read_copies_every_run() {
        let (_, decode, source, destination) = local_pair();
        source.write(100, &[7; 32]).unwrap();
        source.write(500, &[9; 16]).unwrap();
        let runs = vec![run(0, 100, 32), run(64, 500, 16)];
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
    fn shm_engines_read_through_a_read_only_mapping() {
        let prefill = MappedEngine::shm(EngineKey("p".into())).unwrap();
        let decode = MappedEngine::shm(EngineKey("d".into())).unwrap();
        let (_, decode, source, destination) = connect(
            prefill,
            decode,
            Region::shared("p", 4096).unwrap(),
            Region::shared("d", 4096).unwrap(),
        );
        source.write(1000, &[3; 100]).unwrap();
        source.store_u32(7, 42).unwrap();
        decode
            .batch_read(vec![op(vec![run(0, 1000, 100)])])
            .unwrap()
            .wait_blocking(Duration::from_secs(1))
            .unwrap();
        let mut out = [0u8; 100];
        destination.read(0, &mut out).unwrap();
        assert_eq!(out, [3; 100]);
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let words = runtime
            .block_on(decode.read_remote_words(&EngineKey("p".into()), GrantId(1), 0, &[7, 8]))
            .unwrap();
        assert_eq!(words, vec![42, 0]);
        let heap_only = MappedEngine::shm(EngineKey("x".into())).unwrap();
        assert_eq!(
            heap_only.register(0, Arc::new(Region::heap(64))).unwrap_err(),
            EngineError::Refused(
                "region 0 is not in shared memory; shm engines register Region::shared regions".into()
            )
        );
    }

    #[test]
    fn large_batches_complete_on_the_copy_worker() {
        let size = 4 * INLINE_READ_BYTES as usize;
        let fabric = LocalFabric::new();
        let prefill = MappedEngine::local(EngineKey("p".into()), fabric.clone()).unwrap();
        let decode = MappedEngine::local(EngineKey("d".into()), fabric).unwrap();
        let (_, decode, source, destination) =
            connect(prefill, decode, Region::heap(size), Region::heap(size));
        let pattern: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        source.write(0, &pattern).unwrap();
        let report = decode
            .batch_read(vec![op(vec![run(0, 0, size as u64)])])
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
        let (_, decode, _, _) = local_pair();
        decode.fail_next_read_after(40);
        let runs = vec![run(0, 0, 32), run(32, 32, 32)];
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
        let (_, decode, _, _) = local_pair();
        let mut bad = op(vec![run(0, 1000, 64)]);
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
