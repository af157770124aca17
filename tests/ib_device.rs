//! The real verbs device (`--features rdma`) on an RDMA NIC: the verbs contract in loopback
//! (two contexts and queue pairs on one port) and the collective suite over the RDMA link.
//!
//! These need a device (RoCE, InfiniBand, or soft-RoCE: `rdma link add rxe0 type rxe netdev
//! eth0`), so they are ignored by default. Run them with
//! `QCCL_REQUIRE_RDMA=1 cargo test --features rdma --test ib_device -- --ignored`.
//! Without a device each test skips with a message, unless QCCL_REQUIRE_RDMA=1 makes that a
//! failure. QCCL_IB_HCA=name picks the device (default: the first with an active port);
//! QCCL_IB_GID_INDEX the GID index on RoCE (default 0).
#![cfg(feature = "rdma")]

mod common;

use common::job::{text, Job, CHILD};
use common::suite::{cases, run_all};
use qccl::internal::verbs::{
    Completion, CompletionQueue, Context, Fabric, PathSettings, QpCaps, QpState, QueuePair, Region,
    RemoteAddr, Sge, WcOpcode, WcStatus,
};
use qccl::internal::VerbsFabric;
use qccl::Comm;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// (device, port) to test on, or None (skip) when the host has none.
fn device() -> Option<(String, u8)> {
    let fabric = VerbsFabric::new().expect("VerbsFabric::new");
    let devices = fabric.devices().expect("listing RDMA devices");
    let want = std::env::var("QCCL_IB_HCA").ok();
    let found = devices
        .iter()
        .filter(|d| want.as_deref().is_none_or(|w| d.name == w))
        .find_map(|d| {
            d.ports
                .iter()
                .find(|p| p.active)
                .map(|p| (d.name.clone(), p.num))
        });
    if found.is_none() {
        let msg = format!(
            "no RDMA device with an active port (devices: {devices:?}, QCCL_IB_HCA={want:?})"
        );
        if std::env::var("QCCL_REQUIRE_RDMA").is_ok_and(|v| v == "1") {
            panic!("QCCL_REQUIRE_RDMA=1: {msg}");
        }
        eprintln!("skipped: {msg}");
    }
    found
}

fn gid_index() -> u8 {
    std::env::var("QCCL_IB_GID_INDEX")
        .ok()
        .map(|v| v.parse().expect("QCCL_IB_GID_INDEX is a number"))
        .unwrap_or(0)
}

/// One side of a loopback connection.
struct Side {
    ctx: Arc<dyn Context>,
    cq: Arc<dyn CompletionQueue>,
    qp: Box<dyn QueuePair>,
    region: Box<dyn Region>,
}

const REGION: usize = 1 << 20;

fn side(name: &str, port: u8) -> Side {
    let fabric = VerbsFabric::new().unwrap();
    let ctx = fabric.open(name, port).expect("opening the device");
    let cq = ctx.create_cq(256).expect("create_cq");
    let qp = ctx
        .create_qp(
            &cq,
            &cq,
            QpCaps {
                max_send_wr: 64,
                max_recv_wr: 64,
            },
        )
        .expect("create_qp");
    let region = ctx.alloc(REGION).expect("alloc");
    assert_eq!(region.ptr() as usize % 4096, 0, "alloc is page-aligned");
    Side {
        ctx,
        cq,
        qp,
        region,
    }
}

/// Two queue pairs on `name:port`, connected to each other and in RTS.
fn pair(name: &str, port: u8) -> (Side, Side) {
    let (mut a, mut b) = (side(name, port), side(name, port));
    assert_eq!(a.qp.state(), QpState::Reset);
    let path = PathSettings {
        gid_index: gid_index(),
        // Fail fast in the tests that provoke errors (4.096 us * 2^14 = 67 ms per try).
        timeout: 14,
        retry_cnt: 2,
        ..PathSettings::default()
    };
    let (pa, pb) = (0x1234, 0x5678);
    a.qp.to_init().unwrap();
    b.qp.to_init().unwrap();
    let ea = a.qp.endpoint(pa, path.gid_index).unwrap();
    let eb = b.qp.endpoint(pb, path.gid_index).unwrap();
    a.qp.to_rtr(&eb, &path).unwrap();
    b.qp.to_rtr(&ea, &path).unwrap();
    a.qp.to_rts(pa, &path).unwrap();
    b.qp.to_rts(pb, &path).unwrap();
    assert_eq!(a.qp.state(), QpState::Rts);
    assert_eq!(b.qp.state(), QpState::Rts);
    (a, b)
}

/// Polls `cq` until `n` completions arrived (at most 10 s).
fn completions(cq: &Arc<dyn CompletionQueue>, n: usize) -> Vec<Completion> {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while out.len() < n {
        let left = n - out.len();
        if cq.poll(&mut out, left).unwrap() == 0 {
            assert!(
                Instant::now() < deadline,
                "only {} of {n} completions: {out:?}",
                out.len()
            );
            cq.wait(Duration::from_millis(50));
        }
    }
    out
}

fn fill(r: &dyn Region, off: usize, len: usize, seed: u8) {
    for i in 0..len {
        // SAFETY: off + len is inside the region.
        unsafe {
            r.ptr()
                .add(off + i)
                .write_volatile(seed.wrapping_add(i as u8))
        };
    }
}

fn holds(r: &dyn Region, off: usize, len: usize, seed: u8) -> bool {
    // SAFETY: off + len is inside the region.
    (0..len).all(|i| unsafe { r.ptr().add(off + i).read_volatile() } == seed.wrapping_add(i as u8))
}

fn sge(r: &dyn Region, off: usize, len: usize) -> Sge {
    Sge {
        addr: r.addr() + off as u64,
        len: len as u32,
        lkey: r.lkey(),
    }
}

fn remote(r: &dyn Region, off: usize) -> RemoteAddr {
    RemoteAddr {
        addr: r.addr() + off as u64,
        rkey: r.rkey(),
    }
}

#[test]
#[ignore = "needs an RDMA device (RoCE/IB or soft-RoCE rxe)"]
fn write_with_immediate_lands_and_reports_its_value() {
    let Some((name, port)) = device() else { return };
    let (mut a, mut b) = pair(&name, port);
    assert!(a.ctx.name().starts_with(&name));
    let len = 64 * 1024 + 3;
    fill(&*a.region, 0, len, 7);
    b.qp.post_recv(99).unwrap();
    let imm = 0xdead_beef;
    a.qp.post_write(
        1,
        sge(&*a.region, 0, len),
        remote(&*b.region, 4096),
        Some(imm),
        true,
    )
    .unwrap();
    let sent = completions(&a.cq, 1);
    assert_eq!(sent[0].status, WcStatus::Success, "{sent:?}");
    assert_eq!((sent[0].wr_id, sent[0].opcode), (1, WcOpcode::Write));
    assert_eq!(sent[0].qpn, a.qp.qpn());
    let got = completions(&b.cq, 1);
    assert_eq!(got[0].status, WcStatus::Success, "{got:?}");
    assert_eq!(got[0].opcode, WcOpcode::RecvWriteImm);
    assert_eq!(
        (got[0].wr_id, got[0].imm),
        (99, imm),
        "immediate in host order"
    );
    assert_eq!(got[0].byte_len as usize, len);
    assert_eq!(got[0].qpn, b.qp.qpn());
    assert!(holds(&*b.region, 4096, len, 7), "the bytes arrived");
}

#[test]
#[ignore = "needs an RDMA device (RoCE/IB or soft-RoCE rxe)"]
fn writes_complete_in_order_and_data_precedes_its_immediate() {
    let Some((name, port)) = device() else { return };
    let (mut a, mut b) = pair(&name, port);
    let (n, slot) = (32usize, 16 * 1024);
    for i in 0..n {
        b.qp.post_recv(i as u64).unwrap();
    }
    for i in 0..n {
        fill(&*a.region, i * slot, slot, i as u8);
        // The data as a plain unsignaled write, then an immediate alone: the data must be
        // visible when the immediate's receive completes.
        a.qp.post_write(
            1000 + i as u64,
            sge(&*a.region, i * slot, slot),
            remote(&*b.region, i * slot),
            None,
            false,
        )
        .unwrap();
        a.qp.post_write(
            i as u64,
            sge(&*a.region, 0, 0),
            remote(&*b.region, 0),
            Some(i as u32),
            i + 1 == n,
        )
        .unwrap();
    }
    let got = completions(&b.cq, n);
    for (i, c) in got.iter().enumerate() {
        assert_eq!(c.status, WcStatus::Success, "{c:?}");
        assert_eq!((c.wr_id, c.imm), (i as u64, i as u32), "in order");
        assert_eq!(c.byte_len, 0);
        assert!(
            holds(&*b.region, i * slot, slot, i as u8),
            "slot {i} before imm {i}"
        );
    }
    let sent = completions(&a.cq, 1);
    assert_eq!(
        (sent[0].wr_id, sent[0].status),
        ((n - 1) as u64, WcStatus::Success)
    );
    let mut more = Vec::new();
    assert_eq!(a.cq.poll(&mut more, 8).unwrap(), 0, "unsignaled: {more:?}");
}

#[test]
#[ignore = "needs an RDMA device (RoCE/IB or soft-RoCE rxe)"]
fn a_bad_rkey_fails_with_remote_access_and_errors_the_queue_pair() {
    let Some((name, port)) = device() else { return };
    let (mut a, b) = pair(&name, port);
    let bad = RemoteAddr {
        addr: b.region.addr(),
        rkey: b.region.rkey() ^ 0x00ff_ff00,
    };
    a.qp.post_write(5, sge(&*a.region, 0, 4096), bad, None, true)
        .unwrap();
    let got = completions(&a.cq, 1);
    assert_eq!(
        (got[0].wr_id, got[0].status),
        (5, WcStatus::RemoteAccess),
        "{got:?}"
    );
    assert_eq!(a.qp.state(), QpState::Error);
    // Later work is flushed (posting may also be refused outright in the error state).
    if a.qp
        .post_write(6, sge(&*a.region, 0, 8), remote(&*b.region, 0), None, true)
        .is_ok()
    {
        let got = completions(&a.cq, 1);
        assert_eq!(
            (got[0].wr_id, got[0].status),
            (6, WcStatus::WrFlush),
            "{got:?}"
        );
    }
}

#[test]
#[ignore = "needs an RDMA device (RoCE/IB or soft-RoCE rxe)"]
fn to_error_flushes_posted_receives() {
    let Some((name, port)) = device() else { return };
    let (_a, mut b) = pair(&name, port);
    b.qp.post_recv(41).unwrap();
    b.qp.post_recv(42).unwrap();
    b.qp.to_error().unwrap();
    assert_eq!(b.qp.state(), QpState::Error);
    let got = completions(&b.cq, 2);
    assert!(got.iter().all(|c| c.status == WcStatus::WrFlush), "{got:?}");
    let ids: Vec<u64> = got.iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, [41, 42]);
    // Regions may go before their queue pairs (the contract's last rule).
    let Side { region, qp, .. } = b;
    drop(region);
    drop(qp);
}

/// A rank of the collective suite: the test binary re-executes itself (tests/common/job.rs).
#[test]
fn child() {
    let Ok(scenario) = std::env::var(CHILD) else {
        return;
    };
    let run = || -> Result<(), String> {
        let comm = Comm::from_env().map_err(|e| e.to_string())?;
        match scenario.as_str() {
            "suite" => run_all(&comm, &cases(true)),
            other => Err(format!("unknown scenario {other}")),
        }
    };
    common::job::exit_with(run(), 0, 3);
}

/// The collective suite with every peer pair on the RDMA link (QCCL_NET=IB, shared memory
/// off), `n` processes on this host.
fn suite_over_ib(n: usize) {
    let Some((name, port)) = device() else { return };
    let hca = format!("={name}:{port}");
    let gid = gid_index().to_string();
    let env = [
        ("QCCL_NET", "IB"),
        ("QCCL_SHM_DISABLE", "1"),
        ("QCCL_IB_HCA", hca.as_str()),
        ("QCCL_IB_GID_INDEX", gid.as_str()),
        ("QCCL_DEBUG", "INFO"),
    ];
    let outs = Job::new(n).run("suite", &env, Duration::from_secs(600));
    for (r, o) in outs.iter().enumerate() {
        assert_eq!(o.status.code(), Some(0), "rank {r} of {n}:\n{}", text(o));
        // Every peer connection went over RDMA: the connection lines name the device and
        // none fell back to TCP.
        let log = String::from_utf8_lossy(&o.stderr);
        let connected: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("connected to rank"))
            .collect();
        assert!(!connected.is_empty(), "{log}");
        assert!(connected.iter().all(|l| !l.contains(" over tcp")), "{log}");
        assert!(log.contains(&name), "the INFO lines name {name}:\n{log}");
    }
}

#[test]
#[ignore = "needs an RDMA device (RoCE/IB or soft-RoCE rxe)"]
fn suite_2_processes_ib() {
    suite_over_ib(2);
}

#[test]
#[ignore = "needs an RDMA device (RoCE/IB or soft-RoCE rxe)"]
fn suite_3_processes_ib() {
    suite_over_ib(3);
}

/// Runs in CI (no device): the fabric lists none and `open` names the way out.
#[test]
fn without_a_device_open_says_no_rdma_device() {
    let fabric = VerbsFabric::new().unwrap();
    if !fabric.devices().unwrap().is_empty() {
        eprintln!("skipped: this host has an RDMA device");
        return;
    }
    let err = match fabric.open("mlx5_0", 1) {
        Ok(_) => panic!("opened mlx5_0 on a host with no device"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("no RDMA device"), "{err}");
    assert!(
        err.contains("QCCL_IB_HCA") && err.contains("QCCL_IB_EMULATE=1"),
        "{err}"
    );
}
