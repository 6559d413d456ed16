//! burn-dist programs under torchrun, without PyTorch: a stand-in for torchrun's elastic agent
//! holds MASTER_PORT with a listening socket, as the agent's own store does, and starts the
//! ranks (`burn-dist-check`) with exactly the variables torch 2.x's agent sets (checked against
//! the real `torchrun --standalone` of torch 2.15; see docs/guide.md, "Under torchrun"). The
//! ranks must rendezvous beside the agent's store and all-reduce correctly.

mod support;

use std::net::TcpListener;
use std::process::Command;

use support::{Launch, within};

const CHECK: &str = env!("CARGO_BIN_EXE_burn-dist-check");

/// Variables of the developer's shell that would change what a rank does; removed first.
const INHERITED: [&str; 11] = [
    "BURN_DIST_TOKEN",
    "BURN_DIST_TIMEOUT_SECS",
    "BURN_DIST_SHM",
    "BURN_DIST_GATHER_LANE",
    "BURN_DIST_STORE_PORT",
    "BURN_DIST_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT",
    "SLURM_PROCID",
    "RAYON_NUM_THREADS",
    "OMP_NUM_THREADS",
];

/// The agent's store, as far as the ranks can tell: something listening on MASTER_PORT. The
/// port after it is left free for burn-dist's store (taken by chance only if another process
/// grabs it between the probe and the ranks' start, as with any free-port pick).
struct AgentStore {
    _listener: TcpListener,
    port: u16,
}

impl AgentStore {
    fn bind() -> AgentStore {
        for _ in 0..100 {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let port = listener.local_addr().unwrap().port();
            let next_free = port
                .checked_add(1)
                .is_some_and(|next| TcpListener::bind(("127.0.0.1", next)).is_ok());
            if next_free {
                return AgentStore {
                    _listener: listener,
                    port,
                };
            }
        }
        panic!("no free port with a free next port on loopback in 100 tries");
    }
}

/// One worker as torchrun's agent starts it: rank `rank` of `world`, on node `node` of
/// `nodes`, `local_world` workers per node.
fn torchrun_worker(
    agent: &AgentStore,
    (rank, world): (usize, usize),
    (node, nodes): (usize, usize),
    local_world: usize,
    extra: &[(&str, &str)],
) -> Launch {
    let port = agent.port.to_string();
    let (rank_s, world_s) = (rank.to_string(), world.to_string());
    let local = (rank % local_world).to_string();
    let local_world_s = local_world.to_string();
    let (node_s, nodes_s) = (node.to_string(), nodes.to_string());
    let mut command = Command::new(CHECK);
    command.args(["--mib", "0.25", "--iters", "2"]);
    INHERITED.iter().for_each(|v| _ = command.env_remove(v));
    command.envs([
        ("RANK", rank_s.as_str()),
        ("LOCAL_RANK", &local),
        ("WORLD_SIZE", &world_s),
        ("LOCAL_WORLD_SIZE", &local_world_s),
        ("GROUP_RANK", &node_s),
        ("GROUP_WORLD_SIZE", &nodes_s),
        ("ROLE_NAME", "default"),
        ("ROLE_RANK", &rank_s),
        ("ROLE_WORLD_SIZE", &world_s),
        ("MASTER_ADDR", "localhost"),
        ("MASTER_PORT", &port),
        ("TORCHELASTIC_RESTART_COUNT", "0"),
        ("TORCHELASTIC_MAX_RESTARTS", "0"),
        ("TORCHELASTIC_RUN_ID", "stand-in"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        ("OMP_NUM_THREADS", "1"),
        ("BURN_DIST_TIMEOUT_SECS", "60"),
    ]);
    command.envs(extra.iter().copied());
    Launch::spawn_command(command)
}

/// Every worker ends successfully, having verified its all-reduces.
fn assert_all_verified(workers: Vec<Launch>) {
    for (rank, mut worker) in workers.into_iter().enumerate() {
        let status = worker.wait_exit(within(60));
        assert!(status.success(), "rank {rank}: {}", worker.transcript());
        let verified = format!("rank {rank}: 2 all_reduces of 256.0 KiB verified");
        assert!(
            worker.stdout().iter().any(|l| l.starts_with(&verified)),
            "rank {rank}:\n{}",
            worker.transcript()
        );
    }
}

/// `torchrun --standalone --nproc-per-node 2`: one node, the agent's store on MASTER_PORT.
#[test]
fn ranks_started_as_by_torchrun_standalone_rendezvous_beside_the_agents_store() {
    let agent = AgentStore::bind();
    let workers = (0..2)
        .map(|rank| torchrun_worker(&agent, (rank, 2), (0, 1), 2, &[]))
        .collect();
    assert_all_verified(workers);
}

/// Static or c10d rendezvous across two nodes of one rank each, with the job token every node
/// exports before torchrun (on loopback here, as the nodes are this host).
#[test]
fn ranks_of_two_torchrun_nodes_rendezvous_beside_the_agents_store() {
    let agent = AgentStore::bind();
    let token = [("BURN_DIST_TOKEN", "same-on-every-node")];
    let workers = (0..2)
        .map(|rank| torchrun_worker(&agent, (rank, 2), (rank, 2), 1, &token))
        .collect();
    assert_all_verified(workers);
}

/// Where MASTER_PORT + 1 is taken too, BURN_DIST_STORE_PORT places the store.
#[test]
fn the_store_port_can_be_chosen_under_torchrun() {
    let agent = AgentStore::bind();
    let _taken = TcpListener::bind(("127.0.0.1", agent.port + 1)).unwrap();
    let chosen = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = chosen.local_addr().unwrap().port().to_string();
    drop(chosen);
    let env = [("BURN_DIST_STORE_PORT", port.as_str())];
    let workers = (0..2)
        .map(|rank| torchrun_worker(&agent, (rank, 2), (0, 1), 2, &env))
        .collect();
    assert_all_verified(workers);
}
