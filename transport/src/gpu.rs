//! KV memory on AMD GPUs: device memory from HIP (`hipMalloc`), behind the `hip` feature.
//!
//! A GPU region is registered with mori as GPU memory, so the NIC reads it directly. The CPU
//! (pdkv's reference engine) reaches it only through staging copies (`hipMemcpy`): correct, not
//! fast, which is what a reference engine needs. The HIP calls go through a small C shim built
//! against HIP's header (`transport/hip/pdkv_hip_shim.c`) and loaded at node start, so a binary
//! built with the feature runs anywhere and says what is missing.

use std::path::PathBuf;

/// The HIP shim linked against a HIP whose one "GPU" is host memory
/// (`transport/hip/standin/hip_host_memory.c`), built beside the real shim so tests can run GPU
/// regions, and a whole cluster on them, without a GPU by pointing `PDKV_HIP_SHIM` at it.
#[cfg(feature = "hip")]
#[doc(hidden)]
pub const HOST_MEMORY_SHIM: &str = env!("PDKV_HIP_SHIM_HOST_MEMORY");

/// Why GPU memory could not be had or used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuError {
    /// This pdkv binary was built without the `hip` feature.
    #[error(
        "kv_memory = \"gpu\" needs a pdkv built with `--features hip` on a host with ROCm (README, \"AMD GPUs\")"
    )]
    NotBuilt,
    /// The HIP shim or the HIP runtime could not be loaded.
    #[error("cannot load the HIP shim {}: {}{reason}", shim.display(), missing.as_ref().map(|m| format!("{m} is missing; ")).unwrap_or_default())]
    Library {
        /// The shim's path.
        shim: PathBuf,
        /// What is missing, when the loader named it.
        missing: Option<String>,
        /// The loader's message.
        reason: String,
    },
    /// The HIP runtime found no GPU.
    #[error("no AMD GPU: {0}")]
    NoDevice(String),
    /// The configured device index is past the GPUs found.
    #[error("GPU {device} does not exist: HIP found {count}")]
    NoSuchDevice {
        /// The configured index.
        device: u32,
        /// GPUs found.
        count: u32,
    },
    /// A HIP call failed.
    #[error("{0}")]
    Hip(String),
    /// Device memory was asked for by pointer (only staging copies reach it).
    #[error("GPU memory is reached through staging copies, not by pointer")]
    NotHostAccessible,
}

/// Device memory: allocation, staging copies, release.
#[cfg(feature = "hip")]
pub mod device {
    use std::ffi::{c_char, c_void};
    use std::sync::{Arc, OnceLock};

    use super::GpuError;
    use crate::native::{self, MessageBuffer};

    type DeviceCount = unsafe extern "C" fn(*mut i32, *mut c_char, usize) -> i32;
    type Malloc = unsafe extern "C" fn(i32, usize, *mut *mut c_void, *mut c_char, usize) -> i32;
    type Free = unsafe extern "C" fn(i32, *mut c_void) -> i32;
    type Copy = unsafe extern "C" fn(*mut c_void, *const c_void, usize, i32, *mut c_char, usize) -> i32;

    const HOST_TO_DEVICE: i32 = 1;
    const DEVICE_TO_HOST: i32 = 2;
    const DEVICE_TO_DEVICE: i32 = 3;

    struct Shim {
        _library: libloading::Library,
        device_count: DeviceCount,
        malloc: Malloc,
        free: Free,
        copy: Copy,
    }

    fn shim() -> Result<Arc<Shim>, GpuError> {
        static SHIM: OnceLock<Result<Arc<Shim>, GpuError>> = OnceLock::new();
        SHIM.get_or_init(|| {
            let path = native::shim_path(
                "PDKV_HIP_SHIM",
                "libpdkv_hip_shim.so",
                env!("PDKV_HIP_SHIM_BUILT"),
            );
            let library = native::open(&path).map_err(|reason| GpuError::Library {
                shim: path.clone(),
                missing: native::missing_library(&reason),
                reason,
            })?;
            let symbol_error = |error: libloading::Error| GpuError::Library {
                shim: path.clone(),
                missing: Some("a function of the HIP shim (a shim from another pdkv version)".into()),
                reason: error.to_string(),
            };
            // SAFETY: each type matches the shim's C declaration.
            unsafe {
                Ok(Arc::new(Shim {
                    device_count: *library.get(b"pdkv_hip_device_count\0").map_err(symbol_error)?,
                    malloc: *library.get(b"pdkv_hip_malloc\0").map_err(symbol_error)?,
                    free: *library.get(b"pdkv_hip_free\0").map_err(symbol_error)?,
                    copy: *library.get(b"pdkv_hip_copy\0").map_err(symbol_error)?,
                    _library: library,
                }))
            }
        })
        .clone()
    }

    /// `len` zeroed bytes on GPU `device`.
    pub struct DeviceMemory {
        shim: Arc<Shim>,
        pub(crate) ptr: *mut c_void,
        pub(crate) device: i32,
        /// Allocated here (freed on drop), or another runtime's (left alone).
        owned: bool,
    }

    // SAFETY: device memory is an address on the GPU; every access is a synchronous HIP copy
    // that any thread may issue (HIP is thread-safe); exclusivity per block is kept above.
    unsafe impl Send for DeviceMemory {}
    // SAFETY: as above.
    unsafe impl Sync for DeviceMemory {}

    impl DeviceMemory {
        pub(crate) fn allocate(device: u32, len: usize) -> Result<Self, GpuError> {
            let shim = shim()?;
            let mut message = MessageBuffer::new();
            let capacity = message.capacity();
            let mut count = 0i32;
            // SAFETY: valid out-pointer and buffer.
            if unsafe { (shim.device_count)(&mut count, message.as_mut_ptr(), capacity) } != 0 || count <= 0 {
                return Err(GpuError::NoDevice(message.text()));
            }
            let index =
                i32::try_from(device)
                    .ok()
                    .filter(|&index| index < count)
                    .ok_or(GpuError::NoSuchDevice {
                        device,
                        count: count as u32,
                    })?;
            let mut ptr = std::ptr::null_mut();
            // SAFETY: valid out-pointer and buffer.
            if unsafe { (shim.malloc)(index, len.max(1), &mut ptr, message.as_mut_ptr(), capacity) } != 0 {
                return Err(GpuError::Hip(message.text()));
            }
            Ok(DeviceMemory {
                shim,
                ptr,
                device: index,
                owned: true,
            })
        }

        /// Device memory another runtime allocated (vLLM's KV tensors) on HIP device `device`,
        /// used in place and never freed here.
        pub(crate) fn borrow(ptr: *mut c_void, device: u32) -> Result<Self, GpuError> {
            let shim = shim()?;
            let device = i32::try_from(device).map_err(|_| GpuError::NoSuchDevice { device, count: 0 })?;
            Ok(DeviceMemory {
                shim,
                ptr,
                device,
                owned: false,
            })
        }

        fn copy(&self, dst: *mut c_void, src: *const c_void, len: usize, kind: i32) -> Result<(), GpuError> {
            let mut message = MessageBuffer::new();
            let capacity = message.capacity();
            // SAFETY: the caller bounds-checked both ranges.
            match unsafe { (self.shim.copy)(dst, src, len, kind, message.as_mut_ptr(), capacity) } {
                0 => Ok(()),
                _ => Err(GpuError::Hip(message.text())),
            }
        }

        /// Copies `dst.len()` bytes at `offset` (bounds checked by the caller) to the host.
        pub(crate) fn copy_out(&self, offset: usize, dst: *mut u8, len: usize) -> Result<(), GpuError> {
            // SAFETY: offset + len within the allocation (caller's check).
            let src = unsafe { self.ptr.cast::<u8>().add(offset) };
            self.copy(dst.cast(), src.cast(), len, DEVICE_TO_HOST)
        }

        /// Copies `len` host bytes into the allocation at `offset` (bounds checked by the caller).
        pub(crate) fn copy_in(&self, offset: usize, src: *const u8, len: usize) -> Result<(), GpuError> {
            // SAFETY: offset + len within the allocation (caller's check).
            let dst = unsafe { self.ptr.cast::<u8>().add(offset) };
            self.copy(dst.cast(), src.cast(), len, HOST_TO_DEVICE)
        }

        /// Copies `len` bytes between two device addresses (bounds checked by the caller).
        pub(crate) fn device_to_device(
            &self,
            dst: *mut u8,
            src: *const u8,
            len: usize,
        ) -> Result<(), GpuError> {
            self.copy(dst.cast(), src.cast(), len, DEVICE_TO_DEVICE)
        }
    }

    impl Drop for DeviceMemory {
        fn drop(&mut self) {
            if self.owned {
                // SAFETY: allocated by the shim on this device, freed once.
                unsafe { (self.shim.free)(self.device, self.ptr) };
            }
        }
    }
}
