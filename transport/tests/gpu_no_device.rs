//! GPU memory asked for on a host without an AMD GPU: a clear error, from the real HIP runtime.
#![cfg(feature = "hip")]

use pdkv_transport::gpu::GpuError;
use pdkv_transport::region::{Region, RegionError};

#[test]
fn without_a_gpu_the_error_says_so() {
    let has_gpu = std::path::Path::new("/dev/kfd").exists();
    match Region::gpu(0, 4096) {
        Ok(region) => assert!(has_gpu, "a GPU region on a host with no /dev/kfd: {region:?}"),
        Err(RegionError::Gpu(GpuError::NoDevice(message))) => {
            assert!(!has_gpu, "{message}");
            // Debian's (or ROCm's) HIP runtime answers hipErrorNoDevice, through the shim.
            assert!(
                message.contains("hipGetDeviceCount") && message.contains("hipErrorNoDevice"),
                "{message}"
            );
            assert_eq!(
                RegionError::Gpu(GpuError::NoDevice(message.clone())).to_string(),
                format!("no AMD GPU: {message}")
            );
        }
        Err(other) => panic!("expected NoDevice, got {other:?}"),
    }
}
