//! All-reduce in one exchange, for small messages: every rank sends its whole buffer to every
//! other and folds all n contributions in rank order. One hop instead of the ring's 2(n−1) or
//! the tree's 2·log n, at n−1 times the bytes, which is what latency-bound sizes want (NCCL's
//! and MPI's small-message all-reduces make the same trade). Every rank computes the same fold
//! ((x0 ⊕ x1) ⊕ x2) ⊕ … of the same bytes, so the results are bit-identical.

use super::Ctx;
use crate::reduce;
use crate::transport::{RecvReq, SendReq};
use crate::Result;

/// All-reduce of `buf` (`count` elements) in one exchange; out of place when `send` is given.
pub fn all_reduce(ctx: &mut Ctx<'_>, send: Option<&[u8]>, buf: &mut [u8]) -> Result<()> {
    let (n, r) = (ctx.size, ctx.rank);
    let bytes = buf.len();
    let mut scratch = std::mem::take(&mut ctx.scratch.main);
    let result = (|| {
        // Slot p holds rank p's contribution; this rank's own is copied into its slot, so the
        // fold below can write `buf` (which may be the own data, in place).
        let slots = scratch.get(n * bytes);
        slots[r * bytes..(r + 1) * bytes].copy_from_slice(send.unwrap_or(buf));
        if n > 1 {
            let (before, rest) = slots.split_at_mut(r * bytes);
            let (own, after) = rest.split_at_mut(bytes);
            let own: &[u8] = own;
            let sends: Vec<SendReq<'_>> = (0..n)
                .filter(|&p| p != r)
                .map(|p| SendReq { peer: p, data: own })
                .collect();
            let mut recvs: Vec<RecvReq<'_>> = before
                .chunks_mut(bytes)
                .enumerate()
                .chain(
                    after
                        .chunks_mut(bytes)
                        .enumerate()
                        .map(|(i, c)| (r + 1 + i, c)),
                )
                .map(|(p, c)| RecvReq::new(p, c))
                .collect();
            ctx.exchange(&sends, &mut recvs)?;
        }
        let slot = |p: usize| &slots[p * bytes..(p + 1) * bytes];
        let (dtype, op) = (ctx.dtype, ctx.op);
        reduce::fold(dtype, op, buf, Some(slot(0)), (1..n).map(slot));
        reduce::finish(dtype, op, buf, n);
        Ok(())
    })();
    ctx.scratch.main = scratch;
    result
}
