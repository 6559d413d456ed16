//! The validation loss represents the whole validation split, on text whose documents differ
//! (prose, dialogue, ledgers of numbers), at 1 and 2 ranks.
//!
//! The corpus is written here, from word lists and a seeded stream: no download and nobody's
//! text. Its validation split is prose and dialogue, then one long ledger. The first 256 windows
//! (what `--eval-sequences` once took: the start of the split) miss most of the ledger, whose
//! loss is far from the prose's; so the figure of that evaluation is off the split's mean by
//! much more than 0.01, which this test asserts before holding the reported loss to the mean.

use std::path::Path;

use burn::module::Module;
use burn::tensor::ElementConversion;
use burn_dist_models::SetValues;
use burn_dist_models::processes::scratch_dir;
use burn_flex::{Flex, FlexDevice};
use gpt_pretrain::data::{self, Corpus, EvalPlan, EvalWindows, Source, text::Tokenizer};
use gpt_pretrain::model::GptConfig;
use gpt_pretrain::rng::SplitMix64;

mod common;

use common::launched_as;

const CONTEXT: usize = 16;
/// gpt-pretrain's default `--seed`, which seeds the validation sample.
const SEED: u64 = 42;
/// Of the file's bytes; about 400 windows of 17 bytes.
const VAL_FRACTION: f64 = 0.1;

const PROSE: &[&str] = &[
    "the", "river", "ran", "past", "an", "old", "mill", "and", "a", "quiet", "town", "where",
    "people", "walked", "slowly", "under", "tall", "trees", "in", "late", "summer", "light", "of",
    "evening", "while", "children", "played", "near", "water", "stone", "bridge",
];
const SPEAKERS: &[&str] = &["ANNA", "BORIS", "CLARA", "DMITRI"];
const DIALOGUE: &[&str] = &[
    "no", "yes", "why", "never", "come", "here", "now", "go", "away", "listen", "wait", "stop",
    "what", "do", "you", "want", "from", "me", "tell", "him", "tonight",
];

fn words(rng: &mut SplitMix64, list: &[&str], n: usize) -> String {
    (0..n)
        .map(|_| list[rng.below(list.len())])
        .collect::<Vec<_>>()
        .join(" ")
}

fn prose(rng: &mut SplitMix64, bytes: usize) -> String {
    let mut doc = String::new();
    while doc.len() < bytes {
        let n = 6 + rng.below(8);
        let sentence = words(rng, PROSE, n);
        doc += &sentence[..1].to_uppercase();
        doc += &sentence[1..];
        doc += ". ";
    }
    doc + "\n\n"
}

fn dialogue(rng: &mut SplitMix64, bytes: usize) -> String {
    let mut doc = String::new();
    while doc.len() < bytes {
        let speaker = SPEAKERS[rng.below(SPEAKERS.len())];
        let n = 2 + rng.below(5);
        doc += &format!("{speaker}: {}!\n", words(rng, DIALOGUE, n));
    }
    doc + "\n"
}

fn ledger(rng: &mut SplitMix64, bytes: usize) -> String {
    let mut doc = String::new();
    while doc.len() < bytes {
        doc += &format!(
            "{:04} {:>3}.{:02} K-{:02} {}\n",
            rng.below(10_000),
            rng.below(1000),
            rng.below(100),
            rng.below(100),
            rng.below(10)
        );
    }
    doc + "\n"
}

/// About 64 KB: training documents of every kind, then a validation split that starts with
/// prose and dialogue and ends with a ledger of about 40 % of it.
fn write_corpus(path: &Path) {
    let mut rng = SplitMix64::new(2026);
    let mut text = String::new();
    while text.len() < 57_000 {
        let size = 1000 + rng.below(1000);
        text += &match rng.below(3) {
            0 => prose(&mut rng, size),
            1 => dialogue(&mut rng, size),
            _ => ledger(&mut rng, size),
        };
    }
    text += &prose(&mut rng, 2200);
    text += &dialogue(&mut rng, 1800);
    text += &ledger(&mut rng, 2700);
    std::fs::write(path, text).unwrap();
}

/// Each window's loss under the trained parameters, one window per forward: the reference the
/// reported figure is held to, computed without the example's evaluation.
fn window_losses(corpus: &Corpus, params: Vec<Vec<f32>>) -> Vec<f64> {
    let mut config = GptConfig::tiny(Tokenizer::Bytes.vocab_size());
    config.context = CONTEXT;
    let model = config
        .init::<Flex>(0, &FlexDevice)
        .map(&mut SetValues::new(params));
    (0..data::window_count(corpus.val.len(), CONTEXT))
        .map(|i| {
            let (inputs, targets) = data::batch::<Flex>(&corpus.val, CONTEXT, &[i], &FlexDevice);
            model.loss(inputs, targets).into_scalar().elem::<f64>()
        })
        .collect()
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

#[test]
fn the_validation_loss_is_the_whole_splits_mean_at_one_and_two_ranks() {
    let dir = scratch_dir("gpt-validation");
    let text = dir.join("corpus.txt");
    write_corpus(&text);
    let corpus = Corpus::load(
        &Source::Text {
            path: text.clone(),
            tokenizer: Tokenizer::Bytes,
        },
        VAL_FRACTION,
    )
    .unwrap();
    let windows = data::window_count(corpus.val.len(), CONTEXT);
    assert!(
        (257..=512).contains(&windows),
        "{windows} validation windows: more than the 256 evaluated once, fewer than the 512 evaluated whole by default"
    );
    let val_fraction = VAL_FRACTION.to_string();
    let args = [
        "--text",
        text.to_str().unwrap(),
        "--tokenizer",
        "bytes",
        "--val-fraction",
        &val_fraction,
        "--steps",
        "40",
        "--global-batch",
        "8",
        "--lr",
        "1e-2",
        "--eval-every",
        "0",
        "--eval-sequences",
        "512",
        "--log-every",
        "0",
    ];
    let mut reported = Vec::new();
    for world in [1, 2] {
        let run = launched_as(&dir, &format!("world{world}"), world, &args);
        assert!(
            run.stdout
                .contains(&format!("validation: all {windows} windows of 17 tokens")),
            "{world} ranks: the log says how many windows of how many\n{}",
            run.stdout
        );
        let val = run
            .steps
            .last()
            .unwrap()
            .val_loss
            .expect("a final evaluation");
        let losses = window_losses(&corpus, run.params);
        let whole = mean(&losses);
        let first = mean(&losses[..256]);
        assert!(
            (first - whole).abs() > 0.05,
            "the corpus must tell: the first 256 windows score {first:.4}, the split {whole:.4}"
        );
        assert!(
            (val - whole).abs() <= 0.01,
            "{world} ranks: reported {val:.4}, the whole split's mean {whole:.4} (the first windows': {first:.4})"
        );
        reported.push(val);
    }
    assert!(
        (reported[0] - reported[1]).abs() <= 1e-4 * reported[0],
        "1 rank reports {:.6}, 2 ranks {:.6}",
        reported[0],
        reported[1]
    );

    // A sample where the whole split is not asked for: the figure is the mean over exactly
    // the plan's windows (spread over the split: see `EvalPlan`'s tests), read by 2 ranks.
    let run = launched_as(
        &dir,
        "sampled",
        2,
        &[&args[..], &["--eval-sequences", "64"]].concat(),
    );
    assert!(
        run.stdout
            .contains(&format!("validation: 64 of the split's {windows} windows")),
        "{}",
        run.stdout
    );
    let val = run.steps.last().unwrap().val_loss.unwrap();
    let losses = window_losses(&corpus, run.params);
    let plan = EvalPlan::new(windows, EvalWindows::AtMost(64), SEED);
    let sampled: Vec<f64> = plan.windows.iter().map(|&i| losses[i]).collect();
    assert!(
        (val - mean(&sampled)).abs() <= 1e-4,
        "64 windows: reported {val:.6}, their mean {:.6}",
        mean(&sampled)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
