//! How a rank waits: spin with a pause hint for a bounded time, then yield, then block.
//!
//! On this kind of VM waking a blocked process costs ~100–250 µs while a spin round trip
//! costs well under 1 µs. The spin must outlast one wake-up: otherwise, once one rank has
//! blocked, its partner gives up spinning before the reply comes, blocks too, and every later
//! hop pays a wake-up. When ranks outnumber cores the comm sets `spin` to zero (spinning would
//! steal the core the peer needs) and the waiter yields for a while instead, which hands the
//! core to a runnable peer without the cost of sleeping.

use crate::error::{Error, Result};
use crate::transport::stall::{self, Inspector, Stalled};
use crate::transport::LinkConfig;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest single block, so the abort flag is seen promptly.
pub const MAX_BLOCK: Duration = Duration::from_millis(100);

/// State of one wait loop. While it blocks, the comm's stall inspector says what it waits
/// for; dropping it (the operation ended) clears that.
pub struct Waiter {
    spin: Duration,
    yield_until: Duration,
    timeout: Duration,
    last_progress: Instant,
    inspector: Option<Arc<Inspector>>,
    /// The inspector holds this wait's entry.
    published: bool,
    /// ... and it is current (nothing moved since).
    current: bool,
}

/// What the wait loop should do next.
pub enum Next {
    /// Try the non-blocking operations again right away.
    Retry,
    /// Block for at most this long.
    Block(Duration),
}

impl Waiter {
    /// A waiter with the link's spin and timeout.
    pub fn new(cfg: &LinkConfig) -> Waiter {
        Waiter {
            spin: cfg.spin,
            yield_until: cfg.spin + cfg.yield_for,
            timeout: cfg.timeout,
            last_progress: Instant::now(),
            inspector: cfg.inspector.clone(),
            published: false,
            current: false,
        }
    }

    /// Records that bytes moved: the timeout counts from here.
    pub fn progressed(&mut self) {
        self.last_progress = Instant::now();
        self.current = false;
    }

    /// Called when nothing moved. Errors on abort or when the timeout passed (naming the rank
    /// that stalled: see `stall`); `stalled(full)` says what is awaited: the operation and
    /// peers for the inspector, and with `full` the description for the timeout message too
    /// (formatted only then, off the path of a wait that merely blocks).
    pub fn idle(
        &mut self,
        cfg: &LinkConfig,
        stalled: impl FnOnce(bool) -> Stalled,
    ) -> Result<Next> {
        if cfg.abort.load(Ordering::Relaxed) {
            return Err(Error::Aborted("abort() was called on this comm".into()));
        }
        let waited = self.last_progress.elapsed();
        if waited < self.spin {
            std::hint::spin_loop();
            return Ok(Next::Retry);
        }
        if waited < self.yield_until {
            std::thread::yield_now();
            return Ok(Next::Retry);
        }
        if waited >= self.timeout {
            return Err(match &self.inspector {
                Some(i) => i.diagnose(self.timeout, &cfg.abort, stalled(true)),
                None => stall::plain_timeout(cfg.rank, self.timeout, stalled(true)),
            });
        }
        if !self.current {
            if let Some(i) = &self.inspector {
                i.waiting(&stalled(false), self.last_progress);
                self.published = true;
            }
            self.current = true;
        }
        Ok(Next::Block((self.timeout - waited).min(MAX_BLOCK)))
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        if let (true, Some(i)) = (self.published, &self.inspector) {
            i.done();
        }
    }
}
