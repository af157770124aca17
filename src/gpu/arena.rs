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
//! `comm/arena_turn.rs` decides when a call comes here: when the host path would take the
//! arena's rounds for it.

use super::driver::{Driver, Event, Registered, Stream};
use crate::algo::arena::{reduce_into, Rounds, Shape};
use crate::algo::Ctx;
use crate::error::{Error, Result};
use crate::transport::shm::arena::Arena;
use crate::transport::wait::Waiter;
use std::collections::VecDeque;
use std::ffi::c_void;
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
        let call = Call {
            plan: Rounds::new(arena, count, dtype.size()),
            shape,
            io: *io,
            me: arena.rank(),
            n: arena.size(),
        };
        let mut wire = (0u64, 0u64);
        // SAFETY: the caller's promise, passed on.
        let ran = unsafe { self.rounds(arena, &call, &desc, (dtype, op), &mut wire) };
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

    /// The round loop; `wire`: bytes (sent, received) as the host path counts them.
    ///
    /// # Safety
    /// As `run`.
    unsafe fn rounds(
        &self,
        arena: &mut Arena,
        call: &Call,
        desc: &crate::transport::frame::OpDesc,
        (dtype, op): (crate::DType, crate::ReduceOp),
        wire: &mut (u64, u64),
    ) -> Result<()> {
        let (n, me, rounds) = (call.n, call.me, call.plan.rounds);
        let base = arena.begin(rounds);
        let mut waiter = Waiter::new(arena.link_config());
        // Rounds claimed (copies in enqueued), staged (published), reduced, enqueued out
        // (every copy out enqueued) and copied (published).
        let (mut claimed, mut staged, mut reduced, mut out, mut copied) = (0, 0, 0, 0, 0);
        let mut landing: VecDeque<Box<dyn Event>> = VecDeque::new();
        let mut leaving: VecDeque<Box<dyn Event>> = VecDeque::new();
        let mut have = vec![false; n];
        let mut last_move = Instant::now();
        while copied < rounds {
            let seen = arena.bell();
            let mut moved = false;
            while landing.front().map(|e| e.query()).transpose()? == Some(true) {
                landing.pop_front();
                arena.staged(base + staged as u64);
                staged += 1;
                moved = true;
            }
            while claimed < rounds {
                let s = claimed;
                let mut enqueued = Ok(());
                let ok = arena.try_claim(desc, base + s as u64, |q, area| {
                    if let (Ok(()), Some((src, len))) = (&enqueued, call.input(q, s)) {
                        // SAFETY: the area is this rank's until it publishes the round
                        // staged, after the copy's event completed; the input is the
                        // caller's device memory (the caller's promise).
                        enqueued = unsafe { self.down.copy_to_host(area.as_mut_ptr(), src, len) };
                        if q != me {
                            wire.0 += len as u64;
                        }
                    }
                });
                if !ok {
                    break;
                }
                enqueued?;
                landing.push_back(self.down.record()?);
                claimed += 1;
                moved = true;
            }
            if reduced < staged {
                let len = call.plan.slice(me, reduced).len();
                let ok =
                    arena.try_reduce_own(desc, base + reduced as u64, |own, srcs, result| {
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
                    let Some((dst, len)) = call.output(q, out) else {
                        *here = true;
                        continue;
                    };
                    if *here {
                        continue;
                    }
                    let mut enqueued = Ok(());
                    *here = arena.try_copy(q, base + out as u64, |result| {
                        // SAFETY: the owner rewrites its result area only once this rank
                        // published the round copied, after the copy's event completed;
                        // the output is the caller's device memory (the caller's promise).
                        enqueued = unsafe { self.up.copy_to_device(dst, result.as_ptr(), len) };
                    });
                    enqueued?;
                    if *here && q != me {
                        wire.1 += len as u64;
                    }
                }
                if have.iter().all(|&h| h) {
                    leaving.push_back(self.up.record()?);
                    have.fill(false);
                    out += 1;
                    moved = true;
                }
            }
            while leaving.front().map(|e| e.query()).transpose()? == Some(true) {
                leaving.pop_front();
                arena.copied(base + copied as u64);
                copied += 1;
                moved = true;
            }
            if moved {
                waiter.progressed();
                last_move = Instant::now();
            } else if !landing.is_empty() || !leaving.is_empty() {
                // Copies in flight: they complete without the peers, so poll (the bell does
                // not ring for them), bounded by the comm's timeout.
                if last_move.elapsed() > self.timeout {
                    return Err(Error::Timeout(format!(
                        "rank {me}: copies between device {} and the shared-memory arena not \
                         done after {:?} in {desc} (rounds claimed {claimed}, staged {staged}, \
                         reduced {reduced}, copied {copied} of {rounds})",
                        self.ordinal, self.timeout
                    )));
                }
                std::thread::yield_now();
            } else {
                arena.idle(&mut waiter, seen, desc, || {
                    format!(
                        "shared-memory arena stalled in {desc} on device buffers (rounds \
                         staged {staged}, reduced {reduced}, copied {copied} of {rounds})"
                    )
                })?;
            }
        }
        Ok(())
    }
}

/// One call's geometry on this rank.
struct Call {
    plan: Rounds,
    shape: Shape,
    io: DeviceIo,
    me: usize,
    n: usize,
}

impl Call {
    /// Where round `s`'s contribution to owner `q` comes from (device address, bytes): None
    /// when this rank stages nothing for `q` (an all-gather stages its own part alone).
    fn input(&self, q: usize, s: usize) -> Option<(u64, usize)> {
        let r = self.plan.slice(q, s);
        match self.shape {
            Shape::AllGather if q != self.me => None,
            Shape::AllGather => {
                let at = r.start - self.plan.chunks[self.me].start;
                Some((self.io.src + at as u64, r.len()))
            }
            _ => Some((self.io.src + r.start as u64, r.len())),
        }
    }

    /// Where owner `q`'s result of round `s` goes (device address, bytes): None when it
    /// does not come to this rank (a reduce-scatter keeps each owner's own; an in-place
    /// all-gather's own part is there already).
    fn output(&self, q: usize, s: usize) -> Option<(u64, usize)> {
        let r = self.plan.slice(q, s);
        let own = q == self.me;
        match self.shape {
            Shape::ReduceScatter if !own => None,
            Shape::ReduceScatter if !self.io.in_place => {
                let at = r.start - self.plan.chunks[self.me].start;
                Some((self.io.out + at as u64, r.len()))
            }
            Shape::AllGather if own && self.io.in_place => None,
            _ => Some((self.io.out + r.start as u64, r.len())),
        }
    }
}
