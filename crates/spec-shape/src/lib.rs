//! Checks JSON answers against an API's official OpenAPI document. Dev-only: the emulators'
//! tests hold every answer of every operation the providers' clients call to excerpts of
//! Hetzner's `cloud.spec.json` and DigitalOcean's `digitalocean/openapi` documents, vendored
//! under `official/` with their source (see `official/README.md`), by [`Document`]'s validator.

pub mod exercise;
pub mod openapi;

use serde_json::Value;

pub use exercise::{Exercise, get_without_deprecated};
pub use openapi::Document;

/// The excerpt of Hetzner's Cloud API document (`official/hetzner-cloud.excerpt.json`).
pub fn hetzner_cloud() -> Document {
    Document::from_json(include_str!("../official/hetzner-cloud.excerpt.json"))
        .expect("the vendored Hetzner excerpt is JSON")
}

/// The excerpt of DigitalOcean's API document (`official/digitalocean.excerpt.json`).
pub fn digitalocean() -> Document {
    Document::from_json(include_str!("../official/digitalocean.excerpt.json"))
        .expect("the vendored DigitalOcean excerpt is JSON")
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
    fn keys_the_document_dropped() {
        assert_eq!(
            absent(&json!({"datacenter": {}}), "datacenter", "s"),
            vec!["s.datacenter: the document has no such key"]
        );
        assert!(absent(&json!({}), "datacenter", "s").is_empty());
    }

    #[test]
    fn the_vendored_excerpts_catch_what_they_should() {
        let hetzner = hetzner_cloud();
        let problems = hetzner.check_answer(
            "GET",
            "/servers/{id}",
            200,
            &json!({"server": {"id": "42", "status": "paused"}}),
            "h",
        );
        for expected in [
            "h.server.name: required, missing",
            "h.server.id: \"42\" is not of type integer",
        ] {
            assert!(problems.iter().any(|p| p == expected), "{problems:#?}");
        }
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("h.server.status: \"paused\" is not one of"))
        );
        let error =
            json!({"error": {"code": "resource_unavailable", "message": "m", "details": null}});
        assert!(
            hetzner
                .check_answer("POST", "/servers", 412, &error, "h")
                .is_empty()
        );
        let problems = hetzner.check_answer("POST", "/servers", 412, &json!({"id": "x"}), "h");
        assert_eq!(problems, vec!["h.error: required, missing"]);

        let digitalocean = digitalocean();
        let error = json!({"id": "unprocessable_entity", "message": "m"});
        assert!(
            digitalocean
                .check_answer("POST", "/v2/droplets", 422, &error, "d")
                .is_empty()
        );
        let problems =
            digitalocean.check_answer("POST", "/v2/droplets", 422, &json!({"id": 1}), "d");
        assert_eq!(problems.len(), 2, "{problems:#?}");
        assert!(
            !digitalocean
                .check_answer("GET", "/v2/account", 200, &json!({"account": {}}), "d")
                .is_empty()
        );
    }

    #[test]
    fn the_vendored_excerpts_read() {
        for doc in [hetzner_cloud(), digitalocean()] {
            assert!(!doc.operations().is_empty());
            assert!(doc.root()["info"]["x-source"]["commit"].is_string());
        }
    }
}
