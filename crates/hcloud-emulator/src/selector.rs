//! Hetzner label selectors: comma-separated (AND) expressions `k=v`, `k==v`, `k!=v`, `k`,
//! `!k`, `k in (v1,v2)` and `k notin (v1,v2)`.

use std::collections::HashMap;

/// A malformed selector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SelectorError(pub String);

impl std::fmt::Display for SelectorError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SelectorError {}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    Absent(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A parsed label selector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LabelSelector(Vec<Requirement>);

/// Splits on commas that are not inside parentheses.
fn split_top_level(text: &str) -> Result<Vec<&str>, SelectorError> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if depth < 0 {
            return Err(SelectorError(format!("unbalanced parentheses in {text:?}")));
        }
    }
    if depth != 0 {
        return Err(SelectorError(format!("unbalanced parentheses in {text:?}")));
    }
    parts.push(&text[start..]);
    Ok(parts)
}

fn set(text: &str) -> Result<Vec<String>, SelectorError> {
    let inner = text
        .trim()
        .strip_prefix('(')
        .and_then(|t| t.strip_suffix(')'))
        .ok_or_else(|| SelectorError(format!("expected a (value, ...) set, got {text:?}")))?;
    Ok(inner.split(',').map(|v| v.trim().to_owned()).collect())
}

fn key(text: &str) -> Result<String, SelectorError> {
    let k = text.trim();
    if k.is_empty() || k.contains(char::is_whitespace) {
        return Err(SelectorError(format!("invalid key {text:?}")));
    }
    Ok(k.to_owned())
}

impl LabelSelector {
    pub fn parse(text: &str) -> Result<LabelSelector, SelectorError> {
        let mut requirements = Vec::new();
        if text.trim().is_empty() {
            return Ok(LabelSelector(requirements));
        }
        for part in split_top_level(text)? {
            let part = part.trim();
            let requirement = if let Some((k, v)) = part.split_once("!=") {
                Requirement::NotEquals(key(k)?, v.trim().to_owned())
            } else if let Some((k, v)) = part.split_once("==") {
                Requirement::Equals(key(k)?, v.trim().to_owned())
            } else if let Some((k, v)) = part.split_once('=') {
                Requirement::Equals(key(k)?, v.trim().to_owned())
            } else if let Some((k, v)) = part.split_once(" notin ") {
                Requirement::NotIn(key(k)?, set(v)?)
            } else if let Some((k, v)) = part.split_once(" in ") {
                Requirement::In(key(k)?, set(v)?)
            } else if let Some(k) = part.strip_prefix('!') {
                Requirement::Absent(key(k)?)
            } else {
                Requirement::Exists(key(part)?)
            };
            requirements.push(requirement);
        }
        Ok(LabelSelector(requirements))
    }

    pub fn matches(&self, labels: &HashMap<String, String>) -> bool {
        self.0.iter().all(|r| match r {
            Requirement::Equals(k, v) => labels.get(k) == Some(v),
            Requirement::NotEquals(k, v) => labels.get(k) != Some(v),
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::Absent(k) => !labels.contains_key(k),
            Requirement::In(k, vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
            Requirement::NotIn(k, vs) => labels.get(k).is_none_or(|v| !vs.contains(v)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn every_operator() {
        let l = labels(&[("env", "prod"), ("tier", "web"), ("managed", "true")]);
        let yes = [
            "env=prod",
            "env==prod",
            "env!=dev",
            "managed",
            "!missing",
            "tier in (web, db)",
            "tier notin (db)",
            "env=prod,managed=true",
            "",
        ];
        for s in yes {
            assert!(LabelSelector::parse(s).unwrap().matches(&l), "{s}");
        }
        let no = [
            "env=dev",
            "env!=prod",
            "missing",
            "!env",
            "tier in (db)",
            "tier notin (web,db)",
            "env=prod,managed=false",
        ];
        for s in no {
            assert!(!LabelSelector::parse(s).unwrap().matches(&l), "{s}");
        }
        assert!(
            LabelSelector::parse("missing notin (x)")
                .unwrap()
                .matches(&l)
        );
    }

    #[test]
    fn malformed() {
        assert!(LabelSelector::parse("tier in (web").is_err());
        assert!(LabelSelector::parse("tier in web").is_err());
        assert!(LabelSelector::parse("=x").is_err());
        assert!(LabelSelector::parse("a b").is_err());
    }
}
