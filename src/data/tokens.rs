//! [`Tokens`]: a shared, read-only run of token ids, either held in memory or memory-mapped
//! from the token cache, so that every rank of a host shares one copy of the corpus.

use std::ops::{Deref, Range};
use std::sync::Arc;

use memmap2::Mmap;

/// Where the ids live.
enum Store {
    Owned(Vec<u32>),
    /// A token-cache file; the ids are the little-endian u32s from `offset` on.
    ///
    /// Invariant: the file is never written in place (the cache replaces a file by renaming a
    /// new one over it, which leaves this mapping on the old inode), so the bytes never change
    /// under a reader; `offset` is a multiple of 4 and the mapping is page-aligned, so the ids
    /// are aligned for `u32`.
    Mapped {
        map: Mmap,
        offset: usize,
    },
}

impl Store {
    fn all(&self) -> &[u32] {
        match self {
            Store::Owned(v) => v,
            // Checked when the mapping was made (`Tokens::mapped`); cannot fail afterwards.
            Store::Mapped { map, offset } => bytemuck::cast_slice(&map[*offset..]),
        }
    }
}

/// A cheaply cloned view of token ids (`Deref<Target = [u32]>`).
#[derive(Clone)]
pub struct Tokens {
    store: Arc<Store>,
    range: Range<usize>,
}

impl Tokens {
    /// The ids `map[offset..]` holds (little-endian u32), split at `split` into two views.
    /// `None` when the bytes cannot be viewed as `u32` here (misaligned, a length that is not a
    /// multiple of 4, or a big-endian machine): the caller then reads them into memory.
    pub(super) fn mapped(map: Mmap, offset: usize, split: usize) -> Option<(Tokens, Tokens)> {
        let body = map.get(offset..)?;
        if cfg!(target_endian = "big") || bytemuck::try_cast_slice::<u8, u32>(body).is_err() {
            return None;
        }
        let len = body.len() / 4;
        if split > len {
            return None;
        }
        let store = Arc::new(Store::Mapped { map, offset });
        Some((Tokens { store: Arc::clone(&store), range: 0..split }, Tokens { store, range: split..len }))
    }

    /// Whether the ids are memory-mapped (shared with every process that maps the same file).
    pub fn is_mapped(&self) -> bool {
        matches!(*self.store, Store::Mapped { .. })
    }
}

impl From<Vec<u32>> for Tokens {
    fn from(v: Vec<u32>) -> Self {
        let range = 0..v.len();
        Tokens { store: Arc::new(Store::Owned(v)), range }
    }
}

impl Deref for Tokens {
    type Target = [u32];

    fn deref(&self) -> &[u32] {
        &self.store.all()[self.range.clone()]
    }
}

impl PartialEq for Tokens {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for Tokens {}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokens({} ids{})", self.len(), if self.is_mapped() { ", mapped" } else { "" })
    }
}
