//! Output: nccl-tests' header, table and footer on stdout (rank 0), and the result files:
//! JSON (serde; the schema perf-tests/compare and peers/merge.py read), CSV (the JSON's result
//! objects, one line each) and the SVG plot (crate::plot).

use crate::args::Device;
use crate::args::{Args, Step};
use crate::cfmt::{fmt_e, fmt_g};
use crate::plot::Series;
use qccl::{Algo, DType, ReduceOp, TopKScheme, Wire};
use serde::{Deserialize, Deserializer, Serialize};
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;

/// One timed (and possibly checked) mode of one size.
#[derive(Debug, Clone)]
pub struct Measure {
    /// Mean time of one call, µs (combined over ranks per `-a`).
    pub time_us: f64,
    /// size / time, GB/s (1e9 bytes).
    pub algbw: f64,
    /// algbw × the collective's bus factor.
    pub busbw: f64,
    /// Wrong elements over all ranks; None with `-c 0`.
    pub wrong: Option<u64>,
    /// `-C 1`: this rank's own mean time per call, µs (rank 0's is the one shown).
    pub cpu_time_us: Option<f64>,
    /// `-I 1`: the per-iteration statistics.
    pub iter: Option<IterStats>,
}

/// `-I 1`: each timed iteration's time on its slowest rank, and statistics over them after
/// the `-K` first (nccl-tests' per-iteration report; its JSON names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IterStats {
    /// Leading iterations left out of the statistics (`-K`).
    pub skipped_iterations: usize,
    pub min_us: f64,
    pub max_us: f64,
    pub avg_us: f64,
    pub p50_us: f64,
    pub p95_us: f64,
    pub p99_us: f64,
    pub stdev_us: f64,
    /// Coefficient of variation, stdev / avg, %.
    pub cv_pct: f64,
    /// Every iteration, µs (the skipped ones included).
    pub times_us: Vec<f64>,
}

impl IterStats {
    /// Statistics of `times_us` after the first `skip` (nccl-tests' nearest-rank percentiles).
    pub fn new(times_us: Vec<f64>, skip: usize) -> IterStats {
        let skip = skip.min(times_us.len().saturating_sub(1));
        let mut sorted: Vec<f64> = times_us[skip..].to_vec();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len().max(1);
        let at = |i: usize| sorted.get(i).copied().unwrap_or(0.0);
        let pct = |p: usize| at((n * p).div_ceil(100).saturating_sub(1).min(n - 1));
        let avg = sorted.iter().sum::<f64>() / n as f64;
        let var = sorted.iter().map(|t| (t - avg) * (t - avg)).sum::<f64>() / n as f64;
        let stdev = var.sqrt();
        IterStats {
            skipped_iterations: skip,
            min_us: round9(at(0)),
            max_us: round9(at(n - 1)),
            avg_us: round9(avg),
            p50_us: round9(at(n / 2)),
            p95_us: round9(pct(95)),
            p99_us: round9(pct(99)),
            stdev_us: round9(stdev),
            cv_pct: round9(if avg > 0.0 { stdev / avg * 100.0 } else { 0.0 }),
            times_us: times_us.into_iter().map(round9).collect(),
        }
    }
}

/// One line of the table.
#[derive(Debug, Clone)]
pub struct Row {
    /// Bytes (nccl-tests' size column).
    pub size: u64,
    /// Elements passed to the collective (per rank for the partitioned ones).
    pub count: usize,
    /// Element type.
    pub dtype: DType,
    /// Reduction, None for collectives without one.
    pub op: Option<ReduceOp>,
    /// Root, or -1.
    pub root: i64,
    /// Out of place.
    pub oop: Measure,
    /// In place, None where qccl has no in-place form.
    pub ip: Option<Measure>,
    /// All-reduce algorithm the call resolved to.
    pub algo: Option<Algo>,
    /// With a codec (`-Z`) or a top-k collective: the compression columns.
    pub codec: Option<CodecCols>,
    /// Top-k collectives: elements one rank selected (max over ranks; 0 for the dense
    /// baselines).
    pub k: Option<u64>,
    /// `--coll hitopk`: its step times.
    pub steps: Option<StepTimes>,
    /// `-S 1`: when the line was measured (UTC).
    pub timestamp: Option<String>,
    /// Which `-N` cycle (0-based) measured it.
    pub cycle: u64,
}

/// HiTopKComm's steps in one line (the paper's Figure 8): each rank's mean per timed
/// out-of-place call, averaged over ranks, µs. Means rather than the time column's `-a`
/// statistic so that the four add up to (about) one typical rank's call; the slowest rank's
/// wait shows in whichever step it waits in either way.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTimes {
    /// 1. Intra-host reduce-scatter.
    pub rs: f64,
    /// 2. MSTopK on the owned slice (with the error-feedback residual).
    pub topk: f64,
    /// 3. Inter-host all-gather of the pairs and their scatter-add.
    pub ag_add: f64,
    /// 4. Intra-host all-gather.
    pub ag: f64,
    /// Of step 3, the scatter-add alone (JSON only).
    pub scatter_add: f64,
}

/// Names of the step columns, in order.
pub const STEP_COLUMNS: [&str; 4] = ["rs", "topk", "ag+add", "ag"];

/// The three columns a codec adds to a line.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CodecCols {
    /// Payload bytes one rank sent in one call (the last timed out-of-place call; max over
    /// ranks, which is every rank's count for the symmetric schedules).
    pub wire_sent: u64,
    /// Payload bytes one rank received in that call (max over ranks).
    pub wire_received: u64,
    /// Bytes an uncompressed bandwidth-optimal all-reduce sends per rank, size·2(n−1)/n, over
    /// `wire_sent`; under the hierarchy the same for the inter-host level alone (see
    /// [`CodecCols::over_hosts`]). None when nothing was sent (one rank, empty buffer).
    pub ratio: Option<f64>,
    /// Hierarchical calls: the inter-host level's bytes sent per rank (max over ranks).
    pub inter_sent: Option<u64>,
    /// ‖out − exact‖₂ / ‖exact‖₂ of one call on fresh inputs, the worse of the two modes.
    pub rel_err: f64,
}

impl CodecCols {
    /// The columns of a `size`-byte all-reduce on `n` ranks.
    pub fn new(size: u64, n: usize, wire: Wire, rel_err: f64) -> CodecCols {
        let dense = size as f64 * 2.0 * (n as f64 - 1.0) / n as f64;
        CodecCols {
            wire_sent: wire.sent,
            wire_received: wire.received,
            ratio: (wire.sent > 0 && dense > 0.0).then(|| dense / wire.sent as f64),
            inter_sent: None,
            rel_err,
        }
    }

    /// A hierarchical call on `hosts` × `local` ranks that sent `inter_sent` bytes per rank
    /// between hosts: the ratio compares those with the uncompressed inter-host all-reduce of
    /// each rank's 1/local part, size/local·2(hosts−1)/hosts. The intra-host levels move the
    /// same dense bytes either way, through shared memory, so counting them would say little
    /// about what crosses the network.
    pub fn over_hosts(mut self, size: u64, hosts: usize, local: usize, inter_sent: u64) -> Self {
        let dense = size as f64 / local as f64 * 2.0 * (hosts as f64 - 1.0) / hosts as f64;
        self.ratio = (inter_sent > 0 && dense > 0.0).then(|| dense / inter_sent as f64);
        self.inter_sent = Some(inter_sent);
        self
    }
}

/// How `#wrong` is counted for a top-k collective (the header and the JSON say it).
pub fn topk_wrong_rule(scheme: TopKScheme) -> &'static str {
    match scheme {
        TopKScheme::HiTopK | TopKScheme::NaiveAg => {
            "non-finite outputs only (a top-k sum has no error bound; relerr is its measure)"
        }
        TopKScheme::TreeAr | TopKScheme::TwoDTar => {
            "exact check as all_reduce (dense sum of integer-valued inputs)"
        }
        _ => "non-finite outputs only",
    }
}

/// How `#wrong` is counted with a codec (the header and the JSON say it).
pub const CODEC_WRONG_RULE: &str = "non-finite outputs, plus (codecs with an error bound e per \
    encode) elements with |out - exact| > (n+1)*e*max|exact| + the type's tolerance";

impl Row {
    /// Wrong elements of both modes; None when not checked.
    pub fn wrong(&self) -> Option<u64> {
        let ip = self.ip.as_ref().and_then(|m| m.wrong).unwrap_or(0);
        self.oop.wrong.map(|w| w + ip)
    }
}

/// nccl-tests' time formatting: fewer decimals as the time grows.
fn time_str(us: f64) -> String {
    if us >= 10000.0 {
        format!("{us:7.0}")
    } else if us >= 100.0 {
        format!("{us:7.1}")
    } else {
        format!("{us:7.2}")
    }
}

/// One rank as the header lists it.
pub struct RankInfo {
    pub pid: u32,
    pub host: String,
    /// The CPUs it may run on (`0-3,8`).
    pub cpus: String,
    /// Its comm's link kinds (`tcp+shm`, `tcp+ib-emulated`).
    pub links: String,
    /// The GPU whose memory holds its buffers (`--device cuda`); None: host memory.
    pub gpu: Option<GpuInfo>,
}

/// A rank's GPU, as nccl-tests names it.
pub struct GpuInfo {
    pub ordinal: usize,
    /// PCI bus id (`0000:3b:00.0`).
    pub bus_id: String,
    /// `NVIDIA H100 80GB HBM3`.
    pub name: String,
}

/// True when some rank's links run over the emulated RDMA fabric (QCCL_IB_EMULATE=1).
pub fn emulated(ranks: &[RankInfo]) -> bool {
    ranks.iter().any(|r| r.links.contains("ib-emulated"))
}

/// The header: nccl-tests' parameter line, qccl's run line, the ranks, the table head.
/// `arena`: every rank of the comm shares one host (its shared-memory arena serves SRA).
pub fn header(a: &Args, nranks: usize, ranks: &[RankInfo], arena: bool) -> String {
    let (step, kind) = match a.step {
        Step::Factor(f) => (f, "factor"),
        Step::Bytes(b) => (b, "bytes"),
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# nThread 1 nGpus 1 minBytes {} maxBytes {} step: {step}({kind}) warmup iters: {} iters: {} \
         agg iters: 1 validation: {} graph: 0 unalign: {}",
        a.min_bytes, a.max_bytes, a.warmup, a.iters, a.check, a.unalign
    );
    let schedule = match a.coll.topk() {
        Some(scheme) => format!("scheme {}", scheme.name()),
        None => format!("all_reduce algo {}", a.algo.name()),
    };
    let time = if a.report_cputime {
        format!(
            "cputime = rank 0's own mean time per call (-C 1; algbw, busbw on the {} over ranks \
             of each rank's mean)",
            a.time_stat.name()
        )
    } else {
        format!(
            "time = {} over ranks of each rank's mean",
            a.time_stat.name()
        )
    };
    let _ = writeln!(
        s,
        "# qccl-perf: {} on {nranks} ranks, {schedule}, {time}, warmup per size and mode after \
         50 ms of small all-reduces at start; {}{}",
        a.coll.name(),
        if ranks.iter().any(|i| i.gpu.is_some()) && a.stream_null {
            "calls on device buffers go on the NULL stream and return once done (-y 1)"
        } else if ranks.iter().any(|i| i.gpu.is_some()) {
            "calls on device buffers return once enqueued on a stream"
        } else {
            "collectives always block on the host"
        },
        if a.blocking > 0 {
            format!(" (-z {}: the only mode)", a.blocking)
        } else {
            String::new()
        }
    );
    if a.run_cycles != 1 {
        let cycles = match a.run_cycles {
            0 => "until stopped".to_string(),
            n => format!("{n} times"),
        };
        let _ = writeln!(s, "# run cycles: the table runs {cycles} (-N)");
    }
    if a.per_iter {
        let _ = write!(
            s,
            "# Per-Iteration Report: host timing; i_* uses max over ranks"
        );
        if a.per_iter_skip > 0 {
            let _ = write!(s, "; summary skips first {} iterations", a.per_iter_skip);
        }
        let _ = writeln!(s);
    }
    if !a.ignored.is_empty() {
        let _ = writeln!(
            s,
            "# accepted, no effect on host memory: {}",
            a.ignored.join(", ")
        );
    }
    if let Some(scheme) = a.coll.topk() {
        let what = match scheme {
            TopKScheme::HiTopK => format!(
                "HiTopKComm (intra reduce-scatter, MSTopK at density {}, inter all-gather + \
                 scatter-add, intra all-gather), error feedback on",
                density_str(a)
            ),
            TopKScheme::NaiveAg => format!(
                "all-gather of every rank's MSTopK at density {} + scatter-add, error feedback on",
                density_str(a)
            ),
            TopKScheme::TreeAr => "dense tree all-reduce (baseline; --density not used)".into(),
            TopKScheme::TwoDTar => {
                "dense 2-level all-reduce: intra reduce-scatter, inter all-reduce, intra \
                 all-gather (baseline; --density not used)"
                    .into()
            }
            other => other.name().to_string(),
        };
        let steps = if scheme == TopKScheme::HiTopK {
            "; rs/topk/ag+add/ag = the four steps' time, each rank's mean per timed out-of-place \
             call, MEAN over ranks (us)"
        } else {
            ""
        };
        let residuals = if a.coll.sparse() {
            " residuals keyed per type and size, cleared before the checked call;"
        } else {
            ""
        };
        let _ = writeln!(
            s,
            "# {}: {what}; sum, in place (out of place = copy + in place);{residuals} busbw on \
             the uncompressed size; wire(B) = payload bytes sent per rank per call, intra-host \
             included (max over ranks); ratio = size*2(n-1)/n / wire(B); relerr = \
             |out-exact|_2/|exact|_2 vs float64, fresh inputs, worse mode{steps}; #wrong: {}",
            scheme.name(),
            topk_wrong_rule(scheme)
        );
    }
    if let Some(z) = &a.codec {
        let bound = z.codec().error_bound().map_or("none".into(), fmt_e);
        let _ = writeln!(
            s,
            "# codec {z}: all_reduce compressed (error bound per encode {bound}); busbw on the \
             uncompressed size; wire(B) = payload bytes sent per rank per call (max over ranks); \
             ratio = size*2(n-1)/n / wire(B), or on a hierarchical run size/L*2(H-1)/H over the \
             inter-host bytes alone (H hosts of L ranks); relerr = |out-exact|_2/|exact|_2 vs float64, fresh \
             inputs, worse mode; #wrong: {CODEC_WRONG_RULE}"
        );
    }
    let _ = writeln!(s, "#");
    if ranks.iter().any(|i| i.gpu.is_some()) {
        let _ = writeln!(
            s,
            "# device buffers (--device cuda): send and receive buffers in GPU memory, staged \
             by qccl through page-locked host memory (a compressed flat SRA, all-gather scheme, \
             ring or tree on a float type, and naiveag: its codecs run on the GPU, only \
             encoded bytes cross PCIe); calls {}, which is synchronised after each timed loop \
             (with -I after each call)",
            if a.stream_null {
                "on the NULL stream (-y 1)"
            } else {
                "enqueued on qccl-perf's stream"
            }
        );
        if arena {
            let _ = writeln!(
                s,
                "# ranks sharing one host: a dense all_reduce (where SRA takes the shared-memory \
                 arena's rounds), reduce_scatter or all_gather on device buffers {}",
                if a.stream_null {
                    "goes through the arena's page-locked segments, the GPU copying into and \
                     out of them while earlier rounds reduce"
                } else {
                    "is staged in bands pipelined with the shared-memory arena's rounds"
                }
            );
        }
        if std::env::var("QCCL_CUDA_IPC").is_ok_and(|v| v.trim() == "1") {
            let _ = writeln!(
                s,
                "# QCCL_CUDA_IPC=1: dense all_reduce, reduce_scatter and all_gather on device buffers \
                 of ranks of one machine run on the GPU through the peers' memory over CUDA \
                 IPC (no host staging), returning once done"
            );
        }
    }
    let _ = writeln!(s, "# Using devices");
    for (r, i) in ranks.iter().enumerate() {
        let _ = match &i.gpu {
            // nccl-tests' own line.
            Some(g) => writeln!(
                s,
                "#  Rank {r:2} Group  0 Pid {:6} on {:>10} device {:2} [{}] {}",
                i.pid, i.host, g.ordinal, g.bus_id, g.name
            ),
            None => writeln!(
                s,
                "#  Rank {r:2} Group  0 Pid {:6} on {:>10} device {:2} [host] cpu memory, cpus \
                 {}, links {}",
                i.pid, i.host, 0, i.cpus, i.links
            ),
        };
    }
    if emulated(ranks) {
        let _ = writeln!(
            s,
            "# RDMA links over the emulated fabric (QCCL_IB_EMULATE=1): rows marked emulated \
             time the emulation over TCP, not a NIC; no speed claim"
        );
    }
    let _ = writeln!(s, "#");
    // The codec's columns go after nccl-tests' own (the timestamp included), so tools that
    // read those by position still find them.
    let z = a.codec.is_some() || a.coll.topk().is_some();
    let hitopk = a.coll.topk() == Some(TopKScheme::HiTopK);
    let extra = |cols: [&str; 3], steps: [&str; 4]| {
        let mut e = String::new();
        if z {
            e = format!("  {:>10}  {:>6}  {:>8}", cols[0], cols[1], cols[2]);
        }
        if hitopk {
            for c in steps {
                let _ = write!(e, "  {c:>7}");
            }
        }
        e
    };
    let time = if a.report_cputime { "cputime" } else { "time" };
    // One mode's column names (or units): nccl-tests' four, then -I's four.
    let mode = |cols: [&str; 4], iter: [&str; 4]| {
        let mut m = format!(
            "  {:>7}  {:>6}  {:>6} {:>6}",
            cols[0], cols[1], cols[2], cols[3]
        );
        if a.per_iter {
            for c in iter {
                let _ = write!(m, "  {c:>7}");
            }
        }
        m
    };
    let names = mode(
        [time, "algbw", "busbw", "#wrong"],
        ["i_min", "i_max", "i_p99", "i_cv%"],
    );
    let units = mode(
        ["(us)", "(GB/s)", "(GB/s)", ""],
        ["(us)", "(us)", "(us)", "(%)"],
    );
    let (ts_name, ts_unit) = if a.report_timestamps {
        (
            format!("  {:<19}", "timestamp"),
            format!("  {:<19}", "(UTC)"),
        )
    } else {
        (String::new(), String::new())
    };
    let width = names.len();
    let _ = writeln!(
        s,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}{:^width$}{:^width$}{}{}{}",
        "",
        "",
        "",
        "",
        "",
        "out-of-place",
        "in-place",
        " ".repeat(ts_name.len()),
        if z { "       compression" } else { "" },
        if hitopk {
            "          HiTopK steps, mean over ranks"
        } else {
            ""
        }
    );
    let _ = writeln!(
        s,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}{names}{names}{ts_name}{}",
        "size",
        "count",
        "type",
        "redop",
        "root",
        extra(["wire(B)", "ratio", "relerr"], STEP_COLUMNS)
    );
    let line = format!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}{units}{units}{ts_unit}{}",
        "(B)",
        "(elements)",
        "",
        "",
        "",
        extra(["", "", ""], ["(us)"; 4])
    );
    let _ = writeln!(s, "{}", line.trim_end());
    s
}

/// `-M 1`: nccl-tests' memory line, for host memory: the benchmark's buffers (send and
/// receive at the largest size) and the peak resident set, each the max over ranks.
pub fn memory_line(buffer_bytes: u64, peak_rss_bytes: u64) -> String {
    format!(
        "# {:<20} : User-Allocated {} | Peak RSS {} (max over ranks)\n",
        "Host memory usage",
        mem_str(buffer_bytes),
        mem_str(peak_rss_bytes)
    )
}

/// nccl-tests' memory amounts: B, KB, MB or GB (powers of 1024), two decimals.
fn mem_str(b: u64) -> String {
    let x = b as f64;
    for (unit, m) in [("GB", 1u64 << 30), ("MB", 1 << 20), ("KB", 1 << 10)] {
        if b >= m {
            return format!("{:.2} {unit}", x / m as f64);
        }
    }
    format!("{b} B")
}

/// The time now as nccl-tests' timestamp column writes it (`%Y-%m-%d %H:%M:%S`), in UTC.
pub fn utc_timestamp(t: std::time::SystemTime) -> String {
    let secs = t
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// `--density` as given (or its default), for the header.
fn density_str(a: &Args) -> String {
    a.density.map_or("N/A".into(), fmt_g)
}

/// One mode's columns: nccl-tests' four, then with `-I 1` (`per_iter`) its four.
fn measure_str(m: Option<&Measure>, per_iter: bool) -> String {
    let mut s = match m {
        Some(m) => {
            let wrong = m.wrong.map_or("N/A".to_string(), |w| w.to_string());
            format!(
                "  {}  {:6.2}  {:6.2}  {wrong:>5}",
                time_str(m.cpu_time_us.unwrap_or(m.time_us)),
                m.algbw,
                m.busbw
            )
        }
        // No in-place form in qccl's API.
        None => format!("  {:>7}  {:>6}  {:>6}  {:>5}", "N/A", "N/A", "N/A", "N/A"),
    };
    if per_iter {
        match m.and_then(|m| m.iter.as_ref()) {
            Some(t) => {
                for us in [t.min_us, t.max_us, t.p99_us] {
                    let _ = write!(s, "  {}", time_str(us));
                }
                let _ = write!(s, "  {:>7.2}", t.cv_pct);
            }
            None => {
                for _ in 0..4 {
                    let _ = write!(s, "  {:>7}", "N/A");
                }
            }
        }
    }
    s
}

/// One table line, as all_reduce_perf prints it (then, with `-Z` or a top-k collective, the
/// compression columns).
pub fn row(r: &Row) -> String {
    let codec = r.codec.map_or(String::new(), |c| {
        format!(
            "  {:>10}  {:>6}  {:>8}",
            c.wire_sent,
            c.ratio.map_or("N/A".into(), |x| format!("{x:.1}")),
            fmt_e(c.rel_err)
        )
    });
    let steps = r.steps.map_or(String::new(), |t| {
        [t.rs, t.topk, t.ag_add, t.ag]
            .iter()
            .map(|&us| format!("  {}", time_str(us)))
            .collect()
    });
    let per_iter = r.oop.iter.is_some();
    let ts = r
        .timestamp
        .as_ref()
        .map_or(String::new(), |t| format!("  {t}"));
    format!(
        "{:12}  {:12}  {:>8}  {:>6}  {:6}{}{}{ts}{codec}{steps}",
        r.size,
        r.count,
        r.dtype.name(),
        r.op.map_or("none", |o| o.name()),
        r.root,
        measure_str(Some(&r.oop), per_iter),
        measure_str(r.ip.as_ref(), per_iter)
    )
}

/// Mean bus bandwidth over every measured mode of every line (nccl-tests counts in-place too).
pub fn avg_busbw(rows: &[Row]) -> f64 {
    let bws: Vec<f64> = rows
        .iter()
        .flat_map(|r| std::iter::once(r.oop.busbw).chain(r.ip.as_ref().map(|m| m.busbw)))
        .collect();
    if bws.is_empty() {
        0.0
    } else {
        bws.iter().sum::<f64>() / bws.len() as f64
    }
}

/// The footer.
pub fn footer(rows: &[Row], wrong: u64, name: &str) -> String {
    format!(
        "# Out of bounds values : {wrong} {}\n# Avg bus bandwidth    : {} \n#\n# Collective test concluded: {name}_perf\n",
        if wrong > 0 { "FAILED" } else { "OK" },
        fmt_g(avg_busbw(rows)),
    )
}

/// A number with 9 significant digits (no float noise like 125.24300000000001 in the files).
pub fn round9(x: f64) -> f64 {
    if x.is_finite() {
        format!("{x:.8e}").parse().unwrap_or(x)
    } else {
        x
    }
}

/// A finite number rounded to 9 digits, None otherwise (JSON null).
fn finite(x: f64) -> Option<f64> {
    x.is_finite().then(|| round9(x))
}

/// For `Option<Option<T>>` fields: present as null is `Some(None)`, absent `None` (with
/// `#[serde(default)]`).
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

fn host_device() -> String {
    "host".into()
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// The JSON document (`-J`): run parameters and `results`, one object per table line.
///
/// perf-tests/compare and peers/merge.py read `results[].size`, `busbw`, `time_us`, `algbw`
/// and the `inplace_` ones; the rest is for people and other tools. Fields a run has no use for
/// are left out (the codec's without `-Z`), or null where the run has the field but no value
/// (the in-place figures of a collective without an in-place form).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// `"qccl-perf"`.
    pub tool: String,
    /// qccl-perf's version.
    #[serde(default)]
    pub version: String,
    /// nccl-tests' name (`all_reduce`, ...).
    pub collective: String,
    /// The element type, or `all`.
    pub dtype: String,
    /// The reduction, `all`, or `none` for collectives without one.
    pub op: String,
    pub nranks: usize,
    /// The `-A` asked for (each result's `algo` says what it resolved to).
    pub algo: String,
    #[serde(flatten)]
    pub codec: Option<CodecInfo>,
    #[serde(flatten)]
    pub topk: Option<TopKInfo>,
    pub root: usize,
    pub iters: usize,
    pub warmup: usize,
    /// Whether results were checked (`-c` > 0).
    pub check: bool,
    /// `-a`: `rank0`, `avg`, `min` or `max`.
    pub time_stat: String,
    /// `-C 1`: the results have `cpu_time_us` (rank 0's own time; the table's time column).
    #[serde(default, skip_serializing_if = "is_false")]
    pub report_cputime: bool,
    /// Where rank 0's buffers were: `host` or `cuda` (`--device`).
    #[serde(default = "host_device")]
    pub device: String,
    /// Mean busbw over every line and mode (the footer's "Avg bus bandwidth").
    pub avg_busbw: f64,
    /// Wrong elements over every line and mode.
    pub wrong: u64,
    pub results: Vec<ResultRow>,
}

/// With `-Z`: the codec of the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CodecInfo {
    /// The canonical spec.
    pub codec: String,
    /// Relative error bound of one encode; null without one.
    pub codec_error_bound: Option<f64>,
    pub codec_wrong_rule: String,
}

/// With a top-k collective: its scheme.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopKInfo {
    pub scheme: String,
    /// null for the dense baselines, which do not use it.
    pub density: Option<f64>,
    pub error_feedback: bool,
    /// hitopk: how the step times combine over ranks (`"mean"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps_stat: Option<String>,
    pub topk_wrong_rule: String,
}

/// One table line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultRow {
    /// `-N` cycle (0-based); only with `-N` other than 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cycle: Option<u64>,
    pub size: u64,
    pub count: usize,
    #[serde(rename = "type")]
    pub dtype: String,
    pub redop: String,
    pub root: i64,
    /// The all-reduce algorithm `auto` resolved to; null for other collectives.
    pub algo: Option<String>,
    /// Out of place.
    pub time_us: f64,
    pub algbw: f64,
    pub busbw: f64,
    /// In place; null where qccl has no in-place form.
    pub inplace_time_us: Option<f64>,
    pub inplace_algbw: Option<f64>,
    pub inplace_busbw: Option<f64>,
    /// Both modes; null with `-c 0`.
    pub wrong: Option<u64>,
    /// `-C 1`: rank 0's own mean time per call, out of place and in place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_time_us: Option<f64>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub inplace_cpu_time_us: Option<Option<f64>>,
    /// `-I 1`: nccl-tests' per-iteration report of each mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub per_iter: Option<IterStats>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub inplace_per_iter: Option<Option<IterStats>>,
    /// `-S 1`: when the line was measured, UTC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<String>,
    #[serde(flatten)]
    pub codec: Option<CodecFields>,
    #[serde(flatten)]
    pub topk: Option<TopKFields>,
}

/// The compression fields of a line (`-Z`, top-k collectives).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CodecFields {
    pub wire_sent: u64,
    pub wire_received: u64,
    /// Hierarchical runs: the inter-host bytes sent per rank.
    pub inter_sent: Option<u64>,
    /// null when nothing was sent.
    pub ratio: Option<f64>,
    /// null when an output was not finite.
    pub rel_err: Option<f64>,
}

/// The top-k fields of a line: k, and hitopk's step times (null for the other schemes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopKFields {
    pub k: u64,
    pub rs_us: Option<f64>,
    pub topk_us: Option<f64>,
    pub ag_add_us: Option<f64>,
    pub ag_us: Option<f64>,
    pub scatter_add_us: Option<f64>,
}

/// The report of a run of `a` on `nranks` ranks.
pub fn report(a: &Args, nranks: usize, rows: &[Row], wrong: u64, device: Device) -> Report {
    let names = |v: Vec<&str>| {
        if v.len() == 1 {
            v[0].to_string()
        } else {
            "all".into()
        }
    };
    let op = if a.coll.has_op() {
        names(a.ops.iter().map(|o| o.name()).collect())
    } else {
        "none".into()
    };
    Report {
        tool: "qccl-perf".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        collective: a.coll.name().into(),
        dtype: names(a.dtypes.iter().map(|d| d.name()).collect()),
        op,
        nranks,
        algo: a.algo.name().into(),
        codec: a.codec.as_ref().map(|z| CodecInfo {
            codec: z.to_string(),
            codec_error_bound: z.codec().error_bound().and_then(finite),
            codec_wrong_rule: CODEC_WRONG_RULE.into(),
        }),
        topk: a.coll.topk().map(|scheme| TopKInfo {
            scheme: scheme.name().into(),
            // The dense baselines ignore --density: null rather than a density that had no
            // effect.
            density: a.density.filter(|_| a.coll.sparse()),
            error_feedback: a.coll.sparse(),
            steps_stat: (scheme == TopKScheme::HiTopK).then(|| "mean".into()),
            topk_wrong_rule: topk_wrong_rule(scheme).into(),
        }),
        root: a.root,
        iters: a.iters,
        warmup: a.warmup,
        check: a.check > 0,
        time_stat: a.time_stat.name().into(),
        report_cputime: a.report_cputime,
        device: match device {
            Device::Host => "host",
            Device::Cuda => "cuda",
        }
        .into(),
        avg_busbw: round9(avg_busbw(rows)),
        wrong,
        results: rows
            .iter()
            .map(|r| result_row(r, a.run_cycles != 1))
            .collect(),
    }
}

fn result_row(r: &Row, cycles: bool) -> ResultRow {
    let ip = r.ip.as_ref();
    let cputime = r.oop.cpu_time_us.is_some();
    let per_iter = r.oop.iter.is_some();
    ResultRow {
        cycle: cycles.then_some(r.cycle),
        size: r.size,
        count: r.count,
        dtype: r.dtype.name().into(),
        redop: r.op.map_or("none", |o| o.name()).into(),
        root: r.root,
        algo: r.algo.map(|a| a.name().into()),
        time_us: round9(r.oop.time_us),
        algbw: round9(r.oop.algbw),
        busbw: round9(r.oop.busbw),
        inplace_time_us: ip.map(|m| round9(m.time_us)),
        inplace_algbw: ip.map(|m| round9(m.algbw)),
        inplace_busbw: ip.map(|m| round9(m.busbw)),
        wrong: r.wrong(),
        cpu_time_us: r.oop.cpu_time_us.map(round9),
        inplace_cpu_time_us: cputime.then(|| ip.and_then(|m| m.cpu_time_us).map(round9)),
        per_iter: r.oop.iter.clone(),
        inplace_per_iter: per_iter.then(|| ip.and_then(|m| m.iter.clone())),
        timestamp: r.timestamp.clone(),
        codec: r.codec.map(|c| CodecFields {
            wire_sent: c.wire_sent,
            wire_received: c.wire_received,
            inter_sent: c.inter_sent,
            ratio: c.ratio.and_then(finite),
            rel_err: finite(c.rel_err),
        }),
        topk: r.k.map(|k| {
            let t = r.steps;
            TopKFields {
                k,
                rs_us: t.and_then(|t| finite(t.rs)),
                topk_us: t.and_then(|t| finite(t.topk)),
                ag_add_us: t.and_then(|t| finite(t.ag_add)),
                ag_us: t.and_then(|t| finite(t.ag)),
                scatter_add_us: t.and_then(|t| finite(t.scatter_add)),
            }
        }),
    }
}

/// The JSON text of a report.
pub fn json(rep: &Report) -> String {
    let mut s = serde_json::to_string_pretty(rep).expect("a report serializes");
    s.push('\n');
    s
}

/// A JSON value with every object's keys in document order (serde_json's own map sorts
/// them), lists dropped: what a CSV line is made of.
enum Node {
    Leaf(serde_json::Value),
    Obj(Vec<(String, Node)>),
    List,
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Node, D::Error> {
        use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Node;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("JSON")
            }
            fn visit_bool<E>(self, v: bool) -> Result<Node, E> {
                Ok(Node::Leaf(v.into()))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Node, E> {
                Ok(Node::Leaf(v.into()))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Node, E> {
                Ok(Node::Leaf(v.into()))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Node, E> {
                Ok(Node::Leaf(v.into()))
            }
            fn visit_str<E>(self, v: &str) -> Result<Node, E> {
                Ok(Node::Leaf(v.into()))
            }
            fn visit_unit<E>(self) -> Result<Node, E> {
                Ok(Node::Leaf(serde_json::Value::Null))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Node, A::Error> {
                while a.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Node::List)
            }
            fn visit_map<M: MapAccess<'de>>(self, mut m: M) -> Result<Node, M::Error> {
                let mut v = Vec::new();
                while let Some(kv) = m.next_entry()? {
                    v.push(kv);
                }
                Ok(Node::Obj(v))
            }
        }
        d.deserialize_any(V)
    }
}

/// One CSV cell: numbers as JSON writes them, strings quoted when they need it, null empty.
fn csv_cell(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Null => String::new(),
        serde_json::Value::String(s) if s.contains([',', '"', '\n']) => {
            format!("\"{}\"", s.replace('"', "\"\""))
        }
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The CSV text of a report: a header line, then one line per result with the run's
/// `collective` and `nranks` first and then the result object's fields in its order (a nested
/// object's fields as `<object>_<field>`, lists left out: `-I`'s per-iteration times are in
/// the JSON only).
pub fn csv(rep: &Report) -> String {
    let mut cols: Vec<String> = Vec::new();
    let mut lines: Vec<Vec<(String, serde_json::Value)>> = Vec::new();
    for r in &rep.results {
        let text = serde_json::to_string(r).expect("a result serializes");
        let Ok(Node::Obj(fields)) = serde_json::from_str(&text) else {
            unreachable!("a result is an object")
        };
        let mut flat = vec![
            ("collective".to_string(), rep.collective.clone().into()),
            ("nranks".to_string(), rep.nranks.into()),
        ];
        for (k, v) in fields {
            match v {
                Node::Leaf(v) => flat.push((k, v)),
                Node::Obj(inner) => flat.extend(inner.into_iter().filter_map(|(f, x)| match x {
                    Node::Leaf(x) => Some((format!("{k}_{f}"), x)),
                    _ => None,
                })),
                Node::List => {}
            }
        }
        for (k, _) in &flat {
            if !cols.contains(k) {
                cols.push(k.clone());
            }
        }
        lines.push(flat);
    }
    if cols.is_empty() {
        cols = [
            "collective",
            "nranks",
            "size",
            "count",
            "type",
            "redop",
            "root",
            "busbw",
        ]
        .map(String::from)
        .to_vec();
    }
    let mut s = cols.join(",");
    s.push('\n');
    for flat in lines {
        let cells: Vec<String> = cols
            .iter()
            .map(|c| {
                flat.iter()
                    .find(|(k, _)| k == c)
                    .map_or(String::new(), |(_, v)| csv_cell(v))
            })
            .collect();
        s.push_str(&cells.join(","));
        s.push('\n');
    }
    s
}

/// The plot's lines: busbw against size, one per mode, and per type, op and `-N` cycle when
/// the run has several of those.
pub fn plot_series(rows: &[Row]) -> Vec<Series> {
    let distinct = |f: &dyn Fn(&Row) -> String| {
        let mut v: Vec<String> = rows.iter().map(f).collect();
        v.sort();
        v.dedup();
        v.len() > 1
    };
    let by_type = distinct(&|r| r.dtype.name().to_string());
    let by_op = distinct(&|r| r.op.map_or("none", |o| o.name()).to_string());
    let by_cycle = distinct(&|r| r.cycle.to_string());
    let mut out: Vec<Series> = Vec::new();
    for r in rows {
        let mut what = String::new();
        if by_type {
            let _ = write!(what, " {}", r.dtype.name());
        }
        if by_op {
            let _ = write!(what, " {}", r.op.map_or("none", |o| o.name()));
        }
        if by_cycle {
            let _ = write!(what, " cycle {}", r.cycle);
        }
        let modes = [("out-of-place", Some(&r.oop)), ("in-place", r.ip.as_ref())];
        for (mode, m) in modes {
            let Some(m) = m else { continue };
            let label = format!("{mode}{what}");
            let point = (r.size as f64, m.busbw);
            match out.iter_mut().find(|s| s.label == label) {
                Some(s) => s.points.push(point),
                None => out.push(Series {
                    label,
                    points: vec![point],
                }),
            }
        }
    }
    out
}

/// Writes `text` to `path`, durably (a result file is the point of the run).
pub fn write_file(path: &Path, text: &str) -> std::io::Result<()> {
    let mut f = std::fs::File::create(path)?;
    f.write_all(text.as_bytes())?;
    f.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(fmt_g(3.962354), "3.96235");
        assert_eq!(fmt_g(12.5), "12.5");
        assert_eq!(fmt_g(0.0), "0");
        assert_eq!(time_str(23.256), "  23.26");
        assert_eq!(time_str(123.44), "  123.4");
        assert_eq!(time_str(12345.6), "  12346");
        let r = Row {
            size: 4096,
            count: 1024,
            dtype: DType::Float32,
            op: Some(ReduceOp::Sum),
            root: -1,
            oop: Measure {
                time_us: 23.256,
                algbw: 0.18,
                busbw: 0.18,
                wrong: Some(0),
                cpu_time_us: None,
                iter: None,
            },
            ip: None,
            algo: None,
            codec: None,
            k: None,
            steps: None,
            timestamp: None,
            cycle: 0,
        };
        let line = row(&r);
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f.len(), 13, "{line}");
        assert_eq!(&f[..6], ["4096", "1024", "float", "sum", "-1", "23.26"]);
        assert_eq!(f[12], "N/A");
        assert_eq!(fmt_e(0.031), "3.1e-02");
        assert_eq!(fmt_e(0.0), "0.0e+00");
        assert_eq!(fmt_e(1234.0), "1.2e+03");
        assert_eq!(fmt_e(f64::INFINITY), "inf");
        // fp16 halves a 4096-byte all-reduce on 4 ranks: 6144 dense bytes per rank.
        let wire = Wire {
            sent: 3072,
            received: 3072,
        };
        let c = CodecCols::new(4096, 4, wire, 2.5e-4);
        assert_eq!(c.ratio, Some(2.0));
        assert_eq!(CodecCols::new(4096, 1, Wire::default(), 0.0).ratio, None);
        // 2 hosts x 2 ranks, 4-bit between hosts: each rank's half, 2048 B, goes over the
        // network as an all-reduce among 2 (2048 dense bytes sent), compressed 8x.
        let h = CodecCols::new(4096, 4, wire, 0.0).over_hosts(4096, 2, 2, 256);
        assert_eq!((h.ratio, h.inter_sent), (Some(8.0), Some(256)));
        let r = Row {
            codec: Some(c),
            ..r
        };
        let line = row(&r);
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f.len(), 16, "{line}");
        assert_eq!(&f[13..], ["3072", "2.0", "2.5e-04"]);
        let r = Row {
            k: Some(10),
            steps: Some(StepTimes {
                rs: 1.5,
                topk: 20.0,
                ag_add: 123.44,
                ag: 0.0,
                scatter_add: 3.0,
            }),
            ..r
        };
        let line = row(&r);
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f.len(), 20, "{line}");
        assert_eq!(&f[16..], ["1.50", "20.00", "123.4", "0.00"]);
    }
}
