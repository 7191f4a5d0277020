//! Fencing (contract.md §4): a high-water mark per (shard_id, machine_id), compared
//! lexicographically on (epoch, sequence). Pure functions, no I/O.

use std::fmt;

pub mod unknown_ids;

/// The token a shard stamps on every mutating request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FenceToken {
    pub shard_id: String,
    pub epoch: i64,
    pub sequence: i64,
}

impl FenceToken {
    /// The all-zero token (empty shard id, epoch 0, sequence 0) bypasses fencing entirely.
    pub fn is_bypass(&self) -> bool {
        self.shard_id.is_empty() && self.epoch == 0 && self.sequence == 0
    }

    pub fn mark(&self) -> HighWaterMark {
        HighWaterMark {
            epoch: self.epoch,
            sequence: self.sequence,
        }
    }
}

/// The highest (epoch, sequence) accepted so far for one (shard, machine) pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HighWaterMark {
    pub epoch: i64,
    pub sequence: i64,
}

impl fmt::Display for HighWaterMark {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "(epoch={} seq={})", self.epoch, self.sequence)
    }
}

/// The outcome of checking a token against the current mark.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FenceDecision {
    /// The all-zero token: nothing checked, nothing recorded.
    Bypass,
    /// The token is strictly newer (or the first one seen); the mark must advance to it.
    Advance(HighWaterMark),
    /// The token is not strictly newer than the mark; the request must not be applied.
    Reject { mark: HighWaterMark },
}

/// Decides whether `token` passes the mark recorded for its (shard, machine) pair.
pub fn check(current: Option<HighWaterMark>, token: &FenceToken) -> FenceDecision {
    if token.is_bypass() {
        return FenceDecision::Bypass;
    }
    let offered = token.mark();
    match current {
        Some(mark) if offered <= mark => FenceDecision::Reject { mark },
        _ => FenceDecision::Advance(offered),
    }
}

/// Quotes a string the way Go's `%q` does for printable text, so reject messages match the
/// reference byte for byte on ordinary ids.
pub fn go_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{7}' => out.push_str("\\a"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\u{b}' => out.push_str("\\v"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn token(shard: &str, epoch: i64, sequence: i64) -> FenceToken {
        FenceToken {
            shard_id: shard.into(),
            epoch,
            sequence,
        }
    }

    #[test]
    fn zero_token_bypasses_but_a_partial_zero_does_not() {
        assert_eq!(check(None, &token("", 0, 0)), FenceDecision::Bypass);
        assert_eq!(
            check(None, &token("", 1, 0)),
            FenceDecision::Advance(HighWaterMark {
                epoch: 1,
                sequence: 0
            })
        );
        assert!(matches!(
            check(None, &token("s", 0, 0)),
            FenceDecision::Advance(_)
        ));
    }

    #[test]
    fn equal_token_is_a_rejected_replay() {
        let mark = HighWaterMark {
            epoch: 3,
            sequence: 7,
        };
        assert_eq!(
            check(Some(mark), &token("s", 3, 7)),
            FenceDecision::Reject { mark }
        );
        assert_eq!(
            check(Some(mark), &token("s", 3, 6)),
            FenceDecision::Reject { mark }
        );
        assert_eq!(
            check(Some(mark), &token("s", 2, 100)),
            FenceDecision::Reject { mark }
        );
        assert!(matches!(
            check(Some(mark), &token("s", 4, i64::MIN)),
            FenceDecision::Advance(_)
        ));
        assert!(matches!(
            check(Some(mark), &token("s", 3, 8)),
            FenceDecision::Advance(_)
        ));
    }

    #[test]
    fn go_quote_matches_go() {
        assert_eq!(go_quote("shard-a"), "\"shard-a\"");
        assert_eq!(go_quote("a\"b\\c\n"), "\"a\\\"b\\\\c\\n\"");
        assert_eq!(go_quote("\u{1}"), "\"\\x01\"");
    }

    proptest! {
        /// The fence never accepts a token that is not strictly newer than the mark, and
        /// always accepts one that is.
        #[test]
        fn accepts_exactly_the_strictly_newer(
            me in any::<i64>(), ms in any::<i64>(), te in any::<i64>(), ts in any::<i64>(),
        ) {
            let mark = HighWaterMark { epoch: me, sequence: ms };
            let t = token("shard", te, ts);
            let newer = (te, ts) > (me, ms);
            match check(Some(mark), &t) {
                FenceDecision::Advance(m) => { prop_assert!(newer); prop_assert_eq!(m, t.mark()); }
                FenceDecision::Reject { mark: m } => { prop_assert!(!newer); prop_assert_eq!(m, mark); }
                FenceDecision::Bypass => prop_assert!(false, "non-zero token bypassed"),
            }
        }

        /// Replaying any sequence of tokens: the mark is always the maximum accepted so far,
        /// and every accepted token was strictly greater than everything before it.
        #[test]
        fn mark_is_monotonic(tokens in proptest::collection::vec((-3i64..3, -3i64..3), 1..40)) {
            let mut mark: Option<HighWaterMark> = None;
            for (e, s) in tokens {
                if e == 0 && s == 0 { continue; }
                let t = token("x", e, s);
                match check(mark, &t) {
                    FenceDecision::Advance(m) => {
                        if let Some(old) = mark { prop_assert!(m > old); }
                        mark = Some(m);
                    }
                    FenceDecision::Reject { mark: m } => prop_assert!(t.mark() <= m),
                    FenceDecision::Bypass => unreachable!(),
                }
            }
        }
    }
}
