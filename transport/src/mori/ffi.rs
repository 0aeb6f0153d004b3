//! The mori shim's C functions (`transport/mori/pdkv_mori_shim.cpp`), loaded at run time.

use std::ffi::{CString, c_char, c_void};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use super::error::{self, MoriError, TransferCode, shim_code};
use crate::native::{self, MessageBuffer};

/// `pdkv_mori_rdma_config` in the shim.
#[repr(C)]
pub(crate) struct RdmaConfig {
    pub qp_per_transfer: i32,
    pub post_batch_size: i32,
    pub num_worker_threads: i32,
    pub poll_cq_mode: u32,
    pub enable_notification: u32,
}

type Err = *mut c_char;
type EngineNew = unsafe extern "C" fn(*const c_char, *const c_char, u16, *mut *mut c_void, Err, usize) -> i32;
type Free = unsafe extern "C" fn(*mut c_void);
type CreateRdma = unsafe extern "C" fn(*mut c_void, *const RdmaConfig, Err, usize) -> i32;
type Pack = unsafe extern "C" fn(*mut c_void, *mut u8, usize, *mut usize, Err, usize) -> i32;
type WithBlob = unsafe extern "C" fn(*mut c_void, *const u8, usize, Err, usize) -> i32;
type RegisterMemory = unsafe extern "C" fn(
    *mut c_void,
    *mut c_void,
    usize,
    i32,
    u32,
    *mut u8,
    usize,
    *mut usize,
    Err,
    usize,
) -> i32;
type SessionNew = unsafe extern "C" fn(
    *mut c_void,
    *const u8,
    usize,
    *const u8,
    usize,
    *mut *mut c_void,
    Err,
    usize,
) -> i32;
type Alive = unsafe extern "C" fn(*mut c_void) -> i32;
type StatusNew = unsafe extern "C" fn() -> *mut c_void;
type BatchRead = unsafe extern "C" fn(
    *mut c_void,
    *const u64,
    *const u64,
    *const u64,
    usize,
    *mut c_void,
    Err,
    usize,
) -> i32;
type StatusWait = unsafe extern "C" fn(*mut c_void, i32, Err, usize) -> u32;

/// The loaded shim: its functions, valid while `_library` lives (as long as the process, once
/// loaded).
pub(crate) struct Shim {
    _library: libloading::Library,
    engine_new: EngineNew,
    engine_free: Free,
    create_rdma_backend: CreateRdma,
    engine_desc: Pack,
    register_remote: WithBlob,
    deregister_remote: WithBlob,
    register_memory: RegisterMemory,
    deregister_memory: WithBlob,
    session_new: SessionNew,
    session_free: Free,
    session_alive: Alive,
    status_new: StatusNew,
    status_free: Free,
    batch_read: BatchRead,
    status_wait: StatusWait,
}

/// The file name of the shim.
pub(crate) const SHIM_FILE: &str = "libpdkv_mori_shim.so";

/// The shim, loaded on first use; every later call gets the same library or the same error.
pub(crate) fn shim() -> Result<Arc<Shim>, MoriError> {
    static SHIM: OnceLock<Result<Arc<Shim>, MoriError>> = OnceLock::new();
    SHIM.get_or_init(|| {
        let path = native::shim_path("PDKV_MORI_SHIM", SHIM_FILE, env!("PDKV_MORI_SHIM_BUILT"));
        Shim::load(path).map(Arc::new)
    })
    .clone()
}

impl Shim {
    fn load(path: PathBuf) -> Result<Self, MoriError> {
        let library = native::open(&path).map_err(|reason| MoriError::Library {
            shim: path.clone(),
            missing: native::missing_library(&reason),
            reason,
        })?;
        macro_rules! function {
            ($name:literal) => {
                // SAFETY: the type matches the shim's C declaration of this function.
                *unsafe { library.get(concat!($name, "\0").as_bytes()) }.map_err(
                    |symbol_error: libloading::Error| MoriError::Library {
                        shim: path.clone(),
                        missing: Some(format!(
                            "function {} (a shim from another pdkv version)",
                            $name
                        )),
                        reason: symbol_error.to_string(),
                    },
                )?
            };
        }
        Ok(Shim {
            engine_new: function!("pdkv_mori_engine_new"),
            engine_free: function!("pdkv_mori_engine_free"),
            create_rdma_backend: function!("pdkv_mori_create_rdma_backend"),
            engine_desc: function!("pdkv_mori_engine_desc"),
            register_remote: function!("pdkv_mori_register_remote"),
            deregister_remote: function!("pdkv_mori_deregister_remote"),
            register_memory: function!("pdkv_mori_register_memory"),
            deregister_memory: function!("pdkv_mori_deregister_memory"),
            session_new: function!("pdkv_mori_session_new"),
            session_free: function!("pdkv_mori_session_free"),
            session_alive: function!("pdkv_mori_session_alive"),
            status_new: function!("pdkv_mori_status_new"),
            status_free: function!("pdkv_mori_status_free"),
            batch_read: function!("pdkv_mori_session_batch_read"),
            status_wait: function!("pdkv_mori_status_wait"),
            _library: library,
        })
    }

    /// Runs a shim call that fills `message` on failure.
    fn call(&self, name: &'static str, body: impl FnOnce(Err, usize) -> i32) -> Result<(), (i32, String)> {
        let mut message = MessageBuffer::new();
        let capacity = message.capacity();
        match body(message.as_mut_ptr(), capacity) {
            shim_code::OK => Ok(()),
            code => {
                let text = message.text();
                tracing::debug!(call = name, code, message = %text, "mori shim call failed");
                Err((code, text))
            }
        }
    }

    /// A call whose output is packed bytes: retried once with the size the shim asks for.
    fn packed(
        &self,
        name: &'static str,
        mut body: impl FnMut(*mut u8, usize, *mut usize, Err, usize) -> i32,
    ) -> Result<Vec<u8>, (i32, String)> {
        let mut buffer = vec![0u8; 1024];
        for _ in 0..2 {
            let mut len = 0usize;
            match self.call(name, |err, cap| {
                body(buffer.as_mut_ptr(), buffer.len(), &mut len, err, cap)
            }) {
                Ok(()) => {
                    buffer.truncate(len);
                    return Ok(buffer);
                }
                Err((shim_code::BUFFER_TOO_SMALL, _)) => buffer = vec![0u8; len],
                Err(failure) => return Err(failure),
            }
        }
        Err((
            shim_code::BUFFER_TOO_SMALL,
            format!("{name}: the descriptor kept growing"),
        ))
    }

    pub(crate) fn engine_new(&self, key: &str, host: &str, port: u16) -> Result<*mut c_void, MoriError> {
        let text = |value: &str, what: &'static str| {
            CString::new(value).map_err(|_| MoriError::Call {
                call: "engine_new",
                message: format!("the {what} {value:?} holds a NUL byte"),
            })
        };
        let (key, host) = (text(key, "engine key")?, text(host, "host")?);
        let mut engine = std::ptr::null_mut();
        self.call("engine_new", |err, cap| {
            // SAFETY: valid C strings and out-pointer; the shim copies the strings.
            unsafe { (self.engine_new)(key.as_ptr(), host.as_ptr(), port, &mut engine, err, cap) }
        })
        .map_err(|(code, message)| error::from_shim("engine_new", code, message))?;
        Ok(engine)
    }

    /// # Safety
    /// `engine` came from [`Shim::engine_new`] and is freed once, after every session and status.
    pub(crate) unsafe fn engine_free(&self, engine: *mut c_void) {
        // SAFETY: as the caller promises.
        unsafe { (self.engine_free)(engine) }
    }

    pub(crate) fn create_rdma_backend(
        &self,
        engine: *mut c_void,
        config: &RdmaConfig,
    ) -> Result<(), MoriError> {
        self.call("create_rdma_backend", |err, cap| {
            // SAFETY: a live engine and a config that outlives the call.
            unsafe { (self.create_rdma_backend)(engine, config, err, cap) }
        })
        .map_err(|(code, message)| error::from_shim("create_rdma_backend", code, message))
    }

    pub(crate) fn engine_desc(&self, engine: *mut c_void) -> Result<Vec<u8>, MoriError> {
        self.packed("engine_desc", |out, cap, len, err, err_cap| {
            // SAFETY: a live engine; `out` holds `cap` bytes.
            unsafe { (self.engine_desc)(engine, out, cap, len, err, err_cap) }
        })
        .map_err(|(code, message)| error::from_shim("engine_desc", code, message))
    }

    /// Registers (or, with `register = false`, forgets) a peer's packed engine descriptor.
    pub(crate) fn remote(
        &self,
        engine: *mut c_void,
        packed: &[u8],
        register: bool,
        peer: &str,
    ) -> Result<(), MoriError> {
        let (name, function) = if register {
            ("register_remote", self.register_remote)
        } else {
            ("deregister_remote", self.deregister_remote)
        };
        self.call(name, |err, cap| {
            // SAFETY: a live engine; the shim copies the bytes.
            unsafe { function(engine, packed.as_ptr(), packed.len(), err, cap) }
        })
        .map_err(|(code, message)| descriptor_error(name, "engine", peer, code, message))
    }

    /// # Safety
    /// `ptr .. ptr + len` stays allocated until the matching [`Shim::deregister_memory`].
    pub(crate) unsafe fn register_memory(
        &self,
        engine: *mut c_void,
        ptr: *mut c_void,
        len: usize,
        device: i32,
        gpu: bool,
    ) -> Result<Vec<u8>, MoriError> {
        let location = if gpu { 2 } else { 1 };
        self.packed("register_memory", |out, cap, out_len, err, err_cap| {
            // SAFETY: a live engine; the memory outlives the registration (caller's promise).
            unsafe {
                (self.register_memory)(
                    engine, ptr, len, device, location, out, cap, out_len, err, err_cap,
                )
            }
        })
        .map_err(|(code, message)| error::from_shim("register_memory", code, message))
    }

    pub(crate) fn deregister_memory(&self, engine: *mut c_void, packed: &[u8]) -> Result<(), MoriError> {
        self.call("deregister_memory", |err, cap| {
            // SAFETY: a live engine; the shim copies the bytes.
            unsafe { (self.deregister_memory)(engine, packed.as_ptr(), packed.len(), err, cap) }
        })
        .map_err(|(code, message)| error::from_shim("deregister_memory", code, message))
    }

    /// A session from a local to a remote region, or why mori has none.
    pub(crate) fn session_new(
        &self,
        engine: *mut c_void,
        local: &[u8],
        remote: &[u8],
        peer: &str,
    ) -> Result<*mut c_void, (i32, MoriError)> {
        let mut session = std::ptr::null_mut();
        self.call("session_new", |err, cap| {
            // SAFETY: a live engine; the shim copies the bytes.
            unsafe {
                (self.session_new)(
                    engine,
                    local.as_ptr(),
                    local.len(),
                    remote.as_ptr(),
                    remote.len(),
                    &mut session,
                    err,
                    cap,
                )
            }
        })
        .map_err(|(code, message)| {
            (
                code,
                descriptor_error("session_new", "memory", peer, code, message),
            )
        })?;
        Ok(session)
    }

    /// # Safety
    /// `session` came from [`Shim::session_new`], is freed once, and has no READ in flight.
    pub(crate) unsafe fn session_free(&self, session: *mut c_void) {
        // SAFETY: as the caller promises.
        unsafe { (self.session_free)(session) }
    }

    pub(crate) fn session_alive(&self, session: *mut c_void) -> bool {
        // SAFETY: a live session.
        unsafe { (self.session_alive)(session) == 1 }
    }

    pub(crate) fn status_new(&self) -> Result<*mut c_void, MoriError> {
        // SAFETY: no arguments; null on allocation failure.
        let status = unsafe { (self.status_new)() };
        if status.is_null() {
            return Err(MoriError::Call {
                call: "status_new",
                message: "out of memory".into(),
            });
        }
        Ok(status)
    }

    /// # Safety
    /// `status` came from [`Shim::status_new`], is freed once, and no READ still reports to it.
    pub(crate) unsafe fn status_free(&self, status: *mut c_void) {
        // SAFETY: as the caller promises.
        unsafe { (self.status_free)(status) }
    }

    /// Posts one batch of runs (three equal-length arrays) reporting to `status`.
    ///
    /// # Safety
    /// `session` and `status` are live; `status` stays live until it leaves IN_PROGRESS; the
    /// local region stays registered and allocated until then.
    pub(crate) unsafe fn batch_read(
        &self,
        session: *mut c_void,
        local: &[u64],
        remote: &[u64],
        sizes: &[u64],
        status: *mut c_void,
    ) -> Result<(), MoriError> {
        debug_assert!(local.len() == remote.len() && remote.len() == sizes.len());
        self.call("batch_read", |err, cap| {
            // SAFETY: as the caller promises; the arrays hold `sizes.len()` entries and mori
            // copies them before returning.
            unsafe {
                (self.batch_read)(
                    session,
                    local.as_ptr(),
                    remote.as_ptr(),
                    sizes.as_ptr(),
                    sizes.len(),
                    status,
                    err,
                    cap,
                )
            }
        })
        .map_err(|(code, message)| error::from_shim("batch_read", code, message))
    }

    /// Waits at most `timeout_ms` (0: polls once) for `status`; its code, and mori's message if
    /// it failed.
    pub(crate) fn status_wait(&self, status: *mut c_void, timeout_ms: i32) -> (TransferCode, String) {
        let mut message = MessageBuffer::new();
        let capacity = message.capacity();
        // SAFETY: a live status.
        let code = unsafe { (self.status_wait)(status, timeout_ms, message.as_mut_ptr(), capacity) };
        (TransferCode::from_raw(code), message.text())
    }
}

/// A failure of a call that unpacked a peer's descriptor: malformed bytes are the peer's fault.
fn descriptor_error(
    call: &'static str,
    what: &'static str,
    peer: &str,
    code: i32,
    message: String,
) -> MoriError {
    if code == shim_code::NO_SESSION {
        return MoriError::Call { call, message };
    }
    if code == shim_code::EXCEPTION && error::is_unpack_error(&message) {
        return MoriError::BadDescriptor {
            what,
            peer: peer.to_string(),
            message,
        };
    }
    error::from_shim(call, code, message)
}
