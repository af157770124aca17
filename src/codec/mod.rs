//! Codecs: lossy encodings of f32 chunks, applied where data leaves a rank and undone where it
//! arrives, because quantized or sparsified values cannot be summed in compressed form.
//!
//! A codec implements the payload part ([`Codec::encode_payload`], [`Codec::decode_payload`]);
//! the provided methods wrap it in a self-describing header ([`HEADER_LEN`] bytes), so every decode checks the
//! codec, version, parameters, element count and payload length before touching the payload.
//! Every built-in codec encodes n elements into exactly [`Codec::max_encoded_len`]`(n)` bytes
//! (sparse codecs select exactly k), so a receiver knows a chunk's size in advance.
//!
//! Codecs are chosen by a spec string ([`CodecSpec`]): `qsgd:bits=4,bucket=128`, `topk:density=0.01,ef=1`.
//! Error feedback is not a codec but a property of the call (its residual is kept per
//! [`TensorKey`](crate::TensorKey)).

pub mod adaptive;
mod bits;
pub(crate) mod ef;
mod fields;
mod floats;
mod header;
pub(crate) mod layout;
pub(crate) mod mstopk;
mod qsgd;
pub(crate) mod randk;
mod rng;
mod sign;
pub(crate) mod sparse;
mod spec;
pub(crate) mod topk;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use header::{CodecId, HEADER_LEN};
pub use rng::{draw, draw32, uniform24, Rng, Site};
pub use spec::CodecSpec;

use crate::error::{Error, Result};
use header::Header;

/// A lossy (or exact) encoding of f32 chunks. Implementations are stateless apart from their
/// parameters; per-encode randomness comes from the [`Rng`] of the encode site.
pub trait Codec: Send + Sync + std::fmt::Debug {
    /// Which codec this is (written into every chunk header).
    fn id(&self) -> CodecId;

    /// The parameters packed into 64 bits; a chunk whose header carries other parameters is
    /// rejected as encoded by a different codec.
    fn params(&self) -> u64;

    /// The canonical spec string (parses back to an equal codec).
    fn spec(&self) -> String;

    /// True for codecs that send (index, value) pairs (topk, mstopk, randk): their sums are
    /// all-gathered and scatter-added by default.
    fn is_sparse(&self) -> bool {
        false
    }

    /// Payload bytes for `n` elements (exact).
    fn payload_len(&self, n: usize) -> usize;

    /// Encodes `input` into `out` (exactly `payload_len(input.len())` bytes), drawing any
    /// randomness from `rng`.
    fn encode_payload(&self, input: &[f32], rng: &mut Rng, out: &mut [u8]);

    /// Encodes `data` as [`Codec::encode_payload`] does and replaces it with the decoding of
    /// that payload (bit for bit what [`Codec::decode_payload`] gives): the rank that encodes
    /// a sum keeps what its receivers will hold. Codecs override it to do both in one pass.
    fn encode_payload_own(&self, data: &mut [f32], rng: &mut Rng, out: &mut [u8]) -> Result<()> {
        self.encode_payload(data, rng, out);
        self.decode_payload(out, data, false)
    }

    /// Decodes a payload of `out.len()` elements whose length was already checked: into `out`
    /// (`add` false) or added to it (`add` true). Content that cannot be valid (an index out of
    /// range, a bad scale) is an error, never a panic or an out-of-bounds read.
    fn decode_payload(&self, payload: &[u8], out: &mut [f32], add: bool) -> Result<()>;

    /// Worst-case relative error ‖decode(encode(x)) − x‖ / ‖x‖ of one encode, for tests and for
    /// qccl-perf's `#wrong` column; None when the codec gives no bound (sparsifiers).
    fn error_bound(&self) -> Option<f64> {
        None
    }

    // ---- provided: the framed forms ------------------------------------------------------

    /// Bytes of one encoded chunk of `n` elements, header included.
    fn max_encoded_len(&self, n: usize) -> usize {
        HEADER_LEN + self.payload_len(n)
    }

    /// Encodes `input` with its header into `out`; returns the bytes written.
    fn encode(&self, input: &[f32], rng: &mut Rng, out: &mut [u8]) -> Result<usize> {
        let len = framed(self, input.len(), out)?;
        self.encode_payload(input, rng, &mut out[HEADER_LEN..len]);
        Ok(len)
    }

    /// Encodes `data` with its header into `out` and replaces `data` with the decoding
    /// ([`Codec::encode_payload_own`]); returns the bytes written.
    fn encode_own(&self, data: &mut [f32], rng: &mut Rng, out: &mut [u8]) -> Result<usize> {
        let len = framed(self, data.len(), out)?;
        self.encode_payload_own(data, rng, &mut out[HEADER_LEN..len])?;
        Ok(len)
    }

    /// Decodes a chunk of `out.len()` elements into `out`.
    fn decode_into(&self, bytes: &[u8], out: &mut [f32]) -> Result<()> {
        let payload = checked_payload(self, bytes, out.len())?;
        self.decode_payload(payload, out, false)
    }

    /// Adds a decoded chunk of `out.len()` elements to `out` (the hot path of reductions).
    fn decode_add(&self, bytes: &[u8], out: &mut [f32]) -> Result<()> {
        let payload = checked_payload(self, bytes, out.len())?;
        self.decode_payload(payload, out, true)
    }

    /// Subtracts a decoded chunk from `out` (error feedback: residual += input, then this),
    /// using `scratch` if it needs room. Sparse codecs override it to touch only their k
    /// entries instead of decoding a whole dense chunk.
    fn decode_sub(&self, bytes: &[u8], out: &mut [f32], scratch: &mut Vec<f32>) -> Result<()> {
        scratch.resize(out.len(), 0.0);
        self.decode_into(bytes, scratch)?;
        for (o, d) in out.iter_mut().zip(scratch.iter()) {
            *o -= d;
        }
        Ok(())
    }
}

/// Writes the header of an `n`-element chunk into `out` once it is checked to hold the
/// chunk; returns the chunk's length.
fn framed<C: Codec + ?Sized>(codec: &C, n: usize, out: &mut [u8]) -> Result<usize> {
    let len = codec.max_encoded_len(n);
    if out.len() < len {
        return Err(Error::invalid(format!(
            "{}: output of {} bytes cannot hold the {len}-byte encoding of {n} elements",
            codec.spec(),
            out.len()
        )));
    }
    write_header(codec, n, out);
    Ok(len)
}

/// Writes the header of `codec`'s chunk of `n` elements into the first [`HEADER_LEN`] bytes
/// of `out` (the device path writes headers on the host, payloads on the GPU).
pub(crate) fn write_header<C: Codec + ?Sized>(codec: &C, n: usize, out: &mut [u8]) {
    Header {
        codec: codec.id(),
        params: codec.params(),
        count: n as u64,
        payload: codec.payload_len(n) as u64,
    }
    .write(out);
}

/// The payload of `bytes` after checking its header against `codec` and `n` elements.
pub(crate) fn checked_payload<'b, C: Codec + ?Sized>(
    codec: &C,
    bytes: &'b [u8],
    n: usize,
) -> Result<&'b [u8]> {
    let h = Header::read(bytes)?;
    if h.codec != codec.id() || h.params != codec.params() {
        return Err(Error::invalid(format!(
            "encoded chunk was written by codec {} (parameters {:#x}), decoder is {}",
            h.codec.name(),
            h.params,
            codec.spec()
        )));
    }
    if h.count != n as u64 {
        return Err(Error::invalid(format!(
            "encoded chunk holds {} elements, expected {n}",
            h.count
        )));
    }
    let want = codec.payload_len(n);
    let have = bytes.len() - HEADER_LEN;
    if h.payload != want as u64 || have != want {
        return Err(Error::invalid(format!(
            "encoded chunk of {n} elements has a {}-byte payload ({have} bytes present), {} expects {want}",
            h.payload,
            codec.spec()
        )));
    }
    Ok(&bytes[HEADER_LEN..])
}

/// Helpers shared by the codecs' unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::Rng;

    /// Standard normal samples by Box-Muller on the codec Rng.
    pub fn gaussian(n: usize, seed: u64) -> Vec<f32> {
        let mut r = Rng::from_u64(seed);
        (0..n)
            .map(|_| {
                let u1 = 1.0 - r.next_f32() as f64; // (0, 1]
                let u2 = r.next_f32() as f64;
                ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
            })
            .collect()
    }
}
