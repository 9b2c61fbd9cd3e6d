//! tessera: the user-facing crate — DeepSpeed JSON config, the training engine, the model zoo,
//! data, checkpoints, monitors and the `tessera` CLI.

pub mod bridge;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod console;
pub mod data;
pub mod engine;
pub mod env;
pub mod gpu;
pub mod hf;
pub mod infer;
pub mod launch;
pub mod monitor;
pub mod offload;
pub mod schedule;
pub mod serve;
pub mod signals;
pub mod zoo;
