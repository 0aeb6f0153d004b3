//! [`MoriEngine`]: pdkv's [`ReadEngine`] over mori's IO engine (RDMA READ between registered
//! regions, host or GPU memory).
//!
//! The bytes never pass through pdkv: a READ hands mori three arrays of (local offset, remote
//! offset, length) per region pair, and the NIC moves the bytes from the prefill leg's
//! registered region straight into the decode leg's. pdkv keeps what mori does not: bounds
//! checks against the regions, run batching, a bound on outstanding READs, and a completion
//! thread that keeps every mori `TransferStatus` alive until mori is done with it, even when the
//! reader gave up waiting.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pdkv_core::plan::ReadRun;
use pdkv_core::wire::GrantId;

use super::error::{MoriError, TransferCode};
use super::ffi::{self, RdmaConfig, Shim};
use super::runs::batch_runs;
use super::settings::{MoriSettings, PollMode};
use crate::engine::{
    EngineDescriptor, EngineError, EngineKey, EngineKind, MemoryDescriptor, ReadCompleter, ReadEngine,
    ReadHandle, ReadOp, ReadReport, RegionHandle, WordsFuture, check_kind, check_runs,
};
use crate::region::Region;

/// Region id of the engine's own scratch buffer that generation words are read into.
const SCRATCH_REGION: u32 = u32::MAX;
/// Words one generation READ moves at most (the scratch buffer's size / 4).
const SCRATCH_WORDS: usize = 16 * 1024;
/// How long a generation-word READ may take.
const WORDS_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a dropped engine waits for READs still in flight before leaking their statuses
/// (freeing a status mori still writes would be a use after free).
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// A mori engine handle, freed when the last session using it is gone.
struct RawEngine {
    shim: Arc<Shim>,
    ptr: *mut c_void,
}

// SAFETY: mori's IOEngine is used from many threads (its own workers, Python threads in vLLM);
// pdkv serialises the calls that mutate its maps (registration, sessions) behind its own locks.
unsafe impl Send for RawEngine {}
// SAFETY: as above.
unsafe impl Sync for RawEngine {}

impl RawEngine {
    /// A mori engine named `key` whose control plane listens on `host:port`.
    fn new(key: &EngineKey, host: &str, port: u16) -> Result<Arc<Self>, MoriError> {
        let shim = ffi::shim()?;
        Ok(Arc::new(RawEngine {
            ptr: shim.engine_new(&key.0, host, port)?,
            shim,
        }))
    }
}

impl Drop for RawEngine {
    fn drop(&mut self) {
        // SAFETY: created by engine_new, freed once; every session holds an Arc to this engine,
        // so none outlives it.
        unsafe { self.shim.engine_free(self.ptr) };
    }
}

/// A mori session between one local and one remote region.
struct Session {
    engine: Arc<RawEngine>,
    ptr: *mut c_void,
}

// SAFETY: a session is posted to from one thread at a time (the session map's lock is not held
// while posting, but mori's session posts are thread-safe: vLLM posts from many threads).
unsafe impl Send for Session {}
// SAFETY: as above.
unsafe impl Sync for Session {}

impl Drop for Session {
    fn drop(&mut self) {
        // SAFETY: every posted batch holds an Arc to its session until its statuses finished,
        // so no READ is in flight on it.
        unsafe { self.engine.shim.session_free(self.ptr) };
    }
}

/// A posted batch the completion thread watches.
struct Posted {
    statuses: Vec<(*mut c_void, Option<(TransferCode, String)>)>,
    completer: Option<ReadCompleter>,
    report: ReadReport,
    /// Keep the sessions and the local regions alive until mori is done.
    _sessions: Vec<Arc<Session>>,
    _regions: Vec<Arc<Region>>,
}

// SAFETY: the statuses are heap objects of the shim, owned by this batch alone.
unsafe impl Send for Posted {}

impl Posted {
    /// Advances every unfinished status (waiting at most `timeout_ms` on the first); true when all
    /// finished.
    fn progress(&mut self, shim: &Shim, timeout_ms: i32) -> bool {
        let mut wait = timeout_ms;
        for (status, done) in &mut self.statuses {
            if done.is_none() {
                let (code, message) = shim.status_wait(*status, wait);
                wait = 0;
                if code != TransferCode::InProgress && code != TransferCode::Init {
                    *done = Some((code, message));
                }
            }
        }
        self.statuses.iter().all(|(_, done)| done.is_some())
    }

    fn finish(mut self, shim: &Shim) {
        let failure = self.statuses.iter().find_map(|(_, done)| match done {
            Some((code, message)) if *code != TransferCode::Success => Some(MoriError::Transfer {
                code: *code,
                message: message.clone(),
            }),
            _ => None,
        });
        for (status, _) in self.statuses.drain(..) {
            // SAFETY: finished, so mori no longer writes it; freed once.
            unsafe { shim.status_free(status) };
        }
        if let Some(completer) = self.completer.take() {
            completer.complete(match failure {
                Some(error) => Err(error.into()),
                None => Ok(self.report),
            });
        }
    }

    /// Gives up on a batch mori never finished: its statuses are leaked, not freed.
    fn abandon(mut self) {
        self.statuses.clear();
        if let Some(completer) = self.completer.take() {
            completer.complete(Err(EngineError::Abandoned));
        }
        std::mem::forget(self._sessions.split_off(0));
        std::mem::forget(self._regions.split_off(0));
    }
}

/// A local region mori knows.
struct LocalRegion {
    region: Arc<Region>,
    packed: Vec<u8>,
}

/// A peer's engine: its packed descriptor and its regions' packed descriptors.
struct Remote {
    packed: Vec<u8>,
    regions: HashMap<u32, (u64, Vec<u8>)>,
}

/// The mori READ engine of one leg.
pub struct MoriEngine {
    key: EngineKey,
    engine: Arc<RawEngine>,
    packed: Vec<u8>,
    settings: MoriSettings,
    local: Mutex<HashMap<u32, LocalRegion>>,
    remotes: Mutex<HashMap<EngineKey, Remote>>,
    sessions: Mutex<HashMap<(u32, EngineKey, u32), Arc<Session>>>,
    in_flight: Arc<AtomicUsize>,
    posts: Option<SyncSender<Posted>>,
    completions: Option<JoinHandle<()>>,
    /// Registered host memory generation words are read into, one reader at a time.
    scratch: tokio::sync::Mutex<Arc<Region>>,
}

impl std::fmt::Debug for MoriEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoriEngine")
            .field("key", &self.key)
            .field("settings", &self.settings)
            .finish()
    }
}

impl MoriEngine {
    /// A mori engine named `key` whose control plane listens on `host` (`settings.port`), with
    /// an RDMA backend. Fails with what is missing: the shim or a library it needs
    /// ([`MoriError::Library`]), or an RDMA NIC ([`MoriError::NoRdmaNic`]).
    pub fn new(key: EngineKey, host: &str, settings: MoriSettings) -> Result<Self, MoriError> {
        let engine = RawEngine::new(&key, host, settings.port)?;
        let shim = &engine.shim;
        let positive = |value: u32| i32::try_from(value).unwrap_or(i32::MAX);
        shim.create_rdma_backend(
            engine.ptr,
            &RdmaConfig {
                qp_per_transfer: positive(settings.qp_per_transfer),
                post_batch_size: settings.post_batch_size,
                num_worker_threads: positive(settings.workers),
                poll_cq_mode: match settings.poll_mode {
                    PollMode::Polling => 0,
                    PollMode::Event => 1,
                },
                // pdkv signals completion on its own control plane, as vLLM does: mori's
                // notifications can poison statuses under load (mori-rocm.md §1).
                enable_notification: 0,
            },
        )?;
        Self::with_engine(key, engine, settings)
    }

    /// An engine without a backend: it registers memory and packs descriptors but has no route
    /// to READ over (the tests' view of mori on a host with no NIC).
    #[doc(hidden)]
    pub fn without_backend(key: EngineKey, host: &str, settings: MoriSettings) -> Result<Self, MoriError> {
        let engine = RawEngine::new(&key, host, settings.port)?;
        Self::with_engine(key, engine, settings)
    }

    fn with_engine(
        key: EngineKey,
        engine: Arc<RawEngine>,
        settings: MoriSettings,
    ) -> Result<Self, MoriError> {
        let packed = engine.shim.engine_desc(engine.ptr)?;
        let scratch = Arc::new(Region::heap(SCRATCH_WORDS * 4));
        let (posts, received) = std::sync::mpsc::sync_channel(settings.max_outstanding);
        let in_flight = Arc::new(AtomicUsize::new(0));
        let completions = {
            let (shim, in_flight) = (engine.shim.clone(), in_flight.clone());
            std::thread::Builder::new()
                .name(format!("pdkv-mori-{key}"))
                .spawn(move || complete(&shim, &received, &in_flight))
                .map_err(|error| MoriError::Call {
                    call: "spawn completion thread",
                    message: error.to_string(),
                })?
        };
        let this = MoriEngine {
            key,
            engine,
            packed,
            settings,
            local: Mutex::default(),
            remotes: Mutex::default(),
            sessions: Mutex::default(),
            in_flight,
            posts: Some(posts),
            completions: Some(completions),
            scratch: tokio::sync::Mutex::new(scratch.clone()),
        };
        this.register_region(SCRATCH_REGION, scratch)?;
        Ok(this)
    }

    /// The settings this engine runs with.
    pub fn settings(&self) -> &MoriSettings {
        &self.settings
    }

    fn register_region(&self, region_id: u32, region: Arc<Region>) -> Result<Vec<u8>, MoriError> {
        let (device, gpu) = match region.gpu_device() {
            Some(device) => (device, true),
            None => (-1, false),
        };
        // SAFETY: the Arc kept in `local` holds the memory until deregistration in Drop.
        let packed = unsafe {
            self.engine.shim.register_memory(
                self.engine.ptr,
                region.as_ptr().cast_mut().cast(),
                region.len(),
                device,
                gpu,
            )?
        };
        self.local.lock().unwrap_or_else(PoisonError::into_inner).insert(
            region_id,
            LocalRegion {
                region,
                packed: packed.clone(),
            },
        );
        Ok(packed)
    }

    /// The local region `local` and the length of `remote_region` of `peer`: what a READ's
    /// runs are checked against.
    fn lookup(
        &self,
        local: u32,
        peer: &EngineKey,
        remote_region: u32,
    ) -> Result<(Arc<Region>, u64), EngineError> {
        let region = self.local_region(local, |entry| entry.region.clone())?;
        let remote_len = self.remote_region(peer, remote_region)?.0;
        Ok((region, remote_len))
    }

    /// `part` of registered local region `local`.
    fn local_region<T>(&self, local: u32, part: impl FnOnce(&LocalRegion) -> T) -> Result<T, EngineError> {
        self.local
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&local)
            .map(part)
            .ok_or(EngineError::UnknownLocalRegion(local))
    }

    /// Length and packed descriptor of `remote_region` of `peer`.
    fn remote_region(&self, peer: &EngineKey, remote_region: u32) -> Result<(u64, Vec<u8>), EngineError> {
        self.remotes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(peer)
            .and_then(|remote| remote.regions.get(&remote_region).cloned())
            .ok_or_else(|| EngineError::UnknownRemoteRegion {
                engine: peer.clone(),
                region: remote_region,
            })
    }

    /// The session from local region `local` to `remote_region` of `peer`, opened (from both
    /// regions' packed descriptors) on first use and again if mori says it died.
    fn session(&self, local: u32, peer: &EngineKey, remote_region: u32) -> Result<Arc<Session>, EngineError> {
        let key = (local, peer.clone(), remote_region);
        let open = self
            .sessions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
            .filter(|session| self.engine.shim.session_alive(session.ptr))
            .cloned();
        if let Some(session) = open {
            return Ok(session);
        }
        // No lock is held from here on: `register_remote` takes `remotes` before `sessions`.
        let local_packed = self.local_region(local, |entry| entry.packed.clone())?;
        let (_, remote_packed) = self.remote_region(peer, remote_region)?;
        let ptr = self
            .engine
            .shim
            .session_new(self.engine.ptr, &local_packed, &remote_packed, &peer.0)
            .map_err(|(_, error)| match error {
                MoriError::Call {
                    call: "session_new",
                    message,
                } => MoriError::NoRoute {
                    local_region: local,
                    peer: peer.0.clone(),
                    remote_region,
                    message,
                },
                other => other,
            })?;
        let session = Arc::new(Session {
            engine: self.engine.clone(),
            ptr,
        });
        self.sessions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key, session.clone());
        Ok(session)
    }

    /// Posts `ops`, completed through the returned handle by the completion thread.
    fn post(&self, ops: Vec<ReadOp>) -> Result<ReadHandle, EngineError> {
        let limit = self.settings.max_outstanding;
        if self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .is_err()
        {
            return Err(MoriError::Saturated { limit }.into());
        }
        let (completer, handle) = ReadHandle::pending();
        let mut posted = Posted {
            statuses: Vec::with_capacity(ops.len()),
            completer: Some(completer),
            report: ReadReport::default(),
            _sessions: Vec::new(),
            _regions: Vec::new(),
        };
        let result = self.post_into(&mut posted, ops);
        if let Err(error) = result {
            // What was posted before the failure still completes into mori's statuses: the
            // completion thread reaps them; the reader gets this error now.
            posted.completer = None;
            self.hand_over(posted);
            return Err(error);
        }
        self.hand_over(posted);
        Ok(handle)
    }

    fn post_into(&self, posted: &mut Posted, ops: Vec<ReadOp>) -> Result<(), EngineError> {
        // Every run of every op is checked before the first is posted.
        let mut prepared = Vec::with_capacity(ops.len());
        for op in ops {
            let (region, remote_len) = self.lookup(op.local_region, &op.remote_engine, op.remote_region)?;
            check_runs(&op, region.len() as u64, remote_len)?;
            let session = self.session(op.local_region, &op.remote_engine, op.remote_region)?;
            prepared.push((
                session,
                region,
                batch_runs(&op.runs, self.settings.max_message_bytes),
            ));
        }
        for (session, region, runs) in prepared {
            if runs.is_empty() {
                continue;
            }
            let local: Vec<u64> = runs.iter().map(|run| run.local_offset).collect();
            let remote: Vec<u64> = runs.iter().map(|run| run.remote_offset).collect();
            let sizes: Vec<u64> = runs.iter().map(|run| run.len_bytes).collect();
            let status = self.engine.shim.status_new()?;
            // SAFETY: the status goes into `posted` (freed only once finished); the session and
            // the region are kept alive by `posted` until then.
            let result = unsafe {
                self.engine
                    .shim
                    .batch_read(session.ptr, &local, &remote, &sizes, status)
            };
            posted.statuses.push((status, None));
            posted._sessions.push(session);
            posted._regions.push(region);
            result?;
            posted.report.runs += runs.len();
            posted.report.bytes += sizes.iter().sum::<u64>();
        }
        Ok(())
    }

    fn hand_over(&self, posted: Posted) {
        match &self.posts {
            // The bound on in-flight batches is the channel's capacity, so this never blocks.
            Some(posts) => {
                if let Err(std::sync::mpsc::SendError(posted)) = posts.send(posted) {
                    posted.abandon();
                }
            }
            None => posted.abandon(),
        }
    }
}

/// The completion thread: waits on posted batches, completes their handles, frees their
/// statuses; when the engine is dropped, drains what is in flight for at most
/// [`DRAIN_TIMEOUT`].
fn complete(shim: &Shim, posts: &Receiver<Posted>, in_flight: &AtomicUsize) {
    let mut pending: VecDeque<Posted> = VecDeque::new();
    let mut closed_at: Option<Instant> = None;
    loop {
        if pending.is_empty() {
            if closed_at.is_some() {
                return;
            }
            match posts.recv_timeout(Duration::from_millis(100)) {
                Ok(posted) => pending.push_back(posted),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
        loop {
            match posts.try_recv() {
                Ok(posted) => pending.push_back(posted),
                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    closed_at.get_or_insert_with(Instant::now);
                    break;
                }
            }
        }
        let mut index = 0;
        while index < pending.len() {
            let wait = if index == 0 { 1 } else { 0 };
            if pending[index].progress(shim, wait) {
                if let Some(done) = pending.remove(index) {
                    // The slot is free before the reader hears of the completion: a reader
                    // that posts again at once must not find its own finished batch counted.
                    in_flight.fetch_sub(1, Ordering::AcqRel);
                    done.finish(shim);
                }
            } else {
                index += 1;
            }
        }
        if closed_at.is_some_and(|at| at.elapsed() > DRAIN_TIMEOUT) {
            tracing::warn!(
                batches = pending.len(),
                "mori READs still in flight at shutdown; their statuses are leaked"
            );
            for posted in pending.drain(..) {
                posted.abandon();
            }
            return;
        }
    }
}

impl Drop for MoriEngine {
    fn drop(&mut self) {
        self.posts = None;
        if let Some(thread) = self.completions.take() {
            let _ = thread.join();
        }
        self.sessions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        for (_, local) in self.local.lock().unwrap_or_else(PoisonError::into_inner).drain() {
            if let Err(error) = self.engine.shim.deregister_memory(self.engine.ptr, &local.packed) {
                tracing::warn!(%error, "mori: deregistering a region failed");
            }
        }
    }
}

impl ReadEngine for MoriEngine {
    fn key(&self) -> &EngineKey {
        &self.key
    }

    fn descriptor(&self) -> EngineDescriptor {
        EngineDescriptor {
            key: self.key.clone(),
            kind: EngineKind::Mori,
            pid: std::process::id(),
            address: String::new(),
            packed: self.packed.clone(),
        }
    }

    fn register(&self, region_id: u32, region: Arc<Region>) -> Result<MemoryDescriptor, EngineError> {
        if region_id == SCRATCH_REGION
            || self
                .local
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .contains_key(&region_id)
        {
            return Err(EngineError::DuplicateRegion(region_id));
        }
        let len_bytes = region.len() as u64;
        let packed = self.register_region(region_id, region)?;
        Ok(MemoryDescriptor {
            engine: self.key.clone(),
            region: region_id,
            len_bytes,
            handle: RegionHandle::Mori { packed },
        })
    }

    fn register_remote(
        &self,
        engine: &EngineDescriptor,
        regions: &[MemoryDescriptor],
    ) -> Result<(), EngineError> {
        check_kind(engine, EngineKind::Mori)?;
        let mut known = HashMap::with_capacity(regions.len());
        for region in regions {
            match &region.handle {
                RegionHandle::Mori { packed } if region.engine == engine.key => {
                    known.insert(region.region, (region.len_bytes, packed.clone()));
                }
                _ => {
                    return Err(EngineError::Refused(format!(
                        "region {} of {} is not a mori region of that engine",
                        region.region, engine.key
                    )));
                }
            }
        }
        let shim = &self.engine.shim;
        let mut remotes = self.remotes.lock().unwrap_or_else(PoisonError::into_inner);
        let same_engine = remotes
            .get(&engine.key)
            .is_some_and(|old| old.packed == engine.packed);
        if !same_engine {
            // A restarted peer: forget its old engine and every session to it.
            if let Some(old) = remotes.remove(&engine.key) {
                let _ = shim.remote(self.engine.ptr, &old.packed, false, &engine.key.0);
            }
            shim.remote(self.engine.ptr, &engine.packed, true, &engine.key.0)?;
        }
        self.sessions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|(_, peer, _), _| peer != &engine.key);
        remotes.insert(
            engine.key.clone(),
            Remote {
                packed: engine.packed.clone(),
                regions: known,
            },
        );
        Ok(())
    }

    fn batch_read(&self, ops: Vec<ReadOp>) -> Result<ReadHandle, EngineError> {
        self.post(ops)
    }

    fn read_remote_words<'a>(
        &'a self,
        remote_engine: &'a EngineKey,
        grant: GrantId,
        remote_region: u32,
        indices: &'a [u32],
    ) -> WordsFuture<'a> {
        Box::pin(async move {
            let scratch = self.scratch.lock().await;
            let mut words = Vec::with_capacity(indices.len());
            for chunk in indices.chunks(SCRATCH_WORDS) {
                let runs = chunk
                    .iter()
                    .enumerate()
                    .map(|(slot, &index)| ReadRun {
                        local_offset: slot as u64 * 4,
                        remote_offset: u64::from(index) * 4,
                        len_bytes: 4,
                    })
                    .collect();
                self.post(vec![ReadOp {
                    grant,
                    local_region: SCRATCH_REGION,
                    remote_engine: remote_engine.clone(),
                    remote_region,
                    runs,
                }])?
                .wait(WORDS_TIMEOUT)
                .await?;
                for slot in 0..chunk.len() {
                    words.push(scratch.load_u32(slot)?);
                }
            }
            Ok(words)
        })
    }
}
