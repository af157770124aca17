//! How a rank waits: spin with a pause hint for a bounded time, then yield, then block.
//!
//! On this kind of VM waking a blocked process costs ~100–250 µs while a spin round trip
//! costs well under 1 µs. The spin must outlast one wake-up: otherwise, once one rank has
//! blocked, its partner gives up spinning before the reply comes, blocks too, and every later
//! hop pays a wake-up. When ranks outnumber cores the comm sets `spin` to zero (spinning would
//! steal the core the peer needs) and the waiter yields for a while instead, which hands the
//! core to a runnable peer without the cost of sleeping.

use crate::error::{Error, Result};
use crate::transport::LinkConfig;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Longest single block, so the abort flag is seen promptly.
pub const MAX_BLOCK: Duration = Duration::from_millis(100);

/// State of one wait loop.
pub struct Waiter {
    spin: Duration,
    yield_until: Duration,
    timeout: Duration,
    last_progress: Instant,
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
        }
    }

    /// Records that bytes moved: the timeout counts from here.
    pub fn progressed(&mut self) {
        self.last_progress = Instant::now();
    }

    /// Called when nothing moved. Errors on abort or when the timeout passed;
    /// `stalled` describes what is awaited, for the timeout message.
    pub fn idle(&mut self, cfg: &LinkConfig, stalled: impl FnOnce() -> String) -> Result<Next> {
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
            return Err(Error::Timeout(format!(
                "rank {}: no progress for {} ms (QCCL_TIMEOUT_MS): {}",
                cfg.rank,
                self.timeout.as_millis(),
                stalled()
            )));
        }
        Ok(Next::Block((self.timeout - waited).min(MAX_BLOCK)))
    }
}
