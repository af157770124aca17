//! Fused all-reduce: consecutive tensors of a training step reduced together, each group dense
//! or with its own codec, as a fusion plan decides (e.g. `qccl-planner`'s Cupcake plan, whose
//! `Plan::fused` gives the groups). [`PlanRunner`] takes owned gradients one tensor at a time
//! in backprop order and starts each group's all-reduce as soon as the group is complete
//! (wait-free backprop); [`BucketRunner`] keeps each group's gradients in one bucket that
//! backprop writes into (PyTorch DDP's `gradient_as_bucket_view`); the C ABI's
//! QCCL_PLAN_FILE runs grouped calls through [`FusionPlan`] and [`FusedAllReduce`].
//!
//! ```no_run
//! # fn main() -> qccl::Result<()> {
//! use qccl::fused::{FusedGroup, PlanRunner};
//! let comm = qccl::Comm::from_env()?;
//! let sizes = [1 << 20, 64, 1 << 18, 1000]; // elements per tensor, backprop order
//! let groups = [
//!     FusedGroup::new(0..2, Some("qsgd:bits=4,bucket=128")),
//!     FusedGroup::new(2..4, None),
//! ];
//! let mut runner = PlanRunner::new(&comm, &groups, &sizes)?;
//! for step in 0..10 {
//!     for (i, &n) in sizes.iter().enumerate() {
//!         let grad = vec![0.0f32; n]; // ... backprop produces tensor i's gradient ...
//!         runner.submit(i, grad)?;
//!     }
//!     let averaged = runner.finish()?; // one Vec per tensor, in submission order
//!     # let _ = (step, averaged);
//! }
//! # Ok(())
//! # }
//! ```
//!
//! Every rank must run the same groups and submit the same tensors (same sizes, same order):
//! the groups then issue the same collectives in the same order on every rank, with no
//! negotiation.

mod buckets;

pub use buckets::BucketRunner;

use crate::codec::ef::TensorKey;
use crate::coll::Engine;
use crate::comm::{AllReduceCall, Comm, Compression, Request};
use crate::types::{DType, ReduceOp};
use crate::{Error, Result};
use std::ops::Range;

/// The key prefix of the error-feedback residuals of a runner's compressed groups.
pub const DEFAULT_KEY_PREFIX: &str = "plan-group";

/// One group of a fusion: consecutive tensors reduced together, dense (no codec) or
/// compressed with a codec spec (`qsgd:bits=4,bucket=128`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FusedGroup {
    /// The tensors, by index in backprop order.
    pub tensors: Range<usize>,
    /// The codec spec; None: dense.
    pub codec: Option<String>,
}

impl FusedGroup {
    /// Tensors `tensors`, compressed with `codec` (None: dense).
    pub fn new(tensors: Range<usize>, codec: Option<&str>) -> FusedGroup {
        FusedGroup {
            tensors,
            codec: codec.map(str::to_string),
        }
    }
}

/// One group as it is executed.
#[derive(Clone)]
struct RunGroup {
    start: usize,
    end: usize,
    /// `None`: dense all-reduce. Parsed once, so a bad codec spec fails when the plan is
    /// checked and not in the middle of an iteration.
    compression: Option<Compression>,
}

#[doc(hidden)]
/// Fusion groups checked for execution: non-empty, tiling the tensors in order, each
/// group's compression parsed with its error-feedback key, and the group of every tensor. The
/// execution half shared by [`PlanRunner`] (owned gradients) and the C ABI's QCCL_PLAN_FILE
/// (the caller's buffers): [`FusionPlan::prepare`] resolves a group's all-reduce, and
/// [`FusedAllReduce::run`] packs, reduces and unpacks it.
///
/// Compressed groups use the tensor key `"{prefix}/{group index}:{start}..{end}"` (prefix
/// [`DEFAULT_KEY_PREFIX`] unless set with [`with_key_prefix`](Self::with_key_prefix)), so
/// error feedback keeps one residual per group across iterations; the range is part of the
/// key so that plans of different shapes on one comm never share (or fight over) a residual.
#[derive(Clone)]
pub struct FusionPlan {
    groups: Vec<RunGroup>,
    /// Tensor index -> group index.
    group_of: Vec<usize>,
}

impl FusionPlan {
    /// Checks `groups` for `tensors` tensors (None: as many as the groups cover): they are
    /// non-empty and tile the tensors in order, and every codec spec parses.
    pub fn new(fused: &[FusedGroup], tensors: Option<usize>) -> Result<FusionPlan> {
        let mut next = 0;
        let mut groups = Vec::with_capacity(fused.len());
        let mut group_of = Vec::new();
        for (i, g) in fused.iter().enumerate() {
            let (start, end) = (g.tensors.start, g.tensors.end);
            if start != next || end <= start {
                return Err(Error::InvalidArgument(format!(
                    "plan group {i} is {start}..{end}, expected a non-empty group starting at \
                     tensor {next}"
                )));
            }
            if let Some(n) = tensors.filter(|&n| end > n) {
                return Err(Error::InvalidArgument(format!(
                    "plan group {i} is {start}..{end} but there are only {n} tensors"
                )));
            }
            let compression = match &g.codec {
                None => None,
                Some(spec) => Some(Compression::parse(spec).map_err(|e| {
                    Error::InvalidArgument(format!("plan group {i}: codec {spec:?}: {e}"))
                })?),
            };
            groups.push(RunGroup {
                start,
                end,
                compression,
            });
            group_of.extend(std::iter::repeat_n(i, end - start));
            next = end;
        }
        if let Some(n) = tensors.filter(|&n| n != next) {
            return Err(Error::InvalidArgument(format!(
                "plan covers tensors 0..{next} but there are {n}"
            )));
        }
        Ok(FusionPlan { groups, group_of }.with_key_prefix(DEFAULT_KEY_PREFIX))
    }

    /// Uses `prefix` in the error-feedback keys (to keep two runs of the same plan apart, e.g.
    /// two models on one comm).
    pub fn with_key_prefix(mut self, prefix: &str) -> Self {
        for (i, g) in self.groups.iter_mut().enumerate() {
            if let Some(c) = g.compression.take() {
                let key = TensorKey::Name(format!("{prefix}/{i}:{}..{}", g.start, g.end));
                g.compression = Some(c.key(key));
            }
        }
        self
    }

    /// Number of groups.
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }

    /// Number of tensors the groups cover.
    pub fn num_tensors(&self) -> usize {
        self.group_of.len()
    }

    /// The group of tensor `tensor` (< [`num_tensors`](Self::num_tensors)).
    pub fn group_of(&self, tensor: usize) -> usize {
        self.group_of[tensor]
    }

    /// The tensors of group `group`.
    pub fn tensors(&self, group: usize) -> Range<usize> {
        let g = &self.groups[group];
        g.start..g.end
    }

    /// Group `group`'s codec spec, or None for a dense group.
    pub fn codec(&self, group: usize) -> Option<String> {
        self.groups[group]
            .compression
            .as_ref()
            .map(|c| c.codec.to_string())
    }

    /// Resolves group `group`'s all-reduce of `count` fused float32 elements with `op` (sum or
    /// avg) on `comm`: dense (hierarchical across hosts; QCCL_COMPRESSION does not apply, the
    /// plan decides), or compressed with the group's codec under its key.
    pub fn prepare(
        &self,
        comm: &Comm,
        group: usize,
        count: usize,
        op: ReduceOp,
    ) -> Result<FusedAllReduce> {
        let f32 = DType::Float32;
        let call = match &self.groups[group].compression {
            None => comm.prepare_all_reduce_dense(count, f32, op, None)?,
            Some(c) => comm.compressed_call(comm.prepare_all_reduce_compressed(count, f32, op, c)?),
        };
        Ok(FusedAllReduce { call })
    }
}

#[doc(hidden)]
/// One tensor of a fused group, as float32 bytes: its input (None: in place, in the output)
/// and its output.
pub type Part<'a> = (Option<&'a [u8]>, &'a mut [u8]);

#[doc(hidden)]
/// A group's all-reduce, prepared by [`FusionPlan::prepare`].
pub struct FusedAllReduce {
    call: AllReduceCall,
}

impl FusedAllReduce {
    /// Runs on `e` (the engine of the comm that prepared it, in its turn): packs the parts'
    /// inputs into one buffer in order, all-reduces it, and writes each part's share of the
    /// result to its output. A group of one tensor is reduced where it is, without copies.
    pub fn run(&self, e: &mut Engine, parts: &mut [Part<'_>]) -> Result<()> {
        let bytes: usize = parts.iter().map(|(_, out)| out.len()).sum();
        if bytes != self.call.count() * 4
            || parts
                .iter()
                .any(|(i, o)| i.is_some_and(|i| i.len() != o.len()))
        {
            return Err(Error::invalid(format!(
                "fused all_reduce: parts of {bytes} bytes for a group prepared for {} float32 \
                 elements",
                self.call.count()
            )));
        }
        if let [(input, out)] = parts {
            return self.call.run(e, *input, out).map(drop);
        }
        let mut fused = std::mem::take(&mut e.scratch.fused);
        if fused.len() < self.call.count() {
            fused.resize(self.call.count(), 0.0);
        }
        let buf: &mut [u8] = bytemuck::cast_slice_mut(&mut fused[..self.call.count()]);
        let mut at = 0;
        for (input, out) in parts.iter() {
            let src: &[u8] = input.unwrap_or(out);
            buf[at..at + src.len()].copy_from_slice(src);
            at += src.len();
        }
        let done = self.call.run(e, None, buf);
        if done.is_ok() {
            let mut at = 0;
            for (_, out) in parts.iter_mut() {
                let n = out.len();
                out.copy_from_slice(&buf[at..at + n]);
                at += n;
            }
        }
        e.scratch.fused = fused;
        done.map(drop)
    }
}

/// Executes fusion groups on a [`Comm`], one iteration at a time: [`submit`](Self::submit) every
/// tensor's gradient in backprop order, then [`finish`](Self::finish). The runner can be reused
/// for any number of iterations.
///
/// Each group is all-reduced with [`ReduceOp::Avg`], dense, or compressed with its codec spec
/// under its group's key (see [`FusionPlan`]).
pub struct PlanRunner<'c> {
    comm: &'c Comm,
    plan: FusionPlan,
    /// Element count of every tensor.
    elems: Vec<usize>,
    /// The next tensor `submit` expects.
    next: usize,
    /// Gradients of the open (not yet complete) group.
    open: Vec<Vec<f32>>,
    /// One entry per group started this iteration, in group order: its tensors, reduced.
    inflight: Vec<Request<Vec<Vec<f32>>>>,
}

impl<'c> PlanRunner<'c> {
    /// A runner for `groups` over tensors of `sizes` elements on `comm`. Checks that the
    /// groups are non-empty and tile the tensors in order, and that every codec spec parses.
    pub fn new(comm: &'c Comm, groups: &[FusedGroup], sizes: &[usize]) -> Result<PlanRunner<'c>> {
        Ok(PlanRunner {
            comm,
            plan: FusionPlan::new(groups, Some(sizes.len()))?,
            elems: sizes.to_vec(),
            next: 0,
            open: Vec::new(),
            inflight: Vec::new(),
        })
    }

    /// Uses `prefix` instead of [`DEFAULT_KEY_PREFIX`] in the error-feedback keys (to keep two
    /// runners of the same plan apart, e.g. two models on one comm).
    pub fn with_key_prefix(mut self, prefix: &str) -> Self {
        self.plan = self.plan.with_key_prefix(prefix);
        self
    }

    /// Number of groups in the plan.
    pub fn num_groups(&self) -> usize {
        self.plan.num_groups()
    }

    /// Groups whose all-reduce has been started this iteration (they are started in order, so
    /// these are groups `0..launched()`).
    pub fn launched(&self) -> usize {
        self.inflight.len()
    }

    /// True once group `group`'s all-reduce has been started this iteration and has finished
    /// (`finish` will not wait for it). Never blocks.
    pub fn is_done(&mut self, group: usize) -> bool {
        self.inflight.get_mut(group).is_some_and(Request::test)
    }

    /// Hands over tensor `index`'s gradient (its backprop is done). Tensors must come in
    /// backprop order, `0, 1, 2, …`; when `index` is the last tensor of its group, the group is
    /// packed into one buffer and its all-reduce starts before this returns.
    pub fn submit(&mut self, index: usize, grad: Vec<f32>) -> Result<()> {
        if index != self.next {
            return Err(Error::InvalidArgument(if index < self.next {
                format!(
                    "PlanRunner::submit: tensor {index} was already submitted this iteration \
                     (expected tensor {})",
                    self.next
                )
            } else if self.next == self.elems.len() {
                format!(
                    "PlanRunner::submit: tensor {index}: all {} tensors were submitted; call \
                     finish()",
                    self.elems.len()
                )
            } else {
                format!(
                    "PlanRunner::submit: tensor {index} submitted out of order (expected tensor \
                     {}; tensors come in backprop order)",
                    self.next
                )
            }));
        }
        if grad.len() != self.elems[index] {
            return Err(Error::InvalidArgument(format!(
                "PlanRunner::submit: tensor {index} has {} elements, expected {}",
                grad.len(),
                self.elems[index]
            )));
        }
        self.open.push(grad);
        self.next += 1;
        let g = self.plan.group_of(index);
        if self.next == self.plan.tensors(g).end {
            self.launch(g)?;
        }
        Ok(())
    }

    /// Starts the open group's all-reduce; the job owns the gradients and hands them back.
    fn launch(&mut self, g: usize) -> Result<()> {
        let mut grads = std::mem::take(&mut self.open);
        let count = grads.iter().map(Vec::len).sum();
        let call = self.plan.prepare(self.comm, g, count, ReduceOp::Avg)?;
        let req = self.comm.submit(move |e| {
            let mut parts: Vec<Part<'_>> = grads
                .iter_mut()
                .map(|t| (None, bytemuck::cast_slice_mut(t)))
                .collect();
            call.run(e, &mut parts)?;
            Ok(grads)
        })?;
        self.inflight.push(req);
        Ok(())
    }

    /// Waits for every group of this iteration and returns the averaged gradients, one `Vec`
    /// per tensor in submission order. Every tensor must have been submitted. Afterwards the
    /// runner is ready for the next iteration (also when this fails).
    pub fn finish(&mut self) -> Result<Vec<Vec<f32>>> {
        let inflight = std::mem::take(&mut self.inflight);
        let submitted = std::mem::replace(&mut self.next, 0);
        self.open.clear();
        if submitted != self.elems.len() {
            // Still wait for what was started, so no collective is left running behind the
            // caller's back; its error (if any) matters less than the caller's mistake.
            for r in inflight {
                let _ = r.wait();
            }
            return Err(Error::InvalidArgument(format!(
                "PlanRunner::finish: only {submitted} of {} tensors were submitted",
                self.elems.len()
            )));
        }
        let mut out = Vec::with_capacity(self.elems.len());
        for r in inflight {
            out.extend(r.wait()?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{from_ends, on_threads};
    use super::*;
    use crate::config::Config;
    use std::time::{Duration, Instant};

    /// Rank `r`'s gradient of tensor `t` at step `s`: distinct per rank, tensor and element.
    fn grad(r: usize, t: usize, s: usize, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((r * 31 + t * 7 + s * 3 + i) % 97) as f32 * 0.01 - 0.4)
            .collect()
    }

    const SIZES: [usize; 6] = [5, 1000, 1, 64, 3000, 17];

    /// Per-tensor dense all-reduces, the reference.
    fn reference(comm: &Comm, r: usize, step: usize) -> Vec<Vec<f32>> {
        SIZES
            .iter()
            .enumerate()
            .map(|(t, &n)| {
                let mut g = grad(r, t, step, n);
                comm.all_reduce_in_place(&mut g, ReduceOp::Avg).unwrap();
                g
            })
            .collect()
    }

    fn run(comm: &Comm, r: usize, plan: &[FusedGroup], steps: usize) -> Vec<Vec<Vec<f32>>> {
        let mut runner = PlanRunner::new(comm, plan, &SIZES).unwrap();
        (0..steps)
            .map(|s| {
                for (t, &n) in SIZES.iter().enumerate() {
                    runner.submit(t, grad(r, t, s, n)).unwrap();
                }
                runner.finish().unwrap()
            })
            .collect()
    }

    #[test]
    fn dense_plan_equals_per_tensor_all_reduce() {
        for plan in [
            from_ends(&[2, 3, 6], None),
            from_ends(&[6], None),
            from_ends(&[1, 2, 3, 4, 5, 6], None),
        ] {
            let outs = on_threads(3, |r, comm| {
                let got = run(comm, r, &plan, 2);
                let want: Vec<_> = (0..2).map(|s| reference(comm, r, s)).collect();
                (got, want)
            });
            for (got, want) in outs {
                // Avg of the same values in the same order whatever the fusion: bit-identical.
                assert_eq!(got, want, "plan {plan:?}");
            }
        }
    }

    #[test]
    fn compressed_plan_is_close() {
        let mut plan = from_ends(&[1, 4, 6], Some("fp16"));
        plan[1].codec = None; // mixed: dense middle group
        let outs = on_threads(2, |r, comm| {
            let got = run(comm, r, &plan, 3);
            let want: Vec<_> = (0..3).map(|s| reference(comm, r, s)).collect();
            (got, want)
        });
        for (got, want) in &outs {
            for (gs, ws) in got.iter().zip(want) {
                for (g, w) in gs.iter().zip(ws) {
                    assert_eq!(g.len(), w.len());
                    for (a, b) in g.iter().zip(w) {
                        assert!((a - b).abs() <= 1e-3 * b.abs().max(1.0), "{a} vs {b}");
                    }
                }
            }
        }
        // Every rank ends with the same values.
        assert_eq!(outs[0].0, outs[1].0);
    }

    #[test]
    fn groups_start_as_soon_as_complete() {
        let plan = from_ends(&[2, 6], Some("qsgd:bits=4"));
        on_threads(2, |r, comm| {
            let mut runner = PlanRunner::new(comm, &plan, &SIZES).unwrap();
            for step in 0..2 {
                runner.submit(0, grad(r, 0, step, SIZES[0])).unwrap();
                assert_eq!(runner.launched(), 0);
                runner.submit(1, grad(r, 1, step, SIZES[1])).unwrap();
                assert_eq!(runner.launched(), 1);
                // The first group completes on every rank before anyone submits tensor 2: it
                // cannot be waiting for the rest of the backprop.
                let t0 = Instant::now();
                while !runner.is_done(0) {
                    assert!(
                        t0.elapsed() < Duration::from_secs(60),
                        "group 0 never finished"
                    );
                    std::thread::sleep(Duration::from_millis(1));
                }
                assert!(!runner.is_done(1));
                for (t, &n) in SIZES.iter().enumerate().skip(2) {
                    runner.submit(t, grad(r, t, step, n)).unwrap();
                }
                assert_eq!(runner.launched(), 2);
                let out = runner.finish().unwrap();
                assert_eq!(out.len(), SIZES.len());
                for (o, &n) in out.iter().zip(&SIZES) {
                    assert_eq!(o.len(), n);
                }
                assert_eq!(runner.launched(), 0);
            }
        });
    }

    #[test]
    fn bad_plans_and_calls_are_rejected() {
        let comms = Comm::init_threads(1, Config::default()).unwrap();
        let comm = &comms[0];
        let p = [3, 4, 5];
        let err = |plan: Vec<FusedGroup>| match PlanRunner::new(comm, &plan, &p) {
            Ok(_) => panic!("plan {plan:?} accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err(from_ends(&[2], None)).contains("covers tensors 0..2"));
        assert!(err(from_ends(&[2, 2, 3], None)).contains("group 1 is 2..2"));
        assert!(err(from_ends(&[1, 4], None)).contains("only 3 tensors"));
        let mut gap = from_ends(&[1, 3], None);
        gap[1].tensors.start = 2;
        assert!(err(gap).contains("starting at tensor 1"));
        assert!(err(from_ends(&[3], Some("nosuchcodec"))).contains("nosuchcodec"));

        let mut runner = PlanRunner::new(comm, &from_ends(&[2, 3], None), &p).unwrap();
        let e = runner.submit(1, vec![0.0; 4]).unwrap_err().to_string();
        assert!(e.contains("out of order"), "{e}");
        let e = runner.submit(0, vec![0.0; 2]).unwrap_err().to_string();
        assert!(e.contains("has 2 elements, expected 3"), "{e}");
        runner.submit(0, vec![1.0; 3]).unwrap();
        let e = runner.finish().unwrap_err().to_string();
        assert!(e.contains("only 1 of 3"), "{e}");
        // Reusable after the failed iteration.
        for (t, n) in [3, 4, 5].into_iter().enumerate() {
            runner.submit(t, vec![t as f32; n]).unwrap();
        }
        let e = runner.submit(2, vec![0.0; 5]).unwrap_err().to_string();
        assert!(e.contains("already submitted"), "{e}");
        let out = runner.finish().unwrap();
        assert_eq!(out, vec![vec![0.0; 3], vec![1.0; 4], vec![2.0; 5]]);
    }
}

/// Helpers shared by the runners' unit tests.
#[cfg(test)]
mod testing {
    use super::FusedGroup;
    use crate::comm::Comm;
    use crate::config::Config;

    /// Groups ending at `ends` (exclusive), all with `codec`.
    pub fn from_ends(ends: &[usize], codec: Option<&str>) -> Vec<FusedGroup> {
        let mut start = 0;
        ends.iter()
            .map(|&end| {
                let g = FusedGroup::new(start..end, codec);
                start = end;
                g
            })
            .collect()
    }

    /// Runs `f(rank, comm)` on `n` thread ranks and returns the results in rank order.
    pub fn on_threads<R: Send>(n: usize, f: impl Fn(usize, &Comm) -> R + Sync) -> Vec<R> {
        let comms = Comm::init_threads(n, Config::default()).unwrap();
        std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .enumerate()
                .map(|(r, c)| {
                    let f = &f;
                    s.spawn(move || f(r, c))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }
}
