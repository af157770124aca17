//! The float codecs (`none`, `fp16`, `bf16`) on a device, as kernels/shim/floats_driver.cpp
//! launches kernels/floats.cu: one grid-stride kernel a step, each thread 8 elements on the
//! 16-byte vector path. Payloads only (the 32-byte chunk header is the host's), the bytes of
//! the Rust codec's `encode_payload` / `decode_payload`.

use super::{grid_for, BLOCK};
use crate::codec::CodecId;
use crate::error::{Error, Result};
use crate::gpu::driver::{Arg, Driver, Function, Stream};
use std::sync::Arc;

/// Elements one thread handles on the vector path.
const PER_THREAD: usize = 8;

/// A float codec's kernels on one device.
pub struct FloatPlan {
    codec: CodecId,
    encode: Arc<dyn Function>,
    decode: Arc<dyn Function>,
    decode_add: Arc<dyn Function>,
}

impl FloatPlan {
    /// The plan of `codec` on device `ordinal` (loading its kernels); `Unsupported` for a
    /// codec that is not a float codec.
    pub fn new(driver: &dyn Driver, ordinal: usize, codec: CodecId) -> Result<FloatPlan> {
        if !matches!(codec, CodecId::None | CodecId::Fp16 | CodecId::Bf16) {
            return Err(Error::Unsupported(format!(
                "no device launch plan for codec {} yet (float codecs only: none, fp16, bf16)",
                codec.name()
            )));
        }
        let f = |step: &str| driver.function(ordinal, &format!("qccl_{}_{step}", codec.name()));
        Ok(FloatPlan {
            codec,
            encode: f("encode")?,
            decode: f("decode")?,
            decode_add: f("decode_add")?,
        })
    }

    /// The codec.
    pub fn codec(&self) -> CodecId {
        self.codec
    }

    /// Payload bytes of `count` elements (the codec's `payload_len`).
    pub fn payload_len(&self, count: usize) -> usize {
        count * if self.codec == CodecId::None { 4 } else { 2 }
    }

    /// Enqueues `payload = encode(x)` for `count` f32s at device address `x` into
    /// `payload_len(count)` bytes at `payload` (each aligned to its element; 16 bytes for the
    /// vector path).
    ///
    /// # Safety
    /// Both ranges must be memory of the stream's device (or page-locked), valid and not
    /// touched by anything else until the work is known done.
    pub unsafe fn encode(&self, s: &dyn Stream, x: u64, payload: u64, count: usize) -> Result<()> {
        let args = [Arg::Ptr(x), Arg::Ptr(payload), Arg::U64(count as u64)];
        // SAFETY: floats.cu's (const float* x, T* payload, uint64_t count); the ranges are
        // the caller's to keep valid (this function's contract).
        unsafe { launch(s, &*self.encode, count, &args) }
    }

    /// Enqueues the decode of `count` elements of `payload` into the f32s at `out`:
    /// `out[i] = value`, or `out[i] += value` with `add` (the reduction step of a
    /// compressed all-reduce).
    ///
    /// # Safety
    /// As for [`FloatPlan::encode`].
    pub unsafe fn decode(
        &self,
        s: &dyn Stream,
        payload: u64,
        out: u64,
        count: usize,
        add: bool,
    ) -> Result<()> {
        let f = if add { &self.decode_add } else { &self.decode };
        let args = [Arg::Ptr(payload), Arg::Ptr(out), Arg::U64(count as u64)];
        // SAFETY: floats.cu's (const T* payload, float* out, uint64_t count); as above.
        unsafe { launch(s, &**f, count, &args) }
    }
}

/// One grid-stride launch over `count` elements; nothing for none.
///
/// # Safety
/// `args` match `f`'s parameters and name memory valid until the launch is done.
unsafe fn launch(s: &dyn Stream, f: &dyn Function, count: usize, args: &[Arg]) -> Result<()> {
    if count == 0 {
        return Ok(());
    }
    let grid = grid_for(count.div_ceil(PER_THREAD));
    // SAFETY: the caller's promise.
    unsafe { s.launch(f, grid, BLOCK, args) }
}
