//! Every collective, out-of-place and in-place, checked on each rank against references
//! that the rank computes alone from every rank's (reproducible) input.

use super::{check_reduce, input, ops_for, Reference};
use qccl::{Algo, Comm, DType, ReduceOp};
use std::hash::{Hash, Hasher};

/// One test case: dtype, op and count (elements per rank, as NCCL counts them).
#[derive(Debug, Clone, Copy)]
pub struct Case {
    pub dtype: DType,
    pub op: ReduceOp,
    pub count: usize,
}

/// Counts 0, 1, 7, 1000 for every dtype × op; 1000003 for every dtype with Sum and for f32
/// with every op (when `big`).
pub fn cases(big: bool) -> Vec<Case> {
    let mut v = Vec::new();
    for dtype in DType::ALL {
        for op in ops_for(dtype) {
            for count in [0, 1, 7, 1000] {
                v.push(Case { dtype, op, count });
            }
            // On shared memory 1000 elements all-reduce in one shot; from 32 KiB per rank
            // every dtype goes through the arena's SRA rounds.
            if big {
                v.push(Case {
                    dtype,
                    op,
                    count: 32771,
                });
            }
            if big && (op == ReduceOp::Sum || dtype == DType::Float32) {
                v.push(Case {
                    dtype,
                    op,
                    count: 1_000_003,
                });
            }
        }
    }
    v
}

fn hash(b: &[u8]) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    b.hash(&mut h);
    h.finish()
}

/// Checks that every rank holds the same bytes in `out`.
pub fn same_on_all_ranks(comm: &Comm, out: &[u8], what: &str) -> Result<(), String> {
    let mine = [hash(out)];
    let mut all = vec![0u64; comm.size()];
    comm.all_gather(&mine, &mut all)
        .map_err(|e| e.to_string())?;
    if all.iter().any(|h| *h != all[0]) {
        return Err(format!("{what}: ranks ended with different bits: {all:x?}"));
    }
    Ok(())
}

fn ctx(what: &str, c: &Case, extra: &str) -> impl Fn(String) -> String {
    let p = format!("{what} {:?} {} count {} {extra}", c.dtype, c.op, c.count);
    move |e| format!("{p}: {e}")
}

fn q<T>(r: qccl::Result<T>) -> Result<T, String> {
    r.map_err(|e| e.to_string())
}

/// Runs every collective for one case on this rank and checks the results.
pub fn run_case(comm: &Comm, c: &Case, salt: u64) -> Result<(), String> {
    let (n, r) = (comm.size(), comm.rank());
    let (dt, op, count) = (c.dtype, c.op, c.count);
    let es = dt.size();
    let ins: Vec<Vec<u8>> = (0..n).map(|p| input(dt, op, p, count, salt)).collect();

    // all_reduce: every algorithm, out-of-place and in place (hier where there are hosts).
    let mut algos = vec![
        Algo::Auto,
        Algo::Ring,
        Algo::Tree,
        Algo::Sra,
        Algo::AllGather,
    ];
    if comm.num_nodes() > 1 {
        algos.push(Algo::Hier);
    }
    let reference = Reference::new(dt, op, &ins, 0..count)?;
    for algo in algos {
        check_all_reduce(comm, c, &ins, &reference, algo)?;
    }

    // reduce_scatter: inputs of n·count, this rank's part r.
    let big: Vec<Vec<u8>> = (0..n)
        .map(|p| input(dt, op, p, count * n, salt ^ 1))
        .collect();
    let mut out = vec![0u8; count * es];
    q(comm.reduce_scatter_raw(Some(&big[r]), &mut out, count, dt, op)).map_err(ctx(
        "reduce_scatter",
        c,
        "",
    ))?;
    check_reduce(dt, op, &big, r * count..(r + 1) * count, &out).map_err(ctx(
        "reduce_scatter",
        c,
        "",
    ))?;
    let mut buf = big[r].clone();
    q(comm.reduce_scatter_raw(None, &mut buf, count, dt, op)).map_err(ctx(
        "reduce_scatter in-place",
        c,
        "",
    ))?;
    if buf[r * count * es..(r + 1) * count * es] != out[..] {
        return Err(ctx("reduce_scatter", c, "")(
            "in-place result differs".into(),
        ));
    }

    // reduce to roots 0 and n-1.
    for root in [0, n - 1] {
        let mut out = vec![0u8; if r == root { count * es } else { 0 }];
        q(comm.reduce_raw(Some(&ins[r]), &mut out, count, dt, op, root))
            .map_err(ctx("reduce", c, "root"))?;
        let mut buf = ins[r].clone();
        q(comm.reduce_raw(None, &mut buf, count, dt, op, root)).map_err(ctx(
            "reduce in-place",
            c,
            "",
        ))?;
        if r == root {
            reference
                .check(&out)
                .map_err(ctx("reduce", c, &format!("root {root}")))?;
            reference
                .check(&buf)
                .map_err(ctx("reduce in-place", c, &format!("root {root}")))?;
        } else if buf != ins[r] {
            return Err(ctx("reduce in-place", c, "")(
                "a non-root buffer changed".into(),
            ));
        }
    }

    if op != ReduceOp::Sum {
        return Ok(());
    }
    // Data-movement collectives, once per dtype and count.
    let part = |b: &[u8], p: usize| b[p * count * es..(p + 1) * count * es].to_vec();

    let mut out = vec![0u8; n * count * es];
    q(comm.all_gather_raw(Some(&ins[r]), &mut out, count, dt)).map_err(ctx("all_gather", c, ""))?;
    let mut buf = vec![0u8; n * count * es];
    buf[r * count * es..(r + 1) * count * es].copy_from_slice(&ins[r]);
    q(comm.all_gather_raw(None, &mut buf, count, dt)).map_err(ctx("all_gather in-place", c, ""))?;
    for (p, want) in ins.iter().enumerate() {
        if part(&out, p) != *want || part(&buf, p) != *want {
            return Err(ctx("all_gather", c, "")(format!("part {p} wrong")));
        }
    }

    for root in [0, n - 1] {
        let mut out = vec![0u8; count * es];
        let send = if r == root {
            ins[r].clone()
        } else {
            Vec::new()
        };
        q(comm.broadcast_raw(Some(&send), &mut out, count, dt, root)).map_err(ctx(
            "broadcast",
            c,
            "",
        ))?;
        let mut buf = if r == root {
            ins[r].clone()
        } else {
            vec![0u8; count * es]
        };
        q(comm.broadcast_raw(None, &mut buf, count, dt, root)).map_err(ctx(
            "broadcast in-place",
            c,
            "",
        ))?;
        if out != ins[root] || buf != ins[root] {
            return Err(ctx("broadcast", c, "")(format!("root {root}: wrong data")));
        }

        let mut g = vec![0u8; if r == root { n * count * es } else { 0 }];
        q(comm.gather_raw(&ins[r], &mut g, count, dt, root)).map_err(ctx("gather", c, ""))?;
        if r == root && (0..n).any(|p| part(&g, p) != ins[p]) {
            return Err(ctx("gather", c, "")(format!("root {root}: wrong data")));
        }
        let mut s = vec![0u8; count * es];
        let src = if r == root {
            big[root].clone()
        } else {
            Vec::new()
        };
        q(comm.scatter_raw(&src, &mut s, count, dt, root)).map_err(ctx("scatter", c, ""))?;
        if s != part(&big[root], r) {
            return Err(ctx("scatter", c, "")(format!("root {root}: wrong data")));
        }
    }

    let mut out = vec![0u8; n * count * es];
    q(comm.all_to_all_raw(&big[r], &mut out, count, dt)).map_err(ctx("all_to_all", c, ""))?;
    for (p, theirs) in big.iter().enumerate() {
        if part(&out, p) != part(theirs, r) {
            return Err(ctx("all_to_all", c, "")(format!(
                "part from rank {p} wrong"
            )));
        }
    }

    // send/recv between pairs (0,1), (2,3), ...; an odd last rank sits out.
    let partner = r ^ 1;
    if partner < n {
        let mut got = vec![0u8; count * es];
        if r % 2 == 0 {
            q(comm.send_raw(&ins[r], count, dt, partner)).map_err(ctx("send", c, ""))?;
            q(comm.recv_raw(&mut got, count, dt, partner)).map_err(ctx("recv", c, ""))?;
        } else {
            q(comm.recv_raw(&mut got, count, dt, partner)).map_err(ctx("recv", c, ""))?;
            q(comm.send_raw(&ins[r], count, dt, partner)).map_err(ctx("send", c, ""))?;
        }
        if got != ins[partner] {
            return Err(ctx("send/recv", c, "")("wrong data".into()));
        }
    }
    q(comm.barrier()).map_err(ctx("barrier", c, ""))
}

/// Runs `cases` in order; returns the first failure.
/// One all-reduce case with `algo`, out of place and in place, checked against the reference
/// and for identical bits on every rank.
pub fn check_all_reduce(
    comm: &Comm,
    c: &Case,
    ins: &[Vec<u8>],
    reference: &Reference<'_>,
    algo: Algo,
) -> Result<(), String> {
    let (dt, op, count) = (c.dtype, c.op, c.count);
    let r = comm.rank();
    let mut out = vec![0u8; count * dt.size()];
    q(comm.all_reduce_raw(Some(&ins[r]), &mut out, count, dt, op, Some(algo))).map_err(ctx(
        "all_reduce",
        c,
        algo.name(),
    ))?;
    reference
        .check(&out)
        .map_err(ctx("all_reduce", c, algo.name()))?;
    same_on_all_ranks(comm, &out, "all_reduce").map_err(ctx("all_reduce", c, algo.name()))?;
    let mut buf = ins[r].clone();
    q(comm.all_reduce_raw(None, &mut buf, count, dt, op, Some(algo))).map_err(ctx(
        "all_reduce in-place",
        c,
        algo.name(),
    ))?;
    if buf != out {
        return Err(ctx("all_reduce", c, algo.name())(
            "in-place result differs from out-of-place".into(),
        ));
    }
    Ok(())
}

pub fn run_all(comm: &Comm, cases: &[Case]) -> Result<(), String> {
    for (i, c) in cases.iter().enumerate() {
        run_case(comm, c, i as u64)?;
    }
    Ok(())
}

/// A 16 Mi-element f32 all-reduce (every algorithm), checked.
pub fn run_huge(comm: &Comm) -> Result<(), String> {
    let c = Case {
        dtype: DType::Float32,
        op: ReduceOp::Sum,
        count: 16 << 20,
    };
    let n = comm.size();
    let ins: Vec<Vec<u8>> = (0..n)
        .map(|p| input(c.dtype, c.op, p, c.count, 99))
        .collect();
    let reference = Reference::new(c.dtype, c.op, &ins, 0..c.count)?;
    for algo in [Algo::Ring, Algo::Sra, Algo::Tree] {
        let mut out = vec![0u8; c.count * 4];
        q(comm.all_reduce_raw(
            Some(&ins[comm.rank()]),
            &mut out,
            c.count,
            c.dtype,
            c.op,
            Some(algo),
        ))
        .map_err(ctx("all_reduce 16Mi", &c, algo.name()))?;
        reference
            .check(&out)
            .map_err(ctx("all_reduce 16Mi", &c, algo.name()))?;
        same_on_all_ranks(comm, &out, "all_reduce 16Mi")?;
    }
    // In place too: past 4 MiB the arena streams results over the input it staged from.
    let mut out = ins[comm.rank()].clone();
    q(comm.all_reduce_raw(None, &mut out, c.count, c.dtype, c.op, Some(Algo::Sra)))
        .map_err(ctx("all_reduce 16Mi in place", &c, "sra"))?;
    reference
        .check(&out)
        .map_err(ctx("all_reduce 16Mi in place", &c, "sra"))?;
    same_on_all_ranks(comm, &out, "all_reduce 16Mi in place")?;
    Ok(())
}
