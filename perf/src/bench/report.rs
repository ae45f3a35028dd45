//! Reports for people: Markdown tables of load runs, the compare report, and the
//! progress line. Pure functions of the results, so they are tested as text.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::compare::{CompareReport, ConfigName};
use super::run::RunResult;
use super::sessions::{Outcome, SessionsReport};
use super::targets::{self, Verdict};
use super::units::{grouped, ms};

/// Cores of other work during a run above which the report says the figures are skewed.
pub const OTHER_LOAD_WARNING: f64 = 0.25;

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
            cell(&r.label),
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
            errors_with_unmeasured(r),
        );
    }
    out
}

/// One Markdown table of open-loop runs (`--rate`), a row per run: offered and
/// achieved rate, latency from the intended send time (coordinated omission
/// corrected), and the service time alone (from the actual send) for contrast.
pub fn open_loop_markdown(results: &[RunResult]) -> String {
    let mut out = String::new();
    out.push_str(
        "| configuration | sessions | offered req/s | achieved req/s | p50 ms | p90 ms | p99 ms \
         | p99.9 ms | max ms | service p99 ms | send lag p99 ms | unsent | errors |\n",
    );
    out.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    for r in results {
        let l = &r.latency;
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            cell(&r.label),
            r.sessions,
            r.offered_rps
                .map_or("–".into(), |rate| grouped(rate.round() as u64)),
            grouped(r.throughput_rps.round() as u64),
            ms(l.p50_us),
            ms(l.p90_us),
            ms(l.p99_us),
            ms(l.p999_us),
            ms(l.max_us),
            r.service_latency.map_or("–".into(), |s| ms(s.p99_us)),
            r.send_lag.map_or("–".into(), |s| ms(s.p99_us)),
            grouped(r.unsent),
            errors_with_unmeasured(r),
        );
    }
    out
}

/// The open-loop sweep of `compare --rates`: where each configuration saturates,
/// then every run. Empty without a sweep.
pub fn open_loop_section(report: &CompareReport) -> String {
    let mut out = String::new();
    if report.settings.rates.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "\n## Open loop: latency at a fixed offered rate\n\n\
         {} sessions share each offered rate; a request's latency counts from when it was \
         due, so waiting for a busy session is included (coordinated omission corrected). \
         A rate is sustained when at least {:.0} % of it is achieved, no request is left \
         unsent, at most {:.0} % fail, and p99 stays within {:.0} × the Redis baseline's p99 \
         at the lowest rate (one bound for every configuration, as a latency objective is; \
         a configuration's own while the baseline has none); the saturation rate is the \
         lowest offered rate that is not. Each \
         configuration stops at its saturation rate; then runs halfway between its \
         highest sustained and lowest saturated rate narrow the bracket.\n\n\
         | configuration | sustained req/s | saturated at req/s | why |\n|---|---:|---:|---|",
        report.settings.rate_sessions,
        super::compare::ACHIEVED_SHARE * 100.0,
        super::compare::ERROR_SHARE * 100.0,
        super::compare::P99_GROWTH,
    );
    let rate =
        |r: Option<f64>, none: &str| r.map_or(none.to_owned(), |r| grouped(r.round() as u64));
    let mut runs = Vec::new();
    for config in &report.configurations {
        let Some(saturation) = &config.saturation else {
            continue;
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} |",
            config.name,
            rate(saturation.sustained_rps, "none"),
            rate(saturation.saturated_at_rps, "not reached"),
            cell(saturation.reason.as_deref().unwrap_or("–")),
        );
        runs.extend(config.sweep.iter().cloned());
    }
    runs.sort_by(|a, b| {
        a.offered_rps
            .unwrap_or(0.0)
            .total_cmp(&b.offered_rps.unwrap_or(0.0))
    });
    out.push('\n');
    out.push_str(&open_loop_markdown(&runs));
    if let Some(rate) = report.settings.half_baseline_rps {
        let at_half: Vec<RunResult> = report
            .configurations
            .iter()
            .filter_map(|c| c.at_half_baseline.clone())
            .collect();
        let _ = writeln!(
            out,
            "\n### At half the Redis baseline's saturation rate ({} req/s)\n\n\
             Every configuration at one offered rate the baseline sustains.\n",
            grouped(rate.round() as u64)
        );
        out.push_str(&open_loop_markdown(&at_half));
    }
    out
}

/// Text made safe for a Markdown table cell (a `|` would end the cell).
pub fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

/// The errors cell of a run, with set-up and warm-up errors noted apart.
fn errors_with_unmeasured(run: &RunResult) -> String {
    let cell = errors_cell(&run.errors, run.requests);
    let unmeasured: u64 = run.unmeasured_errors.values().sum();
    if unmeasured == 0 {
        cell
    } else {
        let classes: Vec<String> = run
            .unmeasured_errors
            .iter()
            .map(|(class, count)| format!("{class} ×{count}"))
            .collect();
        format!("{cell}; not measured: {}", classes.join(", "))
    }
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

/// The targets as a Markdown table.
pub fn targets_markdown(report: &CompareReport) -> String {
    let mut out = String::from("| target | measured | verdict |\n|---|---|---|\n");
    for check in &report.targets {
        let verdict = match check.verdict {
            Verdict::Met => "met",
            Verdict::Missed => "**missed**",
            Verdict::NotMeasured => "not measured",
        };
        let _ = writeln!(
            out,
            "| {} | {} | {verdict} |",
            cell(&check.target),
            cell(&check.measured)
        );
    }
    out
}

/// What `compare` prints at the end: the verdicts.
pub fn compare_summary(report: &CompareReport) -> String {
    let mut out = String::from("\n");
    out.push_str(&targets_markdown(report));
    out.push_str(&virtual_server_section(report));
    for config in &report.configurations {
        if let Some(reason) = &config.not_available {
            let _ = writeln!(out, "\n{}: not available: {reason}", config.name);
        }
    }
    out
}

/// report.md of `compare`.
pub fn compare_markdown(report: &CompareReport) -> String {
    let mut out = String::new();
    let m = &report.machine;
    let s = &report.settings;
    let _ = writeln!(out, "# mcpgw-bench compare, {} UTC\n", report.started_utc);
    let _ = writeln!(
        out,
        "Machine: {} cores{}{}. {}",
        m.cores,
        m.cpu_model
            .as_deref()
            .map_or(String::new(), |model| format!(" ({model})")),
        m.kernel
            .as_deref()
            .map_or(String::new(), |k| format!(", Linux {k}")),
        m.loopback.map_or(
            "Loopback round trip: not measured.".to_owned(),
            |rtt| format!(
                "Loopback TCP round trip (1 byte, {} times, threads pinned): p50 {:.1} µs, \
                 p99 {:.1} µs with the ends on {} (the yardstick){}.",
                grouped(u64::from(rtt.iterations)),
                rtt.p50_us,
                rtt.p99_us,
                rtt.placement,
                match (rtt.same_cpu_p50_us, rtt.same_cpu_p99_us) {
                    (Some(p50), Some(p99)) =>
                        format!("; p50 {p50:.1} µs, p99 {p99:.1} µs with both on one CPU"),
                    _ => String::new(),
                }
            )
        ),
    );
    let _ = writeln!(
        out,
        "\nLoad: closed loop (each session sends its next request when the answer is complete), \
         legacy MCP sessions (initialize, then `tools/call echo` : `tools/list` = {}), one keep-alive \
         connection per session and worker. Each point measures {} s after {} s of warm-up. \
         Fleet: {} × `mcpgw serve --workers 1` (one URL = one worker), {}; upstream: {}. \
         The load generator runs on the same cores. Total time {:.0} s. mcpgw: `{}`.\n",
        s.mix,
        s.duration_s,
        s.warmup_s,
        s.workers,
        s.redis,
        s.upstream,
        report.total_seconds,
        s.mcpgw
    );
    let others: Vec<f64> = report
        .configurations
        .iter()
        .flat_map(|c| c.runs.iter().filter_map(|r| r.cpu.other_cores))
        .collect();
    if let Some(worst) = others.iter().copied().reduce(f64::max) {
        let mean = others.iter().sum::<f64>() / others.len() as f64;
        let _ = writeln!(
            out,
            "Other processes on the machine used {mean:.2} cores on average during the measured \
             windows (at most {worst:.2}){}\n",
            if worst > OTHER_LOAD_WARNING {
                ": the figures are skewed by that load; rerun on a quiet machine"
            } else {
                "."
            }
        );
    }
    out.push_str("![latency and throughput per configuration](chart.svg)\n\n## Targets\n\n");
    out.push_str(&targets_markdown(report));

    out.push_str("\n## Configurations\n\n");
    for config in &report.configurations {
        match &config.not_available {
            None => {
                let _ = writeln!(out, "- `{}`: {}", config.name, config.description);
            }
            Some(reason) => {
                let _ = writeln!(
                    out,
                    "- `{}`: {} — **not available**: {reason}",
                    config.name, config.description
                );
            }
        }
    }

    out.push_str("\n## Results\n");
    for &level in &s.concurrency {
        let runs: Vec<RunResult> = report
            .configurations
            .iter()
            .filter_map(|c| c.runs.iter().find(|r| r.sessions == level).cloned())
            .collect();
        if runs.is_empty() {
            continue;
        }
        let _ = writeln!(out, "\n### {level} concurrent sessions\n");
        out.push_str(&runs_markdown(&runs));
    }

    out.push_str(&open_loop_section(report));

    out.push_str(
        "\n## Forwarding cost: `tools/call` latency added over sticky, CPU and packets per request\n\n\
         | sessions | configuration | added p50 µs | added p99 µs | req/s | tools/call/s | gateway CPU s/1k req | Redis CPU s/1k req | TCP segments/req | UDP datagrams/req | UDP drops, TCP resends |\n\
         |---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n",
    );
    for &level in &s.concurrency {
        let find = |name: ConfigName| {
            report
                .configurations
                .iter()
                .find(|c| c.name == name)
                .and_then(|c| c.runs.iter().find(|r| r.sessions == level))
        };
        let Some(sticky) = find(ConfigName::Sticky) else {
            continue;
        };
        for name in [
            ConfigName::Sticky,
            ConfigName::Quic,
            ConfigName::Tcp,
            ConfigName::Redis,
            ConfigName::RoundRobin,
        ] {
            let Some(run) = find(name) else { continue };
            let added = |get: fn(&RunResult) -> u64| get(run) as f64 - get(sticky) as f64;
            let net = run.network.as_ref();
            let _ = writeln!(
                out,
                "| {level} | {name} | {:+.0} | {:+.0} | {} | {} | {} | {} | {} | {} | {} |",
                added(|r| r.tools_call_latency.p50_us),
                added(|r| r.tools_call_latency.p99_us),
                grouped(run.throughput_rps.round() as u64),
                grouped(targets::tools_call_rps(run).round() as u64),
                run.cpu
                    .gateway_s_per_1k
                    .map_or("–".into(), |c| format!("{c:.3}")),
                run.cpu
                    .redis_s_per_1k
                    .map_or("–".into(), |c| format!("{c:.3}")),
                net.map_or("–".into(), |n| format!(
                    "{:.1}",
                    n.tcp_segments_per_request
                )),
                net.map_or("–".into(), |n| format!(
                    "{:.1}",
                    n.udp_datagrams_per_request
                )),
                net.map_or("–".into(), |n| format!(
                    "{}, {}",
                    grouped(n.udp_receive_buffer_drops),
                    grouped(n.tcp_retransmitted)
                )),
            );
        }
    }

    out.push_str(&virtual_server_section(report));

    if let Some(sessions) = &report.idle_sessions {
        out.push_str("\n## Idle sessions\n\n");
        out.push_str(&sessions_markdown(sessions));
    }

    out.push_str(
        "\n## How the figures are made\n\n\
         - Latency: successful requests only, from the request leaving the client to the last \
         byte of the answer, in an HDR histogram (3 significant digits); errors are counted by \
         class instead.\n\
         - Added latency: a configuration's `tools/call` percentile minus sticky's at the same \
         concurrency.\n\
         - Forwarded: share of answers whose `mcpgw-edge-worker` differs from `mcpgw-owner-worker`.\n\
         - Redis cmd/req: `INFO commandstats` difference over the measured window (the `info` \
         command excluded) divided by the requests, on the fleet's own Redis; lease renewals \
         are included.\n\
         - CPU: utime + stime from /proc/<pid>/stat of the supervisors and their workers \
         (clock ticks from `getconf CLK_TCK`), per 1,000 requests.\n\
         - Closed loop on a shared 2-core machine: at high concurrency every configuration is \
         CPU-bound, so its latency there mostly reflects CPU cost per request.\n",
    );
    out
}

/// What a virtual server of three members adds to a session's `tools/call` and to
/// the gateway's CPU, against the plain route on the same fleet, upstream and load
/// (`virtual` against `sticky`, `virtual-tcp` against `tcp`); empty without both.
pub fn virtual_server_section(report: &CompareReport) -> String {
    let run_of = |name: ConfigName, level: usize| {
        report
            .configurations
            .iter()
            .find(|c| c.name == name)
            .and_then(|c| c.runs.iter().find(|r| r.sessions == level))
    };
    let mut rows = String::new();
    for &level in &report.settings.concurrency {
        for name in [ConfigName::Virtual, ConfigName::VirtualTcp] {
            let Some(plain_name) = name.plain_counterpart() else {
                continue;
            };
            let (Some(federated), Some(plain)) = (run_of(name, level), run_of(plain_name, level))
            else {
                continue;
            };
            let call =
                |run: &RunResult| (run.tools_call_latency.p50_us, run.tools_call_latency.p99_us);
            let ((plain_p50, plain_p99), (fed_p50, fed_p99)) = (call(plain), call(federated));
            let cpu = |run: &RunResult| run.cpu.gateway_s_per_1k;
            let cpu_cell = match (cpu(plain), cpu(federated)) {
                (Some(p), Some(f)) if p > 0.0 => {
                    format!("{:.0} → {:.0} µs ({:.2}×)", p * 1000.0, f * 1000.0, f / p)
                }
                _ => "–".into(),
            };
            let _ = writeln!(
                rows,
                "| {level} | {name} vs {plain_name} | {} → {} ({:+.0}) | {} → {} ({:+.0}) | {} → {} | {cpu_cell} |",
                plain_p50,
                fed_p50,
                fed_p50 as f64 - plain_p50 as f64,
                plain_p99,
                fed_p99,
                fed_p99 as f64 - plain_p99 as f64,
                grouped(plain.throughput_rps.round() as u64),
                grouped(federated.throughput_rps.round() as u64),
            );
        }
    }
    if rows.is_empty() {
        return String::new();
    }
    format!(
        "\n## Virtual server: three members against the plain route\n\n\
         The same upstream, fleet and load, through `/servers/all/mcp` (three members; a \
         `tools/call` goes to one of them, a `tools/list` merges all three) instead of the \
         plain route. Plain → virtual, with the difference.\n\n\
         | sessions | configurations | tools/call p50 µs | tools/call p99 µs | req/s | gateway CPU per request |\n\
         |---:|---|---:|---:|---:|---:|\n{rows}"
    )
}

/// The idle-session figures as Markdown.
pub fn sessions_markdown(report: &SessionsReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} idle legacy sessions opened on one worker after {} warm-up sessions.\n",
        grouped(report.count as u64),
        report.warmup
    );
    out.push_str("| measurement | per session | before → after | sessions |\n|---|---:|---|---|\n");
    let kib = |bytes: f64| format!("{:.2} KiB", bytes / 1024.0);
    let mib = |bytes: u64| format!("{:.1} MiB", bytes as f64 / 1024.0 / 1024.0);
    match &report.owner {
        Outcome::Measured(owner) => {
            let _ = writeln!(
                out,
                "| owner RSS, standalone worker | {} | {} → {} | {} opened, {} failed, {} held, {:.1} s |",
                kib(owner.per_session_bytes),
                mib(owner.rss_before_bytes),
                mib(owner.rss_after_bytes),
                grouped(owner.opened as u64),
                grouped(owner.failed as u64),
                owner.sessions_held.map_or("?".into(), grouped),
                owner.open_seconds
            );
        }
        Outcome::NotAvailable { not_available } => {
            let _ = writeln!(
                out,
                "| owner RSS, standalone worker | not available: {not_available} | | |"
            );
        }
    }
    match &report.directory {
        Outcome::Measured(directory) => {
            let _ = writeln!(
                out,
                "| directory: Redis used_memory | {} | {} → {} | {} → {} keys |",
                kib(directory.per_session_bytes),
                mib(directory.used_memory_before_bytes),
                mib(directory.used_memory_after_bytes),
                grouped(directory.keys_before),
                grouped(directory.keys_after)
            );
            let w = &directory.worker;
            let _ = writeln!(
                out,
                "| owner RSS, fleet worker | {} | {} → {} | {} opened, {} failed |",
                kib(w.per_session_bytes),
                mib(w.rss_before_bytes),
                mib(w.rss_after_bytes),
                grouped(w.opened as u64),
                grouped(w.failed as u64)
            );
        }
        Outcome::NotAvailable { not_available } => {
            let _ = writeln!(out, "| directory | not available: {not_available} | | |");
        }
    }
    if let Some(upstream) = report
        .owner
        .measured()
        .and_then(|owner| owner.upstream_per_session_bytes)
    {
        let _ = writeln!(
            out,
            "| upstream RSS (its own process, not the owner's) | {} | | same sessions |",
            kib(upstream)
        );
    }
    out
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
            offered_rps: None,
            unsent: 0,
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
            service_latency: None,
            send_lag: None,
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
                upstream_s_per_1k: Some(0.01),
                machine_cores: Some(2.0),
                other_cores: Some(0.0),
            },
            network: None,
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
    fn set_up_errors_are_shown_apart() {
        let mut run = sample("quic", 8, 100, 1.0);
        run.unmeasured_errors
            .insert("initialize: http 503".into(), 2);
        let table = runs_markdown(&[run]);
        assert!(
            table.contains("| 0; not measured: initialize: http 503 ×2 |"),
            "{table}"
        );
    }

    #[test]
    fn table_cells_cannot_break_the_table() {
        assert_eq!(cell("a | b\nc"), "a \\| b c");
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
