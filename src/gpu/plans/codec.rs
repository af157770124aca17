//! The one interface of every codec's launch plan, so the device path encodes and decodes with
//! any codec the same way: payloads only (the 32-byte chunk header is the host's), the bytes of
//! the Rust codec's `encode_payload` / `decode_payload`, bit for bit, and error feedback fused
//! into encode with the CPU's arithmetic.

use super::{FloatPlan, QsgdPlan, SignPlan, SparsePlan};
use crate::codec::{Codec, CodecId};
use crate::error::Result;
use crate::gpu::driver::{Driver, Stream};

/// A codec's kernels on one device, looked up once; every method only enqueues on `s`.
///
/// Addresses are device memory of the stream's device or page-locked host memory (a kernel
/// writes an encoding straight into the host buffer it is sent from), each aligned to its
/// element; all of them must stay valid, and untouched by anything else, until the work is
/// known done (an event or a synchronize after it): that is the `unsafe` contract of each
/// method, besides the lengths each one names.
pub trait CodecPlan: Send + Sync {
    /// The codec.
    fn codec(&self) -> CodecId;

    /// Payload bytes of `count` elements (the Rust codec's `payload_len`).
    fn payload_len(&self, count: usize) -> usize;

    /// Bytes of device scratch memory a call on `count` elements needs at `scratch` (0: none,
    /// and `scratch` is ignored).
    fn scratch_len(&self, _count: usize) -> usize {
        0
    }

    /// Enqueues `payload = encode(x)` of `count` f32s, random draws keyed by `key` (the
    /// `Rng::key` of the piece's site, as the Rust codec's `Rng::new(site)` draws).
    ///
    /// # Safety
    /// See the trait: `x` holds `count` f32s, `payload` `payload_len(count)` bytes.
    #[allow(clippy::too_many_arguments)]
    unsafe fn encode(
        &self,
        s: &dyn Stream,
        x: u64,
        payload: u64,
        count: usize,
        key: u64,
        scratch: u64,
    ) -> Result<()>;

    /// Enqueues error feedback fused into encode: `w = x + res`, `payload = encode(w)`,
    /// `res = (0 + w) - decode(payload)` (the bits of the CPU's compensate, residual += w,
    /// residual -= decoded), and `w` stored at `w_out` unless it is 0.
    ///
    /// # Safety
    /// As [`CodecPlan::encode`]; `res` (and `w_out` unless 0) hold `count` f32s.
    #[allow(clippy::too_many_arguments)]
    unsafe fn encode_ef(
        &self,
        s: &dyn Stream,
        x: u64,
        res: u64,
        w_out: u64,
        payload: u64,
        count: usize,
        key: u64,
        scratch: u64,
    ) -> Result<()>;

    /// Enqueues `out = decode(payload)`, or `out += decode(payload)` with `add` (the
    /// reduction step of a compressed all-reduce), for `count` elements. A payload that fails
    /// the codec's checks (the Rust codec's `decode_payload` error) stores a non-zero i32 at
    /// `bad` (which the caller zeroed, and reads once the work is done: the call then fails;
    /// `out` is unspecified); codecs without checks never touch it.
    ///
    /// # Safety
    /// As [`CodecPlan::encode`]; `out` holds `count` f32s, `bad` 4 bytes.
    #[allow(clippy::too_many_arguments)]
    unsafe fn decode(
        &self,
        s: &dyn Stream,
        payload: u64,
        out: u64,
        count: usize,
        add: bool,
        bad: u64,
        scratch: u64,
    ) -> Result<()>;
}

/// The launch plan of `codec` on device `ordinal` (loading its kernels). Every codec has one
/// (the match is exhaustive: a new codec does not compile here until it has).
pub fn plan_for(
    driver: &dyn Driver,
    ordinal: usize,
    codec: &dyn Codec,
) -> Result<Box<dyn CodecPlan>> {
    match codec.id() {
        CodecId::None | CodecId::Fp16 | CodecId::Bf16 => {
            Ok(Box::new(FloatPlan::new(driver, ordinal, codec.id())?))
        }
        CodecId::Qsgd => Ok(Box::new(QsgdPlan::new(driver, ordinal, codec)?)),
        CodecId::EfSign | CodecId::OneBit => Ok(Box::new(SignPlan::new(driver, ordinal, codec)?)),
        CodecId::TopK | CodecId::MsTopK | CodecId::RandK => {
            Ok(Box::new(SparsePlan::new(driver, ordinal, codec)?))
        }
    }
}
