//! The C types and constants of `include/qccl.h`, under their C names.
//!
//! Enums cross the boundary as `int`: a C caller may pass any value, and reading an unknown
//! value into a Rust enum would be undefined behaviour, so they are checked with
//! `DType::from_i32` / `ReduceOp::from_i32` instead.

use std::ffi::{c_char, c_int, c_void};

/// `qcclResult_t`.
pub type qcclResult_t = c_int;
/// Success.
pub const qcclSuccess: qcclResult_t = 0;
/// Reserved (NCCL numbering); never returned by this build.
pub const qcclUnhandledCudaError: qcclResult_t = 1;
/// An operating-system call failed.
pub const qcclSystemError: qcclResult_t = 2;
/// A bug in qccl, or a panic caught at the boundary.
pub const qcclInternalError: qcclResult_t = 3;
/// A bad argument: null pointer, unknown enum value, overflow, out-of-range rank...
pub const qcclInvalidArgument: qcclResult_t = 4;
/// A call not allowed in this state: destroyed comm, aborted comm, ranks that disagree...
pub const qcclInvalidUsage: qcclResult_t = 5;
/// A peer died, closed its connection or failed.
pub const qcclRemoteError: qcclResult_t = 6;
/// Reserved (NCCL numbering): an operation still in progress.
pub const qcclInProgress: qcclResult_t = 7;
/// A wait passed its deadline.
pub const qcclTimeout: qcclResult_t = 8;
/// Not built (CUDA streams, codecs, HiTopK) or not implemented.
pub const qcclUnsupported: qcclResult_t = 9;

/// `qcclDataType_t`, NCCL's numbering.
pub type qcclDataType_t = c_int;
pub const qcclInt8: qcclDataType_t = 0;
pub const qcclUint8: qcclDataType_t = 1;
pub const qcclInt32: qcclDataType_t = 2;
pub const qcclUint32: qcclDataType_t = 3;
pub const qcclInt64: qcclDataType_t = 4;
pub const qcclUint64: qcclDataType_t = 5;
pub const qcclFloat16: qcclDataType_t = 6;
pub const qcclFloat32: qcclDataType_t = 7;
pub const qcclFloat64: qcclDataType_t = 8;
pub const qcclBfloat16: qcclDataType_t = 9;
/// NCCL's aliases.
pub const qcclChar: qcclDataType_t = 0;
pub const qcclInt: qcclDataType_t = 2;
pub const qcclHalf: qcclDataType_t = 6;
pub const qcclFloat: qcclDataType_t = 7;
pub const qcclDouble: qcclDataType_t = 8;

/// `qcclRedOp_t`, NCCL's numbering.
pub type qcclRedOp_t = c_int;
pub const qcclSum: qcclRedOp_t = 0;
pub const qcclProd: qcclRedOp_t = 1;
pub const qcclMax: qcclRedOp_t = 2;
pub const qcclMin: qcclRedOp_t = 3;
pub const qcclAvg: qcclRedOp_t = 4;

/// Bytes in a `qcclUniqueId` (`ncclUniqueId` is 128 bytes too).
pub const QCCL_UNIQUE_ID_BYTES: usize = 128;
const _: () = assert!(QCCL_UNIQUE_ID_BYTES == qccl_core::internal::UNIQUE_ID_BYTES);

/// `color` of `qcclCommSplit` for a rank that takes no part (NCCL_SPLIT_NOCOLOR).
pub const QCCL_SPLIT_NOCOLOR: c_int = -1;

/// Version of this library, and its `QCCL_VERSION_CODE` (NCCL's encoding
/// major·10000 + minor·100 + patch).
pub const QCCL_MAJOR: c_int = 0;
pub const QCCL_MINOR: c_int = 1;
pub const QCCL_PATCH: c_int = 0;
pub const QCCL_VERSION_CODE: c_int = QCCL_MAJOR * 10000 + QCCL_MINOR * 100 + QCCL_PATCH;

/// `qcclUniqueId`: the 128 bytes of `qccl::UniqueId`, passed by value like `ncclUniqueId`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct qcclUniqueId {
    pub internal: [c_char; QCCL_UNIQUE_ID_BYTES],
}

/// Opaque; `qcclComm_t` is a token the library hands out and never dereferences.
#[repr(C)]
pub struct qcclComm {
    _private: [u8; 0],
}
pub type qcclComm_t = *mut qcclComm;

/// `NULL` (host memory) is the only stream this build accepts.
pub type qcclStream_t = *mut c_void;

/// Opaque codec handle; a token like `qcclComm_t`.
#[repr(C)]
pub struct qcclCodec {
    _private: [u8; 0],
}
pub type qcclCodec_t = *mut qcclCodec;

/// Opaque request of a non-blocking call; a token like `qcclComm_t`.
#[repr(C)]
pub struct qcclRequest {
    _private: [u8; 0],
}
pub type qcclRequest_t = *mut qcclRequest;
