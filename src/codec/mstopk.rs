//! `mstopk:density=D[,samplings=N]`: multi-sampling approximate top-k, Algorithm 1 (MSTopK) of
//! Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud Clusters"
//! (the HiTopKComm paper). Sends exactly k = `k_of``(D, n)` elements, chosen without sorting.
//!
//! # The algorithm
//!
//! With `a = |x|`, mean `ā` and maximum `u`, N samplings bisect a ratio in [l, r] = [0, 1]: each
//! tries `thres = ā + ratio·(u − ā)` with `ratio = l + (r − l)/2` and counts `nnz = #{a ≥ thres}`.
//! A count ≤ k moves r down and, if it is the largest such count so far, records
//! (k1, thres1) = (nnz, thres); a count > k moves l up and, if it is the smallest such count so
//! far, records (k2, thres2). Then the k1 elements with `a ≥ thres1` are taken, and the
//! remaining k − k1 are a contiguous run, at a random offset, of the k2 − k1 elements with
//! `thres2 ≤ a < thres1` in index order (the paper's `ι2[rand : rand + k − k1]`). The result is
//! returned in ascending index order.
//!
//! Every selected element has `a ≥ thres2` and every element left out has `a < thres1`: the
//! exact k-th largest magnitude is ≥ thres2 and the (k+1)-th is < thres1 ([`mstopk_select`]
//! returns this bracket).
//!
//! # Deviations from the paper's pseudo-code
//!
//! * The paper initialises `thres1 = 0` together with `k1 = 0`; if no sampling ever counts
//!   between 1 and k elements, its line 25 would then select every element. Here "no thres1
//!   yet" means +∞ (no element), which is what `k1 = 0` says.
//! * The random offset is `draw(K, 0) % (k2 − k1 − (k − k1) + 1)`, K the encode site's key
//!   ([`super::rng`]: reproducible per site, and computable by a GPU); no offset is needed when
//!   k1 = k.
//! * Magnitudes are compared as integer keys (see [`key`]); for finite inputs this is exactly
//!   the float comparison `a ≥ thres`. An input holding an infinity or NaN, or whose magnitudes
//!   overflow the f32 partial sums of the mean, has no meaningful mean: it is selected by exact
//!   top-k instead ([`select_topk`], NaN counting as the largest magnitude).
//!
//! # Making N samplings cheap
//!
//! A sampling is a count over the whole chunk, so N = 30 plain passes over a chunk in DRAM would
//! cost more than an exact top-k. The selection is nevertheless exactly that of Algorithm 1 run
//! step by step (the tests check this against a literal implementation), because:
//!
//! * Every later threshold is ≥ the current thres2 (the thresholds grow with the ratio and the
//!   ratio never drops below l), and the final selection only looks at elements ≥ thres2. So
//!   once thres2 holds at most half of the working set, the working set is compacted to the
//!   (index, key) pairs at or above it, and later samplings count over those.
//! * Better still, a chunk above 256 Ki elements is first sampled (64 elements in every 16 Ki)
//!   to guess a floor that a little more than k elements reach, and the pass that computes the
//!   mean also collects the elements at or above that floor. Counts at thresholds at or above
//!   the floor are then exact over the collected elements; a threshold below the floor is known
//!   to be reached by more than k elements, which decides the bisection step. Its exact count
//!   would only matter as thres2's k2, and any later count above k taken at or above the floor
//!   replaces it without changing the selection (the two thresholds then bound the same
//!   elements). Only when no such later count comes (one or two samplings, or a floor guessed
//!   above the k-th magnitude) does the search run again over the whole chunk. In the common
//!   case the chunk is read once, plus 1/256 of it for the sample.
//! * Over a working set larger than L2, the next L samplings can only try the 2^L − 1
//!   thresholds of a bisection tree below the current [l, r]. Counting all of them in one pass
//!   and walking the tree with the counts performs L = 3 samplings per read; that pass also
//!   collects the elements above a floor guessed from the sample.
//!
//! The search also stops early when k1 = k (the selection can no longer change), when the
//! thresholds at l and r round to the same f32 (every later sampling repeats a count already
//! made), or when a pass leaves the search state unchanged. These only skip samplings whose
//! outcome is already determined, so the selection is that of all N samplings. The lower
//! bracket returned can differ from the paper's thres2 (a threshold bounding the same elements,
//! or a looser one after an early stop); the upper bracket is the paper's thres1.

use super::rng::draw;
use super::sparse::{self, key, scan_at_least, Selector};
use super::topk::select_topk;
use super::{CodecId, Rng};
use crate::error::Result;

/// Samplings when the spec does not say (the paper's N = 30).
pub const DEFAULT_SAMPLINGS: u32 = 30;
/// The largest number of samplings a spec may ask for.
pub const MAX_SAMPLINGS: u32 = 1000;

/// `mstopk`: k elements chosen by MSTopK's threshold search.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MsTopK {
    density: f64,
    samplings: u32,
}

impl MsTopK {
    /// An MSTopK codec keeping `density` (in (0, 1]) of each chunk, searching with `samplings`
    /// (1..=[`MAX_SAMPLINGS`]) threshold samplings.
    pub fn new(density: f64, samplings: u32) -> Result<MsTopK> {
        sparse::check_density("mstopk", density)?;
        if !(1..=MAX_SAMPLINGS).contains(&samplings) {
            return Err(crate::error::Error::invalid(format!(
                "mstopk: samplings must be in 1..={MAX_SAMPLINGS}, got {samplings}"
            )));
        }
        Ok(MsTopK { density, samplings })
    }
}

/// Elements per block of the counting passes: the block's keys stay in L1 while every
/// threshold of the pass is counted over them.
const BLOCK: usize = 1024;
/// Bisection levels counted per pass while the working set is larger than L2 (7 thresholds):
/// such a pass is bound by memory, so extra compares are nearly free.
const WIDE_LEVELS: u32 = 3;
/// Working sets up to this many elements (1 MiB of keys) are cache resident, where a pass costs
/// compares rather than memory traffic and one level per pass does the least work.
const CACHED_ELEMS: usize = 1 << 18;
/// Chunks above [`CACHED_ELEMS`] are sampled, [`SAMPLE_RUN`] elements (4 cache lines) in every
/// SAMPLE_STRIDE, to guess where to compact while the first pass streams by: 1/256 of the chunk.
const SAMPLE_STRIDE: usize = 1 << 14;
/// See [`SAMPLE_STRIDE`].
const SAMPLE_RUN: usize = 64;

/// `|x|`'s mean (f64) and largest magnitude; with `collect = Some((c, idx, keys))` also appends
/// the (index, key) of every element with key ≥ c, in index order, while the data streams by.
///
/// Partial sums and maxima run in 16 f32 lanes (which the compiler vectorizes, and which give
/// the same result on every machine; a max of integer keys would not vectorize with SSE2), the
/// sums flushed to f64 every 16 Ki elements so the mean stays accurate on long chunks. A NaN
/// makes the mean NaN (the maximum skips it).
// Not inlined: inside the large `mstopk_select` the lane accumulators get spilled, which costs
// this pass (the only full pass in the common case) about half its speed.
#[inline(never)]
fn mean_max(x: &[f32], mut collect: Option<(i32, &mut Vec<u32>, &mut Vec<i32>)>) -> (f64, f32) {
    const LANES: usize = 16;
    const PART: usize = 16 * BLOCK;
    let mut total = 0f64;
    let mut maxs = [0f32; LANES];
    for (p, part) in x.chunks(PART).enumerate() {
        let mut acc = [0f32; LANES];
        let lanes = part.chunks_exact(LANES);
        let tail = lanes.remainder();
        for c in lanes {
            for ((s, m), &v) in acc.iter_mut().zip(maxs.iter_mut()).zip(c) {
                let a = v.abs();
                *s += a;
                // Not f32::max: its NaN handling costs a blend per lane, and a NaN is caught
                // through the sum anyway.
                *m = if a > *m { a } else { *m };
            }
        }
        for (j, &v) in tail.iter().enumerate() {
            let a = v.abs();
            acc[j] += a;
            maxs[j] = if a > maxs[j] { a } else { maxs[j] };
        }
        total += acc.iter().map(|&a| a as f64).sum::<f64>();
        if let Some((c, idx, keys)) = &mut collect {
            // The part is still in L2.
            collect_at_least(part, |v| key(v) as i32, p * PART, *c, idx, keys);
        }
    }
    let max = maxs.iter().fold(0f32, |m, &a| if a > m { a } else { m });
    (total / x.len().max(1) as f64, max)
}

/// Adds to `counts[j]` the number of `keys` ≥ `ts[j]`, for every j.
#[inline]
fn count_keys(keys: &[i32], ts: &[i32], counts: &mut [usize]) {
    for block in keys.chunks(BLOCK) {
        for (c, &t) in counts.iter_mut().zip(ts) {
            // A compare and a subtract per 4 or 8 keys once vectorized; the u32 sum cannot
            // overflow within a block.
            *c += block.iter().map(|&m| (m >= t) as u32).sum::<u32>() as usize;
        }
    }
}

/// [`count_keys`] over the magnitude keys of `x`, made a block at a time into an L1 buffer;
/// with `collect = Some((c, idx, keys))` also appends the (index, key) of every element with key
/// ≥ c, in index order.
fn count_full(
    x: &[f32],
    ts: &[i32],
    counts: &mut [usize],
    mut collect: Option<(i32, &mut Vec<u32>, &mut Vec<i32>)>,
) {
    let mut buf = [0i32; BLOCK];
    for (n, block) in x.chunks(BLOCK).enumerate() {
        let b = &mut buf[..block.len()];
        for (o, &v) in b.iter_mut().zip(block) {
            // Keys are at most 0x7fff_ffff: non-negative as i32, so signed compares are exact.
            *o = key(v) as i32;
        }
        count_keys(b, ts, counts);
        if let Some((c, idx, keys)) = &mut collect {
            collect_at_least(b, |m| m, n * BLOCK, *c, idx, keys);
        }
    }
}

/// Appends `(base + j, key_of(vals[j]))` for every key ≥ `c` (c ≥ 0), as
/// [`sparse::scan_at_least`] does: a vectorized OR-test per 32 keys, a bit mask only for blocks
/// with hits.
#[inline(always)]
fn collect_at_least<T: Copy>(
    vals: &[T],
    key_of: impl Fn(T) -> i32,
    base: usize,
    c: i32,
    idx: &mut Vec<u32>,
    out: &mut Vec<i32>,
) {
    // `c − 1 − key` is negative exactly when key ≥ c, and cannot overflow for c, key ≥ 0.
    let cm1 = c - 1;
    for (b, chunk) in vals.chunks(32).enumerate() {
        if chunk.iter().fold(0i32, |a, &v| a | (cm1 - key_of(v))) < 0 {
            let mut mask = 0u32;
            for (j, &v) in chunk.iter().enumerate() {
                mask |= (((cm1 - key_of(v)) as u32) >> 31) << j;
            }
            while mask != 0 {
                let j = mask.trailing_zeros() as usize;
                idx.push((base + 32 * b + j) as u32);
                out.push(key_of(chunk[j]));
                mask &= mask - 1;
            }
        }
    }
}

/// Keys of the first [`SAMPLE_RUN`] elements of every [`SAMPLE_STRIDE`]: a spread-out sample
/// that costs a small fraction of one pass to read.
fn take_sample(x: &[f32]) -> Vec<i32> {
    x.chunks(SAMPLE_STRIDE)
        .flat_map(|c| &c[..SAMPLE_RUN.min(c.len())])
        .map(|&v| key(v) as i32)
        .collect()
}

/// The floor for the first pass: a key that the sample says a little more than k elements
/// reach. With m = k·s/n sampled elements expected at or above the k-th magnitude (s sampled
/// of n), the floor is the sample's (m + 4√m + 8)-th largest key: more than k elements reach it
/// unless the sample is off by four standard deviations (and then the search only costs more
/// passes), while few more than k are collected (about 1.17·k at density 0.01 on 16 Mi
/// elements). None when that would be over a quarter of the chunk (collecting would cost more
/// than it saves).
fn guess_floor(sample: &[i32], n: usize, k: usize) -> Option<i32> {
    let s = sample.len();
    let m = k as f64 * s as f64 / n as f64;
    let j = (m + 4.0 * m.sqrt()).ceil() as usize + 8;
    if j > s / 4 {
        return None;
    }
    let mut v = sample.to_vec();
    let (_, &mut t, _) = v.select_nth_unstable(s - j);
    Some(t)
}

/// The threshold to compact at while counting the full chunk: the largest tree threshold that
/// the sample says more than 1.5·k elements reach (with 8 sampled elements to spare), so that
/// the pass very likely ends with thres2 at or above it. None when no threshold qualifies or
/// the threshold would keep more than a quarter of the chunk (collecting costs more than it
/// saves). A wrong guess costs time, never correctness: the collected elements are used only if
/// thres2 turns out ≥ the guess.
fn speculate(sample: &[i32], n: usize, k: usize, ts: &[i32]) -> Option<i32> {
    if sample.is_empty() {
        return None;
    }
    let mut sc = vec![0usize; ts.len()];
    count_keys(sample, ts, &mut sc);
    let f = sample.len() as f64 / n as f64;
    let need = 1.5 * k as f64 * f + 8.0;
    ts.iter()
        .zip(&sc)
        .filter(|&(_, &c)| c as f64 >= need && c <= sample.len() / 4)
        .map(|(&t, _)| t)
        .max()
}

/// The elements the search still looks at.
enum Working {
    /// The whole chunk.
    Full,
    /// The (index, key) pairs, in index order, of every element with key ≥ `floor`, more than k
    /// of them. Counts at thresholds ≥ floor are exact over these; a threshold below the floor
    /// is only known to be reached by more than k elements.
    Compact {
        idx: Vec<u32>,
        keys: Vec<i32>,
        floor: i32,
    },
}

impl Working {
    fn len(&self, n: usize) -> usize {
        match self {
            Working::Full => n,
            Working::Compact { keys, .. } => keys.len(),
        }
    }

    /// Keeps only the elements with key ≥ `t` (≥ the current floor).
    fn compact(self, x: &[f32], t: u32, expect: usize) -> Working {
        match self {
            Working::Full => {
                let mut idx = Vec::with_capacity(expect);
                let mut keys = Vec::with_capacity(expect);
                scan_at_least(x, t, |i, m| {
                    idx.push(i as u32);
                    keys.push(m as i32);
                });
                Working::Compact {
                    idx,
                    keys,
                    floor: t as i32,
                }
            }
            Working::Compact {
                mut idx, mut keys, ..
            } => {
                let t = t as i32;
                let mut w = 0;
                for j in 0..keys.len() {
                    if keys[j] >= t {
                        idx[w] = idx[j];
                        keys[w] = keys[j];
                        w += 1;
                    }
                }
                idx.truncate(w);
                keys.truncate(w);
                Working::Compact {
                    idx,
                    keys,
                    floor: t,
                }
            }
        }
    }
}

/// The state of Algorithm 1's loop. Thresholds are kept as magnitude keys of the f32 `thres`.
#[derive(Clone, Copy, PartialEq)]
struct Search {
    k: usize,
    l: f64,
    r: f64,
    k1: usize,
    /// None: no count in 1..=k seen yet (thres1 = +∞, selects nothing).
    t1: Option<u32>,
    /// None: thres2 is below the working set's floor and its count is not known, only that it
    /// is more than k and not less than any count at or above the floor.
    k2: Option<usize>,
    t2: u32,
}

impl Search {
    /// Lines 4–6 (thres1 = +∞ rather than 0, see the module documentation).
    fn new(k: usize, n: usize) -> Search {
        Search {
            k,
            l: 0.0,
            r: 1.0,
            k1: 0,
            t1: None,
            k2: Some(n),
            t2: 0,
        }
    }

    /// Lines 11–23: the update for a sampling at `ratio` (threshold key `t`) that counted `nnz`
    /// (None: more than k, exact count unknown).
    ///
    /// An unknown count can only come before every known count above k (those thresholds are
    /// at or above the floor, and the thresholds that move l only grow). Taking such a
    /// threshold as thres2, and then any later known count above k in its place, can differ
    /// from Algorithm 1 only where the two thresholds have equal counts, so the same elements
    /// at or above them: the selection and k2 come out the same.
    fn step(&mut self, ratio: f64, t: u32, nnz: Option<usize>) {
        match nnz {
            Some(nnz) if nnz <= self.k => {
                self.r = ratio;
                if nnz > self.k1 {
                    self.k1 = nnz;
                    self.t1 = Some(t);
                }
            }
            Some(nnz) => {
                self.l = ratio;
                if self.k2.is_none_or(|k2| nnz < k2) {
                    self.k2 = Some(nnz);
                    self.t2 = t;
                }
            }
            None => {
                self.l = ratio;
                self.k2 = None;
                self.t2 = t;
            }
        }
    }
}

/// Line 9: the threshold at `ratio`, as the key of the f32 threshold.
#[inline]
fn thres_key(mean: f64, span: f64, ratio: f64) -> u32 {
    key((mean + ratio * span) as f32)
}

/// Lines 7–24 over the working set `work`: up to `samplings` samplings, several per pass over
/// a large working set, compacting the working set as thres2 rises.
fn search(
    x: &[f32],
    k: usize,
    samplings: u32,
    (mean, span): (f64, f64),
    sample: &[i32],
    mut work: Working,
) -> (Search, Working) {
    let n = x.len();
    let mut s = Search::new(k, n);
    let mut left = samplings;
    let mut tree_ratio = Vec::new();
    let mut tree_t = Vec::new();
    let mut counts: Vec<Option<usize>> = Vec::new();
    while left > 0 && s.k1 < k {
        // Elements below thres2 can no longer be counted or selected.
        if let Some(k2) = s.k2 {
            if k2 <= work.len(n) / 2 {
                work = work.compact(x, s.t2, k2);
            }
        }
        let levels = if work.len(n) > CACHED_ELEMS {
            WIDE_LEVELS
        } else {
            1
        }
        .min(left);

        // The bisection tree of the next `levels` samplings, in heap order: node j's children
        // are 2j+1 (its count was ≤ k: r moved down) and 2j+2 (count > k: l moved up). The
        // ratios are computed by the same formula, from the same l and r, as the step-by-step
        // loop would.
        let nodes = (1usize << levels) - 1;
        tree_ratio.clear();
        tree_t.clear();
        let mut bounds = vec![(s.l, s.r)];
        for j in 0..nodes {
            let (l, r) = bounds[j];
            let ratio = l + (r - l) / 2.0;
            tree_ratio.push(ratio);
            tree_t.push(thres_key(mean, span, ratio) as i32);
            if 2 * j + 1 < nodes {
                bounds.push((l, ratio));
                bounds.push((ratio, r));
            }
        }
        counts.clear();
        let mut guess = None;
        match &work {
            Working::Full => {
                let mut exact = vec![0usize; nodes];
                match speculate(sample, n, k, &tree_t) {
                    // Count the thresholds below c over the chunk while collecting everything
                    // at or above c; the counts at or above c are then exact over the
                    // collected elements.
                    Some(c) => {
                        let (below, above): (Vec<usize>, Vec<usize>) =
                            (0..nodes).partition(|&j| tree_t[j] < c);
                        let ts = |js: &[usize]| js.iter().map(|&j| tree_t[j]).collect::<Vec<_>>();
                        let (mut cb, mut ca) = (vec![0; below.len()], vec![0; above.len()]);
                        let (mut idx, mut keys) = (Vec::new(), Vec::new());
                        count_full(x, &ts(&below), &mut cb, Some((c, &mut idx, &mut keys)));
                        count_keys(&keys, &ts(&above), &mut ca);
                        for (js, cs) in [(&below, &cb), (&above, &ca)] {
                            for (&j, &cnt) in js.iter().zip(cs) {
                                exact[j] = cnt;
                            }
                        }
                        guess = Some((c, idx, keys));
                    }
                    None => count_full(x, &tree_t, &mut exact, None),
                }
                counts.extend(exact.into_iter().map(Some));
            }
            Working::Compact { keys, floor, .. } => {
                let (above, ts): (Vec<usize>, Vec<i32>) = (0..nodes)
                    .filter(|&j| tree_t[j] >= *floor)
                    .map(|j| (j, tree_t[j]))
                    .unzip();
                let mut ca = vec![0; above.len()];
                count_keys(keys, &ts, &mut ca);
                counts.resize(nodes, None);
                for (&j, &cnt) in above.iter().zip(&ca) {
                    counts[j] = Some(cnt);
                }
            }
        }
        let before = s;
        let mut j = 0;
        for _ in 0..levels {
            s.step(tree_ratio[j], tree_t[j] as u32, counts[j]);
            j = 2 * j + 1 + counts[j].is_none_or(|c| c > k) as usize;
        }
        left -= levels;
        if let Some((c, idx, keys)) = guess {
            if s.t2 as i32 >= c {
                work = Working::Compact {
                    idx,
                    keys,
                    floor: c,
                };
            }
        }
        // Every later threshold lies between those of l and r. Once both are the same f32, that
        // one threshold has been counted (this pass moved l or r onto it) and every further
        // sampling would count it again and change nothing but l or r. A pass that changed
        // nothing at all is likewise repeated forever.
        if s == before || thres_key(mean, span, s.l) == thres_key(mean, span, s.r) {
            break;
        }
    }
    (s, work)
}

/// Selects exactly `min(k, x.len())` elements of `x` by MSTopK (Algorithm 1 with `samplings`
/// samplings, see the module documentation) into `out_idx` (cleared first), ascending. Returns
/// the bracket `(thres2, thres1)`: every selected element has `|x| ≥ thres2`, every other
/// element has `|x| < thres1` (so the exact k-th largest magnitude is ≥ thres2 and the
/// (k+1)-th is < thres1). `thres1` is +∞ when no sampling counted between 1 and k elements; the
/// bracket is `(0, +∞)` when nothing or everything is selected. `site_key` gives the offset of the
/// run taken between the thresholds.
///
/// Inputs with an infinity or NaN are selected by [`select_topk`] instead, and the bracket is
/// then `(m, m)` for the k-th largest magnitude `m` (which may be +∞ or NaN).
pub fn mstopk_select(
    x: &[f32],
    k: usize,
    samplings: u32,
    site_key: u64,
    out_idx: &mut Vec<u32>,
) -> (f32, f32) {
    out_idx.clear();
    let n = x.len();
    let k = k.min(n);
    if k == 0 {
        return (0.0, f32::INFINITY);
    }
    if k == n {
        out_idx.extend(0..n as u32);
        return (0.0, f32::INFINITY);
    }

    // A long chunk is sampled first to guess a floor that a little more than k elements reach,
    // and those elements are collected during the pass that computes the mean; the search
    // then rarely touches the whole chunk again.
    let sample = if n > CACHED_ELEMS {
        take_sample(x)
    } else {
        Vec::new()
    };
    let floor = guess_floor(&sample, n, k);
    let (mut idx, mut keys) = (Vec::new(), Vec::new());

    // Lines 1–3.
    let (mean, umax) = mean_max(x, floor.map(|c| (c, &mut idx, &mut keys)));
    if !umax.is_finite() || !mean.is_finite() {
        select_topk(x, k, out_idx);
        let m = out_idx.iter().map(|&i| key(x[i as usize])).min();
        let m = f32::from_bits(m.unwrap_or(0));
        return (m, m);
    }
    let u = umax as f64;
    // The f32 partial sums can round the mean of equal magnitudes above their maximum; the
    // thresholds must not shrink as the ratio grows.
    let mean = mean.min(u);
    let line9 = (mean, u - mean);

    let first = match floor {
        Some(c) if keys.len() > k => Working::Compact {
            idx,
            keys,
            floor: c,
        },
        _ => Working::Full,
    };
    let (mut s, mut work) = search(x, k, samplings, line9, &sample, first);
    if s.k2.is_none() {
        // The samplings never counted above k at or above the guessed floor (few samplings, or
        // a floor far below the k-th magnitude): search again with exact counts everywhere.
        (s, work) = search(x, k, samplings, line9, &sample, Working::Full);
    }
    let k2 = s.k2.expect("exact counts over the full chunk");

    // Lines 25–28: all of [thres1, ∞), then a run of k − k1 from [thres2, thres1).
    let need = k - s.k1;
    let start = if need > 0 {
        // One draw, as random-k's strata take theirs: uniform over the possible offsets.
        (draw(site_key, 0) % (k2 - s.k1 - need + 1) as u64) as usize
    } else {
        0
    };
    // Finite keys are below u32::MAX, so "no thres1" matches nothing.
    let t1 = s.t1.unwrap_or(u32::MAX);
    let mut j2 = 0;
    out_idx.reserve(k);
    let mut emit = |i: u32, m: u32| {
        if m >= t1 {
            out_idx.push(i);
        } else {
            if (start..start + need).contains(&j2) {
                out_idx.push(i);
            }
            j2 += 1;
        }
    };
    match &work {
        // thres2 can be below the floor only if no count ever exceeded k (thres2 = 0).
        Working::Compact { floor, .. } if (s.t2 as i32) < *floor => {
            scan_at_least(x, s.t2, |i, m| emit(i as u32, m))
        }
        Working::Full => scan_at_least(x, s.t2, |i, m| emit(i as u32, m)),
        Working::Compact { idx, keys, .. } => {
            for (&i, &m) in idx.iter().zip(keys) {
                if m as u32 >= s.t2 {
                    emit(i, m as u32);
                }
            }
        }
    }
    debug_assert_eq!(out_idx.len(), k);
    let upper = s.t1.map_or(f32::INFINITY, f32::from_bits);
    (f32::from_bits(s.t2), upper)
}

impl Selector for MsTopK {
    fn id(&self) -> CodecId {
        CodecId::MsTopK
    }
    fn density(&self) -> f64 {
        self.density
    }
    fn extra(&self) -> u32 {
        self.samplings
    }
    fn spec(&self) -> String {
        format!(
            "mstopk:density={},samplings={}",
            self.density, self.samplings
        )
    }
    fn select(&self, x: &[f32], k: usize, rng: &mut Rng, out: &mut Vec<u32>) {
        mstopk_select(x, k, self.samplings, rng.key(), out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::sparse::k_of;
    use crate::codec::sparse::tests::check_codec;
    use crate::codec::Codec;
    use crate::codec::CodecSpec;

    /// Algorithm 1 as printed (with thres1 starting at +∞), one full pass per sampling and float
    /// comparisons: the reference for the fast version.
    fn reference(x: &[f32], k: usize, samplings: u32, site_key: u64) -> (Vec<u32>, f32) {
        let (mean, umax) = mean_max(x, None);
        let u = umax as f64;
        let mean = mean.min(u);
        let a: Vec<f32> = x.iter().map(|v| v.abs()).collect();
        let (mut l, mut r) = (0.0f64, 1.0f64);
        let (mut k1, mut k2) = (0usize, x.len());
        let (mut thres1, mut thres2) = (f32::INFINITY, 0.0f32);
        for _ in 0..samplings {
            let ratio = l + (r - l) / 2.0;
            let thres = (mean + ratio * (u - mean)) as f32;
            let nnz = a.iter().filter(|&&v| v >= thres).count();
            if nnz <= k {
                r = ratio;
                if nnz > k1 {
                    k1 = nnz;
                    thres1 = thres;
                }
            } else {
                l = ratio;
                if nnz < k2 {
                    k2 = nnz;
                    thres2 = thres;
                }
            }
        }
        let i1: Vec<u32> = (0..x.len() as u32)
            .filter(|&i| a[i as usize] >= thres1)
            .collect();
        let i2: Vec<u32> = (0..x.len() as u32)
            .filter(|&i| a[i as usize] < thres1 && a[i as usize] >= thres2)
            .collect();
        assert_eq!(i1.len(), k1);
        let need = k - k1;
        let start = if need > 0 {
            (draw(site_key, 0) % (i2.len() - need + 1) as u64) as usize
        } else {
            0
        };
        let mut out = i1;
        out.extend_from_slice(&i2[start..start + need]);
        out.sort_unstable();
        (out, thres1)
    }

    /// Test inputs of several shapes.
    fn data(kind: u32, n: usize, seed: u64) -> Vec<f32> {
        let mut r = Rng::from_u64(seed);
        (0..n)
            .map(|i| match kind {
                // Gaussian (Box–Muller).
                0 => {
                    let u1 = (r.next_f32() as f64).max(1e-12);
                    let u2 = r.next_f32() as f64;
                    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
                }
                1 => r.next_f32() * 2.0 - 1.0,
                // Many ties.
                2 => (r.below(7) as f32 - 3.0) * 0.25,
                // All equal magnitudes.
                3 => {
                    if i % 2 == 0 {
                        0.5
                    } else {
                        -0.5
                    }
                }
                4 => 0.0,
                // One huge outlier over tiny values: the early thresholds count nothing.
                _ => {
                    if i == n / 2 {
                        1e30
                    } else {
                        r.next_f32() * 1e-3
                    }
                }
            })
            .collect()
    }

    fn check_selection(x: &[f32], k: usize, idx: &[u32], (lo, hi): (f32, f32)) {
        let k = k.min(x.len());
        assert_eq!(idx.len(), k);
        assert!(idx.windows(2).all(|w| w[0] < w[1]), "not ascending");
        assert!(idx.last().is_none_or(|&i| (i as usize) < x.len()));
        let mut chosen = vec![false; x.len()];
        for &i in idx {
            chosen[i as usize] = true;
            assert!(
                x[i as usize].abs() >= lo,
                "selected {} < {lo}",
                x[i as usize]
            );
        }
        for (i, &v) in x.iter().enumerate() {
            if !chosen[i] {
                assert!(
                    v.abs() < hi || (k == 0 && hi.is_infinite()),
                    "left {v} ≥ {hi}"
                );
            }
        }
        if k > 0 && k < x.len() {
            let mut mags: Vec<f32> = x.iter().map(|v| v.abs()).collect();
            mags.sort_by(|a, b| b.total_cmp(a));
            let (kth, next) = (mags[k - 1], mags[k]);
            assert!(lo <= kth, "k-th {kth} below {lo}");
            assert!(next < hi, "(k+1)-th {next} not below {hi}");
        }
    }

    #[test]
    fn selects_exactly_k_like_algorithm_1() {
        let mut idx = vec![];
        for kind in 0..6 {
            for n in [0usize, 1, 2, 5, 100, 1000, 20_000] {
                for k in [
                    0,
                    1,
                    2,
                    n / 100,
                    n / 10,
                    n / 2,
                    n.saturating_sub(1),
                    n,
                    n + 1,
                ] {
                    for samplings in [1, 2, 3, 5, 30, 200] {
                        let seed = (kind as u64) << 40 | (n as u64) << 16 | k as u64;
                        let x = data(kind, n, seed);
                        let b = mstopk_select(&x, k, samplings, seed, &mut idx);
                        check_selection(&x, k, &idx, b);
                        if k > 0 && k < n {
                            let (want, hi) = reference(&x, k, samplings, seed);
                            assert_eq!(idx, want, "kind {kind} n {n} k {k} samplings {samplings}");
                            assert_eq!(b.1, hi);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn large_chunks_take_the_wide_and_compacted_paths() {
        let mut idx = vec![];
        let n = 1_000_003;
        for (kind, d, samplings) in [
            (0, 0.001, 30),
            (0, 0.01, 30),
            // One or two samplings end with thres2 below the guessed floor: the search reruns.
            (0, 0.001, 1),
            (0, 0.01, 2),
            (1, 0.3, 30),
            (2, 0.001, 30),
            (5, 0.001, 30),
        ] {
            let x = data(kind, n, 9);
            let k = k_of(d, n);
            let b = mstopk_select(&x, k, samplings, 1, &mut idx);
            check_selection(&x, k, &idx, b);
            let (want, hi) = reference(&x, k, samplings, 1);
            assert_eq!(idx, want, "kind {kind} density {d} samplings {samplings}");
            assert_eq!(b.1, hi);
            if kind == 0 && samplings == 30 {
                // 30 samplings pin the Gaussian threshold closely.
                assert!(b.1 - b.0 < 1e-3 * b.1, "bracket {b:?}");
            }
        }
    }

    #[test]
    fn non_finite_inputs_fall_back_to_exact_topk() {
        let mut idx = vec![];
        let x = [1.0, f32::NAN, -5.0, f32::INFINITY, 0.5, 2.0];
        let b = mstopk_select(&x, 3, 30, 0, &mut idx);
        assert_eq!(idx, [1, 2, 3]);
        assert_eq!(b, (5.0, 5.0));
        let x = [f32::MAX, f32::MAX, -f32::MAX, 1.0];
        mstopk_select(&x, 2, 30, 0, &mut idx);
        assert_eq!(idx.len(), 2);
    }

    #[test]
    fn codec_round_trips_and_rejects_corruption() {
        for d in [0.001, 0.1, 0.5, 1.0] {
            let c = MsTopK::new(d, 30).unwrap();
            for n in [0, 1, 2, 5, 100, 1001] {
                check_codec(&c, n, n as u64 + 7);
            }
        }
        check_codec(&MsTopK::new(0.01, 1).unwrap(), 5000, 3);
    }

    #[test]
    fn specs_parse_and_round_trip() {
        let s = CodecSpec::parse("mstopk:density=0.01").unwrap();
        assert_eq!(s.to_string(), "mstopk:density=0.01,samplings=30");
        assert_eq!(s.codec().id(), CodecId::MsTopK);
        assert!(s.codec().is_sparse());
        for text in [
            "mstopk:density=0.001,samplings=1",
            "mstopk:density=0.5,samplings=1000,ef=1",
        ] {
            let s = CodecSpec::parse(text).unwrap();
            assert_eq!(s.to_string(), text);
            assert_eq!(CodecSpec::parse(&s.to_string()).unwrap(), s);
        }
        assert_ne!(
            MsTopK::new(0.01, 30).unwrap().params(),
            MsTopK::new(0.01, 31).unwrap().params()
        );
        for (text, needle) in [
            ("mstopk", "density is required"),
            ("mstopk:samplings=3", "density is required"),
            ("mstopk:density=0", "density must be in (0, 1]"),
            ("mstopk:density=1.5", "density must be in (0, 1]"),
            ("mstopk:density=abc", "density must be a number"),
            (
                "mstopk:density=0.1,samplings=0",
                "samplings must be in 1..=1000",
            ),
            (
                "mstopk:density=0.1,samplings=1001",
                "samplings must be in 1..=1000",
            ),
            (
                "mstopk:density=0.1,samplings=x",
                "samplings must be an integer",
            ),
        ] {
            let e = CodecSpec::parse(text).unwrap_err().to_string();
            assert!(e.contains(needle), "{text}: {e}");
        }
        assert!(MsTopK::new(0.1, 0).is_err());
    }
}
