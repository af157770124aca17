//! Compressed all-reduce on device buffers with the codecs on the GPU (`gpu::sra`): which
//! calls take that path (the rest are staged, `device.rs`; the choice is made in one place,
//! `device_all_reduce.rs`), and how they are ordered on the caller's stream (`Staging::run`
//! with no buffer to copy: the call returns once done) or in the comm's queue.

use super::gpu_hier::GpuHier;
use super::{Comm, PreparedAllReduce, Report};
use crate::coll::Engine;
use crate::error::Result;
use crate::gpu::driver::Driver;
use crate::gpu::sra::{DeviceStats, GpuAllReduce};
use crate::gpu::staging::{self, Placement};
use crossbeam_channel::{SendError, Sender};
use std::ffi::c_void;
use std::sync::Arc;

/// A compressed all-reduce with its codecs on the GPU: flat, or on the hierarchy.
pub(super) enum OnGpu {
    Flat(Arc<GpuAllReduce>),
    Hier(Arc<GpuHier>),
}

impl OnGpu {
    fn whole(&self) -> &GpuAllReduce {
        match self {
            OnGpu::Flat(g) => g,
            OnGpu::Hier(h) => h.whole(),
        }
    }

    fn driver(&self) -> Arc<dyn Driver> {
        self.whole().driver()
    }

    fn ordinal(&self) -> usize {
        self.whole().ordinal()
    }

    /// Runs the call on `e` in its comm's turn; returns once the result is on the device.
    fn run(&self, e: &mut Engine) -> Result<Report> {
        match self {
            OnGpu::Flat(g) => g.run(e),
            OnGpu::Hier(h) => h.run(e),
        }
    }
}

impl Comm {
    /// The GPU path of compressed all-reduce `call` on `send` (None: in place) and `recv`, if
    /// it has one: a flat SRA, all-gather scheme (the one sparse codecs take), ring or tree
    /// on a float type, or the hierarchical schedule on float32 (`gpu_hier.rs`), more than
    /// 0 elements, every buffer aligned to its element in device memory of the comm's
    /// device, a launch plan for each of its codecs. None: stage the call as any other.
    /// Buffers on another device than the comm's are an error, as for staged calls.
    /// `waits`: the call returns once done (a null stream, a queued call); made on a
    /// stream, the hierarchical path is taken on float32 only (`gpu_hier_stream.rs`).
    pub(super) fn gpu_compressed_all_reduce(
        &self,
        call: &PreparedAllReduce,
        send: Option<u64>,
        recv: u64,
        waits: bool,
    ) -> Result<Option<OnGpu>> {
        let Ok(driver) = crate::gpu::select::driver() else {
            return Ok(None);
        };
        let Some(shape) = call.on_device() else {
            if let Some(h) = self.gpu_hier_all_reduce(&driver, call, (send, recv), waits)? {
                return Ok(Some(OnGpu::Hier(Arc::new(h))));
            }
            self.tell_staged(&*driver, call, send, recv);
            return Ok(None);
        };
        let es = shape.5.size();
        let len = shape.3 * es;
        if len == 0 {
            return Ok(None);
        }
        let Some(ordinal) = self.coded_device(&*driver, (send, recv), len, es)? else {
            return Ok(None);
        };
        match GpuAllReduce::new(driver, ordinal, shape, (send, recv), self.coded_shape()) {
            Ok(g) => Ok(Some(OnGpu::Flat(Arc::new(g)))),
            Err(e) => {
                crate::qlog!(
                    Info,
                    "rank {}: compressed all-reduce on device buffers staged, the CPU codecs \
                     encode: {e}",
                    self.rank
                );
                Ok(None)
            }
        }
    }

    /// The device of a compressed call's buffers `send` (None: in place) and `recv`, `len`
    /// bytes each, when they all are device memory aligned to their `es`-byte element
    /// (None otherwise); an error when it is not the comm's device.
    pub(super) fn coded_device(
        &self,
        driver: &dyn Driver,
        (send, recv): (Option<u64>, u64),
        len: usize,
        es: usize,
    ) -> Result<Option<usize>> {
        let bufs = super::device::send_recv(send.map(|s| (s, len)), (recv, len));
        let place = staging::locate(driver, &bufs)?;
        let ordinal = match place.ordinal()? {
            Some(o) if place.device.iter().all(Option::is_some) => o,
            _ => return Ok(None),
        };
        if bufs.iter().any(|b| b.addr % es as u64 != 0) {
            return Ok(None);
        }
        self.check_device(ordinal)?;
        Ok(Some(ordinal))
    }

    /// The comm as the GPU codecs' schedules see it: (ranks, rank, slice bytes, timeout).
    pub(super) fn coded_shape(&self) -> crate::gpu::sra::CommShape {
        (
            self.size,
            self.rank,
            self.config.slice_bytes(),
            self.config.timeout,
        )
    }

    /// Says once per comm (INFO) that a compressed all-reduce on device buffers is staged,
    /// the CPU codecs encoding, because its route has no GPU path: a multi-host job's
    /// hierarchical default on another type than float32 would otherwise be slow without
    /// a word.
    fn tell_staged(
        &self,
        driver: &dyn crate::gpu::driver::Driver,
        call: &PreparedAllReduce,
        send: Option<u64>,
        recv: u64,
    ) {
        let len = call.bytes();
        if len == 0 || !self.gpu_lane.staged_untold() {
            return;
        }
        let bufs = super::device::send_recv(send.map(|s| (s, len)), (recv, len));
        let on_device = staging::locate(driver, &bufs)
            .and_then(|p| p.ordinal())
            .is_ok_and(|o| o.is_some());
        if on_device && self.gpu_lane.first_staged() {
            crate::qlog!(
                Info,
                "rank {}: compressed all-reduce on device buffers with the {} route: staged \
                 through page-locked memory, the CPU codecs encode (the codecs run on the GPU \
                 in the flat schedules, and in the hierarchical one with dense intra-host \
                 levels and the host's ranks on shared memory, on float32 when on a \
                 stream); said once per comm",
                self.rank,
                call.algo().name()
            );
        }
    }

    /// Runs `g` ordered on the caller's `stream` (after its earlier work). On a stream it
    /// returns None once the call is enqueued, as NCCL's: every kernel and copy of the call
    /// is enqueued now on the comm's stream behind an event of the caller's, and the
    /// caller's stream waits for the call's last kernel; the comm's worker moves the bytes
    /// in its turn, enqueueing nothing (`gpu::sra`); an earlier queued operation that did
    /// not declare how many compressed calls it runs is waited for first
    /// (`Queue::submit_declared`: the call's step is known only once it ended). With null, after that wait timed out, or with another
    /// rank of the comm in this process (see `on_stream`), it returns once the result is on
    /// the device: its report with null.
    ///
    /// # Safety
    /// `g`'s buffers must stay valid until the stream passed the call (until this returns
    /// with null), and `stream` be null or a live stream of their device.
    pub(super) unsafe fn run_gpu_all_reduce(
        &self,
        g: OnGpu,
        stream: *mut c_void,
    ) -> Result<Option<Report>> {
        if !stream.is_null() && !self.place.process_peers {
            // SAFETY (both): the caller's promise, passed on.
            let started = match &g {
                OnGpu::Flat(f) => unsafe { self.start_gpu_all_reduce(f, stream) }?,
                OnGpu::Hier(h) => unsafe { self.start_gpu_hier(h, stream) }?,
            };
            if started {
                return Ok(None);
            }
        }
        let device = (g.driver(), g.ordinal());
        // SAFETY: the caller's promise about the stream.
        let report = unsafe { self.in_turn_after(device, stream, |e| g.run(e)) }?;
        Ok(stream.is_null().then_some(report))
    }

    /// Runs `f` in this comm's turn, undeclared, once the work on the caller's `stream`
    /// (null: the legacy default stream) so far is done; returns what `f` returned. For the
    /// GPU paths that return once done (they stage nothing).
    ///
    /// # Safety
    /// `stream` must be null or a live stream of `driver`'s device `ordinal`.
    pub(super) unsafe fn in_turn_after<R>(
        &self,
        (driver, ordinal): (Arc<dyn Driver>, usize),
        stream: *mut c_void,
        f: impl FnOnce(&mut Engine) -> Result<R>,
    ) -> Result<R> {
        let nothing = Placement { device: Vec::new() };
        let mut guard = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let st = self.staging_on(&mut guard, driver, ordinal)?;
        // SAFETY: nothing is staged; the caller's promise about the stream.
        unsafe { st.run(&[], &nothing, stream, |_| self.execute(f)) }
    }

    /// Enqueues `g` on the caller's `stream` and queues the moving of its bytes; false
    /// (nothing done) when its step could not be known within the comm's timeout. An error after the call took its turn
    /// fails the comm: its peers expect this rank in it.
    ///
    /// # Safety
    /// As `run_gpu_all_reduce`, `stream` not null.
    unsafe fn start_gpu_all_reduce(
        &self,
        g: &Arc<GpuAllReduce>,
        stream: *mut c_void,
    ) -> Result<bool> {
        self.check_device(g.ordinal())?;
        self.refuse_if_failed()?;
        // SAFETY: the caller's promise about the stream.
        let caller = unsafe { g.driver().borrow_stream(g.ordinal(), stream)? };
        let mover = g.clone();
        let Some((step, tx)) = self
            .queue
            .submit_declared(self.config.timeout, move |e, step, script| {
                mover.finish(e, step, script)
            })?
        else {
            return Ok(false);
        };
        // The worker takes the script before the call's work is enqueued and moves each
        // exchange's bytes as it is posted (`gpu::sra`): a stream holds only so many pending
        // operations, so it must not wait for the whole call. A send fails only when the comm
        // failed meanwhile (its job dropped): the script comes back, nothing is enqueued.
        self.enqueue_handing(&tx, |hand| g.enqueue(&self.gpu_lane, step, &*caller, hand))
    }

    /// Runs `enqueue`, a call's enqueueing on the caller's thread, which gives the worker
    /// what it needs through `hand` (once; `hand` gives it back when the worker will not
    /// take it: the comm failed), and counts the call enqueued: true. An error before
    /// anything was handed is sent to the worker instead, which fails the call at once.
    pub(super) fn enqueue_handing<H>(
        &self,
        tx: &Sender<Result<H>>,
        enqueue: impl FnOnce(&dyn Fn(H) -> std::result::Result<(), H>) -> Result<()>,
    ) -> Result<bool> {
        let handed = std::cell::Cell::new(false);
        let hand = |h: H| {
            handed.set(true);
            match tx.send(Ok(h)) {
                Ok(()) => Ok(()),
                Err(SendError(Ok(h))) => Err(h),
                Err(SendError(Err(_))) => Ok(()),
            }
        };
        match enqueue(&hand) {
            Ok(()) => {
                self.gpu_lane.count_enqueued();
                Ok(true)
            }
            Err(e) => {
                if !handed.get() {
                    let _ = tx.send(Err(e.clone()));
                }
                Err(e)
            }
        }
    }

    /// Queues `g` behind the comm's earlier operations and returns at once (the C ABI's
    /// non-blocking calls): in the comm's turn it waits for the work on the legacy default
    /// stream, as a staged queued call does (`submit_on_buffers`), and the request ends once
    /// the result is on the device.
    ///
    /// # Safety
    /// `g`'s buffers must stay valid until the request has ended.
    pub(super) unsafe fn submit_gpu_all_reduce(&self, g: OnGpu) -> Result<crate::Request<()>> {
        let nothing = Placement { device: Vec::new() };
        let (driver, ordinal) = (g.driver(), g.ordinal());
        // One compressed call, with the codecs on the GPU. A hierarchical one leaves the
        // device side between its steps: undeclared, so that a compressed call made on a
        // stream meanwhile waits for it to end before it enqueues (its progress waits would
        // otherwise land on the device side's stream ahead of this call's next kernels,
        // which the worker waits for: `Queue::submit_declared`).
        let coded = match g {
            OnGpu::Flat(_) => Some(1),
            OnGpu::Hier(_) => None,
        };
        // SAFETY: no buffer is staged; the caller's promise covers `g`'s.
        unsafe {
            self.submit_staged(driver, ordinal, Vec::new(), nothing, coded, move |e, _| {
                g.run(e).map(drop)
            })
        }
    }

    /// What compressed all-reduces with the codecs on the GPU did on this comm so far.
    #[doc(hidden)]
    pub fn device_stats(&self) -> Result<DeviceStats> {
        self.queue.run(|e| Ok(e.gpu.stats()))
    }
}
