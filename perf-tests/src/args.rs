//! Command line, with nccl-tests' flags and meanings.
//!
//! Hand-written rather than clap: nccl-tests' `-np N` is a two-letter flag behind a single dash
//! and getopt lets a value stick to its flag (`-b1K`); clap can express neither.

use crate::coll::Coll;
use qccl::{Algo, CodecSpec, DType, ReduceOp};
use std::path::PathBuf;
use std::time::Duration;

/// How the message size grows from one line of the table to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// `size *= f` (`-f f`, f > 1).
    Factor(u64),
    /// `size += b` (`-i b`, or nccl-tests' default of 1M when no factor above 1 is given).
    Bytes(u64),
}

/// Which per-rank mean iteration time the table reports (`-a`, nccl-tests' numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeStat {
    /// Rank 0's time (`-a 0`).
    Rank0,
    /// Mean over ranks (`-a 1`, nccl-tests' default).
    Avg,
    /// Minimum over ranks (`-a 2`).
    Min,
    /// Maximum over ranks (`-a 3`, this tool's default).
    Max,
}

impl TimeStat {
    /// Name used in the header and the JSON file.
    pub fn name(self) -> &'static str {
        match self {
            TimeStat::Rank0 => "rank0",
            TimeStat::Avg => "avg",
            TimeStat::Min => "min",
            TimeStat::Max => "max",
        }
    }
}

/// A parsed command line.
#[derive(Debug, Clone)]
pub struct Args {
    /// `-b`: smallest message, bytes.
    pub min_bytes: u64,
    /// `-e`: largest message, bytes.
    pub max_bytes: u64,
    /// `-f` / `-i`.
    pub step: Step,
    /// `-n`: timed iterations per size.
    pub iters: usize,
    /// `-w`: untimed iterations before them.
    pub warmup: usize,
    /// `-S`: time each size for about this long (iterations = S / one call, at most `-n`),
    /// as the peer benchmarks in perf-tests/peers do; None: exactly `-n` iterations.
    pub target_secs: Option<f64>,
    /// `-c`: check results.
    pub check: bool,
    /// `-o`: reduction ops to run (several with `-o all`).
    pub ops: Vec<ReduceOp>,
    /// `-d`: element types to run (several with `-d all`).
    pub dtypes: Vec<DType>,
    /// `-r`: root of broadcast, reduce, gather, scatter.
    pub root: usize,
    /// `-z`: accepted for compatibility; qccl's host collectives always block.
    pub blocking: bool,
    /// `-C` (or the program name): the collective.
    pub coll: Coll,
    /// `-A`: all-reduce algorithm.
    pub algo: Algo,
    /// `-Z`: compress the all-reduce with this codec (all_reduce, float types, sum/avg only).
    /// None with `--calibrate`, whose codecs are in [`Args::codecs`].
    pub codec: Option<CodecSpec>,
    /// Every `-Z` in order: several only with `--calibrate`, which measures each of them (and
    /// [`crate::calibrate::DEFAULT_CODECS`] when none is given).
    pub codecs: Vec<CodecSpec>,
    /// Every `-A` in order: several only with `--calibrate`, which measures each schedule.
    pub algos: Vec<Algo>,
    /// `--calibrate`: measure this machine's cost model instead of printing the table.
    pub calibrate: bool,
    /// `--calibrate-out`: where `--calibrate` writes the cost model (rank 0).
    pub calibrate_out: PathBuf,
    /// `-D`: density ρ of the top-k collectives (`-C hitopk`, `naiveag`, `treear`, `2dtar`),
    /// [`DEFAULT_DENSITY`] for them when not given; None for every other collective.
    pub density: Option<f64>,
    /// `-a`: how the ranks' times combine.
    pub time_stat: TimeStat,
    /// `-J`: JSON output file (written by rank 0).
    pub json: Option<PathBuf>,
    /// `-np`: launch this many local ranks.
    pub np: Option<usize>,
    /// `--timeout` / `-T`: bound on the whole `-np` run.
    pub timeout: Duration,
    /// `--bind-to`: where `-np` puts its ranks (mpirun's flag).
    pub bind: qccl::launch::Bind,
    /// The arguments minus `-np N`: what `-np` hands its children.
    pub passthrough: Vec<String>,
}

/// `--calibrate-out` when not given.
pub const DEFAULT_CALIBRATE_OUT: &str = "qccl-cost.json";
/// `--calibrate`'s smallest size without `-b`: where the fixed cost dominates.
pub const CALIBRATE_MIN_BYTES: u64 = 4 << 10;
/// `--calibrate`'s largest size without `-e`: well into the bandwidth-bound regime.
pub const CALIBRATE_MAX_BYTES: u64 = 64 << 20;

/// `-D` when not given: the paper's usual density (1% of the gradient's elements).
pub const DEFAULT_DENSITY: f64 = 0.01;

/// What the command line asked for.
pub enum Parsed {
    /// Run the benchmark.
    Run(Box<Args>),
    /// `-h`: print usage and exit 0.
    Help,
}

/// Usage text for `-h` and errors.
pub const USAGE: &str = "\
Usage: qccl-perf [options]      (or invoked as all_reduce_perf, reduce_scatter_perf, ...)

nccl-tests for qccl. Launch with -np N (N local processes), or under mpirun, torchrun, srun or
QCCL_RANK/QCCL_WORLD_SIZE/QCCL_COMM_ID; with neither, runs as a single rank.

  -C, --coll <name>          allreduce | reduce_scatter | all_gather | broadcast | reduce |
                             alltoall | sendrecv | gather | scatter |
                             hitopk | naiveag | treear | 2dtar             [program name, else allreduce]
  -b, --minbytes <size>      smallest size, K/M/G suffixes (powers of 1024)            [32M]
  -e, --maxbytes <size>      largest size                                              [32M]
  -f, --stepfactor <f>       multiply the size by f each step                          [1]
  -i, --stepbytes <size>     add this many bytes each step (used when given, or f = 1) [1M]
  -n, --iters <n>            timed iterations per size                                 [20]
  -w, --warmup_iters <n>     untimed iterations before them (per size and mode)        [1]
  -c, --check <0/1>          check results (#wrong)                                    [1]
  -o, --op <op>              sum | prod | min | max | avg | all                        [sum]
  -d, --datatype <type>      float | half | bfloat16 | double | int8 | uint8 | int32 |
                             uint32 | int64 | uint64 | all  (also float32, float16, bf16,
                             fp16, fp32, fp64, int, char, ...)                         [float]
  -r, --root <rank>          root of broadcast, reduce, gather, scatter                [0]
  -A, --algo <algo>          all-reduce algorithm: auto | ring | tree | sra | hier |
                             allgather (one exchange, whole buffers)                   [auto]
  -Z, --codec <spec>         compress the all-reduce with a codec: none | fp16 | bf16 |
                             qsgd:bits=4,bucket=128 | topk:density=0.01 | efsign | ...
                             (allreduce only; float -d; sum or avg -o). busbw stays on
                             the uncompressed size; extra columns: wire(B) bytes sent
                             per rank per call (max over ranks), ratio = dense
                             all-reduce bytes 2(n-1)/n*size over wire(B) (on a
                             hierarchical run: of the inter-host level alone), relerr =
                             |out - exact|_2 / |exact|_2 (float64 reference, fresh
                             inputs, worst of both modes). #wrong counts non-finite
                             outputs, and when the codec bounds one encode's relative
                             error by e, elements off by more than
                             (n+1)*e*max|exact| + the type's own tolerance             [off]
  -D, --density <rho>        top-k density in (0, 1] for -C hitopk (HiTopKComm) and its
                             baselines naiveag (all-gather of every rank's top-k), treear
                             (dense tree) and 2dtar (dense 2-level); those only. A sum of
                             float data (-o sum, float -d); no -Z, -A auto only. Error
                             feedback on, keyed per type and size. Extra columns: wire(B),
                             ratio, relerr as with -Z, and for hitopk the step times rs,
                             topk, ag+add, ag (us, mean over ranks, out of place). #wrong:
                             hitopk, naiveag non-finite outputs only; treear, 2dtar exact
                             as allreduce; treear and 2dtar ignore the density        [0.01]
  -a, --average <0/1/2/3>    reported time: 0 rank 0, 1 mean, 2 min, 3 max over ranks [3]
  -z, --blocking <0/1>       accepted; qccl's host collectives always block
  -t, -g, -m <1>             nccl-tests' threads, GPUs, aggregation: only 1
  -J, --json <file>          write the results as JSON (rank 0)
  -np, --np <N>              launch N local ranks of this program over 127.0.0.1
  -S, --target-secs <secs>   time each size for about this long: iterations =
                             secs / (one call, slowest rank), at most -n           [off]
  -T, --timeout <secs>       with -np: kill all ranks after this long              [3600]
  --bind-to <core|none|auto> with -np: bind rank r to the r-th CPU this process may use
                             (core), or not (none); auto: core when the ranks fit the
                             CPUs (as mpirun) or are a multiple of them            [auto]
  --calibrate                measure this machine's cost model for the planner (qccl-plan)
                             instead of the table: all_reduce alpha + beta*bytes per
                             transport/algorithm (every -A given, float sum, median call,
                             max over ranks, fit over -b..-e by -f [4K..64M by 4], -n
                             iterations), and per codec (every -Z given [fp16,
                             qsgd:bits=4,bucket=128, qsgd:bits=8,bucket=128,
                             mstopk:density=0.01, efsign]) encode and decode_add alpha +
                             beta*bytes on one core of rank 0, and the wire ratio
  --calibrate-out <file>     where --calibrate writes its JSON (rank 0)   [qccl-cost.json]
  -h, --help                 this text
";

/// Parses a byte count with an optional K, M or G suffix (powers of 1024), as nccl-tests.
pub fn parse_size(s: &str) -> Result<u64, String> {
    qccl::config::parse_size(s)
        .ok_or_else(|| format!("'{s}' is not a size (e.g. 4096, 64K, 1M, 2G)"))
}

/// The collective named by the program name (`all_reduce_perf` → all_reduce), if any.
pub fn coll_from_argv0(argv0: &str) -> Option<Coll> {
    let base = std::path::Path::new(argv0).file_name()?.to_str()?;
    let stem = base
        .strip_suffix("_perf")
        .or_else(|| base.strip_suffix("-perf"))?;
    Coll::parse(stem).ok()
}

/// Element type by nccl-tests' name or a common alias.
pub fn parse_dtype(s: &str) -> Result<Vec<DType>, String> {
    let d = match s.to_ascii_lowercase().as_str() {
        "all" => return Ok(DType::ALL.to_vec()),
        "float" | "float32" | "fp32" | "f32" => DType::Float32,
        "half" | "float16" | "fp16" | "f16" => DType::Float16,
        "bfloat16" | "bf16" => DType::Bfloat16,
        "double" | "float64" | "fp64" | "f64" => DType::Float64,
        "int8" | "char" | "i8" => DType::Int8,
        "uint8" | "u8" => DType::Uint8,
        "int32" | "int" | "i32" => DType::Int32,
        "uint32" | "uint" | "u32" => DType::Uint32,
        "int64" | "i64" => DType::Int64,
        "uint64" | "u64" => DType::Uint64,
        _ => {
            return Err(format!(
                "unknown datatype '{s}' (float, half, bfloat16, double, int8, uint8, int32, \
                 uint32, int64, uint64, all)"
            ))
        }
    };
    Ok(vec![d])
}

/// Reduction op by name, or every op for `all`.
pub fn parse_op(s: &str) -> Result<Vec<ReduceOp>, String> {
    let l = s.to_ascii_lowercase();
    if l == "all" {
        return Ok(ReduceOp::ALL.to_vec());
    }
    ReduceOp::ALL
        .iter()
        .find(|o| o.name() == l)
        .map(|o| vec![*o])
        .ok_or_else(|| format!("unknown op '{s}' (sum, prod, min, max, avg, all)"))
}

fn num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String> {
    v.trim()
        .parse()
        .map_err(|_| format!("{flag}: '{v}' is not a valid number"))
}

fn flag01(flag: &str, v: &str) -> Result<bool, String> {
    match v.trim() {
        "0" => Ok(false),
        "1" => Ok(true),
        _ => Err(format!("{flag}: expected 0 or 1, got '{v}'")),
    }
}

/// Options that take a value: (short, long). `np` is the one two-letter short flag.
const OPTS: &[(&str, &str)] = &[
    ("np", "np"),
    ("b", "minbytes"),
    ("e", "maxbytes"),
    ("f", "stepfactor"),
    ("i", "stepbytes"),
    ("n", "iters"),
    ("w", "warmup_iters"),
    ("c", "check"),
    ("o", "op"),
    ("d", "datatype"),
    ("r", "root"),
    ("z", "blocking"),
    ("C", "coll"),
    ("A", "algo"),
    ("Z", "codec"),
    ("D", "density"),
    ("a", "average"),
    ("J", "json"),
    ("T", "timeout"),
    ("S", "target_secs"),
    ("t", "nthreads"),
    ("g", "ngpus"),
    ("m", "agg_iters"),
    // Long only: no single-letter form, so the short lookup (one character) never finds it.
    ("calibrate-out", "calibrate-out"),
    ("bind-to", "bind-to"),
];

/// Long-name aliases.
fn canonical_long(l: &str) -> &str {
    match l {
        "output_file" => "json",
        "op_type" => "op",
        "collective" => "coll",
        "calibrate_out" => "calibrate-out",
        "bind_to" => "bind-to",
        other => other,
    }
}

/// Splits the arguments into (short name, value, raw tokens it used).
fn tokenize(raw: &[String]) -> Result<Vec<(&'static str, String, usize, usize)>, String> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < raw.len() {
        let tok = &raw[i];
        let start = i;
        if tok == "-h" || tok == "--help" {
            out.push(("h", String::new(), start, start + 1));
            i += 1;
            continue;
        }
        // The one option without a value.
        if tok == "--calibrate" {
            out.push(("calibrate", String::new(), start, start + 1));
            i += 1;
            continue;
        }
        let (short, inline): (&'static str, Option<String>) =
            if let Some(long) = tok.strip_prefix("--") {
                let (name, val) = match long.split_once('=') {
                    Some((n, v)) => (n, Some(v.to_string())),
                    None => (long, None),
                };
                let name = canonical_long(name);
                let &(s, _) = OPTS
                    .iter()
                    .find(|(_, l)| *l == name)
                    .ok_or_else(|| format!("unknown option '{tok}'"))?;
                (s, val)
            } else if let Some(rest) = tok.strip_prefix('-').filter(|r| !r.is_empty()) {
                // `-np` first, so that it is not read as `-n p`.
                if let Some(v) = rest.strip_prefix("np") {
                    ("np", (!v.is_empty()).then(|| v.to_string()))
                } else {
                    let (c, v) = rest.split_at(rest.chars().next().map_or(0, char::len_utf8));
                    let &(s, _) = OPTS
                        .iter()
                        .find(|(s, _)| *s == c)
                        .ok_or_else(|| format!("unknown option '{tok}'"))?;
                    (
                        s,
                        (!v.is_empty()).then(|| v.trim_start_matches('=').to_string()),
                    )
                }
            } else {
                return Err(format!("unexpected argument '{tok}'"));
            };
        i += 1;
        let value = match inline {
            Some(v) => v,
            None => {
                let v = raw
                    .get(i)
                    .ok_or_else(|| format!("option '{tok}' needs a value"))?;
                i += 1;
                v.clone()
            }
        };
        out.push((short, value, start, i));
    }
    Ok(out)
}

/// Parses the arguments after the program name; `argv0` may name the collective.
pub fn parse(argv0: &str, raw: &[String]) -> Result<Parsed, String> {
    let mut a = Args {
        min_bytes: 32 << 20,
        max_bytes: 32 << 20,
        step: Step::Bytes(1 << 20),
        iters: 20,
        warmup: 1,
        check: true,
        ops: vec![ReduceOp::Sum],
        dtypes: vec![DType::Float32],
        root: 0,
        blocking: false,
        coll: coll_from_argv0(argv0).unwrap_or(Coll::AllReduce),
        algo: Algo::Auto,
        codec: None,
        codecs: Vec::new(),
        algos: Vec::new(),
        calibrate: false,
        calibrate_out: PathBuf::from(DEFAULT_CALIBRATE_OUT),
        density: None,
        time_stat: TimeStat::Max,
        json: None,
        np: None,
        timeout: Duration::from_secs(3600),
        bind: qccl::launch::Bind::Auto,
        target_secs: None,
        passthrough: Vec::new(),
    };
    let mut factor: Option<u64> = None;
    let mut step_bytes: Option<u64> = None;
    // --calibrate has its own size range unless one is given.
    let (mut min_given, mut max_given) = (false, false);
    let mut calibrate_out_given = false;
    for (flag, v, from, to) in tokenize(raw)? {
        let f = format!("-{flag}");
        let f = f.as_str();
        if flag != "np" && flag != "bind-to" {
            a.passthrough.extend_from_slice(&raw[from..to]);
        }
        match flag {
            "h" => return Ok(Parsed::Help),
            "np" => {
                let n: usize = num(f, &v)?;
                if n == 0 {
                    return Err("-np: need at least 1 rank".into());
                }
                a.np = Some(n);
            }
            "bind-to" => a.bind = v.parse().map_err(|e| format!("--bind-to: {e}"))?,
            "b" => {
                a.min_bytes = parse_size(&v).map_err(|e| format!("{f}: {e}"))?;
                min_given = true;
            }
            "e" => {
                a.max_bytes = parse_size(&v).map_err(|e| format!("{f}: {e}"))?;
                max_given = true;
            }
            "f" => factor = Some(num(f, &v)?),
            "i" => step_bytes = Some(parse_size(&v).map_err(|e| format!("{f}: {e}"))?),
            "n" => a.iters = num(f, &v)?,
            "w" => a.warmup = num(f, &v)?,
            "c" => a.check = flag01(f, &v)?,
            "o" => a.ops = parse_op(&v).map_err(|e| format!("{f}: {e}"))?,
            "d" => a.dtypes = parse_dtype(&v).map_err(|e| format!("{f}: {e}"))?,
            "r" => a.root = num(f, &v)?,
            "z" => a.blocking = flag01(f, &v)?,
            "C" => a.coll = Coll::parse(&v).map_err(|e| format!("{f}: {e}"))?,
            "A" => a
                .algos
                .push(Algo::parse(&v).map_err(|e| format!("{f}: {e}"))?),
            // CodecSpec's message quotes the spec and names the bad field.
            "Z" => a
                .codecs
                .push(CodecSpec::parse(&v).map_err(|e| format!("{f}: {e}"))?),
            "calibrate" => a.calibrate = true,
            "calibrate-out" => {
                if v.is_empty() {
                    return Err("--calibrate-out: needs a file name".into());
                }
                a.calibrate_out = PathBuf::from(v);
                calibrate_out_given = true;
            }
            "D" => {
                let d: f64 = num(f, &v)?;
                // NaN fails both comparisons.
                if !(d > 0.0 && d <= 1.0) {
                    return Err(format!("{f} {v}: the density must be in (0, 1]"));
                }
                a.density = Some(d);
            }
            "a" => {
                a.time_stat = match num::<u32>(f, &v)? {
                    0 => TimeStat::Rank0,
                    1 => TimeStat::Avg,
                    2 => TimeStat::Min,
                    3 => TimeStat::Max,
                    x => return Err(format!("{f}: expected 0, 1, 2 or 3, got {x}")),
                }
            }
            "J" => a.json = Some(PathBuf::from(v)),
            "S" => {
                let s: f64 = num(f, &v)?;
                if !(s > 0.0 && s.is_finite()) {
                    return Err(format!(
                        "{f}: the target must be a positive number of seconds"
                    ));
                }
                a.target_secs = Some(s);
            }
            "T" => {
                let s: f64 = num(f, &v)?;
                if !(s > 0.0 && s.is_finite()) {
                    return Err(format!(
                        "{f}: the timeout must be a positive number of seconds"
                    ));
                }
                a.timeout = Duration::from_secs_f64(s);
            }
            "t" | "g" | "m" => {
                if num::<u64>(f, &v)? != 1 {
                    return Err(format!(
                        "{f} {v}: only 1 is supported (one rank per process, host memory, one \
                         operation per iteration)"
                    ));
                }
            }
            other => unreachable!("option table and match disagree on -{other}"),
        }
    }
    if a.calibrate {
        // A fit over a wide range: small sizes pin alpha, large ones beta.
        if !min_given {
            a.min_bytes = CALIBRATE_MIN_BYTES;
        }
        if !max_given {
            a.max_bytes = CALIBRATE_MAX_BYTES.max(a.min_bytes);
        }
    }
    a.step = match (step_bytes, factor) {
        (Some(b), _) => Step::Bytes(b),
        (None, Some(f)) if f > 1 => Step::Factor(f),
        (None, Some(0)) => return Err("-f: the step factor must be at least 1".into()),
        // Geometric sizes for --calibrate: 1M steps would put nearly every point at the top.
        (None, _) if a.calibrate => Step::Factor(4),
        (None, _) => Step::Bytes(1 << 20),
    };
    if a.step == Step::Bytes(0) {
        return Err("-i: the step must be at least 1 byte".into());
    }
    if a.max_bytes < a.min_bytes {
        return Err(format!(
            "-e {} is below -b {}: the largest size must be at least the smallest",
            a.max_bytes, a.min_bytes
        ));
    }
    if a.iters == 0 {
        return Err("-n: need at least 1 iteration".into());
    }
    if !a.coll.has_op() {
        a.ops = vec![ReduceOp::Sum];
    } else if a.ops.len() == 1 && a.dtypes.len() == 1 {
        a.ops[0]
            .check_dtype(a.dtypes[0])
            .map_err(|e| format!("-o {} -d {}: {e}", a.ops[0], a.dtypes[0]))?;
    }
    if a.calibrate {
        check_calibrate(&mut a)?;
    } else {
        if calibrate_out_given {
            return Err("--calibrate-out: only with --calibrate".into());
        }
        // One schedule and one codec per table; a second flag silently winning would mislead.
        if a.algos.len() > 1 {
            return Err("-A given more than once: only --calibrate takes several".into());
        }
        if a.codecs.len() > 1 {
            return Err("-Z given more than once: only --calibrate takes several".into());
        }
        a.algo = a.algos.first().copied().unwrap_or(Algo::Auto);
        a.codec = a.codecs.first().cloned();
    }
    check_topk(&mut a)?;
    check_codec(&a)?;
    if let Some(np) = a.np {
        if a.coll.rooted() && a.root >= np {
            return Err(format!("-r {}: the root must be below -np {np}", a.root));
        }
    }
    Ok(Parsed::Run(Box::new(a)))
}

/// Rejects what `--calibrate` cannot take and fills in its defaults: it times the
/// uncompressed float all-reduce (so no other collective, and not the compressed-only
/// all-gather schedule) and measures the codecs apart from it.
fn check_calibrate(a: &mut Args) -> Result<(), String> {
    if a.coll != Coll::AllReduce {
        return Err(format!(
            "--calibrate -C {}: calibration times the all-reduce only",
            a.coll.name()
        ));
    }
    if let Some(d) = a.density {
        return Err(format!(
            "--calibrate -D {d}: the density belongs to the top-k collectives"
        ));
    }
    if a.dtypes != [DType::Float32] || a.ops != [ReduceOp::Sum] {
        return Err(
            "--calibrate: gradients are float sums; -d and -o do not apply (float, sum)".into(),
        );
    }
    if a.algos.is_empty() {
        a.algos.push(Algo::Auto);
    }
    a.algo = a.algos[0];
    if a.codecs.is_empty() {
        a.codecs = crate::calibrate::DEFAULT_CODECS
            .iter()
            .map(|s| CodecSpec::parse(s).expect("default codec specs parse"))
            .collect();
    }
    // Codecs are measured apart, not used in the all-reduce (check_codec must not see them).
    a.codec = None;
    Ok(())
}

/// Rejects what the top-k collectives cannot take, and `-D` with any other collective, before
/// any rank starts; sets their default density.
fn check_topk(a: &mut Args) -> Result<(), String> {
    let Some(scheme) = a.coll.topk() else {
        if let Some(d) = a.density {
            return Err(format!(
                "-D {d}: the density applies to -C hitopk, naiveag, treear and 2dtar only, not \
                 -C {}",
                a.coll.name()
            ));
        }
        return Ok(());
    };
    let c = scheme.name();
    if let Some(z) = &a.codec {
        return Err(format!(
            "-Z {z}: -C {c} compresses by itself (top-k at -D); codecs apply to all_reduce only"
        ));
    }
    // The scheme is the algorithm; silently timing something else under -A would mislead.
    if a.algo != Algo::Auto {
        return Err(format!(
            "-A {}: -C {c} fixes its own schedule (use -C allreduce -A {} for that algorithm)",
            a.algo.name(),
            a.algo.name()
        ));
    }
    if let Some(o) = a.ops.iter().find(|o| **o != ReduceOp::Sum) {
        let hint = if a.ops.len() > 1 { " (-o all)" } else { "" };
        return Err(format!("-o {o}{hint}: -C {c} is a sum (-o sum only)"));
    }
    if let Some(d) = a.dtypes.iter().find(|d| !d.is_float()) {
        let hint = if a.dtypes.len() > 1 {
            " (-d all includes integer types; pick float, half, bfloat16 or double)"
        } else {
            ""
        };
        return Err(format!(
            "-C {c} -d {d}: top-k runs on floating-point data only{hint}"
        ));
    }
    a.density.get_or_insert(DEFAULT_DENSITY);
    Ok(())
}

/// Rejects `-Z` combinations the compressed all-reduce would refuse at the first call, so
/// that a bad command line fails before any rank starts.
fn check_codec(a: &Args) -> Result<(), String> {
    let Some(codec) = &a.codec else {
        return Ok(());
    };
    if a.coll != Coll::AllReduce {
        return Err(format!(
            "-Z {codec}: codecs apply to all_reduce only, not -C {}",
            a.coll.name()
        ));
    }
    if let Some(d) = a.dtypes.iter().find(|d| !d.is_float()) {
        let hint = if a.dtypes.len() > 1 {
            " (-d all includes integer types; pick float, half, bfloat16 or double)"
        } else {
            ""
        };
        return Err(format!(
            "-Z {codec} -d {d}: codecs compress floating-point data only{hint}"
        ));
    }
    if let Some(o) = a
        .ops
        .iter()
        .find(|o| !matches!(o, ReduceOp::Sum | ReduceOp::Avg))
    {
        let hint = if a.ops.len() > 1 {
            " (-o all includes prod, min and max)"
        } else {
            ""
        };
        return Err(format!(
            "-Z {codec} -o {o}: compressed all-reduce supports only sum and avg{hint}"
        ));
    }
    Ok(())
}

impl Args {
    /// The message sizes of the table, ascending (nccl-tests' loop).
    pub fn sizes(&self) -> Vec<u64> {
        let mut v = Vec::new();
        let mut s = self.min_bytes;
        while s <= self.max_bytes {
            v.push(s);
            let next = match self.step {
                Step::Factor(f) => s.saturating_mul(f),
                Step::Bytes(b) => s.saturating_add(b),
            };
            if next <= s {
                break;
            }
            s = next;
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Args {
        let raw: Vec<String> = s.split_whitespace().map(String::from).collect();
        match parse("qccl-perf", &raw).unwrap() {
            Parsed::Run(a) => *a,
            Parsed::Help => panic!("help"),
        }
    }

    #[test]
    fn nccl_tests_flags() {
        let a = args("-np 2 -b 4K -e 256M -f 4 -n 5 -w 2 -c 0 -o max -d bf16 -r 1 -z 1 -C reduce");
        assert_eq!((a.min_bytes, a.max_bytes), (4096, 256 << 20));
        assert_eq!(a.step, Step::Factor(4));
        assert_eq!(
            (a.iters, a.warmup, a.check, a.root, a.np),
            (5, 2, false, 1, Some(2))
        );
        assert_eq!(a.ops, vec![ReduceOp::Max]);
        assert_eq!(a.dtypes, vec![DType::Bfloat16]);
        assert_eq!(a.coll, Coll::Reduce);
        assert!(!a.passthrough.iter().any(|s| s == "-np"));
        assert_eq!(a.passthrough.len(), 22);
        assert_eq!(a.sizes().len(), 9); // 4K 16K ... 256M
    }

    #[test]
    fn attached_values_and_long_names() {
        let a = args("-np3 -b1K --maxbytes=64K -i 1K --datatype half -Aring");
        assert_eq!(a.np, Some(3));
        assert_eq!(a.step, Step::Bytes(1024));
        assert_eq!(a.sizes().len(), 64);
        assert_eq!(a.dtypes, vec![DType::Float16]);
        assert_eq!(a.algo, Algo::Ring);
        assert_eq!(
            a.passthrough,
            [
                "-b1K",
                "--maxbytes=64K",
                "-i",
                "1K",
                "--datatype",
                "half",
                "-Aring"
            ]
        );
    }

    #[test]
    fn program_name_and_errors() {
        assert_eq!(coll_from_argv0("/x/all_gather_perf"), Some(Coll::AllGather));
        assert_eq!(coll_from_argv0("sendrecv_perf"), Some(Coll::SendRecv));
        assert_eq!(coll_from_argv0("qccl-perf"), None);
        let bad = |s: &str| {
            let raw: Vec<String> = s.split_whitespace().map(String::from).collect();
            parse("qccl-perf", &raw).is_err()
        };
        assert!(bad("-b 2M -e 1M"));
        assert!(bad("-o avg -d int32"));
        assert!(bad("-d float7"));
        assert!(bad("-x 1"));
        assert!(bad("-n"));
        assert!(bad("-t 2"));
        assert!(!bad("-o avg -d all"));
        assert_eq!(args("-b 0 -e 8 -f 2").sizes(), vec![0]);
    }

    #[test]
    fn topk_collectives_and_density() {
        use qccl::TopKScheme;
        let a = args("-np 2 -C hitopk");
        assert_eq!(a.coll, Coll::TopK(TopKScheme::HiTopK));
        assert_eq!(a.density, Some(DEFAULT_DENSITY));
        let a = args("-C 2dtar -D 0.5 -d half");
        assert_eq!(
            (a.coll.topk(), a.density),
            (Some(TopKScheme::TwoDTar), Some(0.5))
        );
        let a = args("--coll=naiveag --density=1 -A auto");
        assert_eq!(a.density, Some(1.0));
        assert_eq!(
            a.passthrough,
            ["--coll=naiveag", "--density=1", "-A", "auto"]
        );
        assert_eq!(args("-C allreduce").density, None);
        // Program names work as for nccl-tests' collectives.
        assert_eq!(
            coll_from_argv0("/x/hitopk_perf"),
            Some(Coll::TopK(TopKScheme::HiTopK))
        );
        let err = |s: &str| {
            let raw: Vec<String> = s.split_whitespace().map(String::from).collect();
            parse("qccl-perf", &raw)
                .err()
                .unwrap_or_else(|| panic!("{s} parsed"))
        };
        for (cmd, needles) in [
            ("-C hitopk -D 0", &["-D 0", "(0, 1]"][..]),
            ("-C hitopk -D 1.5", &["-D 1.5", "(0, 1]"]),
            ("-C hitopk -D -0.1", &["-D -0.1", "(0, 1]"]),
            ("-C hitopk -D nan", &["-D nan", "(0, 1]"]),
            ("-C hitopk -D x", &["-D", "'x'"]),
            ("-D 0.01", &["-D 0.01", "-C all_reduce"]),
            ("-C broadcast -D 0.1", &["-D 0.1", "-C broadcast"]),
            ("-C hitopk -Z fp16", &["-Z fp16", "-C hitopk"]),
            ("-C treear -A ring", &["-A ring", "-C treear"]),
            ("-C naiveag -o max", &["-o max", "sum"]),
            ("-C 2dtar -o all", &["-o all"]),
            ("-C hitopk -d int32", &["-d int32", "floating-point"]),
            ("-C hitopk -d all", &["-d all includes integer types"]),
        ] {
            let e = err(cmd);
            for n in needles {
                assert!(e.contains(n), "{cmd}: {e}");
            }
        }
    }

    #[test]
    fn codec_flag() {
        let a = args("-np 2 -Z fp16 -o avg -d half -A allgather");
        assert_eq!(a.codec.as_ref().map(|c| c.to_string()), Some("fp16".into()));
        assert_eq!(a.algo, Algo::AllGather);
        // -np's children get -Z too.
        assert_eq!(a.passthrough[..2], ["-Z", "fp16"]);
        let a = args("--codec=bf16:ef=1 -A hier");
        assert_eq!(a.codec.map(|c| c.to_string()), Some("bf16:ef=1".into()));
        assert_eq!(a.algo, Algo::Hier);
        assert!(args("-d all").codec.is_none());
        let err = |s: &str| {
            let raw: Vec<String> = s.split_whitespace().map(String::from).collect();
            parse("qccl-perf", &raw)
                .err()
                .unwrap_or_else(|| panic!("{s} parsed"))
        };
        for (cmd, needles) in [
            ("-Z bogus", &["-Z", "unknown codec \"bogus\""][..]),
            ("-Z fp16:level=1", &["-Z", "unknown field \"level\""]),
            (
                "-Z fp16 -C broadcast",
                &["-Z fp16", "all_reduce only", "-C broadcast"],
            ),
            (
                "-C reduce_scatter -Z bf16",
                &["-Z bf16", "-C reduce_scatter"],
            ),
            ("-Z fp16 -d int32", &["-Z fp16 -d int32", "floating-point"]),
            ("-Z fp16 -d all", &["-d all includes integer types"]),
            ("-Z fp16 -o max", &["-Z fp16 -o max", "sum and avg"]),
            ("-Z fp16 -o all -d half", &["-o all includes"]),
        ] {
            let e = err(cmd);
            for n in needles {
                assert!(e.contains(n), "{cmd}: {e}");
            }
        }
    }

    #[test]
    fn calibrate_flags_and_defaults() {
        let a = args("-np 2 --calibrate");
        assert!(a.calibrate);
        assert_eq!((a.min_bytes, a.max_bytes), (4 << 10, 64 << 20));
        assert_eq!(a.step, Step::Factor(4));
        assert_eq!(a.sizes().len(), 8);
        assert_eq!(a.algos, vec![Algo::Auto]);
        assert_eq!(a.codecs.len(), crate::calibrate::DEFAULT_CODECS.len());
        assert!(
            a.codec.is_none(),
            "codecs are measured, not used in the all-reduce"
        );
        assert_eq!(a.calibrate_out, PathBuf::from(DEFAULT_CALIBRATE_OUT));
        assert_eq!(a.passthrough, ["--calibrate"]);
        let a = args("--calibrate -b 8K -A ring -A tree -Z fp16 -Z efsign --calibrate-out=c.json");
        assert_eq!((a.min_bytes, a.max_bytes), (8 << 10, 64 << 20));
        assert_eq!(a.algos, vec![Algo::Ring, Algo::Tree]);
        assert_eq!(a.algo, Algo::Ring);
        let specs: Vec<String> = a.codecs.iter().map(|c| c.to_string()).collect();
        assert_eq!(specs, ["fp16", "efsign"]);
        assert_eq!(a.calibrate_out, PathBuf::from("c.json"));
        // Without --calibrate, one -A and one -Z as before.
        let a = args("-A tree -Z bf16");
        assert_eq!(a.algo, Algo::Tree);
        assert_eq!(a.codec.map(|c| c.to_string()), Some("bf16".into()));
    }
}
