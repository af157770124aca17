use super::*;
use crate::transport::engine;
use crate::transport::frame::{CollKind, FrameKind, Header, OpDesc};
use crate::transport::SendReq;
use std::net::TcpListener;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

fn desc() -> OpDesc {
    OpDesc {
        coll: CollKind::AllReduce,
        dtype: 7,
        op: 0,
        algo: 0,
        root: 0,
        count: 0,
    }
}

/// Rank 1 queues a data frame of `early` bytes for a later step (split over the pair's
/// `nsocks` sockets as the engine splits it), then an abort frame naming the rank that really
/// died, and closes with our bytes unread (a reset). Our send to it fails first; the error
/// must carry the abort's reason, not just a broken pipe.
fn abort_queued_behind(nsocks: usize, early: usize) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut ours = Vec::new();
    let mut theirs = Vec::new();
    for _ in 0..nsocks {
        ours.push(TcpStream::connect(addr).unwrap());
        let (s, _) = listener.accept().unwrap();
        // As `configure` sets for every comm socket: the frames leave at once, ahead of the
        // reset that the close sends (a reset drops what was still queued to send).
        s.set_nodelay(true).unwrap();
        theirs.push(s);
    }
    let peer = std::thread::spawn(move || {
        // Wait until our send reached every socket, so the close leaves it unread.
        let mut b = [0u8; 1];
        for s in &theirs {
            while s.peek(&mut b).unwrap() == 0 {}
        }
        let data = vec![1u8; early];
        let head = Header {
            kind: FrameKind::Data,
            desc: desc(),
            len: early as u64,
        };
        theirs[0].write_all(&head.encode()).unwrap();
        for (i, (a, b)) in split(early, nsocks).into_iter().enumerate() {
            theirs[i].write_all(&data[a..b]).unwrap();
        }
        let reason = b"rank 1 failed: rank 2 is gone";
        theirs[0]
            .write_all(&Header::abort(reason.len(), Some(2)).encode())
            .unwrap();
        theirs[0].write_all(reason).unwrap();
    });
    for s in &ours {
        s.set_nonblocking(true).unwrap();
    }
    let mut links: Vec<Option<Box<dyn Link>>> =
        vec![None, Some(Box::new(SocketLink::new(ours, addr)))];
    let cfg = LinkConfig {
        rank: 0,
        size: 2,
        timeout: Duration::from_secs(10),
        spin: Duration::ZERO,
        yield_for: Duration::ZERO,
        abort: Arc::new(AtomicBool::new(false)),
        arena_chunk: None,
        inspector: Some(Arc::new(crate::transport::stall::Inspector::new(
            0,
            [0; 16],
            0,
            vec![addr; 3],
        ))),
        registry: Default::default(),
    };
    let big = vec![0u8; 64 << 20];
    let sends = [SendReq {
        peer: 1,
        data: &big,
    }];
    let err = engine::exchange(&mut links, &cfg, &desc(), &sends, &mut [])
        .unwrap_err()
        .to_string();
    peer.join().unwrap();
    assert!(
        err.contains("peer aborted: rank 1 failed: rank 2 is gone"),
        "{err}"
    );
    // The frame's culprit, for this rank's own abort frames and probes.
    assert_eq!(cfg.inspector.unwrap().culprit(), Some(2));
}

#[test]
fn a_send_to_a_peer_that_aborted_reports_the_abort_reason() {
    abort_queued_behind(1, 1000);
}

#[test]
fn the_abort_reason_is_found_behind_a_frame_split_over_two_sockets() {
    abort_queued_behind(2, 100 << 10);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

    /// Any length splits without overflow into ranges that tile it: a peer's header may
    /// announce any u64, and the abort path splits it before the length is checked.
    #[test]
    fn split_tiles_any_length(
        len in proptest::prop_oneof![proptest::prelude::any::<u64>(), 0..1u64 << 20],
        nsocks in 1usize..16,
    ) {
        let len = len as usize;
        let parts = split(len, nsocks);
        proptest::prop_assert!(!parts.is_empty() && parts.len() <= nsocks);
        proptest::prop_assert_eq!(parts[0].0, 0);
        proptest::prop_assert_eq!(parts[parts.len() - 1].1, len);
        for w in parts.windows(2) {
            proptest::prop_assert_eq!(w[0].1, w[1].0);
        }
        proptest::prop_assert!(parts.iter().all(|(a, b)| a <= b));
    }
}
