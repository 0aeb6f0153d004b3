//! How a decode leg chooses each next token from the model's logits, and when it stops.
//!
//! Pure and deterministic: the token chosen at a step depends only on the logits, the request's
//! [`Sampling`] and the step's index (its random draw comes from the request's seed and that
//! index, not from a generator's history). So a one-leg run and a P/D run give the same tokens
//! for the same seed, and a request started over on another decode leg repeats them exactly.
//! The order of the filters is vLLM's: temperature, then top-k, then top-p; `temperature = 0`
//! is greedy (the first largest logit). Log-probabilities are those of the model's own
//! distribution (the logits before temperature and filters), as vLLM reports by default.

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use serde::{Deserialize, Serialize};

/// Most top log-probabilities a request may ask for per token.
pub const MAX_LOGPROBS: u32 = 20;

/// What a request asks of the sampler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    /// 0: greedy; above: logits are divided by it before sampling.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 keeps all.
    pub top_k: u32,
    /// Keep the most likely tokens whose probabilities add up to `top_p` (at least one).
    pub top_p: f32,
    /// Seeds every step's draw.
    pub seed: u64,
    /// Stop after a token that is one of these (it is kept in the token ids).
    pub stop_token_ids: Vec<u32>,
    /// Stop once the generated tokens end with one of these token sequences (for the byte
    /// vocabulary, a stop string's bytes).
    pub stop_sequences: Vec<Vec<u32>>,
    /// Top log-probabilities to report per generated token; `None` reports none.
    pub logprobs: Option<u32>,
}

// The sampler's floats are checked finite where a request is parsed: equality is total on them.
impl Eq for Sampling {}

impl Default for Sampling {
    /// Greedy, no stops, no log-probabilities.
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            stop_token_ids: Vec::new(),
            stop_sequences: Vec::new(),
            logprobs: None,
        }
    }
}

/// A sampling request no sampler can honour.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum SamplingError {
    /// `temperature` negative or not finite.
    #[error("temperature must be a finite number of at least 0, not {0}")]
    Temperature(String),
    /// `top_p` outside (0, 1].
    #[error("top_p must be in (0, 1], not {0}")]
    TopP(String),
    /// More log-probabilities than [`MAX_LOGPROBS`].
    #[error("at most {MAX_LOGPROBS} log-probabilities per token, not {0}")]
    Logprobs(u32),
    /// An empty stop sequence (it would stop before any token).
    #[error("a stop sequence must not be empty")]
    EmptyStop,
}

impl Sampling {
    /// Whether every step takes the most likely token.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Refuses values no sampler can honour.
    pub fn check(&self) -> Result<(), SamplingError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SamplingError::Temperature(self.temperature.to_string()));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p.to_string()));
        }
        if let Some(count) = self.logprobs
            && count > MAX_LOGPROBS
        {
            return Err(SamplingError::Logprobs(count));
        }
        if self.stop_sequences.iter().any(Vec::is_empty) {
            return Err(SamplingError::EmptyStop);
        }
        Ok(())
    }
}

/// A token chosen, with what was asked of its log-probabilities.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    /// The token.
    pub token: u32,
    /// Its log-probability under the model.
    pub logprob: f32,
    /// The most likely tokens and theirs, most likely first (ties by token id).
    pub top: Vec<(u32, f32)>,
}

impl Eq for TokenLogprobs {}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Finish {
    /// `max_tokens` were generated.
    #[default]
    Length,
    /// The last token is a stop token id.
    StopToken,
    /// The tokens end with stop sequence `index` (of [`Sampling::stop_sequences`]).
    StopSequence(u32),
}

/// Chooses the token at generation step `step` (0 for the first generated token) from
/// `logits`; `None` when there are no logits. Log-probabilities are filled in only when asked.
pub fn choose(sampling: &Sampling, step: u64, logits: &[f32]) -> Option<TokenLogprobs> {
    let token = if sampling.is_greedy() {
        greedy(logits)?
    } else {
        sample(sampling, step, logits)?
    };
    let (logprob, top) = match sampling.logprobs {
        None => (0.0, Vec::new()),
        Some(count) => {
            let logprobs = log_softmax(logits);
            (logprobs[token as usize], top_logprobs(&logprobs, count))
        }
    };
    Some(TokenLogprobs { token, logprob, top })
}

/// The first largest logit's token.
pub fn greedy(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (index, &logit) in logits.iter().enumerate() {
        if best.is_none_or(|(_, top)| logit > top) {
            best = Some((index, logit));
        }
    }
    best.map(|(index, _)| index as u32)
}

/// `log(softmax(logits))`, computed in f64 for stability.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&logit| (logit as f64 - max).exp()).sum();
    let log_sum = sum.ln() + max;
    logits
        .iter()
        .map(|&logit| (logit as f64 - log_sum) as f32)
        .collect()
}

/// The `count` largest log-probabilities, largest first, ties by token id.
fn top_logprobs(logprobs: &[f32], count: u32) -> Vec<(u32, f32)> {
    let mut ranked: Vec<(u32, f32)> = logprobs
        .iter()
        .enumerate()
        .map(|(token, &logprob)| (token as u32, logprob))
        .collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    ranked.truncate(count as usize);
    ranked
}

/// The draw of step `step`: uniform in [0, 1), from the seed and the step alone.
fn uniform(seed: u64, step: u64) -> f64 {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(step);
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// Temperature, top-k, top-p, then one draw over what is left.
fn sample(sampling: &Sampling, step: u64, logits: &[f32]) -> Option<u32> {
    if logits.is_empty() {
        return None;
    }
    let temperature = f64::from(sampling.temperature);
    let mut ranked: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(token, &logit)| (token as u32, f64::from(logit) / temperature))
        .collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if sampling.top_k > 0 {
        ranked.truncate(sampling.top_k as usize);
    }
    let max = ranked[0].1;
    let mut weights: Vec<f64> = ranked.iter().map(|&(_, scaled)| (scaled - max).exp()).collect();
    let total: f64 = weights.iter().sum();
    if sampling.top_p < 1.0 {
        // The smallest head whose probability reaches top_p.
        let mut mass = 0.0;
        let mut keep = ranked.len();
        for (index, weight) in weights.iter().enumerate() {
            mass += weight / total;
            if mass >= f64::from(sampling.top_p) {
                keep = index + 1;
                break;
            }
        }
        ranked.truncate(keep);
        weights.truncate(keep);
    }
    let total: f64 = weights.iter().sum();
    let target = uniform(sampling.seed, step) * total;
    let mut mass = 0.0;
    for (&(token, _), weight) in ranked.iter().zip(&weights) {
        mass += weight;
        if target < mass {
            return Some(token);
        }
    }
    ranked.last().map(|&(token, _)| token)
}

/// Whether generation stops after `tokens` (every token generated so far, the newest last).
pub fn stop_after(sampling: &Sampling, tokens: &[u32]) -> Option<Finish> {
    let last = *tokens.last()?;
    if sampling.stop_token_ids.contains(&last) {
        return Some(Finish::StopToken);
    }
    sampling
        .stop_sequences
        .iter()
        .position(|sequence| tokens.ends_with(sequence))
        .map(|index| Finish::StopSequence(index as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampled(temperature: f32, top_k: u32, top_p: f32, seed: u64) -> Sampling {
        Sampling {
            temperature,
            top_k,
            top_p,
            seed,
            ..Sampling::default()
        }
    }

    #[test]
    fn greedy_takes_the_first_largest_logit() {
        assert_eq!(greedy(&[0.5, 2.0, 2.0, -1.0]), Some(1));
        assert_eq!(greedy(&[]), None);
        let choice = choose(&Sampling::default(), 3, &[0.5, 2.0, 2.0, -1.0]).unwrap();
        assert_eq!(choice.token, 1);
        assert!(choice.top.is_empty(), "no logprobs unless asked");
    }

    #[test]
    fn the_same_seed_and_step_draw_the_same_token_and_steps_differ() {
        let logits: Vec<f32> = (0..64).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let sampling = sampled(1.0, 0, 1.0, 42);
        let first: Vec<u32> = (0..200)
            .map(|step| choose(&sampling, step, &logits).unwrap().token)
            .collect();
        let again: Vec<u32> = (0..200)
            .map(|step| choose(&sampling, step, &logits).unwrap().token)
            .collect();
        assert_eq!(first, again);
        let distinct: std::collections::HashSet<u32> = first.iter().copied().collect();
        assert!(
            distinct.len() > 5,
            "a temperature of 1 over 64 tokens draws many: {distinct:?}"
        );
        let other: Vec<u32> = (0..200)
            .map(|step| choose(&sampled(1.0, 0, 1.0, 43), step, &logits).unwrap().token)
            .collect();
        assert_ne!(first, other, "another seed, other draws");
    }

    #[test]
    fn draws_follow_the_softmax_of_the_scaled_logits() {
        // Two tokens with logits 0 and ln 3: probabilities 1/4 and 3/4 at temperature 1; at
        // temperature 2, 1/(1+sqrt 3) and sqrt 3/(1+sqrt 3).
        let logits = [0.0, 3f32.ln()];
        for (temperature, expected) in [(1.0f32, 0.75), (2.0, 3f64.sqrt() / (1.0 + 3f64.sqrt()))] {
            let sampling = sampled(temperature, 0, 1.0, 7);
            let ones = (0..20_000)
                .filter(|&step| choose(&sampling, step, &logits).unwrap().token == 1)
                .count();
            let share = ones as f64 / 20_000.0;
            assert!(
                (share - expected).abs() < 0.015,
                "T={temperature}: {share} vs {expected}"
            );
        }
    }

    #[test]
    fn top_k_and_top_p_keep_only_the_head() {
        // Probabilities at T=1: 0.5, 0.25, 0.125, 0.125 (logits are their logs).
        let logits: Vec<f32> = [0.5f32, 0.25, 0.125, 0.125].iter().map(|p| p.ln()).collect();
        let drawn = |sampling: &Sampling| -> std::collections::BTreeSet<u32> {
            (0..4000)
                .map(|step| choose(sampling, step, &logits).unwrap().token)
                .collect()
        };
        assert_eq!(drawn(&sampled(1.0, 2, 1.0, 1)), [0, 1].into());
        assert_eq!(drawn(&sampled(1.0, 1, 1.0, 1)), [0].into());
        // top_p 0.75 reaches 0.75 with the first two; 0.76 needs the third.
        assert_eq!(drawn(&sampled(1.0, 0, 0.75, 1)), [0, 1].into());
        assert_eq!(drawn(&sampled(1.0, 0, 0.76, 1)), [0, 1, 2].into());
        assert_eq!(drawn(&sampled(1.0, 0, 0.1, 1)), [0].into());
        assert_eq!(drawn(&sampled(1.0, 0, 1.0, 1)), [0, 1, 2, 3].into());
    }

    #[test]
    fn logprobs_are_the_models_own_log_softmax_largest_first() {
        let probabilities = [0.1f32, 0.6, 0.3];
        let logits: Vec<f32> = probabilities.iter().map(|p| p.ln() + 5.0).collect();
        let sampling = Sampling {
            logprobs: Some(2),
            temperature: 0.5,
            seed: 3,
            ..Sampling::default()
        };
        let choice = choose(&sampling, 0, &logits).unwrap();
        assert!((choice.logprob - probabilities[choice.token as usize].ln()).abs() < 1e-5);
        assert_eq!(choice.top.len(), 2);
        assert_eq!((choice.top[0].0, choice.top[1].0), (1, 2));
        assert!((choice.top[0].1 - 0.6f32.ln()).abs() < 1e-5);
        assert!((choice.top[1].1 - 0.3f32.ln()).abs() < 1e-5);
    }

    #[test]
    fn generation_stops_on_a_stop_token_or_at_the_end_of_a_stop_sequence() {
        let sampling = Sampling {
            stop_token_ids: vec![9],
            stop_sequences: vec![vec![1, 2, 3], vec![7]],
            ..Sampling::default()
        };
        assert_eq!(stop_after(&sampling, &[]), None);
        assert_eq!(stop_after(&sampling, &[1, 2]), None);
        assert_eq!(
            stop_after(&sampling, &[5, 1, 2, 3]),
            Some(Finish::StopSequence(0))
        );
        assert_eq!(stop_after(&sampling, &[1, 2, 3, 4]), None, "only at the end");
        assert_eq!(stop_after(&sampling, &[4, 7]), Some(Finish::StopSequence(1)));
        assert_eq!(stop_after(&sampling, &[4, 9]), Some(Finish::StopToken));
        assert_eq!(stop_after(&Sampling::default(), &[9]), None);
    }

    #[test]
    fn values_no_sampler_honours_are_refused() {
        assert_eq!(
            sampled(-1.0, 0, 1.0, 0).check(),
            Err(SamplingError::Temperature("-1".into()))
        );
        assert!(matches!(
            sampled(f32::NAN, 0, 1.0, 0).check(),
            Err(SamplingError::Temperature(_))
        ));
        assert!(matches!(
            sampled(1.0, 0, 0.0, 0).check(),
            Err(SamplingError::TopP(_))
        ));
        assert!(matches!(
            sampled(1.0, 0, 1.5, 0).check(),
            Err(SamplingError::TopP(_))
        ));
        let too_many = Sampling {
            logprobs: Some(21),
            ..Sampling::default()
        };
        assert_eq!(too_many.check(), Err(SamplingError::Logprobs(21)));
        let empty = Sampling {
            stop_sequences: vec![vec![]],
            ..Sampling::default()
        };
        assert_eq!(empty.check(), Err(SamplingError::EmptyStop));
        assert_eq!(Sampling::default().check(), Ok(()));
    }
}
