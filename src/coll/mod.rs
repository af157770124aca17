//! Collectives over bytes: choose the algorithm, build the operation descriptor, run.
//! Arguments were validated by the caller (`check`) before any byte moves.

pub mod check;
pub mod compressed;

use crate::algo::ring::Io;
use crate::algo::Algo;
use crate::algo::{self, part, Ctx, Scratch, Wire};
use crate::codec::ef::Residuals;
use crate::transport::frame::{CollKind, OpDesc};
use crate::transport::{RecvReq, SendReq, Transport};
use crate::types::{DType, ReduceOp};
use crate::Result;

/// What executes collectives for one comm: its transport and scratch, used by one operation
/// at a time.
pub struct Engine {
    /// The transport to the comm's peers.
    pub(crate) t: Transport,
    /// Reused scratch buffers.
    pub(crate) scratch: Scratch,
    /// This rank.
    pub(crate) rank: usize,
    /// Ranks in the comm.
    pub(crate) size: usize,
    /// Slice size (QCCL_BUFFSIZE).
    pub(crate) slice: usize,
    /// Slice size of the pairwise SRA all-reduce (`Config::sra_slice_bytes`).
    pub(crate) sra_slice: usize,
    /// How the ranks reach each other: `auto` picks by it.
    pub(crate) links: Links,
    /// Default all-reduce algorithm (QCCL_ALGO).
    pub(crate) algo: Algo,
    /// Bytes moved by every collective so far (the counters API).
    pub(crate) wire: Wire,
    /// Error-feedback residuals of compressed calls, by tensor key.
    pub(crate) residuals: Residuals,
    /// Compressed calls executed so far: the `step` of their random streams.
    pub(crate) coded_calls: u64,
}

/// How a comm's ranks reach each other, as far as choosing an algorithm goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Links {
    /// Some peer over TCP, every rank on one host: loopback, where the CPUs' copies, not the
    /// wire, set the pace (a job run with QCCL_TRANSPORT=tcp on one machine).
    Sockets,
    /// Some peer over TCP on another host: a network link, where the bytes each link
    /// carries set the pace.
    Network,
    /// Every peer over shared memory: the comm-wide arena (`transport::shm::arena`) serves SRA.
    Arena,
    /// Threads of one process (frames over channels).
    Threads,
}

/// Threads: byte size below which `auto` uses the tree (fewest hops) on more than 2 ranks.
pub const TREE_MAX_BYTES: usize = 64 * 1024;
/// Threads: byte size from which `auto` prefers SRA to the ring on 3..=`SRA_MAX_RANKS` ranks.
pub const SRA_MIN_BYTES: usize = 1 << 20;
/// Sockets: byte size below which `auto` uses the tree on more than 2 ranks (SRA above).
pub const TCP_TREE_MAX_BYTES: usize = 1 << 20;
/// Network: byte size below which `auto` uses the tree on more than 2 ranks (SRA above).
pub const NET_TREE_MAX_BYTES: usize = 16 * 1024;
/// World size up to which `auto` prefers SRA over pairwise links to the ring.
pub const SRA_MAX_RANKS: usize = 8;
/// Byte size below which `auto` uses the one-exchange all-gather scheme on 2 ranks.
pub const ALLGATHER_MAX_BYTES: usize = 64 * 1024;
/// Arena, 2 ranks: byte size from which `auto` uses SRA through the arena (the ring below).
pub const ARENA_SRA_MIN_BYTES_2: usize = 1 << 20;

/// The algorithm `auto` resolves to for `bytes` bytes on `size` ranks linked by `links`.
///
/// Measured with qccl-perf on 2 to 8 processes on 2 cores (docs/perf-history.md). On 2 ranks
/// one exchange of the whole buffers (all-gather scheme) is best below 64 KiB (TCP 4 KiB:
/// 7 µs against the ring's 13; shared memory on par). Through the shared-memory arena SRA
/// has two synchronisation points per round and one copy in, one reduction, one copy out per
/// element: it beats the tree and the ring at every size on 3 to 8 processes (4 ranks, 4 KiB
/// 6–13 µs against the tree's 12–30; 64 MiB 32–38 ms against 42–45), and the ring from 1 MiB
/// on 2. Over TCP each of the ring's dependent steps costs a socket round trip: the tree wins
/// below 1 MiB and SRA above (4 ranks, µs per call, 512 KiB slices: 256 KiB tree 177–205
/// against SRA 245–255, 512 KiB 325–357 against 365–380, 1 MiB on par, 4 MiB SRA 3.5–4.2 ms
/// against 4.2–6.0; 3 ranks on par at 256–512 KiB; ring behind SRA from 256 KiB). Between
/// hosts the wire sets the pace, and SRA, which sends 2(n−1)/n of the buffer per rank over
/// both directions of every link at once, overtakes the tree (whose root link carries the
/// buffer twice each way, up then down) from 16 KiB (emulated cluster, one rank per host,
/// 1 Gbit/s: 4 hosts 16 KiB 187–238 µs against 275, 64 KiB 829 against 1097, 1 MiB 13.3 ms
/// against 23.3; 3 hosts 16 KiB 151–186 against 269–276; the tree ahead to 8 KiB).
/// Threads keep the rules measured for pairwise shared memory: tree below 64 KiB, ring to
/// 1 MiB, SRA above. A measured cost model (`qccl-perf --calibrate`) is to replace these.
pub fn resolve_algo(algo: Algo, bytes: usize, size: usize, links: Links) -> Algo {
    if algo != Algo::Auto {
        return algo;
    }
    if size == 2 && bytes < ALLGATHER_MAX_BYTES {
        return Algo::AllGather;
    }
    match links {
        Links::Arena if size > 2 || bytes >= ARENA_SRA_MIN_BYTES_2 => Algo::Sra,
        Links::Arena => Algo::Ring,
        _ if size == 2 => Algo::Ring,
        Links::Sockets if bytes < TCP_TREE_MAX_BYTES => Algo::Tree,
        Links::Network if bytes < NET_TREE_MAX_BYTES => Algo::Tree,
        Links::Threads if bytes < TREE_MAX_BYTES => Algo::Tree,
        Links::Threads if bytes < SRA_MIN_BYTES => Algo::Ring,
        _ if size <= SRA_MAX_RANKS => Algo::Sra,
        _ => Algo::Ring,
    }
}

impl Engine {
    /// One exchange of frames described by `desc` with some peers: every send and receive
    /// progressed together (the C ABI's grouped point-to-point phases).
    pub fn exchange(
        &mut self,
        desc: &OpDesc,
        sends: &[SendReq<'_>],
        recvs: &mut [RecvReq<'_>],
    ) -> Result<()> {
        self.t.exchange(desc, sends, recvs)
    }

    fn ctx(
        &mut self,
        coll: CollKind,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        algo: u8,
    ) -> Ctx<'_> {
        Ctx {
            t: &mut self.t,
            rank: self.rank,
            size: self.size,
            slice: self.slice,
            scratch: &mut self.scratch,
            desc: OpDesc {
                coll,
                dtype: dtype as u8,
                op: op as u8,
                algo,
                root: root as u32,
                count: count as u64,
            },
            dtype,
            op,
            wire: &mut self.wire,
        }
    }

    /// All-reduce of `count` elements; in place when `send` is None.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        op: ReduceOp,
        algo: Option<Algo>,
    ) -> Result<Algo> {
        let algo = resolve_algo(algo.unwrap_or(self.algo), recv.len(), self.size, self.links);
        if count == 0 {
            return Ok(algo);
        }
        let sra_slice = self.sra_slice;
        let mut ctx = self.ctx(CollKind::AllReduce, count, dtype, op, 0, algo as u8);
        if algo == Algo::Sra {
            ctx.slice = sra_slice;
        }
        match algo {
            Algo::Hier => {
                return Err(crate::Error::Internal(
                    "the hierarchical all-reduce runs above the engine (Comm)".into(),
                ))
            }
            Algo::AllGather => algo::allgather::all_reduce(&mut ctx, send, recv)?,
            Algo::Tree => algo::tree::all_reduce(&mut ctx, send, recv)?,
            Algo::Sra => algo::sra::all_reduce(&mut ctx, send, recv, count)?,
            _ => algo::ring::all_reduce(&mut ctx, send, recv, count)?,
        }
        Ok(algo)
    }

    /// Reduce-scatter: `recvcount` elements per rank; in place (result at `buf[rank]`) when
    /// `send` is None and `recv` is the whole buffer.
    pub fn reduce_scatter(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        recvcount: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        if recvcount == 0 {
            return Ok(());
        }
        let n = self.size;
        let total = recvcount * n;
        let mut ctx = self.ctx(CollKind::ReduceScatter, recvcount, dtype, op, 0, 0);
        if algo::arena::reduce_scatter(&mut ctx, send, recv, total)? {
            return Ok(());
        }
        let io = match send {
            Some(input) => Io::OutOfPlace { input, out: recv },
            None => Io::InPlace(recv),
        };
        algo::ring::reduce_scatter(&mut ctx, io, total)
    }

    /// Reduce-scatter of `count` elements split in near-equal parts (part r has
    /// `algo::part(count, size, r)`); in place when `send` is None, else part r of `buf` gets
    /// the result. Used by the hierarchical all-reduce, whose parts need not be equal.
    pub fn reduce_scatter_parts(
        &mut self,
        send: Option<&[u8]>,
        buf: &mut [u8],
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let mine = part(count, self.size, self.rank, dtype.size());
        let mut ctx = self.ctx(
            CollKind::ReduceScatter,
            count,
            dtype,
            op,
            0,
            Algo::Hier as u8,
        );
        let out = match send {
            Some(_) => &mut buf[mine.clone()],
            None => &mut *buf,
        };
        if algo::arena::reduce_scatter(&mut ctx, send, out, count)? {
            return Ok(());
        }
        let io = match send {
            Some(input) => Io::OutOfPlace {
                input,
                out: &mut buf[mine],
            },
            None => Io::InPlace(buf),
        };
        algo::ring::reduce_scatter(&mut ctx, io, count)
    }

    /// All-gather in place of `count` elements split in near-equal parts, part r from rank r.
    pub fn all_gather_parts(&mut self, buf: &mut [u8], count: usize, dtype: DType) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let mut ctx = self.ctx(
            CollKind::AllGather,
            count,
            dtype,
            ReduceOp::Sum,
            0,
            Algo::Hier as u8,
        );
        if algo::arena::all_gather(&mut ctx, None, buf, count)? {
            return Ok(());
        }
        algo::ring::all_gather(&mut ctx, buf, count)
    }

    /// All-gather of `sendcount` elements per rank into `recv` (n·sendcount); `send` None
    /// means in place (this rank's part is already at its slot).
    pub fn all_gather(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        sendcount: usize,
        dtype: DType,
    ) -> Result<()> {
        if sendcount == 0 {
            return Ok(());
        }
        let n = self.size;
        let mut ctx = self.ctx(CollKind::AllGather, sendcount, dtype, ReduceOp::Sum, 0, 0);
        if algo::arena::all_gather(&mut ctx, send, recv, sendcount * n)? {
            return Ok(());
        }
        if let Some(s) = send {
            let mine = part(sendcount * n, n, ctx.rank, dtype.size());
            recv[mine].copy_from_slice(s);
        }
        algo::ring::all_gather(&mut ctx, recv, sendcount * n)
    }

    /// Broadcast from `root`; root's `send` (if given) is the data.
    pub fn broadcast(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        root: usize,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let mut ctx = self.ctx(CollKind::Broadcast, count, dtype, ReduceOp::Sum, root, 0);
        algo::chain::broadcast(&mut ctx, send, recv, root)
    }

    /// Reduce onto `root` (see `algo::chain::reduce`).
    #[allow(clippy::too_many_arguments)]
    pub fn reduce(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let mut ctx = self.ctx(CollKind::Reduce, count, dtype, op, root, 0);
        algo::chain::reduce(&mut ctx, send, recv, root)
    }

    /// All-to-all with `count` elements per peer.
    pub fn all_to_all(
        &mut self,
        send: &[u8],
        recv: &mut [u8],
        count: usize,
        dtype: DType,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let mut ctx = self.ctx(CollKind::AllToAll, count, dtype, ReduceOp::Sum, 0, 0);
        algo::direct::all_to_all(&mut ctx, send, recv)
    }

    /// Gather of `count` elements per rank onto `root`'s `recv`.
    pub fn gather(
        &mut self,
        send: &[u8],
        recv: Option<&mut [u8]>,
        count: usize,
        dtype: DType,
        root: usize,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let mut ctx = self.ctx(CollKind::Gather, count, dtype, ReduceOp::Sum, root, 0);
        algo::direct::gather(&mut ctx, send, recv, root)
    }

    /// Scatter of `count` elements per rank from `root`'s `send`.
    pub fn scatter(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
        root: usize,
    ) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let mut ctx = self.ctx(CollKind::Scatter, count, dtype, ReduceOp::Sum, root, 0);
        algo::direct::scatter(&mut ctx, send, recv, root)
    }

    /// Point-to-point send of `count` elements to `peer`.
    pub fn send(&mut self, data: &[u8], count: usize, dtype: DType, peer: usize) -> Result<()> {
        let mut ctx = self.ctx(CollKind::SendRecv, count, dtype, ReduceOp::Sum, 0, 0);
        ctx.exchange(&[SendReq { peer, data }], &mut [])
    }

    /// Point-to-point receive of `count` elements from `peer`.
    pub fn recv(&mut self, data: &mut [u8], count: usize, dtype: DType, peer: usize) -> Result<()> {
        let mut ctx = self.ctx(CollKind::SendRecv, count, dtype, ReduceOp::Sum, 0, 0);
        ctx.exchange(&[], &mut [RecvReq::new(peer, data)])
    }

    /// Blocks until every rank has called barrier.
    pub fn barrier(&mut self) -> Result<()> {
        let mut ctx = self.ctx(CollKind::Barrier, 0, DType::Uint8, ReduceOp::Sum, 0, 0);
        algo::direct::barrier(&mut ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_picks_by_size_ranks_and_links() {
        use Algo::*;
        let pick = |bytes, size, links| resolve_algo(Auto, bytes, size, links);
        assert_eq!(pick(4096, 2, Links::Arena), AllGather);
        assert_eq!(pick(256 << 10, 2, Links::Arena), Ring);
        assert_eq!(pick(1 << 20, 2, Links::Arena), Sra);
        assert_eq!(pick(4096, 4, Links::Arena), Sra);
        assert_eq!(pick(4096, 16, Links::Arena), Sra);
        assert_eq!(pick(4096, 4, Links::Sockets), Tree);
        assert_eq!(pick(512 << 10, 4, Links::Sockets), Tree);
        assert_eq!(pick(1 << 20, 4, Links::Sockets), Sra);
        assert_eq!(pick(1 << 20, 16, Links::Sockets), Ring);
        assert_eq!(pick(8 << 10, 4, Links::Network), Tree);
        assert_eq!(pick(16 << 10, 4, Links::Network), Sra);
        assert_eq!(pick(16 << 10, 3, Links::Network), Sra);
        assert_eq!(pick(16 << 10, 16, Links::Network), Ring);
        assert_eq!(pick(4096, 2, Links::Network), AllGather);
        assert_eq!(pick(64 << 10, 2, Links::Network), Ring);
        assert_eq!(pick(4096, 4, Links::Threads), Tree);
        assert_eq!(pick(256 << 10, 4, Links::Threads), Ring);
        assert_eq!(pick(4 << 20, 4, Links::Threads), Sra);
        assert_eq!(resolve_algo(Tree, 64 << 20, 4, Links::Arena), Tree);
    }
}
