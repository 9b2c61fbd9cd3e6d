//! [`BlockPool`]: the cache blocks of a [`super::Backend`], handed out to sequences with
//! reference counts, and the prefix cache: a full block is recorded under the hash of its tokens
//! and every token before them, so a later sequence with the same prefix takes the block instead
//! of computing it again. A block nobody holds stays cached (and findable) until it is handed
//! out again, least recently released first.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

/// The key of a full block: the hash of the previous block's key and this block's tokens.
pub type BlockHash = u64;

/// The key of the full block holding `tokens` after the block keyed `parent` (`None`: the first).
pub fn block_hash(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    // SipHash with fixed keys: the same on every run and platform.
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new_with_keys(0x7465_7373, 0x6572_6121);
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// What a cached block holds, checked on a hit so a hash collision can never hand out a block of
/// other tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Cached {
    hash: BlockHash,
    parent: Option<BlockHash>,
    tokens: Vec<u32>,
}

/// Reference-counted cache blocks with a prefix cache.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    refs: Vec<u32>,
    /// Blocks nobody holds, by release stamp (oldest first): the next handed out.
    free: BTreeMap<u64, u32>,
    /// The stamp a free block sits under in `free`.
    free_stamp: Vec<u64>,
    stamp: u64,
    /// Full blocks by key, and the key and content of each.
    by_hash: HashMap<BlockHash, u32>,
    cached: Vec<Option<Cached>>,
}

impl BlockPool {
    /// `num_blocks` blocks of `block_size` positions, all free.
    pub fn new(num_blocks: usize, block_size: usize) -> BlockPool {
        assert!(block_size > 0, "block_size must be positive");
        let free = (0..num_blocks as u32).map(|b| (u64::from(b), b)).collect();
        BlockPool {
            block_size,
            refs: vec![0; num_blocks],
            free,
            free_stamp: (0..num_blocks as u64).collect(),
            stamp: num_blocks as u64,
            by_hash: HashMap::new(),
            cached: vec![None; num_blocks],
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    /// Blocks nobody holds (cached ones included: they are handed out when needed).
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// How many sequences hold block `b`.
    pub fn refs(&self, b: u32) -> u32 {
        self.refs[b as usize]
    }

    /// A block for one holder, its old cached content forgotten; `None` when every block is held.
    pub fn alloc(&mut self) -> Option<u32> {
        let (_, b) = self.free.pop_first()?;
        if let Some(c) = self.cached[b as usize].take() {
            self.by_hash.remove(&c.hash);
        }
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// One more holder of the held block `b`.
    pub fn retain(&mut self, b: u32) {
        assert!(self.refs[b as usize] > 0, "retain of free block {b}");
        self.refs[b as usize] += 1;
    }

    /// One holder fewer; the last one's release makes the block free (still cached if it was).
    pub fn release(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        assert!(*r > 0, "release of free block {b}");
        *r -= 1;
        if *r == 0 {
            self.free.insert(self.stamp, b);
            self.free_stamp[b as usize] = self.stamp;
            self.stamp += 1;
        }
    }

    /// The cached block holding `tokens` after the block keyed `parent`, taken for one more holder
    /// (out of the free blocks if nobody held it), with its key.
    pub fn lookup(&mut self, parent: Option<BlockHash>, tokens: &[u32]) -> Option<(u32, BlockHash)> {
        let hash = block_hash(parent, tokens);
        let b = *self.by_hash.get(&hash)?;
        let c = self.cached[b as usize].as_ref()?;
        if c.parent != parent || c.tokens != tokens {
            return None;
        }
        if self.refs[b as usize] == 0 {
            self.free.remove(&self.free_stamp[b as usize]);
        }
        self.refs[b as usize] += 1;
        Some((b, hash))
    }

    /// Records the held, fully written block `b` as holding `tokens` after the block keyed
    /// `parent`; returns its key. A key already recorded for another block keeps that block.
    pub fn register(&mut self, b: u32, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        debug_assert_eq!(tokens.len(), self.block_size);
        let hash = block_hash(parent, tokens);
        if self.cached[b as usize].is_none() && !self.by_hash.contains_key(&hash) {
            self.by_hash.insert(hash, b);
            self.cached[b as usize] = Some(Cached { hash, parent, tokens: tokens.to_vec() });
        }
        hash
    }

    /// Checks the bookkeeping: every block is either held or free, never both (tests).
    pub fn check(&self) {
        let held = self.refs.iter().filter(|&&r| r > 0).count();
        assert_eq!(held + self.free.len(), self.refs.len(), "held + free != blocks");
        for &b in self.free.values() {
            assert_eq!(self.refs[b as usize], 0, "free block {b} is held");
        }
        for (h, &b) in &self.by_hash {
            assert_eq!(self.cached[b as usize].as_ref().map(|c| c.hash), Some(*h), "hash index of block {b}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_released_cached_block_is_found_again_until_handed_out() {
        let mut p = BlockPool::new(2, 2);
        let a = p.alloc().unwrap();
        let h = p.register(a, None, &[1, 2]);
        p.release(a);
        assert_eq!(p.num_free(), 2);
        assert_eq!(p.lookup(None, &[1, 2]), Some((a, h)));
        assert_eq!(p.num_free(), 1);
        assert_eq!(p.lookup(None, &[1, 3]), None, "other tokens");
        assert_eq!(p.lookup(Some(h), &[1, 2]), None, "other parent");
        p.release(a);
        // The other block was freed first, so it goes first; then the cached one, forgotten.
        let b = p.alloc().unwrap();
        assert_ne!(a, b);
        assert_eq!(p.alloc(), Some(a));
        assert_eq!(p.alloc(), None);
        p.release(a);
        assert_eq!(p.lookup(None, &[1, 2]), None, "handed out again: forgotten");
        p.check();
    }

    #[test]
    fn a_shared_block_is_free_only_after_its_last_holder_releases_it() {
        let mut p = BlockPool::new(1, 4);
        let a = p.alloc().unwrap();
        p.retain(a);
        p.release(a);
        assert_eq!(p.num_free(), 0);
        p.release(a);
        assert_eq!(p.num_free(), 1);
        p.check();
    }
}
