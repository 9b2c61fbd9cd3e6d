//! Element dtypes (f32, bf16, f16): names, byte sizes, round-to-nearest-even emulation of the
//! narrow types on `f32` buffers, and little-endian (de)serialisation for checkpoints.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};
use rayon::prelude::*;
use thiserror::Error;

/// Slices at least this long are processed in parallel chunks of this many elements.
const PAR_CHUNK: usize = 1 << 16;

/// Storage dtype of a tensor. All math runs in `f32`; narrower dtypes are emulated by rounding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
}

/// Errors from parsing a dtype name or decoding dtype bytes.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum DTypeError {
    #[error("unknown dtype {name:?}: expected one of f32, bf16, f16 (or F32, BF16, F16)")]
    Unknown { name: String },
    #[error("{len_bytes} bytes is not a whole number of {dtype} elements ({size_bytes} bytes each)")]
    Length { dtype: DType, len_bytes: usize, size_bytes: usize },
}

impl DType {
    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// Lower-case name used in configs: "f32", "bf16", "f16".
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }

    /// Name used in safetensors headers: "F32", "BF16", "F16".
    pub fn st_name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::BF16 => "BF16",
            DType::F16 => "F16",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = DTypeError;

    /// Accepts the config names and the safetensors names (case-insensitive), plus the long
    /// spellings "float32", "bfloat16" and "float16".
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(DType::F32),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "f16" | "float16" => Ok(DType::F16),
            _ => Err(DTypeError::Unknown { name: s.to_string() }),
        }
    }
}

/// x ← nearest value of `dtype` to x (round-to-nearest-even; NaN stays NaN, overflow → ±inf).
/// A no-op for F32. Large slices are processed in parallel (elementwise, so deterministic).
pub fn round_to(dtype: DType, x: &mut [f32]) {
    let round_chunk: fn(&mut [f32]) = match dtype {
        DType::F32 => return,
        DType::BF16 => |c| c.iter_mut().for_each(|v| *v = bf16::from_f32(*v).to_f32()),
        DType::F16 => |c| c.iter_mut().for_each(|v| *v = f16::from_f32(*v).to_f32()),
    };
    if x.len() >= 2 * PAR_CHUNK {
        x.par_chunks_mut(PAR_CHUNK).for_each(round_chunk);
    } else {
        round_chunk(x);
    }
}

/// Encodes `x` as little-endian `dtype` elements (values are rounded RNE for narrow dtypes).
pub fn to_bytes(dtype: DType, x: &[f32]) -> Vec<u8> {
    let size = dtype.size_bytes();
    let mut out = vec![0u8; x.len() * size];
    let chunks = out.chunks_exact_mut(size).zip(x);
    match dtype {
        DType::F32 => chunks.for_each(|(o, v)| o.copy_from_slice(&v.to_le_bytes())),
        DType::BF16 => chunks.for_each(|(o, v)| o.copy_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        DType::F16 => chunks.for_each(|(o, v)| o.copy_from_slice(&f16::from_f32(*v).to_le_bytes())),
    }
    out
}

/// Decodes little-endian `dtype` elements into `f32` (exact: every bf16/f16 value is an f32).
pub fn from_bytes(dtype: DType, b: &[u8]) -> Result<Vec<f32>, DTypeError> {
    let size = dtype.size_bytes();
    if b.len() % size != 0 {
        return Err(DTypeError::Length { dtype, len_bytes: b.len(), size_bytes: size });
    }
    let chunks = b.chunks_exact(size);
    let out = match dtype {
        DType::F32 => chunks.map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        DType::BF16 => chunks.map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::F16 => chunks.map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
    };
    Ok(out)
}

/// True when any element is NaN or ±inf. The answer does not depend on scheduling.
pub fn has_non_finite(x: &[f32]) -> bool {
    // Exponent bits all ones ⇔ inf or NaN; a branch-free fold vectorises.
    fn chunk_bad(c: &[f32]) -> bool {
        c.iter().fold(false, |acc, v| acc | (v.to_bits() & 0x7f80_0000 == 0x7f80_0000))
    }
    if x.len() >= 2 * PAR_CHUNK {
        x.par_chunks(PAR_CHUNK).any(chunk_bad)
    } else {
        chunk_bad(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_roundtrip_and_sizes() {
        for d in [DType::F32, DType::BF16, DType::F16] {
            assert_eq!(d.name().parse::<DType>(), Ok(d));
            assert_eq!(d.st_name().parse::<DType>(), Ok(d));
        }
        assert_eq!(DType::F32.size_bytes(), 4);
        assert_eq!(DType::BF16.size_bytes(), 2);
        assert_eq!(DType::F16.size_bytes(), 2);
        let err = "fp8".parse::<DType>().unwrap_err();
        assert!(err.to_string().contains("fp8"), "{err}");
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1 + 2^-8 is exactly halfway between bf16 neighbours 1 and 1+2^-7: ties go to even (1).
        let mut x = vec![1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), 1.0 + 2f32.powi(-9)];
        round_to(DType::BF16, &mut x);
        // 1+3·2^-8 is halfway between 1+2^-7 (odd mantissa) and 1+2^-6 (even): goes up.
        assert_eq!(x, vec![1.0, 1.0 + 2f32.powi(-6), 1.0]);
        let mut big = vec![f32::MAX, f32::NAN, -0.0];
        round_to(DType::BF16, &mut big);
        assert!(big[0].is_infinite() && big[1].is_nan());
        assert_eq!(big[2].to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn f16_rounds_to_nearest_even_and_overflows() {
        // f16 has 10 mantissa bits: 1 + 2^-11 ties to 1, 1 + 3·2^-11 ties up to 1 + 2^-9.
        let mut x = vec![1.0 + 2f32.powi(-11), 1.0 + 3.0 * 2f32.powi(-11), 70000.0, 65504.0];
        round_to(DType::F16, &mut x);
        assert_eq!(x[0], 1.0);
        assert_eq!(x[1], 1.0 + 2f32.powi(-9));
        assert!(x[2].is_infinite());
        assert_eq!(x[3], 65504.0);
    }

    #[test]
    fn rounding_is_idempotent_and_parallel_matches_serial() {
        let mut rng = crate::tensor::Rng::new(7);
        let mut x = vec![0f32; 3 * PAR_CHUNK + 5];
        rng.fill_normal(&mut x, 3.0);
        for d in [DType::BF16, DType::F16] {
            let mut par = x.clone();
            round_to(d, &mut par);
            let mut serial = x.clone();
            serial.chunks_mut(100).for_each(|c| round_to(d, c));
            assert_eq!(par, serial);
            let mut again = par.clone();
            round_to(d, &mut again);
            assert_eq!(again, par);
        }
        let mut same = x.clone();
        round_to(DType::F32, &mut same);
        assert_eq!(same, x);
    }

    #[test]
    fn bytes_roundtrip() {
        let x = vec![1.5f32, -2.25, 0.0, 3.0e-3, 1234.5];
        for d in [DType::F32, DType::BF16, DType::F16] {
            let b = to_bytes(d, &x);
            assert_eq!(b.len(), x.len() * d.size_bytes());
            let back = from_bytes(d, &b).unwrap();
            let mut rounded = x.clone();
            round_to(d, &mut rounded);
            assert_eq!(back, rounded, "{d}");
        }
        assert_eq!(to_bytes(DType::F32, &[1.0]), 1.0f32.to_le_bytes().to_vec());
        assert_eq!(to_bytes(DType::BF16, &[1.0]), vec![0x80, 0x3f]);
        assert_eq!(to_bytes(DType::F16, &[1.0]), vec![0x00, 0x3c]);
        let err = from_bytes(DType::F32, &[0u8; 6]).unwrap_err();
        assert_eq!(err, DTypeError::Length { dtype: DType::F32, len_bytes: 6, size_bytes: 4 });
    }

    #[test]
    fn non_finite_detection() {
        let mut x = vec![1.0f32; 3 * PAR_CHUNK];
        assert!(!has_non_finite(&x));
        x[2 * PAR_CHUNK + 17] = f32::NAN;
        assert!(has_non_finite(&x));
        x[2 * PAR_CHUNK + 17] = f32::NEG_INFINITY;
        assert!(has_non_finite(&x));
        assert!(has_non_finite(&[0.0, f32::INFINITY]));
        assert!(!has_non_finite(&[f32::MAX, f32::MIN_POSITIVE, -0.0]));
        assert!(!has_non_finite(&[]));
    }
}
