//! `DistributedBackend` forwards every method of `Backend` and of every op trait, required and
//! provided, and its generated signature lists match burn-backend's source.
//!
//! To regenerate the lists after a Burn upgrade:
//! `BURN_DIST_REGENERATE=1 cargo test -p burn-dist --test forwarding_is_complete -- --ignored`

mod common;

use std::collections::BTreeSet;

use common::{Method, TRAITS};

/// Burn 0.21.0's counts, measured when the design was written (DESIGN.md, "Decorator surface").
const DESIGN_REQUIRED: &[(&str, usize)] = &[
    ("FloatTensorOps", 80),
    ("IntTensorOps", 67),
    ("BoolTensorOps", 28),
    ("ModuleOps", 18),
    ("QTensorOps", 13),
    ("Backend", 4),
];
const DESIGN_PROVIDED_OP_TRAITS: usize = 212;

fn source_methods() -> Vec<(&'static str, Vec<Method>)> {
    let dir = common::burn_backend_dir();
    TRAITS
        .iter()
        .map(|(name, file, _)| (*name, common::trait_methods(&dir, name, file)))
        .collect()
}

#[test]
fn forwarding_is_complete() {
    let source = source_methods();
    let forwarded = burn_dist::FORWARDED;

    let mut problems = Vec::new();
    let (mut req_total, mut prov_total, mut fwd_total) = (0, 0, 0);
    println!(
        "{:<16} {:>8} {:>8} {:>9} {:>8} {:>8}",
        "trait", "required", "provided", "forwarded", "relabel", "by hand"
    );
    for (name, methods) in &source {
        let declared: BTreeSet<&str> = methods.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(
            declared.len(),
            methods.len(),
            "{name}: duplicate method names"
        );
        let Some((_, list)) = forwarded.iter().find(|(t, _)| t == name) else {
            problems.push(format!("{name}: not forwarded at all"));
            continue;
        };
        let ours: BTreeSet<&str> = list.iter().copied().collect();
        assert_eq!(
            ours.len(),
            list.len(),
            "{name}: a method is forwarded twice"
        );
        let missing: Vec<_> = declared.difference(&ours).collect();
        let extra: Vec<_> = ours.difference(&declared).collect();
        if !missing.is_empty() {
            problems.push(format!("{name}: not forwarded: {missing:?}"));
        }
        if !extra.is_empty() {
            problems.push(format!("{name}: forwarded but not in the trait: {extra:?}"));
        }
        let required = methods.iter().filter(|m| !m.provided).count();
        let provided = methods.len() - required;
        let relabel = methods.iter().filter(|m| m.needs_relabel()).count();
        let by_hand = methods.iter().filter(|m| m.by_hand()).count();
        println!(
            "{name:<16} {required:>8} {provided:>8} {:>9} {relabel:>8} {by_hand:>8}",
            ours.len()
        );
        req_total += required;
        prov_total += provided;
        fwd_total += ours.len();
    }
    for (trait_name, _) in forwarded {
        if !source.iter().any(|(name, _)| name == trait_name) {
            problems.push(format!(
                "{trait_name}: forwarded but not a Backend supertrait here"
            ));
        }
    }
    println!(
        "{:<16} {req_total:>8} {prov_total:>8} {fwd_total:>9}",
        "total"
    );
    assert!(
        problems.is_empty(),
        "forwarding is incomplete:\n  {}",
        problems.join("\n  ")
    );

    // The counts DESIGN.md gives for Burn 0.21.0 (Burn is pinned, so they are exact).
    for (trait_name, expected) in DESIGN_REQUIRED {
        let (_, methods) = source.iter().find(|(n, _)| n == trait_name).unwrap();
        let required = methods.iter().filter(|m| !m.provided).count();
        assert_eq!(required, *expected, "{trait_name}: required methods");
    }
    let provided_ops: usize = source
        .iter()
        .filter(|(name, _)| *name != "Backend")
        .map(|(_, methods)| methods.iter().filter(|m| m.provided).count())
        .sum();
    assert_eq!(
        provided_ops, DESIGN_PROVIDED_OP_TRAITS,
        "provided op-trait methods"
    );
}

/// The committed signature lists are what burn-backend's source generates today.
#[test]
fn generated_lists_are_current() {
    let crate_dir = crate_dir();
    let mut stale = Vec::new();
    for ((name, methods), (_, _, ours)) in source_methods().iter().zip(TRAITS) {
        let text = std::fs::read_to_string(crate_dir.join(ours)).unwrap();
        let region = common::generated_region(&text)
            .unwrap_or_else(|| panic!("{ours}: no @generated markers"));
        if region != common::generated_list(methods, &common::hand_written(&text)) {
            stale.push(format!("{name} ({ours})"));
        }
    }
    assert!(
        stale.is_empty(),
        "stale signature lists: {stale:?}; run\n  BURN_DIST_REGENERATE=1 cargo test -p burn-dist \
         --test forwarding_is_complete -- --ignored"
    );
}

/// Rewrites the signature lists in `src/backend/` from burn-backend's source.
#[test]
#[ignore = "writes src/; run with BURN_DIST_REGENERATE=1 after a Burn upgrade"]
fn regenerate_signature_lists() {
    if std::env::var_os("BURN_DIST_REGENERATE").is_none() {
        eprintln!("set BURN_DIST_REGENERATE=1 to rewrite the lists");
        return;
    }
    let crate_dir = crate_dir();
    for ((name, methods), (_, _, ours)) in source_methods().iter().zip(TRAITS) {
        let path = crate_dir.join(ours);
        let text = std::fs::read_to_string(&path).unwrap();
        let list = common::generated_list(methods, &common::hand_written(&text));
        let new = common::with_generated_region(&text, &list);
        if new != text {
            std::fs::write(&path, new).unwrap();
            println!("rewrote {name} in {ours}");
        }
        let by_hand: Vec<_> = methods.iter().filter(|m| m.by_hand()).collect();
        for m in by_hand {
            println!("{name}::{} must be written by hand in {ours}", m.name);
        }
    }
}

/// This crate's directory, read when the test runs: a binary built in another checkout that
/// shares the target directory would otherwise read that checkout's sources.
fn crate_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .expect("cargo sets CARGO_MANIFEST_DIR when it runs a test")
        .into()
}
