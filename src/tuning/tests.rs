use super::*;
use Flat::*;

fn one_host(n: usize) -> Hosts {
    Hosts::new(vec![n], n)
}

fn pick_in(t: &Tuning, coll: Workload, bytes: usize, size: usize, links: Links) -> Resolved {
    let hosts = one_host(size);
    let s = CallShape {
        coll,
        bytes,
        ranks: size,
        links,
        hosts: &hosts,
    };
    t.choose(&s, Algo::Auto).unwrap()
}

fn pick(bytes: usize, size: usize, links: Links) -> Flat {
    match pick_in(&Tuning::default(), Workload::AllReduce, bytes, size, links) {
        Resolved::Flat(f) => f,
        Resolved::Hier => panic!("hier on one host"),
    }
}

#[test]
fn auto_picks_by_size_ranks_and_links() {
    // The rules the two resolve_algo functions had, row for row.
    assert_eq!(pick(4096, 2, Links::Arena), AllGather);
    assert_eq!(pick(256 << 10, 2, Links::Arena), Ring);
    assert_eq!(pick(1 << 20, 2, Links::Arena), Sra);
    assert_eq!(pick(4096, 4, Links::Arena), Sra);
    assert_eq!(pick(4096, 16, Links::Arena), Sra);
    assert_eq!(pick(4096, 4, Links::Sockets), Tree);
    assert_eq!(pick(512 << 10, 4, Links::Sockets), Tree);
    assert_eq!(pick(1 << 20, 4, Links::Sockets), Sra);
    assert_eq!(pick(1 << 20, 16, Links::Sockets), Ring);
    assert_eq!(pick(8 << 10, 4, Links::Network), Tree);
    assert_eq!(pick(16 << 10, 4, Links::Network), Sra);
    assert_eq!(pick(16 << 10, 3, Links::Network), Sra);
    assert_eq!(pick(16 << 10, 16, Links::Network), Ring);
    assert_eq!(pick(4096, 2, Links::Network), AllGather);
    assert_eq!(pick(64 << 10, 2, Links::Network), Ring);
    assert_eq!(pick(4096, 4, Links::Threads), Tree);
    assert_eq!(pick(256 << 10, 4, Links::Threads), Ring);
    assert_eq!(pick(4 << 20, 4, Links::Threads), Sra);
    // One rank: what the old rules gave it.
    assert_eq!(pick(4096, 1, Links::Arena), Ring);
    assert_eq!(pick(4096, 1, Links::Threads), Tree);
    let t = Tuning::default();
    for links in Links::ALL {
        assert_eq!(
            pick_in(&t, Workload::Sparse, 1 << 20, 4, links),
            Resolved::Flat(AllGather)
        );
        assert_eq!(
            pick_in(&t, Workload::Compressed, 4096, 2, links),
            Resolved::Flat(Sra)
        );
    }
}

/// The old dense rules, verbatim, to compare the table with over a grid.
fn old_rule(bytes: usize, size: usize, links: Links) -> Flat {
    if size == 2 && bytes < 64 * 1024 {
        return AllGather;
    }
    match links {
        Links::Arena if size > 2 || bytes >= 1 << 20 => Sra,
        Links::Arena => Ring,
        _ if size == 2 => Ring,
        Links::Sockets if bytes < 1 << 20 => Tree,
        Links::Network if bytes < 16 * 1024 => Tree,
        Links::Threads if bytes < 64 * 1024 => Tree,
        Links::Threads if bytes < 1 << 20 => Ring,
        _ if size <= 8 => Sra,
        _ => Ring,
    }
}

#[test]
fn the_table_is_the_old_rules_everywhere() {
    for links in Links::ALL {
        for size in 1..=20 {
            for shift in 0..30 {
                for bytes in [(1usize << shift) - 1, 1 << shift, (1 << shift) + 1] {
                    assert_eq!(
                        pick(bytes, size, links),
                        old_rule(bytes, size, links),
                        "{bytes} bytes, {size} ranks, {links:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn hier_where_the_hosts_have_two_levels() {
    let t = Tuning::default();
    let shape = |hosts: &Hosts, coll| {
        let s = CallShape {
            coll,
            bytes: 4096,
            ranks: hosts.per_host.iter().sum(),
            links: Links::Network,
            hosts,
        };
        (
            t.choose(&s, Algo::Auto),
            t.choose(&s, Algo::Hier),
            t.flat(&s),
        )
    };
    let two_by_two = Hosts::new(vec![2, 2], 2);
    for coll in Workload::ALL {
        let (auto, hier, flat) = shape(&two_by_two, coll);
        assert_eq!(auto.unwrap(), Resolved::Hier);
        assert_eq!(hier.unwrap(), Resolved::Hier);
        assert!(matches!(flat, Tree | AllGather | Sra), "{flat:?}");
    }
    // One rank per host: auto stays flat, hier is still allowed (uniform).
    let (auto, hier, _) = shape(&Hosts::new(vec![1, 1, 1], 1), Workload::AllReduce);
    assert_eq!(auto.unwrap(), Resolved::Flat(Tree));
    assert_eq!(hier.unwrap(), Resolved::Hier);
    // Uneven hosts: auto stays flat, hier is refused with the hosts' sizes.
    let (auto, hier, _) = shape(&Hosts::new(vec![2, 1], 2), Workload::AllReduce);
    assert_eq!(auto.unwrap(), Resolved::Flat(Tree));
    let e = hier.unwrap_err().to_string();
    assert!(e.contains("hosts have [2, 1]"), "{e}");
}

#[test]
fn explicit_requests_are_taken_as_asked() {
    let t = Tuning::default();
    let hosts = Hosts::new(vec![2, 2], 2);
    let s = CallShape {
        coll: Workload::AllReduce,
        bytes: 64 << 20,
        ranks: 4,
        links: Links::Arena,
        hosts: &hosts,
    };
    for (a, f) in [
        (Algo::Ring, Ring),
        (Algo::Tree, Tree),
        (Algo::Sra, Sra),
        (Algo::AllGather, AllGather),
    ] {
        assert_eq!(t.choose(&s, a).unwrap(), Resolved::Flat(f));
        assert_eq!(f.algo(), a);
    }
}

const FILE: &str = "# qccl tuning v1
# measured on the cluster
allreduce arena 4 64K tree   # small: the tree
allreduce arena 3-8 * ring
* network * * hier
sparse * 2- 1M sra
";

#[test]
fn file_rows_go_before_the_table() {
    let rows = parse(FILE, "test").unwrap();
    assert_eq!(rows.len(), 4);
    // Written back, each row reads the same.
    let again: String = std::iter::once(HEADER.to_string())
        .chain(rows.iter().map(Row::to_string))
        .collect::<Vec<_>>()
        .join("\n");
    assert_eq!(parse(&again, "test").unwrap(), rows);
    assert_eq!(rows[0].to_string(), "allreduce arena 4 64K tree");
    assert_eq!(rows[3].to_string(), "sparse * 2- 1M sra");
    let t = Tuning::with_rows(rows);
    let dense = |bytes, size, links| pick_in(&t, Workload::AllReduce, bytes, size, links);
    assert_eq!(dense(4096, 4, Links::Arena), Resolved::Flat(Tree));
    assert_eq!(dense(64 << 10, 4, Links::Arena), Resolved::Flat(Ring));
    assert_eq!(dense(64 << 10, 8, Links::Arena), Resolved::Flat(Ring));
    // Not covered by the file: the built-in table.
    assert_eq!(dense(4096, 9, Links::Arena), Resolved::Flat(Sra));
    assert_eq!(dense(4096, 2, Links::Arena), Resolved::Flat(AllGather));
    // A hier row on one host is passed over.
    assert_eq!(dense(4096, 4, Links::Network), Resolved::Flat(Tree));
    let sparse = |bytes, size| pick_in(&t, Workload::Sparse, bytes, size, Links::Threads);
    assert_eq!(sparse(4096, 4), Resolved::Flat(Sra));
    assert_eq!(sparse(1 << 20, 4), Resolved::Flat(AllGather));
    assert_eq!(sparse(4096, 1), Resolved::Flat(AllGather));
}

#[test]
fn bad_files_are_refused_by_line() {
    let bad = |text: &str, needle: &str| {
        let e = parse(text, "QCCL_TUNING_FILE=t.txt").unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        let e = e.to_string();
        assert!(e.contains("QCCL_TUNING_FILE=t.txt: line "), "{e}");
        assert!(e.contains(needle), "{needle}: {e}");
        assert_eq!(e.matches("invalid argument").count(), 1, "{e}");
    };
    bad(
        "",
        "line 1: the file must start with the line '# qccl tuning v1'",
    );
    bad("allreduce * * * ring\n", "line 1: the file must start");
    bad("# qccl tuning v2\n", "line 1: the file must start");
    let h = |rows: &str| format!("{HEADER}\n\n{rows}\n");
    bad(&h("allreduce * * ring"), "line 3: expected 5 fields");
    bad(&h("allreduce * * * ring tree"), "found 6");
    bad(
        &h("bcast * * * ring"),
        "line 3: collective 'bcast' is not one of",
    );
    bad(
        &h("allreduce shm * * ring"),
        "links 'shm' is not one of threads",
    );
    for r in ["0", "3-2", "x", "-4", "2-x", "1--2"] {
        bad(
            &h(&format!("allreduce * {r} * ring")),
            &format!("ranks '{r}'"),
        );
    }
    for b in ["0", "1X", "-1", "huge"] {
        bad(
            &h(&format!("allreduce * * {b} ring")),
            &format!("max_bytes '{b}'"),
        );
    }
    bad(&h("allreduce * * * bogus"), "unknown algorithm 'bogus'");
    bad(&h("allreduce * * * auto"), "a row must choose one of");
    // Comments and blank lines anywhere after the header; a header alone is no rows.
    assert!(parse(&h("# nothing yet"), "t").unwrap().is_empty());
}

#[test]
fn load_names_a_missing_file() {
    let e = Tuning::load(Some(Path::new("/nonexistent/qccl-tuning.txt")))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("QCCL_TUNING_FILE=/nonexistent/qccl-tuning.txt"),
        "{e}"
    );
    assert!(Tuning::load(None).unwrap().rows().is_empty());
}
