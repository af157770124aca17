//! A fusion plan: the model's tensors cut into groups of consecutive tensors (in backprop order),
//! each compressed (or not) and communicated as one unit; plus the usual baseline fusions.

use crate::cost::{Choice, CostModel, Topology};
use crate::profile::Profile;
use crate::sim::CompressOn;
use qccl::{Error, Result};
use serde::{Deserialize, Serialize};

/// One fusion group: tensors `start..end` (backprop order, end exclusive) fused into one buffer,
/// compressed with `codec` (or sent uncompressed for `None`) and communicated as one collective.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Group {
    /// First tensor (index into [`Profile::tensors`]).
    pub start: usize,
    /// One past the last tensor.
    pub end: usize,
    /// Codec name (a key of [`CostModel::codecs`]), or `None` for no compression.
    #[serde(default)]
    pub codec: Option<String>,
    /// How the compressed group is synchronised (Espresso's options); required for a
    /// compressed group of a plan with a [`Plan::topology`], not allowed without one (the
    /// group then uses the original model: one collective on the compressed bytes, see
    /// [`crate::sim`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub choice: Option<Choice>,
}

/// A plan for one iteration: the groups in order (they are communicated in this order) and the
/// execution setting it was made for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Link (cost-model key, e.g. `"tcp/sra"`); `None` means the cost model's default.
    #[serde(default)]
    pub link: Option<String>,
    /// Where compression runs (see [`CompressOn`]).
    #[serde(default)]
    pub compress_on: CompressOn,
    /// The groups, covering tensors `0..n` in order without gaps.
    pub groups: Vec<Group>,
    /// The ranks, for plans whose groups carry a [`Choice`] (Espresso); `None`: the link's cost
    /// is taken as the whole collective's, whatever the rank count (Cupcake's model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<Topology>,
}

impl Plan {
    /// The groups as `qccl::fused` runs them (tensor range and codec spec).
    pub fn fused(&self) -> Vec<qccl::fused::FusedGroup> {
        self.groups
            .iter()
            .map(|g| qccl::fused::FusedGroup::new(g.start..g.end, g.codec.as_deref()))
            .collect()
    }

    /// A plan from group boundaries: `ends` are the exclusive ends of the groups, increasing,
    /// the last one being the tensor count. Default link, compression on the compute stream.
    pub fn from_ends(ends: &[usize], codec: Option<&str>) -> Self {
        let mut start = 0;
        let groups = ends
            .iter()
            .map(|&end| {
                let g = Group {
                    start,
                    end,
                    codec: codec.map(str::to_string),
                    choice: None,
                };
                start = end;
                g
            })
            .collect();
        Plan {
            link: None,
            compress_on: CompressOn::default(),
            groups,
            topology: None,
        }
    }

    /// Sets the link and the compression stream (builder style).
    pub fn on(mut self, link: Option<&str>, compress_on: CompressOn) -> Self {
        self.link = link.map(str::to_string);
        self.compress_on = compress_on;
        self
    }

    /// The exclusive ends of the groups.
    pub fn ends(&self) -> Vec<usize> {
        self.groups.iter().map(|g| g.end).collect()
    }

    /// Layer-wise: every tensor its own group (what frameworks do by default with compression).
    pub fn layer_wise(n: usize, codec: Option<&str>) -> Self {
        Self::from_ends(&(1..=n).collect::<Vec<_>>(), codec)
    }

    /// One group holding every tensor (communication starts only after the whole backprop).
    pub fn single(n: usize, codec: Option<&str>) -> Self {
        let ends: &[usize] = if n == 0 { &[] } else { &[n] };
        Self::from_ends(ends, codec)
    }

    /// `parts` groups with equal tensor counts (the first `n % parts` get one more); `parts` is
    /// clamped to `1..=n`. Cupcake suggests two such groups to bootstrap its search.
    pub fn even_split(n: usize, parts: usize, codec: Option<&str>) -> Self {
        if n == 0 {
            return Self::from_ends(&[], codec);
        }
        let parts = parts.clamp(1, n);
        let (q, r) = (n / parts, n % parts);
        let mut end = 0;
        let ends: Vec<usize> = (0..parts)
            .map(|p| {
                end += q + usize::from(p < r);
                end
            })
            .collect();
        Self::from_ends(&ends, codec)
    }

    /// Fixed-size buckets in the style of PyTorch DDP / Horovod fusion buffers: tensors are added
    /// in backprop order and a bucket closes as soon as it holds at least `bucket_bytes` bytes.
    pub fn buckets(profile: &Profile, bucket_bytes: usize, codec: Option<&str>) -> Self {
        let mut ends = Vec::new();
        let mut acc = 0;
        for (i, t) in profile.tensors.iter().enumerate() {
            acc += t.bytes();
            if acc >= bucket_bytes {
                ends.push(i + 1);
                acc = 0;
            }
        }
        if ends.last() != Some(&profile.len()) && !profile.is_empty() {
            ends.push(profile.len());
        }
        Self::from_ends(&ends, codec)
    }

    /// Checks the groups are non-empty and tile `0..profile.len()` in order, and that the link and
    /// every codec exist in the cost model.
    pub fn validate(&self, profile: &Profile, cost: &CostModel) -> Result<()> {
        cost.link(self.link.as_deref())?;
        if let Some(t) = &self.topology {
            t.validate(cost, None)?;
        }
        let mut next = 0;
        for (i, g) in self.groups.iter().enumerate() {
            if g.start != next || g.end <= g.start {
                return Err(Error::InvalidArgument(format!(
                    "plan group {i} is {}..{}, expected a non-empty group starting at {next}",
                    g.start, g.end
                )));
            }
            if let Some(c) = &g.codec {
                cost.codec(c)?;
            }
            match (&self.topology, &g.codec, g.choice) {
                (None, _, None) | (Some(_), None, None) => {}
                (Some(t), Some(_), Some(ch)) => t.validate(cost, Some(ch))?,
                (None, _, Some(_)) => {
                    return Err(Error::InvalidArgument(format!(
                        "plan group {i} has a choice but the plan has no topology"
                    )))
                }
                (Some(_), None, Some(_)) | (Some(_), Some(_), None) => {
                    return Err(Error::InvalidArgument(format!(
                        "plan group {i}: a choice goes with a codec (and a codec with a choice \
                         on a topology)"
                    )))
                }
            }
            next = g.end;
        }
        if next != profile.len() {
            return Err(Error::InvalidArgument(format!(
                "plan covers tensors 0..{next} but the profile has {}",
                profile.len()
            )));
        }
        Ok(())
    }
}

/// A plan file is checked against its profile by [`Plan::validate`], not on reading.
impl crate::JsonFile for Plan {
    const WHAT: &'static str = "plan";
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::Linear;
    use crate::testing::prof;
    use crate::JsonFile;

    #[test]
    fn baselines_tile_the_model() {
        let p = prof(&[10, 20, 30, 40, 50], 1.0);
        let cost = CostModel::with_link("l", Linear::ZERO);
        assert_eq!(Plan::layer_wise(5, None).ends(), vec![1, 2, 3, 4, 5]);
        assert_eq!(Plan::single(5, None).ends(), vec![5]);
        assert_eq!(Plan::even_split(5, 2, None).ends(), vec![3, 5]);
        assert_eq!(Plan::even_split(5, 9, None).ends(), vec![1, 2, 3, 4, 5]);
        // Bytes 40, 80, 120, 160, 200: 40 + 80 + 120 >= 200 closes the first bucket, 160 + 200
        // the second.
        assert_eq!(Plan::buckets(&p, 200, None).ends(), vec![3, 5]);
        assert_eq!(Plan::buckets(&p, 100, None).ends(), vec![2, 3, 4, 5]);
        assert_eq!(Plan::buckets(&p, 1 << 30, None).ends(), vec![5]);
        for plan in [
            Plan::layer_wise(5, None),
            Plan::single(5, None),
            Plan::even_split(5, 3, None),
            Plan::buckets(&p, 100, None),
        ] {
            plan.validate(&p, &cost).unwrap();
        }
        assert!(Plan::from_ends(&[2, 2, 5], None)
            .validate(&p, &cost)
            .is_err());
        assert!(Plan::from_ends(&[2, 4], None).validate(&p, &cost).is_err());
        assert!(Plan::from_ends(&[5], Some("sign"))
            .validate(&p, &cost)
            .is_err());
        assert!(Plan::single(0, None)
            .validate(&prof(&[], 1.0), &cost)
            .is_ok());
    }

    #[test]
    fn json_round_trip() {
        let plan = Plan::from_ends(&[2, 5], Some("sign")).on(Some("tcp/sra"), CompressOn::Separate);
        assert_eq!(Plan::from_json(&plan.to_json()).unwrap(), plan);
    }
}
