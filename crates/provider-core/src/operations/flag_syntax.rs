//! Go `flag` package syntax for boolean values, which the reference's flags and environment
//! variables accept and operators' existing manifests use.

/// Parses a Go-style boolean value (`true`, `false`, `1`, `0`, `t`, `f`, any case).
pub fn go_bool(text: &str) -> Result<bool, String> {
    match text.to_ascii_lowercase().as_str() {
        "1" | "t" | "true" => Ok(true),
        "0" | "f" | "false" => Ok(false),
        _ => Err(format!("invalid boolean value {text:?}")),
    }
}
