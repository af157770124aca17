//! The buffers of a group's calls on one comm, merged where they overlap, so that a group on
//! device memory stages each byte once: a call that writes a buffer and a later call of the
//! same group that reads it (a broadcast into X, then a send from X) see one page-locked copy,
//! in call order, as they would see the one device buffer.

use crate::buf::RawBuf;
use qccl_core::internal::CallBuf;

/// Disjoint byte ranges, sorted by address, each staged as one buffer.
pub(crate) struct Spans {
    spans: Vec<CallBuf>,
}

impl Spans {
    /// The union of `bufs` (empty ones left out). A span made of several buffers is read
    /// even when none of them is: the calls may write only part of it, and copying it back
    /// whole must not overwrite the rest with whatever the staging memory held.
    pub(crate) fn of(bufs: impl IntoIterator<Item = CallBuf>) -> Spans {
        let mut all: Vec<CallBuf> = bufs.into_iter().filter(|b| b.len > 0).collect();
        all.sort_unstable_by_key(|b| b.addr);
        let mut spans: Vec<CallBuf> = Vec::with_capacity(all.len());
        for b in all {
            match spans.last_mut() {
                Some(s) if b.addr < s.addr + s.len as u64 => {
                    let end = (s.addr + s.len as u64).max(b.addr + b.len as u64);
                    let same = b.addr == s.addr && end == b.addr + b.len as u64;
                    s.len = (end - s.addr) as usize;
                    s.writes |= b.writes;
                    // One range given twice is still whole; anything else is read in.
                    s.reads |= b.reads || !same;
                }
                _ => spans.push(b),
            }
        }
        Spans { spans }
    }

    /// The spans, to stage.
    pub(crate) fn bufs(&self) -> &[CallBuf] {
        &self.spans
    }

    /// `b` moved to where its span was staged: `hosts` holds an address per span (as
    /// `bufs()`); a buffer outside every span (empty, or not one of the calls') is kept.
    pub(crate) fn map(&self, hosts: &[usize], b: RawBuf) -> RawBuf {
        let start = b.start() as u64;
        let i = self
            .spans
            .partition_point(|s| s.addr + s.len as u64 <= start);
        match self.spans.get(i) {
            Some(s) if b.len() > 0 && s.addr <= start => {
                RawBuf::at((hosts[i] + (start - s.addr) as usize) as *mut u8, b.len())
            }
            _ => b,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(addr: u64, len: usize, reads: bool, writes: bool) -> CallBuf {
        CallBuf {
            addr,
            len,
            reads,
            writes,
        }
    }

    fn shape(s: &Spans) -> Vec<(u64, usize, bool, bool)> {
        s.bufs()
            .iter()
            .map(|b| (b.addr, b.len, b.reads, b.writes))
            .collect()
    }

    #[test]
    fn overlapping_buffers_merge_and_are_read_in() {
        let s = Spans::of([
            buf(1000, 100, false, true),
            buf(4000, 10, true, false),
            buf(1050, 100, false, true),
            buf(0, 0, true, true),
            buf(4000, 10, false, true),
            buf(1150, 8, true, false),
        ]);
        // 1000..1150 from two writes is read in (the writes may not cover it); 1150 only
        // touches it, so it stays its own; the range given twice stays exactly itself.
        assert_eq!(
            shape(&s),
            [
                (1000, 150, true, true),
                (1150, 8, true, false),
                (4000, 10, true, true)
            ]
        );
    }

    #[test]
    fn a_buffer_given_twice_is_not_read_for_nothing() {
        let s = Spans::of([buf(64, 32, false, true), buf(64, 32, false, true)]);
        assert_eq!(shape(&s), [(64, 32, false, true)]);
    }

    #[test]
    fn buffers_map_into_their_span() {
        let s = Spans::of([buf(1000, 100, true, false), buf(1040, 100, false, true)]);
        let hosts = [50_000usize];
        let m = s.map(&hosts, RawBuf::at(1040 as *mut u8, 100));
        assert_eq!((m.start(), m.len()), (50_040, 100));
        let m = s.map(&hosts, RawBuf::at(1000 as *mut u8, 10));
        assert_eq!((m.start(), m.len()), (50_000, 10));
        // Not a call's buffer: kept.
        let m = s.map(&hosts, RawBuf::at(9000 as *mut u8, 4));
        assert_eq!(m.start(), 9000);
        assert_eq!(s.map(&hosts, RawBuf::EMPTY).len(), 0);
    }
}
