//! This rank's pieces of the sharded parameters, in one of three forms, and every write into
//! them: the optimizer's (its master weights, or its write-back in the parameters' dtype) and a
//! load's (a record or a checkpoint).
//!
//! It neither gathers nor schedules. A write changes what the gathers ahead read, so
//! `ParamShards` forgets those before it writes here.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use burn::tensor::TensorData;
use burn_backend::DType;

use super::shards::ShardedParamInfo;
use crate::flat::FlatLayout;

/// One rank's pieces (see the module docs).
pub(super) struct PieceStore {
    params: Arc<[ShardedParamInfo]>,
    layout: FlatLayout,
    rank: usize,
    /// Where each parameter's piece lies in this rank's shard (`None`: it holds none of it).
    in_shard: Vec<Option<Range<usize>>>,
    /// Which of the parameter's elements that piece holds.
    within: Vec<Option<Range<usize>>>,
    held: RwLock<Held>,
    /// Per parameter: how many times values from outside the optimizer were written into its
    /// pieces ([`PieceStore::set_piece`]: a record or a checkpoint loaded), so that an
    /// optimizer with master weights of its own sees the load.
    loads: Vec<AtomicU64>,
}

/// This rank's part of the sharded parameters.
enum Held {
    /// Every sharded parameter is f32: this rank's shard of the flat layout itself (padding
    /// zero), which is also the stage-3 optimizer's master weights.
    F32(Vec<f32>),
    /// Each parameter's piece in its own dtype (empty where this rank holds none).
    Pieces(Vec<Vec<u8>>),
    /// The device path: this rank's shard in device memory, in the parameters' one dtype
    /// (`crate::device::DevicePieces`); gathers fill fresh device buffers.
    #[cfg(feature = "device")]
    Device(Box<dyn crate::device::DevicePieces>),
}

impl PieceStore {
    /// `pieces`: this rank's piece of each parameter, in its dtype.
    pub(super) fn new(
        params: Arc<[ShardedParamInfo]>,
        layout: FlatLayout,
        rank: usize,
        pieces: Vec<Vec<u8>>,
    ) -> Self {
        let count = params.len();
        let mut in_shard = vec![None; count];
        let mut within = vec![None; count];
        for piece in layout.pieces(rank) {
            in_shard[piece.param] = Some(piece.in_shard);
            within[piece.param] = Some(piece.within);
        }
        let held = if params.iter().all(|p| p.dtype == DType::F32) {
            let mut shard = vec![0.0f32; layout.shard_len];
            for (range, piece) in in_shard.iter().zip(&pieces) {
                if let Some(range) = range {
                    copy_f32_bytes(&mut shard[range.clone()], piece);
                }
            }
            Held::F32(shard)
        } else {
            Held::Pieces(pieces)
        };
        PieceStore {
            params,
            layout,
            rank,
            in_shard,
            within,
            held: RwLock::new(held),
            loads: (0..count).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn held(&self) -> RwLockReadGuard<'_, Held> {
        self.held.read().unwrap_or_else(|e| e.into_inner())
    }

    fn held_mut(&self) -> RwLockWriteGuard<'_, Held> {
        self.held.write().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// Moves the pieces into device memory (`place` uploads this rank's shard of the flat
    /// layout, given as bytes of the parameters' one dtype `dtype`).
    #[cfg(feature = "device")]
    pub(super) fn place_on_device(
        &self,
        dtype: DType,
        place: impl FnOnce(DType, &[u8]) -> crate::Result<Box<dyn crate::device::DevicePieces>>,
    ) -> crate::Result<()> {
        let mut held = self.held_mut();
        let shard = match &*held {
            Held::F32(shard) => bytemuck::cast_slice(shard).to_vec(),
            Held::Pieces(pieces) => {
                let elem = dtype.size();
                let mut shard = vec![0u8; self.layout.shard_len * elem];
                for (range, piece) in self.in_shard.iter().zip(pieces) {
                    if let Some(range) = range {
                        shard[range.start * elem..range.end * elem].copy_from_slice(piece);
                    }
                }
                shard
            }
            Held::Device(_) => return Ok(()),
        };
        *held = Held::Device(place(dtype, &shard)?);
        Ok(())
    }

    /// The device path: this rank's shard buffer and its dtype; `None` on the host path.
    #[cfg(feature = "device")]
    pub(super) fn device_shard(&self) -> Option<(burn_cubecl::cubecl::server::Handle, DType)> {
        match &*self.held() {
            Held::Device(pieces) => Some(pieces.shard()),
            _ => None,
        }
    }

    /// The device path: issues the gather of parameters `params` (adjacent) into fresh device
    /// buffers, tagged `tag`; `None` on the host path.
    #[cfg(feature = "device")]
    pub(super) fn issue_on_device(
        &self,
        params: Range<usize>,
        tag: u32,
    ) -> Option<Result<Box<dyn crate::device::DeviceGathering>, burn_dist_comm::CommError>> {
        let Held::Device(pieces) = &*self.held() else {
            return None;
        };
        let parts: Vec<crate::device::GatherPart> = params
            .map(|i| crate::device::GatherPart {
                shape: self.params[i].shape.clone(),
                counts: self.params[i].counts.clone(),
                mine: self.in_shard[i].clone().zip(self.within[i].clone()),
            })
            .collect();
        Some(pieces.issue(&parts, tag))
    }

    /// Whether the shard is f32 and so can serve as the optimizer's master weights.
    pub(super) fn holds_f32_shard(&self) -> bool {
        matches!(*self.held(), Held::F32(_))
    }

    /// Runs `update` on the f32 shard in place; `None`, without running it, otherwise.
    pub(super) fn with_master<R>(&self, update: impl FnOnce(&mut [f32]) -> R) -> Option<R> {
        match &mut *self.held_mut() {
            Held::F32(shard) => Some(update(shard)),
            _ => None,
        }
    }

    /// This rank's shard of the flat vector of parameters as f32 (padding zero).
    pub(super) fn shard_values(&self) -> Vec<f32> {
        let pieces = match &*self.held() {
            Held::F32(shard) => return shard.clone(),
            Held::Pieces(pieces) => pieces.clone(),
            #[cfg(feature = "device")]
            Held::Device(pieces) => return pieces.shard_values(),
        };
        let mut shard = vec![0.0f32; self.layout.shard_len];
        for ((range, piece), info) in self.in_shard.iter().zip(pieces).zip(self.params.iter()) {
            if let Some(range) = range {
                let data = TensorData::from_bytes_vec(piece, vec![range.len()], info.dtype);
                let values = data.convert::<f32>().into_vec::<f32>().expect("f32 values");
                shard[range.clone()].copy_from_slice(&values);
            }
        }
        shard
    }

    /// Replaces the pieces by `shard` (this rank's shard of the flat vector, f32), in each
    /// parameter's dtype.
    pub(super) fn write_shard(&self, shard: &[f32]) {
        assert_eq!(shard.len(), self.layout.shard_len, "a shard of the layout");
        match &mut *self.held_mut() {
            Held::F32(held) => held.copy_from_slice(shard),
            Held::Pieces(pieces) => {
                let params = self.params.iter();
                for ((range, piece), info) in self.in_shard.iter().zip(pieces).zip(params) {
                    if let Some(range) = range {
                        let values = shard[range.clone()].to_vec();
                        let data =
                            TensorData::new(values, vec![range.len()]).convert_dtype(info.dtype);
                        *piece = data.into_bytes().to_vec();
                    }
                }
            }
            #[cfg(feature = "device")]
            Held::Device(pieces) => pieces.write_shard(shard),
        }
    }

    /// This rank's piece of parameter `index` cut out of `full` (all of its values, in any
    /// float dtype), in the parameter's dtype; empty where this rank holds none of it.
    pub(super) fn cut_piece(&self, index: usize, full: TensorData) -> Vec<u8> {
        let Some(within) = self.within[index].clone() else {
            return Vec::new();
        };
        let elem = self.params[index].dtype.size();
        let bytes = full.convert_dtype(self.params[index].dtype).into_bytes();
        bytes[within.start * elem..within.end * elem].to_vec()
    }

    /// Replaces this rank's piece of parameter `index` by `piece` (in the parameter's dtype),
    /// counting the load on every rank alike, whether it holds a piece or not.
    pub(super) fn set_piece(&self, index: usize, piece: &[u8]) {
        self.loads[index].fetch_add(1, Ordering::Relaxed);
        let Some(in_shard) = self.in_shard[index].clone() else {
            return; // this rank holds none of it
        };
        let elem = self.params[index].dtype.size();
        assert_eq!(
            piece.len(),
            in_shard.len() * elem,
            "burn-dist: the piece of `{}` written on rank {} has another size than the rank's",
            self.params[index].name,
            self.rank
        );
        match &mut *self.held_mut() {
            Held::F32(shard) => copy_f32_bytes(&mut shard[in_shard], piece),
            Held::Pieces(pieces) => pieces[index] = piece.to_vec(),
            #[cfg(feature = "device")]
            Held::Device(pieces) => pieces.write(in_shard, piece),
        }
    }

    /// Per parameter: how many times [`PieceStore::set_piece`] wrote into its pieces.
    pub(super) fn loads(&self) -> Vec<u64> {
        self.loads
            .iter()
            .map(|count| count.load(Ordering::Relaxed))
            .collect()
    }

    /// Shows this rank's piece of parameter `index`, in its dtype, to `visit` (a gather copies
    /// it straight into its buffer); empty where this rank holds none of it.
    pub(super) fn with_piece<R>(&self, index: usize, visit: impl FnOnce(&[u8]) -> R) -> R {
        match &*self.held() {
            Held::F32(shard) => match self.in_shard[index].clone() {
                Some(range) => visit(bytemuck::cast_slice(&shard[range])),
                None => visit(&[]),
            },
            Held::Pieces(pieces) => visit(&pieces[index]),
            #[cfg(feature = "device")]
            Held::Device(pieces) => {
                let bytes = self.in_shard[index]
                    .clone()
                    .map_or_else(Vec::new, |range| pieces.read(range));
                visit(&bytes)
            }
        }
    }
}

/// Copies the f32 values in `bytes` (little endian, of no particular alignment) into `out`.
fn copy_f32_bytes(out: &mut [f32], bytes: &[u8]) {
    let values = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")));
    out.iter_mut().zip(values).for_each(|(o, v)| *o = v);
}
