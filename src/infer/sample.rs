//! Choosing the next token from logits: greedy, or drawn with temperature after top-k and top-p
//! (nucleus) filtering, with a repetition penalty; one seeded generator per request, so a seed
//! gives the same tokens whatever else is in the batch.

use tessera_kernels::tensor::Rng;

/// How a request's tokens are chosen (the OpenAI API's names and meanings).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0: greedy (the most likely token); above 0 divides the logits before the draw.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the most likely tokens whose probabilities add up to `top_p` (1: all).
    pub top_p: f32,
    /// Above 1 makes tokens already in the sequence less likely (the CTRL / Hugging Face rule:
    /// a positive logit is divided by it, a negative one multiplied); 1: off.
    pub repetition_penalty: f32,
    /// The generator's seed; the same seed and the same logits give the same tokens.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, repetition_penalty: 1.0, seed: 0 }
    }
}

impl SamplingParams {
    /// Refuses values with no meaning, naming the field, the value and what is expected.
    pub fn validate(&self) -> Result<(), String> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!("temperature = {}: expected a finite number >= 0 (0 is greedy)", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p = {}: expected a number in (0, 1]", self.top_p));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return Err(format!("repetition_penalty = {}: expected a finite number > 0 (1 is off)", self.repetition_penalty));
        }
        Ok(())
    }
}

/// A request's sampler: its parameters and its own generator.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        Sampler { params, rng: Rng::new(params.seed) }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether [`Sampler::sample`] is the plain argmax of the logits (temperature 0, no
    /// repetition penalty): then the logits themselves are not needed, only their argmax.
    pub fn is_greedy(&self) -> bool {
        self.params.temperature == 0.0 && self.params.repetition_penalty == 1.0
    }

    /// The next token after `context` (the sequence so far, for the repetition penalty).
    /// `logits` is used as scratch.
    pub fn sample(&mut self, logits: &mut [f32], context: &[u32]) -> u32 {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            penalize(logits, context, p.repetition_penalty);
        }
        if p.temperature == 0.0 {
            return argmax(logits);
        }
        let kept = nucleus(logits, p.temperature, p.top_k, p.top_p);
        let total: f64 = kept.iter().map(|&(_, w)| w).sum();
        let mut r = self.rng.next_f64() * total;
        for &(i, w) in &kept {
            r -= w;
            if r < 0.0 {
                return i;
            }
        }
        kept[kept.len() - 1].0
    }
}

/// The first index of the largest logit.
pub fn argmax(logits: &[f32]) -> u32 {
    logits.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0 as u32
}

/// Applies the repetition penalty to every distinct token of `context`.
fn penalize(logits: &mut [f32], context: &[u32], penalty: f32) {
    let mut seen = std::collections::HashSet::with_capacity(context.len());
    for &t in context {
        if let Some(l) = logits.get_mut(t as usize) {
            if seen.insert(t) {
                *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
            }
        }
    }
}

/// The tokens kept by top-k then top-p, most likely first, with their unnormalised
/// probabilities at `temperature`.
fn nucleus(logits: &[f32], temperature: f32, top_k: usize, top_p: f32) -> Vec<(u32, f64)> {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    if top_k > 0 && top_k < idx.len() {
        idx.select_nth_unstable_by(top_k - 1, by_logit);
        idx.truncate(top_k);
    }
    idx.sort_unstable_by(by_logit);
    let max = logits[idx[0] as usize];
    let mut kept: Vec<(u32, f64)> = idx.iter().map(|&i| (i, f64::from((logits[i as usize] - max) / temperature).exp())).collect();
    if top_p < 1.0 {
        let total: f64 = kept.iter().map(|&(_, w)| w).sum();
        let mut acc = 0.0;
        let cut = kept
            .iter()
            .position(|&(_, w)| {
                acc += w;
                acc >= f64::from(top_p) * total
            })
            .unwrap_or(kept.len() - 1);
        kept.truncate(cut + 1);
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
        SamplingParams { temperature, top_k, top_p, repetition_penalty: 1.0, seed: 7 }
    }

    /// How often each token comes out of `n` draws.
    fn histogram(p: SamplingParams, logits: &[f32], n: usize) -> Vec<usize> {
        let mut s = Sampler::new(p);
        let mut h = vec![0; logits.len()];
        for _ in 0..n {
            h[s.sample(&mut logits.to_vec(), &[]) as usize] += 1;
        }
        h
    }

    #[test]
    fn greedy_takes_the_first_largest_logit() {
        let mut s = Sampler::new(params(0.0, 0, 1.0));
        assert_eq!(s.sample(&mut [0.5, 2.0, 2.0, -1.0], &[]), 1);
    }

    #[test]
    fn draws_follow_the_softmax_at_the_temperature() {
        // At temperature 2, logits 2·ln(1), 2·ln(2), 2·ln(3) give probabilities 1:2:3.
        let logits = [0.0, 2.0 * 2f32.ln(), 2.0 * 3f32.ln()];
        let n = 60_000;
        let h = histogram(params(2.0, 0, 1.0), &logits, n);
        for (k, want) in [1.0 / 6.0, 2.0 / 6.0, 3.0 / 6.0].iter().enumerate() {
            let got = h[k] as f64 / n as f64;
            assert!((got - want).abs() < 0.01, "token {k}: {got} vs {want}");
        }
    }

    #[test]
    fn top_k_and_top_p_keep_only_the_most_likely_tokens() {
        let logits = [3.0, 2.9, 0.0, 1.0, -5.0];
        let h = histogram(params(1.0, 2, 1.0), &logits, 5000);
        assert_eq!((h[2], h[3], h[4]), (0, 0, 0), "top_k 2: {h:?}");
        assert!(h[0] > 0 && h[1] > 0);
        // Probabilities ~ .49, .44, .02, .05, 0: top_p .5 needs the two largest, .4 only the first.
        let h = histogram(params(1.0, 0, 0.5), &logits, 5000);
        assert_eq!((h[2], h[3], h[4]), (0, 0, 0), "top_p .5: {h:?}");
        assert!(h[1] > 0);
        let h = histogram(params(1.0, 0, 0.4), &logits, 2000);
        assert_eq!(h[0], 2000, "top_p .4: {h:?}");
    }

    #[test]
    fn the_same_seed_gives_the_same_tokens_and_another_seed_others() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = |seed| {
            let mut s = Sampler::new(SamplingParams { seed, ..params(1.0, 0, 1.0) });
            (0..50).map(|_| s.sample(&mut logits.clone(), &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
    }

    #[test]
    fn the_repetition_penalty_divides_positive_and_multiplies_negative_logits_once() {
        let mut l = [2.0, -2.0, 1.0];
        penalize(&mut l, &[0, 1, 0, 0], 2.0);
        assert_eq!(l, [1.0, -4.0, 1.0]);
        // With it, greedy moves off a repeated token.
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 3.0, ..params(0.0, 0, 1.0) });
        assert_eq!(s.sample(&mut [2.0, 1.0], &[0]), 1);
    }

    #[test]
    fn meaningless_values_are_refused_by_name() {
        for (p, key) in [
            (params(-1.0, 0, 1.0), "temperature"),
            (params(f32::NAN, 0, 1.0), "temperature"),
            (params(1.0, 0, 0.0), "top_p"),
            (params(1.0, 0, 1.5), "top_p"),
            (SamplingParams { repetition_penalty: 0.0, ..params(1.0, 0, 1.0) }, "repetition_penalty"),
        ] {
            assert!(p.validate().unwrap_err().starts_with(key), "{p:?}");
        }
    }
}
