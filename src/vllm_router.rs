//! `pdkv router` in front of vLLM legs: an OpenAI-compatible HTTP API that sends each request
//! through a prefill leg and a decode leg with vLLM's P/D request protocol, as vLLM's own P/D
//! proxies do, with pdkv's rules ([`pdkv_core::proxy`]): leg choice from each leg's load,
//! another leg when one fails, a local prefill when no prefill leg can, streams that restart
//! without repeating or skipping what the client has.
//!
//! - `POST /v1/completions`, `POST /v1/chat/completions`: the body goes to a prefill leg with
//!   `max_tokens: 1` (`max_completion_tokens` too for chat), `stream: false`, `ignore_eos`, no
//!   stop conditions, logprobs or `min_tokens` (so the one token always hands the KV off), and
//!   `kv_transfer_params: {"do_remote_decode": true}`; the answer's `kv_transfer_params` go
//!   unchanged into the client's own body, which goes to a decode leg; the decode's answer,
//!   streamed or not, is the client's. Every sampling option reaches the decode leg as sent.
//! - `GET /v1/models`; `/live`, `/ready` (a healthy prefill and decode leg), `/metrics`.
//! - Each leg's `/health` and `/metrics` are polled every `[failure] heartbeat_ms`: running and
//!   waiting requests and KV usage feed `least_loaded`; `heartbeat_misses` failed polls in a
//!   row take a leg out of the choice until it answers again.
//! - Every request is bounded by `[limits] request_timeout_ms`, its prefill stage by
//!   `[router] prefill_timeout_ms`; a client that goes away drops the legs' requests with it.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt;
use pdkv_actors::config::ROUTER_NODE;
use pdkv_actors::engines::VllmCluster;
use pdkv_actors::node::{PeerState, Readiness};
use pdkv_core::proxy::{ChunkAction, LegView, Loads, Policy, ProxyRequest, Replay, StageFailure, Step};
use pdkv_core::wire::Role;
use serde_json::{Value, json};
use tracing::Instrument;

use crate::admin::{self, AdminState, ProcessKind};
use crate::client::sample_sum;
use crate::http::{HttpLimits, HttpListener};

/// Largest request body the router reads (a long prompt as token ids fits).
pub const MAX_BODY_BYTES: usize = 8 << 20;

/// Longest a leg's `/health` or `/metrics` poll may take, at most the poll period.
const POLL_BOUND: Duration = Duration::from_secs(2);

/// Chunks a stream may hold for a client that reads slowly before the router stops reading
/// from the decode leg (which then waits: backpressure reaches vLLM).
const STREAM_BUFFER: usize = 64;

/// One vLLM leg as the router sees it.
struct Leg {
    name: String,
    url: String,
    /// Its load, from the last poll.
    polled: Mutex<Polled>,
    /// Requests this router has in flight there.
    in_flight: AtomicU32,
}

#[derive(Debug, Clone, Default)]
struct Polled {
    /// Polls failed in a row; up after the first success.
    misses: u32,
    ever_up: bool,
    reported: u32,
    kv_usage: f64,
    last_error: Option<String>,
}

impl Leg {
    fn load(&self, misses_allowed: u32) -> LegView {
        let polled = self
            .polled
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        LegView {
            healthy: polled.ever_up && polled.misses < misses_allowed,
            in_flight: self.in_flight.load(Ordering::Relaxed),
            reported: polled.reported,
            kv_usage: polled.kv_usage,
        }
    }
}

/// Counts a request in flight on a leg while it lives.
struct InFlight<'a>(&'a Leg);

impl<'a> InFlight<'a> {
    fn new(leg: &'a Leg) -> Self {
        leg.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(leg)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What the handlers share.
struct Shared {
    prefill: Vec<Leg>,
    decode: Vec<Leg>,
    client: reqwest::Client,
    model: String,
    policy: Policy,
    max_retries: u32,
    misses_allowed: u32,
    request_timeout: Duration,
    /// Longest wait for a request's body.
    body_timeout: Duration,
    prefill_timeout: Duration,
    turns: Mutex<(usize, usize)>,
    next_id: AtomicU64,
}

impl Shared {
    fn loads(&self) -> (Vec<LegView>, Vec<LegView>) {
        let of = |legs: &[Leg]| legs.iter().map(|leg| leg.load(self.misses_allowed)).collect();
        (of(&self.prefill), of(&self.decode))
    }

    /// Asks `request` for its next step with the loads of this moment.
    fn step(&self, decide: impl FnOnce(Loads<'_>) -> Step) -> Step {
        let (prefill, decode) = self.loads();
        let mut turns = self.turns.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (prefill_turn, decode_turn) = &mut *turns;
        decide(Loads {
            prefill: &prefill,
            decode: &decode,
            prefill_turn,
            decode_turn,
        })
    }

    fn readiness(&self) -> Readiness {
        let mut peers = std::collections::BTreeMap::new();
        let mut up = (false, false);
        for (role, legs) in [(Role::Prefill, &self.prefill), (Role::Decode, &self.decode)] {
            for leg in legs {
                let healthy = leg.load(self.misses_allowed).healthy;
                if healthy {
                    match role {
                        Role::Prefill => up.0 = true,
                        _ => up.1 = true,
                    }
                }
                let polled = leg.polled.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                peers.insert(
                    leg.name.clone(),
                    PeerState {
                        role,
                        linked: healthy,
                        dialed_out: healthy,
                        incarnation: None,
                        dialed_in: None,
                        last_error: polled.last_error.clone(),
                        dials: 0,
                        links: 0,
                        since_unix_s: 0,
                    },
                );
            }
        }
        let all = peers.values().all(|peer| peer.linked);
        Readiness {
            node: ROUTER_NODE.into(),
            role: Role::Router,
            ready: up.0 && up.1,
            all_peers_linked: all,
            draining: false,
            peers,
        }
    }
}

/// A vLLM leg's load from its `/metrics`: requests running plus waiting, and the share of its KV
/// cache in use.
pub fn vllm_load(text: &str) -> Result<(u32, f64), String> {
    let running =
        sample_sum(text, "vllm:num_requests_running").ok_or("/metrics has no vllm:num_requests_running")?;
    let waiting = sample_sum(text, "vllm:num_requests_waiting").unwrap_or(0.0);
    let usage = sample_sum(text, "vllm:kv_cache_usage_perc")
        .or_else(|| sample_sum(text, "vllm:gpu_cache_usage_perc"))
        .unwrap_or(0.0);
    Ok(((running + waiting).max(0.0) as u32, usage))
}

/// Polls one leg: `/health`, then `/metrics`.
async fn poll(client: &reqwest::Client, leg: &Leg, bound: Duration) {
    let result: Result<(u32, f64), String> = async {
        let health = client
            .get(format!("{}/health", leg.url))
            .timeout(bound)
            .send()
            .await
            .map_err(|error| format!("/health: {error}"))?;
        if !health.status().is_success() {
            return Err(format!("/health answered {}", health.status()));
        }
        let text = client
            .get(format!("{}/metrics", leg.url))
            .timeout(bound)
            .send()
            .await
            .map_err(|error| format!("/metrics: {error}"))?
            .text()
            .await
            .map_err(|error| format!("/metrics: {error}"))?;
        vllm_load(&text)
    }
    .await;
    let mut polled = leg.polled.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    match result {
        Ok((reported, kv_usage)) => {
            if polled.misses > 0 || !polled.ever_up {
                tracing::info!(leg = %leg.name, "leg is up");
            }
            *polled = Polled {
                misses: 0,
                ever_up: true,
                reported,
                kv_usage,
                last_error: None,
            };
        }
        Err(error) => {
            polled.misses = polled.misses.saturating_add(1);
            if polled.misses == 1 && polled.ever_up {
                tracing::warn!(leg = %leg.name, %error, "leg missed a health check");
            }
            polled.last_error = Some(error);
        }
    }
}

/// Which API a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Completions,
    Chat,
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
        }
    }
}

/// An error answer in OpenAI's shape (as vLLM answers them).
fn error_response(status: StatusCode, message: &str, kind: &str, param: Option<&str>) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "param": param, "code": status.as_u16()}});
    (status, axum::Json(body)).into_response()
}

/// A leg's own answer, passed on as it came.
fn passed_on(status: u16, body: String) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))
        .unwrap_or_else(|_| status.into_response())
}

/// The client's body checked, and the prefill body made from it.
struct Bodies {
    decode: Value,
    prefill: Value,
    stream: bool,
}

/// A request refused before any leg sees it.
#[derive(Debug)]
struct Refused {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: &'static str,
}

impl Refused {
    fn response(&self) -> Response {
        error_response(self.status, &self.message, self.kind, Some(self.param))
    }
}

fn bodies(api: Api, bytes: &[u8], model: &str) -> Result<Bodies, Refused> {
    let bad = |message: String, param: &'static str| Refused {
        status: StatusCode::BAD_REQUEST,
        message,
        kind: "BadRequestError",
        param,
    };
    let mut decode: Value =
        serde_json::from_slice(bytes).map_err(|error| bad(format!("body: not JSON ({error})"), "body"))?;
    let Some(object) = decode.as_object_mut() else {
        return Err(bad("body: must be a JSON object".into(), "body"));
    };
    if let Some(asked) = object.get("model")
        && asked.as_str() != Some(model)
    {
        return Err(Refused {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{asked}` does not exist; this router serves {model:?}"),
            kind: "NotFoundError",
            param: "model",
        });
    }
    let stream = match object.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(stream)) => *stream,
        Some(other) => return Err(bad(format!("stream: {other} is not a boolean"), "stream")),
    };
    match object.get("n") {
        None | Some(Value::Null) => {}
        Some(n) if n.as_u64() == Some(1) => {}
        Some(n) => {
            return Err(bad(
                format!("n: {n} completions asked, pdkv's router answers one"),
                "n",
            ));
        }
    }
    // The router's own parameters, never a client's.
    object.remove("kv_transfer_params");
    let mut prefill = decode.clone();
    let prefill_object = prefill.as_object_mut().expect("cloned from an object");
    for key in [
        "stream_options",
        "min_tokens",
        "stop",
        "stop_token_ids",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "echo",
        "n",
        "best_of",
    ] {
        prefill_object.remove(key);
    }
    prefill_object.insert("max_tokens".into(), 1.into());
    if api == Api::Chat {
        prefill_object.insert("max_completion_tokens".into(), 1.into());
    }
    prefill_object.insert("stream".into(), false.into());
    prefill_object.insert("ignore_eos".into(), true.into());
    prefill_object.insert("kv_transfer_params".into(), json!({"do_remote_decode": true}));
    Ok(Bodies {
        decode,
        prefill,
        stream,
    })
}

/// What one HTTP call to a leg came to, as a stage failure if it failed.
fn failure(error: reqwest::Error) -> StageFailure {
    if error.is_timeout() {
        StageFailure::TimedOut
    } else {
        StageFailure::Lost(error.to_string())
    }
}

async fn rejected_or_lost(response: reqwest::Response) -> StageFailure {
    let status = response.status().as_u16();
    let body = response.text().await.unwrap_or_default();
    if (400..500).contains(&status) {
        StageFailure::Rejected { status, body }
    } else {
        StageFailure::Lost(format!(
            "answered {status}: {}",
            body.chars().take(200).collect::<String>()
        ))
    }
}

/// The prefill stage on `leg`: its `kv_transfer_params` (`None` when it handed nothing off).
async fn prefill(
    shared: &Shared,
    api: Api,
    leg: &Leg,
    body: &Value,
    bound: Duration,
) -> Result<Option<Value>, StageFailure> {
    let _counted = InFlight::new(leg);
    let response = shared
        .client
        .post(format!("{}{}", leg.url, api.path()))
        .json(body)
        .timeout(bound)
        .send()
        .await
        .map_err(failure)?;
    if !response.status().is_success() {
        return Err(rejected_or_lost(response).await);
    }
    let answer: Value = response.json().await.map_err(failure)?;
    Ok(match answer.get("kv_transfer_params") {
        Some(params) if params.is_object() => Some(params.clone()),
        _ => None,
    })
}

/// The text a streamed chunk adds (`choices[0].text`, or `delta.content` for chat).
fn chunk_content(chunk: &Value) -> Option<String> {
    let choice = chunk.get("choices")?.get(0)?;
    let text = choice
        .get("text")
        .or_else(|| choice.get("delta")?.get("content"))?
        .as_str()?;
    (!text.is_empty()).then(|| text.to_string())
}

/// One request's drive through the legs.
struct Drive {
    shared: Arc<Shared>,
    api: Api,
    bodies: Bodies,
    request: ProxyRequest,
    deadline: Instant,
    started: Instant,
    params: Option<Value>,
}

/// What the stream writer sends the handler: bytes for the client, or the failure that ended
/// the request before any byte.
enum Out {
    Bytes(Bytes),
    Failed(Response),
}

impl Drive {
    fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// Sends the decode request to `target`, bounded by the request's deadline.
    async fn send_decode(
        &self,
        target: &Leg,
        with_params: bool,
    ) -> Result<reqwest::Response, reqwest::Error> {
        self.shared
            .client
            .post(format!("{}{}", target.url, self.api.path()))
            .json(&self.decode_body(with_params))
            .timeout(self.remaining())
            .send()
            .await
    }

    fn decode_body(&self, with_params: bool) -> Value {
        let mut body = self.bodies.decode.clone();
        if with_params && let Some(params) = &self.params {
            body["kv_transfer_params"] = params.clone();
        }
        body
    }

    /// Runs prefill stages until a decode step (or failure).
    async fn prefill_until_decode(&mut self, mut step: Step) -> Result<(usize, bool), Response> {
        loop {
            match step {
                Step::Prefill { leg } => {
                    let bound = self.shared.prefill_timeout.min(self.remaining());
                    let shared = self.shared.clone();
                    let result = prefill(
                        &shared,
                        self.api,
                        &shared.prefill[leg],
                        &self.bodies.prefill,
                        bound,
                    )
                    .await;
                    metrics::histogram!("pdkv_request_seconds", "stage" => "prefill")
                        .record(self.started.elapsed().as_secs_f64());
                    step = match result {
                        Ok(Some(params)) => {
                            self.params = Some(params);
                            self.shared.step(|loads| self.request.prefilled(loads))
                        }
                        Ok(None) => {
                            self.params = None;
                            self.shared
                                .step(|loads| self.request.prefilled_without_params(loads))
                        }
                        Err(failure) => {
                            tracing::warn!(leg = %shared.prefill[leg].name, ?failure, "prefill failed");
                            self.shared
                                .step(|loads| self.request.prefill_failed(failure, loads))
                        }
                    };
                }
                Step::Decode { leg, with_params } => return Ok((leg, with_params)),
                Step::Fail {
                    stage,
                    reason,
                    rejected,
                } => return Err(self.fail(stage, &reason, rejected)),
            }
        }
    }

    fn fail(&self, stage: &str, reason: &str, rejected: Option<(u16, String)>) -> Response {
        metrics::counter!("pdkv_requests_total", "outcome" => if rejected.is_some() { "bad_request" } else { "error" })
            .increment(1);
        if let Some((status, body)) = rejected {
            return passed_on(status, body);
        }
        if self.remaining().is_zero() {
            return error_response(
                StatusCode::GATEWAY_TIMEOUT,
                &format!(
                    "{stage}: no answer within {} ms",
                    self.shared.request_timeout.as_millis()
                ),
                "timeout_error",
                None,
            );
        }
        error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &format!("{stage} failed: {reason}"),
            "unavailable_error",
            None,
        )
    }

    fn succeeded(&self) {
        metrics::counter!("pdkv_requests_total", "outcome" => "ok").increment(1);
        metrics::histogram!("pdkv_request_seconds", "stage" => "total")
            .record(self.started.elapsed().as_secs_f64());
        let retries = self.request.retries();
        if retries > 0 {
            metrics::counter!("pdkv_retries_total").increment(u64::from(retries));
        }
    }

    /// A whole (unstreamed) answer.
    async fn whole(mut self) -> Response {
        let mut step = self.shared.step(|loads| self.request.start(loads));
        loop {
            let (leg, with_params) = match self.prefill_until_decode(step).await {
                Ok(decode) => decode,
                Err(response) => return response,
            };
            let shared = self.shared.clone();
            let target = &shared.decode[leg];
            let sent = {
                let _counted = InFlight::new(target);
                match self.send_decode(target, with_params).await {
                    Ok(response) if response.status().is_success() => {
                        let status = response.status().as_u16();
                        response
                            .bytes()
                            .await
                            .map(|bytes| (status, bytes))
                            .map_err(failure)
                    }
                    Ok(response) => Err(rejected_or_lost(response).await),
                    Err(error) => Err(failure(error)),
                }
            };
            match sent {
                Ok((status, bytes)) => {
                    self.request.finished();
                    self.succeeded();
                    return Response::builder()
                        .status(status)
                        .header(header::CONTENT_TYPE, "application/json")
                        .body(Body::from(bytes))
                        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
                }
                Err(failure) => {
                    tracing::warn!(leg = %target.name, ?failure, "decode failed");
                    step = self
                        .shared
                        .step(|loads| self.request.decode_failed(failure, false, loads));
                }
            }
        }
    }

    /// A streamed answer: writes the client's events into `out` until the end, restarting on
    /// other legs as the rules say.
    async fn stream(mut self, out: tokio::sync::mpsc::Sender<Out>) {
        let mut replay = Replay::default();
        let mut client_has_bytes = false;
        let mut step = self.shared.step(|loads| self.request.start(loads));
        loop {
            let (leg, with_params) = match self.prefill_until_decode(step).await {
                Ok(decode) => decode,
                Err(response) => {
                    if client_has_bytes {
                        let _ = out
                            .send(Out::Bytes(error_event(&response_message(response).await)))
                            .await;
                        let _ = out
                            .send(Out::Bytes(Bytes::from_static(b"data: [DONE]\n\n")))
                            .await;
                    } else {
                        let _ = out.send(Out::Failed(response)).await;
                    }
                    return;
                }
            };
            replay.restart();
            let shared = self.shared.clone();
            let target = &shared.decode[leg];
            let _counted = InFlight::new(target);
            let response = match self.send_decode(target, with_params).await {
                Ok(response) if response.status().is_success() => response,
                Ok(response) => {
                    let failure = rejected_or_lost(response).await;
                    step = self
                        .shared
                        .step(|loads| self.request.decode_failed(failure, client_has_bytes, loads));
                    continue;
                }
                Err(error) => {
                    step = self.shared.step(|loads| {
                        self.request
                            .decode_failed(failure(error), client_has_bytes, loads)
                    });
                    continue;
                }
            };
            let mut body = response.bytes_stream();
            let mut pending: Vec<u8> = Vec::new();
            let ended = loop {
                let next = tokio::select! {
                    next = body.next() => next,
                    () = out.closed() => return, // the client went away: dropping `body` aborts the leg's request
                };
                match next {
                    Some(Ok(bytes)) => {
                        pending.extend_from_slice(&bytes);
                        let mut verdict = None;
                        while let Some(end) = find_event_end(&pending) {
                            let event: Vec<u8> = pending.drain(..end).collect();
                            match classify(&event) {
                                Event::Done => {
                                    verdict = Some(Ok(()));
                                    break;
                                }
                                Event::Error(message) => {
                                    verdict = Some(Err(StageFailure::Lost(message)));
                                    break;
                                }
                                Event::Chunk(content) => match replay.chunk(content.as_deref()) {
                                    ChunkAction::Forward => {
                                        client_has_bytes = true;
                                        if out.send(Out::Bytes(Bytes::from(event))).await.is_err() {
                                            return;
                                        }
                                    }
                                    ChunkAction::Skip => {}
                                    ChunkAction::Diverged => {
                                        metrics::counter!("pdkv_requests_total", "outcome" => "error")
                                            .increment(1);
                                        let _ = out
                                            .send(Out::Bytes(error_event(
                                                "the request was started over on another leg after a failure and its output differs from what was streamed (an unseeded sample?): stream ended",
                                            )))
                                            .await;
                                        let _ = out
                                            .send(Out::Bytes(Bytes::from_static(b"data: [DONE]\n\n")))
                                            .await;
                                        return;
                                    }
                                },
                                Event::Other => {}
                            }
                        }
                        if let Some(verdict) = verdict {
                            break verdict;
                        }
                    }
                    Some(Err(error)) => break Err(failure(error)),
                    None => break Err(StageFailure::Lost("the stream ended without [DONE]".into())),
                }
            };
            match ended {
                Ok(()) => {
                    self.request.finished();
                    self.succeeded();
                    let _ = out
                        .send(Out::Bytes(Bytes::from_static(b"data: [DONE]\n\n")))
                        .await;
                    return;
                }
                Err(failure) => {
                    tracing::warn!(leg = %target.name, ?failure, "decode stream failed");
                    step = self
                        .shared
                        .step(|loads| self.request.decode_failed(failure, client_has_bytes, loads));
                }
            }
        }
    }
}

/// The message of an error response built here.
async fn response_message(response: Response) -> String {
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 16)
        .await
        .unwrap_or_default();
    serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|body| body["error"]["message"].as_str().map(String::from))
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned())
}

fn error_event(message: &str) -> Bytes {
    let body = json!({"error": {"message": message, "type": "server_error", "code": 503}});
    Bytes::from(format!("data: {body}\n\n"))
}

/// Where the first server-sent event in `bytes` ends (after its blank line).
fn find_event_end(bytes: &[u8]) -> Option<usize> {
    let lf = bytes
        .windows(2)
        .position(|window| window == b"\n\n")
        .map(|at| at + 2);
    let crlf = bytes
        .windows(4)
        .position(|window| window == b"\r\n\r\n")
        .map(|at| at + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

enum Event {
    Chunk(Option<String>),
    Done,
    Error(String),
    Other,
}

fn classify(event: &[u8]) -> Event {
    let text = String::from_utf8_lossy(event);
    let data: String = text
        .lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .map(str::trim_start)
        .collect::<Vec<_>>()
        .join("\n");
    if data.is_empty() {
        return Event::Other;
    }
    if data.trim() == "[DONE]" {
        return Event::Done;
    }
    match serde_json::from_str::<Value>(&data) {
        Ok(value) if value.get("error").is_some() => Event::Error(
            value["error"]["message"]
                .as_str()
                .unwrap_or("the decode leg sent an error")
                .to_string(),
        ),
        Ok(value) => Event::Chunk(chunk_content(&value)),
        Err(_) => Event::Other,
    }
}

async fn serve(State(shared): State<Arc<Shared>>, api: Api, body: Body) -> Response {
    let request_id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    // The span goes with the future, never entered across an await.
    let span = tracing::info_span!("completion", request_id);
    serve_in_span(shared, api, body).instrument(span).await
}

async fn serve_in_span(shared: Arc<Shared>, api: Api, body: Body) -> Response {
    let started = Instant::now();
    let bytes = match crate::http::read_body(body, MAX_BODY_BYTES, shared.body_timeout).await {
        Ok(bytes) => bytes,
        Err(error) => {
            let status = error.status();
            metrics::counter!("pdkv_requests_total", "outcome" => "bad_request").increment(1);
            return error_response(status, &error.to_string(), "BadRequestError", Some("body"));
        }
    };
    let bodies = match bodies(api, &bytes, &shared.model) {
        Ok(bodies) => bodies,
        Err(refused) => {
            metrics::counter!("pdkv_requests_total", "outcome" => "bad_request").increment(1);
            return refused.response();
        }
    };
    let stream = bodies.stream;
    let drive = Drive {
        request: ProxyRequest::new(shared.policy, shared.max_retries),
        deadline: started + shared.request_timeout,
        shared,
        api,
        bodies,
        started,
        params: None,
    };
    if !stream {
        return drive.whole().await;
    }
    let (out, mut events) = tokio::sync::mpsc::channel::<Out>(STREAM_BUFFER);
    tokio::spawn(drive.stream(out).in_current_span());
    match events.recv().await {
        Some(Out::Failed(response)) => response,
        Some(Out::Bytes(first)) => {
            let rest = futures_util::stream::unfold(events, |mut events| async move {
                match events.recv().await {
                    Some(Out::Bytes(bytes)) => Some((Ok::<Bytes, std::convert::Infallible>(bytes), events)),
                    _ => None,
                }
            });
            let stream = futures_util::stream::once(async move { Ok(first) }).chain(rest);
            Response::builder()
                .header(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/event-stream"),
                )
                .header(header::CACHE_CONTROL, "no-cache")
                .body(Body::from_stream(stream))
                .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
        }
        None => error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the request ended without an answer",
            "server_error",
            None,
        ),
    }
}

async fn completions(state: State<Arc<Shared>>, body: Body) -> Response {
    serve(state, Api::Completions, body).await
}

async fn chat(state: State<Arc<Shared>>, body: Body) -> Response {
    serve(state, Api::Chat, body).await
}

async fn models(State(shared): State<Arc<Shared>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{"id": shared.model, "object": "model", "owned_by": "pdkv", "created": 0}],
    }))
    .into_response()
}

/// The router's routes over `shared`.
fn routes(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .with_state(shared)
}

/// Runs `pdkv router` for a cluster of vLLM legs until SIGTERM / SIGINT.
pub fn run(cluster: VllmCluster) -> anyhow::Result<std::process::ExitCode> {
    if cluster.router.http_port == 0 {
        anyhow::bail!(
            "[router] http_port is 0; the router of its own needs a fixed port (`pdkv launch` picks one)"
        );
    }
    let bind = pdkv_actors::node::resolve(cluster.router.bind_host(), cluster.router.http_port)
        .map_err(anyhow::Error::msg)?;
    let listener = HttpListener::bind(bind, "router")?;
    let metrics = admin::install_metrics(ProcessKind::Router)?;
    let limits = HttpLimits::new(&cluster.http, crate::http::raise_file_limit());
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_millis(cluster.failure.heartbeat_ms.max(1000)))
        .pool_idle_timeout(Duration::from_secs(30))
        .build()
        .context("cannot build the HTTP client")?;
    let legs_of = |role: Role| -> Vec<Leg> {
        cluster
            .nodes
            .iter()
            .filter(|node| node.role == role)
            .map(|node| Leg {
                name: node.name.0.clone(),
                url: node.http_url(),
                polled: Mutex::new(Polled::default()),
                in_flight: AtomicU32::new(0),
            })
            .collect()
    };
    let request_timeout = Duration::from_millis(cluster.limits.request_timeout_ms);
    let shared = Arc::new(Shared {
        prefill: legs_of(Role::Prefill),
        decode: legs_of(Role::Decode),
        client,
        model: cluster.engine.served_model_name.clone(),
        policy: cluster.router.selection,
        max_retries: cluster.failure.max_retries,
        misses_allowed: cluster.failure.heartbeat_misses,
        request_timeout,
        body_timeout: limits.body_timeout,
        prefill_timeout: Duration::from_millis(cluster.router.prefill_timeout_ms).min(request_timeout),
        turns: Mutex::new((0, 0)),
        next_id: AtomicU64::new(1),
    });
    let ready = shared.clone();
    let admin_state = AdminState {
        readiness: Arc::new(move || ready.readiness()),
        metrics,
        refresh: None,
    };
    let app = crate::openai::with_json_errors(routes(shared.clone()).merge(admin::routes(admin_state)));
    let period = Duration::from_millis(cluster.failure.heartbeat_ms);
    let poller = shared.clone();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the router's runtime")?;
    let http = match cluster.router.http_threads {
        0 => {
            let _entered = runtime.enter();
            listener.serve_here(app, limits)?
        }
        threads => listener.serve(app, threads, limits)?,
    };
    runtime.block_on(async move {
        let polls = tokio::spawn(async move {
            let bound = POLL_BOUND.min(period.max(Duration::from_millis(100)));
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let legs = poller.prefill.iter().chain(&poller.decode);
                futures_util::future::join_all(legs.map(|leg| poll(&poller.client, leg, bound))).await;
                for leg in poller.prefill.iter().chain(&poller.decode) {
                    let up = leg.load(poller.misses_allowed).healthy;
                    metrics::gauge!("pdkv_peer_up", "peer" => leg.name.clone()).set(if up {
                        1.0
                    } else {
                        0.0
                    });
                }
            }
        });
        crate::outln!(
            "READY node={ROUTER_NODE} role=router engine=vllm http=http://{}",
            http.local_addr()
        );
        crate::node_cmd::wait_for_shutdown_signal().await?;
        polls.abort();
        drop(http);
        anyhow::Ok(std::process::ExitCode::SUCCESS)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vllm_legs_load_is_read_from_its_metrics() {
        let text = "# HELP vllm:num_requests_running Number of requests.\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\",model_name=\"tiny\"} 3.0\nvllm:num_requests_running{engine=\"1\",model_name=\"tiny\"} 1.0\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine=\"0\",model_name=\"tiny\"} 2.0\n# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine=\"0\",model_name=\"tiny\"} 0.25\n";
        assert_eq!(vllm_load(text), Ok((6, 0.25)));
        assert!(
            vllm_load("# nothing\n")
                .unwrap_err()
                .contains("vllm:num_requests_running")
        );
    }

    #[test]
    fn the_prefill_body_asks_one_token_that_always_hands_off_and_the_decode_body_is_the_clients() {
        let client = br#"{"model": "tiny", "prompt": "hi", "max_tokens": 9, "stream": true,
            "stream_options": {"include_usage": true}, "stop": ["x"], "min_tokens": 3, "logprobs": 2,
            "temperature": 0.7, "seed": 5, "kv_transfer_params": {"forged": 1}}"#;
        let bodies = bodies(Api::Completions, client, "tiny").unwrap_or_else(|_| panic!("valid"));
        assert!(bodies.stream);
        let decode = &bodies.decode;
        assert_eq!(decode["max_tokens"], 9);
        assert_eq!(decode["stop"], json!(["x"]));
        assert_eq!(
            (decode["temperature"].clone(), decode["seed"].clone()),
            (json!(0.7), json!(5))
        );
        assert!(
            decode.get("kv_transfer_params").is_none(),
            "a client's params never go to a leg"
        );
        let prefill = &bodies.prefill;
        assert_eq!(prefill["max_tokens"], 1);
        assert_eq!(prefill["stream"], false);
        assert_eq!(prefill["ignore_eos"], true);
        assert_eq!(prefill["kv_transfer_params"], json!({"do_remote_decode": true}));
        for gone in ["stop", "min_tokens", "logprobs", "stream_options"] {
            assert!(prefill.get(gone).is_none(), "{gone}");
        }
        assert_eq!(prefill["temperature"], json!(0.7));
        let chat = bodies_of(
            Api::Chat,
            br#"{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5}"#,
        );
        assert_eq!(
            (
                chat.prefill["max_tokens"].clone(),
                chat.prefill["max_completion_tokens"].clone()
            ),
            (json!(1), json!(1))
        );
        assert_eq!(chat.decode["max_completion_tokens"], 5);
    }

    fn bodies_of(api: Api, body: &[u8]) -> Bodies {
        bodies(api, body, "tiny").unwrap_or_else(|_| panic!("valid"))
    }

    #[test]
    fn bad_bodies_are_refused_by_field() {
        let status = |body: &[u8]| {
            bodies(Api::Completions, body, "tiny")
                .err()
                .map(|refused| refused.status.as_u16())
        };
        assert_eq!(status(b"not json"), Some(400));
        assert_eq!(status(b"[1, 2]"), Some(400));
        assert_eq!(status(br#"{"prompt": "x", "stream": "yes"}"#), Some(400));
        assert_eq!(status(br#"{"prompt": "x", "n": 2}"#), Some(400));
        assert_eq!(status(br#"{"prompt": "x", "model": "other"}"#), Some(404));
        assert_eq!(status(br#"{"prompt": "x", "n": 1}"#), None);
    }

    #[test]
    fn server_sent_events_are_split_and_read() {
        let stream = b"data: {\"choices\": [{\"text\": \"a\"}]}\n\ndata: {\"choices\": [{\"delta\": {\"role\": \"assistant\"}}]}\r\n\r\ndata: [DONE]\n\n";
        let first = find_event_end(stream).unwrap();
        assert!(matches!(classify(&stream[..first]), Event::Chunk(Some(text)) if text == "a"));
        let rest = &stream[first..];
        let second = find_event_end(rest).unwrap();
        assert!(matches!(classify(&rest[..second]), Event::Chunk(None)));
        assert!(matches!(classify(&rest[second..]), Event::Done));
        assert!(
            matches!(classify(b"data: {\"error\": {\"message\": \"boom\"}}\n\n"), Event::Error(message) if message == "boom")
        );
        assert_eq!(find_event_end(b"data: {\"partial"), None);
    }
}
