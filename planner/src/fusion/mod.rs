//! How a step's tensors are grouped for the collective: a fusion [`Plan`] (consecutive groups,
//! each dense or with a codec) with the baseline fusions ([`plan`]), and DeAR's fusion buffer,
//! which forms groups online by a byte threshold ([`buffer`]).

pub mod buffer;
pub mod plan;

pub use plan::{Group, Plan};
