//! Reduction kernels (placeholder until the kernels land).
