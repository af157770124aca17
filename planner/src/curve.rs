//! A link's cost as the planners evaluate it: the fitted line `α + β·bytes`, refined by measured
//! points where the model has them ([`CostModel::measured`](crate::CostModel::measured)).
//!
//! One line cannot follow a collective whose cost per byte changes with size: on the emulated
//! 2 × 2 cluster a compressed all-reduce costs 1.7 ns/B at 9 MB and 2.0 ns/B at 100 MB (caches,
//! shared cores), so a line fitted over 4 KB–100 MB misses the 50 MB fused groups by 10–15%.
//! Between measured points the cost is interpolated linearly; below the first it is the first
//! point's time (small messages are latency-bound), above the last it follows the last
//! segment's slope (or β when that is steeper).
//!
//! Such a curve need not be subadditive (fusing may cost more than the parts), so planners that
//! bound the rest of a search by "the rest fused into one group" use
//! [`LinkCost::fused_lower_bound`] instead, which holds for any cut. Cupcake's Algorithm 1
//! (`plan::algorithm1`), whose prunings hold only for a line, refuses a link that is a curve
//! ([`LinkCost::is_line`]).

use crate::linear::Linear;

/// A link's cost function (cheap to clone: the points are few).
#[derive(Clone, Debug, PartialEq)]
pub struct LinkCost {
    line: Linear,
    /// (bytes, seconds), bytes strictly increasing; empty or a single point: the line alone.
    points: Vec<[f64; 2]>,
}

impl LinkCost {
    /// The line alone.
    pub fn line(line: Linear) -> LinkCost {
        LinkCost {
            line,
            points: Vec::new(),
        }
    }

    /// The line refined by `points` ((bytes, seconds), sorted here; fewer than two: ignored).
    /// A point measured faster than a smaller one (noise) is raised to it: the planners rely
    /// on a cost that never decreases with bytes.
    pub fn with_points(line: Linear, mut points: Vec<[f64; 2]>) -> LinkCost {
        points.sort_by(|a, b| a[0].total_cmp(&b[0]));
        points.dedup_by(|b, a| a[0] == b[0]);
        if points.len() < 2 {
            points.clear();
        }
        let mut floor = 0.0f64;
        for p in &mut points {
            floor = floor.max(p[1]);
            p[1] = floor;
        }
        LinkCost { line, points }
    }

    /// Whether the cost is the line `α + β·bytes` alone: no measured points (fewer than two
    /// distinct ones count as none). A link with points is a curve even where they happen to
    /// lie near the line (below the first point its time is flat, for one).
    pub fn is_line(&self) -> bool {
        self.points.is_empty()
    }

    /// The fitted line.
    pub fn linear(&self) -> &Linear {
        &self.line
    }

    /// Seconds for one operation on `bytes` bytes.
    pub fn time(&self, bytes: f64) -> f64 {
        let p = &self.points;
        let (Some(first), Some(last)) = (p.first(), p.last()) else {
            return self.line.time(bytes);
        };
        if bytes <= first[0] {
            return first[1];
        }
        if bytes >= last[0] {
            return last[1] + self.tail_slope() * (bytes - last[0]);
        }
        let i = p.partition_point(|q| q[0] <= bytes);
        let ([x0, t0], [x1, t1]) = (p[i - 1], p[i]);
        t0 + (t1 - t0) * (bytes - x0) / (x1 - x0)
    }

    fn tail_slope(&self) -> f64 {
        let n = self.points.len();
        let ([x0, t0], [x1, t1]) = (self.points[n - 2], self.points[n - 1]);
        f64::max((t1 - t0) / (x1 - x0), self.line.beta)
    }

    /// A lower bound on the total time of any set of operations whose bytes sum to `bytes`
    /// (the rest of a fusion search, however cut). For the line (α ≥ 0) that is one fused
    /// operation; for a curve, the least seconds per byte anywhere on it times `bytes`.
    pub fn fused_lower_bound(&self, bytes: f64) -> f64 {
        if self.points.is_empty() {
            return self.line.time(bytes);
        }
        let per_byte = self
            .points
            .iter()
            .map(|[x, t]| t / x)
            .fold(self.tail_slope(), f64::min);
        per_byte.max(0.0) * bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_without_points_is_the_line() {
        let l = Linear::new(1e-3, 2e-9);
        let c = LinkCost::line(l);
        assert_eq!(c.time(1e6), l.time(1e6));
        assert_eq!(c.fused_lower_bound(5e6), l.time(5e6));
        assert!(c.is_line());
        // One point is not a curve.
        let one = LinkCost::with_points(l, vec![[1e6, 9.0]]);
        assert_eq!(one.time(1e6), l.time(1e6));
        assert!(one.is_line());
        assert!(!LinkCost::with_points(l, vec![[1e3, 1e-3], [1e6, 3e-3]]).is_line());
    }

    #[test]
    fn points_are_interpolated_and_extended() {
        let l = Linear::new(1e-3, 1e-9);
        let c = LinkCost::with_points(l, vec![[1e8, 0.3], [1e3, 1e-3], [1e6, 2e-3]]);
        assert_eq!(c.time(10.0), 1e-3, "below the first point: its time");
        assert_eq!(c.time(1e6), 2e-3);
        assert!((c.time(5.05e7) - (2e-3 + 0.298 / 2.0)).abs() < 1e-12);
        // Above the last point: the last segment's slope, 0.298 s / 99 MB.
        let slope = 0.298 / 99e6;
        assert!((c.time(2e8) - (0.3 + slope * 1e8)).abs() < 1e-12);
        // Noise that would make a bigger operation cheaper is flattened.
        let c = LinkCost::with_points(l, vec![[4e3, 1.0e-3], [6.5e4, 0.7e-3], [1e6, 2e-3]]);
        assert_eq!(c.time(6.5e4), 1.0e-3);
        assert!(c.time(3e4) <= c.time(5e4));
    }

    #[test]
    fn the_lower_bound_holds_for_every_cut() {
        // Superlinear at the top: fusing costs more than the parts.
        let c = LinkCost::with_points(
            Linear::new(5e-4, 1e-9),
            vec![[4e3, 5e-4], [1e6, 2e-3], [1e7, 1.7e-2], [1e8, 2.0e-1]],
        );
        assert!(
            c.time(1e8) > 2.0 * c.time(5e7),
            "the example is not subadditive"
        );
        let total = 1e8;
        for parts in [1usize, 2, 3, 10, 100, 1000] {
            let cut: f64 = (0..parts).map(|_| c.time(total / parts as f64)).sum();
            assert!(c.fused_lower_bound(total) <= cut, "{parts} parts");
        }
    }
}
