//! Command line: nccl-tests' flags with nccl-tests' meanings (clap), plus qccl's own options
//! under letters nccl-tests leaves free.
//!
//! Two nccl-tests habits clap does not have are handled before it sees the arguments: mpirun's
//! `-np N` (a two-letter flag behind one dash) becomes `--np N`, and getopt's "the last one
//! wins" for a repeated option is clap's `args_override_self`. Values may stick to their flag
//! (`-b1K`, `--maxbytes=64K`) in both.
//!
//! Letters that meant something else in earlier qccl-perf versions (`-C` the collective, `-D`
//! the density, `-S` the target time) mean what nccl-tests says now; a value that only fits
//! the old meaning (`-C allreduce`, `-D 0.01`, `-S 0.3`) stops with a one-line hint naming the
//! new spelling ([`retired_hint`]).

use crate::coll::Coll;
pub use crate::parse::{parse_dtype, parse_size};
use clap::{ArgAction, CommandFactory, FromArgMatches, Parser};
use qccl::{Algo, CodecSpec, DType, ReduceOp};
use std::path::PathBuf;
use std::time::Duration;

/// The codecs `--calibrate` measures when no `-Z` is given: one of each family the planners
/// choose between (half precision, 4- and 8-bit quantisation, 1% sparsification, 1-bit sign).
pub const DEFAULT_CODECS: [&str; 5] = [
    "fp16",
    "qsgd:bits=4,bucket=128",
    "qsgd:bits=8,bucket=128",
    "mstopk:density=0.01",
    "efsign",
];

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
    /// Mean over ranks (`-a 1`, the default, as in nccl-tests).
    Avg,
    /// Minimum over ranks (`-a 2`).
    Min,
    /// Maximum over ranks (`-a 3`).
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
    /// `-N`: how many times the whole table runs; 0 until killed (or `-T`).
    pub run_cycles: u64,
    /// `-s`, `--target-secs`: time each size for about this long (iterations = s / one call,
    /// at most `-n`), as the peer benchmarks in perf-tests/peers do; None: exactly `-n`.
    pub target_secs: Option<f64>,
    /// `-c`: checked calls per size and mode (nccl-tests' check iteration count); 0: none.
    pub check: u32,
    /// `-o`: reduction ops to run (several with `-o all`).
    pub ops: Vec<ReduceOp>,
    /// `-d`: element types to run (several with `-d all`).
    pub dtypes: Vec<DType>,
    /// `-r`: root of broadcast, reduce, gather, scatter.
    pub root: usize,
    /// `-z`: nccl-tests' blocking mode (0-3), accepted; qccl's host collectives always block.
    pub blocking: u8,
    /// `-y 1`: calls on device buffers go on the legacy default stream (NULL), each
    /// returning once done, instead of qccl-perf's own stream.
    pub stream_null: bool,
    /// `-R 1`: the send and receive buffers are registered with the comm.
    pub register: bool,
    /// `-C`: the time column shows rank 0's own time per call instead of the `-a` statistic.
    pub report_cputime: bool,
    /// `-S`: a timestamp after each line's in-place columns.
    pub report_timestamps: bool,
    /// `-M`: the host memory report after the footer.
    pub memory_report: bool,
    /// `-u`: buffers start this many elements past their allocation.
    pub unalign: usize,
    /// `-I`: per-iteration timing (i_min, i_max, i_p99, i_cv% per mode).
    pub per_iter: bool,
    /// `-K`: leading iterations left out of `-I`'s statistics.
    pub per_iter_skip: usize,
    /// nccl-tests options given that have no effect on host memory, for the header
    /// (`-G 1 (CUDA graphs)`).
    pub ignored: Vec<String>,
    /// `-L`, `--coll` (or the program name): the collective.
    pub coll: Coll,
    /// `-A`: all-reduce algorithm.
    pub algo: Algo,
    /// `-Z`: compress the all-reduce with this codec (all_reduce, float types, sum/avg only).
    /// None with `--calibrate`, whose codecs are in [`Args::codecs`].
    pub codec: Option<CodecSpec>,
    /// Every `-Z` in order: several only with `--calibrate`, which measures each of them (and
    /// [`DEFAULT_CODECS`] when none is given).
    pub codecs: Vec<CodecSpec>,
    /// Every `-A` in order: several only with `--calibrate`, which measures each schedule.
    pub algos: Vec<Algo>,
    /// `-Q`, `--calibrate`: measure this machine's cost model instead of printing the table.
    pub calibrate: bool,
    /// `--calibrate-out`: where `--calibrate` writes the cost model (rank 0).
    pub calibrate_out: PathBuf,
    /// `--tuning-out`: where `--calibrate` also writes the fastest all-reduce schedule per
    /// size as a tuning file (QCCL_TUNING_FILE), rank 0; None: no tuning file.
    pub tuning_out: Option<PathBuf>,
    /// `-k`, `--density`: density ρ of the top-k collectives (`--coll hitopk`, `naiveag`,
    /// `treear`, `2dtar`), [`DEFAULT_DENSITY`] for them when not given; None for every other
    /// collective.
    pub density: Option<f64>,
    /// `-a`: how the ranks' times combine.
    pub time_stat: TimeStat,
    /// `-J` (a name not ending in `.csv`): JSON output file (written by rank 0).
    pub json: Option<PathBuf>,
    /// `--csv`, and `-J` with a name ending in `.csv`: CSV output files (rank 0).
    pub csv: Vec<PathBuf>,
    /// `--plot`: SVG of busbw against size (rank 0).
    pub plot: Option<PathBuf>,
    /// `--device`: where the send and receive buffers live; None: device memory when a
    /// driver and device are usable, else host memory (`device::resolve`).
    pub device: Option<Device>,
    /// `-np`: launch this many local ranks.
    pub np: Option<usize>,
    /// `-T`, `--timeout`: bound on the whole `-np` run; None (`-T 0`): no bound.
    pub timeout: Option<Duration>,
    /// `--bind-to`: where `-np` puts its ranks (mpirun's flag).
    pub bind: qccl::launch::Bind,
    /// `--hosts`: emulated hosts `-np` splits its ranks into (1: one host).
    pub hosts: usize,
    /// The arguments minus `-np N`, `--bind-to` and `--hosts`: what `-np` hands its children.
    pub passthrough: Vec<String>,
}

/// `--calibrate-out` when not given.
pub const DEFAULT_CALIBRATE_OUT: &str = "qccl-cost.json";
/// What `--calibrate --tuning-out` measures besides `auto` when no `-A` is given: every flat
/// schedule (the hierarchical one only when asked for, since it needs equal hosts).
pub const TUNING_ALGOS: [Algo; 4] = [Algo::Ring, Algo::Tree, Algo::Sra, Algo::AllGather];
/// `--calibrate`'s smallest size without `-b`: where the fixed cost dominates.
pub const CALIBRATE_MIN_BYTES: u64 = 4 << 10;
/// `--calibrate`'s largest size without `-e`: well into the bandwidth-bound regime.
pub const CALIBRATE_MAX_BYTES: u64 = 64 << 20;

/// `--density` when not given: the paper's usual density (1% of the gradient's elements).
pub const DEFAULT_DENSITY: f64 = 0.01;

/// `-T` when not given, seconds (nccl-tests' default, 0, means no bound; a forgotten `-np`
/// job should not run forever).
pub const DEFAULT_TIMEOUT_SECS: f64 = 3600.0;

/// What the command line asked for.
pub enum Parsed {
    /// Run the benchmark.
    Run(Box<Args>),
    /// `-h`, `--help`, `--version`: print this on stdout and exit 0.
    Print(String),
}

/// A command line that cannot run.
#[derive(Debug)]
pub struct ArgError {
    /// What is wrong; its first line starts the error output (after `qccl-perf: `).
    pub msg: String,
    /// Nothing is to follow the message: a retired-flag hint is one line by design, and clap's
    /// own text already ends in its pointer to `--help`.
    pub complete: bool,
}

impl From<String> for ArgError {
    fn from(msg: String) -> ArgError {
        ArgError {
            msg,
            complete: false,
        }
    }
}

impl From<&str> for ArgError {
    fn from(msg: &str) -> ArgError {
        msg.to_string().into()
    }
}

impl std::fmt::Display for ArgError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.msg)
    }
}

const ABOUT: &str = "nccl-tests for qccl: bandwidth and correctness of every collective";

const LONG_ABOUT: &str = "\
nccl-tests for qccl: bandwidth and correctness of every collective.

Launch with -np N (N local processes), or under mpirun, torchrun, srun or
QCCL_RANK/QCCL_WORLD_SIZE/QCCL_COMM_ID; with neither, runs as a single rank. Invoked as
all_reduce_perf, reduce_scatter_perf, ... (a link), the name picks the collective.

Every single letter nccl-tests defines means what it means there. qccl's own options use
letters nccl-tests leaves free: -L (--coll), -A (--algo), -Z (--codec), -k (--density),
-s (--target-secs), -Q (--calibrate).";

const AFTER_LONG_HELP: &str = "\
Compression (-Z): busbw stays on the uncompressed size; extra columns after nccl-tests' own:
wire(B) bytes sent per rank per call (max over ranks), ratio = dense all-reduce bytes
2(n-1)/n*size over wire(B) (on a hierarchical run: of the inter-host level alone), relerr =
|out - exact|_2 / |exact|_2 (float64 reference, fresh inputs, worst of both modes). #wrong
counts non-finite outputs, and when the codec bounds one encode's relative error by e,
elements off by more than (n+1)*e*max|exact| + the type's own tolerance.

Top-k (--coll hitopk | naiveag | treear | 2dtar): a sum of float data (-o sum, float -d), no
-Z, -A auto only, error feedback on, keyed per type and size. Extra columns: wire(B), ratio,
relerr as with -Z, and for hitopk the step times rs, topk, ag+add, ag (us, mean over ranks,
out of place). #wrong: hitopk, naiveag non-finite outputs only; treear, 2dtar exact as
allreduce; treear and 2dtar ignore the density.

--calibrate measures the all_reduce alpha + beta*bytes per transport/algorithm (every -A
given, float sum, median call, max over ranks, fit over -b..-e by -f [4K..64M by 4], -n
iterations), and per codec (every -Z given [fp16, qsgd:bits=4,bucket=128,
qsgd:bits=8,bucket=128, mstopk:density=0.01, efsign]) encode and decode_add alpha +
beta*bytes on one core of rank 0, and the wire ratio.

--device cuda: send and receive buffers in GPU memory (device local rank % GPUs), each call
enqueued on qccl-perf's stream as the C API does, the stream synchronised after each timed
loop (the time includes qccl's staging through page-locked memory); -c copies the results
back to check them. The default with a usable CUDA driver and GPU, or QCCL_GPU_EMULATE.

Exit code: 0 all good, 1 some results were wrong (#wrong > 0), 2 an error (arguments, comm,
a failed rank, the -np timeout).";

/// The command line as clap sees it. Numbers nccl-tests reads with `strtol` are integers here
/// too; options whose value may only fit a retired meaning (`-C`, `-S`, `-D`) are strings,
/// checked in [`parse`].
#[derive(Parser, Debug)]
#[command(
    name = "qccl-perf",
    bin_name = "qccl-perf",
    version,
    about = ABOUT,
    long_about = LONG_ABOUT,
    after_long_help = AFTER_LONG_HELP,
    disable_version_flag = true,
    args_override_self = true,
    allow_negative_numbers = true,
    next_line_help = true
)]
struct Cli {
    /// Smallest size, bytes; K/M/G suffixes (powers of 1024) [default: 32M]
    #[arg(short = 'b', long, value_name = "SIZE", value_parser = parse_size, help_heading = NCCL)]
    minbytes: Option<u64>,
    /// Largest size [default: 32M]
    #[arg(short = 'e', long, value_name = "SIZE", value_parser = parse_size, help_heading = NCCL)]
    maxbytes: Option<u64>,
    /// Add this many bytes each step (when given, or -f is 1) [default: 1M]
    #[arg(short = 'i', long, value_name = "SIZE", value_parser = parse_size, help_heading = NCCL)]
    stepbytes: Option<u64>,
    /// Multiply the size by this each step [default: 1]
    #[arg(short = 'f', long, value_name = "F", help_heading = NCCL)]
    stepfactor: Option<u64>,
    /// Timed iterations per size and mode
    #[arg(short = 'n', long, value_name = "N", default_value_t = 20, help_heading = NCCL)]
    iters: usize,
    /// Untimed iterations before them (per size and mode)
    #[arg(short = 'w', long = "warmup_iters", value_name = "N", default_value_t = 1, help_heading = NCCL)]
    warmup_iters: usize,
    /// Run the whole table this many times; 0: until stopped (or -T)
    #[arg(short = 'N', long = "run_cycles", value_name = "N", default_value_t = 1, help_heading = NCCL)]
    run_cycles: u64,
    /// Checked calls per size and mode, on fresh inputs (#wrong); 0: none
    #[arg(short = 'c', long, value_name = "N", default_value_t = 1, help_heading = NCCL)]
    check: u32,
    /// sum | prod | min | max | avg | all
    #[arg(short = 'o', long, alias = "op_type", value_name = "OP", default_value = "sum", help_heading = NCCL)]
    op: String,
    /// float | half | bfloat16 | double | int8 | uint8 | int32 | uint32 |
    /// int64 | uint64 | all (also float32, fp16, bf16, fp64, int, char, ...)
    #[arg(short = 'd', long, value_name = "TYPE", default_value = "float", help_heading = NCCL,
          verbatim_doc_comment)]
    datatype: String,
    /// Root of broadcast, reduce, gather, scatter
    #[arg(short = 'r', long, value_name = "RANK", default_value_t = 0, help_heading = NCCL)]
    root: usize,
    /// Time column: 0 rank 0, 1 mean, 2 min, 3 max over the ranks' means
    #[arg(short = 'a', long, value_name = "0-3", default_value_t = 1,
          value_parser = clap::value_parser!(u8).range(0..=3), help_heading = NCCL)]
    average: u8,
    /// 1: the time column is rank 0's own time per call ("cputime"; the
    /// calls block, so its wall time); algbw, busbw stay on the -a time
    #[arg(short = 'C', long = "report_cputime", value_name = "0/1", default_value = "0",
          help_heading = NCCL, verbatim_doc_comment)]
    report_cputime: String,
    /// 1: a timestamp (UTC) after each line's in-place columns
    #[arg(short = 'S', long = "report_timestamps", value_name = "0/1", default_value = "0", help_heading = NCCL)]
    report_timestamps: String,
    /// Write the results (rank 0): CSV when FILE ends in .csv, else JSON
    #[arg(short = 'J', long = "output_file", visible_alias = "json", value_name = "FILE", help_heading = NCCL)]
    output_file: Option<PathBuf>,
    /// With -np: kill all ranks after this many seconds; 0: never [default: 3600]
    #[arg(short = 'T', long, value_name = "SECS", help_heading = NCCL)]
    timeout: Option<f64>,
    /// 1: memory report after the footer (buffers, peak RSS; max over ranks)
    #[arg(short = 'M', long, value_name = "0/1", default_value_t = 0,
          value_parser = clap::value_parser!(u8).range(0..=1), help_heading = NCCL)]
    memory: u8,
    /// Start the buffers this many elements past their allocation
    #[arg(short = 'u', long, value_name = "ELEMS", default_value_t = 0, help_heading = NCCL)]
    unalign: usize,
    /// 1: per-iteration timing after each mode: i_min, i_max, i_p99 (us),
    /// i_cv% over the timed iterations, each on its slowest rank
    #[arg(short = 'I', long = "per_iter_timing", value_name = "0/1", default_value_t = 0,
          value_parser = clap::value_parser!(u8).range(0..=1), help_heading = NCCL,
          verbatim_doc_comment)]
    per_iter_timing: u8,
    /// Leave this many leading iterations out of -I's statistics
    #[arg(short = 'K', long = "per_iter_skip", value_name = "N", default_value_t = 0, help_heading = NCCL)]
    per_iter_skip: usize,

    /// Threads per process: only 1
    #[arg(short = 't', long, value_name = "1", default_value_t = 1, help_heading = GPU)]
    nthreads: u64,
    /// GPUs per thread: only 1
    #[arg(short = 'g', long, value_name = "1", default_value_t = 1, help_heading = GPU)]
    ngpus: u64,
    /// Operations per iteration: only 1
    #[arg(short = 'm', long = "agg_iters", value_name = "1", default_value_t = 1, help_heading = GPU)]
    agg_iters: u64,
    /// No effect: one rank per process
    #[arg(short = 'p', long = "parallel_init", value_name = "0/1", default_value_t = 0, help_heading = GPU)]
    parallel_init: i64,
    /// No effect: qccl's host collectives always block
    #[arg(short = 'z', long, value_name = "0-3", default_value_t = 0,
          value_parser = clap::value_parser!(u8).range(0..=3), help_heading = GPU)]
    blocking: u8,
    /// Calls on device buffers on the NULL stream, each returning once done (1), or on
    /// qccl-perf's own stream, returning once enqueued (0)
    #[arg(short = 'y', long = "stream_null", value_name = "0/1", default_value_t = 0,
          value_parser = clap::value_parser!(i64).range(0..=1), help_heading = GPU)]
    stream_null: i64,
    /// No effect: no CUDA graphs
    #[arg(short = 'G', long, value_name = "N", default_value_t = 0, help_heading = GPU)]
    cudagraph: i64,
    /// 1: register the send and receive buffers with the comm
    /// (qcclCommRegister: RDMA sends them without a copy); 2: as 1
    /// (no symmetric windows)
    #[arg(short = 'R', long = "local_register", value_name = "0-2", default_value_t = 0,
          value_parser = clap::value_parser!(u8).range(0..=2), help_heading = NCCL,
          verbatim_doc_comment)]
    local_register: u8,
    /// No effect: no CTAs
    #[arg(short = 'x', long = "cta_policy", value_name = "0-2", help_heading = GPU)]
    cta_policy: Option<i64>,
    /// Only 0: qccl's own code, no NCCL device kernels
    #[arg(short = 'D', long = "device_implementation", value_name = "0", default_value = "0", help_heading = GPU)]
    device_implementation: String,
    /// No effect: no CTAs
    #[arg(short = 'V', long = "device_cta_count", value_name = "N", help_heading = GPU)]
    device_cta_count: Option<i64>,

    /// allreduce | reduce_scatter | all_gather | broadcast | reduce |
    /// alltoall | sendrecv | gather | scatter | hitopk | naiveag | treear |
    /// 2dtar [default: from the program name, else allreduce]
    #[arg(short = 'L', long, alias = "collective", value_name = "NAME", help_heading = QCCL,
          verbatim_doc_comment)]
    coll: Option<String>,
    /// All-reduce algorithm: auto | ring | tree | sra | hier | allgather
    /// (whole buffers in one exchange, with -Z) [default: auto]
    #[arg(short = 'A', long, value_name = "ALGO", action = ArgAction::Append, help_heading = QCCL,
          verbatim_doc_comment)]
    algo: Vec<String>,
    /// Compress the all-reduce: none | fp16 | bf16 | qsgd:bits=4,bucket=128 |
    /// topk:density=0.01 | efsign | ... (float -d; sum or avg -o)
    #[arg(short = 'Z', long, value_name = "SPEC", action = ArgAction::Append, help_heading = QCCL,
          verbatim_doc_comment)]
    codec: Vec<String>,
    /// Top-k density in (0, 1] of --coll hitopk, naiveag [default: 0.01]
    #[arg(short = 'k', long, value_name = "RHO", help_heading = QCCL)]
    density: Option<f64>,
    /// Time each size for about this long: iterations = SECS / one call
    /// (slowest rank), at most -n
    #[arg(short = 's', long = "target-secs", alias = "target_secs", value_name = "SECS",
          help_heading = QCCL, verbatim_doc_comment)]
    target_secs: Option<f64>,
    /// Measure the cost model for the planner (qccl-plan), not the table
    #[arg(short = 'Q', long, help_heading = QCCL)]
    calibrate: bool,
    /// Where --calibrate writes (rank 0) [default: qccl-cost.json]
    #[arg(long = "calibrate-out", alias = "calibrate_out", value_name = "FILE", help_heading = QCCL)]
    calibrate_out: Option<PathBuf>,
    /// With --calibrate: also write the fastest schedule per size as a
    /// tuning file for QCCL_TUNING_FILE (rank 0; -A defaults to auto,
    /// ring, tree, sra, allgather)
    #[arg(long = "tuning-out", alias = "tuning_out", value_name = "FILE", help_heading = QCCL,
          verbatim_doc_comment)]
    tuning_out: Option<PathBuf>,
    /// Write the results as CSV (rank 0): a line per table line
    #[arg(long, value_name = "FILE", help_heading = QCCL)]
    csv: Option<PathBuf>,
    /// Plot busbw against size as SVG (rank 0): a line per mode, type, op
    #[arg(long, value_name = "FILE.svg", help_heading = QCCL)]
    plot: Option<PathBuf>,
    /// Where the send and receive buffers live: host | cuda (device memory
    /// of GPU local rank % GPUs, staged by qccl through page-locked memory;
    /// a compressed flat SRA, all-gather scheme, ring or tree, and naiveag,
    /// run their codecs on the GPU)
    /// [default: cuda when a CUDA driver and GPU are usable, or
    /// QCCL_GPU_EMULATE is set; else host]
    #[arg(long, value_name = "host|cuda", help_heading = QCCL, verbatim_doc_comment)]
    device: Option<String>,
    /// Launch N local ranks over 127.0.0.1 (also spelled -np N, as mpirun)
    #[arg(long, value_name = "N", help_heading = QCCL)]
    np: Option<usize>,
    /// With -np: rank r on the r-th CPU this process may use (core), or
    /// anywhere (none); auto: core when the ranks fit the CPUs or are a
    /// multiple of them (as mpirun)
    #[arg(long = "bind-to", alias = "bind_to", value_name = "core|none|auto", default_value = "auto",
          help_heading = QCCL, verbatim_doc_comment)]
    bind_to: String,
    /// With -np: split the ranks into N emulated hosts of np/N
    /// consecutive ranks (QCCL_HOSTID per rank): the multi-host routes
    /// (hierarchical all-reduce, hitopk) on one machine, TCP between hosts
    #[arg(long, value_name = "N", default_value_t = 1, help_heading = QCCL, verbatim_doc_comment)]
    hosts: usize,
    /// Print the version
    #[arg(long, action = ArgAction::Version)]
    version: Option<bool>,
}

/// Help headings.
const NCCL: &str = "nccl-tests options";
const GPU: &str = "nccl-tests options for GPUs (accepted)";
const QCCL: &str = "qccl options";

/// The help text (`--help`, the long form).
#[cfg(test)]
pub fn long_help() -> String {
    Cli::command().render_long_help().to_string()
}

/// The collective named by the program name (`all_reduce_perf` → all_reduce), if any.
pub fn coll_from_argv0(argv0: &str) -> Option<Coll> {
    let base = std::path::Path::new(argv0).file_name()?.to_str()?;
    let stem = base
        .strip_suffix("_perf")
        .or_else(|| base.strip_suffix("-perf"))?;
    Coll::parse(stem).ok()
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

/// The one-line hint for a value that fits what a letter meant in earlier qccl-perf versions
/// but not what nccl-tests (and now qccl-perf) means by it: `-C allreduce`, `-S 0.3`,
/// `-D 0.01`. None when `v` is an integer (the nccl-tests meaning applies).
pub fn retired_hint(letter: char, v: &str) -> Option<String> {
    if v.trim().parse::<i64>().is_ok() {
        return None;
    }
    let (now, old, short) = match letter {
        'C' => ("--report_cputime 0/1", "--coll", "-L"),
        'S' => ("--report_timestamps 0/1", "--target-secs", "-s"),
        'D' => ("--device_implementation 0", "--density", "-k"),
        _ => return None,
    };
    Some(format!(
        "-{letter} now means {now} (nccl-tests); use {old} {v} (or {short} {v})"
    ))
}

/// An integer nccl-tests reads with `strtol`, non-zero meaning on; `letter` and `long` name
/// the option in errors.
fn switch(letter: char, long: &str, v: &str) -> Result<bool, ArgError> {
    if let Some(hint) = retired_hint(letter, v) {
        return Err(ArgError {
            msg: hint,
            complete: true,
        });
    }
    v.trim()
        .parse::<i64>()
        .map(|x| x != 0)
        .map_err(|_| format!("-{letter}, --{long}: '{v}' is not an integer").into())
}

/// Splits off what only the launcher uses: `-np N` (mpirun's spelling, also `-npN`, `--np N`,
/// `--np=N`), `--bind-to X` and `--hosts N`. Returns the arguments for clap (`-np` spelled
/// `--np`) and the arguments `-np` hands its children (none of the three).
fn split_launcher_args(raw: &[String]) -> (Vec<String>, Vec<String>) {
    let (mut for_clap, mut passthrough) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < raw.len() {
        let tok = raw[i].as_str();
        let launcher_flag =
            |name: &str| tok == name || tok.strip_prefix(name).is_some_and(|v| v.starts_with('='));
        if tok == "-np" || tok == "--np" {
            for_clap.push("--np".to_string());
            if let Some(v) = raw.get(i + 1) {
                for_clap.push(v.clone());
            }
            i += 2;
        } else if let Some(v) = tok
            .strip_prefix("--np=")
            .or_else(|| tok.strip_prefix("-np"))
        {
            for_clap.push(format!("--np={}", v.trim_start_matches('=')));
            i += 1;
        } else if launcher_flag("--bind-to")
            || launcher_flag("--bind_to")
            || launcher_flag("--hosts")
        {
            for_clap.push(tok.to_string());
            if !tok.contains('=') {
                if let Some(v) = raw.get(i + 1) {
                    for_clap.push(v.clone());
                }
                i += 1;
            }
            i += 1;
        } else {
            for_clap.push(tok.to_string());
            passthrough.push(tok.to_string());
            i += 1;
        }
    }
    (for_clap, passthrough)
}

/// A clap error as one of ours: its text without clap's `error: ` (main prefixes the program
/// name).
fn clap_error(e: clap::Error) -> ArgError {
    let text = e.render().to_string();
    let text = text.strip_prefix("error: ").unwrap_or(&text).trim_end();
    ArgError {
        msg: text.to_string(),
        // clap's text already ends in its "For more information, try '--help'."
        complete: true,
    }
}

/// Parses the arguments after the program name; `argv0` may name the collective.
pub fn parse(argv0: &str, raw: &[String]) -> Result<Parsed, ArgError> {
    let (for_clap, passthrough) = split_launcher_args(raw);
    let cmd = Cli::command();
    let matches = match cmd.try_get_matches_from(
        std::iter::once("qccl-perf".to_string()).chain(for_clap.iter().cloned()),
    ) {
        Ok(m) => m,
        Err(e) => {
            use clap::error::ErrorKind;
            return match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
                    Ok(Parsed::Print(e.render().to_string()))
                }
                _ => Err(clap_error(e)),
            };
        }
    };
    let c = Cli::from_arg_matches(&matches).map_err(clap_error)?;
    let mut a = Args {
        min_bytes: c.minbytes.unwrap_or(32 << 20),
        max_bytes: c.maxbytes.unwrap_or(32 << 20),
        step: Step::Bytes(1 << 20),
        iters: c.iters,
        warmup: c.warmup_iters,
        run_cycles: c.run_cycles,
        target_secs: None,
        check: c.check,
        ops: parse_op(&c.op).map_err(|e| format!("-o: {e}"))?,
        dtypes: parse_dtype(&c.datatype).map_err(|e| format!("-d: {e}"))?,
        root: c.root,
        blocking: c.blocking,
        stream_null: c.stream_null != 0,
        register: c.local_register != 0,
        report_cputime: switch('C', "report_cputime", &c.report_cputime)?,
        report_timestamps: switch('S', "report_timestamps", &c.report_timestamps)?,
        memory_report: c.memory != 0,
        unalign: c.unalign,
        per_iter: c.per_iter_timing != 0,
        per_iter_skip: c.per_iter_skip,
        ignored: Vec::new(),
        coll: match &c.coll {
            Some(v) => Coll::parse(v).map_err(|e| format!("--coll: {e}"))?,
            None => coll_from_argv0(argv0).unwrap_or(Coll::AllReduce),
        },
        algo: Algo::Auto,
        codec: None,
        codecs: c
            .codec
            .iter()
            // CodecSpec's message quotes the spec and names the bad field.
            .map(|v| CodecSpec::parse(v).map_err(|e| format!("-Z: {e}")))
            .collect::<Result<_, _>>()?,
        algos: c
            .algo
            .iter()
            .map(|v| Algo::parse(v).map_err(|e| format!("-A: {e}")))
            .collect::<Result<_, _>>()?,
        calibrate: c.calibrate,
        calibrate_out: c
            .calibrate_out
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_CALIBRATE_OUT)),
        tuning_out: c.tuning_out.clone(),
        density: c.density,
        time_stat: match c.average {
            0 => TimeStat::Rank0,
            1 => TimeStat::Avg,
            2 => TimeStat::Min,
            _ => TimeStat::Max,
        },
        json: None,
        csv: c.csv.iter().cloned().collect(),
        plot: c.plot.clone(),
        device: c
            .device
            .as_deref()
            .map(Device::parse)
            .transpose()
            .map_err(|e| format!("--device: {e}"))?,
        np: c.np,
        timeout: None,
        bind: c.bind_to.parse().map_err(|e| format!("--bind-to: {e}"))?,
        hosts: c.hosts,
        passthrough,
    };
    match c.output_file {
        Some(p) if p.extension().is_some_and(|x| x.eq_ignore_ascii_case("csv")) => a.csv.push(p),
        p => a.json = p,
    }
    for p in a
        .csv
        .iter()
        .chain(&a.json)
        .chain(&a.plot)
        .chain(&a.tuning_out)
    {
        if p.as_os_str().is_empty() {
            return Err("-J, --csv, --plot, --tuning-out: need a file name".into());
        }
    }
    if c.np == Some(0) {
        return Err("-np: need at least 1 rank".into());
    }
    match c.np {
        _ if c.hosts == 0 => return Err("--hosts 0: need at least 1 host".into()),
        Some(np) if !np.is_multiple_of(c.hosts) => {
            return Err(format!(
                "--hosts {}: -np {np} does not split into hosts of the same size",
                c.hosts
            )
            .into())
        }
        None if c.hosts > 1 => return Err("--hosts: only with -np".into()),
        _ => {}
    }
    let timeout = c.timeout.unwrap_or(DEFAULT_TIMEOUT_SECS);
    if !(timeout >= 0.0 && timeout.is_finite()) {
        return Err(
            format!("-T {timeout}: the timeout must be a number of seconds (0: none)").into(),
        );
    }
    a.timeout = (timeout > 0.0).then(|| Duration::from_secs_f64(timeout));
    for (letter, what, v) in [
        ('t', "threads per process", c.nthreads),
        ('g', "GPUs per thread", c.ngpus),
        ('m', "operations per iteration", c.agg_iters),
    ] {
        if v != 1 {
            return Err(format!(
                "-{letter} {v}: only 1 {what} (one rank per process, one device, one operation \
                 per iteration)"
            )
            .into());
        }
    }
    match c.device_implementation.trim().parse::<i64>() {
        Ok(0) => {}
        Ok(d) => {
            return Err(format!(
                "-D {d}: nccl-tests' device implementations run NCCL kernels on GPUs; qccl runs \
                 its own code, only -D 0 (for the top-k density: --density {d})"
            )
            .into())
        }
        Err(_) => {
            return Err(ArgError {
                msg: retired_hint('D', &c.device_implementation)
                    .expect("not an integer, so a hint"),
                complete: true,
            })
        }
    }
    // Recorded for the header: a run that looks GPU-specific should say the option did nothing.
    for (given, note) in [
        (c.parallel_init != 0, format!("-p {}", c.parallel_init)),
        (c.cudagraph != 0, format!("-G {}", c.cudagraph)),
        (c.local_register == 2, "-R 2 (as -R 1)".to_string()),
    ] {
        if given {
            a.ignored.push(note);
        }
    }
    if let Some(x) = c.cta_policy {
        a.ignored.push(format!("-x {x}"));
    }
    if let Some(v) = c.device_cta_count {
        a.ignored.push(format!("-V {v}"));
    }
    if a.per_iter_skip > 0 && !a.per_iter {
        return Err(format!("-K {}: needs -I 1", a.per_iter_skip).into());
    }
    if a.per_iter && a.per_iter_skip >= a.iters {
        return Err(format!(
            "-K {}: must leave at least one of the -n {} iterations",
            a.per_iter_skip, a.iters
        )
        .into());
    }
    if let Some(s) = c.target_secs {
        if !(s > 0.0 && s.is_finite()) {
            return Err(format!(
                "--target-secs {s}: the target must be a positive number of seconds"
            )
            .into());
        }
        a.target_secs = Some(s);
    }
    if let Some(d) = a.density {
        // NaN fails both comparisons.
        if !(d > 0.0 && d <= 1.0) {
            return Err(format!("--density {d}: the density must be in (0, 1]").into());
        }
    }
    if a.calibrate {
        // A fit over a wide range: small sizes pin alpha, large ones beta.
        if c.minbytes.is_none() {
            a.min_bytes = CALIBRATE_MIN_BYTES;
        }
        if c.maxbytes.is_none() {
            a.max_bytes = CALIBRATE_MAX_BYTES.max(a.min_bytes);
        }
    }
    a.step = match (c.stepbytes, c.stepfactor) {
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
        )
        .into());
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
        if c.calibrate_out.is_some() {
            return Err("--calibrate-out: only with --calibrate".into());
        }
        if c.tuning_out.is_some() {
            return Err("--tuning-out: only with --calibrate".into());
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
    check_device(&a)?;
    if let Some(np) = a.np {
        if a.coll.rooted() && a.root >= np {
            return Err(format!("-r {}: the root must be below -np {np}", a.root).into());
        }
    }
    Ok(Parsed::Run(Box::new(a)))
}

/// Rejects what `--device cuda` cannot take: `--calibrate` times host buffers (its cost
/// model is the host path's), and `-R` registers host memory with the comm.
fn check_device(a: &Args) -> Result<(), ArgError> {
    if a.device != Some(Device::Cuda) {
        return Ok(());
    }
    if a.calibrate {
        return Err("--device cuda: --calibrate measures host buffers only (--device host)".into());
    }
    if a.register {
        return Err(
            "--device cuda: -R registers host memory; device buffers cannot be registered \
             (-R 0, or --device host)"
                .into(),
        );
    }
    Ok(())
}

/// Rejects what `--calibrate` cannot take and fills in its defaults: it times the
/// uncompressed float all-reduce (so no other collective, and not the compressed-only
/// all-gather schedule) and measures the codecs apart from it.
fn check_calibrate(a: &mut Args) -> Result<(), String> {
    if a.coll != Coll::AllReduce {
        return Err(format!(
            "--calibrate --coll {}: calibration times the all-reduce only",
            a.coll.name()
        ));
    }
    if let Some(d) = a.density {
        return Err(format!(
            "--calibrate --density {d}: the density belongs to the top-k collectives"
        ));
    }
    if a.dtypes != [DType::Float32] || a.ops != [ReduceOp::Sum] {
        return Err(
            "--calibrate: gradients are float sums; -d and -o do not apply (float, sum)".into(),
        );
    }
    if a.algos.is_empty() {
        a.algos.push(Algo::Auto);
        // A tuning file picks among schedules, so it needs them all measured; auto stays
        // first, the cost model's default link.
        if a.tuning_out.is_some() {
            a.algos.extend(TUNING_ALGOS);
        }
    }
    a.algo = a.algos[0];
    if a.codecs.is_empty() {
        a.codecs = DEFAULT_CODECS
            .iter()
            .map(|s| CodecSpec::parse(s).expect("default codec specs parse"))
            .collect();
    }
    // Codecs are measured apart, not used in the all-reduce (check_codec must not see them).
    a.codec = None;
    Ok(())
}

/// Rejects what the top-k collectives cannot take, and `--density` with any other collective, before
/// any rank starts; sets their default density.
fn check_topk(a: &mut Args) -> Result<(), String> {
    let Some(scheme) = a.coll.topk() else {
        if let Some(d) = a.density {
            return Err(format!(
                "--density {d}: the density applies to --coll hitopk, naiveag, treear and 2dtar \
                 only, not --coll {}",
                a.coll.name()
            ));
        }
        return Ok(());
    };
    let c = scheme.name();
    if let Some(z) = &a.codec {
        return Err(format!(
            "-Z {z}: --coll {c} compresses by itself (top-k at --density); codecs apply to \
             all_reduce only"
        ));
    }
    // The scheme is the algorithm; silently timing something else under -A would mislead.
    if a.algo != Algo::Auto {
        return Err(format!(
            "-A {}: --coll {c} fixes its own schedule (use --coll allreduce -A {} for that \
             algorithm)",
            a.algo.name(),
            a.algo.name()
        ));
    }
    if let Some(o) = a.ops.iter().find(|o| **o != ReduceOp::Sum) {
        let hint = if a.ops.len() > 1 { " (-o all)" } else { "" };
        return Err(format!("-o {o}{hint}: --coll {c} is a sum (-o sum only)"));
    }
    if let Some(d) = a.dtypes.iter().find(|d| !d.is_float()) {
        let hint = if a.dtypes.len() > 1 {
            " (-d all includes integer types; pick float, half, bfloat16 or double)"
        } else {
            ""
        };
        return Err(format!(
            "--coll {c} -d {d}: top-k runs on floating-point data only{hint}"
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
            "-Z {codec}: codecs apply to all_reduce only, not --coll {}",
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

/// Where the send and receive buffers live (`--device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// Host memory (qccl's host collectives on the buffers themselves).
    Host,
    /// Device memory of a CUDA GPU.
    Cuda,
}

impl Device {
    /// `host` or `cuda` (any case).
    pub fn parse(s: &str) -> std::result::Result<Device, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "host" | "cpu" => Ok(Device::Host),
            "cuda" | "gpu" => Ok(Device::Cuda),
            _ => Err(format!("'{s}' is not a device (host, cuda)")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn try_args(s: &str) -> Result<Args, ArgError> {
        let raw: Vec<String> = s.split_whitespace().map(String::from).collect();
        match parse("qccl-perf", &raw)? {
            Parsed::Run(a) => Ok(*a),
            Parsed::Print(_) => panic!("help"),
        }
    }

    fn args(s: &str) -> Args {
        try_args(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn err(s: &str) -> ArgError {
        try_args(s).err().unwrap_or_else(|| panic!("{s} parsed"))
    }

    #[test]
    fn nccl_tests_flags() {
        let a = args("-np 2 -b 4K -e 256M -f 4 -n 5 -w 2 -c 0 -o max -d bf16 -r 1 -z 1 -L reduce");
        assert_eq!((a.min_bytes, a.max_bytes), (4096, 256 << 20));
        assert_eq!(a.step, Step::Factor(4));
        assert_eq!(
            (a.iters, a.warmup, a.check, a.root, a.np),
            (5, 2, 0, 1, Some(2))
        );
        assert_eq!(a.ops, vec![ReduceOp::Max]);
        assert_eq!(a.dtypes, vec![DType::Bfloat16]);
        assert_eq!(a.coll, Coll::Reduce);
        assert!(!a.passthrough.iter().any(|s| s == "-np"));
        assert_eq!(a.passthrough.len(), 22);
        assert_eq!(a.sizes().len(), 9); // 4K 16K ... 256M
                                        // nccl-tests' defaults.
        let a = args("");
        assert_eq!(
            a.time_stat,
            TimeStat::Avg,
            "-a defaults to 1 (mean), as nccl-tests"
        );
        assert_eq!(
            (a.min_bytes, a.max_bytes, a.iters, a.warmup),
            (32 << 20, 32 << 20, 20, 1)
        );
        assert_eq!((a.check, a.run_cycles, a.unalign), (1, 1, 0));
        assert!(!a.report_cputime && !a.report_timestamps && !a.per_iter && !a.memory_report);
        assert_eq!(a.timeout, Some(Duration::from_secs(3600)));
        assert!(a.ignored.is_empty());
    }

    #[test]
    fn nccl_tests_letters_mean_what_they_mean_there() {
        let a = args("-C 1 -S 1 -M 1 -I 1 -K 2 -u 3 -N 4 -c 5 -a 3 -T 0 -z 3");
        assert!(a.report_cputime && a.report_timestamps && a.memory_report && a.per_iter);
        assert_eq!(
            (a.per_iter_skip, a.unalign, a.run_cycles, a.check),
            (2, 3, 4, 5)
        );
        assert_eq!(a.time_stat, TimeStat::Max);
        assert_eq!((a.timeout, a.blocking), (None, 3));
        let a = args("--report_cputime 0 --report_timestamps=0 --output_file x.json");
        assert!(!a.report_cputime && !a.report_timestamps);
        assert_eq!(a.json, Some(PathBuf::from("x.json")));
        // -J infers the type from the suffix; --csv is CSV whatever the name.
        let a = args("-J out.CSV --csv t.txt --plot p.svg");
        assert_eq!(
            (a.json, a.csv),
            (None, vec!["t.txt".into(), "out.CSV".into()])
        );
        assert_eq!(a.plot, Some(PathBuf::from("p.svg")));
        // GPU-only options: accepted, no effect, named in the header (-y 1 has one).
        let a = args("-p 1 -y 1 -G 5 -R 2 -x 1 -D 0 -V 16 -t 1 -g 1 -m 1");
        assert_eq!(
            a.ignored,
            ["-p 1", "-G 5", "-R 2 (as -R 1)", "-x 1", "-V 16"]
        );
        assert!(a.stream_null && !args("-y 0").stream_null);
        for (cmd, needle) in [
            ("-t 2", "-t 2: only 1"),
            ("-g 4", "-g 4: only 1"),
            ("-D 1", "--density 1"),
            ("-K 1", "needs -I 1"),
            ("-I 1 -n 3 -K 3", "at least one"),
            ("-a 4", "-a"),
            ("-I 2", "--per_iter_timing"),
            ("-T -1", "-T -1"),
        ] {
            let e = err(cmd);
            assert!(e.msg.contains(needle), "{cmd}: {e}");
        }
    }

    #[test]
    fn retired_spellings_give_a_one_line_hint() {
        for (cmd, want) in [
            (
                "-C allreduce",
                "-C now means --report_cputime 0/1 (nccl-tests); use --coll allreduce (or -L \
                 allreduce)",
            ),
            (
                "-C 2dtar",
                "-C now means --report_cputime 0/1 (nccl-tests); use --coll 2dtar (or -L 2dtar)",
            ),
            (
                "-S 0.3",
                "-S now means --report_timestamps 0/1 (nccl-tests); use --target-secs 0.3 (or -s \
                 0.3)",
            ),
            (
                "-D 0.01",
                "-D now means --device_implementation 0 (nccl-tests); use --density 0.01 (or -k \
                 0.01)",
            ),
        ] {
            let e = err(cmd);
            assert_eq!(e.msg, want, "{cmd}");
            assert!(e.complete && !e.msg.contains('\n'), "{cmd}");
        }
        assert_eq!(retired_hint('C', "1"), None);
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
        // getopt: the last of a repeated option wins.
        let a = args("-b 1K -b 2K --np 2 --bind-to core -n 3 --bind_to=none");
        assert_eq!((a.min_bytes, a.np), (2048, Some(2)));
        assert_eq!(a.bind, qccl::launch::Bind::None);
        assert_eq!(a.passthrough, ["-b", "1K", "-b", "2K", "-n", "3"]);
        // --hosts is the launcher's too; it must split -np evenly.
        let a = args("-np 4 --hosts 2 -n 3 --hosts=2");
        assert_eq!((a.np, a.hosts), (Some(4), 2));
        assert_eq!(a.passthrough, ["-n", "3"]);
        assert!(err("-np 3 --hosts 2").msg.contains("does not split"));
        assert!(err("--hosts 2").msg.contains("only with -np"));
        assert!(err("-np 2 --hosts 0").msg.contains("at least 1 host"));
    }

    #[test]
    fn program_name_and_errors() {
        assert_eq!(coll_from_argv0("/x/all_gather_perf"), Some(Coll::AllGather));
        assert_eq!(coll_from_argv0("sendrecv_perf"), Some(Coll::SendRecv));
        assert_eq!(coll_from_argv0("qccl-perf"), None);
        let bad = |s: &str| try_args(s).is_err();
        assert!(bad("-b 2M -e 1M"));
        assert!(bad("-o avg -d int32"));
        assert!(bad("-d float7"));
        assert!(bad("-X 1"));
        assert!(bad("-n"));
        assert!(bad("-t 2"));
        assert!(!bad("-o avg -d all"));
        assert_eq!(args("-b 0 -e 8 -f 2").sizes(), vec![0]);
    }

    #[test]
    fn help_and_version() {
        let raw = |s: &str| -> Vec<String> { s.split_whitespace().map(String::from).collect() };
        for flag in ["-h", "--help"] {
            let Ok(Parsed::Print(text)) = parse("qccl-perf", &raw(flag)) else {
                panic!("{flag}")
            };
            for needle in [
                "-np",
                "--coll",
                "-C, --report_cputime",
                "-L, --coll",
                "--version",
            ] {
                assert!(text.contains(needle), "{flag}: no {needle} in\n{text}");
            }
        }
        let Ok(Parsed::Print(v)) = parse("qccl-perf", &raw("--version")) else {
            panic!("--version")
        };
        assert_eq!(v.trim(), format!("qccl-perf {}", env!("CARGO_PKG_VERSION")));
        // -V is nccl-tests' device_cta_count, not the version.
        assert_eq!(args("-V 8").ignored, ["-V 8"]);
        assert!(long_help().contains("Exit code"));
    }

    #[test]
    fn topk_collectives_and_density() {
        use qccl::TopKScheme;
        let a = args("-np 2 -L hitopk");
        assert_eq!(a.coll, Coll::TopK(TopKScheme::HiTopK));
        assert_eq!(a.density, Some(DEFAULT_DENSITY));
        let a = args("--coll 2dtar -k 0.5 -d half");
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
        assert_eq!(args("--collective allreduce").density, None);
        // Program names work as for nccl-tests' collectives.
        assert_eq!(
            coll_from_argv0("/x/hitopk_perf"),
            Some(Coll::TopK(TopKScheme::HiTopK))
        );
        for (cmd, needles) in [
            ("-L hitopk -k 0", &["--density 0", "(0, 1]"][..]),
            ("-L hitopk --density 1.5", &["--density 1.5", "(0, 1]"]),
            ("-L hitopk --density -0.1", &["--density -0.1", "(0, 1]"]),
            ("-L hitopk --density nan", &["--density NaN", "(0, 1]"]),
            ("-L hitopk --density x", &["--density", "'x'"]),
            ("-k 0.01", &["--density 0.01", "--coll all_reduce"]),
            (
                "-L broadcast -k 0.1",
                &["--density 0.1", "--coll broadcast"],
            ),
            ("-L hitopk -Z fp16", &["-Z fp16", "--coll hitopk"]),
            ("-L treear -A ring", &["-A ring", "--coll treear"]),
            ("-L naiveag -o max", &["-o max", "sum"]),
            ("-L 2dtar -o all", &["-o all"]),
            ("-L hitopk -d int32", &["-d int32", "floating-point"]),
            ("-L hitopk -d all", &["-d all includes integer types"]),
        ] {
            let e = err(cmd);
            for n in needles {
                assert!(e.msg.contains(n), "{cmd}: {e}");
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
        for (cmd, needles) in [
            ("-Z bogus", &["-Z", "unknown codec \"bogus\""][..]),
            ("-Z fp16:level=1", &["-Z", "unknown field \"level\""]),
            (
                "-Z fp16 -L broadcast",
                &["-Z fp16", "all_reduce only", "--coll broadcast"],
            ),
            (
                "--coll reduce_scatter -Z bf16",
                &["-Z bf16", "--coll reduce_scatter"],
            ),
            ("-Z fp16 -d int32", &["-Z fp16 -d int32", "floating-point"]),
            ("-Z fp16 -d all", &["-d all includes integer types"]),
            ("-Z fp16 -o max", &["-Z fp16 -o max", "sum and avg"]),
            ("-Z fp16 -o all -d half", &["-o all includes"]),
        ] {
            let e = err(cmd);
            for n in needles {
                assert!(e.msg.contains(n), "{cmd}: {e}");
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
        assert_eq!(a.codecs.len(), DEFAULT_CODECS.len());
        assert!(
            a.codec.is_none(),
            "codecs are measured, not used in the all-reduce"
        );
        assert_eq!(a.calibrate_out, PathBuf::from(DEFAULT_CALIBRATE_OUT));
        assert_eq!(a.passthrough, ["--calibrate"]);
        assert!(args("-Q").calibrate);
        let a = args("--calibrate -b 8K -A ring -A tree -Z fp16 -Z efsign --calibrate-out=c.json");
        assert_eq!((a.min_bytes, a.max_bytes), (8 << 10, 64 << 20));
        assert_eq!(a.algos, vec![Algo::Ring, Algo::Tree]);
        assert_eq!(a.algo, Algo::Ring);
        let specs: Vec<String> = a.codecs.iter().map(|c| c.to_string()).collect();
        assert_eq!(specs, ["fp16", "efsign"]);
        assert_eq!(a.calibrate_out, PathBuf::from("c.json"));
        assert_eq!(a.tuning_out, None);
        // --tuning-out measures every flat schedule unless -A says which.
        let a = args("--calibrate --tuning-out t.txt");
        assert_eq!(a.tuning_out, Some(PathBuf::from("t.txt")));
        assert_eq!(a.algos[0], Algo::Auto);
        assert_eq!(a.algos[1..], TUNING_ALGOS);
        let a = args("--calibrate --tuning-out=t.txt -A sra -A tree");
        assert_eq!(a.algos, vec![Algo::Sra, Algo::Tree]);
        assert!(err("--tuning-out t.txt")
            .msg
            .contains("only with --calibrate"));
        let e = err("--calibrate --tuning-out=");
        assert!(
            e.msg.contains("a value is required for '--tuning-out"),
            "{e}"
        );
        // Without --calibrate, one -A and one -Z as before.
        let a = args("-A tree -Z bf16");
        assert_eq!(a.algo, Algo::Tree);
        assert_eq!(a.codec.map(|c| c.to_string()), Some("bf16".into()));
    }
}
