//! The stage-3 parameter swap file (`offload_param.device = nvme`) and its byte codec.

use rayon::prelude::*;
use tessera_kernels::dtype::DType;

use super::super::store::{PAR_CHUNK, PAR_MIN};
use crate::offload::{AlignedBuf, SwapFile};

/// A swap file of parameters in the storage type (little-endian f32, bf16 or fp16 bits), read
/// and written through block-aligned buffers (O_DIRECT where the filesystem allows).
pub(super) struct ParamSwap {
    pub(super) file: SwapFile,
    pub(super) dtype: DType,
    pub(super) elems: usize,
}

impl ParamSwap {
    pub(super) fn elem_bytes(&self) -> usize {
        self.dtype.size_bytes()
    }

    /// The block-aligned byte window covering elements `start..start + len`, and the offset of
    /// element `start` inside it.
    fn window(&self, start: usize, len: usize) -> (u64, usize, usize) {
        let (es, block) = (self.elem_bytes(), self.file.block());
        let (b0, b1) = (start * es, (start + len) * es);
        let a0 = b0 / block * block;
        let a1 = b1.div_ceil(block) * block;
        (a0 as u64, a1 - a0, b0 - a0)
    }

    fn io_error(&self, what: &str, off: u64, e: std::io::Error) -> String {
        format!("{what} parameter swap file {} at byte {off}: {e}", self.file.path().display())
    }

    pub(super) fn read(&self, start: usize, out: &mut [f32]) -> Result<(), String> {
        let (off, len, skip) = self.window(start, out.len());
        let mut buf = AlignedBuf::new(len, self.file.block());
        self.file.read_at(off, &mut buf, len).map_err(|e| self.io_error("reading", off, e))?;
        decode(self.dtype, &buf.bytes()[skip..skip + out.len() * self.elem_bytes()], out);
        Ok(())
    }

    pub(super) fn write(&self, start: usize, src: &[f32]) -> Result<(), String> {
        let (off, len, skip) = self.window(start, src.len());
        let block = self.file.block();
        let mut buf = AlignedBuf::new(len, block);
        let end = skip + src.len() * self.elem_bytes();
        // Partial first and last blocks keep their other elements: read them first.
        if skip != 0 {
            self.read_block(off, &mut buf, 0)?;
        }
        if end % block != 0 && (end / block != 0 || skip == 0) {
            self.read_block(off, &mut buf, end / block * block)?;
        }
        encode(self.dtype, src, &mut buf.bytes_mut()[skip..end]);
        self.file.write_at(off, &mut buf, len).map_err(|e| self.io_error("writing", off, e))
    }

    /// Reads the block at byte `at` of the window starting at `off` into the same place of `buf`.
    fn read_block(&self, off: u64, buf: &mut AlignedBuf, at: usize) -> Result<(), String> {
        let block = self.file.block();
        let mut one = AlignedBuf::new(block, block);
        let pos = off + at as u64;
        self.file.read_at(pos, &mut one, block).map_err(|e| self.io_error("reading", pos, e))?;
        buf.bytes_mut()[at..at + block].copy_from_slice(one.bytes());
        Ok(())
    }
}

/// Little-endian values of the storage type → f32 (on the thread pool from `PAR_MIN` values).
fn decode(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    let size = dtype.size_bytes();
    if out.len() >= PAR_MIN {
        // Element by element, so the chunking cannot change a bit.
        out.par_chunks_mut(PAR_CHUNK).zip(bytes.par_chunks(PAR_CHUNK * size)).for_each(|(o, b)| decode_serial(dtype, b, o));
        return;
    }
    decode_serial(dtype, bytes, out);
}

/// [`decode`] on one thread.
fn decode_serial(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => out.iter_mut().zip(bytes.chunks_exact(4)).for_each(|(o, b)| *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        DType::BF16 => out.iter_mut().zip(bytes.chunks_exact(2)).for_each(|(o, b)| *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        DType::F16 => out.iter_mut().zip(bytes.chunks_exact(2)).for_each(|(o, b)| *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
    }
}

/// f32 → little-endian values of the storage type, rounded like `Store::write`.
fn encode(dtype: DType, src: &[f32], bytes: &mut [u8]) {
    let size = dtype.size_bytes();
    if src.len() >= PAR_MIN {
        bytes.par_chunks_mut(PAR_CHUNK * size).zip(src.par_chunks(PAR_CHUNK)).for_each(|(b, x)| encode_serial(dtype, x, b));
        return;
    }
    encode_serial(dtype, src, bytes);
}

/// [`encode`] on one thread.
fn encode_serial(dtype: DType, src: &[f32], bytes: &mut [u8]) {
    match dtype {
        DType::F32 => bytes.chunks_exact_mut(4).zip(src).for_each(|(b, x)| b.copy_from_slice(&x.to_le_bytes())),
        DType::BF16 => bytes.chunks_exact_mut(2).zip(src).for_each(|(b, x)| b.copy_from_slice(&half::bf16::from_f32(*x).to_le_bytes())),
        DType::F16 => bytes.chunks_exact_mut(2).zip(src).for_each(|(b, x)| b.copy_from_slice(&half::f16::from_f32(*x).to_le_bytes())),
    }
}
