//! Reads Burn's backend traits from burn-backend's source, for the forwarding test and for
//! regenerating the signature lists in `src/backend/`.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The traits `DistributedBackend` forwards: (trait, file in burn-backend, file in this crate).
pub const TRAITS: &[(&str, &str, &str)] = &[
    ("Backend", "src/backend/base.rs", "src/backend/mod.rs"),
    (
        "FloatTensorOps",
        "src/backend/ops/tensor.rs",
        "src/backend/ops/float.rs",
    ),
    (
        "IntTensorOps",
        "src/backend/ops/int_tensor.rs",
        "src/backend/ops/int.rs",
    ),
    (
        "BoolTensorOps",
        "src/backend/ops/bool_tensor.rs",
        "src/backend/ops/boolean.rs",
    ),
    (
        "QTensorOps",
        "src/backend/ops/qtensor.rs",
        "src/backend/ops/quantized.rs",
    ),
    (
        "ModuleOps",
        "src/backend/ops/modules/base.rs",
        "src/backend/ops/module.rs",
    ),
    (
        "ActivationOps",
        "src/backend/ops/activation.rs",
        "src/backend/ops/activation.rs",
    ),
    (
        "TransactionOps",
        "src/backend/ops/transaction.rs",
        "src/backend/ops/transaction.rs",
    ),
];

/// Type aliases whose `Self` and `B` forms are the same type once `BackendTypes` is resolved.
/// Any other `Name<Self>` in a signature is a struct generic over the backend: `#[relabel]`.
const ALIASES: &[&str] = &[
    "FloatTensor",
    "IntTensor",
    "BoolTensor",
    "QuantizedTensor",
    "Device",
];

/// Float arguments that the op reads only for their shape, dtype and device (burn-backend's
/// default and Flex's `embedding_backward` read `weights.shape()` and its device, never its
/// values): a stage-3 handle passes there as a one-element stand-in instead of being gathered
/// (`Mode::enter_meta`). The bitwise stage-3 tests run every op listed (the GPT's embedding).
pub const METADATA_ONLY: &[(&str, &str)] = &[("embedding_backward", "weights")];

pub const BEGIN: &str = "// @generated begin";
pub const END: &str = "// @generated end";

/// One method declared in a trait body.
#[derive(Debug, Clone)]
pub struct Method {
    pub name: String,
    /// Has a default body.
    pub provided: bool,
    /// Has generic parameters.
    pub generic: bool,
    /// `name: Type` with the trait's backend parameter written as `Self`.
    pub params: Vec<String>,
    /// Return type, `Self` for the backend parameter; `None` for `()`.
    pub ret: Option<String>,
}

impl Method {
    /// Names a struct generic over the backend, so values must be moved across.
    pub fn needs_relabel(&self) -> bool {
        self.params
            .iter()
            .map(|p| param_type(p))
            .chain(self.ret.as_deref())
            .any(|ty| kind(ty) == Some("wrap"))
    }

    /// Cannot go through `forward!`: generic parameters, a float tensor by reference (a
    /// stage-3 handle must answer without gathering), or a float carried inside `impl Trait`
    /// (the opaque result cannot be converted).
    pub fn by_hand(&self) -> bool {
        let float_ref = self
            .params
            .iter()
            .any(|p| param_type(p).starts_with('&') && param_type(p).contains("FloatTensor<Self>"));
        let opaque = self.ret.as_deref().is_some_and(|r| {
            r.starts_with("impl ")
                && (r.contains("FloatTensor<Self>") || generic_structs(r).next().is_some())
        });
        self.generic || float_ref || opaque
    }

    /// The line in a `forward!` list: each argument and the result tagged with how a float
    /// tensor in it passes between the decorator's mode and `B` (see `forward.rs`).
    pub fn list_line(&self) -> String {
        let tagged = |ty: &str| match kind(ty) {
            Some(kind) => format!("{ty} => {kind}"),
            None => ty.to_string(),
        };
        let params: Vec<String> = self
            .params
            .iter()
            .map(|p| {
                let (name, ty) = p.split_once(": ").expect("`name: Type`");
                if METADATA_ONLY.contains(&(self.name.as_str(), name)) {
                    assert_eq!(
                        kind(ty),
                        Some("float"),
                        "{}({name}): a float tensor",
                        self.name
                    );
                    return format!("{name}: {ty} => float_meta");
                }
                format!("{name}: {}", tagged(ty))
            })
            .collect();
        let ret = self
            .ret
            .as_ref()
            .map(|r| format!(" -> {}", tagged(r)))
            .unwrap_or_default();
        format!("fn {}({}){ret};", self.name, params.join(", "))
    }
}

/// The type of a `name: Type` parameter.
fn param_type(param: &str) -> &str {
    param.split_once(": ").map_or(param, |(_, ty)| ty)
}

/// How a value of type `ty` passes between the decorator and `B` (`forward!`'s tags): `None`
/// when it holds no float tensor of the decorator and no struct generic over the backend, which
/// makes it `B`'s type as it is.
fn kind(ty: &str) -> Option<&'static str> {
    const FLOAT: &str = "FloatTensor<Self>";
    if generic_structs(ty).next().is_some() {
        return Some("wrap");
    }
    if !ty.contains(FLOAT) {
        return None;
    }
    Some(match ty {
        "FloatTensor<Self>" => "float",
        "Option<FloatTensor<Self>>" => "float_opt",
        "Vec<FloatTensor<Self>>" => "floats",
        "(FloatTensor<Self>, FloatTensor<Self>)" => "(float, float)",
        t if t.starts_with("(FloatTensor<Self>, ") && t.matches(FLOAT).count() == 1 => "(float, _)",
        t if t.starts_with('&') || t.starts_with("impl ") => return None, // written by hand
        other => panic!("no forward! tag for `{other}`: add one to forward.rs and here"),
    })
}

/// `Name` for every `Name<Self>` in `ty` that is not a plain alias.
fn generic_structs(ty: &str) -> impl Iterator<Item = &str> {
    ty.match_indices("<Self>").filter_map(move |(at, _)| {
        let start = ty[..at]
            .rfind(|c: char| !(c.is_alphanumeric() || c == '_'))
            .map_or(0, |i| i + 1);
        let name = &ty[start..at];
        (!ALIASES.contains(&name)).then_some(name)
    })
}

/// burn-backend's directory, from `cargo metadata`.
///
/// `--filter-platform` with the host's triple matters: without it, `cargo metadata` needs every
/// package of the lock file for every platform (Android, Windows, …), while a build downloads
/// only the host's. Filtered, it works offline on any machine that built this test.
pub fn burn_backend_dir() -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let manifest = std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR")
            .expect("cargo sets CARGO_MANIFEST_DIR when it runs a test"),
    )
    .join("Cargo.toml");
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--offline"])
        .args(["--filter-platform", &host_triple()])
        .arg("--manifest-path")
        .arg(&manifest)
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata JSON");
    let packages = meta["packages"].as_array().expect("packages");
    let backend: Vec<_> = packages
        .iter()
        .filter(|p| p["name"] == "burn-backend")
        .collect();
    assert_eq!(
        backend.len(),
        1,
        "expected exactly one burn-backend in the dependency graph"
    );
    let version = backend[0]["version"].as_str().unwrap();
    assert_eq!(version, "0.21.0", "burn-backend is pinned to =0.21.0");
    let manifest = backend[0]["manifest_path"].as_str().expect("manifest_path");
    Path::new(manifest).parent().unwrap().to_path_buf()
}

/// The triple of the machine running this test, from the rustc that cargo uses.
fn host_triple() -> String {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let out = Command::new(&rustc)
        .arg("-vV")
        .output()
        .unwrap_or_else(|e| panic!("cannot run `{rustc} -vV`: {e}"));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .unwrap_or_else(|| panic!("`{rustc} -vV` printed no `host:` line"))
        .to_string()
}

/// The methods declared in `pub trait <name>` in `file` (not methods of impls or free functions).
pub fn trait_methods(backend_dir: &Path, trait_name: &str, file: &str) -> Vec<Method> {
    let path = backend_dir.join(file);
    let src = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let src = strip_comments_and_literals(&src);
    let body = trait_body(&src, trait_name)
        .unwrap_or_else(|| panic!("no `pub trait {trait_name}` in {path:?}"));
    top_level_fns(body)
        .into_iter()
        .map(|(sig, provided)| parse_signature(&sig, provided))
        .collect()
}

/// Removes comments and empties string and char literals, so braces in them do not count.
fn strip_comments_and_literals(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if b[i] == b'"' {
            i += 1;
            while b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if b[i] == b'\''
            && i + 2 < b.len()
            && (b[i + 1] == b'\\' || (b[i + 2] == b'\'' && b[i + 1] != b'\''))
        {
            // A char literal (a lifetime such as `'a` has no closing quote two bytes on).
            i += 1;
            while b[i] != b'\'' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("' '");
        } else {
            let ch = src[i..].chars().next().unwrap();
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

fn is_ident_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// The text between the braces of `pub trait <name> ... { ... }`.
fn trait_body<'a>(src: &'a str, name: &str) -> Option<&'a str> {
    let needle = format!("pub trait {name}");
    let mut from = 0;
    let start = loop {
        let at = from + src[from..].find(&needle)?;
        let end = at + needle.len();
        if !src.as_bytes().get(end).copied().is_some_and(is_ident_byte) {
            break end;
        }
        from = end;
    };
    let open = start + src[start..].find('{')? + 1;
    let b = src.as_bytes();
    let mut depth = 1;
    let mut i = open;
    while depth > 0 {
        match b[i] {
            b'{' => depth += 1,
            b'}' => depth -= 1,
            _ => {}
        }
        i += 1;
    }
    Some(&src[open..i - 1])
}

/// `(signature text, has a body)` for each `fn` at brace depth 0 of a trait body.
fn top_level_fns(body: &str) -> Vec<(String, bool)> {
    let b = body.as_bytes();
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'{' => depth += 1,
            b'}' => depth -= 1,
            b'f' if depth == 0
                && b[i..].starts_with(b"fn ")
                && (i == 0 || !is_ident_byte(b[i - 1])) =>
            {
                // The signature ends at the first `;` or `{` outside (), [] and <>.
                let mut j = i;
                let mut nest = 0i32;
                loop {
                    match b[j] {
                        b'(' | b'[' | b'<' => nest += 1,
                        b')' | b']' => nest -= 1,
                        b'>' if b[j - 1] != b'-' => nest -= 1,
                        b';' | b'{' if nest == 0 => break,
                        _ => {}
                    }
                    j += 1;
                }
                out.push((body[i..j].to_string(), b[j] == b'{'));
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// Collapses whitespace the way rustfmt would print a one-line signature.
fn tidy(s: &str) -> String {
    let mut s = s.split_whitespace().collect::<Vec<_>>().join(" ");
    for (from, to) in [
        ("( ", "("),
        (" )", ")"),
        ("< ", "<"),
        (" >", ">"),
        (",)", ")"),
        (",>", ">"),
    ] {
        while s.contains(from) {
            s = s.replace(from, to);
        }
    }
    s.trim().trim_end_matches(',').trim().to_string()
}

/// Replaces the trait's backend parameter `B` with `Self`, and burn-backend's `crate::` paths
/// with `burn_backend::`.
fn b_to_self(ty: &str) -> String {
    let mut ty = ty.to_string();
    let mut from = 0;
    while let Some(at) = ty[from..].find("crate::").map(|i| i + from) {
        let before = ty[..at].bytes().next_back();
        if !before.is_some_and(|c| is_ident_byte(c) || c == b':') {
            ty.replace_range(at..at + "crate".len(), "burn_backend");
        }
        from = at + "crate::".len();
    }
    let b = ty.as_bytes();
    let mut out = String::new();
    for (i, ch) in ty.char_indices() {
        let alone = ch == 'B'
            && (i == 0 || !is_ident_byte(b[i - 1]))
            && !b.get(i + 1).copied().is_some_and(is_ident_byte);
        if alone {
            out.push_str("Self");
        } else {
            out.push(ch);
        }
    }
    out
}

/// Splits on commas outside (), [] and <>.
fn split_top_level(s: &str) -> Vec<String> {
    let b = s.as_bytes();
    let mut parts = Vec::new();
    let mut nest = 0i32;
    let mut start = 0;
    for (i, &c) in b.iter().enumerate() {
        match c {
            b'(' | b'[' | b'<' => nest += 1,
            b')' | b']' => nest -= 1,
            b'>' if i == 0 || b[i - 1] != b'-' => nest -= 1,
            b',' if nest == 0 => {
                parts.push(s[start..i].to_string());
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(s[start..].to_string());
    parts
        .into_iter()
        .map(|p| tidy(&p))
        .filter(|p| !p.is_empty())
        .collect()
}

fn parse_signature(sig: &str, provided: bool) -> Method {
    let sig = tidy(sig);
    let rest = sig.strip_prefix("fn ").unwrap();
    let name_end = rest
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap();
    let name = rest[..name_end].to_string();
    let generic = rest[name_end..].starts_with('<');
    // The parameter list: the first `(` after the name and generics, to its matching `)`.
    let b = rest.as_bytes();
    let mut nest = 0i32;
    let mut open = None;
    let mut close = 0;
    for (i, &c) in b.iter().enumerate().skip(name_end) {
        match c {
            b'<' if open.is_none() => nest += 1,
            b'>' if open.is_none() && b[i - 1] != b'-' => nest -= 1,
            b'(' if open.is_none() && nest == 0 => {
                open = Some(i);
                nest = 1;
            }
            b'(' if open.is_some() => nest += 1,
            b')' if open.is_some() => {
                nest -= 1;
                if nest == 0 {
                    close = i;
                    break;
                }
            }
            _ => {}
        }
    }
    let open = open.expect("parameter list");
    let params = split_top_level(&rest[open + 1..close])
        .iter()
        .map(|p| b_to_self(p))
        .collect();
    let after = rest[close + 1..].trim();
    let ret = after.strip_prefix("->").map(|r| {
        let r = r.split(" where ").next().unwrap();
        b_to_self(&tidy(r))
    });
    Method {
        name,
        provided,
        generic,
        params,
        ret,
    }
}

/// The names in a file's `by_hand [...]` list: methods it writes out in full, either because
/// they cannot go through `forward!` or because `DistributedBackend` changes what they do.
pub fn hand_written(file_text: &str) -> Vec<String> {
    let Some(start) = file_text.find("by_hand [") else {
        return Vec::new();
    };
    let list = &file_text[start + "by_hand [".len()..];
    let list = &list[..list.find(']').unwrap_or(0)];
    list.split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(str::to_string)
        .collect()
}

/// The `forward!` list for `methods`, one line each, indented for the macro body, leaving out
/// the methods the file writes by hand (`hand_written`).
pub fn generated_list(methods: &[Method], hand_written: &[String]) -> String {
    let mut out = String::new();
    for m in methods
        .iter()
        .filter(|m| !m.by_hand() && !hand_written.contains(&m.name))
    {
        out.push_str("    ");
        out.push_str(&m.list_line());
        out.push('\n');
    }
    out
}

/// The text between the `@generated` markers of a file in this crate.
pub fn generated_region(file_text: &str) -> Option<&str> {
    let begin = file_text.find(BEGIN)? + BEGIN.len();
    let begin = begin + file_text[begin..].find('\n')? + 1;
    let end = begin + file_text[begin..].find(END)?;
    let end = file_text[..end]
        .rfind('\n')
        .map_or(begin, |i| i + 1)
        .max(begin);
    Some(&file_text[begin..end])
}

/// `file_text` with the region between the markers replaced by `list`.
pub fn with_generated_region(file_text: &str, list: &str) -> String {
    let region = generated_region(file_text).expect("@generated markers");
    let start = region.as_ptr() as usize - file_text.as_ptr() as usize;
    let end = start + region.len();
    format!("{}{}{}", &file_text[..start], list, &file_text[end..])
}
