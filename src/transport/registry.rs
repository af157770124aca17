//! Buffers the user registered with a comm (`Comm::register`, `qcclCommRegister`: NCCL's
//! `ncclCommRegister`), and what link kinds made of them. Registering only records the range,
//! page-aligned; a link kind that can send straight from registered memory (the RDMA link)
//! registers it with its device on first use and keeps that registration on the entry, as
//! NCCL's registration cache does, until the last deregistration of the range drops it.
//!
//! A buffer must be deregistered before it is freed or remapped: a NIC keeps the pages it
//! registered, and would send their old bytes.

use crate::error::{Error, Result};
use std::any::Any;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Registrations are whole pages, as a NIC pins them.
const PAGE: usize = 4096;

/// What a link kind made of a registered range (its device's memory registration).
pub type Made = Arc<dyn Any + Send + Sync>;

/// One registered range.
struct Entry {
    id: u64,
    begin: usize,
    end: usize,
    /// Registrations of this exact range not yet deregistered.
    refs: usize,
    /// Registered by qccl itself (the wire buffers of compressed calls), not the user.
    own: bool,
    /// By maker (a device context's key): what it made of the range, or None where it
    /// could not register it (not tried again).
    made: Vec<(usize, Option<Made>)>,
}

/// A comm's registered ranges.
#[derive(Default)]
pub struct Registry {
    entries: Mutex<Vec<Entry>>,
    /// Entries, read without the lock on every send.
    live: AtomicUsize,
}

/// Handles are numbered across the process, so a handle from one comm is refused by
/// another (NCCL's are pointers: unique too).
static NEXT_HANDLE: AtomicU64 = AtomicU64::new(1);

/// How many ranges are registered and what link kinds made of them (for tests and logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stats {
    /// Ranges the user registered.
    pub ranges: usize,
    /// Device registrations made of them.
    pub made: usize,
    /// qccl's own registered buffers (the wire buffers compressed calls encode into).
    pub wire: usize,
    /// Device registrations made of those.
    pub wire_made: usize,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Registry({:?})", self.stats())
    }
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `len` bytes at `ptr` (rounded out to whole pages); the handle. Registering
    /// the same pages again returns the same handle, counted: each registration needs its
    /// deregistration.
    pub fn register(&self, ptr: *const u8, len: usize) -> Result<u64> {
        self.add(ptr, len, false)
    }

    /// As `register`, for qccl's own buffers (counted apart in [`Registry::stats`]).
    pub fn register_own(&self, ptr: *const u8, len: usize) -> Result<u64> {
        self.add(ptr, len, true)
    }

    fn add(&self, ptr: *const u8, len: usize, own: bool) -> Result<u64> {
        if ptr.is_null() || len == 0 {
            return Err(Error::invalid(format!(
                "register: cannot register {len} bytes at {ptr:p} (a null or empty buffer)"
            )));
        }
        let begin = ptr as usize / PAGE * PAGE;
        let end = (ptr as usize)
            .checked_add(len)
            .and_then(|e| e.checked_next_multiple_of(PAGE))
            .ok_or_else(|| {
                Error::invalid(format!(
                    "register: {len} bytes at {ptr:p} run past the address space"
                ))
            })?;
        let mut entries = self.lock();
        if let Some(e) = entries
            .iter_mut()
            .find(|e| e.begin == begin && e.end == end && e.own == own)
        {
            e.refs += 1;
            return Ok(e.id);
        }
        let id = NEXT_HANDLE.fetch_add(1, Ordering::Relaxed);
        entries.push(Entry {
            id,
            begin,
            end,
            refs: 1,
            own,
            made: Vec::new(),
        });
        self.live.store(entries.len(), Ordering::Release);
        Ok(id)
    }

    /// Drops one registration of handle `id`; the last one drops what link kinds made of
    /// the range (a registration still used by a write in flight lives until it completes).
    pub fn deregister(&self, id: u64) -> Result<()> {
        let gone = {
            let mut entries = self.lock();
            let Some(at) = entries.iter().position(|e| e.id == id) else {
                return Err(Error::invalid(format!(
                    "deregister: handle {id} is not a registration of this comm (or was \
                     already deregistered)"
                )));
            };
            entries[at].refs -= 1;
            if entries[at].refs > 0 {
                return Ok(());
            }
            let e = entries.swap_remove(at);
            self.live.store(entries.len(), Ordering::Release);
            e
        };
        // Device deregistration may take a while: outside the lock.
        drop(gone);
        Ok(())
    }

    /// What maker `key` made of the registered range holding all of `ptr..ptr+len`: made
    /// now by `make(begin, len)` (the whole range) on first use; None where no registered
    /// range holds it or `make` could not.
    pub fn find(
        &self,
        ptr: *const u8,
        len: usize,
        key: usize,
        make: impl FnOnce(*mut u8, usize) -> Option<Made>,
    ) -> Option<Made> {
        if self.live.load(Ordering::Acquire) == 0 {
            return None;
        }
        let (lo, hi) = (ptr as usize, (ptr as usize).checked_add(len)?);
        let mut entries = self.lock();
        // The narrowest range that holds it: the most recent registration of those bytes.
        let e = entries
            .iter_mut()
            .filter(|e| e.begin <= lo && hi <= e.end)
            .min_by_key(|e| e.end - e.begin)?;
        if let Some((_, m)) = e.made.iter().find(|(k, _)| *k == key) {
            return m.clone();
        }
        let m = make(e.begin as *mut u8, e.end - e.begin);
        e.made.push((key, m.clone()));
        m
    }

    /// Counts, for tests and logs.
    pub fn stats(&self) -> Stats {
        let entries = self.lock();
        let (mut st, made) = (Stats::default(), |e: &Entry| {
            e.made.iter().filter(|(_, m)| m.is_some()).count()
        });
        for e in entries.iter() {
            if e.own {
                st.wire += 1;
                st.wire_made += made(e);
            } else {
                st.ranges += 1;
                st.made += made(e);
            }
        }
        st
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn made(n: usize) -> Option<Made> {
        Some(Arc::new(n))
    }

    #[test]
    fn a_range_is_registered_by_whole_pages_and_counted() {
        let r = Registry::default();
        // From a page boundary: 100 bytes from an arbitrary address may span two pages, and
        // then be another range than the 1 byte registered next (a 2% flake, seen).
        let buf = vec![0u8; 4 * PAGE];
        let p = (buf.as_ptr() as usize).next_multiple_of(PAGE) as *const u8;
        let a = r.register(p, 100).unwrap();
        // The same pages: the same handle, counted.
        assert_eq!(r.register(p, 1).unwrap(), a);
        assert_eq!(r.stats().ranges, 1);
        // Found for any bytes inside, made once per maker.
        let mut calls = 0;
        let m = r.find(p, 50, 7, |_, len| {
            calls += 1;
            assert!(len >= PAGE && len % PAGE == 0);
            made(1)
        });
        assert!(m.is_some());
        assert!(r.find(p, 50, 7, |_, _| panic!("made twice")).is_some());
        assert_eq!(calls, 1);
        assert_eq!((r.stats().ranges, r.stats().made), (1, 1));
        r.deregister(a).unwrap();
        assert!(r.find(p, 50, 7, |_, _| panic!("made twice")).is_some());
        r.deregister(a).unwrap();
        assert_eq!(r.stats(), Stats::default());
        assert!(r.find(p, 50, 7, |_, _| made(2)).is_none());
        let e = r.deregister(a).unwrap_err().to_string();
        assert!(e.contains("not a registration of this comm"), "{e}");
        // Another registry's handle is not this one's.
        let other = Registry::default();
        let b = other.register(p, 100).unwrap();
        assert!(r.register(p, 100).unwrap() != b);
        assert!(r.deregister(b).is_err());
    }

    #[test]
    fn bytes_outside_every_range_and_bad_input_are_refused() {
        let r = Registry::default();
        let buf = vec![0u8; 4 * PAGE];
        let base = (buf.as_ptr() as usize).next_multiple_of(PAGE) as *const u8;
        r.register(base, PAGE).unwrap();
        // SAFETY: inside `buf` (4 pages from an address at most a page below `base`).
        let past = unsafe { base.add(PAGE) };
        assert!(r.find(past, 8, 1, |_, _| made(0)).is_none());
        // SAFETY: as above.
        let straddling = unsafe { base.add(PAGE - 8) };
        assert!(r.find(straddling, 16, 1, |_, _| made(0)).is_none());
        // A maker that could not register is not asked again.
        assert!(r.find(base, 8, 2, |_, _| None).is_none());
        assert!(r.find(base, 8, 2, |_, _| panic!("asked again")).is_none());
        for (p, n) in [(std::ptr::null(), 8), (base, 0)] {
            let e = r.register(p, n).unwrap_err().to_string();
            assert!(e.contains("null or empty"), "{e}");
        }
    }
}
