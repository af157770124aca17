//! Driver results as qccl errors: every failure names the call and the `CUresult`
//! ("cuMemcpyDtoHAsync: CUDA_ERROR_ILLEGAL_ADDRESS") after what was being done.

use crate::error::{Error, Result};
use cudarc::driver::sys::CUresult;

/// The `CUresult`'s name, "CUDA_ERROR_INVALID_VALUE". Taken from the enum itself rather than
/// `cuGetErrorName`, so naming an error never calls into the driver.
pub(super) fn result_name(r: CUresult) -> String {
    format!("{r:?}")
}

/// `Ok` for `CUDA_SUCCESS`; otherwise `Error::System` "{what}: {call}: {name}".
pub(super) fn check(r: CUresult, call: &str, what: impl FnOnce() -> String) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(failed(r, call, what()))
    }
}

/// The `Error::System` of a failed driver call.
pub(super) fn failed(r: CUresult, call: &str, what: String) -> Error {
    Error::System(format!("{what}: {call}: {}", result_name(r)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_are_named_as_the_driver_api_names_them() {
        assert_eq!(
            result_name(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS),
            "CUDA_ERROR_ILLEGAL_ADDRESS"
        );
        assert_eq!(
            result_name(CUresult::CUDA_ERROR_NOT_READY),
            "CUDA_ERROR_NOT_READY"
        );
        assert_eq!(result_name(CUresult::CUDA_SUCCESS), "CUDA_SUCCESS");
    }

    #[test]
    fn check_passes_success_and_names_call_and_result_otherwise() {
        assert_eq!(
            check(CUresult::CUDA_SUCCESS, "cuInit", || unreachable!()),
            Ok(())
        );
        let err = check(
            CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
            "cuMemcpyDtoHAsync",
            || "copying 4 bytes from device address 0x10 on CUDA device 0".into(),
        )
        .unwrap_err();
        assert_eq!(
            err,
            Error::System(
                "copying 4 bytes from device address 0x10 on CUDA device 0: cuMemcpyDtoHAsync: \
                 CUDA_ERROR_ILLEGAL_ADDRESS"
                    .into()
            )
        );
    }
}
