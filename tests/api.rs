//! The Rust API's contract: bad input is refused before any byte moves (and leaves the comm
//! usable), async requests, abort, timeouts, split, and init from a UniqueId over TCP.

use qccl::{Algo, Comm, Config, Error, ReduceOp, UniqueId};
use std::time::{Duration, Instant};

fn threads<R: Send + 'static>(
    n: usize,
    config: Config,
    f: impl Fn(Comm) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let f = std::sync::Arc::new(f);
    let comms = Comm::init_threads(n, config).unwrap();
    let hs: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let f = f.clone();
            std::thread::spawn(move || f(c))
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn invalid(r: qccl::Result<()>, needle: &str) {
    match r {
        Err(Error::InvalidArgument(m)) => assert!(m.contains(needle), "{m:?} lacks {needle:?}"),
        other => panic!("expected InvalidArgument containing {needle:?}, got {other:?}"),
    }
}

#[test]
fn bad_input_is_refused_before_any_byte_moves_and_the_comm_stays_usable() {
    invalid(
        Comm::init_threads(0, Config::default()).map(drop),
        "at least one rank",
    );
    let id = UniqueId::with_root("127.0.0.1:1".parse().unwrap(), [0; 16]);
    invalid(
        Comm::init(&id, 3, 3, Config::default()).map(drop),
        "rank 3 is out of range",
    );
    invalid(
        Comm::init(&id, 0, 0, Config::default()).map(drop),
        "world size 0",
    );
    threads(3, Config::default(), |c| {
        let (r, n) = (c.rank(), c.size());
        let mut buf = vec![1f32; 8];
        let short = vec![0f32; 7];
        invalid(
            c.all_reduce(&short, &mut buf, ReduceOp::Sum),
            "sendbuff holds 7 elements but 8",
        );
        invalid(c.broadcast_in_place(&mut buf, n), "root 3 is out of range");
        invalid(c.reduce_in_place(&mut buf, ReduceOp::Sum, 99), "root 99");
        let mut ints = vec![1i32; 8];
        invalid(
            c.all_reduce_in_place(&mut ints, ReduceOp::Avg),
            "avg needs a floating-point",
        );
        invalid(c.send(&buf, r), "cannot send to or from itself");
        invalid(c.recv(&mut buf, n + 1), "out of range");
        invalid(
            c.reduce_scatter_in_place(&mut buf[..7], ReduceOp::Sum),
            "not a multiple of the world size 3",
        );
        let mut gathered = vec![0f32; 8 * n - 1];
        invalid(
            c.all_gather(&buf, &mut gathered),
            "recvbuff holds 23 elements but 24",
        );
        invalid(
            c.all_reduce_raw(
                None,
                &mut [0u8; 7],
                2,
                qccl::DType::Float32,
                ReduceOp::Sum,
                None,
            )
            .map(drop),
            "recvbuff is 7 bytes, not a whole number of float elements",
        );
        // Sizes that overflow are refused, not computed (all_gather once panicked on them).
        let huge = usize::MAX / 4;
        let f32 = qccl::DType::Float32;
        invalid(c.all_gather_raw(None, &mut [], huge, f32), "overflows");
        invalid(c.all_to_all_raw(&[], &mut [], huge, f32), "overflows");
        // The async forms go through the same checks.
        invalid(c.broadcast_async(vec![0f32; 4], n).map(drop), "root 3");
        invalid(
            c.reduce_scatter_async(vec![1i32; 3 * n], ReduceOp::Avg)
                .map(drop),
            "reduce_scatter: op avg needs a floating-point",
        );
        // None of that touched the comm: a real collective still works.
        c.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
        assert!(buf.iter().all(|&x| x == n as f32));
        assert!(c.async_error().is_none());
    });
}

#[test]
fn async_requests_complete_in_submission_order_with_blocking_calls_between() {
    threads(4, Config::default(), |c| {
        let n = c.size() as f32;
        let a = c
            .all_reduce_async(vec![1f32; 100_000], ReduceOp::Sum)
            .unwrap();
        let b = c
            .reduce_scatter_async(vec![c.rank() as f64; 4 * 5], ReduceOp::Max)
            .unwrap();
        let mut blocking = vec![2i64; 10];
        c.all_reduce_in_place(&mut blocking, ReduceOp::Prod)
            .unwrap();
        let d = c.all_gather_async(vec![c.rank() as u8; 3]).unwrap();
        let mut e = c.broadcast_async(vec![c.rank() as i32; 9], 2).unwrap();
        assert!(a.wait().unwrap().iter().all(|&x| x == n));
        assert_eq!(b.wait().unwrap(), vec![3.0; 5]);
        assert!(blocking.iter().all(|&x| x == 16));
        assert_eq!(d.wait().unwrap(), vec![0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]);
        while !e.test() {
            std::thread::yield_now();
        }
        assert_eq!(e.wait().unwrap(), vec![2; 9]);
    });
}

#[test]
fn a_rank_that_never_calls_makes_the_others_time_out_naming_it() {
    let config = Config {
        timeout: Duration::from_millis(500),
        ..Config::default()
    };
    let results = threads(3, config, |c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(2500));
            return Ok(());
        }
        let mut buf = vec![1f32; 1000];
        let t = Instant::now();
        let r = c
            .all_reduce_with(None, &mut buf, ReduceOp::Sum, Algo::Ring)
            .map(drop);
        assert!(
            t.elapsed() < Duration::from_millis(2000),
            "took {:?}",
            t.elapsed()
        );
        // The comm is failed now: later calls return at once with the same error.
        let again = c.barrier();
        assert_eq!(again.as_ref().err(), r.as_ref().err());
        r
    });
    for (rank, r) in results.iter().enumerate().filter(|(r, _)| *r != 1) {
        let e = r.as_ref().expect_err("should fail").to_string();
        assert!(
            e.contains("rank 1") || e.contains("no progress"),
            "rank {rank}: {e}"
        );
    }
}

#[test]
fn abort_returns_within_a_second_and_fails_the_waiting_ranks() {
    let results = threads(3, Config::default(), |c| {
        let mut buf = vec![1f32; 100];
        if c.rank() == 0 {
            // Never joins the collective: aborts instead, while the others wait for it.
            std::thread::sleep(Duration::from_millis(300));
            let t = Instant::now();
            c.abort();
            assert!(t.elapsed() < Duration::from_secs(1));
            let e = c.barrier().unwrap_err();
            assert!(matches!(e, Error::Aborted(_)), "{e:?}");
            return e.to_string();
        }
        let t = Instant::now();
        let e = c.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        e.to_string()
    });
    for r in &results[1..] {
        assert!(r.contains("rank 0"), "{r}");
    }
    // The process is still usable: a new comm works.
    threads(2, Config::default(), |c| c.barrier().unwrap());
}

#[test]
fn abort_interrupts_a_collective_in_progress() {
    let results = threads(2, Config::default(), |c| {
        let c = std::sync::Arc::new(c);
        if c.rank() == 1 {
            let c2 = c.clone();
            let aborter = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                let t = Instant::now();
                c2.abort();
                t.elapsed()
            });
            // Waits for rank 0, which never comes: abort must end the wait.
            let mut buf = vec![0f32; 10];
            let r = c.recv(&mut buf, 0);
            let took = aborter.join().unwrap();
            assert!(took < Duration::from_secs(1), "abort took {took:?}");
            return r.is_err();
        }
        std::thread::sleep(Duration::from_millis(1500));
        true
    });
    assert!(results[1]);
}

#[test]
fn split_by_parity_reverse_keys() {
    threads(5, Config::default(), |c| {
        let color = (c.rank() % 2) as i32;
        let key = -(c.rank() as i32);
        let sub = c.split(color, key).unwrap().unwrap();
        let members: Vec<usize> = (0..5).filter(|r| r % 2 == c.rank() % 2).collect();
        assert_eq!(sub.size(), members.len());
        // Reverse keys: the highest parent rank becomes rank 0.
        assert_eq!(
            sub.rank(),
            members.len() - 1 - members.iter().position(|&r| r == c.rank()).unwrap()
        );
        let mut v = vec![c.rank() as u32; 3];
        sub.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v[0], members.iter().sum::<usize>() as u32);
        // NCCL_SPLIT_NOCOLOR: rank 0 opts out of a second split.
        let again = c.split(if c.rank() == 0 { -1 } else { 7 }, 0).unwrap();
        assert_eq!(again.is_none(), c.rank() == 0);
        if let Some(s) = again {
            assert_eq!(s.size(), 4);
            s.barrier().unwrap();
        }
        // The parent still works after splitting.
        c.barrier().unwrap();
    });
}

#[test]
fn create_group_is_made_by_its_members_alone() {
    threads(5, Config::default(), |c| {
        // Ranks 1, 3, 4 make a group; 0 and 2 never call create_group and go on with the
        // parent meanwhile (a point-to-point exchange of their own).
        let members = [1usize, 3, 4];
        if let Some(me) = members.iter().position(|&r| r == c.rank()) {
            let g = c.create_group(&members, 7).unwrap();
            assert_eq!((g.rank(), g.size()), (me, 3));
            let mut v = vec![c.rank() as f64; 1009];
            g.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
            assert!(v.iter().all(|&x| x == 8.0));
            // The same members again, another tag: a second, independent comm.
            let h = c.create_group(&members, 8).unwrap();
            h.barrier().unwrap();
            // A rank outside the list is refused before anything moves.
            let err = c.create_group(&[0, 2], 9).err().unwrap().to_string();
            assert!(err.contains("is not in the member list"), "{err}");
        } else {
            let peer = if c.rank() == 0 { 2 } else { 0 };
            let mut got = [0u32; 1];
            if c.rank() == 0 {
                c.send(&[42u32], peer).unwrap();
            } else {
                c.recv(&mut got, peer).unwrap();
                assert_eq!(got[0], 42);
            }
        }
        // The parent is untouched: every rank meets in it again.
        let mut v = vec![1u32; 3];
        c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v, vec![5, 5, 5]);
    });
}

#[test]
fn create_group_over_tcp_and_a_disagreeing_member() {
    let id = UniqueId::new().unwrap();
    let hs: Vec<_> = (0..3)
        .map(|r| {
            std::thread::spawn(move || {
                let cfg = Config {
                    timeout: Duration::from_millis(5000),
                    ..Config::default()
                };
                let c = Comm::init(&id, r, 3, cfg).unwrap();
                let g = c.create_group(&[0, 2], 1);
                if r == 1 {
                    assert!(g.is_err());
                } else {
                    let g = g.unwrap();
                    let mut v = vec![r as f32 + 1.0; 4099];
                    g.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
                    assert!(v.iter().all(|&x| x == 4.0));
                }
                // Members that disagree (another tag here): both fail on the first frame,
                // naming the call, rather than waiting for the timeout.
                if r == 2 {
                    return None;
                }
                let t = std::time::Instant::now();
                let err = c
                    .create_group(&[0, 1], 2 + r as u64)
                    .err()
                    .unwrap()
                    .to_string();
                assert!(t.elapsed() < Duration::from_secs(4), "{err}");
                Some(err)
            })
        })
        .collect();
    for (r, h) in hs.into_iter().enumerate() {
        if let Some(err) = h.join().unwrap() {
            assert!(err.contains("split"), "rank {r}: {err}");
        }
    }
}

#[test]
fn init_from_a_unique_id_over_tcp_with_host_topology() {
    let id = UniqueId::new().unwrap();
    let hs: Vec<_> = (0..3)
        .map(|r| {
            std::thread::spawn(move || {
                let c = Comm::init(&id, r, 3, Config::default()).unwrap();
                let mut v = vec![r as f64; 1_000_003];
                c.all_reduce_with(None, &mut v, ReduceOp::Sum, Algo::Sra)
                    .unwrap();
                assert!(v.iter().all(|&x| x == 3.0));
                let sub = c.split(0, 0).unwrap().unwrap();
                sub.barrier().unwrap();
                (
                    c.node(),
                    c.num_nodes(),
                    c.local_rank(),
                    c.local_size(),
                    c.id(),
                )
            })
        })
        .collect();
    let got: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    for (r, g) in got.iter().enumerate() {
        assert_eq!((g.0, g.1, g.2, g.3), (0, 1, r, 3));
        assert_eq!(g.4, got[0].4, "same comm id everywhere");
    }
}

#[test]
fn emulated_hosts_give_node_and_local_rank() {
    let hosts: Vec<String> = ["a", "b", "a", "b", "c"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let comms = Comm::init_threads_on_hosts(&hosts, Config::default()).unwrap();
    let got: Vec<_> = comms
        .iter()
        .map(|c| (c.node(), c.num_nodes(), c.local_rank(), c.local_size()))
        .collect();
    assert_eq!(
        got,
        vec![
            (0, 3, 0, 2),
            (1, 3, 0, 2),
            (0, 3, 1, 2),
            (1, 3, 1, 2),
            (2, 3, 0, 1)
        ]
    );
}
