//! Each kernel's time within a launch plan: a stream that synchronizes before and after every
//! launch and times it on the host's clock. The kernels then run one at a time, so their
//! times add up to more than the plan's own (each also carries a synchronize's few
//! microseconds): the shares say which kernel to work on, not the plan's speed.

use crate::error::Result;
use crate::gpu::driver::{Arg, Event, Function, Stream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A stream of the device whose launches are timed one by one.
pub struct Profiled {
    inner: Box<dyn Stream>,
    timeout: Duration,
    /// (kernel, time) of every launch so far, in order.
    times: Mutex<Vec<(String, Duration)>>,
}

impl Profiled {
    pub fn new(inner: Box<dyn Stream>, timeout: Duration) -> Profiled {
        Profiled {
            inner,
            timeout,
            times: Mutex::new(Vec::new()),
        }
    }

    /// Mean seconds per run of each kernel over `runs` runs of the plan, in the order the
    /// kernels first ran; forgets them.
    pub fn take(&self, runs: usize) -> Vec<(String, f64)> {
        let times = std::mem::take(&mut *self.times.lock().unwrap_or_else(|p| p.into_inner()));
        let mut out: Vec<(String, f64)> = Vec::new();
        for (name, t) in times {
            let secs = t.as_secs_f64() / runs.max(1) as f64;
            match out.iter_mut().find(|(n, _)| *n == name) {
                Some((_, s)) => *s += secs,
                None => out.push((name, secs)),
            }
        }
        out
    }
}

impl Stream for Profiled {
    fn ordinal(&self) -> usize {
        self.inner.ordinal()
    }

    fn raw(&self) -> *mut std::ffi::c_void {
        self.inner.raw()
    }

    unsafe fn copy_to_host(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.copy_to_host(dst, src, len) }
    }

    unsafe fn copy_to_device(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.copy_to_device(dst, src, len) }
    }

    unsafe fn copy_on_device(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.copy_on_device(dst, src, len) }
    }

    fn record(&self) -> Result<Box<dyn Event>> {
        self.inner.record()
    }

    fn wait_event(&self, event: &dyn Event) -> Result<()> {
        self.inner.wait_event(event)
    }

    unsafe fn wait_word(&self, word: *const u32, value: u32) -> Result<()> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.wait_word(word, value) }
    }

    unsafe fn write_word(&self, word: *mut u32, value: u32) -> Result<()> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.write_word(word, value) }
    }

    unsafe fn launch(&self, f: &dyn Function, grid: u32, block: u32, args: &[Arg]) -> Result<()> {
        self.inner.synchronize(self.timeout)?;
        let start = Instant::now();
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.launch(f, grid, block, args) }?;
        self.inner.synchronize(self.timeout)?;
        let took = start.elapsed();
        let mut times = self.times.lock().unwrap_or_else(|p| p.into_inner());
        times.push((f.name().to_string(), took));
        Ok(())
    }

    fn synchronize(&self, timeout: Duration) -> Result<()> {
        self.inner.synchronize(timeout)
    }
}
