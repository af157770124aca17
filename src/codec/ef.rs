//! Error feedback: what an encode lost is kept and added to the next call's input for the same
//! tensor, so compression error does not accumulate over steps (Seide et al., Karimireddy et
//! al.). The residual lives in the comm, keyed by the tensor key given with the call.
//!
//! Inside a collective every encode of positions P by this rank adds (input − decoded) at P to
//! the residual; the next call adds the residual to its input once, before the algorithm runs.
//! Whatever mass any hop of any algorithm dropped is thus re-sent by the rank that dropped it.

use std::collections::HashMap;
use std::fmt;

/// Names a tensor across calls: a number or a name.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum TensorKey {
    /// A numeric id (e.g. a parameter index).
    Id(u64),
    /// A name (e.g. "layer3.weight").
    Name(String),
}

impl fmt::Display for TensorKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TensorKey::Id(i) => write!(f, "#{i}"),
            TensorKey::Name(s) => write!(f, "\"{s}\""),
        }
    }
}

impl From<u64> for TensorKey {
    fn from(v: u64) -> TensorKey {
        TensorKey::Id(v)
    }
}

impl From<&str> for TensorKey {
    fn from(v: &str) -> TensorKey {
        TensorKey::Name(v.to_string())
    }
}

impl From<String> for TensorKey {
    fn from(v: String) -> TensorKey {
        TensorKey::Name(v)
    }
}

/// The residuals of one comm.
#[derive(Default)]
pub struct Residuals {
    map: HashMap<TensorKey, Vec<f32>>,
}

impl Residuals {
    /// The residual of `key`, created zeroed at `len` elements on first use. A call with
    /// another length for the same key starts its residual again from zero (logged at INFO):
    /// the tensor was re-created (PyTorch DDP rebuilds its buckets after the first step), and
    /// what the old one lost belongs to other elements. Every rank sees the same calls, so all
    /// reset together.
    pub fn get(&mut self, key: &TensorKey, len: usize) -> &mut Vec<f32> {
        let r = self
            .map
            .entry(key.clone())
            .or_insert_with(|| vec![0.0; len]);
        if r.len() != len {
            crate::qlog!(
                Info,
                "error feedback: tensor key {key} was used with {} elements, now with {len}: \
                 its residual starts again from zero",
                r.len()
            );
            *r = vec![0.0; len];
        }
        r
    }

    /// Puts back the residual of `key` that a call took out with `std::mem::take`.
    pub fn put(&mut self, key: &TensorKey, residual: Vec<f32>) {
        self.map.insert(key.clone(), residual);
    }

    /// Forgets the residual of `key` (e.g. when a tensor is re-created); true if it existed.
    pub fn remove(&mut self, key: &TensorKey) -> bool {
        self.map.remove(key).is_some()
    }
}

/// Adds the residual to the input and clears it: the start of a compensated call.
pub fn compensate(input: &mut [f32], residual: &mut [f32]) {
    for (x, r) in input.iter_mut().zip(residual.iter_mut()) {
        *x += *r;
        *r = 0.0;
    }
}

/// `compensate` of an out-of-place call: `work = input + residual` in one pass, residual
/// cleared (the same bits as copying, then compensating).
pub fn compensate_from(input: &[f32], work: &mut [f32], residual: &mut [f32]) {
    for ((w, &x), r) in work.iter_mut().zip(input).zip(residual.iter_mut()) {
        *w = x + *r;
        *r = 0.0;
    }
}

/// Records what an encode lost: residual += input − decoded.
pub fn record(residual: &mut [f32], input: &[f32], decoded: &[f32]) {
    for ((r, &x), &d) in residual.iter_mut().zip(input).zip(decoded) {
        *r += x - d;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn residual_is_sized_per_key_and_restarts_when_the_length_changes() {
        let mut r = Residuals::default();
        r.get(&"w".into(), 4)[1] = 2.0;
        assert_eq!(r.get(&"w".into(), 4)[1], 2.0);
        assert_eq!(r.get(&"w".into(), 5), &[0.0; 5]);
        assert_eq!(r.get(&7u64.into(), 3).len(), 3);
        assert_eq!(r.map.len(), 2);
    }

    #[test]
    fn compensate_then_record_keeps_lost_mass() {
        let mut x = vec![1.0, 2.0];
        let mut res = vec![0.5, -0.5];
        compensate(&mut x, &mut res);
        assert_eq!(x, [1.5, 1.5]);
        record(&mut res, &x, &[1.0, 2.0]);
        assert_eq!(res, [0.5, -0.5]);
    }
}
