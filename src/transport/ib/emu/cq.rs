//! The emulated completion queue: a bounded queue under a mutex, and a condvar to wait on.
//!
//! Overrun: a real CQ that overflows is broken (an asynchronous CQ error; its queue pairs
//! fail). Here the completion that did not fit is dropped, the queue is marked overrun, and
//! every later `poll` returns an error naming the depth, so a link that under-sizes its CQ
//! fails loudly instead of losing a completion silently.

use crate::error::{Error, Result};
use crate::transport::ib::verbs::{Completion, CompletionQueue};
use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// A completion queue of an emulated context.
pub struct EmuCq {
    depth: usize,
    name: String,
    state: Mutex<State>,
    ready: Condvar,
}

struct State {
    queue: VecDeque<Completion>,
    overrun: bool,
}

impl EmuCq {
    /// An empty queue with room for `depth` completions; `name` (the context's) is for errors.
    pub fn new(depth: u32, name: String) -> EmuCq {
        EmuCq {
            depth: depth as usize,
            name,
            state: Mutex::new(State {
                queue: VecDeque::new(),
                overrun: false,
            }),
            ready: Condvar::new(),
        }
    }

    /// Adds a completion, as the NIC does; past the depth the queue is overrun (see the
    /// module doc).
    pub fn push(&self, c: Completion) {
        let mut s = self.lock();
        if s.queue.len() >= self.depth {
            if !s.overrun {
                crate::qlog!(
                    Warn,
                    "{}: completion queue overrun (depth {}): qp {} wr_id {} dropped",
                    self.name,
                    self.depth,
                    c.qpn,
                    c.wr_id
                );
            }
            s.overrun = true;
        } else {
            s.queue.push_back(c);
        }
        drop(s);
        self.ready.notify_all();
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding it left a consistent queue: keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl CompletionQueue for EmuCq {
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        let mut s = self.lock();
        if s.overrun {
            return Err(Error::System(format!(
                "{}: completion queue overrun: more than its depth of {} completions were \
                 outstanding",
                self.name, self.depth
            )));
        }
        let n = max.min(s.queue.len());
        out.extend(s.queue.drain(..n));
        Ok(n)
    }

    fn wait(&self, d: Duration) {
        let s = self.lock();
        if s.queue.is_empty() && !s.overrun {
            let _ = self.ready.wait_timeout(s, d);
        }
    }
}
