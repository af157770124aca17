//! HiTopKComm and its baselines on thread ranks with emulated hosts: exact against a float64
//! simulation of Algorithm 2 with the indices MSTopK selected, density 1 equal to the dense
//! all-reduce, bit-identical everywhere, error feedback, NaiveAG reproduced bit for bit.

mod common;

use common::coded::{grad, reference, rel_err};
use common::threads::assert_identical;
use common::topk::{max_rel_diff, simulate};
use qccl::codec::{Rng, Site};
use qccl::{Algo, CodecSpec, Comm, Config, ReduceOp, TopK, TopKScheme};

fn on_hosts<R: Send + 'static>(
    hosts: &[&str],
    f: impl Fn(&Comm) -> R + Send + Sync + 'static,
) -> Vec<R> {
    common::threads::on_hosts(hosts, Config::default(), f)
}

const SHAPES: [&[&str]; 4] = [
    &["a", "a", "a", "a"],           // 1 host x 4
    &["a", "a", "b", "b"],           // 2 x 2
    &["a", "b", "a", "b", "a", "b"], // 2 x 3, interleaved
    &["a", "b", "c"],                // 3 hosts x 1
];

#[test]
fn hitopk_matches_algorithm_2() {
    for hosts in SHAPES {
        for (count, density) in [(10_007usize, 0.01), (50_000, 0.05), (7, 0.5), (1, 1.0)] {
            let outs = on_hosts(hosts, move |comm| {
                let mut g = grad(comm.rank(), count, 3);
                let o = TopK {
                    record_indices: true,
                    ..TopK::new(density).error_feedback(false)
                };
                let rep = comm
                    .topk_all_reduce(&mut g, TopKScheme::HiTopK, &o)
                    .unwrap();
                (g, rep)
            });
            let what = format!("{hosts:?} count {count} density {density}");
            let res: Vec<Vec<f32>> = outs.iter().map(|o| o.0.clone()).collect();
            assert_identical(&res, &what);
            let idx: Vec<Vec<u32>> = outs.iter().map(|o| o.1.indices.clone().unwrap()).collect();
            let sim = simulate(hosts, count, 3, &idx);
            let d = max_rel_diff(&res[0], &sim);
            assert!(d < 1e-5, "{what}: differs from the simulation by {d}");
            for (r, o) in outs.iter().enumerate() {
                let local = hosts.iter().filter(|h| **h == hosts[r]).count();
                let slice = common::topk::part(count, local, common::topk::layout(hosts)[r].1);
                let k = ((density * slice.len() as f64).ceil() as usize)
                    .clamp(slice.len().min(1), slice.len());
                assert_eq!(o.1.k, k, "{what}: rank {r} selected {} not {k}", o.1.k);
            }
        }
    }
}

#[test]
fn density_one_equals_the_dense_all_reduce() {
    let count = 30_011;
    for hosts in SHAPES {
        let outs = on_hosts(hosts, move |comm| {
            let mut g = grad(comm.rank(), count, 4);
            let o = TopK::new(1.0).error_feedback(false);
            comm.topk_all_reduce(&mut g, TopKScheme::HiTopK, &o)
                .unwrap();
            let mut d = grad(comm.rank(), count, 4);
            comm.all_reduce_with(None, &mut d, ReduceOp::Sum, Algo::Hier)
                .unwrap();
            (g, d)
        });
        let (h, d): (Vec<_>, Vec<_>) = outs.into_iter().unzip();
        assert_identical(&h, "hitopk density 1");
        let dense: Vec<f64> = d[0].iter().map(|&x| x as f64).collect();
        assert!(max_rel_diff(&h[0], &dense) < 1e-5, "{hosts:?}");
        assert!(rel_err(&h[0], &reference(hosts.len(), count, 4)) < 1e-6);
    }
}

#[test]
fn baselines_against_their_references() {
    let hosts: &[&str] = &["a", "a", "b", "b"];
    let count = 20_000;
    let density = 0.02;
    let outs = on_hosts(hosts, move |comm| {
        let run = |scheme| {
            let mut g = grad(comm.rank(), count, 6);
            let o = TopK::new(density).error_feedback(false);
            let rep = comm.topk_all_reduce(&mut g, scheme, &o).unwrap();
            (g, rep)
        };
        // NaiveAG first: it is this comm's first compressed call (step 0 of its random stream).
        [
            run(TopKScheme::NaiveAg),
            run(TopKScheme::TreeAr),
            run(TopKScheme::TwoDTar),
        ]
    });
    let exact = reference(4, count, 6);
    for (k, name) in ["naiveag", "treear", "2dtar"].iter().enumerate() {
        let res: Vec<Vec<f32>> = outs.iter().map(|o| o[k].0.clone()).collect();
        assert_identical(&res, name);
        assert!(outs[0][k].1.wire.sent > 0, "{name}");
    }
    // Dense baselines: the float64 sum.
    assert!(rel_err(&outs[0][1].0, &exact) < 1e-6);
    assert!(rel_err(&outs[0][2].0, &exact) < 1e-6);
    // NaiveAG: every rank's MSTopK of its own gradient, summed in rank order, bit for bit.
    let codec = CodecSpec::parse(&format!("mstopk:density={density}")).unwrap();
    let c = codec.codec();
    let mut sim = vec![0f32; count];
    for r in 0..4 {
        let g = grad(r, count, 6);
        let mut enc = vec![0u8; c.max_encoded_len(count)];
        let mut rng = Rng::new(Site {
            seed: 0,
            step: 0,
            chunk: 0,
            rank: r as u64,
        });
        c.encode(&g, &mut rng, &mut enc).unwrap();
        c.decode_add(&enc, &mut sim).unwrap();
    }
    assert!(
        outs[0][0]
            .0
            .iter()
            .zip(&sim)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "naiveag differs from its simulation"
    );
    // HiTopK moves far fewer inter-host bytes than NaiveAG's flat all-gather.
    let e = rel_err(&outs[0][0].0, &exact);
    assert!(e < 1.0, "naiveag error {e}");
}

#[test]
fn error_feedback_resends_the_rest() {
    // The same gradient every step: with error feedback the running total of the results
    // converges to steps × the true sum; without, it misses most of it.
    let hosts: &[&str] = &["a", "a", "b", "b"];
    let count = 4000;
    let steps = 60;
    let outs = on_hosts(hosts, move |comm| {
        let mut totals = [vec![0f64; count], vec![0f64; count]];
        for (t, ef) in [false, true].into_iter().enumerate() {
            for _ in 0..steps {
                let mut g = grad(comm.rank(), count, 8);
                let o = TopK::new(0.05).key("g").error_feedback(ef);
                comm.topk_all_reduce(&mut g, TopKScheme::HiTopK, &o)
                    .unwrap();
                for (a, b) in totals[t].iter_mut().zip(&g) {
                    *a += *b as f64;
                }
            }
        }
        let missing_key = comm
            .topk_all_reduce(&mut [0f32; 10], TopKScheme::HiTopK, &TopK::new(0.1))
            .unwrap_err()
            .to_string();
        (totals, missing_key)
    });
    let want: Vec<f64> = reference(4, count, 8)
        .iter()
        .map(|x| x * steps as f64)
        .collect();
    let err = |t: &[f64]| {
        let num: f64 = t.iter().zip(&want).map(|(a, b)| (a - b).powi(2)).sum();
        let den: f64 = want.iter().map(|b| b * b).sum();
        (num / den).sqrt()
    };
    let (plain, fed) = (err(&outs[0].0[0]), err(&outs[0].0[1]));
    // An entry waits up to about 1/ρ = 20 steps for its turn, so after 60 steps some of the
    // total is still in flight; without EF most of it is simply lost.
    assert!(
        fed < 0.2 && plain > 0.5 && fed * 4.0 < plain,
        "with EF {fed}, without {plain}"
    );
    assert!(outs[0].1.contains("needs a tensor key"), "{}", outs[0].1);
}

#[test]
fn bad_input_and_shapes() {
    let errs = on_hosts(&["a", "a", "b"], |comm| {
        let mut f = vec![0f32; 10];
        let mut i = vec![0i32; 10];
        let o = TopK::new(0.1).key(1u64);
        vec![
            comm.topk_all_reduce(&mut f, TopKScheme::HiTopK, &o)
                .unwrap_err()
                .to_string(),
            comm.topk_all_reduce(&mut i, TopKScheme::NaiveAg, &o)
                .unwrap_err()
                .to_string(),
            comm.topk_all_reduce(&mut f, TopKScheme::HiTopK, &TopK::new(0.0))
                .unwrap_err()
                .to_string(),
        ]
    });
    assert!(
        errs[0][0].contains("same number of ranks on every host"),
        "{}",
        errs[0][0]
    );
    assert!(errs[0][1].contains("not int32"), "{}", errs[0][1]);
    assert!(
        errs[0][2].contains("density 0 is outside"),
        "{}",
        errs[0][2]
    );
    assert!(TopKScheme::parse("2DTAR").is_ok() && TopKScheme::parse("x").is_err());
}

/// Every scheme on no element, one, and a few, blocking and queued, on 2 hosts x 2: each call
/// declares how many compressed calls it runs (HiTopK none on no element), and the comm fails
/// if it runs another number, so a wrong count shows as an error here.
#[test]
fn every_scheme_runs_the_compressed_calls_it_declares() {
    let hosts: &[&str] = &["a", "a", "b", "b"];
    let outs = on_hosts(hosts, |comm| {
        let mut sums = Vec::new();
        for scheme in [
            TopKScheme::HiTopK,
            TopKScheme::NaiveAg,
            TopKScheme::TreeAr,
            TopKScheme::TwoDTar,
        ] {
            for count in [0usize, 1, 13] {
                let o = TopK::new(1.0).error_feedback(false);
                let mut g = vec![1f32; count];
                comm.topk_all_reduce(&mut g, scheme, &o)
                    .unwrap_or_else(|e| panic!("{scheme:?} count {count}: {e}"));
                let req = comm
                    .topk_all_reduce_async(vec![1f32; count], scheme, &o)
                    .unwrap();
                let (h, _) = req
                    .wait()
                    .unwrap_or_else(|e| panic!("{scheme:?} count {count} queued: {e}"));
                sums.push((g, h));
            }
        }
        sums
    });
    // Density 1 of ones: every element sums to the number of ranks, bit for bit.
    for (r, calls) in outs.iter().enumerate() {
        for (g, h) in calls {
            assert!(
                g.iter().chain(h).all(|&v| v == 4.0),
                "rank {r}: {g:?} {h:?}"
            );
        }
    }
}
