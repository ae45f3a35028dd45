//! Reports for people: Markdown tables of load runs, the compare report, and the
//! progress line. Pure functions of the results, so they are tested as text.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::run::RunResult;
use super::units::{grouped, ms};

/// One Markdown table, a row per run.
pub fn runs_markdown(results: &[RunResult]) -> String {
    let mut out = String::new();
    out.push_str(
        "| configuration | sessions | req/s | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms \
         | forwarded | Redis cmd/req | gateway CPU s/1k req | errors |\n",
    );
    out.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    for r in results {
        let l = &r.latency;
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.label,
            r.sessions,
            grouped(r.throughput_rps.round() as u64),
            ms(l.p50_us),
            ms(l.p90_us),
            ms(l.p99_us),
            ms(l.p999_us),
            ms(l.max_us),
            r.forwarded_fraction
                .map_or("–".into(), |f| format!("{:.0}%", f * 100.0)),
            r.redis_commands_per_request
                .map_or("–".into(), |c| format!("{c:.3}")),
            r.cpu
                .gateway_s_per_1k
                .map_or("–".into(), |c| format!("{c:.3}")),
            errors_cell(&r.errors, r.requests),
        );
    }
    out
}

/// `0`, or the count and its classes: `12 (0.1%: http 503 ×10, timeout ×2)`.
pub fn errors_cell(errors: &BTreeMap<String, u64>, requests: u64) -> String {
    let total: u64 = errors.values().sum();
    if total == 0 {
        return "0".into();
    }
    let classes: Vec<String> = errors
        .iter()
        .map(|(class, count)| format!("{class} ×{count}"))
        .collect();
    let share = if requests > 0 {
        total as f64 / requests as f64 * 100.0
    } else {
        100.0
    };
    format!("{total} ({share:.2}%: {})", classes.join(", "))
}

/// The progress line shown on a terminal while a run measures.
pub fn progress_line(label: &str, fraction: f64, done: u64, rate: f64, errors: u64) -> String {
    const WIDTH: usize = 24;
    let fraction = fraction.clamp(0.0, 1.0);
    let filled = (fraction * WIDTH as f64).round() as usize;
    format!(
        "{label} [{}{}] {:>3.0}%  {} requests  {} req/s  {} errors",
        "#".repeat(filled),
        ".".repeat(WIDTH - filled),
        fraction * 100.0,
        grouped(done),
        grouped(rate.round() as u64),
        grouped(errors),
    )
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::bench::latency::LatencySummary;
    use crate::bench::mix::Era;
    use crate::bench::routing::Routing;
    use crate::bench::run::CpuFigures;

    /// A plausible result for rendering tests.
    pub fn sample(label: &str, sessions: usize, p50_us: u64, rps: f64) -> RunResult {
        RunResult {
            label: label.into(),
            urls: vec!["http://127.0.0.1:1/mcp".into()],
            workers: vec![Some("w1".into())],
            era: Era::Legacy,
            routing: Routing::Forward,
            mix: "20:1".into(),
            sessions,
            setup_s: 0.1,
            window_s: 5.0,
            requests: 1000,
            ok: 1000,
            errors: BTreeMap::new(),
            unmeasured_errors: BTreeMap::new(),
            throughput_rps: rps,
            latency: LatencySummary {
                count: 1000,
                p50_us,
                p90_us: p50_us * 2,
                p99_us: p50_us * 3,
                p999_us: p50_us * 4,
                max_us: p50_us * 5,
                mean_us: p50_us as f64,
            },
            tools_call_latency: LatencySummary {
                p50_us,
                p99_us: p50_us * 3,
                ..LatencySummary::default()
            },
            forwarded_fraction: Some(1.0),
            redis_commands_per_request: Some(0.0),
            redis_commands: Some(BTreeMap::new()),
            cpu: CpuFigures {
                clock_ticks_per_second: 100,
                gateway_s_per_1k: Some(0.05),
                gateway_cores: Some(1.0),
                redis_s_per_1k: Some(0.0),
                loadgen_s_per_1k: Some(0.03),
            },
        }
    }

    #[test]
    fn the_runs_table_has_a_row_per_run_with_milliseconds() {
        let table = runs_markdown(&[
            sample("quic", 64, 250, 12_345.4),
            sample("tcp", 8, 1500, 99.0),
        ]);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 4);
        assert!(
            lines[2].starts_with("| quic | 64 | 12,345 | 0.250 | 0.500 | 0.750 |"),
            "{table}"
        );
        assert!(lines[3].contains("| 1.500 |"), "{table}");
        assert!(lines[2].contains("| 100% |"), "{table}");
        for line in &lines {
            assert_eq!(line.matches('|').count(), 13, "{line}");
        }
    }

    #[test]
    fn errors_are_counted_by_class() {
        let mut errors = BTreeMap::new();
        assert_eq!(errors_cell(&errors, 10), "0");
        errors.insert("http 503".to_owned(), 10);
        errors.insert("timeout".to_owned(), 2);
        assert_eq!(
            errors_cell(&errors, 1200),
            "12 (1.00%: http 503 ×10, timeout ×2)"
        );
    }

    #[test]
    fn the_progress_line_fills_its_bar() {
        let line = progress_line("quic c=8", 0.5, 12345, 2469.1, 0);
        assert!(
            line.starts_with("quic c=8 [############............]  50%"),
            "{line}"
        );
        assert!(
            line.contains("12,345 requests  2,469 req/s  0 errors"),
            "{line}"
        );
        assert!(progress_line("x", 7.0, 0, 0.0, 0).contains("100%"));
    }
}
