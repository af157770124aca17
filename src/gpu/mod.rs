//! NVIDIA GPUs: whether a CUDA driver and device are usable, and the CUDA kernels of `kernels/`
//! compiled at run time by NVRTC.
//!
//! What exists: the driver probe ([`available`], [`device_count`]) and, inside the crate, a
//! driver contract (`driver.rs`) with a real and an emulated implementation, device buffers in
//! every collective staged through page-locked memory with NCCL's stream semantics
//! (`staging.rs`, `comm/device.rs`), the embedded kernel sources, their NVRTC compilation
//! (CUBIN for a device's exact `sm_XY`, PTX as a fallback), kernel launches and launch plans
//! (`plans/`). The codecs run on the GPU in compressed all-reduces (`sra.rs`); dense calls go
//! through the peers' GPU memory over CUDA IPC (`ipc.rs`, opt-in) or, on ranks sharing one
//! host, through the shared-memory arena with the GPU copying into and out of it (`arena.rs`).
//! On a caller's stream those arena calls are staged in bands, pipelined
//! (`staging::Staging::start_banded`). What does not exist yet: the codecs on the GPU in
//! the hierarchical schedule and HiTopK, pipelined staging over sockets.
//! docs/ARCHITECTURE.md has the whole picture.
//!
//! With the cargo feature `cuda` (on by default) qccl links no CUDA library: `libcuda.so.1`
//! and `libnvrtc.so.13`/`.so.12` are opened at run time, so the same build runs on a machine
//! without CUDA, where [`available`] says why not. Without the feature, [`available`] says
//! that qccl was built without it.

#[cfg(feature = "cuda")]
mod probe;

// The driver contract the device path is written against (not API yet).
#[doc(hidden)]
pub mod driver;
#[doc(hidden)]
pub mod staging;
// The disk cache folder and stable hash the kernel builders share.
mod cache;
// Kernel arguments as cuLaunchKernel takes them (both drivers).
mod launch;
// Which driver this process uses (QCCL_GPU_EMULATE, else the real one).
pub(crate) mod select;

// The real driver behind the contract (reached through `qccl::internal` by the tests).
#[cfg(feature = "cuda")]
pub(crate) mod cuda;

// Not API yet (reached through `qccl::internal` by the tests): the device path will use them.
#[cfg(feature = "cuda")]
#[doc(hidden)]
pub mod nvrtc;

#[doc(hidden)]
pub mod kernels;

// Compressed SRA all-reduce on device buffers, the codecs run on the GPU (not API yet).
#[doc(hidden)]
pub mod sra;

// Dense all-reduce between the processes of one machine over CUDA IPC (not API yet).
#[doc(hidden)]
pub mod ipc;

// Dense collectives of device buffers through the shared-memory arena, its segments
// page-locked (not API yet).
#[doc(hidden)]
pub mod arena;

// Codecs' and reductions' kernel launch sequences over the driver contract.
#[doc(hidden)]
pub mod plans;

// Kernel throughput against the device's copy bandwidth (qccl-gpu-bench).
#[doc(hidden)]
pub mod bench;

// The emulated driver (needs no CUDA): the device path in CI.
#[doc(hidden)]
pub mod emu;

use crate::Result;

/// `Ok` when a CUDA driver loads, initialises and sees at least one device.
///
/// Otherwise `Error::Unsupported` naming what is missing: "no CUDA driver (libcuda.so.1)
/// found", "no CUDA device", the driver's own error, or a build without the `cuda` feature.
/// Checked once per process; later calls return the same answer.
pub fn available() -> Result<()> {
    device_count().map(|_| ())
}

/// How many CUDA devices the driver sees (at least 1), or why none can be used (as
/// [`available`]).
pub fn device_count() -> Result<usize> {
    #[cfg(feature = "cuda")]
    {
        probe::device_count()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(crate::Error::Unsupported(
            "qccl was built without the `cuda` feature".into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn available_agrees_with_device_count() {
        // On a machine without CUDA both are the same Unsupported error; with a GPU both are Ok.
        match (available(), device_count()) {
            (Ok(()), Ok(n)) => assert!(n >= 1),
            (Err(a), Err(b)) => {
                assert_eq!(a, b);
                assert_eq!(a.code(), crate::Error::Unsupported(String::new()).code());
            }
            (a, b) => panic!("available() = {a:?} but device_count() = {b:?}"),
        }
    }
}
