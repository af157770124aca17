//! Runs the `train_sim` example (examples/train_sim.rs) small: 2 processes, `--quick`, and
//! checks it completes and reports all four strategies with a measured and a simulated time.
//!
//! `cargo test` builds the examples next to the test binaries (`target/<profile>/examples/`),
//! which is where this looks for it.

use std::path::PathBuf;
use std::process::Command;

fn example() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/train_sim-<hash> -> target/<profile>/examples/train_sim
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let path = dir.join("examples").join("train_sim");
    assert!(
        path.exists(),
        "{} is missing: run the whole `cargo test` (it builds the examples) or \
         `cargo build -p qccl-planner --example train_sim` first",
        path.display()
    );
    path
}

#[test]
fn quick_run_reports_all_four_strategies() {
    let out = Command::new(example())
        .args(["-np", "2", "--quick", "--timeout", "120"])
        .env_remove("QCCL_RANK")
        .output()
        .expect("run train_sim");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "train_sim failed\n{stdout}\n{stderr}");
    for name in [
        "no compression, layer-wise",
        "qsgd:bits=4, layer-wise",
        "qsgd:bits=4, Cupcake fusion",
        "DeAR (RS in bwd, AG in fwd)",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no row {name:?} in\n{stdout}"));
        // groups, measured ms, simulated ms, error %: all numbers, times positive.
        let nums: Vec<f64> = line[name.len()..]
            .split_whitespace()
            .map(|x| {
                x.parse()
                    .unwrap_or_else(|_| panic!("bad number in {line:?}"))
            })
            .collect();
        assert_eq!(nums.len(), 4, "{line}");
        assert!(nums[0] >= 1.0 && nums[1] > 0.0 && nums[2] > 0.0, "{line}");
    }
}

#[test]
fn bad_arguments_fail_cleanly() {
    let out = Command::new(example())
        .args(["--compute", "maybe"])
        .env_remove("QCCL_RANK")
        .output()
        .expect("run train_sim");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--compute maybe"));
}
