//! Binary-tree all-reduce: reduce up to rank 0, broadcast down. 2·log2(n) hops instead of the
//! ring's 2(n−1), so it wins for small messages. Rank 0 computes the result once and every
//! other rank receives a copy of it: bit-identical everywhere.

use super::{sub, Ctx};
use crate::reduce;
use crate::transport::{RecvReq, SendReq};
use crate::Result;

/// Rank `r`'s parent (None at the root, rank 0) and children in the binary tree of `n` ranks
/// laid out as a heap: the tree of the dense and the compressed all-reduce alike.
pub fn neighbours(r: usize, n: usize) -> (Option<usize>, Vec<usize>) {
    let kids = [2 * r + 1, 2 * r + 2]
        .into_iter()
        .filter(|&k| k < n)
        .collect();
    ((r > 0).then(|| (r - 1) / 2), kids)
}

/// Tree all-reduce of the `buf.len()` bytes; out-of-place when `send` is given.
pub fn all_reduce(ctx: &mut Ctx<'_>, send: Option<&[u8]>, buf: &mut [u8]) -> Result<()> {
    if let Some(s) = send {
        buf.copy_from_slice(s);
    }
    let (n, r, es) = (ctx.size, ctx.rank, ctx.dtype.size());
    if n == 1 {
        return Ok(());
    }
    let (parent, kids) = neighbours(r, n);
    let whole = 0..buf.len();
    let nsl = ctx.nslices(buf.len());
    let max_slice = sub(&whole, nsl, nsl - 1, es).len() + es;
    let mut land = std::mem::take(&mut ctx.scratch.main);
    let result = (|| {
        let space = land.get(2 * max_slice);
        for j in 0..nsl {
            let sj = sub(&whole, nsl, j, es);
            let len = sj.len();
            if !kids.is_empty() {
                let (l0, l1) = space.split_at_mut(max_slice);
                let mut recvs: Vec<RecvReq<'_>> = kids
                    .iter()
                    .zip([l0, l1])
                    .map(|(&k, l)| RecvReq::new(k, &mut l[..len]))
                    .collect();
                ctx.exchange(&[], &mut recvs)?;
                for part in [&space[..len], &space[max_slice..max_slice + len]]
                    .into_iter()
                    .take(kids.len())
                {
                    reduce::reduce_into(ctx.dtype, ctx.op, &mut buf[sj.clone()], part);
                }
            }
            match parent {
                Some(p) => ctx.exchange(
                    &[SendReq {
                        peer: p,
                        data: &buf[sj],
                    }],
                    &mut [],
                )?,
                None if ctx.op == crate::ReduceOp::Avg => {
                    reduce::finish_avg(ctx.dtype, &mut buf[sj], n)
                }
                None => {}
            }
        }
        for j in 0..nsl {
            let sj = sub(&whole, nsl, j, es);
            if let Some(p) = parent {
                ctx.exchange(&[], &mut [RecvReq::new(p, &mut buf[sj.clone()])])?;
            }
            let sends: Vec<SendReq<'_>> = kids
                .iter()
                .map(|&k| SendReq {
                    peer: k,
                    data: &buf[sj.clone()],
                })
                .collect();
            if !sends.is_empty() {
                ctx.exchange(&sends, &mut [])?;
            }
        }
        Ok(())
    })();
    ctx.scratch.main = land;
    result
}
