//! The inference engine (issue 31): a model behind [`Backend`] with its keys and values in a
//! paged cache, a continuous-batching scheduler over it, sampling, and `tessera serve`.
//!
//! The seam: the scheduler owns the block table of every sequence (which cache blocks hold its
//! positions) and decides what runs each step; a backend owns the cache memory and the model's
//! math (CPU or GPU) and never decides anything.
//!
//! - [`blocks`]: the block pool (reference counts, the prefix cache of full blocks);
//! - [`sched`]: continuous batching, chunked prefill, preemption by recompute;
//! - [`sample`]: greedy, temperature, top-k, top-p, repetition penalty, per-request seeds;
//! - [`engine`]: a backend driven by the scheduler, token by token;
//! - [`text`]: generated tokens as text, stop strings;
//! - [`cpu`]: the paged CPU backend (f32 or int8 linears);
//! - [`gpu`]: the paged GPU backend (bf16, int8 or fp8 linears, CUDA graphs for decode steps);
//! - [`ranks`]: a model's blocks split over rank processes (pipeline parallelism) behind the same seam;
//! - [`recompute`]: the reference backend (recomputes every position; the oracle of the others).

pub mod backend;
pub mod blocks;
pub mod cpu;
pub mod engine;
pub mod gpu;
pub mod ranks;
pub mod recompute;
pub mod sample;
pub mod sched;
pub mod text;

#[cfg(test)]
mod engine_tests;
#[cfg(test)]
mod sched_tests;

pub use backend::{Backend, BackendLost, SeqStep};
pub use cpu::{CpuBackend, CpuOptions, LinearFormat};
pub use engine::{Engine, Event, Finish, Request};
pub use gpu::GpuBackend;
pub use sample::{Sampler, SamplingParams};
