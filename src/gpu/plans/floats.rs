//! The float codecs (`none`, `fp16`, `bf16`) on a device, as kernels/shim/floats_driver.cpp
//! launches kernels/floats.cu: one grid-stride kernel a step, each thread 8 elements on the
//! 16-byte vector path. Payloads only (the 32-byte chunk header is the host's), the bytes of
//! the Rust codec's `encode_payload` / `decode_payload`.

use super::{grid_for, CodecPlan, BLOCK};
use crate::codec::CodecId;
use crate::error::{Error, Result};
use crate::gpu::driver::{Arg, Driver, Function, Stream};
use crate::types::DType;
use std::sync::Arc;

/// Elements one thread handles on the vector path.
const PER_THREAD: usize = 8;

/// A float codec's kernels on one device.
pub struct FloatPlan {
    codec: CodecId,
    encode: Arc<dyn Function>,
    encode_ef: Arc<dyn Function>,
    decode: Arc<dyn Function>,
    decode_add: Arc<dyn Function>,
}

impl FloatPlan {
    /// The plan of `codec` on device `ordinal` (loading its kernels); an invalid argument for
    /// a codec that is not a float codec (`plan_for` picks the plan of any codec).
    pub fn new(driver: &dyn Driver, ordinal: usize, codec: CodecId) -> Result<FloatPlan> {
        if !matches!(codec, CodecId::None | CodecId::Fp16 | CodecId::Bf16) {
            return Err(Error::invalid(format!(
                "codec {} is not a float codec (none, fp16, bf16)",
                codec.name()
            )));
        }
        let f = |step: &str| driver.function(ordinal, &format!("qccl_{}_{step}", codec.name()));
        Ok(FloatPlan {
            codec,
            encode: f("encode")?,
            encode_ef: f("encode_ef")?,
            decode: f("decode")?,
            decode_add: f("decode_add")?,
        })
    }
}

impl CodecPlan for FloatPlan {
    fn codec(&self) -> CodecId {
        self.codec
    }

    fn payload_len(&self, count: usize) -> usize {
        count * if self.codec == CodecId::None { 4 } else { 2 }
    }

    unsafe fn encode(
        &self,
        s: &dyn Stream,
        x: u64,
        payload: u64,
        count: usize,
        _key: u64,
        _scratch: u64,
    ) -> Result<()> {
        let args = [Arg::Ptr(x), Arg::Ptr(payload), Arg::U64(count as u64)];
        // SAFETY: floats.cu's (const float* x, T* payload, uint64_t count); the ranges are
        // the caller's to keep valid (the trait's contract).
        unsafe { launch(s, &*self.encode, count, &args) }
    }

    unsafe fn encode_ef(
        &self,
        s: &dyn Stream,
        x: u64,
        res: u64,
        w_out: u64,
        payload: u64,
        count: usize,
        _key: u64,
        _scratch: u64,
    ) -> Result<()> {
        let args = [
            Arg::Ptr(x),
            Arg::Ptr(res),
            Arg::Ptr(w_out),
            Arg::Ptr(payload),
            Arg::U64(count as u64),
        ];
        // SAFETY: floats.cu's (const float* x, float* res, float* w_out, T* payload,
        // uint64_t count), w_out may be null; as above.
        unsafe { launch(s, &*self.encode_ef, count, &args) }
    }

    unsafe fn decode(
        &self,
        s: &dyn Stream,
        payload: u64,
        out: u64,
        count: usize,
        add: bool,
        _bad: u64,
        _scratch: u64,
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

/// A buffer type's conversion to and from the f32 copy the codecs work on, as the CPU's
/// `with_f32`: float16 and bfloat16 by their float codec's decode (exact) and encode (round to
/// nearest even, the `half` crate's), float64 by `qccl_f64_to_f32` (Rust's `as`) and
/// `qccl_f32_to_f64` (exact).
pub struct Convert {
    to_f32: Arc<dyn Function>,
    from_f32: Arc<dyn Function>,
}

impl Convert {
    /// The conversion of `dtype` buffers on device `ordinal`; None for float32 (the codecs'
    /// own type), `Unsupported` for integer types.
    pub fn new(driver: &dyn Driver, ordinal: usize, dtype: DType) -> Result<Option<Convert>> {
        let f = |name: &str| driver.function(ordinal, name);
        let (to_f32, from_f32) = match dtype {
            DType::Float32 => return Ok(None),
            DType::Float16 => (f("qccl_fp16_decode")?, f("qccl_fp16_encode")?),
            DType::Bfloat16 => (f("qccl_bf16_decode")?, f("qccl_bf16_encode")?),
            DType::Float64 => (f("qccl_f64_to_f32")?, f("qccl_f32_to_f64")?),
            other => {
                return Err(Error::Unsupported(format!(
                    "codecs on the GPU for {other} buffers"
                )))
            }
        };
        Ok(Some(Convert { to_f32, from_f32 }))
    }

    /// Enqueues the conversion of `count` elements of the buffer type at `src` into f32s at
    /// `dst` (`into` true), or of f32s at `src` into the buffer type at `dst`.
    ///
    /// # Safety
    /// Both ranges must hold `count` elements of their type, aligned to it, valid until the
    /// launch is done.
    pub unsafe fn run(
        &self,
        s: &dyn Stream,
        into: bool,
        src: u64,
        dst: u64,
        count: usize,
    ) -> Result<()> {
        let f = if into { &self.to_f32 } else { &self.from_f32 };
        let args = [Arg::Ptr(src), Arg::Ptr(dst), Arg::U64(count as u64)];
        // SAFETY: floats.cu's (const T*, float*, uint64_t) into f32 and (const float*, T*,
        // uint64_t) back, over the caller's ranges; all grid-stride, any grid.
        unsafe { launch(s, &**f, count, &args) }
    }
}
