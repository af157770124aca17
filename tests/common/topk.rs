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

/// HiTopKComm over processes: every rank checks the whole result against the float64
/// simulation of Algorithm 2, with every rank's selected indices gathered (TEST_HOSTS lists
/// the emulated host of each rank).
pub fn check_over_processes(comm: &qccl::Comm) -> Result<(), String> {
    let hosts_env = std::env::var("TEST_HOSTS").map_err(|e| e.to_string())?;
    let hosts: Vec<&str> = hosts_env.split(',').collect();
    let e = |e: qccl::Error| e.to_string();
    for (count, density) in [(100_003usize, 0.01), (999, 0.1)] {
        let mut g = super::coded::grad(comm.rank(), count, 9);
        let o = qccl::TopK {
            record_indices: true,
            ..qccl::TopK::new(density).error_feedback(false)
        };
        let rep = comm
            .topk_all_reduce(&mut g, qccl::TopKScheme::HiTopK, &o)
            .map_err(e)?;
        let mine = rep.indices.unwrap_or_default();
        // Everyone's indices: counts first, then lists padded to the longest.
        let mut ks = vec![0u64; comm.size()];
        comm.all_gather(&[mine.len() as u64], &mut ks).map_err(e)?;
        let kmax = *ks.iter().max().unwrap_or(&0) as usize;
        let mut padded = mine.clone();
        padded.resize(kmax, 0);
        let mut all = vec![0u32; kmax * comm.size()];
        comm.all_gather(&padded, &mut all).map_err(e)?;
        let indices: Vec<Vec<u32>> = (0..comm.size())
            .map(|r| all[r * kmax..r * kmax + ks[r] as usize].to_vec())
            .collect();
        let sim = simulate(&hosts, count, 9, &indices);
        let d = max_rel_diff(&g, &sim);
        if d > 1e-5 {
            return Err(format!("count {count}: differs from Algorithm 2 by {d}"));
        }
        let mut hashes = vec![0u64; comm.size()];
        comm.all_gather(&[super::coded::hash(&g)], &mut hashes)
            .map_err(e)?;
        if hashes.iter().any(|&h| h != hashes[0]) {
            return Err(format!("count {count}: ranks ended with different results"));
        }
        if rep.steps.iter().any(|s| s.is_zero()) && count > 1000 {
            return Err(format!(
                "count {count}: a step took no time: {:?}",
                rep.steps
            ));
        }
    }
    Ok(())
}
