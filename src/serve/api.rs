//! The OpenAI API's request bodies (`/v1/completions`, `/v1/chat/completions`) read into
//! [`GenRequest`], every key checked: a wrong type or value is refused naming the key, a key we
//! cannot honour (`n` > 1, `logprobs`, `echo`, penalties other than 0, ...) is refused by name,
//! an unknown key is refused; and the API's error body.

use serde_json::{json, Map, Value};

use super::chat::Message;
use crate::infer::SamplingParams;

/// An API error: the HTTP status and the OpenAI error object.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> ApiError {
        ApiError { status: 400, message: message.into(), kind: "invalid_request_error", param: param.map(str::to_string), code: None }
    }

    pub fn new(status: u16, kind: &'static str, code: Option<&'static str>, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), kind, param: None, code }
    }

    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

/// The prompt of a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Chat(Vec<Message>),
}

/// A generation request, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    pub model: String,
    pub prompt: Prompt,
    /// `None`: the endpoint's default.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    /// `None`: a fresh seed.
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Generate to `max_tokens` even past the end-of-sequence token (benchmarks; vLLM's key).
    pub ignore_eos: bool,
}

/// Keys that describe the caller and change nothing of the answer.
const METADATA_KEYS: &[&str] = &["user", "metadata", "store", "service_tier"];

/// The keys of a JSON object, taken one by one with their types checked.
struct Fields(Map<String, Value>);

impl Fields {
    fn take(&mut self, key: &str) -> Option<Value> {
        self.0.remove(key).filter(|v| !v.is_null())
    }

    fn number(&mut self, key: &str, default: f64, expected: &str) -> Result<f64, ApiError> {
        match self.take(key) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| ApiError::invalid(Some(key), format!("`{key}` = {v}: expected {expected}"))),
        }
    }

    fn integer(&mut self, key: &str, expected: &str) -> Result<Option<i64>, ApiError> {
        match self.take(key) {
            None => Ok(None),
            Some(v) => match v.as_i64() {
                Some(n) => Ok(Some(n)),
                None => Err(ApiError::invalid(Some(key), format!("`{key}` = {v}: expected {expected}"))),
            },
        }
    }

    fn bool(&mut self, key: &str) -> Result<bool, ApiError> {
        match self.take(key) {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(b),
            Some(v) => Err(ApiError::invalid(Some(key), format!("`{key}` = {v}: expected true or false"))),
        }
    }

    /// Refuses `key` unless absent or `allowed(value)`.
    fn refuse_unless(&mut self, key: &str, allowed: impl Fn(&Value) -> bool, why: &str) -> Result<(), ApiError> {
        match self.take(key) {
            Some(v) if !allowed(&v) => Err(ApiError::invalid(Some(key), format!("`{key}` = {v}: not supported by this server ({why})"))),
            _ => Ok(()),
        }
    }

    /// Refuses every key left.
    fn finish(mut self) -> Result<(), ApiError> {
        for k in METADATA_KEYS {
            self.0.remove(*k);
        }
        match self.0.keys().next() {
            Some(k) => Err(ApiError::invalid(Some(k), format!("unknown key `{k}`"))),
            None => Ok(()),
        }
    }
}

/// Parses a request body: UTF-8, JSON, an object.
pub fn parse_body(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::invalid(None, format!("the request body is not UTF-8 text: invalid byte at offset {}", e.valid_up_to())))?;
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => {
            Err(ApiError::invalid(None, format!("the request body must be a JSON object, got {}", crate::config::value::type_name(&other))))
        }
        Err(e) => Err(ApiError::invalid(None, format!("the request body is not valid JSON: {e}"))),
    }
}

/// A `/v1/completions` body.
pub fn completion(body: Map<String, Value>) -> Result<GenRequest, ApiError> {
    let mut f = Fields(body);
    let prompt = match f.take("prompt") {
        None => return Err(ApiError::invalid(Some("prompt"), "`prompt` is required")),
        Some(v) => completion_prompt(v)?,
    };
    f.refuse_unless("echo", |v| v == &Value::Bool(false), "echo is not implemented")?;
    f.refuse_unless("suffix", |v| v.as_str() == Some(""), "insertion is not implemented")?;
    f.refuse_unless("best_of", |v| v.as_i64() == Some(1), "one choice per request")?;
    let max_tokens = max_tokens(&mut f, "max_tokens")?;
    common(f, prompt, max_tokens)
}

fn completion_prompt(v: Value) -> Result<Prompt, ApiError> {
    let bad = |v: &Value| {
        ApiError::invalid(
            Some("prompt"),
            format!("`prompt` = {}: expected a string, a list of one string, or a list of token ids", short(v)),
        )
    };
    match v {
        Value::String(s) => Ok(Prompt::Text(s)),
        Value::Array(a) if a.len() == 1 && a[0].is_string() => Ok(Prompt::Text(a[0].as_str().unwrap_or_default().to_string())),
        Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_u64) => a
            .iter()
            .map(|t| t.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| bad(t)))
            .collect::<Result<_, _>>()
            .map(Prompt::Tokens),
        Value::Array(a) if a.len() > 1 && a.iter().all(Value::is_string) => {
            Err(ApiError::invalid(Some("prompt"), format!("`prompt` is a list of {} prompts: send one prompt per request", a.len())))
        }
        other => Err(bad(&other)),
    }
}

/// A value for an error message, cut to 80 characters.
fn short(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(80) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s,
    }
}

/// A `/v1/chat/completions` body.
pub fn chat(body: Map<String, Value>) -> Result<GenRequest, ApiError> {
    let mut f = Fields(body);
    let messages = match f.take("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a.into_iter().enumerate().map(|(i, m)| message(i, m)).collect::<Result<Vec<_>, _>>()?,
        Some(v) => {
            return Err(ApiError::invalid(Some("messages"), format!("`messages` = {}: expected a non-empty list of messages", short(&v))))
        }
        None => return Err(ApiError::invalid(Some("messages"), "`messages` is required")),
    };
    f.refuse_unless("tools", |v| v.as_array().is_some_and(Vec::is_empty), "tool calls are not implemented")?;
    f.refuse_unless("tool_choice", |v| v == "none", "tool calls are not implemented")?;
    f.refuse_unless("response_format", |v| v["type"] == "text", "only text answers")?;
    f.refuse_unless("top_logprobs", |v| v.as_i64() == Some(0), "log-probabilities are not implemented")?;
    let a = max_tokens(&mut f, "max_tokens")?;
    let b = max_tokens(&mut f, "max_completion_tokens")?;
    common(f, Prompt::Chat(messages), a.or(b))
}

fn message(i: usize, m: Value) -> Result<Message, ApiError> {
    let key = format!("messages[{i}]");
    let Value::Object(mut o) = m else {
        return Err(ApiError::invalid(Some(&key), format!("`{key}`: expected an object with `role` and `content`")));
    };
    let role = match o.remove("role") {
        Some(Value::String(r)) if ["system", "user", "assistant", "developer"].contains(&r.as_str()) => r,
        other => {
            return Err(ApiError::invalid(
                Some(&format!("{key}.role")),
                format!("`{key}.role` = {}: expected \"system\", \"user\", \"assistant\" or \"developer\"", other.unwrap_or(Value::Null)),
            ))
        }
    };
    let content = match o.remove("content") {
        Some(Value::String(s)) => s,
        // A list of parts: only text parts, joined.
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|p| match (p["type"].as_str(), p["text"].as_str()) {
                (Some("text"), Some(t)) => Ok(t.to_string()),
                _ => Err(ApiError::invalid(
                    Some(&format!("{key}.content")),
                    format!("`{key}.content`: part {} is not a text part (only text is supported)", short(p)),
                )),
            })
            .collect::<Result<Vec<_>, _>>()?
            .concat(),
        other => {
            return Err(ApiError::invalid(
                Some(&format!("{key}.content")),
                format!("`{key}.content` = {}: expected a string", other.unwrap_or(Value::Null)),
            ))
        }
    };
    o.remove("name");
    if let Some(k) = o.keys().next() {
        return Err(ApiError::invalid(Some(&format!("{key}.{k}")), format!("unknown key `{key}.{k}`")));
    }
    Ok(Message { role, content })
}

fn max_tokens(f: &mut Fields, key: &str) -> Result<Option<usize>, ApiError> {
    match f.integer(key, "a whole number >= 1")? {
        None => Ok(None),
        Some(n) if n >= 1 => Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
        Some(n) => Err(ApiError::invalid(Some(key), format!("`{key}` = {n}: expected a whole number >= 1"))),
    }
}

/// The keys both endpoints share; refuses what is left.
fn common(mut f: Fields, prompt: Prompt, max_tokens: Option<usize>) -> Result<GenRequest, ApiError> {
    let model = match f.take("model") {
        Some(Value::String(m)) => m,
        Some(v) => return Err(ApiError::invalid(Some("model"), format!("`model` = {}: expected a string", short(&v)))),
        None => return Err(ApiError::invalid(Some("model"), "`model` is required")),
    };
    let temperature = f.number("temperature", 1.0, "a number in [0, 2]")?;
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(Some("temperature"), format!("`temperature` = {temperature}: expected a number in [0, 2]")));
    }
    let top_p = f.number("top_p", 1.0, "a number in (0, 1]")?;
    let top_k = match f.integer("top_k", "a whole number >= 0 (0 or -1: off)")? {
        None | Some(-1) => 0,
        Some(k) if k >= 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => return Err(ApiError::invalid(Some("top_k"), format!("`top_k` = {k}: expected a whole number >= 0 (0 or -1: off)"))),
    };
    let repetition_penalty = f.number("repetition_penalty", 1.0, "a number > 0 (1: off)")?;
    let seed = f.integer("seed", "a whole number")?.map(|s| s as u64);
    let sampling = SamplingParams {
        temperature: temperature as f32,
        top_k,
        top_p: top_p as f32,
        repetition_penalty: repetition_penalty as f32,
        seed: seed.unwrap_or(0),
    };
    sampling.validate().map_err(|e| {
        let (key, rest) = e.split_once(" = ").unwrap_or((e.as_str(), ""));
        ApiError::invalid(Some(key), format!("`{key}` = {rest}"))
    })?;
    let stop = match f.take("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(a)) if a.len() <= 4 && a.iter().all(Value::is_string) => {
            a.iter().filter_map(|s| s.as_str().map(str::to_string)).collect()
        }
        Some(v) => {
            return Err(ApiError::invalid(
                Some("stop"),
                format!("`stop` = {}: expected a string or a list of at most 4 strings", short(&v)),
            ))
        }
    };
    let stream = f.bool("stream")?;
    let ignore_eos = f.bool("ignore_eos")?;
    let include_usage = match f.take("stream_options") {
        None => false,
        Some(Value::Object(o)) if stream => o.get("include_usage").and_then(Value::as_bool).unwrap_or(false),
        Some(v) => {
            return Err(ApiError::invalid(
                Some("stream_options"),
                format!("`stream_options` = {}: expected an object, with `stream` true", short(&v)),
            ))
        }
    };
    f.refuse_unless("n", |v| v.as_i64() == Some(1), "one choice per request")?;
    f.refuse_unless("logprobs", |v| v == &Value::Bool(false), "log-probabilities are not implemented")?;
    f.refuse_unless("presence_penalty", |v| v.as_f64() == Some(0.0), "use repetition_penalty")?;
    f.refuse_unless("frequency_penalty", |v| v.as_f64() == Some(0.0), "use repetition_penalty")?;
    f.refuse_unless("logit_bias", |v| v.as_object().is_some_and(Map::is_empty), "logit_bias is not implemented")?;
    f.finish()?;
    Ok(GenRequest { model, prompt, max_tokens, sampling, seed, stop, stream, include_usage, ignore_eos })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn a_full_completion_request_reads_every_key() {
        let r = completion(body(json!({
            "model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 40,
            "repetition_penalty": 1.2, "seed": 3, "stop": ["\n", "x"], "stream": true,
            "stream_options": {"include_usage": true}, "n": 1, "user": "u", "logprobs": null
        })))
        .unwrap();
        assert_eq!(r.prompt, Prompt::Text("hi".into()));
        assert_eq!((r.max_tokens, r.seed, r.stream, r.include_usage), (Some(5), Some(3), true, true));
        assert_eq!(r.sampling, SamplingParams { temperature: 0.5, top_k: 40, top_p: 0.9, repetition_penalty: 1.2, seed: 3 });
        assert_eq!(r.stop, vec!["\n", "x"]);
        assert_eq!(completion(body(json!({"model": "m", "prompt": [1, 2]}))).unwrap().prompt, Prompt::Tokens(vec![1, 2]));
    }

    #[test]
    fn bad_values_are_refused_naming_the_key() {
        for (b, key) in [
            (json!({"model": "m"}), "prompt"),
            (json!({"prompt": "x"}), "model"),
            (json!({"model": "m", "prompt": "x", "max_tokens": -1}), "max_tokens"),
            (json!({"model": "m", "prompt": "x", "max_tokens": 0}), "max_tokens"),
            (json!({"model": "m", "prompt": "x", "max_tokens": "5"}), "max_tokens"),
            (json!({"model": "m", "prompt": "x", "temperature": 3}), "temperature"),
            (json!({"model": "m", "prompt": "x", "top_p": 0}), "top_p"),
            (json!({"model": "m", "prompt": "x", "n": 2}), "n"),
            (json!({"model": "m", "prompt": "x", "presence_penalty": 0.5}), "presence_penalty"),
            (json!({"model": "m", "prompt": "x", "stop": [1]}), "stop"),
            (json!({"model": "m", "prompt": "x", "frobnicate": 1}), "frobnicate"),
            (json!({"model": "m", "prompt": ["a", "b"]}), "prompt"),
            (json!({"model": "m", "prompt": [-1]}), "prompt"),
        ] {
            let e = completion(body(b.clone())).unwrap_err();
            assert_eq!((e.status, e.param.as_deref()), (400, Some(key)), "{b}: {e:?}");
            assert!(e.message.contains(key), "{e:?}");
        }
        for (b, key) in [
            (json!({"model": "m", "messages": []}), "messages"),
            (json!({"model": "m", "messages": [{"role": "bot", "content": "x"}]}), "messages[0].role"),
            (json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), "messages[0].content"),
            (json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{}]}), "tools"),
        ] {
            let e = chat(body(b.clone())).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(key), "{b}: {e:?}");
        }
    }

    #[test]
    fn bodies_that_are_not_utf8_json_objects_are_refused() {
        assert!(parse_body(b"{\"a\": \"\xff\"}").unwrap_err().message.contains("not UTF-8 text: invalid byte at offset 7"));
        assert!(parse_body(b"{\"a\": ").unwrap_err().message.contains("not valid JSON"));
        assert!(parse_body(b"[1]").unwrap_err().message.contains("JSON object, got an array"));
    }

    #[test]
    fn chat_messages_take_text_parts_and_max_completion_tokens() {
        let r = chat(body(json!({"model": "m", "max_completion_tokens": 7, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})))
        .unwrap();
        assert_eq!(r.prompt, Prompt::Chat(vec![Message { role: "user".into(), content: "ab".into() }]));
        assert_eq!(r.max_tokens, Some(7));
    }
}
