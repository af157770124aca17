//! Compressed SRA all-reduce on device buffers with the codecs on the GPU (issue #22): the
//! CPU schedule (`algo::compressed::sra::run`), with a `Side` whose data stays in device
//! memory. A slice leaving this rank is encoded by its codec's kernels (error feedback fused)
//! into aligned device scratch and only its payload is copied to page-locked memory, after
//! the 32-byte header the host wrote there; a received chunk's header is checked on the host,
//! its payload copied into device scratch and decoded (added) there. Only encoded bytes cross
//! PCIe, and they are the CPU codecs' bytes: host and device ranks of one job end
//! bit-identical.
//!
//! The arithmetic is the CPU's, step for step: the input plus the residual (`qccl_ef_compensate`
//! for this rank's own slice, `encode_ef` for the peers'), own data exact and then the peers'
//! decoded contributions in rank order, the owner's sum encoded once and replaced by its
//! decoded value, Avg's division after the sum (`qccl_finish_avg_f32`).
//!
//! Every kernel and copy of a call runs on one stream of the comm's, in order; the stream is
//! synchronised before each exchange (a send reads what the copies wrote, a receive
//! overwrites what they read) and at the end. The residual of a tensor key lives in device
//! memory, kept across calls; a key used on host buffers before starts again from zero here
//! (and the reverse).

use super::driver::{Arg, Driver};
use super::plans::{grid_for, plan_for, CodecPlan, BLOCK};
use crate::algo::compressed::sra::{self, Phase, Side};
use crate::algo::compressed::{chunk, nslices, slice};
use crate::algo::{Algo, Ctx};
use crate::codec::ef::TensorKey;
use crate::codec::layout::CodecMap;
use crate::codec::{checked_payload, write_header, Codec, Site, HEADER_LEN};
use crate::coll::compressed::Coded;
use crate::coll::Engine;
use crate::comm::Report;
use crate::error::{Error, Result};
use crate::transport::frame::CollKind;
use crate::types::{DType, ReduceOp};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

// Kept by the engine across calls (its own file, so the engine need not import the call).
pub(crate) mod state;

use state::{addr, Sizes};
pub use state::{DeviceState, DeviceStats};

/// A compressed all-reduce on device buffers, checked and with its kernels loaded; runs on
/// its comm's engine (`run`).
pub struct GpuAllReduce {
    driver: Arc<dyn Driver>,
    ordinal: usize,
    plan: CodecMap,
    /// Launch plan of each codec of `plan`, by spec.
    plans: HashMap<String, Arc<dyn CodecPlan>>,
    key: Option<TensorKey>,
    op: ReduceOp,
    count: usize,
    send: Option<u64>,
    recv: u64,
    seed: u64,
    timeout: Duration,
}

/// The call's shape: (plan, tensor key, op, count, seed).
pub(crate) type Shape<'a> = (&'a CodecMap, Option<&'a TensorKey>, ReduceOp, usize, u64);

impl GpuAllReduce {
    /// The all-reduce of `count` (> 0) f32s of device memory `recv` (in place) or from `send`,
    /// both on device `ordinal` and 4-byte aligned. `Unsupported` when a codec of the plan
    /// has no launch plan, or the kernels cannot be loaded (the caller then stages the call).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        driver: Arc<dyn Driver>,
        ordinal: usize,
        (plan, key, op, count, seed): Shape<'_>,
        send: Option<u64>,
        recv: u64,
        timeout: Duration,
    ) -> Result<GpuAllReduce> {
        let mut plans = HashMap::new();
        for c in plan.codecs() {
            if let std::collections::hash_map::Entry::Vacant(v) = plans.entry(c.spec()) {
                v.insert(Arc::from(plan_for(&*driver, ordinal, &**c)?));
            }
        }
        // Loaded now, outside the comm's turn: a first load may build the kernel file.
        DeviceState::functions(&*driver, ordinal)?;
        Ok(GpuAllReduce {
            driver,
            ordinal,
            plan: plan.clone(),
            plans,
            key: key.cloned(),
            op,
            count,
            send,
            recv,
            seed,
            timeout,
        })
    }

    /// The driver it runs on.
    pub fn driver(&self) -> Arc<dyn Driver> {
        self.driver.clone()
    }

    /// The device it runs on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn plan_of(&self, codec: &dyn Codec) -> Result<&dyn CodecPlan> {
        self.plans
            .get(&codec.spec())
            .map(|p| &**p)
            .ok_or_else(|| Error::Internal(format!("no launch plan loaded for {}", codec.spec())))
    }

    /// Runs the call on `e` (its comm's engine, in its turn), after the caller's earlier work
    /// on the buffers is done; returns once the result is in `recv`. As the host's
    /// `coded_turn`: takes the call's step and the tensor's residual.
    ///
    /// The buffers must stay valid, and be touched by nothing else, until this returns (the
    /// promise `Comm::run_gpu_all_reduce`'s caller made).
    pub fn run(&self, e: &mut Engine) -> Result<Report> {
        crate::qlog!(
            Trace,
            "rank {}: all_reduce(count={}, {}, {}): compressed, codecs on device {}",
            e.rank,
            self.count,
            DType::Float32,
            self.op,
            self.ordinal
        );
        let step = e.coded_calls;
        e.coded_calls += 1;
        let key = self.key.as_ref().filter(|_| self.plan.error_feedback());
        if let Some(k) = key {
            // A key used on host buffers before starts again from zero here.
            e.residuals.remove(k);
        }
        let mut st = match e.gpu.take() {
            Some(st) => st,
            None => DeviceState::new(&*self.driver, self.ordinal)?,
        };
        let out = st.all_reduce(e, self, step, key);
        e.gpu = Some(st);
        out
    }
}

impl DeviceState {
    fn all_reduce(
        &mut self,
        e: &mut Engine,
        g: &GpuAllReduce,
        step: u64,
        key: Option<&TensorKey>,
    ) -> Result<Report> {
        let (count, n, rank) = (g.count, e.size, e.rank);
        let res = match key {
            Some(k) => Some(self.residual(&*g.driver, k, count, g.timeout)?),
            None => None,
        };
        let site = Site {
            seed: g.seed,
            step,
            chunk: 0,
            rank: rank as u64,
        };
        let w0 = e.wire;
        // SAFETY: page-locked memory of ours; the stream is idle.
        unsafe { self.bad_word().write_volatile(0) };
        if n == 1 {
            // As the host's: the residual added (or the input copied), nothing sent.
            self.compensate(g.send.unwrap_or(g.recv), res, g.recv, count)?;
        } else {
            let coded = Coded::new(&g.plan, site, 0, None, DType::Float32);
            let mut ctx = e.coded_ctx(CollKind::AllReduce, count, &coded, Algo::Sra);
            let sizes = sizes(&ctx, g)?;
            self.reserve(&*g.driver, &sizes, n)?;
            let wire = self.wire.as_ref().map_or(std::ptr::null_mut(), |w| w.ptr());
            let (payload, scratch) = (addr(&self.payload), addr(&self.scratch));
            let mut side = DeviceSide {
                st: self,
                g,
                site,
                res,
                wire,
                slot: sizes.slot,
                n,
                rank,
                payload,
                scratch,
                sent: vec![0; n],
                landed: vec![0; n],
            };
            sra::run(&mut ctx, &mut side, count, true)?;
        }
        if g.op == ReduceOp::Avg {
            let args = [Arg::Ptr(g.recv), Arg::U64(count as u64), Arg::U64(n as u64)];
            // SAFETY: reduce.cu's qccl_finish_avg_f32(float* x, uint64_t count, uint64_t n)
            // over the call's `count` f32s; as `compensate`.
            unsafe {
                self.stream
                    .launch(&*self.avg, grid_for(count.div_ceil(4)), BLOCK, &args)?
            };
        }
        self.sync(g.timeout)?;
        self.stats.calls += 1;
        Ok(Report::flat(Algo::Sra, e.wire - w0))
    }
}

/// The room `g` needs on `ctx`: the same chunks and slices as `sra::run`.
fn sizes(ctx: &Ctx<'_>, g: &GpuAllReduce) -> Result<Sizes> {
    let n = ctx.size;
    let chunks: Vec<_> = (0..n).map(|c| chunk(g.count, n, c)).collect();
    let nsl = nslices(ctx, chunks[n - 1].len());
    let mut s = Sizes {
        slot: 0,
        payload: 0,
        scratch: 0,
    };
    for c in &chunks {
        for j in 0..nsl {
            let r = slice(c, nsl, j);
            s.slot = s.slot.max(g.plan.encoded_len(r.clone()));
            for (q, codec) in g.plan.pieces(r) {
                let p = g.plan_of(&**codec)?;
                s.payload = s.payload.max(p.payload_len(q.len()));
                s.scratch = s.scratch.max(p.scratch_len(q.len()));
            }
        }
    }
    Ok(s)
}

/// This rank's side of the schedule on the device: work is `g.recv`, the input `g.send`
/// (None: in place), wire slot `i` (bytes sent to peer i; this rank's own: its encoded sum)
/// at `wire + i·slot`, the bytes received from peer p at slot `n + p`.
struct DeviceSide<'a> {
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
    /// Bytes encoded into each send slot.
    sent: Vec<usize>,
    /// Bytes received into each receive slot.
    landed: Vec<usize>,
}

impl DeviceSide<'_> {
    fn slot_at(&self, i: usize) -> *mut u8 {
        self.wire.wrapping_add(i * self.slot)
    }

    /// Enqueues the encoding of elements `r` of `src` into send slot `to`: per piece, the
    /// header written here, the payload by the codec's kernels into device scratch, then
    /// copied after the header. `own`: the work buffer then takes the decoded value.
    fn encode(&mut self, src: u64, r: Range<usize>, to: usize, own: bool) -> Result<()> {
        let (g, s) = (self.g, &*self.st.stream);
        let base = self.slot_at(to);
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
            // ours that nothing reads or writes until the stream is synchronised before
            // the next exchange.
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
            // stream is synchronised (before the next exchange, and at the end of the call).
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
        self.sent[to] = at;
        Ok(())
    }

    /// Enqueues the decoding of the bytes received from `p` (the encoding of elements `r`)
    /// into the work buffer, or its addition when `add`; headers are checked here.
    fn decode(&mut self, p: usize, r: Range<usize>, add: bool) -> Result<()> {
        let (g, s) = (self.g, &*self.st.stream);
        let base = self.slot_at(self.n + p);
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
            // writes until the next exchange, after a synchronize.
            let bytes = unsafe { std::slice::from_raw_parts(base.add(at), len) };
            let payload = checked_payload(&**codec, bytes, count)?;
            let off = 4 * q.start as u64;
            let (dev, scratch) = (self.payload, self.scratch);
            // SAFETY: as in `encode`; the payload bytes stay untouched until the stream is
            // synchronised before the next exchange.
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
        Ok(())
    }
}

impl Side for DeviceSide<'_> {
    fn len(&self, r: &Range<usize>) -> usize {
        self.g.plan.encoded_len(r.clone())
    }

    fn encode_for(&mut self, p: usize, r: Range<usize>) -> Result<()> {
        self.encode(self.g.send.unwrap_or(self.g.recv), r, p, false)
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

    fn encode_own(&mut self, r: Range<usize>) -> Result<()> {
        self.encode(self.g.recv, r, self.rank, true)
    }

    fn take_from(&mut self, p: usize, r: Range<usize>) -> Result<()> {
        self.decode(p, r, false)
    }

    fn swap(
        &mut self,
        ctx: &mut Ctx<'_>,
        peers: &[usize],
        phase: Phase,
        land: &dyn Fn(usize) -> usize,
    ) -> Result<()> {
        // The encodes' copies are done (sends read them) and so are the decodes of the
        // previous exchange's bytes (the receives overwrite them).
        self.st.sync(self.g.timeout)?;
        let me = ctx.rank;
        let sends: Vec<&[u8]> = (0..self.n)
            .map(|i| {
                // SAFETY: send slot i holds `sent[i]` bytes written by this call (its own
                // slot: its encoded sum), which the stream no longer touches (synchronised
                // above).
                unsafe { std::slice::from_raw_parts(self.slot_at(i), self.sent[i]) }
            })
            .collect();
        let mut lands = Vec::with_capacity(peers.len());
        for &p in peers {
            let len = land(p);
            if len > self.slot {
                return Err(Error::Internal(format!(
                    "{len} bytes from rank {p} do not fit a {}-byte slot",
                    self.slot
                )));
            }
            self.landed[p] = len;
            // SAFETY: receive slot p, `len` <= `slot` bytes of page-locked memory of ours,
            // apart from every send slot; the stream no longer touches it.
            lands.push((p, unsafe {
                std::slice::from_raw_parts_mut(self.slot_at(self.n + p), len)
            }));
        }
        sra::swap(
            ctx,
            peers,
            |p| match phase {
                Phase::Scatter => sends[p],
                Phase::Gather => sends[me],
            },
            lands,
        )
    }
}
