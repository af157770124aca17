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
    /// Calls that had to wait for earlier ones to give their buffers back (or to finish
    /// before page-locked memory was freed).
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
    ///
    /// Pinning and freeing page-locked memory synchronise the device (CUDA's implicit
    /// synchronisation; freeing waits for every stream, callers' streams held for calls in
    /// flight included). So both run outside the pool's lock (a finishing call must be able
    /// to give its buffers back meanwhile), and freeing only after `quiesce` returned: the
    /// caller's way to let its own calls in flight finish first, bounded (counted as a wait).
    pub fn take(
        self: &Arc<Pool>,
        driver: &dyn Driver,
        lens: &[usize],
        timeout: Duration,
        quiesce: impl FnOnce() -> Result<()>,
    ) -> Result<Lent> {
        let deadline = Instant::now() + timeout;
        let mut quiesce = Some(quiesce);
        let mut st = self.lock();
        let mut waited = false;
        loop {
            match st.plan(lens) {
                Plan::Ready(bufs) => {
                    return Ok(Lent {
                        pool: self.clone(),
                        bufs,
                    })
                }
                Plan::Change(change) => {
                    let change = change.expect("a plan's change");
                    let Some(quiesce) = quiesce.take().filter(|_| !change.freed.is_empty()) else {
                        drop(st);
                        return self.apply(driver, change);
                    };
                    // Undo the plan, let the caller's calls finish, then plan again (the
                    // pool may have changed meanwhile).
                    st.undo(change);
                    if !waited {
                        st.stats.waits += 1;
                        waited = true;
                    }
                    drop(st);
                    quiesce()?;
                    st = self.lock();
                    continue;
                }
                Plan::Wait => {}
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

    /// Frees and pins what `change` says, outside the lock (its bytes are already counted),
    /// and lends the call its buffers.
    fn apply(self: &Arc<Pool>, driver: &dyn Driver, change: Change) -> Result<Lent> {
        let Change {
            mut slots,
            freed,
            pin,
        } = change;
        drop(freed);
        let reserved: usize = pin.iter().map(|&(_, l)| l).sum();
        let mut fresh = Vec::with_capacity(pin.len());
        for &(k, len) in &pin {
            match driver.alloc_pinned(len) {
                Ok(b) => fresh.push((k, b)),
                Err(e) => {
                    // Nothing pinned here is kept: the reservation and the free buffers the
                    // call took go back.
                    let kept: Vec<Box<dyn Pinned>> = slots.into_iter().flatten().collect();
                    let mut st = self.lock();
                    st.stats.pinned -= reserved;
                    st.stats.lent -= reserved + kept.iter().map(|b| b.len()).sum::<usize>();
                    st.free.extend(kept);
                    drop(st);
                    self.returned.notify_all();
                    return Err(e);
                }
            }
        }
        for (k, b) in fresh {
            slots[k] = Some(b);
        }
        Ok(Lent {
            pool: self.clone(),
            bufs: slots
                .into_iter()
                .map(|b| b.expect("one buffer per length"))
                .collect(),
        })
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

/// What a call gets from the pool's state, decided under its lock.
enum Plan {
    /// Free buffers fit every length.
    Ready(Vec<Box<dyn Pinned>>),
    /// The cap is reached while earlier calls hold buffers: wait for one to give back.
    Wait,
    /// Page-locked memory must be freed or pinned first (always Some; an Option so the
    /// caller can take it).
    Change(Option<Change>),
}

/// Buffers to free and to pin for a call, already counted in the pool's stats.
#[derive(Default)]
struct Change {
    /// Per length: the free buffer taken for it, or None where one is pinned.
    slots: Vec<Option<Box<dyn Pinned>>>,
    /// Free buffers let go to make room.
    freed: Vec<Box<dyn Pinned>>,
    /// (length index, bytes) to pin.
    pin: Vec<(usize, usize)>,
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
    /// The call's buffers if free ones fit, what to free and pin if the cap allows it now,
    /// else Wait. Buffers it takes and bytes it reserves are counted as lent at once.
    fn plan(&mut self, lens: &[usize]) -> Plan {
        // The smallest free buffer that fits each length, none used twice.
        let mut chosen: Vec<Option<usize>> = Vec::with_capacity(lens.len());
        for &len in lens {
            let fit = (0..self.free.len())
                .filter(|i| !chosen.contains(&Some(*i)) && self.free[*i].len() >= len.max(1))
                .min_by_key(|&i| self.free[i].len());
            chosen.push(fit);
        }
        let pin: Vec<(usize, usize)> = lens
            .iter()
            .zip(&chosen)
            .enumerate()
            .filter(|(_, (_, c))| c.is_none())
            .map(|(k, (&l, _))| (k, l.max(MIN_BUFFER)))
            .collect();
        let missing: usize = pin.iter().map(|&(_, l)| l).sum();
        let mut drop_these = Vec::new();
        if missing > 0 && self.stats.pinned + missing > self.stats.cap {
            // Room first from free buffers this call does not use, largest first.
            let mut spare: Vec<usize> = (0..self.free.len())
                .filter(|i| !chosen.contains(&Some(*i)))
                .collect();
            spare.sort_by_key(|&i| std::cmp::Reverse(self.free[i].len()));
            let mut pinned = self.stats.pinned;
            for i in spare {
                if pinned + missing <= self.stats.cap {
                    break;
                }
                pinned -= self.free[i].len();
                drop_these.push(i);
            }
            if pinned + missing > self.stats.cap {
                if self.stats.lent > 0 {
                    return Plan::Wait;
                }
                // Nothing in flight: this call runs alone, on buffers of its own size.
                let freed = std::mem::take(&mut self.free);
                self.stats.pinned -= freed.iter().map(|b| b.len()).sum::<usize>();
                let pin: Vec<(usize, usize)> = lens
                    .iter()
                    .enumerate()
                    .map(|(k, &l)| (k, l.max(MIN_BUFFER)))
                    .collect();
                return Plan::Change(Some(self.reserve(
                    (0..lens.len()).map(|_| None).collect(),
                    freed,
                    pin,
                )));
            }
        }
        // Free buffers taken and let go by index, highest first so lower indices stay valid.
        let mut slots: Vec<Option<Box<dyn Pinned>>> = (0..lens.len()).map(|_| None).collect();
        let mut out: Vec<(usize, Option<usize>)> = chosen
            .iter()
            .enumerate()
            .filter_map(|(k, c)| c.map(|i| (i, Some(k))))
            .chain(drop_these.into_iter().map(|i| (i, None)))
            .collect();
        out.sort_unstable_by_key(|t| std::cmp::Reverse(t.0));
        let mut freed = Vec::new();
        for (i, k) in out {
            let b = self.free.swap_remove(i);
            match k {
                Some(k) => slots[k] = Some(b),
                None => {
                    self.stats.pinned -= b.len();
                    freed.push(b);
                }
            }
        }
        if pin.is_empty() && freed.is_empty() {
            let bufs: Vec<Box<dyn Pinned>> = slots.into_iter().flatten().collect();
            self.stats.lent += bufs.iter().map(|b| b.len()).sum::<usize>();
            return Plan::Ready(bufs);
        }
        Plan::Change(Some(self.reserve(slots, freed, pin)))
    }

    /// Counts a change's buffers as lent and its bytes to pin as pinned.
    fn reserve(
        &mut self,
        slots: Vec<Option<Box<dyn Pinned>>>,
        freed: Vec<Box<dyn Pinned>>,
        pin: Vec<(usize, usize)>,
    ) -> Change {
        let pinning: usize = pin.iter().map(|&(_, l)| l).sum();
        self.stats.pinned += pinning;
        self.stats.lent += pinning + slots.iter().flatten().map(|b| b.len()).sum::<usize>();
        self.stats.peak = self.stats.peak.max(self.stats.pinned);
        Change { slots, freed, pin }
    }

    /// Puts a change back as it was before `plan` made it.
    fn undo(&mut self, change: Change) {
        let pinning: usize = change.pin.iter().map(|&(_, l)| l).sum();
        let kept: Vec<Box<dyn Pinned>> = change.slots.into_iter().flatten().collect();
        self.stats.pinned -= pinning;
        self.stats.lent -= pinning + kept.iter().map(|b| b.len()).sum::<usize>();
        self.stats.pinned += change.freed.iter().map(|b| b.len()).sum::<usize>();
        self.free.extend(kept);
        self.free.extend(change.freed);
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
        let a = pool.take(&gpu, &[0, 10_000, 100], WAIT, || Ok(())).unwrap();
        assert_eq!(pool.stats().pinned, 4096 + 10_000 + 4096);
        let (small, large) = (a.ptr(0), a.ptr(1));
        drop(a);
        assert_eq!(pool.stats().lent, 0);
        // The page fits 4000 bytes; the 10000-byte buffer is left for the larger length.
        let b = pool.take(&gpu, &[9_000, 4_000], WAIT, || Ok(())).unwrap();
        assert_eq!((b.ptr(0), b.ptr(1)), (large, small));
        let st = pool.stats();
        assert_eq!((st.pinned, st.peak, st.waits), (18_192, 18_192, 0));
    }

    #[test]
    fn a_call_past_the_cap_waits_for_an_earlier_one() {
        let gpu = EmuDriver::new(1);
        let pool = Arc::new(Pool::new(3 * 4096));
        let first = pool.take(&gpu, &[4096, 4096], WAIT, || Ok(())).unwrap();
        std::thread::scope(|s| {
            let second = s.spawn(|| pool.take(&gpu, &[4096, 4096], WAIT, || Ok(())).map(drop));
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
        pool.take(&gpu, &[3 * 4096], WAIT, || Ok(())).unwrap();
        assert_eq!(pool.stats().pinned, 3 * 4096);
    }

    #[test]
    fn a_call_larger_than_the_cap_runs_alone() {
        let gpu = EmuDriver::new(1);
        let pool = Arc::new(Pool::new(4096));
        drop(pool.take(&gpu, &[100], WAIT, || Ok(())).unwrap());
        let big = pool.take(&gpu, &[50_000], WAIT, || Ok(())).unwrap();
        assert_eq!(pool.stats().pinned, 50_000);
        let err = pool
            .take(&gpu, &[1], Duration::from_millis(20), || Ok(()))
            .err()
            .expect("no room while the large call is in flight");
        assert!(matches!(err, Error::Timeout(_)), "{err}");
        assert!(err.to_string().contains("QCCL_STAGING_BYTES"), "{err}");
        drop(big);
        pool.take(&gpu, &[1], WAIT, || Ok(())).unwrap();
    }

    #[test]
    fn freeing_waits_for_the_callers_calls_and_leaves_the_lock_free() {
        let gpu = EmuDriver::new(1);
        let pool = Arc::new(Pool::new(4 * 4096));
        drop(
            pool.take(&gpu, &[4096], WAIT, || panic!("nothing to free"))
                .unwrap(),
        );
        let first = pool
            .take(&gpu, &[8192], WAIT, || panic!("nothing to free"))
            .unwrap();
        let mut first = Some(first);
        let mut asked = 0;
        // 4096 free + 8192 lent: 8192 more pass the cap, so the free page is let go, once
        // the caller's earlier call finished. It gives its buffer back under the pool's
        // lock, which the waiting call must not hold.
        let second = pool
            .take(&gpu, &[8192], WAIT, || {
                asked += 1;
                drop(first.take());
                Ok(())
            })
            .unwrap();
        // Planned again after the quiesce: the returned buffer fits, nothing is freed.
        assert_eq!(asked, 1);
        let st = pool.stats();
        assert_eq!(
            (st.pinned, st.lent, st.waits),
            (4096 + 8192, 8192, 1),
            "{st:?}"
        );
        drop(second);
        // A failed quiesce fails the call and leaves the pool as it was.
        let err = pool
            .take(&gpu, &[3 * 4096], WAIT, || {
                Err(Error::Timeout("calls in flight".into()))
            })
            .err()
            .expect("the quiesce error");
        assert!(err.to_string().contains("calls in flight"), "{err}");
        let st = pool.stats();
        assert_eq!((st.pinned, st.lent), (4096 + 8192, 0), "{st:?}");
    }
}
