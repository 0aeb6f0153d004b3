//! Loading the native shims of the `mori` and `hip` features (see `build.rs`).

use std::ffi::{CStr, c_char};
use std::path::{Path, PathBuf};

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

/// Opens a shim; the error is the loader's message (it names the file that is missing).
pub(crate) fn open(path: &Path) -> Result<libloading::Library, String> {
    // SAFETY: the shims run no code at load beyond C++ static initialisers of the libraries they
    // link (mori's), which create no threads.
    unsafe { libloading::Library::new(path) }.map_err(|error| error.to_string())
}

/// A buffer a shim writes its error message into.
pub(crate) struct MessageBuffer([u8; 1024]);

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
