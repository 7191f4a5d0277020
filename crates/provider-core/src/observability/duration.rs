//! Go duration syntax (`30m`, `2m0s`, `1h30m`, `250ms`), parsed for flags and printed for
//! messages exactly as Go's `time.Duration.String` does.

use std::time::Duration;

/// Parses a Go duration such as `5m`, `1h30m`, `2m0s`, `1.5s` or `0`. Negative durations are
/// accepted and returned as `None` inside `Ok` (the flag means "disabled").
pub fn parse(text: &str) -> Result<Option<Duration>, String> {
    let s = text.trim();
    let invalid = || {
        format!(
            "invalid duration {:?} (use Go syntax such as 30s, 5m or 1h30m)",
            text
        )
    };
    if s.is_empty() {
        return Err(invalid());
    }
    let (negative, mut rest) = match s.as_bytes()[0] {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s),
    };
    if rest == "0" {
        return Ok(Some(Duration::ZERO));
    }
    if rest.is_empty() {
        return Err(invalid());
    }
    let mut total: f64 = 0.0;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if number_len == 0 {
            return Err(invalid());
        }
        let value: f64 = rest[..number_len].parse().map_err(|_| invalid())?;
        rest = &rest[number_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let nanos_per_unit = match &rest[..unit_len] {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            _ => return Err(invalid()),
        };
        rest = &rest[unit_len..];
        total += value * nanos_per_unit;
    }
    if total > u64::MAX as f64 {
        return Err(invalid());
    }
    if negative && total > 0.0 {
        return Ok(None);
    }
    Ok(Some(Duration::from_nanos(total.round() as u64)))
}

/// Formats like Go: `5m0s`, `1h30m0s`, `2s`, `1.5s`, `250ms`, `0s`.
pub fn format(d: Duration) -> String {
    let nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".into();
    }
    if nanos < 1_000_000_000 {
        let (value, unit) = if nanos < 1_000 {
            return format!("{nanos}ns");
        } else if nanos < 1_000_000 {
            (nanos as f64 / 1e3, "µs")
        } else {
            (nanos as f64 / 1e6, "ms")
        };
        return format!("{}{unit}", trim_float(value));
    }
    let hours = nanos / 3_600_000_000_000;
    let minutes = (nanos / 60_000_000_000) % 60;
    let seconds = (nanos % 60_000_000_000) as f64 / 1e9;
    let mut out = String::new();
    if hours > 0 {
        out.push_str(&format!("{hours}h"));
    }
    if hours > 0 || minutes > 0 {
        out.push_str(&format!("{minutes}m"));
    }
    out.push_str(&format!("{}s", trim_float(seconds)));
    out
}

fn trim_float(v: f64) -> String {
    let s = format!("{v:.9}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_owned()
}

/// A clap value parser for Go durations; negative values mean "disabled" (zero).
pub fn flag(text: &str) -> Result<Duration, String> {
    parse(text).map(|d| d.unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_go_syntax() {
        let s = |secs| Some(Duration::from_secs(secs));
        assert_eq!(parse("30m"), Ok(s(1800)));
        assert_eq!(parse("2m0s"), Ok(s(120)));
        assert_eq!(parse("1h30m"), Ok(s(5400)));
        assert_eq!(parse("0"), Ok(s(0)));
        assert_eq!(parse("1.5s"), Ok(Some(Duration::from_millis(1500))));
        assert_eq!(parse("250ms"), Ok(Some(Duration::from_millis(250))));
        assert_eq!(parse("-1m"), Ok(None));
        assert!(parse("5").is_err());
        assert!(parse("5x").is_err());
        assert!(parse("").is_err());
        assert!(parse("m").is_err());
    }

    #[test]
    fn formats_like_go() {
        assert_eq!(format(Duration::from_secs(300)), "5m0s");
        assert_eq!(format(Duration::from_secs(480)), "8m0s");
        assert_eq!(format(Duration::from_secs(5400)), "1h30m0s");
        assert_eq!(format(Duration::from_secs(2)), "2s");
        assert_eq!(format(Duration::from_millis(1500)), "1.5s");
        assert_eq!(format(Duration::from_millis(250)), "250ms");
        assert_eq!(format(Duration::ZERO), "0s");
        assert_eq!(format(Duration::from_secs(3600)), "1h0m0s");
    }
}
