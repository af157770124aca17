//! Device buffers through host staging: a call whose buffers are device memory runs the host
//! collective on page-locked copies of them. The copies in wait for the caller's stream (an
//! event recorded on it, waited for by qccl's own stream), so they see every write the
//! caller enqueued before the call; the copies out finish before the call returns, so work
//! the caller enqueues afterwards sees the result. Host buffers in the same call are used
//! as they are.
//!
//! On a caller's stream (not NULL) a call returns once its work is enqueued (`start`): the
//! copies in are queued on qccl's stream behind an event of the caller's, the caller's stream
//! is made to wait for a page-locked word and then copies the results out of the page-locked
//! buffers, and the comm's worker runs the collective when the copies in are done, then
//! stores the word, releasing the caller's stream, whatever happened: an error fails the comm
//! (`async_error`), never hangs the stream (the buffers' contents are then undefined, as
//! NCCL's are after an error).
//!
//! Every copy is enqueued by `start`, before the stream waits: the worker enqueues no device
//! work for a staged call. CUDA orders work enqueued after an implicitly synchronising call
//! (a `cudaMalloc` of the application, freeing page-locked memory) behind all earlier work,
//! the caller's stream held at the word included; a copy out the worker enqueued then, and
//! waited for before storing the word, would never run (seen on an H200: the stream and the
//! worker both waited until the comm's timeout). For the same reason the pool pins and frees
//! memory only once this comm's earlier calls on streams are done (`quiesce`).
//!
//! A call with no buffer to copy (`run` with none) only orders work on the caller's stream:
//! the compressed SRA with its codecs on the GPU (`gpu::sra`) is run so where it cannot be
//! enqueued when it is made (NULL stream, or its step not known yet).
//!
//! Page-locked memory: the calls that wait share one set of buffers, grown to the largest
//! call; the calls on a caller's stream, which return before they are done, take theirs from
//! a pool that reuses them across calls and caps the bytes pinned (`pool.rs`,
//! QCCL_STAGING_BYTES): enqueueing waits for earlier calls to finish once the cap is reached.
//!
//! `run` and `start` copy whole buffers before and after the collective. `start_banded`
//! cuts a call on a caller's stream into bands (ranks sharing one host, `arena.rs`): every
//! copy still enqueued by the caller, the worker releasing each band's copies out with its
//! own value of the word as soon as the band's rounds are done, so copies and rounds
//! overlap. Dense calls that return once done avoid page-locked buffers altogether where
//! they can (`arena.rs`: the arena's segments registered; `ipc.rs`: CUDA IPC).

use super::driver::{Driver, Memory, Pinned, Stream};
use crate::error::{Error, Result};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod pool;

use pool::Lent;
pub use pool::{Pool, PoolStats, DEFAULT_STAGING_BYTES};

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
    /// Copies in (and out, for calls that wait).
    stream: Box<dyn Stream>,
    /// Copies out of calls in bands that wait (`start_banded_waiting`), made on first use.
    outs: Option<Box<dyn Stream>>,
    pinned: Vec<Box<dyn Pinned>>,
    timeout: Duration,
    /// Page-locked buffers of calls on a caller's stream, lent until each call is done.
    pool: Arc<Pool>,
    /// The word callers' streams wait on, and the last value handed out.
    word: Arc<Word>,
    seq: u32,
}

/// A page-locked 32-bit word: stored by the worker, waited on by streams.
struct Word {
    /// Owns the memory `at` points into.
    _mem: Mutex<Box<dyn Pinned>>,
    at: *const AtomicU32,
}

// SAFETY: the pointer is into the page-locked allocation the mutex owns for the Word's
// whole life, and is only used for atomic loads and stores.
unsafe impl Send for Word {}
// SAFETY: as above.
unsafe impl Sync for Word {}

impl Word {
    /// Raises the word to `seq` (never lowers it: calls may end out of order on failure).
    fn release(&self, seq: u32) {
        // SAFETY: see the type's Send impl.
        unsafe { &*self.at }.fetch_max(seq, Ordering::AcqRel);
    }

    /// Waits, at most `timeout`, until the word reached `seq`: the calls started up to it
    /// are done.
    fn wait_for(&self, seq: u32, timeout: Duration) -> Result<()> {
        let deadline = std::time::Instant::now() + timeout;
        let mut pause = Duration::from_micros(20);
        // SAFETY: see the type's Send impl.
        while unsafe { &*self.at }.load(Ordering::Acquire) < seq {
            if std::time::Instant::now() >= deadline {
                return Err(Error::Timeout(format!(
                    "page-locked staging: this comm's earlier calls on streams were not done \
                     after {timeout:?} (needed before pinning or freeing page-locked memory)"
                )));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
        Ok(())
    }
}

/// Host addresses standing for a call's buffers, moved to the worker with it.
struct Hosts(Vec<*mut u8>);

// SAFETY: they address page-locked buffers owned by the `Finish` they travel with, or the
// caller's host buffers, which the caller keeps valid until its stream passes the call.
unsafe impl Send for Hosts {}

/// What the worker does to end a call started on a caller's stream (`Staging::start`).
pub struct Finish {
    hosts: Hosts,
    /// The copies in, done.
    copied_in: Box<dyn super::driver::Event>,
    /// The copies out on the caller's stream, done (none without buffers to copy out).
    copied_out: Option<Box<dyn super::driver::Event>>,
    /// Given back to the pool when the Finish is dropped, once no copy uses them; None once
    /// kept from the pool for good (a copy that could not be confirmed done).
    pinned: Option<Lent>,
    word: Arc<Word>,
    seq: u32,
    timeout: Duration,
}

impl Finish {
    /// Runs the collective (`run` on the host addresses) once the copies in are done; the
    /// caller's stream copies the results out once the word is stored, on drop (also after
    /// a failure, which the comm records first: `Queue::submit_holding`).
    pub fn run(&mut self, run: impl FnOnce(&[*mut u8]) -> Result<()>) -> Result<()> {
        self.copied_in.synchronize(self.timeout)?;
        run(&self.hosts.0)
    }
}

impl Drop for Finish {
    fn drop(&mut self) {
        // Released even when the job never ran (a failed comm drops it): a stream waiting for
        // a word nobody stores would hang its device work forever.
        self.word.release(self.seq);
        let copies = self
            .copied_out
            .iter()
            .chain(std::iter::once(&self.copied_in));
        settle(&mut self.pinned, copies, self.timeout);
    }
}

/// Records on `caller` the event after the copies out a call enqueued there (`copies`: how
/// enqueueing them went) into `event`, even after a failed enqueue: `pinned` stays lent
/// until the copies that were enqueued are done, and with no event it never goes back.
fn copied_out(
    caller: &dyn Stream,
    copies: Result<()>,
    event: &mut Option<Box<dyn super::driver::Event>>,
    pinned: &mut Option<Lent>,
) -> Result<()> {
    match caller.record() {
        Ok(e) => *event = Some(e),
        Err(e) if copies.is_ok() => return Err(e),
        Err(_) => std::mem::forget(pinned.take()),
    }
    copies
}

/// Lets `pinned` go back to the pool (when its holder drops it) only once every copy that
/// `copies` mark is done; keeps it out of the pool for good when one cannot be confirmed.
fn settle<'a>(
    pinned: &mut Option<Lent>,
    mut copies: impl Iterator<Item = &'a Box<dyn super::driver::Event>>,
    timeout: Duration,
) {
    if let Err(e) = copies.try_for_each(|e| e.synchronize(timeout)) {
        crate::qlog!(
            Warn,
            "page-locked staging buffers kept out of the pool: a copy using them was not \
             confirmed done ({e})"
        );
        std::mem::forget(pinned.take());
    }
}

/// Most operations one call started in bands puts on each of its two streams: per band an
/// event or a wait, and a copy per range each way. CUDA holds some 1000 pending operations
/// per stream before an enqueue blocks, and the caller's stream may hold work of its own.
const BAND_STREAM_OPS: usize = 448;

/// Most bands of a call whose bands copy `ranges` ranges each way (`BAND_STREAM_OPS`).
pub fn most_bands(ranges: usize) -> usize {
    (BAND_STREAM_OPS / (ranges + 1)).max(1)
}

/// One band of a call started with `Staging::start_banded`: its copies in (device address,
/// offset in the page-locked buffer, bytes), made before the call, and out, made once the
/// worker released the band.
#[derive(Debug, Clone, Default)]
pub struct Band {
    /// Device → page-locked.
    pub ins: Vec<(u64, usize, usize)>,
    /// Page-locked → device.
    pub outs: Vec<(u64, usize, usize)>,
}

/// What the worker holds of a call started in bands: the page-locked buffer, an event per
/// band's copies in, and the word values that release each band's copies out.
pub struct Banded {
    /// Back to the pool on drop, once no copy uses it; None once kept from the pool for
    /// good.
    pinned: Option<Lent>,
    landed: Vec<Box<dyn super::driver::Event>>,
    copied_out: Option<Box<dyn super::driver::Event>>,
    word: Arc<Word>,
    base: u32,
    bands: u32,
    timeout: Duration,
}

impl Banded {
    /// The page-locked buffer's first byte.
    pub fn ptr(&self) -> *mut u8 {
        self.pinned
            .as_ref()
            .map_or(std::ptr::null_mut(), |p| p.ptr(0))
    }

    /// True once band `b`'s copies in are done (its bytes are in the buffer); the copy's
    /// error if it failed.
    pub fn landed(&self, b: usize) -> Result<bool> {
        self.landed[b].query()
    }

    /// Lets the caller's stream copy band `b`'s results out (they are in the buffer).
    pub fn release(&self, b: usize) {
        self.word.release(self.base.wrapping_add(b as u32 + 1));
    }

    /// Returns once band `b`'s copies in are done (bounded by the comm's timeout).
    pub fn wait_landed(&self, b: usize) -> Result<()> {
        self.landed[b].synchronize(self.timeout)
    }

    /// Releases every band and returns once their copies out are done (a call that waits:
    /// `Staging::start_banded_waiting`).
    pub fn finish(self) -> Result<()> {
        self.word.release(self.base.wrapping_add(self.bands));
        match &self.copied_out {
            Some(e) => e.synchronize(self.timeout),
            None => Err(Error::Internal(
                "a banded call's copies out were never enqueued".into(),
            )),
        }
    }
}

impl Drop for Banded {
    fn drop(&mut self) {
        // Every band released, even when the job never ran (see `Finish`'s drop).
        self.word.release(self.base.wrapping_add(self.bands));
        let copies = self.copied_out.iter().chain(&self.landed);
        settle(&mut self.pinned, copies, self.timeout);
    }
}

impl Staging {
    /// Staging on device `ordinal`; every wait bounded by `timeout` (the comm's); calls on a
    /// caller's stream take their page-locked buffers from `pool` (capped).
    pub fn new(
        driver: Arc<dyn Driver>,
        ordinal: usize,
        timeout: Duration,
        pool: Arc<Pool>,
    ) -> Result<Staging> {
        let stream = driver.create_stream(ordinal)?;
        let w = driver.alloc_pinned(4)?;
        let at = w.ptr() as *const AtomicU32;
        // SAFETY: fresh page-locked memory, page-aligned, nothing else uses it yet.
        unsafe { &*at }.store(0, Ordering::Release);
        Ok(Staging {
            driver,
            ordinal,
            stream,
            outs: None,
            pinned: Vec::new(),
            timeout,
            pool,
            word: Arc::new(Word {
                _mem: Mutex::new(w),
                at,
            }),
            seq: 0,
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

    /// Enqueues the start of a call on the caller's stream `raw` (not null) and returns what
    /// the comm's worker must do to end it (`Finish::run`): the device buffers the call reads
    /// are copied in behind the stream's earlier work, and the stream waits until the worker
    /// is done with the call. Host buffers are not allowed here (the caller may change them
    /// as soon as this returns); `place` must have a device buffer.
    ///
    /// # Safety
    /// Each device buffer must stay valid until the caller's stream passes the call, and `raw`
    /// be a stream of this device.
    pub unsafe fn start(
        &mut self,
        bufs: &[CallBuf],
        place: &Placement,
        raw: *mut c_void,
    ) -> Result<Finish> {
        if let Some(b) = bufs
            .iter()
            .zip(&place.device)
            .find(|(b, d)| d.is_none() && b.len > 0)
        {
            return Err(Error::invalid(format!(
                "a host buffer at {:#x} with a stream: a call on a stream takes device buffers \
                 only (or pass NULL)",
                b.0.addr
            )));
        }
        // SAFETY: the caller's promise about `raw`.
        let caller = unsafe { self.driver.borrow_stream(self.ordinal, raw)? };
        // May wait for earlier calls on streams to finish (the cap on pinned bytes), and
        // before pinning or freeing memory for this comm's earlier calls (see the module).
        let lens: Vec<usize> = bufs.iter().map(|b| b.len).collect();
        let (word, last, timeout) = (self.word.clone(), self.seq, self.timeout);
        let pinned = self.pool.take(&*self.driver, &lens, self.timeout, || {
            word.wait_for(last, timeout)
        })?;
        let ready = caller.record()?;
        self.stream.wait_event(&*ready)?;
        let mut outs = Vec::new();
        for (i, b) in bufs.iter().enumerate() {
            if b.len > 0 && b.reads {
                // SAFETY: the pinned buffer has room and belongs to this call alone until
                // its Finish is dropped; the device range was located.
                unsafe { self.stream.copy_to_host(pinned.ptr(i), b.addr, b.len)? };
            }
            if b.len > 0 && b.writes {
                outs.push((b.addr, pinned.ptr(i), b.len));
            }
        }
        let copied_in = self.stream.record()?;
        self.seq = self.seq.wrapping_add(1);
        let mut finish = Finish {
            hosts: Hosts(pinned.ptrs()),
            copied_in,
            copied_out: None,
            pinned: Some(pinned),
            word: self.word.clone(),
            seq: self.seq,
            timeout: self.timeout,
        };
        // SAFETY: the word is page-locked memory of this driver, aligned, and lives as long
        // as `self.word`, which every Finish holds until it stored the value.
        unsafe { caller.wait_word(self.word.at.cast(), self.seq)? };
        if outs.is_empty() {
            return Ok(finish);
        }
        let copies = outs.iter().try_for_each(|&(dev, host, len)| {
            // SAFETY: the pinned buffer holds the result once the word is stored and stays
            // out of the pool until the event recorded below is done (`Finish`'s drop);
            // `dev` was located as device memory of `len` bytes, which the caller keeps
            // valid until its stream passes the call.
            unsafe { caller.copy_to_device(dev, host, len) }
        });
        copied_out(&*caller, copies, &mut finish.copied_out, &mut finish.pinned)?;
        Ok(finish)
    }

    /// Enqueues the start of a call on the caller's stream `raw` (not null) in `bands`,
    /// through one page-locked buffer of `len` bytes from the pool: on qccl's stream, behind
    /// the caller's earlier work, each band's copies in, then an event; on the caller's
    /// stream, for each band in order, a wait until the worker stored that band's value of
    /// the word, then the band's copies out. The worker runs the collective band by band
    /// (`Banded::landed`, `Banded::release`): the copies of one band overlap the collective
    /// of another, and the worker enqueues no device work (see the module). Every range is
    /// device memory of this device and lies inside `len` bytes of the buffer.
    ///
    /// # Safety
    /// Each device range must stay valid until the caller's stream passes the call, and
    /// `raw` be a stream of this device.
    pub unsafe fn start_banded(
        &mut self,
        len: usize,
        bands: &[Band],
        raw: *mut c_void,
    ) -> Result<Banded> {
        // SAFETY: the caller's promise about `raw`.
        let caller = unsafe { self.driver.borrow_stream(self.ordinal, raw)? };
        // SAFETY: the caller's promise about the ranges.
        unsafe { self.start_bands(len, bands, &*caller, &*caller) }
    }

    /// As [`Staging::start_banded`] with the copies in behind the work on `after` (a
    /// stream of this device that the call's own work before them is on: a hierarchical
    /// call's residual folded in, `comm/gpu_hier_stream.rs`) instead of the caller's.
    ///
    /// # Safety
    /// As [`Staging::start_banded`].
    pub unsafe fn start_banded_after(
        &mut self,
        len: usize,
        bands: &[Band],
        after: &dyn Stream,
        raw: *mut c_void,
    ) -> Result<Banded> {
        // SAFETY: the caller's promise about `raw`.
        let caller = unsafe { self.driver.borrow_stream(self.ordinal, raw)? };
        // SAFETY: the caller's promise about the ranges.
        unsafe { self.start_bands(len, bands, after, &*caller) }
    }

    /// As [`Staging::start_banded`] for a call that returns once done (`raw` null: the
    /// legacy default stream; queued calls in the comm's turn): the copies in wait for
    /// `raw`'s earlier work, the copies out go on a stream of qccl's own, which no work of
    /// the caller's waits behind; [`Banded::finish`] returns once they are done.
    ///
    /// # Safety
    /// Each device range must stay valid until `Banded::finish` returned (or the Banded
    /// was dropped and its copies settled), and `raw` be null or a stream of this device.
    pub unsafe fn start_banded_waiting(
        &mut self,
        len: usize,
        bands: &[Band],
        raw: *mut c_void,
    ) -> Result<Banded> {
        // SAFETY: the caller's promise about `raw`.
        let after = unsafe { self.driver.borrow_stream(self.ordinal, raw)? };
        let outs = match self.outs.take() {
            Some(s) => s,
            None => self.driver.create_stream(self.ordinal)?,
        };
        // SAFETY: the caller's promise about the ranges.
        let started = unsafe { self.start_bands(len, bands, &*after, &*outs) };
        if started.is_ok() {
            // A failed copy is sticky: the next call makes a new stream.
            self.outs = Some(outs);
        }
        started
    }

    /// `start_banded`'s body: the copies in wait for `after`'s earlier work, the copies out
    /// go on `outs`, each band's behind its value of the word.
    ///
    /// # Safety
    /// As `start_banded`.
    unsafe fn start_bands(
        &mut self,
        len: usize,
        bands: &[Band],
        after: &dyn Stream,
        outs: &dyn Stream,
    ) -> Result<Banded> {
        if bands.is_empty() || len == 0 {
            return Err(Error::Internal("a banded call of no bands or bytes".into()));
        }
        // One take for the whole call: a band's take that had to pin memory would first
        // wait for this comm's earlier calls, the call's own earlier bands included.
        let (word, last, timeout) = (self.word.clone(), self.seq, self.timeout);
        let pinned = self.pool.take(&*self.driver, &[len], self.timeout, || {
            word.wait_for(last, timeout)
        })?;
        let ready = after.record()?;
        self.stream.wait_event(&*ready)?;
        let at = pinned.ptr(0);
        let mut landed = Vec::with_capacity(bands.len());
        for band in bands {
            for &(dev, off, n) in &band.ins {
                // SAFETY: `off + n <= len` (the caller's promise), the buffer is this call's
                // until its Banded is dropped; the device range was located.
                unsafe { self.stream.copy_to_host(at.add(off), dev, n)? };
            }
            landed.push(self.stream.record()?);
        }
        let base = self.seq;
        self.seq = self.seq.wrapping_add(bands.len() as u32);
        let mut banded = Banded {
            pinned: Some(pinned),
            landed,
            copied_out: None,
            word: self.word.clone(),
            base,
            bands: bands.len() as u32,
            timeout: self.timeout,
        };
        let copies = bands.iter().enumerate().try_for_each(|(i, band)| {
            // SAFETY: the word is page-locked memory of this driver, aligned, alive as long
            // as `self.word`, which the Banded holds until it stored its last value.
            unsafe { outs.wait_word(self.word.at.cast(), base.wrapping_add(i as u32 + 1))? };
            band.outs.iter().try_for_each(|&(dev, off, n)| {
                // SAFETY: the band's results are in the buffer once its value is stored;
                // the buffer stays out of the pool until the event below is done.
                unsafe { outs.copy_to_device(dev, at.add(off), n) }
            })
        });
        copied_out(outs, copies, &mut banded.copied_out, &mut banded.pinned)?;
        Ok(banded)
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
