//! The HTTP side of `tessera serve`: the routes, the handlers of the two generation endpoints
//! (checking the request, its prompt and its lengths, admitting it to the bounded queue, then
//! answering at once or streaming server-sent events), and the OpenAI response shapes.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::api::{self, ApiError, GenRequest, Prompt};
use super::chat::ChatTemplate;
use super::metrics::Metrics;
use super::worker::{Job, Out};
use crate::data::Codec;

/// Request limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Requests accepted and not finished, at most; more are answered 429.
    pub max_queue: usize,
    pub max_prompt_tokens: usize,
    /// `max_tokens` at most.
    pub max_tokens: usize,
    pub max_body_bytes: usize,
}

/// What every handler shares.
pub struct AppState {
    pub model_name: String,
    pub codec: Arc<Codec>,
    pub bos: Option<u32>,
    pub chat: Option<ChatTemplate>,
    /// To the engine's thread; taken at shutdown.
    pub jobs: Mutex<Option<std::sync::mpsc::Sender<Job>>>,
    pub limits: Limits,
    pub metrics: Arc<Metrics>,
    /// The model's context (prompt and output).
    pub max_seq_len: usize,
    pub vocab_size: usize,
    pub in_flight: AtomicUsize,
    /// Set on SIGTERM: new requests are answered 503.
    pub draining: AtomicBool,
    /// Set by the engine's thread when the backend is lost (a pipeline rank died): why. Every
    /// request from then on is answered 503, and `/health` too.
    pub lost: Arc<OnceLock<String>>,
    pub next_id: AtomicU64,
    /// Seeds of requests without one: this and the request's number.
    pub seed_base: u64,
    pub created: u64,
}

pub fn router(state: Arc<AppState>) -> Router {
    let body_limit = state.limits.max_body_bytes;
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

fn error_response(s: &AppState, endpoint: &'static str, e: ApiError) -> Response {
    s.metrics.http_response(endpoint, e.status);
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, Json(e.body())).into_response()
}

async fn not_found(uri: axum::http::Uri) -> Response {
    let e = ApiError::new(
        404,
        "invalid_request_error",
        Some("not_found"),
        format!("no route {}: this server answers /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics", uri.path()),
    );
    (StatusCode::NOT_FOUND, Json(e.body())).into_response()
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
    if s.draining.load(Ordering::Relaxed) {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "draining"}))).into_response();
    }
    if let Some(why) = s.lost.get() {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "unavailable", "reason": why}))).into_response();
    }
    Json(json!({"status": "ok"})).into_response()
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    s.metrics.in_flight.set(s.in_flight.load(Ordering::Relaxed) as u64);
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], s.metrics.render()).into_response()
}

fn model_card(s: &AppState) -> Value {
    json!({"id": s.model_name, "object": "model", "created": s.created, "owned_by": "tessera", "max_model_len": s.max_seq_len})
}

async fn models(State(s): State<Arc<AppState>>) -> Response {
    s.metrics.http_response("models", 200);
    Json(json!({"object": "list", "data": [model_card(&s)]})).into_response()
}

async fn model(State(s): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if id != s.model_name {
        return error_response(&s, "models", unknown_model(&s, &id));
    }
    s.metrics.http_response("models", 200);
    Json(model_card(&s)).into_response()
}

fn unknown_model(s: &AppState, name: &str) -> ApiError {
    ApiError::new(
        404,
        "invalid_request_error",
        Some("model_not_found"),
        format!("the model `{name}` does not exist: this server serves `{}` (GET /v1/models)", s.model_name),
    )
}

/// Which endpoint a generation request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Completion,
    Chat,
}

impl Endpoint {
    fn name(self) -> &'static str {
        match self {
            Endpoint::Completion => "completions",
            Endpoint::Chat => "chat_completions",
        }
    }
}

async fn completions(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    generate(s, body, Endpoint::Completion).await
}

async fn chat_completions(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    generate(s, body, Endpoint::Chat).await
}

/// Counts a request in flight until dropped (the response finished, or the client went away).
struct InFlight(Arc<AppState>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn generate(s: Arc<AppState>, body: Result<Bytes, BytesRejection>, ep: Endpoint) -> Response {
    match start(&s, body, ep) {
        Err(e) => error_response(&s, ep.name(), e),
        Ok((req, rx, guard)) => {
            let fmt = Format { ep, id: req_id(&s, ep), created: now(), model: s.model_name.clone() };
            s.metrics.http_response(ep.name(), 200);
            if req.stream {
                stream_response(fmt, rx, guard, req.include_usage)
            } else {
                whole_response(&s, fmt, rx, guard).await
            }
        }
    }
}

fn req_id(s: &AppState, ep: Endpoint) -> String {
    let n = s.next_id.fetch_add(1, Ordering::Relaxed);
    match ep {
        Endpoint::Completion => format!("cmpl-{n}"),
        Endpoint::Chat => format!("chatcmpl-{n}"),
    }
}

fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Checks a request and hands it to the engine.
fn start(
    s: &Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    ep: Endpoint,
) -> Result<(GenRequest, UnboundedReceiver<Out>, InFlight), ApiError> {
    if s.draining.load(Ordering::Relaxed) {
        return Err(ApiError::new(503, "server_error", Some("shutting_down"), "the server is shutting down"));
    }
    if let Some(why) = s.lost.get() {
        return Err(lost(why));
    }
    let body = body.map_err(|e| match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
            413,
            "invalid_request_error",
            Some("body_too_large"),
            format!("the request body is larger than {} bytes (--max-body-bytes)", s.limits.max_body_bytes),
        ),
        _ => ApiError::invalid(None, format!("could not read the request body: {e}")),
    })?;
    let map = api::parse_body(&body)?;
    let req = match ep {
        Endpoint::Completion => api::completion(map)?,
        Endpoint::Chat => api::chat(map)?,
    };
    if req.model != s.model_name {
        return Err(unknown_model(s, &req.model));
    }
    let prompt = prompt_tokens(s, &req.prompt)?;
    let max_tokens = check_lengths(s, &req, prompt.len(), ep)?;
    let n = s.in_flight.fetch_add(1, Ordering::Relaxed);
    let guard = InFlight(s.clone());
    if n >= s.limits.max_queue {
        return Err(ApiError::new(
            429,
            "rate_limit_error",
            Some("queue_full"),
            format!("the server is at capacity ({} requests in flight, --max-queue); retry later", s.limits.max_queue),
        ));
    }
    let mut sampling = req.sampling;
    sampling.seed = req.seed.unwrap_or_else(|| s.seed_base ^ s.next_id.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let (tx, rx) = unbounded_channel();
    let job = Job { prompt, max_tokens, sampling, stop: req.stop.clone(), ignore_eos: req.ignore_eos, tx };
    let sent = s.jobs.lock().expect("jobs lock").as_ref().map(|j| j.send(job).is_ok());
    if sent != Some(true) {
        return Err(ApiError::new(503, "server_error", Some("shutting_down"), "the server is shutting down"));
    }
    Ok((req, rx, guard))
}

/// The answer of a server whose backend is lost: 503, with why.
fn lost(why: &str) -> ApiError {
    ApiError::new(503, "server_error", Some("backend_lost"), format!("the server cannot run the model any more: {why}"))
}

fn prompt_tokens(s: &AppState, p: &Prompt) -> Result<Vec<u32>, ApiError> {
    let encode = |text: &str, param: &str| {
        s.codec.encode(text).map_err(|e| ApiError::invalid(Some(param), format!("the prompt does not tokenize: {e}")))
    };
    let tokens = match p {
        Prompt::Text(t) => s.bos.into_iter().chain(encode(t, "prompt")?).collect(),
        Prompt::Tokens(t) => {
            if let Some(bad) = t.iter().find(|&&x| x as usize >= s.vocab_size) {
                return Err(ApiError::invalid(
                    Some("prompt"),
                    format!("token id {bad} is outside the model's vocabulary of {}", s.vocab_size),
                ));
            }
            t.clone()
        }
        Prompt::Chat(m) => {
            let Some(c) = &s.chat else {
                return Err(ApiError::invalid(
                    Some("messages"),
                    "the model has no chat template (tokenizer_config.json `chat_template`, chat_template.jinja): use /v1/completions",
                ));
            };
            let text = c.render(m).map_err(|e| ApiError::invalid(Some("messages"), format!("{e:#}")))?;
            encode(&text, "messages")?
        }
    };
    let param = if matches!(p, Prompt::Chat(_)) { "messages" } else { "prompt" };
    if tokens.is_empty() {
        return Err(ApiError::invalid(Some(param), "the prompt is empty"));
    }
    Ok(tokens)
}

/// `max_tokens` for the request: given, or the endpoint's default (16 for completions, the rest
/// of the context for chat), within the server's limit and the model's context.
fn check_lengths(s: &AppState, req: &GenRequest, prompt: usize, ep: Endpoint) -> Result<usize, ApiError> {
    let room = s.max_seq_len.saturating_sub(prompt);
    let context_error = |m: usize| {
        let mut e = ApiError::invalid(
            Some(if ep == Endpoint::Chat { "messages" } else { "prompt" }),
            format!(
                "this model's maximum context length is {} tokens; the request needs {} ({prompt} in the prompt, {m} for the completion)",
                s.max_seq_len,
                prompt + m
            ),
        );
        e.code = Some("context_length_exceeded");
        e
    };
    if room == 0 {
        return Err(context_error(1));
    }
    if prompt > s.limits.max_prompt_tokens {
        let param = if ep == Endpoint::Chat { "messages" } else { "prompt" };
        return Err(ApiError::invalid(
            Some(param),
            format!("the prompt is {prompt} tokens; this server takes at most {} (--max-prompt-tokens)", s.limits.max_prompt_tokens),
        ));
    }
    match req.max_tokens {
        Some(m) if m > s.limits.max_tokens => Err(ApiError::invalid(
            Some("max_tokens"),
            format!("`max_tokens` = {m}: this server allows at most {} (--max-tokens)", s.limits.max_tokens),
        )),
        Some(m) if m > room => Err(context_error(m)),
        Some(m) => Ok(m),
        None if ep == Endpoint::Completion => Ok(16.min(room).min(s.limits.max_tokens)),
        None => Ok(room.min(s.limits.max_tokens)),
    }
}

/// The shape of one endpoint's answers.
struct Format {
    ep: Endpoint,
    id: String,
    created: u64,
    model: String,
}

impl Format {
    fn usage(prompt: usize, completion: usize) -> Value {
        json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
    }

    fn whole(&self, text: String, finish: &str, usage: Value) -> Value {
        match self.ep {
            Endpoint::Completion => json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": null}], "usage": usage}),
            Endpoint::Chat => json!({"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": null}], "usage": usage}),
        }
    }

    /// A streamed chunk: `text` (chat: `delta`), its finish reason.
    fn chunk(&self, delta: Value, finish: Option<&str>) -> Value {
        match self.ep {
            Endpoint::Completion => json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": delta, "finish_reason": finish, "logprobs": null}]}),
            Endpoint::Chat => json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": null}]}),
        }
    }

    fn text_chunk(&self, text: String, finish: Option<&str>) -> Value {
        match self.ep {
            Endpoint::Completion => self.chunk(Value::String(text), finish),
            Endpoint::Chat if text.is_empty() && finish.is_some() => self.chunk(json!({}), finish),
            Endpoint::Chat => self.chunk(json!({"content": text}), finish),
        }
    }

    fn usage_chunk(&self, usage: Value) -> Value {
        let object = if self.ep == Endpoint::Chat { "chat.completion.chunk" } else { "text_completion" };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [], "usage": usage})
    }
}

async fn whole_response(s: &AppState, fmt: Format, mut rx: UnboundedReceiver<Out>, guard: InFlight) -> Response {
    let mut text = String::new();
    while let Some(out) = rx.recv().await {
        match out {
            Out::Text(t) => text.push_str(&t),
            Out::Done { finish, prompt_tokens, completion_tokens } => {
                drop(guard);
                return Json(fmt.whole(text, finish.as_str(), Format::usage(prompt_tokens, completion_tokens))).into_response();
            }
            Out::Failed(m) => return error_response(s, fmt.ep.name(), ApiError::new(500, "server_error", None, m)),
            Out::Lost(m) => return error_response(s, fmt.ep.name(), lost(&m)),
        }
    }
    error_response(s, fmt.ep.name(), ApiError::new(500, "server_error", None, "the engine stopped before the answer was complete"))
}

fn stream_response(fmt: Format, rx: UnboundedReceiver<Out>, guard: InFlight, include_usage: bool) -> Response {
    let mut pending = VecDeque::new();
    if fmt.ep == Endpoint::Chat {
        pending.push_back(data(&fmt.chunk(json!({"role": "assistant", "content": ""}), None)));
    }
    let body = SseBody { rx, fmt, pending, done: false, include_usage, _guard: guard };
    Sse::new(body).keep_alive(KeepAlive::default()).into_response()
}

fn data(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

/// The event stream of one streamed answer; dropping it (the client went away) closes the
/// job's channel, which cancels the job.
struct SseBody {
    rx: UnboundedReceiver<Out>,
    fmt: Format,
    pending: VecDeque<Event>,
    done: bool,
    include_usage: bool,
    _guard: InFlight,
}

impl futures_core::Stream for SseBody {
    type Item = Result<Event, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(e) = this.pending.pop_front() {
                return Poll::Ready(Some(Ok(e)));
            }
            if this.done {
                return Poll::Ready(None);
            }
            let out = match this.rx.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(o) => o,
            };
            match out {
                Some(Out::Text(t)) => this.pending.push_back(data(&this.fmt.text_chunk(t, None))),
                Some(Out::Done { finish, prompt_tokens, completion_tokens }) => {
                    this.pending.push_back(data(&this.fmt.text_chunk(String::new(), Some(finish.as_str()))));
                    if this.include_usage {
                        this.pending.push_back(data(&this.fmt.usage_chunk(Format::usage(prompt_tokens, completion_tokens))));
                    }
                    this.pending.push_back(Event::default().data("[DONE]"));
                    this.done = true;
                }
                Some(Out::Failed(m)) => {
                    this.pending.push_back(data(&ApiError::new(500, "server_error", None, m).body()));
                    this.done = true;
                }
                Some(Out::Lost(m)) => {
                    this.pending.push_back(data(&lost(&m).body()));
                    this.done = true;
                }
                None => {
                    let e = ApiError::new(500, "server_error", None, "the engine stopped before the answer was complete");
                    this.pending.push_back(data(&e.body()));
                    this.done = true;
                }
            }
        }
    }
}
