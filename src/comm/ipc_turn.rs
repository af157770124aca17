//! The in-turn work of a dense call over CUDA IPC (`cuda_ipc.rs` decides when it applies and
//! makes the entries): stage this rank's input where the others reach it, agree with them
//! (`coll::ipc_vote`), then either run the device steps (`gpu::ipc`) between barriers or,
//! when some rank's buffers are not on the one device, the usual staged call.

use super::arena_turn::ArenaTurn;
use super::dense_call::{DenseCall, OnDevice};
use crate::algo::Algo;
use crate::coll::call::Coll;
use crate::coll::ipc_vote::{all_ok, exchange, on_one_device, Descriptor};
use crate::coll::Engine;
use crate::error::Result;
use crate::gpu::ipc::IpcLane;
use crate::gpu::staging::Staging;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

impl DenseCall<'_> {
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
            DenseCall::AllReduce(c) => {
                let (count, dtype, op) = c.shape();
                // SAFETY (both): the caller's promise; no scratch is rewritten before the
                // last barrier below.
                unsafe { lane.reduce_own(me, on.recv, count, dtype, op)? };
                lane.synchronize()?;
                e.barrier()?;
                // Every owner's chunk is reduced (the barrier).
                unsafe { lane.gather(me, on.recv, count, dtype)? };
            }
            DenseCall::Coll(c) if c.coll == Coll::ReduceScatter => {
                let at = (rank * part) as u64;
                let out = if on.in_place { on.recv + at } else { on.recv };
                // SAFETY: this rank's part of every rank's input into its output, which no
                // scratch overlaps (the scratch is qccl's own memory).
                unsafe { lane.reduce_chunk(me, at, out, part, c.dtype, c.op)? };
            }
            DenseCall::Coll(_) => {
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

/// What a call over CUDA IPC needs of its comm in the comm's turn (queued calls take it to
/// the worker).
pub(super) struct IpcTurn {
    /// Where a call goes when not every rank's buffers are on one device (and whose rank,
    /// timeout and comm id this turn uses too).
    pub(super) arena: ArenaTurn,
    pub(super) lane: Arc<Mutex<Option<IpcLane>>>,
    pub(super) calls: Arc<AtomicU64>,
    pub(super) size: usize,
}

impl IpcTurn {
    /// Runs `call` on the device buffers `on` in the comm's turn (on `e`): over CUDA IPC
    /// when every rank's buffers are on one device (None), else as `ArenaTurn::run` (an
    /// all-reduce's algorithm; None for the others).
    ///
    /// # Safety
    /// `on`'s buffers must be valid for the call until this returns, and its stream null or
    /// a live stream of their device.
    pub(super) unsafe fn run(
        &self,
        e: &mut Engine,
        st: &mut Staging,
        call: DenseCall<'_>,
        on: &OnDevice,
    ) -> Result<Option<Algo>> {
        let bytes = call.staged(self.size);
        let mut slot = self.lane.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(IpcLane::new(
                on.driver.clone(),
                on.ordinal,
                self.size,
                self.arena.timeout,
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
                    self.arena.rank
                );
                Descriptor::host(bytes)
            }
        };
        let table = exchange(e, &mine)?;
        let peers = on_one_device(&table);
        let opened = match &peers {
            Some(p) => lane
                .open_peers(self.arena.rank, p)
                .and_then(|()| lane.synchronize()),
            None => Ok(()),
        };
        if let Err(err) = &opened {
            crate::qlog!(
                Warn,
                "rank {}: CUDA IPC not set up ({err}): staged",
                self.arena.rank
            );
        }
        // Also the barrier after which every input is in its scratch.
        if peers.is_none() || !all_ok(e, opened.is_ok())? {
            // The scratch copy reads the input, which the staged call may rewrite.
            if let Err(err) = lane.synchronize().and(staged.map(drop)) {
                // Broken (a failed copy is sticky): the next call makes a new lane.
                crate::qlog!(
                    Warn,
                    "rank {}: CUDA IPC lane dropped: {err}",
                    self.arena.rank
                );
                *slot = None;
            }
            // SAFETY: the caller's promise, passed on.
            return unsafe { self.arena.run(e, st, call, on) };
        }
        crate::qlog!(
            Trace,
            "rank {}: comm {:#018x}: {} of {bytes} bytes per rank: CUDA IPC",
            self.arena.rank,
            self.arena.comm_id,
            call.name()
        );
        // SAFETY: agreed above: every scratch staged and mapped; the output is the caller's.
        unsafe { call.run_ipc(lane, e, (self.arena.rank, self.size), on)? };
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok(None)
    }
}
