//! One JSON object per optimizer step (JSON Lines), written by rank 0, and the numbers in it that
//! need computing: throughput, model FLOPs utilization and resident memory.
//!
//! MFU = `flops_per_token · tokens_per_s / peak_flops`, with `flops_per_token = 6·N + 12·L·d·T`
//! (see [`crate::model::GptConfig::flops_per_token`]): the FLOPs the model needs, not the ones
//! the hardware ran (no recomputation counted).

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

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
    /// Tokens of the global batch per second of this step's wall time (all ranks together).
    pub tokens_per_s: f64,
    /// Model FLOPs per second (`flops_per_token · tokens_per_s`).
    pub flops_per_s: f64,
    /// `flops_per_s / --peak-flops` (× world size's share is already in `flops_per_s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    /// Resident memory (VmRSS) of every rank at the end of the step, MiB, by rank.
    pub rss_mib: Vec<f64>,
    /// Seconds since the start of this process's training loop.
    pub elapsed_s: f64,
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
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
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
            elapsed_s: 1.0,
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
    fn resident_memory_is_read_from_procfs() {
        let kib = resident_kib().expect("Linux has /proc/self/status");
        assert!(kib > 100, "{kib} KiB");
    }
}
