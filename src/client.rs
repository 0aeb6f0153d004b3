//! A small client of a launched cluster: completions through the router's HTTP API, and a leg's
//! block accounting read from its `/metrics`.

use std::time::Duration;

use pdkv_actors::scheduler::LegStats;
use pdkv_core::sampling::Sampling;
use pdkv_core::wire::{LegLoad, NodeId};
use serde_json::{Value, json};

use crate::launch::http_agent;

/// One completion as the router answered it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// Generated token ids.
    pub tokens: Vec<u32>,
    /// Digest of every step's logits.
    pub logits_digest: u64,
    /// Bytes the decode leg read.
    pub read_bytes: u64,
    /// READ runs posted.
    pub read_runs: u64,
}

/// Talks to one router.
pub struct Client {
    agent: ureq::Agent,
    base: String,
}

impl Client {
    /// A client of the router at `base` (`http://host:port`), each call bounded by `timeout`.
    pub fn new(base: &str, timeout: Duration) -> Self {
        Client {
            agent: http_agent(timeout),
            base: base.trim_end_matches('/').to_string(),
        }
    }

    /// `POST /v1/completions` with token ids; an error answer becomes `Err` with its message.
    pub fn complete(&self, prompt: &[u32], max_tokens: u32) -> Result<Answer, String> {
        self.complete_sampled(prompt, max_tokens, &Sampling::default())
    }

    /// [`Client::complete`] with the decode leg choosing tokens by `sampling`.
    pub fn complete_sampled(
        &self,
        prompt: &[u32],
        max_tokens: u32,
        sampling: &Sampling,
    ) -> Result<Answer, String> {
        let mut body =
            json!({"model": crate::openai::MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens});
        add_sampling(&mut body, sampling);
        let mut response = self
            .agent
            .post(format!("{}/v1/completions", self.base))
            .send_json(&body)
            .map_err(|error| format!("router: {error}"))?;
        let status = response.status().as_u16();
        let answer: Value = response
            .body_mut()
            .read_json()
            .map_err(|error| format!("router answered {status} without JSON: {error}"))?;
        if status != 200 {
            return Err(format!(
                "{status}: {}",
                answer["error"]["message"].as_str().unwrap_or("no message")
            ));
        }
        parse_answer(&answer)
    }
}

/// Adds what `sampling` asks for to a request body in the API's fields (stop sequences that are
/// not UTF-8 text cannot be written as `stop` strings and are left out).
pub fn add_sampling(body: &mut Value, sampling: &Sampling) {
    if !sampling.is_greedy() {
        body["temperature"] = json!(sampling.temperature);
        body["top_p"] = json!(sampling.top_p);
        body["top_k"] = json!(sampling.top_k);
        body["seed"] = json!(sampling.seed);
    }
    if !sampling.stop_token_ids.is_empty() {
        body["stop_token_ids"] = json!(sampling.stop_token_ids);
    }
    let stops: Vec<String> = sampling
        .stop_sequences
        .iter()
        .filter_map(|sequence| {
            let bytes: Option<Vec<u8>> = sequence.iter().map(|&token| u8::try_from(token).ok()).collect();
            String::from_utf8(bytes?).ok()
        })
        .collect();
    if !stops.is_empty() {
        body["stop"] = json!(stops);
    }
    if let Some(count) = sampling.logprobs {
        body["logprobs"] = json!(count);
    }
}

/// Reads the generated tokens and pdkv's figures from a completions answer.
pub fn parse_answer(answer: &Value) -> Result<Answer, String> {
    let tokens = answer["choices"][0]["token_ids"]
        .as_array()
        .ok_or("answer without choices[0].token_ids")?
        .iter()
        .map(|token| {
            token
                .as_u64()
                .map(|token| token as u32)
                .ok_or("token id is not a number")
        })
        .collect::<Result<Vec<u32>, _>>()?;
    let digest = answer["pdkv"]["logits_digest"]
        .as_str()
        .ok_or("answer without pdkv.logits_digest")?;
    Ok(Answer {
        tokens,
        logits_digest: u64::from_str_radix(digest, 16)
            .map_err(|error| format!("logits digest {digest:?}: {error}"))?,
        read_bytes: answer["pdkv"]["read_bytes"].as_u64().unwrap_or(0),
        read_runs: answer["pdkv"]["read_runs"].as_u64().unwrap_or(0),
    })
}

/// The value of a Prometheus sample `name{labels}` in `text` (labels as written, e.g.
/// `group="0"`; empty for none).
pub fn sample(text: &str, name: &str, labels: &str) -> Option<f64> {
    let key = if labels.is_empty() {
        name.to_string()
    } else {
        format!("{name}{{{labels}}}")
    };
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            line.strip_prefix(key.as_str())?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
}

/// One sample line of a Prometheus text page: metric name, labels as written (without braces),
/// value. `None` for comments, blank lines and lines that are not samples.
pub fn parse_sample(line: &str) -> Option<(&str, &str, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = &line[..name_end];
    let rest = &line[name_end..];
    let (labels, rest) = match rest.strip_prefix('{') {
        Some(inside) => {
            // The closing brace is the first one outside a quoted label value.
            let mut quoted = false;
            let mut escaped = false;
            let mut close = None;
            for (at, c) in inside.char_indices() {
                match c {
                    _ if escaped => escaped = false,
                    '\\' if quoted => escaped = true,
                    '"' => quoted = !quoted,
                    '}' if !quoted => {
                        close = Some(at);
                        break;
                    }
                    _ => {}
                }
            }
            let close = close?;
            (&inside[..close], &inside[close + 1..])
        }
        None => ("", rest),
    };
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        other => other.parse().ok()?,
    };
    Some((name, labels, value))
}

/// The sum of metric `name`'s samples over all their labels (a vLLM with several engines
/// labels each); `None` when the page has none.
pub fn sample_sum(text: &str, name: &str) -> Option<f64> {
    let values: Vec<f64> = text
        .lines()
        .filter_map(parse_sample)
        .filter(|(metric, _, _)| *metric == name)
        .map(|(_, _, value)| value)
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// A leg's block accounting from its `/metrics` at `admin_url`.
pub fn leg_stats(node: &str, admin_url: &str, groups: usize) -> Result<LegStats, String> {
    let agent = http_agent(Duration::from_secs(2));
    let mut response = agent
        .get(format!("{admin_url}/metrics"))
        .call()
        .map_err(|error| format!("{node} /metrics: {error}"))?;
    let text = response
        .body_mut()
        .read_to_string()
        .map_err(|error| format!("{node} /metrics: {error}"))?;
    let missing = |what: &str| format!("{node} /metrics has no {what}");
    let mut free = Vec::with_capacity(groups);
    let mut capacity = Vec::with_capacity(groups);
    for group in 0..groups {
        let labels = format!("group=\"{group}\"");
        free.push(
            sample(&text, "pdkv_blocks_free", &labels).ok_or_else(|| missing("pdkv_blocks_free"))? as u64,
        );
        capacity.push(
            sample(&text, "pdkv_blocks_capacity", &labels).ok_or_else(|| missing("pdkv_blocks_capacity"))?
                as u64,
        );
    }
    Ok(LegStats {
        node: NodeId(node.into()),
        load: LegLoad {
            free_blocks: free,
            capacity,
            requests: sample(&text, "pdkv_requests_active", "")
                .ok_or_else(|| missing("pdkv_requests_active"))? as u64,
            grants: sample(&text, "pdkv_grants_active", "").ok_or_else(|| missing("pdkv_grants_active"))?
                as u64,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_found_by_name_and_labels() {
        let text = "# TYPE pdkv_blocks_free gauge\npdkv_blocks_free{group=\"0\"} 64\npdkv_blocks_free{group=\"1\"} 12\npdkv_grants_active 3\npdkv_grants_active_total 9\n";
        assert_eq!(sample(text, "pdkv_blocks_free", "group=\"1\""), Some(12.0));
        assert_eq!(sample(text, "pdkv_blocks_free", "group=\"0\""), Some(64.0));
        assert_eq!(sample(text, "pdkv_grants_active", ""), Some(3.0));
        assert_eq!(sample(text, "pdkv_blocks_free", "group=\"2\""), None);
    }

    #[test]
    fn sample_lines_parse_with_colons_quoted_braces_and_infinities() {
        assert_eq!(
            parse_sample("vllm:num_requests_running{engine=\"0\",model_name=\"a}b\"} 3.0"),
            Some((
                "vllm:num_requests_running",
                "engine=\"0\",model_name=\"a}b\"",
                3.0
            ))
        );
        assert_eq!(parse_sample("up 1 1700000000"), Some(("up", "", 1.0)));
        assert_eq!(
            parse_sample("h_bucket{le=\"+Inf\"} 7"),
            Some(("h_bucket", "le=\"+Inf\"", 7.0))
        );
        assert_eq!(parse_sample("g -Inf"), Some(("g", "", f64::NEG_INFINITY)));
        for not_a_sample in ["# HELP x y", "", "x{a=\"1\" 2", "x", "x{} nan?"] {
            assert_eq!(parse_sample(not_a_sample), None, "{not_a_sample:?}");
        }
        let page = "# TYPE v gauge\nv{engine=\"0\"} 2\nv{engine=\"1\"} 3.5\nvv 9\n";
        assert_eq!(sample_sum(page, "v"), Some(5.5));
        assert_eq!(sample_sum(page, "w"), None);
    }
}
