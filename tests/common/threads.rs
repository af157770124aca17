//! Thread ranks for tests: one comm per thread over the in-process transport.

use qccl::{Comm, Config};
use std::sync::Arc;

/// Runs `f` on `hosts.len()` thread ranks (rank i on emulated host `hosts[i]`) and returns
/// the results in rank order.
pub fn on_hosts<R: Send + 'static>(
    hosts: &[&str],
    config: Config,
    f: impl Fn(&Comm) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let hosts: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
    let f = Arc::new(f);
    let comms = Comm::init_threads_on_hosts(&hosts, config).expect("init_threads");
    let handles: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let f = f.clone();
            std::thread::spawn(move || f(&c))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

/// Panics unless every rank's result has the same bits as rank 0's.
pub fn assert_identical(outs: &[Vec<f32>], what: &str) {
    for (r, o) in outs.iter().enumerate().skip(1) {
        let same = o.len() == outs[0].len()
            && o.iter()
                .zip(&outs[0])
                .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{what}: rank {r} differs from rank 0");
    }
}
