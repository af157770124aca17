//! Dense calls on device buffers of a comm whose ranks all share one host: through the
//! shared-memory arena with the GPU copying straight into and out of its page-locked
//! segments, the copies overlapping the rounds (`gpu::arena`), whenever the host path would
//! run the call in the arena's rounds (an SRA all-reduce too large for one shot, any
//! reduce-scatter or all-gather); staged through page-locked buffers otherwise.
//!
//! No agreement is needed: the arena's bytes are the same whether a rank's buffers are host
//! or device memory, so each rank picks its side alone. Calls that return once done (a null
//! stream, queued calls, the CUDA IPC entries' fallback) run with the GPU copying into and
//! out of the segments (`ArenaTurn`); calls on a caller's stream, which return once
//! enqueued, are staged in bands whose copies are all enqueued up front
//! (`Comm::enqueue_all_reduce_dense_at`, `gpu::arena::run_banded`).

use super::dense_call::{DenseCall, OnDevice};
use super::route::AllReduceCall;
use super::Comm;
use crate::algo::arena::{one_shot_fits, Shape};
use crate::algo::Algo;
use crate::coll::call::{Coll, CollCall};
use crate::coll::Engine;
use crate::error::{Error, Result};
use crate::gpu::arena::{bands, run_banded, ArenaLane, DeviceIo};
use crate::gpu::driver::Driver;
use crate::gpu::staging::Staging;
use crate::transport::frame::CollKind;
use crate::transport::shm::arena::chunk_for;
use crate::tuning::Flat;
use crate::types::{DType, ReduceOp};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What a dense call through the arena needs of its comm in the comm's turn (queued calls
/// take it to the worker).
pub(super) struct ArenaTurn {
    pub(super) lane: Arc<Mutex<Option<ArenaLane>>>,
    pub(super) calls: Arc<AtomicU64>,
    pub(super) rank: usize,
    pub(super) timeout: Duration,
    pub(super) comm_id: u64,
    /// QCCL_SHM_ARENA_CHUNK, for the arena's rounds.
    pub(super) arena_chunk: Option<usize>,
}

impl ArenaTurn {
    /// Runs `call` on the device buffers `on` in the comm's turn (on `e`), agreed already
    /// where the comm agrees on CUDA IPC: through the arena when the host path would take
    /// its rounds, else staged through `st`. An all-reduce's algorithm.
    ///
    /// # Safety
    /// `on`'s buffers must be valid for the call until this returns, and its stream null or
    /// a live stream of their device.
    pub(super) unsafe fn run(
        &self,
        e: &mut Engine,
        st: &mut Staging,
        call: DenseCall<'_>,
        on: &OnDevice,
    ) -> Result<Option<Algo>> {
        // SAFETY: the caller's promise, passed on.
        if unsafe { self.through_arena(e, call, on)? } {
            return Ok(match call {
                DenseCall::AllReduce(_) => Some(Flat::Sra.algo()),
                DenseCall::Coll(_) => None,
            });
        }
        // SAFETY: the caller's promise, passed on.
        unsafe {
            st.run(&on.bufs, &on.place, on.stream as *mut c_void, |h| {
                call.run_hosts(e, &on.bufs, h, false)
            })
        }
    }

    /// True when `call` ran through the arena; false (nothing moved) when the host path
    /// would not take the arena's rounds for it.
    ///
    /// # Safety
    /// As `run`.
    unsafe fn through_arena(
        &self,
        e: &mut Engine,
        call: DenseCall<'_>,
        on: &OnDevice,
    ) -> Result<bool> {
        let chunk = chunk_for(self.arena_chunk, e.size);
        let Some(ac) = ArenaCall::of(call, e.size, chunk) else {
            return Ok(false);
        };
        let mut ctx = ac.ctx(e);
        if ctx.t.arena()?.is_none() {
            return Ok(false);
        }
        let io = DeviceIo {
            src: on.src,
            out: on.recv,
            in_place: on.in_place,
            stream: on.stream as *mut c_void,
        };
        let device = (&on.driver, on.ordinal);
        // SAFETY: the caller's promise: device memory of the comm's device (`on` was placed
        // so), valid until this returns.
        unsafe { self.on_lane(&mut ctx, device, (ac.shape, call.name()), &io, ac.count) }
    }

    /// Runs a level of a hierarchical call on device buffers `io` of `device` in the comm's
    /// turn (on `e`), as the host path's `Engine::reduce_scatter_parts` and
    /// `all_gather_parts` do (the same descriptor, f32 sums, the parts `part` cuts): a
    /// reduce-scatter or all-gather `shape` of `count` elements through the arena. False
    /// (nothing moved) when the comm has no arena.
    ///
    /// # Safety
    /// `io`'s buffers must be device memory of `device`, valid for the call until this
    /// returns, its stream null or a live stream of the device.
    pub(super) unsafe fn run_parts(
        &self,
        e: &mut Engine,
        device: (&Arc<dyn Driver>, usize),
        shape: Shape,
        io: &DeviceIo,
        count: usize,
    ) -> Result<bool> {
        let (kind, name) = match shape {
            Shape::ReduceScatter => (CollKind::ReduceScatter, "reduce_scatter"),
            Shape::AllGather => (CollKind::AllGather, "all_gather"),
            Shape::AllReduce => {
                return Err(Error::Internal(
                    "a hierarchical level through the arena is a reduce-scatter or an \
                     all-gather"
                        .into(),
                ))
            }
        };
        let hier = Algo::Hier as u8;
        let mut ctx = e.ctx(kind, count, DType::Float32, ReduceOp::Sum, 0, hier);
        if ctx.t.arena()?.is_none() {
            return Ok(false);
        }
        // SAFETY: the caller's promise, passed on.
        unsafe { self.on_lane(&mut ctx, device, (shape, name), io, count) }
    }

    /// Runs `shape` (`name` for the log) on `count` elements of `io` through the arena on
    /// `ctx`, on the comm's lane (made on first use on `device`). False when it has no arena.
    ///
    /// # Safety
    /// As `run_parts`.
    unsafe fn on_lane(
        &self,
        ctx: &mut crate::algo::Ctx<'_>,
        (driver, ordinal): (&Arc<dyn Driver>, usize),
        (shape, name): (Shape, &str),
        io: &DeviceIo,
        count: usize,
    ) -> Result<bool> {
        let mut slot = self.lane.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(ArenaLane::new(driver.clone(), ordinal, self.timeout)?);
        }
        let lane = slot.as_mut().expect("made above");
        crate::qlog!(
            Trace,
            "rank {}: comm {:#018x}: {name} of {count} elements on device {}: through the \
             shared-memory arena",
            self.rank,
            self.comm_id,
            lane.ordinal()
        );
        // SAFETY: the caller's promise, passed on.
        let ran = unsafe { lane.run(ctx, shape, io, count) };
        if ran.is_err() {
            // A failed copy is sticky: the next call makes new streams.
            *slot = None;
        }
        if !ran? {
            return Ok(false);
        }
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }
}

/// A dense call as the host path runs it through the arena: its rounds' shape and
/// elements, and the descriptor its `Engine` method makes (`Engine::all_reduce`,
/// `reduce_scatter`, `all_gather`).
#[derive(Debug, Clone, Copy)]
pub(super) struct ArenaCall {
    pub(super) shape: Shape,
    /// Elements the rounds cover (an all-gather's and reduce-scatter's whole buffer).
    pub(super) count: usize,
    kind: CollKind,
    /// The descriptor's count (a reduce-scatter's and all-gather's per rank).
    desc_count: usize,
    pub(super) dtype: DType,
    op: ReduceOp,
    algo: u8,
}

impl ArenaCall {
    /// `call` on `n` ranks whose arena has `chunk`-byte areas, when the host path runs it in
    /// the arena's rounds: an SRA all-reduce too large for one shot, any reduce-scatter or
    /// all-gather (of at least one element per rank); None otherwise.
    pub(super) fn of(call: DenseCall<'_>, n: usize, chunk: usize) -> Option<ArenaCall> {
        if n < 2 {
            return None;
        }
        match call {
            DenseCall::AllReduce(c) => {
                let (count, dtype, op) = c.shape();
                let sra = count > 0 && c.flat() == Some(Flat::Sra);
                (sra && !one_shot_fits(n, chunk, count * dtype.size())).then_some(ArenaCall {
                    shape: Shape::AllReduce,
                    count,
                    kind: CollKind::AllReduce,
                    desc_count: count,
                    dtype,
                    op,
                    algo: Flat::Sra.algo() as u8,
                })
            }
            DenseCall::Coll(c) if c.count > 0 => {
                let (shape, kind, op) = match c.coll {
                    Coll::ReduceScatter => (Shape::ReduceScatter, CollKind::ReduceScatter, c.op),
                    Coll::AllGather => (Shape::AllGather, CollKind::AllGather, ReduceOp::Sum),
                    _ => return None,
                };
                Some(ArenaCall {
                    shape,
                    count: c.count * n,
                    kind,
                    desc_count: c.count,
                    dtype: c.dtype,
                    op,
                    algo: 0,
                })
            }
            DenseCall::Coll(_) => None,
        }
    }

    /// The engine's context for it, with the host path's descriptor.
    pub(super) fn ctx<'e>(&self, e: &'e mut Engine) -> crate::algo::Ctx<'e> {
        e.ctx(
            self.kind,
            self.desc_count,
            self.dtype,
            self.op,
            0,
            self.algo,
        )
    }
}

impl Comm {
    /// The dense all-reduce `call` on device buffers `send` (None: in place) and `recv`,
    /// enqueued on the caller's `stream` (not null) and returning at once, NCCL's
    /// semantics, pipelined through the shared-memory arena: the copies of one band of
    /// rounds overlap the collective of another (`Staging::start_banded`,
    /// `gpu::arena::run_banded`). False (nothing done) when that does not apply: a null
    /// stream, a comm using CUDA IPC, ranks not all on one host, another rank in this
    /// process, a buffer not on the device, or a call the host path does not run in the
    /// arena's rounds; the caller then makes the call as any other.
    ///
    /// # Safety
    /// `send` and `recv` must not overlap and must be valid for the call's bytes until the
    /// stream passes the call; `stream` a live stream of their device.
    #[doc(hidden)]
    pub unsafe fn enqueue_all_reduce_dense_at(
        &self,
        call: &AllReduceCall,
        send: Option<u64>,
        recv: u64,
        stream: *mut c_void,
    ) -> Result<bool> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.enqueue_dense(DenseCall::AllReduce(call), send, recv, stream) }
    }

    /// As [`Comm::enqueue_all_reduce_dense_at`] for a reduce-scatter or all-gather `call`
    /// (checked here; NCCL's layouts, `send` None in place), or a broadcast or reduce, which
    /// is enqueued in bands of the chain's slices where it takes that path (on any links:
    /// `Comm::rooted_in_bands_at` says when).
    ///
    /// # Safety
    /// As [`Comm::enqueue_all_reduce_dense_at`], with the call's buffer sizes.
    #[doc(hidden)]
    pub unsafe fn enqueue_coll_dense_at(
        &self,
        call: &CollCall<'static>,
        send: Option<u64>,
        recv: u64,
        stream: *mut c_void,
    ) -> Result<bool> {
        self.check(call)?;
        // SAFETY: the caller's promise, passed on.
        unsafe { self.enqueue_dense(DenseCall::Coll(call), send, recv, stream) }
    }

    unsafe fn enqueue_dense(
        &self,
        call: DenseCall<'_>,
        send: Option<u64>,
        recv: u64,
        stream: *mut c_void,
    ) -> Result<bool> {
        if stream.is_null() || self.place.cuda_ipc || self.place.process_peers {
            return Ok(false);
        }
        // SAFETY: the caller's promise, passed on.
        if unsafe { self.enqueue_in_bands(call, send, recv, stream) }? {
            return Ok(true);
        }
        if self.links != crate::tuning::Links::Arena {
            return Ok(false);
        }
        let n = self.size;
        let chunk = chunk_for(self.config.shm_arena_chunk, n);
        let Some(ac) = ArenaCall::of(call, n, chunk) else {
            return Ok(false);
        };
        let (send_len, recv_len) = call.lens(n, send.is_none());
        let bufs = super::device::send_recv(send.map(|s| (s, send_len)), (recv, recv_len));
        let Some((driver, _, ordinal)) = self.all_on_device(&bufs)? else {
            return Ok(false);
        };
        let io = DeviceIo {
            src: call.src(self.rank, send, recv),
            out: recv,
            in_place: send.is_none(),
            stream,
        };
        let es = ac.dtype.size();
        let (bands, per_band, len) = bands(ac.shape, &io, (n, self.rank, chunk), ac.count, es);
        let (timeout, calls, in_place) =
            (self.config.timeout, self.arena_calls.clone(), io.in_place);
        let device = (driver, ordinal);
        // SAFETY: the caller's promise: device memory of the call's bytes until the stream
        // passes the call, a live stream of their device.
        unsafe {
            self.enqueue_banded(device, (len, &bands), stream, Some(0), move |e, b| {
                let mut ctx = ac.ctx(e);
                let shape = (ac.shape, in_place);
                if !run_banded(&mut ctx, shape, ac.count, b, (per_band, chunk), timeout)? {
                    return Err(Error::Internal(
                        "a call cut in bands for the arena found no arena".into(),
                    ));
                }
                calls.fetch_add(1, Ordering::Relaxed);
                Ok(())
            })
        }?;
        Ok(true)
    }
}
