//! The device side a comm keeps across compressed all-reduces with the codecs on the GPU
//! (`GpuLane`, shared by the comm and its engine): a stream, page-locked wire slots and
//! words, device scratch, the error-feedback residuals per tensor key, and the counters;
//! what one call does with it is `mod.rs`.

use crate::algo::compressed::sra::SETS;
use crate::codec::ef::TensorKey;
use crate::error::{Error, Result};
use crate::gpu::driver::{Arg, DeviceMem, Driver, Event, Function, Pinned, Stream};
use crate::gpu::plans::{grid_for, BLOCK};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What compressed all-reduces with the codecs on the GPU did on one comm (`Comm::device_stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Calls run this way.
    pub calls: u64,
    /// Those made on a caller's stream that returned once enqueued (NCCL's semantics), not
    /// once done.
    pub enqueued: u64,
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

/// A comm's device side of these calls, shared by the comm (which enqueues a call's device
/// work on the caller's thread) and its engine (which moves the bytes in the comm's turn).
#[derive(Default)]
pub struct GpuLane {
    /// Made by the first such call.
    pub(super) state: Mutex<Option<DeviceState>>,
    /// Tensor keys used on host buffers since: their device residuals start again from zero
    /// (dropped by the next call that enqueues, not by the engine: freeing device memory
    /// synchronises the device, which the comm's worker must never wait for).
    forgotten: Mutex<HashSet<TensorKey>>,
    pub(super) stats: Mutex<DeviceStats>,
    /// Calls done: bytes moved and device work run (their `Script` dropped).
    pub(super) moved: Arc<AtomicU64>,
    /// Set once the comm said that a call on device buffers was staged for its route.
    told_staged: AtomicBool,
}

impl GpuLane {
    /// True until [`GpuLane::first_staged`] was: the comm has not yet said that a compressed
    /// call on device buffers is staged.
    pub fn staged_untold(&self) -> bool {
        !self.told_staged.load(Ordering::Relaxed)
    }

    /// True the first time only: whether to say that a compressed call on device buffers is
    /// staged (once per comm, not per call).
    pub fn first_staged(&self) -> bool {
        !self.told_staged.swap(true, Ordering::Relaxed)
    }

    /// What it did so far.
    pub fn stats(&self) -> DeviceStats {
        *lock(&self.stats)
    }

    /// Counts the bytes a call copies each way.
    pub(super) fn add_bytes(&self, to_host: u64, to_device: u64) {
        let mut s = lock(&self.stats);
        s.to_host += to_host;
        s.to_device += to_device;
    }

    /// Counts `calls` calls run this way, whose exchanges did `did`.
    pub(crate) fn count_calls(&self, calls: u64, did: DeviceStats) {
        let mut all = lock(&self.stats);
        all.calls += calls;
        all.exchanges += did.exchanges;
        all.overlapped += did.overlapped;
        all.late_sends += did.late_sends;
    }

    /// Counts a call that returned once enqueued.
    pub fn count_enqueued(&self) {
        lock(&self.stats).enqueued += 1;
    }

    /// `key` was used on host buffers: its device residual starts again from zero.
    pub fn forget_later(&self, key: &TensorKey) {
        if lock(&self.state).is_some() {
            lock(&self.forgotten).insert(key.clone());
        }
    }

    /// Forgets the device residual of `key` now (on the caller's thread, in the comm's
    /// turn: every earlier call is done); true if there was one.
    pub fn forget(&self, key: &TensorKey) -> bool {
        lock(&self.forgotten).remove(key);
        lock(&self.state)
            .as_mut()
            .is_some_and(|s| s.residuals.remove(key).is_some())
    }

    /// Runs `f` on the device state (made on first use, on `driver`'s device `ordinal`),
    /// then waits for its stream, at most `timeout`: the steps of a call that returns once
    /// done, each finished before the next.
    pub(super) fn on_state(
        &self,
        (driver, ordinal): (&dyn Driver, usize),
        timeout: Duration,
        f: impl FnOnce(&mut DeviceState) -> Result<()>,
    ) -> Result<()> {
        let mut guard = self.locked((driver, ordinal))?;
        let st = guard.as_mut().expect("made by locked");
        f(st)?;
        st.stream.synchronize(timeout)
    }

    /// The device state, locked (made on first use, on `driver`'s device `ordinal`).
    pub(super) fn locked(
        &self,
        (driver, ordinal): (&dyn Driver, usize),
    ) -> Result<std::sync::MutexGuard<'_, Option<DeviceState>>> {
        let mut guard = lock(&self.state);
        if guard.is_none() {
            *guard = Some(DeviceState::new(driver, ordinal)?);
        }
        Ok(guard)
    }

    /// The keys to forget before a call enqueues.
    pub(super) fn take_forgotten(&self) -> HashSet<TensorKey> {
        std::mem::take(&mut *lock(&self.forgotten))
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Four page-locked words of a comm's device side: the progress word the stream waits on
/// (the comm's worker stores it as exchanges end), the word a decode that fails the
/// codec's checks sets (sticky: such a failure fails the comm), the word a hierarchical
/// call on a stream stores as its pieces' intra-host sums are ready, and the word the stream
/// stores as it passes its marks (`DeviceState::mark`).
pub(super) struct Words {
    mem: Box<dyn Pinned>,
    /// Set once the lane's stream is known failed (sticky): its marks never pass, and their
    /// waits end with this error instead of at their timeout.
    failed: Mutex<Option<Error>>,
}

// SAFETY: the page-locked memory is owned for the value's whole life and only used through
// atomic loads and stores (and by the device, which reads and sets the words).
unsafe impl Send for Words {}
// SAFETY: as above.
unsafe impl Sync for Words {}

impl Words {
    fn new(driver: &dyn Driver) -> Result<Words> {
        let mem = driver.alloc_pinned(64)?;
        let w = Words {
            mem,
            failed: Mutex::new(None),
        };
        w.progress().store(0, Ordering::Release);
        w.bad_atomic().store(0, Ordering::Release);
        w.summed().store(0, Ordering::Release);
        w.passed().store(0, Ordering::Release);
        Ok(w)
    }

    /// The progress word (streams wait on it with `wait_word`).
    pub(super) fn progress(&self) -> &AtomicU32 {
        // SAFETY: 64 bytes of page-aligned page-locked memory owned by `self`.
        unsafe { AtomicU32::from_ptr(self.mem.ptr().cast()) }
    }

    pub(super) fn progress_ptr(&self) -> *const u32 {
        self.mem.ptr().cast()
    }

    /// The check word's address, for the decode kernels.
    pub(super) fn bad_ptr(&self) -> *mut i32 {
        self.mem.ptr().wrapping_add(4).cast()
    }

    fn bad_atomic(&self) -> &AtomicI32 {
        // SAFETY: as `progress`, the next 4 bytes.
        unsafe { AtomicI32::from_ptr(self.bad_ptr()) }
    }

    /// True once a decode found a chunk the codec refuses.
    pub(super) fn bad(&self) -> bool {
        self.bad_atomic().load(Ordering::Acquire) != 0
    }

    /// The word a hierarchical call on a stream stores as each piece's intra-host sums
    /// reach its page-locked copy (`pieces.rs`); the lane's stream waits on it before
    /// copying a part in. Its own counter: pieces end out of step with exchanges.
    pub(super) fn summed(&self) -> &AtomicU32 {
        // SAFETY: as `progress`, the 4 bytes at offset 8.
        unsafe { AtomicU32::from_ptr(self.summed_ptr().cast_mut()) }
    }

    pub(super) fn summed_ptr(&self) -> *const u32 {
        self.mem.ptr().wrapping_add(8).cast()
    }

    /// Records that the lane's stream failed with `e` (the first error is kept).
    pub(super) fn fail(&self, e: Error) {
        lock(&self.failed).get_or_insert(e);
    }

    /// The word the lane's stream stores the value of each mark in as it passes it.
    fn passed(&self) -> &AtomicU32 {
        // SAFETY: as `progress`, the 4 bytes at offset 12.
        unsafe { AtomicU32::from_ptr(self.passed_ptr()) }
    }

    fn passed_ptr(&self) -> *mut u32 {
        self.mem.ptr().wrapping_add(12).cast()
    }
}

/// A point in the lane's stream that the host waits for by reading the `passed` word: no
/// driver call, so a thread blocked in the driver (an enqueue on a full queue keeps CUDA's
/// context lock: an H200 hung on the `cuEventQuery`s this replaced) cannot hold up the
/// worker whose progress would unblock it. A failed stream never passes its marks: the wait
/// ends at its timeout, or earlier where the call's board learns of the failure.
struct Mark {
    words: Arc<Words>,
    value: u32,
}

impl Event for Mark {
    fn query(&self) -> Result<bool> {
        // Cyclic, as the stream's waits: passed when (int32)(word - value) >= 0.
        let at = self.words.passed().load(Ordering::Acquire);
        if at.wrapping_sub(self.value) as i32 >= 0 {
            return Ok(true);
        }
        match &*lock(&self.words.failed) {
            Some(e) => Err(e.clone()),
            None => Ok(false),
        }
    }

    fn synchronize(&self, timeout: Duration) -> Result<()> {
        let deadline = std::time::Instant::now() + timeout;
        let mut pause = Duration::from_micros(5);
        while !self.query()? {
            if std::time::Instant::now() >= deadline {
                return Err(Error::Timeout(format!(
                    "the comm's device stream did not pass mark {} after {timeout:?} (it \
                     passed {}): its earlier work is still running, or failed",
                    self.value,
                    self.words.passed().load(Ordering::Acquire)
                )));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_micros(200));
        }
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A comm's device side of these calls: a stream, the page-locked wire slots and words,
/// device scratch and the error-feedback residuals.
pub struct DeviceState {
    // Dropped first: a stream's drop waits for its work, before the memory below is freed.
    pub(super) stream: Box<dyn Stream>,
    pub(super) ordinal: usize,
    pub(super) compensate: Arc<dyn Function>,
    pub(super) avg: Arc<dyn Function>,
    pub(super) header: Arc<dyn Function>,
    pub(super) zero: Arc<dyn Function>,
    /// Page-locked slots, `sra::SETS` sets of: the bytes sent to each peer (this rank's own
    /// slot: its encoded sum), then the bytes received from each.
    pub(super) wire: Option<Box<dyn Pinned>>,
    pub(super) words: Arc<Words>,
    /// The last progress value handed out (a call's exchanges wait for the next ones).
    pub(super) seq: u32,
    /// The last value of the `summed` word handed out (a hierarchical call's pieces).
    pub(super) summed_seq: u32,
    /// The last mark enqueued on the stream.
    marks: AtomicU32,
    /// Calls enqueued so far (`GpuLane::moved` counts those whose bytes are moved).
    pub(super) issued: u64,
    /// One piece's payload (aligned, whatever its offset in the wire bytes).
    pub(super) payload: Option<Box<dyn DeviceMem>>,
    /// The launch plans' scratch.
    pub(super) scratch: Option<Box<dyn DeviceMem>>,
    /// The f32 copy of the buffer of a call on another float type (the CPU's `with_f32`).
    pub(super) work: Option<Box<dyn DeviceMem>>,
    pub(super) residuals: HashMap<TensorKey, Box<dyn DeviceMem>>,
}

/// Room a call needs, worked out from its slices before it starts.
pub(super) struct Sizes {
    /// Bytes of a wire slot: the longest encoding of any slice.
    pub(super) slot: usize,
    /// Longest payload of one piece.
    pub(super) payload: usize,
    /// Most plan scratch of one piece.
    pub(super) scratch: usize,
    /// The f32 copy of the buffer of a call on another float type.
    pub(super) work: usize,
}

impl DeviceState {
    pub(super) fn functions(driver: &dyn Driver, ordinal: usize) -> Result<[Arc<dyn Function>; 4]> {
        Ok([
            driver.function(ordinal, "qccl_ef_compensate")?,
            driver.function(ordinal, "qccl_finish_avg_f32")?,
            driver.function(ordinal, "qccl_put_header")?,
            driver.function(ordinal, "qccl_ef_zero")?,
        ])
    }

    pub(super) fn new(driver: &dyn Driver, ordinal: usize) -> Result<DeviceState> {
        let [compensate, avg, header, zero] = Self::functions(driver, ordinal)?;
        Ok(DeviceState {
            stream: driver.create_stream(ordinal)?,
            ordinal,
            compensate,
            avg,
            header,
            zero,
            wire: None,
            words: Arc::new(Words::new(driver)?),
            seq: 0,
            summed_seq: 0,
            marks: AtomicU32::new(0),
            issued: 0,
            payload: None,
            scratch: None,
            work: None,
            residuals: HashMap::new(),
        })
    }

    /// The device residual of `key` for `count` f32s, zeroed on first use or when the count
    /// changed (as the host's `Residuals::get`); the residuals of `forgotten` keys dropped.
    /// A residual in use is dropped only once every earlier call is done (`idle`).
    pub(super) fn residual(
        &mut self,
        driver: &dyn Driver,
        key: Option<&TensorKey>,
        count: usize,
        forgotten: HashSet<TensorKey>,
        (moved, timeout): (&AtomicU64, Duration),
    ) -> Result<Option<u64>> {
        let len = 4 * count;
        let stale = key
            .and_then(|k| self.residuals.get(k))
            .is_some_and(|m| m.len() != len);
        if stale || forgotten.iter().any(|k| self.residuals.contains_key(k)) {
            self.idle(moved, timeout)?;
            for k in &forgotten {
                self.residuals.remove(k);
            }
        }
        let Some(key) = key else {
            return Ok(None);
        };
        if let Some(m) = self.residuals.get(key).filter(|m| m.len() == len) {
            return Ok(Some(m.addr()));
        }
        if let Some(old) = self.residuals.remove(key) {
            crate::qlog!(
                Info,
                "error feedback: tensor key {key} was used with {} elements, now with {count}: \
                 its residual starts again from zero",
                old.len() / 4
            );
        }
        let m = driver.alloc_device(self.ordinal, len)?;
        let addr = m.addr();
        // The fresh residual is kept in `residuals` until every call using it is done.
        self.zero(addr, count)?;
        self.residuals.insert(key.clone(), m);
        Ok(Some(addr))
    }

    /// After a call's enqueue failed and its waits were released: waits (at most `timeout`)
    /// for what was enqueued to run, true once it did; false when the stream failed, which
    /// the lane's marks then report (`Words::fail`).
    pub(super) fn drained_after_failure(&self, timeout: Duration) -> bool {
        match self.stream.synchronize(timeout) {
            Ok(()) => true,
            Err(e) => {
                self.words.fail(e);
                false
            }
        }
    }

    /// After a call's enqueue failed: whether the stream failed (sticky: enqueueing a mark
    /// then fails at once, without waiting for anything), which the lane's marks then report.
    pub(super) fn note_if_failed(&self) {
        if let Err(e) = self.mark() {
            self.words.fail(e);
        }
    }

    /// Enqueues a mark after the work enqueued so far: an event for the host alone (no stream
    /// can wait for it) that the worker queries with no driver call (`Mark`).
    pub(super) fn mark(&self) -> Result<Box<dyn Event>> {
        let value = self.marks.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        // SAFETY: the lane's page-locked `passed` word, allocated as long as the lane (whose
        // stream is dropped, after its work, before the words).
        unsafe { self.stream.write_word(self.words.passed_ptr(), value)? };
        Ok(Box::new(Mark {
            words: self.words.clone(),
            value,
        }))
    }

    /// Enqueues setting `count` f32s of device memory at `addr` to +0.0 (`qccl_ef_zero`);
    /// `addr` must hold them until the work enqueued after this is done.
    pub(super) fn zero(&self, addr: u64, count: usize) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let args = [Arg::Ptr(addr), Arg::U64(count as u64)];
        // SAFETY: ef.cu's qccl_ef_zero(float* res, uint64_t count) over `count` f32s at
        // `addr`, which the caller keeps valid (this function's contract).
        unsafe {
            self.stream
                .launch(&*self.zero, grid_for(count), BLOCK, &args)
        }
    }

    /// Grows the wire slots and device scratch to `sizes` for `n` ranks (no wire for one). Memory in use is
    /// replaced only once every earlier call is done (`moved` reached `issued`, and the
    /// stream is idle), on this thread: the comm's worker never frees it.
    pub(super) fn reserve(
        &mut self,
        driver: &dyn Driver,
        sizes: &Sizes,
        n: usize,
        moved: &AtomicU64,
        timeout: Duration,
    ) -> Result<()> {
        let wire = SETS * 2 * n * sizes.slot;
        let grow_wire = wire > 0 && self.wire.as_ref().is_none_or(|w| w.len() < wire);
        let grow = |m: &Option<Box<dyn DeviceMem>>, len: usize| {
            len > 0 && m.as_ref().is_none_or(|m| m.len() < len)
        };
        let grow_payload = grow(&self.payload, sizes.payload);
        let grow_scratch = grow(&self.scratch, sizes.scratch);
        let grow_work = grow(&self.work, sizes.work);
        if !(grow_wire || grow_payload || grow_scratch || grow_work) {
            return Ok(());
        }
        self.idle(moved, timeout)?;
        if grow_wire {
            self.wire = None;
            self.wire = Some(driver.alloc_pinned(wire.max(4096))?);
        }
        if grow_payload {
            self.payload = None;
            self.payload = Some(driver.alloc_device(self.ordinal, sizes.payload)?);
        }
        if grow_scratch {
            self.scratch = None;
            self.scratch = Some(driver.alloc_device(self.ordinal, sizes.scratch)?);
        }
        if grow_work {
            self.work = None;
            self.work = Some(driver.alloc_device(self.ordinal, sizes.work)?);
        }
        Ok(())
    }

    /// Waits, at most `timeout`, until every call enqueued so far is done: its bytes moved
    /// and its device work run (a `Script` counts itself done only then). Not a stream
    /// synchronise: after an allocation that would also wait for the callers' streams.
    pub(super) fn idle(&self, moved: &AtomicU64, timeout: Duration) -> Result<()> {
        let deadline = std::time::Instant::now() + timeout;
        let mut pause = Duration::from_micros(20);
        while moved.load(Ordering::Acquire) < self.issued {
            if std::time::Instant::now() >= deadline {
                return Err(Error::Timeout(format!(
                    "compressed all-reduce on device buffers: this comm's earlier calls were \
                     not done after {timeout:?} (needed before growing its buffers)"
                )));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
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
