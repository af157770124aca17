//! Dense all-reduces over CUDA IPC (QCCL_CUDA_IPC=1): when every rank's buffers are on one
//! device, the ranks reduce them on the GPU through each other's mapped memory
//! (`gpu::ipc`) instead of staging them through page-locked host memory.
//!
//! Whether a call can take that path depends on every rank's buffers, which each rank alone
//! knows. So on a comm whose ranks all asked for it at init (each in its own process, on
//! one machine: `cuda_ipc_between`, the same answer everywhere), every dense all-reduce
//! starts with an all-gather of a short descriptor, whichever way it was called: host
//! buffers and staged calls (groups, non-blocking calls) say "host" inside
//! `AllReduceCall::run`, calls through [`Comm::all_reduce_dense_at`] on device buffers say
//! "device, this bus id, this scratch". Only when all say the same device do they run the
//! IPC path; otherwise each runs the call as it would have (device buffers staged), so
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
use crate::gpu::staging::{self, CallBuf};
use std::ffi::c_void;

impl Comm {
    /// True when this comm's dense all-reduces agree on CUDA IPC first (QCCL_CUDA_IPC=1 on
    /// every rank, each in its own process, on one machine).
    #[doc(hidden)]
    pub fn uses_cuda_ipc(&self) -> bool {
        self.place.cuda_ipc
    }

    /// How many all-reduces ran over CUDA IPC on this comm so far.
    #[doc(hidden)]
    pub fn cuda_ipc_calls(&self) -> u64 {
        self.ipc_calls.load(std::sync::atomic::Ordering::Relaxed)
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
        let (count, dtype, _) = call.shape();
        let bytes = count * dtype.size();
        let bufs = super::device::send_recv(send.map(|s| (s, bytes)), (recv, bytes));
        let found = if call.exchanges() {
            self.all_on_device(&bufs)?
        } else {
            None
        };
        let Some((driver, place, ordinal)) = found else {
            // SAFETY: the caller's promise, passed on; `hosts` stand for the buffers.
            return unsafe {
                self.on_buffers(&bufs, stream, |hosts| {
                    self.execute(|e| run_on(call, e, hosts, true))
                })
            }
            .map(Some);
        };
        let mut guard = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let st = self.staging_on(&mut guard, driver.clone(), ordinal)?;
        self.execute(|e| {
            let mut slot = self.ipc_lane.lock().unwrap_or_else(|p| p.into_inner());
            if slot.is_none() {
                *slot = Some(IpcLane::new(
                    driver,
                    ordinal,
                    self.size,
                    self.config.timeout,
                )?);
            }
            let lane = slot.as_mut().expect("made above");
            // SAFETY: the caller's promise: the input is device memory of this device.
            let staged = unsafe { lane.stage(stream, send.unwrap_or(recv), bytes) };
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
                return unsafe { st.run(&bufs, &place, stream, |h| run_on(call, e, h, false)) }
                    .map(Some);
            }
            let me = (self.rank, self.size);
            crate::qlog!(
                Trace,
                "rank {}: comm {:#018x}: all_reduce(count={count}, {dtype}): CUDA IPC",
                self.rank,
                self.comm_id
            );
            let (_, _, op) = call.shape();
            // SAFETY: `recv` is device memory of this device holding the call (the caller's
            // promise); every scratch is staged and mapped (agreed above), and none is
            // rewritten before the last barrier below.
            unsafe { lane.reduce_own(me, recv, count, dtype, op)? };
            lane.synchronize()?;
            e.barrier()?;
            // SAFETY: as above; every owner's chunk is reduced (the barrier).
            unsafe { lane.gather(me, recv, count, dtype)? };
            lane.synchronize()?;
            e.barrier()?;
            self.ipc_calls
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(None)
        })
    }

    /// The driver, placement and device of `bufs` when each non-empty one is device memory
    /// (at least one), on the comm's device; None otherwise.
    fn all_on_device(&self, bufs: &[CallBuf]) -> Result<Option<OnDevice>> {
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
type OnDevice = (
    std::sync::Arc<dyn crate::gpu::driver::Driver>,
    staging::Placement,
    usize,
);

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
