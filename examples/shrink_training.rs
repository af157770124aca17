//! Training that survives a lost rank: data-parallel SGD on a linear model, 4 processes; rank
//! 2 is killed (SIGKILL) in the middle of training; the survivors see the error, shrink the
//! comm to the 3 of them (`Comm::shrink_failed`), agree on the step to resume from, share the
//! lost rank's data among themselves and finish training.
//!
//! `cargo run --release --example shrink_training` (add `-- --kill-at 0` to kill no one).
//! Gradients travel compressed (8-bit QSGD with error feedback), as CGX would send them.

use qccl::launch::Launch;
use qccl::{Comm, Compression, ReduceOp};

const RANKS: usize = 4;
const FEATURES: usize = 64;
const SAMPLES: usize = 4096;
const STEPS: usize = 120;
const LR: f32 = 0.05;
const VICTIM: usize = 2;

/// Data-parallel training on 4 processes that loses one (SIGKILL) and finishes on the others.
#[derive(clap::Parser, Debug)]
#[command(name = "shrink_training", version)]
struct Cli {
    /// The step at which rank 2 is killed; 0: no one is killed
    #[arg(long = "kill-at", value_name = "STEP", default_value_t = 50)]
    kill_at: usize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let kill_at = <Cli as clap::Parser>::parse().kill_at;
    if std::env::var_os("QCCL_RANK").is_none() {
        Launch::new(RANKS)
            .args(["--kill-at".to_string(), kill_at.to_string()])
            .allow_lost_ranks(1)
            .run()?;
        return Ok(());
    }
    train(kill_at)
}

/// A deterministic value in [-1, 1) from (a, b).
fn noise(a: u64, b: u64) -> f32 {
    let mut x = a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 31;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 29;
    (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// Sample i of the data set: features and a target from a fixed "true" model plus noise.
fn sample(i: usize) -> ([f32; FEATURES], f32) {
    let mut x = [0f32; FEATURES];
    let mut y = 0.1 * noise(i as u64, 999);
    for (j, v) in x.iter_mut().enumerate() {
        *v = noise(i as u64, j as u64);
        y += *v * noise(j as u64, 12345) * 2.0;
    }
    (x, y)
}

/// This member's share of the samples: every `n`-th one from its index.
fn shard(index: usize, n: usize) -> impl Iterator<Item = usize> {
    (index..SAMPLES).step_by(n)
}

/// Gradient of the mean squared error over this shard (summed, not yet divided) and the
/// shard's summed squared error.
fn local_grad(w: &[f32], index: usize, n: usize) -> (Vec<f32>, f32) {
    let mut g = vec![0f32; FEATURES + 1];
    let mut sse = 0.0;
    for i in shard(index, n) {
        let (x, y) = sample(i);
        let pred: f32 = x.iter().zip(w).map(|(a, b)| a * b).sum::<f32>() + w[FEATURES];
        let err = pred - y;
        sse += err * err;
        for (gj, xj) in g.iter_mut().zip(x) {
            *gj += 2.0 * err * xj;
        }
        g[FEATURES] += 2.0 * err;
    }
    (g, sse)
}

fn train(kill_at: usize) -> Result<(), Box<dyn std::error::Error>> {
    let mut comm = Comm::from_env()?;
    let me = comm.rank(); // the original rank: who this process is
    let mut w = vec![0f32; FEATURES + 1];
    let grad_codec = Compression::parse("qsgd:bits=8,bucket=128,ef=1")?.key("grad");
    let mut step = 0;
    let mut loss_before = None;
    while step < STEPS {
        if me == VICTIM && step == kill_at && kill_at > 0 {
            // A preempted machine: no goodbye.
            nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL)?;
        }
        // One step: the summed gradients and losses of all shards, then the update.
        let result = (|| -> qccl::Result<f32> {
            let (mut g, sse) = local_grad(&w, comm.rank(), comm.size());
            comm.all_reduce_compressed(&mut g, ReduceOp::Sum, &grad_codec)?;
            let mut loss = [sse];
            comm.all_reduce_in_place(&mut loss, ReduceOp::Sum)?;
            for (wj, gj) in w.iter_mut().zip(&g) {
                *wj -= LR * gj / SAMPLES as f32;
            }
            Ok(loss[0] / SAMPLES as f32)
        })();
        match result {
            Ok(loss) => {
                if me == 0 && (step % 20 == 0 || step + 1 == STEPS) {
                    println!("step {step:3}: loss {loss:.5} on {} ranks", comm.size());
                }
                loss_before = Some(loss);
                step += 1;
            }
            Err(e) => {
                eprintln!("rank {me}: step {step} failed: {e}");
                let survivors = comm.shrink_failed()?;
                // A step may have finished on some survivors and not on others (its update
                // comes after its sums): all resume from the earliest failed step, with the
                // weights of a rank that failed there.
                let mut from = [step as u64];
                survivors.all_reduce_in_place(&mut from, ReduceOp::Min)?;
                let holds = if from[0] == step as u64 {
                    survivors.rank() as u64
                } else {
                    u64::MAX
                };
                let mut src = [holds];
                survivors.all_reduce_in_place(&mut src, ReduceOp::Min)?;
                survivors.broadcast_in_place(&mut w, src[0] as usize)?;
                step = from[0] as usize;
                if survivors.rank() == 0 {
                    println!(
                        "lost a rank at step {step} (loss then {:.5}): {} survivors carry on",
                        loss_before.unwrap_or(f32::NAN),
                        survivors.size()
                    );
                }
                comm = survivors;
            }
        }
    }
    if comm.rank() == 0 {
        println!("trained {STEPS} steps; {} ranks finished", comm.size());
    }
    Ok(())
}
