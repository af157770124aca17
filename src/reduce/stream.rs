//! Copies that bypass the cache (non-temporal stores), for large results nobody reads soon: a
//! normal store to a line not in cache first reads the line from memory ("read for
//! ownership"), so copying a buffer much larger than the cache costs a read, a read and a
//! write per byte; streaming stores leave out the middle read. Callers must call [`fence`]
//! before another thread or process may read what was streamed.

/// `dst.copy_from_slice(src)` with non-temporal stores where the CPU has them.
pub fn copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "streaming copy of unequal lengths");
    #[cfg(target_arch = "x86_64")]
    {
        // Head up to the first 64-byte (cache line) aligned address of dst, then whole lines.
        let head = dst.as_ptr().align_offset(64).min(dst.len());
        dst[..head].copy_from_slice(&src[..head]);
        let body = (dst.len() - head) / 64 * 64;
        let (d, s) = (&mut dst[head..head + body], &src[head..head + body]);
        match super::x86::Avx2::detect() {
            // SAFETY: the token proves AVX; `d` starts 64-byte aligned and both are whole lines.
            Some(_) => unsafe { lines_avx(d, s) },
            // SAFETY: SSE2 is part of x86_64; same alignment argument.
            None => unsafe { lines_sse2(d, s) },
        }
        let done = head + body;
        dst[done..].copy_from_slice(&src[done..]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

/// Streams whole 64-byte lines from `s` to the 64-byte aligned `d` (equal lengths, multiples
/// of 64). Caller: the CPU has AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn lines_avx(d: &mut [u8], s: &[u8]) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
    for (d, s) in d.chunks_exact_mut(64).zip(s.chunks_exact(64)) {
        let (dp, sp) = (d.as_mut_ptr() as *mut __m256i, s.as_ptr() as *const __m256i);
        // SAFETY: 64 readable bytes at `sp` (unaligned loads allowed), 64 writable bytes at the
        // 64-byte aligned `dp` (the caller's alignment); AVX is the caller's guarantee.
        unsafe {
            let (a, b) = (_mm256_loadu_si256(sp), _mm256_loadu_si256(sp.add(1)));
            _mm256_stream_si256(dp, a);
            _mm256_stream_si256(dp.add(1), b);
        }
    }
}

/// As `lines_avx`, with SSE2 (always present on x86_64).
#[cfg(target_arch = "x86_64")]
unsafe fn lines_sse2(d: &mut [u8], s: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    for (d, s) in d.chunks_exact_mut(16).zip(s.chunks_exact(16)) {
        // SAFETY: 16 readable bytes at `s`, 16 writable bytes at a 16-byte aligned address
        // (the caller's 64-byte alignment, in steps of 16).
        unsafe {
            _mm_stream_si128(
                d.as_mut_ptr() as *mut __m128i,
                _mm_loadu_si128(s.as_ptr() as *const __m128i),
            )
        }
    }
}

/// Orders every streaming store before the stores that follow (x86 `sfence`).
pub fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of x86_64; sfence has no operands.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(test)]
mod tests {
    #[test]
    fn copies_every_alignment_and_length() {
        let src: Vec<u8> = (0..300u32).map(|i| (i * 7 + 3) as u8).collect();
        for off in 0..17 {
            for len in [0, 1, 15, 16, 17, 31, 64, 100, 283 - off] {
                let mut dst = vec![0u8; 300];
                super::copy(&mut dst[off..off + len], &src[5..5 + len]);
                super::fence();
                assert_eq!(
                    &dst[off..off + len],
                    &src[5..5 + len],
                    "off {off} len {len}"
                );
                assert!(dst[..off].iter().all(|&b| b == 0));
                assert!(dst[off + len..].iter().all(|&b| b == 0));
            }
        }
    }
}
