//! End-to-end demonstration of the planners: a synthetic data-parallel training loop over the
//! ResNet-50 profile, where forward and backward compute are timed waits, comparing four ways of
//! communicating the gradients, each measured and predicted by the simulator:
//!
//! 1. **dense, layer-wise**: one uncompressed all-reduce per tensor.
//! 2. **codec, layer-wise**: one compressed all-reduce per tensor (`--codec`, qsgd 4-bit).
//! 3. **codec, Cupcake**: the tensors fused by `optimal_fusion` under the cost model, each group
//!    compressed once ([`qccl::fused::BucketRunner`]).
//! 4. **DeAR**: uncompressed, decoupled: each fusion group's reduce-scatter starts during
//!    backward, its all-gather runs during the next forward and is waited for just before the
//!    group's first layer needs its parameters.
//!
//! ```text
//! cargo run --release -p qccl-planner --example train_sim -- -np 2          # 2 processes
//! cargo run --release -p qccl-planner --example train_sim -- -np 2 --quick  # small, fast
//! perf-tests/emucluster -H 2 -R 2 --rate 100mbit -- target/release/examples/train_sim
//! ```
//!
//! Without QCCL_RANK the program starts `-np` copies of itself on 127.0.0.1 ([`qccl::launch`],
//! as `qccl-perf -np` does); with it (emucluster, mpirun-style launchers) it is one rank.
//!
//! Options: `--iters N` (timed iterations, 5), `--warmup N` (1), `--codec SPEC`
//! (`qsgd:bits=4`), `--compute-scale F` (multiplies the profile's backprop times, 1),
//! `--fwd-ratio F` (forward time of a tensor = F · its backprop time, 0.5), `--compute spin|sleep`
//! (busy-wait, the default, or sleep: a GPU that leaves the CPU free), `--elems-scale F`
//! (shrinks every tensor, 1), `--tensors N` (only the first N tensors in backprop order),
//! `--cost FILE` (a cost model as `qccl-perf --calibrate` writes; default: calibrate here),
//! `--quick` (= `--iters 2 --warmup 1 --elems-scale 0.01 --compute-scale 0.1` and a quicker
//! calibration), `-np N`, `--timeout SECS` (launcher, 900); `--help` lists them, `--version`.
//!
//! # How the prediction is made
//!
//! The cost model has three dense links (`all_reduce`, `reduce_scatter`, `all_gather`, α + β ·
//! input bytes) and one for the compressed all-reduce (`all_reduce/<codec>`). In qccl the codec
//! runs *inside* the collective, on the comm's worker thread: encode, transfer and decode of a
//! group occupy the channel back to back and never delay backprop. So the compressed
//! all-reduce is modelled as one channel operation costing α_c + β_c · input bytes, written as
//! a link per wire byte (β_c / ratio) with a codec whose compression and decompression cost
//! nothing: the simulator then charges exactly α_c + β_c · bytes per group. The
//! self-calibration times every collective at a few sizes up to the whole model (the
//! compressed one end to end, which includes every encode and decode its schedule does, not
//! just one of each) and fits α + β; a `--cost` file's codec costs are folded into that link
//! (α + h_α + d_α, and ratio·β + h_β + d_β per input byte). Every rank takes the maximum of
//! every measurement over the ranks, so all ranks build the same model and the same plans.
//!
//! Predicted iteration = forward + `simulate(...)` for strategies 1–3. For DeAR the backward
//! half is `simulate` of the reduce-scatter plan on the `reduce_scatter` link, and the forward
//! half is simulated here: all-gathers queued in forward order on one channel from the start of
//! the iteration, each group's forward compute starting when its all-gather is done.

use qccl::fused::BucketRunner;
use qccl::launch::Launch;
use qccl::{Comm, ReduceOp, Request};
use qccl_planner::JsonFile;
use qccl_planner::{
    models, optimal_fusion, simulate, CodecCost, CompressOn, CostModel, Linear, Plan, Profile,
};
use std::error::Error;
use std::time::{Duration, Instant};

type Res<T> = std::result::Result<T, Box<dyn Error>>;

const AR: &str = "all_reduce";
const RS: &str = "reduce_scatter";
const AG: &str = "all_gather";

/// Command-line options.
#[derive(Clone, Debug)]
struct Opts {
    np: usize,
    iters: usize,
    warmup: usize,
    codec: String,
    compute_scale: f64,
    fwd_ratio: f64,
    spin: bool,
    elems_scale: f64,
    tensors: Option<usize>,
    cost: Option<String>,
    quick: bool,
    timeout: f64,
}

/// The command line as clap reads it; [`parse_args`] applies `--quick` and checks the values.
#[derive(clap::Parser, Debug)]
#[command(
    name = "train_sim",
    version,
    about = "A synthetic data-parallel training loop over the ResNet-50 profile: four ways of \
             communicating the gradients, measured and simulated (see examples/train_sim.rs)",
    args_override_self = true
)]
struct Cli {
    /// Local processes to start (also spelled -np N) [default: 2]
    #[arg(long, value_name = "N")]
    np: Option<usize>,
    /// Timed iterations [default: 5; --quick 2]
    #[arg(long, value_name = "N")]
    iters: Option<usize>,
    /// Untimed iterations first [default: 1]
    #[arg(long, value_name = "N")]
    warmup: Option<usize>,
    /// Gradient codec [default: qsgd:bits=4]
    #[arg(long, value_name = "SPEC")]
    codec: Option<String>,
    /// Multiplies the profile's backprop times [default: 1; --quick 0.1]
    #[arg(long = "compute-scale", value_name = "F")]
    compute_scale: Option<f64>,
    /// Forward time of a tensor = F x its backprop time [default: 0.5]
    #[arg(long = "fwd-ratio", value_name = "F")]
    fwd_ratio: Option<f64>,
    /// spin (busy-wait) or sleep (a GPU that leaves the CPU free) [default: spin]
    #[arg(long, value_name = "spin|sleep")]
    compute: Option<String>,
    /// Shrinks every tensor [default: 1; --quick 0.01]
    #[arg(long = "elems-scale", value_name = "F")]
    elems_scale: Option<f64>,
    /// Only the first N tensors in backprop order
    #[arg(long, value_name = "N")]
    tensors: Option<usize>,
    /// A cost model as qccl-perf --calibrate writes [default: calibrate here]
    #[arg(long, value_name = "FILE")]
    cost: Option<String>,
    /// Small and fast (CI): --iters 2 --warmup 1 --elems-scale 0.01 --compute-scale 0.1
    /// and a quicker calibration; explicit options still win
    #[arg(long)]
    quick: bool,
    /// Launcher timeout, seconds [default: 900]
    #[arg(long, value_name = "SECS")]
    timeout: Option<f64>,
}

fn parse_args(args: &[String]) -> Res<Opts> {
    use clap::Parser;
    // mpirun's `-np N` is two letters behind one dash, which clap does not take.
    let args = args.iter().map(|a| {
        if a == "-np" {
            "--np".to_string()
        } else {
            a.clone()
        }
    });
    let c = match Cli::try_parse_from(std::iter::once("train_sim".to_string()).chain(args)) {
        Ok(c) => c,
        Err(e) if !e.use_stderr() => {
            // --help, --version
            print!("{e}");
            std::process::exit(0)
        }
        Err(e) => {
            let text = e.render().to_string();
            return Err(text
                .strip_prefix("error: ")
                .unwrap_or(&text)
                .trim_end()
                .into());
        }
    };
    let quick = c.quick;
    let o = Opts {
        np: c.np.unwrap_or(2),
        iters: c.iters.unwrap_or(if quick { 2 } else { 5 }),
        warmup: c.warmup.unwrap_or(1),
        codec: c.codec.unwrap_or_else(|| "qsgd:bits=4".into()),
        compute_scale: c.compute_scale.unwrap_or(if quick { 0.1 } else { 1.0 }),
        fwd_ratio: c.fwd_ratio.unwrap_or(0.5),
        spin: match c.compute.as_deref() {
            None | Some("spin") => true,
            Some("sleep") => false,
            Some(v) => return Err(format!("--compute {v}: use spin or sleep").into()),
        },
        elems_scale: c.elems_scale.unwrap_or(if quick { 0.01 } else { 1.0 }),
        tensors: c.tensors,
        cost: c.cost,
        quick,
        timeout: c.timeout.unwrap_or(900.0),
    };
    if o.np == 0 || o.iters == 0 {
        return Err("-np and --iters must be at least 1".into());
    }
    if !(o.compute_scale >= 0.0 && o.fwd_ratio >= 0.0 && o.elems_scale > 0.0) {
        return Err("--compute-scale and --fwd-ratio must be >= 0, --elems-scale > 0".into());
    }
    Ok(o)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = parse_args(&args).and_then(|o| {
        if std::env::var_os("QCCL_RANK").is_some() {
            rank_main(&o)
        } else {
            launch(&o, &args)
        }
    });
    if let Err(e) = result {
        eprintln!("train_sim: {e}");
        std::process::exit(2);
    }
}

// ---- launcher ---------------------------------------------------------------------------------

/// Starts `o.np` ranks of this program on 127.0.0.1 ([`Launch`]) with the same arguments minus
/// `-np N`, and waits for them; one failing, or the timeout, kills the others.
fn launch(o: &Opts, args: &[String]) -> Res<()> {
    let mut child_args = Vec::new();
    let mut i = 0;
    while i < args.len() {
        if args[i] == "-np" || args[i] == "--np" {
            i += 2;
        } else if args[i].starts_with("--np=") {
            i += 1;
        } else {
            child_args.push(args[i].clone());
            i += 1;
        }
    }
    let timeout = Duration::try_from_secs_f64(o.timeout)
        .map_err(|e| format!("--timeout {}: {e}", o.timeout))?;
    Launch::new(o.np)
        .args(child_args)
        .timeout(timeout)
        .run()
        .map_err(|e| match e {
            qccl::Error::Timeout(_) => format!("{e} (--timeout)").into(),
            e => e.into(),
        })
        .map(drop)
}

// ---- compute -----------------------------------------------------------------------------------

/// Stands in for `secs` of compute: a busy-wait (the CPU is busy, as with CPU training or a
/// GPU driver that spins), or a sleep (a GPU computing while the CPU is free) that wakes a
/// little early and spins the rest, because a plain sleep overshoots by tens of microseconds
/// and there are hundreds of tensors per iteration.
fn compute(secs: f64, spin: bool) {
    if secs <= 0.0 {
        return;
    }
    let d = Duration::from_secs_f64(secs);
    let t0 = Instant::now();
    if !spin && d > Duration::from_micros(200) {
        std::thread::sleep(d - Duration::from_micros(150));
    }
    while t0.elapsed() < d {
        std::hint::spin_loop();
    }
}

// ---- cost model ----------------------------------------------------------------------------

/// Weighted least squares of `t ≈ α + β·x` minimising the *relative* residuals (a fit in
/// absolute terms would only care about the largest size), with α, β clamped to >= 0.
fn fit(points: &[(f64, f64)]) -> Linear {
    let (mut sw, mut swx, mut swxx, mut swt, mut swxt) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(x, t) in points {
        let w = 1.0 / (t * t).max(1e-18);
        sw += w;
        swx += w * x;
        swxx += w * x * x;
        swt += w * t;
        swxt += w * x * t;
    }
    let det = sw * swxx - swx * swx;
    let (a, b) = if det.abs() > 0.0 {
        (
            (swt * swxx - swx * swxt) / det,
            (sw * swxt - swx * swt) / det,
        )
    } else {
        (swt / sw, 0.0)
    };
    if a < 0.0 {
        Linear::new(0.0, (swxt / swxx).max(0.0))
    } else if b < 0.0 {
        Linear::new(swt / sw, 0.0)
    } else {
        Linear::new(a, b)
    }
}

/// Median seconds per call of `f`, from `reps` timed batches of `batch` calls back to back, each
/// on a buffer `prepare` returned (made before the clock starts: allocating and page-faulting
/// a fresh buffer of tens of MB is not the collective's cost, and the training loop reuses its
/// buffers), after one untimed call. Batches measure what the simulator charges a call in a
/// stream of them; a single small call after a barrier mostly measures the barrier's skew.
fn time_it<B>(
    comm: &Comm,
    reps: usize,
    batch: usize,
    mut prepare: impl FnMut() -> B,
    mut f: impl FnMut(B) -> Res<()>,
) -> Res<f64> {
    comm.barrier()?;
    f(prepare())?;
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let bufs: Vec<B> = (0..batch).map(|_| prepare()).collect();
        comm.barrier()?;
        let t0 = Instant::now();
        for b in bufs {
            f(b)?;
        }
        t.push(t0.elapsed().as_secs_f64() / batch as f64);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// Times the collectives at a few sizes on this comm and fits the cost model (see the module
/// docs). Collective: every rank must call it.
fn calibrate(comm: &Comm, codec: &str, sizes: &[usize], reps: usize) -> Res<CostModel> {
    let size = comm.size();
    let c = qccl::Compression::parse(codec)?.key("train_sim calibration");
    // Per size: dense all-reduce, reduce-scatter, all-gather, compressed all-reduce; then the
    // wire bytes of the largest dense and compressed all-reduce.
    let mut m = Vec::new();
    let mut wires = [0.0; 2];
    for &n in sizes {
        // A multiple of the rank count (for the reduce-scatter), of gradient-like values (a
        // constant would make every quantization bucket trivial).
        let n = n.div_ceil(size) * size;
        let batch = ((4 << 20) / (4 * n)).clamp(1, 32);
        let buf: Vec<f32> = (0..n).map(|i| (i % 211) as f32 * 1e-3 - 0.1).collect();
        m.push(time_it(
            comm,
            reps,
            batch,
            || buf.clone(),
            |mut b| {
                comm.all_reduce_in_place(&mut b, ReduceOp::Avg)?;
                Ok(())
            },
        )?);
        m.push(time_it(
            comm,
            reps,
            batch,
            || buf.clone(),
            |b| {
                comm.reduce_scatter_async(b, ReduceOp::Avg)?.wait()?;
                Ok(())
            },
        )?);
        m.push(time_it(
            comm,
            reps,
            batch,
            || buf[..n / size].to_vec(),
            |b| {
                comm.all_gather_async(b)?.wait()?;
                Ok(())
            },
        )?);
        m.push(time_it(
            comm,
            reps,
            batch,
            || buf.clone(),
            |mut b| {
                comm.all_reduce_compressed(&mut b, ReduceOp::Avg, &c)?;
                Ok(())
            },
        )?);
        let w0 = comm.wire()?;
        comm.all_reduce_in_place(&mut buf.clone(), ReduceOp::Avg)?;
        let w1 = comm.wire()?;
        comm.all_reduce_compressed(&mut buf.clone(), ReduceOp::Avg, &c)?;
        let w2 = comm.wire()?;
        wires = [(w1 - w0).sent as f64, (w2 - w1).sent as f64];
    }
    comm.forget_residual(&"train_sim calibration".into())?;
    m.extend(wires);
    // The slowest rank's numbers, identical everywhere, so every rank plans the same groups.
    comm.all_reduce_in_place(&mut m, ReduceOp::Max)?;
    let pts = |k: usize| -> Vec<(f64, f64)> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| ((4 * n.div_ceil(size) * size) as f64, m[4 * i + k]))
            .collect()
    };
    let (ar, rs, ag, comp) = (fit(&pts(0)), fit(&pts(1)), fit(&pts(2)), fit(&pts(3)));
    if comm.rank() == 0 {
        // How well the lines fit: what the simulator's error can be no better than.
        println!("calibration: bytes, then per link measured / fitted ms");
        for (i, &n) in sizes.iter().enumerate() {
            let x = (4 * n.div_ceil(size) * size) as f64;
            let cell =
                |k: usize, l: &Linear| format!("{:.2}/{:.2}", 1e3 * m[4 * i + k], 1e3 * l.time(x));
            println!(
                "  {x:>11} AR {:>17} RS {:>17} AG {:>17} coded AR {:>17}",
                cell(0, &ar),
                cell(1, &rs),
                cell(2, &ag),
                cell(3, &comp)
            );
        }
    }
    // Dense collectives may not count wire bytes (some paths do not); then use what a
    // bandwidth-optimal all-reduce sends, 2(n−1)/n of the buffer.
    let largest = (4 * sizes.last().map_or(1, |n| n.div_ceil(size) * size)) as f64;
    let dense_wire = match m[4 * sizes.len()] {
        w if w > 0.0 => w,
        _ => 2.0 * (size as f64 - 1.0) / size as f64 * largest,
    };
    let ratio = match m[4 * sizes.len() + 1] / dense_wire {
        r if r.is_finite() && r > 0.0 => r.min(1.0),
        _ => 1.0,
    };
    let mut cost = CostModel::with_link(AR, ar);
    cost.links.insert(RS.into(), rs);
    cost.links.insert(AG.into(), ag);
    // The compressed all-reduce's own link, per wire byte, so that a group of `bytes` input
    // bytes costs exactly the fitted α_c + β_c · bytes.
    cost.links.insert(
        compressed_link(codec),
        Linear::new(comp.alpha, comp.beta / ratio),
    );
    // The measured points refine the lines where the planners evaluate them (a line misses
    // the biggest fused groups by 10-15% here; see qccl_planner::curve).
    for (k, name) in [AR, RS, AG].into_iter().enumerate() {
        cost.measured
            .insert(name.into(), pts(k).iter().map(|&(x, t)| [x, t]).collect());
    }
    cost.measured.insert(
        compressed_link(codec),
        pts(3).iter().map(|&(x, t)| [ratio * x, t]).collect(),
    );
    cost.note = format!(
        "train_sim self-calibration: {size} ranks, sizes {sizes:?} f32 elements, median of \
         {reps}, max over ranks; lines refined by the measured points"
    );
    Ok(cost.codec_entry(
        codec,
        CodecCost {
            compress: Linear::ZERO,
            decompress: Linear::ZERO,
            ratio,
        },
    ))
}

/// The cost-model link of the compressed all-reduce with `codec` (module docs).
fn compressed_link(codec: &str) -> String {
    format!("{AR}/{codec}")
}

/// A `--cost` file in the form the demo needs: the codec folded onto the channel (module docs),
/// and reduce-scatter / all-gather links derived from the all-reduce link (same α, half the β:
/// each moves half of an all-reduce's bytes) when the file has none.
fn from_file(path: &str, codec: &str) -> Res<CostModel> {
    let file = CostModel::read(path)?;
    let ar = *file.link(None)?;
    let cc = *file.codec(codec)?;
    let mut cost = CostModel::with_link(AR, ar);
    for name in [RS, AG] {
        let l = file
            .links
            .iter()
            .find(|(k, _)| k.contains(name))
            .map_or(Linear::new(ar.alpha, ar.beta / 2.0), |(_, l)| *l);
        cost.links.insert(name.into(), l);
    }
    cost.note = format!("from {path} (codec folded onto the channel): {}", file.note);
    // Encode, transfer and decode back to back on the channel: per input byte
    // h + ratio·β + d, expressed per wire byte.
    cost.links.insert(
        compressed_link(codec),
        Linear::new(
            ar.alpha + cc.compress.alpha + cc.decompress.alpha,
            (cc.ratio * ar.beta + cc.compress.beta + cc.decompress.beta) / cc.ratio,
        ),
    );
    Ok(cost.codec_entry(
        codec,
        CodecCost {
            compress: Linear::ZERO,
            decompress: Linear::ZERO,
            ratio: cc.ratio,
        },
    ))
}

/// `cost` with `link` as its default (the simulator and the DP use the default link).
fn on_link(cost: &CostModel, link: &str) -> CostModel {
    let mut c = cost.clone();
    c.default_link = link.into();
    c
}

// ---- the training loop -------------------------------------------------------------------------

/// The profile this run trains: ResNet-50, optionally cut and shrunk, backprop times scaled.
fn build_profile(o: &Opts) -> Profile {
    let mut p = models::resnet50();
    if let Some(n) = o.tensors {
        p.tensors.truncate(n);
    }
    for t in &mut p.tensors {
        t.elems = ((t.elems as f64 * o.elems_scale).round() as usize).max(1);
        t.backprop *= o.compute_scale;
    }
    p
}

/// Initial gradients: distinct per rank and element, so the averages are not trivial.
fn initial_grads(p: &Profile, rank: usize) -> Vec<Vec<f32>> {
    p.tensors
        .iter()
        .enumerate()
        .map(|(t, tp)| {
            (0..tp.elems)
                .map(|i| ((rank * 131 + t * 17 + i) % 211) as f32 * 1e-3 - 0.1)
                .collect()
        })
        .collect()
}

/// Timed iterations of strategies 1–3: forward, then backward marking every gradient ready as
/// it is produced, then waiting for the averaged gradients. The gradients live in the plan's
/// buckets ([`BucketRunner`]: backprop would write them in place, so nothing is packed or
/// copied); each iteration's "gradients" are the previous averages, left where they are.
/// Returns seconds per iteration (warm-up excluded).
fn run_plan(comm: &Comm, o: &Opts, p: &Profile, plan: &Plan) -> Res<Vec<f64>> {
    let mut runner = BucketRunner::new(comm, &plan.fused(), &p.sizes())?;
    for (i, g) in initial_grads(p, comm.rank()).into_iter().enumerate() {
        runner.grad_mut(i)?.copy_from_slice(&g);
    }
    let mut times = Vec::new();
    comm.barrier()?;
    for it in 0..o.warmup + o.iters {
        let t0 = Instant::now();
        for t in p.tensors.iter().rev() {
            compute(o.fwd_ratio * t.backprop, o.spin);
        }
        for (i, t) in p.tensors.iter().enumerate() {
            compute(t.backprop, o.spin);
            runner.ready(i)?;
        }
        runner.wait()?;
        if it >= o.warmup {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(times)
}

/// Timed iterations of DeAR over the groups of `plan` (uncompressed): reduce-scatter of each
/// group as soon as backward completes it, wait for all of them (the optimiser step would run
/// on the shards here), then queue the all-gathers in forward order; the next iteration's
/// forward waits for each group's all-gather just before the group's first layer.
fn run_dear(comm: &Comm, o: &Opts, p: &Profile, plan: &Plan) -> Res<Vec<f64>> {
    let size = comm.size();
    let mut params = initial_grads(p, comm.rank());
    let mut ags: Vec<Option<Request<Vec<f32>>>> = (0..plan.groups.len()).map(|_| None).collect();
    let mut times = Vec::new();
    comm.barrier()?;
    for it in 0..o.warmup + o.iters {
        let t0 = Instant::now();
        // Forward: groups in forward order (the reverse of backprop order), layers within a
        // group too.
        for (gi, g) in plan.groups.iter().enumerate().rev() {
            if let Some(req) = ags[gi].take() {
                let full = req.wait()?;
                let mut at = 0;
                for param in &mut params[g.start..g.end] {
                    let n = param.len();
                    param.copy_from_slice(&full[at..at + n]);
                    at += n;
                }
            }
            for t in (g.start..g.end).rev() {
                compute(o.fwd_ratio * p.tensors[t].backprop, o.spin);
            }
        }
        // Backward: a group's reduce-scatter starts as soon as its last gradient is ready.
        let mut rss = Vec::with_capacity(plan.groups.len());
        for g in &plan.groups {
            let elems: usize = p.tensors[g.start..g.end].iter().map(|t| t.elems).sum();
            let mut buf = Vec::with_capacity(elems.div_ceil(size) * size);
            for (t, param) in p.tensors[g.start..g.end]
                .iter()
                .zip(&params[g.start..g.end])
            {
                compute(t.backprop, o.spin);
                buf.extend_from_slice(param);
            }
            buf.resize(elems.div_ceil(size) * size, 0.0);
            rss.push(comm.reduce_scatter_async(buf, ReduceOp::Avg)?);
        }
        let shards = rss
            .into_iter()
            .map(Request::wait)
            .collect::<qccl::Result<Vec<_>>>()?;
        if it >= o.warmup {
            times.push(t0.elapsed().as_secs_f64());
        }
        // Forward order, so the group the first layers need is gathered first.
        for (gi, shard) in shards.into_iter().enumerate().rev() {
            ags[gi] = Some(comm.all_gather_async(shard)?);
        }
    }
    for req in ags.into_iter().flatten() {
        req.wait()?;
    }
    Ok(times)
}

/// Predicted DeAR iteration (module docs): simulated forward with the all-gathers, plus the
/// simulated backward with the reduce-scatters.
fn simulate_dear(o: &Opts, p: &Profile, cost: &CostModel, plan: &Plan) -> Res<f64> {
    let ag = *cost.link(Some(AG))?;
    let (mut channel, mut compute) = (0.0f64, 0.0f64);
    for g in plan.groups.iter().rev() {
        let ts = &p.tensors[g.start..g.end];
        let bytes = ts.iter().map(|t| t.bytes()).sum::<usize>() as f64;
        channel += ag.time(bytes);
        compute = compute.max(channel) + o.fwd_ratio * ts.iter().map(|t| t.backprop).sum::<f64>();
    }
    Ok(compute + simulate(p, &on_link(cost, RS), plan)?.time)
}

fn rank_main(o: &Opts) -> Res<()> {
    let comm = Comm::from_env()?;
    let (rank, size) = (comm.rank(), comm.size());
    let p = build_profile(o);
    let say = |s: String| {
        if rank == 0 {
            println!("{s}");
        }
    };
    say(format!(
        "train_sim: {size} ranks, {} tensors, {:.1} MB of f32 gradients, backprop {:.1} ms, \
         forward {:.1} ms, compute by {}, codec {}, {} iterations (+{} warm-up)",
        p.len(),
        4.0 * p.total_elems() as f64 / 1e6,
        1e3 * p.total_backprop(),
        1e3 * o.fwd_ratio * p.total_backprop(),
        if o.spin { "busy-wait" } else { "sleep" },
        o.codec,
        o.iters,
        o.warmup
    ));

    let t_cal = Instant::now();
    let cost = match &o.cost {
        Some(path) => from_file(path, &o.codec)?,
        None => {
            let largest = p.tensors.iter().map(|t| t.elems).max().unwrap_or(1);
            let sizes: Vec<usize> = if o.quick {
                vec![256, 4096, 65536.min(largest.max(4096))]
            } else {
                // Up to the whole model: fused groups reach tens of MB, and a line fitted to
                // per-tensor sizes only underestimates them (caches, shared cores).
                let total = p.tensors.iter().map(|t| t.elems).sum::<usize>();
                let mut v = vec![1 << 10, 1 << 14, 1 << 18, largest.max(1 << 20)];
                let floor = v[3];
                v.extend(
                    [total / 4, total / 2, total]
                        .into_iter()
                        .filter(|&n| n > floor),
                );
                v
            };
            calibrate(&comm, &o.codec, &sizes, if o.quick { 2 } else { 3 })?
        }
    };
    cost.validate()?;
    say(format!(
        "cost model ({:.1} s): {}",
        t_cal.elapsed().as_secs_f64(),
        cost.note
    ));
    for (name, l) in &cost.links {
        say(format!(
            "  link {name:<15} alpha {:8.1} us  beta {:8.3} ns/B ({:.0} MB/s)",
            l.alpha * 1e6,
            l.beta * 1e9,
            1e-6 / l.beta.max(1e-18)
        ));
    }
    say(format!(
        "  codec {} ratio {:.4} (link {} is per wire byte)",
        o.codec,
        cost.codec(&o.codec)?.ratio,
        compressed_link(&o.codec)
    ));

    let n = p.len();
    let on = CompressOn::Separate;
    let clink = compressed_link(&o.codec);
    let cupcake = optimal_fusion(&p, &cost, Some(&clink), Some(&o.codec), on)?.plan;
    let dear = optimal_fusion(&p, &on_link(&cost, RS), None, None, on)?.plan;
    let strategies: Vec<(String, Plan)> = vec![
        (
            "no compression, layer-wise".into(),
            Plan::layer_wise(n, None),
        ),
        (
            format!("{}, layer-wise", o.codec),
            Plan::layer_wise(n, Some(&o.codec)).on(Some(&clink), on),
        ),
        (format!("{}, Cupcake fusion", o.codec), cupcake),
        ("DeAR (RS in bwd, AG in fwd)".into(), dear),
    ];

    for (name, plan) in &strategies[2..] {
        let mb: Vec<String> = plan
            .groups
            .iter()
            .map(|g| {
                let bytes: usize = p.tensors[g.start..g.end].iter().map(|t| t.bytes()).sum();
                format!("{:.1}", bytes as f64 / 1e6)
            })
            .collect();
        say(format!("  {name}: groups of {} MB", mb.join(", ")));
    }
    let fwd = o.fwd_ratio * p.total_backprop();
    let mut rows = Vec::new();
    for (i, (name, plan)) in strategies.iter().enumerate() {
        let (times, sim) = if i == 3 {
            (
                run_dear(&comm, o, &p, plan)?,
                simulate_dear(o, &p, &cost, plan)?,
            )
        } else {
            (
                run_plan(&comm, o, &p, plan)?,
                fwd + simulate(&p, &cost, plan)?.time,
            )
        };
        // The slowest rank's time per iteration (ranks finish an iteration at slightly
        // different moments; the job runs at the pace of the slowest).
        let mut times = times;
        comm.all_reduce_in_place(&mut times, ReduceOp::Max)?;
        let measured = times.iter().sum::<f64>() / times.len() as f64;
        rows.push((name.clone(), plan.groups.len(), measured, sim));
    }

    say(format!(
        "\n{:<34} {:>6} {:>12} {:>12} {:>8}",
        "strategy", "groups", "measured ms", "simulated ms", "error %"
    ));
    for (name, groups, measured, sim) in &rows {
        say(format!(
            "{name:<34} {groups:>6} {:>12.1} {:>12.1} {:>+8.1}",
            measured * 1e3,
            sim * 1e3,
            100.0 * (sim - measured) / measured
        ));
    }
    say(format!(
        "(ms per iteration: forward + backward + waiting for the gradients; the slowest rank, \
         mean of {} iterations)",
        o.iters
    ));
    Ok(())
}
