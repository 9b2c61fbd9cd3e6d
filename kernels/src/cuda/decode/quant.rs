//! Weight-only quantization of the decoder's linear layers: int8 or fp8 (e4m3) with one f32
//! scale per output channel. A weight `W [k, n]` (a linear layer's `[in, out]`) is stored
//! output-major as `q [n, k]` bytes and `s [n]`:
//!
//! ```text
//! int8: s_j = max_i |W_ij| / 127,  q_ji = round(W_ij / s_j) ∈ [−127, 127]
//! fp8:  s_j = max_i |W_ij| / 448,  q_ji = e4m3(W_ij / s_j)   (round to nearest even)
//! y_rj = s_j · Σ_i x_ri · q_ji
//! ```
//! so a decode step reads a quarter of the f32 weight's bytes (half of bf16's). The same scheme
//! as the CPU's int8 linears (per output channel, symmetric, ±127).

use std::str::FromStr;

/// How the decoder stores its linear layers' weights (the embeddings, norms and LM head stay
/// bf16).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    Bf16,
    Int8,
    /// fp8 e4m3 (OCP: bias 7, max 448, no infinities).
    Fp8,
}

impl FromStr for WeightFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "bf16" => Ok(WeightFormat::Bf16),
            "int8" => Ok(WeightFormat::Int8),
            "fp8" | "e4m3" => Ok(WeightFormat::Fp8),
            _ => Err(format!("weight format `{s}`: expected bf16, int8 or fp8")),
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WeightFormat::Bf16 => "bf16",
            WeightFormat::Int8 => "int8",
            WeightFormat::Fp8 => "fp8",
        })
    }
}

/// A quantized weight on the host: `q [n, k]`, `s [n]`.
#[derive(Clone, Debug)]
pub struct Quantized {
    pub q: Vec<u8>,
    pub s: Vec<f32>,
    pub k: usize,
    pub n: usize,
}

/// The largest magnitude of each format's codes.
fn code_max(fmt: WeightFormat) -> f32 {
    match fmt {
        WeightFormat::Int8 => 127.0,
        WeightFormat::Fp8 => 448.0,
        WeightFormat::Bf16 => unreachable!("bf16 weights are not quantized"),
    }
}

/// Quantizes `w [k, n]` per output channel.
pub fn quantize(w: &[f32], k: usize, n: usize, fmt: WeightFormat) -> Quantized {
    assert_eq!(w.len(), k * n, "quantize: weight must be [k, n]");
    let (mut q, mut s) = (vec![0u8; n * k], vec![0f32; n]);
    for j in 0..n {
        let max = (0..k).map(|i| w[i * n + j].abs()).fold(0f32, f32::max);
        s[j] = max / code_max(fmt);
        let inv = if max > 0.0 { code_max(fmt) / max } else { 0.0 };
        for i in 0..k {
            let v = w[i * n + j] * inv;
            q[j * k + i] = match fmt {
                WeightFormat::Int8 => v.round().clamp(-127.0, 127.0) as i8 as u8,
                _ => e4m3_encode(v),
            };
        }
    }
    Quantized { q, s, k, n }
}

/// The weight the kernels compute with, `[k, n]` f32: `s_j · value(q_ji)`.
pub fn dequantize(t: &Quantized, fmt: WeightFormat) -> Vec<f32> {
    let mut w = vec![0f32; t.k * t.n];
    for j in 0..t.n {
        for i in 0..t.k {
            let b = t.q[j * t.k + i];
            let v = match fmt {
                WeightFormat::Int8 => f32::from(b as i8),
                _ => e4m3_decode(b),
            };
            w[i * t.n + j] = v * t.s[j];
        }
    }
    w
}

/// e4m3 to f32.
pub fn e4m3_decode(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((b >> 3) & 15), f32::from(b & 7));
    match (e, b & 7) {
        (0, _) => sign * m * 2f32.powi(-9),
        (15, 7) => f32::NAN,
        _ => sign * (1.0 + m / 8.0) * 2f32.powi(e - 7),
    }
}

/// f32 to the nearest e4m3 (ties to even; magnitudes past 448 saturate to 448).
pub fn e4m3_encode(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = (v.abs() as f64).min(448.0);
    if a < 2f64.powi(-6) {
        // Subnormal: m · 2^-9, m ≤ 8 (8 is the smallest normal, code 0x08).
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let mut e = a.log2().floor() as i32;
    let mut m = ((a / 2f64.powi(e) - 1.0) * 8.0).round_ties_even() as u8;
    if m == 8 {
        m = 0;
        e += 1;
    }
    sign | (((e + 7) as u8) << 3) | m
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every finite e4m3 code decodes and encodes back to itself; values between two codes go
    /// to the nearer.
    #[test]
    fn e4m3_round_trips_and_rounds_to_nearest() {
        for b in 0..=255u8 {
            let v = e4m3_decode(b);
            if v.is_nan() || b == 0x80 {
                continue;
            }
            assert_eq!(e4m3_encode(v), b, "code {b:#04x} = {v}");
        }
        assert_eq!(e4m3_decode(e4m3_encode(448.0)), 448.0);
        assert_eq!(e4m3_decode(e4m3_encode(1000.0)), 448.0);
        assert_eq!(e4m3_decode(e4m3_encode(1.0 + 1.0 / 16.0)), 1.0); // a tie: to the even mantissa
        assert_eq!(e4m3_decode(e4m3_encode(1.0 + 3.0 / 16.0)), 1.25);
        assert_eq!(e4m3_decode(e4m3_encode(-0.3)), -0.3125);
    }

    /// Per output channel: the largest weight of each channel maps to the largest code, and the
    /// dequantized weight is within half a step of the original.
    #[test]
    fn quantize_per_channel_within_half_a_step() {
        let (k, n) = (33, 5);
        let w: Vec<f32> = (0..k * n).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01 * (1 + i % n) as f32).collect();
        for fmt in [WeightFormat::Int8, WeightFormat::Fp8] {
            let t = quantize(&w, k, n, fmt);
            let d = dequantize(&t, fmt);
            for j in 0..n {
                let max = (0..k).map(|i| w[i * n + j].abs()).fold(0f32, f32::max);
                for i in 0..k {
                    let (a, b) = (w[i * n + j], d[i * n + j]);
                    // int8: half a step of s; e4m3: half an ulp of 3 mantissa bits (1/16 relative), or a subnormal step.
                    let tol = match fmt {
                        WeightFormat::Int8 => 0.5 * t.s[j] * 1.0001,
                        _ => (a.abs() / 16.0).max(t.s[j] * 2f32.powi(-10)) * 1.0001,
                    };
                    assert!((a - b).abs() <= tol, "{fmt} [{i},{j}] {a} → {b} (tol {tol})");
                }
                assert!((d.iter().skip(j).step_by(n).fold(0f32, |m, v| m.max(v.abs())) - max).abs() <= max * 1e-6, "{fmt} channel {j} max");
            }
        }
    }
}
