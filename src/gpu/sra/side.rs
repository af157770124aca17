//! One call's side of the SRA schedule on the device (`sra::Side`), run once when the call is
//! made: every encode, copy and decode of the call is enqueued on the comm's stream, and each
//! exchange becomes a wait for the progress value the comm's worker stores once that
//! exchange's bytes arrived (`moves.rs`). An event after each encode lets the worker send
//! those bytes as soon as they are written, and an event after the decodes of each receive
//! set lets it receive there again (`Script`).

use super::script::{Board, Exchange};
use super::state::DeviceState;
use super::GpuAllReduce;
use crate::algo::compressed::gather::GatherSide;
use crate::algo::compressed::hop::{HopSide, Outgoing};
use crate::algo::compressed::sra::{Phase, Side, SETS};
use crate::codec::{write_header, Site, HEADER_LEN};
use crate::error::{Error, Result};
use crate::gpu::driver::Arg;
use std::ops::Range;

/// This rank's side of the schedule on the device: work is the f32 buffer `recv`, the input
/// `send` (None: in place) — the call's buffers, or its f32 copy for calls on other float types. The page-locked
/// wire holds [`SETS`] sets of `2n` slots of `slot` bytes:
/// in set k, slot i the bytes sent to peer i (this rank's own: its encoded sum), slot `n + p`
/// the bytes received from peer p.
pub(super) struct DeviceSide<'a> {
    st: &'a mut DeviceState,
    g: &'a GpuAllReduce,
    site: Site,
    res: Option<u64>,
    send: Option<u64>,
    recv: u64,
    rank: usize,
    payload: u64,
    scratch: u64,
    /// Bytes encoded into each send slot (`set·n + i`).
    sent: Vec<usize>,
    /// The event after the encode of each send slot (`set·n + i`), posted on the board.
    encoded: Vec<Option<usize>>,
    /// The event after the decodes that read each receive set, until it receives again.
    drained: Vec<Option<usize>>,
    /// The receive set whose decodes were enqueued since the last record.
    decoding: Option<usize>,
    /// Where the latest exchange received from one rank, for forwards (the ring's, the
    /// tree's way down): (set, peer, bytes).
    landed: Option<(usize, usize, usize)>,
    /// What the worker needs, posted as it is enqueued.
    board: &'a Board,
    /// Each exchange a wait for its progress value (false: the decodes are enqueued only
    /// once the bytes arrived, `Lockstep`).
    waits: bool,
    /// Bytes each way, for the stats.
    pub(super) to_host: u64,
    pub(super) to_device: u64,
}

impl<'a> DeviceSide<'a> {
    /// The side of call `g` on `st`, whose wire and scratch `reserve` sized; `board` is
    /// the call's, empty, and filled as the work is enqueued.
    pub(super) fn new(
        (st, g): (&'a mut DeviceState, &'a GpuAllReduce),
        (site, res): (Site, Option<u64>),
        (send, recv): (Option<u64>, u64),
        board: &'a Board,
        waits: bool,
    ) -> DeviceSide<'a> {
        let (payload, scratch) = (
            super::state::addr(&st.payload),
            super::state::addr(&st.scratch),
        );
        let n = board.n;
        DeviceSide {
            st,
            g,
            site,
            res,
            send,
            recv,
            rank: g.rank,
            payload,
            scratch,
            sent: vec![0; SETS * n],
            encoded: vec![None; SETS * n],
            drained: vec![None; SETS],
            decoding: None,
            landed: None,
            board,
            waits,
            to_host: 0,
            to_device: 0,
        }
    }

    /// The call's board.
    pub(super) fn board(&self) -> &Board {
        self.board
    }

    /// Records an event after the work so far and posts it (`encode`: after an encode).
    fn record(&mut self, encode: bool) -> Result<usize> {
        Ok(self.board.post_event(self.st.mark()?, encode))
    }

    /// Records the event that the decodes enqueued since the last exchange are done: their
    /// receive set may then take bytes again.
    fn close_decodes(&mut self) -> Result<()> {
        if let Some(set) = self.decoding.take() {
            self.drained[set] = Some(self.record(false)?);
        }
        Ok(())
    }

    /// Enqueues the encoding of elements `r` of `src` into send slot `to` of `set`: per
    /// piece, the header (`qccl_put_header`), the payload by the codec's kernels into device
    /// scratch, then copied after the header; an event after it. `own`: the work buffer then
    /// takes the decoded value.
    fn encode(
        &mut self,
        src: u64,
        r: Range<usize>,
        set: usize,
        to: usize,
        own: bool,
    ) -> Result<()> {
        self.close_decodes()?;
        let (g, s) = (self.g, &*self.st.stream);
        let base = self.board.send_slot(set, to);
        let bad = self.board.words.bad_ptr() as u64;
        let mut at = 0;
        for (q, at_plan, codec) in g.pieces(r) {
            let plan = g.plan_of(&**codec)?;
            let count = q.len();
            let len = codec.max_encoded_len(count);
            if plan.payload_len(count) != len - HEADER_LEN || at + len > self.board.slot {
                return Err(Error::Internal(format!(
                    "{}: launch plan's payload of {count} elements is {} bytes, the codec's {}",
                    codec.spec(),
                    plan.payload_len(count),
                    len - HEADER_LEN
                )));
            }
            let mut header = [0u8; HEADER_LEN];
            write_header(&**codec, count, &mut header);
            let w = |k: usize| {
                Arg::U64(u64::from_le_bytes(
                    header[8 * k..8 * k + 8].try_into().expect("8 bytes"),
                ))
            };
            let args = [
                Arg::Ptr(base.wrapping_add(at) as u64),
                w(0),
                w(1),
                w(2),
                w(3),
            ];
            let off = 4 * q.start as u64;
            let key = Site {
                chunk: at_plan as u64,
                ..self.site
            }
            .key();
            let (payload, scratch) = (self.payload, self.scratch);
            // SAFETY: wire.cu's qccl_put_header(uint8_t*, 4 × uint64_t) writes the slot's 32
            // bytes at `at` (within the slot: checked above), page-locked memory that the
            // stream reaches only after the exchange that last sent from it (its progress
            // wait precedes this). `src`, `recv` and the residual hold the call's f32s
            // (`off` + count within them), `payload` and `scratch` the room `sizes` found,
            // `bad` a page-locked word; all stay valid, and are touched by nothing else,
            // until the call's `done` event. The worker reads the slot's bytes only after the
            // event recorded below.
            unsafe {
                s.launch(&*self.st.header, 1, 32, &args)?;
                match self.res {
                    Some(res) => {
                        plan.encode_ef(s, src + off, res + off, 0, payload, count, key, scratch)?
                    }
                    None => plan.encode(s, src + off, payload, count, key, scratch)?,
                }
                if len > HEADER_LEN {
                    s.copy_to_host(base.add(at + HEADER_LEN), payload, len - HEADER_LEN)?;
                }
                if own {
                    plan.decode(s, payload, self.recv + off, count, false, bad, scratch)?;
                }
            }
            self.to_host += (len - HEADER_LEN) as u64;
            at += len;
        }
        let i = set * self.board.n + to;
        self.sent[i] = at;
        self.encoded[i] = Some(self.record(true)?);
        Ok(())
    }

    /// Enqueues the decoding of the bytes received from `p` in the latest exchange (the
    /// encoding of elements `r`) into the work buffer, or its addition when `add`. The
    /// stream reaches it once the worker checked the headers and stored the exchange's
    /// progress value.
    fn decode(&mut self, p: usize, r: Range<usize>, add: bool) -> Result<()> {
        let x =
            self.board.exchanges().checked_sub(1).ok_or_else(|| {
                Error::Internal("a decode before any exchange of the call".into())
            })?;
        let set = x % SETS;
        self.decode_slot(self.board.recv_slot(set, p), set, r, add)
    }

    /// Enqueues the decoding (or addition, `add`) of the encoding of elements `r` in the
    /// page-locked slot at `base` of `set` (received, or this rank's own) into the work
    /// buffer.
    fn decode_slot(&mut self, base: *mut u8, set: usize, r: Range<usize>, add: bool) -> Result<()> {
        let (g, s) = (self.g, &*self.st.stream);
        let bad = self.board.words.bad_ptr() as u64;
        let mut at = 0;
        for (q, _, codec) in g.pieces(r) {
            let plan = g.plan_of(&**codec)?;
            let count = q.len();
            let payload = codec.max_encoded_len(count) - HEADER_LEN;
            let off = 4 * q.start as u64;
            let (dev, scratch) = (self.payload, self.scratch);
            // SAFETY: within the slot at `base` (the schedule's lengths fit the slot:
            // `sizes`): a receive slot of `set`, page-locked memory the worker fills before
            // it stores the progress value this copy waits behind, and does not fill again
            // before the event after these decodes (`drained`); or this rank's own send slot,
            // written by the encode's copy earlier on this stream. The device ranges as in
            // `encode`.
            unsafe {
                if payload > 0 {
                    s.copy_to_device(dev, base.add(at + HEADER_LEN), payload)?;
                }
                plan.decode(s, dev, self.recv + off, count, add, bad, scratch)?;
            }
            self.to_device += payload as u64;
            at += HEADER_LEN + payload;
        }
        self.decoding = Some(set);
        Ok(())
    }
}

impl GatherSide<()> for DeviceSide<'_> {
    fn zero(&mut self, r: Range<usize>) -> Result<()> {
        self.close_decodes()?;
        self.st.zero(self.recv + 4 * r.start as u64, r.len())
    }

    fn add_own(&mut self, set: usize, r: Range<usize>) -> Result<()> {
        self.decode_slot(self.board.send_slot(set, self.rank), set, r, true)
    }
}

impl Side<()> for DeviceSide<'_> {
    fn len(&self, r: &Range<usize>) -> usize {
        self.g.encoded_len(r.clone())
    }

    fn encode_for(&mut self, set: usize, p: usize, r: Range<usize>) -> Result<()> {
        self.encode(self.send.unwrap_or(self.recv), r, set, p, false)
    }

    fn keep_own(&mut self, r: Range<usize>) -> Result<()> {
        let off = 4 * r.start as u64;
        let src = self.send.unwrap_or(self.recv) + off;
        let res = self.res.map(|a| a + off);
        self.st.compensate(src, res, self.recv + off, r.len())
    }

    fn add_from(&mut self, p: usize, r: Range<usize>) -> Result<()> {
        self.decode(p, r, true)
    }

    fn encode_own(&mut self, set: usize, r: Range<usize>) -> Result<()> {
        self.encode(self.recv, r, set, self.rank, true)
    }

    fn take_from(&mut self, p: usize, r: Range<usize>) -> Result<()> {
        self.decode(p, r, false)
    }

    fn swap(
        &mut self,
        _: &mut (),
        set: usize,
        peers: &[usize],
        phase: Phase,
        land: &dyn Fn(usize) -> usize,
    ) -> Result<()> {
        // Each peer's bytes: its own slot (scatter) or this rank's encoded sum (gather).
        let (n, me) = (self.board.n, self.rank);
        let from = |p: usize| match phase {
            Phase::Scatter => p,
            Phase::Gather => me,
        };
        let sends = peers
            .iter()
            .map(|&p| {
                let i = set * n + from(p);
                (
                    p,
                    self.board.send_slot(set, from(p)).cast_const(),
                    self.sent[i],
                    self.encoded[i],
                )
            })
            .collect();
        self.post(sends, peers, land)
    }
}

impl HopSide<()> for DeviceSide<'_> {
    fn len(&self, r: &Range<usize>) -> usize {
        self.g.encoded_len(r.clone())
    }

    fn encode_to(&mut self, set: usize, slot: usize, r: Range<usize>) -> Result<()> {
        self.encode(self.recv, r, set, slot, false)
    }

    fn encode_own_to(&mut self, set: usize, slot: usize, r: Range<usize>) -> Result<()> {
        self.encode(self.recv, r, set, slot, true)
    }

    fn pass(
        &mut self,
        _: &mut (),
        what: Outgoing,
        to: &[usize],
        from: &[usize],
        land: usize,
    ) -> Result<()> {
        // The bytes, their length and the event after their encode (None: ready).
        let bytes = match what {
            Outgoing::Encoded { set, slot } => {
                let i = set * self.board.n + slot;
                let at = self.board.send_slot(set, slot).cast_const();
                (at, self.sent[i], self.encoded[i])
            }
            Outgoing::Forward => {
                let (set, p, len) = self.landed.ok_or_else(|| {
                    Error::Internal("a forward after an exchange that received from no one".into())
                })?;
                // Checked by the worker when it arrived; sent from the host, as it is.
                (self.board.recv_slot(set, p).cast_const(), len, None)
            }
            Outgoing::Kept(j) => {
                return Err(Error::Internal(format!(
                    "total {j} sent, but the device keeps no totals"
                )))
            }
            Outgoing::Nothing => (std::ptr::null(), 0, None),
        };
        let sends = to.iter().map(|&p| (p, bytes.0, bytes.1, bytes.2)).collect();
        self.post(sends, from, &|_| land)
    }

    fn take(&mut self, from: usize, r: Range<usize>, add: bool) -> Result<()> {
        self.decode(from, r, add)
    }
}

impl DeviceSide<'_> {
    /// Posts the next exchange: `sends` (peer, slot, bytes, its encode's event) and `land(p)`
    /// bytes received from each of `from`; with `waits`, the stream's decodes then wait for
    /// its progress value.
    fn post(
        &mut self,
        sends: Vec<(usize, *const u8, usize, Option<usize>)>,
        from: &[usize],
        land: &dyn Fn(usize) -> usize,
    ) -> Result<()> {
        self.close_decodes()?;
        let x = self.board.exchanges();
        let rset = x % SETS;
        self.landed = match from {
            [p] => Some((rset, *p, land(*p))),
            _ => None,
        };
        // From here the worker may move this exchange's bytes, while the rest is enqueued.
        self.board.post_exchange(Exchange {
            rset,
            drained: self.drained[rset].take(),
            sends,
            from: from.to_vec(),
        });
        if !self.waits {
            return Ok(());
        }
        let value = self.board.base.wrapping_add(x as u32 + 1);
        // SAFETY: the progress word is page-locked memory of this driver, aligned, kept
        // alive by the Board (whose Script's drop stores at least this value) and the comm's
        // state.
        unsafe {
            self.st
                .stream
                .wait_word(self.board.words.progress_ptr(), value)?
        };
        Ok(())
    }
}
