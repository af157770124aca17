//! Block kernels and the drivers that walk byte slices one block at a time.
//!
//! A kernel reduces one block of [`BLOCK`] elements held in typed arrays; the drivers here cut the
//! caller's byte slices into such blocks. When the byte slices can be viewed as typed slices
//! (aligned, the usual case), whole blocks are reduced in place. Otherwise (misaligned) each block
//! is copied into an aligned staging array, reduced there and copied back: the native-byte-order
//! copy is what `from_ne_bytes`/`to_ne_bytes` would do, but a block at a time. The last, partial
//! block is zero-padded in a staging array too, so every element goes through the same block code
//! whatever the length or alignment, and results are bit-identical across paths (up to the sign
//! and payload of a NaN produced by arithmetic: each inlined copy may order the operands of a
//! commutative operation differently).
//!
//! Everything here is `#[inline(always)]`: the x86_64 entry points call these drivers from a
//! `#[target_feature]` function and get the whole loop compiled for AVX2.

use bytemuck::Pod;
use std::mem::size_of;

/// Elements per block: a fixed trip count the compiler unrolls and vectorizes
/// (64 × f32 = 256 bytes = 8 AVX2 registers).
pub(crate) const BLOCK: usize = 64;

/// One block of elements.
pub(crate) type Block<T> = [T; BLOCK];

/// A binary element-wise operation on blocks of `T`.
pub(crate) trait Kernel: Copy {
    /// Element type, as stored in the buffers.
    type T: Pod;
    /// `dst[i] = dst[i] op src[i]`.
    fn block_into(self, dst: &mut Block<Self::T>, src: &Block<Self::T>);
    /// `dst[i] = a[i] op b[i]`.
    fn block3(self, dst: &mut Block<Self::T>, a: &Block<Self::T>, b: &Block<Self::T>);
}

/// A unary in-place operation on blocks of `T` (the division that finishes an average).
pub(crate) trait MapKernel: Copy {
    /// Element type, as stored in the buffers.
    type T: Pod;
    /// `dst[i] = f(dst[i])`.
    fn block_map(self, dst: &mut Block<Self::T>);
}

#[inline(always)]
fn as_block<T>(s: &[T]) -> &Block<T> {
    s.try_into().expect("chunk of BLOCK elements")
}

#[inline(always)]
fn as_block_mut<T>(s: &mut [T]) -> &mut Block<T> {
    s.try_into().expect("chunk of BLOCK elements")
}

/// Copies `bytes` (at most one block) into `block`, zero-filling what they do not cover.
#[inline(always)]
fn load<T: Pod>(block: &mut Block<T>, bytes: &[u8]) {
    let raw: &mut [u8] = bytemuck::cast_slice_mut(block.as_mut_slice());
    if bytes.len() == raw.len() {
        // Whole block: a copy of known size, which compiles to vector moves, not a memcpy call.
        raw.copy_from_slice(bytes);
    } else {
        raw[..bytes.len()].copy_from_slice(bytes);
        raw[bytes.len()..].fill(0);
    }
}

/// Copies the first `bytes.len()` bytes of `block` out to `bytes`.
#[inline(always)]
fn store<T: Pod>(block: &Block<T>, bytes: &mut [u8]) {
    let raw: &[u8] = bytemuck::cast_slice(block.as_slice());
    if bytes.len() == raw.len() {
        bytes.copy_from_slice(raw);
    } else {
        bytes.copy_from_slice(&raw[..bytes.len()]);
    }
}

#[inline(always)]
fn zeroed<T: Pod>() -> Block<T> {
    [T::zeroed(); BLOCK]
}

/// `dst[i] = dst[i] op src[i]` over byte slices of equal length.
#[inline(always)]
pub(crate) fn reduce_into<K: Kernel>(k: K, dst: &mut [u8], src: &[u8]) {
    if let (Ok(d), Ok(s)) = (
        bytemuck::try_cast_slice_mut::<u8, K::T>(dst),
        bytemuck::try_cast_slice::<u8, K::T>(src),
    ) {
        let mut dc = d.chunks_exact_mut(BLOCK);
        let mut sc = s.chunks_exact(BLOCK);
        for (d, s) in (&mut dc).zip(&mut sc) {
            k.block_into(as_block_mut(d), as_block(s));
        }
        let (d, s) = (dc.into_remainder(), sc.remainder());
        if !d.is_empty() {
            let (mut db, mut sb) = (zeroed::<K::T>(), zeroed::<K::T>());
            db[..d.len()].copy_from_slice(d);
            sb[..s.len()].copy_from_slice(s);
            k.block_into(&mut db, &sb);
            d.copy_from_slice(&db[..d.len()]);
        }
        return;
    }
    let bytes = BLOCK * size_of::<K::T>();
    let (mut db, mut sb) = (zeroed::<K::T>(), zeroed::<K::T>());
    for (d, s) in dst.chunks_mut(bytes).zip(src.chunks(bytes)) {
        load(&mut db, d);
        load(&mut sb, s);
        k.block_into(&mut db, &sb);
        store(&db, d);
    }
}

/// `dst[i] = a[i] op b[i]` over byte slices of equal length.
#[inline(always)]
pub(crate) fn reduce3<K: Kernel>(k: K, dst: &mut [u8], a: &[u8], b: &[u8]) {
    if let (Ok(d), Ok(a), Ok(b)) = (
        bytemuck::try_cast_slice_mut::<u8, K::T>(dst),
        bytemuck::try_cast_slice::<u8, K::T>(a),
        bytemuck::try_cast_slice::<u8, K::T>(b),
    ) {
        let mut dc = d.chunks_exact_mut(BLOCK);
        let mut ac = a.chunks_exact(BLOCK);
        let mut bc = b.chunks_exact(BLOCK);
        for ((d, a), b) in (&mut dc).zip(&mut ac).zip(&mut bc) {
            k.block3(as_block_mut(d), as_block(a), as_block(b));
        }
        let (d, a, b) = (dc.into_remainder(), ac.remainder(), bc.remainder());
        if !d.is_empty() {
            let (mut db, mut ab, mut bb) = (zeroed::<K::T>(), zeroed::<K::T>(), zeroed::<K::T>());
            ab[..a.len()].copy_from_slice(a);
            bb[..b.len()].copy_from_slice(b);
            k.block3(&mut db, &ab, &bb);
            d.copy_from_slice(&db[..d.len()]);
        }
        return;
    }
    let bytes = BLOCK * size_of::<K::T>();
    let (mut db, mut ab, mut bb) = (zeroed::<K::T>(), zeroed::<K::T>(), zeroed::<K::T>());
    for ((d, a), b) in dst
        .chunks_mut(bytes)
        .zip(a.chunks(bytes))
        .zip(b.chunks(bytes))
    {
        load(&mut ab, a);
        load(&mut bb, b);
        k.block3(&mut db, &ab, &bb);
        store(&db, d);
    }
}

/// `dst[i] = f(dst[i])` over a byte slice.
#[inline(always)]
pub(crate) fn map<K: MapKernel>(k: K, dst: &mut [u8]) {
    if let Ok(d) = bytemuck::try_cast_slice_mut::<u8, K::T>(dst) {
        let mut dc = d.chunks_exact_mut(BLOCK);
        for d in &mut dc {
            k.block_map(as_block_mut(d));
        }
        let d = dc.into_remainder();
        if !d.is_empty() {
            let mut db = zeroed::<K::T>();
            db[..d.len()].copy_from_slice(d);
            k.block_map(&mut db);
            d.copy_from_slice(&db[..d.len()]);
        }
        return;
    }
    let mut db = zeroed::<K::T>();
    for d in dst.chunks_mut(BLOCK * size_of::<K::T>()) {
        load(&mut db, d);
        k.block_map(&mut db);
        store(&db, d);
    }
}
