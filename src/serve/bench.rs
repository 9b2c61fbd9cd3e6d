//! `tessera bench-serve`: a load generator for an OpenAI-compatible server (`tessera serve`, or
//! any other, for a peer in the same invocation). Requests arrive as a Poisson process of a given
//! rate, each with a prompt and an output length drawn uniformly from ranges (the prompt as
//! random token ids; `ignore_eos` so the output length is the one drawn), streamed over
//! `/v1/completions`; it reports throughput, time to first token, inter-token latency and
//! request latency (p50/p99) as a table.

use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use tessera_kernels::tensor::Rng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Options of `tessera bench-serve`.
#[derive(Debug, Clone)]
pub struct BenchOpts {
    /// `http://host:port`.
    pub url: String,
    /// The model name (the server's first, from `/v1/models`, when absent).
    pub model: Option<String>,
    pub requests: usize,
    /// Mean arrivals a second.
    pub rate: f64,
    pub prompt_tokens: (usize, usize),
    pub output_tokens: (usize, usize),
    /// Token ids of the random prompts are below this.
    pub vocab: u32,
    pub seed: u64,
}

/// What one request measured.
#[derive(Debug, Clone, Default)]
struct Sample {
    ok: bool,
    error: Option<String>,
    ttft: f64,
    /// Gaps between successive text chunks.
    itl: Vec<f64>,
    latency: f64,
    tokens: usize,
}

/// `host:port` of an `http://` URL.
fn host_port(url: &str) -> Result<String> {
    let Some(rest) = url.strip_prefix("http://") else { bail!("--url {url}: expected http://HOST:PORT") };
    let hp = rest.trim_end_matches('/');
    ensure!(hp.contains(':') && !hp.contains('/'), "--url {url}: expected http://HOST:PORT");
    Ok(hp.to_string())
}

/// Sends one HTTP/1.1 request and calls `on_body` with the decoded body bytes as they come
/// (chunked transfer decoded); returns the status code.
async fn http(addr: &str, method: &str, path: &str, body: &str, mut on_body: impl FnMut(&[u8])) -> Result<u16> {
    let mut s = tokio::net::TcpStream::connect(addr).await.with_context(|| format!("connecting to {addr}"))?;
    s.set_nodelay(true)?;
    let req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
    s.write_all(req.as_bytes()).await?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    let (status, chunked, mut at) = loop {
        let n = s.read(&mut chunk).await?;
        ensure!(n > 0, "{addr} closed the connection before answering");
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).context("no HTTP status line")?;
            break (status, head.contains("transfer-encoding: chunked"), end + 4);
        }
    };
    let mut de = Dechunk { chunked, need: None, done: false };
    loop {
        at = de.feed(&buf, at, &mut on_body)?;
        buf.drain(..at);
        at = 0;
        if de.done {
            return Ok(status);
        }
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Ok(status);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Chunked transfer decoding over a growing buffer.
struct Dechunk {
    chunked: bool,
    /// Bytes of the current chunk still to come (and its CRLF), once its size line was read.
    need: Option<usize>,
    done: bool,
}

impl Dechunk {
    /// Decodes what `buf[at..]` holds; returns how far it got.
    fn feed(&mut self, buf: &[u8], mut at: usize, on_body: &mut impl FnMut(&[u8])) -> Result<usize> {
        if self.done {
            return Ok(buf.len());
        }
        if !self.chunked {
            on_body(&buf[at..]);
            return Ok(buf.len());
        }
        loop {
            match self.need {
                None => {
                    let Some(eol) = buf[at..].windows(2).position(|w| w == b"\r\n") else { return Ok(at) };
                    let line = std::str::from_utf8(&buf[at..at + eol])?;
                    let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16).context("a bad chunk size")?;
                    at += eol + 2;
                    if size == 0 {
                        self.done = true;
                        return Ok(at);
                    }
                    self.need = Some(size);
                }
                Some(n) => {
                    if buf.len() - at < n + 2 {
                        return Ok(at);
                    }
                    on_body(&buf[at..at + n]);
                    at += n + 2;
                    self.need = None;
                }
            }
        }
    }
}

/// One streamed completion of `prompt`, timed.
async fn one(addr: String, model: String, prompt: Vec<u32>, max_tokens: usize) -> Sample {
    let body = serde_json::json!({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": true,
        "ignore_eos": true, "stream_options": {"include_usage": true}})
    .to_string();
    let t0 = Instant::now();
    let mut s = Sample::default();
    let (mut pending, mut last, mut first) = (Vec::new(), t0, true);
    let mut error = None;
    let r = http(&addr, "POST", "/v1/completions", &body, |bytes| {
        pending.extend_from_slice(bytes);
        while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            let Some(data) = std::str::from_utf8(&event).ok().and_then(|e| e.trim().strip_prefix("data: ")) else { continue };
            let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else { continue };
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                s.tokens = n as usize;
            }
            if v["error"].is_object() {
                error = Some(v["error"]["message"].to_string());
            }
            if v["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()) {
                let now = Instant::now();
                match first {
                    true => s.ttft = (now - t0).as_secs_f64(),
                    false => s.itl.push((now - last).as_secs_f64()),
                }
                first = false;
                last = now;
            }
        }
    })
    .await;
    s.latency = t0.elapsed().as_secs_f64();
    match r {
        Ok(200) if error.is_none() && !first => s.ok = true,
        Ok(code) => s.error = Some(error.unwrap_or_else(|| format!("HTTP {code}"))),
        Err(e) => s.error = Some(format!("{e:#}")),
    }
    s
}

/// The server's first model.
async fn first_model(addr: &str) -> Result<String> {
    let mut body = Vec::new();
    let code = http(addr, "GET", "/v1/models", "", |b| body.extend_from_slice(b)).await?;
    ensure!(code == 200, "GET /v1/models: HTTP {code}");
    let v: serde_json::Value = serde_json::from_slice(&body).context("GET /v1/models: not JSON")?;
    v["data"][0]["id"].as_str().map(str::to_string).context("GET /v1/models lists no model")
}

fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// Runs the benchmark and prints its table.
pub fn bench_serve(o: &BenchOpts) -> Result<()> {
    ensure!(o.requests > 0 && o.rate > 0.0, "--requests and --rate must be positive");
    ensure!(
        o.prompt_tokens.0 >= 1 && o.prompt_tokens.0 <= o.prompt_tokens.1,
        "--prompt-tokens {:?}: expected MIN:MAX with 1 <= MIN <= MAX",
        o.prompt_tokens
    );
    ensure!(
        o.output_tokens.0 >= 1 && o.output_tokens.0 <= o.output_tokens.1,
        "--output-tokens {:?}: expected MIN:MAX with 1 <= MIN <= MAX",
        o.output_tokens
    );
    let addr = host_port(&o.url)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        let model = match &o.model {
            Some(m) => m.clone(),
            None => first_model(&addr).await?,
        };
        let mut rng = Rng::new(o.seed);
        let between = |rng: &mut Rng, (lo, hi): (usize, usize)| lo + (rng.next_u64() % (hi - lo + 1) as u64) as usize;
        let t0 = Instant::now();
        let mut at = 0.0;
        let mut tasks = Vec::with_capacity(o.requests);
        for _ in 0..o.requests {
            at += -(1.0 - rng.next_f64()).ln() / o.rate;
            let prompt: Vec<u32> = (0..between(&mut rng, o.prompt_tokens)).map(|_| (rng.next_u64() % u64::from(o.vocab)) as u32).collect();
            let out = between(&mut rng, o.output_tokens);
            let (addr, model) = (addr.clone(), model.clone());
            let start = t0 + Duration::from_secs_f64(at);
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until(start.into()).await;
                one(addr, model, prompt, out).await
            }));
        }
        let mut samples = Vec::with_capacity(tasks.len());
        for t in tasks {
            samples.push(t.await?);
        }
        report(o, &model, &samples, t0.elapsed().as_secs_f64());
        Ok(())
    })
}

fn report(o: &BenchOpts, model: &str, samples: &[Sample], wall: f64) {
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    let tokens: usize = ok.iter().map(|s| s.tokens).sum();
    let mut ttft: Vec<f64> = ok.iter().map(|s| s.ttft * 1e3).collect();
    let mut itl: Vec<f64> = ok.iter().flat_map(|s| s.itl.iter().map(|x| x * 1e3)).collect();
    let mut lat: Vec<f64> = ok.iter().map(|s| s.latency).collect();
    println!(
        "bench-serve: {} ({model}), {} requests, Poisson {} req/s, prompt {}..={} tokens, output {}..={} tokens, seed {}",
        o.url, o.requests, o.rate, o.prompt_tokens.0, o.prompt_tokens.1, o.output_tokens.0, o.output_tokens.1, o.seed
    );
    println!("| metric | value |\n|---|---|");
    println!("| requests ok / failed | {} / {} |", ok.len(), samples.len() - ok.len());
    println!("| wall time | {wall:.2} s |");
    println!("| throughput | {:.2} req/s, {:.1} output tokens/s |", ok.len() as f64 / wall, tokens as f64 / wall);
    println!("| TTFT p50 / p99 | {:.1} / {:.1} ms |", percentile(&mut ttft, 0.5), percentile(&mut ttft, 0.99));
    println!("| ITL p50 / p99 | {:.2} / {:.2} ms |", percentile(&mut itl, 0.5), percentile(&mut itl, 0.99));
    println!("| request latency p50 / p99 | {:.2} / {:.2} s |", percentile(&mut lat, 0.5), percentile(&mut lat, 0.99));
    if let Some(e) = samples.iter().find_map(|s| s.error.as_ref()) {
        println!("first error: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_bodies_decode_across_reads() {
        let wire = b"5\r\nhello\r\n3;x=1\r\n ab\r\n0\r\n\r\n";
        let mut out = Vec::new();
        let mut de = Dechunk { chunked: true, need: None, done: false };
        let mut buf = Vec::new();
        let mut at = 0;
        for b in wire {
            buf.push(*b);
            at = de.feed(&buf, at, &mut |x: &[u8]| out.extend_from_slice(x)).unwrap();
        }
        assert!(de.done);
        assert_eq!(out, b"hello ab");
    }

    #[test]
    fn percentiles_and_urls() {
        assert_eq!(percentile(&mut [3.0, 1.0, 2.0], 0.5), 2.0);
        assert_eq!(percentile(&mut (1..=100).map(f64::from).collect::<Vec<_>>(), 0.99), 99.0);
        assert_eq!(host_port("http://127.0.0.1:8000/").unwrap(), "127.0.0.1:8000");
        assert!(host_port("https://x:1").is_err());
    }
}
