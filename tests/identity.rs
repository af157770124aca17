//! Every rank ends every compressed collective bit-identical: every codec × schedule
//! (sra, ring, tree, allgather, hier, hier with compression inside the host, HiTopK) × world
//! size 2..=6 × flat and two-host layouts (blocked and interleaved) × counts 1, 7, 4099 (and
//! 1000003 at sizes 2 and 5), two calls in a row (the second runs on error-feedback state), in
//! place and out of place. Results are also checked against a float64 reference with a loose bound, so a
//! schedule cannot pass by agreeing on garbage.

mod common;

use common::coded::{grad, reference, rel_err};
use common::threads::on_hosts;
use qccl::{Algo, Comm, Compression, Config, DType, ReduceOp};

/// Every codec, stochastic and nearest rounding, with and without error feedback.
const CODECS: [&str; 12] = [
    "none",
    "fp16",
    "bf16",
    "qsgd:bits=4,bucket=128",
    "qsgd:bits=2,bucket=64,scale=maxabs,rounding=nearest",
    "qsgd:bits=8,bucket=512,ef=1",
    "topk:density=0.01,ef=1",
    "mstopk:density=0.02",
    "randk:density=0.01,ef=1",
    "randk:density=0.05",
    "efsign:ef=1",
    "onebit:ef=1",
];

const COUNTS: [usize; 3] = [1, 7, 4099];

/// A count large enough that every schedule cuts its chunks into several slices.
const WITH_LARGE: [usize; 4] = [1, 7, 4099, 1_000_003];

/// World sizes swept at [`COUNTS`]. The large count ([`WITH_LARGE`]), most of the sweep's
/// time, runs at the first two only: an even and an odd size, four and two 512 KiB slices per
/// chunk (a schedule's slicing depends on the size only through the chunk length).
const SIZES: [usize; 5] = [2, 5, 3, 4, 6];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Schedule {
    Flat(Algo),
    Hier { intra: bool },
    HiTopK,
}

const SCHEDULES: [Schedule; 7] = [
    Schedule::Flat(Algo::Sra),
    Schedule::Flat(Algo::Ring),
    Schedule::Flat(Algo::Tree),
    Schedule::Flat(Algo::AllGather),
    Schedule::Hier { intra: false },
    Schedule::Hier { intra: true },
    Schedule::HiTopK,
];

/// The host layouts of `n` ranks: one host, two hosts blocked (a a b b, or a a b for odd
/// `n`) and interleaved (a b a b).
fn layouts(n: usize) -> Vec<Vec<&'static str>> {
    vec![
        vec!["a"; n],
        (0..n)
            .map(|r| if r < n.div_ceil(2) { "a" } else { "b" })
            .collect(),
        (0..n).map(|r| if r % 2 == 0 { "a" } else { "b" }).collect(),
    ]
}

/// True when every host of `hosts` has as many ranks as the first.
fn uniform(hosts: &[&str]) -> bool {
    let on = |h: &str| hosts.iter().filter(|&&x| x == h).count();
    hosts.iter().all(|h| on(h) == on(hosts[0]))
}

/// The two-level schedules on hosts of different sizes: every rank gets an Unsupported error
/// naming the hosts' sizes, and the comm stays usable.
fn refuses_uneven(comm: &Comm, s: Schedule) -> Result<(), String> {
    let mut g = grad(comm.rank(), 7, 1);
    let err = match s {
        Schedule::HiTopK => comm.hitopk_all_reduce(&mut g, 0.1, "k").map(|_| ()),
        _ => {
            let c = Compression::parse("qsgd:bits=4,bucket=128")
                .unwrap()
                .algo(Algo::Hier)
                .intra_host(s == Schedule::Hier { intra: true });
            comm.all_reduce_compressed(&mut g, ReduceOp::Sum, &c)
                .map(|_| ())
        }
    };
    match err {
        Err(qccl::Error::Unsupported(m)) if m.contains("ranks") => {}
        other => return Err(format!("{s:?} on uneven hosts: {other:?}")),
    }
    comm.barrier()
        .map_err(|e| format!("after the refusal: {e}"))
}

/// One rank's results: for each (count, call, in-place) its output bits, in a fixed order.
type Outs = Vec<(String, Vec<f32>)>;

fn run_rank(comm: &Comm, codec: &str, s: Schedule, counts: &[usize]) -> Outs {
    let mut outs = Vec::new();
    for &count in counts {
        for call in 0..2u64 {
            for in_place in [true, false] {
                let what = format!("count {count} call {call} in_place {in_place}");
                let salt = count as u64 * 4 + call * 2 + in_place as u64;
                let input = grad(comm.rank(), count, salt);
                let key = format!("t{count}-{in_place}");
                let out = match s {
                    Schedule::HiTopK => {
                        // In place only; the out-of-place slot runs it again with another key.
                        let mut g = input;
                        let density = if codec.contains("0.05") { 0.05 } else { 0.01 };
                        comm.hitopk_all_reduce(&mut g, density, key)
                            .unwrap_or_else(|e| panic!("hitopk {what}: {e}"));
                        g
                    }
                    _ => {
                        let mut c = Compression::parse(codec).unwrap().key(key);
                        c = match s {
                            Schedule::Flat(a) => c.algo(a),
                            Schedule::Hier { intra } => c.algo(Algo::Hier).intra_host(intra),
                            Schedule::HiTopK => unreachable!(),
                        };
                        if in_place {
                            let mut g = input;
                            comm.all_reduce_compressed(&mut g, ReduceOp::Sum, &c)
                                .unwrap_or_else(|e| panic!("{what}: {e}"));
                            g
                        } else {
                            let mut g = vec![f32::NAN; count];
                            comm.all_reduce_compressed_raw(
                                Some(bytemuck::cast_slice(&input)),
                                bytemuck::cast_slice_mut(&mut g),
                                count,
                                DType::Float32,
                                ReduceOp::Sum,
                                &c,
                            )
                            .unwrap_or_else(|e| panic!("{what}: {e}"));
                            g
                        }
                    }
                };
                outs.push((format!("{what} salt {salt}"), out));
            }
        }
    }
    outs
}

/// Loose accuracy bound per codec (relative L2 error against the float64 sum): the test is
/// about identity; this only catches a schedule that agrees on garbage.
fn bound(codec: &str, s: Schedule) -> f64 {
    match codec {
        _ if s == Schedule::HiTopK => 2.0,
        "none" => 1e-5,
        "fp16" | "bf16" => 0.05,
        c if c.starts_with("qsgd:bits=8") => 0.05,
        _ => 2.0, // few bits, sparse and sign codecs: bounded, not accurate
    }
}

fn sweep(codec: &'static str, sizes: &[usize], counts: &'static [usize]) {
    for &n in sizes {
        for hosts in layouts(n) {
            for s in SCHEDULES {
                // HiTopK has its own codec (MSTopK): once per layout is enough.
                if s == Schedule::HiTopK && codec != "none" {
                    continue;
                }
                if !matches!(s, Schedule::Flat(_)) && !uniform(&hosts) {
                    for r in on_hosts(&hosts, Config::default(), move |c| refuses_uneven(c, s)) {
                        r.unwrap_or_else(|e| panic!("{codec} hosts {hosts:?}: {e}"));
                    }
                    continue;
                }
                let results = on_hosts(&hosts, Config::default(), move |comm| {
                    run_rank(comm, codec, s, counts)
                });
                for (k, (what, r0)) in results[0].iter().enumerate() {
                    let case = format!("{codec} {s:?} hosts {hosts:?} {what}");
                    for (rank, outs) in results.iter().enumerate().skip(1) {
                        let same = outs[k].1.len() == r0.len()
                            && outs[k]
                                .1
                                .iter()
                                .zip(r0)
                                .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{case}: rank {rank} differs from rank 0");
                    }
                    let count = r0.len();
                    let salt: u64 = what.rsplit(' ').next().unwrap().parse().unwrap();
                    let e = rel_err(r0, &reference(n, count, salt));
                    let call = what.contains("call 1");
                    // Error feedback's second call re-sends the first call's residual: the
                    // bound is on the sum of both calls' errors, which the first bounds.
                    let b = bound(codec, s) * if call { 2.0 } else { 1.0 };
                    assert!(e <= b, "{case}: relative error {e} above {b}");
                }
            }
        }
    }
}

macro_rules! sweep_tests {
    ($($name:ident: $codec:expr;)*) => {$(
        #[test]
        fn $name() {
            sweep($codec, &SIZES[..2], &WITH_LARGE);
            sweep($codec, &SIZES[2..], &COUNTS);
        }
    )*};
}

sweep_tests! {
    none: CODECS[0];
    fp16: CODECS[1];
    bf16: CODECS[2];
    qsgd4_stochastic: CODECS[3];
    qsgd2_nearest_maxabs: CODECS[4];
    qsgd8_ef: CODECS[5];
    topk_ef: CODECS[6];
    mstopk: CODECS[7];
    randk_ef: CODECS[8];
    randk: CODECS[9];
    efsign_ef: CODECS[10];
    onebit_ef: CODECS[11];
}
