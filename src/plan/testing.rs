//! Helpers shared by the planners' unit tests.

use super::profile::{Profile, TensorProfile};
use crate::comm::Comm;
use crate::config::Config;

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

/// Runs `f(rank, comm)` on `n` thread ranks and returns the results in rank order.
pub fn on_threads<R: Send>(n: usize, f: impl Fn(usize, &Comm) -> R + Sync) -> Vec<R> {
    let comms = Comm::init_threads(n, Config::default()).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| {
                let f = &f;
                s.spawn(move || f(r, c))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
