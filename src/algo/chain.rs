//! Pipelined chains for rooted collectives: broadcast flows root → root+1 → …, reduce flows
//! root+1 → root+2 → … → root. Slices let every link of the chain work at once.

use super::{sub, AtOnce, Ctx, PieceIo};
use crate::reduce;
use crate::transport::{RecvReq, SendReq};
use crate::Result;

/// Broadcast of `buf` from `root` (root's `send`, if given, is copied into its `buf` first).
pub fn broadcast(
    ctx: &mut Ctx<'_>,
    send: Option<&[u8]>,
    buf: &mut [u8],
    root: usize,
) -> Result<()> {
    if ctx.rank == root {
        if let Some(s) = send {
            buf.copy_from_slice(s);
        }
    }
    if ctx.size == 1 {
        return Ok(());
    }
    broadcast_in_slices(ctx, buf, root, &AtOnce)
}

/// [`broadcast`] in place in `buf`, a staged copy whose slices (`Ctx::nslices` of the
/// buffer: `algo::chunk_slices` on one rank) `io` says landed (the root's input), each
/// reported done once this rank received and passed it on: the same frames.
pub fn broadcast_in_slices(
    ctx: &mut Ctx<'_>,
    buf: &mut [u8],
    root: usize,
    io: &dyn PieceIo,
) -> Result<()> {
    let (n, es) = (ctx.size, ctx.dtype.size());
    let pos = (ctx.rank + n - root) % n;
    let whole = 0..buf.len();
    let nsl = ctx.nslices(buf.len());
    for j in 0..nsl {
        io.landed(j)?;
        let sj = sub(&whole, nsl, j, es);
        if pos > 0 {
            ctx.exchange(&[], &mut [RecvReq::new(ctx.peer(-1), &mut buf[sj.clone()])])?;
        }
        if pos < n - 1 {
            ctx.exchange(
                &[SendReq {
                    peer: ctx.peer(1),
                    data: &buf[sj],
                }],
                &mut [],
            )?;
        }
        io.done(j);
    }
    Ok(())
}

/// Reduce onto `root`: the input is `send`, or `buf` itself when `send` is None (in place).
/// Root's result lands in `buf`; elsewhere `buf` is only read (and only when in place).
pub fn reduce(ctx: &mut Ctx<'_>, send: Option<&[u8]>, buf: &mut [u8], root: usize) -> Result<()> {
    if ctx.size == 1 {
        if let Some(s) = send {
            buf.copy_from_slice(s);
        }
        return Ok(());
    }
    reduce_in_slices(ctx, send, buf, root, &AtOnce)
}

/// [`reduce`] on more than one rank, each slice (`Ctx::nslices` of the input) started once
/// `io` says this rank's input of it landed and reported done once this rank passed its
/// partial sum on (the root: once its result is in `buf`): the same frames.
pub fn reduce_in_slices(
    ctx: &mut Ctx<'_>,
    send: Option<&[u8]>,
    buf: &mut [u8],
    root: usize,
    io: &dyn PieceIo,
) -> Result<()> {
    let (n, es) = (ctx.size, ctx.dtype.size());
    let bytes = send.map_or(buf.len(), <[u8]>::len);
    let q = (ctx.rank + n - root - 1) % n; // root+1 starts (q = 0), root ends (q = n-1)
    let whole = 0..bytes;
    let nsl = ctx.nslices(bytes);
    let max_slice = sub(&whole, nsl, nsl - 1, es).len() + es;
    let mut land = std::mem::take(&mut ctx.scratch.main);
    let result = (|| {
        let space = land.get(2 * max_slice);
        let (landing, acc) = space.split_at_mut(max_slice);
        for j in 0..nsl {
            io.landed(j)?;
            let sj = sub(&whole, nsl, j, es);
            let len = sj.len();
            if q > 0 {
                let from = ctx.peer(-1);
                ctx.exchange(&[], &mut [RecvReq::new(from, &mut landing[..len])])?;
            }
            let out: &[u8] = if q == 0 {
                match send {
                    Some(s) => &s[sj],
                    None => &buf[sj],
                }
            } else if q == n - 1 {
                let dst = &mut buf[sj.clone()];
                // Own data first either way, so in place and out of place end with the same
                // bits, a NaN's payload included (a call staged in bands runs in place).
                match send {
                    Some(s) => reduce::reduce3(ctx.dtype, ctx.op, dst, &s[sj], &landing[..len]),
                    None => reduce::reduce_into(ctx.dtype, ctx.op, dst, &landing[..len]),
                }
                reduce::finish(ctx.dtype, ctx.op, dst, n);
                io.done(j);
                continue;
            } else {
                let own = match send {
                    Some(s) => &s[sj],
                    None => &buf[sj],
                };
                reduce::reduce3(ctx.dtype, ctx.op, &mut acc[..len], &landing[..len], own);
                &acc[..len]
            };
            ctx.exchange(
                &[SendReq {
                    peer: ctx.peer(1),
                    data: out,
                }],
                &mut [],
            )?;
            io.done(j);
        }
        Ok(())
    })();
    ctx.scratch.main = land;
    result
}
