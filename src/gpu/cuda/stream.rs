//! Streams: qccl's own (`cuStreamCreate`, non-blocking) or the caller's, borrowed; the
//! asynchronous copies between host and device, kernel launches, events on them, and waits.

use super::call::check;
use super::context::Context;
use super::event::CudaEvent;
use super::memory::check_device_range;
use super::module::CudaFunction;
use crate::error::{Error, Result};
use crate::gpu::driver::{Arg, Event, Function, Stream};
use crate::gpu::launch::ArgBlock;
use cudarc::driver::sys;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

/// qccl's streams do not synchronise with the legacy default stream: the application's work
/// on stream 0 must not wait for communication, nor communication for it, unless asked
/// through events.
pub(super) const STREAM_FLAGS: u32 = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;

/// `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD` of cuda.h: handles that are not streams
/// but name the current context's implicit streams.
const CU_STREAM_LEGACY: usize = 0x1;
const CU_STREAM_PER_THREAD: usize = 0x2;

/// How long dropping a stream waits for its work before destroying it anyway (the driver
/// then releases the stream once its work is done).
const DROP_DRAIN: Duration = Duration::from_secs(10);

/// The handle passed to the driver for a caller's `raw`: null, the legacy default stream, is
/// passed as `CU_STREAM_LEGACY`, which means the legacy stream whatever the entry point's
/// default-stream mode.
pub(super) fn driver_handle(raw: *mut c_void) -> sys::CUstream {
    if raw.is_null() {
        CU_STREAM_LEGACY as sys::CUstream
    } else {
        raw.cast()
    }
}

/// Null, `CU_STREAM_LEGACY` or `CU_STREAM_PER_THREAD`: the current context's implicit
/// streams, valid on every device.
pub(super) fn is_implicit(raw: *mut c_void) -> bool {
    matches!(raw as usize, 0 | CU_STREAM_LEGACY | CU_STREAM_PER_THREAD)
}

/// A stream of `ctx`'s device; destroyed on drop when qccl created it.
pub(super) struct CudaStream {
    ctx: Arc<Context>,
    raw: *mut c_void,
    owned: bool,
}

// SAFETY: a CUstream is a driver handle usable from any thread once its context is current
// (every call below enters it first); an owned stream is destroyed once, in Drop, and a
// borrowed one outlives this value (borrow's contract).
unsafe impl Send for CudaStream {}

impl CudaStream {
    /// The device address of the page-locked `word`, for the stream memory operations; the
    /// context must be current.
    ///
    /// # Safety
    /// `word` must lie in memory from `cuMemHostAlloc` with DEVICEMAP (this driver's
    /// `alloc_pinned`).
    unsafe fn mapped_word(&self, word: *const u32) -> Result<sys::CUdeviceptr> {
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: `word` has a device address (this function's contract); `dptr` is a valid
        // out pointer.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, word as *mut _, 0) };
        check(r, "cuMemHostGetDevicePointer", || {
            format!("mapping the word {word:p} for {}", self.place())
        })?;
        Ok(dptr)
    }
    /// A new non-blocking stream in `ctx`.
    pub(super) fn create(ctx: Arc<Context>) -> Result<CudaStream> {
        let _current = ctx.enter()?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the stream is destroyed in Drop.
        let r = unsafe { sys::cuStreamCreate(&mut raw, STREAM_FLAGS) };
        check(r, "cuStreamCreate", || {
            format!("creating a stream on CUDA device {}", ctx.ordinal())
        })?;
        Ok(CudaStream {
            ctx,
            raw: raw.cast(),
            owned: true,
        })
    }

    /// The caller's stream `raw` in `ctx`. A stream of another context (another device, or a
    /// context the application created itself) is refused: qccl's memory and events live in
    /// the device's primary context, the one the CUDA runtime uses.
    ///
    /// # Safety
    /// `raw` is null, an implicit stream handle, or a live stream that outlives the value.
    pub(super) unsafe fn borrow(ctx: Arc<Context>, raw: *mut c_void) -> Result<CudaStream> {
        if !is_implicit(raw) {
            let _current = ctx.enter()?;
            let mut owner: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: `raw` is a live stream (the caller's promise); `owner` is a valid
            // out-pointer.
            let r = unsafe { sys::cuStreamGetCtx(raw.cast(), &mut owner) };
            check(r, "cuStreamGetCtx", || {
                format!("checking the caller's stream {raw:p}")
            })?;
            if owner != ctx.raw() {
                return Err(Error::invalid(format!(
                    "stream {raw:p} does not belong to CUDA device {}'s primary context (the \
                     CUDA runtime's): it is a stream of another device or of a context the \
                     application created",
                    ctx.ordinal()
                )));
            }
        }
        Ok(CudaStream {
            ctx,
            raw,
            owned: false,
        })
    }

    fn handle(&self) -> sys::CUstream {
        driver_handle(self.raw)
    }

    /// "stream 0x… of CUDA device N", for messages.
    fn place(&self) -> String {
        format!(
            "stream {:p} of CUDA device {}",
            self.raw,
            self.ctx.ordinal()
        )
    }
}

impl Stream for CudaStream {
    fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    fn raw(&self) -> *mut c_void {
        self.raw
    }

    unsafe fn copy_to_host(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        if dst.is_null() {
            return Err(Error::invalid(format!(
                "copying {len} bytes from device address {src:#x} to a null host pointer"
            )));
        }
        let _current = self.ctx.enter()?;
        check_device_range(self.ordinal(), src, len)
            .map_err(|e| e.prefixed(&format!("copying to host on {}: ", self.place())))?;
        // SAFETY: `src..src+len` is inside one allocation of this device (checked above);
        // `dst..dst+len` is writable until the copy is known done (the caller's promise);
        // the stream is live in the current context.
        let r = unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, self.handle()) };
        check(r, "cuMemcpyDtoHAsync", || {
            format!(
                "copying {len} bytes from device address {src:#x} to host memory {dst:p} on {}",
                self.place()
            )
        })
    }

    unsafe fn copy_to_device(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        if src.is_null() {
            return Err(Error::invalid(format!(
                "copying {len} bytes from a null host pointer to device address {dst:#x}"
            )));
        }
        let _current = self.ctx.enter()?;
        check_device_range(self.ordinal(), dst, len)
            .map_err(|e| e.prefixed(&format!("copying to the device on {}: ", self.place())))?;
        // SAFETY: `dst..dst+len` is inside one allocation of this device (checked above);
        // `src..src+len` is readable and unchanged until the copy is known done (the
        // caller's promise); the stream is live in the current context.
        let r = unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, self.handle()) };
        check(r, "cuMemcpyHtoDAsync", || {
            format!(
                "copying {len} bytes from host memory {src:p} to device address {dst:#x} on {}",
                self.place()
            )
        })
    }

    unsafe fn copy_on_device(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        if src.max(dst) - src.min(dst) < len as u64 {
            return Err(Error::invalid(format!(
                "copying {len} bytes on the device from {src:#x} to {dst:#x}: the ranges overlap"
            )));
        }
        let _current = self.ctx.enter()?;
        for at in [src, dst] {
            check_device_range(self.ordinal(), at, len)
                .map_err(|e| e.prefixed(&format!("copying on the device on {}: ", self.place())))?;
        }
        // SAFETY: both ranges are inside allocations of this device (checked above) and do
        // not overlap; nothing else touches them until the copy is known done (the caller's
        // promise); the stream is live in the current context.
        let r = unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, self.handle()) };
        check(r, "cuMemcpyDtoDAsync", || {
            format!(
                "copying {len} bytes from device address {src:#x} to {dst:#x} on {}",
                self.place()
            )
        })
    }

    fn record(&self) -> Result<Box<dyn Event>> {
        // SAFETY: the stream is live for as long as `self` (owned, or the borrow's promise).
        let event =
            unsafe { CudaEvent::record(self.ctx.clone(), self.handle(), self.raw as usize)? };
        Ok(Box::new(event))
    }

    fn wait_event(&self, event: &dyn Event) -> Result<()> {
        let Some(event) = event.as_any().downcast_ref::<CudaEvent>() else {
            return Err(Error::invalid(format!(
                "wait_event on {}: the event was not made by the CUDA driver",
                self.place()
            )));
        };
        let _current = self.ctx.enter()?;
        let flags = sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT as u32;
        // SAFETY: the stream and the event are live; waiting on an event of another stream
        // (or device) is allowed by the driver and does not block the caller.
        let r = unsafe { sys::cuStreamWaitEvent(self.handle(), event.raw(), flags) };
        check(r, "cuStreamWaitEvent", || {
            format!("making {} wait for an event", self.place())
        })
    }

    unsafe fn wait_word(&self, word: *const u32, value: u32) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: the caller's promise (this function's contract).
        let dptr = unsafe { self.mapped_word(word) }?;
        let flags = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
        // SAFETY: the stream is live and `dptr` maps a word that stays allocated until the
        // wait is done (this function's contract).
        let r = unsafe { sys::cuStreamWaitValue32_v2(self.handle(), dptr, value, flags) };
        check(r, "cuStreamWaitValue32", || {
            format!("making {} wait for a word", self.place())
        })
    }

    unsafe fn write_word(&self, word: *mut u32, value: u32) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: the caller's promise (this function's contract).
        let dptr = unsafe { self.mapped_word(word) }?;
        // The default flags keep the memory barrier: the work before is visible first.
        let flags = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
        // SAFETY: the stream is live and `dptr` maps a word that stays allocated until the
        // store is done (this function's contract).
        let r = unsafe { sys::cuStreamWriteValue32_v2(self.handle(), dptr, value, flags) };
        check(r, "cuStreamWriteValue32", || {
            format!("making {} store a word", self.place())
        })
    }

    unsafe fn launch(&self, f: &dyn Function, grid: u32, block: u32, args: &[Arg]) -> Result<()> {
        let what = || {
            format!(
                "launching kernel {} (grid {grid}, block {block}) on {}",
                f.name(),
                self.place()
            )
        };
        let Some(func) = f.as_any().downcast_ref::<CudaFunction>() else {
            return Err(Error::invalid(format!(
                "{}: the function was not made by the CUDA driver",
                what()
            )));
        };
        if func.ordinal() != self.ordinal() {
            return Err(Error::invalid(format!(
                "{}: the function was loaded for CUDA device {}",
                what(),
                func.ordinal()
            )));
        }
        if grid == 0 || block == 0 {
            return Err(Error::invalid(format!(
                "{}: an empty grid or block",
                what()
            )));
        }
        let mut values = ArgBlock::new(args);
        let mut params = values.params();
        let _current = self.ctx.enter()?;
        // SAFETY: a function of a module loaded in this stream's context; `params` holds a
        // pointer to each argument's value, which the driver copies before returning; the
        // caller vouches that they match the kernel's parameters and that the memory they
        // name stays valid until the launch is done (this function's contract); 1-D shape,
        // no dynamic shared memory, no `extra`.
        let r = unsafe {
            sys::cuLaunchKernel(
                func.raw(),
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                self.handle(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        check(r, "cuLaunchKernel", what)
    }

    fn synchronize(&self, timeout: Duration) -> Result<()> {
        self.record()?.synchronize(timeout)
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        if let Err(e) = self.synchronize(DROP_DRAIN) {
            crate::qlog!(
                Warn,
                "destroying {} before its work is known done: {e}",
                self.place()
            );
        }
        let destroyed = self.ctx.enter().and_then(|_current| {
            // SAFETY: created by cuStreamCreate and destroyed once, here. Work still queued
            // finishes first: the driver releases the stream after it.
            let r = unsafe { sys::cuStreamDestroy_v2(self.handle()) };
            check(r, "cuStreamDestroy", || {
                format!("destroying {}", self.place())
            })
        });
        if let Err(e) = destroyed {
            crate::qlog!(Warn, "{e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_streams_do_not_synchronise_with_the_default_stream() {
        assert_eq!(STREAM_FLAGS, 0x1);
    }

    #[test]
    fn null_is_passed_as_the_legacy_stream_and_others_unchanged() {
        assert_eq!(driver_handle(std::ptr::null_mut()) as usize, 0x1);
        let raw = 0x7f00_1234_5000_usize as *mut c_void;
        assert_eq!(driver_handle(raw) as usize, 0x7f00_1234_5000);
    }

    #[test]
    fn implicit_stream_handles_are_recognised() {
        for h in [0usize, 1, 2] {
            assert!(is_implicit(h as *mut c_void), "{h}");
        }
        assert!(!is_implicit(0x5000 as *mut c_void));
    }
}
