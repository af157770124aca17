//! The measurement loop: for each type, op and size, time the out-of-place and in-place runs,
//! then check one freshly filled run of each.

use crate::args::{Args, TimeStat};
use crate::coll::{self, Ctx, Shape};
use crate::elem::{Elem, Filler};
use crate::report::{self, Measure, Row};
use half::{bf16, f16};
use qccl::{Algo, Comm, DType, ReduceOp, Result};
use std::io::Write;
use std::time::Instant;

/// Where finished rows go: printed as they come on rank 0, kept for the footer and JSON.
pub struct Sink {
    /// Print the table (rank 0).
    pub print: bool,
    /// Every row so far.
    pub rows: Vec<Row>,
}

impl Sink {
    fn push(&mut self, r: Row) {
        if self.print {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{}", report::row(&r));
            let _ = out.flush();
        }
        self.rows.push(r);
    }
}

/// Runs every (type, op) combination the arguments ask for; returns the total wrong count.
pub fn run(comm: &Comm, a: &Args, sink: &mut Sink) -> Result<u64> {
    let mut wrong = 0;
    for &dtype in &a.dtypes {
        for &op in &a.ops {
            // `-o all` with an integer type: avg only applies to floats.
            if op.check_dtype(dtype).is_err() {
                continue;
            }
            wrong += match dtype {
                DType::Int8 => sizes::<i8>(comm, a, op, sink)?,
                DType::Uint8 => sizes::<u8>(comm, a, op, sink)?,
                DType::Int32 => sizes::<i32>(comm, a, op, sink)?,
                DType::Uint32 => sizes::<u32>(comm, a, op, sink)?,
                DType::Int64 => sizes::<i64>(comm, a, op, sink)?,
                DType::Uint64 => sizes::<u64>(comm, a, op, sink)?,
                DType::Float16 => sizes::<f16>(comm, a, op, sink)?,
                DType::Float32 => sizes::<f32>(comm, a, op, sink)?,
                DType::Float64 => sizes::<f64>(comm, a, op, sink)?,
                DType::Bfloat16 => sizes::<bf16>(comm, a, op, sink)?,
            };
        }
    }
    Ok(wrong)
}

/// One table section: every size for element type `T` and `op`.
fn sizes<T: Elem>(comm: &Comm, a: &Args, op: ReduceOp, sink: &mut Sink) -> Result<u64> {
    let n = comm.size();
    let es = std::mem::size_of::<T>();
    let shapes: Vec<Shape> = a
        .sizes()
        .iter()
        .map(|&b| a.coll.shape((b / es as u64) as usize, n))
        .collect();
    // Allocated once at the largest size, as nccl-tests does.
    let zero = T::from_bits(0);
    let mut send = vec![zero; shapes.iter().map(|s| s.send).max().unwrap_or(0)];
    let mut recv = vec![zero; shapes.iter().map(|s| s.recv).max().unwrap_or(0)];
    let ctx = Ctx {
        comm,
        rank: comm.rank(),
        n,
        root: a.root,
        op,
        algo: a.algo,
        fill: Filler { op, n },
    };
    let mut wrong = 0;
    for sh in shapes {
        let (s, r) = (&mut send[..sh.send], &mut recv[..sh.recv]);
        let (oop, algo) = measure(&ctx, a, sh, false, s, r)?;
        let ip = if a.coll.has_in_place() {
            Some(measure(&ctx, a, sh, true, s, r)?.0)
        } else {
            None
        };
        let row = Row {
            size: sh.bytes(es),
            count: sh.count,
            dtype: T::DTYPE,
            op: a.coll.has_op().then_some(op),
            root: if a.coll.rooted() { a.root as i64 } else { -1 },
            oop,
            ip,
            algo,
        };
        wrong += row.wrong().unwrap_or(0);
        sink.push(row);
    }
    Ok(wrong)
}

/// Warmup, barrier, `iters` timed calls; then, with `-c 1`, one checked call on fresh inputs.
fn measure<T: Elem>(
    ctx: &Ctx<'_>,
    a: &Args,
    sh: Shape,
    in_place: bool,
    send: &mut [T],
    recv: &mut [T],
) -> Result<(Measure, Option<Algo>)> {
    let coll = a.coll;
    for _ in 0..a.warmup {
        coll::run(ctx, coll, in_place, send, recv)?;
    }
    let iters = match a.target_secs {
        None => a.iters,
        Some(target) => {
            // Every rank must run the same count: size it on the slowest rank's call.
            let t = Instant::now();
            coll::run(ctx, coll, in_place, send, recv)?;
            let mut one = [t.elapsed().as_secs_f64()];
            ctx.comm.all_reduce_in_place(&mut one, ReduceOp::Max)?;
            ((target / one[0].max(1e-9)) as usize).clamp(1, a.iters)
        }
    };
    ctx.comm.barrier()?;
    let t0 = Instant::now();
    let mut algo = None;
    for _ in 0..iters {
        algo = coll::run(ctx, coll, in_place, send, recv)?;
    }
    let mine = t0.elapsed().as_secs_f64() * 1e6 / iters as f64;
    let time_us = combine_time(ctx.comm, a.time_stat, mine)?;
    let wrong = if a.check {
        coll::init(ctx, coll, sh, in_place, send, recv);
        coll::run(ctx, coll, in_place, send, recv)?;
        let local = coll::check(ctx, coll, sh, in_place, send, recv);
        let mut total = [0u64];
        ctx.comm.all_reduce(&[local], &mut total, ReduceOp::Sum)?;
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
    Ok((
        Measure {
            time_us,
            algbw,
            busbw: algbw * coll.busbw_factor(ctx.n),
            wrong,
        },
        algo,
    ))
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
