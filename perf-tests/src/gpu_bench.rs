//! qccl-gpu-bench: the device's kernels against its own copy bandwidth, in one run.
//!
//! ```text
//! qccl-gpu-bench                        # 256 MiB of f32, every codec, f32/f16/bf16 sums
//! qccl-gpu-bench -b 64M -n 50 --codec qsgd:bits=4,bucket=128 -J gpu.json
//! ```
//!
//! Rows: a device-to-device copy, the reduction kernels (sum), and each codec's encode with
//! error feedback and decode+add through its launch plan (what the compressed all-reduce
//! launches). Each row's GB/s counts the bytes its work must read and write, as the copy's
//! (`qccl::internal::gpu_bench`); "vs copy" is the ratio to the copy of the same run; algbw
//! is the element bytes processed per second (nccl-tests' algbw). Under each codec row, `#`
//! lines split its time among the plan's kernels, each run alone between two synchronizes
//! in a pass of their own (so they say which kernel to work on, not the row's speed). Under
//! QCCL_GPU_EMULATE the rows run on the CPU through the kernel shim: the figures then say
//! nothing about a GPU.
//!
//! Exit code: 0 done, 2 an error (arguments, no usable device, a kernel that fails).

#![forbid(unsafe_code)]

mod parse;

use clap::Parser;
use parse::{parse_dtype, parse_size};
use qccl::internal::gpu_bench::{run, BenchConfig, Measure};
use std::fmt::Write as _;
use std::time::Duration;

const EXIT_ERROR: i32 = 2;

/// Codecs measured by default: each family, with the settings the tests and docs use.
const DEFAULT_CODECS: &[&str] = &[
    "fp16",
    "bf16",
    "qsgd:bits=4,bucket=128",
    "qsgd:bits=8,bucket=512",
    "qsgd:bits=2,bucket=64,scale=maxabs,rounding=nearest",
    "efsign",
    "onebit",
    "topk:density=0.01",
    "mstopk:density=0.01",
    "randk:density=0.01",
];

/// The command line.
#[derive(Parser, Debug)]
#[command(
    name = "qccl-gpu-bench",
    bin_name = "qccl-gpu-bench",
    version,
    about = "The device's reduction and codec kernels against its own copy bandwidth",
    args_override_self = true
)]
struct Cli {
    /// Bytes of f32 input per launch (K, M, G: powers of 1024).
    #[arg(short = 'b', long, value_name = "SIZE", default_value = "256M", value_parser = parse_size)]
    bytes: u64,
    /// Timed launches per row.
    #[arg(short = 'n', long, default_value_t = 20)]
    iters: usize,
    /// Untimed launches before each row.
    #[arg(short = 'w', long, default_value_t = 3)]
    warmup: usize,
    /// A codec spec to measure (repeatable); default: one of each family.
    #[arg(long = "codec", value_name = "SPEC")]
    codecs: Vec<String>,
    /// Reduction dtypes (comma list of nccl-tests' names: float, half, bfloat16, double, int32,
    /// ..., or all).
    #[arg(
        short = 'd',
        long,
        default_value = "float,half,bfloat16",
        value_delimiter = ','
    )]
    dtypes: Vec<String>,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Also write the rows as JSON to this file.
    #[arg(short = 'J', long, value_name = "FILE")]
    json: Option<std::path::PathBuf>,
}

fn main() {
    let cli = Cli::parse();
    match bench(&cli) {
        Ok(text) => print!("{text}"),
        Err(e) => {
            eprintln!("qccl-gpu-bench: {e}");
            std::process::exit(EXIT_ERROR);
        }
    }
}

fn bench(cli: &Cli) -> Result<String, String> {
    let mut reductions = Vec::new();
    for d in &cli.dtypes {
        reductions.extend(parse_dtype(d.trim())?);
    }
    let codecs: Vec<String> = if cli.codecs.is_empty() {
        DEFAULT_CODECS.iter().map(|s| s.to_string()).collect()
    } else {
        cli.codecs.clone()
    };
    let cfg = BenchConfig {
        count: (cli.bytes / 4) as usize,
        iters: cli.iters,
        warmup: cli.warmup,
        codecs,
        reductions,
        timeout: Duration::from_secs(120),
    };
    let driver = qccl::internal::gpu().map_err(|e| e.to_string())?;
    let info = driver.device(cli.device).map_err(|e| e.to_string())?;
    let rows = run(&*driver, cli.device, &cfg).map_err(|e| e.to_string())?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# qccl-gpu-bench: kernels against the device's copy bandwidth ({} driver)",
        driver.kind()
    );
    let _ = writeln!(
        out,
        "# Using device {}: {} bus {} ({} MiB)",
        info.ordinal,
        info.name,
        info.bus_id,
        info.memory >> 20
    );
    let _ = writeln!(
        out,
        "# {} f32 per launch ({} bytes), {} timed launches after {} warm-up; GB/s counts bytes \
         read and written",
        cfg.count, cli.bytes, cfg.iters, cfg.warmup
    );
    let _ = writeln!(
        out,
        "#\n# {:<62} {:>11} {:>9} {:>10} {:>9} {:>8}",
        "kernel", "time(us)", "algbw", "traffic", "GB/s", "vs copy"
    );
    let copy = rows[0].gbps();
    for m in &rows {
        let _ = writeln!(
            out,
            "  {:<62} {:>11.1} {:>9.1} {:>10} {:>9.1} {:>8.2}",
            m.name,
            m.seconds * 1e6,
            m.algbw(),
            mib(m.traffic),
            m.gbps(),
            m.gbps() / copy
        );
        // Which of the plan's kernels takes the time (each run alone: shares, not speed).
        let all: f64 = m.kernels.iter().map(|(_, t)| t).sum();
        for (k, t) in &m.kernels {
            let _ = writeln!(
                out,
                "#   {:<60} {:>11.1} {:>8.0}%",
                k,
                t * 1e6,
                100.0 * t / all
            );
        }
    }
    if let Some(path) = &cli.json {
        let json = serde_json::json!({
            "device": info.name,
            "bus_id": info.bus_id,
            "driver": driver.kind(),
            "count": cfg.count,
            "iters": cfg.iters,
            "rows": rows.iter().map(|m| row(m, copy)).collect::<Vec<_>>(),
        });
        std::fs::write(path, format!("{json:#}\n"))
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(out)
}

fn mib(bytes: u64) -> String {
    format!("{:.1}M", bytes as f64 / (1 << 20) as f64)
}

fn row(m: &Measure, copy: f64) -> serde_json::Value {
    serde_json::json!({
        "kernel": m.name,
        "count": m.count,
        "traffic_bytes": m.traffic,
        "algbw": m.algbw(),
        "seconds": m.seconds,
        "gbps": m.gbps(),
        "vs_copy": m.gbps() / copy,
        "kernels": m.kernels.iter().map(|(k, t)| serde_json::json!({
            "kernel": k,
            "seconds": t,
        })).collect::<Vec<_>>(),
    })
}
