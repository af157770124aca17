//! Two emulated contexts in one process, talking over loopback.

use super::fault::{Fault, FaultKind};
use super::EmuFabric;
use crate::error::Error;
use crate::transport::ib::verbs::{
    Completion, CompletionQueue, Context, Fabric, PathSettings, QpCaps, QpState, QueuePair, Region,
    RemoteAddr, Sge, WcOpcode, WcStatus,
};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SECRET: [u8; 16] = *b"emulated-fabric!";
const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const REGION: usize = 1 << 20;
/// Longest any expected completion may take.
const PATIENCE: Duration = Duration::from_secs(3);

/// One side of a connected pair.
struct Side {
    qp: Box<dyn QueuePair>,
    region: Box<dyn Region>,
    scq: Arc<dyn CompletionQueue>,
    rcq: Arc<dyn CompletionQueue>,
    // Dropped last: fields drop in declaration order.
    ctx: Arc<dyn Context>,
}

impl Side {
    fn open(fabric: &EmuFabric, caps: QpCaps) -> Side {
        let ctx = fabric.open("emu0", 1).unwrap();
        let scq = ctx.create_cq(1024).unwrap();
        let rcq = ctx.create_cq(1024).unwrap();
        let qp = ctx.create_qp(&scq, &rcq, caps).unwrap();
        let region = ctx.alloc(REGION).unwrap();
        Side {
            qp,
            region,
            scq,
            rcq,
            ctx,
        }
    }

    fn sge(&self, off: usize, len: usize) -> Sge {
        Sge {
            addr: self.region.addr() + off as u64,
            len: len as u32,
            lkey: self.region.lkey(),
        }
    }

    fn at(&self, off: usize) -> RemoteAddr {
        RemoteAddr {
            addr: self.region.addr() + off as u64,
            rkey: self.region.rkey(),
        }
    }

    fn fill(&self, off: usize, bytes: &[u8]) {
        assert!(off + bytes.len() <= self.region.len());
        // SAFETY: inside the region, which no write targets while the test fills it.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.region.ptr().add(off), bytes.len())
        };
    }

    fn bytes(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off + len <= self.region.len());
        // SAFETY: inside the region; read as a copy, after the completion that placed it.
        unsafe { std::slice::from_raw_parts(self.region.ptr().add(off), len) }.to_vec()
    }
}

fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 256,
        max_recv_wr: 256,
    }
}

fn connect(a: &mut Side, b: &mut Side, path: &PathSettings) {
    let (ea, eb) = (
        a.qp.endpoint(100, 0).unwrap(),
        b.qp.endpoint(200, 0).unwrap(),
    );
    for s in [&mut *a, &mut *b] {
        s.qp.to_init().unwrap();
    }
    a.qp.to_rtr(&eb, path).unwrap();
    b.qp.to_rtr(&ea, path).unwrap();
    a.qp.to_rts(100, path).unwrap();
    b.qp.to_rts(200, path).unwrap();
}

fn pair_with(fa: &EmuFabric, fb: &EmuFabric, path: &PathSettings) -> (Side, Side) {
    let (mut a, mut b) = (Side::open(fa, caps()), Side::open(fb, caps()));
    connect(&mut a, &mut b, path);
    (a, b)
}

fn pair() -> (Side, Side) {
    let f = EmuFabric::new(SECRET, LOOPBACK);
    pair_with(&f, &f, &PathSettings::default())
}

/// The next completion on `cq`; fails the test after [`PATIENCE`].
fn next(cq: &Arc<dyn CompletionQueue>) -> Completion {
    let deadline = Instant::now() + PATIENCE;
    let mut out = Vec::new();
    while Instant::now() < deadline {
        if cq.poll(&mut out, 1).unwrap() == 1 {
            return out[0];
        }
        cq.wait(Duration::from_millis(20));
    }
    panic!("no completion within {PATIENCE:?}");
}

/// Asserts nothing completes on `cq` for `d`.
fn quiet(cq: &Arc<dyn CompletionQueue>, d: Duration) {
    std::thread::sleep(d);
    let mut out = Vec::new();
    assert_eq!(cq.poll(&mut out, 16).unwrap(), 0, "unexpected {out:?}");
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn write_without_immediate_places_bytes_then_completes() {
    let (a, b) = pair();
    let data = pattern(64 << 10, 1);
    a.fill(0, &data);
    let mut a = a;
    a.qp.post_write(11, a.sge(0, data.len()), b.at(4096), None, true)
        .unwrap();
    let c = next(&a.scq);
    assert_eq!(
        (c.wr_id, c.status, c.opcode, c.qpn),
        (11, WcStatus::Success, WcOpcode::Write, a.qp.qpn())
    );
    assert_eq!(b.bytes(4096, data.len()), data);
    quiet(&b.rcq, Duration::from_millis(20));
}

#[test]
fn write_with_immediate_consumes_one_receive() {
    let (mut a, mut b) = pair();
    b.qp.post_recv(70).unwrap();
    b.qp.post_recv(71).unwrap();
    let data = pattern(1000, 2);
    a.fill(0, &data);
    a.qp.post_write(1, a.sge(0, 1000), b.at(10), Some(0xabcd), false)
        .unwrap();
    let c = next(&b.rcq);
    assert_eq!(
        (c.wr_id, c.status, c.opcode, c.byte_len, c.imm, c.qpn),
        (
            70,
            WcStatus::Success,
            WcOpcode::RecvWriteImm,
            1000,
            0xabcd,
            b.qp.qpn()
        )
    );
    assert_eq!(b.bytes(10, 1000), data);
    // Unsignaled: no send completion; the second receive is still posted.
    quiet(&a.scq, Duration::from_millis(20));
    a.qp.post_write(2, a.sge(0, 0), b.at(0), Some(5), true)
        .unwrap();
    assert_eq!(next(&b.rcq).wr_id, 71);
    assert_eq!(next(&a.scq).status, WcStatus::Success);
}

#[test]
fn many_writes_arrive_in_order_with_their_bytes() {
    let (mut a, mut b) = pair();
    const N: usize = 200;
    const LEN: usize = 4096;
    for i in 0..N {
        b.qp.post_recv(1000 + i as u64).unwrap();
        a.fill(i * LEN, &pattern(LEN, i as u8));
    }
    for i in 0..N {
        let last = i == N - 1;
        a.qp.post_write(
            i as u64,
            a.sge(i * LEN, LEN),
            b.at(i * LEN),
            Some(i as u32),
            last,
        )
        .unwrap();
    }
    for i in 0..N {
        let c = next(&b.rcq);
        assert_eq!(
            (c.wr_id, c.imm, c.byte_len),
            (1000 + i as u64, i as u32, LEN as u32)
        );
        // The bytes of this write (and all before) are there at its completion.
        assert_eq!(b.bytes(i * LEN, LEN), pattern(LEN, i as u8), "write {i}");
    }
    let c = next(&a.scq);
    assert_eq!((c.wr_id, c.status), (N as u64 - 1, WcStatus::Success));
}

#[test]
fn both_directions_at_once() {
    let (mut a, mut b) = pair();
    a.fill(0, &pattern(512, 3));
    b.fill(0, &pattern(512, 4));
    a.qp.post_recv(1).unwrap();
    b.qp.post_recv(2).unwrap();
    a.qp.post_write(10, a.sge(0, 512), b.at(1024), Some(1), true)
        .unwrap();
    b.qp.post_write(20, b.sge(0, 512), a.at(1024), Some(2), true)
        .unwrap();
    assert_eq!(next(&a.rcq).wr_id, 1);
    assert_eq!(next(&b.rcq).wr_id, 2);
    assert_eq!(next(&a.scq).wr_id, 10);
    assert_eq!(next(&b.scq).wr_id, 20);
    assert_eq!(b.bytes(1024, 512), pattern(512, 3));
    assert_eq!(a.bytes(1024, 512), pattern(512, 4));
}

#[test]
fn no_receive_fails_after_rnr_retries() {
    let f = EmuFabric::new(SECRET, LOOPBACK);
    let path = PathSettings {
        rnr_retry: 2,
        ..PathSettings::default()
    };
    let (mut a, b) = pair_with(&f, &f, &path);
    let t = Instant::now();
    a.qp.post_write(5, a.sge(0, 8), b.at(0), Some(1), false)
        .unwrap();
    a.qp.post_write(6, a.sge(0, 8), b.at(0), None, true)
        .unwrap();
    let c = next(&a.scq);
    assert_eq!((c.wr_id, c.status), (5, WcStatus::RnrRetryExceeded));
    assert_eq!(next(&a.scq).status, WcStatus::WrFlush);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert_eq!(a.qp.state(), QpState::Error);
    // The responder's queue pair is unaffected, as on a NIC; nothing was placed.
    assert_eq!(b.qp.state(), QpState::Rts);
    assert_eq!(b.bytes(0, 8), vec![0; 8]);
}

#[test]
fn a_receive_posted_during_rnr_waits_is_used() {
    let (mut a, mut b) = pair();
    a.fill(0, b"late");
    a.qp.post_write(1, a.sge(0, 4), b.at(0), Some(9), true)
        .unwrap();
    quiet(&a.scq, Duration::from_millis(100));
    b.qp.post_recv(3).unwrap();
    assert_eq!(next(&b.rcq).imm, 9);
    assert_eq!(next(&a.scq).status, WcStatus::Success);
    assert_eq!(b.bytes(0, 4), b"late");
}

#[test]
fn bad_rkey_fails_with_remote_access_and_flushes_the_rest() {
    let (mut a, mut b) = pair();
    b.qp.post_recv(40).unwrap();
    let bad = RemoteAddr {
        rkey: b.region.rkey() ^ 0x5a5a,
        ..b.at(0)
    };
    a.qp.post_write(1, a.sge(0, 64), b.at(0), None, false)
        .unwrap();
    a.qp.post_write(2, a.sge(0, 64), bad, None, false).unwrap();
    a.qp.post_write(3, a.sge(0, 64), b.at(0), None, true)
        .unwrap();
    let c = next(&a.scq);
    assert_eq!((c.wr_id, c.status), (2, WcStatus::RemoteAccess));
    let c = next(&a.scq);
    assert_eq!((c.wr_id, c.status), (3, WcStatus::WrFlush));
    assert_eq!(a.qp.state(), QpState::Error);
    // Both sides in the error state: the responder's receive is flushed.
    let c = next(&b.rcq);
    assert_eq!((c.wr_id, c.status), (40, WcStatus::WrFlush));
    assert_eq!(b.qp.state(), QpState::Error);
}

#[test]
fn out_of_bounds_fails_with_remote_access() {
    let (mut a, b) = pair();
    let past_end = b.at(REGION - 8);
    a.qp.post_write(1, a.sge(0, 16), past_end, None, true)
        .unwrap();
    assert_eq!(next(&a.scq).status, WcStatus::RemoteAccess);
    assert_eq!(b.bytes(REGION - 8, 8), vec![0; 8]);
}

/// Registered user memory is a write source: its bytes go out, once deregistered a write
/// from it is a local protection error, and no peer may write it.
#[test]
fn registered_memory_is_a_source_only() {
    let (mut a, b) = pair();
    let mut mine = pattern(8192, 9);
    // SAFETY: `mine` outlives the regions (dropped before it) and every write posted from
    // them (each completes below).
    let reg = unsafe { a.ctx.register(mine.as_mut_ptr(), mine.len()) }.unwrap();
    let from = |reg: &dyn Region, off: u64, len: u32| Sge {
        addr: reg.addr() + off,
        len,
        lkey: reg.lkey(),
    };
    a.qp.post_write(1, from(&*reg, 100, 4000), b.at(8), None, true)
        .unwrap();
    assert_eq!(next(&a.scq).status, WcStatus::Success);
    assert_eq!(b.bytes(8, 4000), mine[100..4100].to_vec());
    // SAFETY: as above.
    let again = unsafe { a.ctx.register(mine.as_mut_ptr(), mine.len()) }.unwrap();
    let stale = from(&*reg, 0, 16);
    drop(reg);
    a.qp.post_write(2, stale, b.at(8), None, true).unwrap();
    assert_eq!(next(&a.scq).status, WcStatus::LocalProtection);
    drop(again);
    // No peer can write it with its key (a fresh pair: this one is in the error state now).
    let (mut c, d) = pair();
    // SAFETY: as above.
    let theirs = unsafe { d.ctx.register(mine.as_mut_ptr(), mine.len()) }.unwrap();
    let target = RemoteAddr {
        addr: theirs.addr(),
        rkey: theirs.rkey(),
    };
    c.qp.post_write(3, c.sge(0, 16), target, None, true)
        .unwrap();
    assert_eq!(next(&c.scq).status, WcStatus::RemoteAccess);
    drop(theirs);
    assert_eq!(mine, pattern(8192, 9));
}

#[test]
fn deregistered_region_is_a_remote_access_error() {
    let (mut a, mut b) = pair();
    let gone = b.at(0);
    let replacement = b.ctx.alloc(4096).unwrap();
    b.region = replacement;
    a.qp.post_write(1, a.sge(0, 16), gone, None, true).unwrap();
    assert_eq!(next(&a.scq).status, WcStatus::RemoteAccess);
}

#[test]
fn local_key_and_length_are_checked() {
    let (mut a, b) = pair();
    let bad_key = Sge {
        lkey: a.region.lkey() ^ 0x77,
        ..a.sge(0, 8)
    };
    a.qp.post_write(1, bad_key, b.at(0), None, false).unwrap();
    let c = next(&a.scq);
    assert_eq!((c.wr_id, c.status), (1, WcStatus::LocalProtection));
    assert_eq!(a.qp.state(), QpState::Error);

    let (mut a, b) = pair();
    a.qp.post_write(2, a.sge(REGION - 4, 8), b.at(0), None, false)
        .unwrap();
    let c = next(&a.scq);
    assert_eq!((c.wr_id, c.status), (2, WcStatus::LocalLength));
}

#[test]
fn wrong_transitions_and_posts_are_errors_naming_states() {
    let f = EmuFabric::new(SECRET, LOOPBACK);
    let mut a = Side::open(&f, caps());
    let b = Side::open(&f, caps());
    let eb = b.qp.endpoint(0, 0).unwrap();
    let path = PathSettings::default();
    let e = a.qp.to_rtr(&eb, &path).unwrap_err();
    assert!(
        matches!(&e, Error::InvalidUsage(m) if m.contains("Reset") && m.contains("Rtr")),
        "{e}"
    );
    assert!(a.qp.post_recv(1).is_err());
    a.qp.to_init().unwrap();
    assert!(a.qp.to_init().is_err());
    assert!(a.qp.to_rts(0, &path).is_err());
    let e =
        a.qp.post_write(1, a.sge(0, 1), b.at(0), None, true)
            .unwrap_err();
    assert!(e.to_string().contains("Init"), "{e}");
    a.qp.post_recv(1).unwrap();
    assert_eq!(a.qp.state(), QpState::Init);
    assert!(a.ctx.gid(1).is_err());
}

#[test]
fn posts_on_an_errored_queue_pair_flush() {
    let (mut a, b) = pair();
    a.qp.post_recv(8).unwrap();
    a.qp.to_error().unwrap();
    assert_eq!(next(&a.rcq).status, WcStatus::WrFlush);
    a.qp.post_write(9, a.sge(0, 8), b.at(0), None, false)
        .unwrap();
    let c = next(&a.scq);
    assert_eq!((c.wr_id, c.status), (9, WcStatus::WrFlush));
    a.qp.post_recv(10).unwrap();
    let c = next(&a.rcq);
    assert_eq!((c.wr_id, c.status), (10, WcStatus::WrFlush));
}

#[test]
fn a_write_to_an_errored_peer_fails() {
    let (mut a, mut b) = pair();
    b.qp.to_error().unwrap();
    a.qp.post_write(1, a.sge(0, 8), b.at(0), None, true)
        .unwrap();
    assert_eq!(next(&a.scq).status, WcStatus::RetryExceeded);
}

#[test]
fn send_queue_full_is_an_immediate_error() {
    let f = EmuFabric::new(SECRET, LOOPBACK);
    let small = QpCaps {
        max_send_wr: 2,
        max_recv_wr: 1,
    };
    let (mut a, mut b) = (Side::open(&f, small), Side::open(&f, small));
    connect(&mut a, &mut b, &PathSettings::default());
    // Writes with immediate and no receive stay outstanding (RNR, forever).
    for id in 0..2 {
        a.qp.post_write(id, a.sge(0, 8), b.at(0), Some(0), true)
            .unwrap();
    }
    assert!(a
        .qp
        .post_write(2, a.sge(0, 8), b.at(0), Some(0), true)
        .is_err());
    // Nothing consumes a's receives.
    a.qp.post_recv(0).unwrap();
    assert!(a.qp.post_recv(1).is_err());
}

#[test]
fn peer_context_dropped_fails_outstanding_writes_soon() {
    let (mut a, b) = pair();
    // Outstanding: waiting for a receive that never comes.
    a.qp.post_write(1, a.sge(0, 8), b.at(0), Some(0), true)
        .unwrap();
    a.qp.post_write(2, a.sge(0, 8), b.at(0), None, true)
        .unwrap();
    std::thread::sleep(Duration::from_millis(30));
    let t = Instant::now();
    drop(b);
    let c = next(&a.scq);
    assert_eq!((c.wr_id, c.status), (1, WcStatus::RetryExceeded));
    assert_eq!(next(&a.scq).status, WcStatus::WrFlush);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    // The next post flushes.
    a.qp.post_write(3, a.sge(0, 8), a.at(0), None, true)
        .unwrap();
    assert_eq!(next(&a.scq).status, WcStatus::WrFlush);
}

#[test]
fn peer_gone_while_idle_fails_the_next_write() {
    let (mut a, b) = pair();
    let target = b.at(0);
    drop(b);
    std::thread::sleep(Duration::from_millis(50));
    a.qp.post_write(1, a.sge(0, 8), target, None, false)
        .unwrap();
    assert_eq!(next(&a.scq).status, WcStatus::RetryExceeded);
}

#[test]
fn wrong_secret_is_refused() {
    let fa = EmuFabric::new(SECRET, LOOPBACK);
    let fb = EmuFabric::new(*b"another-job-key!", LOOPBACK);
    let (mut a, mut b) = (Side::open(&fa, caps()), Side::open(&fb, caps()));
    let eb = b.qp.endpoint(0, 0).unwrap();
    a.qp.to_init().unwrap();
    b.qp.to_init().unwrap();
    a.qp.to_rtr(&eb, &PathSettings::default()).unwrap();
    let e = a.qp.to_rts(0, &PathSettings::default()).unwrap_err();
    assert!(e.to_string().contains("refused"), "{e}");
    assert_eq!(a.qp.state(), QpState::Rtr);
}

#[test]
fn unknown_queue_pair_is_refused() {
    let f = EmuFabric::new(SECRET, LOOPBACK);
    let (mut a, b) = (Side::open(&f, caps()), Side::open(&f, caps()));
    let mut eb = b.qp.endpoint(0, 0).unwrap();
    eb.qpn ^= 0x40_0000;
    a.qp.to_init().unwrap();
    a.qp.to_rtr(&eb, &PathSettings::default()).unwrap();
    let e = a.qp.to_rts(0, &PathSettings::default()).unwrap_err();
    assert!(e.to_string().contains("no queue pair"), "{e}");
}

#[test]
fn early_writes_wait_for_the_peer_to_reach_rtr() {
    let f = EmuFabric::new(SECRET, LOOPBACK);
    let (mut a, mut b) = (Side::open(&f, caps()), Side::open(&f, caps()));
    let (ea, eb) = (a.qp.endpoint(1, 0).unwrap(), b.qp.endpoint(2, 0).unwrap());
    let path = PathSettings::default();
    a.qp.to_init().unwrap();
    b.qp.to_init().unwrap();
    a.qp.to_rtr(&eb, &path).unwrap();
    a.qp.to_rts(1, &path).unwrap();
    a.fill(0, b"early");
    a.qp.post_write(1, a.sge(0, 5), b.at(0), None, true)
        .unwrap();
    quiet(&a.scq, Duration::from_millis(50));
    b.qp.to_rtr(&ea, &path).unwrap();
    assert_eq!(next(&a.scq).status, WcStatus::Success);
    assert_eq!(b.bytes(0, 5), b"early");
}

#[test]
fn psn_out_of_sequence_is_dropped() {
    let f = EmuFabric::new(SECRET, LOOPBACK);
    let (mut a, mut b) = (Side::open(&f, caps()), Side::open(&f, caps()));
    let (ea, eb) = (a.qp.endpoint(1, 0).unwrap(), b.qp.endpoint(2, 0).unwrap());
    let path = PathSettings::default();
    a.qp.to_init().unwrap();
    b.qp.to_init().unwrap();
    a.qp.to_rtr(&eb, &path).unwrap();
    b.qp.to_rtr(&ea, &path).unwrap();
    // Told the peer it starts at 1, starts at 5.
    a.qp.to_rts(5, &path).unwrap();
    a.qp.post_write(1, a.sge(0, 5), b.at(0), None, true)
        .unwrap();
    assert_eq!(next(&a.scq).status, WcStatus::RetryExceeded);
}

#[test]
fn completion_queue_overrun_is_reported() {
    let f = EmuFabric::new(SECRET, LOOPBACK);
    let ctx = f.open("emu0", 1).unwrap();
    let cq = ctx.create_cq(2).unwrap();
    let mut qp = ctx.create_qp(&cq, &cq, caps()).unwrap();
    qp.to_init().unwrap();
    for id in 0..3 {
        qp.post_recv(id).unwrap();
    }
    qp.to_error().unwrap();
    let e = cq.poll(&mut Vec::new(), 8).unwrap_err();
    assert!(e.to_string().contains("overrun"), "{e}");
    let other = EmuFabric::new(SECRET, LOOPBACK).open("emu0", 1).unwrap();
    let foreign = other.create_cq(4).unwrap();
    assert!(ctx.create_qp(&foreign, &cq, caps()).is_err());
}

#[test]
fn devices_and_endpoints() {
    let f = EmuFabric::new(SECRET, LOOPBACK);
    let d = f.devices().unwrap();
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].name, "emu0");
    assert!(d[0].ports[0].active);
    assert!(f.open("mlx5_0", 1).is_err());
    assert!(f.open("emu0", 2).is_err());
    let ctx = f.open("emu0", 1).unwrap();
    assert_eq!(ctx.name(), "emu0:1");
    let gid = ctx.gid(0).unwrap();
    assert_eq!(&gid[..12], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);
    assert_eq!(&gid[12..], &[127, 0, 0, 1]);
    assert_ne!(ctx.lid(), 0);
}

#[test]
fn big_write_is_quick() {
    let f = EmuFabric::new(SECRET, LOOPBACK);
    let (mut a, mut b) = (Side::open(&f, caps()), Side::open(&f, caps()));
    let big_a = a.ctx.alloc(4 << 20).unwrap();
    let big_b = b.ctx.alloc(4 << 20).unwrap();
    connect(&mut a, &mut b, &PathSettings::default());
    let sge = Sge {
        addr: big_a.addr(),
        len: 4 << 20,
        lkey: big_a.lkey(),
    };
    let to = RemoteAddr {
        addr: big_b.addr(),
        rkey: big_b.rkey(),
    };
    // Warm up, then time one.
    a.qp.post_write(0, sge, to, None, true).unwrap();
    next(&a.scq);
    let t = Instant::now();
    a.qp.post_write(1, sge, to, None, true).unwrap();
    assert_eq!(next(&a.scq).status, WcStatus::Success);
    let took = t.elapsed();
    // Generous for a debug build on a loaded machine; a few ms in release.
    println!("a 4 MiB write took {took:?}");
    assert!(
        took < Duration::from_millis(500),
        "a 4 MiB write took {took:?}"
    );
}

#[test]
fn injected_faults() {
    let run = |kind, n: u64, want: WcStatus| {
        let f = EmuFabric::new(SECRET, LOOPBACK).with_fault(Fault { kind, n });
        let (mut a, b) = pair_with(&f, &f, &PathSettings::default());
        // One at a time: a write outstanding when the fault hits would be flushed too.
        let mut got = Vec::new();
        for id in 1..=3 {
            a.qp.post_write(id, a.sge(0, 8), b.at(0), None, true)
                .unwrap();
            let c = next(&a.scq);
            got.push((c.wr_id, c.status));
        }
        let want_all: Vec<_> = (1..=3)
            .map(|id| {
                let st = match id.cmp(&n) {
                    std::cmp::Ordering::Less => WcStatus::Success,
                    std::cmp::Ordering::Equal => want,
                    std::cmp::Ordering::Greater => WcStatus::WrFlush,
                };
                (id, st)
            })
            .collect();
        assert_eq!(got, want_all, "{kind:?}@{n}");
        assert_eq!(a.qp.state(), QpState::Error);
    };
    run(FaultKind::Cqe, 2, WcStatus::RemoteOperation);
    run(FaultKind::Rkey, 2, WcStatus::RemoteAccess);
    run(FaultKind::Drop, 2, WcStatus::RetryExceeded);
    run(FaultKind::Qp, 2, WcStatus::WrFlush);
}

#[test]
fn fault_variable_parses() {
    assert_eq!(
        Fault::parse("cqe@3").unwrap(),
        Fault {
            kind: FaultKind::Cqe,
            n: 3
        }
    );
    assert_eq!(Fault::parse(" drop@1 ").unwrap().kind, FaultKind::Drop);
    assert_eq!(Fault::parse("qp@10").unwrap().n, 10);
    assert_eq!(Fault::parse("rkey@2").unwrap().kind, FaultKind::Rkey);
    for bad in [
        "", "cqe", "cqe@", "cqe@0", "cqe@-1", "cqe@x", "flip@1", "@3", "cqe@1@2",
    ] {
        let e = Fault::parse(bad).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("QCCL_IB_EMULATE_FAULT")),
            "{bad:?}: {e}"
        );
    }
}

/// Names of this process's threads that belong to the NIC listening on `port`.
fn nic_threads(port: u16) -> Vec<String> {
    let prefix = format!("qccl-emu{port}");
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .filter(|n| n.len() == prefix.len() + 1 && n.starts_with(&prefix))
        .collect()
}

#[test]
fn drops_are_quick_and_leave_no_thread_or_listener() {
    let (mut a, mut b) = pair();
    let ports = [a.ctx.lid(), b.ctx.lid()];
    b.qp.post_recv(1).unwrap();
    a.qp.post_write(1, a.sge(0, 64), b.at(0), Some(1), true)
        .unwrap();
    assert_eq!(next(&a.scq).status, WcStatus::Success);
    // Outstanding when dropped: a write waiting forever for a receive.
    a.qp.post_write(2, a.sge(0, 64), b.at(0), Some(2), true)
        .unwrap();
    b.qp.post_write(3, b.sge(0, 64), a.at(0), None, true)
        .unwrap();
    assert_eq!(next(&b.scq).status, WcStatus::Success);
    let mut names = nic_threads(ports[0]);
    names.sort();
    // Accept, sender, answer reader, and the responder of b's connection.
    assert_eq!(names.len(), 4, "{names:?}");
    let t = Instant::now();
    drop(a);
    drop(b);
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
    for port in ports {
        assert_eq!(nic_threads(port), Vec::<String>::new());
        assert!(std::net::TcpStream::connect((LOOPBACK, port)).is_err());
    }
}

/// Tells [`process_peer`] it is the child of [`across_processes`].
const CHILD_ENV: &str = "QCCL_IB_EMU_TEST_CHILD";
/// Writes the parent makes; the child posts exactly as many receives.
const PROCESS_WRITES: usize = 4;
const PROCESS_LEN: usize = 64 << 10;

/// Where a peer process's region is: its address and rkey, as text.
fn describe(s: &Side, psn: u32) -> String {
    let e = s.qp.endpoint(psn, 0).unwrap();
    let hex: String = e.to_bytes().iter().map(|b| format!("{b:02x}")).collect();
    format!("{hex} {} {}", s.region.addr(), s.region.rkey())
}

fn parse_peer(line: &str) -> (crate::transport::ib::verbs::Endpoint, RemoteAddr) {
    let mut it = line.split_whitespace();
    let hex = it.next().unwrap();
    let mut b = [0u8; crate::transport::ib::verbs::Endpoint::LEN];
    for (i, x) in b.iter_mut().enumerate() {
        *x = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    let addr = it.next().unwrap().parse().unwrap();
    let rkey = it.next().unwrap().parse().unwrap();
    (
        crate::transport::ib::verbs::Endpoint::from_bytes(&b),
        RemoteAddr { addr, rkey },
    )
}

/// The child side of [`across_processes`]; does nothing in a normal test run.
#[test]
fn process_peer() {
    use std::io::BufRead;
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let f = EmuFabric::new(SECRET, LOOPBACK);
    let mut me = Side::open(&f, caps());
    me.qp.to_init().unwrap();
    for i in 0..PROCESS_WRITES {
        me.qp.post_recv(i as u64).unwrap();
    }
    println!("EMU {}", describe(&me, 7));
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    let (peer, parent_region) = parse_peer(&line);
    let path = PathSettings::default();
    me.qp.to_rtr(&peer, &path).unwrap();
    me.qp.to_rts(7, &path).unwrap();
    // The sum of every byte received, in f64 (an independent reference for the parent).
    let mut sum = 0f64;
    for i in 0..PROCESS_WRITES {
        let c = next(&me.rcq);
        assert_eq!(
            (c.wr_id, c.imm, c.status),
            (i as u64, i as u32, WcStatus::Success)
        );
        sum += me
            .bytes(i * PROCESS_LEN, PROCESS_LEN)
            .iter()
            .map(|&b| b as f64)
            .sum::<f64>();
    }
    me.fill(0, &sum.to_le_bytes());
    me.qp
        .post_write(9, me.sge(0, 8), parent_region, Some(99), true)
        .unwrap();
    assert_eq!(next(&me.scq).status, WcStatus::Success);
    println!("EMU done");
    // Stays until killed (or its stdin closes).
    let _ = std::io::stdin().lock().read_line(&mut line);
}

/// Two processes: writes with immediate carry bytes both ways, then the peer is killed while a
/// write is outstanding and the write fails within a bounded time.
#[test]
fn across_processes() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Command, Stdio};
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "transport::ib::emu::tests::process_peer",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // The child's lines, read by a thread so that waiting for them is bounded. Its test
    // harness prints on the same line, so ours are found by their "EMU " mark.
    let (tx, rx) = std::sync::mpsc::channel();
    let out = BufReader::new(child.stdout.take().unwrap());
    std::thread::spawn(move || {
        for l in out.lines().map_while(|l| l.ok()) {
            if let Some(at) = l.find("EMU ") {
                let _ = tx.send(l[at + 4..].to_string());
            }
        }
    });
    let ours = |child: &mut std::process::Child| match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(l) => l,
        Err(e) => {
            let _ = child.kill();
            panic!("no line from the peer process: {e}");
        }
    };
    let f = EmuFabric::new(SECRET, LOOPBACK);
    let mut me = Side::open(&f, caps());
    me.qp.to_init().unwrap();
    me.qp.post_recv(42).unwrap();
    let (peer, child_region) = parse_peer(&ours(&mut child));
    let path = PathSettings::default();
    me.qp.to_rtr(&peer, &path).unwrap();
    me.qp.to_rts(3, &path).unwrap();
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "{}", describe(&me, 3)).unwrap();
    let mut want = 0f64;
    for i in 0..PROCESS_WRITES {
        let data = pattern(PROCESS_LEN, i as u8 + 1);
        want += data.iter().map(|&b| b as f64).sum::<f64>();
        me.fill(i * PROCESS_LEN, &data);
        let to = RemoteAddr {
            addr: child_region.addr + (i * PROCESS_LEN) as u64,
            ..child_region
        };
        me.qp
            .post_write(
                i as u64,
                me.sge(i * PROCESS_LEN, PROCESS_LEN),
                to,
                Some(i as u32),
                false,
            )
            .unwrap();
    }
    let c = next(&me.rcq);
    assert_eq!((c.wr_id, c.imm, c.byte_len), (42, 99, 8));
    let got = f64::from_le_bytes(me.bytes(0, 8).try_into().unwrap());
    assert_eq!(got, want);
    assert_eq!(ours(&mut child), "done");
    // The child has no receive left: this write waits (RNR, forever) until the child dies.
    me.qp
        .post_write(100, me.sge(0, 8), child_region, Some(0), true)
        .unwrap();
    quiet(&me.scq, Duration::from_millis(50));
    child.kill().unwrap();
    let t = Instant::now();
    let c = next(&me.scq);
    child.wait().unwrap();
    assert_eq!((c.wr_id, c.status), (100, WcStatus::RetryExceeded));
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

#[test]
fn a_silent_peer_fails_after_the_ack_timeout() {
    use super::wire::{Answer, HELLO_LEN};
    use std::io::{Read, Write};
    // A "NIC" that accepts the hello, then reads requests and never answers (a hung process).
    let fake = std::net::TcpListener::bind((LOOPBACK, 0)).unwrap();
    let port = fake.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        let (mut s, _) = fake.accept().unwrap();
        let mut hello = [0u8; HELLO_LEN];
        s.read_exact(&mut hello).unwrap();
        s.write_all(&Answer::Accepted.encode()).unwrap();
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    });
    let f = EmuFabric::new(SECRET, LOOPBACK);
    let mut a = Side::open(&f, caps());
    let mut peer = a.qp.endpoint(0, 0).unwrap();
    peer.lid = port;
    // 4.096 us x 2^12 x 2: under the emulation's shortest ACK timeout, 1 s.
    let path = PathSettings {
        timeout: 12,
        retry_cnt: 1,
        ..PathSettings::default()
    };
    a.qp.to_init().unwrap();
    a.qp.to_rtr(&peer, &path).unwrap();
    a.qp.to_rts(0, &path).unwrap();
    let t = Instant::now();
    a.qp.post_write(1, a.sge(0, 8), a.at(0), None, false)
        .unwrap();
    let c = next(&a.scq);
    assert_eq!((c.wr_id, c.status), (1, WcStatus::RetryExceeded));
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(2),
        "{took:?}"
    );
    drop(a);
    server.join().unwrap();
}

#[test]
fn strangers_do_not_hold_up_the_nic() {
    use std::io::Write;
    let f = EmuFabric::new(SECRET, LOOPBACK);
    let (mut a, b) = (Side::open(&f, caps()), Side::open(&f, caps()));
    // One connects and says nothing, one sends garbage, before the real peer connects.
    let _silent = std::net::TcpStream::connect((LOOPBACK, b.ctx.lid())).unwrap();
    let mut garbage = std::net::TcpStream::connect((LOOPBACK, b.ctx.lid())).unwrap();
    garbage.write_all(&[0x55; 64]).unwrap();
    let mut b = b;
    connect(&mut a, &mut b, &PathSettings::default());
    a.qp.post_write(1, a.sge(0, 8), b.at(0), None, true)
        .unwrap();
    assert_eq!(next(&a.scq).status, WcStatus::Success);
}

#[test]
fn zero_length_writes_check_no_rkey() {
    let (mut a, mut b) = pair();
    b.qp.post_recv(5).unwrap();
    let nowhere = RemoteAddr { addr: 0, rkey: 0 };
    let no_sge = Sge {
        addr: 0,
        len: 0,
        lkey: 0,
    };
    a.qp.post_write(1, no_sge, nowhere, Some(77), true).unwrap();
    assert_eq!(next(&a.scq).status, WcStatus::Success);
    let c = next(&b.rcq);
    assert_eq!((c.wr_id, c.imm, c.byte_len), (5, 77, 0));
}

#[test]
fn ipv6_gids_are_used_as_they_are() {
    let v6 = IpAddr::V6(std::net::Ipv6Addr::LOCALHOST);
    if std::net::TcpListener::bind((v6, 0)).is_err() {
        return; // No IPv6 loopback on this machine.
    }
    let f = EmuFabric::new(SECRET, v6);
    let (mut a, b) = pair_with(&f, &f, &PathSettings::default());
    assert_eq!(
        a.ctx.gid(0).unwrap(),
        std::net::Ipv6Addr::LOCALHOST.octets()
    );
    a.fill(0, b"over v6");
    a.qp.post_write(1, a.sge(0, 7), b.at(0), None, true)
        .unwrap();
    assert_eq!(next(&a.scq).status, WcStatus::Success);
    assert_eq!(b.bytes(0, 7), b"over v6");
}
