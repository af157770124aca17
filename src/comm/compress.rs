//! Compressed collectives, the user-facing side: argument checks before any byte moves,
//! conversion of f16/bf16/f64 data to the f32 the codecs work on, layouts (CGX's layer-wise
//! compression), and error feedback with the residual kept in the comm per tensor key.

use super::hier::{CodedEdges, Hier};
use super::{Comm, Request};
use crate::algo::{split_parts, Algo, AtOnce, PieceIo, Wire};
use crate::codec::ef::{self, TensorKey};
use crate::codec::layout::{CodecMap, Layout};
use crate::codec::{CodecSpec, Site};
use crate::coll::call::{Buf, Coll, CollCall};
use crate::coll::compressed::Coded;
use crate::coll::Engine;
use crate::error::{Error, Result};
use crate::reduce;
use crate::tuning::{Flat, Resolved, Workload};
use crate::types::{DType, Element, ReduceOp};
use half::{bf16, f16};
use std::sync::{Arc, Mutex};

/// How one call compresses: the codec, the tensor key (needed for error feedback and
/// layouts), and optionally the schedule.
#[derive(Debug, Clone)]
pub struct Compression {
    /// The codec (with its error-feedback switch).
    pub codec: CodecSpec,
    /// Names the tensor across calls: keys the error-feedback residual and the layout.
    pub key: Option<TensorKey>,
    /// Schedule: None uses QCCL_ALGO / `auto` (all-gather scheme for sparse codecs, SRA
    /// otherwise, hierarchical across several hosts); ring, tree, sra or allgather force one.
    pub algo: Option<Algo>,
    /// Hierarchical schedule only: compress the intra-host phases too (default: only the
    /// inter-host phase, where bandwidth is scarce).
    pub intra_host: bool,
}

impl Compression {
    /// Compression with `codec`, no key, default schedule.
    pub fn new(codec: CodecSpec) -> Compression {
        Compression {
            codec,
            key: None,
            algo: None,
            intra_host: false,
        }
    }

    /// Parses a codec spec (see [`CodecSpec::parse`]).
    pub fn parse(spec: &str) -> Result<Compression> {
        Ok(Compression::new(CodecSpec::parse(spec)?))
    }

    /// Sets the tensor key.
    pub fn key(mut self, key: impl Into<TensorKey>) -> Compression {
        self.key = Some(key.into());
        self
    }

    /// Forces a schedule.
    pub fn algo(mut self, algo: Algo) -> Compression {
        self.algo = Some(algo);
        self
    }

    /// Compresses the intra-host phases of the hierarchical schedule too.
    pub fn intra_host(mut self, on: bool) -> Compression {
        self.intra_host = on;
        self
    }
}

/// What a compressed call did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// The schedule that ran.
    pub algo: Algo,
    /// Payload bytes this rank sent and received (all phases).
    pub wire: Wire,
    /// Of `wire`, the bytes of the inter-host level of a hierarchical call (what crosses the
    /// network; the rest moved through shared memory); None for flat calls.
    pub inter: Option<Wire>,
}

impl Report {
    /// The report of a flat (not hierarchical) call: no inter-host figure.
    pub(crate) fn flat(algo: Algo, wire: Wire) -> Report {
        Report {
            algo,
            wire,
            inter: None,
        }
    }
}

impl Comm {
    /// Registers the layout of the fused buffer called with `key`: each layer is compressed
    /// on its own, with its own codec if it has one; layers matching QCCL_COMPRESSION_EXCLUDE
    /// or under QCCL_COMPRESSION_MINIMAL_SIZE elements travel uncompressed. Local to this rank;
    /// every rank must register the same layout.
    pub fn set_layout(&self, key: impl Into<TensorKey>, layout: Layout) -> Result<()> {
        let key = key.into();
        if layout.layers.is_empty() {
            return Err(Error::invalid(format!(
                "set_layout({key}): the layout has no layers"
            )));
        }
        self.layouts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, layout);
        Ok(())
    }

    /// Registers the layout used by compressed calls that have no layout of their own (no key,
    /// or a key without one) when their element count equals the layout's total: the C ABI's
    /// `qcclCommSetLayout`. None removes it.
    pub fn set_default_layout(&self, layout: Option<Layout>) -> Result<()> {
        if layout.as_ref().is_some_and(|l| l.layers.is_empty()) {
            return Err(Error::invalid(
                "set_default_layout: the layout has no layers",
            ));
        }
        *self
            .default_layout
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = layout;
        Ok(())
    }

    /// Replaces the name patterns of layers kept in full precision (QCCL_COMPRESSION_EXCLUDE):
    /// a layer whose name contains one of them is not compressed.
    pub fn set_exclude_patterns(&self, patterns: Vec<String>) {
        self.filter
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .exclude = patterns;
    }

    /// Forgets the layout of `key`; true if there was one.
    pub fn remove_layout(&self, key: &TensorKey) -> bool {
        self.layouts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key)
            .is_some()
    }

    /// Forgets the error-feedback residual of `key` (a collective-free local call, ordered
    /// after every call submitted before it); true if there was one.
    pub fn forget_residual(&self, key: &TensorKey) -> Result<bool> {
        self.queue.run(|e| {
            let device = e.gpu.forget(key);
            Ok(e.residuals.remove(key) | device)
        })
    }

    /// Payload bytes this comm has sent and received so far, over all collectives.
    pub fn wire(&self) -> Result<Wire> {
        self.queue.run(|e| Ok(e.wire))
    }

    /// Compressed all-reduce in place: `buf` is encoded where it leaves this rank and decoded
    /// where it arrives; every rank ends with bit-identical results. Float types, Sum or Avg.
    pub fn all_reduce_compressed<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        c: &Compression,
    ) -> Result<Report> {
        let n = buf.len();
        self.all_reduce_compressed_raw(None, bytemuck::cast_slice_mut(buf), n, T::DTYPE, op, c)
    }

    /// Compressed all-reduce out of place: `recv` gets the result, `send` is only read (where
    /// the schedule first needs each element: no copy of it up front).
    pub fn all_reduce_compressed_out_of_place<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        c: &Compression,
    ) -> Result<Report> {
        let n = recv.len();
        let send = bytemuck::cast_slice(send);
        self.all_reduce_compressed_raw(
            Some(send),
            bytemuck::cast_slice_mut(recv),
            n,
            T::DTYPE,
            op,
            c,
        )
    }

    /// Compressed all-reduce over bytes; in place when `send` is None.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce_compressed_raw(
        &self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        op: ReduceOp,
        c: &Compression,
    ) -> Result<Report> {
        self.check(
            &CollCall::new(Coll::AllReduce, count, dtype)
                .op(op)
                .bufs(Buf::of(send), Buf::Bytes(recv.len()))
                .codec(&c.codec, c.key.is_some()),
        )?;
        let call = self.prepare_all_reduce_compressed(count, dtype, op, c)?;
        self.queue.run_declared(1, |e| call.run(e, send, recv))
    }

    /// Starts a compressed all-reduce of `buf` in place; the request returns it with the report
    /// (DeAR-style overlap: start it after backprop produced the tensor, wait before use).
    pub fn all_reduce_compressed_async<T: Element>(
        &self,
        mut buf: Vec<T>,
        op: ReduceOp,
        c: &Compression,
    ) -> Result<Request<(Vec<T>, Report)>> {
        let call = self.prepare_all_reduce_compressed(buf.len(), T::DTYPE, op, c)?;
        self.queue.submit_holding((), Some(1), move |e, _| {
            let report = call.run(e, None, bytemuck::cast_slice_mut(&mut buf))?;
            Ok((buf, report))
        })
    }

    #[doc(hidden)]
    /// Checks a compressed all-reduce of `count` elements and resolves everything it needs
    /// (plan, schedule, hierarchy) before any byte moves; the result runs on this comm's engine
    /// (`Comm::execute` / `Comm::submit`), which is how the C ABI queues grouped and
    /// non-blocking compressed calls.
    pub fn prepare_all_reduce_compressed(
        &self,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        c: &Compression,
    ) -> Result<PreparedAllReduce> {
        self.check(
            &CollCall::new(Coll::AllReduce, count, dtype)
                .op(op)
                .codec(&c.codec, c.key.is_some()),
        )?;
        let plan = self.plan(Coll::AllReduce, count, c)?;
        let workload = if plan.is_sparse() {
            Workload::Sparse
        } else {
            Workload::Compressed
        };
        let schedule = match self.choose(workload, count.saturating_mul(dtype.size()), c.algo)? {
            Resolved::Hier => Schedule::Hier(self.hierarchy()?),
            Resolved::Flat(f) => Schedule::Flat(f),
        };
        Ok(PreparedAllReduce {
            plan,
            schedule,
            key: c.key.clone(),
            intra_host: c.intra_host,
            count,
            dtype,
            op,
            seed: self.config.seed,
            rank: self.rank,
            size: self.size,
        })
    }

    /// Compressed reduce-scatter in place: `buf` holds size·recvcount elements; afterwards
    /// part `rank` (`buf[rank·recvcount..]`) holds the sum of every rank's part `rank`, each
    /// peer's contribution encoded once (this rank's own is exact). Float types, Sum or Avg.
    pub fn reduce_scatter_compressed<T: Element>(
        &self,
        buf: &mut [T],
        recvcount: usize,
        op: ReduceOp,
        c: &Compression,
    ) -> Result<Report> {
        let dtype = T::DTYPE;
        self.check(
            &CollCall::new(Coll::ReduceScatter, recvcount, dtype)
                .op(op)
                .bufs(Buf::None, Buf::Bytes(std::mem::size_of_val(buf)))
                .codec(&c.codec, c.key.is_some()),
        )?;
        let plan = self.plan(Coll::ReduceScatter, buf.len(), c)?;
        let (seed, rank, size) = (self.config.seed, self.rank, self.size);
        with_f32(None, bytemuck::cast_slice_mut(buf), dtype, |_, work| {
            self.queue.run(|e| {
                coded_turn(
                    e,
                    c.key.as_ref(),
                    &plan,
                    (None, work),
                    (seed, rank),
                    |e, _, work, site, res| {
                        let w0 = e.wire;
                        e.reduce_scatter_coded(work, Coded::new(&plan, site, 0, res, dtype))?;
                        let mine = rank * recvcount..(rank + 1) * recvcount;
                        let part = bytemuck::cast_slice_mut(&mut work[mine]);
                        reduce::finish(DType::Float32, op, part, size);
                        Ok(Report::flat(Algo::Sra, e.wire - w0))
                    },
                )
            })
        })
    }

    /// Compressed all-gather in place: `buf` holds size·sendcount elements, this rank's part
    /// at `buf[rank·sendcount..]`. Each part is encoded once by its owner; every rank, the owner
    /// included, ends with the same decoded values.
    pub fn all_gather_compressed<T: Element>(
        &self,
        buf: &mut [T],
        sendcount: usize,
        c: &Compression,
    ) -> Result<Report> {
        let dtype = T::DTYPE;
        self.check(
            &CollCall::new(Coll::AllGather, sendcount, dtype)
                .bufs(Buf::None, Buf::Bytes(std::mem::size_of_val(buf)))
                .codec(&c.codec, c.key.is_some()),
        )?;
        let plan = self.plan(Coll::AllGather, buf.len(), c)?;
        let (seed, rank) = (self.config.seed, self.rank);
        with_f32(None, bytemuck::cast_slice_mut(buf), dtype, |_, work| {
            self.queue.run(|e| {
                coded_turn(
                    e,
                    c.key.as_ref(),
                    &plan,
                    (None, work),
                    (seed, rank),
                    |e, _, work, site, res| {
                        let w0 = e.wire;
                        e.all_gather_coded(work, Coded::new(&plan, site, 0, res, dtype))?;
                        Ok(Report::flat(Algo::Ring, e.wire - w0))
                    },
                )
            })
        })
    }

    /// Resolves a validated compressed call's plan of `count` elements (its whole buffer).
    fn plan(&self, k: Coll, count: usize, c: &Compression) -> Result<CodecMap> {
        let name = k.name();
        let keyed = c.key.as_ref().and_then(|key| {
            self.layouts
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(key)
                .cloned()
        });
        let layout = keyed.or_else(|| {
            self.default_layout
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .filter(|l| l.count() == count)
        });
        let filter = self
            .filter
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        match layout {
            Some(l) if l.count() != count => Err(Error::invalid(format!(
                "{name}: tensor {} has a layout of {} elements but the call has {count}",
                c.key.as_ref().expect("key"),
                l.count()
            ))),
            Some(l) => Ok(CodecMap::layered(&c.codec, &l, &filter)),
            None => Ok(CodecMap::uniform(&c.codec, count, &filter)),
        }
    }
}

/// The part every compressed call does on the engine, around its schedule `f`
/// (`lend_residual`), with the residual added to the input first. Out of place (`input`),
/// that addition is also the copy into `work`, and `f` then runs in place; without a
/// residual `f` gets the input.
fn coded_turn<R>(
    e: &mut Engine,
    key: Option<&TensorKey>,
    plan: &CodecMap,
    (input, work): (Option<&[f32]>, &mut [f32]),
    who: (u64, usize),
    f: impl FnOnce(&mut Engine, Option<&[f32]>, &mut [f32], Site, Option<&mut [f32]>) -> Result<R>,
) -> Result<R> {
    let len = work.len();
    lend_residual(e, key, plan, len, who, |e, site, mut residual| {
        let input = match residual {
            Some(ref mut r) => {
                match input {
                    Some(i) => ef::compensate_from(i, work, r),
                    None => ef::compensate(work, r),
                }
                None
            }
            None => input,
        };
        f(e, input, work, site, residual)
    })
}

/// Takes the call's step number (the random streams' `step`) and lends `f` the tensor's
/// error-feedback residual of `len` elements (taken out of the engine for the call, put
/// back after), not yet added to the input.
fn lend_residual<R>(
    e: &mut Engine,
    key: Option<&TensorKey>,
    plan: &CodecMap,
    len: usize,
    (seed, rank): (u64, usize),
    f: impl FnOnce(&mut Engine, Site, Option<&mut [f32]>) -> Result<R>,
) -> Result<R> {
    let step = e.coded_calls;
    e.coded_calls += 1;
    let key = key.filter(|_| plan.error_feedback());
    if let Some(k) = key {
        // A key used on device buffers before starts again from zero on the host.
        e.gpu.forget_later(k);
    }
    let mut residual = key.map(|k| std::mem::take(e.residuals.get(k, len)));
    let site = Site {
        seed,
        step,
        chunk: 0,
        rank: rank as u64,
    };
    let out = f(e, site, residual.as_deref_mut());
    if let (Some(k), Some(r)) = (key, residual) {
        e.residuals.put(k, r);
    }
    out
}

/// Where a compressed all-reduce runs.
enum Schedule {
    /// On the comm's engine with this schedule.
    Flat(Flat),
    /// On the hierarchy's sub-comms.
    Hier(Arc<Hier>),
}

/// A checked compressed all-reduce, ready to run on its comm's engine.
pub struct PreparedAllReduce {
    plan: CodecMap,
    schedule: Schedule,
    key: Option<TensorKey>,
    intra_host: bool,
    count: usize,
    dtype: DType,
    op: ReduceOp,
    seed: u64,
    rank: usize,
    size: usize,
}

impl PreparedAllReduce {
    /// (count, dtype, op) the call was prepared for.
    pub(super) fn shape(&self) -> (usize, DType, ReduceOp) {
        (self.count, self.dtype, self.op)
    }

    /// The call as the device path runs it: (plan, tensor key, op, count, seed, dtype,
    /// schedule), when it is a flat SRA, all-gather or ring schedule on a float type (what `gpu::sra`
    /// implements; other than float32 through an f32 copy, as `with_f32`); None
    /// otherwise.
    pub(super) fn on_device(&self) -> Option<crate::gpu::sra::CallShape<'_>> {
        use crate::gpu::sra::Scheme;
        let floats = self.dtype.is_float();
        let scheme = match self.schedule {
            Schedule::Flat(Flat::Sra) => Scheme::Sra,
            Schedule::Flat(Flat::AllGather) => Scheme::Gather,
            Schedule::Flat(Flat::Ring) => Scheme::Ring,
            Schedule::Flat(Flat::Tree) => Scheme::Tree,
            _ => return None,
        };
        floats.then(|| self.device_shape(scheme))
    }

    fn device_shape(&self, scheme: crate::gpu::sra::Scheme) -> crate::gpu::sra::CallShape<'_> {
        (
            &self.plan,
            self.key.as_ref(),
            self.op,
            self.count,
            self.seed,
            self.dtype,
            scheme,
        )
    }

    /// The call as the device path runs it on the hierarchy (`gpu_hier.rs`): its shape as
    /// `on_device`'s (the schedule standing for the parts' own) and the hierarchy, when it
    /// is a hierarchical schedule on a float type whose intra-host levels are dense; None
    /// otherwise.
    pub(super) fn on_device_hier(&self) -> Option<(crate::gpu::sra::CallShape<'_>, &Arc<Hier>)> {
        let Schedule::Hier(h) = &self.schedule else {
            return None;
        };
        let shape = self.device_shape(crate::gpu::sra::Scheme::Sra);
        (self.dtype.is_float() && !self.intra_host).then_some((shape, h))
    }

    /// The bytes of each of the call's buffers.
    pub(super) fn bytes(&self) -> usize {
        self.count * self.dtype.size()
    }

    /// The schedule the call runs, as its report names it (`Algo::Hier` on the hierarchy's
    /// sub-comms).
    pub fn algo(&self) -> Algo {
        match &self.schedule {
            Schedule::Flat(f) => f.algo(),
            Schedule::Hier(_) => Algo::Hier,
        }
    }

    /// True when the call runs the hierarchical schedule.
    pub(super) fn is_hier(&self) -> bool {
        self.hier().is_some()
    }

    /// The hierarchy the call runs on, when it runs the hierarchical schedule.
    pub(super) fn hier(&self) -> Option<&Arc<Hier>> {
        match &self.schedule {
            Schedule::Hier(h) => Some(h),
            Schedule::Flat(_) => None,
        }
    }

    /// As `run` on the hierarchy, in place in `buf` (the call's page-locked copy, staged
    /// piece by piece: `comm/bands.rs`): each of the hierarchy's pieces (`Hier::pieces` of
    /// f32 elements) starts once `io` says it landed and is reported done after its last
    /// level. The residual is added and other float types converted to f32 per piece before
    /// its first level, Avg's division and the conversion back per piece after its last:
    /// steps element by element, so the bits are `run`'s.
    pub(super) fn run_in_pieces(
        &self,
        e: &mut Engine,
        buf: &mut [u8],
        io: &dyn PieceIo,
    ) -> Result<Report> {
        let Schedule::Hier(h) = &self.schedule else {
            return Err(Error::Internal(
                "a compressed call staged piece by piece is not on the hierarchy".into(),
            ));
        };
        let (count, dtype, es) = (self.count, self.dtype, self.dtype.size());
        if buf.len() != count * es {
            return Err(Error::Internal(format!(
                "a compressed call of {count} elements of {dtype} staged in {} bytes",
                buf.len()
            )));
        }
        let f32s = dtype == DType::Float32 && buf.as_ptr().align_offset(4) == 0;
        let mut copy: Vec<f32>;
        let (work, bytes) = if f32s {
            (bytemuck::cast_slice_mut::<u8, f32>(buf), Vec::new())
        } else {
            copy = vec![0f32; count];
            let at: Vec<_> = (h.pieces(count, 4).iter())
                .map(|r| r.start * es..r.end * es)
                .collect();
            (&mut copy[..], split_parts(buf, &at))
        };
        let edges = StagedEdges {
            io,
            bytes: bytes.into_iter().map(Mutex::new).collect(),
            dtype,
            op: self.op,
            size: self.size,
        };
        let (plan, levels) = (&self.plan, (self.intra_host, dtype));
        let who = (self.seed, self.rank);
        let (wire, inter) =
            lend_residual(e, self.key.as_ref(), plan, count, who, |_, site, res| {
                h.all_reduce_coded(None, work, plan, site, res, levels, &edges)
            })?;
        Ok(Report {
            algo: Algo::Hier,
            wire,
            inter: Some(inter),
        })
    }

    /// Runs the call on `e` (the engine of the comm that prepared it, inside its turn):
    /// `recv` holds `count` elements, `send` (out of place) too.
    pub fn run(&self, e: &mut Engine, send: Option<&[u8]>, recv: &mut [u8]) -> Result<Report> {
        let es = self.dtype.size();
        if recv.len() != self.count * es || send.is_some_and(|s| s.len() != recv.len()) {
            return Err(Error::invalid(format!(
                "all_reduce: buffers of {} and {:?} bytes for a call prepared for {} elements of {}",
                recv.len(),
                send.map(<[u8]>::len),
                self.count,
                self.dtype
            )));
        }
        let (plan, dtype) = (&self.plan, self.dtype);
        let who = (self.seed, self.rank);
        with_f32(send, recv, dtype, |input, work| {
            let report = coded_turn(
                e,
                self.key.as_ref(),
                plan,
                (input, work),
                who,
                |e, input, work, site, res| match &self.schedule {
                    Schedule::Hier(h) => {
                        let levels = (self.intra_host, dtype);
                        let report = h
                            .all_reduce_coded(input, work, plan, site, res, levels, &AtOnce)
                            .map(|(wire, inter)| Report {
                                algo: Algo::Hier,
                                wire,
                                inter: Some(inter),
                            })?;
                        let work = bytemuck::cast_slice_mut(work);
                        reduce::finish(DType::Float32, self.op, work, self.size);
                        Ok(report)
                    }
                    Schedule::Flat(f) => {
                        // The schedule averages as it goes (SRA: per slice, in cache).
                        let w0 = e.wire;
                        let coded = Coded::new(plan, site, 0, res, dtype)
                            .input(input)
                            .avg(self.op == ReduceOp::Avg);
                        e.all_reduce_coded(work, coded, *f)
                            .map(|()| Report::flat(f.algo(), e.wire - w0))
                    }
                },
            )?;
            Ok(report)
        })
    }
}

/// The edges of a compressed call on the hierarchy staged piece by piece (`run_in_pieces`).
struct StagedEdges<'a> {
    io: &'a dyn PieceIo,
    /// Each piece's bytes in the staged buffer when it holds another type than float32
    /// (converted into and out of the f32 work); empty for float32 (the work is the buffer).
    bytes: Vec<Mutex<&'a mut [u8]>>,
    dtype: DType,
    op: ReduceOp,
    /// Ranks of the calling comm (Avg).
    size: usize,
}

impl CodedEdges for StagedEdges<'_> {
    fn start(&self, i: usize, work: &mut [f32], residual: Option<&mut [f32]>) -> Result<()> {
        self.io.landed(i)?;
        if let Some(b) = self.bytes.get(i) {
            to_f32(
                &b.lock().unwrap_or_else(|p| p.into_inner()),
                self.dtype,
                work,
            );
        }
        if let Some(r) = residual {
            ef::compensate(work, r);
        }
        Ok(())
    }

    fn end(&self, i: usize, work: &mut [f32]) -> Result<()> {
        let size = self.size;
        reduce::finish(
            DType::Float32,
            self.op,
            bytemuck::cast_slice_mut(work),
            size,
        );
        if let Some(b) = self.bytes.get(i) {
            from_f32(
                work,
                &mut b.lock().unwrap_or_else(|p| p.into_inner()),
                self.dtype,
            );
        }
        self.io.done(i);
        Ok(())
    }
}

/// Runs `f` on the data as f32: in place for aligned f32, else through a converted copy that
/// is written back after. Out of place (`send`), `f` gets the input beside the work buffer
/// when both are aligned f32 (the schedule reads it where it first needs it: no pass copies
/// it), else the work buffer starts as the (converted) input and `f` gets None.
pub(super) fn with_f32<R>(
    send: Option<&[u8]>,
    recv: &mut [u8],
    dtype: DType,
    f: impl FnOnce(Option<&[f32]>, &mut [f32]) -> Result<R>,
) -> Result<R> {
    if dtype == DType::Float32 {
        let input = send.map(bytemuck::try_cast_slice::<u8, f32>);
        if !matches!(input, Some(Err(_))) {
            if let Ok(work) = bytemuck::try_cast_slice_mut::<u8, f32>(recv) {
                return f(input.and_then(|i| i.ok()), work);
            }
        }
    }
    let input: &[u8] = send.unwrap_or(recv);
    let mut work: Vec<f32> = f32s_of(input, dtype).collect();
    let out = f(None, &mut work)?;
    from_f32(&work, recv, dtype);
    Ok(out)
}

/// The elements `b` of `dtype` as f32 into `out`.
fn to_f32(b: &[u8], dtype: DType, out: &mut [f32]) {
    for (o, x) in out.iter_mut().zip(f32s_of(b, dtype)) {
        *o = x;
    }
}

/// The elements `b` of `dtype` as f32s.
fn f32s_of(b: &[u8], dtype: DType) -> impl Iterator<Item = f32> + '_ {
    b.chunks_exact(dtype.size()).map(move |e| match dtype {
        DType::Float32 => f32::from_ne_bytes([e[0], e[1], e[2], e[3]]),
        DType::Float64 => f64::from_ne_bytes(e.try_into().expect("8 bytes")) as f32,
        DType::Float16 => f16::from_bits(u16::from_ne_bytes([e[0], e[1]])).to_f32(),
        _ => bf16::from_bits(u16::from_ne_bytes([e[0], e[1]])).to_f32(),
    })
}

fn from_f32(work: &[f32], b: &mut [u8], dtype: DType) {
    let es = dtype.size();
    for (e, &x) in b.chunks_exact_mut(es).zip(work) {
        match dtype {
            DType::Float32 => e.copy_from_slice(&x.to_ne_bytes()),
            DType::Float64 => e.copy_from_slice(&(x as f64).to_ne_bytes()),
            DType::Float16 => e.copy_from_slice(&f16::from_f32(x).to_bits().to_ne_bytes()),
            _ => e.copy_from_slice(&bf16::from_f32(x).to_bits().to_ne_bytes()),
        }
    }
}
