//! `ZeroAdamConfig::decay`: which parameters weight decay applies to. Under GPT-2's rule
//! (`DecayRule::Matrices`) a matrix decays and a LayerNorm gain or a bias does not; ZeroAdam
//! with it equals Burn's AdamW split in two (`RuledAdamW`) at 1 to 3 ranks; an all-true mask
//! is Burn's AdamW.

use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::backend::AutodiffBackend;
use burn_dist::{Ddp, DdpConfig, DistributedBackend, Survey};
use burn_dist_comm::{CommConfig, HostCommunicator};
use burn_dist_testing::{
    BurnAdamW, OptimizerKind, SEQUENCE, Stepper, Synthetic, TRANSFORMER_WIDTH, TransformerBlock,
    assert_close, parameters, relative_error, train_ranks,
};
use burn_dist_zero::{DecayRule, RuledAdamW, ZeroAdamConfig};
use burn_flex::{Flex, FlexDevice};

type B = Autodiff<DistributedBackend<Flex>>;

const STEPS: usize = 20;
const LR: f64 = 1e-2;
const GLOBAL_BATCH: usize = 12;
/// Large, so that a parameter decayed by mistake differs by far more than the tolerance.
const DECAY: f32 = 0.5;

/// Burn's AdamW (decay [`DECAY`]) under a rule, as `--optimizer adamw` runs it.
struct Ruled(DecayRule);

struct RuledStepper<M: AutodiffModule<A>, A: AutodiffBackend>(RuledAdamW<M, A>);

impl OptimizerKind for Ruled {
    fn build<A, M>(&self, ddp: &Ddp, _model: &M) -> Box<dyn Stepper<A, M>>
    where
        A: AutodiffBackend,
        M: AutodiffModule<A> + 'static,
    {
        let config = AdamWConfig::new().with_weight_decay(DECAY);
        Box::new(RuledStepper(
            RuledAdamW::new(&config, ddp.params(), &self.0).expect("a rule for this model"),
        ))
    }
}

impl<M: AutodiffModule<A>, A: AutodiffBackend> Stepper<A, M> for RuledStepper<M, A> {
    fn step(
        &mut self,
        _ddp: &Ddp,
        lr: f64,
        model: M,
        grads: GradientsParams,
    ) -> burn_dist::Result<M> {
        Ok(self.0.step(lr, model, grads))
    }
}

fn zero(rule: DecayRule) -> ZeroAdamConfig {
    ZeroAdamConfig::new()
        .with_weight_decay(DECAY)
        .with_decay(rule)
}

fn transformer(world: usize, optimizer: &(impl OptimizerKind + Sync)) -> Vec<Vec<Vec<f32>>> {
    train_ranks::<B>(
        world,
        &DdpConfig::new(),
        Synthetic::Transformer,
        optimizer,
        STEPS,
        GLOBAL_BATCH,
        LR,
        &FlexDevice,
    )
}

/// A job of one rank (this thread) and the test transformer, prepared.
fn one_rank_transformer() -> (Ddp, TransformerBlock<B>) {
    let comm = HostCommunicator::local_group(1, &CommConfig::default()).remove(0);
    let mut ddp = Ddp::for_thread(comm, DdpConfig::new());
    let model = TransformerBlock::<B>::new(TRANSFORMER_WIDTH, 2, 11, &FlexDevice);
    let model = ddp.prepare(model).unwrap();
    (ddp, model)
}

/// One step on a zero gradient: Adam's update is zero, so what changes is the decay alone.
/// Under `DecayRule::Matrices` every tensor of two dimensions is multiplied by exactly
/// `1 − lr·decay`, and every LayerNorm gain and offset and every bias is left as it was; under
/// `DecayRule::All` they shrink too.
#[test]
fn under_the_matrices_rule_a_matrix_decays_and_a_layernorm_gain_and_a_bias_do_not() {
    for (rule, stage) in [
        (DecayRule::Matrices, 1),
        (DecayRule::Matrices, 2),
        (DecayRule::All, 1),
    ] {
        let (mut ddp, model) = one_rank_transformer();
        let names: Vec<String> = Survey::of::<B, _>(&model)
            .floats
            .into_iter()
            .map(|p| p.name)
            .collect();
        let before = parameters::<B, _>(&model);
        let mut zero_adam = zero(rule.clone())
            .with_stage(stage)
            .init::<B, _>(&ddp, &model)
            .unwrap();
        let x = burn::tensor::Tensor::<B, 3>::ones([2, SEQUENCE, TRANSFORMER_WIDTH], &FlexDevice);
        let loss = model.forward(x).sum() * 0.0;
        let grads = ddp.backward(loss, &model).unwrap().expect("gradients");
        let (model, _) = zero_adam.step(LR, model, grads, &ddp).unwrap();
        let after = parameters::<B, _>(&model);

        // As Burn computes it: `1 − lr·decay` in f64 from the f32 learning rate, then f32.
        let factor = (1.0 - f64::from(LR as f32) * f64::from(DECAY)) as f32;
        let mut seen = [false; 3];
        for ((name, before), after) in names.iter().zip(&before).zip(&after) {
            // The linear layers' weights; LayerNorm's are `gamma` and `beta`.
            let is_matrix = name.ends_with(".weight");
            let decays = rule == DecayRule::All || is_matrix;
            let want: Vec<f32> = if decays {
                before.iter().map(|p| p * factor).collect()
            } else {
                before.clone()
            };
            assert!(
                after == &want,
                "{rule:?}, stage {stage}: {name} {}",
                if decays {
                    "must decay"
                } else {
                    "must not decay"
                }
            );
            seen[0] |= is_matrix;
            seen[1] |= name.ends_with("gamma");
            seen[2] |= name.ends_with("bias");
        }
        assert_eq!(
            seen, [true; 3],
            "a matrix, a LayerNorm gain and a bias: {names:?}"
        );
    }
}

/// Burn's AdamW steps a parameter from its own gradient and moments only, so ZeroAdam under
/// GPT-2's rule equals two of Burn's AdamW, one with the decay and one without, at any world
/// size and stage; and the rule matters (it differs from decaying everything).
#[test]
fn zero_adam_under_the_matrices_rule_equals_burn_adamw_split_by_the_rule() {
    let reference = transformer(1, &Ruled(DecayRule::Matrices)).remove(0);
    let decays_all = transformer(1, &Ruled(DecayRule::All)).remove(0);
    let most_changed = reference
        .iter()
        .zip(&decays_all)
        .map(|(a, b)| relative_error(a, b))
        .fold(0.0, f64::max);
    assert!(
        most_changed > 1e-3,
        "the rule changes some tensor: {most_changed:e}"
    );
    for stage in [1, 2] {
        for world in 1..=3 {
            let ranks = transformer(world, &zero(DecayRule::Matrices).with_stage(stage));
            assert_close(
                &ranks[0],
                &reference,
                1e-5,
                &format!("stage {stage}, {world} ranks vs Burn's AdamW split by the rule"),
            );
        }
    }
}

/// A mask of all `true` is Burn's AdamW over 20 steps, and Burn's AdamW split by an all-true
/// rule is Burn's AdamW itself.
#[test]
fn an_all_true_mask_equals_burns_adamw() {
    let model = TransformerBlock::<B>::new(TRANSFORMER_WIDTH, 2, 11, &FlexDevice);
    let count = Survey::of::<B, _>(&model).floats.len();
    let burn = transformer(1, &BurnAdamW).remove(0);
    let mask = ZeroAdamConfig::new().with_decay(DecayRule::Mask(vec![true; count]));
    for world in [1, 2] {
        let ranks = transformer(world, &mask);
        assert_close(
            &ranks[0],
            &burn,
            1e-5,
            &format!("all-true mask, {world} ranks vs Burn's AdamW"),
        );
    }
}

#[test]
fn a_mask_of_another_length_is_refused_naming_both_counts() {
    let (ddp, model) = one_rank_transformer();
    let count = ddp.params().len();
    let Err(error) = ZeroAdamConfig::new()
        .with_decay(DecayRule::Mask(vec![true; 2]))
        .init::<B, _>(&ddp, &model)
    else {
        panic!("a mask of 2 flags for {count} parameters must be refused");
    };
    let message = error.to_string();
    assert!(
        message.contains("2 flags") && message.contains(&format!("{count} trainable")),
        "{message}"
    );
}
