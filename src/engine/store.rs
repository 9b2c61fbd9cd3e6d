//! `Store`: a vector of values kept in the run's storage type (f32, bf16 or fp16 bits), so that
//! the bytes a rank reports holding are the bytes it really holds.

use half::{bf16, f16};
use rayon::prelude::*;
use tessera_kernels::dtype::DType;

/// Values in the storage type. Reads widen to f32; writes round to the storage type.
#[derive(Debug, Clone)]
pub enum Store {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

impl Store {
    pub fn zeros(dtype: DType, len: usize) -> Self {
        match dtype {
            DType::F32 => Store::F32(vec![0.0; len]),
            DType::BF16 => Store::Bf16(vec![bf16::ZERO; len]),
            DType::F16 => Store::F16(vec![f16::ZERO; len]),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Store::F32(v) => v.len(),
            Store::Bf16(v) => v.len(),
            Store::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        let per = match self {
            Store::F32(_) => 4,
            Store::Bf16(_) | Store::F16(_) => 2,
        };
        (self.len() * per) as u64
    }

    /// `out = self[start .. start + out.len()]`, widened to f32.
    pub fn read(&self, start: usize, out: &mut [f32]) {
        let end = start + out.len();
        match self {
            Store::F32(v) => out.copy_from_slice(&v[start..end]),
            Store::Bf16(v) => widen(&v[start..end], out, bf16::to_f32),
            Store::F16(v) => widen(&v[start..end], out, f16::to_f32),
        }
    }

    /// `self[start ..] = src`, rounded to the storage type (round to nearest even).
    pub fn write(&mut self, start: usize, src: &[f32]) {
        let end = start + src.len();
        match self {
            Store::F32(v) => v[start..end].copy_from_slice(src),
            Store::Bf16(v) => narrow(src, &mut v[start..end], bf16::from_f32),
            Store::F16(v) => narrow(src, &mut v[start..end], f16::from_f32),
        }
    }

    /// The whole store widened to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        self.read(0, &mut out);
        out
    }
}

/// Values at and above which a read or write runs on the thread pool (a large model's gradient
/// or parameters, once a step), in chunks of [`PAR_CHUNK`]. Element by element: the chunking
/// cannot change a bit.
pub(super) const PAR_MIN: usize = 1 << 17;
pub(super) const PAR_CHUNK: usize = 1 << 16;

fn widen<T: Copy + Sync>(src: &[T], out: &mut [f32], f: fn(T) -> f32) {
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(PAR_CHUNK).zip(src.par_chunks(PAR_CHUNK)).for_each(|(o, s)| widen(s, o, f));
        return;
    }
    out.iter_mut().zip(src).for_each(|(o, &x)| *o = f(x));
}

fn narrow<T: Send>(src: &[f32], out: &mut [T], f: fn(f32) -> T) {
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(PAR_CHUNK).zip(src.par_chunks(PAR_CHUNK)).for_each(|(o, s)| narrow(s, o, f));
        return;
    }
    out.iter_mut().zip(src).for_each(|(o, &x)| *o = f(x));
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_kernels::dtype::round_to;

    #[test]
    fn writes_round_like_the_kernels_and_bytes_follow_the_type() {
        // Longer than PAR_MIN: the chunked path on the thread pool.
        let x: Vec<f32> = (0..PAR_MIN + 1000).map(|i| (i as f32 * 0.37).sin() * 1000.0 + 1.0 / 3.0).collect();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let mut s = Store::zeros(dtype, x.len());
            s.write(0, &x);
            let mut want = x.clone();
            round_to(dtype, &mut want);
            assert_eq!(s.to_f32(), want, "{dtype:?}");
            assert_eq!(s.bytes(), (x.len() * dtype.size_bytes()) as u64);
        }
    }
}
