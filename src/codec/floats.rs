//! The exact-or-rounded float codecs: `none` (f32 as is), `fp16` and `bf16` (round to nearest
//! even; exact for values representable in the narrow type).

use super::{Codec, CodecId, Rng};
use crate::error::Result;
use half::{bf16, f16};

/// `none`: f32 little endian, bit-exact. Used for layers excluded from compression.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity;

/// `fp16` or `bf16`: each element rounded to a 16-bit float.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Half16 {
    /// bf16 when true, IEEE half otherwise.
    pub brain: bool,
}

impl Codec for Identity {
    fn id(&self) -> CodecId {
        CodecId::None
    }
    fn params(&self) -> u64 {
        0
    }
    fn spec(&self) -> String {
        "none".into()
    }
    fn payload_len(&self, n: usize) -> usize {
        4 * n
    }
    fn encode_payload(&self, input: &[f32], _: &mut Rng, out: &mut [u8]) {
        out.copy_from_slice(bytemuck::cast_slice(input));
    }
    fn decode_payload(&self, payload: &[u8], out: &mut [f32], add: bool) -> Result<()> {
        for (o, b) in out.iter_mut().zip(payload.chunks_exact(4)) {
            let v = f32::from_le_bytes(b.try_into().expect("4 bytes"));
            *o = if add { *o + v } else { v };
        }
        Ok(())
    }
    fn error_bound(&self) -> Option<f64> {
        Some(0.0)
    }
}

impl Codec for Half16 {
    fn id(&self) -> CodecId {
        if self.brain {
            CodecId::Bf16
        } else {
            CodecId::Fp16
        }
    }
    fn params(&self) -> u64 {
        0
    }
    fn spec(&self) -> String {
        self.id().name().into()
    }
    fn payload_len(&self, n: usize) -> usize {
        2 * n
    }
    fn encode_payload(&self, input: &[f32], _: &mut Rng, out: &mut [u8]) {
        for (o, &x) in out.chunks_exact_mut(2).zip(input) {
            let bits = if self.brain {
                bf16::from_f32(x).to_bits()
            } else {
                f16::from_f32(x).to_bits()
            };
            o.copy_from_slice(&bits.to_le_bytes());
        }
    }
    fn decode_payload(&self, payload: &[u8], out: &mut [f32], add: bool) -> Result<()> {
        for (o, b) in out.iter_mut().zip(payload.chunks_exact(2)) {
            let bits = u16::from_le_bytes([b[0], b[1]]);
            let v = if self.brain {
                bf16::from_bits(bits).to_f32()
            } else {
                f16::from_bits(bits).to_f32()
            };
            *o = if add { *o + v } else { v };
        }
        Ok(())
    }
    fn error_bound(&self) -> Option<f64> {
        // Half a unit in the last place: 2^-11 (fp16, within its range), 2^-8 (bf16).
        Some(if self.brain {
            1.0 / 256.0
        } else {
            1.0 / 2048.0
        })
    }
}
