//! The key layout under the prefix and the encoding of each value.
//!
//! - `PREFIX/owner`: the claim of the provider writing the prefix (attached to its lease);
//! - `PREFIX/meta`: format version, revision head and next operation number;
//! - `PREFIX/m/<machine id>`: one machine slot (the local log's slot encoding);
//! - `PREFIX/f/<shard id>/<machine id>`: one fence high-water mark (ids escaped so `/` in an
//!   id cannot make two pairs share a key; the value carries both ids).
//!
//! Every value starts with a format version byte, so a newer layout is refused, not misread.

use crate::rules::fence::HighWaterMark;
use crate::rules::records::{FenceRecord, Slot};

/// The format of every value written here.
const VALUE_VERSION: u8 = 1;
/// The magic at the start of the meta value.
const META_MAGIC: &[u8; 4] = b"BFE1";

/// The keys of one prefix.
#[derive(Clone, Debug)]
pub(crate) struct Keys {
    /// `PREFIX/`.
    root: String,
}

/// What a key under the prefix is.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum KeyKind {
    Owner,
    Meta,
    Slot,
    Fence,
    Unknown,
}

impl Keys {
    pub fn new(prefix: &str) -> Keys {
        Keys {
            root: format!("{prefix}/"),
        }
    }

    pub fn owner(&self) -> Vec<u8> {
        format!("{}owner", self.root).into_bytes()
    }

    pub fn meta(&self) -> Vec<u8> {
        format!("{}meta", self.root).into_bytes()
    }

    pub fn slot(&self, machine_id: &str) -> Vec<u8> {
        format!("{}m/{machine_id}", self.root).into_bytes()
    }

    pub fn fence(&self, shard_id: &str, machine_id: &str) -> Vec<u8> {
        format!("{}f/{}/{}", self.root, escape(shard_id), escape(machine_id)).into_bytes()
    }

    /// The range `[start, end)` holding every key of the prefix.
    pub fn range(&self) -> (Vec<u8>, Vec<u8>) {
        let start = self.root.clone().into_bytes();
        let mut end = start.clone();
        // The root ends in '/', so incrementing the last byte cannot overflow.
        if let Some(last) = end.last_mut() {
            *last += 1;
        }
        (start, end)
    }

    pub fn kind(&self, key: &[u8]) -> KeyKind {
        let Some(rest) = key.strip_prefix(self.root.as_bytes()) else {
            return KeyKind::Unknown;
        };
        match rest {
            b"owner" => KeyKind::Owner,
            b"meta" => KeyKind::Meta,
            _ if rest.starts_with(b"m/") => KeyKind::Slot,
            _ if rest.starts_with(b"f/") => KeyKind::Fence,
            _ => KeyKind::Unknown,
        }
    }
}

/// `%` and `/` percent-escaped: an injective map that keeps the key readable.
fn escape(id: &str) -> String {
    let mut out = String::with_capacity(id.len());
    for c in id.chars() {
        match c {
            '%' => out.push_str("%25"),
            '/' => out.push_str("%2F"),
            c => out.push(c),
        }
    }
    out
}

/// The revision head and the next operation number.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Meta {
    pub revision: i64,
    pub next_op: u64,
}

pub fn encode_meta(meta: Meta) -> Vec<u8> {
    let mut out = Vec::with_capacity(21);
    out.extend_from_slice(META_MAGIC);
    out.push(VALUE_VERSION);
    out.extend_from_slice(&meta.revision.to_le_bytes());
    out.extend_from_slice(&meta.next_op.to_le_bytes());
    out
}

pub fn decode_meta(value: &[u8]) -> Result<Meta, String> {
    if value.len() < 5 || &value[..4] != META_MAGIC {
        return Err("not a state meta record".into());
    }
    check_version(value[4])?;
    let body = &value[5..];
    if body.len() != 16 {
        return Err(format!("meta record has {} bytes, expected 16", body.len()));
    }
    Ok(Meta {
        revision: i64::from_le_bytes(body[..8].try_into().unwrap_or_default()),
        next_op: u64::from_le_bytes(body[8..].try_into().unwrap_or_default()),
    })
}

pub fn encode_slot(slot: &Slot) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    out.push(VALUE_VERSION);
    crate::persistence::durable::encode_slot(slot, &mut out);
    out
}

pub fn decode_slot(value: &[u8]) -> Result<Slot, String> {
    let (&version, body) = value.split_first().ok_or("empty machine record")?;
    check_version(version)?;
    crate::persistence::durable::decode_slot(body)
}

pub fn encode_fence(shard_id: &str, machine_id: &str, mark: HighWaterMark) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + shard_id.len() + machine_id.len());
    out.push(VALUE_VERSION);
    for s in [shard_id, machine_id] {
        out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }
    out.extend_from_slice(&mark.epoch.to_le_bytes());
    out.extend_from_slice(&mark.sequence.to_le_bytes());
    out
}

pub fn decode_fence(value: &[u8]) -> Result<FenceRecord, String> {
    let (&version, mut body) = value.split_first().ok_or("empty fence record")?;
    check_version(version)?;
    let mut take = |n: usize| -> Result<&[u8], String> {
        if body.len() < n {
            return Err("fence record is truncated".into());
        }
        let (head, tail) = body.split_at(n);
        body = tail;
        Ok(head)
    };
    let mut ids = Vec::with_capacity(2);
    for _ in 0..2 {
        let len = u32::from_le_bytes(take(4)?.try_into().unwrap_or_default()) as usize;
        let id = std::str::from_utf8(take(len)?)
            .map_err(|_| "fence record holds an id that is not UTF-8")?
            .to_owned();
        ids.push(id);
    }
    let epoch = i64::from_le_bytes(take(8)?.try_into().unwrap_or_default());
    let sequence = i64::from_le_bytes(take(8)?.try_into().unwrap_or_default());
    if !body.is_empty() {
        return Err("fence record has trailing bytes".into());
    }
    let machine_id = ids.pop().unwrap_or_default();
    let shard_id = ids.pop().unwrap_or_default();
    Ok(FenceRecord {
        shard_id,
        machine_id,
        mark: HighWaterMark { epoch, sequence },
    })
}

fn check_version(version: u8) -> Result<(), String> {
    if version == VALUE_VERSION {
        Ok(())
    } else {
        Err(format!(
            "record format {version} is not {VALUE_VERSION} (written by a newer provider?)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaped_fence_keys_never_collide() {
        let keys = Keys::new("/p");
        assert_ne!(keys.fence("a/b", "c"), keys.fence("a", "b/c"));
        assert_ne!(keys.fence("a%2Fb", "c"), keys.fence("a/b", "c"));
        assert_eq!(keys.kind(&keys.fence("a/b", "c")), KeyKind::Fence);
        assert_eq!(keys.kind(&keys.slot("m/1")), KeyKind::Slot);
        assert_eq!(keys.kind(&keys.owner()), KeyKind::Owner);
        assert_eq!(keys.kind(&keys.meta()), KeyKind::Meta);
        assert_eq!(keys.kind(b"/p/x"), KeyKind::Unknown);
        assert_eq!(keys.kind(b"/q/meta"), KeyKind::Unknown);
        let (start, end) = keys.range();
        assert_eq!(start, b"/p/");
        assert_eq!(end, b"/p0");
    }

    #[test]
    fn values_round_trip_and_a_newer_format_is_refused() {
        let meta = Meta {
            revision: -3,
            next_op: u64::MAX,
        };
        assert_eq!(decode_meta(&encode_meta(meta)), Ok(meta));
        let mark = HighWaterMark {
            epoch: 7,
            sequence: -1,
        };
        let fence = decode_fence(&encode_fence("s/1", "m", mark)).expect("fence");
        assert_eq!(
            (
                fence.shard_id.as_str(),
                fence.machine_id.as_str(),
                fence.mark
            ),
            ("s/1", "m", mark)
        );
        let mut newer = encode_fence("s", "m", mark);
        newer[0] = 2;
        assert!(decode_fence(&newer).unwrap_err().contains("newer"));
        assert!(decode_fence(&encode_fence("s", "m", mark)[..10]).is_err());
        let mut meta_newer = encode_meta(meta);
        meta_newer[4] = 9;
        assert!(decode_meta(&meta_newer).is_err());
    }
}
