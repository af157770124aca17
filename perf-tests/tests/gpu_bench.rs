//! qccl-gpu-bench run as a user would, under the emulated GPU driver (QCCL_GPU_EMULATE=1: the
//! kernels run on the CPU through the shim, so only the table's shape and the JSON are
//! checked, never a figure), and its refusals.

use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_qccl-gpu-bench");

fn bench(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("QCCL_GPU_EMULATE", "1")
        .output()
        .expect("run qccl-gpu-bench")
}

#[test]
fn prints_every_row_against_the_copy_and_writes_json() {
    let dir = std::env::temp_dir().join(format!("qccl-gpu-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("gpu.json");
    let o = bench(&[
        "-b",
        "64K",
        "-n",
        "1",
        "-w",
        "0",
        "-d",
        "float,bf16",
        "--codec",
        "qsgd:bits=4,bucket=128",
        "--codec",
        "randk:density=0.01",
        "-J",
        json.to_str().unwrap(),
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("# Using device 0: emulated GPU"), "{out}");
    let rows: Vec<&str> = out.lines().filter(|l| !l.starts_with('#')).collect();
    let names = [
        "copy",
        "reduce sum f32",
        "reduce sum bf16",
        "encode+ef qsgd:bits=4,bucket=128",
        "decode+add qsgd:bits=4,bucket=128",
        "encode+ef randk:density=0.01",
        "decode+add randk:density=0.01",
    ];
    assert_eq!(rows.len(), names.len(), "{out}");
    for (row, name) in rows.iter().zip(names) {
        assert!(row.trim_start().starts_with(name), "{row:?} is not {name}");
    }
    // The copy's own ratio is 1.
    assert!(rows[0].trim_end().ends_with("1.00"), "{}", rows[0]);
    let text = std::fs::read_to_string(&json).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["driver"], "emulated");
    assert_eq!(v["count"], 16384);
    assert_eq!(v["rows"].as_array().unwrap().len(), names.len());
    assert_eq!(v["rows"][0]["traffic_bytes"], 2 * 65536);
    // A codec row splits its time among its plan's kernels, in the table and the JSON.
    assert!(
        out.contains("#   qccl_qsgd_levels_ef "),
        "no kernel lines under the qsgd row: {out}"
    );
    let kernels = v["rows"][3]["kernels"].as_array().unwrap();
    assert_eq!(kernels[0]["kernel"], "qccl_qsgd_bounds_ef");
    assert_eq!(v["rows"][0]["kernels"].as_array().unwrap().len(), 0);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_arguments_and_codecs_are_refused_by_name() {
    for (args, needle) in [
        (&["-d", "complex"][..], "unknown datatype 'complex'"),
        (&["--codec", "zip:level=3", "-b", "4K"][..], "zip"),
        (&["-b", "0"][..], "at least 1"),
    ] {
        let o = bench(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}
