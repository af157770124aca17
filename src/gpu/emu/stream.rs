//! Emulated streams: a FIFO of operations (copies, kernel launches, event completions, waits
//! on other streams' events) run in order by one worker thread per stream.
//!
//! Checks that need no device happen at enqueue (see `EmuStream::copy`); the copy itself runs
//! on the worker. The first operation that fails makes the stream sticky-failed, as CUDA's
//! sticky errors: the operations after it are skipped, events after it complete with its
//! error, and every later enqueue, `synchronize` or event query returns it.

use super::event::{EmuEvent, EventState};
use super::fault::CopyFault;
use super::library::EmuFunction;
use super::memory::{Allocation, Freed};
use super::Shared;
use crate::error::{Error, Result};
use crate::gpu::driver::{Arg, Event, Function, Stream};
use crate::gpu::launch::{type_name, ArgBlock};
use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long dropping a stream waits for its enqueued work before abandoning the rest.
pub const DROP_DRAIN: Duration = Duration::from_secs(10);

/// Which way a copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    ToHost,
    ToDevice,
}

/// One enqueued copy; the allocation is held, not looked up again by address.
struct CopyOp {
    dir: Direction,
    alloc: Arc<Allocation>,
    /// The device address the caller gave (for errors) and its offset in `alloc`.
    device: u64,
    offset: usize,
    /// Host side: the destination (`ToHost`) or the source (`ToDevice`).
    host: *mut u8,
    len: usize,
    fault: CopyFault,
}

// SAFETY: `host` is only used by the worker, within the range whose validity the caller of
// `copy_to_host`/`copy_to_device` guaranteed until the copy is known done.
unsafe impl Send for CopyOp {}

/// One enqueued kernel launch; device-pointer arguments hold their allocations.
struct LaunchOp {
    func: EmuFunction,
    grid: u32,
    block: u32,
    args: ArgBlock,
    /// Pointer arguments into device memory: (argument index, allocation, offset in it).
    device: Vec<(usize, Arc<Allocation>, usize)>,
}

// SAFETY: the argument values are plain bytes; the memory they point to is the launch's
// caller's to keep valid until the launch is known done (`Stream::launch`'s contract).
unsafe impl Send for LaunchOp {}

/// One enqueued copy between two places of device memory (`copy_on_device`).
struct DeviceCopyOp {
    src: Arc<Allocation>,
    src_offset: usize,
    dst: Arc<Allocation>,
    dst_offset: usize,
    len: usize,
}

/// How long a copy with pageable host memory behind a held stream waits (CUDA: forever).
const PAGEABLE_WAIT: Duration = Duration::from_secs(30);

/// Operations a stream holds pending before an enqueue blocks, by default: about what a CUDA
/// stream holds (an enqueue past some 1000 pending launches waits for one to end), so work
/// that enqueues more than this behind a wait only it can end deadlocks here as on a GPU.
pub const QUEUE_DEPTH: u64 = 1024;

/// How long an enqueue on a full stream waits before it fails (CUDA's: forever).
const FULL_WAIT: Duration = Duration::from_secs(60);

/// Whether an enqueue that waits for room in a full queue holds the driver's lock while it
/// waits, as CUDA's does (QCCL_GPU_EMULATE_FULL_QUEUE_LOCK=1): then an event query or record
/// on any stream of the process waits for it ([`driver_lock`]). CUDA's driver serialises
/// calls on a context lock, and a launch blocked on a full queue keeps it (PyTorch's NCCL
/// watchdog notes `cudaEventQuery` hanging the same way behind a synchronize): a thread that
/// must query events for the queue to drain then deadlocks. Off by default: tests turn it
/// on where they check that qccl's worker makes no driver call a full queue can block.
fn full_queue_locks() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("QCCL_GPU_EMULATE_FULL_QUEUE_LOCK").is_ok_and(|v| v.trim() == "1")
    })
}

/// The emulated driver's lock (see [`full_queue_locks`]): held by an enqueue waiting for room
/// in a full queue; event queries and records take it in passing.
pub(super) fn driver_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// The depth of every emulated stream's queue: QCCL_GPU_EMULATE_QUEUE_DEPTH (at least 1),
/// else [`QUEUE_DEPTH`]. Tests lower it to reach the limit with small calls.
fn queue_depth() -> u64 {
    static DEPTH: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *DEPTH.get_or_init(|| {
        let v = std::env::var("QCCL_GPU_EMULATE_QUEUE_DEPTH").ok();
        match v.as_deref().map(str::trim).filter(|v| !v.is_empty()) {
            None => QUEUE_DEPTH,
            Some(v) => v.parse().ok().filter(|&d| d > 0).unwrap_or_else(|| {
                crate::qlog!(
                    Warn,
                    "QCCL_GPU_EMULATE_QUEUE_DEPTH={v}: expected a positive number of \
                     operations; using {QUEUE_DEPTH}"
                );
                QUEUE_DEPTH
            }),
        }
    })
}

enum Op {
    Copy(CopyOp),
    DeviceCopy(DeviceCopyOp),
    Launch(LaunchOp),
    Record(Arc<EventState>),
    Wait(Arc<EventState>),
    /// `wait_word`: the word's address (page-locked, kept allocated by the caller) and value.
    WaitWord(usize, u32),
    /// `write_word`: the word's address (as for `WaitWord`) and the value stored there.
    WriteWord(usize, u32),
}

struct Queue {
    ops: VecDeque<Op>,
    /// Operations enqueued / finished (run or skipped) so far.
    enqueued: u64,
    done: u64,
    /// The sticky error.
    error: Option<Error>,
    /// No more operations: the owner is dropping the stream.
    closed: bool,
    /// Events recorded so far, to name them.
    events: u64,
    /// `WaitWord`s enqueued and not yet passed.
    word_waits: usize,
}

/// A stream's FIFO and worker, shared by its owner and its borrowers.
pub struct StreamCore {
    /// The handle (`raw()`); 0 for a device's legacy default stream.
    pub id: u64,
    pub ordinal: usize,
    /// "emulated stream 3 on device 0", for errors.
    pub name: String,
    queue: Mutex<Queue>,
    cond: Condvar,
    /// Set when the drain on drop timed out: the worker skips what is left, and abandons a
    /// wait or delay in progress.
    abandon: AtomicBool,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl StreamCore {
    /// A stream with its worker running.
    pub fn start(id: u64, ordinal: usize, name: String) -> Result<Arc<StreamCore>> {
        let core = Arc::new(StreamCore {
            id,
            ordinal,
            name,
            queue: Mutex::new(Queue {
                ops: VecDeque::new(),
                enqueued: 0,
                done: 0,
                error: None,
                closed: false,
                events: 0,
                word_waits: 0,
            }),
            cond: Condvar::new(),
            abandon: AtomicBool::new(false),
            worker: Mutex::new(None),
        });
        let worker = core.clone();
        let handle = std::thread::Builder::new()
            .name(format!("qccl-gpuemu-{id}"))
            .spawn(move || worker.run())
            .map_err(|e| Error::io(format!("spawning the worker of {}", core.name), e))?;
        *core.worker.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
        Ok(core)
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// True until the owner drops the stream.
    pub fn is_open(&self) -> bool {
        !self.lock().closed
    }

    /// Why nothing may be enqueued now (destroyed, or sticky-failed), if so.
    fn refusal(&self, q: &Queue) -> Option<Error> {
        if q.closed {
            return Some(Error::invalid(format!(
                "{} was destroyed (CUDA_ERROR_INVALID_HANDLE)",
                self.name
            )));
        }
        q.error.clone()
    }

    /// The stream's queue with room for one more operation: as CUDA's, an enqueue blocks
    /// while [`queue_depth`] operations are pending (CUDA's forever; here at most
    /// [`FULL_WAIT`], then an error saying so). An error when nothing may be enqueued.
    fn room(&self) -> Result<MutexGuard<'_, Queue>> {
        let depth = queue_depth();
        let mut q = self.lock();
        let deadline = deadline_after(FULL_WAIT);
        // Taken (never while holding the queue) once the queue is found full.
        let mut held = None;
        loop {
            if let Some(e) = self.refusal(&q) {
                return Err(e);
            }
            if q.enqueued - q.done < depth {
                return Ok(q);
            }
            if held.is_none() && full_queue_locks() {
                drop(q);
                held = Some(driver_lock());
                q = self.lock();
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout(format!(
                    "{}: {depth} operations pending for {FULL_WAIT:?}, none done: the \
                     enqueue would block forever on a real device (its queue is full behind \
                     work that does not end)",
                    self.name
                )));
            }
            q = self
                .cond
                .wait_timeout(q, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn enqueue(&self, op: Op) -> Result<()> {
        let mut q = self.room()?;
        if matches!(op, Op::WaitWord(..)) {
            q.word_waits += 1;
        }
        q.ops.push_back(op);
        q.enqueued += 1;
        self.cond.notify_all();
        Ok(())
    }

    /// True while a `wait_word` enqueued on it has not been passed.
    pub fn held_at_a_word(&self) -> bool {
        self.lock().word_waits > 0
    }

    /// Makes the work enqueued after this wait for `event`.
    pub fn wait(&self, event: Arc<EventState>) -> Result<()> {
        self.enqueue(Op::Wait(event))
    }

    /// Records an event after everything enqueued so far.
    pub fn record(&self) -> Result<Arc<EventState>> {
        drop(driver_lock());
        let mut q = self.room()?;
        q.events += 1;
        let event = EventState::new(format!("event {} of {}", q.events, self.name));
        q.ops.push_back(Op::Record(event.clone()));
        q.enqueued += 1;
        self.cond.notify_all();
        Ok(event)
    }

    /// Waits until the operations enqueued before the call are done (or `deadline`): false
    /// when it passed first. With `stop_at_error`, also returns once the stream failed.
    fn wait_done(&self, deadline: Instant, stop_at_error: bool) -> (bool, Option<Error>) {
        let mut q = self.lock();
        let target = q.enqueued;
        loop {
            if stop_at_error && q.error.is_some() || q.done >= target {
                return (true, q.error.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return (false, q.error.clone());
            }
            q = self
                .cond
                .wait_timeout(q, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// `Stream::synchronize`.
    pub fn synchronize(&self, timeout: Duration) -> Result<()> {
        match self.wait_done(deadline_after(timeout), true) {
            (_, Some(e)) => Err(e),
            (true, None) => Ok(()),
            (false, None) => {
                let pending = {
                    let q = self.lock();
                    q.enqueued - q.done
                };
                Err(Error::Timeout(format!(
                    "{}: {pending} operation(s) still pending after {timeout:?}",
                    self.name
                )))
            }
        }
    }

    /// Refuses new work, waits (at most `drain`) for the enqueued work, abandons what is left
    /// after that, and joins the worker. Idempotent.
    pub fn close(&self, drain: Duration) {
        {
            let mut q = self.lock();
            q.closed = true;
            self.cond.notify_all();
        }
        let (drained, _) = self.wait_done(deadline_after(drain), false);
        if !drained {
            self.abandon.store(true, Ordering::Release);
            self.cond.notify_all();
        }
        let handle = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = handle {
            // Every operation ends by itself or on `abandon`, so this join is bounded.
            let _ = h.join();
        }
    }

    /// The worker: runs the operations in order until the stream is closed and empty.
    fn run(&self) {
        loop {
            let (op, failed) = {
                let mut q = self.lock();
                let op = loop {
                    if let Some(op) = q.ops.pop_front() {
                        break op;
                    }
                    if q.closed {
                        return;
                    }
                    q = self.cond.wait(q).unwrap_or_else(|p| p.into_inner());
                };
                (op, q.error.clone())
            };
            let word = matches!(op, Op::WaitWord(..));
            let failed = failed.or_else(|| {
                self.abandon.load(Ordering::Acquire).then(|| {
                    Error::Aborted(format!(
                        "{} was destroyed before its work ran (drain timed out)",
                        self.name
                    ))
                })
            });
            let result = match failed {
                Some(e) => {
                    // Skipped; an event after a failure reports it.
                    if let Op::Record(event) = op {
                        event.complete(Err(e));
                    }
                    Ok(())
                }
                None => self.execute(op),
            };
            let mut q = self.lock();
            q.done += 1;
            if word {
                q.word_waits -= 1;
            }
            if let Err(e) = result {
                q.error.get_or_insert(e);
            }
            self.cond.notify_all();
        }
    }

    fn execute(&self, op: Op) -> Result<()> {
        match op {
            Op::Record(event) => {
                event.complete(Ok(()));
                Ok(())
            }
            Op::Wait(event) => match event.wait_until(far_future(), Some(&self.abandon)) {
                Some(Ok(())) => Ok(()),
                Some(Err(e)) => Err(e.prefixed(&format!(
                    "{}: waited for {}, which failed: ",
                    self.name, event.name
                ))),
                None => Err(Error::Aborted(format!(
                    "{}: destroyed while waiting for {}",
                    self.name, event.name
                ))),
            },
            Op::Copy(copy) => self.copy(copy),
            Op::DeviceCopy(copy) => self.copy_on_device(copy),
            Op::Launch(launch) => self.launch(launch),
            Op::WaitWord(word, value) => {
                // SAFETY: `wait_word`'s contract: an aligned word of page-locked memory that
                // stays allocated until this wait is done; read atomically, as the host
                // stores it from another thread.
                let word = unsafe { &*(word as *const std::sync::atomic::AtomicU32) };
                // CU_STREAM_WAIT_VALUE_GEQ is cyclic: (int32_t)(*word - value) >= 0.
                while (word.load(Ordering::Acquire).wrapping_sub(value) as i32) < 0 {
                    if self.abandon.load(Ordering::Acquire) {
                        return Err(Error::Aborted(format!(
                            "{}: destroyed while waiting for a word to reach {value}",
                            self.name
                        )));
                    }
                    std::thread::sleep(Duration::from_micros(20));
                }
                Ok(())
            }
            Op::WriteWord(word, value) => {
                // SAFETY: `write_word`'s contract, as for `WaitWord`; the host reads the word
                // atomically from another thread, after the work before it (Release).
                let word = unsafe { &*(word as *const std::sync::atomic::AtomicU32) };
                word.store(value, Ordering::Release);
                Ok(())
            }
        }
    }

    fn copy(&self, c: CopyOp) -> Result<()> {
        let what = match c.dir {
            Direction::ToHost => format!(
                "copy of {} bytes from device address 0x{:x}",
                c.len, c.device
            ),
            Direction::ToDevice => {
                format!("copy of {} bytes to device address 0x{:x}", c.len, c.device)
            }
        };
        if let Some(delay) = c.fault.delay {
            self.pause(delay);
        }
        if c.fault.fail {
            return Err(Error::System(format!(
                "{}: {what} failed: injected fault (EmuDriver::fail_next_copy); the stream is \
                 failed (sticky, as after CUDA_ERROR_ILLEGAL_ADDRESS)",
                self.name
            )));
        }
        // SAFETY: the range `offset..offset+len` was checked to lie inside the allocation at
        // enqueue; the host range is valid per the enqueuing call's contract.
        let moved = unsafe {
            match c.dir {
                Direction::ToHost => c.alloc.read(c.offset, c.host, c.len),
                Direction::ToDevice => c.alloc.write(c.offset, c.host, c.len),
            }
        };
        moved.map_err(|Freed| {
            Error::System(format!(
                "{}: {what} failed: {} was freed before the copy ran \
                 (CUDA_ERROR_ILLEGAL_ADDRESS); the stream is failed (sticky)",
                self.name,
                c.alloc.describe()
            ))
        })
    }

    fn copy_on_device(&self, c: DeviceCopyOp) -> Result<()> {
        // Through the host: the emulated device's memory is host memory mapped elsewhere.
        let mut bytes = vec![0u8; c.len];
        // SAFETY: both ranges were checked to lie inside their allocations at enqueue;
        // `bytes` holds `len` bytes.
        let moved = unsafe {
            c.src
                .read(c.src_offset, bytes.as_mut_ptr(), c.len)
                .and_then(|()| c.dst.write(c.dst_offset, bytes.as_ptr(), c.len))
        };
        moved.map_err(|Freed| {
            Error::System(format!(
                "{}: device-to-device copy of {} bytes failed: {} or {} was freed before the \
                 copy ran (CUDA_ERROR_ILLEGAL_ADDRESS); the stream is failed (sticky)",
                self.name,
                c.len,
                c.src.describe(),
                c.dst.describe()
            ))
        })
    }

    /// Runs a kernel on this worker thread, its device memory held mapped meanwhile.
    fn launch(&self, mut l: LaunchOp) -> Result<()> {
        let what = format!(
            "{}: kernel {} (grid {}, block {})",
            self.name,
            l.func.name(),
            l.grid,
            l.block
        );
        // Each allocation once (a second read lock of one could wait behind a free), in a
        // fixed order (two launches cannot wait for each other).
        let mut allocs: Vec<&Arc<Allocation>> = l.device.iter().map(|(_, a, _)| a).collect();
        allocs.sort_by_key(|a| a.id);
        allocs.dedup_by_key(|a| a.id);
        let mut views = Vec::with_capacity(allocs.len());
        for a in allocs {
            let view = a.host_view().map_err(|Freed| {
                Error::System(format!(
                    "{what} failed: {} was freed before the launch ran \
                     (CUDA_ERROR_ILLEGAL_ADDRESS); the stream is failed (sticky)",
                    a.describe()
                ))
            })?;
            views.push((a.id, view));
        }
        for (i, alloc, offset) in &l.device {
            let base = views
                .iter()
                .find(|(id, _)| *id == alloc.id)
                .map_or(std::ptr::null_mut(), |(_, v)| v.base());
            l.args.set_ptr(*i, base as u64 + *offset as u64);
        }
        let mut params = l.args.params();
        let mut message = [0 as std::ffi::c_char; 1024];
        // SAFETY: the entry is the kernel's packed launcher; `params` points at one slot per
        // parameter, of the types the signature check at enqueue confirmed; device pointers
        // are host aliases of allocations held mapped by `views` until after the call; other
        // pointers are pinned memory the caller keeps valid; `message` has its length.
        let failed = unsafe {
            (l.func.entry)(
                l.grid,
                l.block,
                params.as_mut_ptr(),
                message.as_mut_ptr(),
                message.len(),
            )
        };
        drop(views);
        if failed == 0 {
            return Ok(());
        }
        // SAFETY: the entry wrote a NUL-terminated message into `message` (snprintf).
        let why = unsafe { std::ffi::CStr::from_ptr(message.as_ptr()) }.to_string_lossy();
        Err(Error::System(format!(
            "{what} failed: {why}; the stream is failed (sticky)"
        )))
    }

    /// Sleeps `delay`, or less if the stream is abandoned.
    fn pause(&self, delay: Duration) {
        let end = Instant::now() + delay;
        while !self.abandon.load(Ordering::Acquire) {
            let now = Instant::now();
            if now >= end {
                break;
            }
            std::thread::sleep((end - now).min(Duration::from_millis(10)));
        }
    }
}

/// `now + timeout`, saturating at a year.
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout).unwrap_or_else(far_future)
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(365 * 86400)
}

/// A stream handed to the caller: created (owned: dropping it drains and joins the worker)
/// or borrowed (dropping it leaves the stream).
pub struct EmuStream {
    pub(super) core: Arc<StreamCore>,
    pub(super) shared: Arc<Shared>,
    pub(super) owned: bool,
}

impl EmuStream {
    /// The checks of `copy_to_host`/`copy_to_device`, then the enqueue.
    fn copy(&self, dir: Direction, device: u64, host: *mut u8, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let name = &self.core.name;
        let ordinal = self.core.ordinal;
        if host.is_null() {
            return Err(Error::invalid(format!(
                "{name}: null host pointer for a {len}-byte copy (CUDA_ERROR_INVALID_VALUE)"
            )));
        }
        if (host as u64).checked_add(len as u64).is_none() {
            return Err(Error::invalid(format!(
                "{name}: host range {host:p}+{len} wraps around the address space"
            )));
        }
        if let Some(a) = self.shared.memory.overlapping(host as u64, len) {
            return Err(Error::invalid(format!(
                "{name}: host range {host:p}+{len} overlaps emulated device memory ({}): a \
                 device pointer used as host memory (CUDA_ERROR_INVALID_VALUE)",
                a.describe()
            )));
        }
        let alloc = self.device_range(device, len)?;
        let fault = self.shared.faults.take(ordinal);
        self.core.enqueue(Op::Copy(CopyOp {
            dir,
            device,
            offset: (device - alloc.addr) as usize,
            alloc,
            host,
            len,
            fault,
        }))?;
        if self.shared.pinned.contains(host as u64) || !self.core.held_at_a_word() {
            return Ok(());
        }
        // CUDA's copy with pageable host memory returns only once its stream ran it (to the
        // host), or ran its earlier work (from the host): behind a word nobody has stored
        // yet it waits for the store, forever if the caller was to store it. Modelled for a
        // stream held at a word only (bounded by PAGEABLE_WAIT).
        let done = EmuEvent {
            state: self.core.record()?,
        };
        done.synchronize(PAGEABLE_WAIT).map_err(|e| match e {
            Error::Timeout(_) => Error::Timeout(format!(
                "{name}: a {len}-byte copy with pageable host memory {host:p}, behind a \
                 wait for a word, returns only once the stream ran it (CUDA's semantics): \
                 still pending after {PAGEABLE_WAIT:?}; copy from page-locked memory"
            )),
            e => e,
        })
    }
}

impl EmuStream {
    /// `word` as an address, for `wait_word` and `write_word` (named `op` in the error):
    /// refused when null or not 4-byte aligned.
    fn word_at(&self, op: &str, word: *const u32) -> Result<usize> {
        if word.is_null() || !(word as usize).is_multiple_of(4) {
            return Err(Error::invalid(format!(
                "{op} on {}: {word:p} is not an aligned 32-bit word",
                self.core.name
            )));
        }
        Ok(word as usize)
    }

    /// The allocation of this stream's device holding `device..device+len` (a copy's range).
    fn device_range(&self, device: u64, len: usize) -> Result<Arc<Allocation>> {
        let name = &self.core.name;
        let ordinal = self.core.ordinal;
        let Some(alloc) = self.shared.memory.find(device) else {
            return Err(Error::invalid(format!(
                "{name}: device address 0x{device:x} (copy of {len} bytes) is not in a live \
                 allocation of emulated device {ordinal} (CUDA_ERROR_INVALID_VALUE)"
            )));
        };
        if alloc.ordinal != ordinal {
            return Err(Error::invalid(format!(
                "{name}: device address 0x{device:x} is in {}, not memory of device {ordinal} \
                 (CUDA_ERROR_INVALID_VALUE)",
                alloc.describe()
            )));
        }
        if !alloc.contains(device, len) {
            return Err(Error::invalid(format!(
                "{name}: device range 0x{device:x}+{len} runs past the end of {} \
                 (CUDA_ERROR_INVALID_VALUE)",
                alloc.describe()
            )));
        }
        Ok(alloc)
    }

    /// The checks of `launch` (function, shape, arguments against the kernel's parameter
    /// types, each pointer's memory), then the enqueue.
    fn launch_checked(&self, f: &dyn Function, grid: u32, block: u32, args: &[Arg]) -> Result<()> {
        let name = &self.core.name;
        let ordinal = self.core.ordinal;
        let Some(func) = f.as_any().downcast_ref::<EmuFunction>() else {
            return Err(Error::invalid(format!(
                "{name}: kernel {} is not a function of the emulated driver",
                f.name()
            )));
        };
        let kernel = format!("kernel {} ({})", func.name(), func.file);
        if func.ordinal() != ordinal {
            return Err(Error::invalid(format!(
                "{name}: {kernel} was loaded for device {}, not this stream's device \
                 (CUDA_ERROR_INVALID_HANDLE)",
                func.ordinal()
            )));
        }
        if grid == 0 || block == 0 || block > 1024 {
            return Err(Error::invalid(format!(
                "{name}: {kernel} launched with {grid} block(s) of {block} thread(s): both \
                 at least 1, at most 1024 threads a block (CUDA_ERROR_INVALID_VALUE)"
            )));
        }
        let want: Vec<char> = func.signature.chars().collect();
        if want.len() != args.len() {
            return Err(Error::invalid(format!(
                "{name}: {kernel} takes {} argument(s), {} given",
                want.len(),
                args.len()
            )));
        }
        let mut device = Vec::new();
        for (i, (arg, &w)) in args.iter().zip(&want).enumerate() {
            if arg.code() != w {
                return Err(Error::invalid(format!(
                    "{name}: {kernel}: argument {i} is {arg:?}, the parameter is {}",
                    type_name(w)
                )));
            }
            let Arg::Ptr(addr) = *arg else { continue };
            let (memory, pinned) = (&self.shared.memory, &self.shared.pinned);
            if addr == 0 {
                continue;
            }
            // A pointer just past the end of an allocation or page-locked range is its own (a
            // piece of 0 elements at the end of a buffer), unless it is inside another: the
            // next mapping may start at that very address.
            let alloc = match memory.find(addr) {
                Some(a) => Some(a),
                None if pinned.contains(addr) => continue,
                None => memory
                    .find(addr - 1)
                    .filter(|a| addr == a.addr + a.len as u64),
            };
            if alloc.is_none() && pinned.ends_at(addr) {
                continue;
            }
            match alloc {
                Some(a) if a.ordinal == ordinal => {
                    let offset = (addr - a.addr) as usize;
                    device.push((i, a, offset));
                }
                Some(a) => {
                    return Err(Error::invalid(format!(
                        "{name}: {kernel}: argument {i} (0x{addr:x}) is in {}, not memory of \
                         device {ordinal} (CUDA_ERROR_ILLEGAL_ADDRESS on a GPU)",
                        a.describe()
                    )))
                }
                None => {
                    return Err(Error::invalid(format!(
                        "{name}: {kernel}: argument {i} (0x{addr:x}) is neither memory of \
                         emulated device {ordinal} nor page-locked memory from alloc_pinned \
                         (CUDA_ERROR_ILLEGAL_ADDRESS on a GPU)"
                    )))
                }
            }
        }
        self.core.enqueue(Op::Launch(LaunchOp {
            func: func.clone(),
            grid,
            block,
            args: ArgBlock::new(args),
            device,
        }))
    }
}

impl Stream for EmuStream {
    fn ordinal(&self) -> usize {
        self.core.ordinal
    }

    fn raw(&self) -> *mut c_void {
        std::ptr::without_provenance_mut(self.core.id as usize)
    }

    unsafe fn copy_to_host(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        self.copy(Direction::ToHost, src, dst, len)
    }

    unsafe fn copy_to_device(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        // The worker only reads through the pointer for this direction.
        self.copy(Direction::ToDevice, dst, src.cast_mut(), len)
    }

    unsafe fn copy_on_device(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        if src.max(dst) - src.min(dst) < len as u64 {
            return Err(Error::invalid(format!(
                "{}: device-to-device copy of {len} bytes from 0x{src:x} to 0x{dst:x}: the \
                 ranges overlap (CUDA_ERROR_INVALID_VALUE)",
                self.core.name
            )));
        }
        let (s, d) = (self.device_range(src, len)?, self.device_range(dst, len)?);
        self.core.enqueue(Op::DeviceCopy(DeviceCopyOp {
            src_offset: (src - s.addr) as usize,
            src: s,
            dst_offset: (dst - d.addr) as usize,
            dst: d,
            len,
        }))
    }

    fn record(&self) -> Result<Box<dyn Event>> {
        let state = self.core.record()?;
        Ok(Box::new(EmuEvent { state }))
    }

    unsafe fn wait_word(&self, word: *const u32, value: u32) -> Result<()> {
        let at = self.word_at("wait_word", word)?;
        self.core.enqueue(Op::WaitWord(at, value))
    }

    unsafe fn write_word(&self, word: *mut u32, value: u32) -> Result<()> {
        let at = self.word_at("write_word", word)?;
        self.core.enqueue(Op::WriteWord(at, value))
    }

    fn wait_event(&self, event: &dyn Event) -> Result<()> {
        let Some(event) = event.as_any().downcast_ref::<EmuEvent>() else {
            return Err(Error::invalid(format!(
                "{}: wait_event was given an event that is not the emulated driver's",
                self.core.name
            )));
        };
        self.core.wait(event.state.clone())
    }

    unsafe fn launch(&self, f: &dyn Function, grid: u32, block: u32, args: &[Arg]) -> Result<()> {
        self.launch_checked(f, grid, block, args)
    }

    fn synchronize(&self, timeout: Duration) -> Result<()> {
        self.core.synchronize(timeout)
    }
}

impl Drop for EmuStream {
    fn drop(&mut self) {
        if self.owned {
            self.shared.forget_stream(self.core.id);
            self.core.close(DROP_DRAIN);
        }
    }
}
