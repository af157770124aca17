//! One rank's endpoint of a comm: its links by peer, opened lazily through the comm's
//! connector, every exchange run by the progress engine, and the comm-wide capabilities built
//! over the links (reduce-on-receive per peer, the shared-memory arena when every link shares
//! memory). Nothing here depends on a link's kind.

use super::engine;
use super::frame::{Header, OpDesc, MAX_ABORT_LEN};
use super::link::{Connector, Link};
use super::shm::arena::{self, Arena};
use super::stall::Inspector;
use super::{LateSend, LinkConfig, RecvReq, SendReq, SendSource};
use crate::error::{Error, Result};
use std::sync::Arc;

/// A way to move frames between the ranks of one comm.
pub struct Transport {
    cfg: LinkConfig,
    links: Vec<Option<Box<dyn Link>>>,
    connector: Box<dyn Connector>,
    arena: Option<Arena>,
    aborted: bool,
}

impl Transport {
    /// An endpoint whose links `connector` opens, honouring `cfg`.
    pub fn new(cfg: LinkConfig, connector: Box<dyn Connector>) -> Transport {
        Transport {
            links: (0..cfg.size).map(|_| None).collect(),
            cfg,
            connector,
            arena: None,
            aborted: false,
        }
    }

    fn ensure(&mut self, peer: usize) -> Result<()> {
        if self.links[peer].is_some() {
            return Ok(());
        }
        if self.aborted {
            return Err(Error::Aborted("the comm's transport was aborted".into()));
        }
        self.links[peer] = Some(self.connector.connect(peer, &self.cfg)?);
        Ok(())
    }

    /// Sends each of `sends` as one frame and receives one frame into each of `recvs`, all
    /// under the operation descriptor `desc`, which every received frame must match.
    /// At most one send and one receive per peer; never to or from this rank.
    pub fn exchange(
        &mut self,
        desc: &OpDesc,
        sends: &[SendReq<'_>],
        recvs: &mut [RecvReq<'_>],
    ) -> Result<()> {
        for p in sends
            .iter()
            .map(|s| s.peer)
            .chain(recvs.iter().map(|r| r.peer))
        {
            self.ensure(p)?;
        }
        engine::exchange(&mut self.links, &self.cfg, desc, sends, recvs)
    }

    /// `exchange` with `late` sends too, each started once `source` hands its bytes over
    /// (see [`LateSend`]). At most one send per peer among `sends` and `late` together.
    pub fn exchange_late<'a>(
        &mut self,
        desc: &OpDesc,
        sends: &[SendReq<'a>],
        late: &[LateSend],
        source: &mut dyn SendSource<'a>,
        recvs: &mut [RecvReq<'_>],
    ) -> Result<()> {
        for p in sends
            .iter()
            .map(|s| s.peer)
            .chain(late.iter().map(|l| l.peer))
            .chain(recvs.iter().map(|r| r.peer))
        {
            self.ensure(p)?;
        }
        engine::exchange_late(&mut self.links, &self.cfg, desc, sends, late, source, recvs)
    }

    /// True when a receive from `peer` can reduce straight out of the link's memory
    /// (`RecvReq::reducing`), saving the copy into a landing buffer. May connect to `peer`.
    pub fn reduces_on_receive(&mut self, peer: usize) -> Result<bool> {
        self.ensure(peer)?;
        Ok(self.links[peer]
            .as_ref()
            .is_some_and(|l| l.reduces_on_receive()))
    }

    /// The comm-wide shared-memory arena (`shm::arena`) when every peer's link shares memory
    /// with it, else None. Set up on first use: every rank must call this at the same point
    /// of the same collective.
    pub fn arena(&mut self) -> Result<Option<&mut Arena>> {
        let (me, n) = (self.cfg.rank, self.cfg.size);
        if n < 2 || (0..n).any(|p| p != me && !self.connector.shares_memory(p)) {
            return Ok(None);
        }
        if self.arena.is_none() {
            let arena = self.setup_arena()?;
            crate::qlog!(
                Info,
                "rank {me}: comm {:#018x}: shared-memory arena over {} ranks, {} KiB per owner \
                 per round",
                self.connector.comm_id(),
                arena.size(),
                arena.chunk() >> 10
            );
            self.arena = Some(arena);
        }
        Ok(self.arena.as_mut())
    }

    /// Maps the arena (collective: see `arena`), its names travelling over the links.
    fn setup_arena(&mut self) -> Result<Arena> {
        let (me, n) = (self.cfg.rank, self.cfg.size);
        for p in (0..n).filter(|&p| p != me) {
            self.ensure(p)?;
        }
        let pids = self
            .links
            .iter()
            .map(|l| l.as_ref().and_then(|l| l.shared_pid()).unwrap_or(0))
            .collect();
        let addrs = (0..n).map(|p| self.connector.peer_name(p)).collect();
        let desc = OpDesc::setup();
        let (links, cfg) = (&mut self.links, &self.cfg);
        arena::setup(cfg, self.connector.comm_id(), pids, addrs, |s, r| {
            engine::exchange(links, cfg, &desc, s, r)
        })
    }

    /// Tells every connected peer that this rank failed (best effort, bounded to about a
    /// second) and closes the links. Later exchanges fail.
    pub fn abort(&mut self, reason: &str) {
        self.aborted = true;
        // A network comm's accept thread stays: it answers probes with the reason and refuses
        // peers.
        let culprit = self.cfg.inspector.as_ref().and_then(|i| {
            i.fail(reason);
            i.culprit()
        });
        if let Some(a) = &self.arena {
            a.abort(reason, culprit);
        }
        let reason = &reason.as_bytes()[..reason.len().min(MAX_ABORT_LEN as usize)];
        let head = Header::abort(reason.len(), culprit).encode();
        for mut link in self.links.iter_mut().filter_map(Option::take) {
            link.abort(&head, reason);
        }
        self.connector.abort(&head, reason);
    }

    /// The comm's stall inspector (network comms), for a server that takes the listener over.
    pub fn inspector(&self) -> Option<Arc<Inspector>> {
        self.connector.inspector()
    }

    /// The comm's registered buffers.
    pub fn registry(&self) -> Arc<super::registry::Registry> {
        self.cfg.registry.clone()
    }

    /// "tcp", "tcp+shm" or "inproc".
    pub fn name(&self) -> &'static str {
        self.connector.name()
    }
}
