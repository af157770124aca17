//! Late sends: started once their source hands the bytes over, while the rest of the
//! exchange progresses; their source's errors end the exchange.

use crate::error::{Error, Result};
use crate::transport::frame::OpDesc;
use crate::transport::inproc::InProcConnector;
use crate::transport::{LateSend, LinkConfig, RecvReq, SendReq, SendSource, Transport};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

fn transport(key: u64, rank: usize, size: usize, timeout: Duration) -> Transport {
    let cfg = LinkConfig {
        rank,
        size,
        timeout,
        spin: Duration::ZERO,
        yield_for: Duration::ZERO,
        abort: Arc::new(AtomicBool::new(false)),
        arena_chunk: None,
        inspector: None,
        registry: Default::default(),
    };
    let c = InProcConnector::join(key, &cfg).unwrap();
    Transport::new(cfg, Box::new(c))
}

/// Hands `bytes` over on the `after`-th ask, or fails then when `fail`.
struct Slow<'a> {
    bytes: &'a [u8],
    after: usize,
    asked: usize,
    waits: usize,
    fail: bool,
}

impl<'a> SendSource<'a> for Slow<'a> {
    fn ready(&mut self, _: usize) -> Result<Option<&'a [u8]>> {
        self.asked += 1;
        match (self.asked >= self.after, self.fail) {
            (false, _) => Ok(None),
            (true, false) => Ok(Some(self.bytes)),
            (true, true) => Err(Error::Timeout("the bytes never came".into())),
        }
    }

    fn wait(&mut self, _: usize, d: Duration) {
        self.waits += 1;
        std::thread::sleep(d.min(Duration::from_micros(200)));
    }
}

fn slow(bytes: &[u8], after: usize, fail: bool) -> Slow<'_> {
    Slow {
        bytes,
        after,
        asked: 0,
        waits: 0,
        fail,
    }
}

#[test]
fn a_late_send_goes_once_ready_while_the_receives_progress() {
    let key = 0x1a7e_0001;
    // Rank 0's send is late; rank 2's too, with nothing else to wait for once its receive
    // landed: both wait on their source.
    let h: Vec<_> = (0..3)
        .map(|r| {
            std::thread::spawn(move || {
                let mut t = transport(key, r, 3, Duration::from_secs(20));
                let mine = vec![r as u8 + 1; 1000 + r];
                let to = (r + 1) % 3;
                let from = (r + 2) % 3;
                let mut got = vec![0u8; 1000 + from];
                let mut recvs = [RecvReq::new(from, &mut got)];
                let desc = OpDesc::setup();
                let asked = if r == 1 {
                    let sends = [SendReq {
                        peer: to,
                        data: &mine,
                    }];
                    t.exchange(&desc, &sends, &mut recvs).unwrap();
                    0
                } else {
                    let mut src = slow(&mine, 50, false);
                    let late = [LateSend {
                        peer: to,
                        len: mine.len(),
                    }];
                    t.exchange_late(&desc, &[], &late, &mut src, &mut recvs)
                        .unwrap();
                    src.asked
                };
                assert_eq!(got, vec![from as u8 + 1; 1000 + from], "rank {r}");
                asked
            })
        })
        .collect();
    let asked: Vec<usize> = h.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(asked, [50, 0, 50], "asked until ready, and not after");
}

#[test]
fn a_late_sends_error_ends_the_exchange() {
    let key = 0x1a7e_0002;
    let peer = std::thread::spawn(move || {
        let mut t = transport(key, 1, 2, Duration::from_millis(500));
        let mut got = vec![0u8; 8];
        t.exchange(&OpDesc::setup(), &[], &mut [RecvReq::new(0, &mut got)])
    });
    let mut t = transport(key, 0, 2, Duration::from_secs(20));
    let bytes = [7u8; 8];
    let mut src = slow(&bytes, 5, true);
    let late = [LateSend { peer: 1, len: 8 }];
    let err = t
        .exchange_late(&OpDesc::setup(), &[], &late, &mut src, &mut [])
        .unwrap_err();
    assert!(err.to_string().contains("never came"), "{err}");
    assert!(src.waits > 0, "waited on the source between asks");
    // Nothing was sent: the peer times out.
    assert!(peer.join().unwrap().is_err());
}

#[test]
fn a_late_send_of_another_length_than_announced_is_refused() {
    let key = 0x1a7e_0003;
    let mut t = transport(key, 0, 2, Duration::from_secs(5));
    // Rank 1 joins so that the link opens; it never exchanges.
    let _other = transport(key, 1, 2, Duration::from_secs(5));
    let bytes = [7u8; 8];
    let mut src = slow(&bytes, 1, false);
    let late = [LateSend { peer: 1, len: 9 }];
    let err = t
        .exchange_late(&OpDesc::setup(), &[], &late, &mut src, &mut [])
        .unwrap_err();
    assert!(err.to_string().contains("announced with 9 bytes"), "{err}");
}
