use super::*;
use crate::codec::testing::gaussian;
use crate::codec::{CodecSpec, HEADER_LEN};

fn rel_err(x: &[f32], y: &[f32]) -> f64 {
    let num: f64 = x
        .iter()
        .zip(y)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum();
    let den: f64 = x.iter().map(|a| (*a as f64).powi(2)).sum();
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

fn encode(c: &dyn Codec, x: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; c.max_encoded_len(x.len())];
    c.encode(x, &mut Rng::from_u64(0), &mut out).unwrap();
    out
}

fn decode(c: &dyn Codec, bytes: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0.0; n];
    c.decode_into(bytes, &mut out).unwrap();
    out
}

fn f(b: &[u8], k: usize) -> f32 {
    f32::from_le_bytes(b[k..k + 4].try_into().unwrap())
}

#[test]
fn efsign_small_vector() {
    let x = [1.0f32, -2.0, 3.0, -4.0, 0.0, -5.0, 6.0, -7.0, 8.0, -9.0];
    let bytes = encode(&EfSign, &x);
    let p = &bytes[HEADER_LEN..];
    assert_eq!(p.len(), 4 + 2);
    assert_eq!(f(p, 0), 4.5); // 45 / 10
    assert_eq!(&p[4..], &[0b0101_0101, 0b01]);
    let y = decode(&EfSign, &bytes, x.len());
    let want: Vec<f32> = x
        .iter()
        .map(|&v| if v >= 0.0 { 4.5 } else { -4.5 })
        .collect();
    assert_eq!(y, want);
    // Empty chunks carry a zero scale.
    let bytes = encode(&EfSign, &[]);
    assert_eq!(&bytes[HEADER_LEN..], &0.0f32.to_le_bytes());
}

#[test]
fn onebit_small_vector() {
    let c = OneBit::new(4).unwrap();
    let x = [1.0f32, 3.0, -2.0, -4.0, 5.0, -1.0];
    let bytes = encode(&c, &x);
    let p = &bytes[HEADER_LEN..];
    assert_eq!(p.len(), 2 * 8 + 1);
    assert_eq!((f(p, 0), f(p, 4)), (2.0, -3.0));
    assert_eq!((f(p, 8), f(p, 12)), (5.0, -1.0));
    assert_eq!(p[16], 0b01_0011);
    assert_eq!(decode(&c, &bytes, 6), [2.0, 2.0, -3.0, -3.0, 5.0, -1.0]);
    // A bucket without negatives sends 0 for their mean.
    let y = decode(&c, &encode(&c, &[1.0, 2.0, 3.0]), 3);
    assert_eq!(y, [2.0; 3]);
}

#[test]
fn gaussian_errors_paths_and_decode_add() {
    let big = gaussian(1_000_003, 5);
    let codecs: Vec<Box<dyn Codec>> = vec![
        Box::new(EfSign),
        Box::new(OneBit::new(512).unwrap()),
        Box::new(OneBit::new(7).unwrap()),
        Box::new(OneBit::new(3000).unwrap()),
    ];
    for n in [0usize, 1, 5, 127, 128, 129, 4099, 1_000_003] {
        let x = &big[..n];
        for c in &codecs {
            let bytes = encode(c.as_ref(), x);
            assert_eq!(bytes.len(), HEADER_LEN + c.payload_len(n));
            let y = decode(c.as_ref(), &bytes, n);
            let e = rel_err(x, &y);
            assert!(e <= c.error_bound().unwrap(), "{} n={n}: {e}", c.spec());
            if n > 1000 {
                // Gaussian: sqrt(1 − 2/π) ≈ 0.60 for both (onebit's means are ±sqrt(2/π));
                // onebit's small buckets adapt to their own spread and do better.
                let low = if c.spec() == "onebit:bucket=7" {
                    0.4
                } else {
                    0.55
                };
                assert!((low..0.65).contains(&e), "{} n={n}: {e}", c.spec());
            }
            let prev = gaussian(n, 6);
            let mut sum = prev.clone();
            c.decode_add(&bytes, &mut sum).unwrap();
            for i in 0..n {
                assert_eq!(sum[i], prev[i] + y[i]);
            }
        }
        // Portable and AVX2 paths: same bytes, same values.
        let p = |c: &dyn Codec| vec![0u8; c.payload_len(n)];
        let (mut a, mut b) = (p(&EfSign), p(&EfSign));
        EfSign.encode_with(false, x, &mut a);
        EfSign.encode_with(true, x, &mut b);
        assert_eq!(a, b);
        let (mut ya, mut yb) = (vec![1.0f32; n], vec![1.0f32; n]);
        EfSign.decode_with(false, &a, &mut ya, true).unwrap();
        EfSign.decode_with(true, &a, &mut yb, true).unwrap();
        assert_eq!(ya, yb);
        for bucket in [7u32, 512] {
            let c = OneBit::new(bucket).unwrap();
            let (mut a, mut b) = (p(&c), p(&c));
            c.encode_with(false, x, &mut a);
            c.encode_with(true, x, &mut b);
            assert_eq!(a, b);
            let (mut ya, mut yb) = (vec![1.0f32; n], vec![1.0f32; n]);
            c.decode_with(false, &a, &mut ya, true).unwrap();
            c.decode_with(true, &a, &mut yb, true).unwrap();
            assert_eq!(ya, yb);
        }
    }
}

#[test]
fn non_finite_input_and_bad_scales() {
    let y = decode(&EfSign, &encode(&EfSign, &[1.0, f32::INFINITY]), 2);
    assert!(y.iter().all(|v| v.is_nan()));
    let c = OneBit::new(2).unwrap();
    let y = decode(&c, &encode(&c, &[f32::NAN, 1.0, -1.0, 2.0]), 4);
    assert!(y[0].is_nan() && y[1].is_nan());
    assert_eq!(&y[2..], &[-1.0, 2.0]);

    let mut out = [0.0f32; 4];
    let mut bytes = encode(&EfSign, &[1.0, -1.0, 2.0, 3.0]);
    for bad in [-1.0f32, f32::INFINITY] {
        bytes[HEADER_LEN..HEADER_LEN + 4].copy_from_slice(&bad.to_le_bytes());
        assert!(EfSign.decode_into(&bytes, &mut out).is_err());
    }
    let mut bytes = encode(&c, &[1.0, -1.0, 2.0, 3.0]);
    for (k, bad) in [(0, -1.0f32), (4, 1.0), (0, f32::NAN), (8, f32::INFINITY)] {
        let mut b = bytes.clone();
        b[HEADER_LEN + k..HEADER_LEN + k + 4].copy_from_slice(&bad.to_le_bytes());
        assert!(c.decode_into(&b, &mut out).is_err(), "{k} {bad}");
    }
    bytes.truncate(bytes.len() - 1);
    assert!(c.decode_into(&bytes, &mut out).is_err());
    // A onebit chunk is not an efsign chunk, nor one of another bucket size.
    let bytes = encode(&OneBit::new(4).unwrap(), &[1.0, -1.0, 2.0, 3.0]);
    assert!(c.decode_into(&bytes, &mut out).is_err());
    assert!(EfSign.decode_into(&bytes, &mut out).is_err());
}

#[test]
fn garbage_never_panics() {
    let mut r = Rng::from_u64(3);
    let codecs: [Box<dyn Codec>; 3] = [
        Box::new(EfSign),
        Box::new(OneBit::new(1).unwrap()),
        Box::new(OneBit::new(13).unwrap()),
    ];
    for i in 0..3000 {
        let c = codecs[i % 3].as_ref();
        let n = r.below(200) as usize;
        let mut bytes = encode(c, &gaussian(n, i as u64));
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
            assert!(out.iter().all(|v| !v.is_infinite()));
        }
    }
}

#[test]
fn specs() {
    let s = CodecSpec::parse("efsign").unwrap();
    assert!(s.error_feedback());
    assert_eq!(s.to_string(), "efsign");
    assert_eq!(
        CodecSpec::parse("efsign:ef=0").unwrap().to_string(),
        "efsign:ef=0"
    );
    let s = CodecSpec::parse("onebit").unwrap();
    assert!(s.error_feedback());
    assert_eq!(s.to_string(), "onebit:bucket=512");
    let s = CodecSpec::parse("onebit:bucket=64,ef=0").unwrap();
    assert_eq!(s.to_string(), "onebit:bucket=64,ef=0");
    assert_eq!(CodecSpec::parse(&s.to_string()).unwrap(), s);
    for (text, needle) in [
        ("onebit:bucket=0", "bucket must be in"),
        ("onebit:bits=2", "unknown field \"bits\""),
        ("efsign:bucket=4", "unknown field \"bucket\""),
    ] {
        let e = CodecSpec::parse(text).unwrap_err().to_string();
        assert!(e.contains(needle), "{text}: {e}");
    }
}
