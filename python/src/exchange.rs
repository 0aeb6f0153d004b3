//! pdkv's exchange (trim, clip, anchor, pair by absolute position) for Python.
//!
//! Offers and needs cross as JSON text (they travel in vLLM's `kv_transfer_params`, which must
//! be JSON); `pdkv_vllm` wraps them as dicts. Every fault is an `ExchangeError` (a `ValueError`)
//! carrying pdkv's own message; nothing here panics on any input.

use pdkv_core::exchange::{self, ExchangeError as CoreError, Need, Offer};
use pdkv_core::layout::{GroupEntry, GroupSpec, KvLayout};
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

create_exception!(
    _native,
    ExchangeError,
    PyValueError,
    "A block exchange pdkv refuses, with the reason."
);

fn refused(error: impl std::fmt::Display) -> PyErr {
    ExchangeError::new_err(error.to_string())
}

fn exchange_error(error: CoreError) -> PyErr {
    refused(error)
}

/// A model's KV layout: its groups (full attention, sliding window, mamba) and which group each
/// layer belongs to.
#[pyclass(frozen, module = "pdkv_vllm._native")]
pub struct Layout {
    inner: KvLayout,
}

#[pymethods]
impl Layout {
    /// `groups_json`: a JSON list of `{"kind": "full"|"sliding_window"|"chunked_local"|"mamba"|"mamba_align", "block_size": B,
    /// "window": W, "chunk": C, "dcp": D}`; `layer_groups`: the group of each layer (default: one layer per
    /// group).
    #[new]
    #[pyo3(signature = (groups_json, layer_groups=None))]
    fn new(groups_json: &str, layer_groups: Option<Vec<usize>>) -> PyResult<Self> {
        let groups = parse_groups(groups_json)?;
        let layers = layer_groups.unwrap_or_else(|| (0..groups.len()).collect());
        let inner = KvLayout::new(groups, layers).map_err(refused)?;
        Ok(Layout { inner })
    }

    /// Number of groups.
    fn num_groups(&self) -> usize {
        self.inner.groups().len()
    }

    /// The block positions of group `group` a decode leg reads for an `n`-token prompt, as
    /// `(start, end)` (end exclusive).
    fn needed_positions(&self, group: usize, num_prompt_tokens: u64) -> PyResult<(u64, u64)> {
        let spec = self.inner.group(group).ok_or_else(|| {
            refused(format!(
                "group {group} does not exist: the layout has {}",
                self.inner.groups().len()
            ))
        })?;
        let range = exchange::needed_positions(spec, num_prompt_tokens);
        Ok((range.start, range.end))
    }

    /// The layout's compatibility hash (legs with different hashes cannot pair).
    fn compat_hash(&self) -> u64 {
        self.inner.compat_hash()
    }
}

/// The prefill leg's offer (JSON) from its per-group block lists (lookahead tails included).
#[pyfunction]
fn offer(layout: &Layout, num_prompt_tokens: u64, prefill_blocks: Vec<Vec<u32>>) -> PyResult<String> {
    let offer = exchange::offer(&layout.inner, num_prompt_tokens, &prefill_blocks).map_err(exchange_error)?;
    serde_json::to_string(&offer).map_err(refused)
}

/// The decode leg's need (JSON) from its per-group block lists, minus `cached_blocks[g]` leading
/// positions it holds already (prefix hits; empty for none).
#[pyfunction]
#[pyo3(signature = (layout, num_prompt_tokens, decode_blocks, cached_blocks=Vec::new()))]
fn need(
    layout: &Layout,
    num_prompt_tokens: u64,
    decode_blocks: Vec<Vec<u32>>,
    cached_blocks: Vec<u64>,
) -> PyResult<String> {
    let need = exchange::need(&layout.inner, num_prompt_tokens, &decode_blocks, &cached_blocks)
        .map_err(exchange_error)?;
    serde_json::to_string(&need).map_err(refused)
}

/// One READ unit as Python sees it: `(remote_position, local_position, remote_block, local_block)`.
type PairTuple = (u64, u64, u32, u32);

/// Pairs an offer with a need by absolute position: per group, `(remote_position,
/// local_position, remote_block, local_block)` in ascending position order.
#[pyfunction]
fn pair(layout: &Layout, offer_json: &str, need_json: &str) -> PyResult<Vec<Vec<PairTuple>>> {
    let offer: Offer =
        serde_json::from_str(offer_json).map_err(|error| refused(format!("malformed offer: {error}")))?;
    let need: Need =
        serde_json::from_str(need_json).map_err(|error| refused(format!("malformed need: {error}")))?;
    let pairing = exchange::pair(&layout.inner, &offer, &need).map_err(exchange_error)?;
    Ok(pairing
        .groups
        .into_iter()
        .map(|pairs| {
            pairs
                .into_iter()
                .map(|pair| (pair.remote_position, pair.local_position, pair.remote, pair.local))
                .collect()
        })
        .collect())
}

/// KV groups from their JSON description (see [`Layout::new`]).
pub fn parse_groups(groups_json: &str) -> PyResult<Vec<GroupSpec>> {
    let entries: Vec<GroupEntry> =
        serde_json::from_str(groups_json).map_err(|error| refused(format!("groups: {error}")))?;
    entries
        .iter()
        .enumerate()
        .map(|(index, entry)| entry.to_spec(index))
        .collect::<Result<Vec<_>, _>>()
        .map_err(refused)
}

/// Adds the exchange's classes and functions to the module.
pub fn add_to(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<Layout>()?;
    module.add_function(wrap_pyfunction!(offer, module)?)?;
    module.add_function(wrap_pyfunction!(need, module)?)?;
    module.add_function(wrap_pyfunction!(pair, module)?)?;
    module.add("ExchangeError", module.py().get_type::<ExchangeError>())?;
    Ok(())
}
