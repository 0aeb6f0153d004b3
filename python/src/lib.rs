//! `pdkv_vllm._native`: pdkv for vLLM's KV connector.
//!
//! - [`exchange`]: trim, clip, anchor and pair vLLM's per-group block ids (pure).
//! - [`handoff`]: a prefill worker's hand-offs: leases, claims, releases (pure).
//! - [`protocol`]: what decode and prefill workers say to each other on the control plane.
//! - [`agent`]: one worker's KV memory, connections and READs.
//! - [`bindings`]: the agent as the Python class `KvAgent`.

mod agent;
mod bindings;
mod exchange;
mod handoff;
mod protocol;

use pyo3::prelude::*;

#[pymodule]
fn _native(module: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    exchange::add_to(module)?;
    bindings::add_to(module)?;
    Ok(())
}

/// The agent's own log (its memory server's refusals, lapsed releases, READ engine choices):
/// to stderr, where vLLM's log goes, filtered by `PDKV_LOG` (`RUST_LOG` syntax; default `warn`).
/// Once per process; a subscriber the host process installed first wins.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("PDKV_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}
