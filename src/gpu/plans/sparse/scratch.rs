//! The device scratch of a sparse plan: what kernels/shim/sparse_driver.cpp keeps in
//! std::vectors, as regions of the caller's one scratch allocation. Each region starts on a
//! 256-byte boundary (as a fresh `cuMemAlloc` would), so the scratch itself needs only the
//! 8-byte alignment of the u64 state words the kernels update atomically.

use crate::error::{Error, Result};

/// Words of the selection state (SPARSE_STATE in sparse.cuh).
const STATE_WORDS: usize = 31;

/// Bins of the radix select's histogram (u32 each).
const HIST_BINS: usize = 2048;

/// Elements per compaction segment (SPARSE_SEG in sparse.cuh): two u64 counts each.
const SEGMENT: usize = 4096;

/// Elements per part of mstopk's mean, and f32 lanes per part (mstopk.cu).
const MEAN_PART: usize = 16384;
const MEAN_LANES: usize = 16;

/// Where every region starts.
const REGION_ALIGN: usize = 256;

/// Which regions a codec's selection uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Needs {
    /// None (randk draws each pair alone).
    Nothing,
    /// State, histogram and compaction counts (topk).
    Select,
    /// Those and mstopk's per-lane sums and maxima.
    SelectAndMean,
}

/// Device addresses of the regions (0 where unused).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Scratch {
    /// STATE_WORDS u64: the selection state.
    pub state: u64,
    /// HIST_BINS u32.
    pub hist: u64,
    /// 2 u64 per compaction segment.
    pub counts: u64,
    /// mstopk: MEAN_LANES f32 per part, sums then maxima.
    pub psum: u64,
    pub pmax: u64,
}

/// Region sizes in bytes, in layout order: state, hist, counts, psum, pmax.
fn regions(needs: Needs, count: usize) -> [usize; 5] {
    if needs == Needs::Nothing || count == 0 {
        return [0; 5];
    }
    let lanes = if needs == Needs::SelectAndMean {
        count.div_ceil(MEAN_PART) * MEAN_LANES
    } else {
        0
    };
    [
        8 * STATE_WORDS,
        4 * HIST_BINS,
        16 * count.div_ceil(SEGMENT),
        4 * lanes,
        4 * lanes,
    ]
}

/// Offsets of the regions and the total length.
fn layout(needs: Needs, count: usize) -> ([usize; 5], usize) {
    let mut at = [0; 5];
    let mut end = 0;
    for (i, len) in regions(needs, count).into_iter().enumerate() {
        at[i] = end;
        if len > 0 {
            end = (end + len).next_multiple_of(REGION_ALIGN);
        }
    }
    (at, end)
}

impl Scratch {
    /// Bytes of scratch a call on `count` elements needs.
    pub fn len(needs: Needs, count: usize) -> usize {
        layout(needs, count).1
    }

    /// The regions for `count` elements at `base`; `InvalidArgument` naming `scratch` when it
    /// is needed and null or not 8-byte aligned.
    pub fn at(needs: Needs, count: usize, base: u64) -> Result<Scratch> {
        let (at, len) = layout(needs, count);
        if len == 0 {
            return Ok(Scratch::default());
        }
        if base == 0 || !base.is_multiple_of(8) {
            return Err(Error::invalid(format!(
                "sparse plan scratch at {base:#x}: {len} bytes, 8-byte aligned, are needed"
            )));
        }
        let addr = |i: usize| base + at[i] as u64;
        let mean = needs == Needs::SelectAndMean;
        Ok(Scratch {
            state: addr(0),
            hist: addr(1),
            counts: addr(2),
            psum: if mean { addr(3) } else { 0 },
            pmax: if mean { addr(4) } else { 0 },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_aligned_and_cover_the_kernels_arrays() {
        assert_eq!(Scratch::len(Needs::Nothing, 1 << 20), 0);
        assert_eq!(Scratch::len(Needs::Select, 0), 0);
        // state 248 -> 256, hist 8192, counts 16 -> 256.
        assert_eq!(Scratch::len(Needs::Select, 1), 256 + 8192 + 256);
        // counts of 245 segments: 3920 bytes -> 4096.
        assert_eq!(Scratch::len(Needs::Select, 1_000_003), 256 + 8192 + 4096);
        // 62 parts of 16 lanes: 3968 bytes each for sums and maxima.
        assert_eq!(
            Scratch::len(Needs::SelectAndMean, 1_000_003),
            256 + 8192 + 4096 + 2 * 4096
        );
        let s = Scratch::at(Needs::SelectAndMean, 7, 0x1000).unwrap();
        assert_eq!(
            [s.state, s.hist, s.counts, s.psum, s.pmax],
            [0x1000, 0x1100, 0x3100, 0x3200, 0x3300]
        );
        let s = Scratch::at(Needs::Select, 7, 0x1000).unwrap();
        assert_eq!((s.psum, s.pmax), (0, 0));
        for bad in [0, 0x1004] {
            let e = Scratch::at(Needs::Select, 7, bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        }
        assert!(Scratch::at(Needs::Nothing, 7, 0).is_ok());
        assert!(Scratch::at(Needs::Select, 0, 0).is_ok());
    }
}
