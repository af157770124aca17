//! The real CUDA driver: the driver contract (`super::driver`) over cudarc's raw driver API
//! (`cudarc::driver::sys`), with libcuda opened at run time. Built with cargo feature `cuda`.
//!
//! Why the raw calls and not cudarc's safe `CudaContext`/`CudaStream`: those panic when
//! libcuda is absent, make their context current with `cuCtxSetCurrent` (changing the
//! caller's thread state), allocate from the stream-ordered pool (which CUDA IPC cannot
//! share), and synchronise without a bound. Every call here is wrapped once, with its
//! `// SAFETY:`, and reports failures as `Error::System` naming the call and the `CUresult`.
//!
//! Layout: `context` retains each device's primary context and makes it current for the
//! length of one call; `memory` locates pointers and owns pinned and device memory;
//! `stream` and `event` implement streams, copies and bounded waits; `device` describes a
//! device; `call` turns driver results into errors.

mod call;
mod context;
mod device;
mod event;
mod memory;
mod module;
mod stream;

use super::driver::{
    DeviceInfo, DeviceMem, Driver, Function, IpcHandle, Memory, Pinned, Registered, Stream,
};
use crate::error::{Error, Result};
use context::Context;
use memory::{CudaDeviceMem, CudaPinned, CudaRegistered};
use module::Modules;
use std::sync::Arc;
use stream::CudaStream;

/// The CUDA driver with every device's primary context retained (released on drop, after
/// the last memory, stream and event made through it).
pub struct CudaDriver {
    // Declared first: modules unload before the contexts are released.
    modules: Vec<Modules>,
    contexts: Vec<Arc<Context>>,
}

impl std::fmt::Debug for CudaDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDriver")
            .field("devices", &self.contexts.len())
            .finish()
    }
}

impl CudaDriver {
    /// Opens the driver: `Error::Unsupported` with the probe's reason when there is no
    /// driver or no device (checked before any driver call, since cudarc panics without
    /// libcuda), then retains each device's primary context.
    pub fn open() -> Result<CudaDriver> {
        let count = super::probe::device_count()?;
        let contexts = (0..count)
            .map(|ordinal| Context::retain(ordinal).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        let modules = contexts.iter().cloned().map(Modules::new).collect();
        Ok(CudaDriver { modules, contexts })
    }

    /// Device `ordinal`'s context, or an error naming the ordinal.
    fn context(&self, ordinal: usize) -> Result<&Arc<Context>> {
        self.contexts.get(ordinal).ok_or_else(|| {
            Error::invalid(format!(
                "no CUDA device {ordinal}: the driver sees {} (ordinals 0..{})",
                self.contexts.len(),
                self.contexts.len()
            ))
        })
    }
}

impl Driver for CudaDriver {
    fn kind(&self) -> &'static str {
        "cuda"
    }

    fn device_count(&self) -> usize {
        self.contexts.len()
    }

    fn device(&self, ordinal: usize) -> Result<DeviceInfo> {
        device::info(self.context(ordinal)?)
    }

    fn locate(&self, addr: u64) -> Result<Memory> {
        // Any context will do (unified addressing); device 0's is always there.
        let _current = self.context(0)?.enter()?;
        memory::locate(addr)
    }

    fn alloc_pinned(&self, len: usize) -> Result<Box<dyn Pinned>> {
        let ctx = self.context(0)?.clone();
        Ok(Box::new(CudaPinned::alloc(ctx, len)?))
    }

    fn alloc_device(&self, ordinal: usize, len: usize) -> Result<Box<dyn DeviceMem>> {
        let ctx = self.context(ordinal)?.clone();
        Ok(Box::new(CudaDeviceMem::alloc(ctx, len)?))
    }

    fn ipc_open(
        &self,
        ordinal: usize,
        handle: &IpcHandle,
        len: usize,
    ) -> Result<Box<dyn DeviceMem>> {
        let ctx = self.context(ordinal)?.clone();
        Ok(Box::new(CudaDeviceMem::open(ctx, handle, len)?))
    }

    unsafe fn register_host(
        &self,
        ordinal: usize,
        ptr: *mut u8,
        len: usize,
    ) -> Result<Box<dyn Registered>> {
        let ctx = self.context(ordinal)?.clone();
        // SAFETY: the caller's promise, passed on.
        Ok(Box::new(unsafe {
            CudaRegistered::register(ctx, ptr, len)?
        }))
    }

    fn create_stream(&self, ordinal: usize) -> Result<Box<dyn Stream>> {
        let ctx = self.context(ordinal)?.clone();
        Ok(Box::new(CudaStream::create(ctx)?))
    }

    unsafe fn borrow_stream(
        &self,
        ordinal: usize,
        raw: *mut std::ffi::c_void,
    ) -> Result<Box<dyn Stream>> {
        let ctx = self.context(ordinal)?.clone();
        // SAFETY: `raw` is null or a live stream of device `ordinal` that outlives the
        // returned value (this function's contract).
        Ok(Box::new(unsafe { CudaStream::borrow(ctx, raw)? }))
    }

    fn function(&self, ordinal: usize, name: &str) -> Result<Arc<dyn Function>> {
        self.context(ordinal)?;
        let f = self.modules[ordinal]
            .function(name)
            .map_err(|e| e.prefixed(&format!("kernel {name} on CUDA device {ordinal}: ")))?;
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a driver (CI) opening fails with the probe's Unsupported error and nothing
    /// panics; with a GPU it opens every device the probe counted.
    #[test]
    fn open_agrees_with_the_probe() {
        match (CudaDriver::open(), crate::gpu::device_count()) {
            (Ok(driver), Ok(n)) => {
                assert_eq!(driver.device_count(), n);
                assert_eq!(driver.kind(), "cuda");
                let err = driver.device(n).unwrap_err();
                assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
                assert!(
                    err.to_string().contains(&format!("no CUDA device {n}")),
                    "{err}"
                );
            }
            (Err(e), Err(probe)) => {
                assert_eq!(e, probe);
                assert!(matches!(e, Error::Unsupported(_)), "{e}");
            }
            (driver, probe) => {
                panic!("CudaDriver::open() = {driver:?} but the probe says {probe:?}")
            }
        }
    }
}
