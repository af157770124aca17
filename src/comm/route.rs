//! What an all-reduce call does, resolved once on the Comm when the call is made: compressed
//! (QCCL_COMPRESSION, or an explicit codec), hierarchical or flat with which schedule (by
//! `tuning`, from QCCL_ALGO or the call's algorithm, the bytes, the links and the hosts). The result runs inside the comm's turn, so the same value serves a
//! blocking call (`Comm::all_reduce_raw`), a queued one (`Comm::submit`) and a grouped one.

use super::compress::{Compression, PreparedAllReduce};
use super::hier::{self, Hier};
use super::Comm;
use crate::algo::Algo;
use crate::coll::call::{Coll, CollCall};
use crate::coll::Engine;
use crate::error::{Error, Result};
use crate::tuning::{CallShape, Flat, Resolved, Workload};
use crate::types::{DType, ReduceOp};
use std::sync::Arc;

/// Where an all-reduce goes.
enum Route {
    /// On this comm's engine with this schedule.
    Flat(Flat),
    /// Above the engine, on the hierarchy's sub-comms.
    Hier(Arc<Hier>),
    /// A compressed all-reduce (which makes its own flat/hierarchical choice).
    Compressed(PreparedAllReduce),
}

/// A checked all-reduce of `count` elements, its route resolved; run it on the engine of the
/// comm that prepared it, inside that comm's turn.
pub struct AllReduceCall {
    route: Route,
    count: usize,
    dtype: DType,
    op: ReduceOp,
    rank: usize,
    comm_id: u64,
    /// The comm uses CUDA IPC and the call is dense: it starts with the descriptor exchange
    /// (`cuda_ipc.rs`).
    ipc: bool,
}

impl Comm {
    #[doc(hidden)]
    /// Checks an all-reduce and resolves its route: QCCL_COMPRESSION compresses a float sum or
    /// avg; otherwise hierarchical or flat by `algo` (None: QCCL_ALGO) and the hosts. May split
    /// off the hierarchy's sub-comms (a collective) the first time a call needs them.
    pub fn prepare_all_reduce(
        &self,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        algo: Option<Algo>,
    ) -> Result<AllReduceCall> {
        // Validated by the route taken (dense, or compressed with its codec's rules).
        if let Some(spec) = &self.config.compression {
            if dtype.is_float() && matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
                let c = Compression {
                    algo,
                    ..Compression::new(spec.clone())
                };
                let call = self.prepare_all_reduce_compressed(count, dtype, op, &c)?;
                return Ok(self.call(Route::Compressed(call), count, dtype, op));
            }
        }
        self.prepare_all_reduce_dense(count, dtype, op, algo)
    }

    #[doc(hidden)]
    /// As [`Comm::prepare_all_reduce`], never compressed (QCCL_COMPRESSION does not apply):
    /// for callers that decide compression themselves, like a fusion plan's dense groups.
    pub fn prepare_all_reduce_dense(
        &self,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        algo: Option<Algo>,
    ) -> Result<AllReduceCall> {
        self.check(&CollCall::new(Coll::AllReduce, count, dtype).op(op))?;
        let bytes = count.saturating_mul(dtype.size());
        let route = match self.choose(Workload::AllReduce, bytes, algo)? {
            Resolved::Hier => Route::Hier(self.hierarchy()?),
            Resolved::Flat(f) => Route::Flat(f),
        };
        Ok(self.call(route, count, dtype, op))
    }

    /// The schedule of an all-reduce of `bytes` asked to run `algo` (None: QCCL_ALGO) on this
    /// comm: the one place calls ask `tuning`.
    pub(super) fn choose(
        &self,
        coll: Workload,
        bytes: usize,
        algo: Option<Algo>,
    ) -> Result<Resolved> {
        let request = algo.unwrap_or(self.config.algo);
        self.tuning.choose(&self.call_shape(coll, bytes), request)
    }

    /// `auto`'s flat schedule for a call on this comm as one level of a hierarchy.
    pub(super) fn choose_flat(&self, coll: Workload, bytes: usize) -> Flat {
        self.tuning.flat(&self.call_shape(coll, bytes))
    }

    fn call_shape(&self, coll: Workload, bytes: usize) -> CallShape<'_> {
        CallShape {
            coll,
            bytes,
            ranks: self.size,
            links: self.links,
            hosts: &self.hosts,
        }
    }

    #[doc(hidden)]
    /// A compressed all-reduce prepared with [`Comm::prepare_all_reduce_compressed`], as an
    /// [`AllReduceCall`].
    pub fn compressed_call(&self, call: PreparedAllReduce) -> AllReduceCall {
        let (count, dtype, op) = call.shape();
        self.call(Route::Compressed(call), count, dtype, op)
    }

    fn call(&self, route: Route, count: usize, dtype: DType, op: ReduceOp) -> AllReduceCall {
        AllReduceCall {
            // Compressed calls on device buffers run their codecs on the GPU, never here.
            ipc: self.place.cuda_ipc && !matches!(route, Route::Compressed(_)),
            route,
            count,
            dtype,
            op,
            rank: self.rank,
            comm_id: self.comm_id,
        }
    }
}

impl AllReduceCall {
    /// Runs the call on `e` (the preparing comm's engine, inside its turn): `recv` holds
    /// `count` elements, `send` (out of place) too. Returns the algorithm that ran. On a
    /// comm using CUDA IPC it first tells the others that its buffers are host memory
    /// (`cuda_ipc.rs`).
    pub fn run(&self, e: &mut Engine, send: Option<&[u8]>, recv: &mut [u8]) -> Result<Algo> {
        self.check_lens(send, recv)?;
        if self.exchanges() {
            let host = crate::coll::ipc_vote::Descriptor::host(recv.len());
            crate::coll::ipc_vote::exchange(e, &host)?;
        }
        self.run_agreed(e, send, recv)
    }

    /// True when the call starts with a CUDA IPC descriptor exchange.
    pub(super) fn exchanges(&self) -> bool {
        self.ipc && self.count > 0
    }

    /// The flat schedule the call runs, when it runs one (not hierarchical or compressed).
    pub(super) fn flat(&self) -> Option<Flat> {
        match self.route {
            Route::Flat(f) => Some(f),
            _ => None,
        }
    }

    /// The algorithm the call runs: its flat schedule, or `Hier`; None when compressed (its
    /// report says).
    #[doc(hidden)]
    pub fn algo(&self) -> Option<Algo> {
        match &self.route {
            Route::Flat(f) => Some(f.algo()),
            Route::Hier(_) => Some(Algo::Hier),
            Route::Compressed(_) => None,
        }
    }

    /// The hierarchy the call runs on, when its route is the dense hierarchical one.
    pub(super) fn hier(&self) -> Option<&Arc<Hier>> {
        match &self.route {
            Route::Hier(h) => Some(h),
            _ => None,
        }
    }

    /// (count, dtype, op).
    pub(super) fn shape(&self) -> (usize, DType, ReduceOp) {
        (self.count, self.dtype, self.op)
    }

    fn check_lens(&self, send: Option<&[u8]>, recv: &[u8]) -> Result<()> {
        let bytes = self.count * self.dtype.size();
        if recv.len() != bytes || send.is_some_and(|s| s.len() != bytes) {
            return Err(Error::invalid(format!(
                "all_reduce: buffers of {} and {:?} bytes for a call prepared for {} elements of {}",
                recv.len(),
                send.map(<[u8]>::len),
                self.count,
                self.dtype
            )));
        }
        Ok(())
    }

    /// As `run`, after the CUDA IPC agreement (if any) was made.
    pub(super) fn run_agreed(
        &self,
        e: &mut Engine,
        send: Option<&[u8]>,
        recv: &mut [u8],
    ) -> Result<Algo> {
        self.check_lens(send, recv)?;
        // One line per call at TRACE: which route each all-reduce took (tests read it).
        crate::qlog!(
            Trace,
            "rank {}: comm {:#018x}: all_reduce(count={}, {}, {}): {}",
            self.rank,
            self.comm_id,
            self.count,
            self.dtype,
            self.op,
            self.describe()
        );
        let (count, dtype, op) = (self.count, self.dtype, self.op);
        match &self.route {
            Route::Flat(f) => e
                .all_reduce(send, recv, count, dtype, op, *f)
                .map(|()| f.algo()),
            Route::Hier(h) => {
                hier::all_reduce(h, send, recv, count, dtype, op).map(|()| Algo::Hier)
            }
            Route::Compressed(c) => c.run(e, send, recv).map(|r| r.algo),
        }
    }

    /// The route, for logs: "flat", "hierarchical", "compressed" or "compressed hierarchical".
    pub fn describe(&self) -> &'static str {
        match &self.route {
            Route::Flat(_) => "flat",
            Route::Hier(_) => "hierarchical",
            Route::Compressed(c) if c.is_hier() => "compressed hierarchical",
            Route::Compressed(_) => "compressed",
        }
    }

    /// The compressed call inside, if the route is compressed; the call itself otherwise.
    #[doc(hidden)]
    // Boxed as callers keep it (the C ABI's operations), and handed back so when dense.
    #[allow(clippy::boxed_local)]
    pub fn into_compressed(
        self: Box<Self>,
    ) -> std::result::Result<PreparedAllReduce, Box<AllReduceCall>> {
        let call = *self;
        match call.route {
            Route::Compressed(c) => Ok(c),
            route => Err(Box::new(AllReduceCall { route, ..call })),
        }
    }

    /// Number of elements the call was prepared for.
    pub fn count(&self) -> usize {
        self.count
    }

    /// How many compressed calls `run` makes (what a call queued on a stream declares:
    /// `Comm::on_stream`): one on the compressed route, none on a dense one.
    #[doc(hidden)]
    pub fn coded_calls(&self) -> u64 {
        u64::from(matches!(self.route, Route::Compressed(_)))
    }
}
