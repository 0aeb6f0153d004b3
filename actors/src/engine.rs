//! The reference engine: a small, real attention model whose KV lives in paged blocks.
//!
//! Every run can check P/D output against the output of one leg alone only if there is a model
//! whose output depends on every byte of the exchanged KV. This one is tiny but real: token
//! embeddings, layers that each belong to a KV-cache group (full attention, sliding-window
//! attention with window W, or a mamba-style diagonal linear recurrence), f32 math and greedy
//! decoding, with weights drawn from a seeded ChaCha stream so every leg builds the same model.
//!
//! K and V live in the leg's registered regions, one region per layer, `block id * bytes per
//! block` apart; attention reads them through the request's block table exactly as a
//! paged-attention kernel would. A mamba layer keeps its running state in the request's state
//! block (entry 0 of its group's list).
//!
//! Tokens are computed one at a time in the same order on every leg, so the decode leg's
//! recomputation of the last prompt token, fed with KV copied from the prefill leg, is bitwise
//! equal to the one-leg computation; [`LogitsDigest`] condenses every generated step's logits.

use pdkv_core::block::{BlockId, NULL_BLOCK};
use pdkv_core::heads::KvShards;
use pdkv_core::layout::{GroupKind, GroupSpec, KvLayout};
use pdkv_transport::region::RegionError;

use crate::memory::LegMemory;
use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};
use sha2::{Digest, Sha256};

/// Model sizes and seed (the `[model]` table of `cluster.toml`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelParams {
    /// Seed of the weight stream.
    pub seed: u64,
    /// Hidden size: `heads` query heads of `d_model / heads` values each.
    pub d_model: usize,
    /// Vocabulary size.
    pub vocab: u32,
    /// Query heads per attention layer (divides `d_model`).
    pub heads: u32,
    /// KV heads per attention layer (divides `heads`; fewer than `heads` is grouped-query
    /// attention, one is multi-query attention or an MLA-like shared latent).
    pub kv_heads: u32,
}

impl ModelParams {
    /// Values per head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.heads as usize
    }
}

#[derive(Debug)]
enum LayerWeights {
    Attention {
        group: usize,
        wq: Vec<f32>,
        wk: Vec<f32>,
        wv: Vec<f32>,
        wo: Vec<f32>,
    },
    Mamba {
        group: usize,
        decay: Vec<f32>,
        w_in: Vec<f32>,
        w_out: Vec<f32>,
    },
}

/// The reference model: weights plus the KV layout they are paged by.
#[derive(Debug)]
pub struct Model {
    params: ModelParams,
    layout: KvLayout,
    embed: Vec<f32>,
    layers: Vec<LayerWeights>,
    head: Vec<f32>,
}

impl Model {
    /// Builds the model for `layout` from `params.seed`.
    pub fn new(params: ModelParams, layout: KvLayout) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(params.seed);
        let d = params.d_model;
        let kv_dim = params.kv_heads as usize * params.head_dim();
        let scale = 1.0 / (d as f32).sqrt();
        let mut matrix = |rows: usize, cols: usize, scale: f32| -> Vec<f32> {
            (0..rows * cols).map(|_| uniform(&mut rng) * scale).collect()
        };
        let embed = matrix(params.vocab as usize, d, 1.0);
        let mut layers = Vec::with_capacity(layout.num_layers());
        for &group in layout.layer_groups() {
            let kind = layout.groups()[group].kind();
            layers.push(match kind {
                // cluster.toml refuses aligned mamba groups (vLLM's prefix caching layout):
                // this engine keeps one state per request.
                GroupKind::Mamba | GroupKind::MambaAlign => LayerWeights::Mamba {
                    group,
                    // Decays in (0.5, 1): state remembers far back, so a wrong state shows.
                    decay: matrix(1, d, 1.0).into_iter().map(|x| 0.75 + 0.24 * x).collect(),
                    w_in: matrix(d, d, scale),
                    w_out: matrix(d, d, scale),
                },
                GroupKind::Full | GroupKind::SlidingWindow { .. } | GroupKind::ChunkedLocal { .. } => {
                    LayerWeights::Attention {
                        group,
                        // Sharper queries make attention depend visibly on every key.
                        wq: matrix(d, d, 4.0 * scale),
                        wk: matrix(kv_dim, d, scale),
                        wv: matrix(kv_dim, d, scale),
                        wo: matrix(d, d, scale),
                    }
                }
            });
        }
        let head = matrix(params.vocab as usize, d, scale);
        Model {
            params,
            layout,
            embed,
            layers,
            head,
        }
    }

    /// The layout the model is paged by.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Sizes and seed.
    pub fn params(&self) -> ModelParams {
        self.params
    }

    /// Bytes one block of `layer` takes on one rank of a leg split as `shards`: for attention,
    /// the rank's KV heads, each with K and V of the rank's `B_eff / dcp` tokens (heads outside
    /// tokens); for mamba, the rank's share of the state vector ([`state_share`]).
    pub fn bytes_per_block(&self, layer: usize, shards: KvShards) -> u64 {
        let group = &self.layout.groups()[self.layout.layer_groups()[layer]];
        rank_block_bytes(&self.params, group, shards)
            .expect("block sizes were checked against max_leg_bytes when the config was loaded")
    }

    /// Bytes of one head's K and V for one token.
    fn head_cell_bytes(&self) -> u64 {
        2 * self.params.head_dim() as u64 * 4
    }

    /// Computes token `token` at `position` for a request whose blocks are `lists`, writing its
    /// K/V (and, with `commit_state`, its mamba state) into every rank of `memory`. Returns the
    /// logits.
    ///
    /// Each query head attends over the KV head it is grouped with, read from the head group
    /// that computes that query head (query heads are split evenly over the groups), each token
    /// from the group's DCP rank holding it, so every replica of a replicated KV head is read by
    /// some query head. The arithmetic, token order included, does not depend on the leg's TP
    /// or DCP size: legs of any sizes compute the same logits from the same KV.
    ///
    /// Attention reads every position its window covers; a null block there is an error, never
    /// silently skipped.
    pub fn step(
        &self,
        memory: &LegMemory,
        lists: &[Vec<BlockId>],
        position: u64,
        token: u32,
        commit_state: bool,
    ) -> Result<Vec<f32>, EngineError> {
        let d = self.params.d_model;
        if token >= self.params.vocab {
            return Err(EngineError::TokenOutOfRange {
                token,
                vocab: self.params.vocab,
            });
        }
        let shards = memory.shards;
        let tp = shards.tp();
        let dcp = u64::from(shards.dcp());
        let groups = shards.heads();
        let hd = self.params.head_dim();
        let (heads, kv_heads) = (self.params.heads, self.params.kv_heads);
        let cell = self.head_cell_bytes();
        let mut hidden = self.embed[token as usize * d..(token as usize + 1) * d].to_vec();
        let mut scratch = Vec::new();
        let mut gathered = Vec::new();
        let mut cell_values = vec![0.0f32; 2 * hd];
        for (layer, weights) in self.layers.iter().enumerate() {
            let bytes_per_block = self.bytes_per_block(layer, shards);
            match weights {
                LayerWeights::Attention {
                    group,
                    wq,
                    wk,
                    wv,
                    wo,
                } => {
                    let spec = &self.layout.groups()[*group];
                    let block_tokens = spec.effective_block_size();
                    // Checked at load: dcp divides every attention block.
                    let head_bytes = block_tokens / dcp * cell;
                    let list = &lists[*group];
                    let query = matvec(wq, &hidden);
                    let key = matvec(wk, &hidden);
                    let value = matvec(wv, &hidden);
                    let block = block_at(list, *group, position / block_tokens)?;
                    let in_block = position % block_tokens;
                    let slot = u64::from(block) * bytes_per_block + in_block / dcp * cell;
                    for head_group in 0..groups.tp() {
                        let region = memory.layer(shards.rank(head_group, (in_block % dcp) as u32), layer);
                        for local in 0..groups.heads_per_rank() {
                            let head = (groups.first_head(head_group) + local) as usize;
                            cell_values[..hd].copy_from_slice(&key[head * hd..(head + 1) * hd]);
                            cell_values[hd..].copy_from_slice(&value[head * hd..(head + 1) * hd]);
                            region.write_f32s(slot + u64::from(local) * head_bytes, &cell_values)?;
                        }
                    }
                    let first = spec.kind().attended_floor(position).unwrap_or(0);
                    let scale = 1.0 / (hd as f32).sqrt();
                    let mut attended = vec![0.0f32; d];
                    for query_head in 0..heads {
                        // Checked at load: the head groups divide heads, kv_heads divides heads.
                        let head_group = query_head / (heads / groups.tp());
                        let kv_head = query_head / (heads / kv_heads);
                        let local = u64::from(kv_head - groups.first_head(head_group));
                        let q = &query[query_head as usize * hd..(query_head as usize + 1) * hd];
                        let mut scores = Vec::with_capacity((position - first + 1) as usize);
                        let mut values = Vec::with_capacity(scores.capacity() * hd);
                        let mut source = first;
                        while source <= position {
                            let block_position = source / block_tokens;
                            let last = ((block_position + 1) * block_tokens - 1).min(position);
                            let block = block_at(list, *group, block_position)?;
                            scratch.resize((last - source + 1) as usize * 2 * hd, 0.0);
                            let head_start = u64::from(block) * bytes_per_block + local * head_bytes;
                            let (first_in_block, last_in_block) =
                                (source % block_tokens, last % block_tokens);
                            // Each DCP rank's tokens of the range are one run of its slots,
                            // put back in token order.
                            for share in 0..dcp {
                                let first_token = first_in_block + (share + dcp - first_in_block % dcp) % dcp;
                                if first_token > last_in_block {
                                    continue;
                                }
                                let region = memory.layer(shards.rank(head_group, share as u32), layer);
                                let start = head_start + first_token / dcp * cell;
                                if dcp == 1 {
                                    region.read_f32s(start, &mut scratch)?;
                                    continue;
                                }
                                let count = ((last_in_block - first_token) / dcp + 1) as usize;
                                gathered.resize(count * 2 * hd, 0.0);
                                region.read_f32s(start, &mut gathered)?;
                                for (index, values) in gathered.chunks_exact(2 * hd).enumerate() {
                                    let at = (first_token - first_in_block) as usize + index * dcp as usize;
                                    scratch[at * 2 * hd..(at + 1) * 2 * hd].copy_from_slice(values);
                                }
                            }
                            for slot in scratch.chunks_exact(2 * hd) {
                                scores.push(dot(q, &slot[..hd]) * scale);
                                values.extend_from_slice(&slot[hd..]);
                            }
                            source = last + 1;
                        }
                        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let mut total = 0.0f32;
                        for score in &mut scores {
                            *score = (*score - max).exp();
                            total += *score;
                        }
                        let out = &mut attended[query_head as usize * hd..(query_head as usize + 1) * hd];
                        for (weight, value) in scores.iter().zip(values.chunks_exact(hd)) {
                            for (out, v) in out.iter_mut().zip(value) {
                                *out += weight / total * v;
                            }
                        }
                    }
                    add_assign(&mut hidden, &matvec(wo, &attended));
                }
                LayerWeights::Mamba {
                    group,
                    decay,
                    w_in,
                    w_out,
                } => {
                    let block = block_at(&lists[*group], *group, 0)?;
                    let offset = u64::from(block) * bytes_per_block;
                    let mut state = vec![0.0f32; d];
                    if position > 0 {
                        for rank in 0..tp {
                            let share = state_share(d, tp, rank);
                            memory.layer(rank, layer).read_f32s(offset, &mut state[share])?;
                        }
                    }
                    let input = matvec(w_in, &hidden);
                    for ((s, a), u) in state.iter_mut().zip(decay).zip(&input) {
                        *s = a * *s + u;
                    }
                    if commit_state {
                        for rank in 0..tp {
                            let share = state_share(d, tp, rank);
                            memory.layer(rank, layer).write_f32s(offset, &state[share])?;
                        }
                    }
                    add_assign(&mut hidden, &matvec(w_out, &state));
                }
            }
            rms_norm(&mut hidden);
        }
        Ok(matvec(&self.head, &hidden))
    }
}

/// The values of a `d`-value recurrent state rank `rank` of `tp` holds: contiguous shares of
/// `ceil(d / tp)` values, the last ones shorter (or empty) when `tp` does not divide `d`.
pub fn state_share(d: usize, tp: u32, rank: u32) -> std::ops::Range<usize> {
    let share = d.div_ceil(tp as usize);
    let start = (rank as usize * share).min(d);
    start..(start + share).min(d)
}

/// Bytes one block of a layer in `group` takes on one rank of a leg split as `shards`
/// ([`Model::bytes_per_block`]); every rank holds as many (a mamba state's last share may use
/// fewer of them). `None` on overflow.
pub fn rank_block_bytes(params: &ModelParams, group: &GroupSpec, shards: KvShards) -> Option<u64> {
    match group.kind() {
        GroupKind::Mamba | GroupKind::MambaAlign => {
            (state_share(params.d_model, shards.tp(), 0).len() as u64).checked_mul(4)
        }
        _ => {
            // K and V of one head for one token, in f32.
            let head_cell = (params.head_dim() as u64).checked_mul(8)?;
            u64::from(shards.heads().heads_per_rank())
                .checked_mul(group.effective_block_size() / u64::from(shards.dcp()))?
                .checked_mul(head_cell)
        }
    }
}

/// A running digest over every generated step's logits.
#[derive(Debug, Clone, Default)]
pub struct LogitsDigest {
    hasher: Sha256,
}

impl LogitsDigest {
    /// Folds one step's logits in (their exact bits).
    pub fn update(&mut self, logits: &[f32]) {
        for value in logits {
            self.hasher.update(value.to_bits().to_le_bytes());
        }
    }

    /// The digest so far, as 64 bits.
    pub fn finish(&self) -> u64 {
        let digest = self.hasher.clone().finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        u64::from_le_bytes(first)
    }
}

/// The greedy choice: the highest logit, the lowest index on ties.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (index, &value) in logits.iter().enumerate() {
        if value > logits[best] {
            best = index;
        }
    }
    best as u32
}

/// A deterministic prompt of `len` tokens for `seed` (demo and sweep inputs).
pub fn prompt_tokens(seed: u64, len: usize, vocab: u32) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (len as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    (0..len).map(|_| rng.next_u32() % vocab).collect()
}

fn block_at(list: &[BlockId], group: usize, position: u64) -> Result<BlockId, EngineError> {
    match list.get(position as usize) {
        Some(&NULL_BLOCK) | None => Err(EngineError::MissingBlock { group, position }),
        Some(&block) => Ok(block),
    }
}

fn uniform(rng: &mut ChaCha8Rng) -> f32 {
    // 24 random bits mapped to [-1, 1).
    ((rng.next_u32() >> 8) as f32 / (1u32 << 23) as f32) - 1.0
}

fn matvec(matrix: &[f32], vector: &[f32]) -> Vec<f32> {
    matrix
        .chunks_exact(vector.len())
        .map(|row| dot(row, vector))
        .collect()
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn add_assign(target: &mut [f32], delta: &[f32]) {
    for (t, d) in target.iter_mut().zip(delta) {
        *t += d;
    }
}

fn rms_norm(vector: &mut [f32]) {
    let mean_square = vector.iter().map(|x| x * x).sum::<f32>() / vector.len() as f32;
    let scale = 1.0 / (mean_square + 1e-6).sqrt();
    for x in vector {
        *x *= scale;
    }
}

/// Why the engine could not compute a token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// The block table lacks a position the computation needs.
    #[error("group {group}: no block at position {position} (null or beyond the list)")]
    MissingBlock {
        /// Group index.
        group: usize,
        /// Block position.
        position: u64,
    },
    /// A token id outside the vocabulary.
    #[error("token {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        /// Token id.
        token: u32,
        /// Vocabulary size.
        vocab: u32,
    },
    /// A block lies outside the leg's memory.
    #[error("KV memory access out of bounds: {0}")]
    Memory(#[from] RegionError),
}

#[cfg(test)]
mod tests {
    use pdkv_core::layout::GroupSpec;

    use super::*;
    use crate::memory::LegMemory;

    fn layout() -> KvLayout {
        KvLayout::new(
            vec![
                GroupSpec::full(4, 1).unwrap(),
                GroupSpec::sliding_window(4, 6, 1).unwrap(),
                GroupSpec::mamba(),
            ],
            vec![0, 1, 2, 0],
        )
        .unwrap()
    }

    fn model_with(heads: u32, kv_heads: u32) -> Model {
        Model::new(
            ModelParams {
                seed: 3,
                d_model: 8,
                vocab: 16,
                heads,
                kv_heads,
            },
            layout(),
        )
    }

    fn model() -> Model {
        model_with(1, 1)
    }

    fn one_rank() -> KvShards {
        KvShards::new(1, 1, 1).unwrap()
    }

    /// (tp, dcp) splits of a leg: TP only, DCP only, both.
    const SPLITS: [(u32, u32); 6] = [(2, 1), (4, 1), (2, 2), (4, 2), (4, 4), (8, 2)];

    fn run(model: &Model, memory: &LegMemory, lists: &[Vec<BlockId>], prompt: &[u32]) -> Vec<Vec<f32>> {
        prompt
            .iter()
            .enumerate()
            .map(|(position, &token)| model.step(memory, lists, position as u64, token, true).unwrap())
            .collect()
    }

    #[test]
    fn same_request_on_different_blocks_gives_identical_logits() {
        let model = model();
        let memory = LegMemory::heap(&model, one_rank(), &[8, 8, 2]);
        let prompt = prompt_tokens(1, 11, 16);
        let a = run(&model, &memory, &[vec![1, 2, 3], vec![1, 2, 3], vec![1]], &prompt);
        let b = run(&model, &memory, &[vec![7, 5, 4], vec![8, 6, 4], vec![2]], &prompt);
        assert_eq!(a, b);
    }

    #[test]
    fn every_kv_byte_matters() {
        let model = model();
        let memory = LegMemory::heap(&model, one_rank(), &[8, 8, 2]);
        let prompt = prompt_tokens(1, 11, 16);
        let lists = [vec![1, 2, 3], vec![1, 2, 3], vec![1]];
        let clean = run(&model, &memory, &lists, &prompt);
        // Corrupt one K value of position 0 in the full group: the last token must change.
        memory.layers[0]
            .write_f32s(4 * model.bytes_per_block(0, one_rank()), &[9.0])
            .unwrap();
        let last = model.step(&memory, &lists, 10, prompt[10], false).unwrap();
        assert_ne!(last, clean[10]);
    }

    #[test]
    fn a_null_block_in_the_window_is_an_error() {
        let model = model();
        let memory = LegMemory::heap(&model, one_rank(), &[8, 8, 2]);
        let error = model
            .step(&memory, &[vec![1, 2], vec![0, 2], vec![1]], 5, 1, true)
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "group 1: no block at position 0 (null or beyond the list)"
        );
    }

    /// (query heads, KV heads): multi-head, grouped-query, one shared (MLA-like) head.
    const SHAPES: [(u32, u32); 3] = [(4, 4), (4, 2), (4, 1)];

    #[test]
    fn logits_do_not_depend_on_the_tensor_parallel_or_dcp_size() {
        let lists = [vec![1, 2, 3], vec![1, 2, 3], vec![1]];
        let prompt = prompt_tokens(5, 11, 16);
        for (heads, kv_heads) in SHAPES {
            let model = model_with(heads, kv_heads);
            let one = run(
                &model,
                &LegMemory::heap(&model, KvShards::new(kv_heads, 1, 1).unwrap(), &[8, 8, 2]),
                &lists,
                &prompt,
            );
            for (tp, dcp) in SPLITS {
                let Ok(shards) = KvShards::new(kv_heads, tp, dcp) else {
                    continue;
                };
                if !heads.is_multiple_of(tp / dcp) {
                    continue;
                }
                let memory = LegMemory::heap(&model, shards, &[8, 8, 2]);
                assert_eq!(
                    run(&model, &memory, &lists, &prompt),
                    one,
                    "{heads} heads, {kv_heads} KV heads, tp {tp} dcp {dcp}"
                );
            }
        }
    }

    /// Rank `r` of a split leg holds, at local head `j` and slot `s`, the bytes one unsharded
    /// rank holds for global head `first + j` at token `s * dcp + r mod dcp` of the block, where
    /// `first` is vLLM's first head of head group `r / dcp` (written out here): heads outside
    /// tokens, K then V per token.
    #[test]
    fn each_rank_holds_the_heads_and_tokens_vllm_gives_it() {
        let lists = [vec![1, 2, 3], vec![1, 2, 3], vec![1]];
        let prompt = prompt_tokens(9, 10, 16);
        let block_tokens = 4;
        for (heads, kv_heads) in SHAPES {
            let model = model_with(heads, kv_heads);
            let whole = LegMemory::heap(&model, KvShards::new(kv_heads, 1, 1).unwrap(), &[8, 8, 2]);
            run(&model, &whole, &lists, &prompt);
            let cell = 4 * 2 * (8 / heads as usize);
            for (tp, dcp) in SPLITS {
                let Ok(shards) = KvShards::new(kv_heads, tp, dcp) else {
                    continue;
                };
                let head_groups = tp / dcp;
                let memory = LegMemory::heap(&model, shards, &[8, 8, 2]);
                run(&model, &memory, &lists, &prompt);
                let held = (kv_heads / head_groups).max(1) as usize;
                let slots = block_tokens / dcp as usize;
                for rank in 0..tp {
                    let (group, share) = (rank / dcp, (rank % dcp) as usize);
                    // Contiguous heads below kv_heads groups, each head on groups / kv_heads above.
                    let first = if head_groups <= kv_heads {
                        group * kv_heads / head_groups
                    } else {
                        group / (head_groups / kv_heads)
                    } as usize;
                    for layer in [0, 1, 3] {
                        let block = cell * slots * held;
                        let full_block = cell * block_tokens * kv_heads as usize;
                        let mut sharded = vec![0u8; 4 * block];
                        let mut reference = vec![0u8; 4 * full_block];
                        memory.layer(rank, layer).read(0, &mut sharded).unwrap();
                        whole.layer(0, layer).read(0, &mut reference).unwrap();
                        for block_id in 1..4 {
                            for local in 0..held {
                                for slot in 0..slots {
                                    let token = slot * dcp as usize + share;
                                    let ours = block_id * block + (local * slots + slot) * cell;
                                    let theirs = block_id * full_block
                                        + ((first + local) * block_tokens + token) * cell;
                                    assert_eq!(
                                        sharded[ours..ours + cell],
                                        reference[theirs..theirs + cell],
                                        "{heads}/{kv_heads} heads, tp {tp} dcp {dcp}, rank {rank}, layer {layer}, block {block_id}, local head {local}, token {token}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Whether one value written into block 1 of `layer` on `rank` (the rank's first slot, or
    /// its state share) changes the last token's logits of an 11-token prompt.
    fn corrupting_shows(model: &Model, shards: KvShards, rank: u32, layer: usize) -> bool {
        let lists = [vec![1, 2, 3], vec![1, 2, 3], vec![1]];
        let prompt = prompt_tokens(2, 11, 16);
        let memory = LegMemory::heap(model, shards, &[8, 8, 2]);
        let clean = run(model, &memory, &lists, &prompt);
        memory
            .layer(rank, layer)
            .write_f32s(model.bytes_per_block(layer, shards), &[9.0])
            .unwrap();
        model.step(&memory, &lists, 10, prompt[10], false).unwrap() != clean[10]
    }

    /// Every rank's copy is read: a replica of a KV head nobody else holds corrupted on any
    /// one rank changes the logits, so a READ that filled only one replica would show.
    #[test]
    fn every_ranks_copy_of_the_kv_is_read() {
        for (heads, kv_heads) in SHAPES {
            let model = model_with(heads, kv_heads);
            let shards = KvShards::new(kv_heads, 4, 1).unwrap();
            for rank in 0..4 {
                // Position 0's K, local head 0, in the full-attention layer 0.
                assert!(
                    corrupting_shows(&model, shards, rank, 0),
                    "{heads}/{kv_heads} heads, rank {rank} of 4"
                );
                // The state's share on each rank matters too.
                assert!(
                    corrupting_shows(&model, shards, rank, 2),
                    "mamba share of rank {rank} of 4"
                );
            }
        }
        // Under DCP each rank holds every fourth token: position 0's K sits on DCP rank 0,
        // position 1's on DCP rank 1, ...; corrupting any shows.
        let model = model_with(4, 1);
        for rank in 0..4 {
            assert!(
                corrupting_shows(&model, KvShards::new(1, 4, 4).unwrap(), rank, 0),
                "DCP rank {rank} of 4"
            );
        }
    }

    #[test]
    fn a_state_splits_into_contiguous_shares_covering_it_once() {
        assert_eq!(state_share(8, 4, 3), 6..8);
        assert_eq!(state_share(10, 4, 0), 0..3);
        assert_eq!(state_share(10, 4, 3), 9..10);
        assert_eq!(state_share(2, 4, 3), 2..2);
        for (d, tp) in [(8, 1), (8, 3), (7, 4), (3, 8)] {
            let covered: Vec<usize> = (0..tp).flat_map(|rank| state_share(d, tp, rank)).collect();
            assert_eq!(covered, (0..d).collect::<Vec<_>>(), "d {d}, tp {tp}");
        }
    }
}
