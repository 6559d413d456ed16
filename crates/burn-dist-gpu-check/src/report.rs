//! The results file: one JSON object per line, written and flushed as soon as it is known.

#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

use serde_json::{Map, Value, json};

/// Appends result lines to a file (and echoes them on stdout).
pub struct Report {
    file: File,
    failures: usize,
}

impl Report {
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Report { file, failures: 0 })
    }

    /// How many `"status": "fail"` lines were written.
    pub fn failures(&self) -> usize {
        self.failures
    }

    /// Writes `{"check": check, "status": status, "unix_time": …, …fields}`.
    pub fn line(&mut self, check: &str, status: Status, fields: Value) {
        let mut object = Map::new();
        object.insert("check".into(), json!(check));
        object.insert("status".into(), json!(status.as_str()));
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        object.insert("unix_time".into(), json!(now));
        if let Value::Object(fields) = fields {
            object.extend(fields);
        }
        if status == Status::Fail {
            self.failures += 1;
        }
        let text = Value::Object(object).to_string();
        println!("{text}");
        // A line that cannot be written is still on stdout, which run.sh logs.
        if let Err(e) = writeln!(self.file, "{text}").and_then(|()| self.file.flush()) {
            eprintln!("burn-dist-gpu-check: cannot write the results file: {e}");
        }
    }

    pub fn pass(&mut self, check: &str, fields: Value) {
        self.line(check, Status::Pass, fields);
    }

    /// A failed check, with what went wrong in `error`.
    pub fn fail(&mut self, check: &str, error: impl std::fmt::Display, fields: Value) {
        let mut fields = match fields {
            Value::Object(map) => map,
            _ => Map::new(),
        };
        fields.insert("error".into(), json!(error.to_string()));
        self.line(check, Status::Fail, Value::Object(fields));
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Pass,
    Fail,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Status::Pass => "pass",
            Status::Fail => "fail",
        }
    }
}

/// Runs `f`, turning a panic (an assertion of a shared check, or one deep inside a library)
/// into an error message.
pub fn guarded<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|payload| {
        payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panicked with a non-text payload".into())
    })
}

/// The median of timings (the mean of the middle two for an even count).
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}
