//! In-process links: ranks are threads of one process, frames travel over channels
//! (`link.rs`), driven by the same progress engine as every other link.
//!
//! Used by tests (N ranks cheaply) and by `Comm::init_threads`. Endpoints meet through a
//! process-wide registry keyed by the comm's id, so `split` works here too.

mod link;

use super::link::{Connector, Link};
use super::LinkConfig;
use crate::error::{Error, Result};
use crossbeam_channel::{unbounded, Receiver, Sender};
use link::{Frame, InprocLink};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

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

/// One rank's end of an in-process comm: a channel pair per peer, taken as a link on first use.
pub struct InProcConnector {
    comm_id: u64,
    tx: Vec<Option<Sender<Frame>>>,
    rx: Vec<Option<Receiver<Frame>>>,
}

impl InProcConnector {
    /// Takes rank `cfg.rank`'s endpoint of the in-process comm `key` (created by the first
    /// rank to arrive). Never blocks.
    pub fn join(key: u64, cfg: &LinkConfig) -> Result<InProcConnector> {
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
        Ok(InProcConnector {
            comm_id: key,
            tx,
            rx,
        })
    }
}

impl Connector for InProcConnector {
    fn connect(&mut self, peer: usize, _cfg: &LinkConfig) -> Result<Box<dyn Link>> {
        match (self.tx[peer].take(), self.rx[peer].take()) {
            (Some(tx), Some(rx)) => Ok(Box::new(InprocLink::new(tx, rx, self.peer_name(peer)))),
            _ => Err(Error::Internal(format!(
                "no in-process endpoint for rank {peer}"
            ))),
        }
    }

    fn comm_id(&self) -> u64 {
        self.comm_id
    }

    fn abort(&mut self, head: &[u8], reason: &[u8]) {
        // The channels exist from the start: a peer not linked yet still reads this frame
        // when it first receives from this rank.
        for tx in self.tx.iter_mut().filter_map(Option::take) {
            let _ = tx.send([head, reason].concat());
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
