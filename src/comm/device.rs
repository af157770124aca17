//! Calls whose buffers may be device memory (the C ABI's and Python's way in): where every
//! buffer lives is found before any byte moves, and device buffers go through the comm's
//! staging (`gpu::staging`) on the device of its first such call, as an NCCL comm belongs to
//! one device.

use super::Comm;
use crate::error::{Error, Result};
use crate::gpu::staging::{self, CallBuf, Staging};
use std::ffi::c_void;

impl Comm {
    /// True when any of `bufs` is device memory (false without a usable driver).
    #[doc(hidden)]
    pub fn device_buffers(&self, bufs: &[CallBuf]) -> Result<bool> {
        let Ok(driver) = crate::gpu::select::driver() else {
            return Ok(false);
        };
        Ok(staging::locate(&*driver, bufs)?.ordinal()?.is_some())
    }

    /// Runs a call on `bufs`: `run` gets an address standing for each (itself when it is
    /// host memory, a page-locked copy when it is device memory: copied in when the call
    /// reads it, after the work enqueued on `stream` so far, and out when it writes it,
    /// before this returns). `stream` is a `CUstream` of the buffers' device or null (the
    /// legacy default stream); without a usable driver every buffer is host memory and
    /// `stream` must be null.
    ///
    /// # Safety
    /// Each buffer must be valid for the reads and writes it declares (host or device memory
    /// of `len` bytes) until this returns, and `stream` null or a live stream of that device.
    #[doc(hidden)]
    pub unsafe fn on_buffers<R>(
        &self,
        bufs: &[CallBuf],
        stream: *mut c_void,
        run: impl FnOnce(&[*mut u8]) -> Result<R>,
    ) -> Result<R> {
        let as_given = || bufs.iter().map(|b| b.addr as *mut u8).collect::<Vec<_>>();
        let driver = match crate::gpu::select::driver() {
            Ok(d) => d,
            Err(_) if stream.is_null() => return run(&as_given()),
            Err(e) => {
                return Err(Error::Unsupported(format!(
                    "stream {stream:p}: no device buffers here ({e}); pass NULL (host memory, \
                     the call completes before returning)"
                )))
            }
        };
        let place = staging::locate(&*driver, bufs)?;
        let mut guard = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let ordinal = match (place.ordinal()?, guard.as_ref()) {
            (None, _) if stream.is_null() => return run(&as_given()),
            (Some(o), Some(s)) if o != s.ordinal() => {
                return Err(Error::invalid(format!(
                    "buffers on device {o}, but this comm's device is {} (the device of its \
                     first call on device memory)",
                    s.ordinal()
                )))
            }
            (Some(o), _) => o,
            // Host buffers with a stream: they wait for its earlier work on the comm's device.
            (None, Some(s)) => s.ordinal(),
            (None, None) => 0,
        };
        if guard.is_none() {
            crate::qlog!(
                Info,
                "rank {}: device buffers on {} device {ordinal} ({}), staged through \
                 page-locked memory",
                self.rank,
                driver.kind(),
                driver.device(ordinal).map(|d| d.name).unwrap_or_default()
            );
            *guard = Some(Staging::new(driver, ordinal, self.config.timeout)?);
        }
        let st = guard.as_mut().expect("set above");
        // SAFETY: the caller's promise, passed on.
        unsafe { st.run(bufs, &place, stream, run) }
    }
}
