//! The control protocol between the driver (`tessera train --nprocs N`, `tessera coordinator`)
//! and its worker processes or agents: the messages, their framing on a TCP stream, and bounded
//! reads.
//!
//! A spawned worker opens with `Hello`. An agent (`tessera agent`, possibly on another host)
//! first says `Join`; once every agent has joined the coordinator answers each with `Assign`
//! (its rank, the resolved config and, unless the cluster keys were pre-distributed, its node
//! certificate and key), and the agent then continues exactly as a spawned worker (`Hello`,
//! `Mesh`, `Start`, `Ready`, requests). Between requests the coordinator pings idle agents
//! (`Ping` → `Pong`) so that an agent can bound its wait for the next request.
//!
//! A frame is a little-endian `u32` length and that many bytes of JSON (serde), at most
//! [`FRAME_BYTES_MAX`]; a message that does not parse as the expected enum is an error, never a
//! panic. Floating-point values travel as their bit patterns so that NaN and infinities survive.
//! Bulk state (the start state sent to a worker, the masters and optimizer buffers a worker
//! exports between steps) is the one exception to "small messages": a header frame announces
//! each buffer's length and a CRC32C, then the raw little-endian `f32` bytes follow on the same
//! stream (a TCP connection is one ordered stream; control replies never interleave with them
//! because each rank's exchange is strictly request → reply).

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tessera_actors::compute::{MemoryReport, Prepared, StepOrder};

/// Largest control frame accepted (bytes).
pub const FRAME_BYTES_MAX: usize = 1 << 20;
/// How often a blocked read wakes up to check its deadline and liveness (ms).
pub const POLL_MS: u64 = 100;

/// Why a control exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("the peer closed the control connection")]
    Closed,
    #[error("no {what} within {waited_ms} ms")]
    Timeout { what: String, waited_ms: u64 },
    #[error("control connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("control frame of {bytes} bytes exceeds the limit of {FRAME_BYTES_MAX}")]
    TooLarge { bytes: usize },
    #[error("malformed control message (expected {expected}): {detail}")]
    Malformed { expected: &'static str, detail: String },
    #[error("bulk buffer `{name}`: {detail}")]
    Bulk { name: String, detail: String },
}

/// A rank's bytes held, as [`MemoryReport`] without the rank.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct WireMemory {
    pub param_bytes: u64,
    pub grad_bytes: u64,
    pub optim_bytes: u64,
}

impl WireMemory {
    pub fn from_report(m: &MemoryReport) -> Self {
        WireMemory { param_bytes: m.param_bytes, grad_bytes: m.grad_bytes, optim_bytes: m.optim_bytes }
    }

    pub fn report(&self, rank: usize) -> MemoryReport {
        MemoryReport { rank, param_bytes: self.param_bytes, grad_bytes: self.grad_bytes, optim_bytes: self.optim_bytes }
    }
}

/// What a worker holds after each reply: enough for the driver's per-step figures.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Snapshot {
    pub memory: WireMemory,
    pub applied: u64,
    pub skipped: u64,
    /// The loss scale's f32 bits, when a loss scaler runs.
    pub scale_bits: Option<u32>,
    pub bytes_sent_total: u64,
    /// Elastic: a replica this worker should hold was dropped since the last full copy (an
    /// update failed or its digest differed from the owner's): it needs a new full copy.
    #[serde(default)]
    pub replica_stale: bool,
    /// Elastic: the replicas this worker holds wait for more commits' updates than it applies
    /// in the background (a busy CPU): a full copy catches them up.
    #[serde(default)]
    pub replica_behind: bool,
}

/// [`Prepared`] with floats as bits.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct WirePrepared {
    pub loss_sum_bits: u64,
    pub micro_batches: u64,
    pub grad_norm_bits: Option<u64>,
    pub overflow: bool,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub compute_s_bits: u64,
    #[serde(default)]
    pub busy_s_bits: u64,
    #[serde(default)]
    pub busy_micro_batches: u64,
}

impl WirePrepared {
    pub fn new(p: &Prepared) -> Self {
        WirePrepared {
            loss_sum_bits: p.loss_sum.to_bits(),
            micro_batches: p.micro_batches as u64,
            grad_norm_bits: p.grad_norm.map(f64::to_bits),
            overflow: p.overflow,
            bytes_sent: p.bytes_sent,
            bytes_received: p.bytes_received,
            compute_s_bits: p.compute_s.to_bits(),
            busy_s_bits: p.busy_s.to_bits(),
            busy_micro_batches: p.busy_micro_batches as u64,
        }
    }

    pub fn prepared(&self) -> Prepared {
        Prepared {
            loss_sum: f64::from_bits(self.loss_sum_bits),
            micro_batches: self.micro_batches as usize,
            grad_norm: self.grad_norm_bits.map(f64::from_bits),
            overflow: self.overflow,
            bytes_sent: self.bytes_sent,
            bytes_received: self.bytes_received,
            compute_s: f64::from_bits(self.compute_s_bits),
            busy_s: f64::from_bits(self.busy_s_bits),
            busy_micro_batches: self.busy_micro_batches as usize,
        }
    }
}

/// One bulk buffer announced in a header: its name, length in f32 values and CRC32C of its bytes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BulkDesc {
    pub name: String,
    pub len: u64,
    pub crc32c: u32,
}

/// The counters that travel with a rank's state (start state and export).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct StateCounters {
    /// Optimizer steps (`None` in a start state: a fresh optimizer).
    pub optimizer_steps: Option<u64>,
    pub applied: u64,
    pub skipped: u64,
    pub scaler: Option<serde_json::Value>,
}

/// A node's TLS identity as PEM texts, sent to an agent in `Assign` (trusted launch: the
/// control connection is the channel that hands out keys; see `engine::remote`).
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct WireTls {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for WireTls {
    /// Never prints the private key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WireTls").field("ca_pem", &self.ca_pem.len()).field("cert_pem", &self.cert_pem.len()).finish_non_exhaustive()
    }
}

/// Parent → worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ToWorker {
    /// To an agent after every agent joined: its rank of `world`, the resolved config (JSON
    /// text) and its TLS identity (`None` when the agents hold a pre-distributed cluster dir).
    Assign {
        rank: u64,
        world: u64,
        config: String,
        tls: Option<WireTls>,
    },
    /// Are you there? (answered with `Pong`; sent only between requests).
    Ping,
    /// Every rank's QUIC address, in rank order, and (elastic epochs) their node names; empty
    /// names mean `node-<rank>`.
    Mesh {
        addrs: Vec<String>,
        #[serde(default)]
        names: Vec<String>,
    },
    /// The start state: `master_start` is where the master window begins in the flat buffer;
    /// the buffers follow as bulk (first `master`, then the optimizer buffers of the rank's range).
    Start {
        master_start: u64,
        counters: StateCounters,
        buffers: Vec<BulkDesc>,
        /// The steps this state has committed (the next step to run).
        #[serde(default)]
        step: u64,
    },
    Prepare {
        step: u64,
        epoch: u64,
        attempt: u32,
    },
    Commit {
        step: u64,
    },
    Abandon {
        step: u64,
    },
    /// Send masters (and, with `optim`, the optimizer buffers) as bulk, and counters.
    Export {
        optim: bool,
    },
    /// Leave the QUIC group and exit.
    Shutdown,
    /// Elastic: to a joining worker, the id (node name `node-<id>`) it runs under.
    Admit {
        id: u64,
    },
    /// Elastic: to a joining worker, why it is not admitted (it exits with this error).
    Refused {
        error: String,
    },
    /// Elastic: leave the current group and bind a fresh QUIC socket for `epoch`, where this
    /// worker is `rank` of `world` (answered with `EpochAddr`; `Mesh`, `Start`, `Ready` follow).
    Epoch {
        epoch: u64,
        rank: u64,
        world: u64,
    },
    /// Elastic: a full copy of the replicas at `step` committed steps (when an epoch forms, or
    /// after a replica was dropped): send this rank's shard to its ring successors and keep
    /// theirs (answered with `Replicated`). Between full copies the replicas follow the owners'
    /// gradients (`engine::replica`).
    Replicate {
        step: u64,
    },
    /// Elastic: what this worker holds (answered with `Status`).
    Status,
    /// Elastic: export the replica of rank `owner` of the current epoch, as `Export` does.
    ExportReplica {
        owner: u64,
    },
    /// Elastic, on the side connection: abort the collectives of `epoch` (a member was lost).
    Abort {
        epoch: u64,
    },
    /// Elastic, at a step boundary: run the next steps with these micro-batch blocks (per rank
    /// of the current epoch, `(first, level)`), sized by the measured speeds; the partition of
    /// the state stays (answered with `Rebalanced`).
    Blocks {
        blocks: Vec<Vec<(u64, u32)>>,
    },
}

/// Worker → parent.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ToParent {
    /// An agent's first message: who it is, and the rank and world size it was told to take
    /// (torchrun/Slurm variables or `--rank`), if any.
    Join {
        name: String,
        pid: u32,
        rank: Option<u64>,
        world: Option<u64>,
        version: String,
    },
    Hello {
        rank: u64,
        pid: u32,
        quic_addr: String,
        config_hash: String,
        /// BLAKE3 of the training and validation tokens the worker loaded (agents send it; the
        /// coordinator refuses an agent whose data differs from its own).
        #[serde(default)]
        data_blake3: Option<String>,
    },
    Pong,
    Ready {
        snapshot: Snapshot,
    },
    Prepared {
        prepared: WirePrepared,
        snapshot: Snapshot,
    },
    Committed {
        snapshot: Snapshot,
    },
    Abandoned,
    /// Followed by the bulk buffers (first `master`, then optimizer buffers).
    Exported {
        counters: StateCounters,
        buffers: Vec<BulkDesc>,
    },
    /// The request failed on the worker (the step is then abandoned by the driver).
    Failed {
        error: String,
    },
    /// Elastic: the first message of a worker that joins a running job.
    Enlist {
        pid: u32,
        config_hash: String,
    },
    /// Elastic: the first message of a worker's side connection (heartbeats, drain, abort).
    Side {
        id: u64,
    },
    /// Elastic, on the side connection: still alive.
    Heartbeat,
    /// Elastic, on the side connection: got SIGTERM; hand my shard over and let me go.
    Draining,
    /// Elastic: the QUIC address bound for the new epoch.
    EpochAddr {
        quic_addr: String,
    },
    Replicated,
    /// Elastic: the new micro-batch blocks are in force.
    Rebalanced,
    /// Elastic: the committed steps this worker's state holds (`None`: a commit failed half-way,
    /// the state is not usable) and the replicas it keeps: (owner rank, committed steps).
    Status {
        at: Option<u64>,
        replicas: Vec<(u64, u64)>,
    },
}

impl ToWorker {
    pub fn prepare(order: &StepOrder) -> Self {
        ToWorker::Prepare { step: order.step, epoch: order.epoch, attempt: order.attempt }
    }
}

/// Writes one message frame.
pub fn send<T: Serialize>(stream: &mut TcpStream, msg: &T) -> Result<(), WireError> {
    let body = serde_json::to_vec(msg).map_err(|e| WireError::Malformed { expected: "a serialisable message", detail: e.to_string() })?;
    if body.len() > FRAME_BYTES_MAX {
        return Err(WireError::TooLarge { bytes: body.len() });
    }
    let mut frame = Vec::with_capacity(body.len() + 4);
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    stream.write_all(&frame)?;
    stream.flush()?;
    Ok(())
}

/// When a read gives up: a deadline, and a liveness check run on every poll (`Err` stops it).
pub struct Wait<'a> {
    pub what: &'a str,
    pub deadline: Option<Instant>,
    pub alive: &'a dyn Fn() -> Result<(), WireError>,
}

impl Wait<'_> {
    fn tick(&self, started: Instant) -> Result<(), WireError> {
        (self.alive)()?;
        match self.deadline {
            Some(d) if Instant::now() >= d => {
                Err(WireError::Timeout { what: self.what.to_string(), waited_ms: started.elapsed().as_millis() as u64 })
            }
            _ => Ok(()),
        }
    }
}

/// Fills `buf` completely, polling every [`POLL_MS`] (the stream's read timeout is set here).
fn read_full(stream: &mut TcpStream, buf: &mut [u8], wait: &Wait<'_>) -> Result<(), WireError> {
    stream.set_read_timeout(Some(Duration::from_millis(POLL_MS)))?;
    let started = Instant::now();
    let mut got = 0;
    while got < buf.len() {
        match stream.read(&mut buf[got..]) {
            Ok(0) => return Err(WireError::Closed),
            Ok(n) => got += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => wait.tick(started)?,
            Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted) => return Err(WireError::Closed),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Reads one message frame and parses it as `T`.
pub fn recv<T: DeserializeOwned>(stream: &mut TcpStream, expected: &'static str, wait: &Wait<'_>) -> Result<T, WireError> {
    let mut prefix = [0u8; 4];
    read_full(stream, &mut prefix, wait)?;
    let len = frame_len(prefix)?;
    let mut body = vec![0u8; len];
    read_full(stream, &mut body, wait)?;
    decode_body(&body, expected)
}

/// The body length a frame's 4-byte prefix announces, checked against [`FRAME_BYTES_MAX`].
fn frame_len(prefix: [u8; 4]) -> Result<usize, WireError> {
    let len = u32::from_le_bytes(prefix) as usize;
    if len > FRAME_BYTES_MAX {
        return Err(WireError::TooLarge { bytes: len });
    }
    Ok(len)
}

/// Parses a frame body (JSON) as `T`.
fn decode_body<T: DeserializeOwned>(body: &[u8], expected: &'static str) -> Result<T, WireError> {
    serde_json::from_slice(body).map_err(|e| WireError::Malformed { expected, detail: e.to_string() })
}

/// Decodes one frame from the front of `bytes` exactly as [`recv`] does from a stream (a short
/// input is [`WireError::Closed`]); returns the message and the bytes after it. For the fuzzers
/// (`fuzz/` includes this file by path, so the engine itself never calls it).
#[doc(hidden)]
#[allow(dead_code)]
pub fn decode_for_fuzz<'a, T: DeserializeOwned>(bytes: &'a [u8], expected: &'static str) -> Result<(T, &'a [u8]), WireError> {
    let (prefix, rest) = bytes.split_first_chunk::<4>().ok_or(WireError::Closed)?;
    let len = frame_len(*prefix)?;
    let (body, rest) = rest.split_at_checked(len).ok_or(WireError::Closed)?;
    Ok((decode_body(body, expected)?, rest))
}

/// Describes `bufs` for a header (name, length, CRC32C).
pub fn describe(bufs: &[(&str, &[f32])]) -> Vec<BulkDesc> {
    bufs.iter()
        .map(|(name, b)| BulkDesc { name: name.to_string(), len: b.len() as u64, crc32c: crc32c::crc32c(bytemuck::cast_slice(b)) })
        .collect()
}

/// Writes the raw bytes of `bufs` (after their header).
pub fn send_bulk(stream: &mut TcpStream, bufs: &[&[f32]]) -> Result<(), WireError> {
    for b in bufs {
        stream.write_all(bytemuck::cast_slice(b))?;
    }
    stream.flush()?;
    Ok(())
}

/// Reads the buffers a header announced; `len_max` bounds each (the receiver knows its plan).
pub fn recv_bulk(stream: &mut TcpStream, descs: &[BulkDesc], len_max: usize, wait: &Wait<'_>) -> Result<Vec<Vec<f32>>, WireError> {
    descs
        .iter()
        .map(|d| {
            let bulk = |detail: String| WireError::Bulk { name: d.name.clone(), detail };
            let len = usize::try_from(d.len)
                .ok()
                .filter(|&n| n <= len_max)
                .ok_or_else(|| bulk(format!("{} values, at most {len_max} expected", d.len)))?;
            let mut v = vec![0.0f32; len];
            read_full(stream, bytemuck::cast_slice_mut(&mut v), wait)?;
            let crc = crc32c::crc32c(bytemuck::cast_slice(&v));
            if crc != d.crc32c {
                return Err(bulk(format!("CRC32C {crc:#010x}, header says {:#010x}", d.crc32c)));
            }
            Ok(v)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let a = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (b, _) = l.accept().expect("accept");
        (a, b)
    }

    fn wait(ms: u64) -> Wait<'static> {
        Wait { what: "a test message", deadline: Some(Instant::now() + Duration::from_millis(ms)), alive: &|| Ok(()) }
    }

    #[test]
    fn messages_and_bulk_round_trip_with_nan_intact() {
        let (mut a, mut b) = pair();
        let p = Prepared { loss_sum: f64::NAN, grad_norm: Some(f64::INFINITY), micro_batches: 3, ..Prepared::default() };
        send(&mut a, &ToParent::Prepared { prepared: WirePrepared::new(&p), snapshot: Snapshot::default() }).expect("send");
        let data = [1.5f32, -0.0, f32::NAN];
        send(&mut a, &ToParent::Exported { counters: StateCounters::default(), buffers: describe(&[("master", &data)]) }).expect("send");
        send_bulk(&mut a, &[&data]).expect("bulk");
        let Ok(ToParent::Prepared { prepared, .. }) = recv(&mut b, "a reply", &wait(5000)) else { panic!("not Prepared") };
        let back = prepared.prepared();
        assert!(back.loss_sum.is_nan() && back.grad_norm == Some(f64::INFINITY) && back.micro_batches == 3);
        let Ok(ToParent::Exported { buffers, .. }) = recv(&mut b, "a reply", &wait(5000)) else { panic!("not Exported") };
        let got = recv_bulk(&mut b, &buffers, 16, &wait(5000)).expect("bulk");
        assert_eq!(bytemuck::cast_slice::<f32, u32>(&got[0]), bytemuck::cast_slice::<f32, u32>(&data));
    }

    #[test]
    fn malformed_oversized_and_silent_peers_are_errors() {
        let (mut a, mut b) = pair();
        a.write_all(&5u32.to_le_bytes()).and_then(|()| a.write_all(b"nope!")).expect("write");
        assert!(matches!(recv::<ToParent>(&mut b, "a reply", &wait(5000)), Err(WireError::Malformed { .. })));
        a.write_all(&(FRAME_BYTES_MAX as u32 + 1).to_le_bytes()).expect("write");
        assert!(matches!(recv::<ToParent>(&mut b, "a reply", &wait(5000)), Err(WireError::TooLarge { .. })));
        assert!(matches!(recv::<ToParent>(&mut b, "a reply", &wait(300)), Err(WireError::Timeout { .. })));
        let descs = vec![BulkDesc { name: "m".into(), len: 1000, crc32c: 0 }];
        assert!(matches!(recv_bulk(&mut b, &descs, 10, &wait(300)), Err(WireError::Bulk { .. })));
        drop(a);
        assert!(matches!(recv::<ToParent>(&mut b, "a reply", &wait(5000)), Err(WireError::Closed)));
    }

    #[test]
    fn slice_decoding_matches_the_stream_rules() {
        let body = br#"{"Prepare":{"step":4,"epoch":1,"attempt":0}}"#;
        let mut bytes = (body.len() as u32).to_le_bytes().to_vec();
        bytes.extend_from_slice(body);
        bytes.push(7);
        let (msg, rest) = decode_for_fuzz::<ToWorker>(&bytes, "a request").expect("decodes");
        assert!(matches!(msg, ToWorker::Prepare { step: 4, epoch: 1, attempt: 0 }) && rest == [7]);
        assert!(matches!(decode_for_fuzz::<ToWorker>(&bytes[..10], "a request"), Err(WireError::Closed)));
        let huge = (FRAME_BYTES_MAX as u32 + 1).to_le_bytes();
        assert!(matches!(decode_for_fuzz::<ToWorker>(&huge, "a request"), Err(WireError::TooLarge { .. })));
        assert!(matches!(decode_for_fuzz::<ToParent>(&bytes, "a reply"), Err(WireError::Malformed { .. })));
    }
}
