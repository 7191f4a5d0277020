//! Size limits on request fields (docs/limits.md). Everything a client sends that the provider
//! keeps in memory or on disk has a bound, answered with INVALID_ARGUMENT naming the field.
//! The bounds sit far above anything a shard sends (the reference echoes a 10,000-entry
//! `shard_metadata`; the conformance program sends 512 entries of 1 KiB and 256 of 8 KiB), and
//! a request as a whole is bounded by the gRPC message limit (4 MiB).

use crate::rules::error::CoreError;
use crate::rules::machine::StringMap;

/// `machine_id`, Get's `id`, `shard_id` and `cluster_id`, in bytes.
pub const MAX_ID_BYTES: usize = 256;
/// Entries of `shard_metadata`.
pub const MAX_METADATA_ENTRIES: usize = 16_384;

/// Checks an id-like field against [`MAX_ID_BYTES`].
pub fn check_id(field: &'static str, value: &str) -> Result<(), CoreError> {
    if value.len() > MAX_ID_BYTES {
        return Err(CoreError::FieldTooLarge {
            field,
            detail: format!("{} bytes, the limit is {MAX_ID_BYTES}", value.len()),
        });
    }
    Ok(())
}

/// Checks `shard_metadata` against [`MAX_METADATA_ENTRIES`].
pub fn check_metadata(metadata: &StringMap) -> Result<(), CoreError> {
    if metadata.len() > MAX_METADATA_ENTRIES {
        return Err(CoreError::FieldTooLarge {
            field: "shard_metadata",
            detail: format!(
                "{} entries, the limit is {MAX_METADATA_ENTRIES}",
                metadata.len()
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use tonic::Code;

    use super::*;

    #[test]
    fn ids_up_to_the_limit_pass_and_longer_ones_name_the_field() {
        assert!(check_id("machine_id", &"m".repeat(MAX_ID_BYTES)).is_ok());
        let err = check_id("shard_id", &"é".repeat(MAX_ID_BYTES / 2 + 1)).unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert_eq!(
            err.to_string(),
            "shard_id too large: 258 bytes, the limit is 256"
        );
    }

    #[test]
    fn metadata_up_to_the_limit_passes() {
        let mut md: StringMap = (0..MAX_METADATA_ENTRIES)
            .map(|i| (format!("k{i}"), format!("v{i}")))
            .collect();
        assert!(check_metadata(&md).is_ok());
        md.insert("one-more".into(), String::new());
        let err = check_metadata(&md).unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert_eq!(
            err.to_string(),
            "shard_metadata too large: 16385 entries, the limit is 16384"
        );
    }
}
