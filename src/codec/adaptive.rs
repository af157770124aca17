//! Adaptive layer-wise bit-widths (CGX, Section 5 and Algorithm 1): cluster the layers by
//! (size, gradient norm), give the clusters bit-widths and bucket sizes in order of their
//! gradient norm, then make sure the total quantization error stays within `α·E4`, the error
//! of compressing every layer uniformly at the baseline width (4 bits, bucket 128), for which
//! the paper knows that training recovers full accuracy.
//!
//! The module is pure and deterministic: the caller collects per-layer statistics
//! ([`LayerStats`], with [`top_norm`] for the norm) and gets back one [`Assignment`] per layer,
//! which [`qsgd_spec`] turns into a codec spec string.
//!
//! # Error model
//!
//! Max-min quantization of a bucket `v_B` of `N` entries to `b` bits splits `[min, max]` into
//! `s = 2^b − 1` intervals of width `Δ = (max − min)/s` and rounds each entry stochastically to
//! an end of its interval. The rounding is unbiased with variance `Δ²·p(1−p) ≤ Δ²/4` per entry,
//! and `max − min ≤ 2‖v_B‖∞`, so the bucket contributes at most `N·‖v_B‖∞²/s²` to the expected
//! squared error. Summed over the `d/N` buckets of a layer, `Σ_B ‖v_B‖∞²` is a sum over
//! `⌈d/N⌉` distinct entries, hence at most `‖top_{⌈d/N⌉}(v)‖²`, the squared ℓ2 norm of the
//! layer's largest entries. With `G` the norm of the top values (the paper's second clustering
//! coordinate) standing in for that quantity, a layer's error is modelled as
//!
//! ```text
//! err(G, b, N) = N · G² / (2^b − 1)²
//! ```
//!
//! This is the bucketed form of QSGD's `d/s²` variance bound (Alistarh et al., 2017). It is an
//! upper bound, conservative for large buckets (for Gaussian-like data the real growth in `N`
//! is closer to `ln N`), which is the safe side for a budget. The layer size does not appear
//! explicitly: it is already inside `G` (more entries, larger top norm), and it enters the
//! cost side instead, through [`layer_bytes`]. What matters for the budget is that the same
//! model gives both the assignment's error and `E4` (`err` at the reference width and bucket
//! for every layer), so the constant factors cancel in the comparison.

use crate::error::{Error, Result};
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

/// Bytes of per-bucket metadata assumed by the cost model: two f32 (the bucket's minimum and
/// its scale), as max-min quantization needs to decode a bucket.
pub const META_BYTES_PER_BUCKET: usize = 8;

/// Statistics of one layer (one gradient tensor), collected by the caller.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerStats {
    /// The layer's name (used in error messages only).
    pub name: String,
    /// Number of gradient elements.
    pub size: usize,
    /// ℓ2 norm of the top values of the accumulated gradient (see [`top_norm`]); finite and
    /// non-negative.
    pub grad_norm: f64,
}

/// How the k-means centroids are ordered before bit-widths are mapped onto them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClusterOrder {
    /// By the centroid's gradient norm, as Section 5's text says: the highest-norm cluster is
    /// the most sensitive and gets the most bits.
    #[default]
    Norm,
    /// By `norm(C) − size(C)`, as line 2 of Algorithm 1 writes it; computed on the normalised
    /// features, so it is (up to scale) `log(norm) − log(size)`: large layers with small
    /// gradients sort first and compress most.
    NormMinusSize,
}

/// Parameters of the assignment.
#[derive(Debug, Clone, PartialEq)]
pub struct AdaptiveConfig {
    /// Number of k-means clusters, i.e. of distinct bit-widths before the budget step (the
    /// paper's `k = |B|`; it gives no value). Default 3: with bits 2..=6 the clusters get 2,
    /// 4 and 6 bits, so a "typical" cluster keeps the 4-bit baseline.
    pub clusters: usize,
    /// Bit-width of the least sensitive cluster (1..=8). Default 2 (our choice).
    pub min_bits: u8,
    /// Bit-width of the most sensitive cluster (1..=8, at least `min_bits`). Default 6 (our
    /// choice: more than 6 bits buys error the 4-bit baseline already does not need).
    pub max_bits: u8,
    /// Bucket sizes at `min_bits` and at `max_bits`; widths in between get a linear
    /// interpolation (the paper maps bucket sizes linearly like bits but gives no values).
    /// Default (192, 64): larger buckets (less metadata, more error) where bits are few, and the
    /// line passes through the paper's baseline, bucket 128 at 4 bits.
    pub buckets: (usize, usize),
    /// Error budget factor: the total model error must be at most `alpha · E4`. The paper
    /// "usually picked it between 1.5 and 3.0"; default 2.0.
    pub alpha: f64,
    /// Bit-width of the reference uniform compression defining `E4`. Paper: 4.
    pub reference_bits: u8,
    /// Bucket size of the reference uniform compression. Paper: 128 (its baseline, "4 bits and
    /// 128 bucket size always recovers full accuracy").
    pub reference_bucket: usize,
    /// Centroid ordering. Default [`ClusterOrder::Norm`].
    pub order: ClusterOrder,
    /// Maximum Lloyd iterations of k-means (it stops earlier once no point moves). Default 100.
    pub kmeans_iters: usize,
}

impl Default for AdaptiveConfig {
    fn default() -> Self {
        AdaptiveConfig {
            clusters: 3,
            min_bits: 2,
            max_bits: 6,
            buckets: (192, 64),
            alpha: 2.0,
            reference_bits: 4,
            reference_bucket: 128,
            order: ClusterOrder::Norm,
            kmeans_iters: 100,
        }
    }
}

impl AdaptiveConfig {
    /// Checks every field; the error names the bad one.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, msg: String| {
            Err(Error::invalid(format!("adaptive config: {field} {msg}")))
        };
        if self.clusters == 0 {
            return bad("clusters", "must be at least 1, got 0".into());
        }
        for (field, b) in [
            ("min_bits", self.min_bits),
            ("max_bits", self.max_bits),
            ("reference_bits", self.reference_bits),
        ] {
            if !(1..=8).contains(&b) {
                return bad(field, format!("must be in 1..=8, got {b}"));
            }
        }
        if self.min_bits > self.max_bits {
            return bad(
                "min_bits",
                format!(
                    "({}) must not exceed max_bits ({})",
                    self.min_bits, self.max_bits
                ),
            );
        }
        if self.buckets.0 == 0 || self.buckets.1 == 0 {
            return bad(
                "buckets",
                format!("must both be at least 1, got {:?}", self.buckets),
            );
        }
        if self.reference_bucket == 0 {
            return bad("reference_bucket", "must be at least 1, got 0".into());
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return bad(
                "alpha",
                format!("must be a finite number > 0, got {}", self.alpha),
            );
        }
        if self.kmeans_iters == 0 {
            return bad("kmeans_iters", "must be at least 1, got 0".into());
        }
        Ok(())
    }

    /// The bucket size that goes with `bits`: linear between `buckets.0` at `min_bits` and
    /// `buckets.1` at `max_bits`, rounded to the nearest integer (at least 1).
    pub fn bucket_for_bits(&self, bits: u8) -> usize {
        let (lo, hi) = (self.buckets.0 as f64, self.buckets.1 as f64);
        let t = if self.max_bits > self.min_bits {
            (bits as f64 - self.min_bits as f64) / (self.max_bits as f64 - self.min_bits as f64)
        } else {
            0.0
        };
        ((lo + (hi - lo) * t).round() as usize).max(1)
    }
}

/// The compression chosen for one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Assignment {
    /// Quantization bit-width (1..=8).
    pub bits: u8,
    /// Bucket size in elements.
    pub bucket: usize,
}

/// The qsgd codec spec of an assignment: `qsgd:bits=B,bucket=N`.
pub fn qsgd_spec(a: &Assignment) -> String {
    format!("qsgd:bits={},bucket={}", a.bits, a.bucket)
}

/// ℓ2 norm (in f64) of the `fraction` of entries of `grad` that are largest in magnitude: the
/// top `max(1, ⌈fraction·n⌉)` entries, at most all `n`. A fraction that is not positive (or
/// NaN) still takes the single largest entry; an empty gradient has norm 0. NaN entries make
/// the result NaN, which [`assign_bits`] rejects.
pub fn top_norm(grad: &[f32], fraction: f64) -> f64 {
    let n = grad.len();
    if n == 0 {
        return 0.0;
    }
    let want = (fraction * n as f64).ceil();
    // `as` saturates (NaN → 0), then the clamp keeps at least one and at most all entries.
    let k = (want as usize).clamp(1, n);
    let mut mags: Vec<f32> = grad.iter().map(|x| x.abs()).collect();
    if k < n {
        // Partition so that the k largest magnitudes come first (total_cmp puts NaN above
        // every number, so a NaN is always selected and poisons the result).
        mags.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    }
    mags[..k]
        .iter()
        .map(|&x| (x as f64) * (x as f64))
        .sum::<f64>()
        .sqrt()
}

/// Modelled quantization error (expected squared ℓ2 error) of one layer with top-value norm
/// `grad_norm` at `bits` bits and bucket `bucket`: `bucket · grad_norm² / (2^bits − 1)²` (see
/// the module documentation for the derivation).
pub fn model_error(grad_norm: f64, bits: u8, bucket: usize) -> f64 {
    let s = ((1u32 << bits) - 1) as f64;
    bucket as f64 * grad_norm * grad_norm / (s * s)
}

/// Bytes of one layer of `size` elements at `bits` bits and bucket `bucket`: the packed codes
/// plus [`META_BYTES_PER_BUCKET`] per bucket. The quantity the assignment keeps small.
pub fn layer_bytes(size: usize, bits: u8, bucket: usize) -> f64 {
    let codes = (size as f64 * bits as f64 / 8.0).ceil();
    let buckets = size.div_ceil(bucket.max(1)) as f64;
    codes + buckets * META_BYTES_PER_BUCKET as f64
}

/// Total modelled error of `layers` under `assignments` (summed in input order).
pub fn total_error(layers: &[LayerStats], assignments: &[Assignment]) -> f64 {
    layers
        .iter()
        .zip(assignments)
        .map(|(l, a)| model_error(l.grad_norm, a.bits, a.bucket))
        .sum()
}

/// `E4`: the total modelled error of compressing every layer at `cfg.reference_bits` and
/// `cfg.reference_bucket`.
pub fn reference_error(layers: &[LayerStats], cfg: &AdaptiveConfig) -> f64 {
    total_error(layers, &vec![reference(cfg); layers.len()])
}

fn reference(cfg: &AdaptiveConfig) -> Assignment {
    Assignment {
        bits: cfg.reference_bits,
        bucket: cfg.reference_bucket,
    }
}

/// Result of [`kmeans`].
#[derive(Debug, Clone, PartialEq)]
pub struct Clustering {
    /// The cluster of each point, an index into `centroids`.
    pub labels: Vec<usize>,
    /// The centroids of the non-empty clusters (at most `k`, fewer when there are fewer
    /// distinct points).
    pub centroids: Vec<[f64; 2]>,
}

fn dist2(a: [f64; 2], b: [f64; 2]) -> f64 {
    let (dx, dy) = (a[0] - b[0], a[1] - b[1]);
    dx * dx + dy * dy
}

/// Index of the centroid nearest to `p` (the lowest index on ties, for determinism).
fn nearest(p: [f64; 2], centroids: &[[f64; 2]]) -> usize {
    let mut best = 0;
    let mut best_d = f64::INFINITY;
    for (j, &c) in centroids.iter().enumerate() {
        let d = dist2(p, c);
        if d < best_d {
            best = j;
            best_d = d;
        }
    }
    best
}

/// Deterministic k-means over 2-D points (finite coordinates): farthest-first initialisation,
/// then Lloyd iterations until no point changes cluster or `max_iters` is reached.
///
/// Farthest-first starts from the point with the largest second coordinate (for layers, the
/// highest gradient norm) and repeatedly adds the point farthest from its nearest centre; it
/// needs no random numbers, spreads the centres over well-separated groups, and stops early
/// when every point coincides with a centre, so `k` larger than the number of distinct points
/// yields one cluster per distinct point. Ties always go to the lowest index.
pub fn kmeans(points: &[[f64; 2]], k: usize, max_iters: usize) -> Clustering {
    if points.is_empty() || k == 0 {
        return Clustering {
            labels: vec![0; points.len()],
            centroids: Vec::new(),
        };
    }
    let first = (0..points.len())
        .max_by(|&a, &b| {
            points[a][1]
                .total_cmp(&points[b][1])
                .then(points[a][0].total_cmp(&points[b][0]))
                .then(b.cmp(&a)) // max_by keeps the last maximum: prefer the lower index
        })
        .expect("points is not empty");
    let mut centroids = vec![points[first]];
    let mut near: Vec<f64> = points.iter().map(|&p| dist2(p, points[first])).collect();
    while centroids.len() < k {
        let (far, d) =
            near.iter().enumerate().fold(
                (0, 0.0f64),
                |(bi, bd), (i, &d)| {
                    if d > bd {
                        (i, d)
                    } else {
                        (bi, bd)
                    }
                },
            );
        if d <= 0.0 {
            break; // every point is a centre already
        }
        centroids.push(points[far]);
        for (n, &p) in near.iter_mut().zip(points) {
            *n = n.min(dist2(p, points[far]));
        }
    }

    let mut labels: Vec<usize> = points.iter().map(|&p| nearest(p, &centroids)).collect();
    for _ in 0..max_iters {
        let mut sums = vec![[0.0f64; 2]; centroids.len()];
        let mut counts = vec![0usize; centroids.len()];
        for (&p, &l) in points.iter().zip(&labels) {
            sums[l][0] += p[0];
            sums[l][1] += p[1];
            counts[l] += 1;
        }
        for ((c, s), &n) in centroids.iter_mut().zip(&sums).zip(&counts) {
            // An emptied cluster keeps its old centre; it is dropped at the end if it stays
            // empty.
            if n > 0 {
                *c = [s[0] / n as f64, s[1] / n as f64];
            }
        }
        let next: Vec<usize> = points.iter().map(|&p| nearest(p, &centroids)).collect();
        if next == labels {
            break;
        }
        labels = next;
    }

    // Drop empty clusters and renumber the rest in their original order.
    let mut remap = vec![usize::MAX; centroids.len()];
    let mut kept = Vec::new();
    for &l in &labels {
        if remap[l] == usize::MAX {
            remap[l] = 0; // mark used; numbered below
        }
    }
    for (j, c) in centroids.iter().enumerate() {
        if remap[j] != usize::MAX {
            remap[j] = kept.len();
            kept.push(*c);
        }
    }
    Clustering {
        labels: labels.iter().map(|&l| remap[l]).collect(),
        centroids: kept,
    }
}

fn validate_layers(layers: &[LayerStats]) -> Result<()> {
    for (i, l) in layers.iter().enumerate() {
        if !(l.grad_norm.is_finite() && l.grad_norm >= 0.0) {
            return Err(Error::invalid(format!(
                "adaptive: layers[{i}] (\"{}\"): grad_norm must be finite and non-negative, got {}",
                l.name, l.grad_norm
            )));
        }
    }
    Ok(())
}

/// The clustering features of the layers: `(ln size, ln norm)`, each standardised to zero mean
/// and unit variance.
///
/// Logs because sizes (a bias of 10 elements, an embedding of 10^8) and norms span orders of
/// magnitude: on raw values k-means would split on size alone and lump every small layer
/// together. Standardising puts both axes on the same footing, since their units are
/// unrelated. Zero sizes count as 1; zero norms are floored at 10^-12 of the largest norm so
/// that they sort lowest without an infinite coordinate.
fn features(layers: &[LayerStats]) -> Vec<[f64; 2]> {
    let max_norm = layers.iter().map(|l| l.grad_norm).fold(0.0, f64::max);
    let floor = if max_norm > 0.0 {
        max_norm * 1e-12
    } else {
        1.0
    };
    let mut pts: Vec<[f64; 2]> = layers
        .iter()
        .map(|l| [(l.size.max(1) as f64).ln(), l.grad_norm.max(floor).ln()])
        .collect();
    let n = pts.len() as f64;
    for axis in 0..2 {
        let mean = pts.iter().map(|p| p[axis]).sum::<f64>() / n;
        let var = pts.iter().map(|p| (p[axis] - mean).powi(2)).sum::<f64>() / n;
        let sd = var.sqrt();
        for p in &mut pts {
            // A constant axis carries no information; centring it to 0 takes it out.
            p[axis] = if sd > 0.0 { (p[axis] - mean) / sd } else { 0.0 };
        }
    }
    pts
}

/// Clusters the layers and ranks the clusters: returns (cluster of each layer, rank of each
/// cluster in ascending sensitivity, standardised centroids).
fn rank_clusters(
    layers: &[LayerStats],
    cfg: &AdaptiveConfig,
) -> (Vec<usize>, Vec<usize>, Vec<[f64; 2]>) {
    let c = kmeans(&features(layers), cfg.clusters, cfg.kmeans_iters);
    let key = |p: [f64; 2]| match cfg.order {
        ClusterOrder::Norm => p[1],
        ClusterOrder::NormMinusSize => p[1] - p[0],
    };
    let mut order: Vec<usize> = (0..c.centroids.len()).collect();
    // Ascending sensitivity; on equal keys the larger layers sort first (fewer bits), since
    // their bytes are what compression saves.
    order.sort_by(|&a, &b| {
        let (pa, pb) = (c.centroids[a], c.centroids[b]);
        key(pa)
            .total_cmp(&key(pb))
            .then(pb[0].total_cmp(&pa[0]))
            .then(a.cmp(&b))
    });
    let mut rank = vec![0; order.len()];
    for (r, &j) in order.iter().enumerate() {
        rank[j] = r;
    }
    (c.labels, rank, c.centroids)
}

/// Algorithm 1 alone, without the error budget: k-means over the layers, clusters sorted by
/// sensitivity ([`AdaptiveConfig::order`]), bit-widths spread linearly from `min_bits` (least
/// sensitive) to `max_bits` (most sensitive) over the clusters found, buckets following the
/// bits ([`AdaptiveConfig::bucket_for_bits`]). When all layers fall into one cluster there is
/// no heterogeneity to exploit, and they get `reference_bits` (clamped to the range).
pub fn cluster_bits(layers: &[LayerStats], cfg: &AdaptiveConfig) -> Result<Vec<Assignment>> {
    cfg.validate()?;
    validate_layers(layers)?;
    if layers.is_empty() {
        return Ok(Vec::new());
    }
    let (labels, rank, _) = rank_clusters(layers, cfg);
    let k = rank.len();
    let bits_of_rank = |r: usize| -> u8 {
        if k <= 1 {
            cfg.reference_bits.clamp(cfg.min_bits, cfg.max_bits)
        } else {
            let span = (cfg.max_bits - cfg.min_bits) as f64;
            cfg.min_bits + (r as f64 * span / (k - 1) as f64).round() as u8
        }
    };
    Ok(labels
        .iter()
        .map(|&l| {
            let bits = bits_of_rank(rank[l]);
            Assignment {
                bits,
                bucket: cfg.bucket_for_bits(bits),
            }
        })
        .collect())
}

/// f64 with a total order, for the heap.
#[derive(Clone, Copy, PartialEq)]
struct Key(f64);
impl Eq for Key {}
impl PartialOrd for Key {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Key {
    fn cmp(&self, o: &Self) -> Ordering {
        self.0.total_cmp(&o.0)
    }
}

/// The next step up for a layer currently at `bits`: the smallest wider width (up to
/// `max_bits`) whose modelled error is lower, with its priority, the error removed per byte
/// added. None when no wider width helps.
fn next_step(l: &LayerStats, bits: u8, cfg: &AdaptiveConfig) -> Option<(f64, u8)> {
    let err = model_error(l.grad_norm, bits, cfg.bucket_for_bits(bits));
    let bytes = layer_bytes(l.size, bits, cfg.bucket_for_bits(bits));
    (bits + 1..=cfg.max_bits).find_map(|b| {
        let bucket = cfg.bucket_for_bits(b);
        let gain = err - model_error(l.grad_norm, b, bucket);
        if gain <= 0.0 {
            return None;
        }
        let cost = layer_bytes(l.size, b, bucket) - bytes;
        // A step that adds no bytes (more bits but larger buckets) is free: take it first.
        let prio = if cost > 0.0 {
            gain / cost
        } else {
            f64::INFINITY
        };
        Some((prio, b))
    })
}

/// Adaptive bit-widths for `layers` (CGX Algorithm 1 plus the error budget): one
/// [`Assignment`] per layer, in input order.
///
/// 1. [`cluster_bits`]: k-means over normalised (size, norm), bits mapped over the clusters
///    sorted by gradient norm.
/// 2. Budget: while the total [model error](model_error) exceeds `alpha · E4`
///    ([`reference_error`]), raise one layer by one width step, choosing the step that removes
///    the most error per byte added ([`layer_bytes`]), a greedy answer to the paper's
///    "minimise Σ b_ℓ·size(L_ℓ) subject to error ≤ α·E4"; buckets follow the bits.
/// 3. If even `max_bits` everywhere cannot meet the budget (`max_bits` below the reference
///    width, or buckets larger than the reference), fall back to the uniform reference
///    assignment, which meets any budget with `alpha ≥ 1`; with `alpha < 1` and no feasible
///    assignment the result is an `InvalidArgument` error naming alpha.
///
/// Bad configuration or a negative, infinite or NaN norm is an `InvalidArgument` naming the
/// field; no layers give an empty result.
pub fn assign_bits(layers: &[LayerStats], cfg: &AdaptiveConfig) -> Result<Vec<Assignment>> {
    let mut out = cluster_bits(layers, cfg)?;
    if layers.is_empty() {
        return Ok(out);
    }
    let e4 = reference_error(layers, cfg);
    let budget = cfg.alpha * e4;
    let mut total = total_error(layers, &out);
    let mut heap: BinaryHeap<(Key, Reverse<usize>)> = BinaryHeap::new();
    for (i, (l, a)) in layers.iter().zip(&out).enumerate() {
        if let Some((prio, _)) = next_step(l, a.bits, cfg) {
            heap.push((Key(prio), Reverse(i)));
        }
    }
    loop {
        if total <= budget {
            // The running total drifts by rounding; only the from-scratch sum (the one callers
            // can recompute) decides.
            total = total_error(layers, &out);
            if total <= budget {
                return Ok(out);
            }
        }
        let Some((_, Reverse(i))) = heap.pop() else {
            break;
        };
        let l = &layers[i];
        let Some((_, b)) = next_step(l, out[i].bits, cfg) else {
            continue;
        };
        let before = model_error(l.grad_norm, out[i].bits, out[i].bucket);
        out[i] = Assignment {
            bits: b,
            bucket: cfg.bucket_for_bits(b),
        };
        total += model_error(l.grad_norm, b, out[i].bucket) - before;
        if let Some((prio, _)) = next_step(l, b, cfg) {
            heap.push((Key(prio), Reverse(i)));
        }
    }
    let uniform = vec![reference(cfg); layers.len()];
    if total_error(layers, &uniform) <= budget {
        return Ok(uniform);
    }
    Err(Error::invalid(format!(
        "adaptive config: alpha {} gives an error budget of {budget:e} (E4 = {e4:e}) that no \
         assignment within {}..={} bits meets; use alpha >= 1",
        cfg.alpha, cfg.min_bits, cfg.max_bits
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::rng::Rng;

    /// A deterministic pseudo-random layer profile for tests and benchmarks: `n` layers with sizes
    /// log-uniform in `1..=max_size` and norms log-uniform over `norm_decades` decades below 1000.
    fn random_profile(seed: u64, n: usize, max_size: usize, norm_decades: f64) -> Vec<LayerStats> {
        let mut rng = Rng::from_u64(seed);
        let mut unit = move || (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        (0..n)
            .map(|i| LayerStats {
                name: format!("layer{i}"),
                size: ((max_size as f64).powf(unit()).round() as usize).clamp(1, max_size),
                grad_norm: 1e3 * 10f64.powf(-norm_decades * unit()),
            })
            .collect()
    }

    fn layer(name: &str, size: usize, grad_norm: f64) -> LayerStats {
        LayerStats {
            name: name.into(),
            size,
            grad_norm,
        }
    }

    fn err_text(r: Result<Vec<Assignment>>) -> String {
        match r {
            Err(e @ Error::InvalidArgument(_)) => e.to_string(),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn top_norm_takes_the_largest_magnitudes() {
        let g = [1.0f32, -4.0, 0.5, 3.0, -0.125];
        assert_eq!(top_norm(&g, 0.4), 5.0); // |-4|, |3|
        assert_eq!(
            top_norm(&g, 1.0),
            (1.0f64 + 16.0 + 0.25 + 9.0 + 0.015625).sqrt()
        );
        assert_eq!(top_norm(&g, 0.01), 4.0); // at least one entry
        assert_eq!(top_norm(&g, 0.0), 4.0);
        assert_eq!(top_norm(&g, f64::NAN), 4.0);
        assert_eq!(top_norm(&g, 7.0), top_norm(&g, 1.0));
        assert_eq!(top_norm(&[], 0.5), 0.0);
        assert!(top_norm(&[1.0, f32::NAN, 2.0], 0.3).is_nan());
    }

    #[test]
    fn spec_strings() {
        let a = Assignment {
            bits: 3,
            bucket: 256,
        };
        assert_eq!(qsgd_spec(&a), "qsgd:bits=3,bucket=256");
    }

    #[test]
    fn error_model_and_bytes() {
        // 4 bits: s = 15.
        assert_eq!(model_error(15.0, 4, 128), 128.0);
        assert!(model_error(1.0, 5, 128) < model_error(1.0, 4, 128));
        assert!(model_error(1.0, 4, 64) < model_error(1.0, 4, 128));
        assert_eq!(model_error(0.0, 1, 1000), 0.0);
        // 1000 elements at 4 bits = 500 bytes, 8 buckets of 128 → 64 bytes of metadata.
        assert_eq!(layer_bytes(1000, 4, 128), 564.0);
        assert_eq!(layer_bytes(0, 4, 128), 0.0);
    }

    #[test]
    fn bucket_mapping_is_linear_in_bits() {
        let cfg = AdaptiveConfig::default();
        let b: Vec<usize> = (2..=6).map(|bits| cfg.bucket_for_bits(bits)).collect();
        assert_eq!(b, [192, 160, 128, 96, 64]);
        let flat = AdaptiveConfig {
            min_bits: 4,
            max_bits: 4,
            ..cfg
        };
        assert_eq!(flat.bucket_for_bits(4), 192);
    }

    #[test]
    fn kmeans_finds_obvious_clusters() {
        let centres = [[0.0, 0.0], [10.0, 0.0], [5.0, 9.0]];
        let mut pts = Vec::new();
        for (c, centre) in centres.iter().enumerate() {
            for j in 0..7 {
                let dx = (j as f64 - 3.0) * 0.1;
                let dy = ((j * 3 + c) % 5) as f64 * 0.1 - 0.2;
                pts.push([centre[0] + dx, centre[1] + dy]);
            }
        }
        let c = kmeans(&pts, 3, 100);
        assert_eq!(c.centroids.len(), 3);
        for (group, &centre) in c.labels.chunks(7).zip(&centres) {
            let l = group[0];
            assert!(group.iter().all(|&x| x == l), "{c:?}");
            let cen = c.centroids[l];
            assert!(dist2(cen, centre) < 0.1, "{cen:?} vs {centre:?}");
        }
        let mut ls: Vec<usize> = (0..3).map(|g| c.labels[g * 7]).collect();
        ls.sort();
        assert_eq!(ls, [0, 1, 2]);
    }

    #[test]
    fn kmeans_with_fewer_distinct_points_than_k() {
        let pts = [[1.0, 1.0], [1.0, 1.0], [2.0, 2.0]];
        let c = kmeans(&pts, 5, 10);
        assert_eq!(c.centroids.len(), 2);
        assert_eq!(c.labels[0], c.labels[1]);
        assert_ne!(c.labels[0], c.labels[2]);
        assert!(kmeans(&[], 3, 10).labels.is_empty());
    }

    /// A Transformer-like profile: an embedding and big FC layers with small gradient norms,
    /// attention blocks in between, small biases/norms with large ones.
    fn transformer() -> Vec<LayerStats> {
        let mut v = vec![layer("embedding", 10_000_000, 0.3)];
        for i in 0..6 {
            v.push(layer(&format!("fc{i}.w"), 2_000_000, 0.5 + 0.01 * i as f64));
            v.push(layer(&format!("attn{i}.w"), 500_000, 3.0 + 0.1 * i as f64));
            v.push(layer(&format!("ln{i}.b"), 1_000, 20.0 + i as f64));
        }
        v
    }

    #[test]
    fn large_low_norm_layers_get_fewer_bits() {
        let layers = transformer();
        for cfg in [
            AdaptiveConfig::default(),
            AdaptiveConfig {
                alpha: 1.5,
                ..Default::default()
            },
            AdaptiveConfig {
                order: ClusterOrder::NormMinusSize,
                ..Default::default()
            },
        ] {
            let a = assign_bits(&layers, &cfg).unwrap();
            let bits = |name: &str| a[layers.iter().position(|l| l.name == name).unwrap()].bits;
            for i in 0..6 {
                assert!(bits("embedding") < bits(&format!("ln{i}.b")), "{a:?}");
                assert!(
                    bits(&format!("fc{i}.w")) < bits(&format!("ln{i}.b")),
                    "{a:?}"
                );
                assert!(
                    bits(&format!("fc{i}.w")) <= bits(&format!("attn{i}.w")),
                    "{a:?}"
                );
            }
            assert!(total_error(&layers, &a) <= cfg.alpha * reference_error(&layers, &cfg));
            // The point of the exercise: fewer bytes than the uniform baseline.
            let bytes = |a: &[Assignment]| -> f64 {
                layers
                    .iter()
                    .zip(a)
                    .map(|(l, a)| layer_bytes(l.size, a.bits, a.bucket))
                    .sum()
            };
            let uniform = vec![reference(&cfg); layers.len()];
            assert!(bytes(&a) < bytes(&uniform), "{a:?}");
        }
    }

    #[test]
    fn deterministic() {
        let cfg = AdaptiveConfig::default();
        for seed in 0..20 {
            let layers = random_profile(seed, 40, 10_000_000, 6.0);
            let a = assign_bits(&layers, &cfg).unwrap();
            let b = assign_bits(&layers.clone(), &cfg.clone()).unwrap();
            assert_eq!(a, b);
        }
        assert_eq!(
            random_profile(7, 5, 100, 2.0),
            random_profile(7, 5, 100, 2.0)
        );
    }

    #[test]
    fn higher_norm_clusters_never_get_fewer_bits() {
        for clusters in 1..=6 {
            let cfg = AdaptiveConfig {
                clusters,
                min_bits: 1,
                max_bits: 8,
                ..Default::default()
            };
            for seed in 0..30 {
                let layers = random_profile(seed, 1 + (seed as usize * 7) % 50, 1 << 24, 5.0);
                let a = cluster_bits(&layers, &cfg).unwrap();
                let (labels, _, centroids) = rank_clusters(&layers, &cfg);
                for i in 0..layers.len() {
                    for j in 0..layers.len() {
                        if centroids[labels[i]][1] > centroids[labels[j]][1] {
                            assert!(a[i].bits >= a[j].bits, "seed {seed}: {a:?}");
                        }
                    }
                }
                // With a budget that never binds, assign_bits is Algorithm 1 unchanged.
                let loose = AdaptiveConfig {
                    alpha: 1e30,
                    ..cfg.clone()
                };
                assert_eq!(assign_bits(&layers, &loose).unwrap(), a);
            }
        }
    }

    #[test]
    fn error_budget_holds_on_random_profiles() {
        let mut repaired = 0;
        for seed in 0..300u64 {
            let n = 1 + (seed as usize * 13) % 80;
            let layers = random_profile(seed, n, 10_000_000, 1.0 + (seed % 8) as f64);
            let mut cfg = AdaptiveConfig {
                clusters: 1 + (seed as usize) % 5,
                alpha: 1.0 + (seed / 5 % 5) as f64 * 0.5,
                ..Default::default()
            };
            if seed % 2 == 1 {
                // A wider range, down to 1 bit with bucket 256.
                (cfg.min_bits, cfg.max_bits, cfg.buckets) = (1, 8, (256, 32));
            }
            let a = assign_bits(&layers, &cfg).unwrap();
            assert_eq!(a.len(), layers.len());
            let (total, e4) = (total_error(&layers, &a), reference_error(&layers, &cfg));
            assert!(
                total <= cfg.alpha * e4,
                "seed {seed}: {total} > {} * {e4}",
                cfg.alpha
            );
            // Both ranges reach an error far below the reference at their top, so the greedy
            // always fits and every width stays in range with its mapped bucket.
            for x in &a {
                assert!((cfg.min_bits..=cfg.max_bits).contains(&x.bits), "{x:?}");
                assert_eq!(x.bucket, cfg.bucket_for_bits(x.bits));
            }
            if total_error(&layers, &cluster_bits(&layers, &cfg).unwrap()) > cfg.alpha * e4 {
                repaired += 1;
            }
        }
        // The profiles do exercise the budget step, not only Algorithm 1.
        assert!(repaired > 20, "{repaired}");
    }

    #[test]
    fn budget_raises_the_cheapest_error_first() {
        // One cluster at the reference (2 bits), a budget below it: of two layers with the
        // same error, the small one buys the same error reduction for 1000x fewer bytes.
        let cfg = AdaptiveConfig {
            clusters: 1,
            min_bits: 2,
            max_bits: 8,
            buckets: (128, 128),
            reference_bits: 2,
            alpha: 0.9,
            ..Default::default()
        };
        let layers = [layer("big", 1_000_000, 10.0), layer("small", 1_000, 10.0)];
        assert_eq!(cluster_bits(&layers, &cfg).unwrap()[0].bits, 2);
        let a = assign_bits(&layers, &cfg).unwrap();
        assert_eq!((a[0].bits, a[1].bits), (2, 3), "{a:?}");

        // Two clusters whose low one breaks the budget: it is raised only as far as needed.
        let layers = [
            layer("emb1", 1_000_000, 10.0),
            layer("emb2", 1_000_000, 10.0),
            layer("b1", 100, 20.0),
            layer("b2", 100, 20.0),
        ];
        let cfg = AdaptiveConfig {
            clusters: 2,
            ..Default::default()
        };
        let c = cluster_bits(&layers, &cfg).unwrap();
        let bits = |a: &[Assignment]| a.iter().map(|x| x.bits).collect::<Vec<_>>();
        assert_eq!(bits(&c), [2, 2, 6, 6]);
        let e4 = reference_error(&layers, &cfg);
        assert!(total_error(&layers, &c) > cfg.alpha * e4);
        let a = assign_bits(&layers, &cfg).unwrap();
        assert_eq!(bits(&a), [3, 3, 6, 6]);
        assert!(total_error(&layers, &a) <= cfg.alpha * e4);
    }

    #[test]
    fn falls_back_to_reference_when_the_range_cannot_meet_the_budget() {
        let layers = transformer();
        // At most 3 bits and large buckets cannot reach the 4-bit error: uniform 4/128.
        let cfg = AdaptiveConfig {
            min_bits: 2,
            max_bits: 3,
            buckets: (512, 256),
            alpha: 1.5,
            ..Default::default()
        };
        let a = assign_bits(&layers, &cfg).unwrap();
        assert!(a.iter().all(|x| *x
            == Assignment {
                bits: 4,
                bucket: 128
            }));
        // With alpha < 1 even that is over budget.
        let tight = AdaptiveConfig { alpha: 0.5, ..cfg };
        assert!(err_text(assign_bits(&layers, &tight)).contains("alpha"));
        // alpha < 1 is fine when wider widths can get under it.
        let ok = AdaptiveConfig {
            alpha: 0.5,
            max_bits: 8,
            ..Default::default()
        };
        let a = assign_bits(&layers, &ok).unwrap();
        assert!(total_error(&layers, &a) <= 0.5 * reference_error(&layers, &ok));
    }

    #[test]
    fn edge_cases() {
        let cfg = AdaptiveConfig::default();
        assert!(assign_bits(&[], &cfg).unwrap().is_empty());

        // One layer: one cluster, the reference width.
        let one = [layer("w", 1000, 1.0)];
        assert_eq!(
            assign_bits(&one, &cfg).unwrap(),
            [Assignment {
                bits: 4,
                bucket: 128
            }]
        );

        // All layers equal: one cluster, all alike.
        let same: Vec<LayerStats> = (0..10)
            .map(|i| layer(&format!("l{i}"), 4096, 2.5))
            .collect();
        let a = assign_bits(&same, &cfg).unwrap();
        assert!(a.iter().all(|x| x.bits == 4 && x.bucket == 128), "{a:?}");

        // Fewer layers than clusters: the two layers take the two ends of the range, then the
        // budget raises the cheap-to-fix one as needed.
        let two = [layer("big", 1_000_000, 0.01), layer("small", 100, 10.0)];
        let c = cluster_bits(&two, &cfg).unwrap();
        assert_eq!((c[0].bits, c[1].bits), (2, 6));
        let a = assign_bits(&two, &cfg).unwrap();
        assert!(a[0].bits < a[1].bits);
        assert!(total_error(&two, &a) <= cfg.alpha * reference_error(&two, &cfg));

        // Zero norms and zero sizes are allowed (zero error, zero bytes).
        let zeros = [layer("a", 0, 0.0), layer("b", 10, 0.0), layer("c", 10, 1.0)];
        let a = assign_bits(&zeros, &cfg).unwrap();
        assert_eq!(a.len(), 3);
        let all_zero = [layer("a", 5, 0.0), layer("b", 50, 0.0)];
        assert_eq!(assign_bits(&all_zero, &cfg).unwrap().len(), 2);

        // Reference width outside the range with a single cluster is clamped into it.
        let narrow = AdaptiveConfig {
            min_bits: 6,
            max_bits: 8,
            ..Default::default()
        };
        assert_eq!(assign_bits(&one, &narrow).unwrap()[0].bits, 6);
    }

    #[test]
    fn bad_config_and_layers_are_rejected() {
        let layers = [layer("w", 10, 1.0)];
        let d = AdaptiveConfig::default;
        let cases: Vec<(AdaptiveConfig, &str)> = vec![
            (AdaptiveConfig { clusters: 0, ..d() }, "clusters"),
            (
                AdaptiveConfig {
                    min_bits: 5,
                    max_bits: 4,
                    ..d()
                },
                "min_bits",
            ),
            (AdaptiveConfig { min_bits: 0, ..d() }, "min_bits"),
            (AdaptiveConfig { max_bits: 9, ..d() }, "max_bits"),
            (
                AdaptiveConfig {
                    reference_bits: 0,
                    ..d()
                },
                "reference_bits",
            ),
            (AdaptiveConfig { alpha: 0.0, ..d() }, "alpha"),
            (AdaptiveConfig { alpha: -1.0, ..d() }, "alpha"),
            (
                AdaptiveConfig {
                    alpha: f64::NAN,
                    ..d()
                },
                "alpha",
            ),
            (
                AdaptiveConfig {
                    alpha: f64::INFINITY,
                    ..d()
                },
                "alpha",
            ),
            (
                AdaptiveConfig {
                    buckets: (0, 64),
                    ..d()
                },
                "buckets",
            ),
            (
                AdaptiveConfig {
                    reference_bucket: 0,
                    ..d()
                },
                "reference_bucket",
            ),
            (
                AdaptiveConfig {
                    kmeans_iters: 0,
                    ..d()
                },
                "kmeans_iters",
            ),
        ];
        for (cfg, field) in cases {
            let e = err_text(assign_bits(&layers, &cfg));
            assert!(e.contains(field), "{field}: {e}");
            // Bad config is rejected even with no layers.
            assert!(err_text(assign_bits(&[], &cfg)).contains(field));
        }
        for bad in [f64::NAN, -1.0, f64::INFINITY] {
            let ls = [layer("ok", 10, 1.0), layer("fc2", 10, bad)];
            let e = err_text(assign_bits(&ls, &d()));
            assert!(e.contains("grad_norm") && e.contains("layers[1]"), "{e}");
            assert!(e.contains("fc2"), "{e}");
        }
    }
}
