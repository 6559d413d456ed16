//! Joining the job: the one a launcher described in the environment, or, when no launcher
//! started this process, a job of one rank in it, so that the same program runs by hand
//! (`cargo run`) and under `burn-dist-run`, torchrun or Slurm.

use std::sync::Arc;

use burn_dist_comm::{CommConfig, Group, HostCommunicator};

use crate::error::Result;
use crate::threads::{PoolSize, share_cores};

/// The variables that say a launcher started this process. Any one of them is enough: a partial
/// set is a mistake, which joining reports naming the missing variable, rather than a job of
/// one rank that silently trains alone. MASTER_ADDR and MASTER_PORT alone do not count (they
/// name a job's store, not a place in it), nor Slurm's allocation variables without
/// SLURM_PROCID (a shell inside `salloc`, not a task started by `srun`).
pub const LAUNCHER_VARS: [&str; 5] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "SLURM_PROCID",
];

/// The first launcher variable that `get` finds, if any.
pub(crate) fn launcher_variable(get: impl Fn(&str) -> Option<String>) -> Option<&'static str> {
    LAUNCHER_VARS.into_iter().find(|var| get(var).is_some())
}

/// This process's membership: the launched job's group, or `None` for a job of one rank.
pub(crate) struct Joined {
    pub comm: Arc<HostCommunicator>,
    pub group: Option<Group>,
    pub pool: PoolSize,
}

/// Joins the job described by the environment, then gives rayon's pool this rank's share of the
/// host's cores (after joining, so that a bad environment is reported first). Without any
/// launcher variable: a job of one rank, which says so in the log.
pub(crate) fn join() -> Result<Joined> {
    if launcher_variable(|var| std::env::var(var).ok()).is_none() {
        tracing::info!(
            "no launcher variable is set ({}): running as a job of one rank; start the program \
             with `burn-dist-run --nproc-per-node N -- ...` to train on N ranks",
            LAUNCHER_VARS.join(", ")
        );
        let comm = HostCommunicator::local_group(1, &CommConfig::default()).remove(0);
        return Ok(Joined {
            comm: Arc::new(comm),
            group: None,
            pool: share_cores(1),
        });
    }
    let group = burn_dist_comm::init(CommConfig::default())?;
    let pool = share_cores(group.info.local_world_size);
    Ok(Joined {
        comm: group.comm.clone(),
        group: Some(group),
        pool,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn only(set: &'static str) -> impl Fn(&str) -> Option<String> {
        move |var| (var == set).then(|| "0".to_string())
    }

    #[test]
    fn no_launcher_variable_means_a_job_of_one_rank() {
        assert_eq!(launcher_variable(|_| None), None);
        // A store's address alone, or a Slurm allocation without a task id, is not a launch.
        for var in ["MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS", "SLURM_JOB_ID"] {
            assert_eq!(launcher_variable(only(var)), None, "{var}");
        }
    }

    #[test]
    fn any_launcher_variable_means_a_launched_job() {
        for var in LAUNCHER_VARS {
            assert_eq!(launcher_variable(only(var)), Some(var));
        }
    }
}
