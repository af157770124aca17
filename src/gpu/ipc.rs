//! A dense all-reduce of device buffers between the ranks of one machine over CUDA IPC (or,
//! for ranks that are threads of one process, their plain device addresses): no byte
//! crosses PCIe. Each rank copies its input into a device buffer of its own that the
//! others have mapped (`scratch`, shared once per size with `Driver::ipc_open`); the owner of
//! chunk r (rank r, chunks as `algo::part` cuts them) reduces chunk r of every rank's scratch
//! into its receive buffer with `reduce.cu`'s kernels, in rank order (each chunk is reduced
//! once, so every rank ends with the same bits), and puts it back into its scratch; every
//! rank then copies the other chunks from their owners' scratch.
//!
//! A reduce-scatter is the first step alone (each rank reduces its part of every rank's
//! input into its output); an all-gather is the second (each rank copies every other
//! rank's part from its scratch).
//!
//! This file only enqueues device work; `comm/cuda_ipc.rs` decides when the path applies
//! (every rank's buffers on one device) and puts the engine's barriers between the steps:
//! after `stage` (every input in place), after `reduce_own` (every chunk reduced), after
//! `gather` (no rank rewrites its scratch while a peer still reads it).

use super::driver::{Arg, DeviceMem, Driver, IpcHandle, Stream};
use super::kernels::dtype_suffix;
use super::plans::{grid_for, BLOCK};
use crate::algo::part;
use crate::error::{Error, Result};
use crate::types::{DType, ReduceOp};
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

/// Scratch grows in steps of this many bytes (and by half again), so that calls of nearby
/// sizes do not make the peers map a new buffer each time.
const SCRATCH_STEP: usize = 1 << 20;

/// One rank's device side of the IPC all-reduce on its comm's device, kept across calls.
pub struct IpcLane {
    driver: Arc<dyn Driver>,
    ordinal: usize,
    stream: Box<dyn Stream>,
    timeout: Duration,
    /// The device's PCI bus id: ranks whose buffers are on the same one share memory.
    bus_id: String,
    /// This rank's input, where the peers map it, and its handle.
    scratch: Option<(Box<dyn DeviceMem>, IpcHandle)>,
    /// The peers' scratch buffers reachable here, by rank.
    peers: Vec<Option<Peer>>,
}

/// A peer's scratch as this rank reaches it.
enum Peer {
    /// In another process: mapped from its handle.
    Mapped(IpcHandle, Box<dyn DeviceMem>),
    /// In this process (ranks as threads): its own address, used as it is (CUDA opens no
    /// handle of its own process, and needs none: one address space, one context per
    /// device).
    Here(u64),
}

/// What a rank tells the others about its scratch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shared {
    /// The scratch's IPC handle.
    pub handle: IpcHandle,
    /// Its length in bytes.
    pub len: usize,
    /// The process it lives in.
    pub pid: u32,
    /// Its device address in that process.
    pub addr: u64,
}

impl IpcLane {
    /// A lane on device `ordinal` for a comm of `size` ranks; every wait bounded by `timeout`.
    pub fn new(
        driver: Arc<dyn Driver>,
        ordinal: usize,
        size: usize,
        timeout: Duration,
    ) -> Result<IpcLane> {
        let stream = driver.create_stream(ordinal)?;
        let bus_id = driver.device(ordinal)?.bus_id;
        Ok(IpcLane {
            driver,
            ordinal,
            stream,
            timeout,
            bus_id,
            scratch: None,
            peers: (0..size).map(|_| None).collect(),
        })
    }

    /// The device it runs on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's PCI bus id.
    pub fn bus_id(&self) -> &str {
        &self.bus_id
    }

    /// Enqueues the copy of the call's input (`bytes` at device address `src`) into the
    /// scratch, after the work enqueued on the caller's stream `raw` so far; the scratch
    /// grows first when it is too small (only between calls: the previous call ended with
    /// a barrier, so no peer reads it). Returns what the peers need to map it.
    ///
    /// # Safety
    /// `src` must be device memory of this device holding `bytes` (>= 1) bytes, valid and
    /// not written until `synchronize` returned; `raw` null or a live stream of this device.
    pub unsafe fn stage(&mut self, raw: *mut c_void, src: u64, bytes: usize) -> Result<Shared> {
        // SAFETY: the caller's promise about `raw`.
        let caller = unsafe { self.driver.borrow_stream(self.ordinal, raw)? };
        let ready = caller.record()?;
        self.stream.wait_event(&*ready)?;
        if self.scratch.as_ref().is_none_or(|(m, _)| m.len() < bytes) {
            let old = self.scratch.as_ref().map_or(0, |(m, _)| m.len());
            let len = bytes
                .max(old + old / 2)
                .checked_next_multiple_of(SCRATCH_STEP)
                .ok_or_else(|| Error::invalid(format!("{bytes} bytes of IPC scratch")))?;
            // The old one goes first: its peers' mappings are dropped when they see the new
            // handle (`open_peers`).
            self.scratch = None;
            let mem = self.driver.alloc_device(self.ordinal, len)?;
            let handle = mem.ipc_handle()?;
            self.scratch = Some((mem, handle));
        }
        let (mem, handle) = self.scratch.as_ref().expect("made above");
        // SAFETY: the scratch holds at least `bytes` and only this lane writes it, between
        // barriers no peer reads across; `src` is the caller's promise.
        unsafe { self.stream.copy_on_device(mem.addr(), src, bytes)? };
        Ok(Shared {
            handle: *handle,
            len: mem.len(),
            pid: std::process::id(),
            addr: mem.addr(),
        })
    }

    /// Reaches the peers' scratch buffers (`shared[q]` for rank q; this rank's `rank` is
    /// skipped): those of other processes mapped, reusing the mappings of handles seen
    /// before; those of this process at their address.
    pub fn open_peers(&mut self, rank: usize, shared: &[Shared]) -> Result<()> {
        let here = std::process::id();
        for (q, s) in shared.iter().enumerate() {
            if q == rank {
                continue;
            }
            if s.pid == here {
                self.peers[q] = Some(Peer::Here(s.addr));
                continue;
            }
            if matches!(&self.peers[q], Some(Peer::Mapped(h, _)) if *h == s.handle) {
                continue;
            }
            // A peer's new scratch: the mapping of its old one is closed first.
            self.peers[q] = None;
            let mem = self
                .driver
                .ipc_open(self.ordinal, &s.handle, s.len)
                .map_err(|e| e.prefixed(&format!("rank {q}'s all-reduce input over CUDA IPC: ")))?;
            self.peers[q] = Some(Peer::Mapped(s.handle, mem));
        }
        Ok(())
    }

    /// Rank `q`'s scratch address here.
    fn scratch_of(&self, rank: usize, q: usize) -> Result<u64> {
        let addr = if q == rank {
            self.scratch.as_ref().map(|(m, _)| m.addr())
        } else {
            self.peers[q].as_ref().map(|p| match p {
                Peer::Mapped(_, m) => m.addr(),
                Peer::Here(addr) => *addr,
            })
        };
        addr.ok_or_else(|| Error::Internal(format!("rank {q}'s IPC scratch is not mapped")))
    }

    /// Enqueues this rank's chunk of the all-reduce of `count` elements: chunk `rank` of
    /// every rank's scratch reduced with `op` in rank order into `recv`'s chunk (Avg divided
    /// once at the end), then copied into this rank's scratch for the others.
    ///
    /// # Safety
    /// `recv` must be device memory of this device of `count` elements of `dtype`, not used
    /// by anything else until `synchronize` returned; every scratch staged and mapped, and
    /// not rewritten until the peers passed the barrier after `gather`.
    pub unsafe fn reduce_own(
        &self,
        me: (usize, usize),
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let mine = part(count, me.1, me.0, dtype.size());
        let (at, len) = (mine.start as u64, mine.len());
        // SAFETY: the caller's promise; the chunk lies in `recv` and in every scratch.
        unsafe { self.reduce_chunk(me, at, recv + at, len, dtype, op)? };
        if len == 0 {
            return Ok(());
        }
        let own = self.scratch_of(me.0, me.0)? + at;
        // SAFETY: the chunk of `recv` reduced above into the same chunk of this rank's
        // scratch, which no peer reads until the barrier after this call's `synchronize`.
        unsafe { self.stream.copy_on_device(own, recv + at, len) }
    }

    /// Enqueues the reduction with `op`, in rank order, of the `len` bytes at offset `at` of
    /// every rank's scratch into `out` (Avg divided once at the end): an all-reduce's chunk,
    /// a reduce-scatter's part.
    ///
    /// # Safety
    /// `out` must be device memory of this device of `len` bytes, apart from every scratch
    /// and not used by anything else until `synchronize` returned; every scratch staged and
    /// mapped, holding `at + len` bytes.
    pub unsafe fn reduce_chunk(
        &self,
        (rank, size): (usize, usize),
        at: u64,
        out: u64,
        len: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let n = (len / dtype.size()) as u64;
        if n == 0 {
            return Ok(());
        }
        if size < 2 {
            return Err(Error::Internal(
                "a reduction over CUDA IPC needs at least two ranks".into(),
            ));
        }
        let reduce = self.driver.function(
            self.ordinal,
            &format!("qccl_reduce_{}_{}", op.name(), dtype_suffix(dtype)),
        )?;
        for q in 1..size {
            let a = if q == 1 {
                self.scratch_of(rank, 0)? + at
            } else {
                out
            };
            let b = self.scratch_of(rank, q)? + at;
            let args = [Arg::Ptr(out), Arg::Ptr(a), Arg::Ptr(b), Arg::U64(n)];
            // SAFETY: reduce.cu's qccl_reduce_<op>_<T>(T* out, const T* a, const T* b,
            // uint64_t n), out == a allowed: `n` elements of `out` and of two scratch
            // buffers (the caller's promise).
            unsafe {
                self.stream
                    .launch(&*reduce, grid_for(len / 16), BLOCK, &args)?
            };
        }
        if op == ReduceOp::Avg {
            let finish = self.driver.function(
                self.ordinal,
                &format!("qccl_finish_avg_{}", dtype_suffix(dtype)),
            )?;
            let args = [Arg::Ptr(out), Arg::U64(n), Arg::U64(size as u64)];
            // SAFETY: reduce.cu's qccl_finish_avg_<T>(T* x, uint64_t count, uint64_t n) over
            // the `n` elements reduced above.
            unsafe {
                self.stream
                    .launch(&*finish, grid_for(len / 16), BLOCK, &args)?
            };
        }
        Ok(())
    }

    /// Enqueues the copies of every other rank's reduced chunk from its scratch into `recv`.
    ///
    /// # Safety
    /// As `reduce_own`; every owner's chunk reduced and synchronised (a barrier passed).
    pub unsafe fn gather(
        &self,
        me: (usize, usize),
        recv: u64,
        count: usize,
        dtype: DType,
    ) -> Result<()> {
        for q in (0..me.1).filter(|&q| q != me.0) {
            let chunk = part(count, me.1, q, dtype.size());
            let at = chunk.start as u64;
            // SAFETY: owner q's reduced chunk, which it does not rewrite before the barrier
            // after this call's `synchronize`, into the same chunk of `recv`.
            unsafe { self.copy_from(me.0, q, at, recv + at, chunk.len())? };
        }
        Ok(())
    }

    /// Enqueues the copy of `len` bytes at offset `at` of rank `q`'s scratch to `to`.
    ///
    /// # Safety
    /// `to` must be device memory of this device of `len` bytes, not used by anything else
    /// until `synchronize` returned; rank q's scratch staged, mapped, holding `at + len`
    /// bytes, and not rewritten until the barrier after this call's `synchronize`.
    pub unsafe fn copy_from(
        &self,
        rank: usize,
        q: usize,
        at: u64,
        to: u64,
        len: usize,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let from = self.scratch_of(rank, q)? + at;
        // SAFETY: the caller's promise.
        unsafe { self.stream.copy_on_device(to, from, len) }
    }

    /// Waits, at most the comm's timeout, for the work enqueued so far.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize(self.timeout)
    }
}
