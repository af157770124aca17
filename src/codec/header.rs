//! The self-describing header in front of every encoded chunk, so a receiver rejects a
//! malformed or mismatched chunk with an error instead of reading out of bounds.
//!
//! Layout (32 bytes, little endian): codec id u8, version u8, reserved u16 (0), reserved u32
//! (0), codec parameters u64, element count u64, payload length u64. The payload follows.

use crate::error::{Error, Result};

/// Bytes in front of every payload (a multiple of 8, so payloads stay 8-byte aligned).
pub const HEADER_LEN: usize = 32;
/// Encoding version written by this build; a chunk with another version is rejected.
/// 2: stochastic rounding, random-k and MSTopK's offset draw from the counter-based
/// `rng::draw` (1 drew from sequential xoshiro streams: same layout, other random choices, so
/// ranks of both versions would not end bit-identical).
pub const VERSION: u8 = 2;

/// Which codec encoded a chunk (the first header byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum CodecId {
    /// Plain f32 (layers excluded from compression).
    None = 0,
    /// IEEE half precision.
    Fp16 = 1,
    /// bfloat16.
    Bf16 = 2,
    /// Bucketed stochastic quantization.
    Qsgd = 3,
    /// Exact top-k sparsification.
    TopK = 4,
    /// Multi-sampling top-k (HiTopKComm's MSTopK).
    MsTopK = 5,
    /// Random-k sparsification.
    RandK = 6,
    /// Scaled sign.
    EfSign = 7,
    /// 1-bit quantization with two reconstruction values (Seide et al.).
    OneBit = 8,
}

impl CodecId {
    /// The spec name of the codec.
    pub fn name(self) -> &'static str {
        match self {
            CodecId::None => "none",
            CodecId::Fp16 => "fp16",
            CodecId::Bf16 => "bf16",
            CodecId::Qsgd => "qsgd",
            CodecId::TopK => "topk",
            CodecId::MsTopK => "mstopk",
            CodecId::RandK => "randk",
            CodecId::EfSign => "efsign",
            CodecId::OneBit => "onebit",
        }
    }

    fn from_u8(v: u8) -> Option<CodecId> {
        use CodecId::*;
        [None, Fp16, Bf16, Qsgd, TopK, MsTopK, RandK, EfSign, OneBit]
            .into_iter()
            .find(|c| *c as u8 == v)
    }
}

/// The decoded header of one chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Codec that wrote the chunk.
    pub codec: CodecId,
    /// Codec parameters, packed by the codec (`Codec::params`).
    pub params: u64,
    /// Elements encoded.
    pub count: u64,
    /// Payload bytes after the header.
    pub payload: u64,
}

impl Header {
    /// Writes the header into the first `HEADER_LEN` bytes of `out`.
    pub fn write(&self, out: &mut [u8]) {
        let h = &mut out[..HEADER_LEN];
        h.fill(0);
        h[0] = self.codec as u8;
        h[1] = VERSION;
        h[8..16].copy_from_slice(&self.params.to_le_bytes());
        h[16..24].copy_from_slice(&self.count.to_le_bytes());
        h[24..32].copy_from_slice(&self.payload.to_le_bytes());
    }

    /// Parses the header of `bytes`, checking only what the header alone can tell.
    pub fn read(bytes: &[u8]) -> Result<Header> {
        if bytes.len() < HEADER_LEN {
            return Err(Error::invalid(format!(
                "encoded chunk is {} bytes, shorter than its {HEADER_LEN}-byte header",
                bytes.len()
            )));
        }
        let codec = CodecId::from_u8(bytes[0]).ok_or_else(|| {
            Error::invalid(format!("encoded chunk has unknown codec id {}", bytes[0]))
        })?;
        if bytes[1] != VERSION {
            return Err(Error::invalid(format!(
                "encoded chunk has version {}, this build reads version {VERSION} only (every \
                 rank of a job must run the same qccl codec version)",
                bytes[1]
            )));
        }
        if bytes[2..8].iter().any(|&b| b != 0) {
            return Err(Error::invalid(
                "encoded chunk has non-zero reserved header bytes",
            ));
        }
        let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        Ok(Header {
            codec,
            params: u64_at(8),
            count: u64_at(16),
            payload: u64_at(24),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            codec: CodecId::Qsgd,
            params: 0x1234,
            count: 7,
            payload: 9,
        }
    }

    #[test]
    fn round_trips_at_version_2() {
        let mut b = [0xffu8; HEADER_LEN];
        header().write(&mut b);
        assert_eq!(b[1], 2);
        assert_eq!(Header::read(&b).unwrap(), header());
    }

    #[test]
    fn other_versions_are_refused_by_name() {
        let mut b = [0u8; HEADER_LEN];
        header().write(&mut b);
        for v in [0u8, 1, 3, 255] {
            b[1] = v;
            let e = Header::read(&b).unwrap_err().to_string();
            assert!(
                e.contains(&format!("encoded chunk has version {v}"))
                    && e.contains("reads version 2 only"),
                "{e}"
            );
        }
    }
}
