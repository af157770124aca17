//! HiTopKComm's reference: a float64 simulation of Algorithm 2 given the indices each rank's
//! MSTopK selected.

use super::coded::grad;

/// Where rank r sits: (host index, local rank), hosts numbered by first appearance and local
/// ranks in rank order, as qccl's topology does.
pub fn layout(hosts: &[&str]) -> Vec<(usize, usize)> {
    let mut names: Vec<&str> = Vec::new();
    let mut seen: Vec<usize> = Vec::new();
    hosts
        .iter()
        .map(|h| {
            let hi = names.iter().position(|n| n == h).unwrap_or_else(|| {
                names.push(h);
                seen.push(0);
                names.len() - 1
            });
            seen[hi] += 1;
            (hi, seen[hi] - 1)
        })
        .collect()
}

/// Element range of part `i` of `count` cut in `parts` (qccl's `algo::part`).
pub fn part(count: usize, parts: usize, i: usize) -> std::ops::Range<usize> {
    count * i / parts..count * (i + 1) / parts
}

/// Algorithm 2 in float64: for every slice (local rank l), the sum over hosts of each host's
/// slice sum at the indices that host's rank l selected. `indices[r]` are rank r's selected
/// indices relative to its slice.
pub fn simulate(hosts: &[&str], count: usize, salt: u64, indices: &[Vec<u32>]) -> Vec<f64> {
    let where_ = layout(hosts);
    let nhosts = where_.iter().map(|w| w.0).max().map_or(0, |m| m + 1);
    let local = hosts.len() / nhosts.max(1);
    let grads: Vec<Vec<f32>> = (0..hosts.len()).map(|r| grad(r, count, salt)).collect();
    let mut out = vec![0f64; count];
    for (r, &(h, l)) in where_.iter().enumerate() {
        let slice = part(count, local, l);
        for &i in &indices[r] {
            let at = slice.start + i as usize;
            let host_sum: f64 = where_
                .iter()
                .enumerate()
                .filter(|(_, w)| w.0 == h)
                .map(|(q, _)| grads[q][at] as f64)
                .sum();
            out[at] += host_sum;
        }
    }
    out
}

/// Largest |a − b| / (1 + |b|).
pub fn max_rel_diff(a: &[f32], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y).abs() / (1.0 + y.abs()))
        .fold(0.0, f64::max)
}
