//! The inference engine (issue 31): a model behind [`Backend`] with its keys and values in a
//! paged cache, a continuous-batching scheduler over it, sampling, and `tessera serve`.
//!
//! The seam: the scheduler owns the block table of every sequence (which cache blocks hold its
//! positions) and decides what runs each step; a backend owns the cache memory and the model's
//! math (CPU or GPU) and never decides anything.

pub mod backend;
pub mod gpu;

pub use backend::{Backend, SeqStep};
pub use gpu::GpuBackend;
