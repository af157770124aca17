//! A minimal in-process fabric for the link's unit tests: writes are carried out at post time
//! (bytes copied, completions pushed), keeping the verbs rules the link relies on (order per
//! queue pair, a receive consumed per immediate, rkey and bounds checks, flush on error). The
//! emulated fabric (`ib::emu`) is the full one, across processes.

use crate::error::{Error, Result};
use crate::transport::ib::verbs::*;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

#[derive(Default)]
struct Net {
    qps: Mutex<HashMap<u32, Arc<QpShared>>>,
    /// rkey -> (address, length).
    regions: Mutex<HashMap<u32, (usize, usize)>>,
    next: AtomicU32,
    /// The `n`-th data write (1-based) fails with a remote access error; 0: none.
    fail_write: AtomicU32,
}

pub struct FakeFabric(Arc<Net>);

impl FakeFabric {
    /// A fabric whose `fail_write`-th data write fails (0: none does).
    pub fn new(fail_write: u32) -> FakeFabric {
        FakeFabric(Arc::new(Net {
            next: AtomicU32::new(1),
            fail_write: AtomicU32::new(fail_write),
            ..Default::default()
        }))
    }
}

impl Fabric for FakeFabric {
    fn kind(&self) -> &'static str {
        "fake"
    }
    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        Ok(vec![DeviceInfo {
            name: "fake0".into(),
            ports: vec![PortInfo {
                num: 1,
                active: true,
                link_layer: LinkLayer::Ethernet,
            }],
        }])
    }
    fn open(&self, _name: &str, _port: u8) -> Result<Arc<dyn Context>> {
        Ok(Arc::new(Ctx(self.0.clone())))
    }
}

struct Ctx(Arc<Net>);

struct Mem {
    buf: Box<[u64]>,
    len: usize,
    key: u32,
    net: Arc<Net>,
}

impl Region for Mem {
    fn ptr(&self) -> *mut u8 {
        self.buf.as_ptr() as *mut u8
    }
    fn len(&self) -> usize {
        self.len
    }
    fn lkey(&self) -> u32 {
        self.key
    }
    fn rkey(&self) -> u32 {
        self.key
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        self.net.regions.lock().unwrap().remove(&self.key);
    }
}

#[derive(Default)]
pub struct Cq {
    q: Mutex<VecDeque<Completion>>,
    bell: Condvar,
}

impl Cq {
    fn push(&self, c: Completion) {
        self.q.lock().unwrap().push_back(c);
        self.bell.notify_all();
    }
}

impl CompletionQueue for Cq {
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        let mut q = self.q.lock().unwrap();
        let n = q.len().min(max);
        out.extend(q.drain(..n));
        Ok(n)
    }
    fn wait(&self, d: Duration) {
        let q = self.q.lock().unwrap();
        if q.is_empty() {
            let _ = self.bell.wait_timeout(q, d);
        }
    }
}

struct QpShared {
    qpn: u32,
    recvs: Mutex<VecDeque<u64>>,
    recv_cq: Arc<Cq>,
    error: Mutex<bool>,
}

struct Qp {
    s: Arc<QpShared>,
    send_cq: Arc<Cq>,
    remote: Option<u32>,
    net: Arc<Net>,
}

impl Context for Ctx {
    fn name(&self) -> String {
        "fake0:1".into()
    }
    fn link_layer(&self) -> LinkLayer {
        LinkLayer::Ethernet
    }
    fn lid(&self) -> u16 {
        0
    }
    fn gid(&self, _index: u8) -> Result<[u8; 16]> {
        Ok([0; 16])
    }
    fn alloc(&self, len: usize) -> Result<Box<dyn Region>> {
        let key = self.0.next.fetch_add(1, Ordering::Relaxed);
        let buf = vec![0u64; len.div_ceil(8)].into_boxed_slice();
        self.0
            .regions
            .lock()
            .unwrap()
            .insert(key, (buf.as_ptr() as usize, len));
        Ok(Box::new(Mem {
            buf,
            len,
            key,
            net: self.0.clone(),
        }))
    }
    unsafe fn register(&self, _addr: *mut u8, _len: usize) -> Result<Box<dyn Region>> {
        Err(Error::Unsupported("fake".into()))
    }
    fn create_cq(&self, _depth: u32) -> Result<Arc<dyn CompletionQueue>> {
        Ok(Arc::new(Cq::default()))
    }
    fn create_qp(
        &self,
        send_cq: &Arc<dyn CompletionQueue>,
        recv_cq: &Arc<dyn CompletionQueue>,
        _caps: QpCaps,
    ) -> Result<Box<dyn QueuePair>> {
        // The fake's own CQs, found again by address.
        let cast = |c: &Arc<dyn CompletionQueue>| {
            // SAFETY: every CQ of this fabric is a `Cq` (test-only code).
            unsafe { Arc::from_raw(Arc::into_raw(c.clone()) as *const Cq) }
        };
        let qpn = self.0.next.fetch_add(1, Ordering::Relaxed);
        let s = Arc::new(QpShared {
            qpn,
            recvs: Default::default(),
            recv_cq: cast(recv_cq),
            error: Mutex::new(false),
        });
        self.0.qps.lock().unwrap().insert(qpn, s.clone());
        Ok(Box::new(Qp {
            s,
            send_cq: cast(send_cq),
            remote: None,
            net: self.0.clone(),
        }))
    }
}

impl Qp {
    fn flush_all(&self) {
        *self.s.error.lock().unwrap() = true;
        for id in self.s.recvs.lock().unwrap().drain(..) {
            self.s.recv_cq.push(wc(id, WcStatus::WrFlush, self.s.qpn));
        }
    }
}

fn wc(wr_id: u64, status: WcStatus, qpn: u32) -> Completion {
    Completion {
        wr_id,
        status,
        opcode: WcOpcode::Unknown,
        byte_len: 0,
        imm: 0,
        qpn,
    }
}

impl QueuePair for Qp {
    fn qpn(&self) -> u32 {
        self.s.qpn
    }
    fn state(&self) -> QpState {
        QpState::Rts
    }
    fn endpoint(&self, psn: u32, _gid_index: u8) -> Result<Endpoint> {
        Ok(Endpoint {
            lid: 0,
            gid: [0; 16],
            qpn: self.s.qpn,
            psn,
        })
    }
    fn to_init(&mut self) -> Result<()> {
        Ok(())
    }
    fn to_rtr(&mut self, remote: &Endpoint, _path: &PathSettings) -> Result<()> {
        self.remote = Some(remote.qpn);
        Ok(())
    }
    fn to_rts(&mut self, _psn: u32, _path: &PathSettings) -> Result<()> {
        Ok(())
    }
    fn to_error(&mut self) -> Result<()> {
        self.flush_all();
        Ok(())
    }
    fn post_recv(&mut self, wr_id: u64) -> Result<()> {
        if *self.s.error.lock().unwrap() {
            self.s
                .recv_cq
                .push(wc(wr_id, WcStatus::WrFlush, self.s.qpn));
        } else {
            self.s.recvs.lock().unwrap().push_back(wr_id);
        }
        Ok(())
    }
    fn post_write(
        &mut self,
        wr_id: u64,
        local: Sge,
        remote: RemoteAddr,
        imm: Option<u32>,
        signaled: bool,
    ) -> Result<()> {
        let qpn = self.s.qpn;
        if *self.s.error.lock().unwrap() {
            self.send_cq.push(wc(wr_id, WcStatus::WrFlush, qpn));
            return Ok(());
        }
        let peer = self
            .remote
            .and_then(|r| self.net.qps.lock().unwrap().get(&r).cloned());
        let regions = self.net.regions.lock().unwrap();
        let target = regions.get(&remote.rkey).copied();
        let fail = self.net.fail_write.load(Ordering::Relaxed);
        let forced = fail > 0 && imm.is_some_and(|i| i >> 31 == 0) && {
            self.net.fail_write.store(fail - 1, Ordering::Relaxed);
            fail == 1
        };
        let ok = match (&peer, target) {
            (Some(_), Some((base, len))) if !forced => {
                remote.addr as usize >= base
                    && remote.addr as usize + local.len as usize <= base + len
            }
            _ => false,
        };
        if !ok {
            drop(regions);
            self.send_cq.push(wc(wr_id, WcStatus::RemoteAccess, qpn));
            self.flush_all();
            if let Some(p) = peer {
                *p.error.lock().unwrap() = true;
            }
            return Ok(());
        }
        // SAFETY: both ranges were checked against live regions of this fabric (held by the
        // region lock), and the link gives the target bytes to the writer.
        unsafe {
            std::ptr::copy(
                local.addr as *const u8,
                remote.addr as *mut u8,
                local.len as usize,
            )
        };
        drop(regions);
        let peer = peer.expect("checked");
        if let Some(imm) = imm {
            let Some(id) = peer.recvs.lock().unwrap().pop_front() else {
                self.send_cq
                    .push(wc(wr_id, WcStatus::RnrRetryExceeded, qpn));
                return Ok(());
            };
            peer.recv_cq.push(Completion {
                wr_id: id,
                status: WcStatus::Success,
                opcode: WcOpcode::RecvWriteImm,
                byte_len: local.len,
                imm,
                qpn: peer.qpn,
            });
        }
        if signaled {
            self.send_cq.push(Completion {
                opcode: WcOpcode::Write,
                ..wc(wr_id, WcStatus::Success, qpn)
            });
        }
        Ok(())
    }
}
