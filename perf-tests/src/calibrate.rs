//! `--calibrate`: measures this machine's cost model for the planners (`qccl_planner`) and writes
//! it as [`CostModel`] JSON, for `qccl-plan` and anything else that reads one.
//!
//! - **Links.** Every rank times the in-place float-sum all-reduce at each size (`-b`..`-e`,
//!   the same list on every rank) with every `-A` schedule; a size's time is the median call
//!   of each rank, then the maximum over ranks (a collective is done when its slowest rank
//!   is). The points are grouped by the schedule the call resolved to (`auto` may pick
//!   different ones at different sizes) and fitted with `α + β·bytes`, each group becoming a
//!   link named `<transport>/<algorithm>`.
//! - **Tuning** (`--tuning-out`). From the same points, the fastest schedule at each size (the
//!   schedule a call resolved to, whichever `-A` asked), runs of equal winners merged, written
//!   as a tuning file for QCCL_TUNING_FILE: rows for this comm's links and world size, which
//!   the library puts ahead of its built-in table.
//! - **Codecs.** Rank 0 alone, on one core (the others wait in a barrier), times
//!   `Codec::encode` (with the error-feedback update around it when the spec has `ef`) and
//!   `Codec::decode_add` at the same sizes on synthetic gradients, fits each the same way, and
//!   records the wire ratio (encoded bytes / input bytes at the largest size, where the fixed
//!   header matters least).

use crate::args::Args;
use qccl::codec::{Rng, Site};
use qccl::internal::{Pick, Row, Tuning, Workload, TUNING_HEADER};
use qccl::{Algo, CodecSpec, Comm, ReduceOp, Result};
use qccl_planner::JsonFile;
use qccl_planner::{CodecCost, CostModel, Linear};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

/// Wall-clock budget for one codec operation at one size: past it the repetitions stop early
/// (after the first), so a slow codec at 64 MiB does not take `-n` times its long call.
const CODEC_BUDGET: Duration = Duration::from_millis(250);

/// One measured point: bytes moved (or encoded) and seconds per operation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Point {
    /// Input bytes of the operation.
    pub bytes: f64,
    /// Seconds per operation.
    pub secs: f64,
}

/// Fits `secs ≈ α + β·bytes` by least squares on **relative** residuals (weights 1/secs²),
/// then clamps to α, β ≥ 0 (refitting the other coefficient alone).
///
/// Relative, because the sizes span four orders of magnitude: an ordinary fit is decided by
/// the largest sizes, leaving α (the small sizes' cost, which is what fusion amortises) to
/// noise and often negative. The clamp keeps the model valid for the planners (a negative α
/// would make splitting a group look profitable). One point, or all at one size, gives a line
/// through the origin.
pub fn fit(points: &[Point]) -> Linear {
    let pts: Vec<Point> = points
        .iter()
        .filter(|p| p.bytes.is_finite() && p.secs.is_finite() && p.secs > 0.0)
        .copied()
        .collect();
    if pts.is_empty() {
        return Linear::ZERO;
    }
    let (mut s0, mut s1, mut s2, mut t0, mut t1) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for p in &pts {
        let w = 1.0 / (p.secs * p.secs);
        s0 += w;
        s1 += w * p.bytes;
        s2 += w * p.bytes * p.bytes;
        t0 += w * p.secs;
        t1 += w * p.bytes * p.secs;
    }
    // Through the origin (α = 0) and flat (β = 0): the clamped one-coefficient fits.
    let origin = || {
        if s2 > 0.0 {
            Linear::new(0.0, t1 / s2)
        } else {
            Linear::new(t0 / s0, 0.0)
        }
    };
    let det = s0 * s2 - s1 * s1;
    if det <= 1e-12 * s0 * s2 {
        return origin();
    }
    let beta = (s0 * t1 - s1 * t0) / det;
    let alpha = (t0 - beta * s1) / s0;
    if alpha < 0.0 {
        origin()
    } else if beta < 0.0 {
        Linear::new(t0 / s0, 0.0)
    } else {
        Linear::new(alpha, beta)
    }
}

/// Largest relative deviation of the fitted line from the points (how linear the cost is).
pub fn max_rel_err(l: &Linear, points: &[Point]) -> f64 {
    points
        .iter()
        .filter(|p| p.secs > 0.0)
        .map(|p| (l.time(p.bytes) - p.secs).abs() / p.secs)
        .fold(0.0, f64::max)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_unstable_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// The transport part of a link name. Ranks of one host reach each other over shared memory
/// only, so the comm's "tcp+shm" is named "shm" there; across hosts the name stays as is.
pub fn transport_key(comm: &Comm) -> String {
    match comm.transport_name() {
        "tcp+shm" if comm.num_nodes() == 1 => "shm".to_string(),
        other => other.to_string(),
    }
}

/// A fitted link or codec operation, with what it was fitted on.
struct Fitted {
    line: Linear,
    points: Vec<Point>,
}

impl Fitted {
    fn new(points: Vec<Point>) -> Self {
        Fitted {
            line: fit(&points),
            points,
        }
    }
}

/// One timed size of one schedule: bytes, the schedule the calls resolved to, seconds per
/// call (median, slowest rank).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// Bytes per call.
    pub bytes: usize,
    /// What ran.
    pub algo: Algo,
    /// Seconds per call.
    pub secs: f64,
}

/// What the link measurements give: the fitted links, the default one, and every timed size.
struct Measured {
    links: Vec<(String, Fitted)>,
    default_link: String,
    samples: Vec<Sample>,
}

/// The measured model and what the summary prints.
struct Calibration {
    /// Links by name, in first-measured order.
    links: Vec<(String, Fitted)>,
    /// The link the first `-A` schedule used at the largest size.
    default_link: String,
    /// Codecs: (canonical spec, compress, decompress, ratio).
    codecs: Vec<(String, Fitted, Fitted, f64)>,
}

/// The byte sizes to measure: `-b`..`-e` as f32 element counts (sizes below one element
/// dropped, duplicates removed). Every rank computes the same list from the same arguments.
fn sizes(a: &Args) -> Vec<usize> {
    let mut counts: Vec<usize> = a.sizes().iter().map(|&b| (b / 4) as usize).collect();
    counts.retain(|&c| c > 0);
    counts.dedup();
    counts
}

/// Times the all-reduce at every size with every `-A` schedule (all ranks).
fn measure_links(comm: &Comm, a: &Args, counts: &[usize]) -> Result<Measured> {
    let transport = transport_key(comm);
    let max = counts.iter().copied().max().unwrap_or(0);
    // Zeros stay zeros under a sum, so no number of in-place iterations overflows.
    let mut buf = vec![0f32; max];
    let mut points: Vec<(String, Vec<Point>)> = Vec::new();
    let mut default_link = None;
    let mut samples = Vec::new();
    for &algo in &a.algos {
        for &count in counts {
            let b = &mut buf[..count];
            // Warm up at least once: page faults and scratch growth are not the link's cost.
            let mut resolved = Algo::Auto;
            for _ in 0..a.warmup.max(1) {
                resolved = comm.all_reduce_with(None, b, ReduceOp::Sum, algo)?;
            }
            comm.barrier()?;
            let mut times = Vec::with_capacity(a.iters);
            for _ in 0..a.iters {
                let t = Instant::now();
                resolved = comm.all_reduce_with(None, b, ReduceOp::Sum, algo)?;
                times.push(t.elapsed().as_secs_f64());
            }
            // The median ignores the odd call that lost its core; the slowest rank decides
            // when the collective is done.
            let mut secs = [median(&mut times)];
            comm.all_reduce_in_place(&mut secs, ReduceOp::Max)?;
            samples.push(Sample {
                bytes: 4 * count,
                algo: resolved,
                secs: secs[0],
            });
            let key = format!("{transport}/{}", resolved.name());
            let point = Point {
                bytes: (4 * count) as f64,
                secs: secs[0],
            };
            match points.iter_mut().find(|(k, _)| *k == key) {
                Some((_, v)) => v.push(point),
                None => points.push((key.clone(), vec![point])),
            }
            if algo == a.algos[0] && count == max {
                default_link = Some(key);
            }
        }
    }
    let links = points
        .into_iter()
        .map(|(k, p)| (k, Fitted::new(p)))
        .collect();
    Ok(Measured {
        links,
        default_link: default_link.unwrap_or_default(),
        samples,
    })
}

/// The tuning rows of `samples`: at each size the fastest schedule (the first measured on a
/// tie), consecutive sizes with the same winner merged into one row that covers calls below
/// the next winner's first size; the last row covers every larger call. Rows name `links` and
/// exactly `ranks`, so the file leaves other comms to the built-in table.
pub fn tuning_rows(samples: &[Sample], links: qccl::internal::Links, ranks: usize) -> Vec<Row> {
    let mut sizes: Vec<usize> = samples.iter().map(|s| s.bytes).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let winners: Vec<(usize, Pick)> = sizes
        .iter()
        .filter_map(|&b| {
            samples
                .iter()
                .filter(|s| s.bytes == b)
                .filter_map(|s| Pick::of(s.algo).map(|p| (s.secs, p)))
                .reduce(|best, s| if s.0 < best.0 { s } else { best })
                .map(|(_, p)| (b, p))
        })
        .collect();
    let mut rows: Vec<Row> = Vec::new();
    for (i, &(_, pick)) in winners.iter().enumerate() {
        let next = winners[i + 1..].iter().find(|w| w.1 != pick);
        if rows.last().is_some_and(|r| r.pick == pick) {
            continue;
        }
        rows.push(Row {
            coll: Some(Workload::AllReduce),
            links: Some(links),
            min_ranks: ranks,
            max_ranks: ranks,
            max_bytes: next.map_or(usize::MAX, |w| w.0),
            pick,
        });
    }
    rows
}

/// Writes `rows` as a tuning file at `path` with `note` as its comment, and reads it back as
/// the library will (QCCL_TUNING_FILE), so a file this writes is one a comm accepts.
fn write_tuning(path: &std::path::Path, note: &str, rows: &[Row]) -> Result<()> {
    let mut text = format!(
        "{TUNING_HEADER}
# {note}
# collective links ranks max_bytes algorithm
"
    );
    for r in rows {
        let _ = writeln!(text, "{r}");
    }
    std::fs::write(path, text)
        .map_err(|e| qccl::Error::invalid(format!("--tuning-out {}: {e}", path.display())))?;
    Tuning::load(Some(path))?;
    Ok(())
}

/// Synthetic gradients: roughly normal (sum of four uniforms, centred), a few large values,
/// so quantisers see real scales and sparsifiers a real selection.
fn gradients(n: usize) -> Vec<f32> {
    let mut rng = Rng::from_u64(0x6361_6c69_6272_6174); // "calibrat"
    (0..n)
        .map(|_| {
            let s: f32 = (0..4).map(|_| rng.next_f32()).sum::<f32>() - 2.0;
            s * 1e-3
        })
        .collect()
}

/// Median seconds of `op` over up to `iters` repetitions after one warmup, stopping early once
/// [`CODEC_BUDGET`] is spent.
fn time_op(iters: usize, mut op: impl FnMut(u64) -> Result<()>) -> Result<f64> {
    op(0)?;
    let start = Instant::now();
    let mut times = Vec::with_capacity(iters);
    for rep in 0..iters {
        let t = Instant::now();
        op(rep as u64 + 1)?;
        times.push(t.elapsed().as_secs_f64());
        if start.elapsed() > CODEC_BUDGET {
            break;
        }
    }
    Ok(median(&mut times))
}

/// Times one codec's encode and decode_add at every size (rank 0, this thread only).
fn measure_codec(
    spec: &CodecSpec,
    counts: &[usize],
    input: &[f32],
    iters: usize,
) -> Result<(Fitted, Fitted, f64)> {
    let codec = spec.codec();
    let (mut comp, mut decomp) = (Vec::new(), Vec::new());
    let mut ratio = 1.0;
    for &count in counts {
        let x = &input[..count];
        let mut enc = vec![0u8; codec.max_encoded_len(count)];
        let mut len = 0;
        let site = |step| Site {
            seed: 0,
            step,
            chunk: 0,
            rank: 0,
        };
        let secs = if spec.error_feedback() {
            // What a call with error feedback does around the encode: add the residual to the
            // input, encode that, keep what the encode lost.
            let mut residual = vec![0f32; count];
            let mut scratch = Vec::new();
            time_op(iters, |step| {
                for (r, g) in residual.iter_mut().zip(x) {
                    *r += g;
                }
                len = codec.encode(&residual, &mut Rng::new(site(step)), &mut enc)?;
                codec.decode_sub(&enc[..len], &mut residual, &mut scratch)
            })?
        } else {
            time_op(iters, |step| {
                len = codec.encode(x, &mut Rng::new(site(step)), &mut enc)?;
                Ok(())
            })?
        };
        let bytes = (4 * count) as f64;
        comp.push(Point { bytes, secs });
        let mut out = vec![0f32; count];
        let secs = time_op(iters, |_| codec.decode_add(&enc[..len], &mut out))?;
        decomp.push(Point { bytes, secs });
        ratio = len as f64 / bytes;
    }
    Ok((Fitted::new(comp), Fitted::new(decomp), ratio))
}

/// Measures everything on rank 0's side of the barrier.
fn measure_codecs(a: &Args, counts: &[usize]) -> Result<Vec<(String, Fitted, Fitted, f64)>> {
    let input = gradients(counts.iter().copied().max().unwrap_or(0));
    let mut out: Vec<(String, Fitted, Fitted, f64)> = Vec::new();
    for spec in &a.codecs {
        let name = spec.to_string();
        // `-Z fp16 -Z fp16`: one entry.
        if out.iter().any(|(n, ..)| *n == name) {
            continue;
        }
        let (c, d, r) = measure_codec(spec, counts, &input, a.iters)?;
        out.push((name, c, d, r));
    }
    Ok(out)
}

impl Calibration {
    fn model(&self, note: String) -> CostModel {
        CostModel {
            note,
            default_link: self.default_link.clone(),
            links: self
                .links
                .iter()
                .map(|(k, f)| (k.clone(), f.line))
                .collect(),
            codecs: self
                .codecs
                .iter()
                .map(|(k, c, d, r)| {
                    (
                        k.clone(),
                        CodecCost {
                            compress: c.line,
                            decompress: d.line,
                            ratio: *r,
                        },
                    )
                })
                .collect::<BTreeMap<_, _>>(),
            measured: self
                .links
                .iter()
                .map(|(k, f)| {
                    (
                        k.clone(),
                        f.points.iter().map(|p| [p.bytes, p.secs]).collect(),
                    )
                })
                .collect(),
        }
    }

    /// The summary table.
    fn summary(&self) -> String {
        let us = |s: f64| s * 1e6;
        let nspb = |s: f64| s * 1e9;
        let mut s = String::new();
        let w = self
            .links
            .iter()
            .map(|(k, _)| k.len())
            .chain(self.codecs.iter().map(|(k, ..)| k.len()))
            .max()
            .unwrap_or(4)
            .max(6);
        let _ = writeln!(
            s,
            "# {:<w$} {:>10} {:>11} {:>8} {:>8} {:>6}",
            "link", "alpha(us)", "beta(ns/B)", "GB/s", "fit err", "sizes"
        );
        for (k, f) in &self.links {
            let gbps = if f.line.beta > 0.0 {
                format!("{:8.2}", 1e-9 / f.line.beta)
            } else {
                format!("{:>8}", "inf")
            };
            let mark = if *k == self.default_link {
                "  (default)"
            } else {
                ""
            };
            let _ = writeln!(
                s,
                "  {k:<w$} {:>10.2} {:>11.4} {gbps} {:>7.1}% {:>6}{mark}",
                us(f.line.alpha),
                nspb(f.line.beta),
                100.0 * max_rel_err(&f.line, &f.points),
                f.points.len()
            );
        }
        // The points behind each link, so a large fit error can be traced to its sizes.
        for (k, f) in &self.links {
            let pts: Vec<String> = f
                .points
                .iter()
                .map(|p| format!("{}:{:.1}", size_name(p.bytes), us(p.secs)))
                .collect();
            let _ = writeln!(s, "# {k} measured (size:us): {}", pts.join(" "));
        }
        if !self.codecs.is_empty() {
            let _ = writeln!(
                s,
                "# {:<w$} {:>10} {:>11} {:>10} {:>11} {:>8}",
                "codec", "enc a(us)", "enc b(ns/B)", "dec a(us)", "dec b(ns/B)", "ratio"
            );
            for (k, c, d, r) in &self.codecs {
                let _ = writeln!(
                    s,
                    "  {k:<w$} {:>10.2} {:>11.4} {:>10.2} {:>11.4} {r:>8.5}",
                    us(c.line.alpha),
                    nspb(c.line.beta),
                    us(d.line.alpha),
                    nspb(d.line.beta),
                );
            }
        }
        s
    }
}

/// `4096` → `4K`, `67108864` → `64M` (exact multiples only; else plain bytes).
fn size_name(bytes: f64) -> String {
    let b = bytes as u64;
    for (shift, suffix) in [(30, "G"), (20, "M"), (10, "K")] {
        if b >= 1 << shift && b.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", b >> shift);
        }
    }
    b.to_string()
}

/// `--calibrate` on one rank: all ranks time the links, rank 0 the codecs, prints the summary
/// and writes the JSON.
pub fn run(comm: &Comm, a: &Args, host: &str) -> Result<()> {
    let (rank, n) = (comm.rank(), comm.size());
    let counts = sizes(a);
    if counts.is_empty() {
        return Err(qccl::Error::invalid(format!(
            "--calibrate: no size of at least 4 bytes in -b {} .. -e {}",
            a.min_bytes, a.max_bytes
        )));
    }
    if rank == 0 {
        println!(
            "# qccl-perf --calibrate: {n} ranks on {} host(s), {} sizes {}..{} bytes, -A {}, {} \
             iterations (median call, max over ranks); codecs on rank 0, one core",
            comm.num_nodes(),
            counts.len(),
            4 * counts[0],
            4 * counts[counts.len() - 1],
            a.algos
                .iter()
                .map(|x| x.name())
                .collect::<Vec<_>>()
                .join(","),
            a.iters
        );
    }
    let Measured {
        links,
        default_link,
        samples,
    } = measure_links(comm, a, &counts)?;
    let codecs = if rank == 0 {
        measure_codecs(a, &counts)?
    } else {
        Vec::new()
    };
    // The other ranks wait here rather than exit, so a job ends when rank 0 is done.
    comm.barrier()?;
    if rank != 0 {
        return Ok(());
    }
    let cal = Calibration {
        links,
        default_link,
        codecs,
    };
    let note = format!(
        "qccl-perf --calibrate on {host}: {n} ranks on {} host(s), transport {}, sizes {}..{} \
         bytes ({} points), {} iterations; links: in-place float-sum all_reduce, median call, max \
         over ranks; codecs: encode (with the error-feedback update when ef) and decode_add on \
         one core of rank 0; alpha + beta*bytes fitted on relative residuals, clamped >= 0",
        comm.num_nodes(),
        comm.transport_name(),
        4 * counts[0],
        4 * counts[counts.len() - 1],
        counts.len(),
        a.iters
    );
    let model = cal.model(note);
    model.validate()?;
    print!("{}", cal.summary());
    model.write(&a.calibrate_out)?;
    println!(
        "# wrote {} (default link {})",
        a.calibrate_out.display(),
        model.default_link
    );
    if let Some(path) = &a.tuning_out {
        let rows = tuning_rows(&samples, comm.links(), n);
        let note =
            format!(
            "qccl-perf --calibrate on {host}: {n} ranks on {} host(s), links {}, fastest of -A {} \
             per size (median call, max over ranks, {} iterations)",
            comm.num_nodes(),
            comm.links().name(),
            a.algos.iter().map(|x| x.name()).collect::<Vec<_>>().join(","),
            a.iters
        );
        write_tuning(path, &note, &rows)?;
        for r in &rows {
            println!("# tuning: {r}");
        }
        println!("# wrote {} ({} rows)", path.display(), rows.len());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pts(f: impl Fn(f64) -> f64) -> Vec<Point> {
        [4096.0, 65536.0, 1048576.0, 16777216.0]
            .iter()
            .map(|&bytes| Point {
                bytes,
                secs: f(bytes),
            })
            .collect()
    }

    #[test]
    fn fit_recovers_a_line_and_clamps() {
        let l = fit(&pts(|b| 20e-6 + b * 0.5e-9));
        assert!((l.alpha - 20e-6).abs() < 1e-12, "{l:?}");
        assert!((l.beta - 0.5e-9).abs() < 1e-18, "{l:?}");
        assert!(max_rel_err(&l, &pts(|b| 20e-6 + b * 0.5e-9)) < 1e-9);
        // A line whose intercept is negative: α clamps to 0, β fits through the origin.
        let l = fit(&pts(|b| b * 1e-9 - 1e-6));
        assert_eq!(l.alpha, 0.0);
        assert!(l.beta > 0.0);
        // Time falling with size: β clamps to 0.
        let l = fit(&pts(|b| 1.0 / b));
        assert!(l.beta == 0.0 && l.alpha > 0.0, "{l:?}");
        // One point: through the origin.
        let l = fit(&[Point {
            bytes: 100.0,
            secs: 1.0,
        }]);
        assert_eq!(l, Linear::new(0.0, 0.01));
        assert_eq!(fit(&[]), Linear::ZERO);
    }

    #[test]
    fn tuning_rows_merge_runs_of_winners() {
        let s = |bytes, algo, secs| Sample { bytes, algo, secs };
        let samples = [
            // auto's points count for the schedule they resolved to.
            s(4096, Algo::Tree, 3.0),
            s(4096, Algo::Ring, 5.0),
            s(4096, Algo::Sra, 2.0),
            s(16384, Algo::Sra, 2.0),
            s(16384, Algo::Ring, 4.0),
            s(65536, Algo::Ring, 4.0),
            s(65536, Algo::Sra, 6.0),
            s(262144, Algo::Tree, 1.0),
            s(262144, Algo::Ring, 1.0),
        ];
        let rows = tuning_rows(&samples, qccl::internal::Links::Arena, 3);
        let text: Vec<String> = rows.iter().map(Row::to_string).collect();
        assert_eq!(
            text,
            [
                "allreduce arena 3 64K sra",
                "allreduce arena 3 256K ring",
                "allreduce arena 3 * tree",
            ]
        );
        assert!(tuning_rows(&[], qccl::internal::Links::Arena, 3).is_empty());
    }

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }

    #[test]
    fn default_codecs_parse() {
        for s in crate::args::DEFAULT_CODECS {
            CodecSpec::parse(s).unwrap();
        }
    }
}
