//! `--device cuda`: the send and receive buffers in device memory, allocated through qccl's
//! CUDA driver contract (the real driver, or the emulated one under QCCL_GPU_EMULATE), and
//! every collective run on the device addresses the way the C API runs a call on a stream
//! (`Comm::on_stream`): enqueued on qccl-perf's own stream and returning at once; the stream
//! is synchronised at the end of the timed loop, as nccl-tests does with
//! cudaStreamSynchronize. qccl stages the buffers through page-locked host memory (for a
//! dense all-reduce, reduce-scatter or all-gather of ranks sharing one host, in bands
//! pipelined with the shared-memory arena's rounds: `Comm::enqueue_all_reduce_dense_at`),
//! except a
//! compressed all-reduce, which goes through `Comm::all_reduce_compressed_at` as the C API's
//! does: a flat SRA, all-gather scheme, ring or tree on a float type runs its codecs on the
//! GPU (only encoded bytes cross PCIe), and so does a naive all-gather top-k (`naiveag`, the
//! all-gather scheme with MSTopK); its wire column is then the comm's byte count over the
//! loop, per call.
//!
//! With `-y 1` (nccl-tests' `--stream_null`) every call goes on the legacy default stream
//! (NULL) instead and returns once done; a dense all-reduce, reduce-scatter or all-gather of
//! ranks sharing one host then goes through their shared-memory arena, the GPU copying
//! straight into and out of its segments (`Comm::dense_path`), where the host path would take
//! the arena's rounds.
//!
//! The one module of qccl-perf with `unsafe`: device addresses are raw, and `on_stream` takes
//! the caller's promise that they stay valid until the stream passes each call (held here by
//! synchronising before any buffer is freed).

use crate::args::{Args, Device};
use crate::coll::{Coll, Ctx, Ran, Shape};
use crate::elem::Elem;
use qccl::internal::gpu_driver::{DeviceInfo, DeviceMem, Driver, Event, Stream};
use qccl::internal::{
    AllReduceCall, Buf, CallBuf, Coll as Call, CollCall, Engine, PreparedAllReduce, PreparedTopK,
    Shape as Where,
};
use qccl::{Algo, Comm, Error, Result, Wire};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The device this process runs on: `--device` as given (`cuda` needs a usable driver:
/// `Unsupported` naming what is missing), else cuda when a driver and device are usable and
/// the run can take device buffers (not `--calibrate`, not `-R`), else host.
pub fn resolve(a: &Args) -> Result<Device> {
    match a.device {
        Some(Device::Host) => Ok(Device::Host),
        Some(Device::Cuda) => match qccl::internal::gpu() {
            Ok(_) => Ok(Device::Cuda),
            Err(Error::Unsupported(why)) => Err(Error::Unsupported(format!(
                "--device cuda: {why} (--device host runs on host memory; QCCL_GPU_EMULATE=1 \
                 emulates a GPU)"
            ))),
            Err(e) => Err(e.prefixed("--device cuda: ")),
        },
        None if a.calibrate || a.register => Ok(Device::Host),
        None => Ok(match qccl::internal::gpu() {
            Ok(_) => Device::Cuda,
            Err(_) => Device::Host,
        }),
    }
}

/// Calls in flight on the stream at most: each holds page-locked copies of its buffers until
/// it is done, so an unbounded queue of large calls would pin memory without limit.
const IN_FLIGHT: usize = 4;

/// This rank's GPU: its stream, the current table section's device buffers, and the calls
/// enqueued since the last [`Gpu::sync`].
pub struct Gpu {
    driver: Arc<dyn Driver>,
    info: DeviceInfo,
    stream: Box<dyn Stream>,
    /// Send and receive buffers (None before the first section), each allocated `offset`
    /// bytes longer and used from there on (`-u`).
    bufs: Option<(Box<dyn DeviceMem>, Box<dyn DeviceMem>)>,
    offset: usize,
    /// An event after each call still possibly in flight, oldest first.
    in_flight: VecDeque<Box<dyn Event>>,
    /// Each call's report, pushed by the comm's worker as the call runs (in call order).
    done: Arc<Mutex<Vec<Ran>>>,
    /// Compressed calls enqueued whole since the last sync (their algorithm, and a top-k
    /// call's k), which report nothing, and the comm's wire count before them.
    unreported: Vec<(Algo, Option<usize>)>,
    wire_base: Option<Wire>,
    enqueued: usize,
    /// Bound on one wait for the stream: the comm's timeout for each call in flight.
    timeout: Duration,
    /// `-y 1`: calls go on the legacy default stream, each returning once done.
    stream_null: bool,
}

impl Gpu {
    /// Device `local_rank % devices` (several ranks may share one GPU, which NCCL refuses and
    /// qccl allows) with a stream of qccl-perf's own; `timeout` bounds each call's wait.
    pub fn open(local_rank: usize, timeout: Duration, stream_null: bool) -> Result<Gpu> {
        let driver = qccl::internal::gpu()?;
        let ordinal = local_rank % driver.device_count().max(1);
        let info = driver.device(ordinal)?;
        let stream = driver.create_stream(ordinal)?;
        Ok(Gpu {
            driver,
            info,
            stream,
            bufs: None,
            offset: 0,
            in_flight: VecDeque::new(),
            done: Arc::default(),
            unreported: Vec::new(),
            wire_base: None,
            enqueued: 0,
            timeout: timeout.saturating_mul(IN_FLIGHT as u32 + 1),
            stream_null,
        })
    }

    /// The stream calls are ordered on: qccl-perf's own, or null (`-y 1`).
    fn call_stream(&self) -> *mut std::ffi::c_void {
        if self.stream_null {
            std::ptr::null_mut()
        } else {
            self.stream.raw()
        }
    }

    /// The device's identity, for the `# Using devices` lines.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Device buffers for a table section: `send` and `recv` bytes, each starting `offset`
    /// bytes into its allocation. The previous section's are freed once its calls are done.
    pub fn reserve(&mut self, send: usize, recv: usize, offset: usize) -> Result<()> {
        self.stream.synchronize(self.timeout)?;
        self.bufs = None;
        let o = self.info.ordinal;
        let send = self.driver.alloc_device(o, offset + send.max(1))?;
        let recv = self.driver.alloc_device(o, offset + recv.max(1))?;
        self.bufs = Some((send, recv));
        self.offset = offset;
        Ok(())
    }

    /// (send, recv) device addresses of the current section.
    fn addrs(&self) -> Result<(u64, u64)> {
        let (s, r) = self
            .bufs
            .as_ref()
            .ok_or_else(|| Error::Internal("qccl-perf: no device buffers reserved".into()))?;
        let o = self.offset as u64;
        Ok((s.addr() + o, r.addr() + o))
    }

    /// Copies `send` and `recv` into the device buffers, after the calls enqueued so far;
    /// returns once the copies are done.
    pub fn upload<T: Elem>(&mut self, send: &[T], recv: &[T]) -> Result<()> {
        let (s, r) = self.addrs()?;
        for (dst, src) in [(s, send), (r, recv)] {
            // SAFETY: `src` is borrowed until the synchronize below, which ends the copy;
            // `dst` is this section's device buffer, which has room for `src` (`reserve` was
            // given the section's largest lengths) and lives until the next `reserve`.
            unsafe {
                self.stream
                    .copy_to_device(dst, src.as_ptr().cast(), std::mem::size_of_val(src))?
            };
        }
        self.stream.synchronize(self.timeout)
    }

    /// Copies the device buffers back into `send` and `recv`, after the calls enqueued so far.
    pub fn download<T: Elem>(&mut self, send: &mut [T], recv: &mut [T]) -> Result<()> {
        let (s, r) = self.addrs()?;
        for (src, dst) in [(s, send), (r, recv)] {
            // SAFETY: `dst` is borrowed mutably, so nothing else reads or writes it, until
            // the synchronize below, which ends the copy; `src` as in `upload`.
            unsafe {
                self.stream.copy_to_host(
                    dst.as_mut_ptr().cast(),
                    src,
                    std::mem::size_of_val(dst),
                )?
            };
        }
        self.stream.synchronize(self.timeout)
    }

    /// Enqueues one call of `coll` on the device buffers (the shape's leading parts; in place
    /// as [`crate::coll::run`] lays it out) and returns; its report comes from [`Gpu::sync`].
    pub fn enqueue<T: Elem>(
        &mut self,
        ctx: &Ctx<'_>,
        coll: Coll,
        in_place: bool,
        sh: Shape,
    ) -> Result<()> {
        let (s, r) = self.addrs()?;
        let es = std::mem::size_of::<T>();
        let (work, bufs) = Work::prepare::<T>(
            ctx,
            coll,
            in_place,
            sh,
            (s, sh.send * es),
            (r, sh.recv * es),
        )?;
        let call_bufs: Vec<CallBuf> = bufs.clone();
        // On qccl-perf's stream: a dense all-reduce, reduce-scatter or all-gather pipelined
        // through the arena of ranks sharing one host or in bands across hosts, a broadcast
        // or reduce in bands of the chain's slices, enqueued, where that applies.
        let work = match work {
            Work::AllReduce(call) if !self.stream_null => {
                let (send, recv) = send_recv_of(&call_bufs)?;
                // SAFETY: as in `enqueue_compressed`.
                let raw = self.stream.raw();
                if unsafe { ctx.comm.enqueue_all_reduce_dense_at(&call, send, recv, raw) }? {
                    return self.enqueued(Ran {
                        algo: call.algo(),
                        ..Ran::default()
                    });
                }
                Work::AllReduce(call)
            }
            Work::Call(call)
                if !self.stream_null
                    && matches!(
                        call.coll,
                        Call::ReduceScatter | Call::AllGather | Call::Broadcast | Call::Reduce
                    ) =>
            {
                let (send, recv) = send_recv_of(&call_bufs)?;
                // SAFETY: as in `enqueue_compressed`.
                let raw = self.stream.raw();
                if unsafe { ctx.comm.enqueue_coll_dense_at(&call, send, recv, raw) }? {
                    return self.enqueued(Ran::default());
                }
                Work::Call(call)
            }
            work => work,
        };
        match work {
            // As the C API: the core's one entry for compressed all-reduces on raw buffers,
            // which runs the codecs on the GPU where the call has that path.
            Work::Compressed(call) => self.enqueue_compressed(ctx.comm, *call, &call_bufs, None)?,
            // The naive all-gather top-k is a compressed all-reduce (MSTopK, the all-gather
            // scheme): the same entry, its codec on the GPU.
            Work::TopK(call) => match call.into_compressed() {
                Ok((c, k)) => self.enqueue_compressed(ctx.comm, c, &call_bufs, Some(k))?,
                // HiTopKComm on the NULL stream: its top-k and scatter-add on the GPU where
                // the call has that path (`Comm::hitopk_on_device`), returning once done.
                Err(call) if self.stream_null => {
                    let (send, recv) = send_recv_of(&call_bufs)?;
                    // SAFETY: as in `enqueue_compressed`: this section's device memory,
                    // distinct buffers, valid until the call returned.
                    match unsafe { ctx.comm.hitopk_on_device(&call, send, recv) }? {
                        Some(rep) => {
                            let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
                            done.push(Ran {
                                algo: None,
                                wire: Some(rep.wire),
                                inter: None,
                                steps: Some((rep.steps, rep.scatter_add)),
                                k: rep.k,
                            });
                        }
                        None => self.enqueue_staged(ctx.comm, Work::TopK(call), bufs)?,
                    }
                }
                // On qccl-perf's stream (float32): enqueued with the top-k on the GPU
                // (`Comm::enqueue_hitopk_on_device`), else staged.
                // It reports nothing: its bytes come from the comm's count at `sync`, as a
                // compressed call's on the stream.
                Err(call) => {
                    let (send, recv) = send_recv_of(&call_bufs)?;
                    let raw = self.stream.raw();
                    if self.wire_base.is_none() {
                        self.wire_base = Some(ctx.comm.wire()?);
                    }
                    // SAFETY: as in `enqueue_compressed`: this section's device memory,
                    // distinct buffers, valid until the stream passed the call.
                    match unsafe { ctx.comm.enqueue_hitopk_on_device(&call, send, recv, raw) }? {
                        Some(k) => self.unreported.push((Algo::Hier, Some(k))),
                        None => self.enqueue_staged(ctx.comm, Work::TopK(call), bufs)?,
                    }
                }
            },
            // As the C API where `Comm::dense_path` says so: a dense all-reduce through the
            // core's entry, over CUDA IPC when every rank's buffers are on one device (a comm
            // using it), else through one host's arena (NULL stream) or staged, returning
            // once done.
            Work::AllReduce(call) if ctx.comm.dense_path(self.call_stream()) => {
                let (send, recv) = send_recv_of(&call_bufs)?;
                // SAFETY: as in `enqueue_compressed`: this section's device memory, distinct
                // buffers, valid until the call returned; the stream is null or this driver's.
                let algo = unsafe {
                    ctx.comm
                        .all_reduce_dense_at(&call, send, recv, self.call_stream())
                }?;
                let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
                done.push(Ran {
                    algo,
                    ..Ran::default()
                });
            }
            // The same for a reduce-scatter or all-gather.
            Work::Call(call)
                if ctx.comm.dense_path(self.call_stream())
                    && matches!(call.coll, Call::ReduceScatter | Call::AllGather) =>
            {
                let (send, recv) = send_recv_of(&call_bufs)?;
                // SAFETY: as above.
                unsafe {
                    ctx.comm
                        .coll_dense_at(&call, send, recv, self.call_stream())
                }?;
                let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
                done.push(Ran::default());
            }
            // A broadcast or reduce on the NULL stream in bands of the chain's slices, where
            // it takes that path, returning once done.
            Work::Call(call)
                if self.stream_null && matches!(call.coll, Call::Broadcast | Call::Reduce) =>
            {
                let (send, recv) = send_recv_of(&call_bufs)?;
                // SAFETY: as above.
                let null = std::ptr::null_mut();
                if unsafe { ctx.comm.rooted_in_bands_at(&call, send, recv, null) }? {
                    let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
                    done.push(Ran::default());
                } else {
                    self.enqueue_staged(ctx.comm, Work::Call(call), bufs)?;
                }
            }
            work => self.enqueue_staged(ctx.comm, work, bufs)?,
        }
        self.count_enqueued()
    }

    /// Records `ran` for a call enqueued whole (its report known now), and counts it.
    fn enqueued(&mut self, ran: Ran) -> Result<()> {
        self.done
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(ran);
        self.count_enqueued()
    }

    /// Counts a call enqueued, bounding the calls in flight.
    fn count_enqueued(&mut self) -> Result<()> {
        self.enqueued += 1;
        self.in_flight.push_back(self.stream.record()?);
        if self.in_flight.len() > IN_FLIGHT {
            let oldest = self.in_flight.pop_front().expect("more than IN_FLIGHT");
            oldest.synchronize(self.timeout)?;
        }
        Ok(())
    }

    /// Enqueues `work` on `bufs` (the send buffer then the receive buffer, or the one buffer
    /// in place), staged through page-locked memory (`Comm::on_stream`), as the C API does.
    fn enqueue_staged(&mut self, comm: &Comm, work: Work, bufs: Vec<CallBuf>) -> Result<()> {
        let done = self.done.clone();
        let coded = work.coded_calls();
        let call_bufs = bufs.clone();
        if self.stream_null {
            // SAFETY: as below; the call returns once done.
            let ran = unsafe {
                comm.on_buffers(&call_bufs, std::ptr::null_mut(), |hosts| {
                    comm.execute(|e| work.run(e, &bufs, hosts))
                })
            }?;
            done.lock().unwrap_or_else(|p| p.into_inner()).push(ran);
            return Ok(());
        }
        // SAFETY: the buffers are this section's device memory (lengths within `reserve`'s),
        // freed only after the stream is synchronised (`reserve`, `Drop`), so they stay valid
        // until the stream passes the call; the stream is this driver's, on their device.
        unsafe {
            comm.on_stream(&call_bufs, self.stream.raw(), coded, move |e, hosts| {
                let ran = work.run(e, &bufs, hosts)?;
                done.lock().unwrap_or_else(|p| p.into_inner()).push(ran);
                Ok(())
            })
        }
    }

    /// Enqueues compressed all-reduce `call` on `bufs` (the send buffer then the receive
    /// buffer, or the one buffer in place) through `Comm::all_reduce_compressed_at`, as the
    /// C API does. A call enqueued on the stream reports nothing: its bytes on the wire come
    /// from the comm's count at [`Gpu::sync`], shared evenly over the calls since the last.
    fn enqueue_compressed(
        &mut self,
        comm: &Comm,
        call: PreparedAllReduce,
        bufs: &[CallBuf],
        topk: Option<usize>,
    ) -> Result<()> {
        if self.wire_base.is_none() {
            self.wire_base = Some(comm.wire()?);
        }
        let algo = call.algo();
        let (send, recv) = send_recv_of(bufs)?;
        // SAFETY: as in `enqueue`: this section's device memory, distinct buffers (in place
        // is `send: None`), valid until the stream passes the call; the stream is this
        // driver's, on their device.
        let report =
            unsafe { comm.all_reduce_compressed_at(call, send, recv, self.call_stream()) }?;
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        match report {
            Some(rep) => done.push(Ran {
                inter: rep.inter,
                ..ran_of(algo, topk, rep.wire)
            }),
            None => self.unreported.push((algo, topk)),
        }
        Ok(())
    }

    /// Waits until every enqueued call is done and returns their reports in call order; the
    /// comm's error if one failed.
    pub fn sync(&mut self, comm: &Comm) -> Result<Vec<Ran>> {
        self.stream.synchronize(self.timeout)?;
        self.in_flight.clear();
        if let Some(e) = comm.async_error() {
            return Err(e);
        }
        if let Some(base) = self.wire_base.take() {
            // After every call of the comm (its turn): the bytes the calls since `base` moved.
            let now = comm.wire()?;
            self.wire_base = Some(now);
            let calls = std::mem::take(&mut self.unreported);
            if !calls.is_empty() {
                let d = now - base;
                let n = calls.len() as u64;
                let each = Wire {
                    sent: d.sent / n,
                    received: d.received / n,
                };
                let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
                done.extend(
                    calls
                        .into_iter()
                        .map(|(algo, topk)| ran_of(algo, topk, each)),
                );
            }
        }
        let ran = std::mem::take(&mut *self.done.lock().unwrap_or_else(|p| p.into_inner()));
        let enqueued = std::mem::take(&mut self.enqueued);
        if ran.len() != enqueued {
            return Err(Error::Internal(format!(
                "qccl-perf: {enqueued} calls enqueued on the device but {} reported",
                ran.len()
            )));
        }
        Ok(ran)
    }
}

/// An all-reduce's send (None: in place) and receive addresses from its buffers (the send
/// buffer then the receive buffer, or the one buffer in place).
fn send_recv_of(bufs: &[CallBuf]) -> Result<(Option<u64>, u64)> {
    match bufs {
        [whole] => Ok((None, whole.addr)),
        [send, recv] => Ok((Some(send.addr), recv.addr)),
        _ => Err(Error::Internal(format!(
            "qccl-perf: an all-reduce on {} buffers",
            bufs.len()
        ))),
    }
}

/// What a compressed all-reduce of schedule `algo` that moved `wire` reports; a naive
/// all-gather top-k call (`topk`: its k) reports as the staged top-k calls do, with no
/// schedule and zero step times (the baselines').
fn ran_of(algo: Algo, topk: Option<usize>, wire: Wire) -> Ran {
    match topk {
        None => Ran {
            algo: Some(algo),
            wire: Some(wire),
            ..Ran::default()
        },
        Some(k) => Ran {
            algo: None,
            wire: Some(wire),
            inter: None,
            steps: Some(([Duration::ZERO; 4], Duration::ZERO)),
            k,
        },
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // The buffers must outlive every call that may still read or write them.
        let _ = self.stream.synchronize(self.timeout);
    }
}

/// One call, checked and prepared on the caller's thread (as the C API prepares a call
/// before enqueueing it), run later on the comm's worker on the staged host addresses.
enum Work {
    AllReduce(Box<AllReduceCall>),
    Compressed(Box<PreparedAllReduce>),
    TopK(Box<PreparedTopK>),
    /// Every other collective: the engine's own call, as `Comm`'s methods run it.
    Call(CollCall<'static>),
    /// The ring shift of [`crate::coll`]'s sendrecv: a send to `next` and a receive from
    /// `prev`, sending first on even ranks; a local copy on one rank.
    SendRecv {
        send: CollCall<'static>,
        recv: CollCall<'static>,
        send_first: bool,
        /// One rank: the shift is a copy.
        alone: bool,
    },
}

/// (device address, bytes) of a buffer.
type Dev = (u64, usize);

impl Work {
    /// How many compressed calls running it makes, declared to `on_stream` (compressed
    /// all-reduces do not come this way).
    fn coded_calls(&self) -> Option<u64> {
        match self {
            Work::AllReduce(call) => Some(call.coded_calls()),
            Work::Compressed(_) => Some(1),
            Work::TopK(call) => Some(call.coded_calls()),
            Work::Call(_) | Work::SendRecv { .. } => Some(0),
        }
    }

    /// The call and its buffers as `on_stream` takes them: the send buffer (read) then the
    /// receive buffer (written; read too in place); a buffer the call does not use on this
    /// rank (a root-only one elsewhere) is empty, as the C API passes it.
    fn prepare<T: Elem>(
        ctx: &Ctx<'_>,
        coll: Coll,
        in_place: bool,
        sh: Shape,
        send: Dev,
        recv: Dev,
    ) -> Result<(Work, Vec<CallBuf>)> {
        let (c, dtype, op) = (ctx.comm, T::DTYPE, ctx.op);
        let buf = |(addr, len): Dev, reads, writes| CallBuf {
            addr,
            len,
            reads,
            writes,
        };
        // In place the data lives in `send` for reduce_scatter (the n·count buffer) and in
        // `recv` otherwise, as in coll::run.
        let whole = if coll == Coll::ReduceScatter {
            send
        } else {
            recv
        };
        let bufs = if in_place {
            vec![buf(whole, true, true)]
        } else {
            vec![buf(send, true, false), buf(recv, false, true)]
        };
        let work = match coll {
            Coll::AllReduce => match &ctx.compression {
                Some(z) => Work::Compressed(Box::new(
                    c.prepare_all_reduce_compressed(sh.count, dtype, op, z)?,
                )),
                None => Work::AllReduce(Box::new(c.prepare_all_reduce(
                    sh.count,
                    dtype,
                    op,
                    Some(ctx.algo),
                )?)),
            },
            Coll::TopK(scheme) => {
                let o = ctx.topk.as_ref().ok_or_else(|| {
                    Error::Internal(format!("no top-k options for --coll {}", coll.name()))
                })?;
                Work::TopK(Box::new(c.prepare_topk(sh.count, dtype, scheme, o)?))
            }
            Coll::SendRecv => {
                let n = ctx.n;
                let p2p = |kind, peer| CollCall::new(kind, sh.count, dtype).root(peer);
                let send = p2p(Call::Send, (ctx.rank + 1) % n);
                let recv = p2p(Call::Recv, (ctx.rank + n - 1) % n);
                if n > 1 {
                    for call in [&send, &recv] {
                        call.validate(Where {
                            rank: ctx.rank,
                            size: n,
                        })?;
                    }
                }
                Work::SendRecv {
                    send,
                    recv,
                    send_first: ctx.rank.is_multiple_of(2),
                    alone: n == 1,
                }
            }
            other => {
                let kind = match other {
                    Coll::ReduceScatter => Call::ReduceScatter,
                    Coll::AllGather => Call::AllGather,
                    Coll::Broadcast => Call::Broadcast,
                    Coll::Reduce => Call::Reduce,
                    Coll::AllToAll => Call::AllToAll,
                    Coll::Gather => Call::Gather,
                    Coll::Scatter => Call::Scatter,
                    Coll::AllReduce | Coll::TopK(_) | Coll::SendRecv => {
                        unreachable!("matched above")
                    }
                };
                let call = CollCall::new(kind, sh.count, dtype)
                    .op(op)
                    .root(ctx.root)
                    .bufs(
                        if in_place {
                            Buf::None
                        } else {
                            Buf::Bytes(send.1)
                        },
                        Buf::Bytes(if in_place { whole.1 } else { recv.1 }),
                    );
                call.validate(Where {
                    rank: ctx.rank,
                    size: ctx.n,
                })
                .map_err(|e| e.prefixed(&format!("{}: ", kind.name())))?;
                // Root-only buffers are left out elsewhere, as the C API leaves them.
                let mut bufs = bufs;
                if !in_place {
                    use qccl::internal::Side;
                    for (b, side) in bufs.iter_mut().zip([Side::Send, Side::Recv]) {
                        if !call.uses(side, ctx.rank) {
                            b.len = 0;
                        }
                    }
                }
                return Ok((Work::Call(call), bufs));
            }
        };
        Ok((work, bufs))
    }

    /// Runs the call on the staged host addresses `hosts` (one per buffer of `bufs`).
    fn run(self, e: &mut Engine, bufs: &[CallBuf], hosts: &[*mut u8]) -> Result<Ran> {
        // SAFETY: staging hands each non-empty buffer its own page-locked copy of `len`
        // bytes, owned by the call until this returns and distinct from the other buffer's,
        // so the slices are valid and a shared and a mutable one never alias.
        let (send, recv): (Option<&[u8]>, &mut [u8]) = unsafe {
            let slice = |i: usize| -> &mut [u8] {
                match bufs[i].len {
                    0 => &mut [],
                    len => std::slice::from_raw_parts_mut(hosts[i], len),
                }
            };
            match bufs.len() {
                1 => (None, slice(0)),
                _ => (Some(&*slice(0)), slice(1)),
            }
        };
        match self {
            Work::AllReduce(call) => Ok(Ran {
                algo: Some(call.run(e, send, recv)?),
                ..Ran::default()
            }),
            Work::Compressed(_) => Err(Error::Internal(
                "qccl-perf: a compressed all-reduce staged as a plain call (it goes through \
                 Gpu::enqueue_compressed)"
                    .into(),
            )),
            Work::TopK(call) => {
                // In place only, as coll::run: out of place is a copy, then in place.
                if let Some(s) = send {
                    recv.copy_from_slice(s);
                }
                let rep = call.run(e, recv)?;
                Ok(Ran {
                    algo: None,
                    wire: Some(rep.wire),
                    inter: None,
                    steps: Some((rep.steps, rep.scatter_add)),
                    k: rep.k,
                })
            }
            Work::Call(call) => {
                // An empty root-only send buffer elsewhere is ignored there (`run_call`).
                e.run_call(&call, send, recv)?;
                Ok(Ran::default())
            }
            Work::SendRecv {
                send: to_next,
                recv: from_prev,
                send_first,
                alone,
            } => {
                let s = send.unwrap_or(&[]);
                if alone {
                    recv.copy_from_slice(s);
                } else if send_first {
                    e.run_call(&to_next, Some(s), &mut [])?;
                    e.run_call(&from_prev, None, recv)?;
                } else {
                    e.run_call(&from_prev, None, recv)?;
                    e.run_call(&to_next, Some(s), &mut [])?;
                }
                Ok(Ran::default())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names() {
        for (s, d) in [
            ("host", Device::Host),
            ("CPU", Device::Host),
            ("cuda", Device::Cuda),
            (" GPU ", Device::Cuda),
        ] {
            assert_eq!(Device::parse(s), Ok(d), "{s}");
        }
        let e = Device::parse("rocm").unwrap_err();
        assert!(e.contains("'rocm'") && e.contains("host, cuda"), "{e}");
    }
}
