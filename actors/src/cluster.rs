//! A whole P/D cluster of actors in one process, built from a [`ClusterConfig`].
//!
//! Each leg gets its own arbiter (one thread) for its scheduler, allocator, exchange and transfer
//! actors (READs do not block it: engines copy large batches on their own workers). Legs share one
//! read-only [`Model`] and reach each other's memory through an in-process READ engine, exactly
//! as separate processes would: with `read_engine = "shm"` (the default) every leg's KV lives in
//! shared memory and readers map it read-only, with `"local"` in heap memory. Must be started
//! inside an actix `System`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant};

use actix::{Actor, Addr, Arbiter};
use pdkv_core::allocator::Allocator;
use pdkv_core::plan::RegionLayout;
use pdkv_core::wire::{Incarnation, NodeId};
use pdkv_transport::engine::{EngineKey, MemoryDescriptor, ReadEngine};
use pdkv_transport::mapped::{LocalFabric, MappedEngine};
use tokio::sync::Notify;

use crate::allocator::{AllocatorActor, LegStats, Stats};
use crate::config::{ClusterConfig, NodeConfig, ReadEngineKind, Role};
use crate::engine::Model;
use crate::error::{RequestError, ask};
use crate::exchange::ExchangeActor;
use crate::memory::LegMemory;
use crate::router::{Generate, GenerateDirect, PrefillRoute, Router};
use crate::scheduler::{GrantPeer, LegContext, Output, Scheduler};
use crate::transfer::TransferActor;

/// Where Linux states how many memory mappings one process may hold.
const MAX_MAP_COUNT_PATH: &str = "/proc/sys/vm/max_map_count";

/// Linux's default `vm.max_map_count`, assumed when the file cannot be read.
const DEFAULT_MAX_MAP_COUNT: u64 = 65_530;

fn read_max_map_count() -> u64 {
    std::fs::read_to_string(MAX_MAP_COUNT_PATH)
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(DEFAULT_MAX_MAP_COUNT)
}

/// Refuses, before any region is created, a shared-memory cluster in one process whose legs
/// would map more regions than `max_map_count` leaves room for: every leg maps its own regions,
/// and every decode leg maps every prefill leg's regions read-only.
pub fn check_map_count(config: &ClusterConfig, max_map_count: u64) -> Result<(), RequestError> {
    let regions = (config.layout.num_layers() + config.layout.groups().len()) as u64;
    let prefill = config.nodes_with_role(Role::Prefill).count() as u64;
    let decode = config.nodes_with_role(Role::Decode).count() as u64;
    let nodes = config.nodes.len() as u64;
    let needed = regions * nodes + regions * prefill * decode;
    // Libraries, heap arenas, and a stack plus guard for each leg's threads.
    let reserved = 4096 + 16 * nodes;
    let usable = max_map_count.saturating_sub(reserved);
    if needed > usable {
        return Err(RequestError::MapLimit {
            needed,
            decode,
            prefill,
            regions,
            limit: max_map_count,
            reserved,
            usable,
        });
    }
    Ok(())
}

/// A fresh random incarnation for a leg starting now.
fn new_incarnation() -> Result<Incarnation, RequestError> {
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes).map_err(|error| RequestError::NoRandomness(error.to_string()))?;
    Ok(Incarnation(u64::from_le_bytes(bytes)))
}

/// Handles to one running leg.
pub struct LegHandle {
    /// The node's configuration.
    pub node: NodeConfig,
    /// Its scheduler.
    pub scheduler: Addr<Scheduler>,
    /// Its allocator (stats, grants).
    pub allocator: Addr<AllocatorActor>,
    /// Its READ engine (tests arm faults on it).
    pub engine: Arc<MappedEngine>,
    /// Its KV memory.
    pub memory: Arc<LegMemory>,
}

/// A running in-process cluster.
pub struct LocalCluster {
    config: ClusterConfig,
    model: Arc<Model>,
    router: Addr<Router>,
    legs: Vec<LegHandle>,
    arbiters: Vec<Arbiter>,
}

struct Built {
    node: NodeConfig,
    arbiter: Arbiter,
    memory: Arc<LegMemory>,
    engine: Arc<MappedEngine>,
    descriptors: Vec<MemoryDescriptor>,
    allocator: Addr<AllocatorActor>,
    freed: Arc<Notify>,
}

impl LocalCluster {
    /// Starts every leg and the router. Call inside a running actix `System`.
    pub fn start(config: ClusterConfig) -> Result<Self, RequestError> {
        if config.transport.read_engine == ReadEngineKind::Shm {
            check_map_count(&config, read_max_map_count())?;
        }
        let model = Arc::new(Model::new(config.model, config.layout.clone()));
        let fabric = LocalFabric::new();
        let groups = config.layout.groups().len();
        let mut built = Vec::with_capacity(config.nodes.len());
        for node in &config.nodes {
            let capacity = vec![node.blocks_per_group; groups];
            let key = EngineKey(node.name.0.clone());
            let (memory, engine) = match config.transport.read_engine {
                ReadEngineKind::Local => (
                    LegMemory::heap(&model, &capacity),
                    MappedEngine::local(key, fabric.clone())?,
                ),
                ReadEngineKind::Shm => (
                    LegMemory::shared(&model, &capacity, &node.name.0)
                        .map_err(|error| RequestError::Read(error.into()))?,
                    MappedEngine::shm(key)?,
                ),
            };
            let (memory, engine) = (Arc::new(memory), Arc::new(engine));
            let mut descriptors = Vec::new();
            for (id, region) in memory.layers.iter().chain(&memory.generations).enumerate() {
                descriptors.push(engine.register(id as u32, region.clone())?);
            }
            let allocator = Allocator::new(&config.layout, &capacity, node.prefix_caching)?;
            let freed = Arc::new(Notify::new());
            let arbiter = Arbiter::new();
            let actor_memory = memory.clone();
            let actor_freed = freed.clone();
            let (name, limits) = (node.name.clone(), config.limits);
            let allocator = AllocatorActor::start_in_arbiter(&arbiter.handle(), move |_| {
                AllocatorActor::new(
                    name,
                    allocator,
                    limits.max_grants,
                    limits.lease_ms,
                    actor_memory,
                    actor_freed,
                    limits.mailbox,
                )
            });
            built.push(Built {
                node: node.clone(),
                arbiter,
                memory,
                engine,
                descriptors,
                allocator,
                freed,
            });
        }
        let prefill_regions: HashMap<NodeId, RegionLayout> = built
            .iter()
            .filter(|leg| leg.node.role == Role::Prefill)
            .map(|leg| (leg.node.name.clone(), leg.memory.regions.clone()))
            .collect();
        let mut legs = Vec::with_capacity(built.len());
        let mut arbiters = Vec::new();
        let mut prefill_schedulers = Vec::new();
        let mut decode_schedulers = Vec::new();
        for leg in &built {
            let limits = config.limits;
            let (layout, exchange_config, local_regions) =
                (config.layout.clone(), config.exchange, leg.memory.regions.clone());
            let remote_regions = prefill_regions.clone();
            let exchange = ExchangeActor::start_in_arbiter(&leg.arbiter.handle(), move |_| {
                ExchangeActor::new(
                    layout,
                    exchange_config,
                    local_regions,
                    remote_regions,
                    limits.mailbox,
                )
            });
            let mut transfer = None;
            let mut grant_peers = HashMap::new();
            if leg.node.role == Role::Decode {
                for prefill in built.iter().filter(|other| other.node.role == Role::Prefill) {
                    leg.engine
                        .register_remote(&prefill.engine.descriptor(), &prefill.descriptors)?;
                    grant_peers.insert(
                        prefill.node.name.clone(),
                        GrantPeer {
                            release: prefill.allocator.clone().recipient(),
                            renew: prefill.allocator.clone().recipient(),
                        },
                    );
                }
                let engine: Arc<dyn ReadEngine> = leg.engine.clone();
                let generation_base = leg.memory.generation_region_id(0);
                let read_timeout = Duration::from_millis(limits.request_timeout_ms);
                transfer = Some(TransferActor::start_in_arbiter(
                    &leg.arbiter.handle(),
                    move |_| TransferActor::new(engine, generation_base, read_timeout, limits.mailbox),
                ));
            }
            let context = Arc::new(LegContext {
                node: leg.node.name.clone(),
                incarnation: new_incarnation()?,
                role: leg.node.role,
                lookahead_tokens: leg.node.lookahead_tokens,
                prefill_tokens: leg.node.prefill_tokens,
                limits,
                model: model.clone(),
                memory: leg.memory.clone(),
                allocator: leg.allocator.clone(),
                exchange,
                transfer,
                grant_peers,
                freed: leg.freed.clone(),
                waiting: AtomicUsize::new(0),
            });
            let scheduler =
                Scheduler::start_in_arbiter(&leg.arbiter.handle(), move |_| Scheduler::new(context));
            match leg.node.role {
                Role::Prefill => prefill_schedulers.push(PrefillRoute {
                    node: leg.node.name.clone(),
                    scheduler: scheduler.clone(),
                    release: leg.allocator.clone().recipient(),
                }),
                Role::Decode => decode_schedulers.push((leg.node.name.clone(), scheduler.clone())),
            }
            legs.push(LegHandle {
                node: leg.node.clone(),
                scheduler,
                allocator: leg.allocator.clone(),
                engine: leg.engine.clone(),
                memory: leg.memory.clone(),
            });
        }
        arbiters.extend(built.into_iter().map(|leg| leg.arbiter));
        let router = Router::new(
            prefill_schedulers,
            decode_schedulers,
            Duration::from_millis(config.limits.request_timeout_ms),
            config.prompt_limit(),
            config.limits.mailbox,
        )
        .start();
        Ok(LocalCluster {
            config,
            model,
            router,
            legs,
            arbiters,
        })
    }

    /// The configuration the cluster runs.
    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    /// The shared model.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The router (to send requests without waiting for each).
    pub fn router(&self) -> &Addr<Router> {
        &self.router
    }

    /// The running legs.
    pub fn legs(&self) -> &[LegHandle] {
        &self.legs
    }

    /// One leg by name.
    pub fn leg(&self, name: &str) -> Option<&LegHandle> {
        self.legs.iter().find(|leg| leg.node.name.0 == name)
    }

    /// Serves a request P/D.
    pub async fn generate(&self, prompt: Vec<u32>, max_tokens: u32) -> Result<Output, RequestError> {
        let message = Generate {
            prompt: prompt.into(),
            max_tokens,
        };
        ask(&self.router, message, "router").await?
    }

    /// Serves a request on one leg alone.
    pub async fn direct(
        &self,
        prompt: Vec<u32>,
        max_tokens: u32,
        node: Option<NodeId>,
    ) -> Result<Output, RequestError> {
        let message = GenerateDirect {
            prompt: prompt.into(),
            max_tokens,
            node,
        };
        ask(&self.router, message, "router").await?
    }

    /// Every leg's block accounting.
    pub async fn stats(&self) -> Result<Vec<LegStats>, RequestError> {
        let mut stats = Vec::with_capacity(self.legs.len());
        for leg in &self.legs {
            stats.push(ask(&leg.allocator, Stats, "allocator").await?);
        }
        Ok(stats)
    }

    /// Waits (at most `timeout`, polling every few ms) until every leg is idle; returns the last
    /// stats either way.
    pub async fn wait_idle(&self, timeout: Duration) -> Result<Vec<LegStats>, RequestError> {
        let deadline = Instant::now() + timeout;
        loop {
            let stats = self.stats().await?;
            if stats.iter().all(LegStats::is_idle) || Instant::now() >= deadline {
                return Ok(stats);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Stops every arbiter and waits for their threads.
    pub fn shutdown(self) {
        for arbiter in &self.arbiters {
            arbiter.stop();
        }
        for arbiter in self.arbiters {
            let _ = arbiter.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DEFAULT_CLUSTER_TOML;

    fn cluster(prefill: usize, decode: usize) -> ClusterConfig {
        let base = DEFAULT_CLUSTER_TOML;
        let mut text = base[..base.find("[[nodes]]").unwrap()].to_string();
        for (role, count) in [("prefill", prefill), ("decode", decode)] {
            for index in 0..count {
                text.push_str(&format!(
                    "[[nodes]]\nname = \"{role}-{index}\"\nrole = \"{role}\"\nblocks_per_group = 8\n"
                ));
            }
        }
        ClusterConfig::from_toml(&text).unwrap()
    }

    /// 4 layers + 2 generation tables = 6 regions a leg. 112 x 112 legs need
    /// 6 * 224 + 6 * 112 * 112 = 76 608 mappings, more than Linux's default 65 530 allows; 96 x 96
    /// need 56 448, which fit (and run: `pdkv sweep` on such a cluster was tried by hand).
    #[test]
    fn shm_clusters_beyond_max_map_count_are_refused_with_the_limit_named() {
        assert!(check_map_count(&cluster(1, 1), 65_530).is_ok());
        assert!(check_map_count(&cluster(96, 96), 65_530).is_ok());
        let error = check_map_count(&cluster(112, 112), 65_530).unwrap_err();
        assert_eq!(
            error,
            RequestError::MapLimit {
                needed: 76_608,
                decode: 112,
                prefill: 112,
                regions: 6,
                limit: 65_530,
                reserved: 4096 + 16 * 224,
                usable: 65_530 - 4096 - 16 * 224,
            }
        );
        assert!(error.to_string().contains("vm.max_map_count = 65530"), "{error}");
        assert!(check_map_count(&cluster(112, 112), 1 << 20).is_ok());
    }
}
