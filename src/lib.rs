//! qccl: a collective-communication library (NCCL-like) for host memory, over TCP and
//! in-process transports, built for compression inside the collective.
//!
//! Layers, top to bottom (see docs/ARCHITECTURE.md): [`Comm`] (ordered op queue, async
//! requests, timeouts, abort) → `coll` (collectives) → `algo` (ring, tree, sra schedules) →
//! `reduce` (vectorized kernels) and `transport` (tcp, inproc) → `bootstrap` (unique id,
//! rendezvous, environment, host topology).

#![warn(missing_docs)]

pub mod log;

pub mod algo;
pub mod bootstrap;
pub mod coll;
mod comm;
pub mod config;
pub mod error;
pub mod reduce;
pub mod transport;
pub mod types;

pub use bootstrap::UniqueId;
pub use comm::{Comm, Request};
pub use config::{Algo, Config};
pub use error::{Error, Result};
pub use types::{DType, Element, ReduceOp};
