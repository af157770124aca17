//! Output: nccl-tests' header, table and footer on stdout (rank 0), and the JSON file.

use crate::args::{Args, Step};
use qccl::{Algo, DType, ReduceOp, TopKScheme, Wire};
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;

/// One timed (and possibly checked) mode of one size.
#[derive(Debug, Clone, Copy)]
pub struct Measure {
    /// Mean time of one call, µs (combined over ranks per `-a`).
    pub time_us: f64,
    /// size / time, GB/s (1e9 bytes).
    pub algbw: f64,
    /// algbw × the collective's bus factor.
    pub busbw: f64,
    /// Wrong elements over all ranks; None without `-c 1`.
    pub wrong: Option<u64>,
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
    /// `-C hitopk`: its step times.
    pub steps: Option<StepTimes>,
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
    }
}

/// How `#wrong` is counted with a codec (the header and the JSON say it).
pub const CODEC_WRONG_RULE: &str = "non-finite outputs, plus (codecs with an error bound e per \
    encode) elements with |out - exact| > (n+1)*e*max|exact| + the type's tolerance";

impl Row {
    /// Wrong elements of both modes; None when not checked.
    pub fn wrong(&self) -> Option<u64> {
        let ip = self.ip.and_then(|m| m.wrong).unwrap_or(0);
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

/// C's `%g`: 6 significant digits, trailing zeros removed.
pub fn fmt_g(x: f64) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let mag = x.abs().log10().floor() as i32;
    if !(-5..6).contains(&mag) {
        return format!("{x:.5e}");
    }
    let s = format!("{x:.*}", (5 - mag).max(0) as usize);
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// C's `%.1e` (`3.1e-02`: two-digit exponent, which Rust's `{:.1e}` does not pad).
pub fn fmt_e(x: f64) -> String {
    if !x.is_finite() {
        return format!("{x}");
    }
    let s = format!("{x:.1e}");
    match s.split_once('e') {
        Some((m, e)) => {
            let (sign, digits) = e.strip_prefix('-').map_or(("+", e), |d| ("-", d));
            format!("{m}e{sign}{digits:0>2}")
        }
        None => s,
    }
}

/// One rank as the header lists it.
pub struct RankInfo {
    pub pid: u32,
    pub host: String,
    /// The CPUs it may run on (`0-3,8`).
    pub cpus: String,
}

/// The header: nccl-tests' parameter line, qccl's run line, the ranks, the table head.
pub fn header(a: &Args, nranks: usize, ranks: &[RankInfo]) -> String {
    let (step, kind) = match a.step {
        Step::Factor(f) => (f, "factor"),
        Step::Bytes(b) => (b, "bytes"),
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# nThread 1 nGpus 1 minBytes {} maxBytes {} step: {step}({kind}) warmup iters: {} iters: {} \
         agg iters: 1 validation: {} graph: 0",
        a.min_bytes, a.max_bytes, a.warmup, a.iters, a.check as u8
    );
    let schedule = match a.coll.topk() {
        Some(scheme) => format!("scheme {}", scheme.name()),
        None => format!("all_reduce algo {}", a.algo.name()),
    };
    let _ = writeln!(
        s,
        "# qccl-perf: {} on {nranks} ranks, {schedule}, time = {} over ranks of each rank's \
         mean, warmup per size and mode after 50 ms of small all-reduces at start; collectives \
         always block on the host{}",
        a.coll.name(),
        a.time_stat.name(),
        if a.blocking {
            " (-z 1 is the only mode)"
        } else {
            " (-z ignored)"
        }
    );
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
            TopKScheme::TreeAr => "dense tree all-reduce (baseline; -D not used)".into(),
            TopKScheme::TwoDTar => {
                "dense 2-level all-reduce: intra reduce-scatter, inter all-reduce, intra \
                 all-gather (baseline; -D not used)"
                    .into()
            }
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
    let _ = writeln!(s, "# Using devices");
    for (r, i) in ranks.iter().enumerate() {
        let _ = writeln!(
            s,
            "#  Rank {r:2} Group  0 Pid {:6} on {:>10} device {:2} [host] cpu memory, cpus {}",
            i.pid, i.host, 0, i.cpus
        );
    }
    let _ = writeln!(s, "#");
    // The codec's columns go after nccl-tests' own, so tools that read those by position
    // still find them.
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
    let _ = writeln!(
        s,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}           out-of-place                       in-place          {}{}",
        "", "", "", "", "",
        if z { "       compression" } else { "" },
        if hitopk { "          HiTopK steps, mean over ranks" } else { "" }
    );
    let _ = writeln!(
        s,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6} {:>6}  {:>7}  {:>6}  {:>6} {:>6}{}",
        "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw",
        "#wrong", extra(["wire(B)", "ratio", "relerr"], STEP_COLUMNS)
    );
    let _ = writeln!(
        s,
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>5}  {:>7}  {:>6}  {:>6}  {:>5}{}",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "",
        extra(["", "", ""], ["(us)"; 4]).trim_end()
    );
    s
}

/// `-D` as given (or its default), for the header.
fn density_str(a: &Args) -> String {
    a.density.map_or("N/A".into(), fmt_g)
}

fn measure_str(m: Option<&Measure>) -> String {
    match m {
        Some(m) => {
            let wrong = m.wrong.map_or("N/A".to_string(), |w| w.to_string());
            format!(
                "  {}  {:6.2}  {:6.2}  {wrong:>5}",
                time_str(m.time_us),
                m.algbw,
                m.busbw
            )
        }
        // No in-place form in qccl's API.
        None => format!("  {:>7}  {:>6}  {:>6}  {:>5}", "N/A", "N/A", "N/A", "N/A"),
    }
}

/// One table line, as all_reduce_perf prints it (plus the codec's columns with `-Z`).
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
    format!(
        "{:12}  {:12}  {:>8}  {:>6}  {:6}{}{}{codec}{steps}",
        r.size,
        r.count,
        r.dtype.name(),
        r.op.map_or("none", |o| o.name()),
        r.root,
        measure_str(Some(&r.oop)),
        measure_str(r.ip.as_ref())
    )
}

/// Mean bus bandwidth over every measured mode of every line (nccl-tests counts in-place too).
pub fn avg_busbw(rows: &[Row]) -> f64 {
    let bws: Vec<f64> = rows
        .iter()
        .flat_map(|r| std::iter::once(r.oop.busbw).chain(r.ip.map(|m| m.busbw)))
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

/// A JSON number with 9 significant digits (no float noise like 125.24300000000001).
fn num(x: f64) -> String {
    if x.is_finite() {
        let rounded: f64 = format!("{x:.8e}").parse().unwrap_or(x);
        format!("{rounded}")
    } else {
        "null".into()
    }
}

fn opt<T>(v: Option<T>, f: impl Fn(T) -> String) -> String {
    v.map_or("null".into(), f)
}

fn string(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// The JSON document: run parameters and `results`, one object per table line.
pub fn json(a: &Args, nranks: usize, rows: &[Row], wrong: u64) -> String {
    let names = |v: Vec<&str>| {
        if v.len() == 1 {
            v[0].to_string()
        } else {
            "all".into()
        }
    };
    let dtype = names(a.dtypes.iter().map(|d| d.name()).collect());
    let op = if a.coll.has_op() {
        names(a.ops.iter().map(|o| o.name()).collect())
    } else {
        "none".into()
    };
    let mut s = String::from("{\n");
    let _ = writeln!(s, "  \"tool\": \"qccl-perf\",");
    let _ = writeln!(s, "  \"collective\": {},", string(a.coll.name()));
    let _ = writeln!(s, "  \"dtype\": {},", string(&dtype));
    let _ = writeln!(s, "  \"op\": {},", string(&op));
    let _ = writeln!(s, "  \"nranks\": {nranks},");
    let _ = writeln!(s, "  \"algo\": {},", string(a.algo.name()));
    if let Some(z) = &a.codec {
        let _ = writeln!(s, "  \"codec\": {},", string(&z.to_string()));
        let bound = z.codec().error_bound();
        let _ = writeln!(s, "  \"codec_error_bound\": {},", opt(bound, num));
        let _ = writeln!(s, "  \"codec_wrong_rule\": {},", string(CODEC_WRONG_RULE));
    }
    if let Some(scheme) = a.coll.topk() {
        let sparse = a.coll.sparse();
        let _ = writeln!(s, "  \"scheme\": {},", string(scheme.name()));
        // The dense baselines ignore -D: null rather than a density that had no effect.
        let density = a.density.filter(|_| sparse);
        let _ = writeln!(s, "  \"density\": {},", opt(density, num));
        let _ = writeln!(s, "  \"error_feedback\": {sparse},");
        if scheme == TopKScheme::HiTopK {
            let _ = writeln!(s, "  \"steps_stat\": \"mean\",");
        }
        let rule = topk_wrong_rule(scheme);
        let _ = writeln!(s, "  \"topk_wrong_rule\": {},", string(rule));
    }
    let _ = writeln!(s, "  \"root\": {},", a.root);
    let _ = writeln!(s, "  \"iters\": {},", a.iters);
    let _ = writeln!(s, "  \"warmup\": {},", a.warmup);
    let _ = writeln!(s, "  \"check\": {},", a.check);
    let _ = writeln!(s, "  \"time_stat\": {},", string(a.time_stat.name()));
    let _ = writeln!(s, "  \"avg_busbw\": {},", num(avg_busbw(rows)));
    let _ = writeln!(s, "  \"wrong\": {wrong},");
    s.push_str("  \"results\": [");
    for (i, r) in rows.iter().enumerate() {
        let ip = r.ip.as_ref();
        let _ = write!(
            s,
            "{}\n    {{\"size\": {}, \"count\": {}, \"type\": {}, \"redop\": {}, \"root\": {}, \
             \"algo\": {}, \"time_us\": {}, \"algbw\": {}, \"busbw\": {}, \"inplace_time_us\": {}, \
             \"inplace_algbw\": {}, \"inplace_busbw\": {}, \"wrong\": {}}}",
            if i == 0 { "" } else { "," },
            r.size,
            r.count,
            string(r.dtype.name()),
            string(r.op.map_or("none", |o| o.name())),
            r.root,
            opt(r.algo, |a| string(a.name())),
            num(r.oop.time_us),
            num(r.oop.algbw),
            num(r.oop.busbw),
            opt(ip, |m| num(m.time_us)),
            opt(ip, |m| num(m.algbw)),
            opt(ip, |m| num(m.busbw)),
            opt(r.wrong(), |w| w.to_string()),
        );
        if let Some(c) = &r.codec {
            // Spliced in before the closing brace, after every field a reader without -Z
            // knows.
            s.pop();
            let _ = write!(
                s,
                ", \"wire_sent\": {}, \"wire_received\": {}, \"inter_sent\": {}, \"ratio\": {}, \
                 \"rel_err\": {}}}",
                c.wire_sent,
                c.wire_received,
                opt(c.inter_sent, |x| x.to_string()),
                opt(c.ratio, num),
                num(c.rel_err)
            );
        }
        if let Some(k) = r.k {
            // Top-k fields after the compression ones; step times null for the baselines,
            // which have no such steps.
            s.pop();
            let t = r.steps;
            let _ = write!(
                s,
                ", \"k\": {k}, \"rs_us\": {}, \"topk_us\": {}, \"ag_add_us\": {}, \
                 \"ag_us\": {}, \"scatter_add_us\": {}}}",
                opt(t, |t| num(t.rs)),
                opt(t, |t| num(t.topk)),
                opt(t, |t| num(t.ag_add)),
                opt(t, |t| num(t.ag)),
                opt(t, |t| num(t.scatter_add)),
            );
        }
    }
    s.push_str("\n  ]\n}\n");
    s
}

/// Writes the JSON document to `path`.
pub fn write_json(path: &Path, text: &str) -> std::io::Result<()> {
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
            },
            ip: None,
            algo: None,
            codec: None,
            k: None,
            steps: None,
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
