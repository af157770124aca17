//! Element types and reduction operators, numbered as NCCL numbers them.

use crate::error::{Error, Result};
use std::fmt;

/// Element type of a buffer. The discriminants are NCCL's `ncclDataType_t` values.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// `i8`
    Int8 = 0,
    /// `u8`
    Uint8 = 1,
    /// `i32`
    Int32 = 2,
    /// `u32`
    Uint32 = 3,
    /// `i64`
    Int64 = 4,
    /// `u64`
    Uint64 = 5,
    /// IEEE half precision (`half::f16`); reduced through f32.
    Float16 = 6,
    /// `f32`
    Float32 = 7,
    /// `f64`
    Float64 = 8,
    /// bfloat16 (`half::bf16`); reduced through f32.
    Bfloat16 = 9,
}

impl DType {
    /// Every dtype, in numbering order.
    pub const ALL: [DType; 10] = [
        DType::Int8,
        DType::Uint8,
        DType::Int32,
        DType::Uint32,
        DType::Int64,
        DType::Uint64,
        DType::Float16,
        DType::Float32,
        DType::Float64,
        DType::Bfloat16,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::Int8 | DType::Uint8 => 1,
            DType::Float16 | DType::Bfloat16 => 2,
            DType::Int32 | DType::Uint32 | DType::Float32 => 4,
            DType::Int64 | DType::Uint64 | DType::Float64 => 8,
        }
    }

    /// True for the floating-point types.
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DType::Float16 | DType::Float32 | DType::Float64 | DType::Bfloat16
        )
    }

    /// The dtype with NCCL number `v`.
    pub fn from_i32(v: i32) -> Result<DType> {
        DType::ALL
            .get(usize::try_from(v).unwrap_or(usize::MAX))
            .copied()
            .ok_or_else(|| Error::invalid(format!("unknown datatype {v} (valid: 0..=9)")))
    }

    /// nccl-tests' name of the type (`float`, `half`, `bfloat16`, `int32`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::Int8 => "int8",
            DType::Uint8 => "uint8",
            DType::Int32 => "int32",
            DType::Uint32 => "uint32",
            DType::Int64 => "int64",
            DType::Uint64 => "uint64",
            DType::Float16 => "half",
            DType::Float32 => "float",
            DType::Float64 => "double",
            DType::Bfloat16 => "bfloat16",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Reduction operator. The discriminants are NCCL's `ncclRedOp_t` values.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Sum (integers wrap).
    Sum = 0,
    /// Product (integers wrap).
    Prod = 1,
    /// Maximum.
    Max = 2,
    /// Minimum.
    Min = 3,
    /// Sum divided by the number of ranks; floating-point types only.
    Avg = 4,
}

impl ReduceOp {
    /// Every op, in numbering order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ];

    /// The op with NCCL number `v`.
    pub fn from_i32(v: i32) -> Result<ReduceOp> {
        ReduceOp::ALL
            .get(usize::try_from(v).unwrap_or(usize::MAX))
            .copied()
            .ok_or_else(|| Error::invalid(format!("unknown reduction op {v} (valid: 0..=4)")))
    }

    /// nccl-tests' name of the op.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Avg => "avg",
        }
    }

    /// Checks that this op can reduce `dtype` (Avg needs a floating-point type).
    pub fn check_dtype(self, dtype: DType) -> Result<()> {
        if self == ReduceOp::Avg && !dtype.is_float() {
            return Err(Error::invalid(format!(
                "op avg needs a floating-point datatype, got {dtype}"
            )));
        }
        Ok(())
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A Rust element type qccl can move and reduce. Implemented for the ten NCCL types.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// The matching `DType`.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => { $(impl Element for $t { const DTYPE: DType = DType::$d; })* };
}
element!(i8 => Int8, u8 => Uint8, i32 => Int32, u32 => Uint32, i64 => Int64, u64 => Uint64,
    half::f16 => Float16, f32 => Float32, f64 => Float64, half::bf16 => Bfloat16);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbering_matches_nccl() {
        for (i, d) in DType::ALL.iter().enumerate() {
            assert_eq!(*d as i32, i as i32);
            assert_eq!(DType::from_i32(i as i32).unwrap(), *d);
        }
        assert!(DType::from_i32(10).is_err());
        assert!(DType::from_i32(-1).is_err());
        assert_eq!(ReduceOp::Avg as i32, 4);
        assert!(ReduceOp::from_i32(5).is_err());
        assert!(ReduceOp::Avg.check_dtype(DType::Int32).is_err());
        assert!(ReduceOp::Avg.check_dtype(DType::Bfloat16).is_ok());
    }
}
