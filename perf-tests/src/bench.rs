//! The measurement loop: for each type, op and size, time the out-of-place and in-place runs,
//! then check one freshly filled run of each.
//!
//! With a codec (`-Z`) the all-reduce runs compressed, keyed per (type, op, size) so that error
//! feedback keeps one residual per tensor as training would; each mode also records the wire
//! bytes of its last timed call and, from one call on fresh inputs (run even without `-c 1`),
//! the relative error against the float64 reference.
//!
//! The top-k collectives (`--coll hitopk`, `naiveag`, `treear`, `2dtar`) go the same way, keyed
//! per (scheme, type, size), with the same wire and error measures, and for hitopk the mean
//! time of each of its four steps over the timed out-of-place calls.
//!
//! nccl-tests' options that shape the loop: `-N` runs the whole table again, `-u` offsets the
//! buffers, `-I` times each iteration, `-C` keeps each rank's own time beside the combined one,
//! `-S` stamps each line, `-c N` checks up to N calls per size and mode.

use crate::args::{Args, TimeStat};
use crate::coll::{self, Coll, Ctx, Ran, Shape};
use crate::device::Gpu;
use crate::elem::{Elem, Filler};
use crate::report::{self, CodecCols, IterStats, Measure, Row, StepTimes};
use half::{bf16, f16};
use qccl::{Algo, Comm, Compression, DType, ReduceOp, Result, TopK, TopKScheme, Wire};
use std::io::Write;
use std::time::{Duration, Instant};

/// Where finished rows go: printed as they come on rank 0, kept for the footer and JSON.
pub struct Sink {
    /// Print the table (rank 0).
    pub print: bool,
    /// Every row so far.
    pub rows: Vec<Row>,
    /// Largest send + receive buffers of one table section, bytes (`-M`).
    pub buffer_bytes: u64,
    /// Rows measured over the emulated RDMA fabric: printed with an `emulated` mark after
    /// every column, since they measure the emulation, not a NIC.
    pub emulated: bool,
}

impl Sink {
    fn push(&mut self, r: Row) {
        if self.print {
            let mut out = std::io::stdout().lock();
            let mark = if self.emulated { "  emulated" } else { "" };
            let _ = writeln!(out, "{}{mark}", report::row(&r));
            let _ = out.flush();
        }
        self.rows.push(r);
    }
}

/// How long the run's first collectives are repeated before anything is timed (see `settle`).
pub const SETTLE: Duration = Duration::from_millis(50);

/// Small all-reduces for about [`SETTLE`] before the first timed size. On this kind of VM the
/// first milliseconds of collectives after start-up run several times slower (2 ranks, 4 KiB:
/// 5.1 µs with 5 warm-up calls, 1.6 µs after 10 000; 4 ranks 26.5 against 8.6), which a
/// count-based warm-up at small sizes does not cover and which says nothing about steady
/// state. Every rank runs the same number of calls (sized on the slowest rank).
fn settle(comm: &Comm) -> Result<()> {
    let mut buf = vec![0f32; 1024];
    let t = Instant::now();
    for _ in 0..10 {
        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
    }
    let mut one = [t.elapsed().as_secs_f64() / 10.0];
    comm.all_reduce_in_place(&mut one, ReduceOp::Max)?;
    let calls = (SETTLE.as_secs_f64() / one[0].max(1e-9)) as usize;
    for _ in 0..calls.clamp(10, 200_000) {
        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
    }
    Ok(())
}

/// Runs every (type, op) combination the arguments ask for, `-N` times (0: until the process
/// is stopped); returns the total wrong count.
pub fn run(comm: &Comm, a: &Args, sink: &mut Sink, mut gpu: Option<&mut Gpu>) -> Result<u64> {
    settle(comm)?;
    let mut wrong = 0;
    let mut cycle = 0;
    loop {
        for &dtype in &a.dtypes {
            for &op in &a.ops {
                // `-o all` with an integer type: avg only applies to floats.
                if op.check_dtype(dtype).is_err() {
                    continue;
                }
                wrong += match dtype {
                    DType::Int8 => sizes::<i8>(comm, a, op, cycle, sink, gpu.as_deref_mut())?,
                    DType::Uint8 => sizes::<u8>(comm, a, op, cycle, sink, gpu.as_deref_mut())?,
                    DType::Int32 => sizes::<i32>(comm, a, op, cycle, sink, gpu.as_deref_mut())?,
                    DType::Uint32 => sizes::<u32>(comm, a, op, cycle, sink, gpu.as_deref_mut())?,
                    DType::Int64 => sizes::<i64>(comm, a, op, cycle, sink, gpu.as_deref_mut())?,
                    DType::Uint64 => sizes::<u64>(comm, a, op, cycle, sink, gpu.as_deref_mut())?,
                    DType::Float16 => sizes::<f16>(comm, a, op, cycle, sink, gpu.as_deref_mut())?,
                    DType::Float32 => sizes::<f32>(comm, a, op, cycle, sink, gpu.as_deref_mut())?,
                    DType::Float64 => sizes::<f64>(comm, a, op, cycle, sink, gpu.as_deref_mut())?,
                    DType::Bfloat16 => sizes::<bf16>(comm, a, op, cycle, sink, gpu.as_deref_mut())?,
                    other => {
                        return Err(qccl::Error::Unsupported(format!(
                            "qccl-perf has no element type for {other}"
                        )))
                    }
                };
            }
        }
        cycle += 1;
        if a.run_cycles != 0 && cycle >= a.run_cycles {
            return Ok(wrong);
        }
    }
}

/// One table section: every size for element type `T` and `op`.
fn sizes<T: Elem>(
    comm: &Comm,
    a: &Args,
    op: ReduceOp,
    cycle: u64,
    sink: &mut Sink,
    mut gpu: Option<&mut Gpu>,
) -> Result<u64> {
    let n = comm.size();
    let es = std::mem::size_of::<T>();
    let shapes: Vec<Shape> = a
        .sizes()
        .iter()
        .map(|&b| a.coll.shape((b / es as u64) as usize, n))
        .collect();
    // Allocated once at the largest size, as nccl-tests does; with -u the buffers start that
    // many elements in (misaligned for the wider loads), as nccl-tests offsets its pointers.
    let zero = T::from_bits(0);
    let u = a.unalign;
    let mut send = vec![zero; u + shapes.iter().map(|s| s.send).max().unwrap_or(0)];
    let mut recv = vec![zero; u + shapes.iter().map(|s| s.recv).max().unwrap_or(0)];
    sink.buffer_bytes = sink
        .buffer_bytes
        .max(((send.len() + recv.len()) * es) as u64);
    let (send, recv) = (&mut send[u..], &mut recv[u..]);
    // --device cuda: device buffers of the same lengths and offset, the calls' own; the host
    // ones fill them and read their results back for the checks.
    if let Some(g) = gpu.as_deref_mut() {
        g.reserve(
            std::mem::size_of_val(&*send),
            std::mem::size_of_val(&*recv),
            u * es,
        )?;
    }
    // -R 1: registered once for the whole section, as nccl-tests registers its buffers.
    let mut handles = Vec::new();
    if a.register {
        for b in [&send[..], &recv[..]].into_iter().filter(|b| !b.is_empty()) {
            handles.push(comm.register(b)?);
        }
    }
    // The sparse top-k schemes are lossy like a codec; the dense baselines are exact sums and
    // keep all_reduce's integer-valued inputs, so that they can be checked exactly.
    let lossy = a.codec.is_some() || a.coll.sparse();
    let mut ctx = Ctx {
        comm,
        rank: comm.rank(),
        n,
        root: a.root,
        op,
        algo: a.algo,
        fill: Filler { op, n, lossy },
        compression: None,
        topk: None,
    };
    if lossy {
        // Codecs' speed can depend on the data (a sparsifier's selection, a quantizer's
        // scales): time them on the same kind of values they are checked on, not on zeros.
        ctx.fill.fill(send, ctx.rank, 0);
        ctx.fill.fill(recv, ctx.rank, 0);
    }
    let mut wrong = 0;
    for sh in shapes {
        let bytes = sh.bytes(es);
        ctx.compression = a.codec.as_ref().map(|z| {
            // One key per tensor shape: the residual of error feedback has the call's length,
            // so the type is part of the key (one size is a different count per type).
            let key = format!("qccl-perf-{}-{}-{bytes}", T::DTYPE.name(), op.name());
            Compression::new(z.clone()).key(key).algo(a.algo)
        });
        ctx.topk = a.coll.topk().map(|scheme| {
            // As -Z: one error-feedback residual per tensor shape (its length depends on the
            // type at a given size). The dense baselines ignore the key and the density.
            let key = format!(
                "qccl-perf-{}-{}-sum-{bytes}",
                scheme.name(),
                T::DTYPE.name()
            );
            TopK::new(a.density.unwrap_or(crate::args::DEFAULT_DENSITY)).key(key)
        });
        let mut bufs = Bufs {
            send: &mut send[..sh.send],
            recv: &mut recv[..sh.recv],
            gpu: gpu.as_deref_mut(),
            done: Vec::new(),
        };
        let oop = measure(&ctx, a, sh, false, &mut bufs)?;
        let ip = if a.coll.has_in_place() {
            Some(measure(&ctx, a, sh, true, &mut bufs)?)
        } else {
            None
        };
        let codec = oop.codec.map(|(wire, oop_err)| {
            let ip_err = ip.as_ref().and_then(|m| m.codec).map_or(0.0, |c| c.1);
            let cols = CodecCols::new(bytes, n, wire, worst(oop_err, ip_err));
            match oop.inter {
                Some(sent) => {
                    cols.over_hosts(bytes, n / comm.local_size(), comm.local_size(), sent)
                }
                None => cols,
            }
        });
        let (oop_k, oop_steps) = (oop.k, oop.steps);
        let (algo, oop, ip) = (oop.algo, oop.m, ip.map(|m| m.m));
        let timestamp = a
            .report_timestamps
            .then(|| report::utc_timestamp(std::time::SystemTime::now()));
        let row = Row {
            size: sh.bytes(es),
            count: sh.count,
            dtype: T::DTYPE,
            op: a.coll.has_op().then_some(op),
            root: if a.coll.rooted() { a.root as i64 } else { -1 },
            oop,
            ip,
            algo,
            codec,
            k: oop_k,
            steps: oop_steps,
            timestamp,
            cycle,
        };
        wrong += row.wrong().unwrap_or(0);
        sink.push(row);
    }
    for h in handles {
        comm.deregister(h)?;
    }
    Ok(wrong)
}

/// The larger relative error, NaN-proof (either being NaN gives NaN).
fn worst(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

/// One mode (out of place or in place) of one size.
struct Mode {
    /// Timing and #wrong.
    m: Measure,
    /// The all-reduce algorithm of the timed calls.
    algo: Option<Algo>,
    /// With a codec or a top-k collective: the last timed call's wire bytes (max over ranks)
    /// and the relative error of the call on fresh inputs.
    codec: Option<(Wire, f64)>,
    /// With a codec on the hierarchical path: the checked call's inter-host bytes sent (max
    /// over ranks).
    inter: Option<u64>,
    /// Top-k collectives: elements the last timed call selected (max over ranks).
    k: Option<u64>,
    /// `--coll hitopk`: its step times over the timed calls.
    steps: Option<StepTimes>,
}

/// The buffers of one size: host memory, and with `--device cuda` the device buffers the calls
/// run on, which the host ones fill before a run and receive the results of for the checks.
struct Bufs<'a, T> {
    send: &'a mut [T],
    recv: &'a mut [T],
    gpu: Option<&'a mut Gpu>,
    /// The host calls' reports since the last `finish` (device calls report through the GPU).
    done: Vec<Ran>,
}

impl<T: Elem> Bufs<'_, T> {
    /// Fills the inputs of a run (`coll::init`), and the device buffers with them.
    fn init(&mut self, ctx: &Ctx<'_>, coll: Coll, sh: Shape, in_place: bool) -> Result<()> {
        coll::init(ctx, coll, sh, in_place, self.send, self.recv);
        match self.gpu.as_deref_mut() {
            Some(g) => g.upload(self.send, self.recv),
            None => Ok(()),
        }
    }

    /// One call: run now on host memory; enqueued on the GPU's stream (it returns at once).
    fn run(&mut self, ctx: &Ctx<'_>, coll: Coll, sh: Shape, in_place: bool) -> Result<()> {
        match self.gpu.as_deref_mut() {
            Some(g) => g.enqueue::<T>(ctx, coll, in_place, sh),
            None => {
                let ran = coll::run(ctx, coll, in_place, self.send, self.recv)?;
                self.done.push(ran);
                Ok(())
            }
        }
    }

    /// Waits for the calls so far (nccl-tests' cudaStreamSynchronize) and returns their
    /// reports in call order.
    fn finish(&mut self, comm: &Comm) -> Result<Vec<Ran>> {
        match self.gpu.as_deref_mut() {
            Some(g) => g.sync(comm),
            None => Ok(std::mem::take(&mut self.done)),
        }
    }

    /// One call on fresh inputs, finished, its results in the host buffers for the checks;
    /// its report.
    fn checked(&mut self, ctx: &Ctx<'_>, coll: Coll, sh: Shape, in_place: bool) -> Result<Ran> {
        self.init(ctx, coll, sh, in_place)?;
        self.run(ctx, coll, sh, in_place)?;
        let ran = self.finish(ctx.comm)?.pop().unwrap_or_default();
        if let Some(g) = self.gpu.as_deref_mut() {
            g.download(self.send, self.recv)?;
        }
        Ok(ran)
    }
}

/// Warmup, barrier, `iters` timed calls; then, with `-c N` (or a codec), calls on fresh inputs,
/// checked: up to N for the plain collectives (stopping at the first with wrong elements, as
/// nccl-tests), one with a codec or a top-k collective (which also measures its error).
fn measure<T: Elem>(
    ctx: &Ctx<'_>,
    a: &Args,
    sh: Shape,
    in_place: bool,
    b: &mut Bufs<'_, T>,
) -> Result<Mode> {
    let coll = a.coll;
    // Time on real inputs, as nccl-tests does: after an earlier size's check the buffers hold
    // NaN poison, and codecs (MSTopK's exact fallback, qsgd's NaN buckets) run other paths on it.
    b.init(ctx, coll, sh, in_place)?;
    for _ in 0..a.warmup {
        b.run(ctx, coll, sh, in_place)?;
    }
    b.finish(ctx.comm)?;
    let iters = match a.target_secs {
        None => a.iters,
        Some(target) => {
            // Every rank must run the same count: size it on the slowest rank's call.
            let t = Instant::now();
            b.run(ctx, coll, sh, in_place)?;
            b.finish(ctx.comm)?;
            let mut one = [t.elapsed().as_secs_f64()];
            ctx.comm.all_reduce_in_place(&mut one, ReduceOp::Max)?;
            ((target / one[0].max(1e-9)) as usize).clamp(1, a.iters)
        }
    };
    ctx.comm.barrier()?;
    let t0 = Instant::now();
    let mut timed = Vec::with_capacity(iters);
    // -I: each iteration's own time (µs), taken only when asked for (on a GPU each call is
    // then waited for before the next).
    let mut each = Vec::with_capacity(if a.per_iter { iters } else { 0 });
    for _ in 0..iters {
        let t = a.per_iter.then(Instant::now);
        b.run(ctx, coll, sh, in_place)?;
        if let Some(t) = t {
            timed.append(&mut b.finish(ctx.comm)?);
            each.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    timed.append(&mut b.finish(ctx.comm)?);
    let mine = t0.elapsed().as_secs_f64() * 1e6 / iters as f64;
    let ran = timed.last().copied().unwrap_or_default();
    // HiTopK's step times summed over the timed calls (four steps, then the scatter-add).
    let mut step_sum = [0f64; 5];
    for (steps, add) in timed.iter().filter_map(|r| r.steps) {
        for (acc, d) in step_sum.iter_mut().zip(steps.iter().chain([&add])) {
            *acc += d.as_secs_f64();
        }
    }
    let time_us = combine_time(ctx.comm, a.time_stat, mine)?;
    let iter = if a.per_iter {
        // nccl-tests' i_* figures: each iteration on its slowest rank.
        ctx.comm.all_reduce_in_place(&mut each, ReduceOp::Max)?;
        Some(IterStats::new(each, a.per_iter_skip))
    } else {
        None
    };
    let steps = if coll.topk() == Some(TopKScheme::HiTopK) {
        let mut mean = step_sum.map(|t| t * 1e6 / iters as f64);
        ctx.comm.all_reduce_in_place(&mut mean, ReduceOp::Avg)?;
        Some(StepTimes {
            rs: mean[0],
            topk: mean[1],
            ag_add: mean[2],
            ag: mean[3],
            scatter_add: mean[4],
        })
    } else {
        None
    };
    let mut codec = None;
    let mut inter = None;
    let mut k = None;
    let wrong = if let (Some(z), Some(wire)) = (&ctx.compression, ran.wire) {
        // Fresh residual: the checked call measures one compressed all-reduce of these
        // inputs, not the inputs plus what error feedback carried over from the timed calls
        // (on other data), which no error bound covers.
        if let Some(key) = &z.key {
            ctx.comm.forget_residual(key)?;
        }
        b.checked(ctx, coll, sh, in_place)?;
        let acc = coll::accuracy(ctx, b.recv, z.codec.codec().error_bound());
        // Every rank holds the whole (bit-identical) result and should report the same;
        // the max makes the table hold even if not. Byte counts < 2^53 are exact in f64.
        let inter_sent = ran.inter.map_or(-1.0, |w| w.sent as f64);
        let mut v = [
            acc.rel_err,
            wire.sent as f64,
            wire.received as f64,
            inter_sent,
        ];
        ctx.comm.all_reduce_in_place(&mut v, ReduceOp::Max)?;
        let wire = Wire {
            sent: v[1] as u64,
            received: v[2] as u64,
        };
        codec = Some((wire, v[0]));
        inter = (v[3] >= 0.0).then_some(v[3] as u64);
        if a.check > 0 {
            let mut total = [0u64];
            ctx.comm
                .all_reduce(&[acc.wrong], &mut total, ReduceOp::Sum)?;
            Some(total[0])
        } else {
            None
        }
    } else if let (Some(o), Some(wire)) = (&ctx.topk, ran.wire) {
        // As with a codec: a fresh residual, fresh inputs, one call measured against float64.
        if let Some(key) = &o.key {
            ctx.comm.forget_residual(key)?;
        }
        b.checked(ctx, coll, sh, in_place)?;
        let acc = coll::accuracy(ctx, b.recv, None);
        // The dense baselines must be exact sums (integer-valued inputs), as all_reduce; the
        // sparse schemes only finite (accuracy() without a bound).
        let local_wrong = if coll.sparse() {
            acc.wrong
        } else {
            coll::check(ctx, coll, sh, in_place, b.send, b.recv)
        };
        let mut v = [
            acc.rel_err,
            wire.sent as f64,
            wire.received as f64,
            ran.k as f64,
        ];
        ctx.comm.all_reduce_in_place(&mut v, ReduceOp::Max)?;
        let wire = Wire {
            sent: v[1] as u64,
            received: v[2] as u64,
        };
        codec = Some((wire, v[0]));
        k = Some(v[3] as u64);
        if a.check > 0 {
            let mut total = [0u64];
            ctx.comm
                .all_reduce(&[local_wrong], &mut total, ReduceOp::Sum)?;
            Some(total[0])
        } else {
            None
        }
    } else if a.check > 0 {
        let mut total = [0u64];
        for _ in 0..a.check {
            b.checked(ctx, coll, sh, in_place)?;
            let local = coll::check(ctx, coll, sh, in_place, b.send, b.recv);
            ctx.comm.all_reduce(&[local], &mut total, ReduceOp::Sum)?;
            if total[0] > 0 {
                break;
            }
        }
        Some(total[0])
    } else {
        None
    };
    let bytes = sh.bytes(std::mem::size_of::<T>()) as f64;
    let algbw = if time_us > 0.0 {
        bytes / 1e3 / time_us
    } else {
        0.0
    };
    Ok(Mode {
        // busbw on the uncompressed size even with a codec: comparable with NCCL's numbers
        // (how fast the user's data got all-reduced); wire(B) and ratio say what moved.
        m: Measure {
            time_us,
            algbw,
            busbw: algbw * coll.busbw_factor(ctx.n),
            wrong,
            cpu_time_us: a.report_cputime.then_some(mine),
            iter,
        },
        algo: ran.algo,
        codec,
        inter,
        k,
        steps,
    })
}

/// Combines the ranks' mean times as `-a` says (every rank gets the result).
fn combine_time(comm: &Comm, stat: TimeStat, mine: f64) -> Result<f64> {
    let mut out = [0f64];
    match stat {
        TimeStat::Rank0 => {
            comm.broadcast(&[mine], &mut out, 0)?;
            return Ok(out[0]);
        }
        TimeStat::Avg => comm.all_reduce(&[mine], &mut out, ReduceOp::Avg)?,
        TimeStat::Min => comm.all_reduce(&[mine], &mut out, ReduceOp::Min)?,
        TimeStat::Max => comm.all_reduce(&[mine], &mut out, ReduceOp::Max)?,
    }
    Ok(out[0])
}
