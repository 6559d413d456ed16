//! Test scaffolding shared by unit tests, multi-process checks and benches: deterministic
//! per-rank data, the straightforward reference of each reduction, and groups of ranks in one
//! process.

use std::net::SocketAddr;

use half::{bf16, f16};

use crate::store::{StoreClient, StoreServer};
use crate::{CommConfig, Communicator, DType, HostBuffer, HostCommunicator, Link, ReduceOp};

/// SplitMix64: a tiny, well-mixed generator, so data depends only on (seed, rank, index).
fn splitmix(state: u64) -> u64 {
    let mut z = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Rank `rank`'s input of `len` elements: floats uniform in [-1, 1) (never exactly zero),
/// bytes uniform.
pub fn rank_data(dtype: DType, len: usize, seed: u64, rank: usize) -> HostBuffer {
    let base = splitmix(seed ^ splitmix(rank as u64 + 1));
    let bits = (0..len as u64).map(move |i| splitmix(base ^ i.wrapping_mul(0x2545_F491_4F6C_DD1D)));
    let float = |b: u64| ((b >> 40) as f32 + 0.5) / (1u64 << 23) as f32 - 1.0;
    match dtype {
        DType::F32 => HostBuffer::F32(bits.map(float).collect()),
        DType::F16 => HostBuffer::F16(bits.map(|b| f16::from_f32(float(b))).collect()),
        DType::BF16 => HostBuffer::BF16(bits.map(|b| bf16::from_f32(float(b))).collect()),
        DType::U8 => HostBuffer::U8(bits.map(|b| b as u8).collect()),
    }
}

fn from_f32(dtype: DType, values: &[f32]) -> HostBuffer {
    match dtype {
        DType::F32 => HostBuffer::F32(values.to_vec()),
        DType::F16 => HostBuffer::F16(values.iter().map(|&x| f16::from_f32(x)).collect()),
        DType::BF16 => HostBuffer::BF16(values.iter().map(|&x| bf16::from_f32(x)).collect()),
        DType::U8 => HostBuffer::U8(values.iter().map(|&x| x as u8).collect()),
    }
}

/// The reduction of `inputs` (index = rank), element by element: convert to f32, fold over
/// ranks 0, 1, 2, … in order, divide by the rank count for `Avg`, round once.
pub fn reference_reduce(inputs: &[HostBuffer], op: ReduceOp) -> HostBuffer {
    let values: Vec<Vec<f32>> = inputs.iter().map(HostBuffer::to_f32_vec).collect();
    let out: Vec<f32> = (0..values[0].len())
        .map(|i| {
            let mut acc = values[0][i];
            for v in &values[1..] {
                acc = match op {
                    ReduceOp::Sum | ReduceOp::Avg => acc + v[i],
                    ReduceOp::Max if acc.is_nan() || v[i].is_nan() => f32::NAN,
                    ReduceOp::Max => acc.max(v[i]),
                };
            }
            if op == ReduceOp::Avg {
                acc / inputs.len() as f32
            } else {
                acc
            }
        })
        .collect();
    from_f32(inputs[0].dtype(), &out)
}

/// Runs `f(rank, comm)` on one thread per communicator and returns the results by rank.
pub fn run_ranks<T: Send>(
    comms: Vec<HostCommunicator>,
    f: impl Fn(usize, HostCommunicator) -> T + Sync,
) -> Vec<T> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let f = &f;
                scope.spawn(move || f(rank, comm))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// The job token of the groups built here.
pub const TEST_TOKEN: &str = "mesh-group-test-token";

/// A group of `world` ranks in this process with the same store and mesh set-up as separate
/// processes use: loopback TCP, or shared memory where `config` allows it (the default).
/// Joining gets at least 30 s whatever `config` says, so that short collective timeouts in
/// tests do not make the set-up flaky on a loaded machine.
pub fn mesh_group(world: usize, config: &CommConfig) -> (StoreServer, Vec<HostCommunicator>) {
    let server = test_store(world, config);
    let comms = join_ranks(server.local_addr(), world, config);
    (server, comms)
}

/// A store on a free loopback port for a job of `world` ranks, with [`TEST_TOKEN`].
pub fn test_store(world: usize, config: &CommConfig) -> StoreServer {
    let any_port: SocketAddr = "127.0.0.1:0".parse().expect("an address");
    StoreServer::bind(any_port, TEST_TOKEN, world, config).expect("binding a loopback store")
}

/// Joins ranks `0..world`, one thread each, through the store at `store` (see [`mesh_group`]).
pub fn join_ranks(store: SocketAddr, world: usize, config: &CommConfig) -> Vec<HostCommunicator> {
    let join_timeout = config.join_timeout.max(std::time::Duration::from_secs(30));
    let config = &config.clone().with_join_timeout(join_timeout);
    std::thread::scope(|scope| {
        let joins: Vec<_> = (0..world)
            .map(|rank| {
                scope.spawn(move || {
                    let client = StoreClient::connect(store, TEST_TOKEN, rank, config)?;
                    crate::connect(rank, world, &client, TEST_TOKEN, config)
                })
            })
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().expect("join thread").expect("joining the mesh"))
            .collect()
    })
}

/// A [`mesh_group`] whose every pair must be linked by `link` (`Tcp` or `SharedMemory`; shared
/// memory is allowed only for the latter). Panics otherwise, so that a silent fallback cannot
/// pass for the transport under test.
pub fn linked_group(
    world: usize,
    config: &CommConfig,
    link: Link,
) -> (StoreServer, Vec<HostCommunicator>) {
    let config = config
        .clone()
        .with_shared_memory(link == Link::SharedMemory);
    let (store, comms) = mesh_group(world, &config);
    for (rank, comm) in comms.iter().enumerate() {
        let want: Vec<_> = (0..world).map(|q| (q != rank).then_some(link)).collect();
        assert_eq!(comm.links(), want, "rank {rank}'s links");
    }
    (store, comms)
}

/// Every rank of `comms` all-reduces its [`rank_data`] (f32, 1003 elements, `seed`) and gets
/// [`reference_reduce`]'s sum bit for bit: the group formed and works.
pub fn assert_all_reduce_matches_reference(comms: Vec<HostCommunicator>, seed: u64) {
    let inputs: Vec<_> = (0..comms.len())
        .map(|rank| rank_data(DType::F32, 1003, seed, rank))
        .collect();
    let expected = reference_reduce(&inputs, ReduceOp::Sum);
    let results = run_ranks(comms, |rank, comm| {
        comm.all_reduce(inputs[rank].clone(), ReduceOp::Sum)
            .wait()
            .expect("all_reduce")
    });
    for (rank, result) in results.iter().enumerate() {
        assert_eq!(result.as_bytes(), expected.as_bytes(), "rank {rank}'s sum");
    }
}
