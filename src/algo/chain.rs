//! Pipelined chains for rooted collectives: broadcast flows root → root+1 → …, reduce flows
//! root+1 → root+2 → … → root. Slices let every link of the chain work at once.

use super::{sub, Ctx};
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
    let (n, es) = (ctx.size, ctx.dtype.size());
    if ctx.rank == root {
        if let Some(s) = send {
            buf.copy_from_slice(s);
        }
    }
    if n == 1 {
        return Ok(());
    }
    let pos = (ctx.rank + n - root) % n;
    let whole = 0..buf.len();
    let nsl = ctx.nslices(buf.len());
    for j in 0..nsl {
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
    }
    Ok(())
}

/// Reduce onto `root`: the input is `send`, or `buf` itself when `send` is None (in place).
/// Root's result lands in `buf`; elsewhere `buf` is only read (and only when in place).
pub fn reduce(ctx: &mut Ctx<'_>, send: Option<&[u8]>, buf: &mut [u8], root: usize) -> Result<()> {
    let (n, es) = (ctx.size, ctx.dtype.size());
    let bytes = send.map_or(buf.len(), <[u8]>::len);
    if n == 1 {
        if let Some(s) = send {
            buf.copy_from_slice(s);
        }
        return Ok(());
    }
    let q = (ctx.rank + n - root - 1) % n; // root+1 starts (q = 0), root ends (q = n-1)
    let whole = 0..bytes;
    let nsl = ctx.nslices(bytes);
    let max_slice = sub(&whole, nsl, nsl - 1, es).len() + es;
    let mut land = std::mem::take(&mut ctx.scratch.main);
    let result = (|| {
        let space = land.get(2 * max_slice);
        let (landing, acc) = space.split_at_mut(max_slice);
        for j in 0..nsl {
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
                match send {
                    Some(s) => reduce::reduce3(ctx.dtype, ctx.op, dst, &landing[..len], &s[sj]),
                    None => reduce::reduce_into(ctx.dtype, ctx.op, dst, &landing[..len]),
                }
                reduce::finish(ctx.dtype, ctx.op, dst, n);
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
        }
        Ok(())
    })();
    ctx.scratch.main = land;
    result
}
