//! The codecs' random numbers: a counter-based draw, reproducible and seeded from
//! (seed, step, chunk, rank), so that a run repeats exactly, every encode site draws independent
//! numbers, and any element's draw can be computed on its own (a GPU thread per element).
//!
//! The pinned spec, shared bit for bit with `kernels/draw.cuh`:
//! * site key `K` = [`Site::key`]: splitmix64's `mix` chained over seed, step, chunk, rank;
//! * `draw(K, j) = mix(K + (j + 1) * 0x9e3779b97f4a7c15)` (wrapping u64): output `j` of a
//!   splitmix64 stream started at `K`;
//! * element `i`'s 32 random bits: the low half of `draw(K, i / 2)` for even `i`, the high half for
//!   odd `i`; its 24-bit uniform is those bits `>> 8`, times 2^-24;
//! * random-k: `k` strata, stratum `t` covers `[t*n/k, (t+1)*n/k)` and keeps
//!   `start + draw(K, t) % len`.

/// splitmix64's finaliser: a bijective 64-bit mix.
#[inline(always)]
pub(crate) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(MIX1);
    z = (z ^ (z >> 27)).wrapping_mul(MIX2);
    z ^ (z >> 31)
}

/// `mix`'s multipliers (for the SIMD copies of it).
pub(crate) const MIX1: u64 = 0xbf58_476d_1ce4_e5b9;
pub(crate) const MIX2: u64 = 0x94d0_49bb_1331_11eb;

/// splitmix64's increment (the golden ratio in 64 bits).
pub(crate) const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// Output `j` of the splitmix64 stream keyed by `key`: 64 random bits that depend only on
/// (key, j), so each element's draw is independent of how the work is split.
#[inline(always)]
pub fn draw(key: u64, j: u64) -> u64 {
    mix(key.wrapping_add(j.wrapping_add(1).wrapping_mul(GOLDEN)))
}

/// Element `i`'s 32 random bits: one half of `draw(key, i / 2)` (low for even `i`).
#[inline(always)]
pub fn draw32(key: u64, i: u64) -> u32 {
    (draw(key, i >> 1) >> (32 * (i & 1))) as u32
}

/// Element `i`'s uniform in [0, 1) with 24 bits of resolution (stochastic rounding).
#[inline(always)]
pub fn uniform24(key: u64, i: u64) -> f32 {
    (draw32(key, i) >> 8) as f32 * (1.0 / (1u32 << 24) as f32)
}

/// Where an encode happens: what keys its draws.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Site {
    /// The job's seed (QCCL_SEED, default 0).
    pub seed: u64,
    /// The comm's compressed-call counter (same on every rank, since calls are ordered).
    pub step: u64,
    /// Which chunk of the call (an algorithm-chosen id, e.g. global element offset).
    pub chunk: u64,
    /// The encoding rank.
    pub rank: u64,
}

impl Site {
    /// The site key `K` of the draw.
    pub fn key(&self) -> u64 {
        let mut k = mix(self.seed ^ 0x5143_434c_2d63_6f64); // "QCCL-cod"
        k = mix(k ^ self.step);
        k = mix(k ^ self.chunk.rotate_left(17));
        mix(k ^ self.rank.rotate_left(41))
    }
}

/// A keyed splitmix64 stream: output `j` is [`draw`]`(key, j)`. Encode paths take only its
/// [`key`](Rng::key) and draw by element index; the sequential calls serve tests and tools.
#[derive(Debug, Clone)]
pub struct Rng {
    key: u64,
    next: u64,
}

impl Rng {
    /// The stream of one encode site.
    pub fn new(site: Site) -> Rng {
        Rng::from_u64(site.key())
    }

    /// The stream keyed by one 64-bit value.
    pub fn from_u64(key: u64) -> Rng {
        Rng { key, next: 0 }
    }

    /// The key: what an encode draws from, by index, whatever the stream's position.
    #[inline]
    pub fn key(&self) -> u64 {
        self.key
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let r = draw(self.key, self.next);
        self.next = self.next.wrapping_add(1);
        r
    }

    /// Uniform in [0, 1) with 24 bits of resolution.
    #[inline]
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u32 << 24) as f32)
    }

    /// Uniform in 0..n (n > 0), by Lemire's multiply-shift (bias below 2^-32 for n < 2^32).
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference values from splitmix64's definition, computed outside this code (Python:
    /// `z = (k + (j+1)*0x9e3779b97f4a7c15) % 2**64`, then the three xor-shift-multiply steps).
    #[test]
    fn draw_matches_splitmix64() {
        let want: [(u64, u64, u64); 7] = [
            (0, 0, 0xe220_a839_7b1d_cdaf), // splitmix64(seed 0)'s well-known first output
            (0, 1, 0x6e78_9e6a_a1b9_65f4),
            (0, 2, 0x06c4_5d18_8009_454f),
            (1_234_567, 0, 0x599e_d017_fb08_fc85),
            (u64::MAX, 5, 0xd31d_adbd_a438_bb33),
            (0xdead_beef_cafe_f00d, 1 << 40, 0x8c7a_a26f_5ad5_bff5),
            (42, u64::MAX, 0xa759_ea27_d472_7622),
        ];
        for (k, j, r) in want {
            assert_eq!(draw(k, j), r, "draw({k:#x}, {j:#x})");
        }
        let mut s = Rng::from_u64(0);
        assert_eq!(s.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(s.next_u64(), 0x6e78_9e6a_a1b9_65f4);
    }

    #[test]
    fn site_key_matches_the_mix_chain() {
        // Same Python reference: mix chained over seed ^ "QCCL-cod", step, rotl(chunk, 17),
        // rotl(rank, 41).
        let s = Site {
            seed: 1,
            step: 2,
            chunk: 3,
            rank: 4,
        };
        assert_eq!(s.key(), 0x3491_02b4_abfd_7a73);
        assert_eq!(Site::default().key(), 0xdc50_1783_86d3_b575);
        assert_eq!(Rng::new(s).key(), s.key());
    }

    #[test]
    fn element_bits_are_halves_of_one_draw() {
        let k = 0x0123_4567_89ab_cdef;
        for i in [0u64, 1, 2, 7, 1_000_003] {
            let d = draw(k, i / 2);
            let want = if i % 2 == 0 {
                d as u32
            } else {
                (d >> 32) as u32
            };
            assert_eq!(draw32(k, i), want);
            assert_eq!(uniform24(k, i), (want >> 8) as f32 / 16_777_216.0);
        }
    }

    #[test]
    fn sites_are_reproducible_and_distinct() {
        let a = Site {
            seed: 1,
            step: 2,
            chunk: 3,
            rank: 4,
        };
        assert_eq!(a.key(), a.key());
        for other in [
            Site { seed: 0, ..a },
            Site { step: 0, ..a },
            Site { chunk: 0, ..a },
            Site { rank: 0, ..a },
        ] {
            assert_ne!(other.key(), a.key());
        }
    }

    #[test]
    fn uniform_floats_cover_the_unit_interval() {
        let mut r = Rng::from_u64(7);
        let xs: Vec<f32> = (0..100_000).map(|_| r.next_f32()).collect();
        assert!(xs.iter().all(|&x| (0.0..1.0).contains(&x)));
        let mean = xs.iter().map(|&x| x as f64).sum::<f64>() / xs.len() as f64;
        assert!((mean - 0.5).abs() < 0.005, "mean {mean}");
        assert!(xs.iter().all(|_| r.below(10) < 10));
        let us: Vec<f32> = (0..100_000).map(|i| uniform24(7, i)).collect();
        assert!(us.iter().all(|&x| (0.0..1.0).contains(&x)));
        let mean = us.iter().map(|&x| x as f64).sum::<f64>() / us.len() as f64;
        assert!((mean - 0.5).abs() < 0.005, "mean {mean}");
    }
}
