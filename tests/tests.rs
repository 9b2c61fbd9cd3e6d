//! End-to-end tests: the `tessera` binary run as a user would run it.

mod common;
mod e2e_cli;
mod e2e_config_limits;
mod e2e_elastic;
mod e2e_experts;
mod e2e_gpu;
mod e2e_hosts;
mod e2e_launchers;
mod e2e_models;
mod e2e_moe;
mod e2e_moe_outputs;
mod e2e_offload;
mod e2e_outputs;
mod e2e_pipeline;
mod e2e_procs;
mod e2e_serve;
mod e2e_serve_hosts;
mod e2e_signals;
mod e2e_train;
mod e2e_zero;
mod regression;
