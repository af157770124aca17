//! A device's primary context, retained while anything made on the device lives, and the
//! scope that makes it current on the calling thread for the length of one call.
//!
//! Why the primary context: it is the one the CUDA runtime (and so PyTorch) uses, so device
//! pointers, streams and events of the application are valid in it. Why push/pop rather than
//! `cuCtxSetCurrent`: the caller's thread keeps the context it had (a framework's current
//! device is not changed behind its back), and threads may move between calls, so every call
//! enters the context again instead of assuming one stayed current.

use super::call::{check, failed};
use crate::error::Result;
use cudarc::driver::sys::{self, CUresult};
use std::marker::PhantomData;

/// Device `ordinal`'s primary context (`cuDevicePrimaryCtxRetain`), released on drop.
pub(super) struct Context {
    ordinal: usize,
    dev: sys::CUdevice,
    raw: sys::CUcontext,
}

// SAFETY: a CUcontext and CUdevice are process-wide driver handles, not tied to the thread
// that obtained them: the driver API lets any thread make a context current and call into
// it, and its entry points are thread safe. The retain is released exactly once, in Drop.
unsafe impl Send for Context {}
// SAFETY: as for Send; shared use only makes the context current (per thread) and calls
// thread-safe driver functions, nothing is mutated through &self.
unsafe impl Sync for Context {}

impl Context {
    /// Retains device `ordinal`'s primary context. `cuInit` must have succeeded (the probe).
    pub(super) fn retain(ordinal: usize) -> Result<Context> {
        let what = || format!("opening CUDA device {ordinal}");
        let index = i32::try_from(ordinal)
            .map_err(|_| crate::Error::invalid(format!("no CUDA device {ordinal}")))?;
        let mut dev: sys::CUdevice = 0;
        // SAFETY: `dev` is a valid out-pointer; the driver was initialised by the probe.
        check(
            unsafe { sys::cuDeviceGet(&mut dev, index) },
            "cuDeviceGet",
            what,
        )?;
        let mut raw: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `dev` came from cuDeviceGet; `raw` is a valid out-pointer. Released in Drop.
        let r = unsafe { sys::cuDevicePrimaryCtxRetain(&mut raw, dev) };
        check(r, "cuDevicePrimaryCtxRetain", what)?;
        Ok(Context { ordinal, dev, raw })
    }

    /// The device's ordinal.
    pub(super) fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The driver's device handle.
    pub(super) fn device(&self) -> sys::CUdevice {
        self.dev
    }

    /// The raw context.
    pub(super) fn raw(&self) -> sys::CUcontext {
        self.raw
    }

    /// Makes this context current on the calling thread until the returned scope ends; the
    /// thread's previous context is current again afterwards.
    pub(super) fn enter(&self) -> Result<Current> {
        let what = || format!("making CUDA device {}'s context current", self.ordinal);
        let mut now: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `now` is a valid out-pointer.
        check(
            unsafe { sys::cuCtxGetCurrent(&mut now) },
            "cuCtxGetCurrent",
            what,
        )?;
        if now == self.raw {
            return Ok(Current {
                pushed: false,
                _thread: PhantomData,
            });
        }
        // SAFETY: `raw` is retained (alive) for as long as `self`; the scope pops it again on
        // this thread (Current is not Send).
        check(
            unsafe { sys::cuCtxPushCurrent_v2(self.raw) },
            "cuCtxPushCurrent",
            what,
        )?;
        Ok(Current {
            pushed: true,
            _thread: PhantomData,
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: retained once in `retain`, released once here; everything made in the
        // context holds an Arc of it and is gone.
        let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
        if r != CUresult::CUDA_SUCCESS {
            let e = failed(
                r,
                "cuDevicePrimaryCtxRelease",
                format!("releasing CUDA device {}'s context", self.ordinal),
            );
            crate::qlog!(Warn, "{e}");
        }
    }
}

/// A context made current by [`Context::enter`]; pops it on drop. Bound to its thread.
pub(super) struct Current {
    pushed: bool,
    // The context stack is per thread: the scope must end on the thread that began it.
    _thread: PhantomData<*const ()>,
}

impl Drop for Current {
    fn drop(&mut self) {
        if !self.pushed {
            return;
        }
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `enter` pushed a context on this thread (Current is not Send) and nothing
        // between pushes without popping; `popped` is a valid out-pointer.
        let r = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
        if r != CUresult::CUDA_SUCCESS {
            let e = failed(
                r,
                "cuCtxPopCurrent",
                "restoring the caller's CUDA context".into(),
            );
            crate::qlog!(Warn, "{e}");
        }
    }
}
