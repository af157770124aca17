//! Zero-copy sends: a payload inside a buffer registered with the comm (`Comm::register`,
//! `transport::registry`) is written to the peer's slots straight from the caller's memory,
//! through a device registration of the whole buffer made on first use and kept in the
//! registry until the buffer is deregistered (NCCL's registration cache).
//!
//! The engine counts bytes as sent when `send` returns them and may then change them (a ring
//! reduces into what it sent), so bytes written from the caller's memory are reported only
//! once their write completed; bytes copied into staging are reported at once. [`Ahead`]
//! keeps that account.

use super::verbs::{Context, Region};
use crate::transport::registry::{Made, Registry};
use std::collections::VecDeque;
use std::sync::Arc;

/// Smallest payload sent from registered memory: below it the copy into staging costs less
/// than waiting for the write's completion before reporting it (a memcpy of 32 KiB takes
/// about as long as a NIC round trip, a few microseconds).
pub const ZCOPY_MIN: usize = 32 << 10;

/// A device registration of a registered buffer. Holds the context that made it, which
/// therefore outlives it.
pub struct UserMr {
    region: Box<dyn Region>,
    _ctx: Arc<dyn Context>,
}

impl UserMr {
    /// Its local key.
    pub fn lkey(&self) -> u32 {
        self.region.lkey()
    }
}

/// The device registration on `ctx` of the buffer registered in `registry` that holds all of
/// `data`, made now if this is its first use; None when no registered buffer holds it or the
/// device refused it (then it is staged, and the refusal is logged once).
pub fn lookup(registry: &Registry, ctx: &Arc<dyn Context>, data: &[u8]) -> Option<Arc<UserMr>> {
    let key = Arc::as_ptr(ctx) as *const () as usize;
    let made = registry.find(data.as_ptr(), data.len(), key, |addr, len| {
        // SAFETY: the device reads only the bytes of writes the link posts from this
        // registration, and those lie in a payload the engine holds borrowed until the
        // write completed (bytes are reported after), or until `Link::release` moved the
        // queue pair to the error state; the registry drops the registration when the user
        // deregisters the buffer, which they must do before freeing it.
        match unsafe { ctx.register(addr, len) } {
            Ok(region) => Some(Arc::new(UserMr {
                region,
                _ctx: ctx.clone(),
            }) as Made),
            Err(e) => {
                crate::qlog!(
                    Info,
                    "{}: registering a {len}-byte registered buffer failed, so sends from it \
                     are copied: {e}",
                    ctx.name()
                );
                None
            }
        }
    })?;
    made.downcast::<UserMr>().ok()
}

/// Bytes posted to the peer but not yet reported to the engine, and the zero-copy writes
/// among them that have not completed. Offsets count from the first unreported byte.
#[derive(Debug, Default)]
pub struct Ahead {
    posted: usize,
    /// (the write's number, its first byte), in posting order.
    zcopy: VecDeque<(u64, usize)>,
}

impl Ahead {
    /// Bytes posted past what the engine was told.
    pub fn posted(&self) -> usize {
        self.posted
    }

    /// True while a zero-copy write may still read the caller's memory.
    #[cfg(test)]
    pub fn reading(&self) -> bool {
        !self.zcopy.is_empty()
    }

    /// True when `report(completed)` would report bytes.
    pub fn ready(&self, completed: u64) -> bool {
        self.posted > 0
            && self
                .zcopy
                .front()
                .is_none_or(|&(w, at)| at > 0 || w < completed)
    }

    /// `n` bytes copied into staging were posted.
    pub fn staged(&mut self, n: usize) {
        self.posted += n;
    }

    /// `n` bytes were posted from the caller's memory by write number `write`.
    pub fn zero_copy(&mut self, write: u64, n: usize) {
        self.zcopy.push_back((write, self.posted));
        self.posted += n;
    }

    /// With the first `completed` writes complete: the bytes that may be reported now (up to
    /// the first zero-copy write still in flight), which are then no longer counted here.
    pub fn report(&mut self, completed: u64) -> usize {
        while self.zcopy.front().is_some_and(|&(w, _)| w < completed) {
            self.zcopy.pop_front();
        }
        let n = self.zcopy.front().map_or(self.posted, |&(_, at)| at);
        self.posted -= n;
        for (_, at) in self.zcopy.iter_mut() {
            *at -= n;
        }
        n
    }

    /// Forgets everything (the queue pair went to the error state: nothing more is reported).
    pub fn clear(&mut self) {
        *self = Ahead::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staged_bytes_are_reported_at_once_and_zero_copy_ones_after_their_write() {
        let mut a = Ahead::default();
        a.staged(40);
        a.zero_copy(1, 100);
        a.zero_copy(2, 100);
        a.staged(4);
        // Write 0 (the header) complete, 1 and 2 not: the header only.
        assert_eq!(a.report(1), 40);
        assert_eq!((a.posted(), a.reading()), (204, true));
        assert_eq!(a.report(1), 0);
        // Write 1 done: its bytes; write 2 holds back itself and the padding behind it.
        assert_eq!(a.report(2), 100);
        assert_eq!(a.report(3), 104);
        assert_eq!((a.posted(), a.reading()), (0, false));
        // Completions may be counted past writes it never saw (credit writes are not counted
        // here, data writes are: any later number means done).
        a.zero_copy(9, 8);
        assert_eq!(a.report(20), 8);
        a.zero_copy(20, 8);
        a.clear();
        assert_eq!((a.report(0), a.reading()), (0, false));
    }
}
