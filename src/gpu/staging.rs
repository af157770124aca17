//! Device buffers through host staging: a call whose buffers are device memory runs the host
//! collective on page-locked copies of them. The copies in wait for the caller's stream (an
//! event recorded on it, waited for by qccl's own stream), so they see every write the
//! caller enqueued before the call; the copies out finish before the call returns, so work
//! the caller enqueues afterwards sees the result. Host buffers in the same call are used
//! as they are.
//!
//! What is not here yet (issue #22): enqueue-and-return on a stream (the call blocks until
//! the result is on the device), chunked pipelining of the copies with the transfers, codecs
//! and reductions on the GPU before the copy, CUDA IPC between ranks on one device.

use super::driver::{Driver, Memory, Pinned, Stream};
use crate::error::{Error, Result};
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

/// One buffer of a call, as the caller gave it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallBuf {
    /// Its address (host or device).
    pub addr: u64,
    /// Bytes.
    pub len: usize,
    /// The collective reads it (a send buffer; an in-place buffer).
    pub reads: bool,
    /// The collective writes it (a receive buffer).
    pub writes: bool,
}

/// Where a call's buffers live, found before any byte moves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Per buffer: the device ordinal, or None for host memory.
    pub device: Vec<Option<usize>>,
}

impl Placement {
    /// The one device the call's device buffers are on, if any; an error naming the buffers
    /// when they are on two devices.
    pub fn ordinal(&self) -> Result<Option<usize>> {
        let mut on = self.device.iter().flatten();
        let Some(&first) = on.next() else {
            return Ok(None);
        };
        if let Some(&other) = on.find(|&&o| o != first) {
            return Err(Error::invalid(format!(
                "buffers on two devices ({first} and {other}): a call's device buffers must \
                 all be on one device"
            )));
        }
        Ok(Some(first))
    }
}

/// Finds where each of `bufs` lives (empty buffers count as host memory).
pub fn locate(driver: &dyn Driver, bufs: &[CallBuf]) -> Result<Placement> {
    let device = bufs
        .iter()
        .map(|b| {
            if b.len == 0 {
                return Ok(None);
            }
            Ok(match driver.locate(b.addr)? {
                Memory::Host => None,
                Memory::Device { ordinal } => {
                    // The whole buffer must be device memory of the same device.
                    let last = b.addr + (b.len as u64 - 1);
                    if driver.locate(last)? != (Memory::Device { ordinal }) {
                        return Err(Error::invalid(format!(
                            "a {}-byte buffer at {:#x} starts in device {ordinal}'s memory but \
                             does not end there",
                            b.len, b.addr
                        )));
                    }
                    Some(ordinal)
                }
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Placement { device })
}

/// One comm's staging on one device: qccl's stream there and page-locked buffers, kept
/// across calls (allocating page-locked memory is slow).
pub struct Staging {
    driver: Arc<dyn Driver>,
    ordinal: usize,
    stream: Box<dyn Stream>,
    pinned: Vec<Box<dyn Pinned>>,
    timeout: Duration,
}

impl Staging {
    /// Staging on device `ordinal`; every wait bounded by `timeout` (the comm's).
    pub fn new(driver: Arc<dyn Driver>, ordinal: usize, timeout: Duration) -> Result<Staging> {
        let stream = driver.create_stream(ordinal)?;
        Ok(Staging {
            driver,
            ordinal,
            stream,
            pinned: Vec::new(),
            timeout,
        })
    }

    /// The device it stages for.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Runs `run` with a host address standing for each of `bufs` (placed as `place` says):
    /// device buffers are copied into page-locked memory first (those the call reads), after
    /// the work enqueued on the caller's stream `raw` so far, and copied back after `run`
    /// (those it writes); host buffers are passed as they are, once the caller's stream
    /// reached the call. Returns when the results are on the device.
    ///
    /// # Safety
    /// Each buffer must be valid for its reads and writes (host or device memory of `len`
    /// bytes) until this returns, and `raw` null or a stream of this device.
    pub unsafe fn run<R>(
        &mut self,
        bufs: &[CallBuf],
        place: &Placement,
        raw: *mut c_void,
        run: impl FnOnce(&[*mut u8]) -> Result<R>,
    ) -> Result<R> {
        // SAFETY: the caller's promise about `raw`.
        let caller = unsafe { self.driver.borrow_stream(self.ordinal, raw)? };
        let ready = caller.record()?;
        self.stream.wait_event(&*ready)?;
        self.reserve(bufs, place)?;
        let mut hosts = Vec::with_capacity(bufs.len());
        for (i, b) in bufs.iter().enumerate() {
            match place.device[i] {
                None => hosts.push(b.addr as *mut u8),
                Some(_) => {
                    let p = self.pinned[i].ptr();
                    if b.reads {
                        // SAFETY: `p` has room for `b.len` bytes (`reserve`) and nothing else
                        // touches it until the synchronize below; `b.addr` is device memory
                        // of `b.len` bytes (the caller's promise, checked by `locate`).
                        unsafe { self.stream.copy_to_host(p, b.addr, b.len)? };
                    }
                    hosts.push(p);
                }
            }
        }
        // Host buffers too: the caller's earlier work (a copy into them) must be done.
        self.stream.synchronize(self.timeout)?;
        let out = run(&hosts)?;
        for (i, b) in bufs.iter().enumerate() {
            if place.device[i].is_some() && b.writes {
                // SAFETY: as above, the other way; the pinned copy stays untouched until the
                // synchronize below.
                unsafe { self.stream.copy_to_device(b.addr, hosts[i], b.len)? };
            }
        }
        self.stream.synchronize(self.timeout)?;
        Ok(out)
    }

    /// Page-locked room for each device buffer (its index's), grown as needed.
    fn reserve(&mut self, bufs: &[CallBuf], place: &Placement) -> Result<()> {
        while self.pinned.len() < bufs.len() {
            self.pinned.push(self.driver.alloc_pinned(4096)?);
        }
        for (i, b) in bufs.iter().enumerate() {
            if place.device[i].is_some() && self.pinned[i].len() < b.len {
                // Room to grow, so slightly larger calls do not reallocate each time.
                let len = b.len.max(self.pinned[i].len() * 3 / 2);
                self.pinned[i] = self.driver.alloc_pinned(len)?;
            }
        }
        Ok(())
    }
}
