//! The all-reduce algorithms by name: what QCCL_ALGO and a call may ask for.

use crate::error::{Error, Result};

/// All-reduce algorithm choice (QCCL_ALGO, or per call).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Algo {
    /// Pick from message size and world size.
    Auto,
    /// Reduce-scatter then all-gather around a ring: bandwidth-optimal.
    Ring,
    /// Reduce up and broadcast down a binary tree: lowest latency for small messages.
    Tree,
    /// Scatter-reduce-allgather (CGX): each chunk reduced once by its owner, in rank order.
    Sra,
    /// Two-level: intra-host reduce-scatter, inter-host all-reduce among equal local ranks,
    /// intra-host all-gather (needs the same number of ranks on every host).
    Hier,
    /// Compressed only: every rank's encoded buffer to everyone, summed in rank order (the
    /// scheme sparse codecs use by default).
    AllGather,
}

impl Algo {
    /// Parses `auto`, `ring`, `tree`, `sra`, `hier` or `allgather` (case-insensitive).
    pub fn parse(s: &str) -> Result<Algo> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(Algo::Auto),
            "ring" => Ok(Algo::Ring),
            "tree" => Ok(Algo::Tree),
            "sra" => Ok(Algo::Sra),
            "hier" => Ok(Algo::Hier),
            "allgather" | "ag" => Ok(Algo::AllGather),
            other => Err(Error::invalid(format!(
                "unknown algorithm '{other}' (valid: auto, ring, tree, sra, hier, allgather)"
            ))),
        }
    }

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Algo::Auto => "auto",
            Algo::Ring => "ring",
            Algo::Tree => "tree",
            Algo::Sra => "sra",
            Algo::Hier => "hier",
            Algo::AllGather => "allgather",
        }
    }
}
