//! The library's half of each rank's share of the cores (see `burn_dist_comm::threads`): ranks
//! that `burn-dist-run` did not start (Slurm, torchrun, by hand) get it when they join.
//!
//! The launcher sets RAYON_NUM_THREADS before a rank starts, and rayon reads it when it builds
//! its global pool, lazily, at the first parallel call. Here it is too late for a variable but
//! not for the pool: `Ddp::init` builds rayon's global pool with the share, unless the user set
//! RAYON_NUM_THREADS, or the pool was built before (a tensor operation before `Ddp::init`), which
//! is reported, naming the variable that would have sized it. OpenMP reads OMP_NUM_THREADS when
//! its library loads, before `main`: only the launcher, or the user, can set it.

use burn_dist_comm::ThreadShare;
use burn_dist_comm::threads::RAYON_THREADS_VAR;

/// What joining the job did to rayon's global pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolSize {
    /// Built with the share's threads.
    Shared(usize),
    /// Left to the user's (or the launcher's) RAYON_NUM_THREADS, with the threads it gave.
    Chosen(usize),
    /// Already built before `Ddp::init`, with this many threads; the share could not apply.
    AlreadyBuilt { threads: usize, share: usize },
}

/// Gives rayon's global pool this rank's share of the host's cores, for `local_ranks` ranks on
/// the host, unless RAYON_NUM_THREADS is set; says what it did (info, or a warning when the pool
/// already existed with another size).
pub(crate) fn share_cores(local_ranks: usize) -> PoolSize {
    let share = ThreadShare::from_env(local_ranks);
    if !share.sets(RAYON_THREADS_VAR) {
        return PoolSize::Chosen(rayon::current_num_threads());
    }
    let built = rayon::ThreadPoolBuilder::new()
        .num_threads(share.threads)
        .build_global();
    match built {
        Ok(()) => {
            tracing::info!("{share}");
            PoolSize::Shared(share.threads)
        }
        Err(_) => {
            let threads = rayon::current_num_threads();
            if threads != share.threads {
                tracing::warn!(
                    "rayon's global thread pool was built before Ddp::init, with {threads} \
                     threads, but {} ranks on this host share {} cores ({} each): set \
                     {RAYON_THREADS_VAR}={} for each rank, launch with burn-dist-run, or call \
                     Ddp::init before the first tensor operation",
                    share.local_ranks,
                    share.cores,
                    share.threads,
                    share.threads
                );
            }
            PoolSize::AlreadyBuilt {
                threads,
                share: share.threads,
            }
        }
    }
}
