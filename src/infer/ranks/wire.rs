//! What the serving process and its ranks say to each other on a control connection's request
//! lane: rkyv messages checked with bytecheck on receipt (`tessera_fleet::wire`'s framing and
//! limits), and the residual stream of a step as one bulk f32 transfer after its header, with
//! its length and CRC32C in the header (checked before and after reading).
//!
//! A rank: `Hello` (what it loaded) → `Assign` (its blocks, the cache's geometry) → `Ready` →
//! then, per step, `Step` + the stream in → `Done` + the stream out, until `Shutdown`.

use tessera_fleet::wire::BulkDesc;

/// The serving process to a rank.
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum ToRank {
    /// Hold blocks `blocks_start..blocks_end` and their layers of a cache of `num_blocks`
    /// blocks of `block_size` positions; linears in int8 when `int8`.
    Assign { blocks_start: u64, blocks_end: u64, block_size: u64, num_blocks: u64, int8: bool },
    /// Run the rank's blocks on the stream `x` (a bulk buffer after this frame) of a step whose
    /// rows are `seqs`' tokens in order, and answer `Done` with the stream after them.
    Step { id: u64, seqs: Vec<WireSeq>, x: BulkDesc },
    /// Exit.
    Shutdown,
}

/// One sequence of a step: its tokens (the step's rows), the position of the first, and its
/// block table up to the blocks those positions need.
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct WireSeq {
    pub tokens: Vec<u32>,
    pub start: u64,
    pub table: Vec<u32>,
}

/// A rank to the serving process.
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum FromRank {
    /// The rank's model, as it loaded it (checked against the serving process's).
    Hello { rank: u64, pid: u32, num_params: u64, n_layer: u64, d_model: u64, vocab_size: u64 },
    /// The rank holds its blocks and cache.
    Ready { param_bytes: u64, cache_bytes: u64 },
    /// Step `id` ran; the stream follows as a bulk buffer.
    Done { id: u64, y: BulkDesc },
    /// The rank cannot go on (it exits after sending this).
    Failed { why: String },
}
