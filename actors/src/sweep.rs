//! Sweeps: run many prompt lengths P/D and direct, and compare their outputs bitwise.
//!
//! This reproduces the seed's validation (P/D against direct-to-prefill over many prompt
//! lengths). A length *matches* when both runs succeed with equal tokens and equal logits
//! digests; a P/D error is reported, never counted as a match.

use crate::cluster::LocalCluster;
use crate::engine::prompt_tokens;
use crate::error::RequestError;
use pdkv_core::sampling::Sampling;

/// The outcome of one prompt length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Comparison {
    /// Prompt length.
    pub prompt_tokens: u64,
    /// Whether P/D output equals direct output bitwise.
    pub matched: bool,
    /// Why it did not match, if either run failed.
    pub error: Option<String>,
    /// Bytes the decode leg read.
    pub read_bytes: u64,
    /// READ ranges posted.
    pub read_runs: u64,
}

/// The demo's prompt lengths: 102 lengths spread over 1..=1101 tokens.
pub fn demo_lengths() -> Vec<u64> {
    (0..102u64).map(|i| 1 + i * 1100 / 101).collect()
}

/// How a sweep asks for a prompt of `prompt_len` tokens: greedily for even lengths; for odd
/// ones sampled (temperature 0.8, top-k 40, top-p 0.95, a seed of its own) with a stop token,
/// so sweeps check P/D against direct for sampled requests and early stops too.
pub fn sampling_for(prompt_len: u64, vocab: u32) -> Sampling {
    if prompt_len.is_multiple_of(2) {
        return Sampling::default();
    }
    Sampling {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        seed: prompt_len.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        stop_token_ids: vec![(prompt_len % u64::from(vocab.max(1))) as u32],
        ..Sampling::default()
    }
}

/// Runs one length P/D and direct on `cluster` (with [`sampling_for`] the length) and
/// compares. A length no node can hold fails before its prompt is built.
pub async fn compare(cluster: &LocalCluster, prompt_len: u64, max_tokens: u32) -> Comparison {
    if let Err(error) = cluster.config().check_prompt_tokens(prompt_len) {
        return judge(prompt_len, Err(error.clone().into()), Err(error.into()));
    }
    let params = cluster.config().model;
    // Bounded by the check above (at most MAX_PROMPT_TOKENS), so it fits in usize.
    let prompt = prompt_tokens(params.seed, prompt_len as usize, params.vocab);
    let sampling = sampling_for(prompt_len, params.vocab);
    let pd = cluster
        .generate_sampled(prompt.clone(), max_tokens, sampling.clone())
        .await;
    let direct = cluster.direct_sampled(prompt, max_tokens, sampling, None).await;
    judge(prompt_len, pd, direct)
}

fn judge(
    prompt_tokens: u64,
    pd: Result<crate::router::Output, RequestError>,
    direct: Result<crate::router::Output, RequestError>,
) -> Comparison {
    match (pd, direct) {
        (Ok(pd), Ok(direct)) => {
            let matched = pd.tokens == direct.tokens
                && pd.logits_digest == direct.logits_digest
                && pd.finish == direct.finish;
            Comparison {
                prompt_tokens,
                matched,
                error: None,
                read_bytes: pd.read_bytes,
                read_runs: pd.read_runs,
            }
        }
        (Err(error), _) => Comparison {
            prompt_tokens,
            matched: false,
            error: Some(format!("p/d: {error}")),
            read_bytes: 0,
            read_runs: 0,
        },
        (Ok(pd), Err(error)) => Comparison {
            prompt_tokens,
            matched: false,
            error: Some(format!("direct: {error}")),
            read_bytes: pd.read_bytes,
            read_runs: pd.read_runs,
        },
    }
}

/// Lengths where legacy pairing reads the wrong window on a single-window-group layout: only
/// the decode leg holds a lookahead tail (`cdiv(N + k_D, B) > cdiv(N, B)`, none on the prefill
/// leg) and the prompt is longer than the window, so the clipped lists shift by one block.
pub fn legacy_predicted_failure(
    prompt_tokens: u64,
    block_size: u64,
    window: u64,
    decode_lookahead: u64,
) -> bool {
    let decode_tail =
        (prompt_tokens + decode_lookahead).div_ceil(block_size) > prompt_tokens.div_ceil(block_size);
    prompt_tokens > window && decode_tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demo_lengths_are_102_up_past_1024() {
        let lengths = demo_lengths();
        assert_eq!(lengths.len(), 102);
        assert_eq!(lengths[0], 1);
        assert!(*lengths.last().unwrap() >= 1024);
    }

    #[test]
    fn legacy_prediction_matches_the_seed_condition() {
        for n in 1..2000 {
            let seed_condition = n > 128 && (n - 1) % 64 >= 55;
            assert_eq!(legacy_predicted_failure(n, 64, 128, 9), seed_condition, "N = {n}");
        }
    }
}
