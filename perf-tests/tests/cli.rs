//! Runs the built qccl-perf binary as a user would: `-np 2` and `-np 3` for every collective,
//! every datatype, JSON, CSV and SVG output, program names, nccl-tests' letters and the hints
//! for retired ones, failure exit codes, and compressed all-reduce (`-Z`) with its extra
//! columns, and the HiTopKComm collectives (`--coll hitopk`, `naiveag`, `treear`, `2dtar`)
//! with theirs.

use qccl_planner::JsonFile;
use serde_json::Value as Json;
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
    rows(out, 0).into_iter().map(|(l, _)| l).collect()
}

/// The table lines of a successful run with `extra` columns after nccl-tests' 13 (and those
/// columns' fields), after checking header and footer.
fn rows(out: &str, extra: usize) -> Vec<(Line, Vec<String>)> {
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
            assert_eq!(f.len(), 13 + extra, "not {} columns: {line}", 13 + extra);
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
            (l, f[13..].iter().map(|x| x.to_string()).collect())
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
        for l in quick(np, &["--coll", name, "-r", &root]) {
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
    for algo in ["ring", "tree", "sra", "allgather"] {
        quick(3, &["-A", algo]);
    }
}

/// The JSON document of `path` (removed), parsed.
fn read_json(path: &std::path::Path) -> Json {
    let json = std::fs::read_to_string(path).expect("JSON file written");
    let _ = std::fs::remove_file(path);
    serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}:\n{json}"))
}

/// `key` of a JSON object as a number.
fn num(v: &Json, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key}: not a number in {v}"))
}

#[test]
fn json_output() {
    let path = temp_file("out.json");
    let p = path.to_str().unwrap();
    quick(2, &["-J", p]);
    let doc = read_json(&path);
    assert!(
        doc.get("codec").is_none(),
        "no codec fields without -Z: {doc}"
    );
    assert_eq!(doc["tool"], "qccl-perf");
    assert_eq!(doc["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(doc["nranks"], 2);
    assert_eq!(doc["collective"], "all_reduce");
    assert_eq!(doc["time_stat"], "avg", "-a defaults to 1, as nccl-tests");
    let results = doc["results"].as_array().expect("results");
    assert_eq!(results.len(), NOMINAL.len(), "{doc}");
    for (r, size) in results.iter().zip(NOMINAL) {
        assert_eq!(r["size"], size, "{r}");
        assert_eq!(r["count"], size / 4, "{r}");
        assert!(
            num(r, "busbw") > 0.0 && num(r, "inplace_busbw") > 0.0,
            "{r}"
        );
        assert!(
            r.get("wire_sent").is_none() && r.get("cycle").is_none(),
            "{r}"
        );
    }
    // The long name nccl-tests gives -J works too.
    quick(2, &["--output_file", p]);
    assert_eq!(
        read_json(&path)["results"].as_array().map(Vec::len),
        Some(4)
    );
}

/// Checks that `doc` is well-formed XML (one root element, tags nested and closed, attribute
/// values quoted, only XML's own entities); returns the element names in document order.
fn xml_elements(doc: &str) -> Vec<String> {
    let body = doc
        .strip_prefix("<?xml")
        .and_then(|d| d.split_once("?>"))
        .map_or(doc, |(_, rest)| rest);
    let mut open: Vec<String> = Vec::new();
    let mut names = Vec::new();
    let mut rest = body;
    let mut roots = 0;
    let check_text = |t: &str| {
        for (i, _) in t.match_indices('&') {
            let ent = &t[i..t[i..].find(';').map_or(t.len(), |j| i + j + 1)];
            assert!(
                ["&amp;", "&lt;", "&gt;", "&quot;", "&apos;"].contains(&ent),
                "bad entity {ent:?}"
            );
        }
        assert!(
            !t.contains('<') && !t.contains('>'),
            "stray bracket in {t:?}"
        );
    };
    while let Some(start) = rest.find('<') {
        check_text(&rest[..start]);
        let end = rest[start..].find('>').expect("unclosed tag") + start;
        let tag = &rest[start + 1..end];
        rest = &rest[end + 1..];
        if let Some(name) = tag.strip_prefix('/') {
            assert_eq!(
                open.pop().as_deref(),
                Some(name.trim()),
                "mismatched </{name}>"
            );
            continue;
        }
        let self_closing = tag.ends_with('/');
        let tag = tag.trim_end_matches('/');
        let (name, attrs) = tag.split_once(char::is_whitespace).unwrap_or((tag, ""));
        assert!(
            !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'),
            "bad element name {name:?}"
        );
        // name="value" pairs, values free of quotes and brackets.
        let mut a = attrs.trim();
        while !a.is_empty() {
            let (k, v) = a
                .split_once("=\"")
                .unwrap_or_else(|| panic!("bad attributes {attrs:?}"));
            assert!(
                !k.trim().is_empty() && !k.contains(['"', ' ']),
                "bad attribute {k:?}"
            );
            let (val, more) = v
                .split_once('"')
                .unwrap_or_else(|| panic!("unquoted in {attrs:?}"));
            check_text(val);
            a = more.trim_start();
        }
        if open.is_empty() {
            roots += 1;
        }
        names.push(name.to_string());
        if !self_closing {
            open.push(name.to_string());
        }
    }
    check_text(rest.trim());
    assert!(open.is_empty(), "unclosed elements {open:?}");
    assert_eq!(roots, 1, "one root element");
    names
}

#[test]
fn csv_and_plot_output() {
    let (csv, svg, json) = (temp_file("t.csv"), temp_file("t.svg"), temp_file("t.json"));
    let (c, v, j) = (
        csv.to_str().unwrap(),
        svg.to_str().unwrap(),
        json.to_str().unwrap(),
    );
    quick(2, &["--csv", c, "--plot", v, "-J", j]);
    let doc = read_json(&json);
    let table = std::fs::read_to_string(&csv).expect("CSV written");
    let _ = std::fs::remove_file(&csv);
    let lines: Vec<Vec<&str>> = table.lines().map(|l| l.split(',').collect()).collect();
    assert_eq!(lines.len(), 1 + NOMINAL.len(), "{table}");
    let head = &lines[0];
    assert_eq!(
        head[..8],
        [
            "collective",
            "nranks",
            "size",
            "count",
            "type",
            "redop",
            "root",
            "algo"
        ],
        "{table}"
    );
    let col = |name: &str| {
        head.iter()
            .position(|h| *h == name)
            .unwrap_or_else(|| panic!("no column {name}: {table}"))
    };
    // Every line holds what the JSON's result object holds.
    for (l, r) in lines[1..].iter().zip(doc["results"].as_array().unwrap()) {
        assert_eq!(l.len(), head.len(), "{table}");
        assert_eq!((l[0], l[1]), ("all_reduce", "2"), "{table}");
        for key in [
            "size",
            "count",
            "busbw",
            "inplace_busbw",
            "time_us",
            "wrong",
        ] {
            let want = num(r, key);
            let got: f64 = l[col(key)].parse().unwrap();
            assert_eq!(got, want, "{key}: {table}");
        }
    }
    // -J infers CSV from the suffix, as nccl-tests infers the type.
    let csv2 = temp_file("j.csv");
    quick(2, &["-J", csv2.to_str().unwrap()]);
    let text2 = std::fs::read_to_string(&csv2).expect("CSV written by -J");
    let _ = std::fs::remove_file(&csv2);
    assert!(text2.starts_with("collective,nranks,size,"), "{text2}");
    assert_eq!(text2.lines().count(), 1 + NOMINAL.len());

    let plot = std::fs::read_to_string(&svg).expect("SVG written");
    let _ = std::fs::remove_file(&svg);
    let elements = xml_elements(&plot);
    assert_eq!(elements[0], "svg", "{plot}");
    // One line per series: out of place and in place.
    assert_eq!(
        elements.iter().filter(|e| *e == "polyline").count(),
        2,
        "{plot}"
    );
    assert_eq!(
        elements.iter().filter(|e| *e == "circle").count(),
        2 * NOMINAL.len(),
        "{plot}"
    );
    for label in ["out-of-place", "in-place", "1K", "64K", "busbw (GB/s)"] {
        assert!(plot.contains(&format!(">{label}<")), "no {label}: {plot}");
    }
    // A type and op per series with -d all: alltoall has no in-place form, so one line per
    // type.
    let o = run(&[
        "-np", "2", "-L", "alltoall", "-d", "all", "-b", "1K", "-e", "4K", "-f", "4", "-n", "1",
        "-T", "120", "--plot", v,
    ]);
    assert_eq!(o.status.code(), Some(0), "{:?}", text(&o));
    let plot = std::fs::read_to_string(&svg).expect("SVG written");
    let _ = std::fs::remove_file(&svg);
    let elements = xml_elements(&plot);
    assert_eq!(
        elements.iter().filter(|e| *e == "polyline").count(),
        10,
        "{plot}"
    );
    assert!(plot.contains(">out-of-place bfloat16<"), "{plot}");
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
        &["--coll", "bogus"][..],
        &["-b", "2M", "-e", "1M"],
        &["-o", "avg", "-d", "int32"],
        &["-np", "2", "--coll", "reduce", "-r", "2"],
        &["-X", "1"],
        &["-t", "2"],
    ] {
        let o = run(args);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}\n{out}\n{err}");
        assert!(err.starts_with("qccl-perf: "), "{err}");
    }
    let o = run(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    let help = text(&o).0;
    for needle in ["-np", "-C, --report_cputime", "-L, --coll", "Exit code"] {
        assert!(help.contains(needle), "no {needle} in --help:\n{help}");
    }
}

#[test]
fn version() {
    for (bin, name) in [(BIN, "qccl-perf"), (PLAN_BIN, "qccl-plan")] {
        let o = Command::new(bin).arg("--version").output().unwrap();
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
        assert_eq!(out.trim(), format!("{name} {}", env!("CARGO_PKG_VERSION")));
    }
}

#[test]
fn retired_short_spellings_print_a_one_line_hint() {
    for (args, want) in [
        (
            &["-C", "allreduce"][..],
            "qccl-perf: -C now means --report_cputime 0/1 (nccl-tests); use --coll allreduce (or \
             -L allreduce)",
        ),
        (
            &["-np", "2", "-C", "hitopk", "-D", "0.01"],
            "qccl-perf: -C now means --report_cputime 0/1 (nccl-tests); use --coll hitopk (or -L \
             hitopk)",
        ),
        (
            &["-L", "hitopk", "-D", "0.01"],
            "qccl-perf: -D now means --device_implementation 0 (nccl-tests); use --density 0.01 \
             (or -k 0.01)",
        ),
        (
            &["-S", "0.3"],
            "qccl-perf: -S now means --report_timestamps 0/1 (nccl-tests); use --target-secs 0.3 \
             (or -s 0.3)",
        ),
    ] {
        let o = run(args);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}\n{out}\n{err}");
        assert_eq!(err, format!("{want}\n"), "{args:?}");
        assert!(out.is_empty(), "{args:?}: {out}");
    }
    // A nonzero integer -D is nccl-tests' device implementation: refused, with the way to the
    // density.
    let o = run(&["-L", "hitopk", "-D", "1"]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.lines().next().unwrap().contains("--density 1"), "{err}");
}

/// The table lines of `out` split into fields (no header or footer lines).
fn fields(out: &str) -> Vec<Vec<String>> {
    out.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().map(String::from).collect())
        .collect()
}

#[test]
fn nccl_tests_letters_mean_what_they_mean_there() {
    // -C 1 cputime, -S 1 timestamps, -I 1 -K 1 per-iteration report, -M 1 memory, -N 2 two
    // cycles, -u 1 unaligned buffers, -a 3 max, -G 1 accepted without effect, -D 0 accepted.
    let path = temp_file("letters.json");
    let p = path.to_str().unwrap();
    let o = run(&[
        "-np", "2", "-b", "1K", "-e", "16K", "-f", "4", "-n", "4", "-c", "2", "-T", "120", "-C",
        "1", "-S", "1", "-I", "1", "-K", "1", "-M", "1", "-N", "2", "-u", "1", "-a", "3", "-G",
        "1", "-D", "0", "-J", p,
    ]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    assert!(out.contains("validation: 2 graph: 0 unalign: 1"), "{out}");
    assert!(
        out.contains("cputime = rank 0's own mean time per call"),
        "{out}"
    );
    assert!(
        out.contains("# run cycles: the table runs 2 times (-N)"),
        "{out}"
    );
    assert!(
        out.contains("# Per-Iteration Report: host timing; i_* uses max over ranks; summary skips first 1 iterations"),
        "{out}"
    );
    assert!(
        out.contains("# accepted, no effect on host memory: -G 1"),
        "{out}"
    );
    assert!(
        out.contains(
            "  cputime   algbw   busbw #wrong    i_min    i_max    i_p99    i_cv%  cputime"
        ),
        "{out}"
    );
    assert!(out.contains("i_cv%  timestamp"), "{out}");
    let mem = out
        .lines()
        .find(|l| l.starts_with("# Host memory usage    : User-Allocated "))
        .unwrap_or_else(|| panic!("no memory line:\n{out}"));
    assert!(
        mem.contains("| Peak RSS ") && mem.ends_with("(max over ranks)"),
        "{mem}"
    );
    let lines = fields(&out);
    // Two cycles of 1K 4K 16K; each line: 5 + 2 x (4 + 4) + the timestamp's 2 fields.
    assert_eq!(lines.len(), 6, "{out}");
    for f in &lines {
        assert_eq!(f.len(), 23, "{f:?}");
        assert_eq!((f[8].as_str(), f[16].as_str()), ("0", "0"), "#wrong: {f:?}");
        let stats: Vec<f64> = f[9..13].iter().map(|x| x.parse().unwrap()).collect();
        assert!(
            stats[0] > 0.0 && stats[0] <= stats[1] && stats[2] <= stats[1],
            "{f:?}"
        );
        assert!(f[21].len() == 10 && f[22].len() == 8, "timestamp: {f:?}");
    }
    let doc = read_json(&path);
    assert_eq!(
        (&doc["time_stat"], &doc["report_cputime"]),
        (&"max".into(), &true.into())
    );
    let results = doc["results"].as_array().unwrap();
    assert_eq!(results.len(), 6);
    for (i, r) in results.iter().enumerate() {
        assert_eq!(r["cycle"], i as u64 / 3, "{r}");
        assert!(
            num(r, "cpu_time_us") > 0.0 && num(r, "inplace_cpu_time_us") > 0.0,
            "{r}"
        );
        let it = &r["per_iter"];
        assert_eq!(it["times_us"].as_array().map(Vec::len), Some(4), "{r}");
        assert_eq!(it["skipped_iterations"], 1, "{r}");
        assert!(num(it, "min_us") <= num(it, "p50_us") && num(it, "p50_us") <= num(it, "max_us"));
        assert!(r["inplace_per_iter"].is_object(), "{r}");
        assert!(
            r["timestamp"].as_str().is_some_and(|t| t.len() == 19),
            "{r}"
        );
    }
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
    // --target-secs sizes the iteration count from one call (the slowest rank's), like the
    // peers do.
    for l in quick(3, &["--target-secs", "0.002"]) {
        assert_eq!(l.oop.3, 0, "{l:?}");
        assert_eq!(l.ip.map_or(0, |ip| ip.3), 0, "{l:?}");
    }
    for l in quick(2, &["-s", "0.002"]) {
        assert_eq!(l.oop.3, 0, "{l:?}");
    }
    let o = run(&["-np", "2", "--target-secs", "0", "-b", "1K", "-e", "1K"]);
    assert_eq!(o.status.code(), Some(2), "a zero target is refused");
}

/// `-Z` run on `np` ranks over 4K 16K 64K, checked, with JSON: exits 0 with #wrong 0; returns
/// each line's (nccl-tests columns, wire bytes, ratio, relerr) and the parsed JSON.
fn codec_run(np: usize, args: &[&str]) -> (Vec<(Line, u64, f64, f64)>, Json) {
    let path = std::env::temp_dir().join(format!(
        "qccl-perf-codec-{}-{np}-{}.json",
        std::process::id(),
        args.join("_").replace([':', '=', ','], "-")
    ));
    let np_s = np.to_string();
    let mut all = vec!["-np", &np_s];
    all.extend_from_slice(args);
    all.extend_from_slice(&[
        "-b", "4K", "-e", "64K", "-f", "4", "-n", "2", "-w", "1", "-c", "1", "-T", "120", "-J",
    ]);
    all.push(path.to_str().unwrap());
    let o = run(&all);
    let (out, err) = text(&o);
    assert_eq!(
        o.status.code(),
        Some(0),
        "qccl-perf {all:?} failed\nstdout:\n{out}\nstderr:\n{err}"
    );
    assert!(
        out.contains("wire(B)   ratio    relerr"),
        "codec columns missing:\n{out}"
    );
    let lines: Vec<_> = rows(&out, 3)
        .into_iter()
        .map(|(l, x)| {
            let wire = x[0].parse().unwrap_or_else(|_| panic!("wire(B) {x:?}"));
            let ratio = x[1].parse().unwrap_or_else(|_| panic!("ratio {x:?}"));
            let relerr = x[2].parse().unwrap_or_else(|_| panic!("relerr {x:?}"));
            (l, wire, ratio, relerr)
        })
        .collect();
    assert_eq!(lines.len(), 3, "{out}");
    let doc = read_json(&path);
    assert_eq!(doc["wrong"], 0, "{doc}");
    (lines, doc)
}

#[test]
fn codec_fp16_checked_on_2_and_3_ranks() {
    for np in [2, 3] {
        let (lines, doc) = codec_run(np, &["-Z", "fp16"]);
        for (l, wire, ratio, relerr) in &lines {
            let dbg = format!("np {np}: {l:?} wire {wire} ratio {ratio} relerr {relerr}");
            assert_eq!(
                (l.dtype.as_str(), l.redop.as_str()),
                ("float", "sum"),
                "{dbg}"
            );
            // fp16 halves float's bytes; each chunk's header costs a little at 4K.
            assert!(*ratio > 1.8 && *ratio <= 2.0, "{dbg}");
            let dense = l.size as f64 * 2.0 * (np as f64 - 1.0) / np as f64;
            assert!((dense / *wire as f64 - ratio).abs() < 0.05, "{dbg}");
            // The inputs are not integers, so fp16 rounds: an error, but a small one.
            assert!(*relerr > 0.0 && *relerr < 1e-2, "{dbg}");
        }
        assert_eq!(doc["codec"], "fp16");
        assert_eq!(num(&doc, "codec_error_bound"), 1.0 / 2048.0);
        assert!(doc["codec_wrong_rule"].is_string(), "{doc}");
        let results = doc["results"].as_array().expect("results");
        assert_eq!(results.len(), 3);
        for (r, (l, wire, ratio, relerr)) in results.iter().zip(&lines) {
            assert_eq!(r["size"], l.size);
            assert_eq!(r["wrong"], 0);
            assert_eq!(r["wire_sent"], *wire);
            // Symmetric schedule: every rank receives what it sends.
            assert_eq!(r["wire_received"], *wire);
            assert!((num(r, "ratio") - ratio).abs() < 0.051, "{r}");
            assert!((num(r, "rel_err") / relerr - 1.0).abs() < 0.06, "{r}");
            assert_eq!(r["algo"], "sra", "auto is SRA for a dense codec: {r}");
        }
    }
}

#[test]
fn codec_bf16_avg_half_and_forced_schedules() {
    // 16-bit data through a 16-bit codec moves as many bytes as plain half.
    let (lines, doc) = codec_run(3, &["-Z", "bf16", "-o", "avg", "-d", "half", "-A", "ring"]);
    for (l, _, ratio, relerr) in &lines {
        assert_eq!((l.dtype.as_str(), l.redop.as_str()), ("half", "avg"));
        assert!(*ratio > 0.9 && *ratio <= 1.0, "{l:?} {ratio}");
        assert!(*relerr > 0.0 && *relerr < 2e-2, "{l:?} {relerr}");
    }
    let results = doc["results"].as_array().expect("results");
    assert!(results.iter().all(|r| r["algo"] == "ring"), "{doc}");
    codec_run(2, &["-Z", "fp16", "-A", "allgather"]);
}

#[test]
fn codec_errors_exit_2_naming_the_problem() {
    for (args, needles) in [
        (&["-Z", "bogus"][..], &["-Z", "unknown codec \"bogus\""][..]),
        (&["-Z", "fp16:level=3"], &["-Z", "level"]),
        (
            &["-Z", "fp16", "--coll", "broadcast"],
            &["-Z fp16", "--coll broadcast"],
        ),
        (
            &["-Z", "fp16", "-d", "int32"],
            &["-Z fp16 -d int32", "floating-point"],
        ),
        (&["-Z", "fp16", "-o", "min"], &["-o min", "sum and avg"]),
    ] {
        let mut all = vec!["-np", "2"];
        all.extend_from_slice(args);
        let o = run(&all);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}\n{out}\n{err}");
        let first = err.lines().next().unwrap_or("");
        assert!(first.starts_with("qccl-perf: "), "{err}");
        for n in needles {
            assert!(first.contains(n), "{args:?}: {first}");
        }
    }
}

/// One line of a top-k collective's table: nccl-tests' columns, then wire(B), ratio, relerr
/// and (hitopk) the four step times.
#[derive(Debug)]
struct TopKLine {
    l: Line,
    wire: u64,
    relerr: f64,
    steps: Option<[f64; 4]>,
}

/// `-C coll` on `np` ranks over the quick sizes (1K..64K, `-c 1`), with JSON: exits 0 with
/// #wrong 0 (checked by `rows`); returns the parsed lines and JSON.
fn topk_run(np: usize, coll: &str, args: &[&str]) -> (Vec<TopKLine>, Json) {
    let path = std::env::temp_dir().join(format!(
        "qccl-perf-topk-{}-{np}-{coll}-{}.json",
        std::process::id(),
        args.join("_")
    ));
    let np_s = np.to_string();
    let mut all = vec!["-np", &np_s, "--coll", coll];
    all.extend_from_slice(args);
    all.extend_from_slice(QUICK);
    all.extend_from_slice(&["-J", path.to_str().unwrap()]);
    let o = run(&all);
    let (out, err) = text(&o);
    assert_eq!(
        o.status.code(),
        Some(0),
        "qccl-perf {all:?} failed\nstdout:\n{out}\nstderr:\n{err}"
    );
    let hitopk = coll == "hitopk";
    assert_eq!(
        out.contains("wire(B)   ratio    relerr       rs     topk   ag+add       ag"),
        hitopk,
        "step columns for hitopk only:\n{out}"
    );
    assert!(out.contains("wire(B)   ratio    relerr"), "{out}");
    assert!(
        out.contains(&format!("# Collective test concluded: {coll}_perf")),
        "{out}"
    );
    if hitopk {
        assert!(
            out.contains("MEAN over ranks"),
            "the header says how steps combine:\n{out}"
        );
    }
    let lines: Vec<TopKLine> = rows(&out, if hitopk { 7 } else { 3 })
        .into_iter()
        .map(|(l, x)| {
            let f = |i: usize| -> f64 {
                x[i].parse()
                    .unwrap_or_else(|_| panic!("column {} of {x:?}", 13 + i))
            };
            assert_eq!((l.redop.as_str(), l.root), ("sum", -1), "{l:?}");
            assert!(l.ip.is_some(), "in-place columns: {l:?}");
            TopKLine {
                wire: x[0].parse().unwrap_or_else(|_| panic!("wire(B) {x:?}")),
                relerr: f(2),
                steps: hitopk.then(|| [f(3), f(4), f(5), f(6)]),
                l,
            }
        })
        .collect();
    assert_eq!(lines.len(), NOMINAL.len(), "{out}");
    let doc = read_json(&path);
    assert_eq!(doc["wrong"], 0, "{doc}");
    assert_eq!(doc["collective"], coll);
    assert_eq!(doc["scheme"], coll);
    assert!(doc["topk_wrong_rule"].is_string(), "{doc}");
    let results = doc["results"].as_array().expect("results");
    assert_eq!(results.len(), lines.len(), "{doc}");
    for (r, t) in results.iter().zip(&lines) {
        assert_eq!(r["size"], t.l.size, "{r}");
        assert_eq!(r["wire_sent"], t.wire, "{r}");
        assert!(num(r, "wire_received") > 0.0, "{r}");
        assert!(r["k"].as_u64().is_some(), "{r}");
        assert!(num(r, "rel_err").is_finite(), "{r}");
        let names = ["rs_us", "topk_us", "ag_add_us", "ag_us", "scatter_add_us"];
        match t.steps {
            Some(steps) => {
                for (name, shown) in names.iter().zip(steps) {
                    let v = num(r, name);
                    assert!(v >= 0.0, "{name} {r:?}");
                    // The table rounds to 2 decimals (fewer above 100 us).
                    assert!(
                        (v - shown).abs() <= 0.05 + v * 1e-3,
                        "{name} {v} vs {shown}"
                    );
                }
                assert!(
                    num(r, "scatter_add_us") <= num(r, "ag_add_us") + 1e-3,
                    "{r}"
                );
            }
            None => {
                for name in names {
                    assert_eq!(r.get(name), Some(&Json::Null), "{name}: {r}");
                }
            }
        }
    }
    (lines, doc)
}

/// The sparse schemes on 2 and 4 ranks (one emulated host: HiTopK is an intra reduce-scatter,
/// a local top-k and an all-gather): finite outputs, an error that a 1% top-k must show,
/// the density in the JSON.
fn topk_sparse(coll: &str) {
    for np in [2, 4] {
        let (lines, doc) = topk_run(np, coll, &[]);
        assert_eq!(num(&doc, "density"), 0.01);
        assert_eq!(doc["error_feedback"], true);
        assert_eq!(doc.get("steps_stat").is_some(), coll == "hitopk", "{doc:?}");
        for t in &lines {
            assert_eq!(t.l.dtype, "float");
            assert!(t.wire > 0, "{t:?}");
            // Most elements are dropped: far from exact, but no worse than all zeros (1.0).
            assert!(t.relerr > 0.1 && t.relerr <= 1.0, "{t:?}");
            if let Some(steps) = t.steps {
                assert!(steps.iter().all(|s| *s >= 0.0), "{t:?}");
            }
        }
    }
}

#[test]
fn hitopk() {
    topk_sparse("hitopk");
    // A 16-bit type and a larger density: more of the sum survives.
    let (lines, doc) = topk_run(2, "hitopk", &["-d", "bf16", "--density", "0.5"]);
    assert_eq!(num(&doc, "density"), 0.5);
    for t in &lines {
        assert_eq!(t.l.dtype, "bfloat16");
        assert!(t.relerr < 0.9, "{t:?}");
    }
}

#[test]
fn naiveag() {
    topk_sparse("naiveag");
}

/// The dense baselines: exact sums (checked as all_reduce), relerr 0, no density.
fn topk_dense(coll: &str) {
    for np in [2, 4] {
        let (lines, doc) = topk_run(np, coll, &["-k", "0.01"]);
        assert_eq!(doc.get("density"), Some(&Json::Null), "{doc}");
        assert_eq!(doc["error_feedback"], false);
        for t in &lines {
            assert!(t.wire > 0, "{t:?}");
            assert_eq!(t.relerr, 0.0, "{t:?}");
            assert!(t.steps.is_none());
        }
    }
}

#[test]
fn treear() {
    topk_dense("treear");
}

#[test]
fn twodtar() {
    topk_dense("2dtar");
}

#[test]
fn topk_program_name() {
    let o = Command::new(BIN)
        .arg0("2dtar_perf")
        .args(["-np", "2"])
        .args(QUICK)
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    assert!(
        out.contains("# Collective test concluded: 2dtar_perf"),
        "{out}"
    );
    assert_eq!(rows(&out, 3).len(), NOMINAL.len());
}

#[test]
fn topk_errors_exit_2_naming_the_problem() {
    for (args, needles) in [
        (
            &["--coll", "hitopk", "--density", "0"][..],
            &["--density 0", "(0, 1]"][..],
        ),
        (
            &["--coll", "hitopk", "--density", "1.01"],
            &["--density 1.01", "(0, 1]"],
        ),
        (&["-L", "naiveag", "-k", "-1"], &["--density -1", "(0, 1]"]),
        (&["-L", "hitopk", "-k", "inf"], &["--density inf", "(0, 1]"]),
        (&["-L", "hitopk", "-k", "1%"], &["--density", "'1%'"]),
        (&["-k", "0.01"], &["--density 0.01", "--coll all_reduce"]),
        (
            &["--coll", "allreduce", "--density", "0.5"],
            &["--density 0.5", "--coll all_reduce"],
        ),
        (
            &["-L", "all_gather", "-k", "0.5"],
            &["--density 0.5", "--coll all_gather"],
        ),
        (
            &["-L", "hitopk", "-Z", "fp16"],
            &["-Z fp16", "--coll hitopk"],
        ),
        (
            &["-L", "treear", "-A", "ring"],
            &["-A ring", "--coll treear"],
        ),
        (&["-L", "2dtar", "-o", "max"], &["-o max", "sum"]),
        (
            &["-L", "hitopk", "-d", "int32"],
            &["-d int32", "floating-point"],
        ),
    ] {
        let mut all = vec!["-np", "2"];
        all.extend_from_slice(args);
        let o = run(&all);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}\n{out}\n{err}");
        let first = err.lines().next().unwrap_or("");
        assert!(first.starts_with("qccl-perf: "), "{err}");
        for n in needles {
            assert!(first.contains(n), "{args:?}: {first}");
        }
    }
}

/// Network namespaces that exist now.
fn namespaces() -> Vec<String> {
    Command::new("ip")
        .args(["netns", "list"])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter_map(|l| l.split_whitespace().next().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

const EMUCLUSTER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/emucluster");

/// The emulated-cluster tests run one at a time: each checks that no namespace is left behind.
static EMUCLUSTER_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Whether `sh -c c` succeeds.
fn sh(c: &str) -> bool {
    Command::new("sh")
        .args(["-c", c])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Whether emucluster can run here (root, iproute2, network namespaces).
fn emucluster_usable() -> bool {
    sh("test \"$(id -u)\" = 0") && sh("command -v ip && command -v tc") && sh("ip netns list")
}

/// The emulated cluster (`perf-tests/emucluster`): 2 network-namespace "hosts" × 2 ranks over a
/// rate-limited bridge, qccl-perf checked, dense and with a codec. Needs root and iproute2;
/// where they are missing the script must say so and exit 2 (checked instead).
#[test]
fn emulated_cluster_2_hosts_x_2_ranks() {
    let _one = EMUCLUSTER_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let script = EMUCLUSTER;
    let usable = emucluster_usable();
    let emucluster = |codec: Option<&str>| {
        let mut c = Command::new(script);
        c.args([
            "-H", "2", "-R", "2", "--rate", "1gbit", "-T", "120", "--", BIN,
        ]);
        c.args(QUICK);
        if let Some(z) = codec {
            c.args(["-Z", z]);
        }
        c.output().expect("run emucluster")
    };
    if !usable {
        let o = emucluster(None);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains("needs"), "{err}");
        eprintln!("emulated cluster not available here: {err}");
        return;
    }
    let before = namespaces();
    for codec in [None, Some("qsgd:bits=4,bucket=128")] {
        let o = emucluster(codec);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(0), "{codec:?}\n{out}\n{err}");
        let lines = rows(&out, if codec.is_some() { 3 } else { 0 });
        assert_eq!(lines.len(), NOMINAL.len(), "{out}");
        assert!(lines.iter().all(|(l, _)| l.oop.3 == 0), "#wrong:\n{out}");
        assert!(err.contains("2 hosts x 2 ranks"), "{err}");
    }
    let left: Vec<String> = namespaces()
        .into_iter()
        .filter(|n| !before.contains(n))
        .collect();
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
}

/// Open MPI through the emulated cluster (`emucluster --mpi`): perf-tests/peers/mpi_coll_perf.c
/// as one job of 2 hosts × 2 ranks, checked results, rank 0 on emuhost0, traffic through every
/// host's link, nothing left behind. Skipped where emucluster cannot run or Open MPI (mpicc,
/// mpirun) is missing; with root but no mpirun, --mpi must say so and exit 2.
#[test]
fn emulated_cluster_open_mpi() {
    let _one = EMUCLUSTER_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if !emucluster_usable() {
        eprintln!("emulated cluster not available here: skipped");
        return;
    }
    let emucluster = |cmd: &[&str]| {
        Command::new(EMUCLUSTER)
            .args([
                "-H", "2", "-R", "2", "--rate", "1gbit", "-T", "60", "--mpi", "--",
            ])
            .args(cmd)
            .output()
            .expect("run emucluster")
    };
    if !sh("command -v mpirun && command -v mpicc") {
        if !sh("command -v mpirun") {
            let o = emucluster(&["true"]);
            let (_, err) = text(&o);
            assert_eq!(o.status.code(), Some(2), "{err}");
            assert!(err.contains("needs mpirun"), "{err}");
        }
        eprintln!("Open MPI (mpicc, mpirun) not installed: skipped");
        return;
    }
    let exe = temp_file("mpi_coll_perf");
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/peers/mpi_coll_perf.c");
    let o = Command::new("mpicc")
        .args(["-O2", "-o", exe.to_str().unwrap(), src])
        .output()
        .expect("run mpicc");
    assert!(o.status.success(), "mpicc: {:?}", text(&o));
    let before = namespaces();
    let o = emucluster(&[
        exe.to_str().unwrap(),
        "-b",
        "4K",
        "-e",
        "1M",
        "-f",
        "16",
        "-n",
        "3",
        "-w",
        "1",
    ]);
    let _ = std::fs::remove_file(&exe);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    assert!(out.contains("nranks 4, host emuhost0"), "{out}");
    // size count type redop time algbw busbw #wrong iters
    let rows: Vec<Vec<&str>> = out
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| l.split_whitespace().collect())
        .filter(|f: &Vec<&str>| f.len() == 9)
        .collect();
    let sizes: Vec<&str> = rows.iter().map(|f| f[0]).collect();
    assert_eq!(sizes, ["4096", "65536", "1048576"], "{out}");
    assert!(rows.iter().all(|f| f[7] == "0"), "#wrong:\n{out}");
    // "... over each host's link: emuhost0 4.2/4.2, emuhost1 4.2/4.2": both directions used
    let links = err
        .lines()
        .find_map(|l| l.split_once("over each host's link: "))
        .unwrap_or_else(|| panic!("no link summary:\n{err}"))
        .1;
    let mb: Vec<f64> = links
        .split([',', ' ', '/'])
        .filter_map(|x| x.parse().ok())
        .collect();
    assert_eq!(mb.len(), 4, "{links}");
    assert!(mb.iter().all(|&m| m > 1.0), "{links}");
    let left: Vec<String> = namespaces()
        .into_iter()
        .filter(|n| !before.contains(n))
        .collect();
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
}

// ---- --calibrate and qccl-plan -----------------------------------------------------------

const PLAN_BIN: &str = env!("CARGO_BIN_EXE_qccl-plan");

/// A file name under the temp dir, unique per test process and `tag`.
fn temp_file(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("qccl-perf-test-{}-{tag}", std::process::id()))
}

fn plan_run(args: &[&str]) -> Output {
    Command::new(PLAN_BIN)
        .args(args)
        .output()
        .expect("run qccl-plan")
}

/// One row of qccl-plan's comparison: (label, groups, time in ms, chosen).
fn plan_rows(out: &str) -> Vec<(String, usize, f64, bool)> {
    out.lines()
        .filter(|l| l.starts_with("  "))
        .map(|l| {
            let (l, chosen) = match l.strip_suffix("<- chosen") {
                Some(rest) => (rest.trim_end(), true),
                None => (l, false),
            };
            let mut f = l.split_whitespace().rev();
            let ratio = f.next().unwrap_or_else(|| panic!("short row: {l}"));
            assert!(ratio.ends_with('x'), "{l}");
            let time: f64 = f.next().unwrap().parse().unwrap();
            let groups: usize = f.next().unwrap().parse().unwrap();
            let label: Vec<&str> = f.rev().collect();
            (label.join(" "), groups, time, chosen)
        })
        .collect()
}

/// Runs qccl-plan, expects success; checks the comparison (the chosen plan no slower than any
/// row, baselines present) and the plan file (a valid `Plan` for the profile and cost model,
/// simulating to the printed time). Returns stdout and the plan.
fn plan_ok(profile: &str, cost: &std::path::Path, extra: &[&str]) -> (String, qccl_planner::Plan) {
    let out_path = temp_file(&format!("plan-{profile}-{}.json", extra.join("_")));
    let mut args = vec![
        "--profile",
        profile,
        "--cost",
        cost.to_str().unwrap(),
        "--out",
        out_path.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = plan_run(&args);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "qccl-plan {args:?}\n{out}\n{err}");
    let rows = plan_rows(&out);
    let chosen: Vec<_> = rows.iter().filter(|r| r.3).collect();
    assert_eq!(chosen.len(), 1, "one chosen row:\n{out}");
    let best = chosen[0].2;
    for r in &rows {
        assert!(best <= r.2, "chosen {best} ms slower than {r:?}:\n{out}");
    }
    for label in [
        "cupcake optimal, no compression",
        "no compression, 25 MiB buckets (DDP)",
        "layer-wise compressed",
        "25 MiB buckets compressed",
        "single group compressed",
    ] {
        assert!(rows.iter().any(|r| r.0 == label), "no row {label}:\n{out}");
    }
    assert!(out.contains("# chosen: "), "{out}");
    let plan = qccl_planner::Plan::read(&out_path).expect("plan JSON reads back");
    let _ = std::fs::remove_file(&out_path);
    assert_eq!(plan.groups.len(), chosen[0].1, "{out}");
    let prof = qccl_planner::models::shipped()
        .into_iter()
        .find(|(s, _)| *s == profile)
        .map(|(_, p)| p)
        .unwrap();
    let model = qccl_planner::CostModel::read(cost).unwrap();
    let t = qccl_planner::simulate(&prof, &model, &plan).expect("plan fits profile and cost");
    assert!(
        (t.time * 1e3 - best).abs() <= 1e-4 * best.max(1.0),
        "plan simulates to {} ms, printed {best}",
        t.time * 1e3
    );
    (out, plan)
}

#[test]
fn calibrate_writes_a_cost_model_the_planner_reads() {
    use qccl_planner::CostModel;
    let path = temp_file("cost.json");
    let p = path.to_str().unwrap();
    let o = run(&[
        "-np",
        "2",
        // Unbound: the tests of this file run side by side, and bound ranks of each would
        // all sit on the same CPUs, where the kernel can no longer spread them.
        "--bind-to",
        "none",
        "--calibrate",
        "-b",
        "4K",
        "-e",
        // Up to 4 MiB: below ~1 MiB wake-up latency dominates and, on a loaded machine, the
        // fitted slope can come out flat (β clamped to 0).
        "4M",
        "-n",
        "3",
        "-T",
        "120",
        "--calibrate-out",
        p,
    ]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    assert!(out.starts_with("# qccl-perf --calibrate: 2 ranks"), "{out}");
    assert!(out.contains("6 sizes 4096..4194304 bytes"), "{out}");
    assert!(out.contains(&format!("# wrote {p}")), "{out}");
    // read() validates: every coefficient finite and >= 0, ratios > 0, default link present.
    let m = CostModel::read(&path).unwrap_or_else(|e| panic!("{e}\n{out}"));
    let (transport, algo) = m.default_link.split_once('/').expect("transport/algo");
    assert!(!transport.is_empty(), "{}", m.default_link);
    // At the largest size (4 MiB) auto on 2 shared-memory ranks is SRA through the arena.
    assert_eq!(algo, "sra", "{}", m.default_link);
    for (name, l) in &m.links {
        assert!(l.alpha.is_finite() && l.alpha >= 0.0, "{name} {l:?}");
        assert!(l.beta.is_finite() && l.beta >= 0.0, "{name} {l:?}");
    }
    // The default link spans 4 KiB..4 MiB, so its time must grow with the bytes. A link that
    // auto picks only at the smallest sizes (the one-shot rounds up to 32 KiB) may fit flat:
    // among 2-3 points that close together, wake-up noise of the tests running beside this
    // one outweighs the bytes (seen: α 357 µs, β 0).
    let default = &m.links[&m.default_link];
    assert!(default.beta > 0.0, "{} {default:?}", m.default_link);
    assert_eq!(m.codecs.len(), 5, "{:?}", m.codecs.keys());
    for spec in [
        "fp16",
        "qsgd:bits=4,bucket=128",
        "qsgd:bits=8,bucket=128",
        "mstopk:density=0.01",
        "efsign",
    ] {
        let key = qccl::CodecSpec::parse(spec).unwrap().to_string();
        let c = m
            .codecs
            .get(&key)
            .unwrap_or_else(|| panic!("no {key}: {:?}", m.codecs.keys()));
        for l in [c.compress, c.decompress] {
            assert!(l.alpha.is_finite() && l.alpha >= 0.0, "{key} {c:?}");
            assert!(l.beta.is_finite() && l.beta >= 0.0, "{key} {c:?}");
        }
        assert!(c.ratio > 0.0 && c.ratio < 0.6, "{key} {c:?}");
        assert!(out.contains(&key), "summary lists {key}:\n{out}");
    }
    // The measured model plans: every codec, and one given by its short spec.
    plan_ok("resnet50", &path, &[]);
    let (out, plan) = plan_ok("resnet50", &path, &["--codec", "qsgd:bits=4,bucket=128"]);
    assert!(
        plan.link.as_deref() == Some(m.default_link.as_str()),
        "{out}"
    );
    let _ = std::fs::remove_file(&path);
}

#[test]
fn calibrate_schedules_and_codecs_given() {
    use qccl_planner::CostModel;
    let path = temp_file("cost-given.json");
    let o = run(&[
        "-np",
        "3",
        "--calibrate",
        "-A",
        "ring",
        "-A",
        "tree",
        "-Z",
        "fp16",
        "-Z",
        "efsign",
        "-b",
        "4K",
        "-e",
        "64K",
        "-n",
        "2",
        "-T",
        "120",
        &format!("--calibrate-out={}", path.display()),
    ]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    let m = CostModel::read(&path).unwrap_or_else(|e| panic!("{e}\n{out}"));
    let _ = std::fs::remove_file(&path);
    let algos: Vec<&str> = m
        .links
        .keys()
        .map(|k| k.split_once('/').unwrap().1)
        .collect();
    assert_eq!(algos, ["ring", "tree"], "{out}");
    assert!(m.default_link.ends_with("/ring"), "first -A: {out}");
    assert_eq!(
        m.codecs.keys().collect::<Vec<_>>(),
        ["efsign", "fp16"],
        "{out}"
    );
    // Argument errors fail before any rank starts.
    for (args, needle) in [
        (
            &["--calibrate", "--coll", "broadcast"][..],
            "all-reduce only",
        ),
        (&["--calibrate", "-d", "half"], "float"),
        (&["--calibrate", "-Z", "bogus"], "bogus"),
        (&["--calibrate-out", "x.json"], "only with --calibrate"),
        (&["-Z", "fp16", "-Z", "bf16"], "only --calibrate"),
    ] {
        let o = run(args);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}\n{out}\n{err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn calibrate_writes_a_tuning_file_the_library_reads() {
    let cost = temp_file("tuning-cost.json");
    let tuning = temp_file("tuning.txt");
    let t = tuning.to_str().unwrap();
    let o = run(&[
        "-np",
        "2",
        "--bind-to",
        "none",
        "--calibrate",
        "-b",
        "4K",
        "-e",
        "256K",
        "-n",
        "2",
        "-Z",
        "fp16",
        "-T",
        "120",
        &format!("--calibrate-out={}", cost.display()),
        "--tuning-out",
        t,
    ]);
    let (out, err) = text(&o);
    let _ = std::fs::remove_file(&cost);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    // No -A: auto and every flat schedule measured.
    assert!(out.contains("-A auto,ring,tree,sra,allgather"), "{out}");
    assert!(out.contains(&format!("# wrote {t} (")), "{out}");
    let file = std::fs::read_to_string(&tuning).unwrap();
    assert!(file.starts_with("# qccl tuning v1\n"), "{file}");
    // The library reads it back: rows for 2 ranks over the shared-memory arena, the last one
    // covering every larger call.
    let rows = qccl::internal::Tuning::load(Some(&tuning))
        .unwrap_or_else(|e| panic!("{e}\n{file}"))
        .rows()
        .to_vec();
    assert!(!rows.is_empty(), "{file}");
    for r in &rows {
        let line = r.to_string();
        assert!(line.starts_with("allreduce arena 2 "), "{line}\n{file}");
        assert!(out.contains(&format!("# tuning: {line}")), "{out}");
    }
    assert_eq!(rows.last().unwrap().max_bytes, usize::MAX, "{file}");
    // And a run under it passes its checks.
    let o = Command::new(BIN)
        .args(["-np", "2", "--bind-to", "none"])
        .args(QUICK)
        .env("QCCL_TUNING_FILE", &tuning)
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    // A damaged file fails init by line, before any byte moves.
    std::fs::write(&tuning, format!("{file}allreduce arena 2 4K fastest\n")).unwrap();
    let o = Command::new(BIN)
        .args(["-np", "2", "--bind-to", "none"])
        .args(QUICK)
        .env("QCCL_TUNING_FILE", &tuning)
        .output()
        .unwrap();
    let (out, err) = text(&o);
    let _ = std::fs::remove_file(&tuning);
    assert_eq!(o.status.code(), Some(2), "{out}\n{err}");
    let line = file.lines().count() + 1;
    assert!(
        err.contains(&format!("{t}: line {line}: unknown algorithm 'fastest'")),
        "{err}"
    );
}

/// A cost model written here, so the planner's output does not depend on this machine: a
/// 10 Gb/s link with 50 µs per call, a cheap 2x codec and an expensive 32x one.
fn synthetic_cost(tag: &str) -> std::path::PathBuf {
    use qccl_planner::{CodecCost, CostModel, Linear};
    let m = CostModel::with_link("tcp/ring", Linear::new(50e-6, 1.0 / 1.25e9))
        .codec_entry(
            "fp16",
            CodecCost {
                compress: Linear::new(20e-6, 0.1e-9),
                decompress: Linear::new(20e-6, 0.1e-9),
                ratio: 0.5,
            },
        )
        .codec_entry(
            "efsign",
            CodecCost {
                compress: Linear::new(100e-6, 0.6e-9),
                decompress: Linear::new(100e-6, 0.4e-9),
                ratio: 1.0 / 32.0,
            },
        );
    let path = temp_file(tag);
    m.write(&path).unwrap();
    path
}

#[test]
fn plan_shipped_profiles_against_baselines() {
    let cost = synthetic_cost("cost-synthetic.json");
    for profile in ["resnet50", "resnet101", "bert_base"] {
        let (out, plan) = plan_ok(profile, &cost, &["--codec", "fp16"]);
        assert!(out.contains(&format!("# qccl-plan: {profile}: ")), "{out}");
        // On this link fp16 pays off, and fusing beats both one group and one per tensor.
        assert!(
            plan.groups
                .iter()
                .all(|g| g.codec.as_deref() == Some("fp16")),
            "{out}"
        );
        assert!(plan.groups.len() > 1, "{out}");
    }
    let (out, _) = plan_ok("resnet50", &cost, &["--compress-on", "separate"]);
    assert!(out.contains("# optimal fusion per codec:"), "{out}");
    assert!(out.contains("separate stream"), "{out}");
    let _ = std::fs::remove_file(&cost);
}

#[test]
fn plan_errors_name_the_file_and_field() {
    let cost = synthetic_cost("cost-errors.json");
    let c = cost.to_str().unwrap();
    let bad = temp_file("cost-bad.json");
    std::fs::write(
        &bad,
        r#"{"default_link": "x", "links": {"x": {"alpha": 1.0}}, "codecs": {}}"#,
    )
    .unwrap();
    let neg = temp_file("cost-neg.json");
    std::fs::write(
        &neg,
        r#"{"default_link": "x", "links": {"x": {"alpha": -1.0, "beta": 0.0}}, "codecs": {}}"#,
    )
    .unwrap();
    let missing = temp_file("no-such-cost.json");
    let bad_profile = temp_file("profile-bad.json");
    std::fs::write(&bad_profile, r#"{"tensors": [{"name": "w", "elems": 4}]}"#).unwrap();
    let (b, n, m, bp) = (
        bad.to_str().unwrap(),
        neg.to_str().unwrap(),
        missing.to_str().unwrap(),
        bad_profile.to_str().unwrap(),
    );
    for (args, needles) in [
        (
            &["--profile", "resnet50", "--cost", b][..],
            &[b, "beta"][..],
        ),
        (
            &["--profile", "resnet50", "--cost", n],
            &[n, "link x", "alpha"],
        ),
        (&["--profile", "resnet50", "--cost", m], &[m]),
        (&["--profile", bp, "--cost", c], &[bp, "backprop"]),
        (
            &["--profile", "resnet51", "--cost", c],
            &["resnet51", "shipped"],
        ),
        (
            &[
                "--profile",
                "resnet50",
                "--cost",
                c,
                "--codec",
                "qsgd:bits=4",
            ],
            &["qsgd", "fp16"],
        ),
        (
            &["--profile", "resnet50", "--cost", c, "--codec", "bogus"],
            &["bogus"],
        ),
        (
            &["--profile", "resnet50", "--cost", c, "--link", "shm/sra"],
            &["shm/sra", "tcp/ring"],
        ),
        (&["--profile", "resnet50"], &["--cost"]),
        (
            &["--profile", "resnet50", "--cost", c, "--compress-on", "gpu"],
            &["gpu"],
        ),
        (&["--frobnicate"], &["--frobnicate"]),
    ] {
        let o = plan_run(args);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}\n{out}\n{err}");
        assert!(err.starts_with("qccl-plan: "), "{err}");
        for needle in needles {
            assert!(err.contains(needle), "{args:?}: {needle} not in {err}");
        }
    }
    let o = plan_run(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    assert!(text(&o).0.contains("--profile"));
    for f in [&cost, &bad, &neg, &bad_profile] {
        let _ = std::fs::remove_file(f);
    }
}

/// The CPU list each rank's header line reports (`cpus 0-3, links tcp+shm`; host buffers).
fn rank_cpus(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| l.starts_with("#  Rank "))
        .map(|l| {
            let cpus = l.rsplit("cpus ").next().unwrap_or("");
            cpus.split(", links ").next().unwrap_or("").to_string()
        })
        .collect()
}

#[test]
fn bind_to_places_ranks_as_mpirun() {
    let cpus = qccl::launch::allowed_cpus().unwrap();
    let all = qccl::launch::cpu_list(&cpus);
    let np = cpus.len().min(4);
    let np_s = np.to_string();
    // core: rank r on the r-th CPU this process may use (auto does the same when they fit).
    for bind in ["core", "auto"] {
        let o = run(&[
            "-np",
            &np_s,
            "--bind-to",
            bind,
            "-b",
            "1K",
            "-e",
            "1K",
            "--device",
            "host",
        ]);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
        let want: Vec<String> = cpus[..np].iter().map(|c| c.to_string()).collect();
        assert_eq!(rank_cpus(&out), want, "--bind-to {bind}\n{out}");
    }
    // auto with twice as many ranks as CPUs: round-robin, each CPU gets two.
    let twice = (2 * cpus.len()).to_string();
    let o = run(&["-np", &twice, "-b", "1K", "-e", "1K", "--device", "host"]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    let want: Vec<String> = cpus.iter().chain(&cpus).map(|c| c.to_string()).collect();
    assert_eq!(rank_cpus(&out), want, "-np {twice}\n{out}");
    // none, and auto with one rank more than CPUs (uneven): every rank may run anywhere.
    let over = (cpus.len() + 1).to_string();
    for args in [vec!["-np", &np_s, "--bind-to", "none"], vec!["-np", &over]] {
        let o = run(&[&args[..], &["-b", "1K", "-e", "1K", "--device", "host"]].concat());
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
        let ranks = rank_cpus(&out);
        assert_eq!(ranks.len(), args[1].parse::<usize>().unwrap(), "{out}");
        assert!(
            ranks.iter().all(|c| *c == all),
            "{args:?}: {ranks:?}, want {all}"
        );
    }
    let o = run(&["-np", "2", "--bind-to", "socket"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).1.contains("--bind-to"), "{}", text(&o).1);
}

/// The waiting policy each rank logs at QCCL_DEBUG=INFO: "R ranks on C cores … waits spin|yield".
fn wait_policies(err: &str) -> Vec<String> {
    err.lines()
        .filter_map(|l| l.split_once(" ranks on ").map(|(_, rest)| rest))
        .filter_map(|rest| rest.split_once(" cores of this machine: waits "))
        .map(|(cores, how)| format!("{cores} cores, {how}"))
        .collect()
}

#[test]
fn ranks_confined_to_fewer_cores_than_the_machine_has_yield() {
    let cpus = qccl::launch::allowed_cpus().unwrap();
    let first = cpus[0].to_string();
    // Two ranks that may only run on one CPU (taskset, a cpuset, a Slurm cgroup): spinning
    // would hold the CPU the peer needs for a whole time slice per hand-off, so they yield
    // although the machine has more CPUs.
    let o = Command::new("taskset")
        .args([
            "-c", &first, BIN, "-np", "2", "-b", "4K", "-e", "4K", "-c", "1",
        ])
        .env("QCCL_DEBUG", "INFO")
        .output()
        .expect("run taskset (util-linux)");
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    assert_eq!(wait_policies(&err), ["1 cores, yield"; 2], "{err}");
    // Ranks bound one per CPU, or free to use them all, have a core each to spin on.
    if cpus.len() >= 2 {
        for bind in ["core", "none"] {
            let o = Command::new(BIN)
                .args(["-np", "2", "--bind-to", bind, "-b", "4K", "-e", "4K"])
                .env("QCCL_DEBUG", "INFO")
                .output()
                .expect("run qccl-perf");
            let (out, err) = text(&o);
            assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
            let want = format!(
                "{} cores, spin",
                if bind == "core" { 2 } else { cpus.len() }
            );
            assert_eq!(
                wait_policies(&err),
                [want.clone(), want],
                "--bind-to {bind}\n{err}"
            );
        }
    }
}

/// Over the emulated RDMA fabric the device lines name the links and every row is marked
/// emulated (one column after nccl-tests' 13): no speed claim.
#[test]
fn emulated_rdma_rows_are_marked() {
    // Host buffers: their device lines name the links (a GPU's name nccl-tests' way).
    let mut all = vec!["-np", "2", "--device", "host"];
    all.extend_from_slice(QUICK);
    let o = Command::new(BIN)
        .args(&all)
        .env("QCCL_IB_EMULATE", "1")
        .env("QCCL_NET", "IB")
        .env("QCCL_SHM_DISABLE", "1")
        .output()
        .expect("run qccl-perf");
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "stdout:\n{out}\nstderr:\n{err}");
    assert_eq!(out.matches(", links tcp+ib-emulated").count(), 2, "{out}");
    assert!(
        out.contains("# RDMA links over the emulated fabric"),
        "{out}"
    );
    let rows = rows(&out, 1);
    assert_eq!(rows.len(), NOMINAL.len(), "{out}");
    assert!(
        rows.iter().all(|(_, extra)| extra == &["emulated"]),
        "{out}"
    );
}
