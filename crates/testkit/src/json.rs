//! Entries of the JSON documents a test reads back (state exports, check reports).

use serde_json::Value;

/// The entry of the array `doc[list]` whose `key` is `value`; panics, naming them, if none is.
pub fn entry<'a>(doc: &'a Value, list: &str, key: &str, value: &str) -> &'a Value {
    doc[list]
        .as_array()
        .unwrap_or_else(|| panic!("no array {list:?} in {doc}"))
        .iter()
        .find(|e| e[key] == value)
        .unwrap_or_else(|| panic!("no {key} {value:?} in {list:?} of {doc}"))
}
