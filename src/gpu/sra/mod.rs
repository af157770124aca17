//! Compressed all-reduce on device buffers with the codecs on the GPU (issue #22): the CPU's
//! SRA schedule (`algo::compressed::sra::run`), with a `Side` whose data stays in device
//! memory. A slice leaving this rank is encoded by its codec's kernels (error feedback fused)
//! into aligned device scratch and only its payload is copied to page-locked memory, after
//! the 32-byte header a kernel writes there (`qccl_put_header`); a received chunk's header is
//! checked on the host, its payload copied into device scratch and decoded (added) there.
//! Only encoded bytes cross PCIe, and they are the CPU codecs' bytes: host and device ranks
//! of one job end bit-identical.
//!
//! The arithmetic is the CPU's, step for step: the input plus the residual (`qccl_ef_compensate`
//! for this rank's own slice, `encode_ef` for the peers'), own data exact and then the peers'
//! decoded contributions in rank order, the owner's sum encoded once and replaced by its
//! decoded value, Avg's division after the sum (`qccl_finish_avg_f32`).
//!
//! The all-gather scheme (`algo::compressed::gather::run`, the one sparse codecs take: a
//! sum of sparse vectors is not sparse) runs over the same sides: the whole input encoded
//! once (error feedback fused) into this rank's own send slot, one exchange sending it to
//! every peer, then the work zeroed (`qccl_ef_zero`) and every rank's encoding added in
//! rank order, this rank's own from its send slot.
//!
//! The ring and the tree (`algo::compressed::{ring, tree}::run`, asked for with
//! `QCCL_ALGO=ring|tree` or the call's algo) run over the same sides too, as `HopSide`s: the
//! work buffer starts as the input plus the residual (`qccl_ef_compensate` over the whole
//! buffer, as the host's), each hop's partial sum is encoded into the send slot of the rank
//! it goes to, and a forward sends the bytes the previous exchange received from their
//! page-locked receive slot, with no device work. Each rank encodes each element once per
//! call (the tree's root as it sends the total down), so only encoded bytes cross PCIe.
//!
//! A call made on a caller's stream runs the schedule twice. `enqueue` (on the caller's
//! thread, NCCL's enqueue-and-return) runs it over `side.rs`, which enqueues every kernel
//! and copy of the call on the comm's stream: slice j+1's scatter encodes before slice j's
//! exchange, into the other of `sra::SETS` sets of page-locked send and receive slots, and
//! each exchange as a wait for a progress value (`wait_word`) before the copies and decodes
//! of the bytes it receives. The comm's worker runs it over `moves.rs` in the comm's turn,
//! taking each exchange from the call's `Board` as it is posted, while the rest may still be
//! being enqueued (a stream holds only so many pending operations: `script.rs`): each
//! exchange hands a peer's bytes to the progress engine as the event after their encode
//! completes (`sends.rs`), receives into the set whose decodes' event completed, checks the
//! received headers and stores the progress value. The worker enqueues nothing:
//! behind a caller's stream held for the call (CUDA orders all work enqueued after an
//! implicitly synchronising call, such as an application's `cudaMalloc`, behind it) nothing
//! of the call waits for the host but the network. The caller's stream waits for an event
//! after the call's last kernel. A failure stores every progress value the call's stream
//! waits for (`Script`'s drop): the stream runs on to an undefined result, the comm failed.
//! A call that waits for its result (`run`: NULL stream, queued, another rank of the comm
//! in this process) runs both sides in step instead (`moves.rs::Lockstep`), with no progress
//! waits on the stream. `DeviceStats` counts the exchanges that began with encodes still
//! queued.
//!
//! The residual of a tensor key lives in device memory, kept across calls; a key used on host
//! buffers before starts again from zero here (and the reverse).

use super::driver::{Arg, Driver, Stream};
use super::plans::{grid_for, plan_for, CodecPlan, Convert, BLOCK};
use crate::algo::compressed::gather::{self, GatherSide};
use crate::algo::compressed::hop::HopSide;
use crate::algo::compressed::sra::{self, Shape};
use crate::algo::compressed::{chunk, slice};
use crate::algo::compressed::{ring, tree};
use crate::algo::Algo;
use crate::codec::ef::TensorKey;
use crate::codec::layout::CodecMap;
use crate::codec::{Codec, Site};
use crate::coll::compressed::Coded;
use crate::coll::Engine;
use crate::comm::Report;
use crate::error::{Error, Result};
use crate::transport::frame::CollKind;
use crate::types::{DType, ReduceOp};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

mod moves;
mod pieces;
mod script;
mod sends;
mod side;
mod topk;
mod topk_stream;
// Kept by the comm and its engine across calls (its own file, so the engine need not import
// the call).
pub(crate) mod state;

use moves::{Lockstep, MoveSide, Mover};
pub(crate) use pieces::{PieceBoard, StreamPiece};
use script::{Board, Script};
use side::DeviceSide;
pub use state::{DeviceState, DeviceStats};
use state::{GpuLane, Sizes};
pub use topk::DeviceTopK;
pub(crate) use topk_stream::TopKShape;

/// A compressed all-reduce on device buffers, checked and with its kernels loaded.
pub struct GpuAllReduce {
    driver: Arc<dyn Driver>,
    ordinal: usize,
    plan: CodecMap,
    /// Launch plan of each codec of `plan`, by spec.
    plans: HashMap<String, Arc<dyn CodecPlan>>,
    key: Option<TensorKey>,
    op: ReduceOp,
    count: usize,
    send: Option<u64>,
    recv: u64,
    seed: u64,
    /// None for float32; for float16, bfloat16 and float64 the conversion to and from the f32
    /// copy the call runs on (the CPU's `with_f32`).
    convert: Option<Convert>,
    /// The buffers' type (the frames' descriptor names it, as the host's calls do).
    dtype: DType,
    /// SRA, the all-gather scheme (sparse codecs) or the ring.
    scheme: Scheme,
    /// The comm's ranks, this rank and its slice bytes (QCCL_BUFFSIZE).
    n: usize,
    rank: usize,
    slice: usize,
    timeout: Duration,
    /// Plan position of element 0: 0, or where the part lies that a hierarchical call's
    /// inter-host level reduces (`part`).
    base: usize,
    /// Elements of the tensor's residual: `count`, or the whole tensor's for a part.
    res_count: usize,
    /// The rank the random draws are keyed by: this rank, or its rank in the comm a part's
    /// call belongs to (the host's `coded_turn`).
    site_rank: usize,
}

/// The schedules the device runs, as the host's (`algo::compressed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scheme {
    /// Scatter-reduce-allgather (`sra::run`).
    Sra,
    /// The all-gather scheme (`gather::run`), the one sparse codecs take.
    Gather,
    /// The ring (`ring::run`): each hop decodes, adds and re-encodes.
    Ring,
    /// The binary tree (`tree::run`): partial sums up, the root's encoding down.
    Tree,
}

/// A side that can run every scheme of [`Scheme`].
trait SchemeSide<X: ?Sized>: GatherSide<X> + HopSide<X> {}

impl<X: ?Sized, S: GatherSide<X> + HopSide<X>> SchemeSide<X> for S {}

/// The call's shape: (plan, tensor key, op, count, seed, dtype, schedule).
pub(crate) type CallShape<'a> = (
    &'a CodecMap,
    Option<&'a TensorKey>,
    ReduceOp,
    usize,
    u64,
    DType,
    Scheme,
);

/// The f32 buffers a call works on: (input, None in place; result).
type View = (Option<u64>, u64);

/// Where the call runs: (ranks, rank, slice bytes, timeout).
pub(crate) type CommShape = (usize, usize, usize, Duration);

impl GpuAllReduce {
    /// The all-reduce of `count` (> 0) elements of `dtype` (a float type) in
    /// device memory `recv` (in place) or from `send`, both on device `ordinal` and aligned
    /// to their element. `Unsupported` when a codec of the plan has no launch plan, or the
    /// kernels cannot be loaded (the caller then stages the call).
    pub(crate) fn new(
        driver: Arc<dyn Driver>,
        ordinal: usize,
        (plan, key, op, count, seed, dtype, scheme): CallShape<'_>,
        (send, recv): (Option<u64>, u64),
        (n, rank, slice, timeout): CommShape,
    ) -> Result<GpuAllReduce> {
        let mut plans = HashMap::new();
        for c in plan.codecs() {
            if let std::collections::hash_map::Entry::Vacant(v) = plans.entry(c.spec()) {
                v.insert(Arc::from(plan_for(&*driver, ordinal, &**c)?));
            }
        }
        // Loaded now, outside the comm's turn: a first load may build the kernel file.
        DeviceState::functions(&*driver, ordinal)?;
        let convert = Convert::new(&*driver, ordinal, dtype)?;
        Ok(GpuAllReduce {
            driver,
            ordinal,
            plan: plan.clone(),
            plans,
            key: key.cloned(),
            op,
            count,
            send,
            recv,
            seed,
            convert,
            dtype,
            scheme,
            n,
            rank,
            slice,
            timeout,
            base: 0,
            res_count: count,
            site_rank: rank,
        })
    }

    /// The all-reduce (sum) of elements `base..base + count` of this float32 call's plan,
    /// in place in device memory `recv` (`send`: its input, out of place), on a comm of `n`
    /// ranks: a hierarchical call's inter-host level (`comm/hier_device.rs`). Its random
    /// draws and its residual (this call's tensor's, at `base`) are this call's; the frames
    /// name the part, as the host's inter-host level does.
    pub(crate) fn part(
        &self,
        (base, count, scheme): (usize, usize, Scheme),
        (send, recv): (Option<u64>, u64),
        (n, rank, slice, timeout): CommShape,
    ) -> GpuAllReduce {
        GpuAllReduce {
            driver: self.driver.clone(),
            ordinal: self.ordinal,
            plan: self.plan.clone(),
            plans: self.plans.clone(),
            key: self.key.clone(),
            op: ReduceOp::Sum,
            count,
            send,
            recv,
            seed: self.seed,
            convert: None,
            dtype: self.dtype,
            scheme,
            n,
            rank,
            slice,
            timeout,
            base: self.base + base,
            res_count: self.res_count,
            site_rank: self.site_rank,
        }
    }

    /// A hierarchical call's first step on `lane` (the calling comm's), as the host's
    /// `with_f32` and `coded_turn`: the call's f32 work buffer (its receive buffer, or for
    /// another float type the lane's f32 copy of its input) becomes the input plus the
    /// tensor's residual, the residual zeroed; every level then runs in place there.
    /// Returns the work buffer's address once done; it stays the call's until `finish_whole`
    /// (the comm's turn keeps other calls off the lane's copy meanwhile: see
    /// `comm/gpu_hier.rs`).
    pub(crate) fn fold_residual(&self, lane: &GpuLane) -> Result<u64> {
        let mut work = self.recv;
        let input = self.send.unwrap_or(self.recv);
        lane.on_state((&*self.driver, self.ordinal), self.timeout, |st| {
            let key = self.key.as_ref().filter(|_| self.plan.error_feedback());
            let wait = (&*lane.moved, self.timeout);
            let res = st.residual(&*self.driver, key, self.count, lane.take_forgotten(), wait)?;
            let Some(convert) = &self.convert else {
                return st.compensate(input, res, self.recv, self.count);
            };
            let sizes = Sizes {
                slot: 0,
                payload: 0,
                scratch: 0,
                work: 4 * self.count,
            };
            st.reserve(&*self.driver, &sizes, 1, &lane.moved, self.timeout)?;
            work = state::addr(&st.work);
            // SAFETY: converts the call's `count` input elements (valid until the call
            // returns: the caller's promise) into the f32 copy `reserve` sized.
            unsafe { convert.run(&*st.stream, true, input, work, self.count)? };
            st.compensate(work, res, work, self.count)
        })?;
        Ok(work)
    }

    /// A hierarchical call's last step on `lane`, on its f32 `work` buffer: Avg's division
    /// by the calling comm's ranks over the whole result, as the host's `reduce::finish`,
    /// then for another float type the conversion into the receive buffer (`from_f32`).
    /// Returns once done.
    pub(crate) fn finish_whole(&self, lane: &GpuLane, work: u64) -> Result<()> {
        if self.op != ReduceOp::Avg && self.convert.is_none() {
            return Ok(());
        }
        lane.on_state((&*self.driver, self.ordinal), self.timeout, |st| {
            if self.op == ReduceOp::Avg {
                self.divide(st, work)?;
            }
            if let Some(convert) = &self.convert {
                // SAFETY: the f32 copy's `count` values into the call's receive buffer
                // (valid until the call returns: the caller's promise).
                unsafe { convert.run(&*st.stream, false, work, self.recv, self.count)? };
            }
            Ok(())
        })
    }

    /// Enqueues Avg's division of the call's `count` f32s at `work` by its comm's ranks.
    fn divide(&self, st: &mut DeviceState, work: u64) -> Result<()> {
        self.divide_on(&*st.stream, &*st.avg, work)
    }

    /// `divide` on `stream` with `avg` (the lane's `qccl_finish_avg_f32`).
    fn divide_on(
        &self,
        stream: &dyn Stream,
        avg: &dyn super::driver::Function,
        work: u64,
    ) -> Result<()> {
        let count = self.count;
        let args = [
            Arg::Ptr(work),
            Arg::U64(count as u64),
            Arg::U64(self.n as u64),
        ];
        // SAFETY: reduce.cu's qccl_finish_avg_f32(float* x, uint64_t count, uint64_t n)
        // over the call's `count` f32s, valid until the call's `done` event (or until the
        // caller's stream passed it).
        unsafe { stream.launch(avg, grid_for(count.div_ceil(4)), BLOCK, &args) }
    }

    /// The pieces of the call's elements `r`, each one codec's: (elements within the call,
    /// plan position of the first, codec).
    pub(super) fn pieces(
        &self,
        r: Range<usize>,
    ) -> impl Iterator<Item = (Range<usize>, usize, &Arc<dyn Codec>)> {
        let b = self.base;
        self.plan
            .pieces(b + r.start..b + r.end)
            .map(move |(q, c)| (q.start - b..q.end - b, q.start, c))
    }

    /// Bytes of the encoding of the call's elements `r`.
    pub(super) fn encoded_len(&self, r: Range<usize>) -> usize {
        self.plan
            .encoded_len(self.base + r.start..self.base + r.end)
    }

    /// The driver it runs on.
    pub fn driver(&self) -> Arc<dyn Driver> {
        self.driver.clone()
    }

    /// The device it runs on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn plan_of(&self, codec: &dyn Codec) -> Result<&dyn CodecPlan> {
        self.plans
            .get(&codec.spec())
            .map(|p| &**p)
            .ok_or_else(|| Error::Internal(format!("no launch plan loaded for {}", codec.spec())))
    }

    /// Runs the call on `e` (its comm's engine, in its turn), after the caller's earlier work
    /// on the buffers is done; returns once the result is in `recv`. As the host's
    /// `coded_turn`: takes the call's step and the tensor's residual. Each step's device
    /// work is enqueued as the schedule reaches it (`Lockstep`): no progress waits, so
    /// nothing on the stream waits for the host while another rank of this process
    /// allocates memory (after which CUDA orders its work behind everything enqueued
    /// before on the device).
    ///
    /// The buffers must stay valid, and be touched by nothing else, until this returns (the
    /// promise `Comm::run_gpu_all_reduce`'s caller made).
    pub fn run(&self, e: &mut Engine) -> Result<Report> {
        let step = e.coded_calls;
        e.coded_calls += 1;
        self.forget_host_residual(e);
        let lane = e.gpu.clone();
        let w0 = e.wire;
        let stats = self.run_in(e, &lane, step)?;
        lane.count_calls(1, stats);
        Ok(Report::flat(self.algo(), e.wire - w0))
    }

    /// As `run`, as step `step` of the device side `lane` (its comm's, which need not be
    /// `e`'s: a hierarchical call's inter-host level runs on the sub-comm's engine with the
    /// calling comm's lane), counting nothing in `lane`'s stats: what its exchanges did is
    /// returned.
    pub(crate) fn run_in(&self, e: &mut Engine, lane: &GpuLane, step: u64) -> Result<DeviceStats> {
        let mut stats = DeviceStats::default();
        let keep = |script| Ok(Some(script));
        let script = self
            .on_lane(lane, step, None, keep, |st, board, res, site, view| {
                let Some(shape) = self.shape() else {
                    return self.alone(st, res, view);
                };
                let mut ctx = self.exchange_ctx(e);
                let view = self.start(st, res, view)?;
                let dev = DeviceSide::new((st, self), (site, res), view, board, false);
                let mover = Mover::new(self, self.n);
                let mut side = Lockstep { mover, dev };
                let ran = self.schedule(&mut ctx, shape, &mut side);
                lane.add_bytes(side.dev.to_host, side.dev.to_device);
                stats = side.mover.stats;
                ran
            })?
            .ok_or_else(|| Error::Internal("a call in step lost its script".into()))?;
        self.wait_done(script, Ok(stats))
    }

    /// The worker's part of a call whose device work was enqueued when it was made
    /// (`enqueue`, step `step`): moves its bytes in the comm's turn and returns once the
    /// device work is done (the caller's stream waits for it on its own).
    pub(crate) fn finish(&self, e: &mut Engine, step: u64, mut script: Script) -> Result<()> {
        if e.coded_calls != step {
            return Err(Error::Internal(format!(
                "a compressed call enqueued as step {step} runs as step {}",
                e.coded_calls
            )));
        }
        e.coded_calls += 1;
        self.forget_host_residual(e);
        let moved = self.move_bytes(e, &mut script);
        let stats = self.wait_done(script, moved)?;
        e.gpu.count_calls(1, stats);
        Ok(())
    }

    /// Enqueues every kernel and copy of the call as step `step` on the comm's stream (the
    /// caller's thread, when the call is made): behind the work on `caller` (the caller's
    /// stream) so far, each exchange's decodes behind a progress value (`side.rs`), and the
    /// caller's stream then waits for the call's last kernel. What the worker needs to move
    /// the call's bytes (`finish`) goes to `hand` before the first kernel is enqueued, and
    /// each exchange is posted to it as it is enqueued (`script.rs` says why); `hand` gives
    /// the script back when the worker will not take it (the comm failed).
    pub(crate) fn enqueue(
        &self,
        lane: &GpuLane,
        step: u64,
        caller: &dyn Stream,
        hand: impl FnOnce(Script) -> std::result::Result<(), Script>,
    ) -> Result<()> {
        let mut guard = lane.locked((&*self.driver, self.ordinal))?;
        let st = guard.as_mut().expect("made by locked");
        self.enqueue_on(st, lane, step, Some(caller), hand)
    }

    /// `enqueue`'s body on the comm's device state `st` (locked by the caller), behind
    /// `caller`'s work when given (a hierarchical call's parts are ordered on the lane's
    /// stream alone: `pieces.rs`).
    pub(super) fn enqueue_on(
        &self,
        st: &mut DeviceState,
        lane: &GpuLane,
        step: u64,
        caller: Option<&dyn Stream>,
        hand: impl FnOnce(Script) -> std::result::Result<(), Script>,
    ) -> Result<()> {
        let hand = |script| hand(script).map(|()| None);
        self.on_state(
            st,
            lane,
            step,
            caller,
            hand,
            |st, board, res, site, view| {
                let Some(shape) = self.shape() else {
                    return self.alone(st, res, view);
                };
                let view = self.start(st, res, view)?;
                let mut side = DeviceSide::new((st, self), (site, res), view, board, true);
                let ran = self.schedule(&mut (), shape, &mut side);
                lane.add_bytes(side.to_host, side.to_device);
                ran
            },
        )
        .map(drop)
    }

    /// The schedule's name, as the host's calls report it and their frames carry it.
    fn algo(&self) -> Algo {
        match self.scheme {
            Scheme::Sra => Algo::Sra,
            Scheme::Gather => Algo::AllGather,
            Scheme::Ring => Algo::Ring,
            Scheme::Tree => Algo::Tree,
        }
    }

    /// Runs the call's schedule over `side`, its exchanges on `x`.
    fn schedule<X: ?Sized>(
        &self,
        x: &mut X,
        shape: Shape,
        side: &mut impl SchemeSide<X>,
    ) -> Result<()> {
        match self.scheme {
            Scheme::Sra => sra::run(x, shape, side, self.count, true),
            Scheme::Gather => gather::run(x, shape, side, self.count),
            Scheme::Ring => ring::run(x, shape, side, self.count),
            Scheme::Tree => tree::run(x, shape, side, self.count),
        }
    }

    /// The exchanges the schedule makes on `shape`.
    fn exchanges(&self, shape: Shape) -> usize {
        match self.scheme {
            Scheme::Sra => 2 * shape.nsl,
            Scheme::Gather => 1,
            Scheme::Ring => ring::exchanges(shape),
            Scheme::Tree => tree::exchanges(shape),
        }
    }

    /// The f32 buffers the schedule starts from: the ring re-encodes partial sums of the
    /// work buffer, so it starts as the input plus the residual, the residual zeroed (the
    /// host's `coded_turn` and `fill`); SRA and the all-gather scheme read the input where
    /// they encode it, the residual added there.
    fn start(&self, st: &mut DeviceState, res: Option<u64>, view: View) -> Result<View> {
        if !matches!(self.scheme, Scheme::Ring | Scheme::Tree) {
            return Ok(view);
        }
        self.alone(st, res, view)?;
        Ok((None, view.1))
    }

    /// The schedule's shape on more than one rank.
    fn shape(&self) -> Option<Shape> {
        let (count, n, rank, slice) = (self.count, self.n, self.rank, self.slice);
        (n > 1).then(|| match self.scheme {
            Scheme::Tree => tree::shape(count, n, rank, slice),
            _ => Shape::new(count, n, rank, slice),
        })
    }

    /// One rank: as the host's, the residual added (or the input copied) into the f32 work
    /// `view`, nothing sent.
    fn alone(&self, st: &mut DeviceState, res: Option<u64>, view: View) -> Result<()> {
        let (send, recv) = view;
        st.compensate(send.unwrap_or(recv), res, recv, self.count)
    }

    /// A key used on host buffers before starts again from zero here (`e`: the engine of
    /// the comm the call was made on).
    pub(crate) fn forget_host_residual(&self, e: &mut Engine) {
        if let Some(k) = self.key.as_ref().filter(|_| self.plan.error_feedback()) {
            e.residuals.remove(k);
        }
    }

    /// Runs `work` (the call's schedule on the device) on the comm's device state as step
    /// `step`, behind `caller`'s work so far when given: the state made on first use, the
    /// tensor's residual and room for the call found first, the division for Avg and the
    /// `done` event after it (the caller's stream made to wait for it). The call's script
    /// goes to `hand` before its work is enqueued; what `hand` keeps is returned (a script it
    /// gives back as Err is the comm's failure: nothing is enqueued). `work` gets the
    /// state, the call's board, its residual and site, and the f32 buffers it works on
    /// (the call's, or for half precision an f32 copy, converted in before and out after).
    /// On an error, whatever was enqueued runs to its end before the error returns.
    fn on_lane(
        &self,
        lane: &GpuLane,
        step: u64,
        caller: Option<&dyn Stream>,
        hand: impl FnOnce(Script) -> std::result::Result<Option<Script>, Script>,
        work: impl FnOnce(&mut DeviceState, &Board, Option<u64>, Site, View) -> Result<()>,
    ) -> Result<Option<Script>> {
        let mut guard = lane.locked((&*self.driver, self.ordinal))?;
        let st = guard.as_mut().expect("made by locked");
        self.on_state(st, lane, step, caller, hand, work)
    }

    /// `on_lane`'s body on the comm's device state `st`, locked by the caller.
    fn on_state(
        &self,
        st: &mut DeviceState,
        lane: &GpuLane,
        step: u64,
        caller: Option<&dyn Stream>,
        hand: impl FnOnce(Script) -> std::result::Result<Option<Script>, Script>,
        work: impl FnOnce(&mut DeviceState, &Board, Option<u64>, Site, View) -> Result<()>,
    ) -> Result<Option<Script>> {
        crate::qlog!(
            Trace,
            "rank {}: all_reduce(count={}, {}, {}): compressed, codecs on device {}",
            self.rank,
            self.count,
            self.dtype,
            self.op,
            self.ordinal
        );
        let wait = (&*lane.moved, self.timeout);
        let key = self.key.as_ref().filter(|_| self.plan.error_feedback());
        let res = st
            .residual(
                &*self.driver,
                key,
                self.res_count,
                lane.take_forgotten(),
                wait,
            )?
            .map(|r| r + 4 * self.base as u64);
        let shape = self.shape();
        let sizes = self.sizes(shape)?;
        st.reserve(&*self.driver, &sizes, self.n, &lane.moved, self.timeout)?;
        let slot = sizes.slot;
        if let Some(c) = caller {
            st.stream.wait_event(&*c.record()?)?;
        }
        let wire = st.wire.as_ref().map_or(std::ptr::null_mut(), |w| w.ptr());
        let exchanges = shape.map_or(0, |s| self.exchanges(s));
        let base = st.seq;
        st.seq = base.wrapping_add(exchanges as u32);
        st.issued += 1;
        let board = Board::new((wire, slot, self.n), st.words.clone(), base, exchanges);
        let script = Script::new(board.clone(), (lane.moved.clone(), self.timeout));
        let kept = match hand(script) {
            Ok(kept) => kept,
            Err(refused) => {
                let e = Error::Aborted(
                    "compressed all-reduce on device buffers: the comm failed before the call \
                     was enqueued"
                        .into(),
                );
                refused.board.end(Err(e.clone()));
                refused.board.set_finished();
                return Err(e);
            }
        };
        let site = Site {
            seed: self.seed,
            step,
            chunk: 0,
            rank: self.site_rank as u64,
        };
        let enqueued = self.widen(st).and_then(|view| {
            work(st, &board, res, site, view)?;
            if board.exchanges() != exchanges {
                return Err(Error::Internal(format!(
                    "the schedule made {} exchanges, {exchanges} expected",
                    board.exchanges()
                )));
            }
            self.finish_on(st, view, caller)
        });
        match enqueued {
            Ok(done) => {
                board.end(Ok(done));
                Ok(kept)
            }
            Err(e) => {
                // What was enqueued runs to its end before the buffers count as free.
                board.release(exchanges);
                if st.drained_after_failure(self.timeout) {
                    board.set_finished();
                }
                board.end(Err(e.clone()));
                Err(e)
            }
        }
    }

    /// The f32 buffers the call works on: its own, or for another float type the f32 copy of
    /// its input (the send buffer, or the receive buffer in place), the conversion enqueued.
    fn widen(&self, st: &mut DeviceState) -> Result<View> {
        let Some(convert) = &self.convert else {
            return Ok((self.send, self.recv));
        };
        let work = state::addr(&st.work);
        // SAFETY: converts `count` elements of the call's input (valid until its `done`
        // event: the caller's promise, aligned to the element: checked by the comm) into the
        // f32 copy, which `reserve` sized and nothing else uses until the call is done.
        unsafe {
            convert.run(
                &*st.stream,
                true,
                self.send.unwrap_or(self.recv),
                work,
                self.count,
            )?
        };
        Ok((None, work))
    }

    /// Enqueues Avg's division on the f32 work `view`, the conversion back of a call on
    /// another float type, then records the call's `done` event (and makes `caller` wait for
    /// it).
    fn finish_on(
        &self,
        st: &mut DeviceState,
        (_, work): View,
        caller: Option<&dyn Stream>,
    ) -> Result<Box<dyn super::driver::Event>> {
        let count = self.count;
        if self.op == ReduceOp::Avg {
            self.divide(st, work)?;
        }
        if let Some(convert) = &self.convert {
            // SAFETY: converts the f32 copy's `count` values into the call's receive buffer
            // (valid until `done`: the caller's promise), as `from_f32` does.
            unsafe { convert.run(&*st.stream, false, work, self.recv, count)? };
        }
        if let Some(c) = caller {
            c.wait_event(&*st.stream.record()?)?;
        }
        st.mark()
    }

    /// Moves the bytes of the call `script` enqueued, on `e` in the comm's turn: the
    /// schedule's exchanges, each released to the stream once its headers are checked.
    fn move_bytes(&self, e: &mut Engine, script: &mut Script) -> Result<DeviceStats> {
        if script.board.words.bad() {
            // An earlier call's decode refused its bytes after its exchanges ended.
            return Err(bad_chunk());
        }
        let Some(shape) = self.shape() else {
            return Ok(DeviceStats::default());
        };
        let mut ctx = self.exchange_ctx(e);
        let mut side = MoveSide {
            mover: Mover::new(self, self.n),
            script,
        };
        let ran = self.schedule(&mut ctx, shape, &mut side);
        let at = side.mover.x;
        ran.map_err(|e| {
            let state = side.script.board.state();
            e.prefixed(&format!("exchange {at} of the call's ({state}): "))
        })?;
        Ok(side.mover.stats)
    }

    /// The context the call's exchanges run in on `e`: its frames name the call as the
    /// host's compressed calls do (schedule, type, the plan's fingerprint), so host and
    /// device ranks of one job check each other's frames alike.
    fn exchange_ctx<'e>(&self, e: &'e mut Engine) -> crate::algo::Ctx<'e> {
        let site = Site {
            seed: self.seed,
            step: 0,
            chunk: 0,
            rank: self.site_rank as u64,
        };
        let coded = Coded::new(&self.plan, site, 0, None, self.dtype);
        e.coded_ctx(CollKind::AllReduce, self.count, &coded, self.algo())
    }

    /// Ends a call whose bytes were moved (`moved`: what the exchanges did, or their
    /// error): every progress value stored (after a failure the stream runs on, to an
    /// undefined result), then waits for the call's device work, so the caller's buffers go
    /// back only once the stream is done with them. Returns what the exchanges did.
    fn wait_done(&self, script: Script, moved: Result<DeviceStats>) -> Result<DeviceStats> {
        let b = &script.board;
        b.release(b.total);
        let synced = b
            .done(self.timeout)
            .and_then(|d| d.synchronize(self.timeout))
            .map_err(|e| {
                e.prefixed(&format!(
                    "compressed all-reduce on device buffers ({}): ",
                    b.state()
                ))
            });
        if synced.is_ok() {
            b.set_finished();
        }
        let stats = moved?;
        synced?;
        if b.words.bad() {
            return Err(bad_chunk());
        }
        Ok(stats)
    }

    /// The room the call needs on `shape` (None: one rank): the same chunks and slices as
    /// `sra::run` and `ring::run` (the whole buffer for the all-gather scheme, its slices for the
    /// tree), and the f32 copy of a call on
    /// another float type.
    fn sizes(&self, shape: Option<Shape>) -> Result<Sizes> {
        let mut s = Sizes {
            slot: 0,
            payload: 0,
            scratch: 0,
            work: if self.convert.is_some() {
                4 * self.count
            } else {
                0
            },
        };
        let Some(shape) = shape else {
            return Ok(s);
        };
        let (n, nsl) = (shape.n, shape.nsl);
        let ranges: Vec<Range<usize>> = match self.scheme {
            Scheme::Sra | Scheme::Ring => (0..n)
                .flat_map(|c| {
                    let c = chunk(self.count, n, c);
                    (0..nsl).map(move |j| slice(&c, nsl, j))
                })
                .collect(),
            Scheme::Gather => std::iter::once(0..self.count).collect(),
            Scheme::Tree => (0..nsl).map(|j| slice(&(0..self.count), nsl, j)).collect(),
        };
        for r in ranges {
            s.slot = s.slot.max(self.encoded_len(r.clone()));
            for (q, _, codec) in self.pieces(r) {
                let p = self.plan_of(&**codec)?;
                s.payload = s.payload.max(p.payload_len(q.len()));
                s.scratch = s.scratch.max(p.scratch_len(q.len()));
            }
        }
        Ok(s)
    }
}

fn bad_chunk() -> Error {
    Error::invalid(
        "compressed all-reduce on device buffers: a received chunk failed its codec's checks \
         on the device",
    )
}
