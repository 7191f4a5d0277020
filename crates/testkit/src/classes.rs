//! The emulators' request counts by class (`requests_by_class`: listing, create, poll, …,
//! each with how many were sent and how many of them were refused).

use std::borrow::Borrow;
use std::collections::BTreeMap;

/// Requests of `class` sent.
pub fn count<K: Ord + Borrow<str>>(classes: &BTreeMap<K, (usize, usize)>, class: &str) -> usize {
    classes.get(class).map_or(0, |(n, _)| *n)
}

/// How many requests of `class` were sent between the reads `before` and `after`.
pub fn grown<K: Ord + Borrow<str>>(
    before: &BTreeMap<K, (usize, usize)>,
    after: &BTreeMap<K, (usize, usize)>,
    class: &str,
) -> usize {
    count(after, class) - count(before, class)
}
