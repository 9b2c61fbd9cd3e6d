//! What the serving process and its ranks say to each other on a control connection's request
//! lane: rkyv messages checked with bytecheck on receipt (`tessera_fleet::wire`'s framing and
//! limits), and the residual stream of a step as one bulk f32 transfer after its header, with
//! its length and CRC32C in the header (checked before and after reading).
//!
//! A rank: the fleet's `Join` (`tessera_fleet::agent::dial`: who it is, its proof, the rank it
//! asks for) → `Hello` (what it loaded) → `Assign` (its rank, blocks, the cache's geometry) →
//! `Ready` (with the fingerprint of the parameters it holds) → then, per step, `Tables` (the
//! block-table changes, in frames of at most [`super::tables::ENTRIES_PER_FRAME`] entries) and
//! `Step` + the stream in → `Done` + the stream out, until `Shutdown`. No frame grows with the
//! context: a step's frame names each sequence's rows, start and table slot, never its tokens
//! or its table.

use tessera_fleet::wire::BulkDesc;

/// The serving process to a rank.
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum ToRank {
    /// Be rank `rank`: hold blocks `blocks_start..blocks_end` and their layers of a cache of
    /// `num_blocks` blocks of `block_size` positions; linears in int8 when `int8` (the serving
    /// process's `--weights`: a rank has no format of its own).
    Assign { rank: u64, blocks_start: u64, blocks_end: u64, block_size: u64, num_blocks: u64, int8: bool },
    /// Changes to the rank's copy of the block tables (applied in order, before the next step).
    Tables { updates: Vec<TableUpdate> },
    /// Run the rank's blocks on the stream `x` (a bulk buffer after this frame) of a step whose
    /// rows are `seqs`' rows in order, and answer `Done` with the stream after them.
    Step { id: u64, seqs: Vec<WireSeq>, x: BulkDesc },
    /// Exit.
    Shutdown,
}

/// Table slot `slot` becomes its first `keep` entries followed by `append`.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct TableUpdate {
    pub slot: u32,
    pub keep: u32,
    pub append: Vec<u32>,
}

/// One sequence of a step: its rows of the stream (its tokens, which stay in the serving
/// process), the position of the first, and the slot holding its block table (which covers at
/// least the blocks those positions need).
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct WireSeq {
    pub rows: u32,
    pub start: u64,
    pub slot: u32,
}

/// A rank to the serving process.
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum FromRank {
    /// The rank's model as it loaded it (`ModelConfig`'s `Debug` text, checked against the
    /// serving process's: the same binary version prints the same text for the same model).
    Hello { pid: u32, model: String },
    /// The rank holds its blocks and cache; `params_blake3`: the fingerprint of the parameters
    /// of its blocks ([`super::span_blake3`]), checked against the serving process's model.
    Ready { param_bytes: u64, cache_bytes: u64, params_blake3: String },
    /// Step `id` ran; the stream follows as a bulk buffer.
    Done { id: u64, y: BulkDesc },
    /// The rank cannot go on (it exits after sending this).
    Failed { why: String },
}
