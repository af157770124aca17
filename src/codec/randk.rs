//! `randk:density=D`: random-k sparsification. Sends k = `k_of``(D, n)` distinct indices,
//! stratified: the chunk is cut into k strata of ⌊n/k⌋ or ⌈n/k⌉ consecutive elements and one
//! index is drawn uniformly in each, from the counter-based draw keyed by the encode site
//! ([`super::rng`]), so a run repeats exactly, every (step, chunk, rank) draws its own subset,
//! and a GPU draws every stratum independently. Index i is kept with probability 1/len of its
//! stratum: k/n when k divides n, and within a factor ⌈n/k⌉/⌊n/k⌋ of it otherwise. Not every
//! k-subset is possible (two neighbours in one stratum never are sent together), which spreads
//! the kept elements evenly over the chunk.
//!
//! The values are sent unscaled. Random-k is biased that way (its expectation is `k/n · x`), and
//! is meant to run with error feedback (`randk:density=D,ef=1`), which re-sends what was left
//! out; the unbiased variant would multiply by n/k and, without error feedback, inflate the
//! variance by the same factor.

use super::rng::draw;
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
/// ascending: stratum t (0 ≤ t < k) covers `[⌊t·n/k⌋, ⌊(t+1)·n/k⌋)` and keeps
/// `start + draw(key, t) % len`. Each index depends only on (key, t), so a GPU draws them all in
/// parallel; O(k) time, nothing allocated beyond `out_idx`.
pub fn select_randk(n: usize, k: usize, key: u64, out_idx: &mut Vec<u32>) {
    out_idx.clear();
    let k = k.min(n);
    if k == n {
        // Strata of one element each (and no k·n product that could reach 2^64).
        out_idx.extend(0..n as u32);
        return;
    }
    // (t+1)·n ≤ k·n < 2^64 for k < n ≤ 2^32: the products do not overflow.
    let (n, k) = (n as u64, k as u64);
    let mut start = 0;
    out_idx.extend((0..k).map(|t| {
        let end = (t + 1) * n / k;
        let i = start + draw(key, t) % (end - start);
        start = end;
        i as u32
    }));
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
        select_randk(x.len(), k, rng.key(), out);
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
        for n in [0usize, 1, 2, 5, 7, 63, 64, 65, 100, 1000, 100_003] {
            for k in [0, 1, 2, 7, n / 3, n.saturating_sub(1), n, n + 2] {
                select_randk(n, k, r.next_u64(), &mut idx);
                assert_eq!(idx.len(), k.min(n), "n={n} k={k}");
                assert!(idx.windows(2).all(|w| w[0] < w[1]));
                assert!(idx.iter().all(|&i| (i as usize) < n));
            }
        }
    }

    #[test]
    fn matches_hand_computed_strata() {
        // From the spec, computed outside this code (Python: [t*n//k + draw(key, t) %
        // ((t+1)*n//k - t*n//k) for t in range(k)], draw = splitmix64 output t).
        let mut idx = vec![];
        select_randk(100, 7, 0, &mut idx);
        assert_eq!(idx, [9, 22, 37, 46, 66, 73, 93]);
        select_randk(1_000_003, 5, 0x0123_4567_89ab_cdef, &mut idx);
        assert_eq!(idx, [191_965, 225_736, 435_967, 631_437, 983_139]);
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
        select_randk(10_000, 10, site.key(), &mut a);
        select_randk(10_000, 10, site.key(), &mut b);
        select_randk(10_000, 10, Site { rank: 5, ..site }.key(), &mut c);
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn every_index_is_uniform_in_its_stratum() {
        // Chi-square of the index frequencies over many keys against 1/len of the index's
        // stratum (k/n when k divides n); strata of one element always hold their index and
        // carry no information, so they are checked exactly and left out of the statistic.
        // Under 49 degrees of freedom the statistic is about 49 ± 10, so 100 is a loose bound
        // that still catches a biased sampler.
        let mut idx = vec![];
        for (n, k) in [(50usize, 5usize), (50, 25), (50, 7), (50, 49), (50, 1)] {
            let trials = 4000u32;
            let mut freq = vec![0u32; n];
            for s in 0..trials {
                select_randk(n, k, Rng::from_u64(s as u64).next_u64(), &mut idx);
                for &i in &idx {
                    freq[i as usize] += 1;
                }
            }
            // Stratum bounds from the definition.
            let mut chi2 = 0.0;
            for t in 0..k {
                let (a, b) = ((t * n) / k, ((t + 1) * n) / k);
                let p = 1.0 / (b - a) as f64;
                for &f in &freq[a..b] {
                    if b - a == 1 {
                        assert_eq!(f, trials, "n={n} k={k}");
                        continue;
                    }
                    let expect = trials as f64 * p;
                    chi2 += (f as f64 - expect).powi(2) / (expect * (1.0 - p));
                }
            }
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
