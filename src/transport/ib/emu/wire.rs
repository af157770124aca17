//! The emulated NIC's wire format. A connection carries one queue pair's requests: it opens
//! with a hello (the job's secret, the target and source QPNs) and the NIC's answer, then the
//! initiator sends requests (a fixed header, then a write's payload) and the responder answers
//! each with a fixed-size response, in order. All integers are little-endian.

use std::io::{self, ErrorKind, Read};
use std::net::TcpStream;

const HELLO_MAGIC: u32 = 0x5143_4942; // "QCIB"
const ACCEPT_MAGIC: u32 = 0x5143_4941; // "QCIA"
const REFUSE_MAGIC: u32 = 0x5143_4952; // "QCIR"
/// Bumped when any message below changes.
const VERSION: u32 = 1;

/// Bytes of a hello.
pub const HELLO_LEN: usize = 36;
/// Bytes of the NIC's answer to a hello.
pub const ANSWER_LEN: usize = 8;
/// Bytes of a request header.
pub const REQ_LEN: usize = 32;
/// Bytes of a response.
pub const RESP_LEN: usize = 8;

/// What an initiator's NIC says when it connects one of its queue pairs to a peer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// The job's secret: a NIC drops a connection that does not know it.
    pub secret: [u8; 16],
    /// The responder's queue pair.
    pub target_qpn: u32,
    /// The initiator's queue pair (the responder checks it is its connected peer).
    pub source_qpn: u32,
    /// RNR retries the initiator allows (7 = forever): the responder waits for a receive
    /// on its behalf, so the payload crosses the wire once.
    pub rnr_retry: u8,
}

impl Hello {
    /// The wire form.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&VERSION.to_le_bytes());
        b[8..24].copy_from_slice(&self.secret);
        b[24..28].copy_from_slice(&self.target_qpn.to_le_bytes());
        b[28..32].copy_from_slice(&self.source_qpn.to_le_bytes());
        b[32] = self.rnr_retry;
        b
    }

    /// Checks and decodes a hello: refused (and why) unless magic, version and secret match.
    /// The secret is compared in constant time.
    pub fn decode(b: &[u8; HELLO_LEN], secret: &[u8; 16]) -> Result<Hello, String> {
        if u32_at(b, 0) != HELLO_MAGIC {
            return Err("not an emulated-NIC hello".into());
        }
        let version = u32_at(b, 4);
        if version != VERSION {
            return Err(format!("protocol version {version}, not {VERSION}"));
        }
        let diff = b[8..24]
            .iter()
            .zip(secret)
            .fold(0u8, |acc, (x, y)| acc | (x ^ y));
        if std::hint::black_box(diff) != 0 {
            return Err("wrong secret".into());
        }
        Ok(Hello {
            secret: *secret,
            target_qpn: u32_at(b, 24),
            source_qpn: u32_at(b, 28),
            rnr_retry: b[32],
        })
    }
}

/// The NIC's answer to a hello that passed the secret check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// The target queue pair exists: requests may follow.
    Accepted,
    /// No queue pair with that number on this NIC.
    UnknownQp,
}

impl Answer {
    /// The wire form.
    pub fn encode(self) -> [u8; ANSWER_LEN] {
        let (magic, code) = match self {
            Answer::Accepted => (ACCEPT_MAGIC, 0u32),
            Answer::UnknownQp => (REFUSE_MAGIC, 1),
        };
        let mut b = [0u8; ANSWER_LEN];
        b[0..4].copy_from_slice(&magic.to_le_bytes());
        b[4..8].copy_from_slice(&code.to_le_bytes());
        b
    }

    /// Reads the wire form back; `None` for anything else.
    pub fn decode(b: &[u8; ANSWER_LEN]) -> Option<Answer> {
        match (u32_at(b, 0), u32_at(b, 4)) {
            (ACCEPT_MAGIC, 0) => Some(Answer::Accepted),
            (REFUSE_MAGIC, 1) => Some(Answer::UnknownQp),
            _ => None,
        }
    }
}

/// An RDMA write as the initiator sends it; `len` payload bytes follow the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Packet sequence number (24 bits), checked by the responder.
    pub psn: u32,
    /// Target address in the responder's region.
    pub addr: u64,
    /// The responder region's key.
    pub rkey: u32,
    /// Payload bytes.
    pub len: u32,
    /// Immediate value: a write with immediate consumes a receive.
    pub imm: Option<u32>,
}

const OP_WRITE: u32 = 1;
const OP_WRITE_IMM: u32 = 2;

impl Request {
    /// The header's wire form.
    pub fn encode(&self) -> [u8; REQ_LEN] {
        let mut b = [0u8; REQ_LEN];
        let op = if self.imm.is_some() {
            OP_WRITE_IMM
        } else {
            OP_WRITE
        };
        b[0..4].copy_from_slice(&op.to_le_bytes());
        b[4..8].copy_from_slice(&self.psn.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16..20].copy_from_slice(&self.rkey.to_le_bytes());
        b[20..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..28].copy_from_slice(&self.imm.unwrap_or(0).to_le_bytes());
        b
    }

    /// Reads a header back; an error names an unknown opcode.
    pub fn decode(b: &[u8; REQ_LEN]) -> Result<Request, String> {
        let imm = match u32_at(b, 0) {
            OP_WRITE => None,
            OP_WRITE_IMM => Some(u32_at(b, 24)),
            op => return Err(format!("unknown request opcode {op}")),
        };
        Ok(Request {
            psn: u32_at(b, 4),
            addr: u64::from_le_bytes(b[8..16].try_into().unwrap()),
            rkey: u32_at(b, 16),
            len: u32_at(b, 20),
            imm,
        })
    }
}

/// The responder's answer to one request (or a sign of life while it waits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Response {
    /// Placed (and for a write with immediate, a receive consumed).
    Ack,
    /// Still waiting for a receive (RNR) or for its queue pair to reach RTR: not an
    /// answer, only keeps the initiator's ACK timer from firing.
    Waiting,
    /// No receive was posted within the initiator's RNR retries.
    NakRnr,
    /// Unknown or deregistered rkey, or outside the region.
    NakRemoteAccess,
    /// The responder dropped the request (its queue pair is in the error state, not
    /// connected to the sender, or the PSN is out of sequence). A NIC would stay silent
    /// until the initiator's transport retries run out; the emulation says so at once.
    NakDropped,
}

impl Response {
    /// The wire form, with the PSN it answers.
    pub fn encode(self, psn: u32) -> [u8; RESP_LEN] {
        let code: u32 = match self {
            Response::Ack => 0,
            Response::Waiting => 1,
            Response::NakRnr => 2,
            Response::NakRemoteAccess => 3,
            Response::NakDropped => 4,
        };
        let mut b = [0u8; RESP_LEN];
        b[0..4].copy_from_slice(&code.to_le_bytes());
        b[4..8].copy_from_slice(&psn.to_le_bytes());
        b
    }

    /// Reads a response back: what and which PSN; an error names an unknown code.
    pub fn decode(b: &[u8; RESP_LEN]) -> Result<(Response, u32), String> {
        let r = match u32_at(b, 0) {
            0 => Response::Ack,
            1 => Response::Waiting,
            2 => Response::NakRnr,
            3 => Response::NakRemoteAccess,
            4 => Response::NakDropped,
            c => return Err(format!("unknown response code {c}")),
        };
        Ok((r, u32_at(b, 4)))
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

/// How a [`read_message`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Got {
    /// The buffer is full.
    Done,
    /// The read timeout passed before the first byte (only with a read timeout set).
    Idle,
    /// The peer closed the connection before the first byte.
    Closed,
}

/// Fills `buf` from `stream`. A read timeout before the first byte is [`Got::Idle`]; once a
/// message started, the rest is waited for (it is on its way: messages are written whole).
pub fn read_message(stream: &mut TcpStream, buf: &mut [u8]) -> io::Result<Got> {
    let mut got = 0;
    while got < buf.len() {
        match stream.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(Got::Closed),
            Ok(0) => return Err(io::Error::from(ErrorKind::UnexpectedEof)),
            Ok(n) => got += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if got == 0 {
                    return Ok(Got::Idle);
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Got::Done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        let h = Hello {
            secret: [7; 16],
            target_qpn: 0x12_3456,
            source_qpn: 9,
            rnr_retry: 3,
        };
        assert_eq!(Hello::decode(&h.encode(), &[7; 16]), Ok(h));
        assert!(Hello::decode(&h.encode(), &[8; 16]).is_err());
        for a in [Answer::Accepted, Answer::UnknownQp] {
            assert_eq!(Answer::decode(&a.encode()), Some(a));
        }
        for imm in [None, Some(0xdead_beef)] {
            let r = Request {
                psn: 5,
                addr: 1 << 40,
                rkey: 77,
                len: 4096,
                imm,
            };
            assert_eq!(Request::decode(&r.encode()), Ok(r));
        }
        for r in [
            Response::Ack,
            Response::Waiting,
            Response::NakRnr,
            Response::NakRemoteAccess,
            Response::NakDropped,
        ] {
            assert_eq!(Response::decode(&r.encode(11)), Ok((r, 11)));
        }
        assert!(Response::decode(&[9, 0, 0, 0, 0, 0, 0, 0]).is_err());
    }
}
