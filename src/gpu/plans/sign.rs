//! The one-bit codecs (`efsign`, `onebit`) on a device, as kernels/shim/sign_driver.cpp
//! launches kernels/sign.cu: partial sums of 2048-element tiles (8 threads a tile, cut at
//! bucket ends for onebit) into scratch, the scales from them in the CPU's order (one block
//! for efsign, a thread a bucket for onebit), then the sign bits (a thread a byte). Decode:
//! the check kernel into `bad`, then the decode kernel unconditionally (it reads only the
//! payload's own bytes and writes only `out`, so a refused payload is safe to decode).

use super::{grid_for, CodecPlan, BLOCK};
use crate::codec::{Codec, CodecId};
use crate::error::{Error, Result};
use crate::gpu::driver::{Arg, Driver, Function, Stream};
use std::sync::Arc;

/// sign.cu's `QCCL_SIGN_TILE`: elements of a tile of the sums.
const TILE: usize = 2048;

/// Which one-bit codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    EfSign,
    OneBit { bucket: u32 },
}

/// A one-bit codec's kernels on one device.
pub struct SignPlan {
    kind: Kind,
    /// Tile sums (efsign) or segment sums (onebit) of x, and of x + res.
    sums: Arc<dyn Function>,
    sums_ef: Arc<dyn Function>,
    /// The payload's scales from the sums.
    scales: Arc<dyn Function>,
    /// Sign bits of x; with error feedback, of x + res, updating res.
    pack: Arc<dyn Function>,
    pack_ef: Arc<dyn Function>,
    check: Arc<dyn Function>,
    decode: Arc<dyn Function>,
    decode_add: Arc<dyn Function>,
}

impl SignPlan {
    /// The plan of `codec` (efsign or onebit) on device `ordinal` (loading its kernels);
    /// `InvalidArgument` for another codec.
    pub fn new(driver: &dyn Driver, ordinal: usize, codec: &dyn Codec) -> Result<SignPlan> {
        let params = codec.params();
        let kind = match codec.id() {
            CodecId::EfSign if params == 0 => Kind::EfSign,
            CodecId::OneBit if (1..=1 << 24).contains(&params) => Kind::OneBit {
                bucket: params as u32,
            },
            _ => {
                return Err(Error::invalid(format!(
                    "one-bit launch plan: codec {} (parameters {params:#x}) is neither efsign \
                     nor onebit",
                    codec.spec()
                )))
            }
        };
        let f = |name: &str| driver.function(ordinal, name);
        let (sums, sums_ef, scales, pack_ef, check, decode, decode_add) = match kind {
            Kind::EfSign => (
                "qccl_efsign_tile_sums",
                "qccl_efsign_tile_sums_ef",
                "qccl_efsign_scale",
                "qccl_efsign_pack_ef",
                "qccl_efsign_check",
                "qccl_efsign_decode",
                "qccl_efsign_decode_add",
            ),
            Kind::OneBit { .. } => (
                "qccl_onebit_segment_sums",
                "qccl_onebit_segment_sums_ef",
                "qccl_onebit_means",
                "qccl_onebit_pack_ef",
                "qccl_onebit_check",
                "qccl_onebit_decode",
                "qccl_onebit_decode_add",
            ),
        };
        Ok(SignPlan {
            kind,
            sums: f(sums)?,
            sums_ef: f(sums_ef)?,
            scales: f(scales)?,
            pack: f("qccl_signs_pack")?,
            pack_ef: f(pack_ef)?,
            check: f(check)?,
            decode: f(decode)?,
            decode_add: f(decode_add)?,
        })
    }

    /// Scale bytes ahead of the sign bits.
    fn meta_len(&self, count: usize) -> usize {
        match self.kind {
            Kind::EfSign => 4,
            Kind::OneBit { bucket } => 8 * count.div_ceil(bucket as usize),
        }
    }

    /// The arguments the codec's kernels end with: (count) for efsign, (count, bucket) for
    /// onebit.
    fn tail(&self, count: usize) -> Vec<Arg> {
        match self.kind {
            Kind::EfSign => vec![Arg::U64(count as u64)],
            Kind::OneBit { bucket } => vec![Arg::U64(count as u64), Arg::U32(bucket)],
        }
    }

    /// Enqueues the sums of x (or x + `res`) into `scratch`, then the scales into `payload`.
    ///
    /// # Safety
    /// As [`CodecPlan::encode_ef`].
    unsafe fn scales(
        &self,
        s: &dyn Stream,
        x: u64,
        res: Option<u64>,
        payload: u64,
        count: usize,
        scratch: u64,
    ) -> Result<()> {
        if scratch == 0 && self.scratch_len(count) > 0 {
            return Err(Error::invalid(format!(
                "one-bit launch plan: {count} elements need {} bytes of scratch (got null)",
                self.scratch_len(count)
            )));
        }
        let tail = self.tail(count);
        if count > 0 {
            let (f, inputs) = match res {
                Some(res) => (&self.sums_ef, vec![Arg::Ptr(x), Arg::Ptr(res)]),
                None => (&self.sums, vec![Arg::Ptr(x)]),
            };
            // 8 threads a tile; the block a multiple of 32 (the fold's shuffles).
            let grid = grid_for(count.div_ceil(TILE) * 8);
            let args = [&inputs[..], &[Arg::Ptr(scratch)], &tail].concat();
            // SAFETY: qccl_efsign_tile_sums[_ef](x, [res,] tile_sums, count) or
            // qccl_onebit_segment_sums[_ef](x, [res,] seg, count, bucket), the sums in the
            // scratch_len(count) bytes at `scratch`; the ranges are the caller's to keep valid
            // (the trait's contract).
            unsafe { s.launch(&**f, grid, BLOCK, &args) }?;
        }
        let args = [&[Arg::Ptr(scratch), Arg::Ptr(payload)][..], &tail].concat();
        match self.kind {
            // One block writes the scale, 0.0 for no elements (the payload still holds it).
            // SAFETY: qccl_efsign_scale(tile_sums, payload, count), after the sums on `s`.
            Kind::EfSign => unsafe { s.launch(&*self.scales, 1, BLOCK, &args) },
            Kind::OneBit { bucket } if count > 0 => {
                let grid = grid_for(count.div_ceil(bucket as usize));
                // SAFETY: qccl_onebit_means(seg, payload, count, bucket), a thread a bucket,
                // after the sums on `s`.
                unsafe { s.launch(&*self.scales, grid, BLOCK, &args) }
            }
            Kind::OneBit { .. } => Ok(()),
        }
    }
}

/// Blocks for the kernels that take a thread per byte of sign bits (8 elements).
fn bytes_grid(count: usize) -> u32 {
    grid_for(count.div_ceil(8))
}

/// Segments of a onebit encode (sign.cu's `qccl_onebit_segments`): the pieces of the count
/// elements cut at every multiple of the tile and of the bucket.
fn onebit_segments(count: usize, bucket: usize) -> usize {
    // gcd(2048, bucket) is the bucket's power-of-two factor, at most the tile.
    let gcd = (1usize << bucket.trailing_zeros()).min(TILE);
    let lcm = TILE / gcd * bucket;
    count.div_ceil(TILE) + count.div_ceil(bucket) - count.div_ceil(lcm)
}

impl CodecPlan for SignPlan {
    fn codec(&self) -> CodecId {
        match self.kind {
            Kind::EfSign => CodecId::EfSign,
            Kind::OneBit { .. } => CodecId::OneBit,
        }
    }

    fn payload_len(&self, count: usize) -> usize {
        self.meta_len(count) + count.div_ceil(8)
    }

    /// f32 sums (4-byte aligned): efsign one a tile, onebit three a segment.
    fn scratch_len(&self, count: usize) -> usize {
        match self.kind {
            Kind::EfSign => 4 * count.div_ceil(TILE),
            Kind::OneBit { bucket } => 12 * onebit_segments(count, bucket as usize),
        }
    }

    unsafe fn encode(
        &self,
        s: &dyn Stream,
        x: u64,
        payload: u64,
        count: usize,
        _key: u64,
        scratch: u64,
    ) -> Result<()> {
        // SAFETY: the caller's promise (the trait's contract).
        unsafe { self.scales(s, x, None, payload, count, scratch) }?;
        if count == 0 {
            return Ok(());
        }
        let bits = payload + self.meta_len(count) as u64;
        let args = [Arg::Ptr(x), Arg::Ptr(bits), Arg::U64(count as u64)];
        // SAFETY: qccl_signs_pack(x, bits, count), the bits after the scales; as above.
        unsafe { s.launch(&*self.pack, bytes_grid(count), BLOCK, &args) }
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
        scratch: u64,
    ) -> Result<()> {
        // SAFETY: the caller's promise.
        unsafe { self.scales(s, x, Some(res), payload, count, scratch) }?;
        if count == 0 {
            return Ok(());
        }
        let ptrs = [
            Arg::Ptr(x),
            Arg::Ptr(res),
            Arg::Ptr(w_out),
            Arg::Ptr(payload),
        ];
        let args = [&ptrs[..], &self.tail(count)].concat();
        // SAFETY: qccl_efsign_pack_ef(x, res, w_out, payload, count) or
        // qccl_onebit_pack_ef(..., count, bucket), w_out may be null; it reads the scales
        // written before it on `s`; as above.
        unsafe { s.launch(&*self.pack_ef, bytes_grid(count), BLOCK, &args) }
    }

    unsafe fn decode(
        &self,
        s: &dyn Stream,
        payload: u64,
        out: u64,
        count: usize,
        add: bool,
        bad: u64,
        _scratch: u64,
    ) -> Result<()> {
        if bad == 0 {
            return Err(Error::invalid(format!(
                "{} launch plan: decode needs a flag word at `bad` (got null)",
                self.codec().name()
            )));
        }
        match self.kind {
            // The scale is in the payload even for no elements: checked all the same.
            Kind::EfSign => {
                let args = [Arg::Ptr(payload), Arg::Ptr(bad)];
                // SAFETY: qccl_efsign_check(payload, bad); as above.
                unsafe { s.launch(&*self.check, 1, 1, &args) }?;
            }
            Kind::OneBit { bucket } if count > 0 => {
                let args = [&[Arg::Ptr(payload), Arg::Ptr(bad)][..], &self.tail(count)].concat();
                let grid = grid_for(count.div_ceil(bucket as usize));
                // SAFETY: qccl_onebit_check(payload, bad, count, bucket); as above.
                unsafe { s.launch(&*self.check, grid, BLOCK, &args) }?;
            }
            Kind::OneBit { .. } => {}
        }
        if count == 0 {
            return Ok(());
        }
        let f = if add { &self.decode_add } else { &self.decode };
        let args = [&[Arg::Ptr(payload), Arg::Ptr(out)][..], &self.tail(count)].concat();
        // SAFETY: qccl_<codec>_decode[_add](payload, out, count[, bucket]): in bounds whatever
        // the payload holds (the check's verdict only fails the call); as above.
        unsafe { s.launch(&**f, bytes_grid(count), BLOCK, &args) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Segments counted one by one: a new one at every multiple of the tile or the bucket.
    fn counted(count: usize, bucket: usize) -> usize {
        (0..count)
            .filter(|i| i % TILE == 0 || i % bucket == 0)
            .count()
    }

    #[test]
    fn segments_match_a_count_of_their_starts() {
        for bucket in [1, 7, 100, 512, 2048, 3000, 4096, 6144, 1 << 24] {
            for count in [0, 1, 7, 2047, 2048, 2049, 4099, 12_289, 70_001] {
                assert_eq!(
                    onebit_segments(count, bucket),
                    counted(count, bucket),
                    "count {count} bucket {bucket}"
                );
            }
        }
    }
}
