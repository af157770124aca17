//! The cost shape every model here is made of: `alpha + beta · bytes` seconds (a leaf: the
//! cost model and the measured curves both build on it).

use qccl::{Error, Result};
use serde::{Deserialize, Serialize};

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

    /// Half an all-reduce of `bytes`: a reduce-scatter (all-to-all of chunks) or an all-gather
    /// of chunks, in the ring decomposition (see the module docs).
    pub fn half(&self, bytes: f64) -> f64 {
        0.5 * self.time(bytes)
    }

    /// An indivisible all-gather among `ranks` ranks, each contributing `bytes`: `ranks − 1`
    /// ring steps of `bytes`, i.e. `(α + ranks·β·bytes)/2` (see the module docs).
    pub fn all_gather(&self, ranks: usize, bytes: f64) -> f64 {
        0.5 * (self.alpha + ranks as f64 * self.beta * bytes)
    }

    pub(crate) fn validate(&self, what: &str) -> Result<()> {
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
