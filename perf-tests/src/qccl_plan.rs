//! qccl-plan: the Cupcake fusion planner from the command line.
//!
//! ```text
//! qccl-perf -np 2 --calibrate                                  # writes qccl-cost.json
//! qccl-plan --profile resnet50 --cost qccl-cost.json --codec fp16 --out plan.json
//! qccl-plan --profile my-model.json --cost qccl-cost.json      # best codec of the cost model
//! ```
//!
//! Reads a tensor profile (a file, or a shipped name: resnet50, resnet101, bert_base) and a cost
//! model (`qccl_planner::CostModel` JSON), finds the optimal fusion (`qccl_planner::optimal_fusion`)
//! with the codec and without compression, keeps the faster, prints its simulated iteration
//! time beside the usual baselines and writes it as `qccl_planner::Plan` JSON.
//!
//! Exit code: 0 done, 2 an error (arguments, unreadable or invalid files, unknown codec/link).

#![forbid(unsafe_code)]

use clap::Parser;
use qccl::CodecSpec;
use qccl_planner::JsonFile;
use qccl_planner::{models, optimal_fusion, simulate, CompressOn, CostModel, Plan, Profile};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The command line.
#[derive(Parser, Debug)]
#[command(
    name = "qccl-plan",
    bin_name = "qccl-plan",
    version,
    about = "Chooses how a training step's gradients are fused and compressed (Cupcake's \
             optimal fusion over qccl_planner's timeline simulator) and compares it with the \
             usual baselines",
    after_help = AFTER_HELP,
    args_override_self = true,
    next_line_help = true
)]
struct Cli {
    /// Tensor profile JSON (qccl_planner::Profile), or a shipped profile:
    /// resnet50 | resnet101 | bert_base
    #[arg(long, value_name = "FILE|NAME", verbatim_doc_comment)]
    profile: Option<String>,
    /// Cost model JSON (qccl_planner::CostModel), e.g. from qccl-perf --calibrate
    #[arg(long, value_name = "FILE")]
    cost: Option<PathBuf>,
    /// Plan for this codec (a key of the cost model's codecs; a spec such as
    /// qsgd:bits=4,bucket=128 matches its canonical form) [default: every
    /// codec of the cost model, the best chosen]
    #[arg(long, value_name = "SPEC", verbatim_doc_comment)]
    codec: Option<String>,
    /// Link of the cost model, e.g. shm/ring [default: its default_link]
    #[arg(long, value_name = "NAME")]
    link: Option<String>,
    /// compute (compression delays backprop, Cupcake's model) | separate
    /// (its own stream)
    #[arg(
        long = "compress-on",
        value_name = "WHERE",
        default_value = "compute",
        verbatim_doc_comment
    )]
    compress_on: String,
    /// Write the chosen plan as JSON (qccl_planner::Plan)
    #[arg(long, value_name = "FILE", default_value = "qccl-plan.json")]
    out: PathBuf,
}

const AFTER_HELP: &str = "\
The chosen plan is the faster of the optimal fusion with the codec and the optimal fusion
without compression, so it is never slower than any baseline: no compression (25 MiB
buckets, PyTorch DDP's default), layer-wise compression, 25 MiB buckets compressed, and one
compressed group. Times are simulated iteration times from the start of backprop.

Exit code: 0 done, 2 an error (arguments, unreadable or invalid files, unknown codec/link).";

/// Exit code for every error.
const EXIT_ERROR: i32 = 2;

/// PyTorch DDP's default bucket (`bucket_cap_mb=25`).
const BUCKET_BYTES: usize = 25 << 20;

/// The parsed command line.
#[derive(Debug)]
struct Args {
    profile: String,
    cost: PathBuf,
    codec: Option<String>,
    link: Option<String>,
    compress_on: CompressOn,
    out: PathBuf,
}

enum Parsed {
    Run(Args),
    /// `--help`, `--version`: print this and exit 0.
    Print(String),
}

fn parse(raw: &[String]) -> Result<Parsed, String> {
    let c = match Cli::try_parse_from(std::iter::once("qccl-plan".to_string()).chain(raw.to_vec()))
    {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            let text = e.render().to_string();
            return match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => Ok(Parsed::Print(text)),
                _ => Err(text
                    .strip_prefix("error: ")
                    .unwrap_or(&text)
                    .trim_end()
                    .to_string()),
            };
        }
    };
    let nonempty = |name: &str, v: Option<String>| match v {
        Some(v) if v.is_empty() => Err(format!("{name}: empty value")),
        v => Ok(v),
    };
    let compress_on = match c.compress_on.as_str() {
        "compute" => CompressOn::Compute,
        "separate" => CompressOn::Separate,
        v => return Err(format!("--compress-on '{v}': expected compute or separate")),
    };
    if c.out.as_os_str().is_empty() {
        return Err("--out: empty value".into());
    }
    Ok(Parsed::Run(Args {
        profile: nonempty("--profile", c.profile)?
            .ok_or("--profile is required (a file or resnet50, resnet101, bert_base)")?,
        cost: nonempty("--cost", c.cost.map(|p| p.to_string_lossy().into_owned()))?
            .map(PathBuf::from)
            .ok_or("--cost is required (e.g. qccl-cost.json from qccl-perf --calibrate)")?,
        codec: nonempty("--codec", c.codec)?,
        link: nonempty("--link", c.link)?,
        compress_on,
        out: c.out,
    }))
}

/// The profile: a file if one exists at that path, else a shipped model by name.
fn load_profile(arg: &str) -> Result<(String, Profile), String> {
    let path = Path::new(arg);
    if path.exists() {
        let p = Profile::read(path).map_err(|e| format!("--profile {arg}: {e}"))?;
        return Ok((arg.to_string(), p));
    }
    let shipped = models::shipped();
    match shipped.into_iter().find(|(stem, _)| *stem == arg) {
        Some((stem, p)) => Ok((stem.to_string(), p)),
        None => Err(format!(
            "--profile {arg}: no such file, and not a shipped profile (resnet50, resnet101, \
             bert_base)"
        )),
    }
}

/// The cost model's key for `--codec`: the spec as written if it is a key, else its canonical
/// form (`qsgd:bits=4,bucket=128` → `qsgd:bits=4,bucket=128,scale=maxmin,...`, the form
/// `qccl-perf --calibrate` writes).
fn codec_key(cost: &CostModel, spec: &str, cost_path: &Path) -> Result<String, String> {
    if cost.codecs.contains_key(spec) {
        return Ok(spec.to_string());
    }
    let canonical = CodecSpec::parse(spec)
        .map_err(|e| format!("--codec {spec}: {e}"))?
        .to_string();
    if cost.codecs.contains_key(&canonical) {
        return Ok(canonical);
    }
    let known: Vec<&str> = cost.codecs.keys().map(String::as_str).collect();
    Err(format!(
        "--codec {spec}: {} has no codec {canonical:?} (it has: {})",
        cost_path.display(),
        if known.is_empty() {
            "none".to_string()
        } else {
            known.join(", ")
        }
    ))
}

/// One line of the comparison.
struct Row {
    label: String,
    plan: Plan,
    time: f64,
}

fn simulated(
    label: impl Into<String>,
    plan: Plan,
    profile: &Profile,
    cost: &CostModel,
) -> Result<Row, String> {
    let time = simulate(profile, cost, &plan)
        .map_err(|e| e.to_string())?
        .time;
    Ok(Row {
        label: label.into(),
        plan,
        time,
    })
}

/// The optimal fusion for `codec` (None: uncompressed), timed by the simulator like the
/// baselines (the DP's own arithmetic agrees up to rounding; one clock for every row).
fn optimal(
    profile: &Profile,
    cost: &CostModel,
    link: &str,
    codec: Option<&str>,
    on: CompressOn,
) -> Result<Row, String> {
    let f = optimal_fusion(profile, cost, Some(link), codec, on).map_err(|e| e.to_string())?;
    let label = match codec {
        Some(c) => format!("cupcake optimal, {c}"),
        None => "cupcake optimal, no compression".to_string(),
    };
    simulated(label, f.plan, profile, cost)
}

/// `"min / median / max"` of a list.
fn spread(mut v: Vec<f64>, fmt: impl Fn(f64) -> String) -> String {
    if v.is_empty() {
        return "-".into();
    }
    v.sort_unstable_by(f64::total_cmp);
    format!(
        "{} / {} / {}",
        fmt(v[0]),
        fmt(v[v.len() / 2]),
        fmt(v[v.len() - 1])
    )
}

fn mib(bytes: f64) -> f64 {
    bytes / (1 << 20) as f64
}

fn run(a: &Args) -> Result<String, String> {
    let (pname, profile) = load_profile(&a.profile)?;
    let cost = CostModel::read(&a.cost).map_err(|e| format!("--cost {}: {e}", a.cost.display()))?;
    let link = match &a.link {
        Some(l) => {
            if !cost.links.contains_key(l) {
                let known: Vec<&str> = cost.links.keys().map(String::as_str).collect();
                return Err(format!(
                    "--link {l}: {} has no link {l:?} (it has: {})",
                    a.cost.display(),
                    known.join(", ")
                ));
            }
            l.clone()
        }
        None => cost.default_link.clone(),
    };
    let codecs: Vec<String> = match &a.codec {
        Some(spec) => vec![codec_key(&cost, spec, &a.cost)?],
        None => cost.codecs.keys().cloned().collect(),
    };
    let on = a.compress_on;

    let mut s = String::new();
    let total_bytes = 4.0 * profile.total_elems() as f64;
    let _ = writeln!(
        s,
        "# qccl-plan: {pname}: {} tensors, {} parameters ({:.1} MiB), backprop {:.3} ms",
        profile.len(),
        profile.total_elems(),
        mib(total_bytes),
        profile.total_backprop() * 1e3
    );
    let l = cost.link(Some(&link)).map_err(|e| e.to_string())?;
    let _ = writeln!(
        s,
        "# cost {}: link {link} (alpha {:.2} us, {:.2} GB/s), compression on the {} stream",
        a.cost.display(),
        l.alpha * 1e6,
        if l.beta > 0.0 {
            1e-9 / l.beta
        } else {
            f64::INFINITY
        },
        match on {
            CompressOn::Compute => "compute",
            CompressOn::Separate => "a separate",
        }
    );

    let uncompressed = optimal(&profile, &cost, &link, None, on)?;
    // Without --codec: every codec's optimum, and the fastest one gets the comparison.
    let mut best: Option<(String, Row)> = None;
    let cw = codecs.iter().map(String::len).max().unwrap_or(0);
    if codecs.len() > 1 {
        let _ = writeln!(s, "# optimal fusion per codec:");
    }
    for c in &codecs {
        let row = optimal(&profile, &cost, &link, Some(c), on)?;
        if codecs.len() > 1 {
            let _ = writeln!(
                s,
                "#   {c:<cw$} {:>4} groups {:>10.3} ms",
                row.plan.groups.len(),
                row.time * 1e3
            );
        }
        if best.as_ref().is_none_or(|(_, b)| row.time < b.time) {
            best = Some((c.clone(), row));
        }
    }

    let mut rows = Vec::new();
    let codec = best.as_ref().map(|(c, _)| c.clone());
    if let Some((_, row)) = best {
        rows.push(row);
    }
    rows.push(uncompressed);
    let n = profile.len();
    let bucketed =
        |codec: Option<&str>| Plan::buckets(&profile, BUCKET_BYTES, codec).on(Some(&link), on);
    rows.push(simulated(
        "no compression, 25 MiB buckets (DDP)",
        bucketed(None),
        &profile,
        &cost,
    )?);
    if let Some(c) = codec.as_deref() {
        rows.push(simulated(
            "layer-wise compressed",
            Plan::layer_wise(n, Some(c)).on(Some(&link), on),
            &profile,
            &cost,
        )?);
        rows.push(simulated(
            "25 MiB buckets compressed",
            bucketed(Some(c)),
            &profile,
            &cost,
        )?);
        rows.push(simulated(
            "single group compressed",
            Plan::single(n, Some(c)).on(Some(&link), on),
            &profile,
            &cost,
        )?);
    }
    // The two optima come first; the faster one is the plan.
    let chosen = if rows.len() > 1 && rows[1].time < rows[0].time {
        1
    } else {
        0
    };
    let t_opt = rows[chosen].time;
    let lw = rows.iter().map(|r| r.label.len()).max().unwrap_or(0);
    let _ = writeln!(
        s,
        "# {:<lw$} {:>6} {:>12} {:>9}",
        "plan", "groups", "time(ms)", "vs chosen"
    );
    for (i, r) in rows.iter().enumerate() {
        let _ = writeln!(
            s,
            "  {:<lw$} {:>6} {:>12.4} {:>8.3}x{}",
            r.label,
            r.plan.groups.len(),
            r.time * 1e3,
            if t_opt > 0.0 { r.time / t_opt } else { 1.0 },
            if i == chosen { "  <- chosen" } else { "" }
        );
    }

    let plan = &rows[chosen].plan;
    let group_bytes: Vec<f64> = plan
        .groups
        .iter()
        .map(|g| {
            profile.tensors[g.start..g.end]
                .iter()
                .map(|t| t.bytes() as f64)
                .sum()
        })
        .collect();
    let group_tensors: Vec<f64> = plan
        .groups
        .iter()
        .map(|g| (g.end - g.start) as f64)
        .collect();
    let _ = writeln!(
        s,
        "# chosen: {} groups, codec {}; tensors per group min / median / max {}; MiB per group {}",
        plan.groups.len(),
        plan.groups
            .first()
            .and_then(|g| g.codec.as_deref())
            .unwrap_or("none"),
        spread(group_tensors, |x| format!("{x:.0}")),
        spread(group_bytes.clone(), |x| format!("{:.2}", mib(x)))
    );
    if plan.groups.len() <= 32 {
        let sizes: Vec<String> = group_bytes
            .iter()
            .map(|b| format!("{:.2}", mib(*b)))
            .collect();
        let _ = writeln!(
            s,
            "# group sizes (MiB, backprop order): {}",
            sizes.join(" ")
        );
    }
    plan.write(&a.out)
        .map_err(|e| format!("--out {}: {e}", a.out.display()))?;
    let _ = writeln!(s, "# wrote {}", a.out.display());
    Ok(s)
}

fn main() {
    let raw: Vec<String> = std::env::args_os()
        .skip(1)
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    let a = match parse(&raw) {
        Ok(Parsed::Run(a)) => a,
        Ok(Parsed::Print(text)) => {
            print!("{text}");
            return;
        }
        Err(e) => {
            eprintln!("qccl-plan: {e}");
            std::process::exit(EXIT_ERROR);
        }
    };
    match run(&a) {
        Ok(out) => print!("{out}"),
        Err(e) => {
            eprintln!("qccl-plan: {e}");
            std::process::exit(EXIT_ERROR);
        }
    }
}
