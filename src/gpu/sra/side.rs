//! One call's side of the SRA schedule on the device (`sra::Side`), pipelined: every encode
//! and decode only enqueues work on the comm's stream; an event after each encode lets the
//! exchange send those bytes as soon as they are written (`sends.rs`), and an event after the
//! decodes of each receive set lets it receive there again.

use super::sends::EncodedSends;
use super::state::DeviceState;
use super::GpuAllReduce;
use crate::algo::compressed::sra::{Phase, Side, SETS};
use crate::algo::Ctx;
use crate::codec::{checked_payload, write_header, Site, HEADER_LEN};
use crate::error::{Error, Result};
use crate::gpu::driver::Event;
use crate::transport::{LateSend, RecvReq};
use std::ops::Range;

/// This rank's side of the schedule on the device: work is `g.recv`, the input `g.send`
/// (None: in place). The page-locked wire holds [`SETS`] sets of `2n` slots of `slot` bytes:
/// in set k, slot i the bytes sent to peer i (this rank's own: its encoded sum), slot `n + p`
/// the bytes received from peer p.
pub(super) struct DeviceSide<'a> {
    st: &'a mut DeviceState,
    g: &'a GpuAllReduce,
    site: Site,
    res: Option<u64>,
    wire: *mut u8,
    slot: usize,
    n: usize,
    rank: usize,
    payload: u64,
    scratch: u64,
    /// Bytes encoded into each send slot (`set·n + i`).
    sent: Vec<usize>,
    /// The event after the encode of each send slot (`set·n + i`).
    encoded: Vec<Option<Box<dyn Event>>>,
    /// Bytes received into each receive slot of the latest exchange.
    landed: Vec<usize>,
    /// Exchanges so far: exchange x receives into set `x % SETS`.
    exchanges: usize,
    /// The event after the decodes that read each receive set, until it receives again.
    drained: Vec<Option<Box<dyn Event>>>,
    /// The receive set whose decodes were enqueued since the last record.
    decoding: Option<usize>,
}

impl<'a> DeviceSide<'a> {
    /// The side of call `g` on `st`, whose wire and scratch `reserve` sized with `slot`.
    pub(super) fn new(
        st: &'a mut DeviceState,
        g: &'a GpuAllReduce,
        site: Site,
        res: Option<u64>,
        slot: usize,
        (n, rank): (usize, usize),
    ) -> DeviceSide<'a> {
        let wire = st.wire.as_ref().map_or(std::ptr::null_mut(), |w| w.ptr());
        let (payload, scratch) = (
            super::state::addr(&st.payload),
            super::state::addr(&st.scratch),
        );
        DeviceSide {
            st,
            g,
            site,
            res,
            wire,
            slot,
            n,
            rank,
            payload,
            scratch,
            sent: vec![0; SETS * n],
            encoded: (0..SETS * n).map(|_| None).collect(),
            landed: vec![0; n],
            exchanges: 0,
            drained: (0..SETS).map(|_| None).collect(),
            decoding: None,
        }
    }

    fn send_slot(&self, set: usize, i: usize) -> *mut u8 {
        self.wire.wrapping_add((set * 2 * self.n + i) * self.slot)
    }

    fn recv_slot(&self, set: usize, p: usize) -> *mut u8 {
        self.send_slot(set, self.n + p)
    }

    /// Records the event that the decodes enqueued since the last exchange are done: their
    /// receive set may then take bytes again.
    fn close_decodes(&mut self) -> Result<()> {
        if let Some(set) = self.decoding.take() {
            self.drained[set] = Some(self.st.stream.record()?);
        }
        Ok(())
    }

    /// Enqueues the encoding of elements `r` of `src` into send slot `to` of `set`: per
    /// piece, the header written here, the payload by the codec's kernels into device
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
        let base = self.send_slot(set, to);
        let bad = self.st.bad_word() as u64;
        let mut at = 0;
        for (q, codec) in g.plan.pieces(r) {
            let plan = g.plan_of(&**codec)?;
            let count = q.len();
            let len = codec.max_encoded_len(count);
            if plan.payload_len(count) != len - HEADER_LEN || at + len > self.slot {
                return Err(Error::Internal(format!(
                    "{}: launch plan's payload of {count} elements is {} bytes, the codec's {}",
                    codec.spec(),
                    plan.payload_len(count),
                    len - HEADER_LEN
                )));
            }
            // SAFETY: the slot holds `slot` bytes (checked above) of page-locked memory of
            // ours. Nothing reads it: its last exchange (SETS exchanges of this set ago) has
            // returned, and no copy writes it: the previous encode into it completed before
            // that exchange sent its bytes.
            let header = unsafe { std::slice::from_raw_parts_mut(base.add(at), HEADER_LEN) };
            write_header(&**codec, count, header);
            let off = 4 * q.start as u64;
            let key = Site {
                chunk: q.start as u64,
                ..self.site
            }
            .key();
            let (payload, scratch) = (self.payload, self.scratch);
            // SAFETY: `src`, `recv` and the residual hold the call's f32s (`off` + count
            // within them), `payload` and `scratch` the room `sizes` found, `bad` a
            // page-locked word; all stay valid and are touched by nothing else until the
            // stream is synchronised at the end of the call. The slot's bytes are read by
            // the exchange only after the event recorded below.
            unsafe {
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
                    plan.decode(s, payload, g.recv + off, count, false, bad, scratch)?;
                }
            }
            self.st.stats.to_host += (len - HEADER_LEN) as u64;
            at += len;
        }
        let i = set * self.n + to;
        self.sent[i] = at;
        self.encoded[i] = Some(self.st.stream.record()?);
        Ok(())
    }

    /// Enqueues the decoding of the bytes received from `p` in the latest exchange (the
    /// encoding of elements `r`) into the work buffer, or its addition when `add`; headers
    /// are checked here.
    fn decode(&mut self, p: usize, r: Range<usize>, add: bool) -> Result<()> {
        let set =
            self.exchanges.checked_sub(1).ok_or_else(|| {
                Error::Internal("a decode before any exchange of the call".into())
            })? % SETS;
        let (g, s) = (self.g, &*self.st.stream);
        let base = self.recv_slot(set, p);
        let bad = self.st.bad_word() as u64;
        let mut at = 0;
        for (q, codec) in g.plan.pieces(r.clone()) {
            let plan = g.plan_of(&**codec)?;
            let count = q.len();
            let len = codec.max_encoded_len(count);
            if at + len > self.landed[p] {
                return Err(Error::invalid(format!(
                    "encoding of elements {r:?} is {} bytes, shorter than its pieces",
                    self.landed[p]
                )));
            }
            // SAFETY: within the bytes received from `p` (checked above), which nothing
            // writes until this set receives again, after the decodes' event.
            let bytes = unsafe { std::slice::from_raw_parts(base.add(at), len) };
            let payload = checked_payload(&**codec, bytes, count)?;
            let off = 4 * q.start as u64;
            let (dev, scratch) = (self.payload, self.scratch);
            // SAFETY: as in `encode`; the payload bytes stay untouched until the event after
            // these decodes completes (`swap` waits for it before the set receives again).
            unsafe {
                if !payload.is_empty() {
                    s.copy_to_device(dev, payload.as_ptr(), payload.len())?;
                }
                plan.decode(s, dev, g.recv + off, count, add, bad, scratch)?;
            }
            self.st.stats.to_device += payload.len() as u64;
            at += len;
        }
        if at != self.landed[p] {
            return Err(Error::invalid(format!(
                "encoding of elements {r:?} is {} bytes, expected {at}",
                self.landed[p]
            )));
        }
        self.decoding = Some(set);
        Ok(())
    }

    /// True when an encode enqueued so far has not run yet (the GPU still busy with it).
    fn encodes_queued(&self) -> Result<bool> {
        for e in self.encoded.iter().flatten() {
            if !e.query()? {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

impl Side for DeviceSide<'_> {
    fn len(&self, r: &Range<usize>) -> usize {
        self.g.plan.encoded_len(r.clone())
    }

    fn encode_for(&mut self, set: usize, p: usize, r: Range<usize>) -> Result<()> {
        self.encode(self.g.send.unwrap_or(self.g.recv), r, set, p, false)
    }

    fn keep_own(&mut self, r: Range<usize>) -> Result<()> {
        let off = 4 * r.start as u64;
        let src = self.g.send.unwrap_or(self.g.recv) + off;
        let res = self.res.map(|a| a + off);
        self.st.compensate(src, res, self.g.recv + off, r.len())
    }

    fn add_from(&mut self, p: usize, r: Range<usize>) -> Result<()> {
        self.decode(p, r, true)
    }

    fn encode_own(&mut self, set: usize, r: Range<usize>) -> Result<()> {
        self.encode(self.g.recv, r, set, self.rank, true)
    }

    fn take_from(&mut self, p: usize, r: Range<usize>) -> Result<()> {
        self.decode(p, r, false)
    }

    fn swap(
        &mut self,
        ctx: &mut Ctx<'_>,
        set: usize,
        peers: &[usize],
        phase: Phase,
        land: &dyn Fn(usize) -> usize,
    ) -> Result<()> {
        let timeout = self.g.timeout;
        self.close_decodes()?;
        // The set this exchange receives into: the decodes that read it last are done.
        let rset = self.exchanges % SETS;
        if let Some(e) = self.drained[rset].take() {
            e.synchronize(timeout).map_err(|e| {
                Error::Timeout(format!(
                    "compressed all-reduce on device buffers: the decodes of receive set {rset} \
                     are not done: {e}"
                ))
            })?;
        }
        self.exchanges += 1;
        self.st.stats.exchanges += 1;
        if self.encodes_queued()? {
            self.st.stats.overlapped += 1;
        }
        let mut recvs = Vec::with_capacity(peers.len());
        for &p in peers {
            let len = land(p);
            if len > self.slot {
                return Err(Error::Internal(format!(
                    "{len} bytes from rank {p} do not fit a {}-byte slot",
                    self.slot
                )));
            }
            self.landed[p] = len;
            // SAFETY: receive slot p of set `rset`, `len` <= `slot` bytes of page-locked
            // memory of ours, apart from every send slot; no copy reads it any more (waited
            // for above).
            recvs.push(RecvReq::new(p, unsafe {
                std::slice::from_raw_parts_mut(self.recv_slot(rset, p), len)
            }));
        }
        // Each peer's bytes: its own slot (scatter) or this rank's encoded sum (gather).
        let (n, me) = (self.n, self.rank);
        let from = |p: usize| match phase {
            Phase::Scatter => p,
            Phase::Gather => me,
        };
        let late: Vec<LateSend> = peers
            .iter()
            .map(|&p| LateSend {
                peer: p,
                len: self.sent[set * n + from(p)],
            })
            .collect();
        let bytes = peers.iter().map(|&p| {
            let i = from(p);
            (
                p,
                self.encoded[set * n + i].as_deref(),
                self.send_slot(set, i),
                self.sent[set * n + i],
            )
        });
        let mut sends = EncodedSends::new(n, timeout, self.st.bad_word(), bytes);
        let done = ctx.exchange_late(&[], &late, &mut sends, &mut recvs);
        self.st.stats.late_sends += sends.late();
        done
    }
}
