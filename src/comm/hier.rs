//! Two-level all-reduce (Horovod's hierarchical allreduce, CGX's multi-node scheme):
//! reduce-scatter inside each host (shared memory), all-reduce of each part among the ranks
//! with the same local rank across hosts (the network), all-gather inside each host. Only
//! 1/local_size of the data crosses the network per rank.

use super::{pipeline, Comm};
use crate::algo::{part, split_parts, AtOnce, PieceIo, Wire};
use crate::codec::layout::CodecMap;
use crate::codec::Site;
use crate::coll::compressed::Coded;
use crate::error::{Error, Result};
use crate::reduce;
use crate::tuning::Workload;
use crate::types::{DType, ReduceOp};
use std::sync::Arc;

/// The two sub-communicators, made on first use.
pub struct Hier {
    /// The ranks of this host, by rank.
    pub(super) intra: Comm,
    /// The ranks with this local rank, one per host, by host.
    pub(super) inter: Comm,
    /// Ranks in the parent comm (for Avg).
    size: usize,
    /// This rank in the parent comm (for the peers' errors).
    rank: usize,
    /// Bytes per pipelined piece (QCCL_CHUNKSIZE; 0: one piece).
    pub(super) piece_bytes: usize,
}

impl Hier {
    /// The pipelined pieces of a call on the hierarchy of `count` elements of `es` bytes
    /// (QCCL_CHUNKSIZE each at most), in elements.
    pub(super) fn pieces(&self, count: usize, es: usize) -> Vec<std::ops::Range<usize>> {
        pipeline::pieces(count, self.piece_bytes / es)
    }

    /// `ran`, a call on the sub-comms; when it failed (midway: its arguments were checked
    /// before), both sub-comms are aborted first, so that the peers fail at once instead of
    /// at their timeout, each aborting its own in turn: the sub-comms' calls are out of step
    /// from then on anyway.
    pub(super) fn aborting<T>(&self, ran: Result<T>) -> Result<T> {
        if let Err(err) = &ran {
            let why = format!("a call on the hierarchy failed midway: {err}");
            let told = format!("(rank {} of the parent comm) failed: {err}", self.rank);
            self.intra.queue.abort_because(&why, &told);
            self.inter.queue.abort_because(&why, &told);
        }
        ran
    }
}

impl Comm {
    /// The sub-communicators, split off the first time (a collective: every rank reaches its
    /// first hierarchical all-reduce at the same point of its operation sequence).
    pub(super) fn hierarchy(&self) -> Result<Arc<Hier>> {
        let mut slot = self.hier.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = slot.as_ref() {
            return Ok(h.clone());
        }
        let color = |v: usize| i32::try_from(v).map_err(|_| Error::invalid("too many hosts"));
        let t = &self.topo;
        let local_rank = |r: usize| t.ranks_of_node[t.node_of[r]].iter().position(|&x| x == r);
        let (intra, inter) = if matches!(self.fabric, super::Fabric::InProc) {
            // Every rank knows the topology: no exchange, so one thread can drive all ranks.
            // Nodes, ranks and local ranks are below the size, which fits (checked).
            color(self.size)?;
            let c = |v: usize| v as i32;
            let local = |r: usize| local_rank(r).unwrap_or(0);
            (
                Some(self.split_known(|r| (c(t.node_of[r]), c(r)))?),
                Some(self.split_known(|r| (c(local(r)), c(t.node_of[r])))?),
            )
        } else {
            (
                self.split_level(color(t.node)?, color(self.rank)?)?,
                self.split_level(color(t.local_rank)?, color(t.node)?)?,
            )
        };
        let (Some(intra), Some(inter)) = (intra, inter) else {
            return Err(Error::Internal(
                "split returned no comm for a valid color".into(),
            ));
        };
        crate::qlog!(
            Info,
            "rank {}: hierarchical all_reduce: intra-host comm of {} on {}, inter-host comm of {}",
            self.rank,
            intra.size(),
            intra.transport_name(),
            inter.size()
        );
        let h = Arc::new(Hier {
            intra,
            inter,
            size: self.size,
            rank: self.rank,
            piece_bytes: self.config.chunksize,
        });
        *slot = Some(h.clone());
        Ok(h)
    }
}

/// The hierarchical all-reduce of `count` elements; in place when `send` is None. Buffers
/// larger than QCCL_CHUNKSIZE go through in pieces, pipelined (`pipeline`): the inter-host
/// all-reduce of one piece runs while the next piece is reduce-scattered inside the host.
pub fn all_reduce(
    h: &Hier,
    send: Option<&[u8]>,
    recv: &mut [u8],
    count: usize,
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    all_reduce_in_pieces(h, send, recv, (count, dtype, op), &AtOnce)
}

/// [`all_reduce`], each piece started once `io` says it landed and reported done to it.
pub(super) fn all_reduce_in_pieces(
    h: &Hier,
    send: Option<&[u8]>,
    recv: &mut [u8],
    (count, dtype, op): (usize, DType, ReduceOp),
    io: &dyn PieceIo,
) -> Result<()> {
    if count == 0 {
        return Ok(());
    }
    // Avg divides once, at the end, so every rank divides the same bits.
    let sum_op = if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    };
    let (local, me) = (h.intra.size(), h.intra.rank());
    let es = dtype.size();
    let bytes: Vec<_> = h
        .pieces(count, es)
        .into_iter()
        .map(|r| r.start * es..r.end * es)
        .collect();
    let sends = bytes.iter().map(|r| send.map(|s| &s[r.clone()]));
    let pieces: Vec<_> = sends
        .zip(split_parts(recv, &bytes))
        .enumerate()
        .map(|(i, (s, r))| (i, s, r))
        .collect();
    h.aborting(pipeline::run(
        pieces,
        |(i, s, r)| {
            io.landed(*i)?;
            let n = r.len() / es;
            h.intra
                .execute(|e| e.reduce_scatter_parts(*s, r, n, dtype, sum_op))
        },
        |(_, _, r)| {
            let mine = part(r.len() / es, local, me, es);
            let n = mine.len() / es;
            h.inter
                .all_reduce_raw(None, &mut r[mine.clone()], n, dtype, sum_op, None)?;
            reduce::finish(dtype, op, &mut r[mine], h.size);
            Ok(())
        },
        |(i, _, r)| {
            let n = r.len() / es;
            h.intra.execute(|e| e.all_gather_parts(r, n, dtype))?;
            io.done(*i);
            Ok(())
        },
    ))
}

/// One piece of a compressed hierarchical all-reduce: its elements, their plan position, their
/// error-feedback residual, and the bytes its intra-host and inter-host phases moved.
struct CodedPiece<'a> {
    /// Its index among the call's pieces.
    index: usize,
    base: usize,
    /// Out of place: the piece's input (`work` then holds nothing until the first phase).
    input: Option<&'a [f32]>,
    work: &'a mut [f32],
    residual: Option<&'a mut [f32]>,
    intra: Wire,
    inter: Wire,
}

/// What a compressed call on the hierarchy does at the edges of each piece: nothing when its
/// buffer was whole and its residual folded in before it started ([`AtOnce`]); a call
/// staged piece by piece (`PreparedAllReduce::run_in_pieces`) makes a piece ready before
/// its first level and finishes it after its last.
pub(super) trait CodedEdges {
    /// Before piece `i`'s first level: its elements `work` (and its `residual`) made ready.
    fn start(&self, i: usize, work: &mut [f32], residual: Option<&mut [f32]>) -> Result<()>;
    /// After piece `i`'s last level: its result `work` finished (pieces end in order).
    fn end(&self, i: usize, work: &mut [f32]) -> Result<()>;
}

impl CodedEdges for AtOnce {
    fn start(&self, _: usize, _: &mut [f32], _: Option<&mut [f32]>) -> Result<()> {
        Ok(())
    }
    fn end(&self, _: usize, _: &mut [f32]) -> Result<()> {
        Ok(())
    }
}

impl Hier {
    /// The compressed hierarchical all-reduce (sum) of `work`: intra-host reduce-scatter,
    /// compressed all-reduce of this rank's part among the ranks with the same local rank,
    /// intra-host all-gather, pipelined over pieces as the dense one. The intra-host phases
    /// are compressed too when `intra_host`. `edges` starts and ends each piece. Returns the
    /// bytes this rank moved over all three phases, and of those the inter-host phase's.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn all_reduce_coded(
        &self,
        input: Option<&[f32]>,
        work: &mut [f32],
        plan: &CodecMap,
        site: Site,
        residual: Option<&mut [f32]>,
        (intra_host, dtype): (bool, DType),
        edges: &dyn CodedEdges,
    ) -> Result<(Wire, Wire)> {
        if work.is_empty() {
            return Ok((Wire::default(), Wire::default()));
        }
        let ranges = self.pieces(work.len(), 4);
        let mut residuals: Vec<Option<&mut [f32]>> = match residual {
            Some(r) => split_parts(r, &ranges).into_iter().map(Some).collect(),
            None => ranges.iter().map(|_| None).collect(),
        };
        let mut pieces: Vec<CodedPiece<'_>> = ranges
            .iter()
            .zip(split_parts(work, &ranges))
            .zip(residuals.iter_mut())
            .enumerate()
            .map(|(index, ((r, work), res))| CodedPiece {
                index,
                base: r.start,
                input: input.map(|i| &i[r.clone()]),
                work,
                residual: res.take(),
                intra: Wire::default(),
                inter: Wire::default(),
            })
            .collect();
        let (local, me) = (self.intra.size(), self.intra.rank());
        let coll = if plan.is_sparse() {
            Workload::Sparse
        } else {
            Workload::Compressed
        };
        // After the inter-host level, the ranks with this local rank on every host hold the
        // same bits of their part; the intra-host all-gather must encode them identically on
        // every host, so its random draws are keyed by the local rank, not the global one.
        let gather_site = Site {
            rank: me as u64,
            ..site
        };
        self.aborting(pipeline::run(
            pieces.iter_mut().collect(),
            |p| {
                edges.start(p.index, p.work, p.residual.as_deref_mut())?;
                let wire = self.intra.execute(|e| {
                    let w0 = e.wire;
                    // Out of place, the reduce-scatter reads the input: only this rank's part
                    // of `work` is written, the all-gather fills the rest.
                    if intra_host {
                        let res = p.residual.as_deref_mut();
                        let coded = Coded::new(plan, site, p.base, res, dtype).input(p.input);
                        e.reduce_scatter_coded(p.work, coded)?;
                    } else {
                        let count = p.work.len();
                        let input = p.input.map(bytemuck::cast_slice);
                        let bytes = bytemuck::cast_slice_mut(&mut *p.work);
                        e.reduce_scatter_parts(input, bytes, count, DType::Float32, ReduceOp::Sum)?;
                    }
                    Ok(e.wire - w0)
                })?;
                p.intra += wire;
                Ok(())
            },
            |p| {
                let mine = part(p.work.len(), local, me, 1);
                // The inter-host comm's own `auto` for this piece: every rank of it holds a
                // part of the same size (they share the local rank).
                let outer = self.inter.choose_flat(coll, mine.len() * dtype.size());
                let wire = self.inter.execute(|e| {
                    let w0 = e.wire;
                    let res = p.residual.as_deref_mut().map(|r| &mut r[mine.clone()]);
                    e.all_reduce_coded(
                        &mut p.work[mine.clone()],
                        Coded::new(plan, site, p.base + mine.start, res, dtype),
                        outer,
                    )?;
                    Ok(e.wire - w0)
                })?;
                p.inter += wire;
                Ok(())
            },
            |p| {
                let wire = self.intra.execute(|e| {
                    let w0 = e.wire;
                    if intra_host {
                        let res = p.residual.as_deref_mut();
                        let coded = Coded::new(plan, gather_site, p.base, res, dtype);
                        e.all_gather_coded(p.work, coded)?;
                    } else {
                        let count = p.work.len();
                        let bytes = bytemuck::cast_slice_mut(&mut *p.work);
                        e.all_gather_parts(bytes, count, DType::Float32)?;
                    }
                    Ok(e.wire - w0)
                })?;
                p.intra += wire;
                edges.end(p.index, p.work)
            },
        ))?;
        let (mut total, mut inter) = (Wire::default(), Wire::default());
        for p in &pieces {
            total += p.intra;
            total += p.inter;
            inter += p.inter;
        }
        Ok((total, inter))
    }
}

impl Hier {
    /// (ranks on this host, this rank's index among them).
    pub(super) fn intra_shape(&self) -> (usize, usize) {
        (self.intra.size(), self.intra.rank())
    }

    /// Dense intra-host reduce-scatter (sum) of f32 `work` in near-equal parts.
    pub(super) fn intra_reduce_scatter(&self, work: &mut [f32]) -> Result<Wire> {
        let count = work.len();
        self.intra.execute(|e| {
            let w0 = e.wire;
            let bytes = bytemuck::cast_slice_mut(work);
            e.reduce_scatter_parts(None, bytes, count, DType::Float32, ReduceOp::Sum)?;
            Ok(e.wire - w0)
        })
    }

    /// Dense intra-host all-gather of f32 `work` in near-equal parts.
    pub(super) fn intra_all_gather(&self, work: &mut [f32]) -> Result<Wire> {
        let count = work.len();
        self.intra.execute(|e| {
            let w0 = e.wire;
            e.all_gather_parts(bytemuck::cast_slice_mut(work), count, DType::Float32)?;
            Ok(e.wire - w0)
        })
    }

    /// All-gather of equal-length byte blocks among the ranks with this local rank, in host
    /// order.
    pub(super) fn inter_all_gather(&self, mine: &[u8]) -> Result<(Vec<u8>, Wire)> {
        let m = self.inter.size();
        let mut all = vec![0u8; mine.len() * m];
        let wire = self.inter.execute(|e| {
            let w0 = e.wire;
            e.all_gather(Some(mine), &mut all, mine.len(), DType::Uint8)?;
            Ok(e.wire - w0)
        })?;
        Ok((all, wire))
    }

    /// The dense hierarchical all-reduce (2DTAR) of `buf`, returning its bytes.
    pub(super) fn all_reduce_dense(
        &self,
        buf: &mut [u8],
        count: usize,
        dtype: DType,
    ) -> Result<Wire> {
        let mut wire = Wire::default();
        let w = |c: &Comm| c.execute(|e| Ok(e.wire));
        let (a0, b0) = (w(&self.intra)?, w(&self.inter)?);
        all_reduce(self, None, buf, count, dtype, ReduceOp::Sum)?;
        wire += w(&self.intra)? - a0;
        wire += w(&self.inter)? - b0;
        Ok(wire)
    }
}
