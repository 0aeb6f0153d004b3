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
use pdkv_core::wire::NodeId;
use pdkv_transport::engine::{EngineKey, MemoryDescriptor, ReadEngine};
use pdkv_transport::mapped::{LocalFabric, MappedEngine};
use tokio::sync::Notify;

use crate::allocator::{AllocatorActor, LegStats, Stats};
use crate::config::{ClusterConfig, NodeConfig, ReadEngineKind, Role};
use crate::engine::{LegMemory, Model};
use crate::error::{RequestError, ask};
use crate::exchange::ExchangeActor;
use crate::router::{Generate, GenerateDirect, Router};
use crate::scheduler::{GrantPeer, LegContext, Output, Scheduler};
use crate::transfer::TransferActor;

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
                Role::Prefill => prefill_schedulers.push((leg.node.name.clone(), scheduler.clone())),
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
