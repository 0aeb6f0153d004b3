//! pdkv's mori engine end to end over the loopback stand-in of its shim
//! (`transport/mori/standin/loopback_shim.c`): a READ is a memcpy inside this process, completed
//! later on a thread of its own, as a NIC completes posted work. What runs for real is all of
//! pdkv's side: descriptors, sessions, bounds checks, run batching, the completion thread that
//! owns mori's statuses, the bound on outstanding batches, generation reads, failure reporting.
//! (mori itself is `mori_no_device.rs`.) One test function: the knobs are environment variables
//! the stand-in reads at each batch.
#![cfg(feature = "mori")]

use std::sync::Arc;
use std::time::Duration;

use pdkv_core::plan::ReadRun;
use pdkv_core::wire::GrantId;
use pdkv_transport::engine::{EngineError, EngineKey, ReadEngine, ReadOp, ReadReport};
use pdkv_transport::mori::error::TransferCode;
use pdkv_transport::mori::{LOOPBACK_SHIM, MoriEngine, MoriError, MoriSettings};
use pdkv_transport::region::Region;

fn set(key: &str, value: Option<&str>) {
    // SAFETY: this test binary runs one test; the stand-in reads the variable on the thread that
    // posts, after this returns.
    unsafe {
        match value {
            Some(value) => std::env::set_var(key, value),
            None => std::env::remove_var(key),
        }
    }
}

fn run(local_offset: u64, remote_offset: u64, len_bytes: u64) -> ReadRun {
    ReadRun {
        local_offset,
        remote_offset,
        len_bytes,
    }
}

fn op(local_region: u32, remote_region: u32, runs: Vec<ReadRun>) -> ReadOp {
    ReadOp {
        grant: GrantId(1),
        local_region,
        remote_engine: EngineKey("prefill".into()),
        remote_region,
        runs,
    }
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 % 251) as u8).collect()
}

#[test]
fn the_mori_engine_reads_batches_bounds_and_reports_over_a_loopback_nic() {
    set("PDKV_MORI_SHIM", Some(LOOPBACK_SHIM));
    let settings = MoriSettings {
        max_outstanding: 2,
        max_message_bytes: 4096,
        ..MoriSettings::default()
    };
    let prefill = MoriEngine::new(EngineKey("prefill".into()), "127.0.0.1", settings).unwrap();
    let decode = MoriEngine::new(EngineKey("decode".into()), "127.0.0.1", settings).unwrap();
    let source = Arc::new(Region::heap(64 * 1024));
    source.write(0, &pattern(64 * 1024)).unwrap();
    let generations = Arc::new(Region::heap(64));
    for (index, value) in [(0, 11), (3, 33), (7, 77), (15, 1500)] {
        generations.store_u32(index, value).unwrap();
    }
    let adverts = vec![
        prefill.register(0, source.clone()).unwrap(),
        prefill.register(1, generations.clone()).unwrap(),
    ];
    let destination = Arc::new(Region::heap(64 * 1024));
    decode.register(0, destination.clone()).unwrap();
    decode.register_remote(&prefill.descriptor(), &adverts).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();

    // Two runs contiguous on both sides merge; the merge and a 10 000-byte run split at the
    // 4096-byte message bound: 4096 + 904, then 4096 + 4096 + 1808.
    let report = decode
        .batch_read(vec![op(
            0,
            0,
            vec![
                run(0, 8192, 3000),
                run(3000, 11192, 2000),
                run(20000, 40000, 10000),
            ],
        )])
        .unwrap()
        .wait_blocking(Duration::from_secs(5))
        .unwrap();
    assert_eq!(
        report,
        ReadReport {
            bytes: 15000,
            runs: 5
        }
    );
    let expected = pattern(64 * 1024);
    let mut got = vec![0u8; 64 * 1024];
    destination.read(0, &mut got).unwrap();
    assert_eq!(got[..5000], expected[8192..13192]);
    assert_eq!(got[20000..30000], expected[40000..50000]);
    assert!(
        got[5000..20000].iter().all(|&byte| byte == 0),
        "nothing else written"
    );

    // Generation words through the engine's registered scratch buffer, in the order asked.
    let words = runtime
        .block_on(decode.read_remote_words(&EngineKey("prefill".into()), GrantId(1), 1, &[7, 0, 15, 3, 3]))
        .unwrap();
    assert_eq!(words, vec![77, 11, 1500, 33, 33]);

    // At most `max_outstanding` batches in flight: a third is refused, and accepted again once
    // one completes.
    set("PDKV_LOOPBACK_DELAY_US", Some("200000"));
    let first = decode.batch_read(vec![op(0, 0, vec![run(0, 0, 64)])]).unwrap();
    let second = decode.batch_read(vec![op(0, 0, vec![run(64, 64, 64)])]).unwrap();
    assert_eq!(
        decode
            .batch_read(vec![op(0, 0, vec![run(128, 128, 64)])])
            .unwrap_err(),
        EngineError::Mori(MoriError::Saturated { limit: 2 })
    );
    // A reader that stops waiting leaves the status to the completion thread.
    assert!(matches!(
        first.wait_blocking(Duration::from_millis(10)),
        Err(EngineError::Timeout { after_ms: 10 })
    ));
    second.wait_blocking(Duration::from_secs(5)).unwrap();
    set("PDKV_LOOPBACK_DELAY_US", None);
    let mut admitted = None;
    for _ in 0..100 {
        match decode.batch_read(vec![op(0, 0, vec![run(128, 128, 64)])]) {
            Ok(handle) => {
                admitted = Some(handle);
                break;
            }
            Err(EngineError::Mori(MoriError::Saturated { .. })) => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(other) => panic!("{other:?}"),
        }
    }
    admitted
        .expect("the abandoned batch completed and freed its slot")
        .wait_blocking(Duration::from_secs(5))
        .unwrap();

    // A READ that fails half way reports mori's code and message; it is never reported good.
    set("PDKV_LOOPBACK_FAIL_EVERY", Some("1"));
    let error = decode
        .batch_read(vec![op(0, 0, vec![run(0, 0, 4096), run(8192, 8192, 4096)])])
        .unwrap()
        .wait_blocking(Duration::from_secs(5))
        .unwrap_err();
    assert_eq!(
        error,
        EngineError::Mori(MoriError::Transfer {
            code: TransferCode::RdmaOp,
            message: "injected RDMA failure".into()
        })
    );
    set("PDKV_LOOPBACK_FAIL_EVERY", None);

    // Dropping the engine with a READ in flight waits for mori to finish with it.
    set("PDKV_LOOPBACK_DELAY_US", Some("100000"));
    let in_flight = decode.batch_read(vec![op(0, 0, vec![run(0, 0, 4096)])]).unwrap();
    drop(decode);
    assert_eq!(
        in_flight.wait_blocking(Duration::from_secs(5)).unwrap(),
        ReadReport { bytes: 4096, runs: 1 }
    );
    set("PDKV_LOOPBACK_DELAY_US", None);
}
