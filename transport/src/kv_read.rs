//! A decode side's READ of one request's KV, the same for a pdkv decode leg (the transfer actor)
//! and a vLLM decode worker (the connector's agent): which engine reads from a peer, then the
//! READ itself followed by the check that no source block changed under it.
//!
//! Plain values in, so this module knows nothing of actors or of vLLM: the caller has already
//! paired the blocks, built the plan and learned each source block's generation at grant time.

use std::collections::BTreeMap;
use std::time::Duration;

use pdkv_core::block::BlockId;
use pdkv_core::leg::GenerationCheck;
use pdkv_core::plan::{RegionLayout, TransferPlan};
use pdkv_core::wire::{GrantId, NodeId};

use crate::control::Hello;
use crate::engine::{EngineError, EngineKey, EngineKind, ReadEngine, ReadOp, ReadReport};
use crate::host::same_host;

/// No engine of ours reaches the peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{peer} offers READ engines {offers:?}{}, this side reads with {ours:?}",
    if *.other_host { " from another host" } else { "" }
)]
pub struct NoCommonEngine {
    /// The peer.
    pub peer: NodeId,
    /// The engines it offers.
    pub offers: Vec<EngineKind>,
    /// The engines this side reads with, in preference order.
    pub ours: Vec<EngineKind>,
    /// Whether the peer runs on another host (so same-host engines cannot reach it).
    pub other_host: bool,
}

/// Which of `ours` (engine kinds in preference order) reads from `peer`: the first the peer
/// offers that can reach it. Same-host engines (in-process, shared memory) need equal host ids;
/// the network engine and mori reach any host.
pub fn choose_engine(ours: &[EngineKind], our_host: &str, peer: &Hello) -> Result<usize, NoCommonEngine> {
    let offered = |kind: EngineKind| peer.engines.iter().any(|advert| advert.engine.kind == kind);
    let local = same_host(our_host, &peer.host);
    ours.iter()
        .position(|&kind| {
            offered(kind)
                && match kind {
                    EngineKind::Local | EngineKind::Shm => local,
                    EngineKind::Net | EngineKind::Mori => true,
                }
        })
        .ok_or_else(|| NoCommonEngine {
            peer: peer.node.clone(),
            offers: peer.engines.iter().map(|advert| advert.engine.kind).collect(),
            ours: ours.to_vec(),
            other_host: !local,
        })
}

/// Why a READ of a request's KV failed. Any of these fails the request: nothing read under it
/// may be used.
#[derive(Debug, thiserror::Error)]
pub enum KvReadError {
    /// The engine refused, failed or timed out (a partial READ is a failure).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The peer's region layout has no generation table for a group the READ covers.
    #[error("the prefill side has no generation table for group {group}")]
    NoGenerationTable {
        /// The group.
        group: usize,
    },
    /// The engine answered a different number of generation words than it was asked for.
    #[error("group {group}: asked for {asked} generation words, the engine answered {answered}")]
    WordCount {
        /// The group.
        group: usize,
        /// Words asked for.
        asked: usize,
        /// Words answered.
        answered: usize,
    },
    /// A source block was freed (and maybe reused) while it was read.
    #[error(
        "group {group}: prefill block {block} changed generation during the read ({expected} -> {found})"
    )]
    Stale {
        /// The group.
        group: usize,
        /// The prefill block.
        block: BlockId,
        /// Its generation at grant time.
        expected: u32,
        /// Its generation after the copy.
        found: u32,
    },
}

/// One READ: where from, under which grant, what to copy and what to check after.
pub struct KvRead<'a> {
    /// The engine that reads (chosen by [`choose_engine`], the peer registered with it).
    pub engine: &'a dyn ReadEngine,
    /// The peer's engine.
    pub remote: &'a EngineKey,
    /// The grant every byte is read under.
    pub grant: GrantId,
    /// The copies, per layer.
    pub plan: &'a TransferPlan,
    /// Where the peer's regions (and generation tables) are.
    pub remote_regions: &'a RegionLayout,
    /// Each source block's generation at grant time.
    pub checks: &'a [GenerationCheck],
    /// The bound on the copy.
    pub timeout: Duration,
}

impl KvRead<'_> {
    /// Copies the plan, then reads every source block's generation word: any change means the
    /// block was freed while it was read, and the READ fails closed.
    pub async fn run(self) -> Result<ReadReport, KvReadError> {
        let ops: Vec<ReadOp> = self
            .plan
            .layers
            .iter()
            .map(|layer| ReadOp {
                grant: self.grant,
                local_region: layer.local_region,
                remote_engine: self.remote.clone(),
                remote_region: layer.remote_region,
                runs: layer.runs.clone(),
            })
            .collect();
        let report = if ops.is_empty() {
            ReadReport::default()
        } else {
            self.engine.batch_read(ops)?.wait(self.timeout).await?
        };
        let mut by_group: BTreeMap<usize, Vec<&GenerationCheck>> = BTreeMap::new();
        for check in self.checks {
            by_group.entry(check.group).or_default().push(check);
        }
        for (group, checks) in by_group {
            let table = self
                .remote_regions
                .generation_region(group)
                .ok_or(KvReadError::NoGenerationTable { group })?;
            let blocks: Vec<BlockId> = checks.iter().map(|check| check.block).collect();
            let found = self
                .engine
                .read_remote_words(self.remote, self.grant, table, &blocks)
                .await?;
            if found.len() != blocks.len() {
                return Err(KvReadError::WordCount {
                    group,
                    asked: blocks.len(),
                    answered: found.len(),
                });
            }
            for (check, found) in checks.iter().zip(found) {
                if found != check.generation {
                    return Err(KvReadError::Stale {
                        group,
                        block: check.block,
                        expected: check.generation,
                        found,
                    });
                }
            }
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use pdkv_core::plan::{LayerPlan, LayerRegion, ReadRun};
    use pdkv_core::wire::{Incarnation, Role};

    use super::*;
    use crate::control::EngineAdvert;
    use crate::engine::EngineDescriptor;
    use crate::mapped::{LocalFabric, MappedEngine};
    use crate::region::Region;

    fn hello(host: &str, offers: &[EngineKind]) -> Hello {
        Hello {
            node: NodeId("p0".into()),
            role: Role::Prefill,
            incarnation: Incarnation(1),
            regions: RegionLayout::default(),
            protocol_version: crate::codec::PROTOCOL_VERSION,
            layout_hash: 0,
            model: pdkv_core::identity::ModelFields::default(),
            engines: offers
                .iter()
                .map(|&kind| EngineAdvert {
                    engine: EngineDescriptor {
                        key: EngineKey("p0".into()),
                        kind,
                        pid: 1,
                        address: String::new(),
                        packed: Vec::new(),
                    },
                    regions: Vec::new(),
                })
                .collect(),
            host: host.into(),
        }
    }

    /// The first of ours (in our order, not the peer's) that the peer offers and that reaches
    /// it; same-host engines only on an equal, known host id.
    #[test]
    fn the_first_engine_of_ours_that_reaches_the_peer_is_chosen() {
        use EngineKind::{Local, Mori, Net, Shm};
        let peer = hello("boot/h/ns", &[Net, Shm]);
        assert_eq!(choose_engine(&[Shm, Net], "boot/h/ns", &peer), Ok(0));
        assert_eq!(
            choose_engine(&[Net, Shm], "boot/h/ns", &peer),
            Ok(0),
            "our order decides"
        );
        assert_eq!(
            choose_engine(&[Shm, Net], "boot/other/ns", &peer),
            Ok(1),
            "shm stays on its host"
        );
        assert_eq!(choose_engine(&[Mori, Local, Net], "boot/other/ns", &peer), Ok(2));
        assert_eq!(
            choose_engine(&[Shm], "boot/other/ns", &peer),
            Err(NoCommonEngine {
                peer: NodeId("p0".into()),
                offers: vec![Net, Shm],
                ours: vec![Shm],
                other_host: true,
            })
        );
        let error = choose_engine(&[Mori], "boot/h/ns", &peer).unwrap_err();
        assert!(!error.other_host);
        assert_eq!(
            error.to_string(),
            "p0 offers READ engines [Net, Shm], this side reads with [Mori]"
        );
        let unknown = hello("", &[Shm]);
        assert!(
            choose_engine(&[Shm], "", &unknown).is_err(),
            "unknown hosts never match"
        );
    }

    const BLOCK: u64 = 16;

    /// A prefill side (KV region 0, generation table region 1) and a decode side reading it
    /// through the in-process engine.
    struct Pair {
        decode: MappedEngine,
        kv: Arc<Region>,
        generations: Arc<Region>,
        local: Arc<Region>,
        remote_regions: RegionLayout,
        plan: TransferPlan,
    }

    fn pair() -> Pair {
        let fabric = LocalFabric::new();
        let prefill = MappedEngine::local(EngineKey("p0".into()), fabric.clone()).unwrap();
        let decode = MappedEngine::local(EngineKey("d0".into()), fabric).unwrap();
        let (kv, generations, local) = (
            Arc::new(Region::heap(4 * BLOCK as usize)),
            Arc::new(Region::heap(16)),
            Arc::new(Region::heap(4 * BLOCK as usize)),
        );
        let descriptors = vec![
            prefill.register(0, kv.clone()).unwrap(),
            prefill.register(1, generations.clone()).unwrap(),
        ];
        decode.register(0, local.clone()).unwrap();
        decode
            .register_remote(&prefill.descriptor(), &descriptors)
            .unwrap();
        let remote_regions = RegionLayout {
            layers: vec![LayerRegion {
                region: 0,
                base_offset: 0,
                bytes_per_block: BLOCK,
                num_blocks: 4,
            }],
            generations: vec![1],
            ranks: 1,
            dcp: 1,
        };
        // Prefill blocks 2 and 3 into decode blocks 0 and 1.
        let plan = TransferPlan {
            layers: vec![LayerPlan {
                layer: 0,
                local_region: 0,
                remote_region: 0,
                runs: vec![ReadRun {
                    local_offset: 0,
                    remote_offset: 2 * BLOCK,
                    len_bytes: 2 * BLOCK,
                }],
            }],
        };
        Pair {
            decode,
            kv,
            generations,
            local,
            remote_regions,
            plan,
        }
    }

    fn read<'a>(pair: &'a Pair, remote: &'a EngineKey, checks: &'a [GenerationCheck]) -> KvRead<'a> {
        KvRead {
            engine: &pair.decode,
            remote,
            grant: GrantId(1),
            plan: &pair.plan,
            remote_regions: &pair.remote_regions,
            checks,
            timeout: Duration::from_secs(5),
        }
    }

    fn check(group: usize, block: BlockId, generation: u32) -> GenerationCheck {
        GenerationCheck {
            group,
            block,
            generation,
        }
    }

    /// The bytes arrive and the READ passes while every generation is the one granted; a block
    /// whose generation moved fails it by name; a group without a generation table fails it.
    #[test]
    fn a_read_copies_then_fails_closed_on_a_changed_generation() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let pair = pair();
        let remote = EngineKey("p0".into());
        pair.kv.write(2 * BLOCK, &[7; 2 * BLOCK as usize]).unwrap();
        pair.generations.store_u32(2, 5).unwrap();
        pair.generations.store_u32(3, 9).unwrap();
        let granted = [check(0, 2, 5), check(0, 3, 9)];
        let report = runtime.block_on(read(&pair, &remote, &granted).run()).unwrap();
        assert_eq!(report.bytes, 2 * BLOCK);
        let mut copied = [0u8; 2 * BLOCK as usize];
        pair.local.read(0, &mut copied).unwrap();
        assert_eq!(copied, [7; 2 * BLOCK as usize]);

        pair.generations.store_u32(3, 10).unwrap();
        let stale = runtime
            .block_on(read(&pair, &remote, &granted).run())
            .unwrap_err();
        assert!(
            matches!(
                stale,
                KvReadError::Stale {
                    group: 0,
                    block: 3,
                    expected: 9,
                    found: 10
                }
            ),
            "{stale:?}"
        );

        let other_group = [check(1, 2, 5)];
        let missing = runtime
            .block_on(read(&pair, &remote, &other_group).run())
            .unwrap_err();
        assert!(
            matches!(missing, KvReadError::NoGenerationTable { group: 1 }),
            "{missing:?}"
        );

        let stranger = EngineKey("p9".into());
        let unknown = runtime
            .block_on(read(&pair, &stranger, &granted).run())
            .unwrap_err();
        assert!(matches!(unknown, KvReadError::Engine(_)), "{unknown:?}");
    }
}
