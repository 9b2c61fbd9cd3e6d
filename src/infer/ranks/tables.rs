//! Block tables on the ranks, sent as changes: every rank keeps a copy of the tables in numbered
//! slots ([`TableStore`]); the serving process keeps the same copy ([`TableSender`]) and sends,
//! before each step, only what turns the slots into that step's tables ([`TableUpdate`]: keep a
//! prefix, append). A decoding sequence's table grows by one entry a block, so a step of `S`
//! decoding sequences sends about `S / block_size` entries, whatever the context; a new or
//! resumed sequence sends its table once. Updates travel in frames of at most
//! [`ENTRIES_PER_FRAME`] entries (a table longer than that is cut over several), so no frame
//! nears the control plane's limit (`tessera_fleet::wire::FRAME_BYTES_MAX`) however long the
//! contexts or many the sequences. Sans-IO: both halves are plain data, tested without a network.
//!
//! Which slot a sequence's table goes to is the sender's choice and affects only how much is
//! sent, never what a rank holds: an update says the whole resulting table (its kept prefix is the
//! slot's current one, which the sender mirrors). The sender finds a sequence's slot of the
//! previous step by the table's entries (a sequence's last block is written by it alone, and a
//! growing table keeps its prefix), else takes the least recently used one.

use std::collections::HashMap;

use anyhow::{ensure, Result};

use super::wire::TableUpdate;

/// Table entries in one `Tables` frame at most (4 bytes each: a quarter of the frame limit).
pub const ENTRIES_PER_FRAME: usize = 64 * 1024;
/// Slots a rank accepts (a bound on what a peer can make it allocate).
pub const SLOTS_MAX: usize = 1 << 16;
/// Slots the sender keeps before it reuses the least recently used (more when one step has
/// more sequences).
const SLOTS_KEPT: usize = 1024;

/// The serving process's mirror of the ranks' slots.
#[derive(Default)]
pub struct TableSender {
    slots: Vec<Vec<u32>>,
    /// The step each slot was last used in.
    used: Vec<u64>,
    /// A slot by its table's last entry (the newest slot to end there).
    by_tail: HashMap<u32, usize>,
    step: u64,
}

impl TableSender {
    /// The slot of each of a step's `tables`, and the updates (in frames) that make every rank's
    /// slots hold them. Every table must be non-empty.
    pub fn step(&mut self, tables: &[&[u32]]) -> (Vec<u32>, Vec<Vec<TableUpdate>>) {
        self.step += 1;
        let mut slots = Vec::with_capacity(tables.len());
        let mut updates = Vec::new();
        for t in tables {
            let s = self.find(t).unwrap_or_else(|| self.oldest());
            self.used[s] = self.step;
            let old = &self.slots[s];
            let keep = old.iter().zip(t.iter()).take_while(|(a, b)| a == b).count();
            if keep < t.len() || old.len() != t.len() {
                if let Some(&tail) = old.last() {
                    if self.by_tail.get(&tail) == Some(&s) {
                        self.by_tail.remove(&tail);
                    }
                }
                updates.extend(cut(s as u32, keep, &t[keep..]));
                self.slots[s] = t.to_vec();
            }
            self.by_tail.insert(*t.last().expect("a step's table names at least one block"), s);
            slots.push(s as u32);
        }
        (slots, frames(updates))
    }

    /// A slot not yet used this step whose table is a prefix of `t`'s first entries, found by
    /// its last entry (longest first).
    fn find(&self, t: &[u32]) -> Option<usize> {
        (0..t.len()).rev().find_map(|i| {
            let s = *self.by_tail.get(&t[i])?;
            (self.used[s] != self.step && self.slots[s].len() == i + 1 && self.slots[s][..] == t[..=i]).then_some(s)
        })
    }

    /// A new slot while there are fewer than [`SLOTS_KEPT`] (or every one is used this step),
    /// else the least recently used.
    fn oldest(&mut self) -> usize {
        let lru = (0..self.slots.len()).filter(|&s| self.used[s] != self.step).min_by_key(|&s| self.used[s]);
        match lru {
            Some(s) if self.slots.len() >= SLOTS_KEPT => s,
            _ => {
                self.slots.push(Vec::new());
                self.used.push(0);
                self.slots.len() - 1
            }
        }
    }
}

/// `append` to slot `slot` after `keep` entries, as updates of at most [`ENTRIES_PER_FRAME`]
/// entries each.
fn cut(slot: u32, keep: usize, append: &[u32]) -> Vec<TableUpdate> {
    if append.is_empty() {
        return vec![TableUpdate { slot, keep: keep as u32, append: Vec::new() }];
    }
    append
        .chunks(ENTRIES_PER_FRAME)
        .enumerate()
        .map(|(i, part)| TableUpdate { slot, keep: (keep + i * ENTRIES_PER_FRAME) as u32, append: part.to_vec() })
        .collect()
}

/// Updates grouped into frames of at most [`ENTRIES_PER_FRAME`] appended entries.
fn frames(updates: Vec<TableUpdate>) -> Vec<Vec<TableUpdate>> {
    let mut out: Vec<Vec<TableUpdate>> = Vec::new();
    let mut entries = 0;
    for u in updates {
        // Each update also costs a few words of its own: count it as one entry at least.
        let n = u.append.len().max(1);
        if out.is_empty() || entries + n > ENTRIES_PER_FRAME {
            out.push(Vec::new());
            entries = 0;
        }
        entries += n;
        out.last_mut().expect("a frame was just pushed").push(u);
    }
    out
}

/// A rank's copy of the tables.
pub struct TableStore {
    slots: Vec<Vec<u32>>,
    /// The longest table a sequence can have (the context's blocks).
    entries_max: usize,
}

impl TableStore {
    pub fn new(entries_max: usize) -> TableStore {
        TableStore { slots: Vec::new(), entries_max }
    }

    /// Applies one update from the serving process, checked: a slot below [`SLOTS_MAX`], a kept
    /// prefix it holds, a table no longer than the context.
    pub fn apply(&mut self, u: &TableUpdate) -> Result<()> {
        let (s, keep) = (u.slot as usize, u.keep as usize);
        ensure!(s < SLOTS_MAX, "table slot {s}: at most {SLOTS_MAX} slots");
        if s >= self.slots.len() {
            self.slots.resize_with(s + 1, Vec::new);
        }
        let t = &mut self.slots[s];
        ensure!(keep <= t.len(), "table slot {s}: keep {keep} entries of {}", t.len());
        ensure!(
            keep + u.append.len() <= self.entries_max,
            "table slot {s}: {} entries, the context has {} blocks",
            keep + u.append.len(),
            self.entries_max
        );
        t.truncate(keep);
        t.extend_from_slice(&u.append);
        Ok(())
    }

    /// The table in slot `slot`.
    pub fn table(&self, slot: u32) -> Result<&[u32]> {
        match self.slots.get(slot as usize) {
            Some(t) => Ok(t),
            None => anyhow::bail!("table slot {slot} was never sent"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_kernels::tensor::Rng;

    /// Applies a step's frames to `store`; the largest frame's entries.
    fn apply(store: &mut TableStore, frames: &[Vec<TableUpdate>]) -> usize {
        frames.iter().map(|f| f.iter().map(|u| store.apply(u).map(|()| u.append.len()).unwrap()).sum::<usize>()).max().unwrap_or(0)
    }

    /// Seeded steps of sequences that grow, start (some sharing a prefix), end and come back with
    /// their blocks reused: the rank's copy always equals the step's tables, every frame stays
    /// under the budget, and decoding sends a few entries, not the tables.
    #[test]
    fn the_ranks_copy_equals_every_steps_tables_and_frames_stay_bounded() {
        let bs = 4;
        for seed in 0..20u64 {
            let mut rng = Rng::new(seed);
            let mut pick = |n: usize| rng.gen_range(n as u64) as usize;
            let (mut sender, mut store) = (TableSender::default(), TableStore::new(1 << 20));
            let mut live: Vec<(Vec<u32>, usize)> = Vec::new(); // (table, positions)
            let mut next_block = 0u32;
            for _ in 0..200 {
                if live.len() < 12 && pick(3) == 0 {
                    let mut t: Vec<u32> = if !live.is_empty() && pick(2) == 0 { live[0].0[..1].to_vec() } else { vec![] };
                    let len = 1 + pick(40) + if pick(10) == 0 { 70_000 } else { 0 };
                    t.extend((t.len()..len.div_ceil(bs)).map(|_| {
                        next_block = (next_block + 1) % 5000;
                        next_block
                    }));
                    live.push((t, len));
                }
                if !live.is_empty() && pick(8) == 0 {
                    live.remove(pick(live.len()));
                }
                for (t, pos) in &mut live {
                    *pos += 1;
                    if t.len() < pos.div_ceil(bs) {
                        next_block = (next_block + 1) % 5000;
                        t.push(next_block);
                    }
                }
                let tables: Vec<&[u32]> = live.iter().map(|(t, _)| &t[..]).collect();
                let (slots, frames) = sender.step(&tables);
                assert!(frames.iter().all(|f| f.iter().map(|u| u.append.len().max(1)).sum::<usize>() <= ENTRIES_PER_FRAME));
                apply(&mut store, &frames);
                for (t, s) in tables.iter().zip(&slots) {
                    assert_eq!(store.table(*s).unwrap(), *t, "seed {seed}");
                }
                let mut distinct = slots.clone();
                distinct.sort_unstable();
                distinct.dedup();
                assert_eq!(distinct.len(), slots.len(), "two sequences of a step share a slot");
            }
        }
    }

    #[test]
    fn decoding_sends_only_new_blocks() {
        let mut sender = TableSender::default();
        let long: Vec<Vec<u32>> = (0..8u32).map(|s| (0..100_000).map(|i| s * 100_000 + i).collect()).collect();
        let tables: Vec<&[u32]> = long.iter().map(|t| &t[..]).collect();
        let (first, frames) = sender.step(&tables);
        let sent: usize = frames.iter().flatten().map(|u| u.append.len()).sum();
        assert_eq!(sent, 800_000);
        assert!(frames.len() >= 800_000 / ENTRIES_PER_FRAME, "{} frames", frames.len());
        let mut grown = long.clone();
        grown[3].push(9_999_999);
        let tables: Vec<&[u32]> = grown.iter().map(|t| &t[..]).collect();
        let (again, frames) = sender.step(&tables);
        assert_eq!(again, first, "each sequence keeps its slot");
        assert_eq!(frames, vec![vec![TableUpdate { slot: first[3], keep: 100_000, append: vec![9_999_999] }]]);
    }

    #[test]
    fn a_bad_update_is_refused_by_slot_and_count() {
        let mut store = TableStore::new(10);
        let e = store.apply(&TableUpdate { slot: 2, keep: 1, append: vec![] }).unwrap_err();
        assert!(e.to_string().contains("table slot 2: keep 1 entries of 0"), "{e}");
        let e = store.apply(&TableUpdate { slot: 0, keep: 0, append: vec![0; 11] }).unwrap_err();
        assert!(e.to_string().contains("11 entries, the context has 10 blocks"), "{e}");
        let e = store.apply(&TableUpdate { slot: SLOTS_MAX as u32, keep: 0, append: vec![] }).unwrap_err();
        assert!(e.to_string().contains("at most"), "{e}");
        assert!(store.table(5).is_err());
    }
}
