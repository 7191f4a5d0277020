//! Encodings both clouds use for labels, tags and names: lower-case RFC 4648 base32 without
//! padding (label- and tag-safe, reversible), and the validation of a cloud API base URL.

use std::sync::LazyLock;

use data_encoding::{Encoding, Specification};
use reqwest::Url;

/// The lower-case, unpadded RFC 4648 base32 alphabet; decoding also accepts upper case and
/// refuses non-zero trailing bits, so only what an encoder could produce decodes.
static BASE32_LOWER: LazyLock<Encoding> = LazyLock::new(|| {
    let mut spec = Specification::new();
    spec.symbols.push_str("abcdefghijklmnopqrstuvwxyz234567");
    spec.translate.from.push_str("ABCDEFGHIJKLMNOPQRSTUVWXYZ");
    spec.translate.to.push_str("abcdefghijklmnopqrstuvwxyz");
    spec.check_trailing_bits = true;
    spec.encoding().expect("a valid base32 specification")
});

/// Lower-case RFC 4648 base32 without padding.
pub fn base32_lower(bytes: &[u8]) -> String {
    BASE32_LOWER.encode(bytes)
}

/// Decodes unpadded base32 in either case (trailing `=` tolerated); `None` for anything an
/// encoder could not have produced.
pub fn base32_decode(text: &str) -> Option<Vec<u8>> {
    BASE32_LOWER
        .decode(text.trim_end_matches('=').as_bytes())
        .ok()
}

/// Whether the URL's host is `localhost` or a loopback address.
pub fn is_loopback(url: &Url) -> bool {
    let host = url.host_str().unwrap_or("");
    host.eq_ignore_ascii_case("localhost")
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Validates a cloud API base URL given with `flag`: `https://` anywhere, plain `http://` only
/// for loopback hosts (tests, local mirrors). A trailing `/` is dropped.
pub fn parse_api_url(flag: &str, raw: &str) -> Result<Url, String> {
    let trimmed = raw.trim().trim_end_matches('/');
    let url = Url::parse(trimmed).map_err(|e| format!("{flag} {raw:?} is not a valid URL: {e}"))?;
    if url.host_str().is_none_or(str::is_empty) {
        return Err(format!("{flag} {raw:?}: no host"));
    }
    match url.scheme() {
        "https" => Ok(url),
        "http" if is_loopback(&url) => Ok(url),
        "http" => Err(format!(
            "{flag} {raw:?}: plain http is only allowed for loopback addresses; use https"
        )),
        _ => Err(format!("{flag} {raw:?} must be an https:// URL")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rfc4648_vectors() {
        for (plain, encoded) in [
            ("", ""),
            ("f", "my"),
            ("fo", "mzxq"),
            ("foo", "mzxw6"),
            ("foob", "mzxw6yq"),
            ("fooba", "mzxw6ytb"),
            ("foobar", "mzxw6ytboi"),
        ] {
            assert_eq!(base32_lower(plain.as_bytes()), encoded);
            assert_eq!(base32_decode(encoded).unwrap(), plain.as_bytes());
            assert_eq!(
                base32_decode(&encoded.to_uppercase()).unwrap(),
                plain.as_bytes()
            );
        }
        assert_eq!(base32_decode("m"), None, "a lone symbol is not a byte");
        assert_eq!(base32_decode("mz!"), None);
        assert_eq!(base32_decode("mz"), None, "non-zero padding bits");
        assert_eq!(base32_decode("m1"), None);
    }

    #[test]
    fn api_urls() {
        assert!(parse_api_url("--x", "https://api.example.com/v1/").is_ok());
        assert_eq!(
            parse_api_url("--x", "https://api.example.com/v1/")
                .unwrap()
                .path(),
            "/v1"
        );
        assert!(parse_api_url("--x", "http://127.0.0.1:8080").is_ok());
        assert!(parse_api_url("--x", "http://localhost:1").is_ok());
        assert!(parse_api_url("--x", "http://[::1]:9").is_ok());
        let err = parse_api_url("--x", "http://10.0.0.1:80").unwrap_err();
        assert!(
            err.starts_with("--x ") && err.contains("only allowed for loopback"),
            "{err}"
        );
        assert!(
            parse_api_url("--x", "ftp://127.0.0.1")
                .unwrap_err()
                .contains("https://")
        );
        assert!(parse_api_url("--x", "not a url").is_err());
    }

    proptest! {
        #[test]
        fn base32_round_trips(bytes in proptest::collection::vec(any::<u8>(), 0..100)) {
            prop_assert_eq!(base32_decode(&base32_lower(&bytes)), Some(bytes));
        }
    }
}
