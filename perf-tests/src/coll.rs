//! The collectives under test: buffer shapes (as nccl-tests sizes them), bus-bandwidth
//! factors, and for each one how to run it, fill its inputs and check its outputs.

use crate::elem::{Elem, Filler, Want};
use qccl::{Algo, Comm, Compression, ReduceOp, Result, TopK, TopKScheme, Wire};
use std::time::Duration;

/// A collective the benchmark can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coll {
    /// `all_reduce`.
    AllReduce,
    /// `reduce_scatter`.
    ReduceScatter,
    /// `all_gather`.
    AllGather,
    /// `broadcast` from the root.
    Broadcast,
    /// `reduce` onto the root.
    Reduce,
    /// `all_to_all`.
    AllToAll,
    /// Ring shift: rank r sends to r+1 and receives from r−1 (see [`sendrecv`]).
    SendRecv,
    /// `gather` onto the root.
    Gather,
    /// `scatter` from the root.
    Scatter,
    /// `topk_all_reduce` with a scheme: HiTopKComm or one of its paper's baselines (a sum of
    /// float data, in place; see [`Coll::sparse`]).
    TopK(TopKScheme),
}

/// Element counts of one size: what the table's count column shows and the buffer lengths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Count passed to the collective (per rank for the partitioned ones).
    pub count: usize,
    /// Elements of the send buffer.
    pub send: usize,
    /// Elements of the receive buffer.
    pub recv: usize,
}

impl Shape {
    /// Bytes of the larger buffer: the table's size column and the algbw numerator.
    pub fn bytes(&self, elem_size: usize) -> u64 {
        (self.send.max(self.recv) * elem_size) as u64
    }
}

impl Coll {
    /// Every collective, in the order the tests run them.
    #[cfg(test)]
    pub const ALL: [Coll; 13] = [
        Coll::AllReduce,
        Coll::ReduceScatter,
        Coll::AllGather,
        Coll::Broadcast,
        Coll::Reduce,
        Coll::AllToAll,
        Coll::SendRecv,
        Coll::Gather,
        Coll::Scatter,
        Coll::TopK(TopKScheme::HiTopK),
        Coll::TopK(TopKScheme::NaiveAg),
        Coll::TopK(TopKScheme::TreeAr),
        Coll::TopK(TopKScheme::TwoDTar),
    ];

    /// Name as nccl-tests' binaries spell it (without `_perf`).
    pub fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "all_reduce",
            Coll::ReduceScatter => "reduce_scatter",
            Coll::AllGather => "all_gather",
            Coll::Broadcast => "broadcast",
            Coll::Reduce => "reduce",
            Coll::AllToAll => "alltoall",
            Coll::SendRecv => "sendrecv",
            Coll::Gather => "gather",
            Coll::Scatter => "scatter",
            Coll::TopK(s) => s.name(),
        }
    }

    /// Parses a name; case, `_` and `-` do not matter (`allreduce`, `all_reduce`, `AllReduce`).
    pub fn parse(s: &str) -> std::result::Result<Coll, String> {
        let k: String = s
            .chars()
            .filter(|c| *c != '_' && *c != '-')
            .collect::<String>()
            .to_ascii_lowercase();
        Ok(match k.as_str() {
            "allreduce" | "ar" => Coll::AllReduce,
            "reducescatter" | "rs" => Coll::ReduceScatter,
            "allgather" | "ag" => Coll::AllGather,
            "broadcast" | "bcast" => Coll::Broadcast,
            "reduce" => Coll::Reduce,
            "alltoall" | "a2a" => Coll::AllToAll,
            "sendrecv" | "p2p" => Coll::SendRecv,
            "gather" => Coll::Gather,
            "scatter" => Coll::Scatter,
            // Spelled out rather than through TopKScheme::parse, whose aliases `tree` and
            // `hier` read like -A's all-reduce algorithms.
            "hitopk" => Coll::TopK(TopKScheme::HiTopK),
            "naiveag" => Coll::TopK(TopKScheme::NaiveAg),
            "treear" => Coll::TopK(TopKScheme::TreeAr),
            "2dtar" => Coll::TopK(TopKScheme::TwoDTar),
            _ => {
                return Err(format!(
                    "unknown collective '{s}' (allreduce, reduce_scatter, all_gather, broadcast, \
                     reduce, alltoall, sendrecv, gather, scatter, hitopk, naiveag, treear, 2dtar)"
                ))
            }
        })
    }

    /// True when the collective reduces (the redop column and -o apply).
    pub fn has_op(self) -> bool {
        matches!(
            self,
            Coll::AllReduce | Coll::ReduceScatter | Coll::Reduce | Coll::TopK(_)
        )
    }

    /// The top-k scheme, for the HiTopKComm collectives.
    pub fn topk(self) -> Option<TopKScheme> {
        match self {
            Coll::TopK(s) => Some(s),
            _ => None,
        }
    }

    /// True for the sparsifying schemes (hitopk, naiveag): lossy by design, so they run on
    /// the codecs' inputs and are held to finite outputs and a relative error; the dense
    /// baselines (treear, 2dtar) are exact sums and checked as all_reduce is.
    pub fn sparse(self) -> bool {
        matches!(self, Coll::TopK(TopKScheme::HiTopK | TopKScheme::NaiveAg))
    }

    /// True when the collective has a root (-r applies).
    pub fn rooted(self) -> bool {
        matches!(
            self,
            Coll::Broadcast | Coll::Reduce | Coll::Gather | Coll::Scatter
        )
    }

    /// True when qccl's API has an in-place form (all_to_all, gather, scatter and send/recv
    /// take separate buffers).
    pub fn has_in_place(self) -> bool {
        matches!(
            self,
            Coll::AllReduce
                | Coll::ReduceScatter
                | Coll::AllGather
                | Coll::Broadcast
                | Coll::Reduce
                | Coll::TopK(_)
        )
    }

    /// nccl-tests' bus-bandwidth factor for `n` ranks.
    pub fn busbw_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            // The top-k schemes on the uncompressed size, as all_reduce: how fast the user's
            // tensor got summed, comparable across schemes and with NCCL.
            Coll::AllReduce | Coll::TopK(_) => 2.0 * (n - 1.0) / n,
            Coll::ReduceScatter
            | Coll::AllGather
            | Coll::AllToAll
            | Coll::Gather
            | Coll::Scatter => (n - 1.0) / n,
            Coll::Broadcast | Coll::Reduce | Coll::SendRecv => 1.0,
        }
    }

    /// Buffer shape for `elems` elements of total size on `n` ranks (nccl-tests'
    /// `getCollByteCount`: partitioned collectives round down to a multiple of `n`).
    pub fn shape(self, elems: usize, n: usize) -> Shape {
        let per = elems / n;
        match self {
            Coll::AllReduce | Coll::Broadcast | Coll::Reduce | Coll::SendRecv | Coll::TopK(_) => {
                Shape {
                    count: elems,
                    send: elems,
                    recv: elems,
                }
            }
            Coll::ReduceScatter | Coll::Scatter => Shape {
                count: per,
                send: per * n,
                recv: per,
            },
            Coll::AllGather | Coll::Gather => Shape {
                count: per,
                send: per,
                recv: per * n,
            },
            Coll::AllToAll => Shape {
                count: per,
                send: per * n,
                recv: per * n,
            },
        }
    }
}

/// Everything a run needs besides the buffers.
pub struct Ctx<'a> {
    /// The communicator.
    pub comm: &'a Comm,
    /// This rank.
    pub rank: usize,
    /// Ranks in the comm.
    pub n: usize,
    /// `-r`.
    pub root: usize,
    /// Reduction op (Sum for collectives without one).
    pub op: ReduceOp,
    /// `-A`.
    pub algo: Algo,
    /// Deterministic inputs.
    pub fill: Filler,
    /// `-Z`: the all-reduce runs compressed with this (keyed per size); None: plain.
    pub compression: Option<Compression>,
    /// The top-k collectives' options (density, key per size); None for the others.
    pub topk: Option<TopK>,
}

/// What one call reports back.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ran {
    /// The all-reduce algorithm (schedule) the call resolved to; None for other collectives.
    pub algo: Option<Algo>,
    /// Payload bytes this rank moved, for compressed and top-k calls.
    pub wire: Option<Wire>,
    /// Of `wire`, the inter-host level's bytes of a hierarchical compressed all-reduce.
    pub inter: Option<Wire>,
    /// A top-k call's step times (HiTopKComm's four, zero for the baselines) and, of the
    /// third, the scatter-add alone.
    pub steps: Option<([Duration; 4], Duration)>,
    /// Elements this rank selected in a top-k call (0 for the dense baselines).
    pub k: usize,
}

/// Ring shift with qccl's blocking, separate send and recv: even ranks send to r+1 then
/// receive from r−1, odd ranks receive first. With 2 ranks (or any even number) this is two
/// back-to-back phases, each moving `count` elements over every other link, so one iteration
/// costs about two one-way transfers: the reported busbw is about half of what a concurrent
/// sendrecv (nccl-tests' grouped ncclSend+ncclRecv) would show on the same links. With an odd
/// number of ranks the last rank's send waits for rank 0's second phase, so a third phase
/// appears. With 1 rank it is a local copy.
fn sendrecv<T: Elem>(ctx: &Ctx<'_>, send: &[T], recv: &mut [T]) -> Result<()> {
    if ctx.n == 1 {
        recv.copy_from_slice(send);
        return Ok(());
    }
    let next = (ctx.rank + 1) % ctx.n;
    let prev = (ctx.rank + ctx.n - 1) % ctx.n;
    if ctx.rank.is_multiple_of(2) {
        ctx.comm.send(send, next)?;
        ctx.comm.recv(recv, prev)
    } else {
        ctx.comm.recv(recv, prev)?;
        ctx.comm.send(send, next)
    }
}

/// Runs `coll` once on the shape's leading parts of `send` and `recv`. In place, the data
/// lives in `send` for reduce_scatter (the n·count buffer) and in `recv` otherwise. Returns the
/// all-reduce algorithm used, for all_reduce, and the wire bytes of a compressed all_reduce.
pub fn run<T: Elem>(
    ctx: &Ctx<'_>,
    coll: Coll,
    in_place: bool,
    send: &mut [T],
    recv: &mut [T],
) -> Result<Ran> {
    let (c, op) = (ctx.comm, ctx.op);
    if let (Coll::AllReduce, Some(z)) = (coll, &ctx.compression) {
        let rep = if in_place {
            c.all_reduce_compressed(recv, op, z)?
        } else {
            c.all_reduce_compressed_out_of_place(send, recv, op, z)?
        };
        return Ok(Ran {
            algo: Some(rep.algo),
            wire: Some(rep.wire),
            inter: rep.inter,
            ..Ran::default()
        });
    }
    if let Coll::TopK(scheme) = coll {
        // The API is in place only, as the compressed all-reduce's: out of place is the same
        // copy then the in-place call as there.
        if !in_place {
            recv.copy_from_slice(send);
        }
        let o = ctx.topk.as_ref().unwrap_or_else(|| {
            unreachable!("bench sets the top-k options for --coll {}", coll.name())
        });
        let rep = c.topk_all_reduce(recv, scheme, o)?;
        return Ok(Ran {
            algo: None,
            wire: Some(rep.wire),
            inter: None,
            steps: Some((rep.steps, rep.scatter_add)),
            k: rep.k,
        });
    }
    let algo = match (coll, in_place) {
        (Coll::AllReduce, false) => c.all_reduce_with(Some(send), recv, op, ctx.algo)?,
        (Coll::AllReduce, true) => c.all_reduce_with(None, recv, op, ctx.algo)?,
        _ => {
            other(ctx, coll, in_place, send, recv)?;
            return Ok(Ran::default());
        }
    };
    Ok(Ran {
        algo: Some(algo),
        ..Ran::default()
    })
}

/// Every collective but all_reduce.
fn other<T: Elem>(
    ctx: &Ctx<'_>,
    coll: Coll,
    in_place: bool,
    send: &mut [T],
    recv: &mut [T],
) -> Result<()> {
    let c = ctx.comm;
    let (root, op) = (ctx.root, ctx.op);
    match (coll, in_place) {
        (Coll::AllReduce | Coll::TopK(_), _) => unreachable!("{} runs in run()", coll.name()),
        (Coll::ReduceScatter, false) => c.reduce_scatter(send, recv, op)?,
        (Coll::ReduceScatter, true) => c.reduce_scatter_in_place(send, op)?,
        (Coll::AllGather, false) => c.all_gather(send, recv)?,
        (Coll::AllGather, true) => c.all_gather_in_place(recv)?,
        (Coll::Broadcast, false) => c.broadcast(send, recv, root)?,
        (Coll::Broadcast, true) => c.broadcast_in_place(recv, root)?,
        (Coll::Reduce, false) => c.reduce(send, recv, op, root)?,
        (Coll::Reduce, true) => c.reduce_in_place(recv, op, root)?,
        (Coll::AllToAll, false) => c.all_to_all(send, recv)?,
        (Coll::SendRecv, false) => sendrecv(ctx, send, recv)?,
        (Coll::Gather, false) => c.gather(send, recv, root)?,
        (Coll::Scatter, false) => c.scatter(send, recv, root)?,
        (_, true) => unreachable!("{} has no in-place form", coll.name()),
    }
    Ok(())
}

/// Fills the inputs of one checked run (outputs get garbage that cannot pass the check).
pub fn init<T: Elem>(
    ctx: &Ctx<'_>,
    coll: Coll,
    sh: Shape,
    in_place: bool,
    send: &mut [T],
    recv: &mut [T],
) {
    let f = &ctx.fill;
    let (r, root) = (ctx.rank, ctx.root);
    let own = |buf: &mut [T]| f.fill(buf, r, 0);
    f.garbage(recv, r);
    f.garbage(send, r);
    match (coll, in_place) {
        (Coll::AllReduce | Coll::Reduce | Coll::TopK(_), false) => own(send),
        (Coll::AllReduce | Coll::Reduce | Coll::TopK(_), true) => own(recv),
        (Coll::ReduceScatter, _)
        | (Coll::AllToAll | Coll::SendRecv | Coll::AllGather | Coll::Gather, false) => own(send),
        (Coll::AllGather, true) => own(&mut recv[r * sh.count..(r + 1) * sh.count]),
        (Coll::Broadcast, false) | (Coll::Scatter, false) if r == root => own(send),
        (Coll::Broadcast, true) if r == root => own(recv),
        _ => {}
    }
}

/// Counts this rank's wrong output elements after a run that [`init`] prepared.
pub fn check<T: Elem>(
    ctx: &Ctx<'_>,
    coll: Coll,
    sh: Shape,
    in_place: bool,
    send: &[T],
    recv: &[T],
) -> u64 {
    let f = &ctx.fill;
    let (r, n, root, k) = (ctx.rank, ctx.n, ctx.root, sh.count);
    let reduced = |i: usize| f.reduced::<T>(ctx.op, n, i);
    let from = |q: usize, i: usize| Want::Exact(f.value::<T>(q, i));
    match coll {
        // The sparse schemes are checked with accuracy(), not here.
        Coll::AllReduce | Coll::TopK(_) => count(recv, reduced),
        Coll::ReduceScatter => {
            let out = if in_place {
                &send[r * k..(r + 1) * k]
            } else {
                recv
            };
            count(out, |j| reduced(r * k + j))
        }
        Coll::AllGather => count(recv, |i| from(i / k.max(1), i % k.max(1))),
        Coll::Broadcast => count(recv, |i| from(root, i)),
        Coll::Reduce if r == root => count(recv, reduced),
        Coll::AllToAll => count(recv, |i| from(i / k.max(1), r * k + i % k.max(1))),
        Coll::SendRecv => count(recv, |i| from((r + n - 1) % n, i)),
        Coll::Gather if r == root => count(recv, |i| from(i / k.max(1), i % k.max(1))),
        Coll::Scatter => count(recv, |j| from(root, r * k + j)),
        Coll::Reduce | Coll::Gather => 0,
    }
}

/// How close one compressed all_reduce that [`init`] prepared came to the exact result.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Accuracy {
    /// Elements that are not finite, or off by more than the tolerance of [`accuracy`].
    pub wrong: u64,
    /// ‖out − exact‖₂ / ‖exact‖₂ over the whole buffer (inf if an output is not finite).
    pub rel_err: f64,
}

/// Compares this rank's all_reduce output with the float64 reduction of every rank's input
/// (every rank holds the whole result, so this rank's view is the whole answer).
///
/// `bound` is the codec's relative error of one encode. A value passes when it is finite and,
/// if there is a bound, within (n+1)·bound·max|exact| of the exact value, plus the type's own
/// tolerance (ε·n·|exact|, for the rounding back to a 16-bit type): along any schedule an
/// element is encoded at most n+1 times (n−1 partial sums, the reduced chunk, and once more
/// where a schedule re-encodes), each time with an error of at most bound·|what it encodes|,
/// and partial sums stay within about max|exact| for these inputs. Codecs without a bound
/// (sparsifiers drop most elements by design) are only held to finite outputs; their
/// `relerr` is the measure.
pub fn accuracy<T: Elem>(ctx: &Ctx<'_>, recv: &[T], bound: Option<f64>) -> Accuracy {
    let f = &ctx.fill;
    let exact = |i: usize| match f.reduced::<T>(ctx.op, ctx.n, i) {
        Want::Near(e, tol) => (e, tol),
        Want::Exact(x) => (x.to_f64(), 0.0),
    };
    let (mut err2, mut norm2, mut max_abs) = (0f64, 0f64, 0f64);
    for (i, g) in recv.iter().enumerate() {
        let e = exact(i).0;
        let d = g.to_f64() - e;
        err2 += d * d;
        norm2 += e * e;
        max_abs = max_abs.max(e.abs());
    }
    let rel_err = if !err2.is_finite() {
        // A non-finite output: inf rather than NaN, so that a max over ranks keeps it.
        f64::INFINITY
    } else if norm2 > 0.0 {
        (err2 / norm2).sqrt()
    } else if err2 == 0.0 {
        0.0
    } else {
        f64::INFINITY
    };
    let slack = bound.map(|b| (ctx.n as f64 + 1.0) * b * max_abs);
    let wrong = recv
        .iter()
        .enumerate()
        .filter(|&(i, g)| {
            let x = g.to_f64();
            if !x.is_finite() {
                return true;
            }
            slack.is_some_and(|s| {
                let (e, tol) = exact(i);
                (x - e).abs() > s + tol
            })
        })
        .count() as u64;
    Accuracy { wrong, rel_err }
}

fn count<T: Elem>(got: &[T], want: impl Fn(usize) -> Want<T>) -> u64 {
    got.iter()
        .enumerate()
        .filter(|&(i, g)| !want(i).accepts(*g))
        .count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_and_factors() {
        // 1000 floats on 3 ranks: partitioned collectives round down to 333 per rank.
        let s = Coll::ReduceScatter.shape(1000, 3);
        assert_eq!((s.count, s.send, s.recv, s.bytes(4)), (333, 999, 333, 3996));
        let s = Coll::AllGather.shape(1000, 3);
        assert_eq!((s.count, s.send, s.recv), (333, 333, 999));
        assert_eq!(Coll::AllReduce.shape(1000, 3).bytes(4), 4000);
        assert_eq!(Coll::AllReduce.busbw_factor(4), 1.5);
        assert_eq!(Coll::AllGather.busbw_factor(4), 0.75);
        assert_eq!(Coll::SendRecv.busbw_factor(4), 1.0);
        for c in Coll::ALL {
            assert_eq!(Coll::parse(c.name()), Ok(c));
        }
        assert_eq!(Coll::parse("AllReduce"), Ok(Coll::AllReduce));
        assert!(Coll::parse("allreduce2").is_err());
        assert_eq!(Coll::parse("2D_TAR"), Ok(Coll::TopK(TopKScheme::TwoDTar)));
        assert_eq!(Coll::parse("naive-ag"), Ok(Coll::TopK(TopKScheme::NaiveAg)));
        assert_eq!(Coll::TopK(TopKScheme::HiTopK).busbw_factor(4), 1.5);
        assert!(
            Coll::parse("tree").is_err(),
            "-A's names are not collectives"
        );
    }

    #[test]
    fn accuracy_counts_outside_the_bound_and_non_finite() {
        let comm = Comm::init_threads(1, qccl::Config::default())
            .unwrap()
            .pop()
            .unwrap();
        // accuracy() only reads the filler, op and n: pretend to be rank 0 of 4.
        let ctx = Ctx {
            comm: &comm,
            rank: 0,
            n: 4,
            root: 0,
            op: ReduceOp::Sum,
            algo: Algo::Auto,
            fill: Filler {
                op: ReduceOp::Sum,
                n: 4,
                lossy: true,
            },
            compression: None,
            topk: None,
        };
        let exact: Vec<f64> = (0..1000)
            .map(|i| match ctx.fill.reduced::<f32>(ReduceOp::Sum, 4, i) {
                Want::Near(e, _) => e,
                Want::Exact(_) => unreachable!(),
            })
            .collect();
        let max = exact.iter().fold(0f64, |m, e| m.max(e.abs()));
        let mut out: Vec<f32> = exact.iter().map(|&e| e as f32).collect();
        let a = accuracy(&ctx, &out, Some(1e-3));
        assert_eq!(a.wrong, 0);
        assert!(a.rel_err < 1e-6, "{a:?}");
        // Within (n+1)·bound·max|exact| passes, twice that fails; NaN always fails.
        out[3] = (exact[3] + 4.0 * 1e-3 * max) as f32;
        out[5] = (exact[5] + 10.0 * 1e-3 * max) as f32;
        let a = accuracy(&ctx, &out, Some(1e-3));
        assert_eq!(a.wrong, 1, "{a:?}");
        assert!(a.rel_err > 1e-4 && a.rel_err.is_finite(), "{a:?}");
        // No bound: only non-finite outputs count.
        assert_eq!(accuracy(&ctx, &out, None).wrong, 0);
        out[7] = f32::NAN;
        let a = accuracy(&ctx, &out, None);
        assert_eq!(a.wrong, 1);
        assert_eq!(a.rel_err, f64::INFINITY);
    }
}
