//! A completions or chat request as the router takes it: parsed, checked field by field, and
//! admitted against what the cluster can hold, before any leg does work for it.
//!
//! vLLM's OpenAI server is the reference. Sampling (`temperature`, `top_p`, `top_k`, `seed`),
//! stops (`stop`, `stop_token_ids`), `logprobs` and `echo` are honoured by the decode leg's
//! seeded sampler (`pdkv_core::sampling`); what the reference engine does not do (penalties,
//! `logit_bias`, `min_p`, several completions, suffixes) is refused with a 400 naming the field
//! unless the value asks for what it does anyway (`presence_penalty: 0`, `n: 1`, …): a field is
//! never silently ignored.

use axum::http::StatusCode;
use pdkv_actors::config::{PromptLimit, PromptTooLong};
use pdkv_core::sampling::{MAX_LOGPROBS, Sampling};
use serde_json::{Map, Value};

use super::error::ApiError;

/// The one model the reference engine serves.
pub const MODEL_NAME: &str = "pdkv-reference";

/// Most tokens one request may ask for.
pub const MAX_COMPLETION_TOKENS: u32 = 4096;

/// Which API a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    Chat,
}

/// What the cluster can hold for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capacity {
    /// The longest prompt every leg holds.
    pub prompt: PromptLimit,
    /// The most token slots (prompt plus generated tokens) every decode leg holds.
    pub context: PromptLimit,
}

/// A checked request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// Where it came.
    pub endpoint: Endpoint,
    /// Prompt token ids (for chat, the template's bytes).
    pub prompt: Vec<u32>,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// Answer as server-sent events.
    pub stream: bool,
    /// Add a usage chunk to the stream.
    pub include_usage: bool,
    /// How the decode leg chooses tokens and stops.
    pub sampling: Sampling,
    /// Completions: the answer's text starts with the prompt's.
    pub echo: bool,
}

/// Most stop strings or stop token ids one request may give.
pub const MAX_STOPS: usize = 16;

/// The largest temperature taken.
const MAX_TEMPERATURE: f64 = 100.0;

/// The roles a chat message may have.
const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// The plain chat template over the byte tokenizer: each message as `<|role|>\n` + its content +
/// `\n`, then `<|assistant|>\n` for the answer.
pub fn chat_template(messages: &[(String, String)]) -> String {
    let mut text = String::new();
    for (role, content) in messages {
        text.push_str(&format!("<|{role}|>\n{content}\n"));
    }
    text.push_str("<|assistant|>\n");
    text
}

/// Parses and checks a request body for `endpoint` against a vocabulary of `vocab` tokens and
/// the cluster's `capacity`.
pub fn parse(
    endpoint: Endpoint,
    body: &[u8],
    vocab: u32,
    capacity: &Capacity,
) -> Result<Completion, ApiError> {
    let fields = json_object(body)?;
    for (key, value) in &fields {
        check_field(endpoint, key, value)?;
    }
    if let Some(model) = string(&fields, "model")?
        && model != MODEL_NAME
    {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("model: {model:?} does not exist; this server serves {MODEL_NAME:?}"),
            kind: "invalid_request_error",
            param: Some("model".into()),
            retry_after: None,
        });
    }
    let prompt = match endpoint {
        Endpoint::Completions => prompt_tokens(present(&fields, "prompt"), vocab)?,
        Endpoint::Chat => {
            let messages = chat_messages(present(&fields, "messages"))?;
            text_tokens("messages", &chat_template(&messages), vocab)?
        }
    };
    let stream = boolean(&fields, "stream")?.unwrap_or(false);
    let include_usage = match present(&fields, "stream_options") {
        None => false,
        Some(_) if !stream => {
            return Err(ApiError::invalid(
                "stream_options",
                "only allowed when stream is true",
            ));
        }
        Some(Value::Object(options)) => {
            if let Some(key) = options.keys().find(|key| key.as_str() != "include_usage") {
                return Err(ApiError::invalid(
                    format!("stream_options.{key}"),
                    "not supported (only include_usage is)",
                ));
            }
            boolean(options, "include_usage")
                .map_err(|_| ApiError::invalid("stream_options.include_usage", "must be true or false"))?
                .unwrap_or(false)
        }
        Some(_) => return Err(ApiError::invalid("stream_options", "must be an object")),
    };
    // Chat's max_completion_tokens wins over the older max_tokens, as in vLLM.
    let (key, asked) = match (endpoint, count(&fields, "max_completion_tokens")?) {
        (Endpoint::Chat, Some(asked)) => ("max_completion_tokens", Some(asked)),
        _ => ("max_tokens", count(&fields, "max_tokens")?),
    };
    let max_tokens = admit(key, prompt.len() as u64, asked, capacity)?;
    let sampling = sampling(endpoint, &fields, vocab, stream)?;
    let echo = boolean(&fields, "echo")?.unwrap_or(false);
    if echo && sampling.logprobs.is_some() {
        return Err(ApiError::invalid(
            "echo",
            "with logprobs would need the prompt's log-probabilities, which are not computed",
        ));
    }
    Ok(Completion {
        endpoint,
        prompt,
        max_tokens,
        stream,
        include_usage,
        sampling,
        echo,
    })
}

/// A number field within `range`.
fn number(
    fields: &Map<String, Value>,
    key: &str,
    range: std::ops::RangeInclusive<f64>,
    what: &str,
) -> Result<Option<f64>, ApiError> {
    present(fields, key)
        .map(|value| {
            value
                .as_f64()
                .filter(|number| number.is_finite() && range.contains(number))
                .ok_or_else(|| ApiError::invalid(key, format!("{value} is not {what}")))
        })
        .transpose()
}

/// A fresh seed for a sampled request that names none: the request's tokens are drawn from it
/// on whichever decode leg serves it, so a retry on another leg repeats them.
fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_nanos()),
    );
    hasher.finish()
}

/// Stop strings (a string or an array of them) as token sequences, each non-empty.
fn stop_strings(fields: &Map<String, Value>, vocab: u32) -> Result<Vec<Vec<u32>>, ApiError> {
    let strings: Vec<&str> = match present(fields, "stop") {
        None => Vec::new(),
        Some(Value::String(text)) if text.is_empty() => Vec::new(),
        Some(Value::String(text)) => vec![text.as_str()],
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(index, item)| {
                item.as_str()
                    .filter(|text| !text.is_empty())
                    .ok_or_else(|| ApiError::invalid(format!("stop[{index}]"), "must be a non-empty string"))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "must be a string or an array of strings",
            ));
        }
    };
    if strings.len() > MAX_STOPS {
        return Err(ApiError::invalid(
            "stop",
            format!("{} stop strings, at most {MAX_STOPS}", strings.len()),
        ));
    }
    strings
        .iter()
        .enumerate()
        .map(|(index, text)| text_tokens(&format!("stop[{index}]"), text, vocab))
        .collect()
}

/// The sampler a request asks for: greedy unless `temperature` is above 0, a seed drawn here
/// when it samples and names none.
fn sampling(
    endpoint: Endpoint,
    fields: &Map<String, Value>,
    vocab: u32,
    stream: bool,
) -> Result<Sampling, ApiError> {
    let temperature = number(
        fields,
        "temperature",
        0.0..=MAX_TEMPERATURE,
        &format!("a temperature in 0..={MAX_TEMPERATURE}"),
    )?
    .unwrap_or(0.0);
    let top_p = number(
        fields,
        "top_p",
        f64::MIN_POSITIVE..=1.0,
        "a probability in (0, 1]",
    )?
    .unwrap_or(1.0);
    let top_k = match present(fields, "top_k") {
        None => 0,
        Some(value) => match value.as_i64() {
            Some(-1 | 0) => 0,
            Some(k) if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
            _ => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("{value} is not -1, 0 or a positive integer"),
                ));
            }
        },
    };
    let seed = match present(fields, "seed") {
        None => None,
        Some(value) => Some(
            value
                .as_u64()
                .or_else(|| value.as_i64().map(|seed| seed as u64))
                .ok_or_else(|| ApiError::invalid("seed", "must be an integer"))?,
        ),
    };
    let stop_token_ids = match present(fields, "stop_token_ids") {
        None => Vec::new(),
        Some(Value::Array(items)) if items.len() <= MAX_STOPS => items
            .iter()
            .enumerate()
            .map(|(index, item)| {
                item.as_u64()
                    .filter(|&token| token < u64::from(vocab))
                    .map(|token| token as u32)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            format!("stop_token_ids[{index}]"),
                            format!("{item} is not a token id below {vocab}"),
                        )
                    })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid(
                "stop_token_ids",
                format!("must be an array of at most {MAX_STOPS} token ids"),
            ));
        }
    };
    let logprobs = match endpoint {
        Endpoint::Completions => match present(fields, "logprobs") {
            None => None,
            Some(value) => Some(
                value
                    .as_u64()
                    .filter(|&count| count <= u64::from(MAX_LOGPROBS))
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "logprobs",
                            format!("{value} is not a count in 0..={MAX_LOGPROBS}"),
                        )
                    })? as u32,
            ),
        },
        Endpoint::Chat => {
            let wanted = boolean(fields, "logprobs")?.unwrap_or(false);
            let top = match present(fields, "top_logprobs") {
                None => 0,
                Some(value) => value
                    .as_u64()
                    .filter(|&count| count <= u64::from(MAX_LOGPROBS))
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "top_logprobs",
                            format!("{value} is not a count in 0..={MAX_LOGPROBS}"),
                        )
                    })? as u32,
            };
            if top > 0 && !wanted {
                return Err(ApiError::invalid("top_logprobs", "needs logprobs: true"));
            }
            wanted.then_some(top)
        }
    };
    if logprobs.is_some() && stream {
        return Err(ApiError::invalid(
            "logprobs",
            "not supported with stream: true yet; ask without streaming",
        ));
    }
    let sampling = Sampling {
        temperature: temperature as f32,
        top_k,
        top_p: top_p as f32,
        seed: match seed {
            Some(seed) => seed,
            None if temperature > 0.0 => fresh_seed(),
            None => 0,
        },
        stop_token_ids,
        stop_sequences: stop_strings(fields, vocab)?,
        logprobs,
    };
    sampling
        .check()
        .map_err(|error| ApiError::invalid("temperature", error.to_string()))?;
    Ok(sampling)
}

/// The tokens a request may generate: `asked`, or (absent) what fits, as vLLM defaults to the
/// context left; refused when the prompt or prompt plus `asked` cannot fit.
fn admit(key: &str, prompt: u64, asked: Option<u64>, capacity: &Capacity) -> Result<u32, ApiError> {
    if prompt > capacity.prompt.max_tokens {
        let error = PromptTooLong {
            num_prompt_tokens: prompt,
            limit: capacity.prompt.clone(),
        };
        return Err(ApiError::invalid("prompt", error.to_string()));
    }
    let context = &capacity.context;
    let room = context.max_tokens.saturating_sub(prompt);
    match asked {
        Some(0) => Err(ApiError::invalid(
            key,
            format!("0 is outside 1..={MAX_COMPLETION_TOKENS}"),
        )),
        Some(asked) if asked > u64::from(MAX_COMPLETION_TOKENS) => Err(ApiError::invalid(
            key,
            format!("{asked} is outside 1..={MAX_COMPLETION_TOKENS}"),
        )),
        Some(asked) if asked > room => Err(ApiError::invalid(
            key,
            format!(
                "{asked} tokens after a prompt of {prompt} need {} token slots, more than the {} a request may hold: decode leg {} holds {} and reserves {} for lookahead; ask for at most {room}",
                prompt + asked,
                context.max_tokens,
                context.node,
                context.capacity,
                context.lookahead_tokens
            ),
        )),
        Some(asked) => Ok(asked as u32),
        None if room == 0 => Err(ApiError::invalid(
            "prompt",
            format!(
                "a prompt of {prompt} tokens leaves no room to generate: decode leg {} holds {} token slots per request",
                context.node, context.max_tokens
            ),
        )),
        None => Ok(room.min(u64::from(MAX_COMPLETION_TOKENS)) as u32),
    }
}

/// The body as one JSON object, with nothing after it.
fn json_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let value: Value = serde::Deserialize::deserialize(&mut deserializer).map_err(|error| {
        // serde_json says what is wrong (a missing value, nesting past its recursion limit, a
        // number out of range) and where; parsing into a `Value` names no Rust type.
        ApiError::invalid("body", format!("not valid JSON: {error}"))
    })?;
    deserializer.end().map_err(|error| {
        ApiError::invalid(
            "body",
            format!(
                "data after the JSON object at line {}, column {}",
                error.line(),
                error.column()
            ),
        )
    })?;
    match value {
        Value::Object(fields) => Ok(fields),
        _ => Err(ApiError::invalid("body", "must be a JSON object")),
    }
}

/// `key`'s value unless absent or null.
fn present<'a>(fields: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    fields.get(key).filter(|value| !value.is_null())
}

fn boolean(fields: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    present(fields, key)
        .map(|value| {
            value
                .as_bool()
                .ok_or_else(|| ApiError::invalid(key, "must be true or false"))
        })
        .transpose()
}

fn string<'a>(fields: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>, ApiError> {
    present(fields, key)
        .map(|value| {
            value
                .as_str()
                .ok_or_else(|| ApiError::invalid(key, "must be a string"))
        })
        .transpose()
}

fn count(fields: &Map<String, Value>, key: &str) -> Result<Option<u64>, ApiError> {
    present(fields, key)
        .map(|value| {
            value
                .as_u64()
                .ok_or_else(|| ApiError::invalid(key, "must be a positive integer"))
        })
        .transpose()
}

/// The values of fields the reference engine does not act on that ask for what it does anyway.
fn neutral(key: &str, value: &Value) -> Option<bool> {
    let number = value.as_f64();
    Some(match key {
        "min_p" | "presence_penalty" | "frequency_penalty" => number? == 0.0,
        "repetition_penalty" => number? == 1.0,
        "n" | "best_of" => value.as_u64()? == 1,
        "min_tokens" => value.as_u64()? == 0,
        "logit_bias" => value.as_object()?.is_empty(),
        "suffix" => value.as_str()?.is_empty(),
        "response_format" => value.as_object()?.get("type")?.as_str()? == "text",
        "tools" | "functions" => value.as_array()?.is_empty(),
        "tool_choice" | "function_call" => value.as_str()? == "none",
        // Without tools there are no calls to run in parallel or not.
        "parallel_tool_calls" => value.as_bool().map(|_| true)?,
        _ => return None,
    })
}

/// Why a field the reference engine does not act on is refused.
fn unsupported(key: &str) -> &'static str {
    match key {
        "min_p" => "min_p is not supported (temperature, top_k and top_p are)",
        "n" | "best_of" => "pdkv answers one completion per request",
        "suffix" => "suffixes are not supported",
        "min_tokens" => "min_tokens is not supported",
        "response_format" => "structured output is not supported (only {\"type\": \"text\"})",
        "tools" | "functions" | "tool_choice" | "function_call" => "tool calls are not supported",
        _ => "penalties and logit biases are not supported",
    }
}

/// The fields both endpoints take besides those [`neutral`] knows.
const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "logprobs",
    "user",
    "ignore_eos",
];
/// The fields only completions take.
const COMPLETIONS_FIELDS: &[&str] = &["prompt", "echo"];
/// The fields only chat completions take.
const CHAT_FIELDS: &[&str] = &["messages", "max_completion_tokens", "top_logprobs"];

/// Refuses a field `endpoint` does not take, or a value of it the engine would not honour.
fn check_field(endpoint: Endpoint, key: &str, value: &Value) -> Result<(), ApiError> {
    if value.is_null() {
        return Ok(());
    }
    let known = match endpoint {
        Endpoint::Completions => COMPLETIONS_FIELDS,
        Endpoint::Chat => CHAT_FIELDS,
    };
    if COMMON_FIELDS.contains(&key) || known.contains(&key) {
        return match key {
            "user" if !value.is_string() => Err(ApiError::invalid(key, "must be a string")),
            // The byte vocabulary has no end-of-sequence token: there is none to ignore.
            "ignore_eos" if !value.is_boolean() => Err(ApiError::invalid(key, "must be true or false")),
            _ => Ok(()),
        };
    }
    let chat_only =
        endpoint == Endpoint::Completions && matches!(key, "top_logprobs" | "max_completion_tokens");
    let completions_only = endpoint == Endpoint::Chat && matches!(key, "echo" | "suffix" | "best_of");
    match neutral(key, value) {
        _ if chat_only || completions_only => Err(ApiError::invalid(key, "not a field of this endpoint")),
        Some(true) => Ok(()),
        Some(false) => Err(ApiError::invalid(
            key,
            format!("{value} refused: {}", unsupported(key)),
        )),
        None if neutral_key(key) => Err(ApiError::invalid(key, format!("{value} is not a valid value"))),
        None => Err(ApiError::invalid(
            key,
            format!(
                "unknown field; this endpoint takes {}",
                COMMON_FIELDS
                    .iter()
                    .chain(known)
                    .copied()
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
    }
}

/// Whether [`neutral`] knows `key`.
fn neutral_key(key: &str) -> bool {
    matches!(
        key,
        "min_p"
            | "presence_penalty"
            | "frequency_penalty"
            | "repetition_penalty"
            | "n"
            | "best_of"
            | "min_tokens"
            | "logit_bias"
            | "suffix"
            | "response_format"
            | "tools"
            | "functions"
            | "tool_choice"
            | "function_call"
            | "parallel_tool_calls"
            | "echo"
            | "top_logprobs"
    )
}

/// A text's bytes as tokens, each below `vocab`; `param` names the field in errors.
fn text_tokens(param: &str, text: &str, vocab: u32) -> Result<Vec<u32>, ApiError> {
    let tokens: Vec<u32> = text.bytes().map(u32::from).collect();
    if let Some(position) = tokens.iter().position(|&token| token >= vocab) {
        return Err(ApiError::invalid(
            param,
            format!(
                "byte {position} is token {}, outside the vocabulary of {vocab}",
                tokens[position]
            ),
        ));
    }
    Ok(tokens)
}

/// A prompt as a string (one token per byte) or an array of token ids, each below `vocab`.
fn prompt_tokens(prompt: Option<&Value>, vocab: u32) -> Result<Vec<u32>, ApiError> {
    let tokens: Vec<u32> = match prompt {
        Some(Value::String(text)) => text_tokens("prompt", text, vocab)?,
        Some(Value::Array(items)) => {
            if items.first().is_some_and(|item| !item.is_number()) {
                return Err(ApiError::invalid(
                    "prompt",
                    "one prompt per request: a string or an array of token ids",
                ));
            }
            let mut tokens = Vec::with_capacity(items.len());
            for (index, item) in items.iter().enumerate() {
                let token = item
                    .as_u64()
                    .filter(|&token| token < u64::from(vocab))
                    .ok_or_else(|| {
                        ApiError::invalid(
                            format!("prompt[{index}]"),
                            format!("{item} is not a token id below {vocab}"),
                        )
                    })?;
                tokens.push(token as u32);
            }
            tokens
        }
        None => return Err(ApiError::invalid("prompt", "missing")),
        Some(other) => {
            return Err(ApiError::invalid(
                "prompt",
                format!("{other} is neither a string nor an array of token ids"),
            ));
        }
    };
    if tokens.is_empty() {
        return Err(ApiError::invalid(
            "prompt",
            "empty: at least one token is required",
        ));
    }
    Ok(tokens)
}

/// Chat messages as (role, text): content a string or an array of `{"type": "text"}` parts.
fn chat_messages(messages: Option<&Value>) -> Result<Vec<(String, String)>, ApiError> {
    let Some(messages) = messages else {
        return Err(ApiError::invalid("messages", "missing"));
    };
    let Some(messages) = messages.as_array().filter(|messages| !messages.is_empty()) else {
        return Err(ApiError::invalid(
            "messages",
            "must be a non-empty array of messages",
        ));
    };
    let mut parsed = Vec::with_capacity(messages.len());
    for (index, message) in messages.iter().enumerate() {
        let at = |field: &str| format!("messages[{index}].{field}");
        let Some(message) = message.as_object() else {
            return Err(ApiError::invalid(
                format!("messages[{index}]"),
                "must be an object with role and content",
            ));
        };
        if let Some(key) = message
            .keys()
            .find(|key| !matches!(key.as_str(), "role" | "content" | "name"))
        {
            return Err(ApiError::invalid(
                at(key),
                "not supported (a message takes role, content and name)",
            ));
        }
        let role = match message.get("role").and_then(Value::as_str) {
            Some(role) if ROLES.contains(&role) => role,
            Some(role) => {
                return Err(ApiError::invalid(
                    at("role"),
                    format!("{role:?} is not one of {}", ROLES.join(", ")),
                ));
            }
            None => return Err(ApiError::invalid(at("role"), "must be a string")),
        };
        let content = match message.get("content") {
            Some(Value::String(text)) => text.clone(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (part_index, part) in parts.iter().enumerate() {
                    match (part["type"].as_str(), part["text"].as_str()) {
                        (Some("text"), Some(piece)) => text.push_str(piece),
                        _ => {
                            return Err(ApiError::invalid(
                                format!("messages[{index}].content[{part_index}]"),
                                "only {\"type\": \"text\", \"text\": ...} parts are supported",
                            ));
                        }
                    }
                }
                text
            }
            None | Some(Value::Null) if role == "assistant" => String::new(),
            _ => {
                return Err(ApiError::invalid(
                    at("content"),
                    "must be a string or an array of text parts",
                ));
            }
        };
        parsed.push((role.to_string(), content));
    }
    Ok(parsed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_actors::config::TokenCapacity;
    use pdkv_core::wire::NodeId;

    fn limit(node: &str, max_tokens: u64, lookahead_tokens: u64) -> PromptLimit {
        PromptLimit {
            max_tokens,
            node: NodeId(node.into()),
            capacity: TokenCapacity {
                tokens: max_tokens + lookahead_tokens,
                group: Some(0),
                blocks: 4,
                block_tokens: (max_tokens + lookahead_tokens) / 4,
            },
            lookahead_tokens,
        }
    }

    /// Prompts up to 200 tokens; prompt plus generated up to 100 + 156 = 256 minus 9.
    fn capacity() -> Capacity {
        Capacity {
            prompt: limit("prefill-0", 200, 0),
            context: limit("decode-0", 247, 9),
        }
    }

    fn parse_completions(body: &str) -> Result<Completion, ApiError> {
        parse(Endpoint::Completions, body.as_bytes(), 256, &capacity())
    }

    fn refused(endpoint: Endpoint, body: &str) -> (u16, String, String) {
        let error = parse(endpoint, body.as_bytes(), 256, &capacity()).unwrap_err();
        (
            error.status.as_u16(),
            error.param.unwrap_or_default(),
            error.message,
        )
    }

    fn param(body: &str) -> String {
        refused(Endpoint::Completions, body).1
    }

    #[test]
    fn prompts_are_bytes_or_token_ids_below_the_vocabulary() {
        let ok = parse_completions(r#"{"prompt": "hi", "max_tokens": 3}"#).unwrap();
        assert_eq!(ok.prompt, vec![u32::from(b'h'), u32::from(b'i')]);
        assert_eq!(ok.max_tokens, 3);
        assert!(!ok.stream);
        let ok = parse_completions(
            r#"{"prompt": [1, 255], "max_tokens": 2, "stream": true, "stream_options": {"include_usage": true}}"#,
        )
        .unwrap();
        assert_eq!(ok.prompt, vec![1, 255]);
        assert!(ok.stream && ok.include_usage);
        // Values that ask for what greedy decoding does are taken.
        let ok = parse_completions(
            r#"{"prompt": "x", "max_tokens": 1, "temperature": 0, "top_p": 1, "top_k": -1, "seed": 7, "n": 1, "stop": [], "echo": false, "logprobs": null, "user": "u", "model": "pdkv-reference", "presence_penalty": 0}"#,
        );
        assert!(ok.is_ok(), "{ok:?}");
    }

    #[test]
    fn bad_bodies_name_the_field() {
        assert_eq!(param(r#"{"prompt": [1, 256]}"#), "prompt[1]");
        assert_eq!(param(r#"{"prompt": [1, -2]}"#), "prompt[1]");
        assert_eq!(param(r#"{"prompt": ""}"#), "prompt");
        assert_eq!(param(r#"{"prompt": []}"#), "prompt");
        assert_eq!(param(r#"{"prompt": ["a", "b"]}"#), "prompt");
        assert_eq!(param(r#"{"prompt": 7}"#), "prompt");
        assert_eq!(param(r#"{"max_tokens": 3}"#), "prompt");
        assert_eq!(param(r#"{"prompt": "x", "max_tokens": "3"}"#), "max_tokens");
        assert_eq!(param(r#"{"prompt": "x", "max_tokens": 0}"#), "max_tokens");
        assert_eq!(param(r#"{"prompt": "x", "max_tokens": 4097}"#), "max_tokens");
        assert_eq!(param(r#"{"prompt": "x", "n": 2}"#), "n");
        assert_eq!(
            param(r#"{"prompt": "x", "stream_options": {}}"#),
            "stream_options"
        );
        assert_eq!(param(r#"{"prompt": "x", "stream": "yes"}"#), "stream");
        assert_eq!(
            refused(Endpoint::Completions, r#"{"prompt": "x", "model": "gpt-4"}"#).0,
            404
        );
        assert_eq!(param(r#"not json"#), "body");
        let (_, _, message) = refused(Endpoint::Completions, r#"{"prompt": "x", "max_tokens": }"#);
        assert!(
            message.contains("expected value at line 1 column 31"),
            "{message}"
        );
        let deep = format!(r#"{{"prompt": {}1{}}}"#, "[".repeat(1000), "]".repeat(1000));
        let (status, field, message) = refused(Endpoint::Completions, &deep);
        assert_eq!((status, field.as_str()), (400, "body"));
        assert!(message.contains("recursion limit exceeded"), "{message}");
        assert_eq!(param(r#"{not json"#), "body");
        assert_eq!(param(r#"[1, 2]"#), "body");
        // A multi-byte character is bytes >= 128: inside a 256-token vocabulary, outside 128.
        assert!(parse_completions("{\"prompt\": \"é\", \"max_tokens\": 1}").is_ok());
        let error = parse(
            Endpoint::Completions,
            "{\"prompt\": \"é\"}".as_bytes(),
            128,
            &capacity(),
        )
        .unwrap_err();
        assert_eq!(error.param.as_deref(), Some("prompt"));
        assert!(
            error.message.contains("outside the vocabulary of 128"),
            "{}",
            error.message
        );
    }

    #[test]
    fn trailing_data_after_the_object_is_refused() {
        let (status, param, message) = refused(Endpoint::Completions, r#"{"prompt":"a"}{"prompt":"b"}"#);
        assert_eq!((status, param.as_str()), (400, "body"));
        assert!(message.contains("data after the JSON object"), "{message}");
        // Whitespace after it is not data.
        assert!(parse_completions("{\"prompt\":\"a\",\"max_tokens\":1}\n  ").is_ok());
        // Parser internals (Rust types) stay out of the message.
        let (_, _, message) = refused(Endpoint::Completions, r#"{"prompt": "x", "max_tokens": "3"}"#);
        assert!(
            !message.contains("u32") && !message.contains("invalid type"),
            "{message}"
        );
    }

    #[test]
    fn an_unknown_field_is_answered_with_every_field_the_endpoint_takes() {
        for (endpoint, body, own) in [
            (
                Endpoint::Completions,
                r#"{"prompt": "x", "frobnicate": 1}"#,
                "prompt",
            ),
            (
                Endpoint::Chat,
                r#"{"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}"#,
                "messages",
            ),
        ] {
            let (_, param, message) = refused(endpoint, body);
            assert_eq!(param, "frobnicate", "{message}");
            for field in [own, "model", "max_tokens", "stream", "temperature", "stop"] {
                assert!(
                    message.contains(field),
                    "{endpoint:?}: {field} missing from {message}"
                );
            }
        }
    }

    #[test]
    fn options_the_engine_would_not_honour_are_refused_by_name() {
        for (body, field, says) in [
            (
                r#"{"prompt": "x", "presence_penalty": 0.5}"#,
                "presence_penalty",
                "penalties",
            ),
            (
                r#"{"prompt": "x", "logit_bias": {"1": 2}}"#,
                "logit_bias",
                "penalties",
            ),
            (r#"{"prompt": "x", "best_of": 3}"#, "best_of", "one completion"),
            (r#"{"prompt": "x", "min_p": 0.1}"#, "min_p", "min_p"),
            (
                r#"{"prompt": "x", "frobnicate": 1}"#,
                "frobnicate",
                "unknown field",
            ),
            (
                r#"{"prompt": "x", "temperature": "hot"}"#,
                "temperature",
                "is not a temperature",
            ),
            (
                r#"{"prompt": "x", "temperature": -1}"#,
                "temperature",
                "is not a temperature",
            ),
            (r#"{"prompt": "x", "top_p": 0}"#, "top_p", "is not a probability"),
            (
                r#"{"prompt": "x", "top_p": 1.5}"#,
                "top_p",
                "is not a probability",
            ),
            (
                r#"{"prompt": "x", "top_k": -2}"#,
                "top_k",
                "is not -1, 0 or a positive",
            ),
            (r#"{"prompt": "x", "seed": "s"}"#, "seed", "integer"),
            (r#"{"prompt": "x", "stop": [""]}"#, "stop[0]", "non-empty"),
            (r#"{"prompt": "x", "stop": 3}"#, "stop", "a string or an array"),
            (
                r#"{"prompt": "x", "stop_token_ids": [256]}"#,
                "stop_token_ids[0]",
                "below 256",
            ),
            (r#"{"prompt": "x", "logprobs": 21}"#, "logprobs", "0..=20"),
            (
                r#"{"prompt": "x", "logprobs": 2, "stream": true}"#,
                "logprobs",
                "stream",
            ),
            (
                r#"{"prompt": "x", "logprobs": 2, "echo": true}"#,
                "echo",
                "prompt's log-probabilities",
            ),
        ] {
            let (status, param, message) = refused(Endpoint::Completions, body);
            assert_eq!((status, param.as_str()), (400, field), "{body}: {message}");
            assert!(message.contains(says), "{body}: {message}");
        }
        let stops = format!(r#"{{"prompt": "x", "stop": {:?}}}"#, vec!["s"; 17]);
        assert_eq!(param(&stops), "stop");
        for (body, field) in [
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "echo": true}"#,
                "echo",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}"#,
                "top_logprobs",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "logprobs": 2}"#,
                "logprobs",
            ),
        ] {
            assert_eq!(refused(Endpoint::Chat, body).1, field, "{body}");
        }
        assert_eq!(param(r#"{"prompt": "x", "top_logprobs": 2}"#), "top_logprobs");
    }

    #[test]
    fn chat_clients_default_tool_and_format_fields_are_accepted_and_real_ones_refused() {
        let chat = |extra: &str| format!(r#"{{"messages": [{{"role": "user", "content": "x"}}], {extra}}}"#);
        for extra in [
            r#""response_format": {"type": "text"}"#,
            r#""tools": []"#,
            r#""tool_choice": "none""#,
            r#""parallel_tool_calls": false"#,
            r#""functions": [], "function_call": "none""#,
        ] {
            assert!(
                parse(Endpoint::Chat, chat(extra).as_bytes(), 256, &capacity()).is_ok(),
                "{extra}"
            );
        }
        for (extra, field, says) in [
            (
                r#""response_format": {"type": "json_object"}"#,
                "response_format",
                "structured output",
            ),
            (
                r#""response_format": "text""#,
                "response_format",
                "not a valid value",
            ),
            (
                r#""tools": [{"type": "function", "function": {"name": "f"}}]"#,
                "tools",
                "tool calls",
            ),
            (r#""tool_choice": "auto""#, "tool_choice", "tool calls"),
            (
                r#""parallel_tool_calls": 1"#,
                "parallel_tool_calls",
                "not a valid value",
            ),
        ] {
            let (status, param, message) = refused(Endpoint::Chat, &chat(extra));
            assert_eq!((status, param.as_str()), (400, field), "{extra}: {message}");
            assert!(message.contains(says), "{extra}: {message}");
        }
    }

    #[test]
    fn sampling_options_reach_the_sampler() {
        let sampled = parse_completions(
            r#"{"prompt": "x", "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3, "stop": ["Y", "ab"], "stop_token_ids": [7], "logprobs": 2}"#,
        )
        .unwrap()
        .sampling;
        assert_eq!(
            sampled,
            Sampling {
                temperature: 0.7,
                top_k: 5,
                top_p: 0.9,
                seed: 3,
                stop_token_ids: vec![7],
                stop_sequences: vec![vec![u32::from(b'Y')], vec![u32::from(b'a'), u32::from(b'b')]],
                logprobs: Some(2),
            }
        );
        let greedy = parse_completions(r#"{"prompt": "x", "max_tokens": 1, "stop": "Z", "top_k": -1}"#)
            .unwrap()
            .sampling;
        assert!(greedy.is_greedy());
        assert_eq!((greedy.top_k, greedy.seed), (0, 0));
        assert_eq!(greedy.stop_sequences, vec![vec![u32::from(b'Z')]]);
        // A sampled request without a seed gets one drawn for it.
        let seeds: std::collections::HashSet<u64> = (0..8)
            .map(|_| {
                parse_completions(r#"{"prompt": "x", "max_tokens": 1, "temperature": 1}"#)
                    .unwrap()
                    .sampling
                    .seed
            })
            .collect();
        assert!(seeds.len() > 1, "fresh seeds differ: {seeds:?}");
        let chat = parse(
            Endpoint::Chat,
            br#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logprobs": true, "top_logprobs": 3}"#,
            256,
            &capacity(),
        )
        .unwrap();
        assert_eq!(chat.sampling.logprobs, Some(3));
        let echo = parse_completions(r#"{"prompt": "x", "max_tokens": 1, "echo": true}"#).unwrap();
        assert!(echo.echo);
    }

    #[test]
    fn a_request_that_cannot_fit_is_refused_naming_max_tokens_and_an_absent_one_gets_what_fits() {
        // 10 prompt tokens leave 247 - 10 = 237 for generation.
        let prompt: Vec<u32> = vec![1; 10];
        let body = |max: &str| format!(r#"{{"prompt": {prompt:?}{max}}}"#);
        assert_eq!(
            parse_completions(&body(r#", "max_tokens": 237"#))
                .unwrap()
                .max_tokens,
            237
        );
        let (status, param, message) = refused(Endpoint::Completions, &body(r#", "max_tokens": 238"#));
        assert_eq!((status, param.as_str()), (400, "max_tokens"));
        assert!(
            message.contains("248 token slots")
                && message.contains("decode-0")
                && message.contains("at most 237"),
            "{message}"
        );
        assert_eq!(parse_completions(&body("")).unwrap().max_tokens, 237);
        // A prompt of exactly the context leaves nothing; one past the prompt limit is refused.
        let full = Capacity {
            prompt: limit("prefill-0", 247, 0),
            context: limit("decode-0", 247, 9),
        };
        let body = format!(r#"{{"prompt": {:?}}}"#, vec![1; 247]);
        let error = parse(Endpoint::Completions, body.as_bytes(), 256, &full).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("prompt"));
        assert!(error.message.contains("no room"), "{}", error.message);
        let body = format!(r#"{{"prompt": {:?}}}"#, vec![1; 201]);
        let (_, param, message) = refused(Endpoint::Completions, &body);
        assert_eq!(param, "prompt");
        assert!(message.contains("longer than the cluster's limit"), "{message}");
    }

    #[test]
    fn chat_messages_go_through_the_plain_template() {
        let body = r#"{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_completion_tokens": 4, "max_tokens": 9}"#;
        let chat = parse(Endpoint::Chat, body.as_bytes(), 256, &capacity()).unwrap();
        let expected = "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n";
        assert_eq!(chat.prompt, expected.bytes().map(u32::from).collect::<Vec<_>>());
        assert_eq!(chat.max_tokens, 4, "max_completion_tokens wins");
        for (body, field) in [
            (r#"{"messages": []}"#, "messages"),
            (r#"{"prompt": "x"}"#, "prompt"),
            (
                r#"{"messages": [{"role": "wizard", "content": "x"}]}"#,
                "messages[0].role",
            ),
            (
                r#"{"messages": [{"role": "user", "content": 3}]}"#,
                "messages[0].content",
            ),
            (
                r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#,
                "messages[0].content[0]",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x", "tool_calls": []}]}"#,
                "messages[0].tool_calls",
            ),
        ] {
            let (status, param, message) = refused(Endpoint::Chat, body);
            assert_eq!((status, param.as_str()), (400, field), "{body}: {message}");
        }
    }
}
