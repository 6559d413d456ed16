//! `gpt-pretrain`: see the library documentation and `docs/gpt-pretrain.md`.

use std::process::ExitCode;

use burn::backend::Autodiff;
use burn_dist::DistributedBackend;
use burn_flex::{Flex, FlexDevice};
use clap::Parser;
use gpt_pretrain::cli::Args;

/// The CPU backend; on GPUs, `Autodiff<DistributedBackend<Cuda>>` with the same `train::run`.
type B = Autodiff<DistributedBackend<Flex>>;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter("warn")
        .init();
    match gpt_pretrain::train::run::<B>(&Args::parse(), &FlexDevice) {
        Ok(_) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}
