//! Optimal tensor fusion for compression (Cupcake, MLSys 2023).
//!
//! Given a profile, a cost model, a link and one codec (or none), choose the cut of the tensors
//! into consecutive groups that minimises the simulated iteration time ([`crate::sim`]).
//!
//! - [`algorithm1`]: the paper's Algorithm 1 (recursive search with its two prunings: the
//!   optimistic-outcome bound, Insight #1 / Eq. (4), and the `j*` rule, Insight #2 / Eq. (5)).
//!   Exponential in the worst case, so it takes a budget of explored cases. Compute stream
//!   only, and affine links only (see below).
//! - [`optimal_fusion`]: an exact dynamic program over fusion boundaries. After a prefix of
//!   tensors `0..k` has been cut into groups, all that matters for the rest is the pair
//!   (compute/compression stream free at, channel free at): every later event is a
//!   non-decreasing function of both. So for each prefix it keeps only the Pareto front of such
//!   pairs (a state that is no earlier in both coordinates than another can be dropped), plus
//!   a lower-bound cut against the best baseline. Polynomial: O(n² · front) steps.
//! - [`exhaustive`]: all 2^(n−1) fusions through the simulator, the reference for tests.
//!
//! # When each is optimal
//!
//! [`optimal_fusion`] and [`exhaustive`] are exact for every cost model the crate accepts (a
//! link's line or its measured curve, [`CostModel::measured`]) and both [`CompressOn`] models.
//!
//! [`algorithm1`] is exact, with the same iteration time as those two (up to float rounding;
//! ties between plans may be broken differently), when the planned link's cost is affine: its
//! line `α + β·bytes` with no measured points ([`LinkCost::is_line`]). Compression and
//! decompression are always lines, α ≥ 0. It relies on the link being a line twice, with
//! g(x) the link's seconds for x wire bytes:
//! - Eq. (4) bounds the rest `j..n` by the rest fused into one group, which needs
//!   g(x) + g(y) ≥ g(x + y) (subadditivity, from α ≥ 0);
//! - Eq. (5) skips first groups `k..j` shorter than `j*`: moving the boundary between `k..j` and
//!   the next group `j..l` forward to `j*` (or merging the two when `l ≤ j*`) leaves the
//!   compute stream as it was and the channel no later, because the two groups' channel time
//!   g(x + d) + g(y − d) equals g(x) + g(y), which for all sizes holds of a line only.
//!
//! A measured curve breaks both: on 600 random cases of 1–12 tensors with bent, noisy curves
//! (`tests::with_curve`), the search as written was up to 30% slower than the optimum, 47 times
//! above it (with only the `j*` rule: 30%; with only Eq. (4): 10%). So [`algorithm1`] refuses a
//! link with measured points ([`Error::Unsupported`], naming the link); use [`optimal_fusion`]
//! there.

use crate::cost::{CodecCost, CostModel};
use crate::curve::LinkCost;
use crate::fusion::Plan;
use crate::profile::Profile;
use crate::sim::{simulate, CompressOn};
use qccl::{Error, Result};

/// A fusion found by a planner.
#[derive(Clone, Debug, PartialEq)]
pub struct Fusion {
    /// The groups (all with the requested codec), link and compression stream.
    pub plan: Plan,
    /// Its iteration time in seconds, from the planner's own arithmetic (equal to
    /// [`simulate`]'s up to float rounding).
    pub time: f64,
    /// Work done: recursive cases examined (Algorithm 1), states generated (DP), or plans
    /// simulated (exhaustive).
    pub explored: u64,
}

/// Group costs over half-open tensor ranges `k..j`, from prefix sums, so every query is O(1).
struct Costs {
    n: usize,
    /// `bp[j]` = backprop seconds of tensors `0..j` (tensor `j−1` is ready at `bp[j]` without
    /// compression delays).
    bp: Vec<f64>,
    /// `bytes[j]` = f32 bytes of tensors `0..j`.
    bytes: Vec<f64>,
    link: LinkCost,
    codec: Option<CodecCost>,
    on: CompressOn,
}

impl Costs {
    fn new(
        profile: &Profile,
        cost: &CostModel,
        link: Option<&str>,
        codec: Option<&str>,
        on: CompressOn,
    ) -> Result<Self> {
        profile.validate()?;
        cost.validate()?;
        let mut bp = vec![0.0];
        let mut bytes = vec![0.0];
        for t in &profile.tensors {
            bp.push(bp.last().unwrap() + t.backprop);
            bytes.push(bytes.last().unwrap() + t.bytes() as f64);
        }
        Ok(Costs {
            n: profile.len(),
            bp,
            bytes,
            link: cost.link_cost(link)?,
            codec: codec.map(|c| cost.codec(c).copied()).transpose()?,
            on,
        })
    }

    /// Backprop seconds of tensors `k..j`: B(k, j−1) in the paper.
    fn b(&self, k: usize, j: usize) -> f64 {
        self.bp[j] - self.bp[k]
    }

    fn bytes(&self, k: usize, j: usize) -> f64 {
        self.bytes[j] - self.bytes[k]
    }

    /// Compression time of the group `k..j` (0 for an empty range or no codec): Cupcake's h.
    fn h(&self, k: usize, j: usize) -> f64 {
        match &self.codec {
            Some(c) if j > k => c.compress.time(self.bytes(k, j)),
            _ => 0.0,
        }
    }

    /// Channel occupancy of the group `k..j`: communication (Cupcake's g) plus decompression,
    /// which runs on the channel in the simulator's model. 0 for an empty range.
    fn ch(&self, k: usize, j: usize) -> f64 {
        if j <= k {
            return 0.0;
        }
        let bytes = self.bytes(k, j);
        match &self.codec {
            Some(c) => self.link.time(c.ratio * bytes) + c.decompress.time(bytes),
            None => self.link.time(bytes),
        }
    }

    /// A lower bound on the channel occupancy of tensors `k..j` however they are cut into
    /// groups: the fused group's for a line (α ≥ 0 makes costs subadditive), the curve's
    /// bound for a measured link ([`LinkCost::fused_lower_bound`]).
    fn ch_lower(&self, k: usize, j: usize) -> f64 {
        if j <= k {
            return 0.0;
        }
        let bytes = self.bytes(k, j);
        match &self.codec {
            Some(c) => self.link.fused_lower_bound(c.ratio * bytes) + c.decompress.time(bytes),
            None => self.link.fused_lower_bound(bytes),
        }
    }

    /// State after appending the group `k..j` to a prefix in state `(a, c)`: `a` = compute
    /// stream (Compute) or compression stream (Separate) free at, `c` = channel free at.
    /// Mirrors [`simulate`]; a prefix that ends at `k` has backprop done at `bp[k]` (Separate)
    /// or at `a` (Compute).
    fn step(&self, a: f64, c: f64, k: usize, j: usize) -> (f64, f64) {
        let (a, ready) = match self.on {
            CompressOn::Compute => {
                let a = a + self.b(k, j) + self.h(k, j);
                (a, a)
            }
            CompressOn::Separate if self.codec.is_some() => {
                let a = f64::max(a, self.bp[j]) + self.h(k, j);
                (a, a)
            }
            CompressOn::Separate => (a, self.bp[j]),
        };
        (a, f64::max(c, ready) + self.ch(k, j))
    }

    /// Iteration time of a state covering all tensors.
    fn finish(&self, a: f64, c: f64) -> f64 {
        f64::max(c, f64::max(a, self.bp[self.n]))
    }

    /// Iteration time of the groups ending at `ends`, starting from state `(a, c)` at `k`:
    /// f(M + ends) in the paper.
    fn eval_from(&self, mut a: f64, mut c: f64, mut k: usize, ends: &[usize]) -> f64 {
        for &j in ends {
            (a, c) = self.step(a, c, k, j);
            k = j;
        }
        self.finish(a, c)
    }

    /// A lower bound on the iteration time of any completion of a prefix `0..j` in state
    /// `(a, c)`. The rest, however cut, needs at least [`Self::ch_lower`] on the channel and
    /// the compression time of the rest fused into one group (compression is linear with
    /// α ≥ 0, so subadditive), and the last group (which holds tensor n−1, and costs at least
    /// what that tensor alone does: link costs never decrease with bytes) goes on the channel
    /// only after it is compressed.
    fn lower_bound(&self, a: f64, c: f64, j: usize) -> f64 {
        let n = self.n;
        if j == n {
            return self.finish(a, c);
        }
        let last = self.ch(n - 1, n);
        let compressed_by = match self.on {
            CompressOn::Compute => a + self.b(j, n) + self.h(j, n),
            CompressOn::Separate => f64::max(a + self.h(j, n), self.bp[n] + self.h(n - 1, n)),
        };
        f64::max(c + self.ch_lower(j, n), compressed_by + last)
    }

    fn plan(&self, ends: &[usize], link: Option<&str>, codec: Option<&str>) -> Plan {
        Plan::from_ends(ends, codec).on(link, self.on)
    }

    /// The best of the baseline fusions (layer-wise, single group, even splits, 25 MB
    /// buckets): an achievable time that bounds the searches from above.
    fn best_baseline(&self, profile: &Profile) -> (Vec<usize>, f64) {
        let mut cands = vec![
            Plan::layer_wise(self.n, None).ends(),
            Plan::single(self.n, None).ends(),
            Plan::buckets(profile, 25 << 20, None).ends(),
        ];
        for parts in 2..=8 {
            cands.push(Plan::even_split(self.n, parts, None).ends());
        }
        cands
            .into_iter()
            .map(|e| {
                let t = self.eval_from(0.0, 0.0, 0, &e);
                (e, t)
            })
            .min_by(|x, y| x.1.total_cmp(&y.1))
            .unwrap()
    }
}

/// Cupcake's Algorithm 1, as in the paper. It always plans for compression on the compute
/// stream (the paper's model, [`CompressOn::Compute`]): its bounds (`M.comp`, the optimistic
/// outcome) assume backprop and compression share one stream, so there is no Separate variant;
/// use [`optimal_fusion`] for that.
///
/// Faithful to the paper: `Main` enumerates the first group; `FindOptFusion(M, k)` starts from
/// "the rest as one group" (lines 7–8), skips first groups shorter than `j*` (the longest whose
/// backprop plus compression fits in `M.delay`, lines 9–16), and skips a case when its optimistic
/// outcome (lines 19–21) exceeds the best time found so far. Two details the paper leaves open:
/// - `global_opt` is bootstrapped with the better of the single group and two even halves (the
///   paper's suggested heuristic). The single group is needed for exactness: as written,
///   Algorithm 1 only records strategies inside its loop, which never produces it.
/// - Communication cost g is the channel occupancy of the simulator (communication plus
///   decompression), which keeps the bounds valid.
///
/// Exact only for an affine link (see the module docs, "When each is optimal"): a link with
/// measured points in `cost` ([`CostModel::measured`]) is refused with [`Error::Unsupported`]
/// naming it; [`optimal_fusion`] is exact there.
///
/// `budget` caps the number of recursive cases examined; past it the search stops with
/// [`Error::Unsupported`] (the algorithm is exponential in the worst case).
pub fn algorithm1(
    profile: &Profile,
    cost: &CostModel,
    link: Option<&str>,
    codec: Option<&str>,
    budget: Option<u64>,
) -> Result<Fusion> {
    let s = Costs::new(profile, cost, link, codec, CompressOn::Compute)?;
    if !s.link.is_line() {
        return Err(Error::Unsupported(format!(
            "Cupcake Algorithm 1 needs an affine link cost (alpha + beta * bytes), but link {:?} \
             has measured points (a curve), on which its prunings (the optimistic outcome, \
             Eq. (4), and the j* rule, Eq. (5)) can cut the optimum; use optimal_fusion, which \
             is exact for any cost model",
            link.unwrap_or(&cost.default_link)
        )));
    }
    search1(&s, link, codec, budget)
}

/// Algorithm 1's search on any link (on a curve its prunings may cut the optimum, see
/// [`algorithm1`]).
fn search1(
    s: &Costs,
    link: Option<&str>,
    codec: Option<&str>,
    budget: Option<u64>,
) -> Result<Fusion> {
    let n = s.n;
    if n == 0 {
        return Ok(Fusion {
            plan: s.plan(&[], link, codec),
            time: 0.0,
            explored: 0,
        });
    }
    let single = vec![n];
    let halves = Plan::even_split(n, 2, None).ends();
    let (t1, t2) = (
        s.eval_from(0.0, 0.0, 0, &single),
        s.eval_from(0.0, 0.0, 0, &halves),
    );
    let (global_ends, global_time) = if t2 < t1 { (halves, t2) } else { (single, t1) };
    let mut search = Alg1 {
        s,
        global_ends,
        global_time,
        explored: 0,
        budget: budget.unwrap_or(u64::MAX),
    };
    // Main(): every form of x0 = fuse(0, k−1).
    let mut m = Vec::with_capacity(n);
    for k in 1..=n {
        let (a, c) = s.step(0.0, 0.0, 0, k);
        m.push(k);
        search.find(&mut m, a, c, k)?;
        m.pop();
    }
    Ok(Fusion {
        plan: s.plan(&search.global_ends, link, codec),
        time: search.global_time,
        explored: search.explored,
    })
}

struct Alg1<'a> {
    s: &'a Costs,
    global_ends: Vec<usize>,
    global_time: f64,
    explored: u64,
    budget: u64,
}

impl Alg1<'_> {
    /// FindOptFusion(M, k): `m` holds the ends of M's groups (tensors `0..k`), `(a, c)` is
    /// M's state: `a` = M.comp (backprop of `0..k` plus all of M's compressions), `c` = when
    /// M's last group leaves the channel, so M.delay = c − a. Returns the local best ends for
    /// tensors `k..n` and its time.
    fn find(&mut self, m: &mut Vec<usize>, a: f64, c: f64, k: usize) -> Result<(Vec<usize>, f64)> {
        let s = self.s;
        let n = s.n;
        // Lines 7–8: the rest as one group.
        let mut local: Vec<usize> = if k < n { vec![n] } else { vec![] };
        let mut local_time = s.eval_from(a, c, k, &local);
        // Lines 9–16: j* (here as an exclusive end, so fuse(k, i) is k..i+1).
        let delay = c - a;
        let mut jstar = k + 1;
        for j in k + 1..=n {
            if s.b(k, j) + s.h(k, j) <= delay {
                jstar = j;
            } else {
                break;
            }
        }
        // Line 17: M.comp.
        let comp = a;
        for j in jstar..=n {
            // Lines 19–21: the optimistic outcome of x_a = k..j.
            let base = s.b(k, n) + s.h(k, j) + s.h(j, n);
            let cases = f64::max(s.b(k, j) + s.h(k, j), delay) + s.ch(k, j) + s.ch(j, n);
            let optim_outcome = comp + f64::max(base, cases);
            if optim_outcome > self.global_time {
                continue;
            }
            self.explored += 1;
            if self.explored > self.budget {
                return Err(Error::Unsupported(format!(
                    "Cupcake Algorithm 1 exceeded its budget of {} cases",
                    self.budget
                )));
            }
            // Lines 25–28.
            let (a2, c2) = s.step(a, c, k, j);
            m.push(j);
            let (rest, _) = self.find(m, a2, c2, j)?;
            m.pop();
            let mut cur = Vec::with_capacity(1 + rest.len());
            cur.push(j);
            cur.extend_from_slice(&rest);
            let cur_time = s.eval_from(a, c, k, &cur);
            // Lines 29–36.
            if cur_time < local_time {
                local_time = cur_time;
                local.clone_from(&cur);
            }
            if cur_time < self.global_time {
                self.global_time = cur_time;
                self.global_ends.clone_from(m);
                self.global_ends.extend_from_slice(&cur);
            }
        }
        Ok((local, local_time))
    }
}

/// One entry of a prefix's Pareto front.
#[derive(Clone, Copy)]
struct State {
    /// Compute stream (Compute) or compression stream (Separate) free at.
    a: f64,
    /// Channel free at.
    c: f64,
    /// The prefix this state extends (its last group is `from..this prefix`) and the index of
    /// the extended state in that prefix's front.
    from: u32,
    idx: u32,
}

/// The optimal fusion of `profile` for one codec (`None`: uncompressed groups) on `link`
/// (`None`: the cost model's default), by dynamic programming over fusion boundaries with
/// Pareto pruning on (stream-free, channel-free) states. Exact for both [`CompressOn`] models.
pub fn optimal_fusion(
    profile: &Profile,
    cost: &CostModel,
    link: Option<&str>,
    codec: Option<&str>,
    on: CompressOn,
) -> Result<Fusion> {
    let s = Costs::new(profile, cost, link, codec, on)?;
    let n = s.n;
    if n == 0 {
        return Ok(Fusion {
            plan: s.plan(&[], link, codec),
            time: 0.0,
            explored: 0,
        });
    }
    // An achievable time, loosened by a hair so float rounding in the bounds cannot cut the
    // optimum (whose lower bounds are all <= its time <= this).
    let (_, base_time) = s.best_baseline(profile);
    let ub = base_time * (1.0 + 1e-9) + 1e-15;

    let mut fronts: Vec<Vec<State>> = Vec::with_capacity(n + 1);
    fronts.push(vec![State {
        a: 0.0,
        c: 0.0,
        from: 0,
        idx: 0,
    }]);
    let mut cands: Vec<State> = Vec::new();
    let mut explored = 0u64;
    for j in 1..=n {
        cands.clear();
        for (k, front) in fronts.iter().enumerate() {
            for (idx, st) in front.iter().enumerate() {
                let (a, c) = s.step(st.a, st.c, k, j);
                explored += 1;
                if s.lower_bound(a, c, j) <= ub {
                    cands.push(State {
                        a,
                        c,
                        from: k as u32,
                        idx: idx as u32,
                    });
                }
            }
        }
        // Pareto front: by increasing a, keep a state only if its c beats every earlier one.
        cands.sort_unstable_by(|x, y| x.a.total_cmp(&y.a).then(x.c.total_cmp(&y.c)));
        let mut front = Vec::new();
        let mut best_c = f64::INFINITY;
        for st in &cands {
            if st.c < best_c {
                best_c = st.c;
                front.push(*st);
            }
        }
        fronts.push(front);
    }

    let (idx, best) = fronts[n]
        .iter()
        .enumerate()
        .min_by(|x, y| s.finish(x.1.a, x.1.c).total_cmp(&s.finish(y.1.a, y.1.c)))
        .ok_or_else(|| Error::Internal("fusion DP lost every state".into()))?;
    let time = s.finish(best.a, best.c);
    let mut ends = vec![n];
    let (mut j, mut i) = (n, idx);
    while j > 0 {
        let st = fronts[j][i];
        (j, i) = (st.from as usize, st.idx as usize);
        if j > 0 {
            ends.push(j);
        }
    }
    ends.reverse();
    Ok(Fusion {
        plan: s.plan(&ends, link, codec),
        time,
        explored,
    })
}

/// The optimal fusion by brute force: every one of the 2^(n−1) fusions through [`simulate`].
/// For tests and tiny models only: refuses more than 20 tensors.
pub fn exhaustive(
    profile: &Profile,
    cost: &CostModel,
    link: Option<&str>,
    codec: Option<&str>,
    on: CompressOn,
) -> Result<Fusion> {
    let n = profile.len();
    if n > 20 {
        return Err(Error::InvalidArgument(format!(
            "exhaustive fusion of {n} tensors (max 20)"
        )));
    }
    if n == 0 {
        let plan = Plan::single(0, codec).on(link, on);
        return Ok(Fusion {
            time: simulate(profile, cost, &plan)?.time,
            plan,
            explored: 1,
        });
    }
    let mut best: Option<Fusion> = None;
    for mask in 0u32..1 << (n - 1) {
        // Bit i set: a group boundary after tensor i.
        let mut ends: Vec<usize> = (0..n - 1)
            .filter(|i| mask >> i & 1 == 1)
            .map(|i| i + 1)
            .collect();
        ends.push(n);
        let plan = Plan::from_ends(&ends, codec).on(link, on);
        let time = simulate(profile, cost, &plan)?.time;
        if best.as_ref().is_none_or(|b| time < b.time) {
            best = Some(Fusion {
                plan,
                time,
                explored: 0,
            });
        }
    }
    let mut best = best.unwrap();
    best.explored = 1 << (n - 1);
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::Linear;
    use crate::models;
    use crate::profile::TensorProfile;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn log_uniform(rng: &mut StdRng, lo: f64, hi: f64) -> f64 {
        (rng.gen_range(lo.ln()..hi.ln())).exp()
    }

    /// A random model of `n` tensors and a random cost model with a codec "c", scaled so that
    /// backprop, compression overheads and communication are of comparable size (that is where
    /// the fusion trade-off is non-trivial).
    fn random_case(seed: u64, n: usize) -> (Profile, CostModel) {
        let mut rng = StdRng::seed_from_u64(seed);
        let per_elem = log_uniform(&mut rng, 1e-10, 1e-8);
        let tensors = (0..n)
            .map(|i| {
                // Some seeds use equal sizes, to exercise ties.
                let elems = if seed.is_multiple_of(7) {
                    1000
                } else {
                    log_uniform(&mut rng, 10.0, 2e6) as usize
                };
                let noise = if seed.is_multiple_of(3) {
                    1.0
                } else {
                    rng.gen_range(0.2..5.0)
                };
                TensorProfile {
                    name: format!("t{i}"),
                    elems,
                    backprop: 1e-5 + per_elem * elems as f64 * noise,
                }
            })
            .collect();
        let alpha = |rng: &mut StdRng| {
            if rng.gen_bool(0.1) {
                0.0
            } else {
                log_uniform(rng, 1e-6, 2e-3)
            }
        };
        let link = Linear::new(alpha(&mut rng), 1.0 / log_uniform(&mut rng, 1e8, 1e10));
        let codec = CodecCost {
            compress: Linear::new(alpha(&mut rng), 1.0 / log_uniform(&mut rng, 1e9, 3e10)),
            decompress: Linear::new(alpha(&mut rng), 1.0 / log_uniform(&mut rng, 1e9, 3e10)),
            ratio: log_uniform(&mut rng, 0.01, 0.5),
        };
        let cost = CostModel::with_link("l", link).codec_entry("c", codec);
        (
            Profile {
                note: String::new(),
                tensors,
            },
            cost,
        )
    }

    fn same(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs()) + 1e-15
    }

    /// The planner's reported time is the simulator's time for its plan.
    fn check_consistent(p: &Profile, cost: &CostModel, f: &Fusion) {
        let t = simulate(p, cost, &f.plan).unwrap().time;
        assert!(same(t, f.time), "reported {} simulated {t}", f.time);
    }

    #[test]
    fn algorithm1_and_dp_match_brute_force_on_random_models() {
        let (mut cases, mut nontrivial) = (0, 0);
        for seed in 0..600u64 {
            // Every size 1..=14 many times, with extra weight on the largest.
            let n = if seed < 280 {
                1 + (seed as usize % 14)
            } else {
                10 + (seed as usize % 5)
            };
            let (p, cost) = random_case(seed, n);
            for codec in [Some("c"), None] {
                for on in [CompressOn::Compute, CompressOn::Separate] {
                    let brute = exhaustive(&p, &cost, None, codec, on).unwrap();
                    let dp = optimal_fusion(&p, &cost, None, codec, on).unwrap();
                    assert!(
                        same(dp.time, brute.time),
                        "seed {seed} n {n} {codec:?} {on:?}: dp {} brute {}",
                        dp.time,
                        brute.time
                    );
                    check_consistent(&p, &cost, &dp);
                    // Count optima strictly better than every baseline: the cases where the
                    // search matters (the random costs must produce plenty of them).
                    let base = baselines(&p, codec, on)
                        .iter()
                        .map(|b| simulate(&p, &cost, b).unwrap().time)
                        .fold(f64::INFINITY, f64::min);
                    if brute.time < base * (1.0 - 1e-9) {
                        nontrivial += 1;
                    }
                    if on == CompressOn::Compute {
                        let a1 = algorithm1(&p, &cost, None, codec, None).unwrap();
                        assert!(
                            same(a1.time, brute.time),
                            "seed {seed} n {n} {codec:?}: alg1 {} brute {} ({:?} vs {:?})",
                            a1.time,
                            brute.time,
                            a1.plan.ends(),
                            brute.plan.ends()
                        );
                        check_consistent(&p, &cost, &a1);
                    }
                    cases += 1;
                }
            }
        }
        assert_eq!(cases, 600 * 4);
        assert!(
            nontrivial * 5 >= cases,
            "only {nontrivial} of {cases} optima beat the baselines"
        );
        println!("{nontrivial} of {cases} optima beat every baseline");
    }

    /// `cost` with measured points on its link that bend it upwards (fusing can cost more than
    /// the parts) and add noise (a bigger size may measure faster), as calibrations produce.
    fn with_curve(mut cost: CostModel, seed: u64) -> CostModel {
        let mut rng = StdRng::seed_from_u64(seed ^ 0xc0ffee);
        let line = *cost.link(None).unwrap();
        let bend = rng.gen_range(0.0..3.0);
        let points = (0..8)
            .map(|i| {
                let x = 10f64.powf(2.0 + i as f64 * 0.9);
                let noise = rng.gen_range(0.8..1.2);
                [x, line.time(x) * (1.0 + bend * x / 1e8) * noise]
            })
            .collect();
        cost.measured.insert("l".into(), points);
        cost
    }

    /// Algorithm 1 refused, naming the link and the DP.
    fn assert_refused(r: Result<Fusion>, link: &str) {
        match r {
            Err(Error::Unsupported(m)) => assert!(
                m.contains(&format!("link {link:?}")) && m.contains("optimal_fusion"),
                "{m}"
            ),
            other => panic!("Algorithm 1 on the curve of {link:?}: {other:?}"),
        }
    }

    #[test]
    fn on_measured_curves_dp_matches_brute_force_and_algorithm1_refuses() {
        for seed in 0..300u64 {
            let n = 1 + (seed as usize % 12);
            let (p, cost) = random_case(seed, n);
            let cost = with_curve(cost, seed);
            for codec in [Some("c"), None] {
                for on in [CompressOn::Compute, CompressOn::Separate] {
                    let brute = exhaustive(&p, &cost, None, codec, on).unwrap();
                    let dp = optimal_fusion(&p, &cost, None, codec, on).unwrap();
                    assert!(
                        same(dp.time, brute.time),
                        "seed {seed} n {n} {codec:?} {on:?}: dp {} brute {}",
                        dp.time,
                        brute.time
                    );
                    check_consistent(&p, &cost, &dp);
                }
                assert_refused(algorithm1(&p, &cost, None, codec, None), "l");
                assert_refused(algorithm1(&p, &cost, Some("l"), codec, None), "l");
            }
        }
    }

    /// Why Algorithm 1 refuses curves: run anyway on the cases of the test above, its prunings
    /// cut the optimum, by up to 30% of the iteration time.
    #[test]
    fn algorithm1_prunings_cut_the_optimum_on_measured_curves() {
        let (mut worst, mut off, mut cases) = (0.0f64, 0, 0);
        for seed in 0..300u64 {
            let n = 1 + (seed as usize % 12);
            let (p, cost) = random_case(seed, n);
            let cost = with_curve(cost, seed);
            for codec in [Some("c"), None] {
                let s = Costs::new(&p, &cost, None, codec, CompressOn::Compute).unwrap();
                let a1 = search1(&s, None, codec, None).unwrap();
                check_consistent(&p, &cost, &a1);
                let brute = exhaustive(&p, &cost, None, codec, CompressOn::Compute).unwrap();
                assert!(a1.time >= brute.time * (1.0 - 1e-9));
                let gap = a1.time / brute.time - 1.0;
                worst = worst.max(gap);
                off += usize::from(gap > 1e-9);
                cases += 1;
            }
        }
        println!("Algorithm 1 on curves: {off} of {cases} above the optimum, worst +{worst:.3}");
        assert!(off > 0 && worst > 0.2, "{off} of {cases}, worst {worst}");
    }

    #[test]
    fn algorithm1_runs_where_the_planned_link_is_a_line() {
        let (p, cost) = random_case(11, 12);
        let line = *cost.link(None).unwrap();
        // A second link with a measured curve: planning on "l" is unaffected.
        let mut cost = cost;
        cost.links.insert("m".into(), line);
        cost.measured
            .insert("m".into(), vec![[1e3, 1e-3], [1e6, 5e-3], [1e8, 0.9]]);
        // One measured point is no curve (ignored, see `LinkCost::with_points`).
        cost.measured.insert("l".into(), vec![[1e6, 1.0]]);
        for codec in [Some("c"), None] {
            let brute = exhaustive(&p, &cost, None, codec, CompressOn::Compute).unwrap();
            let a1 = algorithm1(&p, &cost, None, codec, None).unwrap();
            assert!(same(a1.time, brute.time), "{} vs {}", a1.time, brute.time);
            assert_refused(algorithm1(&p, &cost, Some("m"), codec, None), "m");
        }
        // Refused before any search, even with nothing to plan.
        assert_refused(
            algorithm1(&Profile::default(), &cost, Some("m"), None, None),
            "m",
        );
    }

    fn baselines(p: &Profile, codec: Option<&str>, on: CompressOn) -> Vec<Plan> {
        let n = p.len();
        let mut v = vec![
            Plan::layer_wise(n, codec),
            Plan::single(n, codec),
            Plan::buckets(p, 25 << 20, codec),
            Plan::buckets(p, 4 << 20, codec),
        ];
        for parts in [2, 3, 4, 8, 16] {
            v.push(Plan::even_split(n, parts, codec));
        }
        v.into_iter().map(|pl| pl.on(None, on)).collect()
    }

    fn check_not_worse_than_baselines(p: &Profile, cost: &CostModel, f: &Fusion, on: CompressOn) {
        let codec = f.plan.groups.first().and_then(|g| g.codec.as_deref());
        for b in baselines(p, codec, on) {
            let t = simulate(p, cost, &b).unwrap().time;
            assert!(
                f.time <= t * (1.0 + 1e-9),
                "optimum {} worse than {:?}: {t}",
                f.time,
                b.ends()
            );
        }
    }

    #[test]
    fn never_worse_than_baselines_on_random_models() {
        for seed in 1000..1040u64 {
            let (p, cost) = random_case(seed, 40 + (seed as usize % 60));
            for on in [CompressOn::Compute, CompressOn::Separate] {
                let f = optimal_fusion(&p, &cost, None, Some("c"), on).unwrap();
                check_consistent(&p, &cost, &f);
                check_not_worse_than_baselines(&p, &cost, &f, on);
            }
            // Algorithm 1 agrees with the DP where it finishes within its budget.
            if let Ok(a1) = algorithm1(&p, &cost, None, Some("c"), Some(200_000)) {
                let dp = optimal_fusion(&p, &cost, None, Some("c"), CompressOn::Compute).unwrap();
                assert!(
                    same(a1.time, dp.time),
                    "seed {seed}: alg1 {} dp {}",
                    a1.time,
                    dp.time
                );
            }
        }
    }

    /// A 10 Gb/s-class link and a 1-bit sign codec with a kernel-launch-like fixed cost.
    fn sample_cost() -> CostModel {
        CostModel::with_link("tcp/sra", Linear::new(100e-6, 1.0 / 1.25e9)).codec_entry(
            "sign",
            CodecCost {
                compress: Linear::new(250e-6, 1.0 / 20e9),
                decompress: Linear::new(150e-6, 1.0 / 20e9),
                ratio: 1.0 / 32.0,
            },
        )
    }

    #[test]
    fn shipped_models_beat_or_match_baselines() {
        let cost = sample_cost();
        for (name, p) in models::shipped() {
            for codec in [Some("sign"), None] {
                for on in [CompressOn::Compute, CompressOn::Separate] {
                    let f = optimal_fusion(&p, &cost, None, codec, on).unwrap();
                    check_consistent(&p, &cost, &f);
                    check_not_worse_than_baselines(&p, &cost, &f, on);
                    assert!(f.plan.validate(&p, &cost).is_ok(), "{name}");
                }
            }
        }
    }

    #[test]
    fn algorithm1_plans_for_the_compute_stream_and_edge_cases() {
        // Algorithm 1 always plans for the compute stream.
        let (p, cost) = random_case(5, 6);
        let a1 = algorithm1(&p, &cost, None, Some("c"), None).unwrap();
        assert_eq!(a1.plan.compress_on, CompressOn::Compute);
        assert!(exhaustive(&models::resnet50(), &cost, None, None, CompressOn::Compute).is_err());
        let empty = Profile::default();
        assert_eq!(
            optimal_fusion(&empty, &cost, None, None, CompressOn::Compute)
                .unwrap()
                .time,
            0.0
        );
        assert_eq!(
            algorithm1(&empty, &cost, None, None, None).unwrap().time,
            0.0
        );
    }

    /// `cargo test --release -- --ignored resnet101`: the DP on the 314-tensor profile.
    #[test]
    #[ignore]
    fn resnet101_plan_time() {
        let p = models::resnet101();
        let cost = sample_cost();
        let t0 = std::time::Instant::now();
        let f = optimal_fusion(&p, &cost, None, Some("sign"), CompressOn::Compute).unwrap();
        let dt = t0.elapsed();
        println!(
            "resnet101: {} groups, {:.3} ms iteration, planned in {dt:?}",
            f.plan.groups.len(),
            f.time * 1e3
        );
        assert!(dt.as_secs_f64() < 0.1);
    }
}
