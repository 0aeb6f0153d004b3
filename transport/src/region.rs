//! Registered memory: byte regions that READ engines copy between.
//!
//! A [`Region`] is a fixed-size, page-aligned span of memory that several parties touch at once
//! without locks, as registered GPU memory is: the leg's engine writes the blocks it owns while a
//! remote reader copies blocks it was granted. Exclusivity is per block and enforced above this
//! module (the allocator hands a block to one owner; a grant pins it; generations catch a block
//! that was freed under a reader). This module only guarantees that every access is in bounds.

use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::gpu::GpuError;

/// Memory that READ engines copy between.
pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
    /// A peer's region mapped for reading only: writes are refused, never attempted.
    read_only: bool,
    /// Keeps the memory alive.
    backing: Backing,
}

/// What owns a region's memory.
pub enum Backing {
    /// Process-private heap memory, page-aligned.
    Heap(PageAligned),
    /// This process's shared memory: a memfd mapped read-write.
    Shared {
        /// The mapping.
        map: memmap2::MmapMut,
        /// The memfd, whose descriptor a peer opens through /proc.
        file: File,
    },
    /// A peer's shared memory mapped read-only.
    PeerMapping(memmap2::Mmap),
    /// Host memory someone else owns and keeps alive (see [`Region::borrowed`]).
    Borrowed,
    /// AMD GPU memory (`hipMalloc`): reached by staging copies, never by pointer.
    #[cfg(feature = "hip")]
    Device(crate::gpu::device::DeviceMemory),
}

/// The device memory behind a region, if it is on a GPU.
#[cfg(feature = "hip")]
macro_rules! on_gpu {
    ($region:expr) => {
        match &$region.backing {
            Backing::Device(memory) => Some(memory),
            _ => None,
        }
    };
}

/// Zeroed heap memory starting on a page boundary, as shared memory and registered GPU memory do:
/// copies between regions then see the same alignment on both sides (the kernel's and libc's
/// copy loops run at half speed or worse when source and destination are misaligned to each
/// other).
pub struct PageAligned {
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
}

/// The alignment of heap regions.
const PAGE: usize = 4096;

impl PageAligned {
    fn zeroed(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len.max(1), PAGE)
            .unwrap_or_else(|_| panic!("a region of {len} bytes overflows the address space"));
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        PageAligned { ptr, layout }
    }
}

impl Drop for PageAligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

// SAFETY: a Region is a raw span of memory. All access goes through bounds-checked copies;
// concurrent access to the same bytes is excluded by block ownership above this module (see the
// module docs), exactly as for memory registered with an RDMA NIC.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region").field("len", &self.len).finish()
    }
}

impl Region {
    /// A zeroed heap region of `len` bytes.
    pub fn heap(len: usize) -> Self {
        let memory = PageAligned::zeroed(len);
        Region {
            ptr: memory.ptr,
            len,
            read_only: false,
            backing: Backing::Heap(memory),
        }
    }

    /// A zeroed region of `len` bytes in shared memory (a memfd), so a same-host peer can map it.
    pub fn shared(name: &str, len: usize) -> Result<Self, RegionError> {
        let file = memfd::MemfdOptions::default()
            .close_on_exec(true)
            .create(name)
            .map_err(|error| RegionError::Io(format!("shared region {name}: {error}")))?
            .into_file();
        file.set_len(len.max(1) as u64)
            .map_err(|error| RegionError::Io(format!("shared region {name}: {error}")))?;
        Self::map_shared(file, len, name)
    }

    /// Shared memory this process already holds open (a memfd another library created, such as
    /// KV tensors a Python process allocated with `os.memfd_create`), all of its current length,
    /// mapped read-write so a same-host peer can map it as it maps [`Region::shared`] memory.
    /// Refuses files that are not memfds: a peer could not open them through `/proc`.
    pub fn adopt_shared(file: File) -> Result<Self, RegionError> {
        let fd = file.as_raw_fd();
        let target = std::fs::read_link(format!("/proc/self/fd/{fd}"))
            .map_err(|error| RegionError::Io(format!("fd {fd}: {error}")))?;
        if !target.to_string_lossy().starts_with("/memfd:") {
            return Err(RegionError::Io(format!(
                "fd {fd} is {}, not a memfd: only memfd memory can be shared with a peer",
                target.display()
            )));
        }
        let len = file
            .metadata()
            .map_err(|error| RegionError::Io(format!("fd {fd}: {error}")))?
            .len();
        let len = usize::try_from(len).map_err(|_| RegionError::Io(format!("fd {fd}: {len} bytes")))?;
        if len == 0 {
            return Err(RegionError::Io(format!("fd {fd} is an empty memfd")));
        }
        Self::map_shared(file, len, &target.to_string_lossy())
    }

    fn map_shared(file: File, len: usize, name: &str) -> Result<Self, RegionError> {
        let io = |error: std::io::Error| RegionError::Io(format!("shared region {name}: {error}"));
        // SAFETY: the memfd belongs to this process; peers map it read-only; the mapping lives as
        // long as the region.
        let mut map = unsafe { memmap2::MmapMut::map_mut(&file) }.map_err(io)?;
        let ptr = NonNull::new(map.as_mut_ptr()).ok_or_else(|| RegionError::Io("null mapping".into()))?;
        Ok(Region {
            ptr,
            len,
            read_only: false,
            backing: Backing::Shared { map, file },
        })
    }

    /// Host memory this process owns elsewhere (KV tensors another runtime allocated), used in
    /// place: engines copy into and out of it, and the network engine serves it.
    ///
    /// # Safety
    /// `ptr .. ptr + len` must be valid, writable host memory of this process for as long as the
    /// region (or any clone of its `Arc`) lives, and nothing may free or remap it meanwhile.
    pub unsafe fn borrowed(ptr: *mut u8, len: usize) -> Result<Self, RegionError> {
        let ptr = NonNull::new(ptr).ok_or_else(|| RegionError::Io("borrowed memory at null".into()))?;
        if len == 0 {
            return Err(RegionError::Io("borrowed memory of 0 bytes".into()));
        }
        Ok(Region {
            ptr,
            len,
            read_only: false,
            backing: Backing::Borrowed,
        })
    }

    /// `len` zeroed bytes of memory on AMD GPU `device` (HIP device index). Fails naming what is
    /// missing: the `hip` feature, the HIP runtime, a GPU, or the device.
    pub fn gpu(device: u32, len: usize) -> Result<Self, RegionError> {
        #[cfg(feature = "hip")]
        {
            let memory = crate::gpu::device::DeviceMemory::allocate(device, len)?;
            let ptr = NonNull::new(memory.ptr.cast::<u8>())
                .ok_or(GpuError::Hip("hipMalloc returned null".into()))?;
            Ok(Self::on_device(ptr, len, memory))
        }
        #[cfg(not(feature = "hip"))]
        {
            let _ = (device, len);
            Err(GpuError::NotBuilt.into())
        }
    }

    /// Memory on AMD GPU `device` that another runtime allocated (vLLM's KV tensors), used in
    /// place: mori registers it, other engines reach it by staging copies.
    ///
    /// # Safety
    /// `ptr .. ptr + len` must be device memory of HIP device `device`, valid for as long as the
    /// region (or any clone of its `Arc`) lives.
    pub unsafe fn borrowed_device(ptr: *mut u8, len: usize, device: u32) -> Result<Self, RegionError> {
        #[cfg(feature = "hip")]
        {
            let ptr = NonNull::new(ptr).ok_or_else(|| RegionError::Io("device memory at null".into()))?;
            if len == 0 {
                return Err(RegionError::Io("device memory of 0 bytes".into()));
            }
            let memory = crate::gpu::device::DeviceMemory::borrow(ptr.as_ptr().cast(), device)?;
            Ok(Self::on_device(ptr, len, memory))
        }
        #[cfg(not(feature = "hip"))]
        {
            let _ = (ptr, len, device);
            Err(GpuError::NotBuilt.into())
        }
    }

    #[cfg(feature = "hip")]
    fn on_device(ptr: NonNull<u8>, len: usize, memory: crate::gpu::device::DeviceMemory) -> Self {
        Region {
            ptr,
            len,
            read_only: false,
            backing: Backing::Device(memory),
        }
    }

    /// Maps a peer's shared region read-only from `path` (`/proc/<pid>/fd/<fd>`), checking it
    /// holds at least `len` bytes.
    pub fn map_peer(path: &Path, len: usize) -> Result<Self, RegionError> {
        let io = |error: std::io::Error| RegionError::Io(format!("{}: {error}", path.display()));
        let file = File::open(path).map_err(io)?;
        let actual = file.metadata().map_err(io)?.len();
        if actual < len as u64 {
            return Err(RegionError::Io(format!(
                "{}: holds {actual} bytes, descriptor says {len}",
                path.display()
            )));
        }
        // SAFETY: read-only shared mapping of a memfd the peer keeps alive; the peer writes
        // blocks it owns while we read blocks we were granted (generations catch violations).
        let map = unsafe { memmap2::MmapOptions::new().len(len.max(1)).map(&file) }.map_err(io)?;
        let ptr =
            NonNull::new(map.as_ptr().cast_mut()).ok_or_else(|| RegionError::Io("null mapping".into()))?;
        Ok(Region {
            ptr,
            len,
            read_only: true,
            backing: Backing::PeerMapping(map),
        })
    }

    /// The memfd descriptor of a shared region (what a peer opens), if the region is one.
    pub fn shared_fd(&self) -> Option<RawFd> {
        match &self.backing {
            Backing::Shared { file, .. } => Some(file.as_raw_fd()),
            _ => None,
        }
    }

    /// Whether writes are refused.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Refuses pointer access to GPU memory.
    fn check_host(&self) -> Result<(), RegionError> {
        #[cfg(feature = "hip")]
        if on_gpu!(self).is_some() {
            return Err(GpuError::NotHostAccessible.into());
        }
        Ok(())
    }

    fn check_writable(&self) -> Result<(), RegionError> {
        if self.read_only {
            Err(RegionError::ReadOnly)
        } else {
            Ok(())
        }
    }

    /// The bytes at `offset .. offset + len`, borrowed.
    ///
    /// # Safety
    /// No one may write these bytes while the borrow lives (the block's owner or a grant
    /// guarantees it).
    pub unsafe fn bytes(&self, offset: u64, len: usize) -> Result<&[u8], RegionError> {
        self.check_host()?;
        let start = self.check(offset, len)?;
        // SAFETY: in bounds; exclusivity is the caller's promise.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(start), len) })
    }

    /// The bytes at `offset .. offset + len`, mutably borrowed (network READs land here).
    ///
    /// # Safety
    /// No one else may read or write these bytes while the borrow lives (the decode leg owns the
    /// destination blocks of a READ).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, offset: u64, len: usize) -> Result<&mut [u8], RegionError> {
        self.check_writable()?;
        self.check_host()?;
        let start = self.check(offset, len)?;
        // SAFETY: in bounds and writable; exclusivity is the caller's promise.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(start), len) })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Base address (for engines that register memory with hardware).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The AMD GPU the region's memory is on, or `None` for host memory (engines that register
    /// memory with hardware say where it is).
    pub fn gpu_device(&self) -> Option<i32> {
        #[cfg(feature = "hip")]
        if let Some(memory) = on_gpu!(self) {
            return Some(memory.device);
        }
        None
    }

    fn check(&self, offset: u64, len: usize) -> Result<usize, RegionError> {
        let start = usize::try_from(offset).map_err(|_| RegionError::OutOfBounds {
            offset,
            len: len as u64,
            region_len: self.len as u64,
        })?;
        match start.checked_add(len) {
            Some(end) if end <= self.len => Ok(start),
            _ => Err(RegionError::OutOfBounds {
                offset,
                len: len as u64,
                region_len: self.len as u64,
            }),
        }
    }

    /// Copies `dst.len()` bytes at `offset` out of the region.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), RegionError> {
        let start = self.check(offset, dst.len())?;
        #[cfg(feature = "hip")]
        if let Some(memory) = on_gpu!(self) {
            return Ok(memory.copy_out(start, dst.as_mut_ptr(), dst.len())?);
        }
        // SAFETY: bounds checked; dst is a distinct Rust allocation.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(start), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into the region at `offset`.
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), RegionError> {
        self.check_writable()?;
        let start = self.check(offset, src.len())?;
        #[cfg(feature = "hip")]
        if let Some(memory) = on_gpu!(self) {
            return Ok(memory.copy_in(start, src.as_ptr(), src.len())?);
        }
        // SAFETY: bounds checked; src is a distinct Rust allocation.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(start), src.len()) };
        Ok(())
    }

    /// Copies `dst.len()` f32 values at `offset` (native byte order) out of the region.
    pub fn read_f32s(&self, offset: u64, dst: &mut [f32]) -> Result<(), RegionError> {
        let bytes = std::mem::size_of_val(dst);
        let start = self.check(offset, bytes)?;
        #[cfg(feature = "hip")]
        if let Some(memory) = on_gpu!(self) {
            return Ok(memory.copy_out(start, dst.as_mut_ptr().cast(), bytes)?);
        }
        // SAFETY: bounds checked; any bit pattern is a valid f32; byte-wise copy needs no alignment.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(start), dst.as_mut_ptr().cast::<u8>(), bytes)
        };
        Ok(())
    }

    /// Copies `src` f32 values into the region at `offset` (native byte order).
    pub fn write_f32s(&self, offset: u64, src: &[f32]) -> Result<(), RegionError> {
        self.check_writable()?;
        let bytes = std::mem::size_of_val(src);
        let start = self.check(offset, bytes)?;
        #[cfg(feature = "hip")]
        if let Some(memory) = on_gpu!(self) {
            return Ok(memory.copy_in(start, src.as_ptr().cast(), bytes)?);
        }
        // SAFETY: bounds checked; byte-wise copy needs no alignment.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr().cast::<u8>(), self.ptr.as_ptr().add(start), bytes)
        };
        Ok(())
    }

    /// Copies `len` bytes from `src` at `src_offset` into this region at `dst_offset`.
    pub fn copy_from(
        &self,
        dst_offset: u64,
        src: &Region,
        src_offset: u64,
        len: u64,
    ) -> Result<(), RegionError> {
        let len_usize = usize::try_from(len).map_err(|_| RegionError::OutOfBounds {
            offset: dst_offset,
            len,
            region_len: self.len as u64,
        })?;
        let dst_start = self.check(dst_offset, len_usize)?;
        let src_start = src.check(src_offset, len_usize)?;
        if std::ptr::eq(self, src) {
            let (a, b) = (dst_start, src_start);
            if a < b + len_usize && b < a + len_usize {
                return Err(RegionError::Overlap);
            }
        }
        #[cfg(feature = "hip")]
        match (on_gpu!(self), on_gpu!(src)) {
            (None, None) => {}
            (Some(dst), None) => {
                // SAFETY: bounds checked above.
                let from = unsafe { src.ptr.as_ptr().add(src_start) };
                return Ok(dst.copy_in(dst_start, from, len_usize)?);
            }
            (None, Some(from)) => {
                // SAFETY: bounds checked above.
                let to = unsafe { self.ptr.as_ptr().add(dst_start) };
                return Ok(from.copy_out(src_start, to, len_usize)?);
            }
            (Some(dst), Some(_)) => {
                // SAFETY: bounds checked above; device addresses, never dereferenced here.
                let (to, from) =
                    unsafe { (self.ptr.as_ptr().add(dst_start), src.ptr.as_ptr().add(src_start)) };
                return Ok(dst.device_to_device(to, from, len_usize)?);
            }
        }
        // SAFETY: both ranges bounds checked and, within one region, disjoint.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.ptr.as_ptr().add(src_start),
                self.ptr.as_ptr().add(dst_start),
                len_usize,
            )
        };
        Ok(())
    }

    /// The `index`th 32-bit word as an atomic (generation tables live in regions).
    pub fn atomic_u32(&self, index: usize) -> Result<&AtomicU32, RegionError> {
        self.check_host()?;
        let offset = index.checked_mul(4).ok_or(RegionError::OutOfBounds {
            offset: u64::MAX,
            len: 4,
            region_len: self.len as u64,
        })?;
        let start = self.check(offset as u64, 4)?;
        // SAFETY: in bounds; the base is 8-aligned and `start` a multiple of 4, so the word is
        // aligned; AtomicU32 has the size and alignment of u32 and lives as long as `self`.
        Ok(unsafe { &*self.ptr.as_ptr().add(start).cast::<AtomicU32>() })
    }

    /// Loads the `index`th 32-bit word with acquire ordering.
    pub fn load_u32(&self, index: usize) -> Result<u32, RegionError> {
        Ok(self.atomic_u32(index)?.load(Ordering::Acquire))
    }

    /// Stores the `index`th 32-bit word with release ordering.
    pub fn store_u32(&self, index: usize, value: u32) -> Result<(), RegionError> {
        self.check_writable()?;
        self.atomic_u32(index)?.store(value, Ordering::Release);
        Ok(())
    }
}

/// A region access outside its bounds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegionError {
    /// The range does not lie inside the region.
    #[error("range {offset}+{len} is outside the region of {region_len} bytes")]
    OutOfBounds {
        /// Start offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Region length.
        region_len: u64,
    },
    /// A copy within one region whose source and destination overlap.
    #[error("source and destination ranges overlap")]
    Overlap,
    /// A write to a peer's region mapped read-only.
    #[error("region is mapped read-only")]
    ReadOnly,
    /// Creating or mapping shared memory failed.
    #[error("{0}")]
    Io(String),
    /// GPU memory could not be had or was asked for by pointer.
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn borrowed_memory_is_used_in_place() {
        let mut owner = vec![0u8; 64];
        // SAFETY: `owner` outlives the region and is not touched while the region is used.
        let region = unsafe { Region::borrowed(owner.as_mut_ptr(), owner.len()) }.unwrap();
        region.write(10, &[1, 2, 3]).unwrap();
        let mut out = [0u8; 3];
        region.read(10, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3]);
        assert!(
            region.shared_fd().is_none(),
            "borrowed memory cannot be mapped by a peer"
        );
        assert!(region.write(62, &[0; 3]).is_err(), "bounds hold");
        drop(region);
        assert_eq!(
            &owner[10..13],
            &[1, 2, 3],
            "the bytes landed in the owner's memory"
        );
        // SAFETY: rejected before use.
        assert!(unsafe { Region::borrowed(std::ptr::null_mut(), 8) }.is_err());
    }

    #[test]
    fn an_adopted_memfd_shares_its_bytes_and_other_files_are_refused() {
        let file = memfd::MemfdOptions::default()
            .create("adopted")
            .unwrap()
            .into_file();
        file.set_len(8192).unwrap();
        // SAFETY: a fresh memfd owned by this test.
        let mut theirs = unsafe { memmap2::MmapMut::map_mut(&file) }.unwrap();
        theirs[4100] = 7;
        let region = Region::adopt_shared(file.try_clone().unwrap()).unwrap();
        assert_eq!(region.len(), 8192);
        assert!(region.shared_fd().is_some());
        let mut byte = [0u8; 1];
        region.read(4100, &mut byte).unwrap();
        assert_eq!(byte, [7], "the adopted mapping sees the creator's write");
        region.write(5, &[9]).unwrap();
        assert_eq!(theirs[5], 9, "the creator sees the adopted mapping's write");

        let empty = memfd::MemfdOptions::default()
            .create("empty")
            .unwrap()
            .into_file();
        assert!(
            matches!(Region::adopt_shared(empty), Err(RegionError::Io(message)) if message.contains("empty"))
        );
        let plain = File::open("/proc/self/exe").unwrap();
        assert!(
            matches!(Region::adopt_shared(plain), Err(RegionError::Io(message)) if message.contains("not a memfd"))
        );
    }

    #[test]
    fn copies_stay_in_bounds() {
        let a = Region::heap(64);
        let b = Region::heap(64);
        a.write(8, &[1, 2, 3, 4]).unwrap();
        b.copy_from(60, &a, 8, 4).unwrap();
        let mut out = [0u8; 4];
        b.read(60, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3, 4]);
        assert_eq!(
            b.copy_from(61, &a, 8, 4),
            Err(RegionError::OutOfBounds {
                offset: 61,
                len: 4,
                region_len: 64
            })
        );
        assert_eq!(
            a.read(u64::MAX, &mut out),
            Err(RegionError::OutOfBounds {
                offset: u64::MAX,
                len: 4,
                region_len: 64
            })
        );
        assert_eq!(a.copy_from(0, &a, 2, 4), Err(RegionError::Overlap));
    }

    #[test]
    fn a_peer_mapping_sees_writes_and_refuses_its_own() {
        let owner = Region::shared("pdkv-test", 4096).unwrap();
        let fd = owner.shared_fd().unwrap();
        let path = format!("/proc/{}/fd/{fd}", std::process::id());
        let peer = Region::map_peer(Path::new(&path), 4096).unwrap();
        owner.write(100, &[5, 6, 7]).unwrap();
        let mut out = [0u8; 3];
        peer.read(100, &mut out).unwrap();
        assert_eq!(out, [5, 6, 7]);
        assert_eq!(peer.write(0, &[1]), Err(RegionError::ReadOnly));
        assert_eq!(
            Region::map_peer(Path::new(&path), 8192).unwrap_err(),
            RegionError::Io(format!("{path}: holds 4096 bytes, descriptor says 8192")),
            "a descriptor longer than the memfd is refused"
        );
    }

    #[test]
    fn words_are_atomic_and_aligned() {
        let region = Region::heap(12);
        region.store_u32(2, 7).unwrap();
        assert_eq!(region.load_u32(2).unwrap(), 7);
        assert_eq!(
            region.load_u32(3),
            Err(RegionError::OutOfBounds {
                offset: 12,
                len: 4,
                region_len: 12
            })
        );
    }
}
