//! cubecl's kernel profiling tables, read back: with profiling on, cubecl times every kernel
//! and, at each device sync, writes a table of the kernels since the previous one
//! (cubecl-runtime 0.10 `logging/profiling.rs`):
//!
//! ```text
//! |⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺|
//! | Name         | Duration  | Num Computed | Ratio |
//! |⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼|
//! | matmul<f32>  | 1.5ms     | 3            | 75 %  |
//! | Total        | 2ms       | 4            | 100 % |
//! ```
//!
//! `gpt-profile` adds the tables of its profiled steps up by kernel. Pure text work, so that it
//! is tested without a GPU.

#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

/// One kernel's time over the tables read.
#[derive(Debug, Clone, PartialEq)]
pub struct Kernel {
    pub name: String,
    pub seconds: f64,
    pub launches: u64,
}

/// The kernels of some tables, added up by name.
#[derive(Debug, Default)]
pub struct Kernels {
    pub kernels: Vec<Kernel>,
    /// How many tables were read.
    pub tables: usize,
}

impl Kernels {
    pub fn parse(text: &str) -> Kernels {
        let mut kernels = Kernels::default();
        for line in text.lines() {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            // "", name, duration, count, ratio, "" (a rule line has no inner cells).
            let [_, name, duration, count, _ratio, _] = cells[..] else {
                continue;
            };
            if name == "Name" {
                kernels.tables += 1;
                continue;
            }
            if name == "Total" {
                continue;
            }
            let (Some(seconds), Ok(launches)) = (duration_seconds(duration), count.parse()) else {
                continue;
            };
            match kernels.kernels.iter_mut().find(|k| k.name == name) {
                Some(kernel) => {
                    kernel.seconds += seconds;
                    kernel.launches += launches;
                }
                None => kernels.kernels.push(Kernel {
                    name: name.to_string(),
                    seconds,
                    launches,
                }),
            }
        }
        kernels
    }

    pub fn total_s(&self) -> f64 {
        self.kernels.iter().map(|k| k.seconds).sum()
    }

    pub fn launches(&self) -> u64 {
        self.kernels.iter().map(|k| k.launches).sum()
    }

    /// The `n` kernels that took the most time, slowest first.
    pub fn slowest(&self, n: usize) -> Vec<Kernel> {
        let mut sorted = self.kernels.clone();
        sorted.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        sorted.truncate(n);
        sorted
    }
}

/// A `Duration`'s `Debug` text (`1.5ms`, `12.3µs`, `2s`, `800ns`) in seconds.
fn duration_seconds(text: &str) -> Option<f64> {
    let split = text.find(|c: char| c.is_alphabetic() || c == 'µ')?;
    let (number, unit) = text.split_at(split);
    let scale = match unit {
        "s" => 1.0,
        "ms" => 1e-3,
        "µs" | "us" => 1e-6,
        "ns" => 1e-9,
        _ => return None,
    };
    number.parse::<f64>().ok().map(|n| n * scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two tables as cubecl writes them (rules of its own characters, cells padded).
    const TABLES: &str = "\
|⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺| 
| Name                     | Duration   | Num Computed | Ratio |
|⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼| 
| matmul<f32, tile 64x64>  | 1.5ms      | 3            | 75 %  |
| fused_elemwise           | 500µs      | 10           | 25 %  |
|⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼⎼| 
| Total                    | 2ms        | 13           | 100 % |
|⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯⎯| 
|⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺⎺| 
| Name                     | Duration   | Num Computed | Ratio |
| fused_elemwise           | 2.5ms      | 5            | 62 %  |
| reduce_sum               | 1.5s       | 1            | 37 %  |
| Total                    | 1.5025s    | 6            | 100 % |
";

    #[test]
    fn tables_add_up_by_kernel_and_the_slowest_come_first() {
        let kernels = Kernels::parse(TABLES);
        assert_eq!(kernels.tables, 2);
        assert_eq!(kernels.launches(), 19);
        let slowest = kernels.slowest(2);
        assert_eq!(slowest[0].name, "reduce_sum");
        assert_eq!(slowest[1].name, "fused_elemwise");
        assert!((slowest[1].seconds - 3e-3).abs() < 1e-12);
        assert_eq!(slowest[1].launches, 15);
        assert!((kernels.total_s() - (1.5 + 3e-3 + 1.5e-3)).abs() < 1e-12);
    }

    #[test]
    fn durations_read_in_every_unit_debug_writes() {
        assert_eq!(duration_seconds("2s"), Some(2.0));
        assert!((duration_seconds("800ns").unwrap() - 8e-7).abs() < 1e-18);
        assert!((duration_seconds("12.5µs").unwrap() - 12.5e-6).abs() < 1e-15);
        assert_eq!(duration_seconds("12"), None);
        assert_eq!(duration_seconds("3 weeks"), None);
    }
}
