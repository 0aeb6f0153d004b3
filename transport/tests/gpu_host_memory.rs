//! GPU regions through every staging-copy path, on a HIP whose one GPU is host memory.
//!
//! The HIP shim is the real one (built against HIP's header), linked in a second copy against
//! `hip/standin/hip_host_memory.c` (`build.rs`); this test binary loads that copy. What it checks
//! is pdkv's side: offsets and lengths of every copy, bounds, and that GPU memory is never
//! reached by pointer.
#![cfg(feature = "hip")]

use pdkv_transport::gpu::GpuError;
use pdkv_transport::region::{Region, RegionError};

fn gpu(len: usize) -> Region {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: set once, before the first GPU region loads the shim; nothing else in this test
    // binary reads the environment concurrently.
    ONCE.call_once(|| unsafe { std::env::set_var("PDKV_HIP_SHIM", pdkv_transport::gpu::HOST_MEMORY_SHIM) });
    Region::gpu(0, len).unwrap()
}

#[test]
fn staging_copies_land_at_the_right_offsets_in_every_direction() {
    let device = gpu(4096);
    assert_eq!(device.gpu_device(), Some(0));
    device.write(100, &[1, 2, 3, 4]).unwrap();
    let mut out = [0u8; 6];
    device.read(99, &mut out).unwrap();
    assert_eq!(out, [0, 1, 2, 3, 4, 0], "zeroed at allocation, written at 100");

    device.write_f32s(512, &[1.5, -2.0]).unwrap();
    let mut floats = [0f32; 2];
    device.read_f32s(512, &mut floats).unwrap();
    assert_eq!(floats, [1.5, -2.0]);

    // Host to device, device to host, device to device.
    let host = Region::heap(4096);
    host.write(8, &[9, 8, 7]).unwrap();
    device.copy_from(2000, &host, 8, 3).unwrap();
    let other = gpu(4096);
    other.copy_from(10, &device, 2000, 3).unwrap();
    let back = Region::heap(64);
    back.copy_from(1, &other, 10, 3).unwrap();
    let mut out = [0u8; 5];
    back.read(0, &mut out).unwrap();
    assert_eq!(out, [0, 9, 8, 7, 0]);
}

#[test]
fn gpu_memory_is_bounds_checked_and_never_reached_by_pointer() {
    let device = gpu(64);
    assert_eq!(
        device.write(62, &[1, 2, 3]),
        Err(RegionError::OutOfBounds {
            offset: 62,
            len: 3,
            region_len: 64
        })
    );
    let host = Region::heap(64);
    assert!(matches!(
        host.copy_from(0, &device, 60, 8),
        Err(RegionError::OutOfBounds { .. })
    ));
    // SAFETY: refused before any borrow is made.
    assert_eq!(
        unsafe { device.bytes(0, 8) }.unwrap_err(),
        RegionError::Gpu(GpuError::NotHostAccessible)
    );
    assert_eq!(
        device.load_u32(0),
        Err(RegionError::Gpu(GpuError::NotHostAccessible))
    );
    assert_eq!(
        Region::gpu(3, 64).unwrap_err(),
        RegionError::Gpu(GpuError::NoSuchDevice { device: 3, count: 1 })
    );
}

#[test]
fn borrowed_device_memory_is_reached_in_place_and_left_to_its_owner() {
    let owner = gpu(4096);
    // SAFETY: `owner` outlives `borrowed` and is the device memory of GPU 0.
    let borrowed = unsafe { Region::borrowed_device(owner.as_ptr().cast_mut(), 4096, 0) }.unwrap();
    assert_eq!(borrowed.gpu_device(), Some(0));
    borrowed.write(300, &[5, 6, 7]).unwrap();
    let mut out = [0u8; 3];
    owner.read(300, &mut out).unwrap();
    assert_eq!(out, [5, 6, 7], "one memory seen through both regions");
    drop(borrowed);
    owner.read(300, &mut out).unwrap();
    assert_eq!(
        out,
        [5, 6, 7],
        "dropping the borrow did not free the owner's memory"
    );
    // SAFETY: rejected before use.
    let null = unsafe { Region::borrowed_device(std::ptr::null_mut(), 8, 0) };
    assert!(matches!(null, Err(RegionError::Io(_))));
}
