//! The page-locked buffers of calls on a caller's stream, reused across calls and capped.
//!
//! Such a call returns once enqueued and holds its buffers until the comm's worker is done
//! with it, so a caller enqueueing many large calls would otherwise pin as much memory as it
//! enqueued. The pool keeps the buffers freed by finished calls for later ones (pinning
//! memory is slow) and bounds the bytes it holds, free and lent together, by a cap
//! (QCCL_STAGING_BYTES): a call that would pass it first lets go of free buffers it cannot
//! use, then waits for earlier calls to give theirs back, at most the comm's timeout. A call
//! larger than the cap still runs, alone: with nothing lent the pool gives up every free
//! buffer and pins that call's bytes, so it holds at most max(cap, the largest call).

use crate::error::{Error, Result};
use crate::gpu::driver::{Driver, Pinned};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// The smallest buffer pinned (a page), so small calls share what they leave behind.
const MIN_BUFFER: usize = 4096;

/// The default cap on page-locked bytes of calls in flight on callers' streams.
pub const DEFAULT_STAGING_BYTES: usize = 256 << 20;

/// What the pool holds and did, for tests and logs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// The cap (QCCL_STAGING_BYTES).
    pub cap: usize,
    /// Page-locked bytes held now, free and lent.
    pub pinned: usize,
    /// Of `pinned`, bytes lent to calls in flight.
    pub lent: usize,
    /// The most bytes ever held at once.
    pub peak: usize,
    /// Calls that had to wait for earlier ones to give their buffers back.
    pub waits: u64,
}

/// Page-locked buffers for calls on callers' streams, shared by those calls' `Finish`es.
pub struct Pool {
    state: Mutex<State>,
    returned: Condvar,
}

struct State {
    free: Vec<Box<dyn Pinned>>,
    stats: PoolStats,
}

impl Pool {
    /// An empty pool holding at most `cap` bytes (but always one call's worth).
    pub fn new(cap: usize) -> Pool {
        Pool {
            state: Mutex::new(State {
                free: Vec::new(),
                stats: PoolStats {
                    cap,
                    ..PoolStats::default()
                },
            }),
            returned: Condvar::new(),
        }
    }

    /// What it holds and did so far.
    pub fn stats(&self) -> PoolStats {
        self.lock().stats
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One buffer of at least each of `lens` bytes, all at once (a call never holds some
    /// while waiting for the rest, which could starve another call of its share): free ones
    /// where they fit, else newly pinned ones from `driver`. Waits at most `timeout` for
    /// earlier calls to return theirs when the cap is reached; then an error naming the cap.
    pub fn take(
        self: &Arc<Pool>,
        driver: &dyn Driver,
        lens: &[usize],
        timeout: Duration,
    ) -> Result<Lent> {
        let deadline = Instant::now() + timeout;
        let mut st = self.lock();
        let mut waited = false;
        loop {
            if let Some(bufs) = st.try_take(driver, lens)? {
                return Ok(Lent {
                    pool: self.clone(),
                    bufs,
                });
            }
            if !waited {
                st.stats.waits += 1;
                waited = true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let need: usize = lens.iter().map(|&l| l.max(MIN_BUFFER)).sum();
                return Err(Error::Timeout(format!(
                    "page-locked staging: a call on a stream needs {need} bytes, but {} of the \
                     {} allowed (QCCL_STAGING_BYTES) are still held by earlier calls on streams \
                     after {timeout:?}; raise QCCL_STAGING_BYTES, or let the streams run before \
                     enqueueing more",
                    st.stats.lent, st.stats.cap
                )));
            }
            st = self
                .returned
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Takes back the buffers of a finished call and wakes the calls waiting for room.
    fn give_back(&self, bufs: Vec<Box<dyn Pinned>>) {
        if bufs.is_empty() {
            return;
        }
        let mut st = self.lock();
        st.stats.lent -= bufs.iter().map(|b| b.len()).sum::<usize>();
        st.free.extend(bufs);
        drop(st);
        self.returned.notify_all();
    }
}

/// One call's buffers, in the order of its lengths; given back to the pool on drop.
pub struct Lent {
    pool: Arc<Pool>,
    bufs: Vec<Box<dyn Pinned>>,
}

impl Lent {
    /// The first byte of buffer `i`.
    pub fn ptr(&self, i: usize) -> *mut u8 {
        self.bufs[i].ptr()
    }

    /// The first byte of each buffer.
    pub fn ptrs(&self) -> Vec<*mut u8> {
        self.bufs.iter().map(|b| b.ptr()).collect()
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        self.pool.give_back(std::mem::take(&mut self.bufs));
    }
}

impl State {
    /// The call's buffers if the cap allows them now; None: wait for a call to give back.
    fn try_take(
        &mut self,
        driver: &dyn Driver,
        lens: &[usize],
    ) -> Result<Option<Vec<Box<dyn Pinned>>>> {
        // The smallest free buffer that fits each length, none used twice.
        let mut chosen: Vec<Option<usize>> = Vec::with_capacity(lens.len());
        for &len in lens {
            let fit = (0..self.free.len())
                .filter(|i| !chosen.contains(&Some(*i)) && self.free[*i].len() >= len.max(1))
                .min_by_key(|&i| self.free[i].len());
            chosen.push(fit);
        }
        let missing: usize = lens
            .iter()
            .zip(&chosen)
            .filter(|(_, c)| c.is_none())
            .map(|(&l, _)| l.max(MIN_BUFFER))
            .sum();
        let cap = self.stats.cap;
        if missing > 0 && self.stats.pinned + missing > cap {
            // Room first from free buffers this call does not use, largest first.
            let mut spare: Vec<usize> = (0..self.free.len())
                .filter(|i| !chosen.contains(&Some(*i)))
                .collect();
            spare.sort_by_key(|&i| std::cmp::Reverse(self.free[i].len()));
            let mut drop_these = Vec::new();
            let mut pinned = self.stats.pinned;
            for i in spare {
                if pinned + missing <= cap {
                    break;
                }
                pinned -= self.free[i].len();
                drop_these.push(i);
            }
            if pinned + missing > cap {
                if self.stats.lent > 0 {
                    return Ok(None);
                }
                // Nothing in flight: this call runs alone, on buffers of its own size.
                self.stats.pinned -= self.free.iter().map(|b| b.len()).sum::<usize>();
                self.free.clear();
                return self.pin_all(driver, lens).map(Some);
            }
            self.release(drop_these, &mut chosen);
        }
        // Newly pinned ones first: a failure leaves the free list as it was.
        let mut fresh = Vec::new();
        for (&len, c) in lens.iter().zip(&chosen) {
            if c.is_none() {
                fresh.push(driver.alloc_pinned(len.max(MIN_BUFFER))?);
            }
        }
        self.stats.pinned += fresh.iter().map(|b| b.len()).sum::<usize>();
        let mut fresh = fresh.into_iter();
        // Free buffers taken by index, highest first so earlier indices stay valid.
        let mut taken: Vec<(usize, usize)> = chosen
            .iter()
            .enumerate()
            .filter_map(|(k, c)| c.map(|i| (i, k)))
            .collect();
        taken.sort_unstable_by_key(|t| std::cmp::Reverse(t.0));
        let mut out: Vec<Option<Box<dyn Pinned>>> = (0..lens.len()).map(|_| None).collect();
        for (i, k) in taken {
            out[k] = Some(self.free.swap_remove(i));
        }
        let out: Vec<Box<dyn Pinned>> = out
            .into_iter()
            .map(|b| b.or_else(|| fresh.next()).expect("one buffer per length"))
            .collect();
        self.lend(&out);
        Ok(Some(out))
    }

    /// Frees the free buffers at `indices` (and renumbers `chosen` to match).
    fn release(&mut self, mut indices: Vec<usize>, chosen: &mut [Option<usize>]) {
        indices.sort_unstable_by_key(|&i| std::cmp::Reverse(i));
        for i in indices {
            self.stats.pinned -= self.free[i].len();
            // `swap_remove` moves the last buffer to `i`.
            let last = self.free.len() - 1;
            self.free.swap_remove(i);
            for c in chosen.iter_mut().flatten() {
                if *c == last {
                    *c = i;
                }
            }
        }
    }

    /// Newly pinned buffers for every length (the pool held nothing free).
    fn pin_all(&mut self, driver: &dyn Driver, lens: &[usize]) -> Result<Vec<Box<dyn Pinned>>> {
        let out = lens
            .iter()
            .map(|&l| driver.alloc_pinned(l.max(MIN_BUFFER)))
            .collect::<Result<Vec<_>>>()?;
        self.stats.pinned += out.iter().map(|b| b.len()).sum::<usize>();
        self.lend(&out);
        Ok(out)
    }

    fn lend(&mut self, bufs: &[Box<dyn Pinned>]) {
        self.stats.lent += bufs.iter().map(|b| b.len()).sum::<usize>();
        self.stats.peak = self.stats.peak.max(self.stats.pinned);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::emu::EmuDriver;

    const WAIT: Duration = Duration::from_secs(30);

    #[test]
    fn buffers_are_reused_and_the_smallest_fit_is_taken() {
        let gpu = EmuDriver::new(1);
        let pool = Arc::new(Pool::new(1 << 20));
        let a = pool.take(&gpu, &[0, 10_000, 100], WAIT).unwrap();
        assert_eq!(pool.stats().pinned, 4096 + 10_000 + 4096);
        let (small, large) = (a.ptr(0), a.ptr(1));
        drop(a);
        assert_eq!(pool.stats().lent, 0);
        // The page fits 4000 bytes; the 10000-byte buffer is left for the larger length.
        let b = pool.take(&gpu, &[9_000, 4_000], WAIT).unwrap();
        assert_eq!((b.ptr(0), b.ptr(1)), (large, small));
        let st = pool.stats();
        assert_eq!((st.pinned, st.peak, st.waits), (18_192, 18_192, 0));
    }

    #[test]
    fn a_call_past_the_cap_waits_for_an_earlier_one() {
        let gpu = EmuDriver::new(1);
        let pool = Arc::new(Pool::new(3 * 4096));
        let first = pool.take(&gpu, &[4096, 4096], WAIT).unwrap();
        std::thread::scope(|s| {
            let second = s.spawn(|| pool.take(&gpu, &[4096, 4096], WAIT).map(drop));
            while pool.stats().waits == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            drop(first);
            second.join().unwrap().unwrap();
        });
        let st = pool.stats();
        assert_eq!((st.waits, st.lent), (1, 0));
        assert!(st.peak <= 3 * 4096, "{st:?}");
        // Free buffers too small for a call are let go to make room for it.
        pool.take(&gpu, &[3 * 4096], WAIT).unwrap();
        assert_eq!(pool.stats().pinned, 3 * 4096);
    }

    #[test]
    fn a_call_larger_than_the_cap_runs_alone() {
        let gpu = EmuDriver::new(1);
        let pool = Arc::new(Pool::new(4096));
        drop(pool.take(&gpu, &[100], WAIT).unwrap());
        let big = pool.take(&gpu, &[50_000], WAIT).unwrap();
        assert_eq!(pool.stats().pinned, 50_000);
        let err = pool
            .take(&gpu, &[1], Duration::from_millis(20))
            .err()
            .expect("no room while the large call is in flight");
        assert!(matches!(err, Error::Timeout(_)), "{err}");
        assert!(err.to_string().contains("QCCL_STAGING_BYTES"), "{err}");
        drop(big);
        pool.take(&gpu, &[1], WAIT).unwrap();
    }
}
