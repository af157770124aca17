//! Properties of the frame header decoder over random and mutated headers: never a panic,
//! nothing allocated for a valid header, an abort never announces more than
//! [`MAX_ABORT_LEN`], and a valid header round-trips.

use super::*;
use crate::test_alloc::requested;
use proptest::prelude::*;

const COLLS: [CollKind; 12] = [
    CollKind::AllReduce,
    CollKind::ReduceScatter,
    CollKind::AllGather,
    CollKind::Broadcast,
    CollKind::Reduce,
    CollKind::AllToAll,
    CollKind::Gather,
    CollKind::Scatter,
    CollKind::SendRecv,
    CollKind::Barrier,
    CollKind::Split,
    CollKind::Setup,
];

/// Bytes the decoder ignores (padding): zero in every encoded header.
const RESERVED: [std::ops::Range<usize>; 2] = [9..12, 32..HEADER_LEN];

fn header() -> impl Strategy<Value = Header> {
    let desc = (
        0..COLLS.len(),
        any::<u8>(),
        any::<u8>(),
        any::<u8>(),
        any::<u32>(),
        any::<u64>(),
    )
        .prop_map(|(c, dtype, op, algo, root, count)| OpDesc {
            coll: COLLS[c],
            dtype,
            op,
            algo,
            root,
            count,
        });
    let len = prop_oneof![any::<u64>(), 0..=MAX_ABORT_LEN];
    (any::<bool>(), desc, len).prop_map(|(abort, desc, len)| Header {
        kind: if abort {
            FrameKind::Abort
        } else {
            FrameKind::Data
        },
        desc,
        len,
    })
}

/// Decodes, checking what a header may claim and that decoding it allocated nothing (an
/// error allocates its message only).
fn decode_checked(b: &[u8; HEADER_LEN]) -> Result<Header> {
    let (r, asked) = requested(|| Header::decode(b, 5));
    match &r {
        Ok(h) => {
            assert_eq!(asked, 0, "a valid header allocates nothing");
            assert!(h.kind == FrameKind::Data || h.len <= MAX_ABORT_LEN);
            // What was decoded is all the header says: re-encoding gives the same bytes, but
            // for the padding.
            let mut want = *b;
            for r in RESERVED {
                want[r].fill(0);
            }
            assert_eq!(h.encode(), want);
        }
        Err(e) => {
            assert!(asked <= 1024, "{asked} bytes requested for an error");
            let e = e.to_string();
            assert!(e.contains("rank 5 sent a malformed frame"), "{e}");
        }
    }
    r
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn random_headers_never_panic(b in any::<[u8; HEADER_LEN]>(), kind in 0u8..4, coll in 0u8..14) {
        let _ = decode_checked(&b);
        // With the magic, and a kind and collective near the valid ones, to reach the later
        // checks.
        let mut b = b;
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = kind;
        b[5] = coll;
        let r = decode_checked(&b);
        prop_assert_eq!(
            r.is_ok(),
            (1..=2).contains(&kind)
                && (1..=12).contains(&coll)
                && (kind == 1 || u64::from_le_bytes(b[24..32].try_into().unwrap()) <= MAX_ABORT_LEN)
        );
    }

    #[test]
    fn headers_round_trip(h in header()) {
        let b = h.encode();
        for r in RESERVED {
            prop_assert!(b[r].iter().all(|&x| x == 0));
        }
        let r = decode_checked(&b);
        if h.kind == FrameKind::Abort && h.len > MAX_ABORT_LEN {
            let e = r.unwrap_err().to_string();
            prop_assert!(e.contains("oversized abort reason"), "{}", e);
        } else {
            let d = r.unwrap();
            prop_assert_eq!(d, h);
            // A data header's length is taken as is, then checked against the expected one.
            prop_assert!(d.check(&h.desc, h.len as usize, 5, 0).is_ok() || h.len > usize::MAX as u64);
            prop_assert!(d.check(&h.desc, (h.len as usize).wrapping_add(1), 5, 0).is_err());
        }
    }

    #[test]
    fn mutated_headers_never_panic(
        h in header(),
        sets in proptest::collection::vec((0..HEADER_LEN, any::<u8>()), 1..4),
        huge in prop_oneof![Just(u64::MAX), Just(MAX_ABORT_LEN + 1), any::<u64>()],
        set_len in any::<bool>(),
    ) {
        let mut b = h.encode();
        for (at, v) in sets {
            b[at] = v;
        }
        if set_len {
            b[24..32].copy_from_slice(&huge.to_le_bytes());
        }
        if let Ok(d) = decode_checked(&b) {
            // Whatever survives the mutation still states a sane length to read next.
            prop_assert!(d.kind == FrameKind::Data || d.len <= MAX_ABORT_LEN);
        }
    }
}
