//! Dense calls on device buffers of a comm whose ranks all share one host: through the
//! shared-memory arena with the GPU copying straight into and out of its page-locked
//! segments, the copies overlapping the rounds (`gpu::arena`), whenever the host path would
//! run the call in the arena's rounds (an SRA all-reduce too large for one shot, any
//! reduce-scatter or all-gather); staged through page-locked buffers otherwise.
//!
//! No agreement is needed: the arena's bytes are the same whether a rank's buffers are host
//! or device memory, so each rank picks its side alone. Only calls that return once done
//! come here (a null stream, queued calls, the CUDA IPC entries' fallback): a call on a
//! caller's stream stays staged, returning once enqueued (`Comm::on_stream`).

use super::dense_call::{DenseCall, OnDevice};
use crate::algo::arena::{one_shot_fits, Shape};
use crate::algo::Algo;
use crate::coll::call::Coll;
use crate::coll::Engine;
use crate::error::Result;
use crate::gpu::arena::{ArenaLane, DeviceIo};
use crate::gpu::staging::Staging;
use crate::transport::frame::CollKind;
use crate::tuning::Flat;
use crate::types::ReduceOp;
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
        let n = e.size;
        // The descriptor and elements as the host path makes them (`Engine::all_reduce`,
        // `reduce_scatter`, `all_gather`).
        let (shape, mut ctx, count) = match call {
            DenseCall::AllReduce(c) => {
                let (count, dtype, op) = c.shape();
                if count == 0 || c.flat() != Some(Flat::Sra) {
                    return Ok(false);
                }
                let algo = Flat::Sra.algo() as u8;
                let ctx = e.ctx(CollKind::AllReduce, count, dtype, op, 0, algo);
                let Some(arena) = ctx.t.arena()? else {
                    return Ok(false);
                };
                if one_shot_fits(arena, count * dtype.size()) {
                    return Ok(false);
                }
                (Shape::AllReduce, ctx, count)
            }
            DenseCall::Coll(c) if c.count > 0 && c.coll == Coll::ReduceScatter => {
                let ctx = e.ctx(CollKind::ReduceScatter, c.count, c.dtype, c.op, 0, 0);
                (Shape::ReduceScatter, ctx, c.count * n)
            }
            DenseCall::Coll(c) if c.count > 0 && c.coll == Coll::AllGather => {
                let ctx = e.ctx(CollKind::AllGather, c.count, c.dtype, ReduceOp::Sum, 0, 0);
                (Shape::AllGather, ctx, c.count * n)
            }
            DenseCall::Coll(_) => return Ok(false),
        };
        if ctx.t.arena()?.is_none() {
            return Ok(false);
        }
        let mut slot = self.lane.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(ArenaLane::new(on.driver.clone(), on.ordinal, self.timeout)?);
        }
        let lane = slot.as_mut().expect("made above");
        crate::qlog!(
            Trace,
            "rank {}: comm {:#018x}: {} of {count} elements on device {}: through the \
             shared-memory arena",
            self.rank,
            self.comm_id,
            call.name(),
            lane.ordinal()
        );
        let io = DeviceIo {
            src: on.src,
            out: on.recv,
            in_place: on.in_place,
            stream: on.stream as *mut c_void,
        };
        // SAFETY: the caller's promise: device memory of the comm's device (`on` was placed
        // so), valid until this returns.
        let ran = unsafe { lane.run(&mut ctx, shape, &io, count) };
        if ran.is_err() {
            // A failed copy is sticky: the next call makes new streams.
            *slot = None;
        }
        ran?;
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }
}
