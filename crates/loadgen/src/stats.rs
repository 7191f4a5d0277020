//! Latency samples, percentiles and the median/min/max summary over repeated runs. Pure.

use std::time::Duration;

/// Latencies of one kind of call in one measured window, in nanoseconds.
#[derive(Clone, Debug, Default)]
pub(crate) struct Samples {
    nanos: Vec<u64>,
    sorted: bool,
}

impl Samples {
    pub(crate) fn with_capacity(n: usize) -> Samples {
        Samples {
            nanos: Vec::with_capacity(n),
            sorted: true,
        }
    }

    pub(crate) fn push(&mut self, latency: Duration) {
        self.nanos
            .push(u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX));
        self.sorted = false;
    }

    pub(crate) fn extend(&mut self, other: Samples) {
        self.nanos.extend(other.nanos);
        self.sorted = false;
    }

    pub(crate) fn len(&self) -> usize {
        self.nanos.len()
    }

    /// The `p`-th percentile (0 < p <= 100) by the nearest-rank method: the smallest sample
    /// such that at least p% of the samples are at or below it. `None` without samples.
    pub(crate) fn percentile(&mut self, p: f64) -> Option<Duration> {
        if !self.sorted {
            self.nanos.sort_unstable();
            self.sorted = true;
        }
        nearest_rank(&self.nanos, p).map(Duration::from_nanos)
    }
}

/// Nearest-rank percentile of ascending `sorted`.
pub(crate) fn nearest_rank(sorted: &[u64], p: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let p = p.clamp(0.0, 100.0);
    // ceil(p/100 * n) computed in integers where possible, so 99.9% of 1000 is rank 999.
    let n = sorted.len();
    let rank = ((p / 100.0) * n as f64 - 1e-9).ceil().max(1.0) as usize;
    Some(sorted[rank.min(n) - 1])
}

/// Median, least and greatest of a figure over repeated runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

/// `None` without values; the median of an even count is the mean of the middle two.
pub(crate) fn spread(values: &[f64]) -> Option<Spread> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    Some(Spread {
        median,
        min: v[0],
        max: v[n - 1],
    })
}

/// A small, fast, deterministic generator for picking ids (xorshift64*); statistical quality
/// is plenty for spreading requests over an inventory.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        // A zero state would stay zero.
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform-enough index below `n` (n > 0).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u64> = (1..=1000).collect();
        assert_eq!(nearest_rank(&v, 50.0), Some(500));
        assert_eq!(nearest_rank(&v, 99.0), Some(990));
        assert_eq!(nearest_rank(&v, 99.9), Some(999));
        assert_eq!(nearest_rank(&v, 100.0), Some(1000));
        assert_eq!(nearest_rank(&v, 0.0), Some(1));
        assert_eq!(nearest_rank(&[7], 99.9), Some(7));
        assert_eq!(nearest_rank(&[1, 2], 50.0), Some(1));
        assert_eq!(nearest_rank(&[1, 2], 51.0), Some(2));
        assert_eq!(nearest_rank(&[], 50.0), None);
        let ten: Vec<u64> = (1..=10).collect();
        assert_eq!(nearest_rank(&ten, 99.0), Some(10));
        assert_eq!(nearest_rank(&ten, 90.0), Some(9));
    }

    #[test]
    fn samples_sort_lazily() {
        let mut s = Samples::with_capacity(4);
        for ms in [5, 1, 4, 2, 3] {
            s.push(Duration::from_millis(ms));
        }
        assert_eq!(s.percentile(50.0), Some(Duration::from_millis(3)));
        let mut more = Samples::default();
        more.push(Duration::from_millis(100));
        s.extend(more);
        assert_eq!(s.len(), 6);
        assert_eq!(s.percentile(100.0), Some(Duration::from_millis(100)));
        assert_eq!(Samples::default().percentile(50.0), None);
    }

    #[test]
    fn spreads() {
        assert_eq!(
            spread(&[3.0, 1.0, 2.0]),
            Some(Spread {
                median: 2.0,
                min: 1.0,
                max: 3.0
            })
        );
        assert_eq!(spread(&[4.0, 1.0, 2.0, 3.0]).unwrap().median, 2.5);
        assert_eq!(spread(&[f64::NAN, 1.0]).unwrap().median, 1.0);
        assert_eq!(spread(&[]), None);
    }

    #[test]
    fn rng_stays_in_range_and_spreads() {
        let mut rng = Rng::new(0);
        let mut hits = [0usize; 10];
        for _ in 0..10_000 {
            hits[rng.below(10)] += 1;
        }
        assert!(hits.iter().all(|&h| (800..1200).contains(&h)), "{hits:?}");
    }
}
