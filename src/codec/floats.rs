//! The exact-or-rounded float codecs: `none` (f32 as is), `fp16` and `bf16` (round to nearest
//! even; exact for values representable in the narrow type).

use super::{Codec, CodecId, Rng};
use crate::error::Result;
use half::f16;

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

impl Half16 {
    /// Encodes on the best path available (`simd` false forces the portable one).
    fn encode_with(&self, simd: bool, input: &[f32], out: &mut [u8]) {
        #[cfg(target_arch = "x86_64")]
        if simd {
            if let Some(cpu) = super::x86::Avx2::detect() {
                return if self.brain {
                    cpu.run(
                        #[inline(always)]
                        || encode16(input, out, bf16_bits),
                    )
                } else {
                    cpu.f16_encode(input, out)
                };
            }
        }
        let _ = simd;
        if self.brain {
            encode16(input, out, bf16_bits)
        } else {
            encode16(input, out, |x| f16::from_f32(x).to_bits())
        }
    }

    fn decode_with(&self, simd: bool, payload: &[u8], out: &mut [f32], add: bool) {
        #[cfg(target_arch = "x86_64")]
        if simd {
            if let Some(cpu) = super::x86::Avx2::detect() {
                return if self.brain {
                    if add {
                        cpu.run(
                            #[inline(always)]
                            || decode16::<true>(payload, out, bf16_value),
                        )
                    } else {
                        cpu.run(
                            #[inline(always)]
                            || decode16::<false>(payload, out, bf16_value),
                        )
                    }
                } else {
                    cpu.f16_decode(payload, out, add)
                };
            }
        }
        let _ = simd;
        let f16 = |b: u16| f16::from_bits(b).to_f32();
        match (self.brain, add) {
            (true, true) => decode16::<true>(payload, out, bf16_value),
            (true, false) => decode16::<false>(payload, out, bf16_value),
            (false, true) => decode16::<true>(payload, out, f16),
            (false, false) => decode16::<false>(payload, out, f16),
        }
    }
}

/// f32 to bf16 bits, round to nearest even, NaN kept quiet: `half`'s conversion, written
/// without branches so that it vectorizes.
#[inline(always)]
pub(super) fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let nan = (b >> 16) | 0x40;
    (if b & 0x7fff_ffff > 0x7f80_0000 {
        nan
    } else {
        rounded
    }) as u16
}

/// bf16 bits to f32 (`half`'s conversion: NaN made quiet).
#[inline(always)]
pub(super) fn bf16_value(h: u16) -> f32 {
    let h = h as u32;
    f32::from_bits(if h & 0x7fff > 0x7f80 { h | 0x40 } else { h } << 16)
}

/// Elements per block of [`encode16`] and [`decode16`]: each block goes through an aligned
/// u16 buffer, so the conversion loops are plain and vectorize, whatever the payload alignment.
const BLOCK16: usize = 256;

/// Elements per tile of fp16/bf16's `encode_payload_own` (16 KiB of f32: stays in L1).
const OWN_TILE: usize = 4096;

/// Encodes through a per-element conversion.
#[inline(always)]
pub(super) fn encode16(input: &[f32], out: &mut [u8], f: impl Fn(f32) -> u16) {
    let mut buf = [0u16; BLOCK16];
    for (x, o) in input.chunks(BLOCK16).zip(out.chunks_mut(2 * BLOCK16)) {
        for (h, &v) in buf.iter_mut().zip(x) {
            *h = f(v).to_le();
        }
        o.copy_from_slice(bytemuck::cast_slice(&buf[..x.len()]));
    }
}

/// Decodes through a per-element conversion, into `out` or added to it.
#[inline(always)]
pub(super) fn decode16<const ADD: bool>(payload: &[u8], out: &mut [f32], f: impl Fn(u16) -> f32) {
    let mut buf = [0u16; BLOCK16];
    for (o, b) in out.chunks_mut(BLOCK16).zip(payload.chunks(2 * BLOCK16)) {
        let buf = &mut buf[..o.len()];
        bytemuck::cast_slice_mut(buf).copy_from_slice(b);
        for (o, &h) in o.iter_mut().zip(buf.iter()) {
            let v = f(u16::from_le(h));
            *o = if ADD { *o + v } else { v };
        }
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
        self.encode_with(true, input, out)
    }
    fn decode_payload(&self, payload: &[u8], out: &mut [f32], add: bool) -> Result<()> {
        self.decode_with(true, payload, out, add);
        Ok(())
    }
    /// Element by element, so tile by tile: each tile is decoded while it is in L1.
    fn encode_payload_own(&self, data: &mut [f32], _: &mut Rng, out: &mut [u8]) -> Result<()> {
        for (d, o) in data.chunks_mut(OWN_TILE).zip(out.chunks_mut(2 * OWN_TILE)) {
            self.encode_with(true, d, o);
            self.decode_with(true, o, d, false);
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

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// Every path gives `half`'s bits, for ordinary values and for special bit patterns.
    #[test]
    fn fast_paths_match_half() {
        let mut r = Rng::from_u64(12);
        let mut x: Vec<f32> = (0..100_003)
            .map(|i| match i % 4 {
                0 => f32::from_bits(r.next_u64() as u32),
                1 => (r.next_f32() - 0.5) * 1e-6,
                2 => (r.next_f32() - 0.5) * 7e4,
                _ => (r.next_f32() - 0.5) * 3.0,
            })
            .collect();
        x.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            65520.0,
        ]);
        for brain in [false, true] {
            let c = Half16 { brain };
            let want: Vec<u8> = x
                .iter()
                .flat_map(|&v| {
                    if brain {
                        bf16::from_f32(v).to_bits()
                    } else {
                        f16::from_f32(v).to_bits()
                    }
                    .to_le_bytes()
                })
                .collect();
            for simd in [false, true] {
                let mut out = vec![0u8; 2 * x.len()];
                c.encode_with(simd, &x, &mut out);
                assert_eq!(out, want, "brain {brain} simd {simd}");
                let want_back: Vec<u32> = out
                    .chunks_exact(2)
                    .map(|b| {
                        let h = u16::from_le_bytes([b[0], b[1]]);
                        if brain {
                            bf16::from_bits(h).to_f32()
                        } else {
                            f16::from_bits(h).to_f32()
                        }
                        .to_bits()
                    })
                    .collect();
                let mut back = vec![0.0f32; x.len()];
                c.decode_with(simd, &out, &mut back, false);
                let got: Vec<u32> = back.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, want_back, "brain {brain} simd {simd}");
                let mut sum = vec![1.5f32; x.len()];
                c.decode_with(simd, &out, &mut sum, true);
                for (s, b) in sum.iter().zip(&back) {
                    assert_eq!(s.to_bits(), (1.5 + b).to_bits());
                }
            }
            // Encoding in place keeps the decoded bits, across tiles and a partial last one.
            let mut own = x.clone();
            let mut out = vec![0u8; 2 * x.len()];
            c.encode_payload_own(&mut own, &mut r, &mut out).unwrap();
            assert_eq!(out, want, "brain {brain} own");
            let mut back = vec![0.0f32; x.len()];
            c.decode_with(false, &out, &mut back, false);
            assert!(own
                .iter()
                .zip(&back)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }
}
