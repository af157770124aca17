//! Runs the built qccl-perf binary as a user would: `-np 2` and `-np 3` for every collective,
//! every datatype, JSON output, program names and failure exit codes.

use std::os::unix::process::CommandExt;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_qccl-perf");
/// Sizes of the quick runs: 1K 4K 16K 64K.
const QUICK: &[&str] = &[
    "-b", "1K", "-e", "64K", "-f", "4", "-n", "2", "-w", "1", "-c", "1", "-T", "120",
];
const NOMINAL: [u64; 4] = [1024, 4096, 16384, 65536];

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .output()
        .expect("run qccl-perf")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// One parsed table line.
#[derive(Debug)]
struct Line {
    size: u64,
    count: u64,
    dtype: String,
    redop: String,
    root: i64,
    oop: (f64, f64, f64, u64),
    ip: Option<(f64, f64, f64, u64)>,
}

fn mode(f: &[&str], line: &str) -> Option<(f64, f64, f64, u64)> {
    if f.iter().all(|x| *x == "N/A") {
        return None;
    }
    let num = |s: &str| {
        s.parse::<f64>()
            .unwrap_or_else(|_| panic!("bad number '{s}' in: {line}"))
    };
    let wrong = f[3]
        .parse::<u64>()
        .unwrap_or_else(|_| panic!("bad #wrong in: {line}"));
    Some((num(f[0]), num(f[1]), num(f[2]), wrong))
}

/// The table lines of a successful run, after checking header and footer.
fn table(out: &str) -> Vec<Line> {
    assert!(
        out.starts_with("# nThread 1 nGpus 1 minBytes "),
        "header missing:\n{out}"
    );
    assert!(out.contains("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong"), "column header missing:\n{out}");
    assert!(
        out.contains("# Out of bounds values : 0 OK"),
        "footer missing or failed:\n{out}"
    );
    let avg = out
        .lines()
        .find_map(|l| l.strip_prefix("# Avg bus bandwidth    : "))
        .unwrap_or_else(|| panic!("no average line:\n{out}"));
    assert!(avg.trim().parse::<f64>().is_ok(), "bad average '{avg}'");
    out.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(f.len(), 13, "not 13 columns: {line}");
            let l = Line {
                size: f[0].parse().unwrap_or_else(|_| panic!("bad size: {line}")),
                count: f[1].parse().unwrap_or_else(|_| panic!("bad count: {line}")),
                dtype: f[2].to_string(),
                redop: f[3].to_string(),
                root: f[4].parse().unwrap_or_else(|_| panic!("bad root: {line}")),
                oop: mode(&f[5..9], line)
                    .unwrap_or_else(|| panic!("no out-of-place numbers: {line}")),
                ip: mode(&f[9..13], line),
            };
            for m in std::iter::once(l.oop).chain(l.ip) {
                assert!(m.0 > 0.0, "time must be positive: {line}");
                assert_eq!(m.3, 0, "wrong elements: {line}");
            }
            l
        })
        .collect()
}

/// Runs `args` + the quick sizes on `np` ranks; expects success and four sane lines.
fn quick(np: usize, args: &[&str]) -> Vec<Line> {
    let np_s = np.to_string();
    let mut all = vec!["-np", &np_s];
    all.extend_from_slice(args);
    all.extend_from_slice(QUICK);
    let o = run(&all);
    let (out, err) = text(&o);
    assert_eq!(
        o.status.code(),
        Some(0),
        "qccl-perf {all:?} failed\nstdout:\n{out}\nstderr:\n{err}"
    );
    let lines = table(&out);
    assert_eq!(lines.len(), NOMINAL.len(), "{out}");
    assert_eq!(
        out.matches("#  Rank ").count(),
        np,
        "one device line per rank:\n{out}"
    );
    for (l, nominal) in lines.iter().zip(NOMINAL) {
        // Partitioned collectives round down to a multiple of the rank count.
        assert!(
            l.size <= nominal && l.size + 8 * np as u64 > nominal,
            "size {} for {nominal}",
            l.size
        );
        assert!(l.count > 0);
    }
    lines
}

fn coll(name: &str, has_op: bool, rooted: bool, in_place: bool) {
    for np in [2, 3] {
        let root = (np - 1).to_string();
        for l in quick(np, &["-C", name, "-r", &root]) {
            assert_eq!(l.dtype, "float");
            assert_eq!(l.redop, if has_op { "sum" } else { "none" });
            assert_eq!(l.root, if rooted { np as i64 - 1 } else { -1 });
            assert_eq!(l.ip.is_some(), in_place, "in-place columns of {name}");
        }
    }
}

#[test]
fn allreduce() {
    coll("allreduce", true, false, true);
}
#[test]
fn reduce_scatter() {
    coll("reduce_scatter", true, false, true);
}
#[test]
fn all_gather() {
    coll("all_gather", false, false, true);
}
#[test]
fn broadcast() {
    coll("broadcast", false, true, true);
}
#[test]
fn reduce() {
    coll("reduce", true, true, true);
}
#[test]
fn alltoall() {
    coll("alltoall", false, false, false);
}
#[test]
fn sendrecv() {
    coll("sendrecv", false, false, false);
}
#[test]
fn gather() {
    coll("gather", false, true, false);
}
#[test]
fn scatter() {
    coll("scatter", false, true, false);
}

#[test]
fn every_datatype_all_reduce() {
    let types = [
        ("float", "float"),
        ("half", "half"),
        ("bfloat16", "bfloat16"),
        ("double", "double"),
        ("int8", "int8"),
        ("uint8", "uint8"),
        ("int32", "int32"),
        ("uint32", "uint32"),
        ("int64", "int64"),
        ("uint64", "uint64"),
        // nccl-tests aliases
        ("float16", "half"),
        ("bf16", "bfloat16"),
        ("int", "int32"),
    ];
    for (arg, shown) in types {
        for l in quick(2, &["-d", arg]) {
            assert_eq!(l.dtype, shown);
        }
    }
}

#[test]
fn every_op_and_algo() {
    for op in ["sum", "prod", "min", "max", "avg"] {
        quick(3, &["-o", op, "-d", "bf16"]);
    }
    for algo in ["ring", "tree", "sra"] {
        quick(3, &["-A", algo]);
    }
}

#[test]
fn json_output() {
    let path = std::env::temp_dir().join(format!("qccl-perf-test-{}.json", std::process::id()));
    let p = path.to_str().unwrap();
    quick(2, &["-J", p]);
    let json = std::fs::read_to_string(&path).expect("JSON file written");
    let _ = std::fs::remove_file(&path);
    assert!(json.contains("\"results\""), "{json}");
    assert!(json.contains("\"nranks\": 2"), "{json}");
    assert!(json.contains("\"collective\": \"all_reduce\""), "{json}");
    assert_eq!(json.matches("\"size\": ").count(), NOMINAL.len(), "{json}");
    assert_eq!(json.matches("\"busbw\": ").count(), NOMINAL.len(), "{json}");
    assert!(json.contains("\"size\": 65536, \"count\": 16384"), "{json}");
}

#[test]
fn program_name_selects_the_collective() {
    let o = Command::new(BIN)
        .arg0("all_gather_perf")
        .args(["-np", "2"])
        .args(QUICK)
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    assert!(
        out.contains("# Collective test concluded: all_gather_perf"),
        "{out}"
    );
    assert_eq!(table(&out)[0].redop, "none");
}

#[test]
fn single_rank_without_launcher() {
    let o = Command::new(BIN)
        .args(QUICK)
        .env_remove("QCCL_RANK")
        .env_remove("QCCL_WORLD_SIZE")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("OMPI_COMM_WORLD_RANK")
        .env_remove("OMPI_COMM_WORLD_SIZE")
        .env_remove("PMI_RANK")
        .env_remove("PMI_SIZE")
        .env_remove("SLURM_PROCID")
        .env_remove("SLURM_NTASKS")
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    assert_eq!(table(&out).len(), 4);
}

#[test]
fn errors_exit_2() {
    for args in [
        &["-C", "bogus"][..],
        &["-b", "2M", "-e", "1M"],
        &["-o", "avg", "-d", "int32"],
        &["-np", "2", "-C", "reduce", "-r", "2"],
    ] {
        let o = run(args);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}\n{out}\n{err}");
        assert!(err.starts_with("qccl-perf: "), "{err}");
    }
    let o = run(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    assert!(text(&o).0.contains("-np"));
}

#[test]
fn timeout_kills_the_ranks() {
    let t = std::time::Instant::now();
    let o = run(&[
        "-np", "2", "-b", "8M", "-e", "8M", "-n", "100000", "-c", "0", "-T", "1",
    ]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("timed out after"), "{err}");
    assert!(t.elapsed().as_secs() < 30);
}

#[test]
fn time_targeted_iterations_still_check_every_size() {
    // -S sizes the iteration count from one call (the slowest rank's), like the peers do.
    for l in quick(3, &["-S", "0.002"]) {
        assert_eq!(l.oop.3, 0, "{l:?}");
        assert_eq!(l.ip.map_or(0, |ip| ip.3), 0, "{l:?}");
    }
    let o = run(&["-np", "2", "-S", "0", "-b", "1K", "-e", "1K"]);
    assert_eq!(o.status.code(), Some(2), "a zero target is refused");
}
