//! Deterministic, resumable training sampler and the fixed validation batches.
//!
//! The training stream is cut into windows of `T + 1` tokens starting at
//! multiples of `T` (window `w` = tokens `[w*T, w*T + T]`; consecutive windows
//! share only their boundary token, so every token after the first is a target
//! exactly once per epoch). Epoch `e` visits all windows in the order of a
//! Fisher–Yates permutation keyed by `(seed, e)`. Global sample `i` is slot
//! `i % windows` of epoch `i / windows`, so a batch's content depends only on
//! `(seed, sample index)`, never on how many ranks share the work.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{DataError, Tokens};

/// SplitMix64 (Steele, Lea, Flood 2014): x += golden gamma; z = x;
/// z = (z ^ z>>30) * C1; z = (z ^ z>>27) * C2; out = z ^ z>>31.
struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform integer in `[0, bound)` (rejection sampling, no modulo bias).
    fn below(&mut self, bound: u64) -> u64 {
        let zone = u64::MAX - (u64::MAX % bound);
        loop {
            let x = self.next_u64();
            if x < zone {
                return x % bound;
            }
        }
    }
}

/// Visiting order of the windows in `epoch`: Fisher–Yates keyed by (seed, epoch).
fn permutation(seed: u64, epoch: u64, windows: u32) -> Arc<[u32]> {
    let key = SplitMix64::new(seed).next_u64() ^ epoch;
    let mut rng = SplitMix64::new(SplitMix64::new(key).next_u64());
    let mut order: Vec<u32> = (0..windows).collect();
    for i in (1..order.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order.into()
}

/// Resumable sampler state: the seed and the number of samples consumed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    pub seed: u64,
    pub cursor: u64,
}

impl SamplerState {
    /// `{"seed": u64, "cursor": u64}`.
    pub fn to_json(&self) -> Value {
        serde_json::json!({ "seed": self.seed, "cursor": self.cursor })
    }

    /// Parses the object written by [`SamplerState::to_json`].
    pub fn from_json(value: &Value) -> Result<Self, DataError> {
        let field = |key: &'static str| -> Result<u64, DataError> {
            match value.get(key) {
                Some(v) => v
                    .as_u64()
                    .ok_or_else(|| DataError::BadState { key, problem: format!("expected an unsigned 64-bit integer, found {v}") }),
                None => Err(DataError::BadState { key, problem: format!("missing from {value}") }),
            }
        };
        Ok(Self { seed: field("seed")?, cursor: field("cursor")? })
    }
}

/// Serves `(inputs, targets)` windows of the training stream; see the module doc.
pub struct Sampler {
    tokens: Tokens,
    seq_len: usize,
    windows: u32,
    seed: u64,
    cursor: u64,
    /// The permutations of the two most recently used epochs.
    cache: Mutex<Vec<(u64, Arc<[u32]>)>>,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler")
            .field("tokens", &self.tokens.len())
            .field("seq_len", &self.seq_len)
            .field("windows", &self.windows)
            .field("seed", &self.seed)
            .field("cursor", &self.cursor)
            .finish()
    }
}

impl Sampler {
    /// A sampler at cursor 0; needs at least `seq_len + 1` tokens.
    pub fn new(tokens: impl Into<Tokens>, seq_len: usize, seed: u64) -> Result<Self, DataError> {
        let tokens = tokens.into();
        if seq_len == 0 {
            return Err(DataError::BadArgument { what: "seq_len", expected: ">= 1", found: "0".into() });
        }
        if tokens.len() < seq_len + 1 {
            return Err(DataError::TooShort { what: "training split".into(), found: tokens.len(), needed: seq_len + 1, seq_len });
        }
        let windows = u32::try_from((tokens.len() - 1) / seq_len).map_err(|_| DataError::BadArgument {
            what: "number of training windows",
            expected: "<= 4294967295 (raise seq_len)",
            found: ((tokens.len() - 1) / seq_len).to_string(),
        })?;
        Ok(Self { tokens, seq_len, windows, seed, cursor: 0, cache: Mutex::new(Vec::new()) })
    }

    /// A sampler positioned at `state`.
    pub fn resume(tokens: impl Into<Tokens>, seq_len: usize, state: SamplerState) -> Result<Self, DataError> {
        let mut sampler = Self::new(tokens, seq_len, state.seed)?;
        sampler.cursor = state.cursor;
        Ok(sampler)
    }

    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The run's seed (the data order's, and the MoE blocks' noise keys').
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Windows per epoch.
    pub fn windows(&self) -> u64 {
        u64::from(self.windows)
    }

    /// Samples consumed so far.
    pub fn cursor(&self) -> u64 {
        self.cursor
    }

    /// Epoch the next sample belongs to.
    pub fn epoch(&self) -> u64 {
        self.cursor / self.windows()
    }

    pub fn state(&self) -> SamplerState {
        SamplerState { seed: self.seed, cursor: self.cursor }
    }

    /// Moves to `state` (seed and cursor).
    pub fn restore(&mut self, state: SamplerState) {
        if state.seed != self.seed {
            self.lock_cache().clear();
        }
        self.seed = state.seed;
        self.cursor = state.cursor;
    }

    /// Marks `count` samples consumed (e.g. a global batch split across ranks).
    pub fn advance(&mut self, count: u64) {
        self.cursor += count;
    }

    /// Fills samples `cursor..cursor+count` and advances the cursor.
    pub fn next_batch(&mut self, count: usize, inputs: &mut [u32], targets: &mut [u32]) {
        self.fill(self.cursor, count, inputs, targets);
        self.advance(count as u64);
    }

    /// Fills samples `first_sample..first_sample+count`, row-major `[count, T]`.
    ///
    /// # Panics
    /// If `inputs` or `targets` is not exactly `count * seq_len` long.
    pub fn fill(&self, first_sample: u64, count: usize, inputs: &mut [u32], targets: &mut [u32]) {
        let t = self.seq_len;
        assert_eq!(inputs.len(), count * t, "inputs must hold count * seq_len tokens");
        assert_eq!(targets.len(), count * t, "targets must hold count * seq_len tokens");
        for row in 0..count {
            let start = self.window_start(first_sample + row as u64);
            let span = &self.tokens[start..start + t + 1];
            inputs[row * t..(row + 1) * t].copy_from_slice(&span[..t]);
            targets[row * t..(row + 1) * t].copy_from_slice(&span[1..]);
        }
    }

    /// Token offset of the window served as global sample `sample`.
    pub fn window_start(&self, sample: u64) -> usize {
        let epoch = sample / self.windows();
        let slot = (sample % self.windows()) as usize;
        let window = self.epoch_order(epoch)[slot] as usize;
        window * self.seq_len
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, Vec<(u64, Arc<[u32]>)>> {
        self.cache.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn epoch_order(&self, epoch: u64) -> Arc<[u32]> {
        let mut cache = self.lock_cache();
        if let Some((_, order)) = cache.iter().find(|(e, _)| *e == epoch) {
            return Arc::clone(order);
        }
        let order = permutation(self.seed, epoch, self.windows);
        if cache.len() >= 2 {
            cache.remove(0);
        }
        cache.push((epoch, Arc::clone(&order)));
        order
    }
}

/// Flattened `(inputs, targets)`, each `[batch, seq_len]` row-major.
pub type TokenBatch = (Vec<u32>, Vec<u32>);

/// Most validation batches one evaluation may take (`tessera.eval_iters`): an evaluation runs
/// one forward pass per batch, so this bounds its time; far more than a validation loss needs.
pub const VAL_BATCHES_MAX: u64 = 100_000;

/// The fixed validation set: `batch * iters` windows of `seq_len + 1` tokens, evenly spaced
/// from the start to the end of the validation tokens, grouped into `iters` batches. Built one
/// batch at a time ([`ValBatches::iter`]), so the set costs no memory up front.
#[derive(Debug, Clone)]
pub struct ValBatches {
    val: Tokens,
    seq_len: usize,
    batch: usize,
    iters: usize,
}

/// The validation set of `val`; refuses a zero size, more than [`VAL_BATCHES_MAX`] batches,
/// and a validation split shorter than one window.
pub fn val_batches(val: impl Into<Tokens>, seq_len: usize, batch: usize, iters: u64) -> Result<ValBatches, DataError> {
    let val = val.into();
    for (what, v) in [("seq_len", seq_len as u64), ("batch", batch as u64), ("iters", iters)] {
        if v == 0 {
            return Err(DataError::BadArgument { what, expected: ">= 1", found: "0".into() });
        }
    }
    if iters > VAL_BATCHES_MAX {
        return Err(DataError::TooManyValBatches { found: iters, max: VAL_BATCHES_MAX });
    }
    if val.len() < seq_len + 1 {
        return Err(DataError::TooShort { what: "validation split".into(), found: val.len(), needed: seq_len + 1, seq_len });
    }
    Ok(ValBatches { val, seq_len, batch, iters: iters as usize })
}

impl ValBatches {
    /// Number of batches.
    pub fn len(&self) -> usize {
        self.iters
    }

    pub fn is_empty(&self) -> bool {
        self.iters == 0
    }

    /// Batch `it` (`< len()`).
    pub fn get(&self, it: usize) -> TokenBatch {
        let (t, n) = (self.seq_len, self.batch as u128 * self.iters as u128);
        let span = (self.val.len() - t - 1) as u128;
        let start_of = |k: u128| match n {
            1 => 0,
            _ => (k * span / (n - 1)) as usize,
        };
        let mut inputs = Vec::with_capacity(self.batch * t);
        let mut targets = Vec::with_capacity(self.batch * t);
        for row in 0..self.batch {
            let s = start_of(it as u128 * self.batch as u128 + row as u128);
            inputs.extend_from_slice(&self.val[s..s + t]);
            targets.extend_from_slice(&self.val[s + 1..s + t + 1]);
        }
        (inputs, targets)
    }

    /// The batches in order, each built when reached.
    pub fn iter(&self) -> impl Iterator<Item = TokenBatch> + '_ {
        (0..self.iters).map(|it| self.get(it))
    }
}
