//! The training engine: turns a resolved [`Config`] into steps. A step runs the global batch's
//! `M` micro-batches, sums their gradients with the fixed tree of
//! [`tessera_transport::tree`], unscales/clips them, and applies the optimizer to fp32 masters.

mod precision;
mod run;
mod summary;

pub use precision::Precision16;
pub use run::{train, TrainOptions, TrainOutcome};
pub use summary::{peak_rss_bytes, Summary};
