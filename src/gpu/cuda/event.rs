//! Events (`cuEventCreate` without timing, `cuEventRecord`), and the bounded wait every
//! blocking call of this driver uses: poll `cuEventQuery` with short sleeps until the
//! deadline, never `cuEventSynchronize`/`cuStreamSynchronize`, which cannot be bounded.

use super::call::{check, failed};
use super::context::Context;
use crate::error::{Error, Result};
use crate::gpu::driver::Event;
use cudarc::driver::sys::{self, CUresult};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Events only order work and say when it is done: no timestamps, which makes recording and
/// querying them cheaper (CUDA's advice for synchronisation-only events).
pub(super) const EVENT_FLAGS: u32 = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;

/// The first sleep between two polls; it doubles up to [`MAX_POLL_SLEEP`]. Short first,
/// because staging waits for copies of microseconds; capped, so a long wait costs little CPU
/// and still notices completion within a fraction of a millisecond.
const FIRST_POLL_SLEEP: Duration = Duration::from_micros(5);
const MAX_POLL_SLEEP: Duration = Duration::from_micros(500);

/// The sleep after `sleep`.
pub(super) fn next_sleep(sleep: Duration) -> Duration {
    (sleep * 2).min(MAX_POLL_SLEEP)
}

/// An event recorded on a stream of `ctx`'s device; destroyed on drop.
pub(super) struct CudaEvent {
    raw: sys::CUevent,
    ctx: Arc<Context>,
    /// The stream it was recorded on, for messages.
    stream: usize,
}

// SAFETY: a CUevent is a driver handle usable from any thread once its context is current
// (every use below enters it); it is destroyed once, in Drop.
unsafe impl Send for CudaEvent {}
// SAFETY: as for Send; cuEventQuery and cuStreamWaitEvent on a shared event are thread safe
// and nothing is mutated through &self.
unsafe impl Sync for CudaEvent {}

impl CudaEvent {
    /// Creates an event and records it on `stream` (a handle of `ctx`'s device, already
    /// translated for the driver), after the work enqueued there so far.
    ///
    /// # Safety
    /// `stream` must be a live stream of `ctx`, or a special handle (CU_STREAM_LEGACY).
    pub(super) unsafe fn record(
        ctx: Arc<Context>,
        stream: sys::CUstream,
        shown: usize,
    ) -> Result<CudaEvent> {
        let _current = ctx.enter()?;
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the event is destroyed in Drop.
        let r = unsafe { sys::cuEventCreate(&mut raw, EVENT_FLAGS) };
        check(r, "cuEventCreate", || {
            format!("creating an event on CUDA device {}", ctx.ordinal())
        })?;
        let event = CudaEvent {
            raw,
            ctx: ctx.clone(),
            stream: shown,
        };
        // SAFETY: the event is live; `stream` is live (the caller's promise); both belong to
        // the current context.
        let r = unsafe { sys::cuEventRecord(event.raw, stream) };
        check(r, "cuEventRecord", || {
            format!("recording an event on {}", event.place())
        })?;
        Ok(event)
    }

    /// The raw event, for `cuStreamWaitEvent`.
    pub(super) fn raw(&self) -> sys::CUevent {
        self.raw
    }

    /// "stream 0x… of CUDA device N", for messages.
    fn place(&self) -> String {
        format!(
            "stream {:#x} of CUDA device {}",
            self.stream,
            self.ctx.ordinal()
        )
    }
}

impl Event for CudaEvent {
    fn query(&self) -> Result<bool> {
        let _current = self.ctx.enter()?;
        // SAFETY: the event is live (destroyed only in Drop) and its context current.
        match unsafe { sys::cuEventQuery(self.raw) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => Err(failed(
                r,
                "cuEventQuery",
                format!("work on {}", self.place()),
            )),
        }
    }

    fn synchronize(&self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let mut sleep = FIRST_POLL_SLEEP;
        loop {
            if self.query()? {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(Error::Timeout(format!(
                    "work on {} was not done after {timeout:?}",
                    self.place()
                )));
            }
            std::thread::sleep(sleep.min(timeout - waited));
            sleep = next_sleep(sleep);
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        let destroyed = self.ctx.enter().and_then(|_current| {
            // SAFETY: created by cuEventCreate and destroyed once, here. An event may be
            // destroyed before its work is done: the driver releases it once it is.
            let r = unsafe { sys::cuEventDestroy_v2(self.raw) };
            check(r, "cuEventDestroy", || {
                format!("destroying an event of {}", self.place())
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
    fn events_record_no_timing() {
        assert_eq!(EVENT_FLAGS, 0x2);
    }

    #[test]
    fn poll_sleeps_grow_and_stay_short() {
        let mut sleep = FIRST_POLL_SLEEP;
        let mut total = Duration::ZERO;
        for _ in 0..20 {
            total += sleep;
            let next = next_sleep(sleep);
            assert!(next >= sleep && next <= MAX_POLL_SLEEP);
            sleep = next;
        }
        assert_eq!(sleep, MAX_POLL_SLEEP);
        assert!(total < Duration::from_millis(10), "{total:?}");
    }
}
