//! Decoding is total: for every codec, truncated, oversized, corrupted or random bytes give an
//! error or a finite-size decode, never a panic or an out-of-bounds access (proptest over
//! random bytes and over mutations of valid encodings). And the codecs' other entry points agree
//! with encode and decode bit for bit, on any f32 bits (`encode_own`, `decode_sub`).

use proptest::prelude::*;
use qccl::codec::{Rng, Site};
use qccl::CodecSpec;

const SPECS: &[&str] = &[
    "none",
    "fp16",
    "bf16",
    "qsgd:bits=4,bucket=128",
    "qsgd:bits=1,bucket=7,scale=maxabs,rounding=nearest",
    "qsgd:bits=8,bucket=1000",
    "qsgd:bits=3,bucket=5",
    "topk:density=0.1",
    "mstopk:density=0.05",
    "randk:density=0.2",
    "efsign",
    "onebit",
];

fn codecs() -> Vec<CodecSpec> {
    SPECS.iter().map(|s| CodecSpec::parse(s).unwrap()).collect()
}

fn valid(spec: &CodecSpec, n: usize, seed: u64) -> Vec<u8> {
    let c = spec.codec();
    let x: Vec<f32> = (0..n)
        .map(|i| (i as f32 * 0.37 + seed as f32).sin() * 3.0)
        .collect();
    let mut out = vec![0u8; c.max_encoded_len(n)];
    let mut rng = Rng::new(Site {
        seed,
        ..Site::default()
    });
    let len = c.encode(&x, &mut rng, &mut out).unwrap();
    assert_eq!(
        len,
        out.len(),
        "{spec}: encode wrote {len} of {} bytes",
        out.len()
    );
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600), n in 0usize..300) {
        for spec in codecs() {
            let mut out = vec![0f32; n];
            let _ = spec.codec().decode_into(&bytes, &mut out);
            let _ = spec.codec().decode_add(&bytes, &mut out);
        }
    }

    /// `encode_own` writes the bytes `encode` writes and leaves exactly what decoding them
    /// gives, on any bits (NaN payloads, infinities, subnormals, both zeros): the rank that
    /// keeps its own sum must hold the receivers' bits.
    #[test]
    fn encode_own_is_encode_then_decode(
        bits in proptest::collection::vec(any::<u32>(), 0..700),
        seed in any::<u64>(),
        tame in any::<bool>(),
    ) {
        // Half the cases from arbitrary bits, half from ordinary values with a few specials.
        let x: Vec<f32> = bits
            .iter()
            .map(|&b| {
                if tame && b % 61 != 0 {
                    (b as f32 / u32::MAX as f32 - 0.5) * 8.0
                } else {
                    f32::from_bits(b)
                }
            })
            .collect();
        let site = Site { seed, ..Site::default() };
        for spec in codecs() {
            let c = spec.codec();
            let n = x.len();
            let mut sent = vec![0u8; c.max_encoded_len(n)];
            c.encode(&x, &mut Rng::new(site), &mut sent).unwrap();
            let mut kept = vec![0f32; n];
            c.decode_into(&sent, &mut kept).unwrap();
            let mut own = x.clone();
            let mut bytes = vec![0u8; c.max_encoded_len(n)];
            let len = c.encode_own(&mut own, &mut Rng::new(site), &mut bytes).unwrap();
            prop_assert_eq!(len, bytes.len());
            prop_assert!(bytes == sent, "{}: other bytes", spec);
            let bad = (0..n).find(|&i| own[i].to_bits() != kept[i].to_bits());
            prop_assert!(bad.is_none(), "{}: element {:?} kept {:?}, decoded {:?}", spec, bad,
                bad.map(|i| own[i]), bad.map(|i| kept[i]));
        }
    }

    #[test]
    fn mutated_encodings_never_panic(
        n in 0usize..400,
        seed in any::<u64>(),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        cut in any::<usize>(),
        extra in 0usize..16,
    ) {
        for spec in codecs() {
            let good = valid(&spec, n, seed);
            let c = spec.codec();
            let mut out = vec![0f32; n];
            prop_assert!(c.decode_into(&good, &mut out).is_ok(), "{} rejects its own encoding", spec);
            // Corrupted bytes: any result but a panic.
            let mut bad = good.clone();
            for &(at, v) in &flips {
                let i = at % bad.len();
                bad[i] ^= v | 1;
            }
            let _ = c.decode_add(&bad, &mut out);
            // Truncated and oversized: always an error.
            let short = &good[..cut % good.len()];
            prop_assert!(c.decode_into(short, &mut out).is_err(), "{} accepted a truncated chunk", spec);
            let mut long = good.clone();
            long.extend(std::iter::repeat_n(0u8, extra + 1));
            prop_assert!(c.decode_into(&long, &mut out).is_err(), "{} accepted an oversized chunk", spec);
            // The wrong element count: an error.
            let mut other = vec![0f32; n + 1];
            prop_assert!(c.decode_into(&good, &mut other).is_err());
        }
    }
}

/// Gradients can hold inf or NaN (an overflowed step): encoding them must not panic, and the
/// chunk must still decode.
#[test]
fn non_finite_inputs_encode_and_decode() {
    let specials = [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        -f32::MAX,
        0.0,
        -0.0,
        1e-45,
    ];
    for spec in codecs() {
        let c = spec.codec();
        for n in [1usize, 2, 7, 130, 1000] {
            for (k, &sp) in specials.iter().enumerate() {
                let x: Vec<f32> = (0..n)
                    .map(|i| {
                        if i % (k + 2) == 0 {
                            sp
                        } else {
                            i as f32 * 0.01
                        }
                    })
                    .collect();
                let mut out = vec![0u8; c.max_encoded_len(n)];
                let mut rng = Rng::new(Site::default());
                c.encode(&x, &mut rng, &mut out).unwrap();
                let mut y = vec![0f32; n];
                c.decode_into(&out, &mut y).unwrap();
                c.decode_add(&out, &mut y).unwrap();
            }
        }
    }
}

/// `decode_sub` (the error-feedback update; O(k) for sparse codecs) equals subtracting the
/// decoded chunk, bit for bit, and rejects what decode rejects.
#[test]
fn decode_sub_matches_decode() {
    for spec in codecs() {
        let c = spec.codec();
        for n in [0usize, 1, 9, 1000] {
            let enc = valid(&spec, n, 3);
            let base: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
            let mut dec = vec![0f32; n];
            c.decode_into(&enc, &mut dec).unwrap();
            let want: Vec<f32> = base.iter().zip(&dec).map(|(b, d)| b - d).collect();
            let mut got = base.clone();
            c.decode_sub(&enc, &mut got, &mut Vec::new()).unwrap();
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{spec} n={n}"
            );
            if n > 0 {
                assert!(c
                    .decode_sub(&enc[..enc.len() - 1], &mut got, &mut Vec::new())
                    .is_err());
            }
        }
    }
}
