//! A single-producer, single-consumer byte ring in a POSIX shared-memory segment: the writer
//! advances `head`, the reader advances `tail`, each side rings the other's "bell" (a futex
//! word) after moving its counter, and sleeps on its own bell only after announcing it.

use super::futex;
use super::segment::Segment;
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// Bytes before the data area: counters on separate cache lines.
const HEADER: usize = 256;
const MAGIC: u64 = 0x5143_434c_5249_4e47; // "QCCLRING"
const OFF_MAGIC: usize = 0;
const OFF_HEAD: usize = 64;
const OFF_HEAD_BELL: usize = 72;
const OFF_READER_ASLEEP: usize = 76;
const OFF_TAIL: usize = 128;
const OFF_TAIL_BELL: usize = 136;
const OFF_WRITER_ASLEEP: usize = 140;

/// One direction of a shared-memory link.
pub struct Ring {
    seg: Segment,
    cap: usize,
}

impl Ring {
    /// Creates (mode 0600, must not exist) and maps segment `name` with `cap` data bytes
    /// (a power of two).
    pub fn create(name: &str, cap: usize) -> Result<Ring> {
        debug_assert!(cap.is_power_of_two());
        let ring = Ring {
            seg: Segment::create(name, HEADER + cap)?,
            cap,
        };
        ring.word64(OFF_MAGIC).store(MAGIC, Ordering::Release);
        Ok(ring)
    }

    /// Maps the existing segment `name` created by the peer.
    pub fn open(name: &str, cap: usize) -> Result<Ring> {
        let ring = Ring {
            seg: Segment::open(name, HEADER + cap)?,
            cap,
        };
        if ring.word64(OFF_MAGIC).load(Ordering::Acquire) != MAGIC {
            return Err(Error::InvalidUsage(format!("{name} is not a qccl ring")));
        }
        Ok(ring)
    }

    /// Removes the name; the mapping stays valid until both sides drop it.
    pub fn unlink(name: &str) {
        Segment::unlink(name);
    }

    fn word64(&self, off: usize) -> &AtomicU64 {
        self.seg.word64(off)
    }

    fn word32(&self, off: usize) -> &AtomicU32 {
        self.seg.word32(off)
    }

    fn data_ptr(&self) -> *mut u8 {
        self.seg.ptr(HEADER)
    }

    /// Writer: copies as much of `parts` (in order) as fits; returns the bytes written.
    pub fn try_write(&self, parts: &[&[u8]]) -> usize {
        let head = self.word64(OFF_HEAD).load(Ordering::Relaxed);
        let tail = self.word64(OFF_TAIL).load(Ordering::Acquire);
        let mut room = self.cap - (head - tail) as usize;
        let mut at = head;
        for p in parts {
            if room == 0 {
                break;
            }
            let n = p.len().min(room);
            self.copy_in(at, &p[..n]);
            at += n as u64;
            room -= n;
        }
        let wrote = (at - head) as usize;
        if wrote > 0 {
            self.word64(OFF_HEAD).store(at, Ordering::Release);
            self.ring(OFF_HEAD_BELL, OFF_READER_ASLEEP);
        }
        wrote
    }

    /// Reader: copies up to `out.len()` available bytes; returns how many.
    pub fn try_read(&self, out: &mut [u8]) -> usize {
        let tail = self.word64(OFF_TAIL).load(Ordering::Relaxed);
        let head = self.word64(OFF_HEAD).load(Ordering::Acquire);
        let n = ((head - tail) as usize).min(out.len());
        if n > 0 {
            self.copy_out(tail, &mut out[..n]);
            self.word64(OFF_TAIL)
                .store(tail + n as u64, Ordering::Release);
            self.ring(OFF_TAIL_BELL, OFF_WRITER_ASLEEP);
        }
        n
    }

    /// Reader: the readable bytes that are contiguous in the ring (up to its end), without
    /// consuming them; `consume` releases them. Lets the receiver reduce straight from the
    /// shared memory instead of copying out first.
    pub fn peek(&self) -> &[u8] {
        let tail = self.word64(OFF_TAIL).load(Ordering::Relaxed);
        let head = self.word64(OFF_HEAD).load(Ordering::Acquire);
        let pos = (tail as usize) & (self.cap - 1);
        let n = ((head - tail) as usize).min(self.cap - pos);
        // SAFETY: [pos, pos+n) is in the data area and holds bytes the writer published
        // (Acquire on head) and will not overwrite until `consume` moves tail past them; the
        // borrow of self keeps the mapping alive.
        unsafe { std::slice::from_raw_parts(self.data_ptr().add(pos), n) }
    }

    /// Reader: releases `n` bytes returned by `peek` to the writer.
    pub fn consume(&self, n: usize) {
        let tail = self.word64(OFF_TAIL).load(Ordering::Relaxed);
        self.word64(OFF_TAIL)
            .store(tail + n as u64, Ordering::Release);
        self.ring(OFF_TAIL_BELL, OFF_WRITER_ASLEEP);
    }

    fn copy_in(&self, at: u64, src: &[u8]) {
        let pos = (at as usize) & (self.cap - 1);
        let first = src.len().min(self.cap - pos);
        // SAFETY: [pos, pos+first) and [0, len-first) lie in the data area; the writer owns
        // the bytes between head and tail + cap (the reader does not touch them until head
        // is published with Release after this copy).
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.data_ptr().add(pos), first);
            std::ptr::copy_nonoverlapping(
                src.as_ptr().add(first),
                self.data_ptr(),
                src.len() - first,
            );
        }
    }

    fn copy_out(&self, at: u64, dst: &mut [u8]) {
        let pos = (at as usize) & (self.cap - 1);
        let first = dst.len().min(self.cap - pos);
        // SAFETY: the bytes between tail and head were published by the writer (Acquire load
        // of head above) and stay untouched by it until tail moves past them.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data_ptr().add(pos), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(
                self.data_ptr(),
                dst.as_mut_ptr().add(first),
                dst.len() - first,
            );
        }
    }

    fn ring(&self, bell: usize, asleep: usize) {
        self.word32(bell).fetch_add(1, Ordering::SeqCst);
        if self.word32(asleep).load(Ordering::SeqCst) != 0 {
            futex::wake(self.word32(bell));
        }
    }

    /// True when the reader has bytes to read.
    pub fn readable(&self) -> bool {
        self.word64(OFF_HEAD).load(Ordering::Acquire)
            != self.word64(OFF_TAIL).load(Ordering::Relaxed)
    }

    /// Writer: free bytes.
    pub fn room(&self) -> usize {
        let used = self.word64(OFF_HEAD).load(Ordering::Relaxed)
            - self.word64(OFF_TAIL).load(Ordering::Acquire);
        self.cap - used as usize
    }

    /// True when the writer has room.
    pub fn writable(&self) -> bool {
        let used = self.word64(OFF_HEAD).load(Ordering::Relaxed)
            - self.word64(OFF_TAIL).load(Ordering::Acquire);
        (used as usize) < self.cap
    }

    /// Reader: sleeps until bytes may be readable or `timeout` passes.
    pub fn wait_readable(&self, timeout: Duration) {
        self.sleep(
            OFF_HEAD_BELL,
            OFF_READER_ASLEEP,
            || self.readable(),
            timeout,
        );
    }

    /// Writer: sleeps until room may be free or `timeout` passes.
    pub fn wait_writable(&self, timeout: Duration) {
        self.sleep(
            OFF_TAIL_BELL,
            OFF_WRITER_ASLEEP,
            || self.writable(),
            timeout,
        );
    }

    fn sleep(&self, bell: usize, asleep: usize, ready: impl Fn() -> bool, timeout: Duration) {
        let flag = self.word32(asleep);
        flag.store(1, Ordering::SeqCst);
        let seen = self.word32(bell).load(Ordering::SeqCst);
        if !ready() {
            futex::wait(self.word32(bell), seen, timeout);
        }
        flag.store(0, Ordering::SeqCst);
    }
}
