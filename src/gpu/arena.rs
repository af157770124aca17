//! Dense all-reduce, reduce-scatter and all-gather of device buffers through the
//! shared-memory arena (`transport::shm::arena`, for comms whose ranks all share one host):
//! the GPU copies straight into and out of the arena's segments, which are page-locked with
//! `Driver::register_host` (CGX's registered shared memory), and the copies overlap the
//! rounds. Per element: one copy device → arena, the owner's reduction on the CPU, one copy
//! arena → device; staging through page-locked buffers of qccl's own (`staging.rs`) adds a
//! host copy each way and copies the whole buffer before the collective starts and after it
//! ends.
//!
//! Round s (the rounds of `algo::arena::Rounds`, which every rank of the call computes the
//! same): this rank claims its slot (`Arena::try_claim`) and enqueues copies of its
//! contribution to every owner, its own included, into the slot's areas on the `down`
//! stream, and publishes the round staged once an event after them completes; it reduces
//! its own chunk's slice from its own area and the peers' (`algo::arena::reduce_into`, the
//! host path's order) into its result area; it enqueues copies of every owner's result
//! into the output on the `up` stream, and tells the owners once they completed. Each step
//! runs as soon as it can, several rounds in flight, so the copies of round s + 1 overlap
//! the reduction of round s. The bytes in the segments are the host path's (an all-gather's
//! owner publishes its part from its own area), so a rank on host buffers and one on device
//! buffers meet in the same call.
//!
//! A call on a caller's stream must return once enqueued, and nothing may be enqueued for it
//! later (`staging.rs`): its copies are all enqueued when it is made, in bands of rounds
//! through one page-locked buffer (`bands`, `Staging::start_banded`), and the same round
//! loop (`run_banded`) stages each round once its band landed and releases each band once
//! all its rounds are out. The loop is written once over its two ends (`Ends`: the device
//! streams, or the bands).
//!
//! `comm/arena_turn.rs` decides when a call comes here: when the host path would take the
//! arena's rounds for it.

use super::driver::{Driver, Event, Registered, Stream};
use super::staging::{Band, Banded};
use crate::algo::arena::{reduce_into, Rounds, Shape};
use crate::algo::Ctx;
use crate::error::{Error, Result};
use crate::transport::frame::OpDesc;
use crate::transport::shm::arena::Arena;
use crate::transport::wait::Waiter;
use std::collections::VecDeque;
use std::ffi::c_void;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One rank's device side of the arena on its comm's device, kept across calls.
pub struct ArenaLane {
    driver: Arc<dyn Driver>,
    ordinal: usize,
    /// Copies device → arena.
    down: Box<dyn Stream>,
    /// Copies arena → device.
    up: Box<dyn Stream>,
    timeout: Duration,
}

/// A call's device buffers: the input (an all-reduce's or reduce-scatter's whole input,
/// an all-gather's own part), the output (the whole buffer, or a reduce-scatter's own part
/// out of place), and the caller's stream (null: the legacy default stream).
#[derive(Debug, Clone, Copy)]
pub struct DeviceIo {
    /// Device address of the input.
    pub src: u64,
    /// Device address of the output.
    pub out: u64,
    /// In place (an all-gather then skips its own part; a reduce-scatter's output is the
    /// whole buffer).
    pub in_place: bool,
    /// The caller's `CUstream`.
    pub stream: *mut c_void,
}

impl ArenaLane {
    /// Streams of its own on device `ordinal`.
    pub fn new(driver: Arc<dyn Driver>, ordinal: usize, timeout: Duration) -> Result<ArenaLane> {
        Ok(ArenaLane {
            down: driver.create_stream(ordinal)?,
            up: driver.create_stream(ordinal)?,
            driver,
            ordinal,
            timeout,
        })
    }

    /// The device.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Page-locks every segment of `arena` once (held by the arena, released before it
    /// unmaps). Without it the copies still run, through the driver's own bounce buffers.
    fn register(&self, arena: &mut Arena) {
        if arena.holds() {
            return;
        }
        let mut held: Vec<Box<dyn Registered>> = Vec::new();
        for (ptr, len) in arena.segments() {
            // SAFETY: a whole mapping of the arena (page-aligned), mapped until the arena is
            // dropped, which drops what it holds first.
            match unsafe { self.driver.register_host(self.ordinal, ptr, len) } {
                Ok(r) => held.push(r),
                Err(e) => {
                    crate::qlog!(
                        Warn,
                        "rank {}: the arena's segments are not page-locked ({e}): copies to \
                         and from the device go through the driver's bounce buffers",
                        arena.rank()
                    );
                    held.clear();
                    break;
                }
            }
        }
        if !held.is_empty() {
            crate::qlog!(
                Info,
                "rank {}: the arena's {} segments ({} KiB) page-locked on the {} driver: \
                 device copies go straight in and out",
                arena.rank(),
                held.len(),
                held.iter().map(|r| r.len()).sum::<usize>() >> 10,
                self.driver.kind()
            );
        }
        arena.hold(Box::new(held));
    }

    /// Runs `shape` on `count` elements of `io`'s device buffers through the comm's arena,
    /// after the work enqueued on the caller's stream so far; returns once the result is in
    /// the output. False (nothing moved) when the comm has no arena.
    ///
    /// # Safety
    /// `io`'s buffers must be device memory of this lane's device, valid for the call's
    /// bytes (`count` elements; an all-gather's input one rank's part, a reduce-scatter's
    /// output out of place too) until this returns, the input not written meanwhile; the
    /// stream null or a live stream of the device.
    pub unsafe fn run(
        &mut self,
        ctx: &mut Ctx<'_>,
        shape: Shape,
        io: &DeviceIo,
        count: usize,
    ) -> Result<bool> {
        let (desc, dtype, op) = (ctx.desc, ctx.dtype, ctx.op);
        let Some(arena) = ctx.t.arena()? else {
            return Ok(false);
        };
        self.register(arena);
        // SAFETY: the caller's promise: null or a live stream of this device.
        let caller = unsafe { self.driver.borrow_stream(self.ordinal, io.stream)? };
        let before = caller.record()?;
        self.down.wait_event(&*before)?;
        self.up.wait_event(&*before)?;
        let call = Call::new(arena, shape, count, dtype.size(), io.in_place);
        let mut ends = DeviceEnds {
            down: &*self.down,
            up: &*self.up,
            io: *io,
            own_start: call.plan.chunks[call.me].start,
            shape,
        };
        let mut wire = (0u64, 0u64);
        // SAFETY: the caller's promise, passed on.
        let ran = unsafe {
            rounds(
                arena,
                &call,
                &mut ends,
                (&desc, dtype, op, self.timeout),
                &mut wire,
            )
        };
        // Whatever happened, no copy may touch the arena or the buffers once this returns.
        let drained = self
            .down
            .synchronize(self.timeout)
            .and(self.up.synchronize(self.timeout));
        ran.and(drained)?;
        ctx.wire.sent += wire.0;
        ctx.wire.received += wire.1;
        Ok(true)
    }
}

/// Runs `shape` on `count` elements through the comm's arena from and into the page-locked
/// buffer of a call started in bands on a caller's stream (`Staging::start_banded`, with
/// the bands [`bands`] made, `per_band` rounds each): a round is staged once its band
/// landed, and a band is released (its copies out may go) once all its rounds are out. The
/// worker enqueues no device work. False (nothing moved) when the comm has no arena; an
/// error when the arena's rounds are not the ones the bands were cut for.
pub fn run_banded(
    ctx: &mut Ctx<'_>,
    (shape, in_place): (Shape, bool),
    count: usize,
    banded: &Banded,
    (per_band, chunk): (usize, usize),
    timeout: Duration,
) -> Result<bool> {
    let (desc, dtype, op) = (ctx.desc, ctx.dtype, ctx.op);
    let Some(arena) = ctx.t.arena()? else {
        return Ok(false);
    };
    if arena.chunk() != chunk {
        return Err(Error::Internal(format!(
            "the call's bands were cut for {chunk}-byte rounds, the arena has {}",
            arena.chunk()
        )));
    }
    let call = Call::new(arena, shape, count, dtype.size(), in_place);
    let mut ends = PinnedEnds {
        banded,
        at: banded.ptr(),
        per_band,
        rounds: call.plan.rounds,
    };
    let mut wire = (0u64, 0u64);
    // SAFETY: the buffer holds the whole call's bytes (`bands`' offsets), each band's
    // only once it landed and until it is released.
    unsafe {
        rounds(
            arena,
            &call,
            &mut ends,
            (&desc, dtype, op, timeout),
            &mut wire,
        )?
    };
    ctx.wire.sent += wire.0;
    ctx.wire.received += wire.1;
    Ok(true)
}

/// The bands of a call of `count` elements of `es` bytes whose device buffers `io` names,
/// on `n` ranks of which this is `me`, through arena rounds of at most `chunk` bytes per
/// owner: each band's copies (`Staging::start_banded`, offsets into a buffer laid out as
/// the whole call), the rounds per band, and the buffer's bytes.
pub fn bands(
    shape: Shape,
    io: &DeviceIo,
    (n, me, chunk): (usize, usize, usize),
    count: usize,
    es: usize,
) -> (Vec<Band>, usize, usize) {
    let call = Call {
        plan: Rounds::of(n, chunk, count, es),
        shape,
        in_place: io.in_place,
        me,
        n,
    };
    let ends = DeviceEnds::addresses(io, shape, call.plan.chunks[me].start);
    let rounds = call.plan.rounds;
    // A band copies at most one range per owner each way.
    let per_band = rounds.div_ceil(crate::gpu::staging::most_bands(n));
    let span = |q: usize, first: usize, last: usize| {
        let (a, b) = (call.plan.slice(q, first), call.plan.slice(q, last));
        a.start..b.end
    };
    let bands = (0..rounds)
        .step_by(per_band)
        .map(|first| {
            let last = (first + per_band).min(rounds) - 1;
            let mut band = Band::default();
            for q in 0..n {
                if call.input(q, first).is_some() {
                    let r = span(q, first, last);
                    band.ins.push((ends.input(r.start), r.start, r.len()));
                }
                if call.output(q, first).is_some() {
                    let r = span(q, first, last);
                    band.outs.push((ends.output(r.start), r.start, r.len()));
                }
            }
            band
        })
        .collect();
    (bands, per_band, count * es)
}

/// The two ends of a call through the arena: where each round's contributions come from and
/// where its results go (whole-buffer byte offsets; `Call` says which exist).
trait Ends {
    /// Round `s`'s input is here (may be staged).
    fn ready(&mut self, s: usize) -> Result<bool>;

    /// Stages (or enqueues) the `len` input bytes at `at` into `area`.
    ///
    /// # Safety
    /// `area` must be writable for `len` bytes until the round is published staged.
    unsafe fn stage(&mut self, at: usize, len: usize, area: *mut u8) -> Result<()>;

    /// After a round's stages: what to wait for before publishing it (None: at once).
    fn staged(&mut self) -> Result<Option<Box<dyn Event>>>;

    /// Puts (or enqueues) the `len` result bytes at `result` to `at`.
    ///
    /// # Safety
    /// `result` must stay unwritten for `len` bytes until the round is published copied.
    unsafe fn put(&mut self, at: usize, len: usize, result: *const u8) -> Result<()>;

    /// After a round's puts: what to wait for before telling the owners (None: at once).
    fn put_all(&mut self) -> Result<Option<Box<dyn Event>>>;

    /// Round `s` is out, the owners told.
    fn done(&mut self, s: usize);
}

/// Device buffers: copies on the lane's streams as slots free up.
struct DeviceEnds<'a> {
    down: &'a dyn Stream,
    up: &'a dyn Stream,
    io: DeviceIo,
    own_start: usize,
    shape: Shape,
}

/// Where whole-buffer offsets lie in a call's device buffers.
struct Addresses {
    io: DeviceIo,
    own_start: usize,
    shape: Shape,
}

impl Addresses {
    /// The input at whole-buffer offset `at` (an all-gather's input is its own part).
    fn input(&self, at: usize) -> u64 {
        match self.shape {
            Shape::AllGather => self.io.src + (at - self.own_start) as u64,
            _ => self.io.src + at as u64,
        }
    }

    /// The output at `at` (a reduce-scatter's output out of place is its own part).
    fn output(&self, at: usize) -> u64 {
        match self.shape {
            Shape::ReduceScatter if !self.io.in_place => self.io.out + (at - self.own_start) as u64,
            _ => self.io.out + at as u64,
        }
    }
}

impl DeviceEnds<'_> {
    fn addresses(io: &DeviceIo, shape: Shape, own_start: usize) -> Addresses {
        Addresses {
            io: *io,
            own_start,
            shape,
        }
    }
}

impl Ends for DeviceEnds<'_> {
    fn ready(&mut self, _: usize) -> Result<bool> {
        Ok(true)
    }

    unsafe fn stage(&mut self, at: usize, len: usize, area: *mut u8) -> Result<()> {
        let src = DeviceEnds::addresses(&self.io, self.shape, self.own_start).input(at);
        // SAFETY: the caller's promise for `area`; the input is the call's device memory.
        unsafe { self.down.copy_to_host(area, src, len) }
    }

    fn staged(&mut self) -> Result<Option<Box<dyn Event>>> {
        self.down.record().map(Some)
    }

    unsafe fn put(&mut self, at: usize, len: usize, result: *const u8) -> Result<()> {
        let dst = DeviceEnds::addresses(&self.io, self.shape, self.own_start).output(at);
        // SAFETY: the caller's promise for `result`; the output is the call's device memory.
        unsafe { self.up.copy_to_device(dst, result, len) }
    }

    fn put_all(&mut self) -> Result<Option<Box<dyn Event>>> {
        self.up.record().map(Some)
    }

    fn done(&mut self, _: usize) {}
}

/// A call started in bands: its page-locked buffer, laid out as the whole call.
struct PinnedEnds<'a> {
    banded: &'a Banded,
    at: *mut u8,
    per_band: usize,
    rounds: usize,
}

impl Ends for PinnedEnds<'_> {
    fn ready(&mut self, s: usize) -> Result<bool> {
        self.banded.landed(s / self.per_band)
    }

    unsafe fn stage(&mut self, at: usize, len: usize, area: *mut u8) -> Result<()> {
        // SAFETY: the band holding `at..at + len` landed (`ready`) and the buffer holds the
        // whole call; `area` is the caller's promise; they do not overlap (qccl's buffer
        // and the arena).
        unsafe { std::ptr::copy_nonoverlapping(self.at.add(at), area, len) };
        Ok(())
    }

    fn staged(&mut self) -> Result<Option<Box<dyn Event>>> {
        Ok(None)
    }

    unsafe fn put(&mut self, at: usize, len: usize, result: *const u8) -> Result<()> {
        // SAFETY: the caller's stream reads `at..at + len` only once its band is released,
        // after this; `result` is the caller's promise.
        unsafe { std::ptr::copy_nonoverlapping(result, self.at.add(at), len) };
        Ok(())
    }

    fn put_all(&mut self) -> Result<Option<Box<dyn Event>>> {
        Ok(None)
    }

    fn done(&mut self, s: usize) {
        if (s + 1).is_multiple_of(self.per_band) || s + 1 == self.rounds {
            self.banded.release(s / self.per_band);
        }
    }
}

/// The round loop: `ends` stage and put the bytes, `wire` gets (sent, received) as the host
/// path counts them; copies the ends wait for are bounded by `timeout`.
///
/// # Safety
/// As `ArenaLane::run` for the ends' buffers.
unsafe fn rounds(
    arena: &mut Arena,
    call: &Call,
    ends: &mut dyn Ends,
    (desc, dtype, op, timeout): (&OpDesc, crate::DType, crate::ReduceOp, Duration),
    wire: &mut (u64, u64),
) -> Result<()> {
    let (n, me, rounds) = (call.n, call.me, call.plan.rounds);
    let base = arena.begin(rounds);
    let mut waiter = Waiter::new(arena.link_config());
    // Rounds claimed (stages made or enqueued), staged (published), reduced, put (every
    // result put or enqueued) and copied (published).
    let (mut claimed, mut staged, mut reduced, mut out, mut copied) = (0, 0, 0, 0, 0);
    let mut landing: VecDeque<Box<dyn Event>> = VecDeque::new();
    let mut leaving: VecDeque<Box<dyn Event>> = VecDeque::new();
    let mut have = vec![false; n];
    let mut last_move = Instant::now();
    while copied < rounds {
        let seen = arena.bell();
        let mut moved = false;
        let mut awaiting = false;
        while landing.front().map(|e| e.query()).transpose()? == Some(true) {
            landing.pop_front();
            arena.staged(base + staged as u64);
            staged += 1;
            moved = true;
        }
        while claimed < rounds {
            let s = claimed;
            if !ends.ready(s)? {
                awaiting = true;
                break;
            }
            let mut made = Ok(());
            let ok = arena.try_claim(desc, base + s as u64, |q, area| {
                if let (Ok(()), Some(r)) = (&made, call.input(q, s)) {
                    // SAFETY: the area is this rank's until it publishes the round staged,
                    // after the stage is done (its event, if any, completed).
                    made = unsafe { ends.stage(r.start, r.len(), area.as_mut_ptr()) };
                    if q != me {
                        wire.0 += r.len() as u64;
                    }
                }
            });
            if !ok {
                break;
            }
            made?;
            match ends.staged()? {
                Some(e) => landing.push_back(e),
                None if landing.is_empty() => {
                    arena.staged(base + s as u64);
                    staged += 1;
                }
                None => {
                    return Err(Error::Internal(
                        "an arena round staged at once behind one still landing".into(),
                    ))
                }
            }
            claimed += 1;
            moved = true;
        }
        if reduced < staged {
            let len = call.plan.slice(me, reduced).len();
            let ok = arena.try_reduce_own(desc, base + reduced as u64, |own, srcs, result| {
                let result = &mut result[..len];
                if call.shape.reduces() {
                    let srcs: Vec<&[u8]> = srcs.iter().map(|s| &s[..len]).collect();
                    reduce_into(dtype, op, n, &own[..len], &srcs, result);
                    wire.1 += (len * srcs.len()) as u64;
                } else {
                    result.copy_from_slice(&own[..len]);
                }
                if call.shape.gathers() {
                    wire.0 += (len * (n - 1)) as u64;
                }
            })?;
            if ok {
                reduced += 1;
                moved = true;
            }
        }
        if out < reduced {
            for (q, here) in have.iter_mut().enumerate() {
                let Some(r) = call.output(q, out) else {
                    *here = true;
                    continue;
                };
                if *here {
                    continue;
                }
                let mut made = Ok(());
                *here = arena.try_copy(q, base + out as u64, |result| {
                    // SAFETY: the owner rewrites its result area only once this rank
                    // published the round copied, after the put is done.
                    made = unsafe { ends.put(r.start, r.len(), result.as_ptr()) };
                });
                made?;
                if *here && q != me {
                    wire.1 += r.len() as u64;
                }
            }
            if have.iter().all(|&h| h) {
                match ends.put_all()? {
                    Some(e) => leaving.push_back(e),
                    None if leaving.is_empty() => {
                        arena.copied(base + out as u64);
                        ends.done(out);
                        copied += 1;
                    }
                    None => {
                        return Err(Error::Internal(
                            "an arena round out at once behind one still leaving".into(),
                        ))
                    }
                }
                have.fill(false);
                out += 1;
                moved = true;
            }
        }
        while leaving.front().map(|e| e.query()).transpose()? == Some(true) {
            leaving.pop_front();
            arena.copied(base + copied as u64);
            ends.done(copied);
            copied += 1;
            moved = true;
        }
        if moved {
            waiter.progressed();
            last_move = Instant::now();
        } else if awaiting || !landing.is_empty() || !leaving.is_empty() {
            // Copies in flight: they complete without the peers, so poll (the bell does not
            // ring for them), bounded by the comm's timeout.
            if last_move.elapsed() > timeout {
                return Err(Error::Timeout(format!(
                    "rank {me}: copies between the device and the shared-memory arena not \
                     done after {timeout:?} in {desc} (rounds claimed {claimed}, staged \
                     {staged}, reduced {reduced}, copied {copied} of {rounds})"
                )));
            }
            std::thread::yield_now();
        } else {
            arena.idle(&mut waiter, seen, desc, || {
                format!(
                    "shared-memory arena stalled in {desc} on device buffers (rounds staged \
                     {staged}, reduced {reduced}, copied {copied} of {rounds})"
                )
            })?;
        }
    }
    Ok(())
}

/// One call's geometry on this rank.
struct Call {
    plan: Rounds,
    shape: Shape,
    /// In place (an all-gather's own part is in the output already).
    in_place: bool,
    me: usize,
    n: usize,
}

impl Call {
    fn new(arena: &Arena, shape: Shape, count: usize, es: usize, in_place: bool) -> Call {
        Call {
            plan: Rounds::new(arena, count, es),
            shape,
            in_place,
            me: arena.rank(),
            n: arena.size(),
        }
    }

    /// Round `s`'s contribution to owner `q` (whole-buffer bytes): None when this rank
    /// stages nothing for `q` (an all-gather stages its own part alone).
    fn input(&self, q: usize, s: usize) -> Option<Range<usize>> {
        match self.shape {
            Shape::AllGather if q != self.me => None,
            _ => Some(self.plan.slice(q, s)),
        }
    }

    /// Where owner `q`'s result of round `s` goes (whole-buffer bytes): None when it does
    /// not come to this rank (a reduce-scatter keeps each owner's own; an in-place
    /// all-gather's own part is there already).
    fn output(&self, q: usize, s: usize) -> Option<Range<usize>> {
        let own = q == self.me;
        match self.shape {
            Shape::ReduceScatter if !own => None,
            Shape::AllGather if own && self.in_place => None,
            _ => Some(self.plan.slice(q, s)),
        }
    }
}
