//! Dense all-reduces over CUDA IPC (QCCL_CUDA_IPC=1): when every rank's buffers are on one
//! device, the ranks reduce them on the GPU through each other's memory (`gpu::ipc`:
//! mapped over CUDA IPC from another process, at its address in the same one) instead of
//! staging them through page-locked host memory.
//!
//! Whether a call can take that path depends on every rank's buffers, which each rank alone
//! knows. So on a comm whose ranks all asked for it at init, all on one machine
//! (`ipc_descriptor::cuda_ipc_between`, the same answer everywhere), every dense all-reduce
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

use super::device_all_reduce::staged;
use super::ipc_descriptor::{all_ok, exchange, on_one_device, Descriptor};
use super::route::AllReduceCall;
use super::Comm;
use crate::algo::Algo;
use crate::coll::Engine;
use crate::error::{Error, Result};
use crate::gpu::ipc::IpcLane;
use crate::gpu::staging::{self, CallBuf, Staging};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

impl Comm {
    /// True when this comm's dense all-reduces agree on CUDA IPC first (QCCL_CUDA_IPC=1 on
    /// every rank, all on one machine).
    #[doc(hidden)]
    pub fn uses_cuda_ipc(&self) -> bool {
        self.place.cuda_ipc
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
        let on = match self.place_call(call, send, recv, stream as usize)? {
            Ok(on) => on,
            Err(bufs) => {
                // SAFETY: the caller's promise, passed on; `hosts` stand for the buffers.
                return unsafe {
                    self.on_buffers(&bufs, stream, |hosts| {
                        self.execute(|e| run_on(call, e, hosts, true))
                    })
                }
                .map(Some);
            }
        };
        let mut guard = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let st = self.staging_on(&mut guard, on.driver.clone(), on.ordinal)?;
        let turn = self.ipc_turn();
        // SAFETY: the caller's promise, passed on.
        self.execute(|e| unsafe { turn.run(e, st, call, &on) })
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
        let on = match self.place_call(&call, send, recv, 0)? {
            Ok(on) => on,
            Err(bufs) => {
                // SAFETY: the caller's promise, passed on; `hosts` stand for the buffers.
                return unsafe {
                    self.submit_on_buffers(bufs, Some(0), move |e, hosts| {
                        run_on(&call, e, hosts, true).map(drop)
                    })
                };
            }
        };
        let staging = self.queued_staging.clone();
        let first = if staging.lock().unwrap_or_else(|p| p.into_inner()).is_none() {
            Some(self.new_staging(on.driver.clone(), on.ordinal)?)
        } else {
            None
        };
        let turn = self.ipc_turn();
        self.queue.submit_holding((), Some(0), move |e, _| {
            let mut guard = staging.lock().unwrap_or_else(|p| p.into_inner());
            if guard.is_none() {
                *guard = first;
            }
            let st = guard.as_mut().expect("made before the call was queued");
            // SAFETY: the caller's promise, passed on; the legacy default stream.
            unsafe { turn.run(e, st, &call, &on) }.map(drop)
        })
    }

    fn ipc_turn(&self) -> IpcTurn {
        IpcTurn {
            lane: self.ipc_lane.clone(),
            calls: self.ipc_calls.clone(),
            rank: self.rank,
            size: self.size,
            timeout: self.config.timeout,
            comm_id: self.comm_id,
        }
    }

    /// The call on device buffers, ordered on `stream` (a `CUstream`, 0 for the legacy
    /// default stream), when it may go over CUDA IPC and each non-empty buffer is device
    /// memory (`all_on_device`); else its buffers, for the usual path.
    fn place_call(
        &self,
        call: &AllReduceCall,
        send: Option<u64>,
        recv: u64,
        stream: usize,
    ) -> Result<std::result::Result<OnDevice, Vec<CallBuf>>> {
        let (count, dtype, _) = call.shape();
        let bytes = count * dtype.size();
        let bufs = super::device::send_recv(send.map(|s| (s, bytes)), (recv, bytes));
        let found = if call.exchanges() {
            self.all_on_device(&bufs)?
        } else {
            None
        };
        Ok(match found {
            Some((driver, place, ordinal)) => Ok(OnDevice {
                driver,
                place,
                ordinal,
                bufs,
                src: send.unwrap_or(recv),
                recv,
                stream,
            }),
            None => Err(bufs),
        })
    }

    /// The driver, placement and device of `bufs` when each non-empty one is device memory
    /// (at least one), on the comm's device; None otherwise.
    fn all_on_device(&self, bufs: &[CallBuf]) -> Result<Option<Found>> {
        let Ok(driver) = crate::gpu::select::driver() else {
            return Ok(None);
        };
        let place = staging::locate(&*driver, bufs)?;
        let host = bufs
            .iter()
            .zip(&place.device)
            .any(|(b, d)| b.len > 0 && d.is_none());
        match place.ordinal()? {
            Some(o) if !host => {
                self.check_device(o)?;
                Ok(Some((driver, place, o)))
            }
            _ => Ok(None),
        }
    }
}

/// A call's driver, where its buffers are, and their one device.
type Found = (
    Arc<dyn crate::gpu::driver::Driver>,
    staging::Placement,
    usize,
);

/// A call's buffers when all are device memory: its driver, where they are, their device,
/// the input (send, or recv in place), the output, and the caller's stream (a `CUstream`).
struct OnDevice {
    driver: Arc<dyn crate::gpu::driver::Driver>,
    place: staging::Placement,
    ordinal: usize,
    bufs: Vec<CallBuf>,
    src: u64,
    recv: u64,
    stream: usize,
}

/// What a call over CUDA IPC needs of its comm in the comm's turn (queued calls take it to
/// the worker).
struct IpcTurn {
    lane: Arc<Mutex<Option<IpcLane>>>,
    calls: Arc<AtomicU64>,
    rank: usize,
    size: usize,
    timeout: Duration,
    comm_id: u64,
}

impl IpcTurn {
    /// Runs `call` on the device buffers `on` in the comm's turn (on `e`): over CUDA IPC
    /// when every rank's buffers are on one device (None), else staged through `st` (the
    /// algorithm that ran).
    ///
    /// # Safety
    /// `on`'s buffers must be valid for the call until this returns, and its stream null or
    /// a live stream of their device.
    unsafe fn run(
        &self,
        e: &mut Engine,
        st: &mut Staging,
        call: &AllReduceCall,
        on: &OnDevice,
    ) -> Result<Option<Algo>> {
        let (count, dtype, op) = call.shape();
        let bytes = count * dtype.size();
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
                    run_on(call, e, h, false)
                })
            }
            .map(Some);
        }
        let me = (self.rank, self.size);
        crate::qlog!(
            Trace,
            "rank {}: comm {:#018x}: all_reduce(count={count}, {dtype}): CUDA IPC",
            self.rank,
            self.comm_id
        );
        // SAFETY: `recv` is device memory of this device holding the call (the caller's
        // promise); every scratch is staged and mapped (agreed above), and none is
        // rewritten before the last barrier below.
        unsafe { lane.reduce_own(me, on.recv, count, dtype, op)? };
        lane.synchronize()?;
        e.barrier()?;
        // SAFETY: as above; every owner's chunk is reduced (the barrier).
        unsafe { lane.gather(me, on.recv, count, dtype)? };
        lane.synchronize()?;
        e.barrier()?;
        self.calls.fetch_add(1, Ordering::Relaxed);
        Ok(None)
    }
}

/// Runs `call` on `e` over `hosts` (send, if any, then recv; host addresses standing for the
/// buffers); `exchange`: with its CUDA IPC descriptor ("host"), unless already made.
fn run_on(call: &AllReduceCall, e: &mut Engine, hosts: &[*mut u8], exchange: bool) -> Result<Algo> {
    let (count, dtype, _) = call.shape();
    let len = count * dtype.size();
    // SAFETY: each host address stands for one buffer of `len` bytes, valid until the call
    // ends (`on_buffers`, `Staging::run`), and they do not overlap (the entry's promise).
    unsafe {
        let (send, recv) = match hosts {
            [s, r] => (Some(&*staged(*s, len)), staged(*r, len)),
            [r] => (None, staged(*r, len)),
            _ => {
                return Err(Error::Internal(format!(
                    "an all-reduce got {} buffers, not one or two",
                    hosts.len()
                )))
            }
        };
        if exchange {
            call.run(e, send, recv)
        } else {
            call.run_agreed(e, send, recv)
        }
    }
}
