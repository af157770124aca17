//! Command-line values the perf-tests binaries share (qccl-perf, qccl-gpu-bench): sizes and
//! element types by nccl-tests' names.

use qccl::DType;

/// Parses a byte count with an optional K, M or G suffix (powers of 1024), as nccl-tests.
pub fn parse_size(s: &str) -> Result<u64, String> {
    qccl::internal::parse_size(s)
        .ok_or_else(|| format!("'{s}' is not a size (e.g. 4096, 64K, 1M, 2G)"))
}

/// Element type by nccl-tests' name or a common alias.
pub fn parse_dtype(s: &str) -> Result<Vec<DType>, String> {
    let d = match s.to_ascii_lowercase().as_str() {
        "all" => return Ok(DType::ALL.to_vec()),
        "float" | "float32" | "fp32" | "f32" => DType::Float32,
        "half" | "float16" | "fp16" | "f16" => DType::Float16,
        "bfloat16" | "bf16" => DType::Bfloat16,
        "double" | "float64" | "fp64" | "f64" => DType::Float64,
        "int8" | "char" | "i8" => DType::Int8,
        "uint8" | "u8" => DType::Uint8,
        "int32" | "int" | "i32" => DType::Int32,
        "uint32" | "uint" | "u32" => DType::Uint32,
        "int64" | "i64" => DType::Int64,
        "uint64" | "u64" => DType::Uint64,
        _ => {
            return Err(format!(
                "unknown datatype '{s}' (float, half, bfloat16, double, int8, uint8, int32, \
                 uint32, int64, uint64, all)"
            ))
        }
    };
    Ok(vec![d])
}
