//! Bootstrap wire format: hand-written, little-endian, length-prefixed.
//!
//! Every message is one frame: `u32 LE body length`, then the body. The root reads hellos of at
//! most [`MAX_HELLO_LEN`] bytes, so a stranger cannot make it allocate more than that; a rank
//! reads replies of at most [`MAX_REPLY_LEN`] bytes, and only as fast as they arrive.
//!
//! The decoders check every length field against its limit ([`MAX_HOST_ID_LEN`],
//! [`MAX_CPU_MASK_LEN`], [`MAX_WORLD_SIZE`]) and against the bytes left in the body before
//! they allocate, so a decoded message holds no more string bytes than its body, at most one
//! table entry per 29 body bytes, and at most 8 CPU numbers per body byte (a CPU mask is a
//! bit set; the decoded list holds one `usize` per set bit). A decoded hello therefore holds
//! at most two 1 KiB strings and 8192 CPU numbers (64 KiB). The properties in `wire/props.rs`
//! check this over random and mutated bytes.
//!
//! Hello (rank → root). The first 32 bytes are frozen across protocol versions, so that a root
//! can name the rank and both versions when they differ:
//!
//! | offset | size | field                                                    |
//! |--------|------|----------------------------------------------------------|
//! | 0      | 4    | magic `b"QCHI"`                                          |
//! | 4      | 4    | protocol version (u32)                                   |
//! | 8      | 16   | secret from the unique id                                |
//! | 24     | 4    | rank (u32)                                               |
//! | 28     | 4    | world size (u32)                                         |
//! | 32     | 4    | pid (u32) — version 1 from here on                       |
//! | 36     | 19   | transport listen address (see below)                     |
//! | 55     | 2+n  | host id: u16 length, then UTF-8 bytes                    |
//!
//! An address is 19 bytes: family (4 or 6), port (u16), 16 IP bytes (IPv4 in the first 4).
//!
//! Reply (root → rank): magic `b"QCRP"`, then a tag byte.
//! - tag 1, table: comm id (u64), count (u32), then per rank in rank order: rank (u32),
//!   pid (u32), address (19 bytes), host id (u16 length + bytes).
//! - tag 2, error (frozen across versions): kind (u8: 1 usage, 2 timeout), message (u32 length
//!   + UTF-8 bytes).

use super::peer::{PeerInfo, World};
use crate::error::{Error, Result};
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Magic opening a hello.
pub(crate) const HELLO_MAGIC: [u8; 4] = *b"QCHI";
/// Magic opening a reply.
pub(crate) const REPLY_MAGIC: [u8; 4] = *b"QCRP";
/// Largest hello body the root accepts.
pub(crate) const MAX_HELLO_LEN: usize = 4096;
/// Largest reply body a rank accepts.
pub(crate) const MAX_REPLY_LEN: usize = 128 << 20;
/// Longest host id, in bytes.
pub(crate) const MAX_HOST_ID_LEN: usize = 1024;
/// Longest CPU mask, in bytes (8192 CPUs).
pub(crate) const MAX_CPU_MASK_LEN: usize = 1024;
/// Largest world size the bootstrap accepts.
pub(crate) const MAX_WORLD_SIZE: usize = 1 << 18;
/// Length of the frozen hello prefix.
pub(crate) const HELLO_HEAD_LEN: usize = 32;

const TAG_TABLE: u8 = 1;
const TAG_ERROR: u8 = 2;

/// What kind of error the root reports; the rank maps it to an [`Error`] variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorKind {
    /// The ranks disagree or a stranger knocked: `Error::InvalidUsage`.
    Usage = 1,
    /// The init deadline passed: `Error::Timeout`.
    Timeout = 2,
}

/// A decoded hello. `tail` is `None` when the version differs from ours (its layout is unknown).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hello {
    pub version: u32,
    pub secret: [u8; 16],
    pub rank: u32,
    pub size: u32,
    pub tail: Option<PeerInfo>,
}

/// A decoded reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply {
    Table(World),
    Error { kind: ErrorKind, msg: String },
}

fn malformed(what: &str, detail: impl std::fmt::Display) -> Error {
    Error::InvalidUsage(format!("malformed {what}: {detail}"))
}

/// Little-endian reader over a message body; errors name the message and the offset.
struct Rd<'a> {
    b: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Rd<'a> {
    fn new(b: &'a [u8], what: &'static str) -> Rd<'a> {
        Rd { b, pos: 0, what }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let left = self.b.len() - self.pos;
        if left < n {
            return Err(malformed(
                self.what,
                format!(
                    "truncated at offset {}: needs {n} more bytes, has {left}",
                    self.pos
                ),
            ));
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.arr()?))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr()?))
    }

    fn str(&mut self, len: usize) -> Result<String> {
        let at = self.pos;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| malformed(self.what, format!("string at offset {at} is not UTF-8")))
    }

    fn addr(&mut self) -> Result<SocketAddr> {
        let at = self.pos;
        let family = self.u8()?;
        let port = self.u16()?;
        let ip: [u8; 16] = self.arr()?;
        match family {
            4 => Ok(SocketAddr::new(
                IpAddr::V4(Ipv4Addr::new(ip[0], ip[1], ip[2], ip[3])),
                port,
            )),
            6 => Ok(SocketAddr::new(IpAddr::V6(Ipv6Addr::from(ip)), port)),
            f => Err(malformed(
                self.what,
                format!("address family {f} at offset {at} (expected 4 or 6)"),
            )),
        }
    }

    fn finish(&self) -> Result<()> {
        if self.pos != self.b.len() {
            return Err(malformed(
                self.what,
                format!("{} trailing bytes", self.b.len() - self.pos),
            ));
        }
        Ok(())
    }
}

fn put_addr(out: &mut Vec<u8>, addr: &SocketAddr) {
    let mut ip = [0u8; 16];
    let family = match addr.ip() {
        IpAddr::V4(v4) => {
            ip[..4].copy_from_slice(&v4.octets());
            4
        }
        IpAddr::V6(v6) => {
            ip = v6.octets();
            6
        }
    };
    out.push(family);
    out.extend_from_slice(&addr.port().to_le_bytes());
    out.extend_from_slice(&ip);
}

fn put_host_id(out: &mut Vec<u8>, host_id: &str) {
    // Callers check the length; clamp anyway so the prefix never lies.
    let b = &host_id.as_bytes()[..host_id.len().min(MAX_HOST_ID_LEN)];
    out.extend_from_slice(&(b.len() as u16).to_le_bytes());
    out.extend_from_slice(b);
}

fn host_id(rd: &mut Rd<'_>) -> Result<String> {
    let len = rd.u16()? as usize;
    if len > MAX_HOST_ID_LEN {
        return Err(malformed(
            rd.what,
            format!("host id of {len} bytes exceeds the limit of {MAX_HOST_ID_LEN}"),
        ));
    }
    rd.str(len)
}

/// A CPU list as a bit mask (bit c of byte c / 8), trimmed after the highest CPU; CPUs past
/// the mask's limit are left out.
fn put_cpus(out: &mut Vec<u8>, cpus: &[usize]) {
    let len = cpus
        .iter()
        .filter(|&&c| c < MAX_CPU_MASK_LEN * 8)
        .map(|&c| c / 8 + 1)
        .max()
        .unwrap_or(0);
    let mut mask = vec![0u8; len];
    for &c in cpus.iter().filter(|&&c| c / 8 < len) {
        mask[c / 8] |= 1 << (c % 8);
    }
    out.extend_from_slice(&(len as u16).to_le_bytes());
    out.extend_from_slice(&mask);
}

fn cpus(rd: &mut Rd<'_>) -> Result<Vec<usize>> {
    let len = rd.u16()? as usize;
    if len > MAX_CPU_MASK_LEN {
        return Err(malformed(
            rd.what,
            format!("CPU mask of {len} bytes exceeds the limit of {MAX_CPU_MASK_LEN}"),
        ));
    }
    let mask = rd.take(len)?;
    // One reservation of exactly the list's size: a usize per set bit.
    let mut list = Vec::with_capacity(mask.iter().map(|b| b.count_ones() as usize).sum());
    list.extend((0..len * 8).filter(|&c| mask[c / 8] & (1 << (c % 8)) != 0));
    Ok(list)
}

/// A 0/1 byte.
fn flag(rd: &mut Rd<'_>) -> Result<bool> {
    match rd.u8()? {
        0 => Ok(false),
        1 => Ok(true),
        b => Err(malformed(rd.what, format!("flag byte {b} is not 0 or 1"))),
    }
}

/// Frame: length prefix then body.
fn framed(body: Vec<u8>) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Encodes a hello frame (length prefix included).
pub(crate) fn encode_hello(version: u32, secret: &[u8; 16], me: &PeerInfo, size: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(64 + me.host_id.len());
    b.extend_from_slice(&HELLO_MAGIC);
    b.extend_from_slice(&version.to_le_bytes());
    b.extend_from_slice(secret);
    b.extend_from_slice(&(me.rank as u32).to_le_bytes());
    b.extend_from_slice(&size.to_le_bytes());
    b.extend_from_slice(&me.pid.to_le_bytes());
    put_addr(&mut b, &me.addr);
    put_host_id(&mut b, &me.host_id);
    put_host_id(&mut b, &me.machine_id);
    put_cpus(&mut b, &me.cpus);
    b.push(u8::from(me.rdma));
    b.push(u8::from(me.cuda_ipc));
    framed(b)
}

/// Decodes a hello body. The tail is parsed only when `version == ours`.
pub(crate) fn decode_hello(body: &[u8], ours: u32) -> Result<Hello> {
    let mut rd = Rd::new(body, "hello");
    let magic: [u8; 4] = rd.arr()?;
    if magic != HELLO_MAGIC {
        return Err(malformed(
            "hello",
            format!("magic {magic:02x?} is not {HELLO_MAGIC:02x?} (\"QCHI\")"),
        ));
    }
    let version = rd.u32()?;
    let secret = rd.arr()?;
    let rank = rd.u32()?;
    let size = rd.u32()?;
    let tail = if version == ours {
        let pid = rd.u32()?;
        let addr = rd.addr()?;
        let host_id = host_id(&mut rd)?;
        let machine_id = self::host_id(&mut rd)?;
        let cpus = self::cpus(&mut rd)?;
        let rdma = flag(&mut rd)?;
        let cuda_ipc = flag(&mut rd)?;
        rd.finish()?;
        Some(PeerInfo {
            rank: rank as usize,
            host_id,
            machine_id,
            addr,
            pid,
            cpus,
            rdma,
            cuda_ipc,
        })
    } else {
        None
    };
    Ok(Hello {
        version,
        secret,
        rank,
        size,
        tail,
    })
}

/// Encodes a table reply frame.
pub(crate) fn encode_table(world: &World) -> Vec<u8> {
    let mut b = Vec::with_capacity(20 + world.peers.len() * 64);
    b.extend_from_slice(&REPLY_MAGIC);
    b.push(TAG_TABLE);
    b.extend_from_slice(&world.comm_id.to_le_bytes());
    b.extend_from_slice(&(world.peers.len() as u32).to_le_bytes());
    for p in &world.peers {
        b.extend_from_slice(&(p.rank as u32).to_le_bytes());
        b.extend_from_slice(&p.pid.to_le_bytes());
        put_addr(&mut b, &p.addr);
        put_host_id(&mut b, &p.host_id);
        put_host_id(&mut b, &p.machine_id);
        put_cpus(&mut b, &p.cpus);
        b.push(u8::from(p.rdma));
        b.push(u8::from(p.cuda_ipc));
    }
    framed(b)
}

/// Encodes an error reply frame.
pub(crate) fn encode_error(kind: ErrorKind, msg: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(14 + msg.len());
    b.extend_from_slice(&REPLY_MAGIC);
    b.push(TAG_ERROR);
    b.push(kind as u8);
    b.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    b.extend_from_slice(msg.as_bytes());
    framed(b)
}

/// Decodes a reply body.
pub(crate) fn decode_reply(body: &[u8]) -> Result<Reply> {
    let mut rd = Rd::new(body, "reply");
    let magic: [u8; 4] = rd.arr()?;
    if magic != REPLY_MAGIC {
        return Err(malformed(
            "reply",
            format!("magic {magic:02x?} is not {REPLY_MAGIC:02x?} (\"QCRP\")"),
        ));
    }
    let reply = match rd.u8()? {
        TAG_TABLE => {
            let comm_id = rd.u64()?;
            let n = rd.u32()? as usize;
            if n > MAX_WORLD_SIZE {
                return Err(malformed(
                    "reply",
                    format!("table of {n} ranks exceeds the limit of {MAX_WORLD_SIZE}"),
                ));
            }
            // Each entry is at least 30 bytes: never reserve more than the body can hold.
            let mut peers = Vec::with_capacity(n.min(body.len() / 30));
            for _ in 0..n {
                let rank = rd.u32()? as usize;
                let pid = rd.u32()?;
                let addr = rd.addr()?;
                let host_id = host_id(&mut rd)?;
                let machine_id = self::host_id(&mut rd)?;
                let cpus = self::cpus(&mut rd)?;
                let rdma = flag(&mut rd)?;
                let cuda_ipc = flag(&mut rd)?;
                peers.push(PeerInfo {
                    rank,
                    host_id,
                    machine_id,
                    addr,
                    pid,
                    cpus,
                    rdma,
                    cuda_ipc,
                });
            }
            Reply::Table(World { comm_id, peers })
        }
        TAG_ERROR => {
            let kind = match rd.u8()? {
                1 => ErrorKind::Usage,
                2 => ErrorKind::Timeout,
                k => return Err(malformed("reply", format!("unknown error kind {k}"))),
            };
            let len = rd.u32()? as usize;
            let msg = rd.str(len)?;
            Reply::Error { kind, msg }
        }
        t => return Err(malformed("reply", format!("unknown tag {t}"))),
    };
    rd.finish()?;
    Ok(reply)
}

/// Writes one already-framed message.
pub(crate) fn write_frame(w: &mut impl Write, frame: &[u8]) -> io::Result<()> {
    w.write_all(frame)?;
    w.flush()
}

/// Reads one frame body of at most `max` bytes from a blocking stream. The buffer grows only as
/// data arrives, so a lying length prefix costs nothing. A body over `max` is `InvalidData`.
pub(crate) fn read_frame(r: &mut impl Read, max: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("message of {len} bytes exceeds the limit of {max}"),
        ));
    }
    let mut body = Vec::with_capacity(len.min(64 * 1024));
    r.take(len as u64).read_to_end(&mut body)?;
    if body.len() != len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "connection closed after {} of {len} message bytes",
                body.len()
            ),
        ));
    }
    Ok(body)
}

/// For incremental (non-blocking) reading: given the bytes received so far, returns the body
/// length once the whole frame is in `buf`, `None` while incomplete, or an error message when
/// the announced length exceeds `max`.
pub(crate) fn frame_complete(buf: &[u8], max: usize) -> std::result::Result<Option<usize>, String> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    if len > max {
        return Err(format!(
            "announced a message of {len} bytes, over the limit of {max}"
        ));
    }
    Ok((buf.len() >= 4 + len).then_some(len))
}

#[cfg(test)]
mod props;

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(rank: usize) -> PeerInfo {
        PeerInfo {
            rank,
            host_id: format!("host-{rank}"),
            machine_id: format!("m-{}", rank / 2),
            addr: if rank.is_multiple_of(2) {
                "127.0.0.1:4000".parse().unwrap()
            } else {
                "[fd00::2]:4001".parse().unwrap()
            },
            pid: 77 + rank as u32,
            cpus: [vec![], vec![3], vec![0, 7, 8, 63], vec![1000]][rank % 4].clone(),
            rdma: rank % 3 == 1,
            cuda_ipc: rank.is_multiple_of(2),
        }
    }

    #[test]
    fn cpu_masks_roundtrip_and_are_bounded() {
        for list in [
            vec![],
            vec![0],
            vec![1, 8, 9, 63, 1000],
            vec![MAX_CPU_MASK_LEN * 8 - 1],
        ] {
            let mut b = Vec::new();
            put_cpus(&mut b, &list);
            assert_eq!(cpus(&mut Rd::new(&b, "t")).unwrap(), list);
        }
        // A CPU past the mask's limit is left out rather than sent wrong.
        let mut b = Vec::new();
        put_cpus(&mut b, &[2, MAX_CPU_MASK_LEN * 8]);
        assert_eq!(cpus(&mut Rd::new(&b, "t")).unwrap(), [2]);
        let mut b = ((MAX_CPU_MASK_LEN + 1) as u16).to_le_bytes().to_vec();
        b.resize(b.len() + MAX_CPU_MASK_LEN + 1, 0xff);
        let e = cpus(&mut Rd::new(&b, "t")).unwrap_err().to_string();
        assert!(e.contains("CPU mask of 1025 bytes"), "{e}");
    }

    #[test]
    fn hello_roundtrip_and_version_head() {
        let f = encode_hello(1, &[7; 16], &peer(3), 5);
        assert_eq!(frame_complete(&f, MAX_HELLO_LEN), Ok(Some(f.len() - 4)));
        assert_eq!(frame_complete(&f[..f.len() - 1], MAX_HELLO_LEN), Ok(None));
        let h = decode_hello(&f[4..], 1).unwrap();
        assert_eq!((h.version, h.rank, h.size, h.secret), (1, 3, 5, [7; 16]));
        assert_eq!(h.tail, Some(peer(3)));
        // Another version: the frozen head is readable, the tail is not parsed.
        let f2 = encode_hello(2, &[7; 16], &peer(1), 5);
        let h2 = decode_hello(&f2[4..], 1).unwrap();
        assert_eq!((h2.version, h2.rank, h2.tail), (2, 1, None));
        // Truncation and bad magic are errors, not panics.
        for cut in 0..f.len() - 4 {
            assert!(decode_hello(&f[4..4 + cut], 1).is_err(), "cut {cut}");
        }
        let mut bad = f[4..].to_vec();
        bad[0] = b'X';
        assert!(decode_hello(&bad, 1)
            .unwrap_err()
            .to_string()
            .contains("magic"));
    }

    #[test]
    fn reply_roundtrip() {
        let w = World {
            comm_id: 0xdead_beef_1234,
            peers: (0..4).map(peer).collect(),
        };
        let f = encode_table(&w);
        let body = read_frame(&mut &f[..], MAX_REPLY_LEN).unwrap();
        assert_eq!(decode_reply(&body).unwrap(), Reply::Table(w));
        let e = encode_error(ErrorKind::Timeout, "ranks [2] did not join");
        let body = read_frame(&mut &e[..], MAX_REPLY_LEN).unwrap();
        assert_eq!(
            decode_reply(&body).unwrap(),
            Reply::Error {
                kind: ErrorKind::Timeout,
                msg: "ranks [2] did not join".into()
            }
        );
        for cut in 0..body.len() {
            assert!(decode_reply(&body[..cut]).is_err());
        }
    }

    #[test]
    fn frame_limits() {
        let huge = (u32::MAX).to_le_bytes();
        assert!(frame_complete(&huge, MAX_HELLO_LEN).is_err());
        let err = read_frame(&mut &huge[..], 16).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        // A length that is not backed by data fails without allocating it.
        let short = [8u8, 0, 0, 0, 1, 2];
        let err = read_frame(&mut &short[..], 16).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }
}
