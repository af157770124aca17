//! The timeline simulator: (profile, cost model, plan) → iteration time and per-group events.
//!
//! # Model
//!
//! Time 0 is the start of backprop (forward propagation is a constant that no plan changes, so
//! it is left out). Three resources:
//!
//! - **Compute stream.** Backprop computes the tensors in profile order, back to back, with no
//!   waiting (wait-free backprop). A group's gradients are complete when its last tensor is.
//! - **Compression.** Where it runs is [`CompressOn`]:
//!   - [`CompressOn::Compute`] (default, Cupcake's model, §4 and Algorithm 1 line 17:
//!     `M.comp = B(0,k−1) + Σ h(x)`): a group is compressed on the compute stream right after
//!     its last tensor's backprop, so it *delays* the backprop of every later tensor. This is what
//!     happens when the codec kernels share the GPU (or the CPU cores) with backprop.
//!   - [`CompressOn::Separate`]: compression has its own stream; a group is compressed when its
//!     gradients are ready and the compression stream is free (groups in order), and backprop is
//!     never delayed: tensor `i` is ready at the prefix sum of backprop times.
//! - **Channel.** One communication channel serves the groups in plan order: a group's
//!   communication starts when the group is ready (compressed, or backprop done if uncompressed)
//!   and the channel is free, and takes `α + β · wire bytes` of the plan's link (wire bytes =
//!   `ratio · 4 · elems` with a codec, `4 · elems` without). Decompression follows immediately
//!   and **occupies the channel too**: in qccl the decode (and the reduction of decoded data) runs
//!   inside the collective, on the thread that drives the communication, so the next group's
//!   communication cannot start before it ends. This keeps the groups FIFO end to end.
//!
//! **Topologies (Espresso).** A plan with a [`Plan::topology`] gives each compressed group a
//! [`Choice`] (scheme, and for two-level jobs which tiers are compressed) and takes its costs
//! from [`CostModel::sync`]: the compression before the first communication runs as above (flat
//! jobs, or the intra tier compressed); every later phase — communication on either tier and
//! the codec work between phases — occupies the channel, and the final decode is the group's
//! `decompress` event. Uncompressed groups all-reduce (flat) or reduce-scatter, all-reduce the
//! shard across machines and all-gather (hierarchical), all on the channel.
//!
//! The iteration ends when the last group is decompressed (or communicated, without a codec) —
//! or when backprop ends, if that is later (only possible with an empty plan).

use crate::cost::{Choice, CostModel, Topology};
use crate::curve::LinkCost;
use crate::fusion::{Group, Plan};
use crate::profile::Profile;
use qccl::Result;
use serde::{Deserialize, Serialize};

/// Where a group's compression runs (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CompressOn {
    /// On the compute stream, after the group's backprop, delaying later backprop (Cupcake).
    #[default]
    Compute,
    /// On its own stream, overlapping backprop.
    Separate,
}

/// What happened to one group, as `(start, end)` seconds from the start of backprop.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GroupEvents {
    /// From the start of the backprop of the group's first tensor to its last tensor's gradient.
    pub backprop: (f64, f64),
    /// Compression, if the group has a codec.
    pub compress: Option<(f64, f64)>,
    /// Communication on the channel.
    pub comm: (f64, f64),
    /// Decompression (on the channel, right after `comm`), if the group has a codec.
    pub decompress: Option<(f64, f64)>,
}

/// The simulated iteration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    /// Iteration time in seconds (from the start of backprop).
    pub time: f64,
    /// One entry per plan group, in plan order.
    pub groups: Vec<GroupEvents>,
}

/// Simulates one iteration of `plan` (validated against `profile` and `cost` first).
pub fn simulate(profile: &Profile, cost: &CostModel, plan: &Plan) -> Result<Timeline> {
    profile.validate()?;
    plan.validate(profile, cost)?;
    let sim = Stepper::new(profile, cost, plan)?;
    let mut st = SimState::default();
    let mut groups = Vec::with_capacity(plan.groups.len());
    for g in &plan.groups {
        groups.push(sim.step(&mut st, g)?);
    }
    Ok(Timeline {
        time: sim.finish(&st),
        groups,
    })
}

/// The simulator's state between two groups: when each resource is free. Everything that
/// happens to later groups depends on the earlier ones only through it, so planners can keep
/// the state after a prefix and try several continuations.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct SimState {
    /// Compute stream free at (Compute mode: backprop + compression).
    compute: f64,
    /// Prefix sum of backprop (Separate mode).
    ready_bp: f64,
    /// Compression stream free at (Separate mode).
    compress_free: f64,
    /// Channel free at.
    channel: f64,
}

impl SimState {
    /// When the channel is free (the last group stepped is fully synchronised).
    pub(crate) fn channel_free(&self) -> f64 {
        self.channel
    }
}

/// One plan's setting (profile, cost model, link, compression stream, topology), stepping
/// through groups. Groups are *not* validated here: [`simulate`] validates the whole plan, and
/// planners validate the options they step with.
pub(crate) struct Stepper<'a> {
    profile: &'a Profile,
    cost: &'a CostModel,
    link_name: Option<&'a str>,
    link: LinkCost,
    on: CompressOn,
    topology: Option<&'a Topology>,
}

impl<'a> Stepper<'a> {
    /// The setting of `plan` (its groups are ignored).
    pub(crate) fn new(profile: &'a Profile, cost: &'a CostModel, plan: &'a Plan) -> Result<Self> {
        Ok(Stepper {
            profile,
            cost,
            link_name: plan.link.as_deref(),
            link: cost.link_cost(plan.link.as_deref())?,
            on: plan.compress_on,
            topology: plan.topology.as_ref(),
        })
    }

    /// Appends group `g` after the state `st` (updated) and returns its events.
    pub(crate) fn step(&self, st: &mut SimState, g: &Group) -> Result<GroupEvents> {
        let tensors = &self.profile.tensors[g.start..g.end];
        let bp: f64 = tensors.iter().map(|t| t.backprop).sum();
        let bytes = tensors.iter().map(|t| t.bytes()).sum::<usize>() as f64;
        let codec = g.codec.as_deref().map(|c| self.cost.codec(c)).transpose()?;
        // (compression before communication, channel occupancy, final decode on the channel).
        let sync = match (self.topology, codec) {
            (Some(t), _) => {
                let cc = codec.zip(g.choice);
                let s = self.cost.sync(t, self.link_name, bytes, cc)?;
                let pre = cc.filter(|(_, ch)| precompresses(t, *ch)).map(|_| s.pre);
                (pre, s.channel, cc.map(|_| s.post))
            }
            (None, Some(c)) => (
                Some(c.compress.time(bytes)),
                self.link.time(c.ratio * bytes),
                Some(c.decompress.time(bytes)),
            ),
            (None, None) => (None, self.link.time(bytes), None),
        };

        // Backprop of this group's tensors.
        let backprop = match self.on {
            CompressOn::Compute => (st.compute, st.compute + bp),
            CompressOn::Separate => (st.ready_bp, st.ready_bp + bp),
        };
        st.compute = backprop.1;
        st.ready_bp = backprop.1;

        // Compression, then the time the group can go on the wire.
        let compress = sync.0.map(|h| {
            let start = match self.on {
                CompressOn::Compute => st.compute,
                CompressOn::Separate => f64::max(st.compress_free, backprop.1),
            };
            let end = start + h;
            match self.on {
                CompressOn::Compute => st.compute = end,
                CompressOn::Separate => st.compress_free = end,
            }
            (start, end)
        });
        let ready = compress.map_or(backprop.1, |c| c.1);

        // Communication then decompression, FIFO on the channel.
        let comm_start = f64::max(st.channel, ready);
        let comm = (comm_start, comm_start + sync.1);
        let decompress = sync.2.map(|d| (comm.1, comm.1 + d));
        st.channel = decompress.map_or(comm.1, |d| d.1);
        Ok(GroupEvents {
            backprop,
            compress,
            comm,
            decompress,
        })
    }

    /// The iteration time once every group has been stepped.
    pub(crate) fn finish(&self, st: &SimState) -> f64 {
        f64::max(st.channel, st.compute.max(st.ready_bp))
    }
}

/// Whether `choice` compresses the tensor before its first communication (then the
/// compression runs on the compute or compression stream; otherwise inside the collective).
fn precompresses(t: &Topology, choice: Choice) -> bool {
    match t {
        Topology::Flat { .. } => true,
        Topology::Hierarchical { .. } => choice.intra,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{CodecCost, Linear};
    use crate::profile::TensorProfile;

    /// Tensors of `elems` elements each (4·elems bytes) with the given backprop times.
    fn prof(t: &[(usize, f64)]) -> Profile {
        Profile {
            note: String::new(),
            tensors: t
                .iter()
                .map(|&(elems, backprop)| TensorProfile {
                    name: String::new(),
                    elems,
                    backprop,
                })
                .collect(),
        }
    }

    /// Link: 1 s + 1 s per 100 bytes. Codec "c": compress 2 s + 1 s/400 B, decompress
    /// 1 s + 1 s/400 B, ratio 1/4. (Round numbers so the timelines can be done by hand.)
    fn cost() -> CostModel {
        CostModel::with_link("l", Linear::new(1.0, 0.01)).codec_entry(
            "c",
            CodecCost {
                compress: Linear::new(2.0, 0.0025),
                decompress: Linear::new(1.0, 0.0025),
                ratio: 0.25,
            },
        )
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn uncompressed_layer_wise_is_wait_free_backprop_with_a_fifo_channel() {
        // Tensors: 100 B / bp 1, 400 B / bp 1, 100 B / bp 10.
        let p = prof(&[(25, 1.0), (100, 1.0), (25, 10.0)]);
        let t = simulate(&p, &cost(), &Plan::layer_wise(3, None)).unwrap();
        // g0: ready 1, comm 1..3 (1 + 1). g1: ready 2, channel free 3, comm 3..8 (1 + 4).
        // g2: ready 12, comm 12..14.
        assert_eq!(t.groups[0].comm, (1.0, 3.0));
        assert_eq!(t.groups[1].comm, (3.0, 8.0));
        assert_eq!(t.groups[2].comm, (12.0, 14.0));
        assert_eq!(t.groups[2].backprop, (2.0, 12.0));
        assert!(t
            .groups
            .iter()
            .all(|g| g.compress.is_none() && g.decompress.is_none()));
        assert!(close(t.time, 14.0));
    }

    #[test]
    fn compression_on_the_compute_stream_delays_backprop() {
        // Two tensors of 400 B, bp 1 each; codec c; groups [0], [1].
        let p = prof(&[(100, 1.0), (100, 1.0)]);
        let t = simulate(&p, &cost(), &Plan::layer_wise(2, Some("c"))).unwrap();
        // g0: bp 0..1, compress 1..4 (2 + 1), comm 4..6 (1 + 100 B · 0.01),
        //     decompress 6..8 (1 + 1).
        // g1: bp 4..5 (delayed by g0's compression), compress 5..8, comm starts at
        //     max(8 channel, 8 ready) = 8..10, decompress 10..12.
        let g = &t.groups;
        assert_eq!(g[0].backprop, (0.0, 1.0));
        assert_eq!(g[0].compress, Some((1.0, 4.0)));
        assert_eq!(g[0].comm, (4.0, 6.0));
        assert_eq!(g[0].decompress, Some((6.0, 8.0)));
        assert_eq!(g[1].backprop, (4.0, 5.0));
        assert_eq!(g[1].compress, Some((5.0, 8.0)));
        assert_eq!(g[1].comm, (8.0, 10.0));
        assert_eq!(g[1].decompress, Some((10.0, 12.0)));
        assert!(close(t.time, 12.0));

        // Fused: bp 0..2, compress 2..(2+2+2)=6, comm 6..(6+1+2)=9, decompress 9..(9+1+2)=12.
        let f = simulate(&p, &cost(), &Plan::single(2, Some("c"))).unwrap();
        assert_eq!(f.groups[0].compress, Some((2.0, 6.0)));
        assert_eq!(f.groups[0].comm, (6.0, 9.0));
        assert_eq!(f.groups[0].decompress, Some((9.0, 12.0)));
        assert!(close(f.time, 12.0));
    }

    #[test]
    fn separate_compression_stream_overlaps_backprop() {
        let p = prof(&[(100, 1.0), (100, 1.0)]);
        let plan = Plan::layer_wise(2, Some("c")).on(None, CompressOn::Separate);
        let t = simulate(&p, &cost(), &plan).unwrap();
        // g0: bp 0..1, compress 1..4, comm 4..6, decompress 6..8.
        // g1: bp 1..2 (not delayed), compress waits for the stream: 4..7; comm max(8,7) = 8..10,
        //     decompress 10..12.
        let g = &t.groups;
        assert_eq!(g[1].backprop, (1.0, 2.0));
        assert_eq!(g[1].compress, Some((4.0, 7.0)));
        assert_eq!(g[1].comm, (8.0, 10.0));
        assert!(close(t.time, 12.0));
    }

    #[test]
    fn mixed_codecs_and_link_choice() {
        let p = prof(&[(100, 1.0), (100, 1.0)]);
        let mut c = cost();
        c.links.insert("fast".into(), Linear::new(0.0, 0.001));
        // g0 uncompressed on "fast": ready 1, comm 1..1.4. g1 with c: bp 1..2, compress 2..5,
        // comm 5..5.1, decompress 5.1..7.1.
        let mut plan = Plan::from_ends(&[1, 2], Some("c")).on(Some("fast"), CompressOn::Compute);
        plan.groups[0].codec = None;
        let t = simulate(&p, &c, &plan).unwrap();
        assert_eq!(t.groups[0].comm, (1.0, 1.4));
        assert_eq!(t.groups[1].compress, Some((2.0, 5.0)));
        assert!(close(t.groups[1].comm.1, 5.1));
        assert!(close(t.time, 7.1));
        plan.link = Some("missing".into());
        assert!(simulate(&p, &c, &plan).is_err());
    }

    #[test]
    fn topology_schemes_by_hand() {
        use crate::cost::{Choice, Scheme, Topology};
        // One tensor of 400 B, bp 1; link "l" (all-reduce 1 + 0.01/B) and codec c (ratio 1/4).
        let p = prof(&[(100, 1.0)]);
        let mut c = cost();
        let mut plan = Plan::layer_wise(1, Some("c"));
        plan.topology = Some(Topology::Flat { ranks: 4 });
        let run = |plan: &Plan| simulate(&p, &c, plan).unwrap();
        // Codec without a choice on a topology is rejected.
        assert!(simulate(&p, &cost(), &plan).is_err());
        // All-gather, 4 ranks, W = 100 B: pre c(400) = 3 (1..4); channel (1 + 4·0.01·100)/2
        // = 2.5 (4..6.5); post d(3·400) = 4 (6.5..10.5).
        plan.groups[0].choice = Some(Choice::flat(Scheme::AllGather));
        let t = run(&plan);
        assert_eq!(t.groups[0].compress, Some((1.0, 4.0)));
        assert_eq!(t.groups[0].comm, (4.0, 6.5));
        assert_eq!(t.groups[0].decompress, Some((6.5, 10.5)));
        // Divisible: channel 2·(1 + 1)/2 + d(300) 1.75 + c(100) 2.25 = 6 (4..10); post 1.75.
        plan.groups[0].choice = Some(Choice::flat(Scheme::Divisible));
        let t = run(&plan);
        assert_eq!(t.groups[0].comm, (4.0, 10.0));
        assert!(close(t.time, 11.75));
        // Uncompressed on a topology: the all-reduce, as without one (1..6).
        plan.groups[0].codec = None;
        plan.groups[0].choice = None;
        assert!(close(run(&plan).time, 6.0));

        // Two machines of two ranks; intra link "i" 0.5 + 0.001/B, inter "l". Shard 200 B.
        c.links.insert("i".into(), Linear::new(0.5, 0.001));
        plan.topology = Some(Topology::Hierarchical {
            machines: 2,
            local: 2,
            intra: "i".into(),
        });
        let run = |plan: &Plan| simulate(&p, &c, plan).unwrap();
        // Uncompressed: I.half(400) 0.45 + E(200) 3 + I.half(400) 0.45 = 3.9 (1..4.9).
        assert!(close(run(&plan).time, 4.9));
        // Inter-only all-gather: no pre-compression; 0.45 + c(200) 2.5 + E.all_gather(2, 50)
        // (1 + 2·0.01·50)/2 = 1 + d(200) 1.5 + 0.45 = 5.9 (1..6.9), no post.
        plan.groups[0].codec = Some("c".into());
        plan.groups[0].choice = Some(Choice {
            inter: Some(Scheme::AllGather),
            intra: false,
        });
        let t = run(&plan);
        assert_eq!(t.groups[0].compress, None);
        assert!(close(t.time, 6.9));
        // Intra only: pre c(400) 3 (1..4); I.half(100) 0.3 + d(200) 1.5 + E(200) 3 + c(200)
        // 2.5 + I.half(100) 0.3 = 7.6 (4..11.6); post d(200) 1.5.
        plan.groups[0].choice = Some(Choice {
            inter: None,
            intra: true,
        });
        let t = run(&plan);
        assert_eq!(t.groups[0].compress, Some((1.0, 4.0)));
        assert!(close(t.groups[0].comm.1, 11.6));
        assert!(close(t.time, 13.1));
        // A choice compressing nothing, or one on a plan without topology, is rejected.
        plan.groups[0].choice = Some(Choice {
            inter: None,
            intra: false,
        });
        assert!(simulate(&p, &c, &plan).is_err());
        plan.topology = None;
        plan.groups[0].choice = Some(Choice::flat(Scheme::Divisible));
        assert!(simulate(&p, &c, &plan).is_err());
    }

    #[test]
    fn empty_profile_takes_no_time() {
        let t = simulate(&prof(&[]), &cost(), &Plan::single(0, None)).unwrap();
        assert_eq!(t.time, 0.0);
        assert!(t.groups.is_empty());
    }
}
