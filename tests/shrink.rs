//! Survivors carry on: ranks of a job loop over mixed collectives checked against float64
//! references; one rank is SIGKILLed at a random moment; every survivor gets an error, calls
//! `shrink_failed` (or `shrink` with the lost rank), and the loop goes on, on the new comm,
//! to the end. Real processes over TCP and over shared memory.

mod common;

use common::coded::{grad, hash};
use common::job::{leftover_segments, text, wait, Job, CHILD};
use qccl::{Comm, Compression, ReduceOp};
use std::time::{Duration, Instant};

/// Exit code of a survivor that finished the loop after shrinking once.
const SHRUNK: i32 = 0;
/// Collectives each survivor runs at least, and at least after its shrink (a failure makes
/// it repeat its step on the new comm).
const STEPS: u64 = 60;
const AFTER: u64 = 30;

#[test]
fn child() {
    let Ok(scenario) = std::env::var(CHILD) else {
        return;
    };
    common::job::exit_with(run_child(&scenario), SHRUNK, 3);
}

fn var(name: &str) -> usize {
    std::env::var(name).unwrap().parse().unwrap()
}

fn run_child(scenario: &str) -> Result<(), String> {
    let mut comm = Comm::from_env().map_err(|e| e.to_string())?;
    if scenario == "disagree" {
        return disagree(&comm);
    }
    let (n, me, victim) = (comm.size(), comm.rank(), var("SHRINK_VICTIM"));
    if me == victim {
        // Dies at a random moment of its loop, whatever it is doing then.
        let after = Duration::from_millis(var("SHRINK_DIE_AFTER_MS") as u64);
        std::thread::spawn(move || {
            std::thread::sleep(after);
            // SIGKILL cannot be caught: the process ends here, mid-whatever.
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
        });
    }
    // Old ranks of the current comm's members (the test's own bookkeeping, for references).
    let mut members: Vec<usize> = (0..n).collect();
    let mut shrunk = None;
    let mut step = 0;
    let start = Instant::now();
    while step < STEPS || shrunk.is_none_or(|at| step < at + AFTER) {
        if shrunk.is_none() && start.elapsed() > Duration::from_secs(60) {
            break;
        }
        match one_step(&comm, &members, step) {
            Ok(()) => step += 1,
            Err(e) if shrunk.is_none() => {
                eprintln!("rank {me}: step {step}: {e}; shrinking");
                let t = Instant::now();
                let next = if scenario == "given" {
                    comm.shrink(&[victim])
                } else {
                    comm.shrink_failed()
                }
                .map_err(|e| format!("shrink at step {step}: {e}"))?;
                members.retain(|&r| r != victim);
                let want = members.iter().position(|&r| r == me).unwrap();
                if next.size() != members.len() || next.rank() != want {
                    return Err(format!(
                        "new comm: rank {} of {}, expected {want} of {}",
                        next.rank(),
                        next.size(),
                        members.len()
                    ));
                }
                eprintln!("rank {me}: shrunk in {:?}", t.elapsed());
                // A collective may have completed on some survivors and failed on others:
                // all resume from the earliest failed step (the recovery recipe's "agree on
                // the iteration"; here redoing a step is harmless).
                let mut from = [step];
                next.all_reduce_in_place(&mut from, ReduceOp::Min)
                    .map_err(|e| format!("agreeing on the step after the shrink: {e}"))?;
                step = from[0];
                shrunk = Some(step);
                comm = next;
            }
            Err(e) => return Err(format!("step {step} after the shrink: {e}")),
        }
    }
    match shrunk {
        Some(at) => {
            println!("SHRUNK-AT {at}");
            Ok(())
        }
        None => Err("the victim never failed the comm".into()),
    }
}

/// Survivors that name different ranks all get an error (no comm for anyone); the rank
/// they exclude, alive, sees its comm aborted.
fn disagree(comm: &Comm) -> Result<(), String> {
    comm.barrier().map_err(|e| e.to_string())?;
    let leaving: &[usize] = match comm.rank() {
        3 => {
            return match comm.barrier() {
                Err(e) => {
                    println!("EXCLUDED: {e}");
                    Ok(())
                }
                Ok(()) => Err("the excluded rank's comm was not aborted".into()),
            }
        }
        2 => &[1, 3],
        _ => &[3],
    };
    match comm.shrink(leaving) {
        Ok(c) => Err(format!("shrink gave a comm of {} ranks", c.size())),
        Err(e) => {
            println!("REFUSED: {e}");
            Ok(())
        }
    }
}

/// One collective of the loop, checked. `members` are the old ranks of `comm`'s ranks.
fn one_step(comm: &Comm, members: &[usize], step: u64) -> Result<(), String> {
    let q = |r: qccl::Result<()>| r.map_err(|e| e.to_string());
    let me = members[comm.rank()];
    let count = [1usize, 7, 4099, 65_537, 262_147][step as usize % 5];
    let input = |old: usize| grad(old, count, step);
    let sum = || {
        let mut s = vec![0f64; count];
        for &m in members {
            for (a, b) in s.iter_mut().zip(input(m)) {
                *a += b as f64;
            }
        }
        s
    };
    match step % 6 {
        0 | 1 => {
            let mut out = vec![0f32; count];
            q(comm.all_reduce(&input(me), &mut out, ReduceOp::Sum))?;
            close(&out, &sum(), 1e-5, "all_reduce")
        }
        2 => {
            let mut v: Vec<f64> = input(me).iter().map(|&x| x as f64).collect();
            q(comm.all_reduce_in_place(&mut v, ReduceOp::Avg))?;
            let want: Vec<f64> = sum().iter().map(|s| s / members.len() as f64).collect();
            let got: Vec<f32> = v.iter().map(|&x| x as f32).collect();
            close(&got, &want, 1e-6, "all_reduce avg f64")
        }
        3 => {
            let root = (step as usize / 6) % comm.size();
            let mut v = if comm.rank() == root {
                input(me)
            } else {
                vec![0f32; count]
            };
            q(comm.broadcast_in_place(&mut v, root))?;
            (v == input(members[root]))
                .then_some(())
                .ok_or_else(|| "broadcast: wrong data".into())
        }
        4 => {
            let mine = input(me);
            let mut all = vec![0f32; count * comm.size()];
            q(comm.all_gather(&mine, &mut all))?;
            for (i, &m) in members.iter().enumerate() {
                if all[i * count..(i + 1) * count] != input(m)[..] {
                    return Err(format!("all_gather: part {i} is not old rank {m}'s"));
                }
            }
            Ok(())
        }
        _ => {
            let c = Compression::parse("qsgd:bits=4,bucket=128").unwrap();
            let mut v = input(me);
            comm.all_reduce_compressed(&mut v, ReduceOp::Sum, &c)
                .map_err(|e| e.to_string())?;
            let mut hashes = vec![0u64; comm.size()];
            q(comm.all_gather(&[hash(&v)], &mut hashes))?;
            if hashes.iter().any(|&h| h != hashes[0]) {
                return Err("compressed all_reduce: ranks differ".into());
            }
            close(&v, &sum(), 0.5, "compressed all_reduce")
        }
    }
}

/// Relative L2 error of `got` against `want` within `bound`.
fn close(got: &[f32], want: &[f64], bound: f64, what: &str) -> Result<(), String> {
    let e = common::coded::rel_err(got, want);
    (e <= bound)
        .then_some(())
        .ok_or_else(|| format!("{what}: relative error {e} above {bound}"))
}

/// A small deterministic generator for the trials.
fn mix(x: u64) -> u64 {
    common::mix(x, 0x5348_5249_4e4b, 7)
}

/// One trial: `n` ranks, the victim killed after `die_ms`; every survivor must finish the
/// loop on the shrunk comm, and leave no segment behind.
fn trial(n: usize, victim: usize, die_ms: u64, scenario: &str, transport: &str) {
    let job = Job::new(n);
    let (v, d) = (victim.to_string(), die_ms.to_string());
    // "ib": every pair over the emulated RDMA link.
    let ib = transport == "ib";
    let mut env = vec![
        ("SHRINK_VICTIM", v.as_str()),
        ("SHRINK_DIE_AFTER_MS", d.as_str()),
        ("QCCL_TRANSPORT", if ib { "tcp" } else { transport }),
        ("QCCL_TIMEOUT_MS", "10000"),
        ("QCCL_DEBUG", "WARN"),
    ];
    if ib {
        env.extend([("QCCL_IB_EMULATE", "1"), ("QCCL_NET", "IB")]);
    }
    let children: Vec<_> = (0..n).map(|r| job.spawn(r, scenario, &env)).collect();
    let pids: Vec<u32> = children.iter().map(|c| c.id()).collect();
    let what = format!("{scenario} {n} ranks over {transport}, rank {victim} dies at {die_ms} ms");
    let outs: Vec<_> = children
        .into_iter()
        .map(|c| wait(c, Duration::from_secs(120)))
        .collect();
    let all = || {
        let each = outs
            .iter()
            .enumerate()
            .map(|(r, o)| format!("rank {r}: {}", text(o)));
        each.collect::<Vec<_>>().join("\n")
    };
    for (r, o) in outs.iter().enumerate() {
        if r == victim {
            continue;
        }
        let ok = o.status.code() == Some(SHRUNK);
        assert!(ok, "{what}: rank {r} failed; all ranks:\n{}", all());
        let log = String::from_utf8_lossy(&o.stderr);
        for l in log
            .lines()
            .filter(|l| l.contains("shrunk in") || l.contains("shrinking"))
        {
            eprintln!("{what}: {l}");
        }
    }
    let survivors: Vec<u32> = (0..n).filter(|&r| r != victim).map(|r| pids[r]).collect();
    let left = leftover_segments(&survivors);
    assert!(left.is_empty(), "{what}: segments left: {left:?}");
}

/// 50 random trials: 4 and 5 ranks, TCP and shared memory, the victim and the moment drawn.
#[test]
fn survivors_shrink_and_carry_on_in_50_random_trials() {
    let seed = std::env::var("QCCL_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    eprintln!("seed {seed} (QCCL_TEST_SEED reruns these trials)");
    for t in 0..50u64 {
        let r = mix(seed ^ t);
        let n = 4 + (r % 2) as usize;
        let victim = (r >> 8) as usize % n;
        let die_ms = 150 + (r >> 16) % 600;
        let transport = if (r >> 32).is_multiple_of(2) {
            "tcp"
        } else {
            "shm"
        };
        trial(n, victim, die_ms, "failed", transport);
    }
}

/// The same with the lost rank named (`shrink(&[victim])`), rank 0 among the victims.
#[test]
fn survivors_shrink_with_the_lost_rank_named() {
    for (n, victim, transport) in [(4, 0, "tcp"), (5, 3, "shm"), (4, 1, "shm")] {
        trial(n, victim, 300, "given", transport);
    }
}

#[test]
fn survivors_shrink_over_the_emulated_rdma_link() {
    trial(4, 1, 300, "given", "ib");
}

/// Survivors that disagree on who leaves: every one of them gets an error, within the
/// timeout, and none gets a comm.
#[test]
fn survivors_that_disagree_on_who_leaves_all_get_an_error() {
    let job = Job::new(4);
    let env = [("QCCL_TIMEOUT_MS", "5000"), ("SHRINK_VICTIM", "99")];
    let start = Instant::now();
    let outs = job.run("disagree", &env, Duration::from_secs(60));
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.status.code(), Some(SHRUNK), "rank {r}:\n{}", text(o));
        let out = String::from_utf8_lossy(&o.stdout);
        let want = if r == 3 { "EXCLUDED" } else { "REFUSED" };
        assert!(out.contains(want), "rank {r}: {}", text(o));
        let line = out.lines().find(|l| l.contains(want)).unwrap_or_default();
        eprintln!("rank {r}: {line}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
}

/// The example (examples/shrink_training.rs) loses rank 2 at step 50 and its survivors
/// finish with the loss of the run that lost no one: the lost rank's data is shared out.
#[test]
fn the_training_example_survives_a_killed_rank() {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let example = dir.join("examples").join("shrink_training");
    assert!(
        example.exists(),
        "{} is missing: run the whole `cargo test` (it builds the examples)",
        example.display()
    );
    let run = |kill_at: &str| {
        let out = std::process::Command::new(&example)
            .args(["--kill-at", kill_at])
            .env_remove("QCCL_RANK")
            .env("QCCL_TIMEOUT_MS", "20000")
            .output()
            .expect("running the example");
        let text = format!(
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{text}");
        let last = text
            .lines()
            .find(|l| l.starts_with("step 119: loss"))
            .unwrap_or_else(|| panic!("no final loss in\n{text}"))
            .to_string();
        (last, text)
    };
    let (lost, text) = run("50");
    assert!(text.contains("lost a rank at step 50"), "{text}");
    assert!(
        text.contains("on 3 ranks") && text.contains("3 ranks finished"),
        "{text}"
    );
    let (whole, _) = run("0");
    // Same loss to 3 digits (the sums' order differs: 3 shards instead of 4).
    let loss = |l: &str| -> f64 { l.split_whitespace().nth(3).unwrap().parse().unwrap() };
    assert!(
        (loss(&lost) - loss(&whole)).abs() < 1e-3,
        "{lost} vs {whole}"
    );
}
