//! `topk:density=D`: exact top-k sparsification. Sends the k = `k_of``(D, n)` elements of
//! largest magnitude; ties at the k-th magnitude go to the lower indices, so the selection is a
//! function of the input alone (every rank, every run picks the same elements).
//!
//! NaN counts as a larger magnitude than any number, infinity included (see [`key`]): a NaN in a
//! gradient is sent rather than silently parked in an error-feedback residual.

use super::sparse::{self, key, scan_at_least, Selector};
use super::{CodecId, Rng};
use crate::error::Result;

/// `topk`: the k largest magnitudes, exactly.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TopK {
    density: f64,
}

impl TopK {
    /// A top-k codec keeping `density` of each chunk; the density must be in (0, 1].
    pub fn new(density: f64) -> Result<TopK> {
        sparse::check_density("topk", density)?;
        Ok(TopK { density })
    }
}

/// Puts into `out_idx` (cleared first) the ascending indices of the `min(k, x.len())` elements of
/// largest magnitude, ties broken towards lower indices.
///
/// O(n) on average: a quickselect on a scratch copy of the magnitude keys finds the k-th largest
/// key `t`, then one pass collects every element above `t` and the first elements equal to `t`
/// in index order until there are k. Allocates 4·n bytes of scratch.
pub fn select_topk(x: &[f32], k: usize, out_idx: &mut Vec<u32>) {
    out_idx.clear();
    let n = x.len();
    let k = k.min(n);
    if k == 0 {
        return;
    }
    if k == n {
        out_idx.extend(0..n as u32);
        return;
    }
    let mut keys: Vec<u32> = x.iter().map(|&v| key(v)).collect();
    let (_, &mut t, above) = keys.select_nth_unstable(n - k);
    // The k − 1 keys above position n − k are ≥ t; those equal to t compete with the other ties
    // for the remaining places.
    let greater = above.iter().filter(|&&m| m > t).count();
    let mut ties = k - greater;
    drop(keys);
    out_idx.reserve(k);
    scan_at_least(x, t, |i, m| {
        if m > t {
            out_idx.push(i as u32);
        } else if ties > 0 {
            ties -= 1;
            out_idx.push(i as u32);
        }
    });
    debug_assert_eq!(out_idx.len(), k);
}

impl Selector for TopK {
    fn id(&self) -> CodecId {
        CodecId::TopK
    }
    fn density(&self) -> f64 {
        self.density
    }
    fn spec(&self) -> String {
        format!("topk:density={}", self.density)
    }
    fn select(&self, x: &[f32], k: usize, _: &mut Rng, out: &mut Vec<u32>) {
        select_topk(x, k, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::sparse::k_of;
    use crate::codec::sparse::tests::check_codec;
    use crate::codec::Codec;
    use crate::codec::CodecSpec;

    /// The reference: sort all indices by (magnitude key descending, index ascending).
    fn brute(x: &[f32], k: usize) -> Vec<u32> {
        let mut order: Vec<u32> = (0..x.len() as u32).collect();
        order.sort_by_key(|&i| (std::cmp::Reverse(key(x[i as usize])), i));
        order.truncate(k);
        order.sort_unstable();
        order
    }

    #[test]
    fn matches_brute_force_sort() {
        let mut r = Rng::from_u64(11);
        let mut idx = vec![];
        for n in [0usize, 1, 2, 5, 100, 1000, 100_003] {
            for kind in 0..4 {
                let x: Vec<f32> = (0..n)
                    .map(|_| match kind {
                        0 => r.next_f32() * 2.0 - 1.0,
                        // Few distinct magnitudes of both signs: many ties.
                        1 => (r.below(5) as f32 - 2.0) * 0.5,
                        2 => 0.0,
                        _ => [-0.0, 0.0, 1.0, -1.0, f32::INFINITY][r.below(5) as usize],
                    })
                    .collect();
                for k in [0, 1, 2, n / 3, n.saturating_sub(1), n, n + 3] {
                    select_topk(&x, k, &mut idx);
                    assert_eq!(idx, brute(&x, k.min(n)), "n={n} kind={kind} k={k}");
                }
            }
        }
    }

    #[test]
    fn large_chunk_matches_brute_force() {
        let mut r = Rng::from_u64(12);
        let n = 1_000_003;
        // Quantized values: ties right at the threshold.
        let x: Vec<f32> = (0..n)
            .map(|_| (r.next_f32() * 2000.0 - 1000.0).round())
            .collect();
        let mut idx = vec![];
        for k in [1, 1000, k_of(0.01, n)] {
            select_topk(&x, k, &mut idx);
            assert_eq!(idx, brute(&x, k), "k={k}");
        }
    }

    #[test]
    fn nan_counts_as_largest_and_does_not_panic() {
        let x = [1.0, f32::NAN, -5.0, f32::NEG_INFINITY, 0.5, -f32::NAN];
        let mut idx = vec![];
        select_topk(&x, 2, &mut idx);
        assert_eq!(idx, [1, 5]);
        select_topk(&x, 3, &mut idx);
        assert_eq!(idx, [1, 3, 5]);
    }

    #[test]
    fn codec_round_trips_and_rejects_corruption() {
        for d in [0.001, 0.1, 0.5, 1.0] {
            let c = TopK::new(d).unwrap();
            for n in [0, 1, 2, 5, 100, 1001] {
                check_codec(&c, n, n as u64);
            }
        }
        // The decoded chunk holds exactly the top-k.
        let c = TopK::new(0.1).unwrap();
        let mut r = Rng::from_u64(5);
        let x: Vec<f32> = (0..1000).map(|_| r.next_f32() - 0.5).collect();
        let mut enc = vec![0; c.max_encoded_len(1000)];
        c.encode(&x, &mut r, &mut enc).unwrap();
        let mut out = vec![0.0; 1000];
        c.decode_into(&enc, &mut out).unwrap();
        let want = brute(&x, 100);
        for i in 0..1000u32 {
            let v = if want.binary_search(&i).is_ok() {
                x[i as usize]
            } else {
                0.0
            };
            assert_eq!(out[i as usize], v);
        }
    }

    #[test]
    fn specs_parse_and_round_trip() {
        let s = CodecSpec::parse("topk:density=0.01").unwrap();
        assert_eq!(s.to_string(), "topk:density=0.01");
        assert!(s.codec().is_sparse());
        assert_eq!(s.codec().id(), CodecId::TopK);
        assert!(!s.error_feedback());
        for text in [
            "topk:density=0.01,ef=1",
            "topk:density=1",
            "topk:density=0.0000001",
        ] {
            let s = CodecSpec::parse(text).unwrap();
            assert_eq!(s.to_string(), text);
            assert_eq!(CodecSpec::parse(&s.to_string()).unwrap(), s);
        }
        assert_ne!(
            TopK::new(0.01).unwrap().params(),
            TopK::new(0.02).unwrap().params()
        );
        for (text, needle) in [
            ("topk", "density is required"),
            ("topk:density=0", "density must be in (0, 1]"),
            ("topk:density=1.5", "density must be in (0, 1]"),
            ("topk:density=-0.1", "density must be in (0, 1]"),
            ("topk:density=nan", "density must be in (0, 1]"),
            ("topk:density=abc", "density must be a number"),
            (
                "topk:density=0.1,samplings=3",
                "unknown field \"samplings\"",
            ),
        ] {
            let e = CodecSpec::parse(text).unwrap_err().to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
        assert!(TopK::new(0.0).is_err());
    }
}
