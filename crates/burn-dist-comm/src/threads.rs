//! Each rank's share of the host's cores.
//!
//! A CPU backend left alone sizes its thread pool to the whole machine (rayon's global pool, which
//! Flex and gemm use, does). N ranks on one host of N cores then run N² busy threads, which take
//! the cores and the caches from each other: on 2 cores, 2 ranks of the tiny GPT ran 22 % faster
//! with one thread each (issue 17; docs/perf/cpu-throughput.md). So each rank gets
//! `max(1, cores / local ranks)` threads, through the variables the pools read, unless the user
//! set them: `burn-dist-run` puts them in each rank's environment, and `Ddp::init` sizes rayon's
//! pool itself for ranks started some other way (Slurm, torchrun). See docs/guide.md, "Threads
//! per rank".

use std::fmt;

/// Sizes rayon's global pool (Flex's kernels, gemm's parallel matmul, NdArray's).
pub const RAYON_THREADS_VAR: &str = "RAYON_NUM_THREADS";
/// Sizes OpenMP's pool (a BLAS such as OpenBLAS built with OpenMP, PyTorch in a data loader).
pub const OPENMP_THREADS_VAR: &str = "OMP_NUM_THREADS";
/// Every variable a rank's share is written to.
pub const THREAD_VARS: [&str; 2] = [RAYON_THREADS_VAR, OPENMP_THREADS_VAR];

/// The threads each of a host's ranks gets, and which of [`THREAD_VARS`] carry it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadShare {
    /// Cores this process may run on.
    pub cores: usize,
    /// Ranks sharing them.
    pub local_ranks: usize,
    /// `max(1, cores / local_ranks)`.
    pub threads: usize,
    /// The variables the user left unset, which this share sets (in [`THREAD_VARS`] order).
    pub sets: Vec<&'static str>,
    /// The variables the user set, with their values: the user's choice wins.
    pub kept: Vec<(&'static str, String)>,
}

impl ThreadShare {
    /// The share of `local_ranks` ranks on `cores` cores, given the variables that `get` reads
    /// (the process environment, or a test's map). A variable that is present, whatever its
    /// value, is the user's and is kept.
    pub fn plan(cores: usize, local_ranks: usize, get: impl Fn(&str) -> Option<String>) -> Self {
        let (mut sets, mut kept) = (Vec::new(), Vec::new());
        for var in THREAD_VARS {
            match get(var) {
                Some(value) => kept.push((var, value)),
                None => sets.push(var),
            }
        }
        ThreadShare {
            cores,
            local_ranks,
            threads: (cores / local_ranks.max(1)).max(1),
            sets,
            kept,
        }
    }

    /// The share of `local_ranks` ranks on this host, as this process's environment stands.
    pub fn from_env(local_ranks: usize) -> Self {
        ThreadShare::plan(available_cores(), local_ranks, |var| {
            std::env::var_os(var).map(|v| v.to_string_lossy().into_owned())
        })
    }

    /// The variables to add to a rank's environment: the unset ones, each to [`Self::threads`].
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let threads = self.threads.to_string();
        self.sets
            .iter()
            .map(|&var| (var, threads.clone()))
            .collect()
    }

    /// Whether `var` was left to this share (not set by the user).
    pub fn sets(&self, var: &str) -> bool {
        self.sets.contains(&var)
    }
}

impl fmt::Display for ThreadShare {
    /// One line for the log: what each rank gets, and what of the user's was kept.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ThreadShare {
            cores,
            local_ranks,
            threads,
            ..
        } = self;
        let plural =
            |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
        let ranks = plural(*local_ranks, "rank", "ranks");
        let (cores, threads) = (
            plural(*cores, "core", "cores"),
            plural(*threads, "thread", "threads"),
        );
        let kept = listed(&self.kept);
        if self.sets.is_empty() {
            return write!(
                f,
                "{ranks} on this host share {cores}: kept yours, {kept} (the share would be \
                 {threads} each)"
            );
        }
        write!(
            f,
            "{ranks} on this host share {cores}: each gets {threads} ({})",
            listed(&self.env())
        )?;
        if self.kept.is_empty() {
            write!(f, "; export {RAYON_THREADS_VAR} to choose yourself")?;
        } else {
            write!(f, "; kept yours: {kept}")?;
        }
        Ok(())
    }
}

/// `VAR=value` pairs, space-separated.
fn listed(vars: &[(&'static str, String)]) -> String {
    let vars: Vec<String> = vars.iter().map(|(v, n)| format!("{v}={n}")).collect();
    vars.join(" ")
}

/// The cores this process may run on: its CPU affinity and cgroup quota, as
/// [`std::thread::available_parallelism`] reads them; 1 when they cannot be read.
pub fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn plan(cores: usize, local: usize, vars: &[(&str, &str)]) -> ThreadShare {
        let map: HashMap<&str, &str> = vars.iter().copied().collect();
        ThreadShare::plan(cores, local, |v| map.get(v).map(|s| s.to_string()))
    }

    #[test]
    fn each_rank_gets_cores_over_local_ranks_and_at_least_one() {
        assert_eq!(plan(2, 2, &[]).threads, 1);
        assert_eq!(plan(16, 4, &[]).threads, 4);
        assert_eq!(plan(10, 4, &[]).threads, 2, "rounded down");
        assert_eq!(plan(2, 8, &[]).threads, 1, "never 0");
        assert_eq!(plan(8, 0, &[]).threads, 8, "0 ranks read as 1");
        assert_eq!(
            plan(16, 4, &[]).env(),
            [
                ("RAYON_NUM_THREADS", "4".into()),
                ("OMP_NUM_THREADS", "4".into())
            ]
        );
    }

    #[test]
    fn a_variable_the_user_set_is_kept_and_the_other_still_set() {
        let share = plan(16, 4, &[("RAYON_NUM_THREADS", "7")]);
        assert_eq!(share.env(), [("OMP_NUM_THREADS", "4".into())]);
        assert_eq!(share.kept, [("RAYON_NUM_THREADS", "7".into())]);
        assert!(!share.sets(RAYON_THREADS_VAR) && share.sets(OPENMP_THREADS_VAR));
        let both = plan(
            16,
            4,
            &[("RAYON_NUM_THREADS", ""), ("OMP_NUM_THREADS", "2")],
        );
        assert!(both.env().is_empty(), "present, even empty, is the user's");
    }

    #[test]
    fn the_log_line_says_what_each_rank_gets_and_what_was_kept() {
        assert_eq!(
            plan(2, 2, &[]).to_string(),
            "2 ranks on this host share 2 cores: each gets 1 thread \
             (RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1); export RAYON_NUM_THREADS to choose yourself"
        );
        assert_eq!(
            plan(
                2,
                2,
                &[("RAYON_NUM_THREADS", "2"), ("OMP_NUM_THREADS", "2")]
            )
            .to_string(),
            "2 ranks on this host share 2 cores: kept yours, RAYON_NUM_THREADS=2 \
             OMP_NUM_THREADS=2 (the share would be 1 thread each)"
        );
        assert_eq!(
            plan(8, 2, &[("RAYON_NUM_THREADS", "3")]).to_string(),
            "2 ranks on this host share 8 cores: each gets 4 threads (OMP_NUM_THREADS=4); \
             kept yours: RAYON_NUM_THREADS=3"
        );
    }
}
