//! The codecs' random stream: reproducible, seeded from (seed, step, chunk, rank) so that a run
//! repeats exactly while every encode site draws independent numbers.

/// splitmix64's finaliser: a bijective 64-bit mix.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Where an encode happens: what seeds its random stream.
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

/// xoshiro256++ seeded through splitmix64: fast, 256-bit state, good statistics.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// The stream of one encode site.
    pub fn new(site: Site) -> Rng {
        let mut k = mix(site.seed ^ 0x5143_434c_2d63_6f64); // "QCCL-cod"
        k = mix(k ^ site.step);
        k = mix(k ^ site.chunk.rotate_left(17));
        k = mix(k ^ site.rank.rotate_left(41));
        Rng::from_u64(k)
    }

    /// A stream from one 64-bit seed.
    pub fn from_u64(seed: u64) -> Rng {
        let mut x = seed;
        let mut s = [0u64; 4];
        for w in &mut s {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            *w = mix(x);
        }
        Rng { s }
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let out = (s[0].wrapping_add(s[3])).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
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

    #[test]
    fn sites_are_reproducible_and_distinct() {
        let a = Site {
            seed: 1,
            step: 2,
            chunk: 3,
            rank: 4,
        };
        let first: Vec<u64> = (0..4)
            .map({
                let mut r = Rng::new(a);
                move |_| r.next_u64()
            })
            .collect();
        let again: Vec<u64> = (0..4)
            .map({
                let mut r = Rng::new(a);
                move |_| r.next_u64()
            })
            .collect();
        assert_eq!(first, again);
        for other in [
            Site { seed: 0, ..a },
            Site { step: 0, ..a },
            Site { chunk: 0, ..a },
            Site { rank: 0, ..a },
        ] {
            assert_ne!(Rng::new(other).next_u64(), first[0]);
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
    }
}
