use super::*;
use crate::codec::testing::gaussian;
use crate::codec::{CodecSpec, Site, HEADER_LEN};

fn rel_err(x: &[f32], y: &[f32]) -> f64 {
    let num: f64 = x
        .iter()
        .zip(y)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum();
    let den: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

fn q(bits: u32, bucket: u32, scale: Scale, rounding: Rounding) -> Qsgd {
    Qsgd::new(bits, bucket, scale, rounding).unwrap()
}

fn encode(c: &dyn Codec, x: &[f32], seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; c.max_encoded_len(x.len())];
    let n = c.encode(x, &mut Rng::from_u64(seed), &mut out).unwrap();
    assert_eq!(n, out.len());
    out
}

fn decode(c: &dyn Codec, bytes: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0.0; n];
    c.decode_into(bytes, &mut out).unwrap();
    out
}

const SCALES: [Scale; 2] = [Scale::MaxMin, Scale::MaxAbs];
const ROUNDINGS: [Rounding; 2] = [Rounding::Stochastic, Rounding::Nearest];

#[test]
fn gaussian_round_trip_error_paths_and_bounds() {
    let big = gaussian(1_000_003, 1);
    for n in [0usize, 1, 5, 127, 128, 129, 1_000_003] {
        let x = &big[..n];
        for bits in [8, 4] {
            for scale in SCALES {
                for rounding in ROUNDINGS {
                    for bucket in [1u32, 7, 128, 1000] {
                        let c = q(bits, bucket, scale, rounding);
                        let bytes = encode(&c, x, 42);
                        assert_eq!(bytes.len(), HEADER_LEN + c.payload_len(n));
                        let y = decode(&c, &bytes, n);
                        let e = rel_err(x, &y);
                        // Stochastic rounding's rms error is step/sqrt(6); at 8 bits with
                        // buckets of 1000 Gaussians (range ~6.5σ) that is ~1.04%, so this
                        // one case gets 1.2%.
                        let limit = match (bits, bucket, rounding) {
                            (8, 1000, Rounding::Stochastic) => 0.012,
                            (8, _, _) => 0.01,
                            _ => 0.2,
                        };
                        let what = c.spec();
                        assert!(e < limit, "{what} n={n}: error {e}");
                        assert!(e <= c.error_bound().unwrap(), "{what} n={n}: {e}");
                        assert!(y.iter().all(|v| v.is_finite()), "{what}");
                        if n > 200_000 && bucket != 128 {
                            continue; // the remaining checks, at full size, for one bucket
                        }
                        // The portable and AVX2 paths give the same bytes and values.
                        let mut a = vec![0u8; c.payload_len(n)];
                        let mut b = a.clone();
                        c.encode_with(Path::Portable, x, &Rng::from_u64(42), &mut a);
                        for path in [Path::Avx2, Path::Avx512] {
                            c.encode_with(path, x, &Rng::from_u64(42), &mut b);
                            assert_eq!(a, b, "{what} n={n} {path:?}");
                        }
                        assert_eq!(&bytes[HEADER_LEN..], &a[..], "{what} n={n}");
                        let mut ya = vec![0.0f32; n];
                        c.decode_with(false, &a, &mut ya, false).unwrap();
                        assert_eq!(bits_of(&ya), bits_of(&y), "{what} n={n}");
                        // decode_add adds exactly the decoded values, on both paths.
                        let prev = gaussian(n, 3);
                        let mut sum = prev.clone();
                        c.decode_add(&bytes, &mut sum).unwrap();
                        let mut sum2 = prev.clone();
                        c.decode_with(false, &a, &mut sum2, true).unwrap();
                        for i in 0..n {
                            assert_eq!(sum[i], prev[i] + y[i], "{what} n={n} i={i}");
                            assert_eq!(sum2[i].to_bits(), sum[i].to_bits());
                        }
                    }
                }
            }
        }
    }
}

fn bits_of(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn every_width_and_odd_sizes_agree_across_paths() {
    let x = gaussian(5000, 9);
    for bits in 1..=8 {
        for bucket in [1u32, 3, 8, 100, 2049, 5000, 9000] {
            for n in [0usize, 1, 7, 8, 9, 2047, 2048, 2049, 5000] {
                let c = q(bits, bucket, SCALES[n % 2], ROUNDINGS[bucket as usize % 2]);
                let x = &x[..n];
                let mut a = vec![0u8; c.payload_len(n)];
                let mut b = a.clone();
                c.encode_with(Path::Portable, x, &Rng::from_u64(5), &mut a);
                for path in [Path::Avx2, Path::Avx512] {
                    c.encode_with(path, x, &Rng::from_u64(5), &mut b);
                    assert_eq!(a, b, "{} n={n} {path:?}", c.spec());
                }
                let mut ya = vec![0.0f32; n];
                let mut yb = vec![0.0f32; n];
                c.decode_with(false, &a, &mut ya, false).unwrap();
                c.decode_with(true, &a, &mut yb, false).unwrap();
                assert_eq!(bits_of(&ya), bits_of(&yb), "{} n={n}", c.spec());
                let e = rel_err(x, &ya);
                assert!(e <= c.error_bound().unwrap(), "{} n={n}: {e}", c.spec());
            }
        }
    }
}

#[test]
fn encoding_own_data_keeps_exactly_what_the_decoder_gives() {
    // Gaussian data with extremes, non-finite values and a constant bucket in it.
    let mut x = gaussian(5000, 11);
    x[17] = f32::NAN;
    x[3000] = f32::INFINITY;
    x[4500] = -f32::MAX;
    x[4501] = f32::MAX;
    x[256..384].fill(0.75);
    for bits in [1, 2, 4, 8] {
        for bucket in [1u32, 7, 128, 2049, 9000] {
            for n in [0usize, 1, 9, 2048, 2049, 5000] {
                let c = q(bits, bucket, SCALES[n % 2], ROUNDINGS[bucket as usize % 2]);
                let sent = encode(&c, &x[..n], 3);
                let kept = decode(&c, &sent, n);
                for path in [Path::Portable, Path::Avx2, Path::Avx512] {
                    let mut own = x[..n].to_vec();
                    let mut bytes = vec![0u8; c.payload_len(n)];
                    c.encode_with(path, &mut own[..], &Rng::from_u64(3), &mut bytes);
                    assert_eq!(bytes, sent[HEADER_LEN..], "{} n={n} {path:?}", c.spec());
                    assert_eq!(bits_of(&own), bits_of(&kept), "{} n={n} {path:?}", c.spec());
                }
                let mut own = x[..n].to_vec();
                let mut framed = vec![0u8; c.max_encoded_len(n)];
                let len = c
                    .encode_own(&mut own, &mut Rng::from_u64(3), &mut framed)
                    .unwrap();
                assert_eq!((len, &framed), (sent.len(), &sent), "{}", c.spec());
                assert_eq!(bits_of(&own), bits_of(&kept), "{} n={n}", c.spec());
            }
        }
    }
}

#[test]
fn levels_and_layout_on_a_small_vector() {
    // Bucket of 4 with min 0 and max 3 at 2 bits: levels are the values themselves.
    let c = q(2, 4, Scale::MaxMin, Rounding::Nearest);
    let x = [0.0f32, 1.0, 2.0, 3.0, -1.0, 1.0];
    let bytes = encode(&c, &x, 0);
    let p = &bytes[HEADER_LEN..];
    assert_eq!(p.len(), 2 * 8 + 2);
    assert_eq!(f32::from_le_bytes(p[0..4].try_into().unwrap()), 0.0);
    assert_eq!(f32::from_le_bytes(p[4..8].try_into().unwrap()), 3.0);
    assert_eq!(f32::from_le_bytes(p[8..12].try_into().unwrap()), -1.0);
    assert_eq!(f32::from_le_bytes(p[12..16].try_into().unwrap()), 1.0);
    // Levels 0,1,2,3 then 0,3: 0b11_10_01_00, 0b0000_11_00.
    assert_eq!(&p[16..], &[0b1110_0100, 0b0000_1100]);
    assert_eq!(decode(&c, &bytes, 6), x);
    // maxabs: symmetric levels, zero-centred, so ±m is exact.
    let c = q(4, 3, Scale::MaxAbs, Rounding::Nearest);
    let x = [-7.0f32, 7.0, 0.0];
    let y = decode(&c, &encode(&c, &x, 0), 3);
    assert_eq!(&y[..2], &x[..2]);
    assert!(y[2].abs() <= 7.0 / 15.0 + 1e-6);
}

#[test]
fn constant_and_non_finite_buckets() {
    let c = q(4, 4, Scale::MaxMin, Rounding::Stochastic);
    let x = [
        2.5f32,
        2.5,
        2.5,
        2.5,
        1.0,
        f32::NAN,
        3.0,
        4.0,
        1.0,
        f32::INFINITY,
        -1.0,
    ];
    let y = decode(&c, &encode(&c, &x, 1), x.len());
    assert_eq!(&y[..4], &[2.5; 4]);
    assert!(y[4..].iter().all(|v| v.is_nan()), "{y:?}");
    // Near f32::MAX nothing overflows.
    let c = q(3, 2, Scale::MaxMin, Rounding::Nearest);
    let x = [-f32::MAX, f32::MAX, f32::MAX, f32::MAX * 0.5];
    let y = decode(&c, &encode(&c, &x, 1), 4);
    assert_eq!(&y[..3], &x[..3]);
    assert!(y.iter().all(|v| v.is_finite()));
}

#[test]
fn stochastic_rounding_is_unbiased() {
    let n = 1000;
    let x = gaussian(n, 11);
    for (bits, bucket, scale) in [(2, 64, Scale::MaxMin), (4, 128, Scale::MaxAbs)] {
        let c = q(bits, bucket, scale, Rounding::Stochastic);
        // Per-element variance of one encode: p(1−p)·step², p the fractional level position.
        let mut var = vec![0.0f64; n];
        for (bi, xb) in x.chunks(bucket as usize).enumerate() {
            let (lo, hi) = bucket_bounds(scale, xb);
            let step = (hi as f64 - lo as f64) / c.top() as f64;
            for (j, &v) in xb.iter().enumerate() {
                let t = (v as f64 - lo as f64) / step;
                let p = t - t.floor();
                var[bi * bucket as usize + j] = p * (1.0 - p) * step * step;
            }
        }
        let total_var: f64 = var.iter().sum();
        let mut sum = vec![0.0f64; n];
        let mut done = 0usize;
        let mut errs = Vec::new();
        for trials in [100usize, 1600] {
            while done < trials {
                let y = decode(&c, &encode(&c, &x, 1000 + done as u64), n);
                for (s, v) in sum.iter_mut().zip(&y) {
                    *s += *v as f64;
                }
                done += 1;
            }
            // ‖mean − x‖² is a sum of n squared errors of variance var_i / trials: its ratio
            // to the expectation is within a few × sqrt(2/n) ≈ 0.045 of 1 when unbiased.
            let sq: f64 = sum
                .iter()
                .zip(&x)
                .map(|(s, &v)| (s / trials as f64 - v as f64).powi(2))
                .sum();
            let ratio = sq / (total_var / trials as f64);
            assert!(
                (0.75..1.25).contains(&ratio),
                "{} T={trials}: {ratio}",
                c.spec()
            );
            errs.push(sq.sqrt());
        }
        // 16× the trials: the error of the mean shrinks ~4×.
        let shrink = errs[0] / errs[1];
        assert!(
            (3.0..5.3).contains(&shrink),
            "{}: shrink {shrink}",
            c.spec()
        );
    }
}

#[test]
fn sites_seed_the_rounding() {
    let c = q(4, 128, Scale::MaxMin, Rounding::Stochastic);
    let x = gaussian(4096, 2);
    let site = Site {
        seed: 1,
        step: 2,
        chunk: 3,
        rank: 4,
    };
    let run = |s: Site| {
        let mut out = vec![0u8; c.max_encoded_len(x.len())];
        c.encode(&x, &mut Rng::new(s), &mut out).unwrap();
        out
    };
    assert_eq!(run(site), run(site));
    assert_ne!(run(site), run(Site { rank: 5, ..site }));
    assert_ne!(run(site), run(Site { step: 3, ..site }));
    // Nearest rounding draws nothing.
    let c = q(4, 128, Scale::MaxMin, Rounding::Nearest);
    let mut a = vec![0u8; c.max_encoded_len(x.len())];
    let mut b = a.clone();
    c.encode(&x, &mut Rng::new(site), &mut a).unwrap();
    c.encode(&x, &mut Rng::new(Site { rank: 5, ..site }), &mut b)
        .unwrap();
    assert_eq!(a, b);
}

#[test]
fn mismatched_parameters_are_rejected() {
    let x = gaussian(300, 4);
    let enc = q(4, 128, Scale::MaxMin, Rounding::Stochastic);
    let bytes = encode(&enc, &x, 0);
    for other in [
        q(8, 128, Scale::MaxMin, Rounding::Stochastic),
        q(4, 64, Scale::MaxMin, Rounding::Stochastic),
        q(4, 128, Scale::MaxAbs, Rounding::Stochastic),
        q(4, 128, Scale::MaxMin, Rounding::Nearest),
    ] {
        let mut out = vec![0.0; 300];
        let e = other.decode_into(&bytes, &mut out).unwrap_err().to_string();
        assert!(e.contains("parameters"), "{e}");
    }
    let mut out = vec![0.0; 299];
    assert!(enc.decode_into(&bytes, &mut out).is_err());
    let mut out = vec![0.0; 300];
    assert!(enc
        .decode_into(&bytes[..bytes.len() - 1], &mut out)
        .is_err());
}

#[test]
fn bad_scales_are_errors() {
    let c = q(4, 2, Scale::MaxMin, Rounding::Nearest);
    let mut bytes = encode(&c, &[1.0, 2.0, 3.0, 4.0], 0);
    let set = |b: &mut Vec<u8>, k: usize, v: f32| {
        b[HEADER_LEN + 4 * k..HEADER_LEN + 4 * k + 4].copy_from_slice(&v.to_le_bytes())
    };
    let mut out = [0.0f32; 4];
    set(&mut bytes, 0, 5.0); // min 5 > max 2
    assert!(c.decode_into(&bytes, &mut out).is_err());
    set(&mut bytes, 0, f32::NEG_INFINITY);
    assert!(c.decode_into(&bytes, &mut out).is_err());
    set(&mut bytes, 0, f32::NAN); // only one NaN
    assert!(c.decode_into(&bytes, &mut out).is_err());
    set(&mut bytes, 1, f32::NAN); // both: a non-finite bucket
    c.decode_into(&bytes, &mut out).unwrap();
    assert!(out[0].is_nan() && out[1].is_nan() && out[2] == 3.0);
    let c = q(4, 2, Scale::MaxAbs, Rounding::Nearest);
    let mut bytes = encode(&c, &[1.0, 2.0, 3.0, 4.0], 0);
    set(&mut bytes, 1, -1.0);
    assert!(c.decode_into(&bytes, &mut out).is_err());
}

#[test]
fn garbage_never_panics() {
    let mut r = Rng::from_u64(77);
    let codecs: Vec<Qsgd> = [(1, 1), (3, 5), (4, 128), (8, 9)]
        .iter()
        .flat_map(|&(b, k)| {
            SCALES
                .iter()
                .map(move |&s| q(b, k, s, Rounding::Stochastic))
        })
        .collect();
    for i in 0..3000 {
        let c = &codecs[i % codecs.len()];
        let n = r.below(300) as usize;
        let mut bytes = encode(c, &gaussian(n, i as u64), i as u64);
        // Random payload behind a valid header, sometimes a wrong length too.
        for b in &mut bytes[HEADER_LEN..] {
            *b = r.next_u64() as u8;
        }
        if i % 3 == 0 {
            let cut = r.below(bytes.len() as u64 + 1) as usize;
            bytes.truncate(cut);
        }
        if i % 7 == 0 {
            bytes = (0..r.below(100)).map(|_| r.next_u64() as u8).collect();
        }
        let mut out = vec![0.0f32; n];
        let _ = c.decode_add(&bytes, &mut out);
        if c.decode_into(&bytes, &mut out).is_ok() {
            // Within the stored (finite or NaN) bounds.
            assert!(out.iter().all(|v| !v.is_infinite()));
        }
    }
}

#[test]
fn specs_parse_with_defaults_and_round_trip() {
    let s = CodecSpec::parse("qsgd").unwrap();
    assert_eq!(
        s.codec().spec(),
        "qsgd:bits=4,bucket=128,scale=maxmin,rounding=stochastic"
    );
    assert!(!s.error_feedback());
    for text in [
        "qsgd:bits=8",
        "qsgd:bits=2,bucket=7,scale=maxabs",
        "qsgd:rounding=nearest,bits=1,bucket=16777216",
        "qsgd:bits=4,ef=1",
    ] {
        let a = CodecSpec::parse(text).unwrap();
        let b = CodecSpec::parse(&a.to_string()).unwrap();
        assert_eq!(a, b, "{text}");
        assert_eq!(a.codec().params(), b.codec().params());
        assert_eq!(a.error_feedback(), text.contains("ef=1"));
    }
    let a = CodecSpec::parse("qsgd:bits=2,bucket=7,scale=maxabs,rounding=nearest").unwrap();
    assert_eq!(
        a.to_string(),
        "qsgd:bits=2,bucket=7,scale=maxabs,rounding=nearest"
    );
    for (text, needle) in [
        ("qsgd:bits=0", "bits must be in 1..=8"),
        ("qsgd:bits=9", "bits must be in 1..=8"),
        ("qsgd:bits=x", "bits must be an integer"),
        ("qsgd:bucket=0", "bucket must be in"),
        ("qsgd:bucket=16777217", "bucket must be in"),
        ("qsgd:scale=foo", "scale must be one of maxmin|maxabs"),
        (
            "qsgd:rounding=foo",
            "rounding must be one of stochastic|nearest",
        ),
        ("qsgd:density=0.1", "unknown field \"density\""),
    ] {
        let e = CodecSpec::parse(text).unwrap_err().to_string();
        assert!(e.contains(needle), "{text}: {e}");
    }
}

#[test]
fn floor_small_is_floor() {
    let mut r = Rng::from_u64(8);
    for _ in 0..100_000 {
        let t = r.next_f32() * 255.0;
        assert_eq!(floor_small(t), t.floor() as u8, "{t}");
    }
    for k in 0..=255u8 {
        let t = k as f32;
        assert_eq!(floor_small(t), k);
        assert_eq!(floor_small(t - t * f32::EPSILON), k.saturating_sub(1));
        if k < 255 {
            assert_eq!(floor_small(t + 0.5), k);
        }
    }
}

#[test]
fn uniforms_are_the_spec_draws() {
    // Each tile's fill against the element-wise definition (rng::uniform24), at tile starts
    // far from 0 too.
    let key = 0x0123_4567_89ab_cdef;
    let mut u = vec![0.0f32; 2056];
    for i0 in [0usize, 2, 2048, 1 << 40, 1 << 62] {
        for len in [8usize, 16, 2048, 2056] {
            fill_uniforms(key, i0, &mut u[..len]);
            for (c, &v) in u[..len].iter().enumerate() {
                let i = (i0 + c) as u64;
                assert_eq!(v, crate::codec::rng::uniform24(key, i), "i0={i0} c={c}");
            }
            #[cfg(target_arch = "x86_64")]
            if let Some(cpu) = crate::codec::x86::Avx2::detect() {
                let mut v = vec![0.0f32; len];
                cpu.fill_uniforms(key, i0, &mut v);
                assert_eq!(bits_of(&v), bits_of(&u[..len]), "avx2 i0={i0} len={len}");
            }
        }
    }
}

/// The levels of one encode from the spec, element by element in f32 exactly as the kernel
/// computes them: t = (x/2 − lo/2)·(L / (hi/2 − lo/2)) + u_i, clamped to [0, L], floored.
fn reference_levels(c: &Qsgd, x: &[f32], key: u64) -> Vec<u8> {
    let b = c.bucket as usize;
    let top = c.top() as f32;
    let mut out = Vec::with_capacity(x.len());
    for (bi, xb) in x.chunks(b.max(1)).enumerate() {
        let (l, h) = bucket_bounds(c.scale, xb);
        let d = h * 0.5 - l * 0.5;
        let (lo2, inv) = if d > 0.0 {
            (l * 0.5, top / d)
        } else {
            (0.0, 0.0)
        };
        for (j, &v) in xb.iter().enumerate() {
            let i = (bi * b + j) as u64;
            let r = match c.rounding {
                Rounding::Stochastic => crate::codec::rng::uniform24(key, i),
                Rounding::Nearest => 0.5,
            };
            let t = (v * 0.5 - lo2) * inv + r;
            out.push(t.clamp(0.0, top).floor() as u8);
        }
    }
    out
}

#[test]
fn each_level_depends_only_on_its_element_draw() {
    // Whatever the tile, bucket or CPU path, element i rounds with uniform24(K, i): the
    // encoded levels equal the element-wise reference.
    let big = gaussian(70_001, 21);
    let site = Site {
        seed: 9,
        step: 3,
        chunk: 4096,
        rank: 2,
    };
    for n in [0usize, 1, 7, 2047, 2049, 4099, 70_001] {
        let x = &big[..n];
        for (bits, bucket, scale) in [
            (4, 128, Scale::MaxMin),
            (1, 7, Scale::MaxAbs),
            (8, 3000, Scale::MaxMin),
            (3, 1, Scale::MaxAbs),
        ] {
            let c = q(bits, bucket, scale, Rounding::Stochastic);
            let want = reference_levels(&c, x, site.key());
            let bytes = encode_site(&c, x, site);
            let mut got = vec![0u8; n.next_multiple_of(8)];
            let p = &bytes[HEADER_LEN..];
            let stream = &p[c.meta_bytes(n)..];
            let mut padded = stream.to_vec();
            padded.resize(got.len() / 8 * bits as usize, 0);
            crate::codec::bits::unpack(bits as usize, &padded, &mut got);
            assert_eq!(&got[..n], &want[..], "{} n={n}", c.spec());
        }
    }
}

fn encode_site(c: &Qsgd, x: &[f32], site: Site) -> Vec<u8> {
    let mut out = vec![0u8; c.max_encoded_len(x.len())];
    c.encode(x, &mut Rng::new(site), &mut out).unwrap();
    out
}

#[test]
fn version_1_chunks_are_refused() {
    let c = q(4, 128, Scale::MaxMin, Rounding::Stochastic);
    let x = gaussian(300, 5);
    let mut bytes = encode(&c, &x, 0);
    assert_eq!(bytes[1], 2);
    bytes[1] = 1;
    let mut out = vec![0.0; 300];
    let e = c.decode_into(&bytes, &mut out).unwrap_err().to_string();
    assert!(
        e.contains("version 1") && e.contains("reads version 2"),
        "{e}"
    );
}
