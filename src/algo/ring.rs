//! Ring reduce-scatter and all-gather, and all-reduce as their composition: bandwidth-optimal,
//! each rank sends 2(n−1)/n of the buffer. The chunk of rank r is reduced once, by rank r,
//! and then copied around the ring, so every rank ends with the same bits.

use super::{part, split_ref_mut, sub, Ctx};
use crate::reduce;
use crate::transport::{RecvReq, SendReq};
use crate::Result;

/// Reduces the `count` elements of `input` (split in n near-equal chunks) across ranks and
/// leaves chunk `rank`'s reduction in `out`. Avg is finished here.
pub fn reduce_scatter(ctx: &mut Ctx<'_>, input: &[u8], count: usize, out: &mut [u8]) -> Result<()> {
    let (n, r, es) = (ctx.size, ctx.rank, ctx.dtype.size());
    let chunk = |c: usize| part(count, n, c, es);
    debug_assert_eq!(out.len(), chunk(r).len());
    if n == 1 {
        out.copy_from_slice(input);
        return Ok(());
    }
    let max_chunk = chunk(n - 1).len();
    let nsl = ctx.nslices(max_chunk);
    let max_slice = sub(&(0..max_chunk), nsl, nsl - 1, es).len() + es;
    // Two accumulators (the one being sent, the one being filled) and one landing slice.
    let mut scratch = std::mem::take(&mut ctx.scratch.main);
    let space = scratch.get(2 * max_chunk + max_slice);
    let (w0, rest) = space.split_at_mut(max_chunk);
    let (w1, land) = rest.split_at_mut(max_chunk);
    let mut work = [w0, w1];
    let result = (|| {
        for s in 0..n - 1 {
            let a = ctx.peer(-(s as isize) - 1);
            let b = ctx.peer(-(s as isize) - 2);
            let (ra, rb) = (chunk(a), chunk(b));
            let (w_prev, w_cur) = {
                let [x, y] = &mut work;
                if s % 2 == 0 {
                    (&**y, &mut **x)
                } else {
                    (&**x, &mut **y)
                }
            };
            for j in 0..nsl {
                let sa = sub(&ra, nsl, j, es);
                let sb = sub(&rb, nsl, j, es);
                let src: &[u8] = if s == 0 {
                    &input[sa.clone()]
                } else {
                    &w_prev[sa.start - ra.start..sa.end - ra.start]
                };
                let landing = &mut land[..sb.len()];
                ctx.exchange(
                    &[SendReq {
                        peer: ctx.peer(1),
                        data: src,
                    }],
                    &mut [RecvReq {
                        peer: ctx.peer(-1),
                        data: landing,
                    }],
                )?;
                let local = sb.start - rb.start..sb.end - rb.start;
                let dst: &mut [u8] = if s == n - 2 {
                    &mut out[local]
                } else {
                    &mut w_cur[local]
                };
                reduce::reduce3(
                    ctx.dtype,
                    ctx.op,
                    dst,
                    &input[sb.clone()],
                    &land[..sb.len()],
                );
            }
        }
        Ok(())
    })();
    ctx.scratch.main = scratch;
    result?;
    if ctx.op == crate::ReduceOp::Avg {
        reduce::finish_avg(ctx.dtype, out, n);
    }
    Ok(())
}

/// In place on `buf` (n near-equal chunks of `count` elements in all): every rank's chunk
/// `rank` is copied to every other rank.
pub fn all_gather(ctx: &mut Ctx<'_>, buf: &mut [u8], count: usize) -> Result<()> {
    let (n, es) = (ctx.size, ctx.dtype.size());
    if n == 1 {
        return Ok(());
    }
    let chunk = |c: usize| part(count, n, c, es);
    let nsl = ctx.nslices(chunk(n - 1).len());
    for s in 0..n - 1 {
        let ra = chunk(ctx.peer(-(s as isize)));
        let rb = chunk(ctx.peer(-(s as isize) - 1));
        for j in 0..nsl {
            let (src, dst) = split_ref_mut(buf, sub(&ra, nsl, j, es), sub(&rb, nsl, j, es));
            ctx.exchange(
                &[SendReq {
                    peer: ctx.peer(1),
                    data: src,
                }],
                &mut [RecvReq {
                    peer: ctx.peer(-1),
                    data: dst,
                }],
            )?;
        }
    }
    Ok(())
}

/// Ring all-reduce of `count` elements: out-of-place from `send` into `buf`, or in place on
/// `buf` when `send` is None.
pub fn all_reduce(
    ctx: &mut Ctx<'_>,
    send: Option<&[u8]>,
    buf: &mut [u8],
    count: usize,
) -> Result<()> {
    let (n, es) = (ctx.size, ctx.dtype.size());
    let mine = part(count, n, ctx.rank, es);
    match send {
        Some(input) => reduce_scatter(ctx, input, count, &mut buf[mine])?,
        None => {
            // The input is read while chunk `rank` is accumulated, so the result lands in a
            // separate buffer first and is copied in (1/n of the data).
            let mut aux = std::mem::take(&mut ctx.scratch.aux);
            let own = aux.get(mine.len());
            let res = reduce_scatter(ctx, buf, count, own);
            if res.is_ok() {
                buf[mine].copy_from_slice(own);
            }
            ctx.scratch.aux = aux;
            res?;
        }
    }
    all_gather(ctx, buf, count)
}
