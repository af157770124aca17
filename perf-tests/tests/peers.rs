//! The tools `perf-tests/compare` runs beside the benchmarks: the CPU placement probe
//! (`peers/core_rtt.c`) and the report's merge (`peers/merge.py`), checked on real output and
//! on a results directory written here.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const PEERS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/peers");

/// A fresh directory under the system's temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("qccl-peers-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn build_core_rtt(dir: &Path) -> PathBuf {
    let bin = dir.join("core_rtt");
    // The C compiler the C ABI tests use too.
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let st = Command::new(&cc)
        .args(["-O2", "-pthread", "-o"])
        .arg(&bin)
        .arg(format!("{PEERS}/core_rtt.c"))
        .status()
        .unwrap_or_else(|e| panic!("{cc} (needed to build peers/core_rtt.c): {e}"));
    assert!(st.success(), "core_rtt.c did not compile");
    bin
}

fn cpus() -> usize {
    // The CPUs this process may run on, as core_rtt picks them.
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[test]
fn core_rtt_samples_the_round_trip_and_refuses_bad_arguments() {
    let dir = TempDir::new("rtt");
    let bin = build_core_rtt(&dir.0);

    let bad = Command::new(&bin).args(["-c", "0,0"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("two different CPU"));
    let bad = Command::new(&bin).args(["-k", "0"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(2));

    let one = Command::new(&bin).output().unwrap();
    if cpus() < 2 {
        assert_eq!(one.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&one.stderr).contains("needs two CPUs"));
        return;
    }
    assert!(one.status.success(), "{one:?}");
    let ns: f64 = String::from_utf8_lossy(&one.stdout).trim().parse().unwrap();
    assert!(ns > 0.0 && ns < 1e6, "round trip {ns} ns");

    // Sampling mode: lines of "unix_time ns" until SIGTERM, then a clean exit.
    let out = dir.0.join("s.rtt");
    let mut child = Command::new(&bin)
        .args(["-i", "0.1"])
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(800));
    let term = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    assert!(child.wait().unwrap().success());
    let text = std::fs::read_to_string(&out).unwrap();
    let lines: Vec<Vec<f64>> = text
        .lines()
        .map(|l| l.split_whitespace().map(|x| x.parse().unwrap()).collect())
        .collect();
    assert!(lines.len() >= 2, "samples: {text:?}");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    for l in &lines {
        assert_eq!(l.len(), 2, "{text:?}");
        assert!((now - l[0]).abs() < 60.0 && l[1] > 0.0, "{text:?}");
    }
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

/// Runs peers/merge.py on the results dir `d` with `args`; its stdout once it succeeded.
fn merge(d: &Path, args: &[&str]) -> String {
    let out = Command::new("python3")
        .arg(format!("{PEERS}/merge.py"))
        .arg("--dir")
        .arg(d)
        .args(args)
        .output()
        .expect("python3 (needed to run peers/merge.py)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

fn result(busbw: f64) -> String {
    format!(
        "[{{\"size\": 4096, \"time_us\": 10.0, \"busbw\": {busbw}}}, \
         {{\"size\": 1048576, \"time_us\": 300.0, \"busbw\": {}}}]",
        busbw * 10.0
    )
}

#[test]
fn merge_marks_each_run_by_where_the_cpus_were() {
    let dir = TempDir::new("merge");
    let d = &dir.0;
    write(&d.join("rtt-start.rtt"), "1.0 60\n1.1 62\n");
    // Run 1: both near. Run 2: qccl far (all samples > 2 x 60), mpi-tcp near.
    // Run 3: qccl mixed (1 of 2 far), mpi-tcp without samples.
    let runs = [
        ("1", 0.30, "1 61\n2 70\n3 64\n", 0.20, Some("1 65\n")),
        (
            "2",
            0.10,
            "1 340\n2 350\n3 330\n",
            0.25,
            Some("1 66\n2 68\n"),
        ),
        ("3", 0.20, "1 60\n2 360\n", 0.22, None),
    ];
    for (r, q, q_rtt, m, m_rtt) in runs {
        let np = d.join(format!("run{r}/np2"));
        write(&np.join("qccl.json"), &result(q));
        write(&np.join("qccl.rtt"), q_rtt);
        write(&np.join("mpi-tcp.json"), &result(m));
        if let Some(t) = m_rtt {
            write(&np.join("mpi-tcp.rtt"), t);
        }
    }
    let text = merge(d, &["--labels", "qccl,mpi-tcp", "--np", "2", "--runs", "3"]);
    let row = |first: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("| {first} |")))
            .unwrap_or_else(|| panic!("no row {first}: {text}"))
            .split(" | ")
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let r = row("4 KiB");
    assert_eq!(r[1], "0.30 / 0.10f / 0.20m", "{text}");
    assert_eq!(r[2], "0.20 / 0.25 / 0.22", "{text}");
    // Ratios: same placement unmarked; far against near marked; no samples, no mark.
    assert_eq!(r[3].trim_end_matches(" |"), "1.50 / 0.40? / 0.91", "{text}");
    let r = row("1 MiB");
    assert_eq!(r[1], "3.00 / 1.00f / 2.00m", "{text}");
    assert!(text.contains("far = over 2 × 60 ns"), "{text}");
    assert!(text.contains("qccl near (64 ns, 0% far) / far (340 ns, 100% far) / mixed"));
    assert!(
        text.contains("mpi-tcp near (65 ns, 0% far) / near (68 ns, 0% far) / —"),
        "{text}"
    );

    // What compare asks while it runs: the far line, and one run's placement.
    let ask = |args: &[&str]| merge(d, args).trim().to_string();
    assert_eq!(ask(&["--far-above"]), "120");
    let run2 = d.join("run2/np2/qccl.rtt");
    assert_eq!(
        ask(&["--placement", run2.to_str().unwrap()]),
        "far (340 ns, 100% far)"
    );
    let none = d.join("run3/np2/mpi-tcp.rtt");
    assert_eq!(ask(&["--placement", none.to_str().unwrap()]), "");
}

#[test]
fn merge_sets_in_place_peers_against_qccls_in_place_figures() {
    let dir = TempDir::new("merge-ip");
    let d = &dir.0;
    let np = d.join("run1/np2");
    // qccl out of place 2.0 / in place 3.0 GB/s; MPI (two buffers) 1.0; Gloo (in place) 1.5.
    write(
        &np.join("qccl.json"),
        "{\"results\": [{\"size\": 4096, \"time_us\": 8.0, \"busbw\": 2.0, \
         \"inplace_time_us\": 6.0, \"inplace_busbw\": 3.0}]}",
    );
    write(
        &np.join("mpi-tcp.json"),
        "[{\"size\": 4096, \"time_us\": 20.0, \"busbw\": 1.0}]",
    );
    write(
        &np.join("gloo.json"),
        "[{\"size\": 4096, \"time_us\": 900.0, \"busbw\": 1.5, \"in_place\": true}]",
    );
    let text = merge(
        d,
        &["--labels", "qccl,mpi-tcp,gloo", "--np", "2", "--runs", "1"],
    );
    assert!(
        text.contains(
            "| size | qccl busbw | qccl in-place busbw | mpi-tcp busbw | gloo busbw \
             | qccl/mpi-tcp | qccl/gloo |"
        ),
        "{text}"
    );
    // MPI against qccl's out-of-place 2.0, Gloo against its in-place 3.0.
    assert!(
        text.contains("| 4 KiB | 2.00 | 3.00 | 1.00 | 1.50 | 2.00 | 2.00 |"),
        "{text}"
    );
    assert!(
        text.contains("| **avg busbw** | 2.00 | 3.00 | 1.00 | 1.50 | 2.00 | 2.00 |"),
        "{text}"
    );
    assert!(
        text.contains("| **time @ 4 KiB (µs)** | 8.0 | 6.0 | 20.0 | 900.0 |"),
        "{text}"
    );
}

/// The (tag, attributes) of every element of the SVG at `path`, read by Python's XML parser
/// (which refuses a document that is not well-formed).
fn svg_elements(path: &Path) -> Vec<(String, String)> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import sys, xml.etree.ElementTree as E\n\
             for e in E.parse(sys.argv[1]).iter():\n\
             \x20   print(e.tag.split('}')[-1], e.get('data-label') or '', sep='\\t')",
        ])
        .arg(path)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let (t, a) = l.split_once('\t').unwrap_or((l, ""));
            (t.to_string(), a.to_string())
        })
        .collect()
}

#[test]
fn merge_draws_one_line_per_benchmark_and_run() {
    let dir = TempDir::new("merge-svg");
    let d = &dir.0;
    for r in ["1", "2"] {
        for n in ["2", "4"] {
            let np = d.join(format!("run{r}/np{n}"));
            write(
                &np.join("qccl.json"),
                "{\"results\": [{\"size\": 4096, \"busbw\": 2.0, \"inplace_busbw\": 3.0}, \
                 {\"size\": 65536, \"busbw\": 4.0, \"inplace_busbw\": 5.0}]}",
            );
            write(&np.join("mpi-shm.json"), &result(1.0));
            write(
                &np.join("gloo.json"),
                "[{\"size\": 4096, \"busbw\": 1.5, \"in_place\": true}]",
            );
        }
    }
    let svg_dir = d.join("plots");
    let text = merge(
        d,
        &[
            "--labels",
            "qccl,mpi-shm,gloo",
            "--svg-dir",
            svg_dir.to_str().unwrap(),
        ],
    );
    for n in [2, 4] {
        let link = format!("![busbw vs size, {n} ranks](plots/busbw-np{n}.svg)");
        assert!(text.contains(&link), "{text}");
        let el = svg_elements(&svg_dir.join(format!("busbw-np{n}.svg")));
        assert_eq!(el[0].0, "svg");
        // qccl out of place and in place (Gloo is set against it), MPI, Gloo: 4 x 2 runs.
        let series: Vec<&str> = el
            .iter()
            .filter(|(t, a)| t == "g" && !a.is_empty())
            .map(|(_, a)| a.as_str())
            .collect();
        assert_eq!(
            series,
            [
                "qccl run 1",
                "qccl run 2",
                "qccl in-place run 1",
                "qccl in-place run 2",
                "mpi-shm run 1",
                "mpi-shm run 2",
                "gloo run 1",
                "gloo run 2"
            ],
            "np {n}"
        );
        assert_eq!(el.iter().filter(|(t, _)| t == "polyline").count(), 8);
        // Points: 2 sizes for qccl's and MPI's lines, 1 for Gloo's.
        assert_eq!(el.iter().filter(|(t, _)| t == "circle").count(), 6 * 2 + 2);
    }
}

#[test]
fn merge_divides_averages_over_the_sizes_both_sides_measured() {
    let dir = TempDir::new("merge-common");
    let d = &dir.0;
    let np = d.join("run1/np2");
    // qccl's in-place figure is missing at 8 KiB; Gloo measured both sizes.
    write(
        &np.join("qccl.json"),
        "[{\"size\": 4096, \"busbw\": 2.0, \"inplace_busbw\": 3.0}, \
         {\"size\": 8192, \"busbw\": 4.0, \"inplace_busbw\": null}]",
    );
    write(
        &np.join("gloo.json"),
        "[{\"size\": 4096, \"busbw\": 1.5, \"in_place\": true}, \
         {\"size\": 8192, \"busbw\": 10.0, \"in_place\": true}]",
    );
    let text = merge(d, &["--labels", "qccl,gloo", "--np", "2", "--runs", "1"]);
    // Columns average what they have; the ratio only 4 KiB, where both have a figure.
    assert!(
        text.contains("| **avg busbw** | 3.00 | 3.00 | 5.75 | 2.00 |"),
        "{text}"
    );
}
