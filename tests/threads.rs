//! Every collective on ranks that are threads (in-process transport), world sizes 1–7.

mod common;

use common::suite::{cases, run_all, run_huge, Case};
use qccl::{Comm, Config, DType, ReduceOp};

fn on_threads(n: usize, f: impl Fn(&Comm) -> Result<(), String> + Send + Sync + 'static) {
    on_hosts(&vec!["h".to_string(); n], f)
}

/// Ranks as threads, rank i pretending to run on host `hosts[i]`.
fn on_hosts(hosts: &[String], f: impl Fn(&Comm) -> Result<(), String> + Send + Sync + 'static) {
    let comms = Comm::init_threads_on_hosts(hosts, Config::default()).expect("init_threads");
    run_comms(comms, f)
}

/// Runs `f` on every comm, each on its own thread; panics naming the ranks that failed.
fn run_comms(comms: Vec<Comm>, f: impl Fn(&Comm) -> Result<(), String> + Send + Sync + 'static) {
    let n = comms.len();
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let f = f.clone();
            std::thread::spawn(move || f(&c).map_err(|e| format!("rank {}: {e}", c.rank())))
        })
        .collect();
    let errors: Vec<String> = handles
        .into_iter()
        .filter_map(|h| h.join().expect("rank thread panicked").err())
        .collect();
    assert!(errors.is_empty(), "world size {n}:\n{}", errors.join("\n"));
}

#[test]
fn world_1() {
    on_threads(1, |c| run_all(c, &cases(true)));
}

// Two ranks run the big cases as processes (tests/processes.rs).
#[test]
fn world_2() {
    on_threads(2, |c| run_all(c, &cases(false)));
}

#[test]
fn world_3() {
    on_threads(3, |c| run_all(c, &cases(true)));
}

#[test]
fn world_4() {
    on_threads(4, |c| run_all(c, &cases(false)));
}

#[test]
fn world_5() {
    on_threads(5, |c| run_all(c, &cases(true)));
}

// Up to 32771 elements: the million-element cases at 7 ranks are the arena's
// (tests/processes.rs `arena_7_processes`), and world 5 runs them here.
#[test]
fn world_7() {
    let cases: Vec<Case> = cases(true)
        .into_iter()
        .filter(|c| c.count < 1_000_000)
        .collect();
    on_threads(7, move |c| run_all(c, &cases));
}

/// Any slice size the config accepts works for every collective and algorithm: one below
/// an element boundary, odd, one larger than every buffer; out of range is refused at init.
#[test]
fn every_accepted_slice_size_works_and_others_are_refused() {
    for buffsize in [4096usize, 4097, 5001, 1 << 30] {
        for hosts in [vec!["h".to_string(); 3], hosts(&["a", "a", "b", "b"])] {
            let config = Config {
                buffsize: Some(buffsize),
                chunksize: 4096,
                ..Config::default()
            };
            let comms = Comm::init_threads_on_hosts(&hosts, config).expect("init_threads");
            run_comms(comms, move |c| {
                let big = [DType::Float32, DType::Float64, DType::Int8].map(|dtype| Case {
                    dtype,
                    op: ReduceOp::Sum,
                    count: 100_003,
                });
                run_all(c, &cases(false))
                    .and_then(|()| run_all(c, &big))
                    .map_err(|e| format!("QCCL_BUFFSIZE={buffsize}: {e}"))
            });
        }
    }
    for buffsize in [0usize, 4095, (1 << 30) + 1] {
        let config = Config {
            buffsize: Some(buffsize),
            ..Config::default()
        };
        let e = Comm::init_threads(2, config).err().expect("refused");
        assert!(e.to_string().contains("QCCL_BUFFSIZE"), "{e}");
    }
}

#[test]
fn huge_16mi_world_3() {
    on_threads(3, run_huge);
}

fn hosts(spec: &[&str]) -> Vec<String> {
    spec.iter().map(|s| s.to_string()).collect()
}

#[test]
fn hierarchical_2_hosts_x_2_ranks() {
    on_hosts(&hosts(&["a", "a", "b", "b"]), |c| run_all(c, &cases(false)));
}

#[test]
fn hierarchical_2_hosts_x_3_ranks_interleaved() {
    // Ranks of a host need not be contiguous.
    on_hosts(&hosts(&["a", "b", "a", "b", "a", "b"]), |c| {
        run_all(c, &cases(false))
    });
}

#[test]
fn hierarchical_from_the_config_does_not_recurse_into_its_levels() {
    // QCCL_ALGO=hier: the levels inherit the config; were they hierarchical too, each level's
    // all-reduce would split again until the stack overflowed.
    for spec in [&["a", "a", "b", "b"][..], &["a", "a", "a"]] {
        let config = Config {
            algo: qccl::Algo::Hier,
            ..Config::default()
        };
        let comms = Comm::init_threads_on_hosts(&hosts(spec), config).unwrap();
        let n = spec.len();
        run_comms(comms, move |c| {
            let mut v = vec![1f32 + c.rank() as f32; 4099];
            c.all_reduce_in_place(&mut v, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            let want = (n * (n + 1) / 2) as f32;
            (v.iter().all(|&x| x == want))
                .then_some(())
                .ok_or_else(|| format!("{} instead of {want}", v[0]))
        });
    }
}

#[test]
fn hierarchical_needs_equal_hosts() {
    on_hosts(&hosts(&["a", "a", "b"]), |c| {
        let mut v = vec![1f32; 10];
        match c.all_reduce_with(None, &mut v, qccl::ReduceOp::Sum, qccl::Algo::Hier) {
            Err(qccl::Error::Unsupported(m)) if m.contains("same number of ranks") => {}
            other => return Err(format!("expected unsupported, got {other:?}")),
        }
        // Auto falls back to a flat algorithm on such a world.
        c.all_reduce_in_place(&mut v, qccl::ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        (v[0] == 3.0)
            .then_some(())
            .ok_or_else(|| format!("wrong sum {}", v[0]))
    });
}

#[test]
fn one_thread_drives_every_rank_into_its_first_hierarchical_all_reduce() {
    // As qcclCommInitAll comms inside a group: each rank's first hierarchical call splits its
    // sub-comms, and the thread reaches the next rank only after this call returns.
    let config = qccl::Config {
        timeout: std::time::Duration::from_secs(5),
        ..qccl::Config::default()
    };
    let comms = Comm::init_threads_on_hosts(&hosts(&["a", "a", "b", "b"]), config).unwrap();
    let start = std::time::Instant::now();
    let requests: Vec<_> = comms
        .iter()
        .enumerate()
        .map(|(r, c)| {
            let buf: Vec<f32> = (0..1000).map(|i| (r * 1000 + i) as f32).collect();
            c.all_reduce_async(buf, qccl::ReduceOp::Sum).unwrap()
        })
        .collect();
    for req in requests {
        let out = req.wait().unwrap();
        for (i, &x) in out.iter().enumerate() {
            let want: usize = (0..4).map(|r| r * 1000 + i).sum();
            assert_eq!(x, want as f32, "element {i}");
        }
    }
    assert!(
        start.elapsed() < std::time::Duration::from_secs(4),
        "took {:?}: waited for a timeout",
        start.elapsed()
    );
}
