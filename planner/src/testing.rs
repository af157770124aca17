//! Helpers shared by the planners' unit tests.

use crate::profile::{Profile, TensorProfile};

/// A profile of tensors with these element counts, each taking `backprop` seconds.
pub fn prof(sizes: &[usize], backprop: f64) -> Profile {
    Profile {
        note: String::new(),
        tensors: sizes
            .iter()
            .enumerate()
            .map(|(i, &elems)| TensorProfile {
                name: format!("t{i}"),
                elems,
                backprop,
            })
            .collect(),
    }
}
