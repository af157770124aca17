//! A multi-process all-reduce over TCP.
//!
//! `cargo run --example all_reduce -- 4` starts 4 processes on this machine ([`qccl::launch`]
//! sets QCCL_RANK, QCCL_WORLD_SIZE, QCCL_COMM_ID and QCCL_SECRET for each). Under another
//! launcher (mpirun, torchrun, srun) each process just calls `Comm::from_env()`.

use clap::Parser;
use qccl::launch::Launch;
use qccl::{Comm, ReduceOp};

/// A multi-process all-reduce over TCP: starts RANKS processes on this machine, or, under a
/// launcher (QCCL_RANK, RANK, OMPI_COMM_WORLD_RANK set), is one rank of the job.
#[derive(Parser, Debug)]
#[command(name = "all_reduce", version)]
struct Cli {
    /// Processes to start
    #[arg(default_value_t = 4)]
    ranks: usize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("QCCL_RANK").is_some()
        || std::env::var_os("RANK").is_some()
        || std::env::var_os("OMPI_COMM_WORLD_RANK").is_some()
    {
        return rank_main();
    }
    let cli = Cli::parse();
    Launch::new(cli.ranks).run()?;
    Ok(())
}

fn rank_main() -> Result<(), Box<dyn std::error::Error>> {
    let comm = Comm::from_env()?;
    let (rank, size) = (comm.rank(), comm.size());
    // Rank r contributes r+1 in every element: the sum is size(size+1)/2 everywhere.
    let send = vec![(rank + 1) as f32; 1 << 20];
    let mut recv = vec![0f32; send.len()];
    let start = std::time::Instant::now();
    comm.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
    let took = start.elapsed();
    let expected = (size * (size + 1) / 2) as f32;
    let correct = recv.iter().all(|&x| x == expected);
    println!(
        "rank {rank}/{size}: all_reduce of {} floats -> {} (expected {expected}, {}) in {:.2} ms",
        recv.len(),
        recv[0],
        if correct { "correct" } else { "WRONG" },
        took.as_secs_f64() * 1e3
    );
    if !correct {
        return Err("wrong result".into());
    }
    Ok(())
}
