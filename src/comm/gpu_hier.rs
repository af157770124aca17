//! Compressed hierarchical all-reduce on device buffers with the codecs on the GPU: the
//! route a multi-host job takes by default (`hier.rs`), its three levels with the device at
//! both ends of each. Inside each host, a dense reduce-scatter and all-gather of f32 sums
//! through the shared-memory arena, the GPU copying into and out of its registered segments
//! (`ArenaTurn::run_parts`); across hosts, the compressed all-reduce of this rank's part
//! among the ranks with its local rank, encoded and decoded on the GPU (`gpu::sra` on a
//! part of the call's plan, `GpuAllReduce::part`): what leaves the device for the network
//! is encoded bytes only. Pieces are pipelined as the host's (`pipeline`): the network level
//! of one piece runs while the next is reduce-scattered inside the host.
//!
//! The arithmetic is the host's step for step, so host and device ranks of one job end
//! bit-identical: the residual folded into the whole input first (`coded_turn`), the
//! arena's f32 sums (the host path's bytes), the part's random draws keyed by the calling
//! comm's rank, the call's step and the plan position, its residual the tensor's at the
//! part, and Avg's division over the whole result at the end.
//!
//! Float16, bfloat16 and float64 run on an f32 copy in device memory, as the host's
//! `with_f32` (`GpuAllReduce::fold_residual`, `finish_whole`).
//!
//! Taken by calls that return once done (a null stream, queued calls) on float buffers
//! when the intra-host levels are dense (the default) and the ranks of each host share the
//! arena (or a host has one rank); staged through page-locked memory piece by piece, the
//! CPU codecs encoding, otherwise (`bands.rs`). A call on a caller's stream must return once
//! enqueued, with every device operation of it enqueued by then (`staging.rs` says why),
//! and these levels enqueue theirs as they go: such a call on float32 runs the same levels
//! from a plan enqueued whole (`gpu_hier_stream.rs`), on another float type it is staged.

use super::arena_turn::ArenaTurn;
use super::hier::Hier;
use super::{pipeline, Comm, PreparedAllReduce, Report};
use crate::algo::arena::Shape;
use crate::algo::{part, Algo, Wire};
use crate::coll::Engine;
use crate::error::{Error, Result};
use crate::gpu::arena::DeviceIo;
use crate::gpu::driver::Driver;
use crate::gpu::sra::{CommShape, DeviceStats, GpuAllReduce, Scheme};
use crate::tuning::{Flat, Links, Workload};
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// A compressed hierarchical all-reduce on device buffers, checked and with its kernels
/// loaded.
pub(super) struct GpuHier {
    /// The whole call on the calling comm: its residual, Avg, and the parts' template.
    pub(super) whole: GpuAllReduce,
    pub(super) hier: Arc<Hier>,
    /// The intra-host comm's way through its arena.
    intra: ArenaTurn,
    pub(super) pieces: Vec<Piece>,
    /// The inter-host comm's (ranks, rank, slice bytes, timeout).
    pub(super) inter: CommShape,
}

/// One pipelined piece: its elements, this rank's part of them (both as elements of the
/// call) and the inter-host level's schedule for that part.
pub(super) struct Piece {
    pub(super) at: Range<usize>,
    pub(super) mine: Range<usize>,
    pub(super) scheme: Scheme,
}

impl Comm {
    /// The GPU path of the hierarchical compressed all-reduce `call` on `send` (None: in
    /// place) and `recv`, when it has one (see the module docs); None: stage it.
    pub(super) fn gpu_hier_all_reduce(
        &self,
        driver: &Arc<dyn Driver>,
        call: &PreparedAllReduce,
        (send, recv): (Option<u64>, u64),
        waits: bool,
    ) -> Result<Option<GpuHier>> {
        let Some((shape, hier)) = call.on_device_hier() else {
            return Ok(None);
        };
        let count = shape.3;
        // On a stream, float32 only (`gpu_hier_stream.rs` says why).
        let typed = waits || shape.5 == crate::types::DType::Float32;
        if count == 0 || !levels_on_device(hier) || !typed {
            return Ok(None);
        }
        let es = shape.5.size();
        let Some(ordinal) = self.coded_device(&**driver, (send, recv), es * count, es)? else {
            return Ok(None);
        };
        let here = self.coded_shape();
        let whole = match GpuAllReduce::new(driver.clone(), ordinal, shape, (send, recv), here) {
            Ok(g) => g,
            Err(e) => {
                crate::qlog!(
                    Info,
                    "rank {}: hierarchical compressed all-reduce on device buffers staged, \
                     the CPU codecs encode: {e}",
                    self.rank
                );
                return Ok(None);
            }
        };
        let (inter, intra) = (&hier.inter, &hier.intra);
        let (local, me) = (intra.size(), intra.rank());
        let workload = if shape.0.is_sparse() {
            Workload::Sparse
        } else {
            Workload::Compressed
        };
        // The host's pieces and, per piece, the inter-host comm's own choice for the part
        // (every rank of it holds a part of the same size: they share the local rank).
        let pieces = hier
            .pieces(count, 4)
            .into_iter()
            .map(|at| {
                let p = part(at.len(), local, me, 1);
                let mine = at.start + p.start..at.start + p.end;
                let scheme = scheme_of(inter.choose_flat(workload, es * mine.len()));
                Piece { at, mine, scheme }
            })
            .collect();
        crate::qlog!(
            Trace,
            "rank {}: compressed all-reduce of {count} elements on device {ordinal}: \
             hierarchical, the codecs on the GPU",
            self.rank
        );
        Ok(Some(GpuHier {
            whole,
            intra: intra.arena_turn(),
            pieces,
            inter: inter.coded_shape(),
            hier: hier.clone(),
        }))
    }
}

/// The intra-host level `shape` of a hierarchical call on f32 device buffer `buf` of
/// `device`, in place on its elements `at`, this rank's part of them starting at element
/// `own`: the reduce-scatter leaves this rank's part of the host's sum in its place, the
/// all-gather spreads every part. Nothing with one rank on the host.
///
/// # Safety
/// `buf` must be device memory of `device` holding the elements `at`, valid and touched by
/// nothing else until this returns.
pub(super) unsafe fn intra_level(
    hier: &Hier,
    turn: &ArenaTurn,
    device: (&Arc<dyn Driver>, usize),
    buf: u64,
    (at, own): (Range<usize>, usize),
    shape: Shape,
) -> Result<Wire> {
    if hier.intra.size() < 2 {
        return Ok(Wire::default());
    }
    let addr = |i: usize| buf + 4 * i as u64;
    let io = DeviceIo {
        src: match shape {
            Shape::AllGather => addr(own),
            _ => addr(at.start),
        },
        out: addr(at.start),
        in_place: true,
        stream: std::ptr::null_mut(),
    };
    hier.intra.execute(|e| {
        let w0 = e.wire;
        // SAFETY: the caller's promise; the legacy default stream.
        let ran = unsafe { turn.run_parts(e, device, shape, &io, at.len()) }?;
        if !ran {
            return Err(Error::Internal(
                "the intra-host comm of a hierarchical call on device buffers has no \
                 shared-memory arena"
                    .into(),
            ));
        }
        Ok(e.wire - w0)
    })
}

/// True when the intra-host levels of `hier` can run on device buffers: one rank on the
/// host, or its ranks on the shared-memory arena (not threads of one process).
pub(super) fn levels_on_device(hier: &Hier) -> bool {
    let intra = &hier.intra;
    intra.size() < 2 || (intra.links == Links::Arena && !intra.place.process_peers)
}

/// The device schedule of the host's flat choice.
fn scheme_of(f: Flat) -> Scheme {
    match f {
        Flat::Sra => Scheme::Sra,
        Flat::AllGather => Scheme::Gather,
        Flat::Ring => Scheme::Ring,
        Flat::Tree => Scheme::Tree,
    }
}

impl GpuHier {
    /// The call's whole-buffer view (its device and driver).
    pub(super) fn whole(&self) -> &GpuAllReduce {
        &self.whole
    }

    /// Runs the call on `e` (the calling comm's engine, in its turn), after the caller's
    /// earlier work on the buffers is done; returns once the result is in the receive
    /// buffer. The buffers must stay valid, and be touched by nothing else, until then.
    pub(super) fn run(&self, e: &mut Engine) -> Result<Report> {
        let step = e.coded_calls;
        e.coded_calls += 1;
        self.whole.forget_host_residual(e);
        let lane = e.gpu.clone();
        let work = self.whole.fold_residual(&lane)?;
        let across = Mutex::new((DeviceStats::default(), Wire::default()));
        // The caller's thread runs both intra-host levels.
        let intra = std::cell::Cell::new(Wire::default());
        let inside = |p: &Piece, shape| {
            let mut w = intra.get();
            w += self.inside(p, work, shape)?;
            intra.set(w);
            Ok(())
        };
        self.hier.aborting(pipeline::run(
            self.pieces.iter().collect(),
            |p| inside(p, Shape::ReduceScatter),
            |p| {
                let Some((did, wire)) = self.across(p, work, &lane, step)? else {
                    return Ok(());
                };
                let mut a = across.lock().unwrap_or_else(|e| e.into_inner());
                a.0.exchanges += did.exchanges;
                a.0.overlapped += did.overlapped;
                a.0.late_sends += did.late_sends;
                a.1 += wire;
                Ok(())
            },
            |p| inside(p, Shape::AllGather),
        ))?;
        self.whole.finish_whole(&lane, work)?;
        let (did, inter) = across.into_inner().unwrap_or_else(|e| e.into_inner());
        lane.count_calls(1, did);
        let mut wire = intra.get();
        wire += inter;
        Ok(Report {
            algo: Algo::Hier,
            wire,
            inter: Some(inter),
        })
    }

    /// The intra-host level `shape` of piece `p`, in place in the f32 `work` buffer.
    fn inside(&self, p: &Piece, work: u64, shape: Shape) -> Result<Wire> {
        let driver = self.whole.driver();
        let device = (&driver, self.whole.ordinal());
        let at = (p.at.clone(), p.mine.start);
        // SAFETY: the call's f32 work buffer (its receive buffer, valid until the call
        // returns: the caller's promise; or the lane's copy, the call's until it ends),
        // piece `p` within it.
        unsafe { intra_level(&self.hier, &self.intra, device, work, at, shape) }
    }

    /// The inter-host level of piece `p`: the compressed all-reduce of this rank's part of
    /// the f32 `work` buffer, step `step` on `lane`. What its exchanges did and its bytes;
    /// None when the part is empty (so it is on every rank of the inter-host comm: they
    /// share the local rank).
    fn across(
        &self,
        p: &Piece,
        work: u64,
        lane: &crate::gpu::sra::state::GpuLane,
        step: u64,
    ) -> Result<Option<(DeviceStats, Wire)>> {
        if p.mine.is_empty() {
            return Ok(None);
        }
        let at = work + 4 * p.mine.start as u64;
        let level = (p.mine.start, p.mine.len(), p.scheme);
        let g = self.whole.part(level, (None, at), self.inter);
        self.hier.inter.execute(|e| {
            let w0 = e.wire;
            let did = g.run_in(e, lane, step)?;
            Ok(Some((did, e.wire - w0)))
        })
    }
}
