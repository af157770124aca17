//! The RDMA link over the emulated fabric (QCCL_IB_EMULATE=1), with ranks as OS processes and
//! shared memory disabled, so that every peer pair talks over an RC queue pair: the collective
//! suite, compressed all-reduces and HiTopK at 2, 3 and 5 processes (float64 references,
//! bit-identical ranks), and the faults a NIC reports (a completion with an error, a queue
//! pair in the error state, an rkey out of bounds, a killed rank): every survivor fails
//! cleanly, naming the peer, within the timeout.
//!
//! The test binary re-executes itself: `child` is the rank's entry point, a no-op unless
//! QCCL_TEST_CHILD names a scenario.

mod common;

use common::job::{leftover_segments, text, wait, Job, CHILD};
use common::suite::{cases, run_all, run_case, Case};
use qccl::{Comm, DType, ReduceOp};
use std::process::{Child, Output};
use std::time::{Duration, Instant};

/// Exit code of a rank whose collective returned an error.
const FAILED_CLEANLY: i32 = 3;

/// Every pair over the emulated RDMA link.
const IB: [(&str, &str); 4] = [
    ("QCCL_IB_EMULATE", "1"),
    ("QCCL_NET", "IB"),
    ("QCCL_SHM_DISABLE", "1"),
    ("QCCL_DEBUG", "INFO"),
];

/// Codecs checked over the link, with the relative error each may reach.
const COMPRESSED_SPECS: &[(&str, f64)] = &[
    ("fp16", 2e-3),
    ("qsgd:bits=4,bucket=128", 0.35),
    ("topk:density=0.01,ef=1", 1.5),
];

#[test]
fn child() {
    let Ok(scenario) = std::env::var(CHILD) else {
        return;
    };
    common::job::exit_with(run_child(&scenario), 0, FAILED_CLEANLY);
}

/// This process's threads, by name.
fn threads() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
                .map(|n| n.trim().to_string())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn run_child(scenario: &str) -> Result<(), String> {
    if scenario == "threads" {
        return no_thread_outlives_its_comm();
    }
    let comm = Comm::from_env().map_err(|e| e.to_string())?;
    match scenario {
        "suite" => {
            // Every collective, dtype and op at small counts; large ones cross many slots.
            run_all(&comm, &cases(false))?;
            for (i, count) in [1_000_003, 131_075].into_iter().enumerate() {
                let c = Case {
                    dtype: DType::Float32,
                    op: ReduceOp::Sum,
                    count,
                };
                run_case(&comm, &c, 1000 + i as u64)?;
            }
            let c = Case {
                dtype: DType::Float64,
                op: ReduceOp::Max,
                count: 65_537,
            };
            run_case(&comm, &c, 2000)?;
            for (spec, bound) in COMPRESSED_SPECS {
                common::coded::check_spec(&comm, spec, *bound)?;
            }
            // Compressed chunks went from the registered wire buffers, without a copy.
            let st = comm.registrations();
            if st.wire == 0 || st.wire_made == 0 {
                return Err(format!("no wire buffer was sent from: {st:?}"));
            }
            if std::env::var("TEST_HOSTS").is_ok() {
                common::topk::check_over_processes(&comm)?;
            }
            Ok(())
        }
        "allreduce" => {
            // Exact sums of small integers, flat and hierarchical.
            for algo in [qccl::Algo::Ring, qccl::Algo::Hier] {
                let send: Vec<f32> = (0..100_000).map(|i| (comm.rank() + i % 5) as f32).collect();
                let mut recv = vec![0f32; send.len()];
                comm.all_reduce_with(Some(&send), &mut recv, ReduceOp::Sum, algo)
                    .map_err(|e| e.to_string())?;
                let n = comm.size();
                for (i, &x) in recv.iter().enumerate() {
                    let want: usize = (0..n).map(|r| r + i % 5).sum();
                    if x != want as f32 {
                        return Err(format!("{algo:?}: element {i} is {x}, want {want}"));
                    }
                }
            }
            Ok(())
        }
        "registered" => registered_buffers(&comm),
        "loop" => {
            // All-reduces until something fails (a fault, or the parent kills a rank).
            let mut buf = vec![1f32; 1 << 20];
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(30) {
                let t = Instant::now();
                if let Err(e) = comm.all_reduce_in_place(&mut buf, ReduceOp::Max) {
                    return Err(format!("after {} ms: {e}", t.elapsed().as_millis()));
                }
            }
            Err("no failure within 30 s".into())
        }
        other => Err(format!("unknown scenario {other}")),
    }
}

/// Values whose sums are exact in f32: rank, round and index mixed into small integers.
fn fill(buf: &mut [f32], rank: usize, round: usize) {
    for (i, x) in buf.iter_mut().enumerate() {
        *x = ((rank * 7 + round * 3 + i) % 11) as f32;
    }
}

/// Checks `buf` holds the sums of `fill(_, r, round)` over every rank, against float64.
fn check_sums(buf: &[f32], n: usize, round: usize, what: &str) -> Result<(), String> {
    for (i, &x) in buf.iter().enumerate() {
        let want: f64 = (0..n).map(|r| ((r * 7 + round * 3 + i) % 11) as f64).sum();
        if x as f64 != want {
            return Err(format!("{what}: element {i} is {x}, want {want}"));
        }
    }
    Ok(())
}

/// The registration cache over the link: a buffer registered once and reused by many calls
/// (every algorithm, new contents each time) is sent from directly, one device registration
/// made on first use; registering it again counts; after deregistration and free, a new
/// buffer (often at the same address) is right both unregistered and registered anew.
fn registered_buffers(comm: &Comm) -> Result<(), String> {
    let (n, r) = (comm.size(), comm.rank());
    let e = |e: qccl::Error| e.to_string();
    let count = 1_000_003;
    let mut buf = vec![0f32; count];
    let h = comm.register(&buf).map_err(e)?;
    if comm.register(&buf[..count / 2]).map_err(e)? == h {
        return Err("a narrower range got the whole buffer's handle".into());
    }
    let algos = [
        qccl::Algo::Ring,
        qccl::Algo::Tree,
        qccl::Algo::Sra,
        qccl::Algo::AllGather,
    ];
    for (round, algo) in algos.into_iter().enumerate() {
        fill(&mut buf, r, round);
        comm.all_reduce_with(None, &mut buf, ReduceOp::Sum, algo)
            .map_err(e)?;
        check_sums(&buf, n, round, &format!("{algo:?} round {round}"))?;
    }
    // Out of place, the send side registered: a broadcast from every root in turn.
    for root in 0..n {
        fill(&mut buf, root, 9);
        let mut out = vec![0f32; count];
        comm.broadcast(&buf, &mut out, root).map_err(e)?;
        let mut want = vec![0f32; count];
        fill(&mut want, root, 9);
        if out != want {
            return Err(format!("broadcast from {root}: wrong bytes"));
        }
    }
    let st = comm.registrations();
    if st.ranges != 2 || (n > 1 && st.made < 1) {
        return Err(format!("registrations after the calls: {st:?}"));
    }
    let h2 = comm.register(&buf).map_err(e)?;
    if h2 != h {
        return Err(format!(
            "the same buffer registered again: {h2:?}, not {h:?}"
        ));
    }
    for handle in [h, h] {
        comm.deregister(handle).map_err(e)?;
    }
    if comm.deregister(h).is_ok() {
        return Err("a third deregistration of a twice-registered buffer passed".into());
    }
    let st = comm.registrations();
    if st.ranges != 1 {
        return Err(format!("registrations left: {st:?}"));
    }
    drop(buf);
    // Freed; a new buffer of the same size, unregistered, then registered.
    let mut again = vec![0f32; count];
    for round in 0..2 {
        let h = (round == 1)
            .then(|| comm.register(&again))
            .transpose()
            .map_err(e)?;
        fill(&mut again, r, 10 + round);
        comm.all_reduce_in_place(&mut again, ReduceOp::Sum)
            .map_err(e)?;
        check_sums(&again, n, 10 + round, &format!("new buffer, round {round}"))?;
        if let Some(h) = h {
            comm.deregister(h).map_err(e)?;
        }
    }
    Ok(())
}

/// A comm and a split of it over the link, then dropped: every thread they started (the
/// emulated NICs', the accept and link setup threads, the workers) is gone within a bound.
fn no_thread_outlives_its_comm() -> Result<(), String> {
    let before = threads();
    {
        let comm = Comm::from_env().map_err(|e| e.to_string())?;
        let mut buf = vec![1f32; 1 << 20];
        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        let half = comm
            .split((comm.rank() % 2) as i32, 0)
            .map_err(|e| e.to_string())?
            .ok_or("split gave no comm")?;
        half.all_reduce_in_place(&mut buf, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        comm.barrier().map_err(|e| e.to_string())?;
    }
    let start = Instant::now();
    let mut now = threads();
    while now.len() > before.len() && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
        now = threads();
    }
    if now.len() > before.len() {
        return Err(format!("threads before the comm {before:?}, after {now:?}"));
    }
    Ok(())
}

/// The suite on `hosts.len()` processes (emulated hosts, for HiTopK's hierarchy); every
/// connection over the emulated RDMA link.
fn suite(hosts: &[&str]) {
    let n = hosts.len();
    let job = Job::new(n);
    let all = hosts.join(",");
    let children: Vec<Child> = hosts
        .iter()
        .enumerate()
        .map(|(r, h)| {
            let mut env = IB.to_vec();
            env.extend([("QCCL_HOSTID", *h), ("TEST_HOSTS", &all)]);
            job.spawn(r, "suite", &env)
        })
        .collect();
    for (r, c) in children.into_iter().enumerate() {
        let o = wait(c, Duration::from_secs(300));
        assert_eq!(o.status.code(), Some(0), "rank {r} of {n}:\n{}", text(&o));
        let log = String::from_utf8_lossy(&o.stderr);
        let connected = log.lines().filter(|l| l.contains("connected to rank"));
        assert!(connected.clone().count() >= n - 1, "{log}");
        assert!(
            connected
                .clone()
                .all(|l| l.contains(" over ib emulated emu0:1 (qp ")),
            "rank {r}: {log}"
        );
        assert!(log.contains(" on tcp+ib-emulated "), "rank {r}: {log}");
    }
}

#[test]
fn suite_over_ib_2_processes() {
    suite(&["a", "a"]);
}

#[test]
fn suite_over_ib_3_processes() {
    suite(&["a", "b", "c"]);
}

#[test]
fn suite_over_ib_5_processes() {
    suite(&["a", "b", "c", "d", "e"]);
}

/// As NCCL chooses: ranks of one (emulated) host keep shared memory, hosts talk RDMA.
/// The registration cache at 3 processes: reused and freed buffers (see
/// `registered_buffers`).
#[test]
fn registered_buffers_are_sent_from_directly_and_stay_right() {
    let job = Job::new(3);
    let children: Vec<Child> = (0..3).map(|r| job.spawn(r, "registered", &IB)).collect();
    for (r, c) in children.into_iter().enumerate() {
        let o = wait(c, Duration::from_secs(120));
        assert_eq!(o.status.code(), Some(0), "rank {r}:\n{}", text(&o));
    }
}

#[test]
fn shared_memory_inside_a_host_and_rdma_between_hosts() {
    let job = Job::new(4);
    let children: Vec<Child> = (0..4)
        .map(|r| {
            let host = if r < 2 { "host-a" } else { "host-b" };
            let env = [
                ("QCCL_IB_EMULATE", "1"),
                ("QCCL_HOSTID", host),
                ("QCCL_DEBUG", "INFO"),
            ];
            job.spawn(r, "allreduce", &env)
        })
        .collect();
    for (r, c) in children.into_iter().enumerate() {
        let o = wait(c, Duration::from_secs(120));
        assert_eq!(o.status.code(), Some(0), "rank {r}: {}", text(&o));
        let log = String::from_utf8_lossy(&o.stderr);
        let world = log
            .lines()
            .find_map(|l| l.split(&format!("rank {r}/4: comm ")).nth(1))
            .map(|rest| rest[..18].to_string())
            .expect("the world comm's id is logged");
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| l.contains(&format!("comm {world}: connected to rank")))
            .collect();
        // The ring's neighbours: one on this host, one on the other.
        assert!(lines.len() >= 2, "rank {r}: {log}");
        assert!(
            lines.iter().any(|l| l.contains(" over shm ")),
            "rank {r}: {log}"
        );
        assert!(
            lines.iter().any(|l| l.contains(" over ib ")),
            "rank {r}: {log}"
        );
        for line in lines {
            let peer: usize = line.split("connected to rank ").nth(1).unwrap()[..1]
                .parse()
                .unwrap();
            let want = if (peer < 2) == (r < 2) {
                " over shm "
            } else {
                " over ib emulated "
            };
            assert!(line.contains(want), "rank {r}: {line}");
        }
    }
}

/// Without a device to use, QCCL_NET=IB fails at init, saying why.
#[test]
fn qccl_net_ib_without_a_usable_device_fails_at_init() {
    let env = [
        ("QCCL_IB_EMULATE", "1"),
        ("QCCL_NET", "IB"),
        ("QCCL_IB_HCA", "mlx5"),
    ];
    let outs = Job::new(2).run("suite", &env, Duration::from_secs(60));
    for (r, o) in outs.iter().enumerate() {
        let err = failed_cleanly(&format!("rank {r}"), o);
        assert!(
            err.contains("QCCL_NET=IB: no usable RDMA port (emu0:1 excluded by QCCL_IB_HCA)"),
            "rank {r}: {err}"
        );
    }
}

fn failed_cleanly(who: &str, o: &Output) -> String {
    assert_eq!(o.status.code(), Some(FAILED_CLEANLY), "{who}: {}", text(o));
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn no_thread_outlives_its_comm_over_ib() {
    let outs = Job::new(3).run("threads", &IB, Duration::from_secs(60));
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.status.code(), Some(0), "rank {r}:\n{}", text(o));
    }
}

/// Rank 1 of 3 is killed mid-loop: the others fail within the timeout, naming it, and leave
/// no shared-memory segment.
#[test]
fn a_killed_rank_makes_the_others_fail_naming_it() {
    let job = Job::new(3);
    let mut env = IB.to_vec();
    env.push(("QCCL_TIMEOUT_MS", "3000"));
    let mut children: Vec<Child> = (0..3).map(|r| job.spawn(r, "loop", &env)).collect();
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    std::thread::sleep(Duration::from_millis(1500));
    let mut victim = children.remove(1);
    victim.kill().unwrap();
    let killed_at = Instant::now();
    let _ = wait(victim, Duration::from_secs(5));
    for c in children {
        let o = wait(c, Duration::from_secs(20));
        let took = killed_at.elapsed();
        let err = failed_cleanly("survivor", &o);
        assert!(took < Duration::from_millis(5000), "survivor took {took:?}");
        assert!(err.contains("rank 1"), "error should name rank 1: {err}");
    }
    let left = leftover_segments(&pids);
    assert!(left.is_empty(), "segments left in /dev/shm: {left:?}");
}

/// Rank 1 of 3 meets `fault` (QCCL_IB_EMULATE_FAULT) mid-loop: it fails with the verbs
/// status `status`, and every rank fails cleanly within the timeout with an error naming a
/// peer; nothing is left in /dev/shm.
fn fault(fault: &str, status: &str) {
    let job = Job::new(3);
    let mut env = IB.to_vec();
    env.push(("QCCL_TIMEOUT_MS", "3000"));
    let start = Instant::now();
    let children: Vec<Child> = (0..3)
        .map(|r| {
            let mut env = env.clone();
            if r == 1 {
                env.push(("QCCL_IB_EMULATE_FAULT", fault));
            }
            job.spawn(r, "loop", &env)
        })
        .collect();
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    for (r, c) in children.into_iter().enumerate() {
        let o = wait(c, Duration::from_secs(30));
        let err = failed_cleanly(&format!("{fault}: rank {r}"), &o);
        let last = err
            .lines()
            .find(|l| l.starts_with("QCCL-TEST-ERROR"))
            .unwrap_or_default()
            .to_string();
        eprintln!("{fault}: rank {r}: {last}");
        if r == 1 {
            assert!(
                last.contains(status) && last.contains("verbs completion status"),
                "{fault}: rank 1 should report {status:?}: {err}"
            );
        }
        let named = (0..3).any(|p| p != r && last.contains(&format!("rank {p}")));
        assert!(named, "{fault}: rank {r} names no peer: {err}");
    }
    // Each rank's collectives start within a second or two; the failure then takes at most
    // about the timeout.
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "{fault}: took {:?}",
        start.elapsed()
    );
    let left = leftover_segments(&pids);
    assert!(left.is_empty(), "segments left in /dev/shm: {left:?}");
}

#[test]
fn a_completion_with_an_error_fails_every_rank_cleanly() {
    fault("cqe@40", "remote operation error");
}

#[test]
fn a_queue_pair_in_the_error_state_fails_every_rank_cleanly() {
    fault("qp@40", "work request flushed error");
}

#[test]
fn an_rkey_the_peer_refuses_fails_every_rank_cleanly() {
    fault("rkey@40", "remote access error");
}

#[test]
fn a_cut_connection_fails_every_rank_cleanly() {
    fault("drop@40", "transport retry counter exceeded");
}

/// A malformed fault plan fails init by name, even where RDMA is optional.
#[test]
fn a_bad_fault_plan_fails_at_init() {
    let env = [("QCCL_IB_EMULATE", "1"), ("QCCL_IB_EMULATE_FAULT", "cqe")];
    let outs = Job::new(2).run("allreduce", &env, Duration::from_secs(60));
    for (r, o) in outs.iter().enumerate() {
        let err = failed_cleanly(&format!("rank {r}"), o);
        assert!(err.contains("QCCL_IB_EMULATE_FAULT"), "rank {r}: {err}");
    }
}
