//! The control protocol between the driver (`tessera train --nprocs N`, `tessera coordinator`)
//! and its worker processes or agents: the messages, their framing, and bounded reads.
//!
//! A spawned worker opens with `Hello`. An agent (`tessera agent`, possibly on another host)
//! first says `Join` (with a join token and its own public key, or with the certificate it
//! holds); once every agent has joined the coordinator answers each with `Assign` (its rank, the
//! resolved config and, for an agent that came with a token, a certificate for its own key — no
//! private key ever travels), and the agent then continues exactly as a spawned worker (`Hello`,
//! `Mesh`, `Start`, `Ready`, requests). Between requests the coordinator pings agents (`Ping`
//! → `Pong`) so that an agent can bound its wait for the next request. A step crosses as
//! `Prepare`/`Commit`/`Abandon` requests and their replies (the driver's `ElasticCompute`); a
//! compute error crosses as [`WireComputeError`], its kind intact.
//!
//! A message is rkyv-encoded and validated with bytecheck on receipt (`decode`): a frame that
//! does not validate as the expected enum is an error naming what was expected, never a panic.
//! Frames are at most [`FRAME_BYTES_MAX`]. They travel on a QUIC [`ControlConn`] (TLS 1.3,
//! `tessera_transport::quic::control`; [`ControlIo`] is the carrier interface): requests and
//! replies on its request lane, bulk state on its own stream per transfer. Every worker also
//! keeps a second connection, its side connection (`Side`, heartbeats, `Draining`, `Abort`).
//!
//! Bulk state (the start state sent to a worker, the masters and optimizer buffers a worker
//! exports between steps) is the one exception to "small messages": a header frame announces
//! each buffer's length and a CRC32C, and the receiver checks the lengths against its plan
//! before reading the raw little-endian `f32` bytes, and the CRC after.

use std::time::Instant;

use rkyv::api::high::{HighDeserializer, HighSerializer, HighValidator};
use rkyv::bytecheck::CheckBytes;
use rkyv::rancor::Error as RkyvError;
use rkyv::ser::allocator::ArenaHandle;
use rkyv::util::AlignedVec;
use tessera_actors::compute::{ComputeError, MemoryReport, MoeBlockTally, MoeTally, PhaseTimes, Prepared, StepOrder, TimedOp};
use tessera_transport::quic::control::{ControlError, LANE_REQUESTS};
use tessera_transport::quic::ControlConn;

/// Largest control frame accepted (bytes).
pub const FRAME_BYTES_MAX: usize = 1 << 20;
/// How often a blocked read wakes up to check its deadline and liveness (ms).
pub const POLL_MS: u64 = 100;
/// Bound on writing one bulk transfer (ms).
pub const BULK_SEND_TIMEOUT_MS: u64 = 600_000;
/// Exit status of a worker asked to drain (SIGTERM, SIGUSR1) that saw no step boundary within
/// its drain grace: the driver reads it as a drain that timed out, not a crash.
pub const EXIT_DRAIN_GRACE: i32 = 3;

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
    #[error("control connection: {0}")]
    Control(String),
}

impl From<ControlError> for WireError {
    fn from(e: ControlError) -> Self {
        match e {
            ControlError::Closed(_) => WireError::Closed,
            ControlError::TooLarge { bytes } => WireError::TooLarge { bytes },
            ControlError::Stopped(why) => WireError::Io(std::io::Error::other(why)),
            other => WireError::Control(other.to_string()),
        }
    }
}

/// `Option<serde_json::Value>` as JSON text on the wire (rkyv cannot archive a JSON value); a
/// text that does not parse is refused when the message is decoded.
pub struct AsJson;

impl rkyv::with::ArchiveWith<serde_json::Value> for AsJson {
    type Archived = rkyv::string::ArchivedString;
    type Resolver = rkyv::string::StringResolver;
    fn resolve_with(field: &serde_json::Value, resolver: Self::Resolver, out: rkyv::Place<Self::Archived>) {
        // serde_json prints a value the same way every time (maps keep their order).
        rkyv::string::ArchivedString::resolve_from_str(&field.to_string(), resolver, out);
    }
}

impl<S> rkyv::with::SerializeWith<serde_json::Value, S> for AsJson
where
    S: rkyv::rancor::Fallible + rkyv::ser::Writer + ?Sized,
    S::Error: rkyv::rancor::Source,
    str: rkyv::SerializeUnsized<S>,
{
    fn serialize_with(field: &serde_json::Value, s: &mut S) -> Result<Self::Resolver, S::Error> {
        rkyv::string::ArchivedString::serialize_from_str(&field.to_string(), s)
    }
}

impl<D> rkyv::with::DeserializeWith<rkyv::string::ArchivedString, serde_json::Value, D> for AsJson
where
    D: rkyv::rancor::Fallible + ?Sized,
    D::Error: rkyv::rancor::Source,
{
    fn deserialize_with(field: &rkyv::string::ArchivedString, _: &mut D) -> Result<serde_json::Value, D::Error> {
        serde_json::from_str(field.as_str()).map_err(<D::Error as rkyv::rancor::Source>::new)
    }
}

/// A rank's bytes held, as [`MemoryReport`] without the rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Snapshot {
    pub memory: WireMemory,
    pub applied: u64,
    pub skipped: u64,
    /// The loss scale's f32 bits, when a loss scaler runs.
    pub scale_bits: Option<u32>,
    pub bytes_sent_total: u64,
    /// Elastic: a replica this worker should hold was dropped since the last full copy (an
    /// update failed or its digest differed from the owner's): it needs a new full copy.
    pub replica_stale: bool,
    /// Elastic: the replicas this worker holds wait for more commits' updates than it applies
    /// in the background (a busy CPU): a full copy catches them up.
    pub replica_behind: bool,
    /// The worker process's peak resident set size so far (`summary.json`'s
    /// `peak_rss_bytes_per_rank`).
    pub peak_rss_bytes: u64,
}

/// [`ComputeError`]'s kind on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum WireErrorKind {
    /// [`ComputeError::Lost`], with the peer's rank when known.
    Lost {
        rank: Option<u64>,
    },
    Aborted,
    Failed,
}

/// [`ComputeError`] as it crosses processes (`ToParent::Failed`): its kind, what a torn commit
/// reached, and the human cause. A torn commit travels flat (its cause's kind with `torn` set),
/// so the driver gets the `ComputeError` the worker returned and decides by its kind.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct WireComputeError {
    pub kind: WireErrorKind,
    /// `Some(stepped)` for [`ComputeError::Torn`].
    pub torn: Option<Option<u64>>,
    pub why: String,
}

impl From<ComputeError> for WireComputeError {
    fn from(e: ComputeError) -> Self {
        let (torn, cause) = match e {
            ComputeError::Torn { stepped, cause } => (Some(stepped), *cause),
            e => (None, e),
        };
        let (kind, why) = match cause {
            ComputeError::Lost { rank, why } => (WireErrorKind::Lost { rank: rank.map(|r| r as u64) }, why),
            ComputeError::Aborted { why } => (WireErrorKind::Aborted, why),
            // A torn cause is never torn itself (`ComputeError::torn` keeps one level).
            ComputeError::Failed { why } => (WireErrorKind::Failed, why),
            e @ ComputeError::Torn { .. } => (WireErrorKind::Failed, e.to_string()),
        };
        WireComputeError { kind, torn, why }
    }
}

impl std::fmt::Display for WireComputeError {
    /// The human cause, as the [`ComputeError`] it stands for shows it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.why)
    }
}

impl WireComputeError {
    /// A failure of the sender alone ([`ComputeError::Failed`]).
    pub fn failed(why: impl Into<String>) -> Self {
        ComputeError::failed(why).into()
    }
}

impl From<WireComputeError> for ComputeError {
    fn from(w: WireComputeError) -> Self {
        let why = w.why;
        let cause = match w.kind {
            WireErrorKind::Lost { rank } => ComputeError::Lost { rank: rank.map(|r| r as usize), why },
            WireErrorKind::Aborted => ComputeError::Aborted { why },
            WireErrorKind::Failed => ComputeError::Failed { why },
        };
        match w.torn {
            Some(stepped) => cause.torn(stepped),
            None => cause,
        }
    }
}

/// [`Prepared`] with floats as bits.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct WirePrepared {
    pub loss_sum_bits: u64,
    pub micro_batches: u64,
    pub grad_norm_bits: Option<u64>,
    pub overflow: bool,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub compute_s_bits: u64,
    pub busy_s_bits: u64,
    pub busy_micro_batches: u64,
    /// `PhaseTimes`' forward, backward inner and backward allreduce seconds, as bits.
    pub phases_bits: [u64; 3],
    pub moe: Option<WireMoeTally>,
    /// `TimedOp`s as (kind, chunk, micro-batch, start bits, end bits).
    pub timeline: Vec<(u8, u32, u32, u64, u64)>,
    pub activation_bytes_peak: u64,
}

/// [`MoeTally`] with floats as bits: per MoE block (index, tokens per expert, dropped pairs).
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct WireMoeTally {
    pub blocks: Vec<(u64, Vec<u64>, u64)>,
    pub aux_sum_bits: u64,
    pub z_sum_bits: u64,
    pub micro_batches: u64,
}

impl WireMoeTally {
    pub fn new(t: &MoeTally) -> Self {
        WireMoeTally {
            blocks: t.blocks.iter().map(|b| (b.block as u64, b.tokens_per_expert.clone(), b.dropped)).collect(),
            aux_sum_bits: t.aux_sum.to_bits(),
            z_sum_bits: t.z_sum.to_bits(),
            micro_batches: t.micro_batches,
        }
    }

    pub fn tally(&self) -> MoeTally {
        let block = |(b, tokens, dropped): &(u64, Vec<u64>, u64)| MoeBlockTally {
            block: *b as usize,
            tokens_per_expert: tokens.clone(),
            dropped: *dropped,
        };
        MoeTally {
            blocks: self.blocks.iter().map(block).collect(),
            aux_sum: f64::from_bits(self.aux_sum_bits),
            z_sum: f64::from_bits(self.z_sum_bits),
            micro_batches: self.micro_batches,
        }
    }
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
            phases_bits: [p.phases.forward_s, p.phases.backward_inner_s, p.phases.backward_allreduce_s].map(f64::to_bits),
            moe: p.moe.as_ref().map(WireMoeTally::new),
            timeline: p.timeline.iter().map(|o| (o.kind, o.chunk, o.micro_batch, o.start_s.to_bits(), o.end_s.to_bits())).collect(),
            activation_bytes_peak: p.activation_bytes_peak,
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
            phases: PhaseTimes {
                forward_s: f64::from_bits(self.phases_bits[0]),
                backward_inner_s: f64::from_bits(self.phases_bits[1]),
                backward_allreduce_s: f64::from_bits(self.phases_bits[2]),
            },
            moe: self.moe.as_ref().map(WireMoeTally::tally),
            timeline: self
                .timeline
                .iter()
                .map(|&(kind, chunk, micro_batch, a, b)| TimedOp {
                    kind,
                    chunk,
                    micro_batch,
                    start_s: f64::from_bits(a),
                    end_s: f64::from_bits(b),
                })
                .collect(),
            activation_bytes_peak: self.activation_bytes_peak,
        }
    }
}

/// One bulk buffer announced in a header: its name, length in f32 values and CRC32C of its bytes.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct BulkDesc {
    pub name: String,
    pub len: u64,
    pub crc32c: u32,
}

/// The counters that travel with a rank's state (start state and export).
#[derive(Debug, Clone, Default, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct StateCounters {
    /// Optimizer steps (`None` in a start state: a fresh optimizer).
    pub optimizer_steps: Option<u64>,
    pub applied: u64,
    pub skipped: u64,
    /// The loss scaler's state (JSON), when one runs.
    #[rkyv(with = rkyv::with::Map<AsJson>)]
    pub scaler: Option<serde_json::Value>,
}

/// Parent → worker.
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum ToWorker {
    /// To an agent after every agent joined: its rank of `world`, the resolved config (JSON
    /// text) and, for an agent that joined with a token, the cluster CA and a certificate for
    /// `node-<rank>` over the public key it sent (`None` when it came with its own certificate).
    Assign {
        rank: u64,
        world: u64,
        config: String,
        identity: Option<AssignedIdentity>,
    },
    /// Are you there? (answered with `Pong`; sent only between requests).
    Ping,
    /// Every rank's QUIC address, in rank order, and (elastic epochs) their node names; empty
    /// names mean `node-<rank>`.
    Mesh {
        addrs: Vec<String>,
        names: Vec<String>,
    },
    /// The start state: `master_start` is where the master window begins in the flat buffer;
    /// the buffers follow as bulk (first `master`, then the optimizer buffers of the rank's range).
    Start {
        master_start: u64,
        counters: StateCounters,
        buffers: Vec<BulkDesc>,
        /// The steps this state has committed (the next step to run).
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
    /// Elastic: to a worker or agent that joins a running job (its `Join` proved it belongs):
    /// the id it runs under (node name `node-<id>`), the resolved config (JSON text) and, for
    /// one that came with a join token, the CA and a certificate for `node-<id>` over the
    /// public key it sent. It answers with `Hello` once its data is loaded, then waits for the
    /// `Epoch` that makes it a member.
    Admit {
        id: u64,
        config: String,
        identity: Option<AssignedIdentity>,
    },
    /// Elastic: to a joining worker, why it is not admitted (it exits with this error).
    Refused {
        error: String,
    },
    /// Elastic: leave the current group and bind a fresh QUIC socket for `epoch`, where this
    /// worker is `rank` of `world` (answered with `EpochAddr`; `Mesh`, `Start`, `Ready` follow).
    /// `installed` is the newest epoch whose replicas all got their first full copy: the worker
    /// keeps what it holds of that epoch (its shard and replicas) until a newer one is
    /// installed, so a loss while `epoch` forms is restored from memory.
    Epoch {
        epoch: u64,
        rank: u64,
        world: u64,
        installed: Option<u64>,
    },
    /// Elastic: a full copy of the replicas at `step` committed steps (when an epoch forms, or
    /// after a replica was dropped): send this rank's shard to its ring successors and keep
    /// theirs (answered with `Replicated`). Between full copies the replicas follow the owners'
    /// gradients (the front crate's `engine::replica`).
    Replicate {
        step: u64,
    },
    /// Elastic: what this worker holds (answered with `Status`).
    Status,
    /// Elastic: export what this worker holds of rank `owner`'s shard in plan epoch `epoch` (a
    /// replica of the current epoch, or the kept shards of the installed one), as `Export` does.
    ExportReplica {
        owner: u64,
        epoch: u64,
    },
    /// Elastic: every member of `epoch` holds its first full replica copy: the shards kept from
    /// the epoch before can go (answered with `Installed`).
    Installed {
        epoch: u64,
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
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum ToParent {
    /// An agent's first message: who it is, and the rank and world size it was told to take
    /// (torchrun/Slurm variables or `--rank`), if any.
    Join {
        name: String,
        pid: u32,
        rank: Option<u64>,
        world: Option<u64>,
        version: String,
        /// The join token's secret (an agent without a certificate; checked in constant time).
        token: Option<Vec<u8>>,
        /// The agent's own public key (ECDSA P-256, uncompressed) for the coordinator to certify.
        public_key: Option<Vec<u8>>,
        /// Which machine and pid namespace it runs in ([`crate::join::host_id`]): an
        /// elastic driver on the same one watches and, when it is lost, kills it by its pid.
        host: String,
    },
    Hello {
        rank: u64,
        pid: u32,
        quic_addr: String,
        config_hash: String,
        /// BLAKE3 of the training and validation tokens the worker loaded (agents send it; the
        /// coordinator refuses an agent whose data differs from its own).
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
    /// The request failed on the worker (the step is then abandoned by the driver): a compute
    /// error keeps its kind (lost, aborted, failed, torn with what it stepped).
    Failed {
        error: WireComputeError,
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
    /// Elastic: the plan epoch this worker is a member of (`None`: none), the committed steps its
    /// state holds (`None`: a commit failed before its optimizer step finished, the state is not
    /// usable), the replicas it
    /// keeps: (owner rank, committed steps), and the shards it kept from the installed epoch
    /// `kept_epoch` while a newer one forms (its own and its replicas, same pairs).
    Status {
        epoch: Option<u64>,
        at: Option<u64>,
        replicas: Vec<(u64, u64)>,
        kept_epoch: Option<u64>,
        kept: Vec<(u64, u64)>,
    },
    /// Elastic: the kept shards are dropped.
    Installed,
}

/// The certificate a coordinator made for an agent's own key, and the CA that signed it (PEM).
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct AssignedIdentity {
    pub ca_pem: String,
    pub cert_pem: String,
}

impl ToWorker {
    pub fn prepare(order: &StepOrder) -> Self {
        ToWorker::Prepare { step: order.step, epoch: order.epoch, attempt: order.attempt }
    }
}

/// A carrier of control frames and bulk transfers (see the module doc).
pub trait ControlIo {
    /// Sends one frame (≤ [`FRAME_BYTES_MAX`]).
    fn write_frame(&mut self, frame: Vec<u8>) -> Result<(), WireError>;
    /// The next frame, waiting as `wait` allows.
    fn read_frame(&mut self, wait: &Wait<'_>) -> Result<Vec<u8>, WireError>;
    /// Sends the raw bytes of `bufs` (after their header frame).
    fn write_bulk(&mut self, bufs: &[&[f32]]) -> Result<(), WireError>;
    /// Reads buffers of exactly `lens` values (announced by a header and checked by the caller).
    fn read_bulk(&mut self, lens: &[usize], wait: &Wait<'_>) -> Result<Vec<Vec<f32>>, WireError>;
}

impl ControlIo for ControlConn {
    fn write_frame(&mut self, frame: Vec<u8>) -> Result<(), WireError> {
        Ok(self.send(LANE_REQUESTS, frame)?)
    }

    fn read_frame(&mut self, wait: &Wait<'_>) -> Result<Vec<u8>, WireError> {
        let started = Instant::now();
        loop {
            if let Some(frame) = self.recv(LANE_REQUESTS, POLL_MS)? {
                return Ok(frame);
            }
            wait.tick(started)?;
        }
    }

    fn write_bulk(&mut self, bufs: &[&[f32]]) -> Result<(), WireError> {
        let bytes: Vec<&[u8]> = bufs.iter().map(|b| bytemuck::cast_slice::<f32, u8>(b)).collect();
        Ok(self.send_bulk(&bytes, BULK_SEND_TIMEOUT_MS)?)
    }

    fn read_bulk(&mut self, lens: &[usize], wait: &Wait<'_>) -> Result<Vec<Vec<f32>>, WireError> {
        let bytes: Vec<usize> = lens.iter().map(|n| n * 4).collect();
        let alive = || (wait.alive)().map_err(|e| e.to_string());
        let got = self.recv_bulk(&bytes, POLL_MS, wait.deadline, &alive)?;
        Ok(got
            .iter()
            .map(|b| {
                let mut v = vec![0.0f32; b.len() / 4];
                bytemuck::cast_slice_mut::<f32, u8>(&mut v).copy_from_slice(b);
                v
            })
            .collect())
    }
}

/// rkyv bytes of `msg`.
pub fn encode<T>(msg: &T) -> Vec<u8>
where
    T: for<'a> rkyv::Serialize<HighSerializer<AlignedVec, ArenaHandle<'a>, RkyvError>>,
{
    // Serialising plain owned data into a growable buffer cannot fail.
    match rkyv::to_bytes::<RkyvError>(msg) {
        Ok(bytes) => bytes.to_vec(),
        Err(e) => unreachable!("rkyv serialisation of an owned message failed: {e}"),
    }
}

/// Validates (bytecheck) and decodes a frame as `T`.
pub fn decode<T>(frame: &[u8], expected: &'static str) -> Result<T, WireError>
where
    T: rkyv::Archive,
    T::Archived: for<'a> CheckBytes<HighValidator<'a, RkyvError>> + rkyv::Deserialize<T, HighDeserializer<RkyvError>>,
{
    let mut aligned = AlignedVec::<16>::with_capacity(frame.len());
    aligned.extend_from_slice(frame);
    rkyv::from_bytes::<T, RkyvError>(&aligned).map_err(|e| WireError::Malformed { expected, detail: e.to_string() })
}

/// Writes one message frame.
pub fn send<T>(c: &mut (impl ControlIo + ?Sized), msg: &T) -> Result<(), WireError>
where
    T: for<'a> rkyv::Serialize<HighSerializer<AlignedVec, ArenaHandle<'a>, RkyvError>>,
{
    let body = encode(msg);
    if body.len() > FRAME_BYTES_MAX {
        return Err(WireError::TooLarge { bytes: body.len() });
    }
    c.write_frame(body)
}

/// Reads one message frame and decodes it as `T`.
pub fn recv<T>(c: &mut (impl ControlIo + ?Sized), expected: &'static str, wait: &Wait<'_>) -> Result<T, WireError>
where
    T: rkyv::Archive,
    T::Archived: for<'a> CheckBytes<HighValidator<'a, RkyvError>> + rkyv::Deserialize<T, HighDeserializer<RkyvError>>,
{
    decode(&c.read_frame(wait)?, expected)
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

/// The body length a frame's 4-byte prefix announces, checked against [`FRAME_BYTES_MAX`].
fn frame_len(prefix: [u8; 4]) -> Result<usize, WireError> {
    let len = u32::from_le_bytes(prefix) as usize;
    if len > FRAME_BYTES_MAX {
        return Err(WireError::TooLarge { bytes: len });
    }
    Ok(len)
}

/// Decodes one length-prefixed message (`[u32 LE length ≤ FRAME_BYTES_MAX][frame]`, as a
/// control lane carries frames) from the front of `bytes` (a short input is
/// [`WireError::Closed`]); returns the message and the bytes after it.
/// For the fuzzers (`fuzz/` includes this file by path, so the engine itself never calls it).
#[doc(hidden)]
#[allow(dead_code)]
pub fn decode_for_fuzz<'a, T>(bytes: &'a [u8], expected: &'static str) -> Result<(T, &'a [u8]), WireError>
where
    T: rkyv::Archive,
    T::Archived: for<'b> CheckBytes<HighValidator<'b, RkyvError>> + rkyv::Deserialize<T, HighDeserializer<RkyvError>>,
{
    let (prefix, rest) = bytes.split_first_chunk::<4>().ok_or(WireError::Closed)?;
    let len = frame_len(*prefix)?;
    let (body, rest) = rest.split_at_checked(len).ok_or(WireError::Closed)?;
    Ok((decode(body, expected)?, rest))
}

/// Describes `bufs` for a header (name, length, CRC32C).
pub fn describe(bufs: &[(&str, &[f32])]) -> Vec<BulkDesc> {
    bufs.iter()
        .map(|(name, b)| BulkDesc { name: name.to_string(), len: b.len() as u64, crc32c: crc32c::crc32c(bytemuck::cast_slice(b)) })
        .collect()
}

/// Writes the raw bytes of `bufs` (after their header).
pub fn send_bulk<C: ControlIo + ?Sized>(c: &mut C, bufs: &[&[f32]]) -> Result<(), WireError> {
    c.write_bulk(bufs)
}

/// Reads the buffers a header announced; `len_max` bounds each (the receiver knows its plan),
/// checked before a byte is read; each buffer's CRC32C after.
pub fn recv_bulk<C: ControlIo + ?Sized>(
    c: &mut C,
    descs: &[BulkDesc],
    len_max: usize,
    wait: &Wait<'_>,
) -> Result<Vec<Vec<f32>>, WireError> {
    let lens = descs
        .iter()
        .map(|d| {
            usize::try_from(d.len)
                .ok()
                .filter(|&n| n <= len_max)
                .ok_or_else(|| WireError::Bulk { name: d.name.clone(), detail: format!("{} values, at most {len_max} expected", d.len) })
        })
        .collect::<Result<Vec<usize>, WireError>>()?;
    let bufs = c.read_bulk(&lens, wait)?;
    for (d, v) in descs.iter().zip(&bufs) {
        let crc = crc32c::crc32c(bytemuck::cast_slice(v));
        if crc != d.crc32c {
            return Err(WireError::Bulk { name: d.name.clone(), detail: format!("CRC32C {crc:#010x}, header says {:#010x}", d.crc32c) });
        }
    }
    Ok(bufs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tessera_transport::quic::{ClientAuth, ClusterCa, ControlEndpoint, ALPN_CONTROL};

    /// A control connection over loopback with mutual TLS: (endpoints, client side, server side).
    fn pair() -> ((ControlEndpoint, ControlEndpoint), ControlConn, ControlConn) {
        let ca = ClusterCa::generate().expect("CA");
        let (server_id, client_id) = (ca.issue("coordinator").expect("id"), ca.issue("node-0").expect("id"));
        let local: std::net::SocketAddr = ([127, 0, 0, 1], 0).into();
        let tls = server_id.server_config_for(ALPN_CONTROL, ClientAuth::Required).expect("tls");
        let server = ControlEndpoint::bind(local, Some(tls)).expect("bind");
        let addr = server.local_addr().expect("addr");
        let client = ControlEndpoint::bind(local, None).expect("bind");
        let t = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                match server.accept(100) {
                    Ok(Some(c)) => return (c, server),
                    _ if Instant::now() < deadline => continue,
                    _ => panic!("no connection"),
                }
            }
        });
        let a = client.connect(addr, "coordinator", client_id.client_config_for(ALPN_CONTROL).expect("tls"), 10_000).expect("connect");
        let (b, server) = t.join().expect("accepting");
        ((server, client), a, b)
    }

    fn wait(ms: u64) -> Wait<'static> {
        Wait { what: "a test message", deadline: Some(Instant::now() + Duration::from_millis(ms)), alive: &|| Ok(()) }
    }

    #[test]
    fn messages_and_bulk_round_trip_with_nan_intact() {
        let (_endpoints, mut a, mut b) = pair();
        let moe = MoeTally {
            blocks: vec![MoeBlockTally { block: 1, tokens_per_expert: vec![5, 0, 7], dropped: 2 }],
            aux_sum: 1.25,
            z_sum: f64::NAN,
            micro_batches: 3,
        };
        let p = Prepared {
            loss_sum: f64::NAN,
            grad_norm: Some(f64::INFINITY),
            micro_batches: 3,
            moe: Some(moe.clone()),
            ..Prepared::default()
        };
        send(&mut a, &ToParent::Prepared { prepared: WirePrepared::new(&p), snapshot: Snapshot::default() }).expect("send");
        let data = [1.5f32, -0.0, f32::NAN];
        send(&mut a, &ToParent::Exported { counters: StateCounters::default(), buffers: describe(&[("master", &data)]) }).expect("send");
        send_bulk(&mut a, &[&data]).expect("bulk");
        let Ok(ToParent::Prepared { prepared, .. }) = recv(&mut b, "a reply", &wait(5000)) else { panic!("not Prepared") };
        let back = prepared.prepared();
        assert!(back.loss_sum.is_nan() && back.grad_norm == Some(f64::INFINITY) && back.micro_batches == 3);
        let m = back.moe.expect("the MoE tally crossed");
        assert_eq!((&m.blocks, m.aux_sum, m.micro_batches), (&moe.blocks, 1.25, 3));
        assert!(m.z_sum.is_nan());
        let Ok(ToParent::Exported { buffers, .. }) = recv(&mut b, "a reply", &wait(5000)) else { panic!("not Exported") };
        let got = recv_bulk(&mut b, &buffers, 16, &wait(5000)).expect("bulk");
        assert_eq!(bytemuck::cast_slice::<f32, u32>(&got[0]), bytemuck::cast_slice::<f32, u32>(&data));
    }

    #[test]
    fn malformed_oversized_and_silent_peers_are_errors() {
        let (_endpoints, mut a, mut b) = pair();
        a.write_frame(b"nope!".to_vec()).expect("write");
        assert!(matches!(recv::<ToParent>(&mut b, "a reply", &wait(5000)), Err(WireError::Malformed { .. })));
        let huge = ToParent::Failed { error: WireComputeError::failed("x".repeat(FRAME_BYTES_MAX + 1)) };
        assert!(matches!(send(&mut a, &huge), Err(WireError::TooLarge { .. })));
        assert!(matches!(recv::<ToParent>(&mut b, "a reply", &wait(300)), Err(WireError::Timeout { .. })));
        let descs = vec![BulkDesc { name: "m".into(), len: 1000, crc32c: 0 }];
        assert!(matches!(recv_bulk(&mut b, &descs, 10, &wait(300)), Err(WireError::Bulk { .. })));
        a.close("bye");
        assert!(matches!(recv::<ToParent>(&mut b, "a reply", &wait(5000)), Err(WireError::Closed)));
    }

    #[test]
    fn slice_decoding_matches_the_stream_rules() {
        let body = encode(&ToWorker::Prepare { step: 4, epoch: 1, attempt: 0 });
        let mut bytes = (body.len() as u32).to_le_bytes().to_vec();
        bytes.extend_from_slice(&body);
        bytes.push(7);
        let (msg, rest) = decode_for_fuzz::<ToWorker>(&bytes, "a request").expect("decodes");
        assert!(matches!(msg, ToWorker::Prepare { step: 4, epoch: 1, attempt: 0 }) && rest == [7]);
        assert!(matches!(decode_for_fuzz::<ToWorker>(&bytes[..10], "a request"), Err(WireError::Closed)));
        let huge = (FRAME_BYTES_MAX as u32 + 1).to_le_bytes();
        assert!(matches!(decode_for_fuzz::<ToWorker>(&huge, "a request"), Err(WireError::TooLarge { .. })));
    }

    #[test]
    fn every_message_kind_round_trips_and_a_bad_scaler_text_is_refused() {
        let counters = StateCounters {
            optimizer_steps: Some(3),
            applied: 2,
            skipped: 1,
            scaler: Some(serde_json::json!({"scale": 1024.0, "good": 7})),
        };
        let msgs = vec![
            ToWorker::Assign {
                rank: 1,
                world: 3,
                config: "{}".into(),
                identity: Some(AssignedIdentity { ca_pem: "ca".into(), cert_pem: "cert".into() }),
            },
            ToWorker::Start { master_start: 4, counters: counters.clone(), buffers: describe(&[("master", &[1.0, 2.0])]), step: 6 },
            ToWorker::Commit { step: 5 },
            ToWorker::Mesh { addrs: vec!["127.0.0.1:5".into()], names: vec!["node-0".into()] },
        ];
        for m in &msgs {
            assert_eq!(&decode::<ToWorker>(&encode(m), "a request").expect("decodes"), m);
        }
        let up = ToParent::Committed { snapshot: Snapshot { applied: 3, scale_bits: Some(7), ..Snapshot::default() } };
        assert_eq!(decode::<ToParent>(&encode(&up), "a reply").expect("decodes"), up);
        // A compute error keeps its kind, the peer's rank and what a torn commit reached.
        let torn = ComputeError::Lost { rank: Some(2), why: "peer 2 gone".into() }.torn(Some(7));
        let failed = ToParent::Failed { error: WireComputeError::from(torn.clone()) };
        let Ok(ToParent::Failed { error }) = decode::<ToParent>(&encode(&failed), "a reply") else { panic!("not Failed") };
        assert_eq!(ComputeError::from(error), torn);
        // A scaler state whose JSON text does not parse is a malformed message, not a panic.
        let mut bytes = encode(&ToParent::Exported { counters, buffers: Vec::new() });
        let at = bytes.windows(5).position(|w| w == b"scale").expect("the JSON text is in the frame");
        bytes[at - 2] = b'}';
        assert!(matches!(decode::<ToParent>(&bytes, "a reply"), Err(WireError::Malformed { .. })));
        assert!(matches!(decode::<ToParent>(&encode(&msgs[0]), "a reply"), Err(WireError::Malformed { expected: "a reply", .. })));
    }
}
