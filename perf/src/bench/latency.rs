//! Latency recording: an HDR histogram per load session (no sharing, no locks on the
//! request path), merged once at the end and summarized as the percentiles every
//! report shows.

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Microsecond latencies with three significant digits (0.1% error), growing as
/// needed so a stuck request shows up as it is instead of being clipped.
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new(3).expect("3 significant digits is a valid precision")
}

/// Records one latency. `record` grows the histogram (it auto-resizes);
/// `saturating_record` would clip to the current range instead.
pub fn record(histogram: &mut Histogram<u64>, micros: u64) {
    if histogram.record(micros).is_err() {
        histogram.saturating_record(micros);
    }
}

/// The percentiles of one set of latencies, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    pub count: u64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
    pub mean_us: f64,
}

impl LatencySummary {
    pub fn of(histogram: &Histogram<u64>) -> LatencySummary {
        if histogram.is_empty() {
            return LatencySummary::default();
        }
        LatencySummary {
            count: histogram.len(),
            p50_us: histogram.value_at_quantile(0.50),
            p90_us: histogram.value_at_quantile(0.90),
            p99_us: histogram.value_at_quantile(0.99),
            p999_us: histogram.value_at_quantile(0.999),
            max_us: histogram.max(),
            mean_us: histogram.mean(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_come_from_the_recorded_values() {
        let mut histogram = new_histogram();
        for value in 1..=1000u64 {
            record(&mut histogram, value * 10);
        }
        record(&mut histogram, 2_000_000);
        let summary = LatencySummary::of(&histogram);
        assert_eq!(summary.count, 1001);
        // Three significant digits: within 0.1% of the exact value.
        let close = |got: u64, want: u64| (got as f64 - want as f64).abs() <= want as f64 * 0.001;
        assert!(close(summary.p50_us, 5010), "{summary:?}");
        assert!(close(summary.p90_us, 9010), "{summary:?}");
        assert!(close(summary.p99_us, 9910), "{summary:?}");
        assert!(close(summary.max_us, 2_000_000), "{summary:?}");
        assert!(summary.p999_us >= summary.p99_us);
    }

    #[test]
    fn merged_histograms_summarize_all_sessions() {
        let mut a = new_histogram();
        let mut b = new_histogram();
        record(&mut a, 100);
        record(&mut b, 300);
        a.add(&b).expect("same precision");
        let summary = LatencySummary::of(&a);
        assert_eq!(summary.count, 2);
        assert!(summary.max_us >= 300);
        assert_eq!(
            LatencySummary::of(&new_histogram()),
            LatencySummary::default()
        );
    }
}
