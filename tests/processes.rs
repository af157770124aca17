//! Ranks as separate OS processes over TCP on loopback: the whole collective suite, and the
//! failure cases (a killed rank, ranks that disagree, a wrong secret, a late joiner).
//!
//! The test binary re-executes itself: `child` is the rank's entry point, a no-op unless
//! QCCL_TEST_CHILD names a scenario.

mod common;

use common::job::{child_command, leftover_segments, text, wait, Job, CHILD};
use common::suite::{cases, run_all, run_case, run_huge, Case};
use qccl::{Algo, Comm, DType, ReduceOp};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

/// Exit code of a rank whose collective returned the expected kind of error.
const FAILED_CLEANLY: i32 = 3;

#[test]
fn child() {
    let Ok(scenario) = std::env::var(CHILD) else {
        return;
    };
    // Strangers tests: ranks other than 0 join once the root's strangers are connected.
    if std::env::var("QCCL_RANK").is_ok_and(|r| r != "0") {
        if let Ok(gate) = std::env::var("GATE_BEFORE_INIT") {
            wait_for_file(&gate);
        }
    }
    common::job::exit_with(run_child(&scenario), 0, FAILED_CLEANLY);
}

fn run_child(scenario: &str) -> Result<(), String> {
    let comm = Comm::from_env().map_err(|e| e.to_string())?;
    match scenario {
        "suite" => {
            run_all(&comm, &cases(true))?;
            run_huge(&comm)
        }
        "compressed" => {
            for (spec, bound) in COMPRESSED_SPECS {
                common::coded::check_spec(&comm, spec, *bound)?;
            }
            Ok(())
        }
        "hitopk" => common::topk::check_over_processes(&comm),
        "arena" => {
            // Every collective on 5 or 7 ranks: all-reduce, reduce-scatter and all-gather
            // through the shared-memory arena, the rest over the pairwise rings.
            for (i, c) in cases(false)
                .into_iter()
                .chain([Case {
                    dtype: DType::Float32,
                    op: ReduceOp::Sum,
                    count: 1_000_003,
                }])
                .enumerate()
            {
                let count = if c.count == 1000 { 65537 } else { c.count };
                run_case(&comm, &Case { count, ..c }, i as u64)?;
            }
            Ok(())
        }
        "allreduce" => {
            let send = vec![comm.rank() as f32 + 1.0; 1000];
            let mut recv = vec![0f32; 1000];
            comm.all_reduce(&send, &mut recv, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            let n = comm.size() as f32;
            if recv.iter().any(|&x| x != n * (n + 1.0) / 2.0) {
                return Err(format!("wrong all_reduce result {}", recv[0]));
            }
            Ok(())
        }
        "async" => {
            // A non-blocking all-reduce, checked exactly (small integers sum exactly).
            let buf: Vec<f32> = (0..1000).map(|i| (comm.rank() * 1000 + i) as f32).collect();
            let out = comm
                .all_reduce_async(buf, ReduceOp::Sum)
                .and_then(|r| r.wait())
                .map_err(|e| e.to_string())?;
            let n = comm.size();
            for (i, &x) in out.iter().enumerate() {
                let want: usize = (0..n).map(|r| r * 1000 + i).sum();
                if x != want as f32 {
                    return Err(format!("all_reduce_async: element {i} is {x}, want {want}"));
                }
            }
            Ok(())
        }
        "loop" => {
            // Large all-reduces until something fails (the parent kills a rank).
            let mut buf = vec![1f32; 4 << 20];
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(60) {
                let t = Instant::now();
                if let Err(e) = comm.all_reduce_in_place(&mut buf, ReduceOp::Max) {
                    return Err(format!("after {} ms: {e}", t.elapsed().as_millis()));
                }
            }
            Ok(())
        }
        "auto_between_hosts" => {
            // One rank per emulated host: auto takes the tree below 16 KiB, SRA from there.
            for (count, want) in [(2048, Algo::Tree), (4096, Algo::Sra), (65536, Algo::Sra)] {
                let send: Vec<f32> = (0..count).map(|i| (comm.rank() + i % 7) as f32).collect();
                let mut recv = vec![0f32; count];
                let got = comm
                    .all_reduce_with(Some(&send), &mut recv, ReduceOp::Sum, Algo::Auto)
                    .map_err(|e| e.to_string())?;
                if got != want {
                    return Err(format!("{count} floats: auto took {got:?}, want {want:?}"));
                }
                let n = comm.size();
                for (i, &x) in recv.iter().enumerate() {
                    let exact: usize = (0..n).map(|r| r + i % 7).sum();
                    if x != exact as f32 {
                        return Err(format!("{count} floats: element {i} is {x}, want {exact}"));
                    }
                }
            }
            Ok(())
        }
        "strangers" => {
            // Connections start once the strangers hold their connections to every listener.
            wait_for_file(&std::env::var("GATE_BEFORE_CONNECT").map_err(|e| e.to_string())?);
            let t = Instant::now();
            let n = comm.size();
            let send = vec![comm.rank() as f32 + 1.0; 1000];
            let mut recv = vec![0f32; 1000];
            comm.all_reduce(&send, &mut recv, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            let mut all = vec![0u32; n];
            comm.all_gather(&[comm.rank() as u32], &mut all)
                .map_err(|e| e.to_string())?;
            if all != (0..n as u32).collect::<Vec<_>>() || recv[0] != (n * (n + 1) / 2) as f32 {
                return Err(format!("wrong results {all:?} {}", recv[0]));
            }
            eprintln!(
                "QCCL-TEST: connected and done in {} ms",
                t.elapsed().as_millis()
            );
            Ok(())
        }
        "stall_loop" => stall_loop(&comm),
        "mismatch" => {
            // Rank 2 disagrees on the count.
            let count = if comm.rank() == 2 { 7 } else { 5 };
            let mut buf = vec![1f32; count];
            comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)
                .map_err(|e| e.to_string())
        }
        "silent" => {
            // One all-reduce through the arena, then rank 2 stays away from the second one
            // (SILENT_COUNT floats: SRA rounds, or one shot when small).
            let count = std::env::var("SILENT_COUNT").map_or(1 << 16, |c| c.parse().unwrap());
            let mut buf = vec![1f32; count];
            comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            if comm.rank() == 2 {
                std::thread::sleep(Duration::from_secs(4));
                return Ok(());
            }
            let t = Instant::now();
            match comm.all_reduce_in_place(&mut buf, ReduceOp::Sum) {
                Ok(()) => Err("the second all-reduce succeeded without rank 2".into()),
                Err(e) => Err(format!("after {} ms: {e}", t.elapsed().as_millis())),
            }
        }
        other => Err(format!("unknown scenario {other}")),
    }
}

/// Collectives of every kind, sizes and algorithm in turn, until one fails (the parent stops a
/// rank with SIGSTOP). The error must be the comm's asynchronous error too.
fn stall_loop(comm: &Comm) -> Result<(), String> {
    let (n, me) = (comm.size(), comm.rank());
    let algos = [Algo::Ring, Algo::Tree, Algo::Sra, Algo::Auto];
    let counts = [1000, 65536, 1 << 20];
    let mut buf = vec![1f32; (1 << 20) * n];
    let mut out = vec![0f32; (1 << 20) * n];
    let start = Instant::now();
    let mut i = 0usize;
    while start.elapsed() < Duration::from_secs(60) {
        if i == 20 {
            eprintln!("QCCL-TEST: looping");
        }
        let count = counts[i / 11 % counts.len()];
        let what = match i % 11 {
            0..=3 => format!("all_reduce {count} {:?}", algos[i % 11]),
            4 => format!("broadcast {count}"),
            5 => format!("all_gather {count}"),
            6 => format!("reduce_scatter {count}"),
            7 => format!("reduce {count}"),
            8 => format!("all_to_all {count}"),
            9 => "barrier".to_string(),
            _ => format!("all_reduce {count} in place"),
        };
        let t = Instant::now();
        let r = match i % 11 {
            0..=3 => comm
                .all_reduce_with(
                    Some(&buf[..count]),
                    &mut out[..count],
                    ReduceOp::Sum,
                    algos[i % 11],
                )
                .map(drop),
            4 => comm.broadcast_in_place(&mut buf[..count], i % n),
            5 => comm.all_gather(&buf[..count], &mut out[..count * n]),
            6 => comm.reduce_scatter(&buf[..count * n], &mut out[..count], ReduceOp::Max),
            7 => comm.reduce(&buf[..count], &mut out[..count], ReduceOp::Max, i % n),
            8 => comm.all_to_all(&buf[..count * n], &mut out[..count * n]),
            9 => comm.barrier(),
            _ => comm.all_reduce_in_place(&mut buf[..count], ReduceOp::Max),
        };
        if let Err(e) = r {
            let same = comm.async_error().as_ref() == Some(&e);
            return Err(format!(
                "rank {me} after {} ms in {what} (call {i}; async error the same: {same}): {e}",
                t.elapsed().as_millis()
            ));
        }
        i += 1;
    }
    Ok(())
}

fn suite(n: usize, transport: &str) {
    let env = [("QCCL_TRANSPORT", transport), ("QCCL_DEBUG", "INFO")];
    let outs = Job::new(n).run("suite", &env, Duration::from_secs(600));
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.status.code(), Some(0), "rank {r} of {n}:\n{}", text(o));
        // Every peer connection used the transport asked for.
        let log = String::from_utf8_lossy(&o.stderr);
        let over = format!(" over {transport}");
        let connected = log.lines().filter(|l| l.contains("connected to rank"));
        assert!(connected.clone().count() > 0, "{log}");
        assert!(connected.clone().all(|l| l.contains(&over)), "{log}");
    }
}

// Four processes run the suite in `emulated_hosts_use_shm_inside_a_host_and_tcp_between_hosts`
// (shm and tcp at once), five and seven in `arena_*`.
#[test]
fn suite_2_processes_tcp() {
    suite(2, "tcp");
}

#[test]
fn suite_3_processes_tcp() {
    suite(3, "tcp");
}

/// Codecs checked over real processes, with the relative error each may reach on 4 ranks.
const COMPRESSED_SPECS: &[(&str, f64)] = &[
    ("fp16", 2e-3),
    ("bf16:ef=1", 2e-2),
    ("qsgd:bits=4,bucket=128", 0.35),
    ("topk:density=0.01,ef=1", 1.5),
];

fn compressed(n: usize, transport: &str) {
    let env = [("QCCL_TRANSPORT", transport)];
    let outs = Job::new(n).run("compressed", &env, Duration::from_secs(600));
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.status.code(), Some(0), "rank {r} of {n}:\n{}", text(o));
    }
}

#[test]
fn compressed_4_processes_shm() {
    compressed(4, "shm");
}

#[test]
fn compressed_3_processes_tcp() {
    compressed(3, "tcp");
}

#[test]
fn suite_2_processes_shm() {
    suite(2, "shm");
}

#[test]
fn suite_3_processes_shm() {
    suite(3, "shm");
}

/// Every collective on 5 and 7 processes over shared memory, with 4 KiB per owner and round
/// in the arena so that large calls take hundreds of rounds and reuse every slot many times.
fn arena(n: usize) {
    let env = [
        ("QCCL_TRANSPORT", "shm"),
        ("QCCL_SHM_ARENA_CHUNK", "4096"),
        ("QCCL_DEBUG", "INFO"),
    ];
    let outs = Job::new(n).run("arena", &env, Duration::from_secs(600));
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.status.code(), Some(0), "rank {r} of {n}:\n{}", text(o));
        let log = String::from_utf8_lossy(&o.stderr);
        assert!(
            log.contains(&format!("shared-memory arena over {n} ranks, 4 KiB")),
            "rank {r} did not use the arena:\n{log}"
        );
    }
}

#[test]
fn arena_5_processes() {
    arena(5);
}

#[test]
fn arena_7_processes() {
    arena(7);
}

#[test]
fn emulated_hosts_use_shm_inside_a_host_and_tcp_between_hosts() {
    let job = Job::new(4);
    let children: Vec<Child> = (0..4)
        .map(|r| {
            let host = if r < 2 { "host-a" } else { "host-b" };
            // Small pieces, so that the 1M-element cases run the hierarchical all-reduce's
            // pipeline over many pieces.
            let env = [
                ("QCCL_HOSTID", host),
                ("QCCL_DEBUG", "INFO"),
                ("QCCL_CHUNKSIZE", "65536"),
            ];
            job.spawn(r, "suite", &env)
        })
        .collect();
    for (r, c) in children.into_iter().enumerate() {
        let o = wait(c, Duration::from_secs(600));
        assert_eq!(o.status.code(), Some(0), "rank {r}: {}", text(&o));
        let log = String::from_utf8_lossy(&o.stderr).into_owned();
        // The world comm: shm to the same emulated host, tcp to the other.
        let world = log
            .lines()
            .find_map(|l| l.split(&format!("rank {r}/4: comm ")).nth(1))
            .map(|rest| rest[..18].to_string())
            .expect("the world comm's id is logged");
        for line in log
            .lines()
            .filter(|l| l.contains(&format!("comm {world}: connected to rank")))
        {
            let peer: usize = line.split("connected to rank ").nth(1).unwrap()[..1]
                .parse()
                .unwrap();
            let same_host = (peer < 2) == (r < 2);
            let want = if same_host { " over shm" } else { " over tcp" };
            assert!(line.contains(want), "rank {r}: {line}");
        }
        // The suite's hierarchical all-reduces: intra-host level on shm, inter-host on tcp.
        assert!(
            log.contains("intra-host comm of 2 on tcp+shm"),
            "rank {r}: {log}"
        );
        assert!(
            log.lines()
                .any(|l| l.contains("/2: comm ") && l.contains(" on tcp (node")),
            "rank {r}: no inter-host tcp comm in {log}"
        );
    }
}

#[test]
fn auto_between_hosts_takes_sra_from_16_kib() {
    let job = Job::new(3);
    let children: Vec<Child> = (0..3)
        .map(|r| {
            job.spawn(
                r,
                "auto_between_hosts",
                &[("QCCL_HOSTID", &format!("host-{r}"))],
            )
        })
        .collect();
    for (r, c) in children.into_iter().enumerate() {
        let o = wait(c, Duration::from_secs(60));
        assert_eq!(o.status.code(), Some(0), "rank {r}: {}", text(&o));
    }
}

#[test]
fn two_sockets_per_peer_and_debug_logging_to_a_file() {
    let dir = std::env::temp_dir().join(format!("qccl-log-{}", rand::random::<u32>()));
    std::fs::create_dir_all(&dir).unwrap();
    let pattern = dir.join("qccl.%h.%p.log");
    let env = [
        ("QCCL_TRANSPORT", "tcp"),
        ("QCCL_NSOCKS_PERPEER", "2"),
        ("QCCL_DEBUG", "INFO"),
        ("QCCL_DEBUG_FILE", pattern.to_str().unwrap()),
    ];
    let outs = Job::new(3).run("allreduce", &env, Duration::from_secs(60));
    for o in &outs {
        assert_eq!(o.status.code(), Some(0), "{}", text(o));
    }
    // One file per process (%p), each saying what the environment set and what connected.
    let logs: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
        .collect();
    assert_eq!(logs.len(), 3, "{logs:?}");
    for log in &logs {
        assert!(
            log.contains("QCCL_NSOCKS_PERPEER set by environment to 2"),
            "{log}"
        );
        assert!(log.contains("over tcp (2 socket(s))"), "{log}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn killed_rank_makes_the_others_fail_within_the_timeout_over_tcp() {
    killed_rank(&[("QCCL_TIMEOUT_MS", "3000"), ("QCCL_TRANSPORT", "tcp")]);
}

#[test]
fn killed_rank_over_shm_makes_the_others_fail_and_leaves_no_segment() {
    let pids = killed_rank(&[("QCCL_TIMEOUT_MS", "3000"), ("QCCL_TRANSPORT", "shm")]);
    let left = leftover_segments(&pids);
    assert!(left.is_empty(), "segments left in /dev/shm: {left:?}");
}

/// Kills rank 1 of 3 mid-collective; checks the survivors' errors; returns all three pids.
fn killed_rank(env: &[(&str, &str)]) -> Vec<u32> {
    let job = Job::new(3);
    let mut children: Vec<Child> = (0..3).map(|r| job.spawn(r, "loop", env)).collect();
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    std::thread::sleep(Duration::from_millis(1500));
    let mut victim = children.remove(1);
    // Child::kill is SIGKILL on Unix: no chance to say goodbye.
    victim.kill().unwrap();
    let killed_at = Instant::now();
    let _ = wait(victim, Duration::from_secs(5));
    for c in children {
        let o = wait(c, Duration::from_secs(20));
        let took = killed_at.elapsed();
        assert_eq!(o.status.code(), Some(FAILED_CLEANLY), "{}", text(&o));
        assert!(
            took < Duration::from_millis(3000 + 2000),
            "survivor took {took:?}"
        );
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("rank 1"), "error should name rank 1: {err}");
    }
    pids
}

#[test]
fn ranks_that_disagree_all_get_an_error_naming_the_odd_one() {
    disagree(&[("QCCL_TIMEOUT_MS", "5000")]);
}

#[test]
fn ranks_that_disagree_in_the_shared_memory_arena_all_get_the_same_error() {
    disagree(&[
        ("QCCL_TIMEOUT_MS", "5000"),
        ("QCCL_TRANSPORT", "shm"),
        ("QCCL_ALGO", "sra"),
    ]);
}

#[test]
fn a_rank_that_stays_away_from_an_arena_collective_times_the_others_out() {
    stays_away("65536");
}

#[test]
fn a_rank_that_stays_away_from_a_one_shot_all_reduce_times_the_others_out() {
    stays_away("1000");
}

fn stays_away(count: &str) {
    let env = [
        ("QCCL_TIMEOUT_MS", "1500"),
        ("QCCL_TRANSPORT", "shm"),
        ("QCCL_ALGO", "sra"),
        ("SILENT_COUNT", count),
    ];
    let outs = Job::new(3).run("silent", &env, Duration::from_secs(30));
    assert_eq!(outs[2].status.code(), Some(0), "{}", text(&outs[2]));
    let mut timed_out = 0;
    for (r, o) in outs[..2].iter().enumerate() {
        let err = failed_cleanly(&format!("rank {r}"), o);
        // The first survivor to time out aborts, and the other may learn of it (with the
        // reason) before its own timeout.
        assert!(
            err.contains("shared-memory arena stalled"),
            "rank {r}: {err}"
        );
        // Rank 2 is named, with its address, as the one the others waited for.
        assert!(
            err.contains("rank 2 (127.0.0.1:")
                && err.contains("made no progress for 1500 ms (QCCL_TIMEOUT_MS)"),
            "rank {r}: {err}"
        );
        eprintln!("rank {r}: {}", err.lines().last().unwrap_or_default());
        let one_shot = err.contains("one-shot round");
        assert_eq!(one_shot, count == "1000", "rank {r}: {err}");
        let timeout = err.contains("timeout");
        assert!(timeout || err.contains("peer aborted"), "rank {r}: {err}");
        timed_out += usize::from(timeout && !err.contains("peer aborted"));
        let ms: u64 = err
            .split("after ")
            .nth(1)
            .and_then(|t| t.split(' ').next())
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("rank {r}: no elapsed time in {err}"));
        // A rank that learned of the other's abort may have started its call a moment later
        // than the one that timed out, so its own clock reads a little under the timeout.
        let least = if err.contains("peer aborted") {
            1000
        } else {
            1500
        };
        assert!(
            (least..3500).contains(&ms),
            "rank {r} failed after {ms} ms: {err}"
        );
    }
    assert!(timed_out > 0, "no survivor reported the stalled arena");
}

/// Checks that `o` is a rank whose collective failed with an error (not a crash, not a hang)
/// and returns its stderr.
fn failed_cleanly(who: &str, o: &Output) -> String {
    assert_eq!(o.status.code(), Some(FAILED_CLEANLY), "{who}: {}", text(o));
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Rank 2 of 3 all-reduces 7 elements, the others 5: everyone fails naming rank 2's call.
fn disagree(env: &[(&str, &str)]) {
    let outs = Job::new(3).run("mismatch", env, Duration::from_secs(30));
    for (r, o) in outs.iter().enumerate() {
        let err = failed_cleanly(&format!("rank {r}"), o);
        assert!(
            err.contains("count=7") && err.contains("rank 2"),
            "rank {r}: {err}"
        );
    }
}

#[test]
fn a_stranger_with_the_wrong_secret_is_refused_and_the_job_goes_on() {
    let job = Job::new(2);
    let env = [("QCCL_DEBUG", "WARN")];
    let root = job.spawn(0, "allreduce", &env);
    let wrong = "0123456789abcdef0123456789abcdef";
    let stranger = job.spawn(
        1,
        "allreduce",
        &[("QCCL_SECRET", wrong), ("QCCL_INIT_TIMEOUT_MS", "5000")],
    );
    let s = wait(stranger, Duration::from_secs(20));
    assert_eq!(s.status.code(), Some(FAILED_CLEANLY), "{}", text(&s));
    assert!(
        String::from_utf8_lossy(&s.stderr).contains("wrong secret"),
        "{}",
        text(&s)
    );
    let real = job.spawn(1, "allreduce", &env);
    for o in [
        wait(root, Duration::from_secs(30)),
        wait(real, Duration::from_secs(30)),
    ] {
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    }
}

#[test]
fn a_late_joiner_past_the_init_deadline_fails_everyone_clearly() {
    let job = Job::new(2);
    let env = [("QCCL_INIT_TIMEOUT_MS", "1500")];
    let root = job.spawn(0, "allreduce", &env);
    std::thread::sleep(Duration::from_millis(2500));
    let late = job.spawn(1, "allreduce", &env);
    let r = wait(root, Duration::from_secs(20));
    let l = wait(late, Duration::from_secs(20));
    assert_eq!(r.status.code(), Some(FAILED_CLEANLY), "{}", text(&r));
    assert!(
        String::from_utf8_lossy(&r.stderr).contains("[1] did not join"),
        "{}",
        text(&r)
    );
    assert_eq!(l.status.code(), Some(FAILED_CLEANLY), "{}", text(&l));
}

#[test]
fn torchrun_variables_are_enough_to_join() {
    let job = Job::new(2);
    // qccl rendezvouses on MASTER_PORT + 1 (torchrun's store has MASTER_PORT): the job's
    // reserved port. Nothing listens on MASTER_PORT here.
    let master_port = job.port() - 1;
    let children: Vec<Child> = (0..2)
        .map(|r| {
            let mut cmd = child_command("allreduce");
            cmd.env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", master_port.to_string())
                .env_remove("QCCL_RANK")
                .env_remove("QCCL_COMM_ID");
            cmd.spawn().unwrap()
        })
        .collect();
    for c in children {
        let o = wait(c, Duration::from_secs(30));
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    }
}

#[test]
fn compressed_on_2_emulated_hosts_x_2_ranks() {
    // Auto resolves to the hierarchical schedule here: the inter-host level (tcp) compressed,
    // the intra-host levels (shm) dense; every other schedule runs flat over tcp+shm.
    let job = Job::new(4);
    let children: Vec<Child> = (0..4)
        .map(|r| {
            let host = if r % 2 == 0 { "host-a" } else { "host-b" };
            // 100_003-element cases go through the pipeline in 7 pieces.
            job.spawn(
                r,
                "compressed",
                &[("QCCL_HOSTID", host), ("QCCL_CHUNKSIZE", "65536")],
            )
        })
        .collect();
    for (r, c) in children.into_iter().enumerate() {
        let o = wait(c, Duration::from_secs(600));
        assert_eq!(o.status.code(), Some(0), "rank {r}: {}", text(&o));
    }
}

#[test]
fn async_all_reduce_goes_hierarchical_across_emulated_hosts() {
    let job = Job::new(4);
    let children: Vec<Child> = (0..4)
        .map(|r| {
            let host = if r < 2 { "host-a" } else { "host-b" };
            job.spawn(
                r,
                "async",
                &[
                    ("QCCL_HOSTID", host),
                    ("QCCL_DEBUG", "TRACE"),
                    ("QCCL_DEBUG_SUBSYS", "COLL"),
                ],
            )
        })
        .collect();
    for (r, c) in children.into_iter().enumerate() {
        let o = wait(c, Duration::from_secs(300));
        assert_eq!(o.status.code(), Some(0), "rank {r}: {}", text(&o));
        let log = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(
            log.lines()
                .any(|l| l.contains("all_reduce(count=1000,") && l.ends_with(": hierarchical")),
            "rank {r}: the async all-reduce did not go hierarchical: {log}"
        );
        // Route lines are COLL, and COLL alone leaves out the connections (INIT and NET).
        assert!(log.contains(" QCCL TRACE COLL rank "), "{log}");
        assert!(!log.contains("connected to rank"), "{log}");
    }
}

fn hitopk_on(hosts: &[&str]) {
    let job = Job::new(hosts.len());
    let all = hosts.join(",");
    let children: Vec<Child> = hosts
        .iter()
        .enumerate()
        .map(|(r, h)| job.spawn(r, "hitopk", &[("QCCL_HOSTID", h), ("TEST_HOSTS", &all)]))
        .collect();
    for (r, c) in children.into_iter().enumerate() {
        let o = wait(c, Duration::from_secs(600));
        assert_eq!(o.status.code(), Some(0), "{hosts:?} rank {r}: {}", text(&o));
    }
}

#[test]
fn hitopk_2_hosts_x_2_processes() {
    hitopk_on(&["host-a", "host-a", "host-b", "host-b"]);
}

#[test]
fn hitopk_1_host_x_4_and_2_hosts_x_3_processes() {
    hitopk_on(&["h", "h", "h", "h"]);
    hitopk_on(&["a", "b", "a", "b", "a", "b"]);
}

#[test]
fn a_segment_left_by_a_killed_setup_is_cleared_by_the_next_job() {
    // A process gone for good: its pid names the segments it would have left.
    let mut gone = Command::new("true").spawn().unwrap();
    gone.wait().unwrap();
    let name = |tag: &str| format!("/dev/shm/qccl-{tag}-p{}-0-1-00000000", gone.id());
    let (old, young) = (name("00000000000000a1"), name("00000000000000a2"));
    for f in [&old, &young] {
        std::fs::write(f, b"left behind").unwrap();
    }
    let two_minutes_ago = std::time::SystemTime::now() - Duration::from_secs(120);
    std::fs::File::options()
        .write(true)
        .open(&old)
        .unwrap()
        .set_modified(two_minutes_ago)
        .unwrap();
    let outs = Job::new(2).run(
        "allreduce",
        &[("QCCL_TRANSPORT", "shm")],
        Duration::from_secs(60),
    );
    let young_kept = std::path::Path::new(&young).exists();
    let _ = std::fs::remove_file(&young);
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.status.code(), Some(0), "rank {r}: {}", text(o));
    }
    assert!(!std::path::Path::new(&old).exists(), "{old} is still there");
    // Younger than a minute: perhaps a live setup in another pid namespace; kept.
    assert!(young_kept, "{young} was removed");
}

/// Waits (at most a minute) until `path` exists.
fn wait_for_file(path: &str) {
    let start = Instant::now();
    while !std::path::Path::new(path).exists() && start.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A rank whose stderr is read as it comes: lines go to `lines` as well as into the text
/// that `finish` returns with the rank's exit status.
struct Watched {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
    /// The lines received so far.
    seen: Vec<String>,
    stderr: std::thread::JoinHandle<String>,
}

impl Watched {
    fn spawn(job: &Job, rank: usize, scenario: &str, env: &[(&str, &str)]) -> Watched {
        let mut child = job.spawn(rank, scenario, env);
        let err = child.stderr.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        let stderr = std::thread::spawn(move || {
            use std::io::BufRead;
            let mut all = String::new();
            for line in std::io::BufReader::new(err).lines().map_while(|l| l.ok()) {
                let _ = tx.send(line.clone());
                all.push_str(&line);
                all.push('\n');
            }
            all
        });
        Watched {
            child,
            lines,
            seen: Vec::new(),
            stderr,
        }
    }

    /// The text after `marker` on the first line holding it, up to the next space or comma.
    fn find(&mut self, marker: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut i = 0;
        loop {
            if i == self.seen.len() {
                let left = deadline.saturating_duration_since(Instant::now());
                let line = self
                    .lines
                    .recv_timeout(left)
                    .unwrap_or_else(|_| panic!("no line with {marker:?}"));
                self.seen.push(line);
            }
            if let Some(rest) = self.seen[i].split(marker).nth(1) {
                return rest.split([' ', ',']).next().unwrap().to_string();
            }
            i += 1;
        }
    }

    /// Waits (at most `limit`, then kills) and returns the exit code and the whole stderr.
    fn finish(self, limit: Duration) -> (Option<i32>, String) {
        let o = wait(self.child, limit);
        let mut err = self.stderr.join().unwrap();
        err.push_str(&String::from_utf8_lossy(&o.stdout));
        (o.status.code(), err)
    }
}

/// How a stranger behaves once connected.
#[derive(Clone, Copy, Debug)]
enum Stranger {
    /// Sends nothing.
    Idle,
    /// Sends a burst of random bytes, then nothing.
    Garbage,
    /// Sends a byte of a plausible hello every half second.
    Trickle,
}

/// Opens `n` connections of each kind in `kinds` to `addr`, keeping them open (trickling)
/// until `stop` is set.
fn strangers(
    addr: std::net::SocketAddr,
    kinds: &[(Stranger, usize)],
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<usize> {
    use std::io::Write;
    let kinds = kinds.to_vec();
    let mut socks = Vec::new();
    for (kind, n) in kinds {
        for _ in 0..n {
            let mut s = std::net::TcpStream::connect(addr).expect("a stranger connects");
            if let Stranger::Garbage = kind {
                let junk: Vec<u8> = (0..4096).map(|_| rand::random()).collect();
                let _ = s.write_all(&junk);
            }
            socks.push((kind, s));
        }
    }
    std::thread::spawn(move || {
        // "QCHS", then the version, then zeros: the head of a hello, one byte at a time.
        let mut hello = vec![0x53, 0x48, 0x43, 0x51, 3, 0, 0, 0];
        hello.resize(40, 0);
        let mut at = 0;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            for (kind, s) in &mut socks {
                if let Stranger::Trickle = kind {
                    let _ = s.write_all(&hello[at % 40..at % 40 + 1]);
                }
            }
            at += 1;
            std::thread::sleep(Duration::from_millis(500));
        }
        socks.len()
    })
}

/// Strangers hold idle, garbage and trickling connections to the rendezvous root and to every
/// rank's data listener before the ranks connect: the job must still complete (each rank's
/// connections time out after QCCL_TIMEOUT_MS, so completing is completing in time).
fn strangers_do_not_stall(transport: &str) {
    let n = 3;
    let job = Job::new(n);
    let dir = std::env::temp_dir().join(format!("qccl-strangers-{}", rand::random::<u64>()));
    std::fs::create_dir_all(&dir).unwrap();
    let (root_gate, gate) = (dir.join("root"), dir.join("listeners"));
    let env = [
        ("QCCL_TRANSPORT", transport),
        ("QCCL_DEBUG", "INFO"),
        ("QCCL_TIMEOUT_MS", "10000"),
        ("GATE_BEFORE_INIT", root_gate.to_str().unwrap()),
        ("GATE_BEFORE_CONNECT", gate.to_str().unwrap()),
    ];
    let kinds = [
        (Stranger::Idle, 14),
        (Stranger::Garbage, 3),
        (Stranger::Trickle, 3),
    ];
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut ranks: Vec<Watched> = (0..n)
        .map(|r| Watched::spawn(&job, r, "strangers", &env))
        .collect();
    let mut threads = Vec::new();
    // The root first: the other ranks join only once its strangers are there.
    let root: std::net::SocketAddr = ranks[0]
        .find("bootstrap root listening on ")
        .trim_end_matches(',')
        .parse()
        .unwrap();
    threads.push(strangers(root, &[(Stranger::Idle, 20)], stop.clone()));
    std::fs::write(&root_gate, b"").unwrap();
    for (r, w) in ranks.iter_mut().enumerate() {
        let addr: std::net::SocketAddr =
            w.find(&format!("rank {r}: listening on ")).parse().unwrap();
        threads.push(strangers(addr, &kinds, stop.clone()));
    }
    std::fs::write(&gate, b"").unwrap();
    let outs: Vec<(Option<i32>, String)> = ranks
        .into_iter()
        .map(|w| w.finish(Duration::from_secs(60)))
        .collect();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let held: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(held, 20 + 20 * n);
    std::fs::remove_dir_all(&dir).unwrap();
    for (r, (code, err)) in outs.iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {r} over {transport}:\n{err}");
        // The strangers were there: the garbage ones were refused on their first bytes.
        let refused = err.matches("refused: not a qccl hello").count();
        assert!(refused >= 3, "rank {r} over {transport}:\n{err}");
        for line in err.lines().filter(|l| l.starts_with("QCCL-TEST:")) {
            eprintln!("rank {r} over {transport}: {line}");
        }
    }
}

#[test]
fn strangers_holding_connections_do_not_stall_a_tcp_job() {
    strangers_do_not_stall("tcp");
}

#[test]
fn strangers_holding_connections_do_not_stall_a_shm_job() {
    strangers_do_not_stall("shm");
}

/// Stops rank `victim` of 4 with SIGSTOP while the ranks loop over collectives; every survivor
/// must fail (not hang) within its timeout plus a margin, with an error naming the stopped
/// rank and its address. The timeout is 3 s, or 8 s for all but rank `early` (which then
/// fails first and the others may learn of it through its abort). Returns (survivor errors
/// naming the stopped rank, survivors).
fn stopped_rank(transport: &str, victim: usize, early: Option<usize>) -> (usize, usize) {
    let n = 4;
    let job = Job::new(n);
    let mut ranks: Vec<Watched> = (0..n)
        .map(|r| {
            let timeout = if early.is_none_or(|e| e == r) {
                "3000"
            } else {
                "8000"
            };
            let env = [
                ("QCCL_TRANSPORT", transport),
                ("QCCL_TIMEOUT_MS", timeout),
                ("QCCL_DEBUG", "INFO"),
            ];
            Watched::spawn(&job, r, "stall_loop", &env)
        })
        .collect();
    let addrs: Vec<String> = ranks
        .iter_mut()
        .enumerate()
        .map(|(r, w)| w.find(&format!("rank {r}: listening on ")))
        .collect();
    for w in &mut ranks {
        w.find("QCCL-TEST: looping");
    }
    // Somewhere in the loop, not always at the same call.
    std::thread::sleep(Duration::from_millis(rand::random::<u64>() % 500));
    let stopped = ranks.remove(victim);
    let pid = nix::unistd::Pid::from_raw(stopped.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let outs: Vec<(Option<i32>, String)> = ranks
        .into_iter()
        .map(|w| w.finish(Duration::from_secs(8 + 10)))
        .collect();
    // Child::kill is SIGKILL, which a stopped process gets too.
    let _ = stopped.finish(Duration::ZERO);
    let want = format!("rank {victim} ({})", addrs[victim]);
    let mut named = 0;
    for (i, (code, err)) in outs.iter().enumerate() {
        let r = if i < victim { i } else { i + 1 };
        assert_eq!(
            *code,
            Some(FAILED_CLEANLY),
            "rank {r} over {transport}:\n{err}"
        );
        let line = err
            .lines()
            .find(|l| l.starts_with("QCCL-TEST-ERROR"))
            .unwrap_or_default();
        assert!(line.contains("async error the same: true"), "{line}");
        let verdict = if line.contains(&want) {
            "named"
        } else {
            "NOT NAMED"
        };
        named += usize::from(line.contains(&want));
        eprintln!("over {transport}, rank {victim} stopped, early {early:?}: {verdict}: {line}");
    }
    (named, n - 1)
}

fn stopped_ranks_are_named(transport: &str) {
    let trials: usize = std::env::var("STALL_TRIALS").map_or(2, |t| t.parse().unwrap());
    let (mut named, mut all) = (0, 0);
    for t in 0..trials {
        let victim = [2, 0, 3, 1][t % 4];
        // Every other trial, one survivor's shorter timeout makes it fail first.
        let early = (t % 2 == 1).then_some((victim + 1 + t % 3) % 4);
        let (k, m) = stopped_rank(transport, victim, early);
        named += k;
        all += m;
    }
    eprintln!("over {transport}: {named} of {all} survivor errors named the stopped rank");
    assert_eq!(named, all);
}

#[test]
fn a_stopped_rank_is_named_by_every_survivor_over_tcp() {
    stopped_ranks_are_named("tcp");
}

#[test]
fn a_stopped_rank_is_named_by_every_survivor_over_shm() {
    stopped_ranks_are_named("shm");
}
