//! Scaffolding shared by the gpt-pretrain integration tests.

use burn_dist_models::relative_error;
use burn_flex::{Flex, FlexDevice};

/// The tests' model: `--model tiny` at `--context 16` on the synthetic corpus's vocabulary.
const D_MODEL: usize = 64;

/// `got` and `reference` (a run's parameters as `--out` writes them, in visit order) agree
/// tensor by tensor within `tolerance` (‖got − reference‖ / ‖reference‖), with one exception:
/// the key third of each attention's `c_attn.bias` (query, key and value biases in one vector).
/// Its gradient is zero in exact arithmetic (softmax ignores a constant added to a row of
/// scores), so its values are rounding noise that Adam turns into updates, and that noise
/// depends on the reduction order (a fresh 1-rank run differs from a 2-rank one there). That
/// third is only held to stay noise: its difference within 1e-3 of the whole bias's norm. The
/// query and value thirds get `tolerance` of their own norms, like every other tensor.
pub fn assert_same_model(got: &[Vec<f32>], reference: &[Vec<f32>], tolerance: f64, what: &str) {
    let mut config = gpt_pretrain::model::GptConfig::tiny(64);
    config.context = 16;
    let model = config.init::<Flex>(0, &FlexDevice);
    let params = burn_dist::Survey::of::<Flex, _>(&model).floats;
    assert_eq!(
        params.iter().map(|p| p.numel()).collect::<Vec<_>>(),
        reference.iter().map(Vec::len).collect::<Vec<_>>(),
        "{what}: the tensors are the tiny model's"
    );
    assert_eq!(got.len(), reference.len(), "{what}: tensors");
    let norm = |x: &[f32]| x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
    for ((param, got), reference) in params.iter().zip(got).zip(reference) {
        let name = &param.name;
        let check = |part: &str, error: f64, tolerance: f64| {
            assert!(
                error <= tolerance,
                "{what}: {name}{part} differs by {error:e} (tolerance {tolerance:e})"
            );
        };
        if !name.ends_with("attn.c_attn.bias") {
            check("", relative_error(got, reference), tolerance);
            continue;
        }
        let (q, k, v) = (0..D_MODEL, D_MODEL..2 * D_MODEL, 2 * D_MODEL..3 * D_MODEL);
        check(
            " (query)",
            relative_error(&got[q.clone()], &reference[q]),
            tolerance,
        );
        check(
            " (value)",
            relative_error(&got[v.clone()], &reference[v]),
            tolerance,
        );
        let key_difference: Vec<f32> = got[k.clone()]
            .iter()
            .zip(&reference[k])
            .map(|(a, b)| a - b)
            .collect();
        check(" (key)", norm(&key_difference) / norm(reference), 1e-3);
    }
}
