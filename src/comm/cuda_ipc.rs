//! Dense all-reduces over CUDA IPC (QCCL_CUDA_IPC=1): when every rank's buffers are on one
//! device, the ranks reduce them on the GPU through each other's memory (`gpu::ipc`:
//! mapped over CUDA IPC from another process, at its address in the same one) instead of
//! staging them through page-locked host memory.
//!
//! Whether a call can take that path depends on every rank's buffers, which each rank alone
//! knows. So on a comm whose ranks all asked for it at init, all on one machine
//! (`World::cuda_ipc`, the same answer everywhere), every dense all-reduce
//! starts with an all-gather of a short descriptor, whichever way it was called: host
//! buffers and staged calls (groups) say "host" inside `AllReduceCall::run`; calls through
//! [`Comm::all_reduce_dense_at`] or [`Comm::submit_all_reduce_dense_at`] on device buffers
//! say "device, this bus id, this scratch". Only when all say the same device do they run
//! the IPC path; otherwise each runs the call as it would have (device buffers staged), so
//! every rank makes the same choice. A rank that cannot set the path up (no memory for
//! its scratch, a peer's buffer that does not map) says so in the next agreement and the
//! ranks fall back together, before any result is written.
//!
//! On a caller's stream such a call returns once done (it waits for the stream's earlier
//! work first), as the GPU codecs' calls do.
//!
//! The same entries serve comms whose ranks share one host without CUDA IPC, for calls that
//! return once done (`Comm::dense_path`): device buffers then go through the shared-memory
//! arena, the GPU copying into and out of it (`arena_turn.rs`), as they do on a comm using
//! CUDA IPC when not every rank's buffers are on one device.

use super::arena_turn::ArenaTurn;
use super::dense_call::{DenseCall, OnDevice, OwnedDense};
use super::ipc_turn::IpcTurn;
use super::route::AllReduceCall;
use super::Comm;
use crate::algo::Algo;
use crate::coll::call::CollCall;
use crate::error::Result;
use crate::gpu::staging::{self, CallBuf};
use crate::tuning::Links;
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::Arc;

impl Comm {
    /// True when this comm's dense all-reduces agree on CUDA IPC first (QCCL_CUDA_IPC=1 on
    /// every rank, all on one machine).
    #[doc(hidden)]
    pub fn uses_cuda_ipc(&self) -> bool {
        self.place.cuda_ipc
    }

    /// True when [`Comm::all_reduce_dense_at`], [`Comm::coll_dense_at`] and
    /// [`Comm::submit_all_reduce_dense_at`] (stream null) may run this comm's calls on device
    /// buffers better than the generic staged path: the comm uses CUDA IPC, or (for calls
    /// that return once done: `stream` null) its ranks share one host, whose arena the GPU
    /// copies into and out of (`arena_turn.rs`), or its ranks are processes linked by
    /// sockets, whose hierarchical and SRA all-reduces are staged piece by piece
    /// (`bands.rs`).
    #[doc(hidden)]
    pub fn dense_path(&self, stream: *mut c_void) -> bool {
        let arena = self.links == Links::Arena;
        self.place.cuda_ipc || (stream.is_null() && (arena || !self.place.process_peers))
    }

    /// How many calls on device buffers ran through the shared-memory arena, the GPU
    /// copying into and out of it (`arena_turn.rs`), on this comm so far.
    #[doc(hidden)]
    pub fn arena_device_calls(&self) -> u64 {
        self.arena_calls.load(Ordering::Relaxed)
    }

    /// How many all-reduces ran over CUDA IPC on this comm so far.
    #[doc(hidden)]
    pub fn cuda_ipc_calls(&self) -> u64 {
        self.ipc_calls.load(Ordering::Relaxed)
    }

    /// The dense all-reduce `call` on `send` (None: in place) and `recv`, raw addresses of
    /// host or device memory, ordered on the caller's `stream` (null: the legacy default
    /// stream); returns once the result is in `recv`. Over CUDA IPC when every rank's
    /// buffers are on one device and the comm uses it ([`Comm::uses_cuda_ipc`]), returning
    /// None; staged (device buffers) or on the host as any other call otherwise, returning
    /// the algorithm that ran.
    ///
    /// # Safety
    /// `send` and `recv` must not overlap and be valid for the call's bytes (host memory, or
    /// device memory of one device) until this returns; `stream` null or a live stream of
    /// their device.
    #[doc(hidden)]
    pub unsafe fn all_reduce_dense_at(
        &self,
        call: &AllReduceCall,
        send: Option<u64>,
        recv: u64,
        stream: *mut c_void,
    ) -> Result<Option<Algo>> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.dense_at(DenseCall::AllReduce(call), send, recv, stream) }
    }

    /// A reduce-scatter or all-gather `call` (checked) on `send` (None: in place, `recv` the
    /// whole buffer, NCCL's layouts) and `recv`, as [`Comm::all_reduce_dense_at`]: over CUDA
    /// IPC when every rank's buffers are on one device and the comm uses it, else as any
    /// other call; returns once the result is in `recv`.
    ///
    /// # Safety
    /// As [`Comm::all_reduce_dense_at`], with the call's buffer sizes.
    #[doc(hidden)]
    pub unsafe fn coll_dense_at(
        &self,
        call: &CollCall<'static>,
        send: Option<u64>,
        recv: u64,
        stream: *mut c_void,
    ) -> Result<()> {
        self.check(call)?;
        // SAFETY: the caller's promise, passed on.
        unsafe { self.dense_at(DenseCall::Coll(call), send, recv, stream) }.map(drop)
    }

    /// The blocking entries' one body: None when the call ran over CUDA IPC.
    unsafe fn dense_at(
        &self,
        call: DenseCall<'_>,
        send: Option<u64>,
        recv: u64,
        stream: *mut c_void,
    ) -> Result<Option<Algo>> {
        if let Some(plan) = self.dense_bands_of(call, send, recv)? {
            // SAFETY: the caller's promise, passed on.
            unsafe { self.run_bands_waiting(plan, stream) }?;
            return Ok(match call {
                DenseCall::AllReduce(c) => c.algo(),
                DenseCall::Coll(_) => None,
            });
        }
        let on = match self.place_call(call, send, recv, stream as usize)? {
            Ok(on) => on,
            Err((bufs, host)) => {
                let run =
                    |hosts: &[*mut u8]| self.execute(|e| call.run_hosts(e, &bufs, hosts, true));
                if host && stream.is_null() {
                    // Host memory on NULL: used as it is (what `on_buffers` would find again).
                    return run(&super::device::as_given(&bufs));
                }
                // SAFETY: the caller's promise, passed on; `hosts` stand for the buffers.
                return unsafe { self.on_buffers(&bufs, stream, run) };
            }
        };
        let mut guard = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let st = self.staging_on(&mut guard, on.driver.clone(), on.ordinal)?;
        let turn = self.ipc_turn();
        let ipc = call.exchanges(self.place.cuda_ipc);
        // SAFETY (both): the caller's promise, passed on.
        self.execute(|e| unsafe {
            if ipc {
                turn.run(e, st, call, &on)
            } else {
                turn.arena.run(e, st, call, &on)
            }
        })
    }

    /// As [`Comm::all_reduce_dense_at`] with the legacy default stream, but queued behind the
    /// comm's earlier operations and returning at once (the C ABI's non-blocking calls):
    /// the request ends once the result is in `recv`.
    ///
    /// # Safety
    /// As [`Comm::all_reduce_dense_at`], until the request has ended.
    #[doc(hidden)]
    pub unsafe fn submit_all_reduce_dense_at(
        &self,
        call: Box<AllReduceCall>,
        send: Option<u64>,
        recv: u64,
    ) -> Result<crate::Request<()>> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.submit_dense(OwnedDense::AllReduce(call), send, recv) }
    }

    /// As [`Comm::coll_dense_at`] (a reduce-scatter or all-gather, checked here) with the
    /// legacy default stream, but queued as [`Comm::submit_all_reduce_dense_at`] is
    /// (`qcclIReduceScatter`, `qcclIAllGather`).
    ///
    /// # Safety
    /// As [`Comm::coll_dense_at`], until the request has ended.
    #[doc(hidden)]
    pub unsafe fn submit_coll_dense_at(
        &self,
        call: CollCall<'static>,
        send: Option<u64>,
        recv: u64,
    ) -> Result<crate::Request<()>> {
        self.check(&call)?;
        // SAFETY: the caller's promise, passed on.
        unsafe { self.submit_dense(OwnedDense::Coll(call), send, recv) }
    }

    /// The queued entries' one body.
    unsafe fn submit_dense(
        &self,
        call: OwnedDense,
        send: Option<u64>,
        recv: u64,
    ) -> Result<crate::Request<()>> {
        if let Some(plan) = self.dense_bands_of(call.call(), send, recv)? {
            // SAFETY: the caller's promise, passed on.
            return unsafe { self.submit_bands(plan) };
        }
        let on = match self.place_call(call.call(), send, recv, 0)? {
            Ok(on) => on,
            Err((bufs, _)) => {
                let lens = bufs.clone();
                // SAFETY: the caller's promise, passed on; `hosts` stand for the buffers.
                return unsafe {
                    self.submit_on_buffers(bufs, Some(0), move |e, hosts| {
                        call.call().run_hosts(e, &lens, hosts, true).map(drop)
                    })
                };
            }
        };
        let turn = self.ipc_turn();
        let ipc = call.call().exchanges(self.place.cuda_ipc);
        let (driver, ordinal) = (on.driver.clone(), on.ordinal);
        self.submit_with_staging(driver, ordinal, Some(0), move |e, st| {
            let call = call.call();
            // SAFETY (both): the caller's promise, passed on; the legacy default stream.
            unsafe {
                if ipc {
                    turn.run(e, st, call, &on)
                } else {
                    turn.arena.run(e, st, call, &on)
                }
            }
            .map(drop)
        })
    }

    /// What a dense call through the arena needs of this comm in its turn.
    pub(super) fn arena_turn(&self) -> ArenaTurn {
        ArenaTurn {
            lane: self.arena_lane.clone(),
            calls: self.arena_calls.clone(),
            rank: self.rank,
            timeout: self.config.timeout,
            comm_id: self.comm_id,
            arena_chunk: self.config.shm_arena_chunk,
        }
    }

    pub(super) fn ipc_turn(&self) -> IpcTurn {
        IpcTurn {
            arena: self.arena_turn(),
            lane: self.ipc_lane.clone(),
            calls: self.ipc_calls.clone(),
            size: self.size,
        }
    }

    /// The call on device buffers, ordered on `stream` (a `CUstream`, 0 for the legacy
    /// default stream), when it may go over CUDA IPC or through the arena and each non-empty
    /// buffer is device memory (`all_on_device`); else its buffers for the usual path, and
    /// whether they were found to be all host memory (no need to look again).
    fn place_call(
        &self,
        call: DenseCall<'_>,
        send: Option<u64>,
        recv: u64,
        stream: usize,
    ) -> Result<std::result::Result<OnDevice, (Vec<CallBuf>, bool)>> {
        let (send_len, recv_len) = call.lens(self.size, send.is_none());
        let bufs = super::device::send_recv(send.map(|s| (s, send_len)), (recv, recv_len));
        let arena = self.links == Links::Arena && stream == 0 && call.moves_bytes();
        let found = if call.exchanges(self.place.cuda_ipc) || arena {
            self.placed(&bufs)?
        } else {
            Placed::Mixed
        };
        Ok(match found {
            Placed::Device((driver, place, ordinal)) => Ok(OnDevice {
                driver,
                place,
                ordinal,
                bufs,
                src: call.src(self.rank, send, recv),
                recv,
                in_place: send.is_none(),
                stream,
            }),
            Placed::Host => Err((bufs, true)),
            Placed::Mixed => Err((bufs, false)),
        })
    }

    /// The driver, placement and device of `bufs` when each non-empty one is device memory
    /// (at least one), on the comm's device; None otherwise.
    pub(super) fn all_on_device(&self, bufs: &[CallBuf]) -> Result<Option<Found>> {
        Ok(match self.placed(bufs)? {
            Placed::Device(found) => Some(found),
            Placed::Host | Placed::Mixed => None,
        })
    }

    /// Where `bufs` are, found once (a call's dense entry passes it on).
    fn placed(&self, bufs: &[CallBuf]) -> Result<Placed> {
        let Ok(driver) = crate::gpu::select::driver() else {
            return Ok(Placed::Host);
        };
        let place = staging::locate(&*driver, bufs)?;
        let host = bufs
            .iter()
            .zip(&place.device)
            .any(|(b, d)| b.len > 0 && d.is_none());
        match place.ordinal()? {
            Some(o) if !host => {
                self.check_device(o)?;
                Ok(Placed::Device((driver, place, o)))
            }
            Some(_) => Ok(Placed::Mixed),
            None => Ok(Placed::Host),
        }
    }
}

/// Where a call's buffers are.
enum Placed {
    /// Every non-empty one on the comm's device (at least one).
    Device(Found),
    /// All host memory (or no usable driver).
    Host,
    /// Some of each.
    Mixed,
}

/// A call's driver, where its buffers are, and their one device.
type Found = (
    Arc<dyn crate::gpu::driver::Driver>,
    staging::Placement,
    usize,
);
