//! The mori engine on a host without ROCm 7: it refuses to start and names the missing library.
//! (Its own test binary: the no-device stand-ins another test preloads would hide the fault.)
#![cfg(feature = "mori")]

use pdkv_transport::engine::EngineKey;
use pdkv_transport::mori::{MoriEngine, MoriError, MoriSettings};

#[test]
fn without_rocm_7_the_engine_names_the_missing_runtime() {
    // SAFETY: probing whether the loader finds ROCm 7's HIP runtime on this host.
    let rocm7 = unsafe { libloading::Library::new("libamdhip64.so.7") }.is_ok();
    let result = MoriEngine::new(EngineKey("p".into()), "127.0.0.1", MoriSettings::default());
    if rocm7 {
        // A ROCm 7 host: mori loads, and either an RDMA NIC answers or the error names it.
        assert!(
            matches!(result, Ok(_) | Err(MoriError::NoRdmaNic(_))),
            "{:?}",
            result.err()
        );
        return;
    }
    match result.unwrap_err() {
        MoriError::Library { missing, reason, .. } => {
            assert!(reason.contains("libamdhip64.so.7"), "{reason}");
            assert_eq!(missing.as_deref(), Some("libamdhip64.so.7 (ROCm's HIP runtime)"));
        }
        other => panic!("expected a Library error, got {other:?}"),
    }
}
