//! One JSON object per optimizer step (JSON Lines), written by rank 0, and the numbers in it that
//! need computing: throughput, model FLOPs utilization and resident memory.
//!
//! Throughput is wall clock over whole iterations ([`LoopClock`]): each step's time runs from the
//! previous step's record to its own, so evaluation, checkpoints and bookkeeping count, and the
//! steps' times add up to the loop's. What is printed and plotted is then what a user timing the
//! run gets.
//!
//! MFU = `flops_per_token · tokens_per_s / peak_flops`, with `flops_per_token = 6·N + 12·L·d·T`
//! (see [`crate::model::GptConfig::flops_per_token`]): the FLOPs the model needs, not the ones
//! the hardware ran (no recomputation counted).

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

/// One line of the metrics file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// Optimizer steps done (1 after the first step).
    pub step: u64,
    /// Mean training loss of the step's global batch, nats per token.
    pub loss: f64,
    /// Mean validation loss, on the steps that evaluate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// The corpus's entropy floor, nats per token, when known (synthetic corpus).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub floor: Option<f64>,
    pub lr: f64,
    /// The loss scale used in this step (f16 only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f32>,
    /// Global L2 norm of the averaged gradient before clipping; `None` (null) when it is not
    /// finite (a step that loss scaling skips).
    #[serde(default)]
    pub grad_norm: Option<f64>,
    /// Whether the step was skipped (loss scaling found inf/NaN).
    #[serde(default)]
    pub skipped: bool,
    /// Tokens of the global batch per second of this iteration's wall time (all ranks
    /// together): from the previous step's record to this one's, evaluation and checkpoints
    /// included.
    pub tokens_per_s: f64,
    /// Model FLOPs per second (`flops_per_token · tokens_per_s`).
    pub flops_per_s: f64,
    /// `flops_per_s / --peak-flops` (× world size's share is already in `flops_per_s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    /// Resident memory (VmRSS) of every rank at the end of the step, MiB, by rank; on the steps
    /// that print a line only (`--log-every`, evaluations, the last), else empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rss_mib: Vec<f64>,
    /// The most resident memory every rank has had so far (VmHWM), MiB, by rank; on the same
    /// steps as `rss_mib`. It counts every page a rank maps in full: at ZeRO stage 3 the
    /// peers' shared gather buffers are counted in every rank that read them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peak_rss_mib: Vec<f64>,
    /// The most proportional set size every rank has had so far (private memory plus its
    /// share of each shared page, read at the steps' high points: `crate::memory`), MiB, by
    /// rank; on the same steps as `rss_mib`. What a rank costs the host: the ranks' figures
    /// add up to what they hold together.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peak_pss_mib: Vec<f64>,
    /// ZeRO stage 3: what rank 0's sharded parameters held and cost in this step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards: Option<ShardRecord>,
    /// Seconds since the start of this process's training loop.
    pub elapsed_s: f64,
    /// Bytes rank 0's reducer moved from the backend's memory to the host in this step; on the
    /// device path also ZeroAdam's (they share one counter): 0 gradient bytes with NCCL, only
    /// the step's scalars (`ReducerStats::bytes_to_host`).
    #[serde(default)]
    pub bytes_to_host: u64,
    /// The same from the host into the backend's memory (`ReducerStats::bytes_to_device`).
    #[serde(default)]
    pub bytes_to_device: u64,
    /// Seconds rank 0's training thread spent on checkpoints since the previous record (in
    /// this iteration's wall time): a synchronous save whole; with `--checkpoint-async` the
    /// snapshot, the directory's preparation, the polls and the commits. `None` without
    /// `--checkpoint-every`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_s: Option<f64>,
}

/// ZeRO stage 3's counters for one step of one rank (burn-dist's `ShardStats`), in MiB.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ShardRecord {
    /// This rank's pieces of the parameters.
    pub shard_mib: f64,
    /// The most gathered parameter bytes held at once during the step (by the running ops).
    pub gathered_peak_mib: f64,
    /// Parameter bytes gathered during the step (forward, backward, evaluation).
    pub gathered_mib: f64,
    /// Parameters read outside any op so far (0 in training).
    pub reads: u64,
    /// Seconds the step's ops waited for their gathers to arrive.
    #[serde(default)]
    pub gather_wait_s: f64,
    /// Gathers issued ahead of their use during the step (0 with `--prefetch-gathers 0`, and
    /// in the first step, which records the schedule).
    #[serde(default)]
    pub prefetched: u64,
    /// Host gathers of the step written into a buffer an earlier gather left (none in the
    /// first step), and the bytes of such buffers kept free at the step's end.
    #[serde(default)]
    pub reused_buffers: u64,
    #[serde(default)]
    pub pooled_mib: f64,
    /// Host gathers of the step that read the peers' pieces where they lie (shared buffers
    /// of ranks on one host).
    #[serde(default)]
    pub gathered_in_place: u64,
    /// What rank 0's shared buffers (its arena under `/dev/shm`) hold at the step's end, and
    /// the most they have held at once since the start.
    #[serde(default)]
    pub shared_mib: f64,
    #[serde(default)]
    pub shared_peak_mib: f64,
}

/// Tokens per second of wall time: over one iteration, over a log interval and over the whole
/// loop, all read from one clock, so that they agree.
pub struct LoopClock {
    began: Instant,
    /// The end of the previous iteration (its record).
    lap: Instant,
    /// The end of the iteration of the previous printed line, and the tokens since.
    interval: (Instant, u64),
    tokens: u64,
}

/// One reading of a [`LoopClock`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    pub tokens_per_s: f64,
    /// Seconds since the loop began.
    pub elapsed_s: f64,
}

impl LoopClock {
    /// Starts the clock at the top of the training loop.
    pub fn start() -> Self {
        let now = Instant::now();
        LoopClock {
            began: now,
            lap: now,
            interval: (now, 0),
            tokens: 0,
        }
    }

    /// Ends an iteration that trained `tokens`: its rate since the previous one ended.
    pub fn lap(&mut self, tokens: u64) -> Rate {
        let now = Instant::now();
        let seconds = now.duration_since(self.lap).as_secs_f64();
        self.lap = now;
        self.interval.1 += tokens;
        self.tokens += tokens;
        Rate {
            tokens_per_s: tokens as f64 / seconds.max(f64::MIN_POSITIVE),
            elapsed_s: now.duration_since(self.began).as_secs_f64(),
        }
    }

    /// The rate over the iterations since the previous call (a log interval), up to the last lap.
    pub fn interval(&mut self) -> f64 {
        let (since, tokens) = self.interval;
        self.interval = (self.lap, 0);
        tokens as f64
            / self
                .lap
                .duration_since(since)
                .as_secs_f64()
                .max(f64::MIN_POSITIVE)
    }

    /// The rate over the whole loop until now, and the tokens and seconds it is made of.
    pub fn end_to_end(&self) -> (f64, u64, f64) {
        let seconds = self.began.elapsed().as_secs_f64();
        (
            self.tokens as f64 / seconds.max(f64::MIN_POSITIVE),
            self.tokens,
            seconds,
        )
    }
}

/// Appends records to a JSON Lines file.
pub struct MetricsWriter {
    out: BufWriter<File>,
    path: PathBuf,
}

impl MetricsWriter {
    /// Creates `path` (and its directory); `append` keeps the records of an earlier run (resume).
    pub fn open(path: &Path, append: bool) -> Result<Self, String> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        }
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(path)
            .map_err(|e| format!("--metrics {}: {e}", path.display()))?;
        Ok(MetricsWriter {
            out: BufWriter::new(file),
            path: path.to_path_buf(),
        })
    }

    /// Writes one line and flushes it, so a crashed run keeps every finished step.
    pub fn write(&mut self, record: &StepRecord) -> Result<(), String> {
        let line = serde_json::to_string(record).expect("a record serializes");
        writeln!(self.out, "{line}")
            .and_then(|()| self.out.flush())
            .map_err(|e| format!("writing {}: {e}", self.path.display()))
    }
}

/// Every record of a metrics file; when a resumed run repeated steps, the last record of each
/// step wins, in step order.
pub fn read(path: &Path) -> Result<Vec<StepRecord>, String> {
    let file = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut records: Vec<StepRecord> = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| format!("{}: {e}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let record: StepRecord = serde_json::from_str(&line)
            .map_err(|e| format!("{} line {}: {e}", path.display(), i + 1))?;
        records.retain(|r| r.step != record.step);
        records.push(record);
    }
    records.sort_by_key(|r| r.step);
    Ok(records)
}

/// This process's resident set size (VmRSS of /proc/self/status) in KiB; `None` where there is
/// no procfs.
pub fn resident_kib() -> Option<u64> {
    status_kib("VmRSS:")
}

/// The most resident memory this process has had (VmHWM, its high-water mark) in KiB.
pub fn peak_resident_kib() -> Option<u64> {
    status_kib("VmHWM:")
}

fn status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_the_last_record_of_a_step_wins() {
        let path = std::env::temp_dir().join(format!("gpt-metrics-{}.jsonl", std::process::id()));
        let record = |step, loss| StepRecord {
            step,
            loss,
            val_loss: (step == 2).then_some(1.5),
            floor: Some(1.0),
            lr: 1e-3,
            loss_scale: None,
            grad_norm: Some(0.5),
            skipped: false,
            tokens_per_s: 100.0,
            flops_per_s: 1e9,
            mfu: None,
            rss_mib: vec![10.0, 11.0],
            peak_rss_mib: vec![12.0, 13.0],
            peak_pss_mib: vec![11.0, 12.0],
            shards: Some(ShardRecord {
                shard_mib: 1.0,
                gathered_peak_mib: 0.5,
                gathered_mib: 4.0,
                reads: 0,
                gather_wait_s: 0.25,
                prefetched: 3,
                reused_buffers: 2,
                pooled_mib: 0.25,
                gathered_in_place: 1,
                shared_mib: 0.5,
                shared_peak_mib: 0.75,
            }),
            elapsed_s: 1.0,
            checkpoint_s: Some(0.125),
            bytes_to_host: 4096,
            bytes_to_device: 4144,
        };
        let mut w = MetricsWriter::open(&path, false).unwrap();
        for step in 1..=3 {
            w.write(&record(step, 3.0)).unwrap();
        }
        drop(w);
        let mut w = MetricsWriter::open(&path, true).unwrap();
        w.write(&record(3, 2.0)).unwrap();
        drop(w);
        let back = read(&path).unwrap();
        assert_eq!(back.len(), 3);
        assert_eq!(back[1], record(2, 3.0));
        assert_eq!(back[2].loss, 2.0, "the resumed run's step 3");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn the_laps_of_a_loop_clock_add_up_to_its_end_to_end_rate() {
        let mut clock = LoopClock::start();
        let mut seconds = 0.0;
        let mut last = None;
        for tokens in [100, 300, 200] {
            // Some work of known size between the laps, so no lap is empty.
            let spin = Instant::now();
            while spin.elapsed().as_micros() < 500 {}
            let rate = clock.lap(tokens);
            seconds += tokens as f64 / rate.tokens_per_s;
            last = Some(rate);
        }
        let interval = clock.interval();
        let (end_to_end, tokens, _) = clock.end_to_end();
        assert_eq!(tokens, 600);
        let elapsed = last.unwrap().elapsed_s;
        assert!(
            (seconds - elapsed).abs() < 1e-9 * elapsed,
            "{seconds} vs {elapsed}"
        );
        assert!((interval - 600.0 / elapsed).abs() < 1e-9 * interval);
        assert!(
            end_to_end <= interval,
            "the end-to-end time also counts since the last lap"
        );
    }

    #[test]
    fn resident_memory_is_read_from_procfs() {
        let kib = resident_kib().expect("Linux has /proc/self/status");
        assert!(kib > 100, "{kib} KiB");
    }
}
