//! `split(color, key)`: sub-communicators, as NCCL's ncclCommSplit.

use super::{Comm, Fabric, Placement};
use crate::error::{Error, Result};
use crate::transport::frame::{CollKind, OpDesc};
use crate::transport::{RecvReq, SendReq};
use crate::types::DType;
use std::hash::{Hash, Hasher};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener};
use std::sync::atomic::Ordering;

const RECORD: usize = 28;

fn encode(color: i32, key: i32, addr: Option<SocketAddr>) -> [u8; RECORD] {
    let mut b = [0u8; RECORD];
    b[0..4].copy_from_slice(&color.to_le_bytes());
    b[4..8].copy_from_slice(&key.to_le_bytes());
    if let Some(a) = addr {
        let ip = match a.ip() {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        b[8..24].copy_from_slice(&ip.octets());
        b[24..26].copy_from_slice(&a.port().to_le_bytes());
    }
    b
}

fn decode(b: &[u8]) -> (i32, i32, SocketAddr) {
    let color = i32::from_le_bytes(b[0..4].try_into().unwrap());
    let key = i32::from_le_bytes(b[4..8].try_into().unwrap());
    let v6 = Ipv6Addr::from(<[u8; 16]>::try_from(&b[8..24]).unwrap());
    let ip = v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4);
    let port = u16::from_le_bytes(b[24..26].try_into().unwrap());
    (color, key, SocketAddr::new(ip, port))
}

impl Comm {
    /// Splits this comm (a collective call on all its ranks): ranks passing the same `color`
    /// form a new comm, ranked by `key` (ties broken by rank in this comm). A negative color
    /// (NCCL_SPLIT_NOCOLOR) takes no part and gets `None`.
    pub fn split(&self, color: i32, key: i32) -> Result<Option<Comm>> {
        self.split_as(color, key, self.config.clone())
    }

    /// A comm of `members` (ranks of this comm, ascending; a member's new rank is its place in
    /// the list) made by the members alone, as MPI's `MPI_Comm_create_group`: ranks outside
    /// the list do not call it, and this comm goes on unchanged (torch's `new_group`, where only
    /// members reach the backend). `tag` tells apart groups of the same members: every member
    /// passes the same. Members that disagree on the list fail with both calls named.
    pub fn create_group(&self, members: &[usize], tag: u64) -> Result<Comm> {
        let me = check_members(members, self.size, self.rank)?;
        let listener =
            match &self.fabric {
                Fabric::Tcp { ip, .. } => Some(TcpListener::bind((*ip, 0)).map_err(|e| {
                    Error::io(format!("create_group: binding a listener on {ip}"), e)
                })?),
                Fabric::InProc => None,
            };
        let addr = listener.as_ref().and_then(|l| l.local_addr().ok());
        let mine = encode(0, me as i32, addr);
        let mut all = vec![0u8; RECORD * members.len()];
        all[me * RECORD..][..RECORD].copy_from_slice(&mine);
        let mut h = std::hash::DefaultHasher::new();
        (self.comm_id, "create_group", tag, members).hash(&mut h);
        let child_id = h.finish();
        if members.len() > 1 {
            // The list's hash rides in the descriptor, so members given different lists of the
            // same length meet a descriptor mismatch on the first frame instead of a timeout.
            let desc = OpDesc {
                coll: CollKind::Split,
                dtype: DType::Uint8 as u8,
                op: 0,
                algo: 0,
                root: child_id as u32,
                count: (RECORD * members.len()) as u64,
            };
            let rank = self.rank;
            self.execute(|engine| {
                let sends: Vec<SendReq<'_>> = members
                    .iter()
                    .filter(|&&r| r != rank)
                    .map(|&peer| SendReq { peer, data: &mine })
                    .collect();
                let mut recvs: Vec<RecvReq<'_>> = all
                    .chunks_mut(RECORD)
                    .zip(members)
                    .filter(|&(_, &r)| r != rank)
                    .map(|(rec, &peer)| RecvReq::new(peer, rec))
                    .collect();
                engine.exchange(&desc, &sends, &mut recvs)
            })?;
        }
        let list = all
            .chunks(RECORD)
            .zip(members)
            .map(|(rec, &r)| {
                let (_, key, a) = decode(rec);
                (key, r, a)
            })
            .collect();
        self.child(child_id, list, listener, self.config.clone())
    }

    /// A level of this comm's hierarchy (`split` with the levels' config): a level is never
    /// hierarchical itself, or QCCL_ALGO=hier would have each level split again, without end.
    pub(super) fn split_level(&self, color: i32, key: i32) -> Result<Option<Comm>> {
        self.split_as(color, key, self.level_config())
    }

    fn level_config(&self) -> crate::Config {
        let mut config = self.config.clone();
        if config.algo == crate::Algo::Hier {
            config.algo = crate::Algo::Auto;
        }
        config
    }

    fn split_as(&self, color: i32, key: i32, config: crate::Config) -> Result<Option<Comm>> {
        let seq = self.splits.fetch_add(1, Ordering::Relaxed);
        let listener = match &self.fabric {
            Fabric::Tcp { ip, .. } if color >= 0 => Some(
                TcpListener::bind((*ip, 0))
                    .map_err(|e| Error::io(format!("split: binding a listener on {ip}"), e))?,
            ),
            _ => None,
        };
        let addr = listener.as_ref().and_then(|l| l.local_addr().ok());
        let mine = encode(color, key, addr);
        let mut all = vec![0u8; RECORD * self.size];
        self.all_gather(&mine[..], &mut all)?;
        if color < 0 {
            return Ok(None);
        }
        let members: Vec<(i32, usize, SocketAddr)> = all
            .chunks(RECORD)
            .enumerate()
            .filter_map(|(r, rec)| {
                let (c, k, a) = decode(rec);
                (c == color).then_some((k, r, a))
            })
            .collect();
        self.child(self.child_id(seq, color), members, listener, config)
            .map(Some)
    }

    /// A split whose color and key of every rank this rank can compute itself
    /// (`assign(rank)`), made without exchanging anything: for in-process comms, whose
    /// sub-comms meet through the process-wide registry. One thread may then drive every
    /// rank's first hierarchical call in turn (qcclCommInitAll inside a group) where the
    /// collective `split` would wait for the ranks that thread has not reached yet.
    /// The comm is a level of this comm's hierarchy (never hierarchical itself).
    pub(super) fn split_known(&self, assign: impl Fn(usize) -> (i32, i32)) -> Result<Comm> {
        if !matches!(self.fabric, Fabric::InProc) {
            return Err(Error::Internal(
                "split_known is for in-process comms (sockets need the peers' addresses)".into(),
            ));
        }
        let seq = self.splits.fetch_add(1, Ordering::Relaxed);
        let (color, _) = assign(self.rank);
        let unspecified = SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0);
        let members = (0..self.size)
            .filter_map(|r| {
                let (c, k) = assign(r);
                (c == color).then_some((k, r, unspecified))
            })
            .collect();
        self.child(
            self.child_id(seq, color),
            members,
            None,
            self.level_config(),
        )
    }

    /// The id of the `seq`-th split of this comm, for `color` (the same on every member).
    fn child_id(&self, seq: u64, color: i32) -> u64 {
        let mut h = std::hash::DefaultHasher::new();
        (self.comm_id, seq, color).hash(&mut h);
        h.finish()
    }

    /// The comm `child_id` of `members` (key, parent rank, listen address), ranked by key
    /// then parent rank: a split's, or the survivors' of a shrink.
    pub(super) fn child(
        &self,
        child_id: u64,
        mut members: Vec<(i32, usize, SocketAddr)>,
        listener: Option<TcpListener>,
        config: crate::Config,
    ) -> Result<Comm> {
        members.sort_unstable_by_key(|&(k, r, _)| (k, r));
        let child_rank = members
            .iter()
            .position(|&(_, r, _)| r == self.rank)
            .ok_or_else(|| Error::Internal("split: this rank missing from its own color".into()))?;
        let place = Placement {
            host_ids: members
                .iter()
                .map(|&(_, r, _)| self.place.host_ids[r].clone())
                .collect(),
            rdma: members
                .iter()
                .map(|&(_, r, _)| self.place.rdma[r])
                .collect(),
            // The parent's processes still share this machine's cores.
            machine_ranks: self.place.machine_ranks,
            machine_cores: self.place.machine_cores,
            process_peers: self.place.process_peers && members.len() > 1,
            cuda_ipc: self.place.cuda_ipc && members.len() > 1,
        };
        let fabric = match &self.fabric {
            Fabric::Tcp { ip, rdma, .. } => Fabric::Tcp {
                ip: *ip,
                peers: members.iter().map(|&(_, _, a)| a).collect(),
                rdma: rdma.clone(),
            },
            Fabric::InProc => Fabric::InProc,
        };
        Comm::build(
            child_rank,
            place,
            child_id,
            self.secret,
            config,
            self.tuning.clone(),
            fabric,
            listener,
        )
    }
}

/// This rank's place in `members`, after checking the list: not empty, ascending without
/// repeats, every rank below `size`, `rank` among them.
fn check_members(members: &[usize], size: usize, rank: usize) -> Result<usize> {
    if let Some(&r) = members.iter().find(|&&r| r >= size) {
        return Err(Error::invalid(format!(
            "create_group: rank {r} is out of range for a comm of {size} ranks"
        )));
    }
    if members.windows(2).any(|w| w[0] >= w[1]) {
        return Err(Error::invalid(format!(
            "create_group: the member list {members:?} must be ascending without repeats"
        )));
    }
    members.iter().position(|&r| r == rank).ok_or_else(|| {
        Error::invalid(format!(
            "create_group: rank {rank} is not in the member list {members:?} (only members call it)"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::check_members;

    #[test]
    fn member_lists_are_checked_before_anything_moves() {
        assert_eq!(check_members(&[0, 2, 3], 4, 2).unwrap(), 1);
        assert_eq!(check_members(&[1], 2, 1).unwrap(), 0);
        let msg = |m: &[usize], size, rank| check_members(m, size, rank).unwrap_err().to_string();
        assert!(msg(&[0, 4], 4, 0).contains("rank 4 is out of range"));
        assert!(msg(&[2, 1], 4, 1).contains("ascending without repeats"));
        assert!(msg(&[1, 1], 4, 1).contains("ascending without repeats"));
        assert!(msg(&[0, 1], 4, 3).contains("rank 3 is not in the member list"));
        assert!(msg(&[], 4, 0).contains("not in the member list"));
    }
}
