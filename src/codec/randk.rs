//! `randk:density=D`: random-k sparsification. Sends k = `k_of``(D, n)` distinct indices
//! drawn uniformly (every k-subset equally likely) from the encode site's [`Rng`], so a run
//! repeats exactly and every (step, chunk, rank) draws its own subset.
//!
//! The values are sent unscaled. Random-k is biased that way (its expectation is `k/n · x`), and
//! is meant to run with error feedback (`randk:density=D,ef=1`), which re-sends what was left
//! out; the unbiased variant would multiply by n/k and, without error feedback, inflate the
//! variance by the same factor.

use super::sparse::{self, Selector};
use super::{CodecId, Rng};
use crate::error::Result;

/// `randk`: k uniformly random elements.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RandK {
    density: f64,
}

impl RandK {
    /// A random-k codec keeping `density` (in (0, 1]) of each chunk.
    pub fn new(density: f64) -> Result<RandK> {
        sparse::check_density("randk", density)?;
        Ok(RandK { density })
    }
}

/// Puts into `out_idx` (cleared first) `min(k, n)` distinct indices below `n` (n ≤ 2^32),
/// uniformly random and ascending.
///
/// Floyd's algorithm (k draws, each a uniform subset extended by one) marking a bitmap of n
/// bits; reading the bitmap back gives the indices already sorted. O(k + n/64) time, n/8 bytes.
pub fn select_randk(n: usize, k: usize, rng: &mut Rng, out_idx: &mut Vec<u32>) {
    out_idx.clear();
    let k = k.min(n);
    if k == n {
        out_idx.extend(0..n as u32);
        return;
    }
    let mut bits = vec![0u64; n.div_ceil(64)];
    let mut mark = |i: usize| -> bool {
        let (w, b) = (i / 64, 1u64 << (i % 64));
        let fresh = bits[w] & b == 0;
        bits[w] |= b;
        fresh
    };
    for j in n - k..n {
        // A uniform k-subset of 0..=j from one of 0..j: add t, or j if t is already in.
        let t = rng.below(j as u64 + 1) as usize;
        if !mark(t) {
            mark(j);
        }
    }
    out_idx.reserve(k);
    for (w, &word) in bits.iter().enumerate() {
        let mut word = word;
        while word != 0 {
            out_idx.push((w * 64) as u32 + word.trailing_zeros());
            word &= word - 1;
        }
    }
    debug_assert_eq!(out_idx.len(), k);
}

impl Selector for RandK {
    fn id(&self) -> CodecId {
        CodecId::RandK
    }
    fn density(&self) -> f64 {
        self.density
    }
    fn spec(&self) -> String {
        format!("randk:density={}", self.density)
    }
    fn select(&self, x: &[f32], k: usize, rng: &mut Rng, out: &mut Vec<u32>) {
        select_randk(x.len(), k, rng, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::sparse::tests::check_codec;
    use crate::codec::{CodecSpec, Site};

    #[test]
    fn exactly_k_distinct_ascending_indices() {
        let mut idx = vec![];
        let mut r = Rng::from_u64(1);
        for n in [0usize, 1, 2, 5, 63, 64, 65, 100, 1000, 100_003] {
            for k in [0, 1, 2, n / 3, n.saturating_sub(1), n, n + 2] {
                select_randk(n, k, &mut r, &mut idx);
                assert_eq!(idx.len(), k.min(n), "n={n} k={k}");
                assert!(idx.windows(2).all(|w| w[0] < w[1]));
                assert!(idx.iter().all(|&i| (i as usize) < n));
            }
        }
    }

    #[test]
    fn reproducible_per_site() {
        let site = Site {
            seed: 1,
            step: 2,
            chunk: 3,
            rank: 4,
        };
        let (mut a, mut b, mut c) = (vec![], vec![], vec![]);
        select_randk(10_000, 10, &mut Rng::new(site), &mut a);
        select_randk(10_000, 10, &mut Rng::new(site), &mut b);
        select_randk(10_000, 10, &mut Rng::new(Site { rank: 5, ..site }), &mut c);
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn every_index_is_equally_likely() {
        // Chi-square of the index frequencies over many seeds against k/n per draw; with
        // n − 1 = 49 degrees of freedom the statistic is about 49 ± 10, so 100 is a loose bound
        // that still catches a biased sampler.
        let mut idx = vec![];
        for (n, k) in [(50usize, 5usize), (50, 25), (50, 49)] {
            let trials = 4000;
            let mut freq = vec![0u32; n];
            for s in 0..trials {
                select_randk(n, k, &mut Rng::from_u64(s), &mut idx);
                for &i in &idx {
                    freq[i as usize] += 1;
                }
            }
            let expect = trials as f64 * k as f64 / n as f64;
            // Each count is binomial with variance trials·p·(1 − p).
            let var = expect * (1.0 - k as f64 / n as f64);
            let chi2: f64 = freq
                .iter()
                .map(|&f| (f as f64 - expect).powi(2) / var)
                .sum();
            assert!(chi2 < 100.0, "n={n} k={k} chi2={chi2} {freq:?}");
        }
    }

    #[test]
    fn codec_round_trips_and_rejects_corruption() {
        for d in [0.001, 0.1, 0.5, 1.0] {
            let c = RandK::new(d).unwrap();
            for n in [0, 1, 2, 5, 100, 1001] {
                check_codec(&c, n, n as u64 + 3);
            }
        }
    }

    #[test]
    fn specs_parse_and_round_trip() {
        let s = CodecSpec::parse("randk:density=0.25,ef=1").unwrap();
        assert_eq!(s.to_string(), "randk:density=0.25,ef=1");
        assert_eq!(s.codec().id(), CodecId::RandK);
        assert!(s.codec().is_sparse() && s.error_feedback());
        assert_eq!(CodecSpec::parse(&s.to_string()).unwrap(), s);
        for (text, needle) in [
            ("randk", "density is required"),
            ("randk:density=0", "density must be in (0, 1]"),
            ("randk:density=1.5", "density must be in (0, 1]"),
            ("randk:density=abc", "density must be a number"),
        ] {
            let e = CodecSpec::parse(text).unwrap_err().to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
    }
}
