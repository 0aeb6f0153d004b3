//! What can go wrong with mori, named so an operator knows what to install or fix.

use std::path::PathBuf;

/// mori's `TransferStatus` codes (`mori/io/enum.hpp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferCode {
    /// Done.
    Success,
    /// Not started.
    Init,
    /// Posted, not done.
    InProgress,
    /// mori refused the arguments.
    InvalidArgs,
    /// A memory region or engine mori does not know.
    NotFound,
    /// The NIC reported an error (e.g. a remote protection fault after the owner deregistered).
    RdmaOp,
    /// The engine or session is in a bad state.
    BadState,
    /// A GPU operation failed.
    GpuOp,
    /// A code this pdkv does not know (a newer mori).
    Other(u32),
}

impl TransferCode {
    /// The code mori returned.
    pub fn from_raw(code: u32) -> Self {
        match code {
            0 => TransferCode::Success,
            1 => TransferCode::Init,
            2 => TransferCode::InProgress,
            11 => TransferCode::InvalidArgs,
            12 => TransferCode::NotFound,
            13 => TransferCode::RdmaOp,
            14 => TransferCode::BadState,
            15 => TransferCode::GpuOp,
            other => TransferCode::Other(other),
        }
    }

    /// Whether the transfer ended in failure (mori: code above `ERR_BEGIN` = 10).
    pub fn failed(self) -> bool {
        match self {
            TransferCode::Success | TransferCode::Init | TransferCode::InProgress => false,
            TransferCode::Other(code) => code > 10,
            _ => true,
        }
    }
}

/// Return codes of the C shim (`transport/mori/pdkv_mori_shim.cpp`).
#[cfg_attr(not(feature = "mori"), allow(dead_code))]
pub(crate) mod shim_code {
    pub const OK: i32 = 0;
    pub const EXCEPTION: i32 = 1;
    pub const INVALID_ARGUMENT: i32 = 2;
    pub const NO_SESSION: i32 = 3;
    pub const BUFFER_TOO_SMALL: i32 = 4;
}

/// Why the mori engine cannot start or could not READ.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MoriError {
    /// This pdkv binary was built without the `mori` feature.
    #[error(
        "read_engine = \"mori\" needs a pdkv built with `--features mori` on a host with mori and ROCm 7 (README, \"AMD GPUs\")"
    )]
    NotBuilt,
    /// The shim, mori or a library they need could not be loaded.
    #[error("cannot load the mori shim {}: {}{reason}", shim.display(), missing.as_ref().map(|m| format!("{m} is missing; ")).unwrap_or_default())]
    Library {
        /// The shim's path.
        shim: PathBuf,
        /// What is missing, in an operator's words, when the loader named it.
        missing: Option<String>,
        /// The loader's message.
        reason: String,
    },
    /// mori found no active RDMA NIC.
    #[error("no RDMA NIC: mori says \"{0}\"")]
    NoRdmaNic(String),
    /// A peer's packed engine or memory descriptor that mori cannot read.
    #[error("{what} descriptor from {peer} is malformed: {message}")]
    BadDescriptor {
        /// `engine` or `memory`.
        what: &'static str,
        /// Who sent it.
        peer: String,
        /// mori's (msgpack's) message.
        message: String,
    },
    /// mori has no backend that connects a local and a remote region (no RDMA backend, or the
    /// memory kinds cannot meet).
    #[error("no mori route from local region {local_region} to region {remote_region} of {peer}: {message}")]
    NoRoute {
        /// Local region id.
        local_region: u32,
        /// Remote engine.
        peer: String,
        /// Remote region id.
        remote_region: u32,
        /// The shim's message.
        message: String,
    },
    /// A mori call threw.
    #[error("mori {call} failed: {message}")]
    Call {
        /// The shim function.
        call: &'static str,
        /// mori's message.
        message: String,
    },
    /// A posted READ completed with an error.
    #[error("mori READ failed with {code:?}: {message}")]
    Transfer {
        /// mori's status code.
        code: TransferCode,
        /// mori's message.
        message: String,
    },
    /// More READ batches in flight than `[transport.mori] max_outstanding`.
    #[error("{limit} mori READ batches are already in flight ([transport.mori] max_outstanding)")]
    Saturated {
        /// The bound.
        limit: usize,
    },
}

/// The error a shim call's failure means.
#[cfg_attr(not(feature = "mori"), allow(dead_code))]
pub(crate) fn from_shim(call: &'static str, code: i32, message: String) -> MoriError {
    if message.contains("no active RDMA device") {
        return MoriError::NoRdmaNic(message);
    }
    match code {
        shim_code::INVALID_ARGUMENT => MoriError::Call {
            call,
            message: format!(
                "invalid argument{}",
                if message.is_empty() {
                    String::new()
                } else {
                    format!(": {message}")
                }
            ),
        },
        _ => MoriError::Call { call, message },
    }
}

/// Whether a message thrown while unpacking a descriptor comes from msgpack (a malformed blob)
/// rather than from mori's own logic.
#[cfg_attr(not(feature = "mori"), allow(dead_code))]
pub(crate) fn is_unpack_error(message: &str) -> bool {
    [
        "bad_cast",
        "insufficient bytes",
        "parse error",
        "type_error",
        "unpack",
    ]
    .iter()
    .any(|needle| message.contains(needle))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shim_failures_map_to_the_fault_they_name() {
        let nic =
            "no active RDMA device on this host; set MORI_DISABLE_AUTO_XGMI=0 to enable XGMI-only fallback";
        assert_eq!(
            from_shim("create_rdma_backend", shim_code::EXCEPTION, nic.into()),
            MoriError::NoRdmaNic(nic.into())
        );
        assert_eq!(
            from_shim("register_memory", shim_code::EXCEPTION, "hipErrorNoDevice".into()),
            MoriError::Call {
                call: "register_memory",
                message: "hipErrorNoDevice".into()
            }
        );
        assert_eq!(
            from_shim("engine_new", shim_code::INVALID_ARGUMENT, String::new()).to_string(),
            "mori engine_new failed: invalid argument"
        );
        assert!(is_unpack_error("std::bad_cast"));
        assert!(!is_unpack_error("no active RDMA device"));
    }

    #[test]
    fn transfer_codes_follow_mori() {
        assert_eq!(TransferCode::from_raw(0), TransferCode::Success);
        assert_eq!(TransferCode::from_raw(13), TransferCode::RdmaOp);
        for raw in [0, 1, 2] {
            assert!(!TransferCode::from_raw(raw).failed(), "{raw}");
        }
        for raw in [11, 12, 13, 14, 15, 16] {
            assert!(TransferCode::from_raw(raw).failed(), "{raw}");
        }
        assert!(
            !TransferCode::from_raw(7).failed(),
            "below ERR_BEGIN is not a failure"
        );
    }
}
