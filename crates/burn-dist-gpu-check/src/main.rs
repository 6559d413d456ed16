//! The GPU device check of burn-dist, one binary carried to the GPU machine (see docs/gpu.md).
//!
//! ```text
//! burn-dist-gpu-check <check> [--out FILE] [--device N] [--elements N] [--cache DIR]
//!                             [--seconds S] [--stack fusion|cube] [--precision f32|bf16]
//!                             [--zero-stage 1|2|3] [--place device|offload]
//!                             [--model gpt2-124m|gpt-6b] [--expect train|device-memory-error]
//!   nccl-w1     NcclCommunicator at world size 1 through a loopback TCP store: every
//!               collective x dtype (f32, f16, bf16, u8) against the host reference
//!   kernels     burn-dist-kernels' kernel checks on cubecl's CUDA runtime, bf16 included
//!   fused-step  the fused ZeroAdam step at --elements (default 2^28) f32 parameters, timed,
//!               next to a device copy and Burn's stock AdamW on burn-cuda
//!   ddp-step    a transformer training step with the in-place NCCL reducer at world size 1
//!               against the same backend unsynchronized: overhead, parameters equal
//!   ddp-timed   only the timed part of ddp-step (warm-up and the interleaved timed steps)
//!   device-path Burn's `Cuda` (fusion on) with the device reducer against plain `Cuda`, and
//!               ZeroAdam's in-place step against its host path: scalars only cross
//!   ranks       two and three ranks on one GPU (threads as ranks, staged collectives): DDP,
//!               ZeRO-2 and ZeRO-3 against one rank with the whole batch, f32 and bf16
//!   gpt         GPT-2 124M training steps with our stack (--stack fusion: Burn's `Cuda`,
//!               cube: burn-cuda without fusion; --precision f32 | bf16): the first step's
//!               phases, tokens/s, MFU and one step split, for the comparison with
//!               gpt2_torch.py; it plans its steps within --seconds. In bf16, ZeroAdam at
//!               --zero-stage 1 | 2 | 3, its state in device memory (--place device) or in
//!               host memory (--place offload): the device memory between steps against
//!               the formula, and the time the steps waited for the gradient shard
//!   gpt-profile the same with cubecl's profiling on: the kernels that take the time
//!   versions    NVRTC's and the driver's CUDA versions as loaded (for run.sh), one line
//! ```
//!
//! Every result is one JSON line appended to `--out` (default `gpu-check.jsonl`) as soon as it
//! is known, so a check killed by its timeout still leaves what it finished. The exit code is
//! 0 when every line passed, 1 when one failed, 2 on bad usage.
//!
//! Built with the `cuda` feature (`cargo xtask gpu-check`); without it the binary only says so.

use std::process::ExitCode;

mod profile;
mod report;

#[cfg(feature = "cuda")]
mod ddp_step;
#[cfg(feature = "cuda")]
mod device_path;
#[cfg(feature = "cuda")]
mod fused_step;
#[cfg(feature = "cuda")]
mod gpt;
#[cfg(feature = "cuda")]
mod kernels;
#[cfg(feature = "cuda")]
mod libraries;
#[cfg(feature = "cuda")]
mod nccl_w1;
#[cfg(feature = "cuda")]
mod ranks;

const USAGE: &str = "\
usage: burn-dist-gpu-check <nccl-w1 | kernels | fused-step | ddp-step | ddp-timed | device-path | ranks | gpt | gpt-profile | versions>
           [--out FILE] [--device N] [--elements N] [--cache DIR] [--seconds S]
           [--stack fusion|cube] [--precision f32|bf16] [--zero-stage 1|2|3]
           [--place device|offload] [--model gpt2-124m|gpt-6b]
           [--expect train|device-memory-error]

  nccl-w1     NCCL communicator at world size 1 (loopback store), every collective x dtype
  kernels     the fused-kernel checks on the CUDA runtime, bf16 included
  fused-step  timing of the fused step at --elements f32 (default 268435456) vs copy and
              Burn's AdamW
  ddp-step    transformer step with the in-place NCCL reducer (world size 1) vs without:
              overhead, and the parameters agree
  ddp-timed   only ddp-step's timed comparison (warm-up, then interleaved timed steps)
  device-path Burn's Cuda (fusion on) on the device path vs plain Cuda; ZeroAdam in device
              memory vs its host path, host<->device bytes per step
  ranks       2 and 3 ranks on one GPU (threads, staged collectives) vs 1 rank, whole batch
  gpt         GPT-2 124M steps with our stack (--stack fusion|cube, --precision f32|bf16):
              first-step phases, tokens/s, MFU, one step split; plans within --seconds;
              bf16: ZeroAdam at --zero-stage N, --place device (its state in device
              memory) or offload (in host memory), device memory against the formula;
              --model gpt-6b: a 6.25 B GPT, batch 1; --expect device-memory-error: passes
              when on_device refuses the shape for device memory, naming offload
  gpt-profile the same with cubecl's kernel profiling: which kernels take the time
  versions    prints nvrtc=X.Y driver=X.Y as this binary loads them (none, stub)

Results: one JSON line per result, appended to --out (default gpu-check.jsonl). --cache DIR:
cubecl keeps compiled kernels and autotune results there, for the next checks of the call.
--seconds S: the check's limit (run.sh's), within which it plans its steps.";

/// The fused step's default size: 2^28 f32 (10 GB moved per step, far past the caches). At
/// 2^30 the host-side set-up (random state tiled to the length, then uploaded) took most of
/// the check's limit and left no time for Burn's AdamW line.
const DEFAULT_ELEMENTS: usize = 1 << 28;

/// Command-line options shared by the checks.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct Options {
    pub out: std::path::PathBuf,
    pub device: usize,
    pub elements: usize,
    /// Where cubecl keeps compiled kernels (PTX) and autotune results between the checks of
    /// one device call (`--cache DIR`; none: every check compiles and tunes cold).
    pub cache: Option<std::path::PathBuf>,
    /// The check's limit (`--seconds`, run.sh's), for the checks that plan within it.
    pub seconds: Option<u64>,
    /// `--stack`, `--precision`, `--zero-stage` and `--place` of the gpt checks, checked
    /// there.
    pub stack: String,
    pub precision: String,
    pub zero_stage: usize,
    pub place: String,
    /// `--model gpt2-124m | gpt-6b` of the gpt checks.
    pub model: String,
    /// `--expect train | device-memory-error`: whether the gpt check must train, or be refused
    /// by `ZeroAdam::on_device` for device memory (a shape that fits only offloaded).
    pub expect: String,
}

fn parse(args: &[String]) -> Result<(String, Options), String> {
    let check = args.first().cloned().ok_or("no check named")?;
    let mut options = Options {
        out: "gpu-check.jsonl".into(),
        device: 0,
        elements: DEFAULT_ELEMENTS,
        cache: None,
        seconds: None,
        stack: "fusion".into(),
        precision: "f32".into(),
        zero_stage: 1,
        place: "device".into(),
        model: "gpt2-124m".into(),
        expect: "train".into(),
    };
    let mut rest = args[1..].iter();
    while let Some(flag) = rest.next() {
        let value = rest.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<usize>()
                .map_err(|e| format!("{flag} {value:?}: {e}"))
        };
        match flag.as_str() {
            "--out" => options.out = value.into(),
            "--device" => options.device = number()?,
            "--elements" => options.elements = number()?,
            "--cache" => options.cache = Some(value.into()),
            "--seconds" => options.seconds = Some(number()? as u64),
            "--stack" => options.stack = value.clone(),
            "--precision" => options.precision = value.clone(),
            "--zero-stage" => options.zero_stage = number()?,
            "--place" => options.place = value.clone(),
            "--model" => options.model = value.clone(),
            "--expect" => options.expect = value.clone(),
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    Ok((check, options))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (check, options) = match parse(&args) {
        Ok(parsed) => parsed,
        Err(problem) => {
            eprintln!("burn-dist-gpu-check: {problem}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    run(&check, &options)
}

#[cfg(not(feature = "cuda"))]
fn run(check: &str, _options: &Options) -> ExitCode {
    eprintln!(
        "burn-dist-gpu-check {check}: this binary was built without the `cuda` feature; build \
         the device check with `cargo xtask gpu-check` (see docs/gpu.md)"
    );
    ExitCode::from(2)
}

#[cfg(feature = "cuda")]
fn run(check: &str, options: &Options) -> ExitCode {
    if check == "versions" {
        println!("{}", libraries::versions());
        return ExitCode::SUCCESS;
    }
    let profile = check == "gpt-profile";
    if options.cache.is_some() || profile {
        configure_cubecl(options.cache.as_deref(), profile);
    }
    let mut report = match report::Report::open(&options.out) {
        Ok(report) => report,
        Err(e) => {
            eprintln!(
                "burn-dist-gpu-check: cannot open {}: {e}",
                options.out.display()
            );
            return ExitCode::from(2);
        }
    };
    match check {
        "nccl-w1" => nccl_w1::run(&mut report, options),
        "kernels" => kernels::run(&mut report, options),
        "fused-step" => fused_step::run(&mut report, options),
        "ddp-step" => ddp_step::run(&mut report, options),
        "ddp-timed" => ddp_step::run_timed(&mut report, options),
        "device-path" => device_path::run(&mut report, options),
        "ranks" => ranks::run(&mut report, options),
        "gpt" => gpt::run(&mut report, options, false),
        "gpt-profile" => gpt::run(&mut report, options, true),
        other => {
            eprintln!("burn-dist-gpu-check: unknown check {other:?}\n{USAGE}");
            return ExitCode::from(2);
        }
    }
    if report.failures() == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// cubecl compiles every kernel with NVRTC and autotunes matmuls and fusion in each process,
/// and keeps neither by default (cubecl-runtime 0.10 `config/compilation.rs`: `cache: None`).
/// The checks of one device call are processes of this binary, so with a `cache` directory
/// they share, only the first to need a kernel compiles it, and a tuned shape is not tuned
/// again. With `profile`, cubecl also times every kernel and writes a table of them at each
/// device sync into [`gpt::profile_log`] (gpt-profile reads it). Set before any cubecl client
/// exists (cubecl reads its configuration once).
#[cfg(feature = "cuda")]
fn configure_cubecl(cache: Option<&std::path::Path>, profile: bool) {
    use cubecl::config::cache::CacheConfig;
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    let mut config = CubeClRuntimeConfig::from_current_dir();
    if let Some(dir) = cache {
        config.compilation.cache = Some(CacheConfig::File(dir.join("compilation")));
        config.autotune.cache = CacheConfig::File(dir.join("autotune"));
    }
    if profile {
        config.profiling.logger.file = Some(gpt::profile_log());
        config.profiling.logger.append = true;
        config.profiling.logger.level = cubecl::config::profiling::ProfilingLogLevel::Basic;
    }
    CubeClRuntimeConfig::set(config.override_from_env());
}
