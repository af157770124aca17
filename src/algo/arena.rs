//! All-reduce (as SRA), reduce-scatter and all-gather through the shared-memory arena
//! (`transport::shm::arena`), for comms whose ranks all share one host.
//!
//! Each round covers one slice of every owner's chunk. Every rank copies its contribution for
//! owner q into its own segment; owner q reduces its own input and the peers' contributions
//! (in rank order) straight out of their segments into its output, and into its result area
//! when the others need it; every rank copies each owner's result out. Reduce-scatter stops
//! after the reduction; all-gather skips it (the owner publishes its own data). Rounds
//! pipeline over the arena's slots, and one loop progresses whatever is ready (stage ahead,
//! reduce, copy out), so no rank waits on a step it could overlap.
//!
//! Small all-reduces go in one shot instead: every rank stages its whole input and folds all
//! of them: one synchronisation point (up to [`ONE_SHOT_MAX_FOLDED`]).

use super::{part, sub, Ctx};
use crate::reduce;
use crate::transport::shm::arena::{Arena, CHUNK};
use crate::transport::wait::Waiter;
use crate::{DType, ReduceOp, Result};
use std::ops::Range;

/// Reduction block: the result block stays in L1 while every contribution is added to it.
const BLOCK: usize = 16 << 10;

/// Buffer size from which results go to the caller's buffer with streaming stores: a normal
/// store to a line not in cache reads it first. Out of place (2-core Intel VM): 4 ranks 4–16
/// MiB +10–40%, 2 ranks 64–256 MiB +20–25%, no loss at 2 ranks 1–16 MiB. In place the lines
/// were just read for staging, and there the two machines differ: the Intel VM lost (2 ranks
/// 64 MiB 6.0–6.4 → 4.8 GB/s), the AMD EPYC VM gains (2 ranks 16–256 MiB, four interleaved
/// runs: 5.6–7.7 GB/s against 3.7–6.6). The project's machines are the AMD kind now.
const STREAM_MIN_BYTES: usize = 4 << 20;

/// All-reduce of `count` elements (chunks as `part` splits them); out of place when `send`
/// is given. False (nothing moved) when the comm has no arena.
pub fn all_reduce(
    ctx: &mut Ctx<'_>,
    send: Option<&[u8]>,
    buf: &mut [u8],
    count: usize,
) -> Result<bool> {
    if one_shot(ctx, send, buf)? {
        return Ok(true);
    }
    run(ctx, Shape::AllReduce, send, buf, count)
}

/// Most bytes a rank folds in a one-shot all-reduce (buffer × ranks); larger calls go through
/// SRA. Measured (2-CPU VM, µs per call, one-shot against SRA): 4 ranks 1 KiB 4.0 / 7.0,
/// 4 KiB 5.2 / 7.5, 16 KiB 9.7 / 11.0, 24 KiB on par, 32 KiB 16 / 14.8; 3 ranks 4 KiB
/// 4.0 / 6.2-8.2, 16 KiB on par, 32 KiB behind; 8 ranks 4 KiB 12.6 / 19.5, 16 KiB 25-29 / 23.5;
/// 2 ranks on par to 32 KiB, behind at 64 KiB.
const ONE_SHOT_MAX_FOLDED: usize = 64 << 10;

/// True when an all-reduce of `len` bytes on `n` ranks through an arena of `chunk`-byte
/// areas goes in one shot, not in SRA rounds.
pub fn one_shot_fits(n: usize, chunk: usize, len: usize) -> bool {
    len * n <= ONE_SHOT_MAX_FOLDED && len <= chunk
}

/// One-shot all-reduce: every rank stages its whole input, and once all have, folds all of
/// them in rank order into its output. One synchronisation point instead of SRA's two, and a
/// rank that finished folds can stage its next call at once, so ranks that share a core hand
/// it over about once per call; but each rank reduces the whole buffer, n times SRA's share.
/// False (nothing moved) when the comm has no arena or the buffer is too large for one shot.
fn one_shot(ctx: &mut Ctx<'_>, send: Option<&[u8]>, buf: &mut [u8]) -> Result<bool> {
    let (desc, dtype, op) = (ctx.desc, ctx.dtype, ctx.op);
    let Some(arena) = ctx.t.arena()? else {
        return Ok(false);
    };
    let (n, len) = (arena.size(), buf.len());
    if !one_shot_fits(n, arena.chunk(), len) {
        return Ok(false);
    }
    let round = arena.next_round();
    let mut waiter = Waiter::new(arena.link_config());
    let mut staged = false;
    loop {
        let seen = arena.bell();
        if !staged {
            let input: &[u8] = send.unwrap_or(buf);
            staged = arena.try_stage_whole(&desc, round, |area| {
                area[..len].copy_from_slice(input);
            });
        }
        if staged {
            let done = arena.try_gather(&desc, round, |inputs| {
                let mut all = inputs.iter().map(|i| &i[..len]);
                reduce::fold(dtype, op, buf, all.next(), all);
                reduce::finish(dtype, op, buf, n);
            })?;
            if done {
                break;
            }
        }
        arena.idle(&mut waiter, seen, &desc, || {
            format!(
                "shared-memory arena stalled in {desc} (one-shot round {}: {})",
                round,
                if staged {
                    "staged, waiting for the peers' inputs"
                } else {
                    "waiting for a free slot"
                }
            )
        })?;
    }
    ctx.wire.sent += len as u64;
    ctx.wire.received += (len * (n - 1)) as u64;
    Ok(true)
}

/// Reduce-scatter of `count` elements split as `part` splits them: out of place `send` holds
/// all of them and `out` gets this rank's part; in place (`send` None) `out` is the whole
/// buffer and the part is reduced where it lies. False when the comm has no arena.
pub fn reduce_scatter(
    ctx: &mut Ctx<'_>,
    send: Option<&[u8]>,
    out: &mut [u8],
    count: usize,
) -> Result<bool> {
    run(ctx, Shape::ReduceScatter, send, out, count)
}

/// All-gather of `count` elements split as `part` splits them: part r comes from rank r,
/// from `send` when given, else already in place in `buf`. False when the comm has no arena.
pub fn all_gather(
    ctx: &mut Ctx<'_>,
    send: Option<&[u8]>,
    buf: &mut [u8],
    count: usize,
) -> Result<bool> {
    run(ctx, Shape::AllGather, send, buf, count)
}

/// Which collective a round loop runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Shape {
    /// Reduce, then every rank copies every owner's result.
    AllReduce,
    /// Reduce; each owner keeps its result.
    ReduceScatter,
    /// Each owner publishes its own part; every rank copies them.
    AllGather,
}

impl Shape {
    /// Owners reduce contributions.
    pub fn reduces(self) -> bool {
        self != Shape::AllGather
    }

    /// Every rank copies every owner's result.
    pub fn gathers(self) -> bool {
        self != Shape::ReduceScatter
    }
}

/// How a collective of `count` elements splits into rounds: owner q's chunk (`part`), cut
/// into `rounds` slices of at most the arena's chunk. Every rank of the call computes the
/// same one, whatever its buffers (host here, device in `gpu::arena`).
pub struct Rounds {
    /// Owner q's whole-buffer byte range.
    pub chunks: Vec<Range<usize>>,
    /// Rounds of the call (at least 1).
    pub rounds: usize,
    es: usize,
}

impl Rounds {
    /// The rounds of `count` elements of `es` bytes on `arena`.
    pub fn new(arena: &Arena, count: usize, es: usize) -> Rounds {
        Rounds::of(arena.size(), arena.chunk(), count, es)
    }

    /// The rounds of `count` elements of `es` bytes on `n` ranks, at most `chunk` bytes per
    /// owner per round (the arena's `chunk`).
    pub fn of(n: usize, chunk: usize, count: usize, es: usize) -> Rounds {
        let chunks: Vec<Range<usize>> = (0..n).map(|c| part(count, n, c, es)).collect();
        // Rounds of at most the arena's chunk, and at least 8 of them while they can stay at
        // CHUNK or more: a buffer of a few rounds would not pipeline (2 ranks, 1 MiB: 512 KiB
        // rounds 250 µs, 128 KiB 118 µs).
        let largest = chunks.iter().map(|c| c.len()).max().unwrap_or(0);
        let per_round = (largest / 8).clamp(CHUNK.min(chunk), chunk) / es;
        let rounds = largest.div_ceil(es).div_ceil(per_round).max(1);
        Rounds { chunks, rounds, es }
    }

    /// Round `s`'s slice of owner `q`'s chunk (whole-buffer byte range).
    pub fn slice(&self, q: usize, s: usize) -> Range<usize> {
        sub(&self.chunks[q], self.rounds, s, self.es)
    }
}

/// The round loop over `count` elements in `part`'s chunks, one per owner. `buf` holds the
/// whole buffer, except for an out-of-place reduce-scatter, where it is this rank's chunk
/// alone; `send` is the whole input (all-reduce, reduce-scatter) or this rank's chunk
/// (all-gather).
fn run(
    ctx: &mut Ctx<'_>,
    shape: Shape,
    send: Option<&[u8]>,
    buf: &mut [u8],
    count: usize,
) -> Result<bool> {
    let (desc, dtype, op) = (ctx.desc, ctx.dtype, ctx.op);
    let Some(arena) = ctx.t.arena()? else {
        return Ok(false);
    };
    let (n, me) = (arena.size(), arena.rank());
    let plan = Rounds::new(arena, count, dtype.size());
    let (chunks, rounds) = (&plan.chunks, plan.rounds);
    // Where this rank's chunk starts in `buf`.
    let own_at = match (shape, send) {
        (Shape::ReduceScatter, Some(_)) => 0,
        _ => chunks[me].start,
    };
    let (reduces, gathers) = (shape.reduces(), shape.gathers());
    // Round s covers slice s of every owner's chunk (whole-buffer byte ranges).
    let slice = |q: usize, s: usize| plan.slice(q, s);
    // This rank's slice s within `buf`, and within its own chunk.
    let own_out = |s: usize| {
        let r = slice(me, s);
        r.start - chunks[me].start + own_at..r.end - chunks[me].start + own_at
    };
    let own_rel = |s: usize| {
        let r = slice(me, s);
        r.start - chunks[me].start..r.end - chunks[me].start
    };
    let streaming = chunks[n - 1].end >= STREAM_MIN_BYTES;
    let put: fn(&mut [u8], &[u8]) = if streaming {
        reduce::stream::copy
    } else {
        |d, s| d.copy_from_slice(s)
    };
    let base = arena.begin(rounds);
    let mut waiter = Waiter::new(arena.link_config());
    let (mut staged, mut reduced, mut copied) = (0, 0, 0);
    let mut have = vec![false; n]; // owners whose result of round `copied` is copied out
    let (mut sent, mut received) = (0u64, 0u64);
    while copied < rounds {
        let seen = arena.bell();
        let mut moved = false;
        // Stage ahead as far as the slots allow: the owners can reduce while this rank waits.
        // An all-gather stages nothing but the call's descriptor, which the owners check.
        while staged < rounds {
            let input: &[u8] = send.unwrap_or(buf);
            let ok = arena.try_stage(&desc, base + staged as u64, |q, area| {
                if reduces {
                    let src = &input[slice(q, staged)];
                    area[..src.len()].copy_from_slice(src);
                    sent += src.len() as u64;
                }
            });
            if !ok {
                break;
            }
            staged += 1;
            moved = true;
        }
        if reduced < staged {
            let out = &mut buf[own_out(reduced)];
            let ok = arena.try_reduce(&desc, base + reduced as u64, |srcs, result| {
                let result = &mut result[..out.len()];
                match shape {
                    // Published first: `put` may stream, and streamed bytes are not read back.
                    Shape::AllGather => match send {
                        Some(s) => {
                            result.copy_from_slice(&s[own_rel(reduced)]);
                            put(out, &s[own_rel(reduced)]);
                        }
                        None => result.copy_from_slice(out),
                    },
                    _ => {
                        let own = send.map(|s| &s[slice(me, reduced)]);
                        reduce_round(dtype, op, n, own, srcs, result, out, gathers, put);
                        received += (out.len() * srcs.len()) as u64;
                    }
                }
                if gathers {
                    sent += (out.len() * (n - 1)) as u64;
                }
            })?;
            if ok {
                reduced += 1;
                moved = true;
            }
        }
        if copied < reduced {
            for q in 0..n {
                if q == me || have[q] || !gathers {
                    continue;
                }
                let dst = &mut buf[slice(q, copied)];
                have[q] = arena.try_copy(q, base + copied as u64, |result| {
                    put(dst, &result[..dst.len()]);
                });
                if have[q] {
                    received += dst.len() as u64;
                    moved = true;
                }
            }
            if !gathers || (0..n).all(|q| q == me || have[q]) {
                arena.copied(base + copied as u64);
                have.fill(false);
                copied += 1;
                moved = true;
            }
        }
        if moved {
            waiter.progressed();
        } else {
            arena.idle(&mut waiter, seen, &desc, || {
                format!(
                    "shared-memory arena stalled in {desc} (rounds staged {staged}, reduced \
                     {reduced}, copied {copied} of {rounds})"
                )
            })?;
        }
    }
    if streaming {
        reduce::stream::fence();
    }
    ctx.wire.sent += sent;
    ctx.wire.received += received;
    Ok(true)
}

/// Owner's reduction of one round into `result` alone, block by block: `own op srcs[0] op
/// srcs[1] …` (the same order, so the same bits, as `reduce_round`), Avg finished. For an
/// owner whose buffers are device memory: its own contribution was staged beside the
/// peers', and the result goes to the device from `result` (`gpu::arena`).
pub fn reduce_into(
    dtype: DType,
    op: ReduceOp,
    n: usize,
    own: &[u8],
    srcs: &[&[u8]],
    result: &mut [u8],
) {
    let len = result.len();
    let mut at = 0;
    while at < len {
        let end = (at + BLOCK).min(len);
        let res = &mut result[at..end];
        reduce::fold(
            dtype,
            op,
            res,
            Some(&own[at..end]),
            srcs.iter().map(|s| &s[at..end]),
        );
        reduce::finish(dtype, op, res, n);
        at = end;
    }
}

/// Owner's reduction of one round, block by block: `own op srcs[0] op srcs[1] …` (`own` is
/// `out` itself in place), Avg finished. The result goes to `out`, and to `result` as well
/// when `publish` (the other ranks copy it from there).
#[allow(clippy::too_many_arguments)]
fn reduce_round(
    dtype: DType,
    op: ReduceOp,
    n: usize,
    own: Option<&[u8]>,
    srcs: &[&[u8]],
    result: &mut [u8],
    out: &mut [u8],
    publish: bool,
    put: fn(&mut [u8], &[u8]),
) {
    let len = out.len();
    let mut at = 0;
    while at < len {
        let end = (at + BLOCK).min(len);
        // Accumulate where the result must end up anyway: the result area when it is
        // published (then copied to `out` while hot), else `out` itself.
        let others = srcs.iter().map(|s| &s[at..end]);
        let own = own.map(|own| &own[at..end]);
        if publish {
            let res = &mut result[at..end];
            reduce::fold(dtype, op, res, Some(own.unwrap_or(&out[at..end])), others);
            reduce::finish(dtype, op, res, n);
            put(&mut out[at..end], res);
        } else {
            // Without `own`, `out` holds this rank's contribution already.
            let res = &mut out[at..end];
            reduce::fold(dtype, op, res, own, others);
            reduce::finish(dtype, op, res, n);
        }
        at = end;
    }
}
