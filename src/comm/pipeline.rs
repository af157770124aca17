//! A three-stage pipeline over the pieces of one large operation: the first and last stage of
//! every piece run on the caller's thread, the middle stage on a second thread, so that the
//! middle stage of piece i (the hierarchical all-reduce's network phase) runs while the caller
//! does the first stage of piece i+1 (its shared-memory phase), as NCCL overlaps the levels of
//! its trees and rings.
//!
//! The caller's stages run in the order first(0), first(1), last(0), first(2), last(1), …,
//! last(n−1); the middle stages in piece order. Both orders depend only on the piece count, so
//! every rank issues the same sequence of collectives on each sub-communicator.

use crate::error::{Error, Result};
use crossbeam_channel::bounded;
use std::ops::Range;

/// The element ranges of `count` elements cut into pieces of at most `piece` elements (one
/// piece when `piece` is 0 or not smaller than `count`).
pub fn pieces(count: usize, piece: usize) -> Vec<Range<usize>> {
    let n = if piece == 0 {
        1
    } else {
        count.div_ceil(piece).max(1)
    };
    (0..n).map(|i| crate::algo::part(count, n, i, 1)).collect()
}

/// Runs `first`, `middle` and `last` on every piece (see the module docs). A single piece runs
/// on the caller's thread alone. The first error stops new pieces from starting; the call
/// returns once the second thread has finished its current piece.
pub fn run<T: Send>(
    pieces: Vec<T>,
    mut first: impl FnMut(&mut T) -> Result<()>,
    middle: impl Fn(&mut T) -> Result<()> + Sync,
    mut last: impl FnMut(&mut T) -> Result<()>,
) -> Result<()> {
    if pieces.len() <= 1 {
        for mut p in pieces {
            first(&mut p)?;
            middle(&mut p)?;
            last(&mut p)?;
        }
        return Ok(());
    }
    std::thread::scope(|s| {
        // Made inside the scope so that an early return drops them before the scope joins the
        // second thread, which then sees the channel closed instead of waiting forever. Two
        // pieces at most wait for or run in the middle stage: enough to keep it busy.
        let (to_mid, mid_in) = bounded::<T>(2);
        let (mid_out, from_mid) = bounded::<Result<T>>(2);
        let middle = &middle;
        s.spawn(move || {
            for mut p in mid_in {
                let r = middle(&mut p).map(|()| p);
                let failed = r.is_err();
                if mid_out.send(r).is_err() || failed {
                    break;
                }
            }
        });
        let mut in_flight = 0usize;
        let mut finish_one = |in_flight: &mut usize| -> Result<()> {
            let mut p = from_mid.recv().map_err(|_| {
                Error::Internal("pipeline: the middle stage stopped without an answer".into())
            })??;
            *in_flight -= 1;
            last(&mut p)
        };
        for mut p in pieces {
            first(&mut p)?;
            if to_mid.send(p).is_err() {
                // The middle stage failed: its error, behind the pieces it finished.
                return Err(from_mid.iter().find_map(Result::err).unwrap_or_else(|| {
                    Error::Internal("pipeline: the middle stage stopped early".into())
                }));
            }
            in_flight += 1;
            if in_flight == 2 {
                finish_one(&mut in_flight)?;
            }
        }
        drop(to_mid);
        while in_flight > 0 {
            finish_one(&mut in_flight)?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn pieces_cover_the_range_evenly() {
        let one = |r: std::ops::Range<usize>| vec![r];
        assert_eq!(pieces(0, 4), one(0..0));
        assert_eq!(pieces(10, 0), one(0..10));
        assert_eq!(pieces(10, 10), one(0..10));
        assert_eq!(pieces(10, 4), vec![0..3, 3..6, 6..10]);
        let p = pieces(1_000_003, 1000);
        assert_eq!(p.len(), 1001);
        assert!(p.windows(2).all(|w| w[0].end == w[1].start));
        assert!(p.iter().all(|r| r.len() <= 1000));
    }

    #[test]
    fn stages_run_in_the_documented_orders() {
        for n in [1usize, 2, 3, 7] {
            let caller = Mutex::new(Vec::new());
            let mid = Mutex::new(Vec::new());
            let mut data: Vec<u64> = (0..n as u64).collect();
            run(
                data.iter_mut().collect(),
                |p| {
                    caller.lock().unwrap().push(format!("f{}", **p));
                    Ok(())
                },
                |p| {
                    mid.lock().unwrap().push(**p);
                    **p += 100;
                    Ok(())
                },
                |p| {
                    caller.lock().unwrap().push(format!("l{}", **p - 100));
                    Ok(())
                },
            )
            .unwrap();
            let mut want = vec!["f0".to_string()];
            for i in 1..n {
                want.push(format!("f{i}"));
                want.push(format!("l{}", i - 1));
            }
            want.push(format!("l{}", n - 1));
            assert_eq!(*caller.lock().unwrap(), want, "n = {n}");
            assert_eq!(*mid.lock().unwrap(), (0..n as u64).collect::<Vec<_>>());
            assert_eq!(data, (100..100 + n as u64).collect::<Vec<_>>());
        }
    }

    #[test]
    fn an_error_in_any_stage_is_returned() {
        let fail_at = |k: u64| {
            move |p: &mut u64| {
                if *p == k {
                    Err(Error::invalid("boom"))
                } else {
                    Ok(())
                }
            }
        };
        for k in 0..4u64 {
            let r = run((0..4).collect(), fail_at(k), |_| Ok(()), |_| Ok(()));
            assert!(r.is_err(), "first fails at {k}");
            let r = run((0..4).collect(), |_| Ok(()), fail_at(k), |_| Ok(()));
            // The middle stage's own error, not the pipeline's.
            let msg = r.expect_err("the middle stage failed").to_string();
            assert!(msg.contains("boom"), "middle fails at {k}: {msg}");
            let r = run((0..4).collect(), |_| Ok(()), |_| Ok(()), fail_at(k));
            assert!(r.is_err(), "last fails at {k}");
        }
    }
}
