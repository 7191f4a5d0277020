//! Building blocks for structured inputs: strings drawn from a decoder's own vocabulary, JSON
//! documents shaped like the ones a decoder expects, and byte-level mutations of valid
//! encodings.

use arbitrary::{Result, Unstructured};
use serde_json::{Map, Number, Value};

/// A string: usually one of `vocab` (in a random letter case when `vary_case`), otherwise
/// arbitrary text.
pub(crate) fn word(u: &mut Unstructured<'_>, vocab: &[&str], vary_case: bool) -> Result<String> {
    if !vocab.is_empty() && u.ratio(3, 4)? {
        let w = *u.choose(vocab)?;
        if vary_case && u.ratio(1, 4)? {
            let mut out = String::with_capacity(w.len());
            for c in w.chars() {
                out.push(if u.arbitrary()? {
                    c.to_ascii_uppercase()
                } else {
                    c
                });
            }
            return Ok(out);
        }
        return Ok(w.to_owned());
    }
    short_string(u)
}

/// Arbitrary text of at most 40 characters.
pub(crate) fn short_string(u: &mut Unstructured<'_>) -> Result<String> {
    let s: String = u.arbitrary()?;
    Ok(s.chars().take(40).collect())
}

/// A JSON value whose object keys come from `keys` (any case) and whose strings come from
/// `strings`, nested at most `depth` deep.
pub(crate) fn json(
    u: &mut Unstructured<'_>,
    keys: &[&str],
    strings: &[&str],
    depth: u32,
) -> Result<Value> {
    let choice = if depth == 0 {
        u.int_in_range(0..=4)?
    } else {
        u.int_in_range(0..=6)?
    };
    Ok(match choice {
        0 => Value::Null,
        1 => Value::Bool(u.arbitrary()?),
        2 => Value::Number(number(u)?),
        3 | 4 => Value::String(word(u, strings, false)?),
        5 => {
            let n = u.int_in_range(0..=4)?;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                items.push(json(u, keys, strings, depth - 1)?);
            }
            Value::Array(items)
        }
        _ => Value::Object(object(u, keys, strings, depth - 1)?),
    })
}

/// A JSON object with up to eight keys drawn from `keys`.
pub(crate) fn object(
    u: &mut Unstructured<'_>,
    keys: &[&str],
    strings: &[&str],
    depth: u32,
) -> Result<Map<String, Value>> {
    let n = u.int_in_range(0..=8)?;
    let mut map = Map::new();
    for _ in 0..n {
        let key = word(u, keys, true)?;
        map.insert(key, json(u, keys, strings, depth)?);
    }
    Ok(map)
}

/// A JSON number: small and large integers, fractions, and the edges of i64/u64.
pub(crate) fn number(u: &mut Unstructured<'_>) -> Result<Number> {
    Ok(match u.int_in_range(0..=5)? {
        0 => Number::from(u.int_in_range(-3i64..=100)?),
        1 => Number::from(u.arbitrary::<i64>()?),
        2 => Number::from(u.arbitrary::<u64>()?),
        3 => Number::from(*u.choose(&[i64::MIN, i64::MAX, -1, 0])?),
        4 => Number::from(u64::MAX),
        _ => Number::from_f64(u.arbitrary::<f64>()?).unwrap_or_else(|| Number::from(0)),
    })
}

/// Serialises `value` and then, sometimes, damages the text.
pub(crate) fn json_bytes(u: &mut Unstructured<'_>, value: &Value) -> Result<Vec<u8>> {
    let text = serde_json::to_vec(value).unwrap_or_default();
    if u.ratio(1, 4)? {
        mutate(u, &text)
    } else {
        Ok(text)
    }
}

/// Applies one to four random edits to `bytes`: flip or set a byte, truncate, delete or
/// duplicate a range, insert arbitrary bytes.
pub(crate) fn mutate(u: &mut Unstructured<'_>, bytes: &[u8]) -> Result<Vec<u8>> {
    let mut out = bytes.to_vec();
    for _ in 0..u.int_in_range(1..=4)? {
        let len = out.len();
        match u.int_in_range(0..=5)? {
            0 if len > 0 => {
                let i = u.choose_index(len)?;
                out[i] ^= 1 << u.int_in_range(0..=7)?;
            }
            1 if len > 0 => {
                let i = u.choose_index(len)?;
                out[i] = *u.choose(&[0, 1, 0x7f, 0x80, 0xff, b'"', b'{', b'['])?;
            }
            2 => out.truncate(u.int_in_range(0..=len)?),
            3 if len > 0 => {
                let a = u.choose_index(len)?;
                let b = u.int_in_range(a..=len)?;
                out.drain(a..b);
            }
            4 if len > 0 => {
                let a = u.choose_index(len)?;
                let b = u.int_in_range(a..=len.min(a + 64))?;
                let copy = out[a..b].to_vec();
                let at = u.int_in_range(0..=len)?;
                out.splice(at..at, copy);
            }
            _ => {
                let n = u.int_in_range(0..=16)?;
                let insert = u.bytes(n)?.to_vec();
                let at = u.int_in_range(0..=len)?;
                out.splice(at..at, insert);
            }
        }
    }
    Ok(out)
}
