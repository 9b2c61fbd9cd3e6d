//! tessera-transport: how workers exchange tensors — the deterministic reduction tree, and
//! collectives and point-to-point between workers (in-process, QUIC, NCCL backends).

pub mod collective;
pub mod local;
pub mod nccl;
pub mod quic;
pub mod tree;
