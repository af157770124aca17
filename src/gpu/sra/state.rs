//! The device side a comm keeps across compressed all-reduces with the codecs on the GPU
//! (in its engine): a stream, page-locked wire slots, device scratch, the error-feedback
//! residuals per tensor key, and the counters; what one call does with it is `mod.rs`.

use crate::algo::compressed::sra::SETS;
use crate::codec::ef::TensorKey;
use crate::error::{Error, Result};
use crate::gpu::driver::{Arg, DeviceMem, Driver, Function, Pinned, Stream};
use crate::gpu::plans::{grid_for, BLOCK};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// What compressed all-reduces with the codecs on the GPU did on one comm (`Comm::device_stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Calls run this way.
    pub calls: u64,
    /// Bytes copied from the device to page-locked memory (encoded payloads).
    pub to_host: u64,
    /// Bytes copied from page-locked memory to the device (received payloads).
    pub to_device: u64,
    /// Exchanges those calls made.
    pub exchanges: u64,
    /// Exchanges that began with encodes still queued on the stream: the GPU encoding while
    /// the network moved bytes.
    pub overlapped: u64,
    /// Sends that an exchange began before their bytes were written, and started once their
    /// encode's event completed.
    pub late_sends: u64,
}

/// A comm's device side of these calls, kept in its engine across calls: a stream, the
/// page-locked wire slots, device scratch and the error-feedback residuals.
pub struct DeviceState {
    // Dropped first: a stream's drop waits for its work, before the memory below is freed.
    pub(super) stream: Box<dyn Stream>,
    pub(super) ordinal: usize,
    pub(super) compensate: Arc<dyn Function>,
    pub(super) avg: Arc<dyn Function>,
    /// Page-locked slots, `sra::SETS` sets of: the bytes sent to each peer (this rank's own
    /// slot: its encoded sum), then the bytes received from each.
    pub(super) wire: Option<Box<dyn Pinned>>,
    /// The word a decode that fails the codec's checks sets (page-locked).
    pub(super) bad: Box<dyn Pinned>,
    /// One piece's payload (aligned, whatever its offset in the wire bytes).
    pub(super) payload: Option<Box<dyn DeviceMem>>,
    /// The launch plans' scratch.
    pub(super) scratch: Option<Box<dyn DeviceMem>>,
    pub(super) residuals: HashMap<TensorKey, Box<dyn DeviceMem>>,
    pub(super) stats: DeviceStats,
}

/// Room a call needs, worked out from its slices before it starts.
pub(super) struct Sizes {
    /// Bytes of a wire slot: the longest encoding of any slice.
    pub(super) slot: usize,
    /// Longest payload of one piece.
    pub(super) payload: usize,
    /// Most plan scratch of one piece.
    pub(super) scratch: usize,
}

impl DeviceState {
    pub(super) fn functions(driver: &dyn Driver, ordinal: usize) -> Result<[Arc<dyn Function>; 2]> {
        Ok([
            driver.function(ordinal, "qccl_ef_compensate")?,
            driver.function(ordinal, "qccl_finish_avg_f32")?,
        ])
    }

    pub(super) fn new(driver: &dyn Driver, ordinal: usize) -> Result<DeviceState> {
        let [compensate, avg] = Self::functions(driver, ordinal)?;
        Ok(DeviceState {
            stream: driver.create_stream(ordinal)?,
            ordinal,
            compensate,
            avg,
            wire: None,
            bad: driver.alloc_pinned(64)?,
            payload: None,
            scratch: None,
            residuals: HashMap::new(),
            stats: DeviceStats::default(),
        })
    }

    /// What it did so far.
    pub fn stats(&self) -> DeviceStats {
        self.stats
    }

    /// Forgets the device residual of `key`; true if there was one.
    pub fn forget(&mut self, key: &TensorKey) -> bool {
        self.residuals.remove(key).is_some()
    }

    /// The device residual of `key` for `count` f32s, zeroed on first use or when the count
    /// changed (as the host's `Residuals::get`).
    pub(super) fn residual(
        &mut self,
        driver: &dyn Driver,
        key: &TensorKey,
        count: usize,
        timeout: Duration,
    ) -> Result<u64> {
        let len = 4 * count;
        if let Some(m) = self.residuals.get(key).filter(|m| m.len() == len) {
            return Ok(m.addr());
        }
        if let Some(old) = self.residuals.get(key) {
            crate::qlog!(
                Info,
                "error feedback: tensor key {key} was used with {} elements, now with {count}: \
                 its residual starts again from zero",
                old.len() / 4
            );
        }
        let m = driver.alloc_device(self.ordinal, len)?;
        let zeros = vec![0u8; len];
        // SAFETY: `zeros` holds `len` bytes and outlives the synchronize below; `m` is fresh
        // device memory of `len` bytes.
        unsafe { self.stream.copy_to_device(m.addr(), zeros.as_ptr(), len)? };
        self.stream.synchronize(timeout)?;
        let addr = m.addr();
        self.residuals.insert(key.clone(), m);
        Ok(addr)
    }

    /// Grows the wire slots and device scratch to `sizes` for `n` ranks (the stream is idle
    /// between calls, so replaced memory is not in use).
    pub(super) fn reserve(&mut self, driver: &dyn Driver, sizes: &Sizes, n: usize) -> Result<()> {
        let wire = SETS * 2 * n * sizes.slot;
        if wire > 0 && self.wire.as_ref().is_none_or(|w| w.len() < wire) {
            self.wire = Some(driver.alloc_pinned(wire.max(4096))?);
        }
        for (mem, len) in [
            (&mut self.payload, sizes.payload),
            (&mut self.scratch, sizes.scratch),
        ] {
            if len > 0 && mem.as_ref().is_none_or(|m| m.len() < len) {
                *mem = Some(driver.alloc_device(self.ordinal, len)?);
            }
        }
        Ok(())
    }

    pub(super) fn bad_word(&self) -> *mut i32 {
        self.bad.ptr().cast()
    }

    /// Waits for the stream's work; an error if a decode found a chunk the codec refuses.
    pub(super) fn sync(&self, timeout: Duration) -> Result<()> {
        self.stream.synchronize(timeout)?;
        // SAFETY: page-locked memory of ours, aligned; the stream is idle, so no kernel
        // writes it now.
        if unsafe { self.bad_word().read_volatile() } != 0 {
            return Err(Error::invalid(
                "compressed all-reduce on device buffers: a received chunk failed its codec's \
                 checks on the device",
            ));
        }
        Ok(())
    }

    /// Enqueues `w = x + res, res = 0` over `count` f32s (with `res` 0: `w = x`).
    pub(super) fn compensate(
        &mut self,
        x: u64,
        res: Option<u64>,
        w: u64,
        count: usize,
    ) -> Result<()> {
        if count == 0 || (res.is_none() && x == w) {
            return Ok(());
        }
        let args = [
            Arg::Ptr(x),
            Arg::Ptr(res.unwrap_or(0)),
            Arg::Ptr(w),
            Arg::U64(count as u64),
        ];
        // SAFETY: ef.cu's (const float* x, float* res, float* w, uint64_t count); the ranges
        // hold `count` f32s of the call's buffers or residual, valid until it ends.
        unsafe {
            self.stream
                .launch(&*self.compensate, grid_for(count), BLOCK, &args)
        }
    }
}

pub(super) fn addr(m: &Option<Box<dyn DeviceMem>>) -> u64 {
    m.as_ref().map_or(0, |m| m.addr())
}
