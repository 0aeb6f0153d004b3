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
    exchange::add_to(module)?;
    bindings::add_to(module)?;
    Ok(())
}
