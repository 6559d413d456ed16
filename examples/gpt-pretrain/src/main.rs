//! `gpt-pretrain`: see the library documentation and `docs/gpt-pretrain.md`.

use std::process::ExitCode;

use clap::Parser;
use gpt_pretrain::cli::Args;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter("warn")
        .init();
    match gpt_pretrain::backend::run(&Args::parse()) {
        Ok(_) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
        }
    }
}
