//! Loading the native shims of the `mori` and `hip` features (see `build.rs`), and naming in
//! an operator's words what the loader could not find.

#[cfg(any(feature = "mori", feature = "hip"))]
use std::ffi::{CStr, c_char};
#[cfg(any(feature = "mori", feature = "hip"))]
use std::path::{Path, PathBuf};

#[cfg(any(feature = "mori", feature = "hip"))]
/// Where a shim is loaded from: `$<env_var>` when set; else `file` next to the running binary
/// (an install ships the shim beside `pdkv`); else where the build left it.
pub(crate) fn shim_path(env_var: &str, file: &str, built: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(env_var) {
        return PathBuf::from(path);
    }
    if let Some(beside) = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join(file)))
        .filter(|path| path.exists())
    {
        return beside;
    }
    PathBuf::from(built)
}

#[cfg(any(feature = "mori", feature = "hip"))]
/// Opens a shim; the error is the loader's message (it names the file that is missing).
pub(crate) fn open(path: &Path) -> Result<libloading::Library, String> {
    // SAFETY: the shims run no code at load beyond C++ static initialisers of the libraries they
    // link (mori's), which create no threads.
    unsafe { libloading::Library::new(path) }.map_err(|error| error.to_string())
}

#[cfg(any(feature = "mori", feature = "hip"))]
/// A buffer a shim writes its error message into.
pub(crate) struct MessageBuffer([u8; 1024]);

#[cfg(any(feature = "mori", feature = "hip"))]
impl MessageBuffer {
    pub(crate) fn new() -> Self {
        MessageBuffer([0; 1024])
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut c_char {
        self.0.as_mut_ptr().cast()
    }

    pub(crate) fn capacity(&self) -> usize {
        self.0.len()
    }

    /// The message written (the shim always terminates it; an unterminated buffer reads empty).
    pub(crate) fn text(&self) -> String {
        CStr::from_bytes_until_nul(&self.0)
            .map(|text| text.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

/// The library a loader error says is missing, in an operator's words: the loader's own file name
/// plus what provides it.
#[cfg_attr(not(any(feature = "mori", feature = "hip")), allow(dead_code))]
pub(crate) fn missing_library(loader_message: &str) -> Option<String> {
    if let Some((symbol, rest)) = loader_message
        .split_once("undefined symbol: ")
        .map(|(_, rest)| rest.split_once(", version ").unwrap_or((rest, "")))
    {
        let version = rest.trim();
        return Some(format!(
            "symbol {symbol}{} (the ROCm runtime found is older than the one mori was built for)",
            if version.is_empty() {
                String::new()
            } else {
                format!(" version {version}")
            }
        ));
    }
    let (before, _) = loader_message.split_once(": cannot open shared object file")?;
    let file = before
        .rsplit(['/', ' '])
        .next()
        .unwrap_or(before)
        .trim_end_matches(':');
    let provider = if file.starts_with("libamdhip64") {
        " (ROCm's HIP runtime)"
    } else if file.starts_with("libhsa-runtime64") {
        " (ROCm's HSA runtime)"
    } else if file.starts_with("libmori") {
        " (mori: unpack the amd-mori wheel and point MORI_ROOT at its mori/ folder when building)"
    } else if file.starts_with("libpci") {
        " (Debian package libpci3)"
    } else if file.starts_with("libpdkv_") {
        " (the shim built with pdkv: set PDKV_MORI_SHIM to its path)"
    } else {
        ""
    };
    Some(format!("{file}{provider}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loader_messages_name_what_is_missing() {
        // glibc's messages, as dlopen reports them on a host without ROCm 7.
        assert_eq!(
            missing_library("libamdhip64.so.7: cannot open shared object file: No such file or directory")
                .as_deref(),
            Some("libamdhip64.so.7 (ROCm's HIP runtime)")
        );
        assert_eq!(
            missing_library(
                "/opt/pdkv/libpdkv_mori_shim.so: cannot open shared object file: No such file or directory"
            )
            .as_deref(),
            Some("libpdkv_mori_shim.so (the shim built with pdkv: set PDKV_MORI_SHIM to its path)")
        );
        assert_eq!(
            missing_library(
                "/w/mori/libmori_application.so: undefined symbol: hsa_amd_portable_export_dmabuf, version ROCR_1"
            )
            .as_deref(),
            Some(
                "symbol hsa_amd_portable_export_dmabuf version ROCR_1 (the ROCm runtime found is older than the one mori was built for)"
            )
        );
        assert_eq!(
            missing_library("libpci.so.3: cannot open shared object file: x").as_deref(),
            Some("libpci.so.3 (Debian package libpci3)")
        );
        assert_eq!(missing_library("something else went wrong"), None);
    }
}
