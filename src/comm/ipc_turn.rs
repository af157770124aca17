//! The in-turn work of a dense call over CUDA IPC (`cuda_ipc.rs` decides when it applies and
//! makes the entries): stage this rank's input where the others reach it, agree with them
//! (`coll::ipc_vote`), then either run the device steps (`gpu::ipc`) between barriers or,
//! when some rank's buffers are not on the one device, the usual staged call.

use super::device_all_reduce::staged;
use super::route::AllReduceCall;
use crate::algo::Algo;
use crate::coll::call::{Coll, CollCall};
use crate::coll::ipc_vote::{all_ok, exchange, on_one_device, Descriptor};
use crate::coll::Engine;
use crate::error::{Error, Result};
use crate::gpu::ipc::IpcLane;
use crate::gpu::staging::{self, CallBuf, Staging};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A dense call that may go over CUDA IPC.
#[derive(Clone, Copy)]
pub(super) enum IpcCall<'a> {
    AllReduce(&'a AllReduceCall),
    /// A reduce-scatter or an all-gather.
    Coll(&'a CollCall<'static>),
}

impl IpcCall<'_> {
    /// Bytes of one rank's part: the whole call for an all-reduce.
    fn part(&self) -> usize {
        match self {
            IpcCall::AllReduce(c) => {
                let (count, dtype, _) = c.shape();
                count * dtype.size()
            }
            IpcCall::Coll(c) => c.count * c.dtype.size(),
        }
    }

    /// Its buffers' lengths on `size` ranks, (send, recv); in place the one buffer is the
    /// whole one (NCCL's layouts).
    pub(super) fn lens(&self, size: usize, in_place: bool) -> (usize, usize) {
        let part = self.part();
        match self {
            IpcCall::Coll(c) if c.coll == Coll::ReduceScatter && in_place => (0, part * size),
            IpcCall::Coll(c) if c.coll == Coll::ReduceScatter => (part * size, part),
            IpcCall::Coll(_) if in_place => (0, part * size),
            IpcCall::Coll(_) => (part, part * size),
            IpcCall::AllReduce(_) => (part, part),
        }
    }

    /// Bytes each rank stages (its input) on `size` ranks.
    fn staged(&self, size: usize) -> usize {
        match self {
            IpcCall::Coll(c) if c.coll == Coll::ReduceScatter => self.part() * size,
            _ => self.part(),
        }
    }

    /// True when the ranks agree on CUDA IPC before running it (a comm using it).
    pub(super) fn exchanges(&self, comm_uses_it: bool) -> bool {
        match self {
            IpcCall::AllReduce(c) => c.exchanges(),
            IpcCall::Coll(c) => {
                comm_uses_it
                    && self.part() > 0
                    && matches!(c.coll, Coll::ReduceScatter | Coll::AllGather)
            }
        }
    }

    /// Where rank `rank`'s input starts: `send`, or in place `recv` (an all-gather's own
    /// part of it).
    pub(super) fn src(&self, rank: usize, send: Option<u64>, recv: u64) -> u64 {
        match (self, send) {
            (_, Some(s)) => s,
            (IpcCall::Coll(c), None) if c.coll == Coll::AllGather => {
                recv + (rank * self.part()) as u64
            }
            (_, None) => recv,
        }
    }

    /// "all_reduce", for logs.
    fn name(&self) -> &'static str {
        match self {
            IpcCall::AllReduce(_) => "all_reduce",
            IpcCall::Coll(c) => c.coll.name(),
        }
    }

    /// Runs the call on `e` over `hosts`, host addresses standing for `bufs` (send, if any,
    /// then recv); `exchange`: with its CUDA IPC descriptor ("host"), unless already made.
    /// The algorithm of an all-reduce.
    pub(super) fn run_hosts(
        &self,
        e: &mut Engine,
        bufs: &[CallBuf],
        hosts: &[*mut u8],
        exchange: bool,
    ) -> Result<Option<Algo>> {
        // SAFETY: each host address stands for its buffer's `len` bytes, valid until the call
        // ends (`on_buffers`, `Staging::run`), and they do not overlap (the entry's promise).
        let (send, recv) = unsafe {
            match (bufs, hosts) {
                ([s, r], [hs, hr]) => (Some(&*staged(*hs, s.len)), staged(*hr, r.len)),
                ([r], [hr]) => (None, staged(*hr, r.len)),
                _ => {
                    return Err(Error::Internal(format!(
                        "a {} got {} buffers, not one or two",
                        self.name(),
                        hosts.len()
                    )))
                }
            }
        };
        match (self, exchange) {
            (IpcCall::AllReduce(c), true) => c.run(e, send, recv).map(Some),
            (IpcCall::AllReduce(c), false) => c.run_agreed(e, send, recv).map(Some),
            (IpcCall::Coll(c), true) => e.run_call(c, send, recv).map(|()| None),
            (IpcCall::Coll(c), false) => e.run_call_agreed(c, send, recv).map(|()| None),
        }
    }

    /// Enqueues the device steps on `lane` and puts the engine's barriers between them.
    ///
    /// # Safety
    /// Every rank's scratch staged and mapped (agreed); `on`'s output device memory of this
    /// device, valid until this returns.
    unsafe fn run_ipc(
        &self,
        lane: &IpcLane,
        e: &mut Engine,
        (rank, size): (usize, usize),
        on: &OnDevice,
    ) -> Result<()> {
        let me = (rank, size);
        let part = self.part();
        match self {
            IpcCall::AllReduce(c) => {
                let (count, dtype, op) = c.shape();
                // SAFETY (both): the caller's promise; no scratch is rewritten before the
                // last barrier below.
                unsafe { lane.reduce_own(me, on.recv, count, dtype, op)? };
                lane.synchronize()?;
                e.barrier()?;
                // Every owner's chunk is reduced (the barrier).
                unsafe { lane.gather(me, on.recv, count, dtype)? };
            }
            IpcCall::Coll(c) if c.coll == Coll::ReduceScatter => {
                let at = (rank * part) as u64;
                let out = if on.in_place { on.recv + at } else { on.recv };
                // SAFETY: this rank's part of every rank's input into its output, which no
                // scratch overlaps (the scratch is qccl's own memory).
                unsafe { lane.reduce_chunk(me, at, out, part, c.dtype, c.op)? };
            }
            IpcCall::Coll(_) => {
                for q in 0..size {
                    // SAFETY: rank q's part, all of its scratch, into its place in the
                    // output (this rank's own too: from its scratch, the same bytes).
                    let to = on.recv + (q * part) as u64;
                    if q != rank || !on.in_place {
                        unsafe { lane.copy_from(rank, q, 0, to, part)? };
                    }
                }
            }
        }
        lane.synchronize()?;
        e.barrier()
    }
}

/// A call's buffers when all are device memory: its driver, where they are, their device,
/// the input (send, or recv in place), the output, in place or not, and the caller's stream
/// (a `CUstream`).
pub(super) struct OnDevice {
    pub(super) driver: Arc<dyn crate::gpu::driver::Driver>,
    pub(super) place: staging::Placement,
    pub(super) ordinal: usize,
    pub(super) bufs: Vec<CallBuf>,
    pub(super) src: u64,
    pub(super) recv: u64,
    pub(super) in_place: bool,
    pub(super) stream: usize,
}

/// What a call over CUDA IPC needs of its comm in the comm's turn (queued calls take it to
/// the worker).
pub(super) struct IpcTurn {
    pub(super) lane: Arc<Mutex<Option<IpcLane>>>,
    pub(super) calls: Arc<AtomicU64>,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) timeout: Duration,
    pub(super) comm_id: u64,
}

impl IpcTurn {
    /// Runs `call` on the device buffers `on` in the comm's turn (on `e`): over CUDA IPC
    /// when every rank's buffers are on one device (None), else staged through `st` (an
    /// all-reduce's algorithm; None for the others).
    ///
    /// # Safety
    /// `on`'s buffers must be valid for the call until this returns, and its stream null or
    /// a live stream of their device.
    pub(super) unsafe fn run(
        &self,
        e: &mut Engine,
        st: &mut Staging,
        call: IpcCall<'_>,
        on: &OnDevice,
    ) -> Result<Option<Algo>> {
        let bytes = call.staged(self.size);
        let mut slot = self.lane.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(IpcLane::new(
                on.driver.clone(),
                on.ordinal,
                self.size,
                self.timeout,
            )?);
        }
        let lane = slot.as_mut().expect("made above");
        // SAFETY: the caller's promise: the input is device memory of this device.
        let staged = unsafe { lane.stage(on.stream as *mut c_void, on.src, bytes) };
        let mine = match &staged {
            Ok(s) => Descriptor {
                bytes: bytes as u64,
                device: Some((lane.bus_id().to_owned(), *s)),
            },
            Err(err) => {
                crate::qlog!(
                    Warn,
                    "rank {}: CUDA IPC not set up ({err}): staged",
                    self.rank
                );
                Descriptor::host(bytes)
            }
        };
        let table = exchange(e, &mine)?;
        let peers = on_one_device(&table);
        let opened = match &peers {
            Some(p) => lane
                .open_peers(self.rank, p)
                .and_then(|()| lane.synchronize()),
            None => Ok(()),
        };
        if let Err(err) = &opened {
            crate::qlog!(
                Warn,
                "rank {}: CUDA IPC not set up ({err}): staged",
                self.rank
            );
        }
        // Also the barrier after which every input is in its scratch.
        if peers.is_none() || !all_ok(e, opened.is_ok())? {
            // The scratch copy reads the input, which the staged call may rewrite.
            if let Err(err) = lane.synchronize().and(staged.map(drop)) {
                // Broken (a failed copy is sticky): the next call makes a new lane.
                crate::qlog!(Warn, "rank {}: CUDA IPC lane dropped: {err}", self.rank);
                *slot = None;
            }
            // SAFETY: the caller's promise, passed on.
            return unsafe {
                st.run(&on.bufs, &on.place, on.stream as *mut c_void, |h| {
                    call.run_hosts(e, &on.bufs, h, false)
                })
            };
        }
        crate::qlog!(
            Trace,
            "rank {}: comm {:#018x}: {} of {bytes} bytes per rank: CUDA IPC",
            self.rank,
            self.comm_id,
            call.name()
        );
        // SAFETY: agreed above: every scratch staged and mapped; the output is the caller's.
        unsafe { call.run_ipc(lane, e, (self.rank, self.size), on)? };
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok(None)
    }
}
