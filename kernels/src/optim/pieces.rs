//! Splitting a shard into parallel work pieces that never straddle a tensor boundary, so each
//! piece has one weight-decay flag and one segment index.

use std::ops::Range;

use super::norm::FlatLayout;

/// A run of shard-local elements inside one tensor, at most `chunk` long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Piece {
    /// Shard-local element range.
    pub local: Range<usize>,
    /// Index of the tensor (segment) this piece belongs to.
    pub segment: usize,
    /// Whether weight decay applies to that tensor.
    pub decay: bool,
}

/// Cuts `shard_range` at tensor boundaries and every `chunk` elements; the pieces are sorted and
/// cover `0..shard_range.len()` exactly. `decay` has one flag per segment of `layout`, and
/// `shard_range` must already be checked to lie inside the layout.
pub(crate) fn shard_pieces(layout: &FlatLayout, decay: &[bool], shard_range: &Range<usize>, chunk: usize) -> Vec<Piece> {
    let lo = shard_range.start;
    let mut pieces = Vec::with_capacity(shard_range.len() / chunk + 8);
    let Some(first) = layout.segment_of(lo) else {
        return pieces;
    };
    for (segment, seg) in layout.segments().iter().enumerate().skip(first) {
        if seg.start >= shard_range.end {
            break;
        }
        let mut a = seg.start.max(lo);
        let b = seg.end.min(shard_range.end);
        while a < b {
            let e = b.min(a + chunk);
            pieces.push(Piece { local: a - lo..e - lo, segment, decay: decay[segment] });
            a = e;
        }
    }
    pieces
}

/// Splits `buf` into the sub-slices of consecutive `pieces` (which must tile `0..buf.len()`).
pub(crate) fn split_mut<'a>(mut buf: &'a mut [f32], pieces: &[Piece]) -> Vec<&'a mut [f32]> {
    let mut out = Vec::with_capacity(pieces.len());
    for p in pieces {
        let (head, tail) = std::mem::take(&mut buf).split_at_mut(p.local.len());
        out.push(head);
        buf = tail;
    }
    out
}

/// Shared-slice version of [`split_mut`].
pub(crate) fn split_ref<'a>(buf: &'a [f32], pieces: &[Piece]) -> Vec<&'a [f32]> {
    pieces.iter().map(|p| &buf[p.local.clone()]).collect()
}
