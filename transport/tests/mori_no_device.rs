//! mori loaded for real on a host with no AMD GPU and no RDMA NIC.
//!
//! mori 1.2.4's `libmori_io.so` links ROCm 7's HIP and HSA runtimes. This test preloads the
//! stand-ins `build.rs` compiles from `mori/standin/` (every HIP and HSA call answers "no
//! device", as the real runtimes do on such a host); the dynamic loader then resolves mori's
//! imports against them, and the shim runs mori's real code: engines, memory registration,
//! msgpack descriptors, remote registration, sessions, and the NIC probe.
#![cfg(feature = "mori")]

use std::path::Path;
use std::sync::{Arc, Once};

use pdkv_core::plan::{ReadRun, RegionLayout};
use pdkv_core::wire::{GrantId, Incarnation, NodeId, Role};
use pdkv_transport::codec::{PROTOCOL_VERSION, decode, encode};
use pdkv_transport::control::{EngineAdvert, Hello};
use pdkv_transport::engine::{
    EngineDescriptor, EngineError, EngineKey, EngineKind, MemoryDescriptor, ReadEngine, ReadOp, RegionHandle,
};
use pdkv_transport::mori::{MoriEngine, MoriError, MoriSettings};
use pdkv_transport::region::Region;

fn preload_no_device_runtime() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for library in ["libhsa-runtime64.so.1", "libamdhip64.so.7"] {
            let path = Path::new(env!("PDKV_MORI_STANDIN_DIR")).join(library);
            // SAFETY: the stand-ins run no code at load; RTLD_GLOBAL makes their sonames satisfy
            // libmori_io.so's imports.
            let loaded = unsafe {
                libloading::os::unix::Library::open(
                    Some(&path),
                    libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
                )
            }
            .unwrap_or_else(|error| panic!("{}: {error}", path.display()));
            std::mem::forget(loaded);
        }
    });
}

fn engine(name: &str) -> MoriEngine {
    preload_no_device_runtime();
    MoriEngine::without_backend(EngineKey(name.into()), "127.0.0.1", MoriSettings::default())
        .unwrap_or_else(|error| panic!("mori engine {name}: {error}"))
}

fn packed(descriptor: &MemoryDescriptor) -> &[u8] {
    match &descriptor.handle {
        RegionHandle::Mori { packed } => packed,
        other => panic!("a mori engine registered a {other:?} region"),
    }
}

fn op(local_region: u32, remote: &str, remote_region: u32, runs: Vec<ReadRun>) -> ReadOp {
    ReadOp {
        grant: GrantId(1),
        local_region,
        remote_engine: EngineKey(remote.into()),
        remote_region,
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
fn an_rdma_backend_on_a_host_without_a_nic_fails_naming_the_nic() {
    preload_no_device_runtime();
    let error = MoriEngine::new(EngineKey("p-nic".into()), "127.0.0.1", MoriSettings::default()).unwrap_err();
    match &error {
        MoriError::NoRdmaNic(message) => assert!(message.contains("no active RDMA device"), "{message}"),
        other => panic!("expected NoRdmaNic, got {other:?}"),
    }
    assert!(error.to_string().starts_with("no RDMA NIC: "), "{error}");
}

#[test]
fn descriptors_are_mori_msgpack_and_travel_through_the_handshake() {
    let prefill = engine("p-desc");
    let reader = engine("d-desc");
    let region = Arc::new(Region::heap(64 * 1024));
    let memory = prefill.register(0, region).unwrap();
    assert_eq!((memory.region, memory.len_bytes), (0, 64 * 1024));
    // mori packs EngineDesc as a msgpack array of 6 starting with its key, and MemoryDesc as an
    // array of 15 starting with its engine's key (mori/io/common.hpp, MSGPACK_DEFINE).
    let descriptor = prefill.descriptor();
    assert_eq!(descriptor.kind, EngineKind::Mori);
    assert_eq!(&descriptor.packed[..2], &[0x96, 0xa0 | 6]);
    assert_eq!(&descriptor.packed[2..8], b"p-desc");
    assert_eq!(&packed(&memory)[..2], &[0x9f, 0xa0 | 6]);
    assert_eq!(&packed(&memory)[2..8], b"p-desc");

    // The descriptors cross the wire in the hello, bincode-encoded like every frame.
    let hello = Hello {
        node: NodeId("p-desc".into()),
        role: Role::Prefill,
        incarnation: Incarnation(9),
        regions: RegionLayout::default(),
        protocol_version: PROTOCOL_VERSION,
        layout_hash: 1,
        model: pdkv_core::identity::ModelFields::default(),
        engines: vec![EngineAdvert {
            engine: descriptor,
            regions: vec![memory],
        }],
        host: "h".into(),
    };
    let received: Hello = decode(&encode(&hello).unwrap()).unwrap();
    assert_eq!(received, hello);
    let advert = &received.engines[0];
    reader.register_remote(&advert.engine, &advert.regions).unwrap();
    // The same peer saying hello again (a reconnect) is accepted.
    reader.register_remote(&advert.engine, &advert.regions).unwrap();
}

#[test]
fn a_read_with_no_route_fails_naming_both_regions_and_the_peer() {
    let prefill = engine("p-route");
    let reader = engine("d-route");
    let memory = prefill.register(3, Arc::new(Region::heap(8192))).unwrap();
    reader.register(1, Arc::new(Region::heap(8192))).unwrap();
    reader.register_remote(&prefill.descriptor(), &[memory]).unwrap();
    let error = reader
        .batch_read(vec![op(1, "p-route", 3, vec![run(0, 4096, 4096)])])
        .unwrap_err();
    match error {
        EngineError::Mori(MoriError::NoRoute {
            local_region,
            peer,
            remote_region,
            ..
        }) => assert_eq!((local_region, peer.as_str(), remote_region), (1, "p-route", 3)),
        other => panic!("expected NoRoute, got {other:?}"),
    }
}

#[test]
fn reads_outside_a_region_or_of_unknown_regions_are_refused_before_mori_sees_them() {
    let prefill = engine("p-bounds");
    let reader = engine("d-bounds");
    let memory = prefill.register(0, Arc::new(Region::heap(4096))).unwrap();
    reader.register(0, Arc::new(Region::heap(4096))).unwrap();
    reader.register_remote(&prefill.descriptor(), &[memory]).unwrap();
    let refused = |ops| reader.batch_read(ops).unwrap_err();
    assert!(matches!(
        refused(vec![op(0, "p-bounds", 0, vec![run(0, 4000, 200)])]),
        EngineError::Bounds {
            side: "remote",
            region: 0,
            ..
        }
    ));
    assert!(matches!(
        refused(vec![op(0, "p-bounds", 0, vec![run(u64::MAX, 0, 2)])]),
        EngineError::Bounds {
            side: "local",
            region: 0,
            ..
        }
    ));
    assert_eq!(
        refused(vec![op(5, "p-bounds", 0, vec![run(0, 0, 8)])]),
        EngineError::UnknownLocalRegion(5)
    );
    assert_eq!(
        refused(vec![op(0, "p-bounds", 9, vec![run(0, 0, 8)])]),
        EngineError::UnknownRemoteRegion {
            engine: EngineKey("p-bounds".into()),
            region: 9
        }
    );
    assert_eq!(
        refused(vec![op(0, "nobody", 0, vec![run(0, 0, 8)])]),
        EngineError::UnknownRemoteRegion {
            engine: EngineKey("nobody".into()),
            region: 0
        }
    );
    assert_eq!(
        reader.register(0, Arc::new(Region::heap(64))).unwrap_err(),
        EngineError::DuplicateRegion(0)
    );
}

#[test]
fn malformed_or_foreign_peer_descriptors_are_refused_by_name() {
    let reader = engine("d-bad");
    let garbage = EngineDescriptor {
        key: EngineKey("p-bad".into()),
        kind: EngineKind::Mori,
        pid: 1,
        address: String::new(),
        packed: vec![0x01, 0x02, 0x03],
    };
    match reader.register_remote(&garbage, &[]).unwrap_err() {
        EngineError::Mori(MoriError::BadDescriptor { what, peer, .. }) => {
            assert_eq!((what, peer.as_str()), ("engine", "p-bad"))
        }
        other => panic!("expected BadDescriptor, got {other:?}"),
    }
    let net = EngineDescriptor {
        kind: EngineKind::Net,
        ..garbage.clone()
    };
    assert_eq!(
        reader.register_remote(&net, &[]).unwrap_err(),
        EngineError::WrongKind {
            engine: EngineKey("p-bad".into()),
            found: EngineKind::Net,
            expected: EngineKind::Mori
        }
    );
    // A good engine whose region descriptor is garbage: refused when a READ opens the session.
    let prefill = engine("p-badmem");
    reader.register(0, Arc::new(Region::heap(4096))).unwrap();
    let forged = MemoryDescriptor {
        engine: EngineKey("p-badmem".into()),
        region: 0,
        len_bytes: 4096,
        handle: RegionHandle::Mori { packed: vec![0xc1] },
    };
    reader.register_remote(&prefill.descriptor(), &[forged]).unwrap();
    match reader
        .batch_read(vec![op(0, "p-badmem", 0, vec![run(0, 0, 64)])])
        .unwrap_err()
    {
        EngineError::Mori(MoriError::BadDescriptor { what, peer, .. }) => {
            assert_eq!((what, peer.as_str()), ("memory", "p-badmem"))
        }
        other => panic!("expected BadDescriptor, got {other:?}"),
    }
    // A region that is not a mori region at all.
    let shm = MemoryDescriptor {
        engine: EngineKey("p-badmem".into()),
        region: 1,
        len_bytes: 4096,
        handle: RegionHandle::Net,
    };
    assert!(matches!(
        reader.register_remote(&prefill.descriptor(), &[shm]).unwrap_err(),
        EngineError::Refused(message) if message.contains("region 1 of p-badmem")
    ));
}
