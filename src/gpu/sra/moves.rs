//! The comm's worker's part of a compressed all-reduce on device buffers (`Mover`): an
//! exchange waits for its receive set to be drained, sends each peer's bytes as their
//! encode's event completes (`sends.rs`) and receives into the page-locked slots; the
//! received headers are checked as the schedule reaches their decodes. Two `sra::Side`s over
//! the host's `Ctx` use it: `MoveSide`, for a call whose device work was all enqueued before
//! (its encodes and decodes are on the stream already, so here they only check what arrived,
//! and the next exchange, or the end, stores the progress value that lets the stream decode
//! them; nothing is enqueued), and `Lockstep`, which enqueues each step's device work as the
//! schedule reaches it (`side.rs` without progress waits: a decode is enqueued once its
//! bytes are checked), for calls that wait for their result.

use super::script::{Board, Script};
use super::sends::EncodedSends;
use super::side::DeviceSide;
use super::state::DeviceStats;
use super::GpuAllReduce;
use crate::algo::compressed::gather::GatherSide;
use crate::algo::compressed::hop::{HopSide, Outgoing};
use crate::algo::compressed::sra::{Phase, Side, SETS};
use crate::algo::Ctx;
use crate::codec::checked_payload;
use crate::error::{Error, Result};
use crate::transport::{LateSend, RecvReq};
use std::ops::Range;

/// The worker's state through one call's exchanges.
pub(super) struct Mover<'a> {
    pub(super) g: &'a GpuAllReduce,
    /// Exchanges so far.
    pub(super) x: usize,
    /// Bytes received from each peer in the latest exchange.
    landed: Vec<usize>,
    /// Encodes posted on the board known done: one stream runs them in order, so each query
    /// starts where the last found one still queued.
    encoded: usize,
    pub(super) stats: DeviceStats,
}

/// The worker's side of a call enqueued before (`GpuAllReduce::enqueue`).
pub(super) struct MoveSide<'a> {
    pub(super) mover: Mover<'a>,
    pub(super) script: &'a mut Script,
}

/// The side of a call that waits for its result: each step's device work enqueued as the
/// schedule reaches it, its bytes moved in between.
pub(super) struct Lockstep<'a> {
    pub(super) mover: Mover<'a>,
    pub(super) dev: DeviceSide<'a>,
}

impl<'a> Mover<'a> {
    pub(super) fn new(g: &'a GpuAllReduce, n: usize) -> Mover<'a> {
        Mover {
            g,
            x: 0,
            landed: vec![0; n],
            encoded: 0,
            stats: DeviceStats::default(),
        }
    }

    /// Checks the headers of the bytes received from `p` in the latest exchange against the
    /// pieces of elements `r`, before the stream may decode them.
    fn check(&self, board: &Board, p: usize, r: Range<usize>) -> Result<()> {
        let set =
            self.x.checked_sub(1).ok_or_else(|| {
                Error::Internal("a decode before any exchange of the call".into())
            })? % SETS;
        let landed = self.landed[p];
        // SAFETY: `landed` (<= slot) bytes of receive slot p of `set`, written by the latest
        // exchange; the stream reads them only after this check.
        let bytes =
            unsafe { std::slice::from_raw_parts(board.recv_slot(set, p).cast_const(), landed) };
        let mut at = 0;
        for (q, _, codec) in self.g.pieces(r.clone()) {
            let len = codec.max_encoded_len(q.len());
            if at + len > landed {
                return Err(Error::invalid(format!(
                    "encoding of elements {r:?} is {landed} bytes, shorter than its pieces"
                )));
            }
            checked_payload(&**codec, &bytes[at..at + len], q.len())?;
            at += len;
        }
        if at != landed {
            return Err(Error::invalid(format!(
                "encoding of elements {r:?} is {landed} bytes, expected {at}"
            )));
        }
        Ok(())
    }

    /// Exchange `self.x` of `board` on `ctx`: its bytes sent to the ranks `to`, `land(p)`
    /// bytes received from each rank p of `from`; waits for it to be posted (it may still be
    /// being enqueued).
    fn swap(
        &mut self,
        board: &Board,
        ctx: &mut Ctx<'_>,
        to: &[usize],
        from: &[usize],
        land: &dyn Fn(usize) -> usize,
    ) -> Result<()> {
        let timeout = self.g.timeout;
        let s = board;
        let ex = s.exchange(self.x, timeout)?;
        let expected: Vec<usize> = ex.sends.iter().map(|s| s.0).collect();
        if ex.rset != self.x % SETS || expected != to || ex.from != from {
            return Err(Error::Internal(format!(
                "exchange {} to ranks {to:?} from {from:?} was enqueued to {expected:?} from {:?}",
                self.x, ex.from
            )));
        }
        if let Some(d) = &ex.drained {
            d.synchronize(timeout).map_err(|e| {
                Error::Timeout(format!(
                    "compressed all-reduce on device buffers: the decodes of receive set {} \
                     are not done: {e}",
                    ex.rset
                ))
            })?;
        }
        self.stats.exchanges += 1;
        if s.encodes_queued(&mut self.encoded) {
            self.stats.overlapped += 1;
        }
        let mut recvs = Vec::with_capacity(from.len());
        for &p in from {
            let len = land(p);
            if len > s.slot {
                return Err(Error::Internal(format!(
                    "{len} bytes from rank {p} do not fit a {}-byte slot",
                    s.slot
                )));
            }
            self.landed[p] = len;
            // SAFETY: receive slot p of set `rset`, `len` <= `slot` bytes of page-locked
            // memory of the comm's, apart from every send slot; no copy reads it any more
            // (its decodes' event waited for above) and none will before this exchange's
            // bytes are checked.
            recvs.push(RecvReq::new(p, unsafe {
                std::slice::from_raw_parts_mut(s.recv_slot(ex.rset, p), len)
            }));
        }
        let late: Vec<LateSend> = ex
            .sends
            .iter()
            .map(|&(peer, _, len, _)| LateSend { peer, len })
            .collect();
        let bytes = ex
            .sends
            .iter()
            .map(|(p, at, len, e)| (*p, e.as_deref(), *at, *len));
        let bad = s.words.bad_ptr().cast_const();
        let mut sends = EncodedSends::new(s.n, timeout, bad, bytes);
        let done = ctx.exchange_late(&[], &late, &mut sends, &mut recvs);
        self.stats.late_sends += sends.late();
        self.x += 1;
        done
    }
}

impl<'c> Side<Ctx<'c>> for MoveSide<'_> {
    fn len(&self, r: &Range<usize>) -> usize {
        self.mover.g.encoded_len(r.clone())
    }

    fn encode_for(&mut self, _: usize, _: usize, _: Range<usize>) -> Result<()> {
        Ok(())
    }

    fn keep_own(&mut self, _: Range<usize>) -> Result<()> {
        Ok(())
    }

    fn add_from(&mut self, p: usize, r: Range<usize>) -> Result<()> {
        self.mover.check(&self.script.board, p, r)
    }

    fn encode_own(&mut self, _: usize, _: Range<usize>) -> Result<()> {
        Ok(())
    }

    fn take_from(&mut self, p: usize, r: Range<usize>) -> Result<()> {
        self.mover.check(&self.script.board, p, r)
    }

    fn swap(
        &mut self,
        ctx: &mut Ctx<'c>,
        _set: usize,
        peers: &[usize],
        _phase: Phase,
        land: &dyn Fn(usize) -> usize,
    ) -> Result<()> {
        // The previous exchange's headers are checked: the stream may decode its bytes.
        let board = &self.script.board;
        board.release(self.mover.x);
        self.mover.swap(board, ctx, peers, peers, land)
    }
}

impl<'c> HopSide<Ctx<'c>> for MoveSide<'_> {
    fn len(&self, r: &Range<usize>) -> usize {
        self.mover.g.encoded_len(r.clone())
    }

    fn encode_to(&mut self, _: usize, _: usize, _: Range<usize>) -> Result<()> {
        Ok(())
    }

    fn encode_own_to(&mut self, _: usize, _: usize, _: Range<usize>) -> Result<()> {
        Ok(())
    }

    fn pass(
        &mut self,
        ctx: &mut Ctx<'c>,
        _: Outgoing,
        to: &[usize],
        from: &[usize],
        land: usize,
    ) -> Result<()> {
        // As `swap`: the previous exchange's headers are checked.
        let board = &self.script.board;
        board.release(self.mover.x);
        self.mover.swap(board, ctx, to, from, &|_| land)
    }

    fn take(&mut self, from: usize, r: Range<usize>, _: bool) -> Result<()> {
        self.mover.check(&self.script.board, from, r)
    }
}

impl<'c> GatherSide<Ctx<'c>> for MoveSide<'_> {
    fn zero(&mut self, _: Range<usize>) -> Result<()> {
        Ok(())
    }

    fn add_own(&mut self, _: usize, _: Range<usize>) -> Result<()> {
        Ok(())
    }
}

impl<'c> GatherSide<Ctx<'c>> for Lockstep<'_> {
    fn zero(&mut self, r: Range<usize>) -> Result<()> {
        self.dev.zero(r)
    }

    fn add_own(&mut self, set: usize, r: Range<usize>) -> Result<()> {
        self.dev.add_own(set, r)
    }
}

impl<'c> Side<Ctx<'c>> for Lockstep<'_> {
    fn len(&self, r: &Range<usize>) -> usize {
        self.mover.g.encoded_len(r.clone())
    }

    fn encode_for(&mut self, set: usize, p: usize, r: Range<usize>) -> Result<()> {
        self.dev.encode_for(set, p, r)
    }

    fn keep_own(&mut self, r: Range<usize>) -> Result<()> {
        self.dev.keep_own(r)
    }

    fn add_from(&mut self, p: usize, r: Range<usize>) -> Result<()> {
        self.mover.check(self.dev.board(), p, r.clone())?;
        self.dev.add_from(p, r)
    }

    fn encode_own(&mut self, set: usize, r: Range<usize>) -> Result<()> {
        self.dev.encode_own(set, r)
    }

    fn take_from(&mut self, p: usize, r: Range<usize>) -> Result<()> {
        self.mover.check(self.dev.board(), p, r.clone())?;
        self.dev.take_from(p, r)
    }

    fn swap(
        &mut self,
        ctx: &mut Ctx<'c>,
        set: usize,
        peers: &[usize],
        phase: Phase,
        land: &dyn Fn(usize) -> usize,
    ) -> Result<()> {
        self.dev.swap(&mut (), set, peers, phase, land)?;
        let board = self.dev.board();
        self.mover.swap(board, ctx, peers, peers, land)
    }
}

impl<'c> HopSide<Ctx<'c>> for Lockstep<'_> {
    fn len(&self, r: &Range<usize>) -> usize {
        self.mover.g.encoded_len(r.clone())
    }

    fn encode_to(&mut self, set: usize, slot: usize, r: Range<usize>) -> Result<()> {
        self.dev.encode_to(set, slot, r)
    }

    fn encode_own_to(&mut self, set: usize, slot: usize, r: Range<usize>) -> Result<()> {
        self.dev.encode_own_to(set, slot, r)
    }

    fn pass(
        &mut self,
        ctx: &mut Ctx<'c>,
        what: Outgoing,
        to: &[usize],
        from: &[usize],
        land: usize,
    ) -> Result<()> {
        self.dev.pass(&mut (), what, to, from, land)?;
        let board = self.dev.board();
        self.mover.swap(board, ctx, to, from, &|_| land)
    }

    fn take(&mut self, from: usize, r: Range<usize>, add: bool) -> Result<()> {
        self.mover.check(self.dev.board(), from, r.clone())?;
        self.dev.take(from, r, add)
    }
}
