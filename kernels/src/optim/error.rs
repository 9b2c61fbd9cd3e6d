//! The error type of the optimizer module: every variant names what was wrong and the values seen.

use std::ops::Range;

/// Errors from layouts, optimizer steps, checkpoint state and loss scaling.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OptimError {
    /// Segments of a [`super::FlatLayout`] must be sorted, contiguous and start at 0.
    #[error("flat layout segment {index} is {found:?} but must start at {expected_start} (segments must be sorted, contiguous and non-decreasing)")]
    LayoutNotContiguous { index: usize, expected_start: usize, found: Range<usize> },
    /// A shard range used for norms must have block-aligned bounds (or end at the total).
    #[error("shard range {range:?} is not aligned to NORM_BLOCK={block} (bounds must be multiples of {block} or equal the total length {total})")]
    ShardRangeUnaligned { range: Range<usize>, block: usize, total: usize },
    /// A shard range reaches beyond the flat buffer or is reversed.
    #[error("shard range {range:?} is invalid for a flat buffer of {total} elements")]
    ShardRangeOutOfBounds { range: Range<usize>, total: usize },
    /// A buffer passed in has the wrong number of elements.
    #[error("{what} has {found} elements, expected {expected}")]
    LengthMismatch { what: &'static str, expected: usize, found: usize },
    /// A checkpoint lacks a state buffer the optimizer needs.
    #[error("{optimizer} checkpoint state is missing buffer \"{name}\"")]
    MissingStateBuffer { optimizer: &'static str, name: &'static str },
    /// A checkpoint state buffer has the wrong number of elements.
    #[error("{optimizer} checkpoint buffer \"{name}\" has {found} elements, expected {expected}")]
    StateBufferLength { optimizer: &'static str, name: String, expected: usize, found: usize },
    /// A checkpoint carries a buffer this optimizer does not know (or the same one twice).
    #[error("{optimizer} checkpoint has unexpected or duplicate buffer \"{name}\" (expected {expected:?})")]
    UnexpectedStateBuffer { optimizer: &'static str, name: String, expected: Vec<&'static str> },
    /// A hyper-parameter is out of its valid range.
    #[error("{optimizer}.{name} = {value} is invalid: expected {expected}")]
    InvalidParam { optimizer: &'static str, name: &'static str, value: f64, expected: &'static str },
    /// DeepSpeed aborts when an overflow happens while the loss scale already sits at its floor.
    #[error("loss scale {scale} is already at the minimum {min_scale} and gradients overflowed again; cannot decrease the scale further")]
    LossScaleAtMinimum { scale: f32, min_scale: f32 },
    /// Loss-scaler checkpoint state that cannot come from a valid run.
    #[error("invalid loss scaler state: {field} = {value} ({expected})")]
    InvalidLossScalerState { field: &'static str, value: f64, expected: &'static str },
    /// A collective norm reduction failed (a peer was lost, the group was aborted). A step that
    /// returns this changed nothing: the shard is as it was before the call.
    #[error("the norm all-reduce failed: {0}")]
    NormReduce(String),
}
