//! Parameters replaced behind ZeroAdam's back (a record loaded, an older model put back), seen
//! at the next step, so that training goes on from the values the model holds.
//!
//! Why: at stages 1 and 2, and at stage 3 below f32, ZeroAdam keeps f32 master weights of its
//! own and writes them into the model at every step. The everyday "roll back to the best model"
//! (`let best = model.clone().into_record(); ...; model = model.load_record(best)`) would load
//! the old weights and the next step would overwrite them with the current masters: the load
//! undone, silently. PyTorch's optimizers read the parameters at every step, and a user expects
//! the same here. So each step first finds the parameters that are no longer what ZeroAdam last
//! wrote, and takes their values into its master weights before the update. The moments and
//! step counts stay as they are, as PyTorch keeps them when weights are loaded.
//!
//! How a replaced parameter is told, at the cost of a look at each parameter:
//! - **Stages 1 and 2**: by the autodiff node of its tensor. A tensor keeps its node through
//!   clones, marks (`set_distributed`) and `require_grad`; a loaded, forked or rebuilt one has
//!   another (Burn numbers nodes once per process). ZeroAdam remembers the node of each tensor
//!   it wrote, or, before its first step, of the model it was built from.
//! - **Stage 3**: every clone of the model shares the pieces, and each step leaves fresh
//!   leaves over them, so the node says nothing; the sharded model counts the writes into each
//!   parameter's pieces from outside the optimizer instead (`ParamShards::loads`).
//!
//! Which values win: the model's, unless ZeroAdam's own state was loaded since its last step
//! (`ZeroAdam::import`, its record, `checkpoint::load`): that state brings the master weights
//! that go with the loaded model, more precise than the model's own below f32. DeepSpeed does
//! the same: a checkpoint restores the fp32 masters, loading the module alone refreshes them.
//!
//! Every rank must decide alike, or the ranks' shards of the master weights part ways: each
//! rank's finding (how many parameters, a digest of which, and whether its state was loaded)
//! travels in the step's agreement, in bytes that were padding, and ranks that differ from rank
//! 0 fail, all of them, naming the first that differs.

use std::any::Any;

use burn::backend::Autodiff;
use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, BackendTypes};
use burn_dist::{ParamInfo, ParamShards};

use crate::error::{Result, ZeroError};

/// What the model's parameters were when ZeroAdam last wrote them (or was built).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Stamps {
    /// Stages 1 and 2: per parameter, the autodiff node of its tensor (`None` on an autodiff
    /// backend other than Burn's, whose tensors cannot be told apart: never seen replaced).
    Nodes(Vec<Option<u64>>),
    /// Stage 3: per parameter, the count of loads into its pieces (`ParamShards::loads`).
    Loads(Vec<u64>),
}

impl Stamps {
    /// The stamps of `model` now: its tensors' nodes (stages 1 and 2), or the sharded model's
    /// load counts (stage 3).
    pub(crate) fn of<B: AutodiffBackend, M: AutodiffModule<B>>(
        params: &[ParamInfo],
        shards: Option<&ParamShards>,
        model: &M,
    ) -> Self {
        if let Some(shards) = shards {
            return Stamps::Loads(shards.loads());
        }
        let mut nodes = Nodes {
            params,
            nodes: vec![None; params.len()],
        };
        model.visit(&mut nodes);
        Stamps::Nodes(nodes.nodes)
    }

    /// The parameters whose stamp `now` differs from this one, in parameter order.
    pub(crate) fn replaced_in(&self, now: &Stamps) -> Vec<usize> {
        fn differ<T: PartialEq>(then: &[T], now: &[T]) -> Vec<usize> {
            (0..now.len()).filter(|&i| now[i] != then[i]).collect()
        }
        match (self, now) {
            (Stamps::Nodes(then), Stamps::Nodes(now)) => differ(then, now),
            (Stamps::Loads(then), Stamps::Loads(now)) => differ(then, now),
            _ => unreachable!("one kind of stamps for one optimizer"),
        }
    }
}

/// Reads the autodiff node of every parameter's tensor.
struct Nodes<'a> {
    params: &'a [ParamInfo],
    nodes: Vec<Option<u64>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Nodes<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(index) = self.params.iter().position(|p| p.id == param.id) {
            self.nodes[index] = node_of(param.val());
        }
    }
}

/// The autodiff node of `tensor`, on Burn's autodiff backend (whatever its checkpointing
/// strategy: its float primitive does not depend on it).
fn node_of<B: AutodiffBackend, const D: usize>(tensor: Tensor<B, D>) -> Option<u64> {
    type Primitive<I> = <Autodiff<I> as BackendTypes>::FloatTensorPrimitive;
    let primitive = tensor.into_primitive().tensor();
    (&primitive as &dyn Any)
        .downcast_ref::<Primitive<B::InnerBackend>>()
        .map(|tensor| tensor.node.id.value)
}

/// What this rank found at the start of a step.
#[derive(Debug, Clone, Default)]
pub(crate) struct Replaced {
    /// The parameters replaced since the last step, in parameter order.
    pub params: Vec<usize>,
    /// Whether ZeroAdam's own state was loaded since: its master weights win.
    pub imported: bool,
}

impl Replaced {
    /// Whether the step takes the model's values of [`Replaced::params`] into the master
    /// weights.
    pub(crate) fn takes_values(&self) -> bool {
        !self.params.is_empty() && !self.imported
    }

    /// The finding as the step's agreement carries it, in 6 bytes: whether the state was
    /// loaded, how many parameters were replaced (at most 255 counted), and a 32-bit FNV-1a
    /// digest of which (0 when none: a step after no load sends zeros, as before).
    pub(crate) fn note(&self) -> [u8; NOTE_LEN] {
        let mut note = [0u8; NOTE_LEN];
        note[0] = u8::from(self.imported);
        note[1] = self.params.len().min(255) as u8;
        if !self.params.is_empty() {
            let mut digest: u32 = 0x811c_9dc5;
            for &index in &self.params {
                for byte in (index as u64).to_le_bytes() {
                    digest = (digest ^ u32::from(byte)).wrapping_mul(0x0100_0193);
                }
            }
            note[2..].copy_from_slice(&digest.to_le_bytes());
        }
        note
    }

    /// Fails unless every rank's note (`notes`, in rank order) is rank 0's: `names` are the
    /// parameters' names, for the message.
    pub(crate) fn check_agreed<'a>(
        &self,
        notes: impl Iterator<Item = &'a [u8]>,
        names: &[ParamInfo],
    ) -> Result<()> {
        let notes: Vec<&[u8]> = notes.collect();
        let Some(rank) = (1..notes.len()).find(|&rank| notes[rank] != notes[0]) else {
            return Ok(());
        };
        let said = |note: &[u8]| Replacements {
            replaced: note[1],
            imported: note[0] != 0,
        };
        let here: Vec<&str> = self
            .params
            .iter()
            .take(3)
            .map(|&i| names[i].name.as_str())
            .collect();
        Err(ZeroError::ReplacedOnSomeRanks {
            rank,
            found: said(notes[rank]),
            rank0_found: said(notes[0]),
            here: match here.is_empty() {
                true => "none".into(),
                false => format!("`{}`", here.join("`, `")),
            },
        })
    }
}

/// Bytes of [`Replaced::note`].
pub(crate) const NOTE_LEN: usize = 6;

/// What one rank found replaced since the last step, as the other ranks read it from the step's agreement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replacements {
    /// Parameters replaced since the last step (255: 255 or more).
    pub replaced: u8,
    /// Whether ZeroAdam's state was loaded since.
    pub imported: bool,
}

impl std::fmt::Display for Replacements {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} parameters replaced", self.replaced)?;
        if self.imported {
            write!(f, " and the optimizer state loaded")?;
        }
        Ok(())
    }
}
