//! The module graph of each workspace crate: no two modules of a crate may refer to each other
//! (`crate::b::…` in `a` and `crate::a::…` in `b`). A pair that does is one idea split in two
//! files, or two ideas knotted together; either way a reader cannot understand one without the
//! other. Only code that ships counts: comments, `#[cfg(test)]` items and the test modules they
//! declare are left out, since tests may reach across.
//!
//! A crate whose root lists its layers (lines `//! 1. `name/`: …`, the lowest first, as
//! provider-core's `lib.rs` does) has its modules in those folders: a module is then
//! `layer::name`, every file sits in a listed layer, and no module refers to a module of a
//! layer above its own. A path through a re-export of the root (`crate::fleet`, kept from
//! before the folders) counts as the module it names.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// What is wrong with the module graph of the crate at `src`, one line each.
fn violations(src: &Path) -> Result<Vec<String>> {
    let root = ["lib.rs", "main.rs"]
        .iter()
        .map(|name| src.join(name))
        .find(|path| path.is_file());
    let root_text = match &root {
        Some(path) => {
            fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?
        }
        None => String::new(),
    };
    let layers = layers(&root_text);
    let aliases = aliases(&root_text);
    let mut problems = Vec::new();
    for layer in &layers {
        if !src.join(layer).is_dir() {
            problems.push(format!("layer {layer}/ is listed but has no folder"));
        }
    }
    let layer_of = |module: &str| {
        let layer = module.split("::").next().unwrap_or_default();
        layers.iter().position(|l| l == layer)
    };

    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut files = Vec::new();
    collect(src, &mut files)?;
    let test_files = test_files(src, &files)?;
    for file in &files {
        if test_files
            .iter()
            .any(|t| file.starts_with(t.with_extension("")))
            || test_files.contains(file)
        {
            continue;
        }
        let Some(module) = module_of(src, file, &layers) else {
            if !layers.is_empty() && Some(file) != root.as_ref() {
                problems.push(format!(
                    "{} sits outside the layers",
                    file.strip_prefix(src).unwrap_or(file).display()
                ));
            }
            continue;
        };
        let text = fs::read_to_string(file)?;
        for path in references(&shipping_code(&text)) {
            let referenced = if layers.is_empty() {
                path.first().cloned()
            } else {
                resolve(&path, &layers, &aliases)
            };
            if let Some(referenced) = referenced.filter(|r| *r != module) {
                edges.entry(module.clone()).or_default().insert(referenced);
            }
        }
    }
    for (a, targets) in &edges {
        for b in targets {
            if a < b && edges.get(b).is_some_and(|back| back.contains(a)) {
                problems.push(format!("{a} <-> {b}"));
            }
            if let (Some(from), Some(to)) = (layer_of(a), layer_of(b))
                && to > from
            {
                problems.push(format!(
                    "{a} uses {b}, of the layer above ({} over {})",
                    layers[to], layers[from]
                ));
            }
        }
    }
    problems.sort();
    Ok(problems)
}

/// The layers a crate root lists, lowest first: its `//! 1. `name/`…` lines.
fn layers(root: &str) -> Vec<String> {
    let mut layers = Vec::new();
    for line in root.lines() {
        let Some(doc) = line.trim().strip_prefix("//!") else {
            continue;
        };
        let Some((number, rest)) = doc.trim().split_once(". `") else {
            continue;
        };
        if number.parse() == Ok(layers.len() + 1)
            && let Some((name, _)) = rest.split_once("/`")
        {
            layers.push(name.to_owned());
        }
    }
    layers
}

/// The root's re-exports (`pub use rules::{fence, machine};`): each name with the path it stands
/// for.
fn aliases(root: &str) -> BTreeMap<String, Vec<String>> {
    let mut aliases = BTreeMap::new();
    for (at, _) in root.match_indices("pub use ") {
        let tree = &root[at + "pub use ".len()..];
        let tree = &tree[..tree.find(';').unwrap_or(tree.len())];
        for path in use_tree(tree.as_bytes(), &mut 0) {
            if let Some(name) = path.last() {
                aliases.insert(name.clone(), path);
            }
        }
    }
    aliases
}

/// The module (`layer::name`) a path from the crate root names, through the root's
/// re-exports; `None` for anything else (an item of the root, a macro).
fn resolve(
    path: &[String],
    layers: &[String],
    aliases: &BTreeMap<String, Vec<String>>,
) -> Option<String> {
    let mut path = path.to_vec();
    // A re-export may name another (`pub use backend::Backend` after `pub use
    // provisioning::backend`); a cycle of them cannot compile, the bound only ends the loop.
    for _ in 0..8 {
        let first = path.first()?;
        if layers.contains(first) {
            return Some(match path.get(1) {
                Some(name) if name != "self" && name != "*" => format!("{first}::{name}"),
                _ => first.clone(),
            });
        }
        let target = aliases.get(first)?;
        path = target.iter().chain(&path[1..]).cloned().collect();
    }
    None
}

/// The files only tests compile: those of `#[cfg(test)] mod name;` declarations.
fn test_files(src: &Path, files: &[PathBuf]) -> Result<BTreeSet<PathBuf>> {
    let mut test_files = BTreeSet::new();
    for file in files {
        let text = fs::read_to_string(file).with_context(|| format!("read {}", file.display()))?;
        let dir = module_dir(src, file);
        let mut cfg_test = false;
        for line in text.lines().map(str::trim) {
            if line == "#[cfg(test)]" {
                cfg_test = true;
                continue;
            }
            if cfg_test && let Some(name) = declared_module(line) {
                test_files.insert(dir.join(format!("{name}.rs")));
                test_files.insert(dir.join(name).join("mod.rs"));
            }
            cfg_test = false;
        }
    }
    Ok(test_files)
}

fn collect(dir: &Path, files: &mut Vec<PathBuf>) -> Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("read {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            collect(&path, files)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files.sort();
    Ok(())
}

/// The directory a file's child modules live in (`a.rs` and `a/mod.rs` both: `a/`).
fn module_dir(src: &Path, file: &Path) -> PathBuf {
    let parent = file.parent().unwrap_or(src);
    match file.file_stem().and_then(|s| s.to_str()) {
        Some("mod" | "lib" | "main") => parent.to_path_buf(),
        Some(stem) => parent.join(stem),
        None => parent.to_path_buf(),
    }
}

/// `name` of a `mod name;` declaration (any visibility).
fn declared_module(line: &str) -> Option<&str> {
    let rest = line
        .strip_prefix("pub ")
        .or(line.strip_prefix("pub(crate) "))
        .unwrap_or(line);
    let name = rest.strip_prefix("mod ")?.strip_suffix(';')?;
    name.chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_')
        .then_some(name)
}

/// The module a file belongs to: its top-level module, or with layers `layer::name` (a layer's
/// own `mod.rs` is `layer`); `None` for the crate root, `src/bin/` and, with layers, a file
/// outside them.
fn module_of(src: &Path, file: &Path, layers: &[String]) -> Option<String> {
    let relative = file.strip_prefix(src).ok()?;
    let mut parts = relative
        .components()
        .filter_map(|c| c.as_os_str().to_str())
        .map(|part| part.strip_suffix(".rs").unwrap_or(part));
    let first = parts.next()?;
    if layers.is_empty() {
        return (!matches!(first, "lib" | "main" | "bin")).then(|| first.to_owned());
    }
    if !layers.iter().any(|l| l == first) {
        return None;
    }
    Some(match parts.next() {
        Some("mod") | None => first.to_owned(),
        Some(name) => format!("{first}::{name}"),
    })
}

/// The text of a file up to its first `#[cfg(test)]`, without comments.
fn shipping_code(text: &str) -> String {
    let mut code = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed == "#[cfg(test)]" {
            break;
        }
        if trimmed.starts_with("//") {
            continue;
        }
        code.push_str(line);
        code.push('\n');
    }
    code
}

/// Every path after `crate::` in `code`, grouped imports (`use crate::{a, b::{c, d}}`) expanded
/// into one path each.
fn references(code: &str) -> BTreeSet<Vec<String>> {
    let mut paths = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        let mut position = at + "crate::".len();
        for path in use_tree(code.as_bytes(), &mut position) {
            if !path.is_empty() {
                paths.insert(path);
            }
        }
    }
    paths
}

/// The paths of the use tree (or plain path) at `*at` in `text`: `a::b`, `a::{b, c::d}`,
/// `{a, b}`; parsing stops at the first byte that cannot continue it.
fn use_tree(text: &[u8], at: &mut usize) -> Vec<Vec<String>> {
    let skip_space = |at: &mut usize| {
        while text.get(*at).is_some_and(u8::is_ascii_whitespace) {
            *at += 1;
        }
    };
    skip_space(at);
    if text.get(*at) == Some(&b'{') {
        *at += 1;
        let mut paths = Vec::new();
        loop {
            skip_space(at);
            match text.get(*at) {
                None => return paths,
                Some(b'}') => {
                    *at += 1;
                    return paths;
                }
                Some(b',') => *at += 1,
                Some(_) => {
                    let start = *at;
                    paths.extend(use_tree(text, at));
                    // Skip what ends the item (`as name`) up to its `,` or `}`.
                    while text.get(*at).is_some_and(|b| *b != b',' && *b != b'}') {
                        *at += 1;
                    }
                    if *at == start {
                        *at += 1;
                    }
                }
            }
        }
    }
    let start = *at;
    while text
        .get(*at)
        .is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_' || *b == b'*')
    {
        *at += 1;
    }
    let segment = String::from_utf8_lossy(&text[start..*at]).into_owned();
    if segment.is_empty() {
        return vec![Vec::new()];
    }
    if text[*at..].starts_with(b"::") {
        *at += 2;
        let rest = use_tree(text, at);
        return rest
            .into_iter()
            .map(|tail| std::iter::once(segment.clone()).chain(tail).collect())
            .collect();
    }
    vec![vec![segment]]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_workspace_crate_keeps_its_modules_apart_and_its_layers_in_order() {
        let crates = crate::repo::root().join("crates");
        let mut problems = Vec::new();
        for entry in fs::read_dir(&crates).expect("crates/") {
            let src = entry.expect("entry").path().join("src");
            if src.is_dir() {
                for problem in violations(&src).expect("scan") {
                    problems.push(format!("{}: {problem}", src.display()));
                }
            }
        }
        problems.sort();
        assert!(
            problems.is_empty(),
            "the module graph breaks its rules:\n{}",
            problems.join("\n")
        );
    }

    #[test]
    fn provider_core_lists_its_layers_and_every_folder_is_one() {
        let src = crate::repo::root().join("crates/provider-core/src");
        let listed = layers(&fs::read_to_string(src.join("lib.rs")).expect("lib.rs"));
        assert_eq!(
            listed,
            [
                "observability",
                "rules",
                "provisioning",
                "security",
                "persistence",
                "runtime",
                "wire",
                "operations"
            ]
        );
        let mut folders: Vec<String> = fs::read_dir(&src)
            .expect("src/")
            .map(|e| e.expect("entry").path())
            .filter(|p| p.is_dir())
            .filter_map(|p| Some(p.file_name()?.to_str()?.to_owned()))
            .collect();
        folders.sort();
        let mut sorted = listed.clone();
        sorted.sort();
        assert_eq!(folders, sorted);
    }

    #[test]
    fn a_mutual_reference_is_found_and_tests_are_left_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        let src = dir.path();
        fs::write(src.join("lib.rs"), "mod a;\nmod b;\nmod c;\n").unwrap();
        fs::write(
            src.join("a.rs"),
            "//! see crate::c\nuse crate::{b::Thing, self};\n#[cfg(test)]\nmod tests;\n",
        )
        .unwrap();
        fs::create_dir(src.join("a")).unwrap();
        fs::write(src.join("a/tests.rs"), "use crate::c::X;\n").unwrap();
        fs::write(src.join("b.rs"), "fn f() { crate::a::g() }\n").unwrap();
        fs::write(
            src.join("c.rs"),
            "use crate::a;\n#[cfg(test)]\nmod t { use crate::b; }\n",
        )
        .unwrap();
        assert_eq!(violations(src).unwrap(), ["a <-> b"]);
    }

    /// A made-up layered crate: `low/` (x, y) under `high/` (z).
    fn layered(files: &[(&str, &str)]) -> Vec<String> {
        let dir = tempfile::tempdir().expect("tempdir");
        let src = dir.path();
        let root = "//! Layers:\n//! 1. `low/`: below.\n//! 2. `high/`: above.\n\
            mod high;\nmod low;\npub use high::z;\npub use low::{x, y};\npub use x::Thing;\n";
        fs::write(src.join("lib.rs"), root).unwrap();
        for (path, text) in files {
            let path = src.join(path);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        }
        violations(src).unwrap()
    }

    #[test]
    fn layers_in_order_pass() {
        let problems = layered(&[
            ("low/mod.rs", "pub mod x;\npub mod y;\n"),
            ("low/x.rs", "pub struct Thing;\n"),
            (
                "low/y.rs",
                "use crate::low::x::Thing;\nuse crate::Thing as T;\n",
            ),
            ("high/mod.rs", "pub mod z;\n"),
            (
                "high/z.rs",
                "use crate::{low::{x, y::f}, Thing};\nfn g() { crate::y::f() }\n\
                 #[cfg(test)]\nmod tests;\n",
            ),
            ("high/z/tests.rs", "use crate::high::z;\n"),
        ]);
        assert_eq!(problems, Vec::<String>::new());
    }

    #[test]
    fn a_reference_up_a_layer_a_knot_inside_one_and_a_stray_module_are_found() {
        let problems = layered(&[
            ("low/mod.rs", "pub mod x;\npub mod y;\n"),
            // Up a layer, once through the new path and once through the old one.
            (
                "low/x.rs",
                "use crate::high::z::Z;\nfn f() { crate::z::g() }\n",
            ),
            // A knot inside `low`, one side through a nested group, one through a re-export.
            ("low/y.rs", "use crate::{low::{x::{self, Thing}}};\n"),
            ("low/x/inner.rs", "fn h() { crate::y::f() }\n"),
            ("high/mod.rs", "pub mod z;\n"),
            ("high/z.rs", "pub struct Z;\n"),
            ("stray.rs", "use crate::low::x;\n"),
        ]);
        assert_eq!(
            problems,
            [
                "low::x <-> low::y",
                "low::x uses high::z, of the layer above (high over low)",
                "stray.rs sits outside the layers",
            ]
        );
    }

    #[test]
    fn a_listed_layer_without_a_folder_is_found() {
        let problems = layered(&[("low/mod.rs", "")]);
        assert_eq!(problems, ["layer high/ is listed but has no folder"]);
    }

    #[test]
    fn use_trees_expand_into_paths() {
        let paths = |text: &str| use_tree(text.as_bytes(), &mut 0);
        assert_eq!(paths("a::b::C;"), [["a", "b", "C"]]);
        assert_eq!(
            paths("{a::{b, c::D as E}, f} rest"),
            [vec!["a", "b"], vec!["a", "c", "D"], vec!["f"]]
        );
        assert_eq!(paths("x::y::<T>::new()"), [["x", "y"]]);
    }
}
