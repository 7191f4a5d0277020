//! The module graph of each workspace crate: no two top-level modules of a crate may refer to
//! each other (`crate::a::…` in `a` and `crate::b::…` in `a`'s counterpart). A pair that does is
//! one idea split in two files, or two ideas knotted together; either way a reader cannot
//! understand one without the other. Only code that ships counts: comments, `#[cfg(test)]`
//! items and the test modules they declare are left out, since tests may reach across.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// The pairs of top-level modules of `src` that refer to each other, `a < b`.
fn mutual_references(src: &Path) -> Result<Vec<(String, String)>> {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut test_files = BTreeSet::new();
    let mut files = Vec::new();
    collect(src, &mut files)?;
    // First the files only tests compile: `#[cfg(test)] mod name;` beside them.
    for file in &files {
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
    for file in &files {
        if test_files
            .iter()
            .any(|t| file.starts_with(t.with_extension("")))
            || test_files.contains(file)
        {
            continue;
        }
        let Some(top) = top_module(src, file) else {
            continue;
        };
        let text = fs::read_to_string(file)?;
        for referenced in references(&shipping_code(&text)) {
            if referenced != top {
                edges.entry(top.clone()).or_default().insert(referenced);
            }
        }
    }
    let mut pairs = Vec::new();
    for (a, targets) in &edges {
        for b in targets {
            if a < b && edges.get(b).is_some_and(|back| back.contains(a)) {
                pairs.push((a.clone(), b.clone()));
            }
        }
    }
    Ok(pairs)
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

/// The top-level module a file belongs to; `None` for the crate root and for `src/bin/`.
fn top_module(src: &Path, file: &Path) -> Option<String> {
    let relative = file.strip_prefix(src).ok()?;
    let first = relative.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (!matches!(name, "lib" | "main" | "bin")).then(|| name.to_owned())
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

/// Every `x` of `crate::x` in `code`, grouped imports (`use crate::{a, b::c}`) included.
fn references(code: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    for (at, _) in code.match_indices("crate::") {
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            for item in group.split(',') {
                let name = ident(item.trim());
                if !name.is_empty() && name != "self" {
                    names.insert(name);
                }
            }
        } else {
            let name = ident(rest);
            if !name.is_empty() {
                names.insert(name);
            }
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_two_modules_of_a_workspace_crate_refer_to_each_other() {
        let crates = crate::repo::root().join("crates");
        let mut knots = Vec::new();
        for entry in fs::read_dir(&crates).expect("crates/") {
            let src = entry.expect("entry").path().join("src");
            if src.is_dir() {
                for (a, b) in mutual_references(&src).expect("scan") {
                    knots.push(format!("{}: {a} <-> {b}", src.display()));
                }
            }
        }
        knots.sort();
        assert!(
            knots.is_empty(),
            "modules that refer to each other:\n{}",
            knots.join("\n")
        );
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
        assert_eq!(
            mutual_references(src).unwrap(),
            vec![("a".to_owned(), "b".to_owned())]
        );
    }
}
