//! The C ABI of qccl: `libqccl.so` and `libqccl.a`, declared by `include/qccl.h`.
//!
//! NCCL-shaped (`qcclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream)`, NCCL's
//! numbering and in-place rules) so that engines calling NCCL switch by renaming; see
//! `docs/C_API.md` for the function list, errors and the NCCL mapping, and `ffi/README.md`
//! for building, installing and testing.
//!
//! Every entry point runs inside `last_error::guard`: errors become `qcclResult_t` codes with
//! the detailed message kept for `qcclGetLastError`, and a panic becomes
//! `qcclInternalError` instead of crossing the boundary. Handles are tokens looked up in a
//! registry (`handle`), so a destroyed comm is reported, not dereferenced. Raw pointers are
//! checked when a call is made (`buf`) and turned into slices only when its operation runs
//! (`op`); `unsafe` lives in those two places and at the out-pointer writes, each with a
//! `SAFETY` comment.

#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]
#![deny(unsafe_op_in_unsafe_fn)]

mod buf;
mod codec;
mod coll;
mod comm;
mod device;
mod group;
mod handle;
mod last_error;
mod nesting;
mod op;
mod plan;
mod register;
mod spans;
pub mod types;

pub use codec::*;
pub use coll::*;
pub use comm::*;
pub use group::{qcclGroupEnd, qcclGroupStart};
pub use last_error::{qcclGetErrorString, qcclGetLastError};
pub use register::{qcclCommDeregister, qcclCommRegister};
pub use types::*;

#[cfg(test)]
mod tests {
    use super::*;
    use qccl_core::{DType, ReduceOp};

    #[test]
    fn numbering_matches_the_rust_api() {
        let dtypes = [
            qcclInt8,
            qcclUint8,
            qcclInt32,
            qcclUint32,
            qcclInt64,
            qcclUint64,
            qcclFloat16,
            qcclFloat32,
            qcclFloat64,
            qcclBfloat16,
        ];
        for (d, c) in DType::ALL.iter().zip(dtypes) {
            assert_eq!(*d as i32, c);
        }
        let ops = [qcclSum, qcclProd, qcclMax, qcclMin, qcclAvg];
        for (o, c) in ReduceOp::ALL.iter().zip(ops) {
            assert_eq!(*o as i32, c);
        }
        let e = qccl_core::Error::Unsupported(String::new());
        assert_eq!(e.code(), qcclUnsupported);
        assert_eq!(qccl_core::Error::invalid("").code(), qcclInvalidArgument);
        assert_eq!(qccl_core::Error::Timeout(String::new()).code(), qcclTimeout);
    }

    #[test]
    fn version_matches_the_crate() {
        let v = format!("{QCCL_MAJOR}.{QCCL_MINOR}.{QCCL_PATCH}");
        assert_eq!(v, env!("CARGO_PKG_VERSION"));
        let mut got = 0;
        // SAFETY: a valid out pointer.
        assert_eq!(unsafe { qcclGetVersion(&mut got) }, qcclSuccess);
        assert_eq!(got, QCCL_VERSION_CODE);
    }
}
