//! qccl-perf: nccl-tests for qccl.
//!
//! ```text
//! qccl-perf -np 4 -b 4K -e 256M -f 4 --coll allreduce      # 4 local ranks over 127.0.0.1
//! mpirun -np 4 qccl-perf -b 8 -e 128M -f 2 -d half         # or any launcher qccl::Comm::from_env reads
//! qccl-perf -np 2 -b 64K -e 4M -f 4 -Z bf16                # compressed all_reduce (wire, ratio, relerr)
//! qccl-perf -np 4 --coll hitopk --density 0.01 -b 4M -e 64M -f 4  # HiTopKComm; or naiveag, treear, 2dtar
//! qccl-perf -np 2 -b 4K -e 64M -f 2 -J r.json --csv r.csv --plot r.svg   # result files
//! ln -s qccl-perf all_gather_perf; ./all_gather_perf -np 2
//! qccl-perf -np 2 --calibrate                              # measure the cost model: qccl-cost.json
//! ```
//!
//! Exit code: 0 all good, 1 some results were wrong (#wrong > 0), 2 an error (arguments, comm,
//! a failed rank, the -np timeout). See `--help` and README.md.

// Only `device` (device addresses, `Comm::on_stream`) may use `unsafe`.
#![deny(unsafe_code)]

mod args;
mod bench;
mod calibrate;
mod cfmt;
mod coll;
#[allow(unsafe_code)]
mod device;
mod elem;
mod parse;
mod plot;
mod report;

use args::Device;
use args::{Args, Parsed};
use device::Gpu;
use qccl::launch::Launch;
use qccl::{Comm, Config};
use report::RankInfo;

/// Exit code of a rank whose results had wrong elements (the run itself completed).
const EXIT_WRONG: i32 = 1;
/// Exit code for errors: bad arguments, a failed comm, a failed rank, the timeout.
const EXIT_ERROR: i32 = 2;

/// Launcher variables that mean "this process is one rank of a job" (see qccl::bootstrap::env).
const LAUNCHER_VARS: [&str; 10] = [
    "QCCL_RANK",
    "QCCL_WORLD_SIZE",
    "RANK",
    "WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
];

/// The job's comm from the launcher's variables, or a single rank when there are none (as
/// nccl-tests runs without mpirun).
fn open_comm() -> qccl::Result<Comm> {
    if LAUNCHER_VARS.iter().any(|v| std::env::var_os(v).is_some()) {
        return Comm::from_env();
    }
    let mut one = Comm::init_threads(1, Config::from_env()?)?;
    Ok(one.pop().expect("init_threads(1) returns one comm"))
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// (pid, host, CPUs, links, GPU) of every rank, for the "Using devices" lines.
fn rank_table(comm: &Comm, gpu: Option<&Gpu>) -> qccl::Result<Vec<RankInfo>> {
    // pid, then the host name, the CPU list and the link kinds, each NUL-padded; then the
    // GPU's ordinal (u32::MAX: host buffers), bus id and name.
    const REC: usize = 264;
    const HOST: std::ops::Range<usize> = 4..68;
    const CPUS: std::ops::Range<usize> = 68..128;
    const LINKS: std::ops::Range<usize> = 128..160;
    const ORDINAL: std::ops::Range<usize> = 160..164;
    const BUS: std::ops::Range<usize> = 164..200;
    const NAME: std::ops::Range<usize> = 200..REC;
    let mut mine = [0u8; REC];
    mine[..4].copy_from_slice(&std::process::id().to_le_bytes());
    let put = |rec: &mut [u8], at: std::ops::Range<usize>, s: &str| {
        let b = &s.as_bytes()[..s.len().min(at.len() - 1)];
        rec[at.start..at.start + b.len()].copy_from_slice(b);
    };
    put(&mut mine, HOST, &hostname());
    let cpus =
        qccl::launch::allowed_cpus().map_or_else(|_| "?".into(), |c| qccl::launch::cpu_list(&c));
    put(&mut mine, CPUS, &cpus);
    put(&mut mine, LINKS, comm.transport_name());
    let ordinal = gpu.map_or(u32::MAX, |g| g.info().ordinal as u32);
    mine[ORDINAL].copy_from_slice(&ordinal.to_le_bytes());
    if let Some(g) = gpu {
        put(&mut mine, BUS, &g.info().bus_id);
        put(&mut mine, NAME, &g.info().name);
    }
    let mut all = vec![0u8; REC * comm.size()];
    comm.all_gather(&mine[..], &mut all)?;
    let text = |b: &[u8]| {
        String::from_utf8_lossy(b)
            .trim_end_matches('\0')
            .to_string()
    };
    Ok(all
        .chunks(REC)
        .map(|rec| RankInfo {
            pid: u32::from_le_bytes([rec[0], rec[1], rec[2], rec[3]]),
            host: text(&rec[HOST]),
            cpus: text(&rec[CPUS]),
            links: text(&rec[LINKS]),
            gpu: match u32::from_le_bytes(rec[ORDINAL].try_into().expect("4 bytes")) {
                u32::MAX => None,
                o => Some(report::GpuInfo {
                    ordinal: o as usize,
                    bus_id: text(&rec[BUS]),
                    name: text(&rec[NAME]),
                }),
            },
        })
        .collect())
}

/// The peak resident set of this process (VmHWM), bytes; 0 where /proc does not say.
fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Writes the result files `a` asks for (rank 0): `-J` JSON, `--csv` / `-J *.csv` CSV,
/// `--plot` SVG.
fn write_outputs(
    a: &Args,
    n: usize,
    rows: &[report::Row],
    wrong: u64,
    device: Device,
) -> Result<(), (std::path::PathBuf, std::io::Error)> {
    let rep = report::report(a, n, rows, wrong, device);
    let mut files: Vec<(&std::path::Path, String)> = Vec::new();
    if let Some(path) = &a.json {
        files.push((path, report::json(&rep)));
    }
    for path in &a.csv {
        files.push((path, report::csv(&rep)));
    }
    if let Some(path) = &a.plot {
        let title = format!(
            "qccl-perf {} on {n} ranks: busbw vs size{}",
            a.coll.name(),
            a.codec
                .as_ref()
                .map_or(String::new(), |z| format!(", -Z {z}"))
        );
        files.push((path, plot::svg(&title, &report::plot_series(rows))));
    }
    for (path, text) in files {
        report::write_file(path, &text).map_err(|e| (path.to_path_buf(), e))?;
    }
    Ok(())
}

/// One rank's whole run; returns the exit code.
fn rank_main(a: &Args) -> i32 {
    // Before any comm: a --device cuda that cannot run stops here, naming what is missing.
    let device = match device::resolve(a) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("qccl-perf: {e}");
            return EXIT_ERROR;
        }
    };
    let comm = match open_comm() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("qccl-perf: {e}");
            return EXIT_ERROR;
        }
    };
    let (rank, n) = (comm.rank(), comm.size());
    if a.coll.rooted() && a.root >= n {
        if rank == 0 {
            eprintln!(
                "qccl-perf: -r {}: the root must be below the {n} ranks",
                a.root
            );
        }
        return EXIT_ERROR;
    }
    if a.calibrate {
        return match calibrate::run(&comm, a, &hostname()) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("qccl-perf: rank {rank} of {n}: {e}");
                EXIT_ERROR
            }
        };
    }
    let result = (|| -> qccl::Result<u64> {
        let mut gpu = match device {
            Device::Cuda => Some(Gpu::open(
                comm.local_rank(),
                comm.config().timeout,
                a.stream_null,
            )?),
            Device::Host => None,
        };
        let ranks = rank_table(&comm, gpu.as_ref())?;
        if rank == 0 {
            let arena = n > 1 && comm.links() == qccl::internal::Links::Arena;
            print!("{}", report::header(a, n, &ranks, arena));
        }
        let mut sink = bench::Sink {
            print: rank == 0,
            rows: Vec::new(),
            buffer_bytes: 0,
            emulated: report::emulated(&ranks),
        };
        let wrong = bench::run(&comm, a, &mut sink, gpu.as_mut())?;
        // Every rank takes part in the maxima; rank 0 prints them.
        let memory = if a.memory_report {
            let mut m = [sink.buffer_bytes, peak_rss_bytes()];
            comm.all_reduce_in_place(&mut m, qccl::ReduceOp::Max)?;
            Some(m)
        } else {
            None
        };
        if rank == 0 {
            print!("{}", report::footer(&sink.rows, wrong, a.coll.name()));
            if let Some([buffers, rss]) = memory {
                print!("{}", report::memory_line(buffers, rss));
            }
            write_outputs(a, n, &sink.rows, wrong, device)
                .map_err(|(path, e)| qccl::Error::io(format!("writing {}", path.display()), e))?;
        }
        Ok(wrong)
    })();
    match result {
        Ok(0) => 0,
        Ok(_) => EXIT_WRONG,
        Err(e) => {
            eprintln!("qccl-perf: rank {rank} of {n}: {e}");
            EXIT_ERROR
        }
    }
}

fn main() {
    let mut argv = std::env::args_os();
    let argv0 = argv.next().unwrap_or_else(|| "qccl-perf".into());
    let raw: Vec<String> = argv.map(|s| s.to_string_lossy().into_owned()).collect();
    let a = match args::parse(&argv0.to_string_lossy(), &raw) {
        Ok(Parsed::Run(a)) => a,
        Ok(Parsed::Print(text)) => {
            print!("{text}");
            return;
        }
        Err(e) if e.complete => {
            eprintln!("qccl-perf: {e}");
            std::process::exit(EXIT_ERROR);
        }
        Err(e) => {
            eprintln!("qccl-perf: {e}\n\nFor more information, try '--help'.");
            std::process::exit(EXIT_ERROR);
        }
    };
    // --device cuda without a driver: one message, before any rank starts.
    if a.np.is_some() && a.device == Some(Device::Cuda) {
        if let Err(e) = device::resolve(&a) {
            eprintln!("qccl-perf: {e}");
            std::process::exit(EXIT_ERROR);
        }
    }
    let code = match a.np {
        // Ranks that found wrong results finish the run; any other failure stops the job.
        Some(np) => {
            let mut job = Launch::new(np)
                .args(&a.passthrough)
                .bind(a.bind)
                .hosts(a.hosts)
                .finished_code(EXIT_WRONG);
            if let Some(t) = a.timeout {
                job = job.timeout(t);
            }
            job.run().unwrap_or_else(|e| {
                let hint = matches!(e, qccl::Error::Timeout(_)).then_some(" (-T, --timeout)");
                eprintln!("qccl-perf: {e}{}", hint.unwrap_or(""));
                EXIT_ERROR
            })
        }
        None => rank_main(&a),
    };
    std::process::exit(code);
}
