//! qccl's planners: pure, deterministic functions over tensor profiles and a cost model that
//! decide how a training step's gradients go through the collective. They run no collective
//! themselves: a plan's groups are executed by `qccl::fused` ([`Plan::fused`] hands them
//! over), and `qccl-perf --calibrate` measures the cost model they read.
//!
//! - [`profile`]: the tensors of a model in backprop order, with sizes and backprop times.
//! - [`models`]: ResNet-50/101 and BERT-base profiles built from the published architectures
//!   (the files under `data/profiles/` are their output).
//! - [`cost`]: the cost model: link α + β·bytes per transport/algorithm, codec compression and
//!   decompression α + β·bytes and compression ratio (Cupcake's g and h); for Espresso, the
//!   all-gather and divisible schemes and flat or two-level topologies ([`CostModel::sync`]).
//! - [`fusion`]: how tensors are grouped: a [`Plan`] (fusion groups, each with a codec or none)
//!   and the baseline fusions, and DeAR's fusion buffer (groups by a byte threshold).
//! - [`sim`]: the timeline simulator that turns (profile, cost model, plan) into an iteration time.
//! - [`cupcake`]: optimal fusion for compression: the paper's Algorithm 1 (exact on a link's
//!   line, refuses measured curves) and an exact dynamic program with Pareto pruning that scales
//!   to hundreds of tensors.
//! - [`espresso`](mod@espresso): per-tensor compression strategy (compress or not, codec, divisible or
//!   all-gather scheme, which tiers of a two-level job): the paper's Algorithm 1 and brute force.
//! - [`dear`]: DeAR with qccl, and the Bayesian tuner of its fusion threshold.
//!
//! Inputs and outputs are JSON files (serde), so `qccl-perf --calibrate` can write cost models and
//! tools can read and write profiles and plans.
//!
//! ```no_run
//! # fn main() -> qccl::Result<()> {
//! use qccl::fused::PlanRunner;
//! use qccl_planner::{models, Plan};
//! let comm = qccl::Comm::from_env()?;
//! let profile = models::resnet50();
//! let plan = Plan::even_split(profile.len(), 8, Some("qsgd:bits=4"));
//! let mut runner = PlanRunner::new(&comm, &plan.fused(), &profile.sizes())?;
//! for (i, t) in profile.tensors.iter().enumerate() {
//!     runner.submit(i, vec![0.0f32; t.elems])?; // ... backprop produces tensor i's gradient
//! }
//! let averaged = runner.finish()?;
//! # let _ = averaged;
//! # Ok(())
//! # }
//! ```

pub mod cost;
pub mod cupcake;
pub mod curve;
pub mod dear;
pub mod espresso;
pub mod fusion;
mod linear;
pub mod models;
pub mod profile;
pub mod sim;
#[cfg(test)]
mod testing;

pub use cost::{Choice, CodecCost, CostModel, Linear, Scheme, SyncCost, Topology};
pub use cupcake::{algorithm1, exhaustive, optimal_fusion, Fusion};
pub use curve::LinkCost;
pub use espresso::{
    best_uniform, espresso, espresso_algorithm1, exhaustive_espresso, uniform, Decision,
    EspressoCtx, EspressoPlan,
};
pub use fusion::{Group, Plan};
pub use profile::{Profile, TensorProfile};
pub use sim::{simulate, CompressOn, GroupEvents, Timeline};

use qccl::{Error, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::path::Path;

/// The planners' files (profiles, cost models, plans): JSON text and files, checked on reading.
pub trait JsonFile: Serialize + DeserializeOwned {
    /// What the file holds, for error messages.
    const WHAT: &'static str;

    /// Checks a parsed value (default: nothing to check).
    fn check(&self) -> Result<()> {
        Ok(())
    }

    /// Parses and checks a value from JSON text.
    fn from_json(text: &str) -> Result<Self> {
        let v: Self = from_json(Self::WHAT, text)?;
        v.check()?;
        Ok(v)
    }

    /// Pretty JSON (with a trailing newline).
    fn to_json(&self) -> String {
        to_json(self)
    }

    /// Reads and checks a file.
    fn read(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_json(&read_text(path.as_ref())?)
    }

    /// Writes the value as pretty JSON.
    fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        write_text(path.as_ref(), &self.to_json())
    }
}

/// Parses a planner file from JSON text; parse errors become [`Error::InvalidArgument`].
pub(crate) fn from_json<T: DeserializeOwned>(what: &str, text: &str) -> Result<T> {
    serde_json::from_str(text).map_err(|e| Error::InvalidArgument(format!("{what} JSON: {e}")))
}

/// Pretty JSON with a trailing newline, so shipped files diff cleanly and compare byte for byte.
pub(crate) fn to_json<T: Serialize>(value: &T) -> String {
    // Serialising plain structs of numbers, strings and maps with string keys cannot fail.
    let mut s = serde_json::to_string_pretty(value).expect("planner types serialise");
    s.push('\n');
    s
}

/// Reads a whole file as text; I/O errors become [`Error::System`] naming the path.
pub(crate) fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| Error::System(format!("{}: {e}", path.display())))
}

/// Writes a whole file; I/O errors become [`Error::System`] naming the path.
pub(crate) fn write_text(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|e| Error::System(format!("{}: {e}", path.display())))
}
