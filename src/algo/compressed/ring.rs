//! Compressed ring: reduce-scatter where every hop decodes, adds and re-encodes (n−1
//! quantizations of a chunk, so the error grows with the world size: SRA's reason to exist),
//! then an all-gather that forwards the owner's encoding unchanged. Written once over a
//! [`HopSide`] (`run`, `run_gather`), for the host's calls and the device's.

use super::hop::{HopSide, HostHops, Outgoing};
use super::sra::{Shape, SETS};
use super::{chunk, slice, Coder};
use crate::algo::Ctx;
use crate::Result;
use std::ops::Range;

/// Compressed ring all-reduce (sum) of `work`, in place.
pub fn all_reduce(ctx: &mut Ctx<'_>, cd: &mut Coder<'_>, work: &mut [f32]) -> Result<()> {
    if ctx.size == 1 {
        return Ok(());
    }
    let count = work.len();
    let shape = Shape::of(ctx, count);
    let mut side = HostHops::new(ctx, cd, work);
    let done = run(ctx, shape, &mut side, count);
    side.give_back(ctx);
    done
}

/// Ring all-gather of encoded chunks: rank q's finished chunk is `owned(q)`; it encodes it
/// once (keeping the decoded copy) and every other rank decodes and forwards those bytes.
pub fn all_gather(
    ctx: &mut Ctx<'_>,
    cd: &mut Coder<'_>,
    work: &mut [f32],
    chunks: &[Range<usize>],
    owned: impl Fn(usize) -> usize,
) -> Result<()> {
    if ctx.size == 1 {
        return Ok(());
    }
    let longest = chunks.iter().map(|c| c.len()).max().unwrap_or(0);
    let shape = Shape {
        n: ctx.size,
        rank: ctx.rank,
        nsl: super::nslices(ctx, longest),
    };
    let mut side = HostHops::new(ctx, cd, work);
    let done = run_gather(ctx, shape, &mut side, chunks, &owned, 0);
    side.give_back(ctx);
    done
}

/// Exchanges of the ring all-reduce on `shape`: n−1 per slice each way.
pub fn exchanges(shape: Shape) -> usize {
    2 * (shape.n - 1) * shape.nsl
}

/// The ring all-reduce of `count` elements for `shape.n` > 1 ranks, its exchanges on `x`:
/// n−1 reduce-scatter steps per slice, then the all-gather of each rank's finished chunk.
pub fn run<X: ?Sized>(
    x: &mut X,
    shape: Shape,
    side: &mut dyn HopSide<X>,
    count: usize,
) -> Result<()> {
    let (n, r, nsl) = (shape.n, shape.rank, shape.nsl);
    let chunks: Vec<_> = (0..n).map(|c| chunk(count, n, c)).collect();
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let mut xs = 0;
    for step in 0..n - 1 {
        let send_c = (r + n - step) % n;
        let recv_c = (r + 2 * n - step - 1) % n;
        for j in 0..nsl {
            let (ss, rs) = (
                slice(&chunks[send_c], nsl, j),
                slice(&chunks[recv_c], nsl, j),
            );
            let set = xs % SETS;
            side.encode_to(set, next, ss)?;
            let sent = Outgoing::Encoded { set, slot: next };
            let land = side.len(&rs);
            side.pass(x, sent, &[next], &[prev], land)?;
            xs += 1;
            side.take(prev, rs, true)?;
        }
    }
    // Rank r finished chunk r+1.
    run_gather(x, shape, side, &chunks, &|q| (q + 1) % n, xs)
}

/// The ring all-gather of `chunks` over `shape`, its exchanges on `x` after `xs` earlier
/// ones of the call: per slice, this rank's `owned(rank)` encoded once, then n−1 steps each
/// decoding what arrived and forwarding it.
pub fn run_gather<X: ?Sized>(
    x: &mut X,
    shape: Shape,
    side: &mut dyn HopSide<X>,
    chunks: &[Range<usize>],
    owned: &dyn Fn(usize) -> usize,
    mut xs: usize,
) -> Result<()> {
    let (n, r, nsl) = (shape.n, shape.rank, shape.nsl);
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    for j in 0..nsl {
        let own = slice(&chunks[owned(r)], nsl, j);
        let set = xs % SETS;
        side.encode_own_to(set, next, own)?;
        for step in 0..n - 1 {
            let from = (r + 2 * n - step - 1) % n;
            let rs = slice(&chunks[owned(from)], nsl, j);
            let what = if step == 0 {
                Outgoing::Encoded { set, slot: next }
            } else {
                Outgoing::Forward
            };
            let land = side.len(&rs);
            side.pass(x, what, &[next], &[prev], land)?;
            xs += 1;
            side.take(prev, rs, false)?;
        }
    }
    Ok(())
}
