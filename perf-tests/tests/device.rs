//! qccl-perf on device buffers (`--device cuda`), run as a user would, under the emulated GPU
//! driver (QCCL_GPU_EMULATE=1): its device memory faults when host code touches it, so a
//! collective that skipped qccl's staging crashes the rank instead of passing. At 1 and 3
//! ranks (sharing the one emulated GPU), dense and compressed all-reduce and other
//! collectives (a root-only buffer, HiTopK) with `-c 1` checks against the float64 reference,
//! the `# Using devices` lines nccl-tests prints for GPUs, the default (cuda when a driver is
//! usable), and the refusal of `--device cuda` without a driver.
//!
//! The same runs on a real GPU: `--ignored` (QCCL_REQUIRE_GPU=1 makes a missing GPU a failure).

use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_qccl-perf");
/// Sizes of the quick runs: 1K 4K 16K 64K.
const QUICK: &[&str] = &[
    "-b", "1K", "-e", "64K", "-f", "4", "-n", "2", "-w", "1", "-c", "1", "-T", "120",
];

/// qccl-perf on `np` ranks (0: one, without -np) with `args` and the quick sizes,
/// QCCL_GPU_EMULATE set to `emulate` (None: unset); (exit code, stdout, stderr).
fn perf(emulate: Option<&str>, np: usize, args: &[&str]) -> (Option<i32>, String, String) {
    perf_with(emulate, np, args, &[])
}

/// As [`perf`], with `env` added.
fn perf_with(
    emulate: Option<&str>,
    np: usize,
    args: &[&str],
    env: &[(&str, &str)],
) -> (Option<i32>, String, String) {
    let mut cmd = Command::new(BIN);
    cmd.envs(env.iter().copied());
    if np > 0 {
        cmd.args(["-np", &np.to_string()]);
    }
    cmd.args(args).args(QUICK);
    match emulate {
        Some(n) => cmd.env("QCCL_GPU_EMULATE", n),
        None => cmd.env_remove("QCCL_GPU_EMULATE"),
    };
    let o: Output = cmd.output().expect("run qccl-perf");
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Checks a successful run on `np` ranks: one nccl-tests GPU line per rank, naming a device
/// `device` matches, and four table lines with no wrong element in either mode.
fn check(out: &str, err: &str, np: usize, device: impl Fn(&str) -> bool) {
    let ranks: Vec<&str> = out.lines().filter(|l| l.starts_with("#  Rank ")).collect();
    assert_eq!(ranks.len(), np, "one device line per rank:\n{out}\n{err}");
    for (r, l) in ranks.iter().enumerate() {
        // #  Rank  0 Group  0 Pid  12345 on HOST device  0 [0000:3b:00.0] NVIDIA H100 ...
        let f: Vec<&str> = l.split_whitespace().collect();
        assert_eq!(f[..3], ["#", "Rank", &r.to_string()], "{l}");
        assert_eq!(f[3..5], ["Group", "0"], "{l}");
        assert_eq!((f[5], f[7], f[9]), ("Pid", "on", "device"), "{l}");
        let rest = l.split_once(" device ").expect("device").1;
        assert!(device(rest), "rank {r}'s device: {l}");
    }
    assert!(out.contains("# device buffers (--device cuda)"), "{out}");
    // Ranks sharing one host (the arena) on qccl-perf's stream: the banded staging.
    assert_eq!(
        out.contains("is staged in bands pipelined with the shared-memory arena's rounds"),
        np > 1,
        "{out}"
    );
    assert!(
        out.contains("# Out of bounds values : 0 OK"),
        "{out}\n{err}"
    );
    // Where the #wrong columns are (-I adds columns before the in-place ones).
    let head = header(out);
    let wrong: Vec<usize> = (0..head.len()).filter(|&i| head[i] == "#wrong").collect();
    assert_eq!(wrong.len(), 2, "{out}");
    let rows: Vec<Vec<&str>> = out
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 4, "{out}");
    for f in rows {
        assert_eq!(f.len(), head.len(), "{f:?}");
        assert_eq!(f[wrong[0]], "0", "out-of-place #wrong: {f:?}");
        assert!(
            f[wrong[1]] == "0" || f[wrong[1]] == "N/A",
            "in-place #wrong: {f:?}"
        );
    }
}

/// The emulated GPU, as its driver names it: `device  0 [emulated:0] emulated GPU`.
fn emulated_gpu(rest: &str) -> bool {
    rest.split_whitespace().collect::<Vec<_>>() == ["0", "[emulated:0]", "emulated", "GPU"]
}

/// Runs `args` with `--device cuda` under the emulated driver at 1 and 3 ranks.
fn on_emulated_gpu(args: &[&str]) {
    on_emulated_gpu_with(|_| args.iter().map(|a| a.to_string()).collect());
}

/// As [`on_emulated_gpu`], the arguments depending on the number of ranks.
fn on_emulated_gpu_with(args: impl Fn(usize) -> Vec<String>) {
    for np in [1, 3] {
        let mut all = vec!["--device".to_string(), "cuda".into()];
        all.extend(args(np));
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        let (code, out, err) = perf(Some("1"), np, &all);
        assert_eq!(code, Some(0), "{all:?} on {np}\n{out}\n{err}");
        check(&out, &err, np, emulated_gpu);
    }
}

#[test]
fn all_reduce_dense() {
    on_emulated_gpu(&["-d", "float", "-o", "sum"]);
}

/// QCCL_CUDA_IPC=1: the dense all-reduces, reduce-scatters and all-gathers of 3 ranks
/// (processes sharing the emulated GPU) go through each other's mapped memory, every dtype
/// and op checked; the header says so.
#[test]
fn dense_calls_over_cuda_ipc() {
    for coll in ["all_reduce", "reduce_scatter", "all_gather"] {
        let args = ["--device", "cuda", "--coll", coll, "-d", "all", "-o", "all"];
        let (code, out, err) = perf_with(Some("1"), 3, &args, &[("QCCL_CUDA_IPC", "1")]);
        assert_eq!(code, Some(0), "{coll}\n{out}\n{err}");
        assert!(out.contains("# QCCL_CUDA_IPC=1: dense"), "{out}");
        let ranks = out.lines().filter(|l| l.starts_with("#  Rank ")).count();
        assert_eq!(ranks, 3, "{out}");
        assert!(
            out.contains("# Out of bounds values : 0 OK"),
            "{coll}\n{out}\n{err}"
        );
    }
}

/// `-y 1`: calls on the NULL stream; the dense ones on ranks sharing one host go through
/// the arena, the (emulated) GPU copying into and out of its page-locked segments (the log
/// says so), and every checked value is right.
#[test]
fn dense_calls_on_the_null_stream_go_through_the_arena() {
    for coll in ["all_reduce", "reduce_scatter", "all_gather", "broadcast"] {
        let args = [
            "--device", "cuda", "--coll", coll, "-d", "all", "-o", "all", "-y", "1",
        ];
        let (code, out, err) = perf_with(Some("1"), 3, &args, &[("QCCL_DEBUG", "INFO")]);
        assert_eq!(code, Some(0), "{coll}\n{out}\n{err}");
        assert!(out.contains("return once done (-y 1)"), "{out}");
        assert!(
            out.contains("the GPU copying into and out of them"),
            "{out}"
        );
        assert!(
            out.contains("# Out of bounds values : 0 OK"),
            "{coll}\n{out}\n{err}"
        );
        // Broadcast runs no arena rounds (it is staged in bands of the chain's slices); the
        // others reach sizes past one shot.
        assert_eq!(
            err.contains("page-locked on the emulated driver"),
            coll != "broadcast",
            "{coll}\n{err}"
        );
    }
}

/// Across emulated hosts (`--hosts 2`: two hosts of two ranks), calls on device buffers
/// take their device paths (the log says so) and every checked value is right: a dense
/// all-reduce on qccl-perf's stream and on the NULL one, staged piece by piece on the
/// hierarchical route (on SRA with `--hosts 4`, a rank per host; on the ring with
/// `--hosts 2` on 2 ranks), a reduce-scatter and an all-gather on the ring, a broadcast
/// (stream) and a reduce (NULL) in bands of the chain's slices; a compressed
/// all-reduce and HiTopKComm (NULL and qccl-perf's stream), the hierarchical levels
/// through each host's arena, the codecs and the top-k on the emulated GPU.
#[test]
fn calls_across_emulated_hosts_take_their_device_paths() {
    let staged = "hierarchical, staged in";
    let runs: [(usize, &[&str], &str); 12] = [
        (4, &["--hosts", "2"], staged),
        (4, &["--hosts", "2", "-y", "1"], staged),
        (4, &["--hosts", "4"], "SRA, staged in"),
        // The ring from 64 KiB.
        (2, &["--hosts", "2"], "ring, staged in"),
        // Reduce-scatter and all-gather run the ring across hosts.
        (
            4,
            &["--hosts", "2", "--coll", "reduce_scatter"],
            ": ring, staged in",
        ),
        (
            4,
            &["--hosts", "2", "--coll", "all_gather"],
            ": ring, staged in",
        ),
        // Broadcast and reduce run the chain, in bands of its slices (any links).
        (
            4,
            &["--hosts", "2", "--coll", "broadcast", "-r", "1"],
            ": chain, staged in",
        ),
        (
            4,
            &["--hosts", "2", "--coll", "reduce", "-y", "1"],
            ": chain, staged in",
        ),
        (
            4,
            &["--hosts", "2", "-y", "1", "-Z", "fp16"],
            "hierarchical, the codecs on the GPU",
        ),
        // On qccl-perf's stream too (float32), enqueued.
        (
            4,
            &["--hosts", "2", "-Z", "fp16"],
            "hierarchical, the codecs on the GPU",
        ),
        (
            4,
            &[
                "--hosts",
                "2",
                "-y",
                "1",
                "--coll",
                "hitopk",
                "--density",
                "0.1",
            ],
            "the top-k on the GPU",
        ),
        // On qccl-perf's stream too (float32), enqueued.
        (
            4,
            &["--hosts", "2", "--coll", "hitopk", "--density", "0.1"],
            "on a stream: the top-k on the GPU",
        ),
    ];
    for (np, what, says) in runs {
        let mut args = vec!["--device", "cuda"];
        args.extend_from_slice(what);
        let (code, out, err) = perf_with(Some("1"), np, &args, &[("QCCL_DEBUG", "TRACE")]);
        assert_eq!(code, Some(0), "{what:?}\n{out}\n{err}");
        assert!(
            out.contains("# Out of bounds values : 0 OK"),
            "{what:?}\n{out}\n{err}"
        );
        assert!(
            err.contains(says),
            "{what:?}: no \"{says}\" in the log\n{err}"
        );
    }
}

/// The names of the table's columns (its header line, without the leading `#`).
fn header(out: &str) -> Vec<&str> {
    out.lines()
        .find(|l| l.starts_with("#       size"))
        .unwrap_or_else(|| panic!("no column header:\n{out}"))
        .split_whitespace()
        .skip(1)
        .collect()
}

/// The column named `name` of every table row of `out`.
fn column(out: &str, name: &str) -> Vec<String> {
    let at = header(out)
        .iter()
        .position(|h| *h == name)
        .unwrap_or_else(|| panic!("no column {name}:\n{out}"));
    out.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().nth(at).unwrap_or_default().to_string())
        .collect()
}

/// Through the core's entry for compressed calls, as the C API: the codecs run on the
/// (emulated) GPU and the call reports no bytes itself; the wire column, from the comm's
/// count over the loop, is the host run's.
#[test]
fn all_reduce_compressed() {
    let z = ["-Z", "qsgd:bits=4,bucket=128"];
    on_emulated_gpu(&z);
    for np in [1, 3] {
        let run = |device: &str| {
            let (code, out, err) = perf(Some("1"), np, &[&["--device", device][..], &z].concat());
            assert_eq!(code, Some(0), "{device} on {np}\n{out}\n{err}");
            column(&out, "wire(B)")
        };
        let host = run("host");
        assert_eq!(host.len(), 4, "{host:?}");
        assert_eq!(
            run("cuda"),
            host,
            "wire(B) on {np} ranks, device against host"
        );
    }
}

/// The naive all-gather top-k goes through the same entry (MSTopK on the GPU): its wire
/// bytes and relative error are the host run's.
#[test]
fn naive_all_gather_top_k_as_a_compressed_call() {
    let args = ["--coll", "naiveag", "-k", "0.1"];
    on_emulated_gpu(&args);
    let run = |device: &str| {
        let (code, out, err) = perf(Some("1"), 3, &[&["--device", device][..], &args].concat());
        assert_eq!(code, Some(0), "{device}\n{out}\n{err}");
        (column(&out, "wire(B)"), column(&out, "relerr"))
    };
    let host = run("host");
    assert_eq!(host.0.len(), 4, "{host:?}");
    assert_eq!(run("cuda"), host, "wire(B) and relerr, device against host");
}

#[test]
fn reduce_scatter_unaligned_half() {
    on_emulated_gpu(&["--coll", "reduce_scatter", "-d", "half", "-u", "3"]);
}

/// Broadcast from the last rank: its send buffer is the root's alone.
#[test]
fn broadcast_from_the_last_rank() {
    on_emulated_gpu_with(|np| {
        ["--coll", "broadcast", "-r", &(np - 1).to_string()]
            .map(String::from)
            .to_vec()
    });
}

#[test]
fn hitopk_per_iteration() {
    on_emulated_gpu(&["--coll", "hitopk", "-I", "1"]);
}

/// Without --device a usable driver means device buffers (the result file says so); with
/// --device host the lines are the host ones.
#[test]
fn default_is_cuda_when_a_driver_is_usable() {
    let json = std::env::temp_dir().join(format!("qccl-perf-device-{}.json", std::process::id()));
    let path = json.to_str().unwrap();
    let (code, out, err) = perf(Some("1"), 1, &["-J", path]);
    assert_eq!(code, Some(0), "{out}\n{err}");
    check(&out, &err, 1, emulated_gpu);
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(doc["device"], "cuda", "{doc}");
    let _ = std::fs::remove_file(&json);
    let (code, out, err) = perf(Some("1"), 1, &["--device", "host"]);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("[host] cpu memory"), "{out}");
    assert!(!out.contains("# device buffers"), "{out}");
}

/// `--device cuda` without a driver stops before any rank makes a comm, naming what is
/// missing; the default falls back to host memory.
#[test]
fn cuda_without_a_driver_is_refused() {
    if qccl::gpu::available().is_ok() {
        eprintln!("skipped: this machine has a CUDA driver and GPU");
        return;
    }
    for np in [0, 1, 3] {
        let (code, out, err) = perf(None, np, &["--device", "cuda"]);
        assert_eq!(code, Some(2), "{out}\n{err}");
        assert!(out.is_empty(), "no table, no header:\n{out}");
        assert!(
            err.starts_with("qccl-perf: unsupported: --device cuda: ")
                && err.contains("--device host"),
            "{err}"
        );
        assert_eq!(
            err.lines().count(),
            1,
            "one message, not one per rank:\n{err}"
        );
    }
    let (code, out, err) = perf(None, 1, &[]);
    assert_eq!(code, Some(0), "{out}\n{err}");
    assert!(out.contains("[host] cpu memory"), "{out}");
}

/// Options device buffers cannot take are refused by name.
#[test]
fn register_and_calibrate_are_host_only() {
    for args in [&["-R", "1"][..], &["--calibrate"]] {
        let all = [&["--device", "cuda"], args].concat();
        let (code, out, err) = perf(Some("1"), 1, &all);
        assert_eq!(code, Some(2), "{all:?}\n{out}\n{err}");
        assert!(err.starts_with("qccl-perf: --device cuda: "), "{err}");
    }
}

/// The same runs on a real GPU (every rank on device `local rank % GPUs`).
#[test]
#[ignore = "needs an NVIDIA GPU (QCCL_REQUIRE_GPU=1 makes a missing one a failure)"]
fn on_a_real_gpu() {
    if let Err(e) = qccl::gpu::available() {
        assert_ne!(
            std::env::var("QCCL_REQUIRE_GPU").as_deref(),
            Ok("1"),
            "QCCL_REQUIRE_GPU=1 but no GPU: {e}"
        );
        eprintln!("skipped: {e}");
        return;
    }
    let real = |rest: &str| !rest.contains("emulated") && rest.contains(':');
    for args in [
        &[][..],
        &["-Z", "qsgd:bits=4,bucket=128"],
        &["--coll", "reduce_scatter", "-d", "half"],
        &["--coll", "hitopk"],
    ] {
        for np in [1, 3] {
            let all = [&["--device", "cuda"], args].concat();
            let (code, out, err) = perf(None, np, &all);
            assert_eq!(code, Some(0), "{all:?} on {np}\n{out}\n{err}");
            check(&out, &err, np, real);
        }
    }
    // Dense all-reduces over CUDA IPC between 3 processes on the one GPU.
    let all = ["--device", "cuda"];
    let (code, out, err) = perf_with(None, 3, &all, &[("QCCL_CUDA_IPC", "1")]);
    assert_eq!(code, Some(0), "CUDA IPC on 3\n{out}\n{err}");
    check(&out, &err, 3, real);
}
