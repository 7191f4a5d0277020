//! Checks a JSON answer against the shape an API's official document gives an object: every
//! key the document requires is present, each value has the document's type (`null` only where
//! the document allows it), enum values are among the document's, timestamps are RFC 3339, and
//! keys the document no longer has are absent. Dev-only: the emulators' tests hold their answers
//! to Hetzner's `cloud.spec.json` and DigitalOcean's `digitalocean/openapi` documents with it;
//! each shape is written down beside its test with the schema it comes from.

use serde_json::Value;

/// The type of a value, as the document states it.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    /// `type: integer`.
    Int,
    /// `type: number`.
    Num,
    /// `type: string`.
    Str,
    /// `type: boolean`.
    Bool,
    /// `type: object`.
    Obj,
    /// `type: array`.
    Arr,
    /// `type: string, format: date-time` (RFC 3339).
    Time,
    /// `type: string` with `enum`.
    OneOf(&'static [&'static str]),
}

/// One key of an object's shape.
#[derive(Clone, Copy, Debug)]
pub struct Field {
    pub name: &'static str,
    pub kind: Kind,
    /// Whether the document allows `null` (`type: [T, "null"]` or `nullable: true`).
    pub nullable: bool,
    /// Whether the document lists it under `required`.
    pub required: bool,
}

/// A required key that is never `null`.
pub const fn req(name: &'static str, kind: Kind) -> Field {
    Field {
        name,
        kind,
        nullable: false,
        required: true,
    }
}

/// A required key that may be `null`.
pub const fn req_null(name: &'static str, kind: Kind) -> Field {
    Field {
        name,
        kind,
        nullable: true,
        required: true,
    }
}

/// An optional key (checked only when present).
pub const fn opt(name: &'static str, kind: Kind) -> Field {
    Field {
        name,
        kind,
        nullable: false,
        required: false,
    }
}

/// Whether `text` is an RFC 3339 date-time: `YYYY-MM-DDTHH:MM:SS`, an optional fraction, then
/// `Z` or `±HH:MM`.
pub fn is_rfc3339(text: &str) -> bool {
    let b = text.as_bytes();
    let digits = |range: std::ops::Range<usize>| {
        b.get(range.clone())
            .is_some_and(|s| s.len() == range.len() && s.iter().all(u8::is_ascii_digit))
    };
    let base = digits(0..4)
        && b.get(4) == Some(&b'-')
        && digits(5..7)
        && b.get(7) == Some(&b'-')
        && digits(8..10)
        && matches!(b.get(10), Some(b'T' | b't'))
        && digits(11..13)
        && b.get(13) == Some(&b':')
        && digits(14..16)
        && b.get(16) == Some(&b':')
        && digits(17..19);
    if !base {
        return false;
    }
    let mut rest = &text[19..];
    if let Some(fraction) = rest.strip_prefix('.') {
        let end = fraction
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(fraction.len());
        if end == 0 {
            return false;
        }
        rest = &fraction[end..];
    }
    match rest.as_bytes() {
        [b'Z' | b'z'] => true,
        [b'+' | b'-', h1, h2, b':', m1, m2] => [h1, h2, m1, m2].iter().all(|c| c.is_ascii_digit()),
        _ => false,
    }
}

fn kind_ok(value: &Value, kind: Kind) -> bool {
    match kind {
        Kind::Int => value.is_i64() || value.is_u64(),
        Kind::Num => value.is_number(),
        Kind::Str => value.is_string(),
        Kind::Bool => value.is_boolean(),
        Kind::Obj => value.is_object(),
        Kind::Arr => value.is_array(),
        Kind::Time => value.as_str().is_some_and(is_rfc3339),
        Kind::OneOf(values) => value.as_str().is_some_and(|v| values.contains(&v)),
    }
}

/// Every way `value` (found at `at`, e.g. `GET /servers servers[0]`) breaks `shape`.
pub fn check(value: &Value, shape: &[Field], at: &str) -> Vec<String> {
    let Some(object) = value.as_object() else {
        return vec![format!("{at}: not an object: {value}")];
    };
    let mut problems = Vec::new();
    for field in shape {
        match object.get(field.name) {
            None if field.required => {
                problems.push(format!("{at}.{}: required, missing", field.name))
            }
            None => {}
            Some(Value::Null) if field.nullable => {}
            Some(Value::Null) => problems.push(format!("{at}.{}: null, not allowed", field.name)),
            Some(v) if !kind_ok(v, field.kind) => {
                problems.push(format!("{at}.{}: {v} is not {:?}", field.name, field.kind))
            }
            Some(_) => {}
        }
    }
    problems
}

/// A problem when `value` carries `key`, which the document no longer has.
pub fn absent(value: &Value, key: &str, at: &str) -> Vec<String> {
    value
        .get(key)
        .map(|_| vec![format!("{at}.{key}: the document has no such key")])
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn timestamps() {
        assert!(is_rfc3339("2026-07-01T12:00:00Z"));
        assert!(is_rfc3339("2024-04-25T00:00:00+00:00"));
        assert!(is_rfc3339("2024-04-25T00:00:00.123456-02:30"));
        assert!(!is_rfc3339("@1700000000"));
        assert!(!is_rfc3339("2024-04-25 00:00:00"));
        assert!(!is_rfc3339("2024-04-25T00:00:00"));
        assert!(!is_rfc3339("2024-04-25T00:00:00."));
    }

    #[test]
    fn shapes() {
        const SHAPE: &[Field] = &[
            req("id", Kind::Int),
            req("deprecated", Kind::Bool),
            req_null("deprecation", Kind::Obj),
            req("status", Kind::OneOf(&["running", "off"])),
            opt("category", Kind::Str),
        ];
        let good = json!({"id": 1, "deprecated": false, "deprecation": null, "status": "off"});
        assert!(check(&good, SHAPE, "x").is_empty());
        let bad = json!({"id": "1", "deprecated": null, "status": "paused", "category": 3});
        assert_eq!(
            check(&bad, SHAPE, "x"),
            vec![
                "x.id: \"1\" is not Int",
                "x.deprecated: null, not allowed",
                "x.deprecation: required, missing",
                "x.status: \"paused\" is not OneOf([\"running\", \"off\"])",
                "x.category: 3 is not Str",
            ]
        );
        assert_eq!(
            absent(&json!({"datacenter": {}}), "datacenter", "s").len(),
            1
        );
    }
}
