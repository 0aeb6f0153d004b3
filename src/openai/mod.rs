//! The router's OpenAI-compatible API (vLLM's OpenAI server is the reference):
//! `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `/health`, `/version`.
//!
//! The reference model's vocabulary is byte-level: a string prompt is one token per byte, and
//! generated tokens come back as `text` (bytes decoded; streamed in whole characters, so a
//! streamed answer's text equals the unstreamed one's) and as `token_ids`. Every answer also
//! carries a `pdkv` object (logits digest, bytes read, stage times) so a client can check it bit
//! for bit against a one-leg run. Bad requests get a 4xx whose JSON error names the field.

mod error;
mod request;
mod text;

pub use error::{ApiError, request_error, with_json_errors};
pub use request::{Capacity, Completion, Endpoint, MAX_COMPLETION_TOKENS, MODEL_NAME, chat_template, parse};
pub use text::{TextStream, token_text, visible_text};

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
use pdkv_actors::router::Output;
use pdkv_actors::router::{Cancel, Generate, Router as RouterActor};
use pdkv_core::sampling::Finish;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tracing::Instrument;

/// The request id header, honoured and echoed.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Longest `X-Request-Id` accepted.
const MAX_REQUEST_ID: usize = 128;

/// What the API handlers need.
#[derive(Clone)]
pub struct ApiState {
    /// The router actor.
    pub router: Addr<RouterActor>,
    /// Tokens of the model's vocabulary.
    pub vocab: u32,
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
    /// Longest wait for a request's body.
    pub body_timeout: Duration,
    /// What the cluster can hold for one request.
    pub capacity: Capacity,
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

fn with_request_id(mut response: Response, request_id: &str) -> Response {
    if let Ok(value) = HeaderValue::from_str(request_id) {
        response.headers_mut().insert(REQUEST_ID_HEADER, value);
    }
    response
}

fn error_response(error: &ApiError, request_id: &str) -> Response {
    with_request_id(error.clone().into_response(), request_id)
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

/// The API routes.
pub fn routes(state: ApiState) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route(
            "/version",
            get(|| async { axum::Json(json!({"version": env!("CARGO_PKG_VERSION")})) }),
        )
        .with_state(state)
}

async fn models() -> Response {
    let body = json!({
        "object": "list",
        "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "pdkv", "created": 0}],
    });
    axum::Json(body).into_response()
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
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

async fn completions(state: State<ApiState>, headers: HeaderMap, body: Body) -> Response {
    serve(state, Endpoint::Completions, headers, body).await
}

async fn chat_completions(state: State<ApiState>, headers: HeaderMap, body: Body) -> Response {
    serve(state, Endpoint::Chat, headers, body).await
}

async fn serve(
    State(state): State<ApiState>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Body,
) -> Response {
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
    serve_completion(state, endpoint, body, request_id, started)
        .instrument(span)
        .await
}

/// Counts a request refused before any leg saw it.
fn refuse(error: &ApiError, request_id: &str, started: Instant) -> Response {
    metrics::counter!("pdkv_requests_total", "outcome" => error.outcome()).increment(1);
    metrics::histogram!("pdkv_request_seconds", "stage" => "total", "outcome" => error.outcome())
        .record(started.elapsed().as_secs_f64());
    error_response(error, request_id)
}

/// The rest of a completion, inside the request's span.
async fn serve_completion(
    state: ApiState,
    endpoint: Endpoint,
    body: Body,
    request_id: String,
    started: Instant,
) -> Response {
    let bytes = match crate::http::read_body(body, state.max_body_bytes, state.body_timeout).await {
        Ok(bytes) => bytes,
        Err(error) => {
            let status = error.status();
            let error = ApiError {
                status,
                message: error.to_string(),
                kind: "invalid_request_error",
                param: Some("body".into()),
                retry_after: None,
            };
            return refuse(&error, &request_id, started);
        }
    };
    let completion = match parse(endpoint, &bytes, state.vocab, &state.capacity) {
        Ok(completion) => completion,
        Err(error) => return refuse(&error, &request_id, started),
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
        sampling: completion.sampling.clone(),
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
    let id = match endpoint {
        Endpoint::Completions => format!("cmpl-{request_id}"),
        Endpoint::Chat => format!("chatcmpl-{request_id}"),
    };
    let reply = Reply {
        id,
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
        let elapsed = self.started.elapsed().as_secs_f64();
        match result {
            Ok(output) => {
                metrics::counter!("pdkv_requests_total", "outcome" => "ok").increment(1);
                metrics::histogram!("pdkv_request_seconds", "stage" => "prefill", "outcome" => "ok")
                    .record(output.prefill_stage.as_secs_f64());
                metrics::histogram!("pdkv_request_seconds", "stage" => "decode", "outcome" => "ok")
                    .record(output.decode_stage.as_secs_f64());
                metrics::histogram!("pdkv_request_seconds", "stage" => "total", "outcome" => "ok")
                    .record(elapsed);
                None
            }
            Err(error) => {
                tracing::warn!(%error, "completion failed");
                let api = request_error(error);
                metrics::counter!("pdkv_requests_total", "outcome" => api.outcome()).increment(1);
                metrics::histogram!("pdkv_request_seconds", "stage" => "total", "outcome" => api.outcome())
                    .record(elapsed);
                Some(api)
            }
        }
    }

    /// The whole answer at once: JSON, or (streaming) every chunk in one body.
    fn whole(&self, result: Result<Output, RequestError>) -> Response {
        if let Some(error) = self.record(&result) {
            return error.into_response();
        }
        let Ok(output) = result else {
            return StatusCode::INTERNAL_SERVER_ERROR.into_response();
        };
        if self.completion.stream {
            let mut text = TextStream::new(&self.completion.sampling);
            let mut events = vec![self.chunk(&output.tokens, &mut text, true)];
            events.extend(self.ending(&output, &mut text));
            return sse_response(Body::from(sse(&events)));
        }
        let mut text = visible_text(&output.tokens, &self.completion.sampling, output.finish);
        if self.completion.echo {
            text.insert_str(0, &token_text(&self.completion.prompt));
        }
        let finish = finish_reason(output.finish);
        let logprobs = self.logprobs(&output);
        let choice = match self.completion.endpoint {
            Endpoint::Completions => json!({
                "index": 0,
                "text": text,
                "token_ids": output.tokens,
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
            Endpoint::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "token_ids": output.tokens,
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
        };
        let mut body = self.object(json!([choice]), false);
        body["usage"] = usage(self.completion.prompt.len(), output.tokens.len());
        body["pdkv"] = json!(pdkv_info(&output));
        axum::Json(body).into_response()
    }

    /// The answer's log-probabilities in the endpoint's shape, or null when not asked for:
    /// completions as `tokens` / `token_logprobs` / `top_logprobs` (the top n and the chosen
    /// token, as vLLM) / `text_offset` (byte offsets into the generated text); chat as
    /// `content`, one entry per token with its `bytes` and its top n.
    fn logprobs(&self, output: &Output) -> Value {
        let Some(count) = self.completion.sampling.logprobs else {
            return Value::Null;
        };
        match self.completion.endpoint {
            Endpoint::Completions => {
                let mut text_offset = Vec::new();
                let mut tokens = Vec::new();
                let mut token_logprobs = Vec::new();
                let mut top = Vec::new();
                // One token is one byte of text.
                for (offset, entry) in output.logprobs.iter().enumerate() {
                    text_offset.push(offset);
                    tokens.push(token_piece(entry.token));
                    token_logprobs.push(entry.logprob);
                    let mut dict = serde_json::Map::new();
                    for &(token, logprob) in entry.top.iter().take(count as usize) {
                        dict.insert(token_piece(token), json!(logprob));
                    }
                    dict.entry(token_piece(entry.token))
                        .or_insert(json!(entry.logprob));
                    top.push(Value::Object(dict));
                }
                json!({
                    "tokens": tokens,
                    "token_logprobs": token_logprobs,
                    "top_logprobs": top,
                    "text_offset": text_offset,
                })
            }
            Endpoint::Chat => {
                let content: Vec<Value> = output
                    .logprobs
                    .iter()
                    .map(|entry| {
                        let top: Vec<Value> = entry
                            .top
                            .iter()
                            .take(count as usize)
                            .map(|&(token, logprob)| {
                                json!({"token": token_piece(token), "logprob": logprob, "bytes": [token]})
                            })
                            .collect();
                        json!({
                            "token": token_piece(entry.token),
                            "logprob": entry.logprob,
                            "bytes": [entry.token],
                            "top_logprobs": top,
                        })
                    })
                    .collect();
                json!({"content": content})
            }
        }
    }

    /// What every answer and chunk of this completion says, around its `choices`.
    fn object(&self, choices: Value, chunk: bool) -> Value {
        let object = match (self.completion.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": MODEL_NAME,
            "choices": choices,
        })
    }

    /// The one choice of a chunk: `text` (and the ids it came from), the finish reason if set.
    fn choice(&self, text: String, tokens: &[u32], first: bool, finish: Option<&str>) -> Value {
        match self.completion.endpoint {
            Endpoint::Completions => json!({
                "index": 0,
                "text": text,
                "token_ids": tokens,
                "logprobs": null,
                "finish_reason": finish,
            }),
            Endpoint::Chat => {
                let delta = if first {
                    json!({"role": "assistant", "content": text})
                } else {
                    json!({"content": text})
                };
                json!({
                    "index": 0,
                    "delta": delta,
                    "token_ids": tokens,
                    "logprobs": null,
                    "finish_reason": finish,
                })
            }
        }
    }

    /// A chunk of `tokens`, their text in whole characters (the first after the prompt's text
    /// with `echo`).
    fn chunk(&self, tokens: &[u32], text: &mut TextStream, first: bool) -> Value {
        let mut piece = text.push(tokens);
        if first && self.completion.echo {
            piece.insert_str(0, &token_text(&self.completion.prompt));
        }
        self.object(json!([self.choice(piece, tokens, first, None)]), true)
    }

    /// The last chunks: the finish reason with what text was held back and pdkv's figures, then
    /// `usage` (with no choices) if asked for.
    fn ending(&self, output: &Output, text: &mut TextStream) -> Vec<Value> {
        let mut last = self.object(
            json!([self.choice(
                text.finish(output.finish),
                &[],
                false,
                Some(finish_reason(output.finish))
            )]),
            true,
        );
        last["pdkv"] = json!(pdkv_info(output));
        let mut chunks = vec![last];
        if self.completion.include_usage {
            let mut tail = self.object(json!([]), true);
            tail["usage"] = usage(self.completion.prompt.len(), output.tokens.len());
            chunks.push(tail);
        }
        chunks
    }
}

/// OpenAI's name for why an answer ended.
fn finish_reason(finish: Finish) -> &'static str {
    match finish {
        Finish::Length => "length",
        Finish::StopToken | Finish::StopSequence(_) => "stop",
    }
}

/// A token as log-probability listings name it: the character for an ASCII byte, `<0xNN>` for
/// any other byte (it is part of a character, not one), as byte-fallback vocabularies do.
fn token_piece(token: u32) -> String {
    match u8::try_from(token) {
        Ok(byte) if byte.is_ascii() => char::from(byte).to_string(),
        Ok(byte) => format!("<0x{byte:02X}>"),
        Err(_) => format!("<{token}>"),
    }
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

/// Streams tokens as the decode leg sends them, then the ending (or an `error` chunk), then
/// `[DONE]`. Tokens the router could not pass on early are taken from the answer, so the stream
/// always ends with every token of the answer, in order. A client that stops reading is cut off
/// by the server's write bound, which drops the body and so cancels the request.
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
        let mut text = TextStream::new(&reply.completion.sampling);
        let mut sent = first.clone();
        // A client that went away ends the writing, not the request.
        let _ = events
            .send(Ok(event(&reply.chunk(&first, &mut text, true))))
            .await;
        let result = loop {
            tokio::select! {
                result = &mut answer => break result,
                Some(more) = tokens.recv() => {
                    let _ = events.send(Ok(event(&reply.chunk(&more, &mut text, false)))).await;
                    sent.extend(more);
                }
                // The reader went away: the guard, dropped armed, cancels the request.
                () = events.closed() => return,
            }
        };
        guard.disarm();
        while let Ok(more) = tokens.try_recv() {
            let _ = events
                .send(Ok(event(&reply.chunk(&more, &mut text, false))))
                .await;
            sent.extend(more);
        }
        let last = match (reply.record(&result), result) {
            (None, Ok(output)) => match output.tokens.strip_prefix(sent.as_slice()) {
                Some(missing) => {
                    if !missing.is_empty() {
                        let _ = events
                            .send(Ok(event(&reply.chunk(missing, &mut text, false))))
                            .await;
                    }
                    reply.ending(&output, &mut text)
                }
                None => vec![
                    ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "server_error",
                        "streamed tokens differ from the decode leg's answer",
                    )
                    .body(),
                ],
            },
            (Some(error), _) => vec![error.body()],
            (None, Err(_)) => {
                vec![ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "no answer").body()]
            }
        };
        for chunk in last {
            let _ = events.send(Ok(event(&chunk))).await;
        }
        let _ = events
            .send(Ok(axum::body::Bytes::from_static(DONE.as_bytes())))
            .await;
    });
    let stream = futures_util::stream::unfold(body, |mut body| async move {
        body.recv().await.map(|item| (item, body))
    });
    sse_response(Body::from_stream(stream))
}
