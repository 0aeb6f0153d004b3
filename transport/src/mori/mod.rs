//! mori, AMD's RDMA IO engine, as a pdkv READ engine.
//!
//! mori has a C++ API only. A small C++ shim (`transport/mori/pdkv_mori_shim.cpp`) gives it a C
//! surface; the `mori` feature builds the shim as a shared library (`build.rs`) that
//! [`MoriEngine`] loads at node start, so a binary built with the feature runs on any host and
//! names what is missing where mori cannot run.
//!
//! What needs no library is always built and tested: run batching ([`runs`]), the settings
//! ([`settings`]) and the error kinds ([`error`]).

pub mod error;
pub mod runs;
pub mod settings;

#[cfg(feature = "mori")]
mod engine;
#[cfg(feature = "mori")]
mod ffi;

#[cfg(feature = "mori")]
pub use engine::MoriEngine;
pub use error::MoriError;
pub use settings::{MoriSettings, PollMode};

/// Whether this build has the mori engine.
pub const BUILT: bool = cfg!(feature = "mori");

/// The loopback stand-in of the shim (`transport/mori/standin/loopback_shim.c`: a READ is a
/// memcpy within the process, completed later on a thread), built beside the real shim so tests
/// can run [`MoriEngine`] end to end by pointing `PDKV_MORI_SHIM` at it. Never used otherwise.
#[cfg(feature = "mori")]
#[doc(hidden)]
pub const LOOPBACK_SHIM: &str = env!("PDKV_MORI_LOOPBACK_SHIM");

#[cfg(test)]
mod tests {
    use pdkv_core::plan::RegionLayout;
    use pdkv_core::wire::{Incarnation, NodeId, Role};

    use crate::codec::{PROTOCOL_VERSION, decode, encode};
    use crate::control::{EngineAdvert, Hello};
    use crate::engine::{EngineDescriptor, EngineKey, EngineKind, MemoryDescriptor, RegionHandle};

    /// mori's descriptors are opaque bytes to pdkv: they cross the handshake unchanged, and a
    /// truncated hello is an error, not a panic (no library needed).
    #[test]
    fn mori_descriptors_round_trip_through_the_handshake() {
        let packed_engine = vec![0x96, 0xa2, b'p', b'0', 0xc0, 0xc0, 0xc0, 0x00, 0x01];
        let packed_memory: Vec<u8> = (0..160u8).collect();
        let hello = Hello {
            node: NodeId("p0".into()),
            role: Role::Prefill,
            incarnation: Incarnation(42),
            regions: RegionLayout::default(),
            protocol_version: PROTOCOL_VERSION,
            layout_hash: 7,
            model: pdkv_core::identity::ModelFields::default(),
            engines: vec![EngineAdvert {
                engine: EngineDescriptor {
                    key: EngineKey("p0".into()),
                    kind: EngineKind::Mori,
                    pid: 1234,
                    address: String::new(),
                    packed: packed_engine.clone(),
                },
                regions: vec![MemoryDescriptor {
                    engine: EngineKey("p0".into()),
                    region: 5,
                    len_bytes: 1 << 30,
                    handle: RegionHandle::Mori {
                        packed: packed_memory.clone(),
                    },
                }],
            }],
            host: "h".into(),
        };
        let bytes = encode(&hello).unwrap();
        let back: Hello = decode(&bytes).unwrap();
        assert_eq!(back, hello);
        assert_eq!(back.engines[0].engine.packed, packed_engine);
        assert_eq!(
            back.engines[0].regions[0].handle,
            RegionHandle::Mori {
                packed: packed_memory
            }
        );
        for cut in [1, bytes.len() / 2, bytes.len() - 1] {
            assert!(decode::<Hello>(&bytes[..cut]).is_err(), "cut at {cut}");
        }
    }
}
