//! `nccl-w1`: the NCCL communicator at world size 1, joined through a TCP store on loopback
//! as a real job joins, every collective × dtype × length against the host reference
//! (`burn_dist_comm::testing`). At world size 1 each collective must return its input
//! exactly, so the comparison is bitwise.
//!
//! What world size 1 cannot reach: the grouped calls for uneven chunks (one rank has one
//! chunk; `nccl::plan`'s unit tests cover their layout), timeouts and dead peers.

use std::time::{Duration, Instant};

use burn_dist_comm::store::{StoreClient, StoreServer};
use burn_dist_comm::testing::{rank_data, reference_reduce};
use burn_dist_comm::{
    CommConfig, CommError, Communicator, DType, HostBuffer, NcclCommunicator, ReduceOp, chunk_range,
};
use serde_json::json;

use crate::Options;
use crate::report::Report;

const TOKEN: &str = "gpu-check";
/// Empty, single, odd, a few cubes, just past a power of two, and 4 MiB-ish.
const LENGTHS: [usize; 6] = [0, 1, 7, 1000, 4097, (1 << 20) + 3];
const DTYPES: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::U8];

pub fn run(report: &mut Report, options: &Options) {
    let config = CommConfig::default().with_timeout(Duration::from_secs(60));
    let any_port = "127.0.0.1:0".parse().expect("a socket address");
    let joined = StoreServer::bind(any_port, TOKEN, 1, &config).and_then(|server| {
        let store = StoreClient::connect(server.local_addr(), TOKEN, 0, &config)?;
        Ok((server, store))
    });
    let (_server, store) = match joined {
        Ok(joined) => joined,
        Err(e) => return report.fail("nccl-w1/store", e, json!({})),
    };

    let start = Instant::now();
    let comm = match NcclCommunicator::new(&store, 0, 1, options.device, &config) {
        Ok(comm) => comm,
        Err(e) => return report.fail("nccl-w1/init", e, json!({ "device": options.device })),
    };
    let (major, minor, patch) = comm.nccl_version();
    report.pass(
        "nccl-w1/init",
        json!({
            "device": options.device,
            "nccl_version": format!("{major}.{minor}.{patch}"),
            "seconds": start.elapsed().as_secs_f64(),
        }),
    );

    for (i, dtype) in DTYPES.into_iter().enumerate() {
        let start = Instant::now();
        let mut cases = 0;
        let mut failures = Vec::new();
        for (j, len) in LENGTHS.into_iter().enumerate() {
            let seed = 1000 * i as u64 + j as u64;
            if let Err(e) = check_length(&comm, dtype, len, seed, &mut cases, &mut failures) {
                failures.push(format!("len {len}: {e}"));
                break;
            }
        }
        let fields = json!({
            "dtype": dtype.to_string(),
            "lengths": LENGTHS,
            "cases": cases,
            "seconds": start.elapsed().as_secs_f64(),
        });
        let check = format!("nccl-w1/{dtype}");
        if failures.is_empty() {
            report.pass(&check, fields);
        } else {
            let first: Vec<&String> = failures.iter().take(8).collect();
            report.fail(
                &check,
                format!("{} failures: {first:?}", failures.len()),
                fields,
            );
        }
    }

    let start = Instant::now();
    drop(comm);
    report.pass(
        "nccl-w1/shutdown",
        json!({ "seconds": start.elapsed().as_secs_f64() }),
    );

    check_errors(report, &store, options, &config);
}

/// Runs every collective on `len` elements of `dtype`, pushing a message per mismatch.
/// `Err` when a collective itself fails (the communicator is aborted then).
fn check_length(
    comm: &NcclCommunicator,
    dtype: DType,
    len: usize,
    seed: u64,
    cases: &mut usize,
    failures: &mut Vec<String>,
) -> Result<(), CommError> {
    let input = rank_data(dtype, len, seed, 0);
    let mut expect = |what: String, got: &HostBuffer, want: &HostBuffer| {
        *cases += 1;
        if let Some(problem) = differ(got, want) {
            failures.push(format!("{what} {dtype} len {len}: {problem}"));
        }
    };
    let ops: &[ReduceOp] = match dtype {
        DType::U8 => &[ReduceOp::Max],
        _ => &[ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max],
    };
    for &op in ops {
        let want = reference_reduce(std::slice::from_ref(&input), op);
        let got = comm.all_reduce(comm.upload(&input)?, op).wait()?;
        expect(format!("all_reduce {op}"), &comm.download(&got)?, &want);

        // This rank's chunk, then all-gathered back in place from the reduce-scatter's view.
        let own = chunk_range(len, 1, 0);
        let shard = comm.reduce_scatter(comm.upload(&input)?, op).wait()?;
        expect(
            format!("reduce_scatter {op}"),
            &comm.download(&shard)?,
            &want.slice(own),
        );
        let gathered = comm.all_gather(shard, len).wait()?;
        expect(
            format!("all_gather after reduce_scatter {op}"),
            &comm.download(&gathered)?,
            &want,
        );

        let counted = comm
            .reduce_scatter_counts(comm.upload(&input)?, op, vec![len])
            .wait()?;
        expect(
            format!("reduce_scatter_counts {op}"),
            &comm.download(&counted)?,
            &want,
        );
    }
    let gathered = comm.all_gather(comm.upload(&input)?, len).wait()?;
    expect("all_gather".into(), &comm.download(&gathered)?, &input);
    let broadcast = comm.broadcast(comm.upload(&input)?, 0).wait()?;
    expect("broadcast".into(), &comm.download(&broadcast)?, &input);
    comm.barrier().wait()?;
    Ok(())
}

/// `None` when bitwise equal, else what differs.
fn differ(got: &HostBuffer, want: &HostBuffer) -> Option<String> {
    if got.dtype() != want.dtype() || got.len() != want.len() {
        return Some(format!(
            "got {} {} elements, want {} {}",
            got.len(),
            got.dtype(),
            want.len(),
            want.dtype()
        ));
    }
    let size = got.dtype().size();
    let bad: Vec<usize> = got
        .as_bytes()
        .chunks_exact(size)
        .zip(want.as_bytes().chunks_exact(size))
        .enumerate()
        .filter(|(_, (a, b))| a != b)
        .map(|(i, _)| i)
        .collect();
    (!bad.is_empty()).then(|| {
        format!(
            "{} of {} elements differ (first at {})",
            bad.len(),
            got.len(),
            bad[0]
        )
    })
}

/// A bad argument is refused with an error that names it, the communicator then fails fast
/// (aborted, no hang), and dropping it returns. Runs on a second communicator of the same
/// store, which also checks that a job can build several.
fn check_errors(report: &mut Report, store: &StoreClient, options: &Options, config: &CommConfig) {
    let start = Instant::now();
    let comm = match NcclCommunicator::new(store, 0, 1, options.device, config) {
        Ok(comm) => comm,
        Err(e) => {
            return report.fail(
                "nccl-w1/errors",
                format!("second communicator: {e}"),
                json!({}),
            );
        }
    };
    let result = (|| -> Result<(String, String), String> {
        let buf = comm
            .upload(&rank_data(DType::F32, 16, 7, 0))
            .map_err(|e| e.to_string())?;
        let bad = match comm.broadcast(buf, 1).wait() {
            Err(e @ CommError::InvalidArgument { .. }) if e.to_string().contains("root 1") => {
                e.to_string()
            }
            other => return Err(format!("broadcast from root 1 of 1 gave {other:?}")),
        };
        let buf = comm
            .upload(&rank_data(DType::U8, 16, 7, 0))
            .map_err(|e| e.to_string())?;
        let after = match comm.all_reduce(buf, ReduceOp::Max).wait() {
            Err(e @ CommError::Aborted { .. }) => e.to_string(),
            other => return Err(format!("the collective after a failure gave {other:?}")),
        };
        Ok((bad, after))
    })();
    drop(comm);
    let seconds = start.elapsed().as_secs_f64();
    match result {
        Ok((bad, after)) => report.pass(
            "nccl-w1/errors",
            json!({ "bad_root": bad, "after_failure": after, "seconds": seconds }),
        ),
        Err(e) => report.fail("nccl-w1/errors", e, json!({ "seconds": seconds })),
    }
}
