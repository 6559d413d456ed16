//! Which parameters weight decay applies to: `ZeroAdamConfig::decay`.
//!
//! Burn's `AdamW` decays every parameter. GPT-2's recipe, as nanoGPT and llm.c train it,
//! decays only the tensors of two or more dimensions (the matmuls' weights and the
//! embeddings), never the biases or the LayerNorm gains and offsets: shrinking a gain towards
//! zero or a bias towards zero is not regularization, it changes what the layer computes.

use burn_dist::ParamInfo;
use serde::{Deserialize, Serialize};

use crate::error::{Result, ZeroError};

/// Which trainable parameters weight decay applies to.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum DecayRule {
    /// Every parameter, as Burn's `AdamW` and `Adam` do (the default).
    #[default]
    All,
    /// Parameters of two or more dimensions (weight matrices, embeddings, convolution
    /// kernels); not biases or normalization parameters. GPT-2's rule, as nanoGPT and llm.c
    /// apply it.
    Matrices,
    /// One flag per trainable parameter, in the order of `Ddp::params()` (the model's visit
    /// order): `true` decays. [`DecayRule::mask_of`] builds one from a predicate.
    Mask(Vec<bool>),
}

impl DecayRule {
    /// A mask from a predicate on each prepared parameter (its name, shape and dtype), e.g.
    /// `DecayRule::mask_of(ddp.params(), |p| !p.name.contains("norm"))`.
    pub fn mask_of(params: &[ParamInfo], decays: impl Fn(&ParamInfo) -> bool) -> DecayRule {
        DecayRule::Mask(params.iter().map(decays).collect())
    }

    /// Whether each of `params` decays.
    pub fn resolve(&self, params: &[ParamInfo]) -> Result<Vec<bool>> {
        match self {
            DecayRule::All => Ok(vec![true; params.len()]),
            DecayRule::Matrices => Ok(params.iter().map(|p| p.shape.len() >= 2).collect()),
            DecayRule::Mask(mask) if mask.len() == params.len() => Ok(mask.clone()),
            DecayRule::Mask(mask) => Err(ZeroError::DecayMaskLength {
                got: mask.len(),
                expected: params.len(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::ParamId;
    use burn::tensor::DType;

    fn param(name: &str, shape: &[usize]) -> ParamInfo {
        ParamInfo {
            id: ParamId::new(),
            name: name.into(),
            shape: shape.to_vec(),
            dtype: DType::F32,
            require_grad: true,
        }
    }

    #[test]
    fn matrices_decay_and_vectors_do_not() {
        let params = [
            param("wte.weight", &[64, 16]),
            param("ln.gamma", &[16]),
            param("fc.weight", &[16, 32]),
            param("fc.bias", &[32]),
        ];
        assert_eq!(
            DecayRule::Matrices.resolve(&params).unwrap(),
            [true, false, true, false]
        );
        assert_eq!(DecayRule::All.resolve(&params).unwrap(), [true; 4]);
        let named = DecayRule::mask_of(&params, |p| p.name.starts_with("fc"));
        assert_eq!(named.resolve(&params).unwrap(), [false, false, true, true]);
        let e = DecayRule::Mask(vec![true; 3]).resolve(&params).unwrap_err();
        assert!(
            e.to_string().contains("3 flags") && e.to_string().contains("4 trainable"),
            "{e}"
        );
    }
}
