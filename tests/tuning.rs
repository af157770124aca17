//! QCCL_TUNING_FILE: a tuning file's rows change what `auto` picks (visible in the algorithm
//! each call returns), results stay right against a float64 reference, and bad files fail
//! init naming the file and line.

mod common;

use common::coded::{grad, reference, rel_err};
use common::threads::on_hosts;
use qccl::{Algo, Comm, Compression, Config, Error, ReduceOp};
use std::path::PathBuf;

/// A tuning file with `rows` under the header, unique per test process and `tag`.
fn tuning_file(tag: &str, rows: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("qccl-tuning-{}-{tag}.txt", std::process::id()));
    std::fs::write(&path, format!("# qccl tuning v1\n{rows}")).unwrap();
    path
}

fn config(path: &std::path::Path) -> Config {
    Config {
        tuning_file: Some(path.to_path_buf()),
        ..Config::default()
    }
}

/// The algorithm `auto` ran for an f32 sum of `count` elements on every rank, checked against
/// the float64 sum.
fn auto_algo(hosts: &[&str], config: Config, count: usize) -> Vec<Algo> {
    let n = hosts.len();
    let exact = reference(n, count, 7);
    on_hosts(hosts, config, move |c: &Comm| {
        let send = grad(c.rank(), count, 7);
        let mut recv = vec![0f32; count];
        let algo = c
            .all_reduce_with(Some(&send), &mut recv, ReduceOp::Sum, Algo::Auto)
            .unwrap();
        let err = rel_err(&recv, &exact);
        assert!(
            err < 1e-6,
            "rank {}: {algo:?}: relative error {err}",
            c.rank()
        );
        algo
    })
}

#[test]
fn a_tuning_file_changes_what_auto_picks() {
    let four = ["h"; 4];
    // Built in: threads, 4 ranks, 4 KiB: the tree; 4 MiB: SRA.
    assert_eq!(auto_algo(&four, Config::default(), 1024), [Algo::Tree; 4]);
    let path = tuning_file(
        "flat",
        "# measured elsewhere\nallreduce threads 4 8K ring\nallreduce threads 3-4 * allgather\n",
    );
    assert_eq!(auto_algo(&four, config(&path), 1024), [Algo::Ring; 4]);
    assert_eq!(auto_algo(&four, config(&path), 5000), [Algo::AllGather; 4]);
    // Rows for other world sizes leave this one to the built-in table.
    assert_eq!(auto_algo(&["h"; 5], config(&path), 1024), [Algo::Tree; 5]);
    // An explicit algorithm is not the table's to change.
    let explicit = on_hosts(&four, config(&path), |c: &Comm| {
        let mut v = vec![1f32; 1024];
        c.all_reduce_with(None, &mut v, ReduceOp::Sum, Algo::Sra)
            .unwrap()
    });
    assert_eq!(explicit, [Algo::Sra; 4]);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_tuning_file_can_keep_two_hosts_flat_or_compress_another_way() {
    let hosts = ["a", "a", "b", "b"];
    assert_eq!(auto_algo(&hosts, Config::default(), 1024), [Algo::Hier; 4]);
    let path = tuning_file("hosts", "allreduce * 4 * sra\ncompressed * * * ring\n");
    assert_eq!(auto_algo(&hosts, config(&path), 1024), [Algo::Sra; 4]);
    // Compressed calls read their own rows (the Report names the schedule that ran).
    let count = 4096;
    let exact = reference(4, count, 3);
    let reports = on_hosts(&hosts, config(&path), move |c: &Comm| {
        let mut v = grad(c.rank(), count, 3);
        let r = c
            .all_reduce_compressed(&mut v, ReduceOp::Sum, &Compression::parse("fp16").unwrap())
            .unwrap();
        let err = rel_err(&v, &exact);
        assert!(err < 1e-2, "rank {}: relative error {err}", c.rank());
        r.algo
    });
    assert_eq!(reports, [Algo::Ring; 4]);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn bad_tuning_files_fail_init_by_name_and_line() {
    let path = tuning_file(
        "bad",
        "allreduce threads 4 8K ring\nallreduce threads 0 * ring\n",
    );
    let e = Comm::init_threads(2, config(&path))
        .err()
        .expect("a bad file fails init");
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    let msg = e.to_string();
    let want = format!("QCCL_TUNING_FILE={}: line 3: ranks '0'", path.display());
    assert!(msg.contains(&want), "{msg}");
    let _ = std::fs::remove_file(&path);
    let e = Comm::init_threads(2, config(&path))
        .err()
        .expect("a missing file fails init");
    assert!(e.to_string().contains("cannot read it"), "{e}");
}
