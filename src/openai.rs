//! The router's OpenAI-compatible completions API (as vLLM's and SGLang's P/D proxies serve it):
//! `POST /v1/completions` and `GET /v1/models`.
//!
//! The reference model's vocabulary is byte-level: a string prompt is one token per byte, and
//! generated tokens come back as `text` (bytes, lossily decoded) and as `token_ids`. Every answer
//! also carries a `pdkv` object (logits digest, bytes read, stage times) so a client can check
//! it bit for bit against a one-leg run. Bad requests get a 4xx whose JSON error names the field.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use actix::Addr;
use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use pdkv_actors::error::RequestError;
use pdkv_actors::router::{Cancel, Generate, Router as RouterActor};
use pdkv_actors::scheduler::Output;
use pdkv_core::wire::Failure;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tracing::Instrument;

/// The one model the reference engine serves.
pub const MODEL_NAME: &str = "pdkv-reference";

/// The request id header, honoured and echoed.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Longest `X-Request-Id` accepted.
const MAX_REQUEST_ID: usize = 128;

/// Most tokens one request may ask for.
pub const MAX_COMPLETION_TOKENS: u32 = 4096;

/// `max_tokens` when the request names none (OpenAI's default).
const DEFAULT_MAX_TOKENS: u32 = 16;

/// What the API handlers need.
#[derive(Clone)]
pub struct ApiState {
    /// The router actor.
    pub router: Addr<RouterActor>,
    /// Tokens of the model's vocabulary.
    pub vocab: u32,
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
    /// The router's whole-request bound; the handler waits a little longer at most.
    pub request_timeout: Duration,
    /// Ids of requests that came without `X-Request-Id`.
    pub next_id: Arc<AtomicU64>,
    /// Names the router knows requests by for cancelling them ([`Cancel`]).
    pub next_client: Arc<AtomicU64>,
}

/// Cancels a request at the router when dropped still armed: the client went away (the
/// handler was dropped with its connection, or a stream's reader closed) before the answer.
struct CancelOnDrop {
    router: Addr<RouterActor>,
    client: u64,
    armed: bool,
}

impl CancelOnDrop {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            // One message per abandoned request, so `do_send` cannot pile up past the request
            // rate; it must not be lost, or the legs would hold the request's blocks until its
            // deadline.
            self.router.do_send(Cancel { client: self.client });
        }
    }
}

/// The API routes.
pub fn routes(state: ApiState) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .with_state(state)
}

async fn models() -> Response {
    let body = json!({
        "object": "list",
        "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "pdkv", "created": 0}],
    });
    axum::Json(body).into_response()
}

/// A completions request as sent; fields pdkv does not use (temperature, …) are ignored.
#[derive(Debug, Deserialize)]
struct CompletionRequest {
    model: Option<String>,
    /// Null when missing, refused by name below.
    #[serde(default)]
    prompt: Value,
    max_tokens: Option<u32>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    n: Option<u32>,
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// A 4xx or 5xx answer in OpenAI's error shape.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<String>,
}

impl ApiError {
    fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        let param = param.into();
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!("{param}: {}", message.into()),
            kind: "invalid_request_error",
            param: Some(param),
        }
    }

    fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

fn request_error(error: &RequestError) -> ApiError {
    let (status, kind) = match error {
        RequestError::EmptyPrompt | RequestError::PromptTooLong(_) | RequestError::SlotOverflow { .. } => {
            (StatusCode::BAD_REQUEST, "invalid_request_error")
        }
        RequestError::Timeout { .. } => (StatusCode::GATEWAY_TIMEOUT, "timeout_error"),
        RequestError::UnknownNode(_) | RequestError::NoLeg { .. } | RequestError::Mailbox { .. } => {
            (StatusCode::SERVICE_UNAVAILABLE, "unavailable_error")
        }
        RequestError::Failed {
            failure: Failure::QueueFull { .. } | Failure::NoFreeBlocks { .. },
            ..
        } => (StatusCode::SERVICE_UNAVAILABLE, "overloaded_error"),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "server_error"),
    };
    let param = (status == StatusCode::BAD_REQUEST).then(|| "prompt".to_string());
    ApiError {
        status,
        message: error.to_string(),
        kind,
        param,
    }
}

/// A short name for a failed request's cause (metric label).
fn outcome_label(error: &ApiError) -> &'static str {
    match error.status.as_u16() {
        400..=499 => "bad_request",
        503 => "unavailable",
        504 => "timeout",
        _ => "error",
    }
}

fn with_request_id(mut response: Response, request_id: &str) -> Response {
    if let Ok(value) = HeaderValue::from_str(request_id) {
        response.headers_mut().insert(REQUEST_ID_HEADER, value);
    }
    response
}

fn error_response(error: &ApiError, request_id: &str) -> Response {
    let response = (error.status, axum::Json(error.body())).into_response();
    with_request_id(response, request_id)
}

/// The request id: the client's `X-Request-Id` if it is printable ASCII of at most 128 bytes,
/// else a new one.
fn request_id(headers: &HeaderMap, next: &AtomicU64) -> Result<String, ApiError> {
    match headers.get(REQUEST_ID_HEADER) {
        Some(value) => {
            let text = value
                .to_str()
                .ok()
                .filter(|text| !text.is_empty() && text.len() <= MAX_REQUEST_ID)
                .filter(|text| text.bytes().all(|byte| byte.is_ascii_graphic()))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "X-Request-Id",
                        format!("must be 1 to {MAX_REQUEST_ID} printable ASCII characters without spaces"),
                    )
                })?;
            Ok(text.to_string())
        }
        None => Ok(format!("pdkv-{}", next.fetch_add(1, Ordering::Relaxed))),
    }
}

/// A checked request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// Answer as server-sent events.
    pub stream: bool,
    /// Add a usage chunk to the stream.
    pub include_usage: bool,
}

/// Parses and checks a request body against a vocabulary of `vocab` tokens.
pub fn parse_completion(body: &[u8], vocab: u32) -> Result<Completion, ApiError> {
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err(ApiError::invalid("body", "must be a JSON object"));
    }
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let request: CompletionRequest =
        serde_path_to_error::deserialize(&mut deserializer).map_err(|error| {
            let path = error.path().to_string();
            // serde_path_to_error names the root "." and a spot inside malformed JSON "?".
            let param = if path == "." || path.starts_with('?') {
                "body".to_string()
            } else {
                path
            };
            ApiError::invalid(param, error.into_inner().to_string())
        })?;
    if let Some(model) = &request.model
        && model != MODEL_NAME
    {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("model: {model:?} does not exist; this server serves {MODEL_NAME:?}"),
            kind: "invalid_request_error",
            param: Some("model".into()),
        });
    }
    if let Some(n) = request.n
        && n != 1
    {
        return Err(ApiError::invalid(
            "n",
            format!("{n} completions asked, pdkv answers one"),
        ));
    }
    let prompt = prompt_tokens(&request.prompt, vocab)?;
    let max_tokens = request.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    if max_tokens == 0 || max_tokens > MAX_COMPLETION_TOKENS {
        return Err(ApiError::invalid(
            "max_tokens",
            format!("{max_tokens} is outside 1..={MAX_COMPLETION_TOKENS}"),
        ));
    }
    if request.stream_options.is_some() && !request.stream {
        return Err(ApiError::invalid(
            "stream_options",
            "only allowed when stream is true",
        ));
    }
    Ok(Completion {
        prompt,
        max_tokens,
        stream: request.stream,
        include_usage: request
            .stream_options
            .is_some_and(|options| options.include_usage),
    })
}

/// A prompt as a string (one token per byte) or an array of token ids, each below `vocab`.
fn prompt_tokens(prompt: &Value, vocab: u32) -> Result<Vec<u32>, ApiError> {
    let tokens: Vec<u32> = match prompt {
        Value::String(text) => {
            let tokens: Vec<u32> = text.bytes().map(u32::from).collect();
            if let Some(position) = tokens.iter().position(|&token| token >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!(
                        "byte {position} is token {}, outside the vocabulary of {vocab}",
                        tokens[position]
                    ),
                ));
            }
            tokens
        }
        Value::Array(items) => {
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
        Value::Null => return Err(ApiError::invalid("prompt", "missing")),
        other => {
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

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

/// The text of generated tokens: one byte per token (byte-level vocabulary).
fn token_text(tokens: &[u32]) -> String {
    let bytes: Vec<u8> = tokens.iter().map(|&token| token.min(255) as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// What pdkv adds to every answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PdkvInfo {
    /// Digest of every generated step's logits, hex.
    pub logits_digest: String,
    /// Bytes the decode leg read.
    pub read_bytes: u64,
    /// READ runs posted.
    pub read_runs: u64,
    /// Prefix-hit blocks reused by the decode leg.
    pub cached_blocks: u64,
    /// Router: prefill stage, ms.
    pub prefill_ms: f64,
    /// Router: decode stage, ms.
    pub decode_ms: f64,
}

fn pdkv_info(output: &Output) -> PdkvInfo {
    PdkvInfo {
        logits_digest: format!("{:016x}", output.logits_digest),
        read_bytes: output.read_bytes,
        read_runs: output.read_runs,
        cached_blocks: output.cached_blocks,
        prefill_ms: output.prefill_stage.as_secs_f64() * 1e3,
        decode_ms: output.decode_stage.as_secs_f64() * 1e3,
    }
}

fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

async fn completions(State(state): State<ApiState>, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    let request_id = match request_id(&headers, &state.next_id) {
        Ok(id) => id,
        Err(error) => {
            let fresh = format!("pdkv-{}", state.next_id.fetch_add(1, Ordering::Relaxed));
            return error_response(&error, &fresh);
        }
    };
    // The span goes with the future (`instrument`), never entered across an await: a guard held
    // over an await leaks into whatever the thread polls next, nesting other requests' spans.
    let span = tracing::info_span!("completion", request_id = %request_id);
    serve_completion(state, body, request_id, started)
        .instrument(span)
        .await
}

/// The rest of `POST /v1/completions`, inside the request's span.
async fn serve_completion(state: ApiState, body: Body, request_id: String, started: Instant) -> Response {
    let bytes = match axum::body::to_bytes(body, state.max_body_bytes).await {
        Ok(bytes) => bytes,
        Err(_) => {
            let error = ApiError {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                message: format!("body: larger than {} bytes", state.max_body_bytes),
                kind: "invalid_request_error",
                param: Some("body".into()),
            };
            metrics::counter!("pdkv_requests_total", "outcome" => "bad_request").increment(1);
            return error_response(&error, &request_id);
        }
    };
    let completion = match parse_completion(&bytes, state.vocab) {
        Ok(completion) => completion,
        Err(error) => {
            metrics::counter!("pdkv_requests_total", "outcome" => "bad_request").increment(1);
            return error_response(&error, &request_id);
        }
    };
    let (token_tx, token_rx) = if completion.stream {
        // Room for every token: each message carries at least one.
        let (tx, rx) = tokio::sync::mpsc::channel(completion.max_tokens as usize + 1);
        (Some(tx), Some(rx))
    } else {
        (None, None)
    };
    let client = state.next_client.fetch_add(1, Ordering::Relaxed);
    let generate = Generate {
        prompt: completion.prompt.clone().into(),
        max_tokens: completion.max_tokens,
        stream: token_tx,
        client: Some(client),
    };
    let guard = CancelOnDrop {
        router: state.router.clone(),
        client,
        armed: true,
    };
    // The router bounds the request; this bound only guards against a router that is gone.
    let bound = state.request_timeout + Duration::from_secs(5);
    let router = state.router.clone();
    let mut answer = Box::pin(async move {
        match tokio::time::timeout(bound, router.send(generate)).await {
            Ok(Ok(result)) => result,
            Ok(Err(error)) => Err(RequestError::Mailbox {
                actor: "router",
                detail: error.to_string(),
            }),
            Err(_) => Err(RequestError::Timeout {
                stage: "router",
                after_ms: bound.as_millis() as u64,
            }),
        }
    });
    let reply = Reply {
        id: format!("cmpl-{request_id}"),
        created: unix_now(),
        completion,
        started,
    };
    if let Some(mut tokens) = token_rx {
        // Wait for the first token or the answer: a request that fails before its first token
        // still gets an error status; once a token is out, the answer streams.
        let first = tokio::select! {
            result = &mut answer => Err(result),
            first = tokens.recv() => Ok(first),
        };
        let response = match first {
            Ok(Some(first)) => stream_live(reply, first, tokens, answer, guard),
            Ok(None) => {
                let result = answer.await;
                guard.disarm();
                reply.whole(result)
            }
            Err(result) => {
                guard.disarm();
                reply.whole(result)
            }
        };
        return with_request_id(response, &request_id);
    }
    let result = answer.await;
    guard.disarm();
    with_request_id(reply.whole(result), &request_id)
}

/// What every answer to one completion shares.
struct Reply {
    id: String,
    created: u64,
    completion: Completion,
    started: Instant,
}

impl Reply {
    /// Counts the outcome; the error in OpenAI's shape if it failed.
    fn record(&self, result: &Result<Output, RequestError>) -> Option<ApiError> {
        match result {
            Ok(output) => {
                metrics::counter!("pdkv_requests_total", "outcome" => "ok").increment(1);
                metrics::histogram!("pdkv_request_seconds", "stage" => "prefill")
                    .record(output.prefill_stage.as_secs_f64());
                metrics::histogram!("pdkv_request_seconds", "stage" => "decode")
                    .record(output.decode_stage.as_secs_f64());
                metrics::histogram!("pdkv_request_seconds", "stage" => "total")
                    .record(self.started.elapsed().as_secs_f64());
                None
            }
            Err(error) => {
                tracing::warn!(%error, "completion failed");
                let api = request_error(error);
                metrics::counter!("pdkv_requests_total", "outcome" => outcome_label(&api)).increment(1);
                Some(api)
            }
        }
    }

    /// The whole answer at once: JSON, or (streaming) every chunk in one body.
    fn whole(&self, result: Result<Output, RequestError>) -> Response {
        if let Some(error) = self.record(&result) {
            return (error.status, axum::Json(error.body())).into_response();
        }
        let Ok(output) = result else {
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        };
        if self.completion.stream {
            let mut events = vec![self.chunk(&output.tokens, 0)];
            events.push(self.tail(&output));
            return sse_response(Body::from(sse(&events)));
        }
        let mut body = self.object(json!([choice(&output.tokens, true)]));
        body["usage"] = usage(self.completion.prompt.len(), output.tokens.len());
        body["pdkv"] = json!(pdkv_info(&output));
        axum::Json(body).into_response()
    }

    /// What every answer and chunk of this completion says, around its `choices`.
    fn object(&self, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": MODEL_NAME,
            "choices": choices,
        })
    }

    /// A chunk of `tokens` after `sent` earlier ones; the one that completes `max_tokens`
    /// carries the finish reason.
    fn chunk(&self, tokens: &[u32], sent: usize) -> Value {
        let last = sent + tokens.len() >= self.completion.max_tokens as usize;
        self.object(json!([choice(tokens, last)]))
    }

    /// The last chunk: no choices, pdkv's figures, and `usage` if asked for.
    fn tail(&self, output: &Output) -> Value {
        let mut tail = self.object(json!([]));
        tail["pdkv"] = json!(pdkv_info(output));
        if self.completion.include_usage {
            tail["usage"] = usage(self.completion.prompt.len(), output.tokens.len());
        }
        tail
    }
}

/// The one choice of an answer or chunk: `tokens`, and the finish reason if they end it.
fn choice(tokens: &[u32], finishes: bool) -> Value {
    json!({
        "index": 0,
        "text": token_text(tokens),
        "token_ids": tokens,
        "logprobs": null,
        "finish_reason": if finishes { Value::from("length") } else { Value::Null },
    })
}

/// One server-sent event.
fn event(value: &Value) -> axum::body::Bytes {
    axum::body::Bytes::from(format!("data: {value}\n\n"))
}

const DONE: &str = "data: [DONE]\n\n";

fn sse(events: &[Value]) -> String {
    let mut text = String::new();
    for value in events {
        text.push_str(&format!("data: {value}\n\n"));
    }
    text.push_str(DONE);
    text
}

fn sse_response(body: Body) -> Response {
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// Events a live stream may hold unsent before its writer waits for the client.
const STREAM_BUFFER: usize = 64;

/// Streams tokens as the decode leg sends them, then the tail (or an `error` chunk), then
/// `[DONE]`. Tokens the router could not pass on early are taken from the answer, so the stream
/// always ends with every token of the answer, in order.
fn stream_live(
    reply: Reply,
    first: Vec<u32>,
    mut tokens: tokio::sync::mpsc::Receiver<Vec<u32>>,
    mut answer: std::pin::Pin<Box<dyn std::future::Future<Output = Result<Output, RequestError>> + Send>>,
    guard: CancelOnDrop,
) -> Response {
    let (events, body) =
        tokio::sync::mpsc::channel::<Result<axum::body::Bytes, std::convert::Infallible>>(STREAM_BUFFER);
    tokio::spawn(async move {
        let mut sent = first.clone();
        // A client that went away ends the writing, not the request.
        let _ = events.send(Ok(event(&reply.chunk(&first, 0)))).await;
        let result = loop {
            tokio::select! {
                result = &mut answer => break result,
                Some(more) = tokens.recv() => {
                    let _ = events.send(Ok(event(&reply.chunk(&more, sent.len())))).await;
                    sent.extend(more);
                }
                // The reader went away: the guard, dropped armed, cancels the request.
                () = events.closed() => return,
            }
        };
        guard.disarm();
        while let Ok(more) = tokens.try_recv() {
            let _ = events.send(Ok(event(&reply.chunk(&more, sent.len())))).await;
            sent.extend(more);
        }
        let last = match (reply.record(&result), result) {
            (None, Ok(output)) => match output.tokens.strip_prefix(sent.as_slice()) {
                Some(missing) => {
                    if !missing.is_empty() {
                        let _ = events.send(Ok(event(&reply.chunk(missing, sent.len())))).await;
                    }
                    reply.tail(&output)
                }
                None => ApiError {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    message: "streamed tokens differ from the decode leg's answer".into(),
                    kind: "server_error",
                    param: None,
                }
                .body(),
            },
            (Some(error), _) => error.body(),
            (None, Err(_)) => json!({"error": {"message": "no answer", "type": "server_error"}}),
        };
        let _ = events.send(Ok(event(&last))).await;
        let _ = events
            .send(Ok(axum::body::Bytes::from_static(DONE.as_bytes())))
            .await;
    });
    let stream = futures_util::stream::unfold(body, |mut body| async move {
        body.recv().await.map(|item| (item, body))
    });
    sse_response(Body::from_stream(stream))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param(body: &str) -> (u16, String, String) {
        let error = parse_completion(body.as_bytes(), 256).unwrap_err();
        (
            error.status.as_u16(),
            error.param.unwrap_or_default(),
            error.message,
        )
    }

    #[test]
    fn prompts_are_bytes_or_token_ids_below_the_vocabulary() {
        let ok = parse_completion(br#"{"prompt": "hi", "max_tokens": 3}"#, 256).unwrap();
        assert_eq!(ok.prompt, vec![u32::from(b'h'), u32::from(b'i')]);
        assert_eq!(ok.max_tokens, 3);
        assert!(!ok.stream);
        let ok = parse_completion(
            br#"{"prompt": [1, 255], "stream": true, "stream_options": {"include_usage": true}}"#,
            256,
        )
        .unwrap();
        assert_eq!(ok.prompt, vec![1, 255]);
        assert_eq!(ok.max_tokens, DEFAULT_MAX_TOKENS);
        assert!(ok.stream && ok.include_usage);
        // Fields pdkv does not use are accepted and ignored.
        assert!(
            parse_completion(
                br#"{"prompt": "x", "temperature": 0.7, "model": "pdkv-reference"}"#,
                256
            )
            .is_ok()
        );
    }

    #[test]
    fn bad_bodies_name_the_field() {
        assert_eq!(param(r#"{"prompt": [1, 256]}"#).1, "prompt[1]");
        assert_eq!(param(r#"{"prompt": [1, -2]}"#).1, "prompt[1]");
        assert_eq!(param(r#"{"prompt": ""}"#).1, "prompt");
        assert_eq!(param(r#"{"prompt": []}"#).1, "prompt");
        assert_eq!(param(r#"{"prompt": ["a", "b"]}"#).1, "prompt");
        assert_eq!(param(r#"{"prompt": 7}"#).1, "prompt");
        assert_eq!(param(r#"{"max_tokens": 3}"#).1, "prompt");
        assert_eq!(param(r#"{"prompt": "x", "max_tokens": "3"}"#).1, "max_tokens");
        assert_eq!(param(r#"{"prompt": "x", "max_tokens": 0}"#).1, "max_tokens");
        assert_eq!(param(r#"{"prompt": "x", "max_tokens": 4097}"#).1, "max_tokens");
        assert_eq!(param(r#"{"prompt": "x", "n": 2}"#).1, "n");
        assert_eq!(
            param(r#"{"prompt": "x", "stream_options": {}}"#).1,
            "stream_options"
        );
        assert_eq!(param(r#"{"prompt": "x", "stream": "yes"}"#).1, "stream");
        assert_eq!(param(r#"{"prompt": "x", "model": "gpt-4"}"#).0, 404);
        assert_eq!(param(r#"not json"#).1, "body");
        assert_eq!(param(r#"{not json"#).1, "body");
        assert_eq!(param(r#"[1, 2]"#).1, "body");
        // A multi-byte character is bytes >= 128: inside a 256-token vocabulary, outside 128.
        assert!(parse_completion("{\"prompt\": \"é\"}".as_bytes(), 256).is_ok());
        let error = parse_completion("{\"prompt\": \"é\"}".as_bytes(), 128).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("prompt"));
        assert!(
            error.message.contains("outside the vocabulary of 128"),
            "{}",
            error.message
        );
    }
}
