//! Dense bit packing shared by the quantizing codecs: element k of a B-bit stream occupies bits
//! k·B .. k·B+B of the byte string, least significant bit first. Eight elements always fill
//! exactly B bytes, so everything works on groups of eight; callers pad the last group.
//!
//! The fixed widths 1, 2, 4 and 8 use word-level shift-and-mask tricks that compile to a few
//! instructions per group; other widths assemble the group in a u64.

/// Packs `lv.len() / 8` groups of eight levels (each below 2^bits) into `out`
/// (`bits` bytes per group).
#[inline(always)]
pub(super) fn pack(bits: usize, lv: &[u8], out: &mut [u8]) {
    debug_assert_eq!(lv.len() % 8, 0);
    debug_assert_eq!(out.len(), lv.len() / 8 * bits);
    match bits {
        8 => out.copy_from_slice(lv),
        4 => {
            for (o, g) in out.chunks_exact_mut(4).zip(lv.chunks_exact(8)) {
                let x = u64::from_le_bytes(g.try_into().expect("8 levels"));
                let y = (x | (x >> 4)) & 0x00ff_00ff_00ff_00ff;
                let z = (y | (y >> 8)) & 0x0000_ffff_0000_ffff;
                let w = (z | (z >> 16)) as u32;
                o.copy_from_slice(&w.to_le_bytes());
            }
        }
        2 => {
            for (o, g) in out.chunks_exact_mut(2).zip(lv.chunks_exact(8)) {
                let x = u64::from_le_bytes(g.try_into().expect("8 levels"));
                let y = (x | (x >> 6)) & 0x000f_000f_000f_000f;
                let z = (y | (y >> 12)) & 0x0000_00ff_0000_00ff;
                let w = (z | (z >> 24)) as u16;
                o.copy_from_slice(&w.to_le_bytes());
            }
        }
        1 => {
            for (o, g) in out.iter_mut().zip(lv.chunks_exact(8)) {
                let x = u64::from_le_bytes(g.try_into().expect("8 levels"));
                // Byte i (0 or 1) lands on bit 56 + i; the cross terms stay below bit 56 (they
                // are distinct single bits, so they cannot carry into it).
                *o = (x.wrapping_mul(0x0102_0408_1020_4080) >> 56) as u8;
            }
        }
        _ => {
            for (o, g) in out.chunks_exact_mut(bits).zip(lv.chunks_exact(8)) {
                let mut acc = 0u64;
                for (i, &l) in g.iter().enumerate() {
                    acc |= (l as u64) << (bits * i);
                }
                o.copy_from_slice(&acc.to_le_bytes()[..bits]);
            }
        }
    }
}

/// The inverse of [`pack`]: `inp.len() / bits` groups into `lv` (eight levels per group).
#[inline(always)]
pub(super) fn unpack(bits: usize, inp: &[u8], lv: &mut [u8]) {
    debug_assert_eq!(lv.len() % 8, 0);
    debug_assert_eq!(inp.len(), lv.len() / 8 * bits);
    match bits {
        8 => lv.copy_from_slice(inp),
        4 => {
            for (g, i) in lv.chunks_exact_mut(8).zip(inp.chunks_exact(4)) {
                let z = u32::from_le_bytes(i.try_into().expect("4 bytes")) as u64;
                let z = (z | (z << 16)) & 0x0000_ffff_0000_ffff;
                let z = (z | (z << 8)) & 0x00ff_00ff_00ff_00ff;
                let z = (z | (z << 4)) & 0x0f0f_0f0f_0f0f_0f0f;
                g.copy_from_slice(&z.to_le_bytes());
            }
        }
        2 => {
            for (g, i) in lv.chunks_exact_mut(8).zip(inp.chunks_exact(2)) {
                let z = u16::from_le_bytes(i.try_into().expect("2 bytes")) as u64;
                let z = (z | (z << 24)) & 0x0000_00ff_0000_00ff;
                let z = (z | (z << 12)) & 0x000f_000f_000f_000f;
                let z = (z | (z << 6)) & 0x0303_0303_0303_0303;
                g.copy_from_slice(&z.to_le_bytes());
            }
        }
        1 => {
            for (g, &b) in lv.chunks_exact_mut(8).zip(inp) {
                for (i, l) in g.iter_mut().enumerate() {
                    *l = (b >> i) & 1;
                }
            }
        }
        _ => {
            let mask = (1u64 << bits) - 1;
            for (g, i) in lv.chunks_exact_mut(8).zip(inp.chunks_exact(bits)) {
                let mut w = [0u8; 8];
                w[..bits].copy_from_slice(i);
                let acc = u64::from_le_bytes(w);
                for (k, l) in g.iter_mut().enumerate() {
                    *l = ((acc >> (bits * k)) & mask) as u8;
                }
            }
        }
    }
}

/// Packs `xs` (a multiple of 8 long) into one bit per element, bit set for `x >= 0` (so NaN and
/// negatives clear it).
#[inline(always)]
pub(super) fn pack_signs(xs: &[f32], out: &mut [u8]) {
    debug_assert_eq!(xs.len(), out.len() * 8);
    for (o, g) in out.iter_mut().zip(xs.chunks_exact(8)) {
        let mut b = 0u8;
        for (i, &x) in g.iter().enumerate() {
            b |= ((x >= 0.0) as u8) << i;
        }
        *o = b;
    }
}

/// Sign bits of any number of elements starting at a multiple of 8: the last byte is padded
/// with zero bits.
#[inline(always)]
pub(super) fn pack_signs_tail(xs: &[f32], out: &mut [u8]) {
    let full = xs.len() / 8;
    pack_signs(&xs[..full * 8], &mut out[..full]);
    if !xs.len().is_multiple_of(8) {
        let mut g = [-1.0f32; 8];
        g[..xs.len() % 8].copy_from_slice(&xs[full * 8..]);
        pack_signs(&g, &mut out[full..full + 1]);
    }
}

/// Decodes one bit per element starting at bit `first` of `bits`: `one` where the bit is set,
/// `zero` where it is clear; stored into `out` or added to it.
#[inline(always)]
pub(super) fn decode_signs<const ADD: bool>(
    bits: &[u8],
    first: usize,
    out: &mut [f32],
    one: f32,
    zero: f32,
) {
    #[inline(always)]
    fn put<const ADD: bool>(o: &mut f32, v: f32) {
        *o = if ADD { *o + v } else { v };
    }
    let bit = |k: usize| (bits[k / 8] >> (k % 8)) & 1 != 0;
    // Head: up to the next byte boundary.
    let head = ((8 - first % 8) % 8).min(out.len());
    for (j, o) in out[..head].iter_mut().enumerate() {
        put::<ADD>(o, if bit(first + j) { one } else { zero });
    }
    let rest = &mut out[head..];
    let b0 = (first + head) / 8;
    let full = rest.len() / 8;
    for (g, &b) in rest.chunks_exact_mut(8).zip(&bits[b0..b0 + full]) {
        for (i, o) in g.iter_mut().enumerate() {
            put::<ADD>(o, if (b >> i) & 1 != 0 { one } else { zero });
        }
    }
    let tail_start = first + head + full * 8;
    for (j, o) in rest[full * 8..].iter_mut().enumerate() {
        put::<ADD>(o, if bit(tail_start + j) { one } else { zero });
    }
}

/// Asks for the cache lines of `xs` ahead of use, so that DRAM reads of the next tile overlap
/// the computation on this one (the hardware prefetcher alone leaves them mostly serialized).
#[inline(always)]
pub(super) fn prefetch(xs: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for line in xs.chunks(16) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch is only a hint: it never faults nor changes memory, whatever the
        // address. SSE, which it needs, is part of the x86_64 baseline.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast::<i8>()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = xs;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_unpack_round_trip_every_width() {
        for bits in 1..=8usize {
            let lv: Vec<u8> = (0..64u32)
                .map(|i| ((i * 37 + 11) % (1 << bits)) as u8)
                .collect();
            let mut packed = vec![0u8; 8 * bits];
            pack(bits, &lv, &mut packed);
            // The dense little-endian layout, bit by bit.
            for (k, &l) in lv.iter().enumerate() {
                for j in 0..bits {
                    let p = k * bits + j;
                    assert_eq!((packed[p / 8] >> (p % 8)) & 1, (l >> j) & 1, "bits {bits}");
                }
            }
            let mut back = vec![0u8; 64];
            unpack(bits, &packed, &mut back);
            assert_eq!(back, lv, "bits {bits}");
        }
    }

    #[test]
    fn signs_round_trip_at_any_offset() {
        let xs: Vec<f32> = (0..37)
            .map(|i| if i % 3 == 0 { -1.0 } else { 2.0 })
            .collect();
        let mut packed = vec![0u8; 5];
        pack_signs_tail(&xs, &mut packed);
        for first in 0..xs.len() {
            let mut out = vec![0.0f32; xs.len() - first];
            decode_signs::<false>(&packed, first, &mut out, 1.0, -1.0);
            for (o, x) in out.iter().zip(&xs[first..]) {
                assert_eq!(*o, x.signum());
            }
        }
    }
}
