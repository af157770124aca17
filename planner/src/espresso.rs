//! Per-tensor compression strategy (Espresso, Wang et al., EuroSys 2023).
//!
//! For every gradient tensor, decide whether to compress it and, if so, with which codec and
//! [`Choice`] (divisible or indivisible scheme; for two-level jobs, compress the intra-machine
//! phases, the inter-machine phase or both). The objective is the simulated iteration time
//! ([`crate::sim`], with the plan's [`Topology`] and [`CostModel::sync`]); tensors are not fused
//! (Espresso decides per tensor: the plan is layer-wise).
//!
//! - [`espresso_algorithm1`]: the paper's Algorithm 1 (GPU compression decisions): tensors by
//!   decreasing size, ties broken towards the output layer; before the loop and after every
//!   decision, *Remove* rules out the uncompressed tensors communicated before a bubble of the
//!   channel; each remaining tensor gets the option (or none) that minimises the iteration time
//!   with every other decision fixed.
//! - [`espresso`]: Algorithm 1 followed by a local search (a deviation, see its docs) that
//!   escapes the single pass's local optima.
//! - [`exhaustive_espresso`]: every combination of options, the reference for small models.
//! - [`uniform`] / [`best_uniform`]: the baselines "compress nothing" and "compress everything
//!   with one option".
//!
//! Deviations from the paper:
//! - Dimension 2 (GPU or CPU per tensor) and Algorithm 2 (CPU offloading) are not modelled per
//!   tensor: where compression runs is the plan-wide [`CompressOn`] of the context.
//! - The option set is the simplified decision tree of [`Topology::choices`] (times the
//!   context's codecs), not the paper's full tree of compression/decompression positions.
//! - Remove's rule is exact in this model, not only a heuristic: a tensor communicated before
//!   a bubble (the channel idles, waiting for a later tensor to be ready) cannot shorten the
//!   iteration by being compressed — it only widens the bubble — and nothing decided later can
//!   close that bubble, because later decisions only delay readiness before it.

use crate::cost::{Choice, CostModel, Scheme, Topology};
use crate::fusion::{Group, Plan};
use crate::profile::Profile;
use crate::sim::{simulate, CompressOn, SimState, Stepper};
use qccl::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// The job Espresso plans for: ranks, links, candidate codecs, where compression runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EspressoCtx {
    /// Flat or two-level ranks (the intra link is named inside).
    pub topology: Topology,
    /// The flat (or inter-machine) link; `None`: the cost model's default.
    #[serde(default)]
    pub link: Option<String>,
    /// Candidate codecs (keys of [`CostModel::codecs`]); the paper uses one GC algorithm.
    pub codecs: Vec<String>,
    /// Where compression before communication runs.
    #[serde(default)]
    pub compress_on: CompressOn,
}

impl EspressoCtx {
    /// A flat job of `ranks` ranks on the default link, compression on the compute stream.
    pub fn flat(ranks: usize, codecs: &[&str]) -> Self {
        EspressoCtx {
            topology: Topology::Flat { ranks },
            link: None,
            codecs: codecs.iter().map(|c| c.to_string()).collect(),
            compress_on: CompressOn::Compute,
        }
    }

    /// A two-level job: `machines` × `local` ranks, `intra` link inside a machine, the default
    /// link across machines, compression on the compute stream.
    pub fn hierarchical(machines: usize, local: usize, intra: &str, codecs: &[&str]) -> Self {
        EspressoCtx {
            topology: Topology::Hierarchical {
                machines,
                local,
                intra: intra.to_string(),
            },
            ..Self::flat(2, codecs)
        }
    }

    /// Every compression option of one tensor (the paper's `C_gpu`): each codec with each of
    /// the topology's choices. "No compression" is not listed; it is always a candidate.
    pub fn options(&self) -> Vec<Decision> {
        let choices = self.topology.choices();
        self.codecs
            .iter()
            .flat_map(|c| {
                choices.iter().map(move |&choice| Decision {
                    codec: c.clone(),
                    choice,
                })
            })
            .collect()
    }

    /// A layer-wise plan with `decisions[i]` for tensor `i` (`None`: uncompressed).
    pub fn plan(&self, decisions: &[Option<Decision>]) -> Plan {
        let mut plan =
            Plan::layer_wise(decisions.len(), None).on(self.link.as_deref(), self.compress_on);
        plan.topology = Some(self.topology.clone());
        for (g, d) in plan.groups.iter_mut().zip(decisions) {
            if let Some(d) = d {
                g.codec = Some(d.codec.clone());
                g.choice = Some(d.choice);
            }
        }
        plan
    }
}

/// The compression option of one tensor.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Decision {
    /// Codec name.
    pub codec: String,
    /// Scheme and tiers.
    pub choice: Choice,
}

impl fmt::Display for Decision {
    /// `codec:scheme` for the flat (or inter-machine) scheme, `+intra` when the intra-machine
    /// phases are compressed too, `codec:intra` when only they are.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = |s: Scheme| match s {
            Scheme::AllGather => "allgather",
            Scheme::Divisible => "divisible",
        };
        match (self.choice.inter, self.choice.intra) {
            (Some(s), false) => write!(f, "{}:{}", self.codec, scheme(s)),
            (Some(s), true) => write!(f, "{}:{}+intra", self.codec, scheme(s)),
            (None, _) => write!(f, "{}:intra", self.codec),
        }
    }
}

/// A compression strategy and its simulated iteration time.
#[derive(Clone, Debug, PartialEq)]
pub struct EspressoPlan {
    /// Per tensor (profile order): its option, or `None` for no compression.
    pub decisions: Vec<Option<Decision>>,
    /// The layer-wise plan applying the decisions (feed it to [`simulate`]).
    pub plan: Plan,
    /// Simulated iteration time of `plan`, seconds.
    pub time: f64,
    /// Strategies whose iteration time was evaluated.
    pub evaluated: u64,
    /// Tensors ruled out by Remove (communicated before a bubble); 0 for the other planners.
    pub ruled_out: usize,
}

impl EspressoPlan {
    /// How many tensors and f32 bytes got each option (`"none"` for uncompressed), by label.
    pub fn summary(&self, profile: &Profile) -> BTreeMap<String, (usize, usize)> {
        let mut m: BTreeMap<String, (usize, usize)> = BTreeMap::new();
        for (d, t) in self.decisions.iter().zip(&profile.tensors) {
            let key = d
                .as_ref()
                .map_or_else(|| "none".to_string(), Decision::to_string);
            let e = m.entry(key).or_default();
            e.0 += 1;
            e.1 += t.bytes();
        }
        m
    }
}

/// The precomputed setting shared by the planners: options, one group per (tensor, option).
struct Setting<'a> {
    ctx: &'a EspressoCtx,
    options: Vec<Decision>,
    /// `groups[i][0]`: tensor `i` uncompressed; `groups[i][o + 1]`: with `options[o]`.
    groups: Vec<Vec<Group>>,
    template: Plan,
}

impl<'a> Setting<'a> {
    fn new(profile: &Profile, cost: &CostModel, ctx: &'a EspressoCtx) -> Result<Self> {
        profile.validate()?;
        cost.validate()?;
        if ctx.codecs.is_empty() {
            return Err(Error::InvalidArgument(
                "Espresso needs at least one codec".into(),
            ));
        }
        let options = ctx.options();
        // Validating the uniform plan of every option checks the links, the topology, the
        // codec names and the choices once, so the search can step unvalidated groups.
        let n = profile.len();
        ctx.plan(&vec![None; n]).validate(profile, cost)?;
        for d in &options {
            ctx.plan(&vec![Some(d.clone()); n.max(1)])
                .validate(&one_tensor_if_empty(profile), cost)?;
        }
        let groups = (0..n)
            .map(|i| {
                let none = Group {
                    start: i,
                    end: i + 1,
                    codec: None,
                    choice: None,
                };
                let mut v = vec![none.clone()];
                v.extend(options.iter().map(|d| Group {
                    codec: Some(d.codec.clone()),
                    choice: Some(d.choice),
                    ..none.clone()
                }));
                v
            })
            .collect();
        Ok(Setting {
            ctx,
            options,
            groups,
            template: ctx.plan(&[]),
        })
    }

    /// Decisions from option indices (0: none, `o + 1`: `options[o]`).
    fn decisions(&self, idx: &[usize]) -> Vec<Option<Decision>> {
        idx.iter()
            .map(|&o| o.checked_sub(1).map(|o| self.options[o].clone()))
            .collect()
    }

    /// The final plan for option indices, its time from [`simulate`] itself.
    fn finish(
        &self,
        profile: &Profile,
        cost: &CostModel,
        idx: &[usize],
        evaluated: u64,
        ruled_out: usize,
    ) -> Result<EspressoPlan> {
        let decisions = self.decisions(idx);
        let plan = self.ctx.plan(&decisions);
        let time = simulate(profile, cost, &plan)?.time;
        Ok(EspressoPlan {
            decisions,
            plan,
            time,
            evaluated,
            ruled_out,
        })
    }
}

/// Option validation needs a tensor to put the option on.
fn one_tensor_if_empty(profile: &Profile) -> Profile {
    if profile.is_empty() {
        let mut p = profile.clone();
        p.tensors.push(crate::profile::TensorProfile {
            name: String::new(),
            elems: 1,
            backprop: 0.0,
        });
        p
    } else {
        profile.clone()
    }
}

/// F(S) with Remove's bubble detection: the iteration time of option indices `idx` and the
/// index of the last tensor whose communication waited for it to be ready after the channel
/// had gone idle (0 if none).
fn evaluate(sim: &Stepper, s: &Setting, idx: &[usize]) -> Result<(f64, usize)> {
    let mut st = SimState::default();
    let mut last_bubble = 0;
    for (i, &o) in idx.iter().enumerate() {
        let before = st.channel_free();
        let ev = sim.step(&mut st, &s.groups[i][o])?;
        // Relative tolerance: a "bubble" made of float rounding is no bubble.
        if i > 0 && ev.comm.0 > before + 1e-12 * before.abs().max(1e-12) {
            last_bubble = i;
        }
    }
    Ok((sim.finish(&st), last_bubble))
}

/// Lines 2–3 of Algorithm 1: decreasing size; equal sizes closest to the output layer (lowest
/// backprop index) first. A stable sort on size alone gives exactly that.
fn size_order(profile: &Profile) -> Vec<usize> {
    let mut order: Vec<usize> = (0..profile.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(profile.tensors[i].elems));
    order
}

/// Espresso's Algorithm 1 exactly as in the paper (see the module docs): one pass over the
/// tensors in O(n² · options) simulated group steps. [`espresso`] adds a local search.
pub fn espresso_algorithm1(
    profile: &Profile,
    cost: &CostModel,
    ctx: &EspressoCtx,
) -> Result<EspressoPlan> {
    let s = Setting::new(profile, cost, ctx)?;
    let sim = Stepper::new(profile, cost, &s.template)?;
    let (idx, _, evaluated, ruled_out) = algorithm1(&sim, &s, profile)?;
    s.finish(profile, cost, &idx, evaluated, ruled_out)
}

/// Espresso's strategy: [`espresso_algorithm1`], then a local search the paper does not have
/// (a documented deviation): passes of GetBestOption over every tensor in the same order, now
/// with "no compression" as a candidate for compressed tensors too, until a pass changes
/// nothing; the same search is also started from the best uniform strategy ([`best_uniform`]),
/// and the better result is returned. Algorithm 1 changes one tensor at a time starting from
/// "compress nothing", so it can stop where two tensors would have to change together (e.g. a
/// large tensor whose compression delays the backprop that small, latency-bound tensors'
/// compression needs); the second start also makes the result never worse than compressing
/// everything with one option.
pub fn espresso(profile: &Profile, cost: &CostModel, ctx: &EspressoCtx) -> Result<EspressoPlan> {
    let s = Setting::new(profile, cost, ctx)?;
    let sim = Stepper::new(profile, cost, &s.template)?;
    let order = size_order(profile);
    let (idx, time, mut evaluated, ruled_out) = algorithm1(&sim, &s, profile)?;
    let (mut best, mut best_time, e) = polish(&sim, &s, &order, idx, time)?;
    evaluated += e;
    for o in 1..=s.options.len() {
        let idx = vec![o; profile.len()];
        let (t, _) = evaluate(&sim, &s, &idx)?;
        let (idx, t, e) = polish(&sim, &s, &order, idx, t)?;
        evaluated += 1 + e;
        if t < best_time {
            (best, best_time) = (idx, t);
        }
    }
    s.finish(profile, cost, &best, evaluated, ruled_out)
}

/// Local search: passes of single-tensor best moves (any option or none) in `order` until a
/// pass improves nothing. Returns the indices, their time and the evaluations spent.
fn polish(
    sim: &Stepper,
    s: &Setting,
    order: &[usize],
    mut idx: Vec<usize>,
    mut time: f64,
) -> Result<(Vec<usize>, f64, u64)> {
    let mut evaluated = 0;
    // Every accepted move strictly lowers the time, so this ends; the cap bounds planning time
    // on large models (a pass is O(n² · options) group steps).
    for _pass in 0..20 {
        let mut improved = false;
        for &j in order {
            let cur = idx[j];
            let mut best_o = cur;
            for o in 0..=s.options.len() {
                if o == cur {
                    continue;
                }
                idx[j] = o;
                let (t, _) = evaluate(sim, s, &idx)?;
                evaluated += 1;
                // Relative margin: float noise must not count as progress.
                if t < time * (1.0 - 1e-12) {
                    (time, best_o) = (t, o);
                    improved = true;
                }
            }
            idx[j] = best_o;
        }
        if !improved {
            break;
        }
    }
    Ok((idx, time, evaluated))
}

/// Algorithm 1 on option indices: (indices, time, evaluations, tensors ruled out).
fn algorithm1(
    sim: &Stepper,
    s: &Setting,
    profile: &Profile,
) -> Result<(Vec<usize>, f64, u64, usize)> {
    let n = profile.len();
    let order = size_order(profile);
    let mut idx = vec![0usize; n];
    let mut removed = vec![false; n];
    let mut ruled_out = 0;
    // Remove(S, G): uncompressed tensors before the last bubble leave the search for good.
    let remove = |idx: &[usize], last_bubble: usize, removed: &mut [bool], count: &mut usize| {
        for j in 0..last_bubble {
            if idx[j] == 0 && !removed[j] {
                removed[j] = true;
                *count += 1;
            }
        }
    };
    let (mut time, bubble) = evaluate(sim, s, &idx)?;
    let mut evaluated = 1u64;
    remove(&idx, bubble, &mut removed, &mut ruled_out); // line 4
    for &j in &order {
        if removed[j] {
            continue;
        }
        // GetBestOption(S, j): S itself first, so ties keep the current (uncompressed) tensor.
        // Keeping S changes no bubble, so its "new bubble" is none (0: nothing to remove).
        let (mut best_o, mut best_bubble) = (idx[j], 0);
        for o in 1..=s.options.len() {
            idx[j] = o;
            let (t, b) = evaluate(sim, s, &idx)?;
            evaluated += 1;
            if t < time {
                (time, best_o, best_bubble) = (t, o, b);
            }
        }
        idx[j] = best_o;
        remove(&idx, best_bubble, &mut removed, &mut ruled_out); // line 8
    }
    Ok((idx, time, evaluated, ruled_out))
}

/// The optimal strategy by brute force over all `(options + 1)^n` combinations (depth-first,
/// sharing the simulator state of common prefixes). For tests and tiny models: refuses more
/// than 10 million combinations.
pub fn exhaustive_espresso(
    profile: &Profile,
    cost: &CostModel,
    ctx: &EspressoCtx,
) -> Result<EspressoPlan> {
    let s = Setting::new(profile, cost, ctx)?;
    let sim = Stepper::new(profile, cost, &s.template)?;
    let m = s.options.len() + 1;
    let combos = (m as f64).powi(profile.len() as i32);
    if combos > 1e7 {
        return Err(Error::InvalidArgument(format!(
            "exhaustive Espresso over {m}^{} combinations (max 1e7)",
            profile.len()
        )));
    }
    struct Dfs<'a, 'b> {
        sim: &'a Stepper<'b>,
        s: &'a Setting<'b>,
        cur: Vec<usize>,
        best: (f64, Vec<usize>),
        evaluated: u64,
    }
    impl Dfs<'_, '_> {
        fn go(&mut self, st: SimState) -> Result<()> {
            let i = self.cur.len();
            if i == self.s.groups.len() {
                self.evaluated += 1;
                let t = self.sim.finish(&st);
                if t < self.best.0 {
                    self.best = (t, self.cur.clone());
                }
                return Ok(());
            }
            for o in 0..self.s.groups[i].len() {
                let mut next = st;
                self.sim.step(&mut next, &self.s.groups[i][o])?;
                self.cur.push(o);
                self.go(next)?;
                self.cur.pop();
            }
            Ok(())
        }
    }
    let mut dfs = Dfs {
        sim: &sim,
        s: &s,
        cur: Vec::with_capacity(profile.len()),
        best: (f64::INFINITY, vec![]),
        evaluated: 0,
    };
    dfs.go(SimState::default())?;
    let (evaluated, best) = (dfs.evaluated, dfs.best.1);
    s.finish(profile, cost, &best, evaluated, 0)
}

/// The same option for every tensor: `None` is "compress nothing", `Some(d)` "compress
/// everything with `d`".
pub fn uniform(
    profile: &Profile,
    cost: &CostModel,
    ctx: &EspressoCtx,
    decision: Option<&Decision>,
) -> Result<EspressoPlan> {
    let decisions = vec![decision.cloned(); profile.len()];
    let plan = ctx.plan(&decisions);
    let time = simulate(profile, cost, &plan)?.time;
    Ok(EspressoPlan {
        decisions,
        plan,
        time,
        evaluated: 1,
        ruled_out: 0,
    })
}

/// "Compress everything with the best single option": the best of [`uniform`] over
/// [`EspressoCtx::options`].
pub fn best_uniform(
    profile: &Profile,
    cost: &CostModel,
    ctx: &EspressoCtx,
) -> Result<EspressoPlan> {
    let mut best: Option<EspressoPlan> = None;
    for d in ctx.options() {
        let u = uniform(profile, cost, ctx, Some(&d))?;
        if best.as_ref().is_none_or(|b| u.time < b.time) {
            best = Some(u);
        }
    }
    best.ok_or_else(|| Error::InvalidArgument("Espresso needs at least one codec".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{CodecCost, Linear};
    use crate::models;
    use crate::profile::TensorProfile;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn log_uniform(rng: &mut StdRng, lo: f64, hi: f64) -> f64 {
        (rng.gen_range(lo.ln()..hi.ln())).exp()
    }

    fn prof(t: &[(usize, f64)]) -> Profile {
        Profile {
            note: String::new(),
            tensors: t
                .iter()
                .enumerate()
                .map(|(i, &(elems, backprop))| TensorProfile {
                    name: format!("t{i}"),
                    elems,
                    backprop,
                })
                .collect(),
        }
    }

    fn random_codec(rng: &mut StdRng) -> CodecCost {
        let alpha = |rng: &mut StdRng| {
            if rng.gen_bool(0.1) {
                0.0
            } else {
                log_uniform(rng, 1e-6, 1e-3)
            }
        };
        CodecCost {
            compress: Linear::new(alpha(rng), 1.0 / log_uniform(rng, 1e9, 3e10)),
            decompress: Linear::new(alpha(rng), 1.0 / log_uniform(rng, 1e9, 3e10)),
            ratio: log_uniform(rng, 0.01, 0.5),
        }
    }

    /// A random model of `n` tensors, cost model and context (`hier`: two-level job), scaled
    /// so backprop, codec overheads and communication are comparable.
    fn random_case(
        seed: u64,
        n: usize,
        codecs: usize,
        hier: bool,
    ) -> (Profile, CostModel, EspressoCtx) {
        let mut rng = StdRng::seed_from_u64(seed);
        let per_elem = log_uniform(&mut rng, 1e-10, 1e-8);
        let tensors: Vec<(usize, f64)> = (0..n)
            .map(|_| {
                // Some seeds repeat sizes, to exercise the ties of the size order.
                let elems = if seed.is_multiple_of(5) {
                    [1000, 100_000][rng.gen_range(0..2)]
                } else {
                    log_uniform(&mut rng, 10.0, 2e6) as usize
                };
                (
                    elems,
                    1e-5 + per_elem * elems as f64 * rng.gen_range(0.2..5.0),
                )
            })
            .collect();
        let link = Linear::new(
            log_uniform(&mut rng, 1e-6, 2e-3),
            1.0 / log_uniform(&mut rng, 1e8, 1e10),
        );
        let mut cost = CostModel::with_link("l", link);
        let names = ["c0", "c1", "c2"];
        for name in &names[..codecs] {
            cost = cost.codec_entry(name, random_codec(&mut rng));
        }
        let ctx = if hier {
            let intra = Linear::new(
                log_uniform(&mut rng, 1e-6, 1e-4),
                1.0 / log_uniform(&mut rng, 1e9, 1e11),
            );
            cost.links.insert("i".into(), intra);
            let m = [2, 4, 8][rng.gen_range(0..3)];
            let k = [2, 4, 8][rng.gen_range(0..3)];
            EspressoCtx::hierarchical(m, k, "i", &names[..codecs])
        } else {
            EspressoCtx::flat([2, 4, 8, 16, 64][rng.gen_range(0..5)], &names[..codecs])
        };
        let ctx = EspressoCtx {
            compress_on: if seed.is_multiple_of(3) {
                CompressOn::Separate
            } else {
                CompressOn::Compute
            },
            ..ctx
        };
        (prof(&tensors), cost, ctx)
    }

    fn none_time(p: &Profile, cost: &CostModel, ctx: &EspressoCtx) -> f64 {
        uniform(p, cost, ctx, None).unwrap().time
    }

    fn same(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs()) + 1e-15
    }

    #[test]
    fn near_exhaustive_and_never_worse_than_the_baselines_on_random_models() {
        // (tensor counts, codecs, hierarchical, seeds): option counts 3, 5, 6 and 11 per tensor.
        let suites: [(std::ops::RangeInclusive<usize>, usize, bool, u64); 4] = [
            (1..=8, 1, false, 400),
            (2..=7, 2, false, 120),
            (1..=6, 1, true, 200),
            (2..=5, 2, true, 60),
        ];
        let (mut worst, mut worst_at, mut sum, mut cases) = (0.0f64, String::new(), 0.0, 0);
        let (mut optimal, mut nontrivial) = (0, 0);
        let (mut a1_worst, mut a1_worst_at, mut a1_sum, mut a1_over) =
            (0.0f64, String::new(), 0.0, 0);
        for (si, (ns, codecs, hier, seeds)) in suites.into_iter().enumerate() {
            let span = ns.end() - ns.start() + 1;
            for seed in 0..seeds {
                let n = ns.start() + (seed as usize % span);
                let (p, cost, ctx) = random_case(seed * 10 + si as u64, n, codecs, hier);
                let e = espresso(&p, &cost, &ctx).unwrap();
                let a1 = espresso_algorithm1(&p, &cost, &ctx).unwrap();
                let x = exhaustive_espresso(&p, &cost, &ctx).unwrap();
                assert!(a1.time <= none_time(&p, &cost, &ctx) * (1.0 + 1e-9));
                assert!(e.time <= a1.time * (1.0 + 1e-9));
                let a1_gap = a1.time / x.time - 1.0;
                if a1_gap > a1_worst {
                    (a1_worst, a1_worst_at) = (a1_gap, format!("suite {si} seed {seed} n {n}"));
                }
                a1_sum += a1_gap;
                a1_over += usize::from(a1_gap > 0.05);
                let none = uniform(&p, &cost, &ctx, None).unwrap();
                let all = best_uniform(&p, &cost, &ctx).unwrap();
                let at = format!("suite {si} seed {seed} n {n}");
                assert!(e.time >= x.time * (1.0 - 1e-9), "{at}: below the optimum");
                assert!(e.time <= none.time * (1.0 + 1e-9), "{at}: worse than none");
                assert!(
                    e.time <= all.time * (1.0 + 1e-9),
                    "{at}: worse than all {}",
                    all.time
                );
                assert_eq!(x.evaluated, (ctx.options().len() as u64 + 1).pow(n as u32));
                let gap = e.time / x.time - 1.0;
                if gap > worst {
                    (worst, worst_at) = (gap, at);
                }
                sum += gap;
                cases += 1;
                optimal += usize::from(gap <= 1e-9);
                nontrivial += usize::from(x.time < none.time.min(all.time) * (1.0 - 1e-9));
            }
        }
        println!(
            "{cases} cases: Espresso optimal in {optimal}, mean gap {:.4}%, worst {:.3}% \
             ({worst_at}); the optimum mixes options (beats none and every uniform) in \
             {nontrivial}",
            100.0 * sum / cases as f64,
            100.0 * worst
        );
        println!(
            "Algorithm 1 alone: mean gap {:.4}%, worst {:.3}% ({a1_worst_at}), {a1_over} cases over 5%",
            100.0 * a1_sum / cases as f64,
            100.0 * a1_worst
        );
        assert!(worst <= 0.05, "worst gap {worst} at {worst_at}");
        assert!(
            nontrivial * 4 >= cases,
            "too few non-trivial cases: {nontrivial}"
        );
    }

    #[test]
    fn reported_time_is_the_simulators() {
        for seed in 0..20 {
            let (p, cost, ctx) = random_case(seed, 12, 2, seed % 2 == 0);
            let e = espresso(&p, &cost, &ctx).unwrap();
            let t = simulate(&p, &cost, &e.plan).unwrap().time;
            assert!(same(t, e.time));
            assert_eq!(e.plan.groups.len(), p.len());
            assert!(e.plan.validate(&p, &cost).is_ok());
        }
    }

    /// 10 GB/s-class link, 100 µs per collective; a 1/32 codec with a 200 µs kernel cost.
    fn hand_cost() -> CostModel {
        CostModel::with_link("net", Linear::new(100e-6, 1.0 / 1.25e9)).codec_entry(
            "sign",
            CodecCost {
                compress: Linear::new(200e-6, 1.0 / 20e9),
                decompress: Linear::new(100e-6, 1.0 / 20e9),
                ratio: 1.0 / 32.0,
            },
        )
    }

    #[test]
    fn tiny_tensor_stays_uncompressed_and_large_one_gets_compressed() {
        // Output layer first: a bias of 1000 elements (4 KB: 3 µs of wire, but 300+ µs of
        // codec α), then a 16M-element weight (64 MB: 54 ms of wire on 8 ranks).
        let p = prof(&[(1000, 1e-5), (16 << 20, 0.02)]);
        let ctx = EspressoCtx::flat(8, &["sign"]);
        let e = espresso(&p, &hand_cost(), &ctx).unwrap();
        assert_eq!(e.decisions[0], None, "{:?}", e.decisions);
        assert!(e.decisions[1].is_some(), "{:?}", e.decisions);
        let x = exhaustive_espresso(&p, &hand_cost(), &ctx).unwrap();
        assert!(same(e.time, x.time));

        // The same large tensor with a link 1000x faster: compression no longer pays.
        let mut fast = hand_cost();
        fast.links
            .insert("net".into(), Linear::new(1e-6, 1.0 / 1.25e12));
        let e = espresso(&p, &fast, &ctx).unwrap();
        assert!(e.decisions.iter().all(Option::is_none), "{:?}", e.decisions);
    }

    #[test]
    fn schemes_follow_the_rank_count_and_tiers_follow_the_links() {
        let p = prof(&[(4 << 20, 0.005)]);
        let cost = hand_cost();
        // Two ranks: one compression and a cheap all-gather beat the divisible scheme's
        // second round of codec work; 64 ranks: all-gathering 63 copies does not pay.
        let choice = |ctx: &EspressoCtx, cost: &CostModel| {
            espresso(&p, cost, ctx).unwrap().decisions[0]
                .clone()
                .map(|d| d.choice)
        };
        assert_eq!(
            choice(&EspressoCtx::flat(2, &["sign"]), &cost),
            Some(Choice::flat(Scheme::AllGather))
        );
        assert_eq!(
            choice(&EspressoCtx::flat(64, &["sign"]), &cost),
            Some(Choice::flat(Scheme::Divisible))
        );
        // Two-level: a fast intra link (NVLink-like) is left uncompressed; a slow one (PCIe
        // shared by 8 ranks) gets compressed too.
        let mut c = cost.clone();
        c.links
            .insert("nvlink".into(), Linear::new(5e-6, 1.0 / 150e9));
        c.links
            .insert("pcie".into(), Linear::new(20e-6, 1.0 / 0.5e9));
        let d = choice(&EspressoCtx::hierarchical(8, 8, "nvlink", &["sign"]), &c).unwrap();
        assert!(!d.intra && d.inter.is_some(), "{d:?}");
        let d = choice(&EspressoCtx::hierarchical(8, 8, "pcie", &["sign"]), &c).unwrap();
        assert!(d.intra, "{d:?}");
    }

    #[test]
    fn bubbles_rule_tensors_out() {
        // A slow backprop tail: the channel idles before the last tensor is ready, so the
        // tensors before it gain nothing from compression and are ruled out at once.
        let p = prof(&[
            (1 << 20, 1e-3),
            (1 << 20, 1e-3),
            (1 << 20, 1e-3),
            (1000, 1.0),
        ]);
        let ctx = EspressoCtx::flat(4, &["sign"]);
        let e = espresso_algorithm1(&p, &hand_cost(), &ctx).unwrap();
        assert_eq!(e.ruled_out, 3);
        assert!(e.decisions.iter().all(Option::is_none));
        // The first evaluation, then only the last tensor's two options.
        assert_eq!(e.evaluated, 1 + 2);
        let e = espresso(&p, &hand_cost(), &ctx).unwrap();
        assert!(e.decisions.iter().all(Option::is_none));
    }

    #[test]
    fn bad_contexts_are_rejected() {
        let p = prof(&[(100, 1e-3)]);
        let cost = hand_cost();
        assert!(espresso(&p, &cost, &EspressoCtx::flat(8, &[])).is_err());
        assert!(espresso(&p, &cost, &EspressoCtx::flat(8, &["nope"])).is_err());
        assert!(espresso(&p, &cost, &EspressoCtx::flat(1, &["sign"])).is_err());
        assert!(espresso(
            &p,
            &cost,
            &EspressoCtx::hierarchical(2, 2, "nope", &["sign"])
        )
        .is_err());
        assert!(exhaustive_espresso(
            &prof(&[(100, 1e-3); 20]),
            &cost,
            &EspressoCtx::flat(8, &["sign"])
        )
        .is_err());
        let e = espresso(&Profile::default(), &cost, &EspressoCtx::flat(8, &["sign"])).unwrap();
        assert_eq!((e.time, e.decisions.len()), (0.0, 0));
    }

    /// The sample cost model of the Cupcake tests and bench, plus intra-machine links.
    fn sample_cost() -> CostModel {
        let mut c = CostModel::with_link("tcp/sra", Linear::new(100e-6, 1.0 / 1.25e9)).codec_entry(
            "sign",
            CodecCost {
                compress: Linear::new(250e-6, 1.0 / 20e9),
                decompress: Linear::new(150e-6, 1.0 / 20e9),
                ratio: 1.0 / 32.0,
            },
        );
        c.links.insert("shm".into(), Linear::new(10e-6, 1.0 / 10e9));
        c
    }

    #[test]
    fn shipped_models() {
        let cost = sample_cost();
        let ctxs = [
            ("flat 8", EspressoCtx::flat(8, &["sign"])),
            ("flat 64", EspressoCtx::flat(64, &["sign"])),
            ("2x4 shm", EspressoCtx::hierarchical(2, 4, "shm", &["sign"])),
            ("8x8 shm", EspressoCtx::hierarchical(8, 8, "shm", &["sign"])),
        ];
        for (name, p) in models::shipped() {
            for (cname, ctx) in &ctxs {
                let t0 = std::time::Instant::now();
                let e = espresso(&p, &cost, ctx).unwrap();
                let dt = t0.elapsed();
                let none = uniform(&p, &cost, ctx, None).unwrap();
                let all = best_uniform(&p, &cost, ctx).unwrap();
                assert!(e.time <= none.time * (1.0 + 1e-9) && e.time <= all.time * (1.0 + 1e-9));
                assert!(same(e.time, simulate(&p, &cost, &e.plan).unwrap().time));
                let all_d = all.decisions.first().cloned().flatten().unwrap();
                println!(
                    "{name:9} {cname:8}: espresso {:8.3} ms | none {:8.3} ms | all {} {:8.3} ms | \
                     planned in {:.1} ms ({} evaluations, {} ruled out)",
                    e.time * 1e3,
                    none.time * 1e3,
                    all_d,
                    all.time * 1e3,
                    dt.as_secs_f64() * 1e3,
                    e.evaluated,
                    e.ruled_out
                );
                for (k, (count, bytes)) in e.summary(&p) {
                    println!(
                        "      {k:24} {count:4} tensors {:9.3} MB",
                        bytes as f64 / 1e6
                    );
                }
            }
        }
    }
}
