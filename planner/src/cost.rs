//! The cost model: Cupcake's g (communication) and h (compression), plus decompression.
//!
//! Every cost is linear in bytes, `α + β·bytes` ([`Linear`]): α is the fixed cost of one operation
//! (kernel launch, per-message latency) and is what fusion amortises; β is the per-byte cost.
//! `qccl-perf --calibrate` is meant to measure these and write them as JSON.
//!
//! # Schemes and tiers (Espresso)
//!
//! A link's [`Linear`] is the time of one *all-reduce* of `bytes` among the ranks it joins. For
//! Espresso's per-tensor options ([`Choice`]) the other collectives are derived from it with the
//! textbook ring decomposition (Thakur et al.): an all-reduce of `B` bytes on `n` ranks is
//! `2(n−1)` steps of `α_s + β_s·B/n`, so `α = 2(n−1)·α_s` and `β = 2(n−1)/n·β_s`. Hence
//! - a reduce-scatter (or all-to-all of chunks) and an all-gather of chunks of `B` are each half
//!   an all-reduce: `(α + β·B)/2` ([`Linear::half`]); a *divisible* scheme moves
//!   `2(n−1)/n` of the compressed bytes per rank, like an all-reduce of them;
//! - an *indivisible* all-gather where every rank contributes `W` bytes is `n−1` steps of `W`:
//!   `(α + n·β·W)/2` ([`Linear::all_gather`]), i.e. `(n−1)·W` bytes per rank.
//!
//! [`CostModel::sync`] puts these together with the codec's costs into the time one tensor's
//! synchronisation occupies the channel, for a flat or a two-level ([`Topology`]) job.

use crate::curve::LinkCost;
pub use crate::linear::Linear;
use qccl::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What one codec costs. Bytes are always the group's *uncompressed* f32 bytes (`4 · elems`) for
/// compression and decompression (the kernels read or write that much), and the wire carries
/// `ratio ·` that many bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CodecCost {
    /// Compression (encode) time of a group of `bytes` input bytes: Cupcake's h.
    pub compress: Linear,
    /// Decompression (decode, including the aggregation of received data) of a group whose
    /// uncompressed size is `bytes`.
    pub decompress: Linear,
    /// Wire bytes per input byte (e.g. 1/32 for 1-bit sign, ~0.02 for 1% top-k with indices).
    pub ratio: f64,
}

/// How a compressed tensor is synchronised on one tier (Espresso's Dimension 3; compressed
/// tensors cannot be all-reduced because aggregating them is not associative).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scheme {
    /// Indivisible: all-gather of the whole compressed tensors; each rank then decodes and sums
    /// the `n − 1` it received. One compression, `(n−1)·W` wire bytes per rank.
    AllGather,
    /// Divisible: all-to-all of compressed chunks, the chunk's owner decodes and sums them and
    /// compresses the sum again, then an all-gather of the compressed sums, decoded by all.
    /// `2(n−1)/n·W` wire bytes per rank, but two compressions and two decodes.
    Divisible,
}

/// Where and how one compressed tensor is compressed (Espresso's Dimension 4, simplified).
///
/// Flat jobs: `inter` is the scheme of the single collective and `intra` must be false.
/// Hierarchical jobs (intra reduce-scatter, inter-machine exchange of each rank's shard, intra
/// all-gather): `intra` compresses both intra-machine phases (always divisible, as in Espresso:
/// it moves less than two indivisible ones), `inter` the inter-machine phase with that scheme
/// (`None`: uncompressed). At least one of them is set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Choice {
    /// Scheme of the flat collective or of the inter-machine phase; `None`: not compressed there.
    #[serde(default)]
    pub inter: Option<Scheme>,
    /// Hierarchical jobs: the intra-machine phases are compressed.
    #[serde(default)]
    pub intra: bool,
}

impl Choice {
    /// A flat job's choice: the collective uses `scheme`.
    pub const fn flat(scheme: Scheme) -> Self {
        Choice {
            inter: Some(scheme),
            intra: false,
        }
    }
}

/// The ranks a plan synchronises, for plans whose groups carry a [`Choice`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Topology {
    /// `ranks` ranks in one collective on the plan's link.
    Flat {
        /// Number of ranks (≥ 2).
        ranks: usize,
    },
    /// `machines` machines of `local` ranks each: the plan's link is the inter-machine one and
    /// joins `machines` ranks (one per machine); `intra` joins the `local` ranks of a machine.
    Hierarchical {
        /// Machines (≥ 2).
        machines: usize,
        /// Ranks per machine (≥ 2).
        local: usize,
        /// Intra-machine link (a key of [`CostModel::links`]).
        intra: String,
    },
}

impl Topology {
    /// Total rank count.
    pub fn ranks(&self) -> usize {
        match self {
            Topology::Flat { ranks } => *ranks,
            Topology::Hierarchical {
                machines, local, ..
            } => machines * local,
        }
    }

    /// The choices valid on this topology (see [`Choice`]): flat `[all-gather, divisible]`;
    /// hierarchical: inter-only with each scheme, intra-only, and both with each scheme.
    pub fn choices(&self) -> Vec<Choice> {
        let schemes = [Scheme::AllGather, Scheme::Divisible];
        match self {
            Topology::Flat { .. } => schemes.into_iter().map(Choice::flat).collect(),
            Topology::Hierarchical { .. } => {
                let mut v = Vec::with_capacity(5);
                for intra in [false, true] {
                    if intra {
                        v.push(Choice { inter: None, intra });
                    }
                    v.extend(schemes.into_iter().map(|s| Choice {
                        inter: Some(s),
                        intra,
                    }));
                }
                v
            }
        }
    }

    /// Checks the rank counts, that the intra link exists, and (if given) that `choice` is
    /// valid here.
    pub fn validate(&self, cost: &CostModel, choice: Option<Choice>) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        match self {
            Topology::Flat { ranks } => {
                if *ranks < 2 {
                    return bad(format!("flat topology of {ranks} ranks (need >= 2)"));
                }
                if let Some(c) = choice {
                    if c.intra || c.inter.is_none() {
                        return bad(format!("choice {c:?} on a flat topology"));
                    }
                }
            }
            Topology::Hierarchical {
                machines,
                local,
                intra,
            } => {
                if *machines < 2 || *local < 2 {
                    return bad(format!(
                        "hierarchical topology of {machines} x {local} ranks (need >= 2 x 2)"
                    ));
                }
                cost.link(Some(intra))?;
                if let Some(c) = choice {
                    if !c.intra && c.inter.is_none() {
                        return bad("choice compresses neither tier".into());
                    }
                }
            }
        }
        Ok(())
    }
}

/// What synchronising one tensor (or group) costs, from [`CostModel::sync`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SyncCost {
    /// Compression before any communication (on the compute or compression stream).
    pub pre: f64,
    /// Channel occupancy: every communication phase and the codec work between phases
    /// (decode-and-sum, re-compression), which runs inside the collective.
    pub channel: f64,
    /// The final decode, also on the channel, right after `channel` (0 if the last phase is
    /// uncompressed).
    pub post: f64,
}

/// The whole cost model: links (one per transport/algorithm, e.g. `"tcp/sra"`) and codecs, each
/// keyed by name.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Free text: machine, rank count, how it was measured.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub note: String,
    /// The link used when a plan names none; must be a key of `links`.
    pub default_link: String,
    /// Communication time of one collective on `bytes` wire bytes: Cupcake's g.
    pub links: BTreeMap<String, Linear>,
    /// Codec costs by codec name (the names the comm's codec specs use).
    pub codecs: BTreeMap<String, CodecCost>,
    /// Measured (bytes, seconds) points of some links, which refine their lines where the
    /// simulator and Cupcake's DP evaluate them ([`LinkCost`]; Cupcake's Algorithm 1 refuses a
    /// link that has them); Espresso's derived collectives use the lines alone.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub measured: BTreeMap<String, Vec<[f64; 2]>>,
}

impl CostModel {
    /// A model with one link (which becomes the default) and no codecs.
    pub fn with_link(name: &str, link: Linear) -> Self {
        CostModel {
            note: String::new(),
            default_link: name.to_string(),
            links: BTreeMap::from([(name.to_string(), link)]),
            codecs: BTreeMap::new(),
            measured: BTreeMap::new(),
        }
    }

    /// Adds or replaces a codec (builder style).
    pub fn codec_entry(mut self, name: &str, cost: CodecCost) -> Self {
        self.codecs.insert(name.to_string(), cost);
        self
    }

    /// The link called `name`, or the default link for `None`.
    pub fn link(&self, name: Option<&str>) -> Result<&Linear> {
        let name = name.unwrap_or(&self.default_link);
        self.links
            .get(name)
            .ok_or_else(|| Error::InvalidArgument(format!("cost model has no link {name:?}")))
    }

    /// The link called `name` (`None`: the default) with its measured points, if any.
    pub fn link_cost(&self, name: Option<&str>) -> Result<LinkCost> {
        let line = *self.link(name)?;
        let name = name.unwrap_or(&self.default_link);
        Ok(match self.measured.get(name) {
            Some(points) => LinkCost::with_points(line, points.clone()),
            None => LinkCost::line(line),
        })
    }

    /// The codec called `name`.
    pub fn codec(&self, name: &str) -> Result<&CodecCost> {
        self.codecs
            .get(name)
            .ok_or_else(|| Error::InvalidArgument(format!("cost model has no codec {name:?}")))
    }

    /// The cost of synchronising `bytes` (uncompressed f32 bytes) over `topology`, with `link`
    /// (`None`: the default) as the flat or inter-machine link, compressed with `codec` and
    /// `choice` or not at all (`None`). Phases (see the module docs for the link formulas;
    /// `r` = ratio, `d(x)` / `c(x)` = decompress / compress of `x` uncompressed bytes):
    ///
    /// - flat, uncompressed: all-reduce `L(B)`.
    /// - flat, all-gather: pre `c(B)`; `L.all_gather(n, rB)`; post `d((n−1)·B)`.
    /// - flat, divisible: pre `c(B)`; `L.half(rB) + d((n−1)/n·B) + c(B/n) + L.half(rB)`;
    ///   post `d((n−1)/n·B)`.
    /// - hierarchical (`k` local ranks, `N` machines, shard `S = B/k`): intra reduce-scatter
    ///   (`I.half(B)`, or compressed: pre `c(B)`, `I.half(rB) + d((k−1)/k·B)`); the shard on the
    ///   inter link (all-reduce `E(S)`, or the flat compressed formulas on `S` with `N` ranks,
    ///   its compression `c(S)` on the channel since it happens mid-collective); intra
    ///   all-gather (`I.half(B)`, or compressed: `c(S) + I.half(rB)`, post `d((k−1)/k·B)`).
    ///
    /// Simplifications: a rank decodes what it receives (its own contribution is used as is);
    /// the inter phase's result is decoded before the intra all-gather re-compresses it.
    pub fn sync(
        &self,
        topology: &Topology,
        link: Option<&str>,
        bytes: f64,
        codec: Option<(&CodecCost, Choice)>,
    ) -> Result<SyncCost> {
        let link = self.link(link)?;
        // One tier of `n` ranks: (channel, post) for `b` bytes with an optional scheme; the
        // input is compressed before (by the caller) if a scheme is given.
        let tier = |l: &Linear, n: usize, b: f64, cs: Option<(&CodecCost, Scheme)>| match cs {
            None => (l.time(b), 0.0),
            Some((c, Scheme::AllGather)) => (
                l.all_gather(n, c.ratio * b),
                c.decompress.time((n - 1) as f64 * b),
            ),
            Some((c, Scheme::Divisible)) => {
                let part = (n - 1) as f64 / n as f64 * b;
                (
                    l.half(c.ratio * b)
                        + c.decompress.time(part)
                        + c.compress.time(b / n as f64)
                        + l.half(c.ratio * b),
                    c.decompress.time(part),
                )
            }
        };
        Ok(match topology {
            Topology::Flat { ranks } => match codec {
                None => SyncCost {
                    pre: 0.0,
                    channel: link.time(bytes),
                    post: 0.0,
                },
                Some((c, choice)) => {
                    let scheme = choice.inter.ok_or_else(|| {
                        Error::InvalidArgument("flat choice without a scheme".into())
                    })?;
                    let (channel, post) = tier(link, *ranks, bytes, Some((c, scheme)));
                    SyncCost {
                        pre: c.compress.time(bytes),
                        channel,
                        post,
                    }
                }
            },
            Topology::Hierarchical {
                machines,
                local,
                intra,
            } => {
                let il = self.link(Some(intra))?;
                let (k, shard) = (*local, bytes / *local as f64);
                let codec_intra = codec.filter(|(_, ch)| ch.intra).map(|(c, _)| c);
                let inter = codec.and_then(|(c, ch)| ch.inter.map(|s| (c, s)));
                let mut out = SyncCost::default();
                // Phase 1: intra reduce-scatter.
                match codec_intra {
                    Some(c) => {
                        out.pre = c.compress.time(bytes);
                        out.channel += il.half(c.ratio * bytes)
                            + c.decompress.time((k - 1) as f64 / k as f64 * bytes);
                    }
                    None => out.channel += il.half(bytes),
                }
                // Phase 2: each rank's shard among the machines.
                if let Some((c, _)) = inter {
                    out.channel += c.compress.time(shard);
                }
                let (ch, post) = tier(link, *machines, shard, inter);
                out.channel += ch + post;
                // Phase 3: intra all-gather.
                match codec_intra {
                    Some(c) => {
                        out.channel += c.compress.time(shard) + il.half(c.ratio * bytes);
                        out.post = c.decompress.time((k - 1) as f64 / k as f64 * bytes);
                    }
                    None => out.channel += il.half(bytes),
                }
                out
            }
        })
    }

    /// Checks the default link exists and every cost is finite and non-negative (ratio > 0).
    pub fn validate(&self) -> Result<()> {
        self.link(None)?;
        for (name, l) in &self.links {
            l.validate(&format!("link {name}"))?;
        }
        for (name, points) in &self.measured {
            if !self.links.contains_key(name) {
                return Err(Error::InvalidArgument(format!(
                    "measured points for {name:?}, which is not a link of the model"
                )));
            }
            if let Some([b, t]) = points
                .iter()
                .find(|[b, t]| !(b.is_finite() && *b > 0.0 && t.is_finite() && *t >= 0.0))
            {
                return Err(Error::InvalidArgument(format!(
                    "link {name}: measured point ({b} bytes, {t} s) must have bytes > 0 and \
                     seconds >= 0"
                )));
            }
        }
        for (name, c) in &self.codecs {
            c.compress.validate(&format!("codec {name} compress"))?;
            c.decompress.validate(&format!("codec {name} decompress"))?;
            if !(c.ratio.is_finite() && c.ratio > 0.0) {
                return Err(Error::InvalidArgument(format!(
                    "codec {name}: ratio {} must be finite and > 0",
                    c.ratio
                )));
            }
        }
        Ok(())
    }
}

impl crate::JsonFile for CostModel {
    const WHAT: &'static str = "cost model";
    fn check(&self) -> Result<()> {
        self.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::JsonFile;

    #[test]
    fn lookup_default_and_json_round_trip() {
        let m = CostModel::with_link("tcp/sra", Linear::new(50e-6, 1.0 / 1.0e9)).codec_entry(
            "sign",
            CodecCost {
                compress: Linear::new(2e-4, 1e-10),
                decompress: Linear::new(1e-4, 2e-10),
                ratio: 1.0 / 32.0,
            },
        );
        assert_eq!(m.link(None).unwrap(), m.link(Some("tcp/sra")).unwrap());
        assert!(m.link(Some("shm/ring")).is_err());
        assert!(m.codec("topk").is_err());
        assert_eq!(m.link(None).unwrap().time(1e9), 50e-6 + 1.0);
        let back = CostModel::from_json(&m.to_json()).unwrap();
        assert_eq!(back, m);

        let mut bad = m.clone();
        bad.default_link = "nope".into();
        assert!(CostModel::from_json(&bad.to_json()).is_err());
        let mut bad = m.clone();
        bad.codecs.get_mut("sign").unwrap().ratio = 0.0;
        assert!(bad.validate().is_err());
        let mut bad = m;
        bad.links.get_mut("tcp/sra").unwrap().alpha = -1.0;
        assert!(bad.validate().is_err());
    }
}
