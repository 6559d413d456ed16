//! `burn-dist-ckpt`: look into and consolidate burn-dist sharded checkpoints.
//!
//! ```text
//! burn-dist-ckpt inspect <checkpoint-dir>               manifest summary, every file verified
//! burn-dist-ckpt consolidate <checkpoint-dir> <out>     full fp32 master weights and moments
//! burn-dist-ckpt export <checkpoint-dir> <out>          the model's weights, in their dtypes
//! ```
//!
//! `<checkpoint-dir>` is a step directory or a root of them (its newest complete checkpoint).

use std::process::ExitCode;

use burn_dist_zero::checkpoint::{self, Manifest};

const USAGE: &str = "usage:
  burn-dist-ckpt inspect <checkpoint-dir>
  burn-dist-ckpt consolidate <checkpoint-dir> <out-file>
  burn-dist-ckpt export <checkpoint-dir> <out-file>

<checkpoint-dir> is a step-* directory, or a directory of them (the newest complete one is used).";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let outcome = match args.as_slice() {
        ["inspect", dir] => inspect(dir),
        ["consolidate", dir, out] => consolidate(dir, out),
        ["export", dir, out] => export(dir, out),
        ["-h" | "--help" | "help"] => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("burn-dist-ckpt: {error}");
            ExitCode::FAILURE
        }
    }
}

/// The model's weights as one safetensors file, as a stage-1 or stage-2 checkpoint's model file
/// holds them; a ZeRO stage-3 checkpoint's are assembled from the shards, one at a time.
fn export(dir: &str, out: &str) -> checkpoint::Result<()> {
    let manifest = checkpoint::export(dir, out)?;
    println!(
        "wrote {out}: the model of step {} ({} trainable parameters{})",
        manifest.step,
        manifest.params.len(),
        match manifest.weights {
            checkpoint::Weights::MasterShards => ", from the shards' master weights",
            checkpoint::Weights::ModelFile => "",
        }
    );
    Ok(())
}

fn inspect(dir: &str) -> checkpoint::Result<()> {
    let resolved = checkpoint::resolve(dir)?;
    let manifest = Manifest::read(&resolved)?;
    print_summary(&resolved, &manifest);
    // Verify last, so a corrupt file still shows the summary first.
    checkpoint::verify(&resolved)?;
    println!(
        "all {} files verified (size and crc32)",
        manifest.files.len()
    );
    Ok(())
}

fn print_summary(dir: &std::path::Path, m: &Manifest) {
    println!("checkpoint   {}", dir.display());
    println!("format       {}", m.format_version);
    println!("step         {}", m.step);
    println!("world size   {}", m.world_size);
    println!("samples      {} consumed globally", m.samples_consumed);
    match m.scaler {
        Some(s) => println!(
            "scaler       scale {} growth tracker {}",
            s.scale, s.growth_tracker
        ),
        None => println!("scaler       none"),
    }
    println!("random       seed {} step {}", m.random.seed, m.random.step);
    println!(
        "layout       {} parameters, {} elements, {} per shard ({} padding)",
        m.params.len(),
        m.layout.total,
        m.layout.shard_len,
        m.layout.shard_len * m.world_size - m.layout.total
    );
    for p in &m.params {
        println!("  {:<40} {:?} {}", p.name, p.shape, p.dtype);
    }
    println!("files");
    for f in &m.files {
        println!(
            "  {:<28} {:>12} bytes  crc32 {:08x}",
            f.name, f.bytes, f.crc32
        );
    }
}

fn consolidate(dir: &str, out: &str) -> checkpoint::Result<()> {
    let full = checkpoint::consolidate(dir, out)?;
    println!(
        "wrote {out}: {} parameters of step {} ({} elements; master, exp_avg, exp_avg_sq in f32)",
        full.manifest.params.len(),
        full.manifest.step,
        full.manifest.layout.total
    );
    Ok(())
}
