//! Collectives on Burn tensors and on scalars, for the user's own agreement between ranks:
//! averaging a metric, a global count, an early-stopping decision, rank 0's choice.
//!
//! They run on the host communicator of the `Ddp` (the same group that reduces gradients), so
//! they work on every backend: a tensor is read to the host, reduced, and written back to its
//! own device in its own dtype. Every rank must call the same collectives in the same order, as
//! for any collective. None of them is meant for gradients, which `Ddp::backward` reduces.
//!
//! - Tensor all-reduce goes through f32 (the communicator sums in f32, in rank order, so every
//!   rank gets the same bits); an f64 tensor loses its extra precision.
//! - Tensor all-gather and broadcast move the bytes as they are: exact for every dtype.
//! - Scalars move as their 8 bytes and reduce in f64 or u64, in rank order: exact and the same
//!   on every rank.
//!
//! ```no_run
//! # fn main() -> burn_dist::Result<()> {
//! use burn_dist::{Ddp, DdpConfig, ReduceOp};
//! let ddp = Ddp::init(DdpConfig::new())?;
//! let local_loss = 0.25;
//! let mean_loss = ddp.all_reduce_f64(local_loss, ReduceOp::Avg)?;
//! // Stop when any rank wants to: the same decision everywhere.
//! let wants_to_stop = mean_loss < 0.01;
//! let stop = ddp.all_reduce_u64(wants_to_stop as u64, ReduceOp::Max)? == 1;
//! if ddp.is_main() && stop {
//!     println!("early stop at mean loss {mean_loss}");
//! }
//! # Ok(())
//! # }
//! ```

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_dist_comm::{CommError, Communicator, HostBuffer, ReduceOp};

use crate::Ddp;
use crate::error::{DistError, Result};

impl Ddp {
    /// Every rank's `tensor` reduced element-wise by `op` (sum, mean over ranks, max; a NaN on
    /// any rank wins the max), on this rank's device and in its dtype. The tensors must have the
    /// same shape on every rank. The reduction runs in f32.
    pub fn all_reduce_tensor<B: Backend, const D: usize>(
        &self,
        tensor: Tensor<B, D>,
        op: ReduceOp,
    ) -> Result<Tensor<B, D>> {
        let (device, dtype, shape) = (tensor.device(), tensor.dtype(), tensor.shape());
        let values = read(tensor, "a tensor to all-reduce")?
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| DistError::TensorRead {
                what: "a tensor to all-reduce as f32",
                reason: format!("{e:?}"),
            })?;
        let HostBuffer::F32(reduced) = self
            .communicator()
            .all_reduce(HostBuffer::F32(values), op)
            .wait()?
        else {
            unreachable!("an f32 all-reduce returns f32")
        };
        let data = TensorData::new(reduced, shape).convert_dtype(dtype);
        Ok(Tensor::from_data(data, (&device, dtype)))
    }

    /// Every rank's `tensor`, in rank order, on this rank's device. Shapes may differ between
    /// ranks (e.g. a smaller last batch), dtypes may not: cat them with `Tensor::cat` when they
    /// fit together. The values are exact.
    pub fn all_gather_tensor<B: Backend, const D: usize>(
        &self,
        tensor: Tensor<B, D>,
    ) -> Result<Vec<Tensor<B, D>>> {
        let (device, dtype) = (tensor.device(), tensor.dtype());
        let dims: Vec<u64> = tensor.dims().iter().map(|&d| d as u64).collect();
        let all_dims = self.all_gather_u64s(&dims)?;
        let bytes = read(tensor, "a tensor to all-gather")?
            .into_bytes()
            .to_vec();
        let all_bytes = self.all_gather_bytes(bytes)?;
        all_dims
            .chunks_exact(D)
            .zip(all_bytes)
            .enumerate()
            .map(|(rank, (dims, bytes))| {
                let shape: Vec<usize> = dims.iter().map(|&d| d as usize).collect();
                let expected = shape.iter().product::<usize>() * dtype.size();
                if bytes.len() != expected {
                    return Err(DistError::TensorMismatch {
                        op: "all_gather_tensor",
                        rank,
                        expected,
                        got: bytes.len(),
                        reason: "every rank's tensor must have the same dtype",
                    });
                }
                let data = TensorData::from_bytes_vec(bytes, shape, dtype);
                Ok(Tensor::from_data(data, (&device, dtype)))
            })
            .collect()
    }

    /// Rank `root`'s `tensor` on every rank, on this rank's device. Every rank passes a tensor
    /// of the same shape and dtype (its values are ignored except on `root`). The values are
    /// exact.
    pub fn broadcast_tensor<B: Backend, const D: usize>(
        &self,
        tensor: Tensor<B, D>,
        root: usize,
    ) -> Result<Tensor<B, D>> {
        let (device, dtype, shape) = (tensor.device(), tensor.dtype(), tensor.shape());
        let bytes = read(tensor, "a tensor to broadcast")?.into_bytes().to_vec();
        // Every rank's length first, so that every rank fails alike, naming the rank whose
        // tensor differs from the root's, instead of some ranks waiting for the others.
        let lengths = self.all_gather_u64s(&[bytes.len() as u64])?;
        let Some(&root_len) = lengths.get(root) else {
            return Err(CommError::InvalidArgument {
                op: "broadcast_tensor".into(),
                reason: format!("root {root} is not a rank of {}", lengths.len()),
            }
            .into());
        };
        if let Some(rank) = lengths.iter().position(|&len| len != root_len) {
            return Err(DistError::TensorMismatch {
                op: "broadcast_tensor",
                rank,
                expected: root_len as usize,
                got: lengths[rank] as usize,
                reason: "every rank must pass a tensor of the root's shape and dtype",
            });
        }
        let received = self
            .communicator()
            .broadcast(HostBuffer::U8(bytes), root)
            .wait()?;
        let data = TensorData::from_bytes_vec(received.as_bytes().to_vec(), shape, dtype);
        Ok(Tensor::from_data(data, (&device, dtype)))
    }

    /// Every rank's `value` reduced by `op` in f64, in rank order (the same bits on every rank).
    /// Max: a NaN on any rank wins.
    pub fn all_reduce_f64(&self, value: f64, op: ReduceOp) -> Result<f64> {
        let all = self.all_gather_f64(value)?;
        Ok(match op {
            ReduceOp::Sum => all.iter().sum(),
            ReduceOp::Avg => all.iter().sum::<f64>() / all.len() as f64,
            ReduceOp::Max => all.into_iter().fold(f64::NEG_INFINITY, |max, x| {
                if x.is_nan() || x > max { x } else { max }
            }),
        })
    }

    /// Every rank's `value` reduced by `op` in u64. Avg rounds down; a sum that overflows u64 is
    /// an error ([`DistError::Overflow`]) on every rank.
    pub fn all_reduce_u64(&self, value: u64, op: ReduceOp) -> Result<u64> {
        let all = self.all_gather_u64(value)?;
        let sum = || -> Result<u64> {
            all.iter()
                .try_fold(0u64, |sum, &x| sum.checked_add(x))
                .ok_or(DistError::Overflow {
                    op: "all_reduce_u64",
                })
        };
        Ok(match op {
            ReduceOp::Sum => sum()?,
            ReduceOp::Avg => sum()? / all.len() as u64,
            ReduceOp::Max => all.into_iter().max().unwrap_or(0),
        })
    }

    /// Every rank's `value`, in rank order.
    pub fn all_gather_f64(&self, value: f64) -> Result<Vec<f64>> {
        let bits = self.all_gather_u64s(&[value.to_bits()])?;
        Ok(bits.into_iter().map(f64::from_bits).collect())
    }

    /// Every rank's `value`, in rank order.
    pub fn all_gather_u64(&self, value: u64) -> Result<Vec<u64>> {
        self.all_gather_u64s(&[value])
    }

    /// Rank `root`'s `value` on every rank.
    pub fn broadcast_f64(&self, value: f64, root: usize) -> Result<f64> {
        Ok(f64::from_bits(self.broadcast_u64(value.to_bits(), root)?))
    }

    /// Rank `root`'s `value` on every rank.
    pub fn broadcast_u64(&self, value: u64, root: usize) -> Result<u64> {
        let bytes = value.to_le_bytes().to_vec();
        let received = self
            .communicator()
            .broadcast(HostBuffer::U8(bytes), root)
            .wait()?;
        Ok(u64_of(received.as_bytes()))
    }

    /// Every rank's `values` (the same count on every rank), concatenated in rank order.
    pub(crate) fn all_gather_u64s(&self, values: &[u64]) -> Result<Vec<u64>> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let total = bytes.len() * self.world_size();
        let all = self
            .communicator()
            .all_gather(HostBuffer::U8(bytes), total)
            .wait()?;
        Ok(all.as_bytes().chunks_exact(8).map(u64_of).collect())
    }

    /// Every rank's `bytes` (any length on each rank), in rank order: the lengths first, then
    /// the bytes padded to the longest.
    pub(crate) fn all_gather_bytes(&self, mut bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let lengths = self.all_gather_u64s(&[bytes.len() as u64])?;
        let longest = lengths.iter().copied().max().unwrap_or(0) as usize;
        bytes.resize(longest, 0);
        let all = self
            .communicator()
            .all_gather(HostBuffer::U8(bytes), longest * self.world_size())
            .wait()?;
        let all = all.as_bytes();
        Ok(lengths
            .iter()
            .enumerate()
            .map(|(rank, &len)| all[rank * longest..rank * longest + len as usize].to_vec())
            .collect())
    }
}

/// A tensor's values on the host.
fn read<B: Backend, const D: usize>(
    tensor: Tensor<B, D>,
    what: &'static str,
) -> Result<TensorData> {
    tensor.try_into_data().map_err(|e| DistError::TensorRead {
        what,
        reason: format!("{e:?}"),
    })
}

fn u64_of(bytes: &[u8]) -> u64 {
    u64::from_le_bytes(bytes.try_into().expect("8 bytes"))
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Tensor, TensorData};
    use burn_dist_comm::testing::run_ranks;
    use burn_dist_comm::{CommConfig, HostCommunicator, ReduceOp};
    use burn_flex::{Flex, FlexDevice};

    use crate::{Ddp, DdpConfig, DistError};

    /// `f(rank's Ddp)` on each rank of an in-process group of `world` ranks, results by rank.
    fn on_ranks<T: Send>(world: usize, f: impl Fn(Ddp) -> T + Sync) -> Vec<T> {
        let comms = HostCommunicator::local_group(world, &CommConfig::default());
        run_ranks(comms, |_, comm| f(Ddp::for_thread(comm, DdpConfig::new())))
    }

    fn tensor<const D: usize>(values: &[f32], shape: [usize; D]) -> Tensor<Flex, D> {
        Tensor::from_data(TensorData::new(values.to_vec(), shape), &FlexDevice)
    }

    fn values<const D: usize>(tensor: Tensor<Flex, D>) -> (Vec<usize>, Vec<f32>) {
        let dims = tensor.dims().to_vec();
        (dims, tensor.into_data().into_vec::<f32>().unwrap())
    }

    #[test]
    fn tensor_all_reduce_sums_averages_and_maxes_over_three_ranks() {
        let results = on_ranks(3, |ddp| {
            // Rank r holds [[r + 1, -10 (r + 1)]].
            let r = ddp.rank() as f32 + 1.0;
            let mine = || tensor(&[r, -10.0 * r], [1, 2]);
            let main = ddp.is_main();
            let [sum, avg, max] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max]
                .map(|op| values(ddp.all_reduce_tensor(mine(), op).unwrap()));
            (main, sum, avg, max)
        });
        for (rank, (main, sum, avg, max)) in results.into_iter().enumerate() {
            assert_eq!(main, rank == 0);
            assert_eq!(sum, (vec![1, 2], vec![6.0, -60.0]), "rank {rank}");
            assert_eq!(avg, (vec![1, 2], vec![2.0, -20.0]), "rank {rank}");
            assert_eq!(max, (vec![1, 2], vec![3.0, -10.0]), "rank {rank}");
        }
    }

    #[test]
    fn tensor_all_gather_returns_every_ranks_tensor_in_rank_order_whatever_its_shape() {
        let results = on_ranks(2, |ddp| {
            let mine = match ddp.rank() {
                0 => tensor(&[1.0, 2.0], [1, 2]),
                _ => tensor(&[3.0, 4.0, 5.0, 6.0], [2, 2]),
            };
            let all = ddp.all_gather_tensor(mine).unwrap();
            all.into_iter().map(values).collect::<Vec<_>>()
        });
        for all in results {
            assert_eq!(
                all,
                vec![
                    (vec![1, 2], vec![1.0, 2.0]),
                    (vec![2, 2], vec![3.0, 4.0, 5.0, 6.0])
                ]
            );
        }
    }

    #[test]
    fn tensor_broadcast_gives_every_rank_the_roots_values() {
        let results = on_ranks(3, |ddp| {
            let r = ddp.rank() as f32;
            let mine = tensor(&[r, 1.5 * r, -r], [3]);
            values(ddp.broadcast_tensor(mine, 1).unwrap())
        });
        for got in results {
            assert_eq!(got, (vec![3], vec![1.0, 1.5, -1.0]));
        }
    }

    #[test]
    fn tensor_broadcast_of_another_shape_fails_on_every_rank_naming_the_rank() {
        let results = on_ranks(2, |ddp| {
            let len = 2 + ddp.rank();
            ddp.broadcast_tensor(tensor(&vec![0.0; len], [len]), 0)
        });
        for result in results {
            match result {
                Err(DistError::TensorMismatch {
                    rank: 1,
                    expected: 8,
                    got: 12,
                    ..
                }) => {}
                other => panic!("{:?}", other.map(values)),
            }
        }
    }

    #[test]
    fn scalar_collectives_reduce_in_f64_and_u64_in_rank_order() {
        let results = on_ranks(3, |ddp| {
            let rank = ddp.rank();
            // 0.1, 0.2, 0.3: their f64 sum in rank order is 0.6000000000000001 (through f32 it
            // would be 0.6000000238…).
            let x = [0.1, 0.2, 0.3][rank];
            let f64s = (
                ddp.all_reduce_f64(x, ReduceOp::Sum).unwrap(),
                ddp.all_reduce_f64(x, ReduceOp::Avg).unwrap(),
                ddp.all_reduce_f64(x, ReduceOp::Max).unwrap(),
                ddp.all_reduce_f64([1.0, f64::NAN, 2.0][rank], ReduceOp::Max)
                    .unwrap(),
                ddp.all_gather_f64(x).unwrap(),
                ddp.broadcast_f64(x, 2).unwrap(),
            );
            let n = [1u64, 2, 4][rank];
            let u64s = (
                ddp.all_reduce_u64(n, ReduceOp::Sum).unwrap(),
                ddp.all_reduce_u64(n, ReduceOp::Avg).unwrap(),
                ddp.all_reduce_u64(n, ReduceOp::Max).unwrap(),
                ddp.all_gather_u64(n).unwrap(),
                ddp.broadcast_u64(n, 1).unwrap(),
                ddp.all_reduce_u64([u64::MAX - 1, 1, 0][rank], ReduceOp::Sum)
                    .unwrap(),
            );
            let overflow = ddp.all_reduce_u64([u64::MAX, 1, 0][rank], ReduceOp::Sum);
            (f64s, u64s, overflow)
        });
        for (rank, ((sum, avg, max, nan_max, all, root), u64s, overflow)) in
            results.into_iter().enumerate()
        {
            assert_eq!(sum, 0.6000000000000001, "rank {rank}");
            assert_eq!(avg, 0.6000000000000001 / 3.0, "rank {rank}");
            assert_eq!(max, 0.3, "rank {rank}");
            assert!(
                nan_max.is_nan(),
                "a NaN on any rank wins the max (rank {rank})"
            );
            assert_eq!(all, vec![0.1, 0.2, 0.3], "rank {rank}");
            assert_eq!(root, 0.3, "rank {rank}");
            assert_eq!(u64s, (7, 2, 4, vec![1, 2, 4], 2, u64::MAX), "rank {rank}");
            assert!(
                matches!(overflow, Err(DistError::Overflow { .. })),
                "rank {rank}: {overflow:?}"
            );
        }
    }
}
