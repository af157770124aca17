//! qccl: a collective-communication library (NCCL-like) for host memory, over TCP and
//! in-process transports, built for compression inside the collective.
//!
//! Layers, top to bottom (see docs/ARCHITECTURE.md): [`Comm`] (ordered op queue, async
//! requests, timeouts, abort) → `coll` (collectives) → `algo` (ring, tree, sra schedules) →
//! `reduce` (vectorized kernels) and `transport` (tcp, inproc) → `bootstrap` (unique id,
//! rendezvous, environment, host topology).
//!
//! # Example
//!
//! Four ranks as threads of this process (the in-process transport); across processes,
//! each rank calls [`Comm::from_env`] (or [`Comm::init`] with a shared [`UniqueId`]) instead;
//! [`launch`] starts N local ranks of a program, like `mpirun -np N` on one machine.
//!
//! ```
//! use qccl::{Comm, Config, ReduceOp};
//!
//! let comms = Comm::init_threads(4, Config::default())?;
//! let handles: Vec<_> = comms
//!     .into_iter()
//!     .map(|comm| {
//!         std::thread::spawn(move || -> qccl::Result<Vec<f32>> {
//!             let mut grad = vec![comm.rank() as f32; 1000];
//!             comm.all_reduce_in_place(&mut grad, ReduceOp::Avg)?;
//!             Ok(grad)
//!         })
//!     })
//!     .collect();
//! for h in handles {
//!     assert!(h.join().unwrap()?.iter().all(|&x| x == 1.5)); // (0+1+2+3)/4
//! }
//! # Ok::<(), qccl::Error>(())
//! ```

#![warn(missing_docs)]

#[doc(hidden)]
pub mod log;

mod algo;
mod bootstrap;
pub mod codec;
mod coll;
mod comm;
mod config;
mod error;
pub mod fused;
pub mod gpu;
pub mod launch;
mod reduce;
mod sys;
mod transport;
mod tuning;
mod types;

#[cfg(test)]
mod test_alloc;

pub use algo::{Algo, Wire};
pub use bootstrap::UniqueId;
pub use codec::ef::TensorKey;
pub use codec::layout::{Layer, Layout};
pub use codec::{Codec, CodecSpec};
pub use comm::{
    Comm, Compression, RegHandle, Registrations, Report, Request, TopK, TopKReport, TopKScheme,
};
pub use config::{Config, TransportChoice};
pub use error::{Error, Result};
pub use types::{DType, Element, ReduceOp};

/// What qccl's own C library, tools and benchmarks use from inside: not part of the API, and
/// it changes without notice.
#[doc(hidden)]
pub mod internal {
    pub use crate::bootstrap::env::{detect, EnvInit};
    pub use crate::bootstrap::unique_id::UNIQUE_ID_BYTES;
    pub use crate::codec::ef::{compensate as ef_compensate, record as ef_record};
    pub use crate::codec::mstopk::mstopk_select;
    pub use crate::codec::randk::select_randk;
    pub use crate::codec::sparse::k_of;
    pub use crate::codec::topk::select_topk;
    pub use crate::coll::call::{Buf, Coll, CollCall, Shape, Side};
    pub use crate::coll::Engine;
    pub use crate::comm::{AllReduceCall, PreparedAllReduce, PreparedTopK};
    pub use crate::config::parse_size;
    /// Kernel throughput against the device's copy bandwidth (qccl-gpu-bench).
    pub use crate::gpu::bench as gpu_bench;
    /// The real CUDA driver, for tests/gpu_driver.rs.
    #[cfg(feature = "cuda")]
    pub use crate::gpu::cuda::CudaDriver;
    /// The device path's driver contract, its choice and staging (C ABI, Python, tests).
    pub use crate::gpu::driver as gpu_driver;
    pub use crate::gpu::kernels;
    #[cfg(feature = "cuda")]
    pub use crate::gpu::nvrtc;
    pub use crate::gpu::select::{driver as gpu, emulate as emulate_gpu, emulated_driver};
    pub use crate::gpu::sra::{DeviceStats, GpuAllReduce};
    pub use crate::gpu::staging::CallBuf;
    pub use crate::reduce::{finish_avg, reduce3, reduce_into};
    pub use crate::transport::frame::{CollKind, OpDesc};
    /// The verbs contract and the real device, for tests/ib_device.rs.
    #[cfg(feature = "rdma")]
    pub use crate::transport::ib::{device::VerbsFabric, verbs};
    pub use crate::transport::{RecvReq, SendReq};
    pub use crate::tuning::{Links, Pick, Row, Tuning, Workload, HEADER as TUNING_HEADER};
    #[cfg(feature = "cuda")]
    pub use cudarc;
}
