//! Tensor fusion by a byte threshold (Horovod / PyTorch-DDP / DeAR style): consecutive
//! tensors, in the order their gradients become ready (backprop order), share one buffer —
//! and so one collective — while their total stays within the threshold.
//!
//! The rule, identical in [`fuse`] and [`FusionBuffer`]: a tensor joins the open group if the
//! group is empty or the sum stays `<= threshold`; otherwise the open group is closed and the
//! tensor opens the next one. Hence a tensor larger than the threshold always forms a group
//! of its own, threshold 0 gives one group per (non-empty) tensor, and an unbounded
//! threshold one group for everything. A zero-byte tensor joins any group still within the
//! threshold (but not one made of a single oversized tensor).

use std::ops::Range;

/// Groups tensors of the given sizes (bytes, in backprop order) into consecutive index
/// ranges whose total is at most `threshold`, except single tensors larger than it.
/// The ranges cover `0..sizes.len()` in order; empty input gives no groups.
pub fn fuse(sizes: &[usize], threshold: usize) -> Vec<Range<usize>> {
    let mut buf = FusionBuffer::new(threshold);
    let mut groups: Vec<Range<usize>> = sizes
        .iter()
        .enumerate()
        .filter_map(|(i, &b)| buf.push(i, b))
        .collect();
    groups.extend(buf.flush());
    groups
}

/// Streaming form of [`fuse`], for use from gradient hooks: push each tensor as its gradient
/// becomes ready; a group is emitted when the next tensor would overflow it, and the rest by
/// [`flush`](Self::flush) at the end of the backward pass.
///
/// A full group is only emitted when the next tensor arrives, like Horovod's and DeAR's
/// fusion controllers, which look at the buffer when a tensor is pushed. Callers that want
/// an oversized tensor on the wire immediately can check [`pending_bytes`](Self::pending_bytes)
/// against [`threshold`](Self::threshold) and [`flush`](Self::flush) themselves — the groups
/// then differ from [`fuse`], but all ranks do the same thing, which is what matters.
#[derive(Debug, Clone)]
pub struct FusionBuffer {
    threshold: usize,
    /// Start of the open group and the index the next push must carry.
    start: usize,
    next: Option<usize>,
    bytes: usize,
}

impl FusionBuffer {
    /// An empty buffer that fuses up to `threshold` bytes per group.
    pub fn new(threshold: usize) -> FusionBuffer {
        FusionBuffer {
            threshold,
            start: 0,
            next: None,
            bytes: 0,
        }
    }

    /// Adds tensor `index` of `bytes` bytes; returns the group it closed, if any (which never
    /// contains `index` itself: that tensor is now pending).
    ///
    /// # Panics
    ///
    /// If `index` does not follow the previously pushed one: groups are index ranges, so
    /// tensors must arrive consecutively (the first push, or the first after a flush, may
    /// start anywhere).
    pub fn push(&mut self, index: usize, bytes: usize) -> Option<Range<usize>> {
        let Some(next) = self.next else {
            self.start = index;
            self.next = Some(index + 1);
            self.bytes = bytes;
            return None;
        };
        assert_eq!(
            index, next,
            "FusionBuffer::push: tensor {index} pushed, expected {next}"
        );
        self.next = Some(index + 1);
        match self.bytes.checked_add(bytes) {
            Some(total) if total <= self.threshold => {
                self.bytes = total;
                None
            }
            _ => {
                let done = self.start..index;
                self.start = index;
                self.bytes = bytes;
                Some(done)
            }
        }
    }

    /// Emits the open group, if any, and empties the buffer (end of the backward pass).
    pub fn flush(&mut self) -> Option<Range<usize>> {
        let next = self.next.take()?;
        self.bytes = 0;
        Some(self.start..next)
    }

    /// The tensors waiting in the open group.
    pub fn pending(&self) -> Option<Range<usize>> {
        self.next.map(|n| self.start..n)
    }

    /// Bytes in the open group.
    pub fn pending_bytes(&self) -> usize {
        self.bytes
    }

    /// The fusion threshold in bytes.
    pub fn threshold(&self) -> usize {
        self.threshold
    }

    /// Changes the threshold for groups opened from now on; the open group keeps what it has
    /// (flush first to apply it at a clean boundary, e.g. between iterations when the tuner
    /// suggests a new size).
    pub fn set_threshold(&mut self, threshold: usize) {
        self.threshold = threshold;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes_of(groups: &[Range<usize>], sizes: &[usize]) -> Vec<usize> {
        groups
            .iter()
            .map(|g| sizes[g.clone()].iter().sum())
            .collect()
    }

    /// Groups cover 0..n in order, each non-empty.
    fn assert_partition(groups: &[Range<usize>], n: usize) {
        let mut at = 0;
        for g in groups {
            assert_eq!(g.start, at, "{groups:?}");
            assert!(g.end > g.start, "{groups:?}");
            at = g.end;
        }
        assert_eq!(at, n, "{groups:?}");
    }

    #[test]
    fn basic_grouping() {
        let sizes = [4, 4, 4, 10, 1, 1, 9, 3];
        let g = fuse(&sizes, 10);
        assert_eq!(g, vec![0..2, 2..3, 3..4, 4..6, 6..7, 7..8]);
        assert_partition(&g, sizes.len());
        assert!(sizes_of(&g, &sizes).iter().all(|&s| s <= 10));
        // Exactly reaching the threshold is allowed.
        assert_eq!(fuse(&[5, 5, 5, 5], 10), vec![0..2, 2..4]);
    }

    #[test]
    fn empty_input() {
        assert!(fuse(&[], 100).is_empty());
        let mut b = FusionBuffer::new(100);
        assert_eq!(b.flush(), None);
        assert_eq!(b.pending(), None);
    }

    #[test]
    fn threshold_zero_separates_everything() {
        assert_eq!(fuse(&[1, 2, 3], 0), vec![0..1, 1..2, 2..3]);
        // Zero-byte tensors fit into a group within the threshold, even a zero one, but not
        // next to an oversized tensor.
        assert_eq!(fuse(&[0, 0, 3, 0], 0), vec![0..2, 2..3, 3..4]);
        assert_eq!(fuse(&[3, 0, 0], 5), vec![0..3]);
    }

    #[test]
    fn huge_threshold_one_group() {
        let sizes = [usize::MAX / 2, usize::MAX / 2, 7];
        assert_eq!(fuse(&sizes, usize::MAX), vec![0..2, 2..3], "no overflow");
        assert_eq!(fuse(&[1, 2, 3, 4], usize::MAX), vec![0..4]);
    }

    #[test]
    fn oversized_tensor_alone() {
        assert_eq!(fuse(&[100], 10), vec![0..1]);
        assert_eq!(fuse(&[3, 100, 3], 10), vec![0..1, 1..2, 2..3]);
        assert_eq!(fuse(&[100, 200], 10), vec![0..1, 1..2]);
    }

    #[test]
    fn streaming_equals_batch() {
        // Deterministic pseudo-random sizes, many thresholds.
        let mut s = 12345u64;
        let sizes: Vec<usize> = (0..300)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let r = (s >> 33) as usize;
                // Mix of tiny, medium and large, like biases, convs and FC layers.
                match r % 5 {
                    0 => r % 64,
                    1 | 2 => r % 10_000,
                    _ => r % 1_000_000,
                }
            })
            .collect();
        for threshold in [0, 1, 100, 5_000, 250_000, 1 << 20, 1 << 30, usize::MAX] {
            let batch = fuse(&sizes, threshold);
            assert_partition(&batch, sizes.len());
            for (g, bytes) in batch.iter().zip(sizes_of(&batch, &sizes)) {
                assert!(
                    g.len() == 1 || bytes <= threshold,
                    "{g:?} {bytes} > {threshold}"
                );
            }
            // Streaming with an index offset and checking pending state along the way.
            let mut buf = FusionBuffer::new(threshold);
            let mut stream = Vec::new();
            for (i, &b) in sizes.iter().enumerate() {
                if let Some(g) = buf.push(i + 1000, b) {
                    stream.push(g.start - 1000..g.end - 1000);
                }
                assert_eq!(buf.pending().unwrap().end, i + 1001);
                let p = buf.pending().unwrap();
                assert_eq!(
                    buf.pending_bytes(),
                    sizes[p.start - 1000..p.end - 1000].iter().sum::<usize>()
                );
            }
            let last = buf.flush().unwrap();
            stream.push(last.start - 1000..last.end - 1000);
            assert_eq!(stream, batch, "threshold {threshold}");
            assert_eq!(buf.pending(), None);
        }
    }

    #[test]
    fn buffer_reuse_across_iterations() {
        let mut b = FusionBuffer::new(8);
        assert_eq!(b.push(0, 5), None);
        assert_eq!(b.push(1, 5), Some(0..1));
        assert_eq!(b.flush(), Some(1..2));
        // Next iteration starts again at 0 with a new threshold.
        b.set_threshold(20);
        assert_eq!(b.threshold(), 20);
        assert_eq!(b.push(0, 5), None);
        assert_eq!(b.push(1, 5), None);
        assert_eq!(b.pending_bytes(), 10);
        assert_eq!(b.flush(), Some(0..2));
    }

    #[test]
    #[should_panic(expected = "expected 1")]
    fn push_must_be_consecutive() {
        let mut b = FusionBuffer::new(8);
        b.push(0, 1);
        b.push(2, 1);
    }
}
