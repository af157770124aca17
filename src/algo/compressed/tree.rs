//! Compressed binary tree: each rank adds its children's decoded partial sums to its own exact
//! data and sends its sum up encoded; the root encodes the total once and the encoding travels
//! down unchanged. log2(n) quantizations on the way up. Written once over a [`HopSide`]
//! (`run`), for the host's calls and the device's.

use super::hop::{HopSide, HostHops, Outgoing};
use super::sra::{Shape, SETS};
use super::{nslices, slice, Coder};
use crate::algo::tree::neighbours;
use crate::algo::Ctx;
use crate::Result;

/// Compressed tree all-reduce (sum) of `work`, in place.
pub fn all_reduce(ctx: &mut Ctx<'_>, cd: &mut Coder<'_>, work: &mut [f32]) -> Result<()> {
    if ctx.size == 1 {
        return Ok(());
    }
    let count = work.len();
    let shape = Shape {
        n: ctx.size,
        rank: ctx.rank,
        nsl: nslices(ctx, count),
    };
    let mut side = HostHops::new(ctx, cd, work);
    if ctx.rank == 0 {
        // The root encodes each slice's total on the way up, sent on the way down while the
        // children send it their next slices.
        side.keep_room(ctx, shape.nsl);
    }
    let done = run(ctx, shape, &mut side, count);
    side.give_back(ctx);
    done
}

/// The tree's shape for a call of `count` elements on `n` ranks with slices of `slice`
/// bytes: the whole buffer is cut in slices (what `all_reduce` finds on its `ctx`).
pub fn shape(count: usize, n: usize, rank: usize, slice: usize) -> Shape {
    Shape {
        n,
        rank,
        nsl: (4 * count).div_ceil(slice.max(1)).max(1),
    }
}

/// Exchanges of the tree all-reduce on `shape`: per slice, one from the children and one to
/// the parent on the way up, one from the parent and one to the children on the way down.
pub fn exchanges(shape: Shape) -> usize {
    let (parent, kids) = neighbours(shape.rank, shape.n);
    2 * (usize::from(parent.is_some()) + usize::from(!kids.is_empty())) * shape.nsl
}

/// The tree all-reduce of `count` elements for `shape.n` > 1 ranks, its exchanges on `x`.
pub fn run<X: ?Sized>(
    x: &mut X,
    shape: Shape,
    side: &mut dyn HopSide<X>,
    count: usize,
) -> Result<()> {
    let (n, r, nsl) = (shape.n, shape.rank, shape.nsl);
    let (parent, kids) = neighbours(r, n);
    let whole = 0..count;
    let mut xs = 0;
    // The root's totals kept from the way up (`HopSide::keep_total`), by slice.
    let mut kept = Vec::with_capacity(nsl);
    for j in 0..nsl {
        let sj = slice(&whole, nsl, j);
        if !kids.is_empty() {
            let land = side.len(&sj);
            side.pass(x, Outgoing::Nothing, &[], &kids, land)?;
            xs += 1;
            for &k in &kids {
                side.take(k, sj.clone(), true)?;
            }
        }
        kept.push(match parent {
            Some(p) => {
                let set = xs % SETS;
                side.encode_to(set, p, sj)?;
                side.pass(x, Outgoing::Encoded { set, slot: p }, &[p], &[], 0)?;
                xs += 1;
                false
            }
            None => side.keep_total(j, sj)?,
        });
    }
    for (j, &kept) in kept.iter().enumerate() {
        let sj = slice(&whole, nsl, j);
        let down = match parent {
            Some(p) => {
                let land = side.len(&sj);
                side.pass(x, Outgoing::Nothing, &[], &[p], land)?;
                xs += 1;
                side.take(p, sj, false)?;
                Outgoing::Forward
            }
            None if kept => Outgoing::Kept(j),
            None => {
                // A side that keeps no totals (the device) encodes each as it sends it: the
                // same bytes.
                let set = xs % SETS;
                side.encode_own_to(set, r, sj)?;
                Outgoing::Encoded { set, slot: r }
            }
        };
        if !kids.is_empty() {
            side.pass(x, down, &kids, &[], 0)?;
            xs += 1;
        }
    }
    Ok(())
}
