//! The parts of a leg that depend on `[transport]`: where its KV lives (`kv_memory`) and the
//! mori engine (`read_engine = "mori"`). Built the same for a leg in its own process and for a
//! leg of a cluster in one process; a missing feature, library, GPU or NIC fails the start with
//! one error naming it.

use std::sync::Arc;

use pdkv_transport::engine::ReadEngine;

use crate::config::{ClusterConfig, KvMemory, NodeConfig};
use crate::engine::Model;
use crate::error::StartError;
use crate::memory::LegMemory;

/// The leg's KV memory: shared host memory (same-host peers map it), or its GPU's memory.
pub(crate) fn leg_memory(
    config: &ClusterConfig,
    node: &NodeConfig,
    model: &Model,
) -> Result<LegMemory, StartError> {
    let capacity = vec![node.blocks_per_group; config.layout.groups().len()];
    match config.transport.kv_memory {
        KvMemory::Host => LegMemory::shared(model, node.shards, &capacity, &node.name.0).map_err(|source| {
            StartError::Memory {
                node: node.name.0.clone(),
                source,
            }
        }),
        KvMemory::Gpu => {
            LegMemory::gpu(model, node.shards, &capacity, node.gpu).map_err(|source| StartError::GpuMemory {
                node: node.name.0.clone(),
                gpu: node.gpu,
                source,
            })
        }
    }
}

/// The leg's mori engine, its control plane on the node's host.
pub(crate) fn mori_engine(
    config: &ClusterConfig,
    node: &NodeConfig,
) -> Result<Arc<dyn ReadEngine>, StartError> {
    start_mori(config, node).map_err(|source| StartError::MoriStart {
        node: node.name.0.clone(),
        source,
    })
}

#[cfg(feature = "mori")]
fn start_mori(
    config: &ClusterConfig,
    node: &NodeConfig,
) -> Result<Arc<dyn ReadEngine>, pdkv_transport::mori::MoriError> {
    use pdkv_transport::engine::EngineKey;
    use pdkv_transport::mori::MoriEngine;
    let engine = MoriEngine::new(
        EngineKey(node.name.0.clone()),
        &node.address.host,
        config.transport.mori,
    )?;
    Ok(Arc::new(engine))
}

#[cfg(not(feature = "mori"))]
fn start_mori(
    _: &ClusterConfig,
    _: &NodeConfig,
) -> Result<Arc<dyn ReadEngine>, pdkv_transport::mori::MoriError> {
    Err(pdkv_transport::mori::MoriError::NotBuilt)
}
