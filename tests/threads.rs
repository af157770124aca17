//! Every collective on ranks that are threads (in-process transport), world sizes 1–7.

mod common;

use common::suite::{cases, run_all, run_huge};
use qccl::{Comm, Config};

fn on_threads(n: usize, f: impl Fn(&Comm) -> Result<(), String> + Send + Sync + 'static) {
    let f = std::sync::Arc::new(f);
    let comms = Comm::init_threads(n, Config::default()).expect("init_threads");
    let handles: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let f = f.clone();
            std::thread::spawn(move || f(&c).map_err(|e| format!("rank {}: {e}", c.rank())))
        })
        .collect();
    let errors: Vec<String> = handles
        .into_iter()
        .filter_map(|h| h.join().expect("rank thread panicked").err())
        .collect();
    assert!(errors.is_empty(), "world size {n}:\n{}", errors.join("\n"));
}

#[test]
fn world_1() {
    on_threads(1, |c| run_all(c, &cases(true)));
}

#[test]
fn world_2() {
    on_threads(2, |c| run_all(c, &cases(true)));
}

#[test]
fn world_3() {
    on_threads(3, |c| run_all(c, &cases(true)));
}

#[test]
fn world_4() {
    on_threads(4, |c| run_all(c, &cases(false)));
}

#[test]
fn world_5() {
    on_threads(5, |c| run_all(c, &cases(true)));
}

#[test]
fn world_7() {
    on_threads(7, |c| run_all(c, &cases(true)));
}

#[test]
fn huge_16mi_world_3() {
    on_threads(3, run_huge);
}
