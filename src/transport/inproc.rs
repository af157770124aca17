//! In-process transport: ranks are threads of one process, frames travel over channels.
//!
//! Used by tests (N ranks cheaply) and by `Comm::init_threads`. Endpoints meet through a
//! process-wide registry keyed by the comm's id, so `split` works here too.

use super::frame::{FrameKind, Header, OpDesc};
use super::stall::Stalled;
use super::wait::{Next, Waiter};
use super::{LinkConfig, RecvReq, SendReq, Transport};
use crate::error::{Error, Result};
use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

struct Frame {
    header: Header,
    payload: Vec<u8>,
}

type Endpoint = (Vec<Option<Sender<Frame>>>, Vec<Option<Receiver<Frame>>>);

struct Pending {
    size: usize,
    endpoints: Vec<Option<Endpoint>>,
    left: usize,
}

fn registry() -> &'static Mutex<HashMap<u64, Pending>> {
    static REG: OnceLock<Mutex<HashMap<u64, Pending>>> = OnceLock::new();
    REG.get_or_init(|| Mutex::new(HashMap::new()))
}

/// One rank's end of an in-process comm.
pub struct InProcTransport {
    cfg: LinkConfig,
    tx: Vec<Option<Sender<Frame>>>,
    rx: Vec<Option<Receiver<Frame>>>,
}

impl InProcTransport {
    /// Takes rank `cfg.rank`'s endpoint of the in-process comm `key` (created by the first
    /// rank to arrive). Never blocks.
    pub fn connect(key: u64, cfg: LinkConfig) -> Result<InProcTransport> {
        let (rank, size) = (cfg.rank, cfg.size);
        let mut reg = registry().lock().unwrap_or_else(|e| e.into_inner());
        let pending = reg.entry(key).or_insert_with(|| {
            let mut tx: Vec<Vec<Option<Sender<Frame>>>> = (0..size).map(|_| Vec::new()).collect();
            let mut rx: Vec<Vec<Option<Receiver<Frame>>>> = (0..size)
                .map(|_| (0..size).map(|_| None).collect())
                .collect();
            for (src, txs) in tx.iter_mut().enumerate() {
                for (dst, rxs) in rx.iter_mut().enumerate() {
                    if src == dst {
                        txs.push(None);
                    } else {
                        let (s, r) = unbounded();
                        txs.push(Some(s));
                        rxs[src] = Some(r);
                    }
                }
            }
            Pending {
                size,
                endpoints: tx.into_iter().zip(rx).map(Some).collect(),
                left: size,
            }
        });
        if pending.size != size {
            return Err(Error::InvalidUsage(format!(
                "rank {rank} joined in-process comm with size {size} but it has size {}",
                pending.size
            )));
        }
        let (tx, rx) = pending.endpoints[rank]
            .take()
            .ok_or_else(|| Error::InvalidUsage(format!("rank {rank} joined twice")))?;
        pending.left -= 1;
        if pending.left == 0 {
            reg.remove(&key);
        }
        Ok(InProcTransport { cfg, tx, rx })
    }

    fn gone(&self, peer: usize) -> Error {
        Error::Remote {
            rank: peer,
            addr: self.peer_name(peer),
            msg: "the peer's endpoint is closed (its comm was dropped or aborted)".into(),
        }
    }
}

impl Transport for InProcTransport {
    fn exchange(
        &mut self,
        desc: &OpDesc,
        sends: &[SendReq<'_>],
        recvs: &mut [RecvReq<'_>],
    ) -> Result<()> {
        for s in sends {
            let tx = self.tx[s.peer].as_ref().ok_or_else(|| self.gone(s.peer))?;
            let header = Header {
                kind: FrameKind::Data,
                desc: *desc,
                len: s.data.len() as u64,
            };
            tx.send(Frame {
                header,
                payload: s.data.to_vec(),
            })
            .map_err(|_| self.gone(s.peer))?;
        }
        let mut done = vec![false; recvs.len()];
        let mut left = recvs.len();
        let mut waiter = Waiter::new(&self.cfg);
        while left > 0 {
            let mut first_pending = None;
            for (i, r) in recvs.iter_mut().enumerate() {
                if done[i] {
                    continue;
                }
                let rx = self.rx[r.peer].as_ref().ok_or_else(|| self.gone(r.peer))?;
                match rx.try_recv() {
                    Ok(f) => {
                        accept_frame(f, r, desc, self.cfg.rank, &self.peer_name(r.peer))?;
                        done[i] = true;
                        left -= 1;
                        waiter.progressed();
                    }
                    Err(TryRecvError::Empty) => {
                        first_pending.get_or_insert(i);
                    }
                    Err(TryRecvError::Disconnected) => return Err(self.gone(r.peer)),
                }
            }
            let Some(i) = first_pending else { continue };
            let peer = recvs[i].peer;
            let stalled = |full: bool| Stalled {
                what: if full {
                    format!("waiting for rank {peer} in {desc}")
                } else {
                    String::new()
                },
                ..Stalled::on(*desc, vec![peer])
            };
            if let Next::Block(d) = waiter.idle(&self.cfg, stalled)? {
                let rx = self.rx[peer].as_ref().ok_or_else(|| self.gone(peer))?;
                match rx.recv_timeout(d) {
                    Ok(f) => {
                        accept_frame(f, &mut recvs[i], desc, self.cfg.rank, &self.peer_name(peer))?;
                        done[i] = true;
                        left -= 1;
                        waiter.progressed();
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return Err(self.gone(peer)),
                }
            }
        }
        Ok(())
    }

    fn reduces_on_receive(&mut self, _peer: usize) -> Result<bool> {
        // The frame's payload is already in memory: reducing from it saves a copy too.
        Ok(true)
    }

    fn abort(&mut self, reason: &str) {
        let reason = &reason.as_bytes()[..reason.len().min(super::frame::MAX_ABORT_LEN as usize)];
        for tx in self.tx.iter_mut().filter_map(Option::take) {
            let header = Header::abort(reason.len(), None);
            let _ = tx.send(Frame {
                header,
                payload: reason.to_vec(),
            });
        }
        self.rx.iter_mut().for_each(|r| *r = None);
    }

    fn peer_name(&self, peer: usize) -> String {
        format!("in-process rank {peer}")
    }

    fn name(&self) -> &'static str {
        "inproc"
    }
}

fn accept_frame(f: Frame, r: &mut RecvReq<'_>, desc: &OpDesc, me: usize, addr: &str) -> Result<()> {
    if f.header.kind == FrameKind::Abort {
        return Err(Error::Remote {
            rank: r.peer,
            addr: addr.to_string(),
            msg: format!(
                "{}{}",
                super::PEER_ABORTED,
                String::from_utf8_lossy(&f.payload)
            ),
        });
    }
    f.header.check(desc, r.data.len(), r.peer, me)?;
    match &r.reduce {
        Some(red) => red.apply(r.data, 0, &f.payload),
        None => r.data.copy_from_slice(&f.payload),
    }
    Ok(())
}
