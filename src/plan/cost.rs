//! The cost model: Cupcake's g (communication) and h (compression), plus decompression.
//!
//! Every cost is linear in bytes, `α + β·bytes` ([`Linear`]): α is the fixed cost of one operation
//! (kernel launch, per-message latency) and is what fusion amortises; β is the per-byte cost.
//! `qccl-perf --calibrate` is meant to measure these and write them as JSON.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// A linear cost `alpha + beta · bytes`, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Linear {
    /// Fixed seconds per operation.
    pub alpha: f64,
    /// Seconds per byte.
    pub beta: f64,
}

impl Linear {
    /// No cost at all.
    pub const ZERO: Linear = Linear {
        alpha: 0.0,
        beta: 0.0,
    };

    /// `alpha + beta · bytes`.
    pub const fn new(alpha: f64, beta: f64) -> Self {
        Linear { alpha, beta }
    }

    /// Seconds for one operation on `bytes` bytes.
    pub fn time(&self, bytes: f64) -> f64 {
        self.alpha + self.beta * bytes
    }

    fn validate(&self, what: &str) -> Result<()> {
        // Non-negative α is what makes "fuse the rest into one group" a lower bound on the rest's
        // cost (subadditivity), which Cupcake's pruning and the DP's bounds rely on.
        let ok = |x: f64| x.is_finite() && x >= 0.0;
        if ok(self.alpha) && ok(self.beta) {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "{what}: alpha {} and beta {} must be finite and >= 0",
                self.alpha, self.beta
            )))
        }
    }
}

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
}

impl CostModel {
    /// A model with one link (which becomes the default) and no codecs.
    pub fn with_link(name: &str, link: Linear) -> Self {
        CostModel {
            note: String::new(),
            default_link: name.to_string(),
            links: BTreeMap::from([(name.to_string(), link)]),
            codecs: BTreeMap::new(),
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

    /// The codec called `name`.
    pub fn codec(&self, name: &str) -> Result<&CodecCost> {
        self.codecs
            .get(name)
            .ok_or_else(|| Error::InvalidArgument(format!("cost model has no codec {name:?}")))
    }

    /// Checks the default link exists and every cost is finite and non-negative (ratio > 0).
    pub fn validate(&self) -> Result<()> {
        self.link(None)?;
        for (name, l) in &self.links {
            l.validate(&format!("link {name}"))?;
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

    /// Parses and validates a cost model from JSON text.
    pub fn from_json(text: &str) -> Result<Self> {
        let m: CostModel = super::from_json("cost model", text)?;
        m.validate()?;
        Ok(m)
    }

    /// Pretty JSON (with a trailing newline).
    pub fn to_json(&self) -> String {
        super::to_json(self)
    }

    /// Reads and validates a cost-model file.
    pub fn read(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_json(&super::read_text(path.as_ref())?)
    }

    /// Writes the cost model as pretty JSON.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        super::write_text(path.as_ref(), &self.to_json())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
