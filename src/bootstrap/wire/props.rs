//! Properties of the bootstrap decoders over random and mutated bytes: never a panic, never
//! more decoded than the limits in the module docs allow, and a valid message round-trips.

use super::*;
use crate::test_alloc::requested;
use proptest::prelude::*;

const VERSION: u32 = crate::bootstrap::PROTOCOL_VERSION;

/// The smallest table entry: rank, pid, address, three empty length-prefixed fields.
const MIN_ENTRY: usize = 4 + 4 + 19 + 2 + 2 + 2;

fn addr() -> impl Strategy<Value = SocketAddr> {
    prop_oneof![
        (any::<[u8; 4]>(), any::<u16>()).prop_map(|(ip, port)| SocketAddr::from((ip, port))),
        (any::<[u8; 16]>(), any::<u16>())
            .prop_map(|(ip, port)| SocketAddr::new(IpAddr::V6(Ipv6Addr::from(ip)), port)),
    ]
}

/// Host ids up to the limit, multi-byte characters included.
fn host_id() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "\\PC{0,40}",
        1 => Just("h".repeat(MAX_HOST_ID_LEN)),
        1 => Just("é".repeat(MAX_HOST_ID_LEN / 2)),
    ]
}

/// CPU lists as the decoder returns them: ascending, distinct, within the mask's limit.
fn cpus() -> impl Strategy<Value = Vec<usize>> {
    prop_oneof![
        4 => proptest::collection::btree_set(0..MAX_CPU_MASK_LEN * 8, 0..20),
        1 => Just((0..MAX_CPU_MASK_LEN * 8).collect()),
    ]
    .prop_map(|s| s.into_iter().collect())
}

fn peer() -> impl Strategy<Value = PeerInfo> {
    (
        any::<u32>(),
        host_id(),
        host_id(),
        addr(),
        any::<u32>(),
        cpus(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(rank, host_id, machine_id, addr, pid, cpus, rdma, cuda_ipc)| PeerInfo {
                rank: rank as usize,
                host_id,
                machine_id,
                addr,
                pid,
                cpus,
                rdma,
                cuda_ipc,
            },
        )
}

fn world() -> impl Strategy<Value = World> {
    (any::<u64>(), proptest::collection::vec(peer(), 0..6))
        .prop_map(|(comm_id, peers)| World { comm_id, peers })
}

/// Body (length prefix stripped) of a framed message, checking the prefix on the way.
fn body(frame: &[u8]) -> Vec<u8> {
    let len = u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize;
    assert_eq!(len, frame.len() - 4, "length prefix");
    frame[4..].to_vec()
}

/// One change to a valid encoding.
#[derive(Debug, Clone)]
enum Mutation {
    /// Replaces the byte at (index modulo length).
    Set(usize, u8),
    /// XORs a bit into the byte at (index modulo length).
    Flip(usize, u8),
    /// Keeps the first (n modulo length + 1) bytes.
    Truncate(usize),
    /// Appends bytes.
    Extend(Vec<u8>),
    /// Writes a little-endian u16 or u32 at (index modulo length), as a length field: huge,
    /// just past a limit, or random.
    Length(usize, u32, bool),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let big = prop_oneof![
        Just(u32::MAX),
        Just(u16::MAX as u32),
        Just(MAX_HOST_ID_LEN as u32 + 1),
        Just(MAX_WORLD_SIZE as u32 + 1),
        Just(MAX_REPLY_LEN as u32),
        any::<u32>(),
    ];
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, v)| Mutation::Set(i, v)),
        (any::<usize>(), 0..8u8).prop_map(|(i, b)| Mutation::Flip(i, 1 << b)),
        any::<usize>().prop_map(Mutation::Truncate),
        proptest::collection::vec(any::<u8>(), 1..64).prop_map(Mutation::Extend),
        (any::<usize>(), big, any::<bool>()).prop_map(|(i, v, wide)| Mutation::Length(i, v, wide)),
    ]
}

fn mutate(b: &mut Vec<u8>, muts: &[Mutation]) {
    for m in muts {
        let n = b.len();
        match m {
            Mutation::Set(i, v) if n > 0 => b[i % n] = *v,
            Mutation::Flip(i, x) if n > 0 => b[i % n] ^= x,
            Mutation::Truncate(k) if n > 0 => b.truncate(k % n),
            Mutation::Extend(more) => b.extend_from_slice(more),
            Mutation::Length(i, v, wide) if n > 0 => {
                let bytes = if *wide {
                    v.to_le_bytes().to_vec()
                } else {
                    (*v as u16).to_le_bytes().to_vec()
                };
                let at = i % n;
                let end = (at + bytes.len()).min(n);
                b[at..end].copy_from_slice(&bytes[..end - at]);
            }
            _ => {}
        }
    }
}

/// Heap bytes of one decoded peer's variable parts.
fn peer_heap(p: &PeerInfo) -> (usize, usize) {
    (p.host_id.len() + p.machine_id.len(), p.cpus.len())
}

/// Checks what a decoded hello may hold: each field within its limit, and no more string
/// bytes than the body had, no more CPUs than 8 per body byte.
fn check_hello_bounds(body: &[u8], h: &Hello) {
    if let Some(p) = &h.tail {
        assert!(p.host_id.len() <= MAX_HOST_ID_LEN);
        assert!(p.machine_id.len() <= MAX_HOST_ID_LEN);
        assert!(p.cpus.len() <= MAX_CPU_MASK_LEN * 8);
        let (strings, cpus) = peer_heap(p);
        assert!(strings <= body.len() && cpus <= 8 * body.len());
        assert!(p.cpus.windows(2).all(|w| w[0] < w[1]), "CPUs ascending");
    }
}

/// Checks what a decoded reply may hold (see the module docs).
fn check_reply_bounds(body: &[u8], r: &Reply) {
    match r {
        Reply::Table(w) => {
            assert!(w.peers.len() <= MAX_WORLD_SIZE);
            assert!(w.peers.len() * MIN_ENTRY <= body.len());
            // The reservation was checked against the body, not taken from the count alone.
            assert!(w.peers.capacity() <= body.len() / 29);
            let (mut strings, mut cpus) = (0, 0);
            for p in &w.peers {
                assert!(p.host_id.len() <= MAX_HOST_ID_LEN);
                assert!(p.machine_id.len() <= MAX_HOST_ID_LEN);
                assert!(p.cpus.len() <= MAX_CPU_MASK_LEN * 8);
                let (s, c) = peer_heap(p);
                strings += s;
                cpus += c;
            }
            assert!(strings <= body.len() && cpus <= 8 * body.len());
        }
        Reply::Error { msg, .. } => assert!(msg.len() <= body.len()),
    }
}

/// The most decoding an `n`-byte body may request from the allocator, from the limits in the
/// module docs: its bytes again for strings, 64 bytes per body byte for CPU lists (8 numbers
/// of 8 bytes), the table's reservation (one entry per 29 bytes), and room for an error
/// message.
fn budget(n: usize) -> usize {
    n + 64 * n + n / 29 * std::mem::size_of::<PeerInfo>() + 4096
}

/// The most [`read_frame`] may request for a frame of which `got` bytes arrived: its first
/// reservation (64 KiB at most, whatever the prefix announces), then growth as data arrives.
fn read_budget(got: usize) -> usize {
    64 * 1024 + 4 * got + 4096
}

fn decode_hello_checked(body: &[u8]) -> Result<Hello> {
    let (r, asked) = requested(|| decode_hello(body, VERSION));
    assert!(
        asked <= budget(body.len()),
        "hello of {} bytes: {asked} bytes requested",
        body.len()
    );
    if let Ok(h) = &r {
        check_hello_bounds(body, h);
    }
    r
}

fn decode_reply_checked(body: &[u8]) -> Result<Reply> {
    let (r, asked) = requested(|| decode_reply(body));
    assert!(
        asked <= budget(body.len()),
        "reply of {} bytes: {asked} bytes requested",
        body.len()
    );
    if let Ok(reply) = &r {
        check_reply_bounds(body, reply);
    }
    r
}

/// [`read_frame`] over `data` arriving 7 bytes at a time, checking what it requested.
fn read_frame_checked(data: &[u8], max: usize) -> io::Result<Vec<u8>> {
    let mut r = Dribble { data, given: 0 };
    let (out, asked) = requested(|| read_frame(&mut r, max));
    assert!(
        asked <= read_budget(r.given),
        "{asked} bytes requested for {} read",
        r.given
    );
    out
}

/// Random bytes behind a real magic (and, for hellos, our version), so decoding gets past
/// the first check; `len` around the size of real messages.
fn with_prefix(prefix: &[u8], mut rest: Vec<u8>) -> Vec<u8> {
    let mut b = prefix.to_vec();
    b.append(&mut rest);
    b
}

/// A reader that claims whatever its first bytes say but then runs dry, counting what it gave.
struct Dribble<'a> {
    data: &'a [u8],
    given: usize,
}

impl Read for Dribble<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = buf.len().min(self.data.len() - self.given).min(7);
        buf[..n].copy_from_slice(&self.data[self.given..self.given + n]);
        self.given += n;
        Ok(n)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_bytes_never_panic(
        bytes in proptest::collection::vec(any::<u8>(), 0..4096),
        tail in proptest::collection::vec(any::<u8>(), 0..96),
        max in 0usize..8192,
    ) {
        let _ = decode_hello_checked(&bytes);
        let _ = decode_reply_checked(&bytes);
        // Past the magic (and, for a hello, the version and frozen head), at lengths around
        // those of real messages.
        let mut head = HELLO_MAGIC.to_vec();
        head.extend_from_slice(&VERSION.to_le_bytes());
        let _ = decode_hello_checked(&with_prefix(&head, tail.clone()));
        let _ = decode_hello_checked(&with_prefix(&HELLO_MAGIC, tail.clone()));
        for tag in [TAG_TABLE, TAG_ERROR, 0, 3] {
            let mut head = REPLY_MAGIC.to_vec();
            head.push(tag);
            let _ = decode_reply_checked(&with_prefix(&head, tail.clone()));
        }
        match frame_complete(&bytes, max) {
            Ok(Some(len)) => prop_assert!(len <= max && 4 + len <= bytes.len()),
            Ok(None) => {}
            Err(e) => prop_assert!(e.contains("over the limit"), "{}", e),
        }
        match read_frame_checked(&bytes, max) {
            Ok(b) => {
                prop_assert!(b.len() <= max);
                prop_assert_eq!(&b[..], &bytes[4..4 + b.len()]);
            }
            Err(e) => prop_assert!(matches!(
                e.kind(),
                io::ErrorKind::InvalidData | io::ErrorKind::UnexpectedEof
            )),
        }
    }

    #[test]
    fn valid_messages_round_trip(
        p in peer(),
        secret in any::<[u8; 16]>(),
        size in any::<u32>(),
        w in world(),
        timeout in any::<bool>(),
        msg in "\\PC{0,200}",
    ) {
        let f = encode_hello(VERSION, &secret, &p, size);
        prop_assert!(f.len() - 4 <= MAX_HELLO_LEN, "a full hello fits the root's limit");
        prop_assert_eq!(frame_complete(&f, MAX_HELLO_LEN), Ok(Some(f.len() - 4)));
        let b = read_frame(&mut &f[..], MAX_HELLO_LEN).unwrap();
        prop_assert_eq!(&b, &body(&f));
        let h = decode_hello_checked(&b).unwrap();
        prop_assert_eq!(
            h,
            Hello { version: VERSION, secret, rank: p.rank as u32, size, tail: Some(p.clone()) }
        );
        // Another version keeps the frozen head readable and leaves the tail alone.
        let f = encode_hello(VERSION + 1, &secret, &p, size);
        let h = decode_hello_checked(&body(&f)).unwrap();
        prop_assert_eq!((h.version, h.secret, h.rank, h.size), (VERSION + 1, secret, p.rank as u32, size));
        prop_assert_eq!(h.tail, None);

        let f = encode_table(&w);
        let b = read_frame(&mut &f[..], MAX_REPLY_LEN).unwrap();
        prop_assert_eq!(decode_reply_checked(&b).unwrap(), Reply::Table(w));
        let kind = if timeout { ErrorKind::Timeout } else { ErrorKind::Usage };
        let f = encode_error(kind, &msg);
        prop_assert_eq!(decode_reply_checked(&body(&f)).unwrap(), Reply::Error { kind, msg });
    }

    #[test]
    fn mutated_messages_never_panic(
        p in peer(),
        w in world(),
        msg in "\\PC{0,50}",
        muts in proptest::collection::vec(mutation(), 1..4),
        max in prop_oneof![Just(MAX_HELLO_LEN), 0usize..200],
    ) {
        let mut hello = encode_hello(VERSION, &[3; 16], &p, 9);
        mutate(&mut hello, &muts);
        let _ = decode_hello_checked(hello.get(4..).unwrap_or_default());
        // The framed bytes as the root and a rank read them, length prefix mutated too.
        let _ = frame_complete(&hello, max);
        if let Ok(b) = read_frame_checked(&hello, max) {
            prop_assert!(b.len() <= max);
            let _ = decode_hello_checked(&b);
        }
        for mut reply in [encode_table(&w), encode_error(ErrorKind::Usage, &msg)] {
            mutate(&mut reply, &muts);
            let _ = decode_reply_checked(reply.get(4..).unwrap_or_default());
            if let Ok(b) = read_frame_checked(&reply, MAX_REPLY_LEN) {
                let _ = decode_reply_checked(&b);
            }
        }
    }
}

/// Each length field set to a huge value is refused with an error naming it, and no more
/// than the body is ever read or reserved.
#[test]
fn huge_length_fields_are_refused() {
    let p = PeerInfo {
        rank: 1,
        host_id: "h".into(),
        machine_id: "m".into(),
        addr: "127.0.0.1:9".parse().unwrap(),
        pid: 5,
        cpus: vec![1, 2],
        rdma: false,
        cuda_ipc: false,
    };
    let hello = body(&encode_hello(VERSION, &[0; 16], &p, 2));
    // Host id, machine id and CPU mask lengths (u16) at their offsets.
    for (at, what) in [(55, "host id"), (58, "host id"), (61, "CPU mask")] {
        let mut b = hello.clone();
        b[at..at + 2].copy_from_slice(&u16::MAX.to_le_bytes());
        let e = decode_hello_checked(&b).unwrap_err().to_string();
        assert!(
            e.contains(&format!("{what} of 65535 bytes exceeds the limit")),
            "{e}"
        );
    }
    let table = body(&encode_table(&World {
        comm_id: 1,
        peers: vec![p],
    }));
    // The rank count (u32 at 13): over the world limit, then within it but past the body.
    let mut b = table.clone();
    b[13..17].copy_from_slice(&u32::MAX.to_le_bytes());
    let e = decode_reply_checked(&b).unwrap_err().to_string();
    assert!(
        e.contains("table of 4294967295 ranks exceeds the limit"),
        "{e}"
    );
    let mut b = table.clone();
    b[13..17].copy_from_slice(&(MAX_WORLD_SIZE as u32).to_le_bytes());
    let e = decode_reply_checked(&b).unwrap_err().to_string();
    assert!(e.contains("truncated"), "{e}");
    // The error message length (u32 at 6).
    let mut b = body(&encode_error(ErrorKind::Usage, "x"));
    b[6..10].copy_from_slice(&u32::MAX.to_le_bytes());
    let e = decode_reply_checked(&b).unwrap_err().to_string();
    assert!(e.contains("needs 4294967295 more bytes, has 1"), "{e}");

    // A frame announcing the limit but backed by 10 bytes: read_frame gives up after what
    // arrived, without reserving the announced size.
    let mut f = (MAX_REPLY_LEN as u32).to_le_bytes().to_vec();
    f.extend_from_slice(&[0; 10]);
    let mut r = Dribble { data: &f, given: 0 };
    let (e, asked) = requested(|| read_frame(&mut r, MAX_REPLY_LEN).unwrap_err());
    assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    assert_eq!(r.given, f.len());
    assert!(asked <= read_budget(f.len()), "{asked} bytes requested");
    // Over the limit: refused on the prefix alone.
    let mut f = (MAX_HELLO_LEN as u32 + 1).to_le_bytes().to_vec();
    f.extend_from_slice(&[0; 10]);
    let mut r = Dribble { data: &f, given: 0 };
    let e = read_frame(&mut r, MAX_HELLO_LEN).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    assert_eq!(r.given, 4);
    assert!(frame_complete(&f, MAX_HELLO_LEN).is_err());
}
