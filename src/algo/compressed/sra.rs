//! Compressed scatter-reduce-allgather (CGX): each rank encodes chunk j once and sends it to its
//! owner j; the owner adds the decoded contributions to its own exact data in rank order,
//! encodes the sum once, keeps the decoded copy and all-gathers the encoding. Two quantizations
//! per element whatever the world size, so the error does not grow with the ring length.
//!
//! The schedule (`run`) is written once over a [`Side`]: where a rank's data lives and how it
//! encodes and decodes. The host's side is the [`Coder`] over an f32 buffer; the device's
//! (`gpu::sra`) runs the codecs' kernels over device memory. Both keep the same chunks,
//! slices, pieces and order of additions, so host and device ranks of one job end
//! bit-identical.
//!
//! Slice j+1's scatter encodes are issued before slice j's exchanges, into the other of
//! [`SETS`] sets of send buffers: a device runs them while slice j's bytes move. They read and
//! write only peers' chunks of slice j+1, which nothing of slice j touches, so every value and
//! the order of additions stay those of the plain order.

use super::{chunk, nslices, slice, Coder};
use crate::algo::wire::WireBuf;
use crate::algo::Ctx;
use crate::reduce;
use crate::transport::{RecvReq, SendReq};
use crate::{DType, Result};
use std::ops::Range;

/// Sets of send buffers in flight: slice j's are set `j % SETS`, filled while the set of
/// slice j−1 is being sent.
pub const SETS: usize = 2;

/// Which exchange of a slice a [`Side::swap`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Each peer's encoded slice to its owner (`Side::encode_for` filled them).
    Scatter,
    /// The owner's encoded sum to every peer (`Side::encode_own` filled it).
    Gather,
}

/// One rank's data and codec in the SRA schedule. Element ranges are positions in the call's
/// buffer; `p` is a peer's rank; `set` (below [`SETS`]) the set of send buffers an encode
/// fills and an exchange sends. Methods may only enqueue work (a device), as long as `swap`
/// sends what the encodes of its set wrote and decodes read the bytes of the latest `swap`.
/// `X` is what an exchange runs on: the host's `Ctx`, or nothing for a side that only
/// enqueues a call's device work (`gpu::sra`, whose bytes another side moves later).
pub trait Side<X: ?Sized> {
    /// Bytes of the encoding of elements `r`.
    fn len(&self, r: &Range<usize>) -> usize;
    /// Encodes elements `r` of the input (of the work buffer when in place) into the bytes
    /// of `set` sent to peer `p`, recording the loss for error feedback.
    fn encode_for(&mut self, set: usize, p: usize, r: Range<usize>) -> Result<()>;
    /// Out of place: copies the input's elements `r` (this rank's own slice) into the work
    /// buffer, exact. In place: nothing.
    fn keep_own(&mut self, r: Range<usize>) -> Result<()>;
    /// Adds the decoded bytes received from `p` (the encoding of elements `r`) to the work
    /// buffer.
    fn add_from(&mut self, p: usize, r: Range<usize>) -> Result<()>;
    /// Encodes elements `r` of the work buffer (this rank's sum) into the bytes of `set` sent
    /// to every peer, and replaces them with their decoded value.
    fn encode_own(&mut self, set: usize, r: Range<usize>) -> Result<()>;
    /// Decodes the bytes received from `p` (the encoding of elements `r`) into the work
    /// buffer.
    fn take_from(&mut self, p: usize, r: Range<usize>) -> Result<()>;
    /// One exchange with every peer in `peers`: this phase's bytes of `set` sent, and
    /// `land(p)` bytes received from each.
    fn swap(
        &mut self,
        x: &mut X,
        set: usize,
        peers: &[usize],
        phase: Phase,
        land: &dyn Fn(usize) -> usize,
    ) -> Result<()>;
}

/// The schedule's shape: ranks, this rank, slices per chunk.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Ranks (> 1).
    pub n: usize,
    /// This rank.
    pub rank: usize,
    /// Slices each chunk is cut into.
    pub nsl: usize,
}

impl Shape {
    /// The shape of a call of `count` elements on `n` ranks with slices of `slice` bytes
    /// (what `ctx` has for the host's calls).
    pub fn new(count: usize, n: usize, rank: usize, slice: usize) -> Shape {
        let last = chunk(count, n, n - 1).len();
        Shape {
            n,
            rank,
            nsl: (4 * last).div_ceil(slice.max(1)).max(1),
        }
    }

    /// The shape of a call of `count` elements on `ctx`.
    pub fn of(ctx: &Ctx<'_>, count: usize) -> Shape {
        let last = chunk(count, ctx.size, ctx.size - 1).len();
        Shape {
            n: ctx.size,
            rank: ctx.rank,
            nsl: nslices(ctx, last),
        }
    }
}

/// Compressed SRA all-reduce (sum) of `work`: in place, or out of place from `input` (read
/// where it is encoded; only this rank's own chunk is copied into `work`). With `avg` (the
/// number of ranks) each slice is divided by it once final, while it is in cache: the same
/// division as a pass after the call, without the pass.
pub fn all_reduce(
    ctx: &mut Ctx<'_>,
    cd: &mut Coder<'_>,
    input: Option<&[f32]>,
    work: &mut [f32],
    avg: Option<usize>,
) -> Result<()> {
    host(ctx, cd, input, work, true, avg)
}

/// Compressed reduce-scatter (sum): afterwards chunk `rank` of `work` (`chunk(count, n, rank)`)
/// holds the exact sum of its own data and every peer's decoded contribution. Out of place
/// (`input`), the other chunks of `work` are not touched.
pub fn reduce_scatter(
    ctx: &mut Ctx<'_>,
    cd: &mut Coder<'_>,
    input: Option<&[f32]>,
    work: &mut [f32],
) -> Result<()> {
    host(ctx, cd, input, work, false, None)
}

fn host(
    ctx: &mut Ctx<'_>,
    cd: &mut Coder<'_>,
    input: Option<&[f32]>,
    work: &mut [f32],
    gather: bool,
    avg: Option<usize>,
) -> Result<()> {
    let count = work.len();
    if ctx.size == 1 {
        // One rank: its sum is its input, and dividing by 1 changes no value.
        if let Some(i) = input {
            work.copy_from_slice(i);
        }
        return Ok(());
    }
    let n = ctx.size;
    // Encoded into registered memory: an RDMA link sends them without a copy.
    let mut side = HostSide {
        cd,
        input,
        work,
        out: (0..SETS * n).map(|_| ctx.wire_buf()).collect(),
        result: ctx.wire_buf(),
        land: vec![Vec::new(); n],
        avg,
    };
    let shape = Shape::of(ctx, count);
    let done = run(ctx, shape, &mut side, count, gather);
    ctx.give_wire(side.out.into_iter().chain([side.result]));
    done
}

/// The schedule over `count` elements for `shape.n` > 1 ranks, its exchanges on `x`; with
/// `gather` false it stops after the scatter-reduce (a reduce-scatter).
pub fn run<X: ?Sized>(
    x: &mut X,
    shape: Shape,
    side: &mut dyn Side<X>,
    count: usize,
    gather: bool,
) -> Result<()> {
    let (n, r, nsl) = (shape.n, shape.rank, shape.nsl);
    let chunks: Vec<_> = (0..n).map(|c| chunk(count, n, c)).collect();
    let peers: Vec<usize> = (0..n).filter(|&p| p != r).collect();
    // Scatter: every peer's slice, encoded once, to its owner.
    let encode_scatter = |side: &mut dyn Side<X>, j: usize| -> Result<()> {
        for &p in &peers {
            side.encode_for(j % SETS, p, slice(&chunks[p], nsl, j))?;
        }
        Ok(())
    };
    encode_scatter(side, 0)?;
    for j in 0..nsl {
        let s = |c: usize| slice(&chunks[c], nsl, j);
        let set = j % SETS;
        if j + 1 < nsl {
            // One slice ahead: a device encodes it while slice j's bytes move.
            encode_scatter(side, j + 1)?;
        }
        let own = side.len(&s(r));
        side.swap(x, set, &peers, Phase::Scatter, &|_| own)?;
        // Own data exact, then the peers in rank order: the same arithmetic on every run.
        side.keep_own(s(r))?;
        for &p in &peers {
            side.add_from(p, s(r))?;
        }
        if !gather {
            continue;
        }
        // All-gather: the owner's sum, encoded once, to everyone.
        side.encode_own(set, s(r))?;
        let lens: Vec<usize> = (0..n).map(|c| side.len(&s(c))).collect();
        side.swap(x, set, &peers, Phase::Gather, &|p| lens[p])?;
        for &p in &peers {
            side.take_from(p, s(p))?;
        }
    }
    Ok(())
}

/// The host's side: the CPU codecs over an f32 work buffer.
struct HostSide<'a, 'c> {
    cd: &'a mut Coder<'c>,
    input: Option<&'a [f32]>,
    work: &'a mut [f32],
    /// The encoding sent to each peer (scatter), by set: set k's to peer p at `k·n + p`.
    out: Vec<WireBuf>,
    /// This rank's encoded sum (gather).
    result: WireBuf,
    land: Vec<Vec<u8>>,
    /// Avg: the number of ranks each final slice is divided by.
    avg: Option<usize>,
}

impl HostSide<'_, '_> {
    /// Elements `r` of the work buffer hold their final sum: divides them for Avg.
    fn finish(&mut self, r: Range<usize>) {
        if let Some(n) = self.avg {
            reduce::finish_avg(
                DType::Float32,
                bytemuck::cast_slice_mut(&mut self.work[r]),
                n,
            );
        }
    }
}

impl<'c> Side<Ctx<'c>> for HostSide<'_, '_> {
    fn len(&self, r: &Range<usize>) -> usize {
        self.cd.len(r)
    }

    fn encode_for(&mut self, set: usize, p: usize, r: Range<usize>) -> Result<()> {
        let len = self.cd.len(&r);
        let src = self.input.unwrap_or(self.work);
        let n = self.land.len();
        self.cd.encode(src, r, self.out[set * n + p].fit(len))
    }

    fn keep_own(&mut self, r: Range<usize>) -> Result<()> {
        if let Some(i) = self.input {
            self.work[r.clone()].copy_from_slice(&i[r]);
        }
        Ok(())
    }

    fn add_from(&mut self, p: usize, r: Range<usize>) -> Result<()> {
        self.cd.decode(&self.land[p], self.work, r, true)
    }

    fn encode_own(&mut self, _set: usize, r: Range<usize>) -> Result<()> {
        // Sent by the next swap, before the next encode_own: one buffer serves every set.
        let len = self.cd.len(&r);
        self.cd
            .encode_own(self.work, r.clone(), self.result.fit(len))?;
        self.finish(r);
        Ok(())
    }

    fn take_from(&mut self, p: usize, r: Range<usize>) -> Result<()> {
        self.cd.decode(&self.land[p], self.work, r.clone(), false)?;
        self.finish(r);
        Ok(())
    }

    fn swap(
        &mut self,
        ctx: &mut Ctx<'c>,
        set: usize,
        peers: &[usize],
        phase: Phase,
        land: &dyn Fn(usize) -> usize,
    ) -> Result<()> {
        for &p in peers {
            self.land[p].resize(land(p), 0);
        }
        let out = &self.out[set * self.land.len()..][..self.land.len()];
        let (result, me) = (&self.result, ctx.rank);
        let lands = self
            .land
            .iter_mut()
            .enumerate()
            .filter(|(p, _)| *p != me)
            .map(|(p, l)| (p, l.as_mut_slice()));
        swap(
            ctx,
            peers,
            |p| match phase {
                Phase::Scatter => out[p].bytes(),
                Phase::Gather => result.bytes(),
            },
            lands,
        )
    }
}

/// One exchange with every peer: `send(p)` goes to peer p while each `(p, land)` receives
/// from p.
pub fn swap<'a, 'b>(
    ctx: &mut Ctx<'_>,
    peers: &[usize],
    send: impl Fn(usize) -> &'a [u8],
    land: impl IntoIterator<Item = (usize, &'b mut [u8])>,
) -> Result<()> {
    let sends: Vec<SendReq<'_>> = peers
        .iter()
        .map(|&p| SendReq {
            peer: p,
            data: send(p),
        })
        .collect();
    let mut recvs: Vec<RecvReq<'_>> = land.into_iter().map(|(p, l)| RecvReq::new(p, l)).collect();
    ctx.exchange(&sends, &mut recvs)
}
