//! qccl: a collective-communication library (NCCL-like) for host memory, over TCP and
//! in-process transports, built for compression inside the collective.
//!
//! Layers, top to bottom (see docs/ARCHITECTURE.md): [`Comm`] (ordered op queue, async
//! requests, timeouts, abort) → `coll` (collectives) → `algo` (ring, tree, sra schedules) →
//! `reduce` (vectorized kernels) and `transport` (tcp, inproc) → `bootstrap` (unique id,
//! rendezvous, environment, host topology).

#![warn(missing_docs)]

pub mod log;

pub mod bootstrap;
pub mod config;
pub mod error;
pub mod reduce;
pub mod types;

pub use config::{Algo, Config};
pub use error::{Error, Result};
pub use types::{DType, Element, ReduceOp};
