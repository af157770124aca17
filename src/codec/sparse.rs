//! The payload shared by the sparsifying codecs (`topk`, `mstopk`, `randk`) and the helpers they
//! share: how many elements a density keeps, the magnitude key used for every comparison, and a
//! block-skipping scan for the few elements above a threshold.
//!
//! # Payload
//!
//! A chunk of `n` elements is sent as exactly `k = k_of(density, n)` (index, value) pairs, so a
//! receiver knows the chunk's size before it arrives:
//!
//! ```text
//! k × u32 index (little endian, strictly increasing, each < n) | k × f32 value (little endian)
//! ```
//!
//! Structure of arrays rather than interleaved pairs: the indices are checked in one tight pass
//! before anything is written, and a consumer that gathers or scatters by index reads each array
//! sequentially. The payload is 8·k bytes.
//!
//! Decoding checks every index (in range, strictly increasing) before touching the output, so a
//! corrupt payload is an error that leaves `out` as it was, never a panic or a stray write.
//!
//! # Chunk size
//!
//! Indices are u32, so a chunk holds at most [`MAX_ELEMS`] = 2^32 elements (every index < n then
//! fits). Algorithms must call [`check_len`] before encoding a chunk with a sparse codec: encoding
//! cannot fail, so it panics on a longer chunk instead.

use super::{Codec, CodecId, Rng};
use crate::error::{Error, Result};

/// The largest chunk a sparse codec encodes: every index below it fits a u32.
pub const MAX_ELEMS: usize = 1 << 32;

/// The number of elements a density keeps out of `n`: `ceil(density·n)` clamped to
/// `[min(1, n), n]`, so any non-empty chunk sends at least one element and `n = 0` sends none.
///
/// The product is taken in f64 and nudged down by four ulps before rounding up, because decimal
/// densities are inexact in binary (0.07 · 100 is 7.000000000000001 in f64) and `ceil` would
/// otherwise keep one element more than the decimal product says. Sender and receiver compute the
/// same k either way; the nudge only makes it the k a reader expects.
pub fn k_of(density: f64, n: usize) -> usize {
    if n == 0 {
        return 0;
    }
    let x = density * n as f64;
    let k = (x - x * (4.0 * f64::EPSILON)).ceil();
    // `as` saturates, and NaN becomes 0; the clamp covers both.
    (k as usize).clamp(1, n)
}

/// Fails for a chunk too long for u32 indices (more than [`MAX_ELEMS`] elements).
pub fn check_len(n: usize) -> Result<()> {
    if n > MAX_ELEMS {
        return Err(Error::Unsupported(format!(
            "sparse codecs encode chunks of at most 2^32 elements (u32 indices), got {n}"
        )));
    }
    Ok(())
}

/// Payload bytes for `k` pairs.
pub fn payload_len(k: usize) -> usize {
    8 * k
}

/// The magnitude of `v` as an integer key: its bits without the sign. For non-negative floats
/// the integer order of the bits is the numeric order, so every comparison of magnitudes is an
/// integer comparison (vectorizes without float compares, and -0.0 equals 0.0). A NaN's key is
/// above infinity's, so sparsifiers treat NaN as the largest magnitude (it is sent, not hidden).
#[inline(always)]
pub fn key(v: f32) -> u32 {
    v.to_bits() & 0x7fff_ffff
}

/// Calls `f(index, key)` for every element of `x` whose [`key`] is ≥ `t`, in index order.
///
/// Blocks of 32 elements are first tested with a branch-free OR-reduction the compiler
/// vectorizes; only blocks holding a hit build a bit mask of their hits and visit its set bits.
/// At sparsifier densities most blocks are skipped, so this runs at close to memory speed.
#[inline]
pub fn scan_at_least(x: &[f32], t: u32, mut f: impl FnMut(usize, u32)) {
    const B: usize = 32;
    if t > i32::MAX as u32 {
        return; // no key reaches t
    }
    if t == 0 {
        for (i, &v) in x.iter().enumerate() {
            f(i, key(v));
        }
        return;
    }
    // Keys and t are in [0, 2^31), so `t − 1 − key` cannot overflow and is negative exactly
    // when key ≥ t: a block has a hit iff the OR of these has its sign bit set.
    let tm1 = t as i32 - 1;
    let blocks = x.chunks_exact(B);
    let tail = blocks.remainder();
    let mut base = 0;
    for block in blocks {
        let any = block
            .iter()
            .fold(0i32, |acc, &v| acc | (tm1 - key(v) as i32));
        if any < 0 {
            let mut mask = 0u32;
            for (j, &v) in block.iter().enumerate() {
                mask |= (((tm1 - key(v) as i32) as u32) >> 31) << j;
            }
            while mask != 0 {
                let j = mask.trailing_zeros() as usize;
                f(base + j, key(block[j]));
                mask &= mask - 1;
            }
        }
        base += B;
    }
    for (j, &v) in tail.iter().enumerate() {
        let m = key(v);
        if m >= t {
            f(base + j, m);
        }
    }
}

/// Writes the payload of the pairs `(idx[j], x[idx[j]])` into `out` (exactly
/// `payload_len(idx.len())` bytes). `idx` must be strictly increasing and in range of `x`.
pub fn write(x: &[f32], idx: &[u32], out: &mut [u8]) {
    let k = idx.len();
    assert_eq!(
        out.len(),
        payload_len(k),
        "sparse payload buffer does not match {k} pairs"
    );
    debug_assert!(idx.windows(2).all(|w| w[0] < w[1]));
    let (ib, vb) = out.split_at_mut(4 * k);
    for (o, &i) in ib.chunks_exact_mut(4).zip(idx) {
        o.copy_from_slice(&i.to_le_bytes());
    }
    for (o, &i) in vb.chunks_exact_mut(4).zip(idx) {
        o.copy_from_slice(&x[i as usize].to_le_bytes());
    }
}

/// Panics unless a chunk of `n` elements can be encoded: the encode methods cannot return an
/// error, and the algorithms are required to have called [`check_len`].
pub(crate) fn assert_len(n: usize) {
    if let Err(e) = check_len(n) {
        panic!("{e} (callers must check sparse::check_len before encoding)");
    }
}

/// Subtracts a sparse payload from `out` (`out[i] -= v` for each pair), after the same checks
/// as [`decode`]: the error-feedback update of the sparsifiers, O(k) instead of O(n).
pub fn decode_sub(payload: &[u8], out: &mut [f32]) -> Result<()> {
    check_indices(payload, out.len())?;
    for (i, v) in pairs(payload) {
        out[i] -= v;
    }
    Ok(())
}

/// Checks a sparse payload's shape and that its indices are in range and strictly increasing.
fn check_indices(payload: &[u8], n: usize) -> Result<()> {
    if !payload.len().is_multiple_of(8) {
        return Err(Error::invalid(format!(
            "sparse payload of {} bytes is not a whole number of 8-byte (index, value) pairs",
            payload.len()
        )));
    }
    let k = payload.len() / 8;
    // The smallest index allowed next: strictly increasing indices also rule out duplicates,
    // so k > n is caught here too.
    let mut next = 0usize;
    for (j, c) in payload[..4 * k].chunks_exact(4).enumerate() {
        let i = u32::from_le_bytes(c.try_into().expect("4 bytes")) as usize;
        if i >= n {
            return Err(Error::invalid(format!(
                "sparse payload: index {i} (pair {j}) is out of range for a chunk of {n} elements"
            )));
        }
        if i < next {
            return Err(Error::invalid(format!(
                "sparse payload: index {i} (pair {j}) does not increase on the previous one ({})",
                next - 1
            )));
        }
        next = i + 1;
    }
    Ok(())
}

/// Decodes a payload into `out` (`add` false: zero it, then place the values) or adds it to
/// `out` (`add` true). Every index is checked first: on error `out` is untouched.
pub fn decode(payload: &[u8], out: &mut [f32], add: bool) -> Result<()> {
    check_indices(payload, out.len())?;
    if !add {
        out.fill(0.0);
    }
    for (i, v) in pairs(payload) {
        // In range: checked above.
        let o = &mut out[i];
        *o = if add { *o + v } else { v };
    }
    Ok(())
}

/// The (index, value) pairs of a payload whose shape was checked.
fn pairs(payload: &[u8]) -> impl Iterator<Item = (usize, f32)> + '_ {
    let k = payload.len() / 8;
    let (ib, vb) = payload.split_at(4 * k);
    ib.chunks_exact(4).zip(vb.chunks_exact(4)).map(|(c, v)| {
        (
            u32::from_le_bytes(c.try_into().expect("4 bytes")) as usize,
            f32::from_le_bytes(v.try_into().expect("4 bytes")),
        )
    })
}

/// The 64 parameter bits of a sparse codec: the density rounded to f32 in the high half, a
/// codec-specific field (mstopk's samplings) in the low half. Two densities that agree in f32 but
/// not in f64 are told apart anyway when their k differ, by the header's payload length.
pub(crate) fn params(density: f64, extra: u32) -> u64 {
    ((density as f32).to_bits() as u64) << 32 | extra as u64
}

/// What tells the sparsifiers apart: how they choose their k indices. Everything else (the
/// payload, decoding, the error-feedback update) is shared by the [`Codec`] impl below.
pub trait Selector: Send + Sync + std::fmt::Debug {
    /// The codec id written into chunk headers.
    fn id(&self) -> CodecId;
    /// Fraction of elements kept.
    fn density(&self) -> f64;
    /// A codec-specific parameter carried in the header (mstopk's samplings), 0 if none.
    fn extra(&self) -> u32 {
        0
    }
    /// The canonical spec string.
    fn spec(&self) -> String;
    /// Appends the k chosen indices of `x`, ascending, to the empty `out`.
    fn select(&self, x: &[f32], k: usize, rng: &mut Rng, out: &mut Vec<u32>);
}

impl<S: Selector> Codec for S {
    fn id(&self) -> CodecId {
        Selector::id(self)
    }
    fn params(&self) -> u64 {
        params(self.density(), self.extra())
    }
    fn spec(&self) -> String {
        Selector::spec(self)
    }
    fn is_sparse(&self) -> bool {
        true
    }
    fn payload_len(&self, n: usize) -> usize {
        payload_len(k_of(self.density(), n))
    }
    fn encode_payload(&self, input: &[f32], rng: &mut Rng, out: &mut [u8]) {
        assert_len(input.len());
        let mut idx = Vec::new();
        self.select(input, k_of(self.density(), input.len()), rng, &mut idx);
        write(input, &idx, out);
    }
    fn decode_payload(&self, payload: &[u8], out: &mut [f32], add: bool) -> Result<()> {
        decode(payload, out, add)
    }
    fn decode_sub(&self, bytes: &[u8], out: &mut [f32], _: &mut Vec<f32>) -> Result<()> {
        let payload = super::checked_payload(self, bytes, out.len())?;
        decode_sub(payload, out)
    }
}

/// A density in (0, 1], or an error naming it.
pub(crate) fn check_density(codec: &str, density: f64) -> Result<()> {
    if density > 0.0 && density <= 1.0 {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "{codec}: density must be in (0, 1], got {density}"
        )))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::codec::{Codec, Rng};

    #[test]
    fn k_of_rounds_up_and_clamps() {
        assert_eq!(k_of(0.5, 0), 0);
        assert_eq!(k_of(0.001, 1), 1);
        assert_eq!(k_of(0.001, 1000), 1);
        assert_eq!(k_of(0.001, 1001), 2);
        assert_eq!(k_of(0.07, 100), 7); // 7.000000000000001 in f64
        assert_eq!(k_of(0.01, 300), 3);
        assert_eq!(k_of(1.0, 5), 5);
        assert_eq!(k_of(1e-9, 5), 1);
        assert_eq!(k_of(0.001, 16 << 20), 16778);
        assert_eq!(k_of(1.0 / 3.0, 3), 1);
    }

    #[test]
    fn long_chunks_are_refused() {
        assert!(check_len(MAX_ELEMS).is_ok());
        let e = check_len(MAX_ELEMS + 1).unwrap_err().to_string();
        assert!(e.contains("2^32"), "{e}");
    }

    #[test]
    fn scan_finds_exactly_the_elements_at_least_t() {
        let mut r = Rng::from_u64(3);
        for n in [0usize, 1, 31, 32, 33, 100, 1000] {
            let x: Vec<f32> = (0..n).map(|_| r.next_f32() * 2.0 - 1.0).collect();
            let t = key(0.9);
            let mut got = vec![];
            scan_at_least(&x, t, |i, m| {
                assert_eq!(m, key(x[i]));
                got.push(i)
            });
            let want: Vec<usize> = (0..n).filter(|&i| x[i].abs() >= 0.9).collect();
            assert_eq!(got, want);
            let mut none = 0;
            scan_at_least(&x, u32::MAX, |_, _| none += 1);
            assert_eq!(none, 0);
        }
    }

    /// Round trip and corruption checks every sparse codec must pass, on `n` random elements.
    pub(crate) fn check_codec(c: &dyn Codec, n: usize, seed: u64) {
        let mut r = Rng::from_u64(seed);
        let x: Vec<f32> = (0..n).map(|_| r.next_f32() * 2.0 - 1.0).collect();
        let len = c.max_encoded_len(n);
        let mut enc = vec![0u8; len];
        assert_eq!(
            c.encode(&x, &mut Rng::from_u64(seed), &mut enc).unwrap(),
            len
        );
        assert!(c.is_sparse());
        let k = (len - crate::codec::HEADER_LEN) / 8;

        // decode_into: x at the sent indices, 0 elsewhere; exactly k non-zeros (x has no zeros
        // with overwhelming probability, and a zero would only lower the count).
        let mut out = vec![f32::NAN; n];
        c.decode_into(&enc, &mut out).unwrap();
        let sent: Vec<usize> = (0..n).filter(|&i| out[i] != 0.0).collect();
        assert_eq!(sent.len(), k, "{} n={n}", c.spec());
        for i in 0..n {
            assert!(out[i] == 0.0 || out[i] == x[i]);
        }

        // decode_add adds the same values.
        let base: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let mut acc = base.clone();
        c.decode_add(&enc, &mut acc).unwrap();
        for i in 0..n {
            assert_eq!(acc[i], base[i] + out[i]);
        }

        if k == 0 {
            return;
        }
        let p = crate::codec::HEADER_LEN;
        let corrupt = |f: &dyn Fn(&mut [u8])| {
            let mut bad = enc.clone();
            f(&mut bad);
            let mut o = base.clone();
            let e = c.decode_add(&bad, &mut o);
            assert!(e.is_err(), "{} n={n}: corrupt payload decoded", c.spec());
            assert_eq!(o, base, "output touched by a failed decode");
        };
        // An index ≥ n.
        corrupt(&|b| b[p + 4 * (k - 1)..p + 4 * k].copy_from_slice(&(n as u32).to_le_bytes()));
        corrupt(&|b| b[p..p + 4].copy_from_slice(&u32::MAX.to_le_bytes()));
        if k >= 2 {
            // A repeated index and a decreasing one.
            corrupt(&|b| {
                let first: [u8; 4] = b[p..p + 4].try_into().unwrap();
                b[p + 4..p + 8].copy_from_slice(&first)
            });
            corrupt(&|b| {
                let (x, y) = (p, p + 4);
                let a: [u8; 4] = b[x..x + 4].try_into().unwrap();
                let bb: [u8; 4] = b[y..y + 4].try_into().unwrap();
                b[x..x + 4].copy_from_slice(&bb);
                b[y..y + 4].copy_from_slice(&a);
            });
        }
        // Truncated or extended chunks fail the header's length check.
        let mut o = base.clone();
        assert!(c.decode_add(&enc[..len - 1], &mut o).is_err());
        let mut longer = enc.clone();
        longer.push(0);
        assert!(c.decode_add(&longer, &mut o).is_err());
        assert!(c.decode_into(&enc, &mut vec![0.0; n + 1]).is_err());
        assert_eq!(o, base);

        // Random payload bytes behind a valid header: an error or a valid decode, never a panic.
        for s in 0..50u64 {
            let mut r = Rng::from_u64(s);
            let mut bad = enc.clone();
            for b in &mut bad[p..] {
                *b = r.next_u64() as u8;
            }
            if s % 2 == 0 {
                // Small random indices are more likely to be in range and hit the order check.
                for j in 0..k {
                    let i = r.below(n as u64 + 2) as u32;
                    bad[p + 4 * j..p + 4 * j + 4].copy_from_slice(&i.to_le_bytes());
                }
            }
            let _ = c.decode_add(&bad, &mut o.clone());
            let _ = c.decode_into(&bad, &mut o.clone());
        }
    }

    #[test]
    fn decode_rejects_bad_payloads_without_touching_out() {
        let mut out = vec![1.0f32; 4];
        assert!(decode(&[0; 7], &mut out, false).is_err());
        // indices 1, 1
        let mut p = vec![];
        for i in [1u32, 1] {
            p.extend_from_slice(&i.to_le_bytes());
        }
        p.extend_from_slice(&[0; 8]);
        let e = decode(&p, &mut out, false).unwrap_err().to_string();
        assert!(e.contains("does not increase"), "{e}");
        assert_eq!(out, [1.0; 4]);
        // 5 pairs into 4 elements
        let mut p = vec![];
        for i in 0u32..5 {
            p.extend_from_slice(&i.to_le_bytes());
        }
        p.extend_from_slice(&[0; 20]);
        let e = decode(&p, &mut out, true).unwrap_err().to_string();
        assert!(e.contains("out of range"), "{e}");
        assert_eq!(out, [1.0; 4]);
        // empty payload, decode_into zeroes
        decode(&[], &mut out, false).unwrap();
        assert_eq!(out, [0.0; 4]);
    }
}
