//! Emulated events: a point in a stream's work, completed by the stream's worker when it
//! reaches it (with the stream's error if the stream failed first).

use crate::error::{Error, Result};
use crate::gpu::driver::Event;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How often a wait that can be abandoned looks at its abandon flag.
const POLL: Duration = Duration::from_millis(10);

/// The shared state of one event.
pub struct EventState {
    /// "event 4 of emulated stream 2 on device 0", for errors.
    pub name: String,
    done: Mutex<Option<Result<()>>>,
    cond: Condvar,
}

impl EventState {
    /// A pending event.
    pub fn new(name: String) -> Arc<EventState> {
        Arc::new(EventState {
            name,
            done: Mutex::new(None),
            cond: Condvar::new(),
        })
    }

    /// Marks the recorded work done (`Err`: it failed); the first completion counts.
    pub fn complete(&self, result: Result<()>) {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        if done.is_none() {
            *done = Some(result);
            self.cond.notify_all();
        }
    }

    /// `None` while pending, else the work's result.
    pub fn state(&self) -> Option<Result<()>> {
        self.done.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Waits for completion until `deadline`, or until `abandon` is set; `None` when neither
    /// completion came.
    pub fn wait_until(
        &self,
        deadline: Instant,
        abandon: Option<&AtomicBool>,
    ) -> Option<Result<()>> {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = done.as_ref() {
                return Some(r.clone());
            }
            let now = Instant::now();
            if now >= deadline
                || abandon.is_some_and(|a| a.load(std::sync::atomic::Ordering::Acquire))
            {
                return None;
            }
            let slice = if abandon.is_some() {
                POLL.min(deadline - now)
            } else {
                deadline - now
            };
            done = self
                .cond
                .wait_timeout(done, slice)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// An event handed to the caller.
pub struct EmuEvent {
    pub(super) state: Arc<EventState>,
}

impl Event for EmuEvent {
    fn query(&self) -> Result<bool> {
        drop(super::stream::driver_lock());
        match self.state.state() {
            None => Ok(false),
            Some(r) => r.map(|()| true),
        }
    }

    fn synchronize(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now()
            .checked_add(timeout)
            .unwrap_or_else(|| Instant::now() + Duration::from_secs(86400 * 365));
        self.state.wait_until(deadline, None).unwrap_or_else(|| {
            Err(Error::Timeout(format!(
                "{} not reached after {timeout:?}",
                self.state.name
            )))
        })
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
