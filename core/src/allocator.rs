//! The block allocator of one leg: per-group pools of KV blocks, position-indexed request lists,
//! a prefix cache for full-attention groups, pins for remote READs and per-block generations.
//!
//! Pure state machine: callers say what happened (a request was admitted, its window moved, it
//! finished, a grant pinned its blocks) and read back the lists. Blocks that became free are
//! reported through [`Allocator::poll_freed`] with their new generation, so a shell that mirrors
//! generations into shared memory (for one-sided READs that validate after copying) stays exact.
//!
//! Rules:
//! - Block id 0 is the null block and never allocated; a pool of capacity `c` hands out `1..=c`.
//! - Allocation is all-or-nothing over every group; running out is an [`AllocError`] naming the
//!   group, never a partial allocation.
//! - Allocation prefers the lowest contiguous run of free ids, so plans coalesce into few READs.
//! - A block's reference count covers the requests holding it and the pins on it; it returns to
//!   the free pool only when both are gone. Its generation is bumped when it is freed (or when a
//!   cached block is evicted for reuse), so a reader holding an old generation can tell.
//! - Prefix caching: full blocks of prompt tokens are hashed in a chain (each hash covers every
//!   token before it). Unreferenced cached blocks stay reusable until evicted least-recently-used.

use std::collections::{BTreeSet, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

use serde::{Deserialize, Serialize};

use crate::block::{BlockId, NULL_BLOCK};
use crate::layout::{GroupKind, GroupSpec, KvLayout};
use crate::wire::RequestId;

/// A block that went back to the free pool, with its new generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FreedBlock {
    /// Group index.
    pub group: usize,
    /// Block id.
    pub block: BlockId,
    /// Generation after the bump.
    pub generation: u32,
}

/// What [`Allocator::allocate`] hands back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    /// Position-indexed list per group (null below a window group's first needed block).
    pub blocks: Vec<Vec<BlockId>>,
    /// Leading positions per group that were prefix-cache hits (already hold the KV).
    pub cached_blocks: Vec<u64>,
}

/// Per-request state.
#[derive(Debug, Clone)]
struct RequestBlocks {
    blocks: Vec<Vec<BlockId>>,
    slots: u64,
}

/// One group's pool.
#[derive(Debug, Clone)]
struct Pool {
    spec: GroupSpec,
    capacity: u32,
    /// Free, uncached ids.
    free: BTreeSet<BlockId>,
    /// Reference count per id (requests + pins); index 0 unused.
    refs: Vec<u32>,
    generation: Vec<u32>,
    /// Prefix hash a cached block holds.
    hash: Vec<Option<u64>>,
    cached: HashMap<u64, BlockId>,
    /// Unreferenced cached blocks by last-use tick (LRU first).
    evictable: BTreeSet<(u64, BlockId)>,
    evictable_tick: Vec<Option<u64>>,
}

impl Pool {
    fn new(spec: GroupSpec, capacity: u32) -> Self {
        let slots = capacity as usize + 1;
        Pool {
            spec,
            capacity,
            free: (1..=capacity).collect(),
            refs: vec![0; slots],
            generation: vec![0; slots],
            hash: vec![None; slots],
            cached: HashMap::new(),
            evictable: BTreeSet::new(),
            evictable_tick: vec![None; slots],
        }
    }

    fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Takes `count` blocks: the lowest contiguous free run if there is one, else the lowest free
    /// ids, then least-recently-used cached blocks. The caller checked availability.
    fn take(&mut self, count: usize, freed: &mut Vec<FreedBlock>, group: usize) -> Vec<BlockId> {
        let mut taken = Vec::with_capacity(count);
        if count == 0 {
            return taken;
        }
        let mut run_start = None;
        let mut run_len = 0usize;
        let mut previous = None;
        for &id in &self.free {
            if previous.is_some_and(|p: BlockId| p + 1 == id) {
                run_len += 1;
            } else {
                run_start = Some(id);
                run_len = 1;
            }
            previous = Some(id);
            if run_len == count {
                break;
            }
        }
        let from_free: Vec<BlockId> = match run_start {
            Some(start) if run_len == count => (start..start + count as BlockId).collect(),
            _ => self.free.iter().take(count).copied().collect(),
        };
        for id in from_free {
            self.free.remove(&id);
            taken.push(id);
        }
        while taken.len() < count {
            // Availability was checked, so an evictable block exists here.
            let Some((_, id)) = self.evictable.pop_first() else {
                break;
            };
            self.evictable_tick[id as usize] = None;
            if let Some(hash) = self.hash[id as usize].take() {
                self.cached.remove(&hash);
            }
            self.generation[id as usize] = self.generation[id as usize].wrapping_add(1);
            freed.push(FreedBlock {
                group,
                block: id,
                generation: self.generation[id as usize],
            });
            taken.push(id);
        }
        for &id in &taken {
            self.refs[id as usize] = 1;
        }
        taken
    }

    fn unref(&mut self, id: BlockId, tick: u64, freed: &mut Vec<FreedBlock>, group: usize) {
        if id == NULL_BLOCK {
            return;
        }
        let refs = &mut self.refs[id as usize];
        debug_assert!(
            *refs > 0,
            "block {id} of group {group} released more often than held"
        );
        *refs = refs.saturating_sub(1);
        if *refs > 0 {
            return;
        }
        if self.hash[id as usize].is_some() {
            self.evictable.insert((tick, id));
            self.evictable_tick[id as usize] = Some(tick);
        } else {
            self.generation[id as usize] = self.generation[id as usize].wrapping_add(1);
            freed.push(FreedBlock {
                group,
                block: id,
                generation: self.generation[id as usize],
            });
            self.free.insert(id);
        }
    }

    /// Takes a reference on a cached block, pulling it out of the evictable set.
    fn reference_cached(&mut self, id: BlockId) {
        if let Some(tick) = self.evictable_tick[id as usize].take() {
            self.evictable.remove(&(tick, id));
        }
        self.refs[id as usize] += 1;
    }
}

/// The block allocator of one leg.
#[derive(Debug, Clone)]
pub struct Allocator {
    pools: Vec<Pool>,
    requests: HashMap<RequestId, RequestBlocks>,
    prefix_caching: bool,
    tick: u64,
    freed: Vec<FreedBlock>,
}

impl Allocator {
    /// An allocator for `layout` with `capacity[g]` blocks in group `g` (ids `1..=capacity`).
    pub fn new(layout: &KvLayout, capacity: &[u32], prefix_caching: bool) -> Result<Self, AllocError> {
        if capacity.len() != layout.groups().len() {
            return Err(AllocError::CapacityCount {
                given: capacity.len(),
                groups: layout.groups().len(),
            });
        }
        if let Some(group) = capacity.iter().position(|&c| c == 0) {
            return Err(AllocError::ZeroCapacity { group });
        }
        Ok(Allocator {
            pools: layout
                .groups()
                .iter()
                .zip(capacity)
                .map(|(spec, &capacity)| Pool::new(*spec, capacity))
                .collect(),
            requests: HashMap::new(),
            prefix_caching,
            tick: 0,
            freed: Vec::new(),
        })
    }

    /// Admits `request` with `slots` token slots (prompt plus lookahead). With `attending_token`
    /// `Some(t)` (the first token this leg will compute, its earlier KV coming from elsewhere),
    /// window groups hold the null block below the block of token `t + 1 - W`, the oldest token
    /// `t`'s window sees; with `None` every position gets a block. With prefix caching, full groups
    /// reuse cached blocks for leading full blocks of `prompt`, never the block of the last prompt
    /// token (it is always recomputed).
    pub fn allocate(
        &mut self,
        request: RequestId,
        prompt: &[u32],
        slots: u64,
        attending_token: Option<u64>,
    ) -> Result<Allocation, AllocError> {
        if self.requests.contains_key(&request) {
            return Err(AllocError::DuplicateRequest(request));
        }
        if slots == 0 {
            return Err(AllocError::NoSlots(request));
        }
        // Plan every group first, commit only if all fit.
        let mut plans = Vec::with_capacity(self.pools.len());
        for (group, pool) in self.pools.iter().enumerate() {
            let spec = pool.spec;
            let len = spec.blocks_for_tokens(slots);
            let nulls = match attending_token.and_then(|token| spec.kind().attended_floor(token)) {
                Some(floor) => (floor / spec.effective_block_size()).min(len),
                None => 0,
            };
            let mut hits = if self.prefix_caching && spec.kind() == GroupKind::Full {
                self.lookup_prefix(group, prompt)
            } else {
                Vec::new()
            };
            // A caller asking for fewer slots than the prompt holds gets no hits past them.
            hits.truncate((len - nulls) as usize);
            let fresh = (len - nulls) as usize - hits.len();
            let evictable_hits = hits
                .iter()
                .filter(|&&id| pool.evictable_tick[id as usize].is_some())
                .count();
            let available = pool.available() - evictable_hits;
            if fresh > available {
                return Err(if fresh as u64 > u64::from(pool.capacity) {
                    AllocError::NeverFits {
                        group,
                        kind: spec.kind(),
                        needed: fresh as u64,
                        capacity: pool.capacity,
                    }
                } else {
                    AllocError::OutOfBlocks {
                        group,
                        kind: spec.kind(),
                        needed: fresh,
                        free: available,
                    }
                });
            }
            plans.push((nulls as usize, hits, fresh));
        }
        let mut blocks = Vec::with_capacity(plans.len());
        let mut cached_blocks = Vec::with_capacity(plans.len());
        for (group, (nulls, hits, fresh)) in plans.into_iter().enumerate() {
            let pool = &mut self.pools[group];
            for &id in &hits {
                pool.reference_cached(id);
            }
            let mut list = vec![NULL_BLOCK; nulls];
            cached_blocks.push(hits.len() as u64);
            list.extend(hits);
            list.extend(pool.take(fresh, &mut self.freed, group));
            blocks.push(list);
        }
        self.requests.insert(
            request,
            RequestBlocks {
                blocks: blocks.clone(),
                slots,
            },
        );
        Ok(Allocation {
            blocks,
            cached_blocks,
        })
    }

    /// Grows a request's attention groups to cover `slots` token slots (decode steps beyond the
    /// lookahead). All-or-nothing.
    pub fn extend(&mut self, request: RequestId, slots: u64) -> Result<&[Vec<BlockId>], AllocError> {
        let state = self
            .requests
            .get(&request)
            .ok_or(AllocError::UnknownRequest(request))?;
        let mut growth = Vec::with_capacity(self.pools.len());
        for (group, pool) in self.pools.iter().enumerate() {
            let have = state.blocks[group].len() as u64;
            let want = pool.spec.blocks_for_tokens(slots).max(have);
            let extra = (want - have) as usize;
            if extra > pool.available() {
                return Err(AllocError::OutOfBlocks {
                    group,
                    kind: pool.spec.kind(),
                    needed: extra,
                    free: pool.available(),
                });
            }
            growth.push(extra);
        }
        let state = self
            .requests
            .get_mut(&request)
            .ok_or(AllocError::UnknownRequest(request))?;
        for (group, extra) in growth.into_iter().enumerate() {
            let taken = self.pools[group].take(extra, &mut self.freed, group);
            state.blocks[group].extend(taken);
        }
        state.slots = state.slots.max(slots);
        Ok(&state.blocks)
    }

    /// Frees window-group blocks that token `attending_token`'s window no longer sees (below the
    /// block of token `attending_token + 1 - W`), and chunked-group blocks of chunks before its
    /// own, replacing them with the null block.
    ///
    /// A prefill leg calls it with the last prompt token (`N - 1`), which the decode leg
    /// recomputes: every block holding tokens `N - W .. N - 1` stays, one token more than the
    /// prefill leg's own next step would keep.
    pub fn release_window(&mut self, request: RequestId, attending_token: u64) -> Result<(), AllocError> {
        self.tick += 1;
        let tick = self.tick;
        let state = self
            .requests
            .get_mut(&request)
            .ok_or(AllocError::UnknownRequest(request))?;
        for (group, pool) in self.pools.iter_mut().enumerate() {
            let Some(first_needed) = pool.spec.kind().attended_floor(attending_token) else {
                continue;
            };
            let list = &mut state.blocks[group];
            let below = ((first_needed / pool.spec.effective_block_size()) as usize).min(list.len());
            for id in &mut list[..below] {
                pool.unref(*id, tick, &mut self.freed, group);
                *id = NULL_BLOCK;
            }
        }
        Ok(())
    }

    /// Pins every real block of `lists` (a grant): they stay allocated until [`Self::unpin`],
    /// even if their request finishes. Returns each block's generation, parallel to `lists`.
    pub fn pin(&mut self, lists: &[Vec<BlockId>]) -> Result<Vec<Vec<u32>>, AllocError> {
        self.check_lists(lists)?;
        let mut generations = Vec::with_capacity(lists.len());
        for (pool, list) in self.pools.iter_mut().zip(lists) {
            let mut group_generations = Vec::with_capacity(list.len());
            for &id in list {
                if id != NULL_BLOCK {
                    pool.refs[id as usize] += 1;
                }
                group_generations.push(pool.generation[id as usize]);
            }
            generations.push(group_generations);
        }
        Ok(generations)
    }

    /// Drops the pins [`Self::pin`] took on `lists`.
    pub fn unpin(&mut self, lists: &[Vec<BlockId>]) -> Result<(), AllocError> {
        self.check_lists(lists)?;
        self.tick += 1;
        for (group, (pool, list)) in self.pools.iter_mut().zip(lists).enumerate() {
            for &id in list {
                pool.unref(id, self.tick, &mut self.freed, group);
            }
        }
        Ok(())
    }

    /// Finishes a request: with prefix caching and `cache_prompt`, its full prompt blocks in full
    /// groups become cache entries; then every block it holds is released.
    pub fn finish(&mut self, request: RequestId, cache_prompt: Option<&[u32]>) -> Result<(), AllocError> {
        let state = self
            .requests
            .remove(&request)
            .ok_or(AllocError::UnknownRequest(request))?;
        self.tick += 1;
        for (group, list) in state.blocks.iter().enumerate() {
            let pool = &mut self.pools[group];
            if let (true, GroupKind::Full, Some(prompt)) =
                (self.prefix_caching, pool.spec.kind(), cache_prompt)
            {
                let block_tokens = pool.spec.effective_block_size() as usize;
                for (position, hash) in prefix_hashes(prompt, block_tokens).into_iter().enumerate() {
                    let id = list[position];
                    if id == NULL_BLOCK || pool.cached.contains_key(&hash) || pool.hash[id as usize].is_some()
                    {
                        continue;
                    }
                    pool.hash[id as usize] = Some(hash);
                    pool.cached.insert(hash, id);
                }
            }
            for &id in list {
                pool.unref(id, self.tick, &mut self.freed, group);
            }
        }
        Ok(())
    }

    /// A request's current lists.
    pub fn blocks(&self, request: RequestId) -> Option<&[Vec<BlockId>]> {
        self.requests.get(&request).map(|state| state.blocks.as_slice())
    }

    /// Blocks of `group` that a new request could take (free plus evictable cached).
    pub fn free_blocks(&self, group: usize) -> usize {
        self.pools.get(group).map_or(0, Pool::available)
    }

    /// Blocks of `group` in all.
    pub fn capacity(&self, group: usize) -> u32 {
        self.pools.get(group).map_or(0, |pool| pool.capacity)
    }

    /// Whether every group's free count equals its capacity (nothing held, nothing pinned).
    pub fn is_idle(&self) -> bool {
        self.requests.is_empty()
            && self
                .pools
                .iter()
                .all(|pool| pool.available() == pool.capacity as usize)
    }

    /// Current generation of a block.
    pub fn generation(&self, group: usize, block: BlockId) -> Option<u32> {
        self.pools.get(group)?.generation.get(block as usize).copied()
    }

    /// Number of requests holding blocks.
    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// Blocks freed since the last call, with their new generations.
    pub fn poll_freed(&mut self) -> Vec<FreedBlock> {
        std::mem::take(&mut self.freed)
    }

    fn lookup_prefix(&self, group: usize, prompt: &[u32]) -> Vec<BlockId> {
        let pool = &self.pools[group];
        let block_tokens = pool.spec.effective_block_size() as usize;
        // Never hit the block holding the last prompt token: the decode leg recomputes it.
        let usable = &prompt[..prompt.len().saturating_sub(1)];
        prefix_hashes(usable, block_tokens)
            .into_iter()
            .map_while(|hash| pool.cached.get(&hash).copied())
            .collect()
    }

    fn check_lists(&self, lists: &[Vec<BlockId>]) -> Result<(), AllocError> {
        if lists.len() != self.pools.len() {
            return Err(AllocError::ListCount {
                given: lists.len(),
                groups: self.pools.len(),
            });
        }
        for (group, (pool, list)) in self.pools.iter().zip(lists).enumerate() {
            if let Some(&block) = list.iter().find(|&&id| id > pool.capacity) {
                return Err(AllocError::BlockOutOfRange {
                    group,
                    block,
                    capacity: pool.capacity,
                });
            }
            if let Some(&block) = list
                .iter()
                .find(|&&id| id != NULL_BLOCK && pool.refs[id as usize] == 0)
            {
                return Err(AllocError::BlockNotHeld { group, block });
            }
        }
        Ok(())
    }
}

/// Whether moving the attending token from `from` to `to` lets some window or chunked group of
/// `layout` free a block (the oldest token it attends to crossed a block boundary). Lets a
/// decode loop skip asking the allocator on steps where nothing would be freed.
pub fn window_crosses_block(layout: &KvLayout, from: u64, to: u64) -> bool {
    layout.groups().iter().any(|group| {
        let kind = group.kind();
        let block_tokens = group.effective_block_size();
        match (kind.attended_floor(from), kind.attended_floor(to)) {
            (Some(from), Some(to)) => to / block_tokens > from / block_tokens,
            _ => false,
        }
    })
}

/// Chained hashes of the full `block_tokens`-sized blocks of `tokens`: hash `p` covers tokens
/// `0 .. (p+1) * block_tokens`.
pub fn prefix_hashes(tokens: &[u32], block_tokens: usize) -> Vec<u64> {
    let mut hashes = Vec::with_capacity(tokens.len() / block_tokens.max(1));
    let mut parent = 0u64;
    for chunk in tokens.chunks_exact(block_tokens.max(1)) {
        let mut hasher = DefaultHasher::new();
        parent.hash(&mut hasher);
        chunk.hash(&mut hasher);
        parent = hasher.finish();
        hashes.push(parent);
    }
    hashes
}

/// Why the allocator refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum AllocError {
    /// Not enough free blocks now; may succeed after others finish.
    #[error("group {group} ({kind}): needs {needed} free blocks, {free} free")]
    OutOfBlocks {
        /// Group index.
        group: usize,
        /// Group kind.
        kind: GroupKind,
        /// Blocks needed.
        needed: usize,
        /// Blocks free.
        free: usize,
    },
    /// The request needs more blocks than the group holds in all: it can never run here.
    #[error("group {group} ({kind}): needs {needed} blocks, the leg has only {capacity}")]
    NeverFits {
        /// Group index.
        group: usize,
        /// Group kind.
        kind: GroupKind,
        /// Blocks needed.
        needed: u64,
        /// Group capacity.
        capacity: u32,
    },
    /// The request already holds blocks.
    #[error("{0} already holds blocks")]
    DuplicateRequest(RequestId),
    /// The request holds no blocks here.
    #[error("{0} holds no blocks on this leg")]
    UnknownRequest(RequestId),
    /// A request needs at least one slot.
    #[error("{0} asks for 0 token slots")]
    NoSlots(RequestId),
    /// One capacity per group is required.
    #[error("capacity has {given} entries, the layout has {groups} groups")]
    CapacityCount {
        /// Entries given.
        given: usize,
        /// Groups in the layout.
        groups: usize,
    },
    /// A group needs at least one block.
    #[error("group {group}: capacity must be at least 1 block")]
    ZeroCapacity {
        /// Group index.
        group: usize,
    },
    /// Pin lists need one list per group.
    #[error("{given} lists given, the layout has {groups} groups")]
    ListCount {
        /// Lists given.
        given: usize,
        /// Groups in the layout.
        groups: usize,
    },
    /// A block id beyond the pool.
    #[error("group {group}: block {block} is beyond the pool's {capacity} blocks")]
    BlockOutOfRange {
        /// Group index.
        group: usize,
        /// Block id.
        block: BlockId,
        /// Pool capacity.
        capacity: u32,
    },
    /// Pinning a block nobody holds would resurrect freed memory.
    #[error("group {group}: block {block} is not held by any request")]
    BlockNotHeld {
        /// Group index.
        group: usize,
        /// Block id.
        block: BlockId,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout::one_layer_per_group(vec![
            GroupSpec::full(4, 1).unwrap(),
            GroupSpec::sliding_window(4, 8, 1).unwrap(),
            GroupSpec::mamba(),
        ])
        .unwrap()
    }

    #[test]
    fn allocates_contiguous_position_indexed_lists_with_window_nulls() {
        let mut allocator = Allocator::new(&layout(), &[16, 16, 4], false).unwrap();
        let allocation = allocator
            .allocate(RequestId(1), &[1; 14], 14 + 3, Some(13))
            .unwrap();
        assert_eq!(
            allocation.blocks,
            vec![vec![1, 2, 3, 4, 5], vec![0, 1, 2, 3, 4], vec![1]]
        );
        assert_eq!(allocator.free_blocks(0), 11);
        allocator.finish(RequestId(1), None).unwrap();
        assert!(allocator.is_idle());
    }

    /// Allocation prefers the lowest run of free ids long enough for the request (plans then
    /// coalesce into few READs), and falls back to the lowest ids only when no run is long enough.
    #[test]
    fn allocation_prefers_the_lowest_contiguous_run() {
        let mut allocator = Allocator::new(&layout(), &[8, 16, 8], false).unwrap();
        for (id, tokens) in [(1, 4), (2, 4), (3, 4), (4, 4), (5, 16)] {
            allocator
                .allocate(RequestId(id), &vec![1; tokens], tokens as u64, None)
                .unwrap();
        }
        for id in [2, 4, 5] {
            allocator.finish(RequestId(id), None).unwrap();
        }
        // Free ids of the full group: 2, 4, 5, 6, 7, 8.
        let run = allocator.allocate(RequestId(6), &[1; 12], 12, None).unwrap();
        assert_eq!(run.blocks[0], vec![4, 5, 6]);
        // Free: 2, 7, 8. No run of 3: the lowest ids.
        let scattered = allocator.allocate(RequestId(7), &[1; 12], 12, None).unwrap();
        assert_eq!(scattered.blocks[0], vec![2, 7, 8]);
    }

    /// The accessors a shell reports from: capacity, request count, idleness, generations.
    #[test]
    fn accessors_report_the_pools() {
        let mut allocator = Allocator::new(&layout(), &[16, 12, 4], false).unwrap();
        assert_eq!(
            (
                allocator.capacity(0),
                allocator.capacity(1),
                allocator.capacity(2)
            ),
            (16, 12, 4)
        );
        assert_eq!(allocator.capacity(3), 0);
        assert!(allocator.is_idle());
        allocator.allocate(RequestId(1), &[1; 8], 8, None).unwrap();
        assert_eq!(allocator.num_requests(), 1);
        assert!(!allocator.is_idle(), "a request holds blocks");
        allocator.finish(RequestId(1), None).unwrap();
        assert_eq!(allocator.num_requests(), 0);
        assert_eq!(allocator.generation(0, 1), Some(1));
        assert_eq!(allocator.generation(0, 3), Some(0));
        assert_eq!(allocator.generation(0, 17), None);
        assert!(allocator.is_idle());
        // Idle needs every group back: a pin alone keeps it busy.
        let held = allocator.allocate(RequestId(2), &[1; 1], 1, None).unwrap();
        allocator.pin(&held.blocks).unwrap();
        allocator.finish(RequestId(2), None).unwrap();
        assert_eq!(allocator.num_requests(), 0);
        assert!(!allocator.is_idle(), "pinned blocks are not free");
        allocator.unpin(&held.blocks).unwrap();
        assert!(allocator.is_idle());
    }

    /// Two requests that computed the same prompt at once: the first to finish caches its
    /// blocks, the second's go back to the free pool (generation bumped), never a second entry.
    #[test]
    fn a_prompt_computed_twice_is_cached_once() {
        let mut allocator = Allocator::new(&layout(), &[16, 16, 4], true).unwrap();
        let prompt: Vec<u32> = (0..9).collect();
        let first = allocator.allocate(RequestId(1), &prompt, 9, None).unwrap();
        let second = allocator.allocate(RequestId(2), &prompt, 9, None).unwrap();
        assert_eq!(second.cached_blocks[0], 0, "nothing cached yet");
        allocator.finish(RequestId(1), Some(&prompt)).unwrap();
        allocator.poll_freed();
        allocator.finish(RequestId(2), Some(&prompt)).unwrap();
        let freed: Vec<BlockId> = allocator
            .poll_freed()
            .iter()
            .filter(|freed| freed.group == 0)
            .map(|freed| freed.block)
            .collect();
        assert_eq!(
            freed, second.blocks[0],
            "the duplicate's blocks are freed, not cached"
        );
        let third = allocator.allocate(RequestId(3), &prompt, 9, None).unwrap();
        assert_eq!(third.cached_blocks[0], 2);
        assert_eq!(third.blocks[0][..2], first.blocks[0][..2]);
    }

    /// A request that needs exactly the blocks left gets them, by allocation or by extension.
    #[test]
    fn the_last_free_blocks_can_be_taken() {
        let mut allocator = Allocator::new(&layout(), &[4, 4, 4], false).unwrap();
        allocator.allocate(RequestId(1), &[1; 8], 8, None).unwrap();
        let allocation = allocator.allocate(RequestId(2), &[1; 4], 4, None).unwrap();
        assert_eq!(allocation.blocks[0], vec![3]);
        assert_eq!(allocator.extend(RequestId(2), 8).unwrap()[0], vec![3, 4]);
        assert_eq!(allocator.free_blocks(0), 0);
        // A request needing the whole pool while others hold part of it waits (may fit later);
        // only one needing more than the pool never fits.
        assert!(matches!(
            allocator.allocate(RequestId(3), &[1; 16], 16, None),
            Err(AllocError::OutOfBlocks {
                group: 0,
                needed: 4,
                ..
            })
        ));
        assert!(matches!(
            allocator.allocate(RequestId(3), &[1; 17], 17, None),
            Err(AllocError::NeverFits {
                group: 0,
                needed: 5,
                ..
            })
        ));
        assert_eq!(
            allocator.extend(RequestId(2), 9).unwrap_err(),
            AllocError::OutOfBlocks {
                group: 0,
                kind: GroupKind::Full,
                needed: 1,
                free: 0
            }
        );
    }

    #[test]
    fn running_out_names_the_group_and_allocates_nothing() {
        let mut allocator = Allocator::new(&layout(), &[4, 16, 4], false).unwrap();
        allocator.allocate(RequestId(1), &[1; 8], 8, None).unwrap();
        let error = allocator.allocate(RequestId(2), &[1; 12], 12, None).unwrap_err();
        assert_eq!(error.to_string(), "group 0 (full): needs 3 free blocks, 2 free");
        assert_eq!(allocator.free_blocks(1), 14);
        let error = allocator.allocate(RequestId(3), &[1; 40], 40, None).unwrap_err();
        assert_eq!(
            error.to_string(),
            "group 0 (full): needs 10 blocks, the leg has only 4"
        );
    }

    #[test]
    fn window_release_frees_and_bumps_generations() {
        let mut allocator = Allocator::new(&layout(), &[16, 16, 4], false).unwrap();
        allocator.allocate(RequestId(1), &[1; 16], 16, None).unwrap();
        allocator.poll_freed();
        allocator.release_window(RequestId(1), 16).unwrap();
        assert_eq!(allocator.blocks(RequestId(1)).unwrap()[1], vec![0, 0, 3, 4]);
        let freed = allocator.poll_freed();
        assert_eq!(
            freed,
            vec![
                FreedBlock {
                    group: 1,
                    block: 1,
                    generation: 1
                },
                FreedBlock {
                    group: 1,
                    block: 2,
                    generation: 1
                }
            ]
        );
    }

    #[test]
    fn pinned_blocks_outlive_their_request() {
        let mut allocator = Allocator::new(&layout(), &[16, 16, 4], false).unwrap();
        let allocation = allocator.allocate(RequestId(1), &[1; 8], 8, None).unwrap();
        let generations = allocator.pin(&allocation.blocks).unwrap();
        assert_eq!(generations, vec![vec![0, 0], vec![0, 0], vec![0]]);
        allocator.finish(RequestId(1), None).unwrap();
        assert_eq!(allocator.free_blocks(0), 14);
        allocator.unpin(&allocation.blocks).unwrap();
        assert!(allocator.is_idle());
        assert_eq!(allocator.generation(0, 1), Some(1));
        assert!(matches!(
            allocator.pin(&allocation.blocks),
            Err(AllocError::BlockNotHeld { .. })
        ));
    }

    #[test]
    fn prefix_hits_reuse_full_blocks_but_never_the_last_token_block() {
        let mut allocator = Allocator::new(&layout(), &[16, 16, 4], true).unwrap();
        let prompt: Vec<u32> = (0..12).collect();
        let first = allocator.allocate(RequestId(1), &prompt, 13, None).unwrap();
        allocator.finish(RequestId(1), Some(&prompt)).unwrap();
        assert!(allocator.is_idle(), "cached blocks count as free");
        let second = allocator.allocate(RequestId(2), &prompt, 13, None).unwrap();
        // 12 tokens = 3 full blocks; the block of token 11 is recomputed, so 2 hits.
        assert_eq!(second.cached_blocks, vec![2, 0, 0]);
        assert_eq!(second.blocks[0][..2], first.blocks[0][..2]);
        let mut other = prompt.clone();
        other[5] = 99;
        let third = allocator.allocate(RequestId(3), &other, 13, None).unwrap();
        assert_eq!(third.cached_blocks, vec![1, 0, 0]);
        allocator.finish(RequestId(2), None).unwrap();
        allocator.finish(RequestId(3), None).unwrap();
        assert!(allocator.is_idle());
    }

    #[test]
    fn cached_blocks_are_evicted_lru_when_space_runs_out() {
        let mut allocator = Allocator::new(&layout(), &[4, 16, 4], true).unwrap();
        let prompt: Vec<u32> = (0..16).collect();
        allocator.allocate(RequestId(1), &prompt, 16, None).unwrap();
        allocator.finish(RequestId(1), Some(&prompt)).unwrap();
        assert_eq!(allocator.free_blocks(0), 4);
        let other: Vec<u32> = (100..116).collect();
        allocator.allocate(RequestId(2), &other, 16, None).unwrap();
        assert!(allocator.poll_freed().iter().filter(|f| f.group == 0).count() == 4);
        allocator.finish(RequestId(2), None).unwrap();
        assert!(allocator.is_idle());
    }

    /// Eviction takes the least recently used cached blocks first: of two cached prompts, the
    /// one touched last survives a request that needs room.
    #[test]
    fn eviction_follows_least_recent_use() {
        // Block size 4; capacity 6 in the full group. A 9-token prompt holds 3 blocks, of which
        // 2 are full prompt blocks that can be cached (the block of the last token never is).
        let mut allocator = Allocator::new(&layout(), &[6, 16, 4], true).unwrap();
        let a: Vec<u32> = (0..9).collect();
        let b: Vec<u32> = (100..109).collect();
        let run = |allocator: &mut Allocator, id: u64, prompt: &[u32]| {
            let allocation = allocator.allocate(RequestId(id), prompt, 9, None).unwrap();
            allocator.finish(RequestId(id), Some(prompt)).unwrap();
            allocation
        };
        let first_a = run(&mut allocator, 1, &a);
        run(&mut allocator, 2, &b);
        // Touch A again: now B is the least recently used.
        assert_eq!(run(&mut allocator, 3, &a).cached_blocks[0], 2);
        allocator.poll_freed();
        // 4 blocks needed, 2 free: the other 2 come from the LRU cached prompt, B.
        let fresh: Vec<u32> = (200..216).collect();
        let taken = allocator.allocate(RequestId(4), &fresh, 16, None).unwrap();
        let evicted: Vec<BlockId> = allocator
            .poll_freed()
            .iter()
            .filter(|freed| freed.group == 0)
            .map(|freed| freed.block)
            .collect();
        assert_eq!(evicted.len(), 2);
        assert!(evicted.iter().all(|block| taken.blocks[0].contains(block)));
        assert!(
            evicted
                .iter()
                .all(|block| !first_a.blocks[0][..2].contains(block)),
            "A's cached blocks survive"
        );
        allocator.finish(RequestId(4), None).unwrap();
        let again_a = allocator.allocate(RequestId(5), &a, 9, None).unwrap();
        assert_eq!(again_a.cached_blocks[0], 2);
        assert_eq!(again_a.blocks[0][..2], first_a.blocks[0][..2]);
        allocator.finish(RequestId(5), None).unwrap();
        let again_b = allocator.allocate(RequestId(6), &b, 9, None).unwrap();
        assert_eq!(again_b.cached_blocks[0], 0, "B was evicted");
    }

    #[test]
    fn fewer_slots_than_cached_prompt_blocks_is_not_an_underflow() {
        let mut allocator = Allocator::new(&layout(), &[16, 16, 4], true).unwrap();
        let prompt: Vec<u32> = (0..16).collect();
        allocator.allocate(RequestId(1), &prompt, 16, None).unwrap();
        allocator.finish(RequestId(1), Some(&prompt)).unwrap();
        let allocation = allocator.allocate(RequestId(2), &prompt, 4, None).unwrap();
        assert_eq!(allocation.blocks[0].len(), 1);
        assert_eq!(allocation.cached_blocks[0], 1);
    }

    #[test]
    fn window_crossings_are_found_at_block_boundaries_only() {
        let layout = layout(); // window 8, block 4
        // Token t attends from t + 1 - 8: tokens 10 and 11 attend from 3 and 4 (blocks 0 and 1).
        assert!(window_crosses_block(&layout, 10, 11));
        assert!(!window_crosses_block(&layout, 11, 12));
        assert!(
            !window_crosses_block(&layout, 2, 7),
            "the window has not moved off token 0"
        );
        assert!(window_crosses_block(&layout, 2, 20));
        let full_only = KvLayout::one_layer_per_group(vec![GroupSpec::full(4, 1).unwrap()]).unwrap();
        assert!(!window_crosses_block(&full_only, 0, 1000));
    }

    /// Chunks of 6 tokens in blocks of 4 (a chunk is no whole number of blocks): token t
    /// attends from 6 * floor(t / 6). Allocation for attending token 13 (chunk 12..=17) nulls
    /// blocks 0-2 (tokens 0..=11); release for token 18 (chunk 18..=23) also frees block 3
    /// (tokens 12..=15), keeps block 4 (16..=19, holding token 18). Crossings are at chunk starts
    /// that enter a new block only.
    #[test]
    fn chunked_groups_null_and_release_the_blocks_of_earlier_chunks() {
        let layout = KvLayout::one_layer_per_group(vec![
            GroupSpec::full(4, 1).unwrap(),
            GroupSpec::chunked_local(4, 6, 1).unwrap(),
        ])
        .unwrap();
        let mut allocator = Allocator::new(&layout, &[16, 16], false).unwrap();
        let allocation = allocator.allocate(RequestId(1), &[1; 14], 20, Some(13)).unwrap();
        assert_eq!(allocation.blocks[0].len(), 5);
        let chunked = &allocation.blocks[1];
        assert_eq!(chunked.len(), 5);
        assert_eq!(&chunked[..3], &[NULL_BLOCK; 3]);
        assert!(chunked[3..].iter().all(|&id| id != NULL_BLOCK));
        let (kept_block_3, kept_block_4) = (chunked[3], chunked[4]);
        allocator.poll_freed();
        allocator.release_window(RequestId(1), 17).unwrap();
        assert!(
            allocator.poll_freed().is_empty(),
            "token 17 is still in chunk 12..=17"
        );
        allocator.release_window(RequestId(1), 18).unwrap();
        let lists = allocator.blocks(RequestId(1)).unwrap();
        assert_eq!(lists[1], vec![0, 0, 0, 0, kept_block_4]);
        let freed: Vec<(usize, BlockId)> = allocator
            .poll_freed()
            .iter()
            .map(|freed| (freed.group, freed.block))
            .collect();
        assert_eq!(freed, vec![(1, kept_block_3)]);
        assert!(!window_crosses_block(&layout, 12, 17));
        assert!(window_crosses_block(&layout, 17, 18), "chunk 18.. leaves block 3");
        assert!(!window_crosses_block(&layout, 18, 23));
        assert!(
            window_crosses_block(&layout, 23, 24),
            "chunk 24.. starts in block 6, chunk 18.. in block 4"
        );
    }

    #[test]
    fn extend_grows_attention_groups_only() {
        let mut allocator = Allocator::new(&layout(), &[16, 16, 4], false).unwrap();
        allocator.allocate(RequestId(1), &[1; 8], 8, None).unwrap();
        let lists = allocator.extend(RequestId(1), 13).unwrap();
        assert_eq!(lists[0].len(), 4);
        assert_eq!(lists[1].len(), 4);
        assert_eq!(lists[2].len(), 1);
    }
}
