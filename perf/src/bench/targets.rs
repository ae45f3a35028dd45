//! The published targets, checked against what `compare` measured. Pure: the same
//! report always gives the same verdicts, and the tests pin the arithmetic.
//!
//! "Added latency" of a forwarding configuration is its `tools/call` latency minus
//! the sticky configuration's at the same percentile and concurrency: what
//! forwarding costs over sending the request to the owner directly.

use serde::Serialize;

use super::compare::{ConfigName, ConfigOutcome};
use super::loopback::LoopbackRtt;
use super::run::RunResult;
use super::sessions::SessionsReport;
use super::units::grouped;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    Met,
    Missed,
    /// A configuration it needs did not run.
    NotMeasured,
}

#[derive(Debug, Clone, Serialize)]
pub struct TargetCheck {
    pub target: String,
    pub measured: String,
    pub verdict: Verdict,
}

/// Redis commands per request below which a configuration has no Redis round trip
/// on its request path (what remains is lease renewals, which follow time).
pub const NO_REDIS_PER_REQUEST: f64 = 0.01;
/// Owner memory per idle session, bytes.
pub const SESSION_MEMORY_TARGET: f64 = 16.0 * 1024.0;
pub const IDLE_SESSIONS_TARGET: usize = 10_000;
pub const ROUND_ROBIN_RPS_TARGET: f64 = 10_000.0;

fn outcome_of(outcomes: &[ConfigOutcome], name: ConfigName) -> Option<&ConfigOutcome> {
    outcomes.iter().find(|o| o.name == name)
}

fn run_at(outcomes: &[ConfigOutcome], name: ConfigName, concurrency: usize) -> Option<&RunResult> {
    outcome_of(outcomes, name)?
        .runs
        .iter()
        .find(|r| r.sessions == concurrency)
}

fn concurrency_levels(outcomes: &[ConfigOutcome]) -> Vec<usize> {
    let mut levels: Vec<usize> = outcomes
        .iter()
        .flat_map(|o| o.runs.iter().map(|r| r.sessions))
        .collect();
    levels.sort_unstable();
    levels.dedup();
    levels
}

/// `tools/call` latency added over sticky at p50 or p99, in microseconds.
fn added_us(outcomes: &[ConfigOutcome], name: ConfigName, c: usize, p99: bool) -> Option<f64> {
    let forwarded = run_at(outcomes, name, c)?;
    let sticky = run_at(outcomes, ConfigName::Sticky, c)?;
    let pick = |r: &RunResult| {
        if p99 {
            r.tools_call_latency.p99_us
        } else {
            r.tools_call_latency.p50_us
        }
    };
    Some(pick(forwarded) as f64 - pick(sticky) as f64)
}

/// tools/call answers per second of a run.
pub fn tools_call_rps(run: &RunResult) -> f64 {
    if run.window_s > 0.0 {
        run.tools_call_latency.count as f64 / run.window_s
    } else {
        0.0
    }
}

const MESH: [ConfigName; 2] = [ConfigName::Quic, ConfigName::Tcp];

/// `cores`: the CPUs the machine gave every process under test, to tell a run that the
/// machine's cores bounded (see [`cpu_ceiling`]).
pub fn evaluate(
    outcomes: &[ConfigOutcome],
    sessions: Option<&SessionsReport>,
    loopback: Option<&LoopbackRtt>,
    cores: usize,
) -> Vec<TargetCheck> {
    let levels = concurrency_levels(outcomes);
    vec![
        forwarded_p50(outcomes, &levels, loopback),
        mesh_vs_redis_p99(outcomes, &levels),
        mesh_vs_redis_throughput(outcomes, &levels, cores),
        mesh_vs_redis_open_loop_p99(outcomes),
        mesh_vs_redis_saturation(outcomes, cores),
        forwarded_cpu(outcomes),
        round_robin_throughput(outcomes),
        no_redis_per_request(outcomes),
        session_memory(sessions),
        idle_sessions(sessions),
    ]
}

/// Judged at the lowest concurrency, where queueing adds least to the difference;
/// the higher levels are listed for the record.
fn forwarded_p50(
    outcomes: &[ConfigOutcome],
    levels: &[usize],
    loopback: Option<&LoopbackRtt>,
) -> TargetCheck {
    let target =
        "A forwarded tools/call adds at most one loopback round trip at p50 over sticky".to_owned();
    let Some(rtt) = loopback else {
        return not_measured(target, "the loopback round trip was not measured");
    };
    let mut parts = Vec::new();
    let mut verdict = None;
    for &c in levels {
        let added: Vec<(ConfigName, f64)> = MESH
            .iter()
            .filter_map(|&name| Some((name, added_us(outcomes, name, c, false)?)))
            .collect();
        if added.is_empty() {
            continue;
        }
        if verdict.is_none() {
            verdict = Some(if added.iter().all(|(_, a)| *a <= rtt.p50_us) {
                Verdict::Met
            } else {
                Verdict::Missed
            });
        }
        let text: Vec<String> = added
            .iter()
            .map(|(n, a)| format!("{n} {a:+.0} µs"))
            .collect();
        parts.push(format!("c={c}: {}", text.join(", ")));
    }
    match verdict {
        None => not_measured(target, "needs sticky and quic or tcp runs"),
        Some(verdict) => TargetCheck {
            target,
            measured: format!(
                "{} (loopback RTT p50 {:.0} µs on {}; judged at the lowest concurrency)",
                parts.join("; "),
                rtt.p50_us,
                rtt.placement
            ),
            verdict,
        },
    }
}

fn mesh_vs_redis_p99(outcomes: &[ConfigOutcome], levels: &[usize]) -> TargetCheck {
    let target =
        "QUIC and TCP mesh add ≥3× less latency at p99 than the Redis pub/sub baseline".to_owned();
    let mut parts = Vec::new();
    let mut all_met = true;
    for &c in levels {
        let Some(redis) = added_us(outcomes, ConfigName::Redis, c, true) else {
            continue;
        };
        for name in MESH {
            let Some(mesh) = added_us(outcomes, name, c, true) else {
                continue;
            };
            // A mesh that adds nothing measurable beats any positive baseline.
            let ratio = if mesh <= 0.0 {
                f64::INFINITY
            } else {
                redis / mesh
            };
            all_met &= ratio >= 3.0;
            parts.push(format!(
                "c={c} {name}: {mesh:+.0} µs vs redis {redis:+.0} µs ({})",
                ratio_text(ratio)
            ));
        }
    }
    comparison(
        target,
        parts,
        all_met,
        "needs sticky, redis and quic or tcp runs",
    )
}

fn mesh_vs_redis_throughput(
    outcomes: &[ConfigOutcome],
    levels: &[usize],
    cores: usize,
) -> TargetCheck {
    let target =
        "QUIC and TCP mesh forward ≥2× the throughput of the Redis pub/sub baseline".to_owned();
    let mut parts = Vec::new();
    let mut all_met = true;
    for &c in levels {
        let Some(redis) = run_at(outcomes, ConfigName::Redis, c) else {
            continue;
        };
        for name in MESH {
            let Some(mesh) = run_at(outcomes, name, c) else {
                continue;
            };
            let ratio = if redis.throughput_rps > 0.0 {
                mesh.throughput_rps / redis.throughput_rps
            } else {
                f64::INFINITY
            };
            all_met &= ratio >= 2.0;
            parts.push(format!(
                "c={c} {name}: {} vs {} req/s ({})",
                grouped(mesh.throughput_rps.round() as u64),
                grouped(redis.throughput_rps.round() as u64),
                ratio_text(ratio)
            ));
        }
    }
    let mut check = comparison(target, parts, all_met, "needs redis and quic or tcp runs");
    let ceilings: Vec<String> = levels
        .iter()
        .filter_map(|&c| cpu_ceiling(outcomes, c, cores))
        .map(|ceiling| format!("{} ({})", ratio_text(ceiling.ratio()), ceiling.figures()))
        .collect();
    if check.verdict != Verdict::NotMeasured && !ceilings.is_empty() {
        check.measured += &format!(
            ". Where the baseline kept the machine's {cores} cores busy, even a forward that \
             cost no more CPU than a local request would reach at most {}",
            ceilings.join("; ")
        );
    }
    check
}

/// The most throughput a forwarding configuration can reach against the Redis baseline
/// at one concurrency, on a machine whose cores every process under test shares (the
/// load generator and the upstream too), if its hop cost nothing: a forward then costs
/// the machine what a local request does. Present only when the baseline's run kept
/// at least 90 % of the cores busy, so that cores, not latency, bounded it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct CpuCeiling {
    sessions: usize,
    /// Machine CPU per local (`sticky`) request, µs.
    local_us: f64,
    /// Machine CPU per request forwarded by the baseline, µs.
    baseline_us: f64,
}

impl CpuCeiling {
    fn ratio(&self) -> f64 {
        self.baseline_us / self.local_us
    }

    /// What the ceiling was computed from.
    fn figures(&self) -> String {
        format!(
            "CPU per request of every process under test at c={}: local {:.0} µs, redis {:.0} µs",
            self.sessions, self.local_us, self.baseline_us
        )
    }
}

fn cpu_ceiling(outcomes: &[ConfigOutcome], c: usize, cores: usize) -> Option<CpuCeiling> {
    let baseline = run_at(outcomes, ConfigName::Redis, c)?;
    let local = run_at(outcomes, ConfigName::Sticky, c)?;
    let busy = baseline.cpu.machine_cores?;
    if cores == 0 || busy < 0.9 * cores as f64 {
        return None;
    }
    let ceiling = CpuCeiling {
        sessions: c,
        local_us: machine_us_per_request(local)?,
        baseline_us: machine_us_per_request(baseline)?,
    };
    (ceiling.local_us > 0.0).then_some(ceiling)
}

/// CPU per request, µs, of every process a request runs through on this machine: the
/// gateway, Redis, the load generator and the upstream. `None` while one is unknown.
fn machine_us_per_request(run: &RunResult) -> Option<f64> {
    let cpu = &run.cpu;
    let s_per_1k = cpu.gateway_s_per_1k?
        + cpu.loadgen_s_per_1k?
        + cpu.upstream_s_per_1k?
        + cpu.redis_s_per_1k.unwrap_or(0.0);
    Some(s_per_1k * 1000.0)
}

/// Open loop, at half the baseline's saturation rate: a rate the baseline sustains,
/// so the comparison is of latency, not of who saturates first.
fn mesh_vs_redis_open_loop_p99(outcomes: &[ConfigOutcome]) -> TargetCheck {
    let target = "At half the Redis baseline's saturation rate (open loop), forwarded p99 ≥3× \
                  lower than the baseline's"
        .to_owned();
    let at_half = |name: ConfigName| outcome_of(outcomes, name)?.at_half_baseline.as_ref();
    let Some(redis) = at_half(ConfigName::Redis) else {
        return not_measured(target, "needs a rate sweep in which the baseline saturates");
    };
    let mut parts = Vec::new();
    let mut all_met = true;
    for name in MESH {
        let Some(mesh) = at_half(name) else {
            continue;
        };
        let ratio = redis.latency.p99_us as f64 / mesh.latency.p99_us.max(1) as f64;
        all_met &= ratio >= 3.0;
        parts.push(format!(
            "{name}: p99 {:.2} vs {:.2} ms at {} req/s ({})",
            mesh.latency.p99_us as f64 / 1000.0,
            redis.latency.p99_us as f64 / 1000.0,
            grouped(redis.offered_rps.unwrap_or(0.0).round() as u64),
            ratio_text(ratio)
        ));
    }
    comparison(
        target,
        parts,
        all_met,
        "needs quic or tcp runs at the same rate",
    )
}

/// The saturation rates of the open-loop sweep. A mesh that never saturated is
/// credited with its highest sustained rate, as a lower bound ("more than").
fn mesh_vs_redis_saturation(outcomes: &[ConfigOutcome], cores: usize) -> TargetCheck {
    let target = "The mesh's open-loop saturation rate ≥2× the Redis baseline's".to_owned();
    let saturation = |name: ConfigName| outcome_of(outcomes, name)?.saturation.as_ref();
    let Some(redis) = saturation(ConfigName::Redis).and_then(|s| s.saturated_at_rps) else {
        return not_measured(target, "needs a rate sweep in which the baseline saturates");
    };
    let mut parts = Vec::new();
    let mut all_met = true;
    for name in MESH {
        let Some(mesh) = saturation(name) else {
            continue;
        };
        let (rate, bound) = match (mesh.saturated_at_rps, mesh.sustained_rps) {
            (Some(at), _) => (at, ""),
            (None, Some(sustained)) => (sustained, "more than "),
            (None, None) => continue,
        };
        let ratio = rate / redis;
        // A lower bound meets the target only when the bound itself does.
        all_met &= ratio >= 2.0;
        parts.push(format!(
            "{name}: {bound}{} vs {} req/s ({bound}{})",
            grouped(rate.round() as u64),
            grouped(redis.round() as u64),
            ratio_text(ratio)
        ));
    }
    let mut check = comparison(target, parts, all_met, "needs quic or tcp in the sweep");
    // The sweep offers its load over the closed loop's 64 sessions' worth of work; the
    // closed-loop ceiling nearest that level says what the cores allow.
    let ceiling = concurrency_levels(outcomes)
        .into_iter()
        .filter(|&c| c <= 64)
        .rev()
        .find_map(|c| cpu_ceiling(outcomes, c, cores));
    if let Some(ceiling) = ceiling
        && check.verdict != Verdict::NotMeasured
    {
        check.measured += &format!(
            ". Bound by the machine's {cores} cores, a forward that cost no more CPU than a \
             local request would saturate at {} the baseline's rate at most ({})",
            ratio_text(ceiling.ratio()),
            ceiling.figures()
        );
    }
    check
}

/// Gateway CPU per forwarded request against a local one, closed loop at 64
/// sessions (the highest level below that when 64 did not run).
fn forwarded_cpu(outcomes: &[ConfigOutcome]) -> TargetCheck {
    let target = "Gateway CPU per forwarded request ≤1.5× a local one at 64 sessions".to_owned();
    let level = concurrency_levels(outcomes)
        .into_iter()
        .filter(|&c| c <= 64)
        .max();
    let cpu = |name: ConfigName| run_at(outcomes, name, level?)?.cpu.gateway_s_per_1k;
    let Some(local) = cpu(ConfigName::Sticky).filter(|&local| local > 0.0) else {
        return not_measured(target, "needs a sticky run with gateway CPU figures");
    };
    let mut parts = Vec::new();
    let mut all_met = true;
    for name in MESH {
        let Some(forwarded) = cpu(name) else {
            continue;
        };
        let ratio = forwarded / local;
        all_met &= ratio <= 1.5;
        parts.push(format!(
            "c={} {name}: {:.0} vs {:.0} µs ({ratio:.2}×)",
            level.unwrap_or(0),
            forwarded * 1000.0,
            local * 1000.0
        ));
    }
    comparison(target, parts, all_met, "needs quic or tcp runs")
}

fn ratio_text(ratio: f64) -> String {
    if ratio.is_finite() {
        format!("{ratio:.1}×")
    } else {
        "∞".into()
    }
}

fn comparison(target: String, parts: Vec<String>, all_met: bool, missing: &str) -> TargetCheck {
    if parts.is_empty() {
        return not_measured(target, missing);
    }
    TargetCheck {
        target,
        measured: parts.join("; "),
        verdict: if all_met {
            Verdict::Met
        } else {
            Verdict::Missed
        },
    }
}

fn round_robin_throughput(outcomes: &[ConfigOutcome]) -> TargetCheck {
    let target = "≥10,000 tools/call requests/s through a 2-worker fleet, round-robin, load generator on the same cores".to_owned();
    let best = outcomes
        .iter()
        .find(|o| o.name == ConfigName::RoundRobin)
        .and_then(|o| {
            o.runs
                .iter()
                .max_by(|a, b| tools_call_rps(a).total_cmp(&tools_call_rps(b)))
        });
    match best {
        None => not_measured(target, "needs round-robin runs"),
        Some(run) => {
            let rps = tools_call_rps(run);
            TargetCheck {
                target,
                measured: format!(
                    "{} tools/call/s at c={} ({} req/s with tools/list)",
                    grouped(rps.round() as u64),
                    run.sessions,
                    grouped(run.throughput_rps.round() as u64)
                ),
                verdict: if rps >= ROUND_ROBIN_RPS_TARGET {
                    Verdict::Met
                } else {
                    Verdict::Missed
                },
            }
        }
    }
}

fn no_redis_per_request(outcomes: &[ConfigOutcome]) -> TargetCheck {
    let target =
        "No Redis round trip per request in steady state (sticky and mesh forwarding)".to_owned();
    let mut worst: Option<(f64, ConfigName, usize)> = None;
    for outcome in outcomes.iter().filter(|o| {
        matches!(
            o.name,
            ConfigName::Sticky | ConfigName::Quic | ConfigName::Tcp | ConfigName::RoundRobin
        )
    }) {
        for run in &outcome.runs {
            if let Some(per) = run.redis_commands_per_request
                && worst.is_none_or(|(w, _, _)| per > w)
            {
                worst = Some((per, outcome.name, run.sessions));
            }
        }
    }
    match worst {
        None => not_measured(target, "needs fleet runs with Redis counters"),
        Some((per, name, c)) => TargetCheck {
            target,
            measured: format!(
                "at most {per:.4} Redis commands per request ({name}, c={c}); lease renewals follow time, not requests"
            ),
            verdict: if per <= NO_REDIS_PER_REQUEST {
                Verdict::Met
            } else {
                Verdict::Missed
            },
        },
    }
}

fn session_memory(sessions: Option<&SessionsReport>) -> TargetCheck {
    let target =
        "≤16 KiB of owner memory per idle session (upstream connection excluded)".to_owned();
    match sessions.and_then(|s| s.owner.measured()) {
        None => not_measured(target, "the idle-session measurement did not run"),
        Some(owner) => TargetCheck {
            target,
            measured: format!(
                "{:.1} KiB per session (RSS growth over {} sessions on a standalone worker)",
                owner.per_session_bytes / 1024.0,
                grouped(owner.opened as u64)
            ),
            verdict: if owner.per_session_bytes <= SESSION_MEMORY_TARGET {
                Verdict::Met
            } else {
                Verdict::Missed
            },
        },
    }
}

fn idle_sessions(sessions: Option<&SessionsReport>) -> TargetCheck {
    let target = "10,000 idle sessions on one worker".to_owned();
    let Some(report) = sessions else {
        return not_measured(target, "the idle-session measurement did not run");
    };
    let Some(owner) = report.owner.measured() else {
        return not_measured(target, "the idle-session measurement failed");
    };
    let held = owner.sessions_held.unwrap_or(owner.opened as u64);
    TargetCheck {
        target,
        measured: format!(
            "{} opened, {} failed, {} held (incl. {} warm-up) in {:.1} s",
            grouped(owner.opened as u64),
            grouped(owner.failed as u64),
            grouped(held),
            report.warmup,
            owner.open_seconds
        ),
        verdict: if owner.opened >= IDLE_SESSIONS_TARGET && owner.failed == 0 {
            Verdict::Met
        } else if report.count < IDLE_SESSIONS_TARGET {
            Verdict::NotMeasured
        } else {
            Verdict::Missed
        },
    }
}

fn not_measured(target: String, why: &str) -> TargetCheck {
    TargetCheck {
        target,
        measured: format!("not measured: {why}"),
        verdict: Verdict::NotMeasured,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::report::tests::sample;

    fn outcome(name: ConfigName, runs: Vec<RunResult>) -> ConfigOutcome {
        ConfigOutcome {
            name,
            description: String::new(),
            not_available: None,
            runs,
            sweep: Vec::new(),
            saturation: None,
            at_half_baseline: None,
        }
    }

    fn rtt(p50_us: f64) -> LoopbackRtt {
        LoopbackRtt {
            iterations: 1,
            placement: "different CPUs",
            p50_us,
            p99_us: p50_us * 2.0,
            max_us: p50_us * 3.0,
            same_cpu_p50_us: None,
            same_cpu_p99_us: None,
        }
    }

    #[test]
    fn forwarding_cost_is_measured_against_sticky_and_the_loopback() {
        let outcomes = vec![
            outcome(ConfigName::Sticky, vec![sample("sticky", 8, 200, 1000.0)]),
            outcome(ConfigName::Quic, vec![sample("quic", 8, 230, 900.0)]),
            outcome(ConfigName::Tcp, vec![sample("tcp", 8, 260, 900.0)]),
        ];
        let check = forwarded_p50(&outcomes, &[8], Some(&rtt(40.0)));
        assert_eq!(check.verdict, Verdict::Missed, "{check:?}");
        assert!(
            check.measured.contains("quic +30 µs, tcp +60 µs"),
            "{check:?}"
        );
        let check = forwarded_p50(&outcomes, &[8], Some(&rtt(60.0)));
        assert_eq!(check.verdict, Verdict::Met);
        assert_eq!(
            forwarded_p50(&outcomes, &[8], None).verdict,
            Verdict::NotMeasured
        );
    }

    fn with_cpu(mut run: RunResult, us_per_request: f64) -> RunResult {
        run.cpu.gateway_s_per_1k = Some(us_per_request / 1000.0);
        run
    }

    #[test]
    fn forwarded_cpu_is_judged_against_sticky_at_64_sessions() {
        let sticky = outcome(
            ConfigName::Sticky,
            vec![
                with_cpu(sample("sticky", 8, 100, 1000.0), 10.0),
                with_cpu(sample("sticky", 64, 100, 1000.0), 32.0),
            ],
        );
        let tcp = |us| {
            outcome(
                ConfigName::Tcp,
                vec![
                    with_cpu(sample("tcp", 8, 100, 1000.0), 1.0),
                    with_cpu(sample("tcp", 64, 100, 1000.0), us),
                ],
            )
        };
        let missed = forwarded_cpu(&[sticky.clone(), tcp(70.0)]);
        assert_eq!(missed.verdict, Verdict::Missed, "{missed:?}");
        assert!(
            missed.measured.contains("c=64 tcp: 70 vs 32 µs (2.19×)"),
            "{missed:?}"
        );
        let met = forwarded_cpu(&[sticky.clone(), tcp(48.0)]);
        assert_eq!(met.verdict, Verdict::Met, "{met:?}");
        assert_eq!(forwarded_cpu(&[tcp(48.0)]).verdict, Verdict::NotMeasured);
    }

    fn swept(name: ConfigName, sustained: Option<f64>, saturated: Option<f64>) -> ConfigOutcome {
        let mut o = outcome(name, Vec::new());
        o.saturation = Some(super::super::compare::Saturation {
            sustained_rps: sustained,
            saturated_at_rps: saturated,
            reason: None,
        });
        o
    }

    #[test]
    fn saturation_rates_compare_to_the_baselines_and_an_unsaturated_mesh_is_a_lower_bound() {
        let redis = swept(ConfigName::Redis, Some(4000.0), Some(6000.0));
        let met = mesh_vs_redis_saturation(
            &[
                redis.clone(),
                swept(ConfigName::Tcp, Some(12_000.0), Some(14_000.0)),
            ],
            2,
        );
        assert_eq!(met.verdict, Verdict::Met, "{met:?}");
        assert!(
            met.measured.contains("tcp: 14,000 vs 6,000 req/s (2.3×)"),
            "{met:?}"
        );
        let bound = mesh_vs_redis_saturation(
            &[redis.clone(), swept(ConfigName::Tcp, Some(8000.0), None)],
            2,
        );
        assert_eq!(bound.verdict, Verdict::Missed, "{bound:?}");
        assert!(bound.measured.contains("more than 8,000"), "{bound:?}");
        let unsaturated = swept(ConfigName::Redis, Some(32_000.0), None);
        assert_eq!(
            mesh_vs_redis_saturation(&[unsaturated, swept(ConfigName::Tcp, Some(1.0), None)], 2)
                .verdict,
            Verdict::NotMeasured
        );
    }

    #[test]
    fn open_loop_p99_is_compared_at_half_the_baselines_saturation_rate() {
        let at_half = |name: ConfigName, p99_us: u64| {
            let mut o = outcome(name, Vec::new());
            let mut run = sample(name.as_str(), 64, p99_us / 3, 3000.0);
            run.offered_rps = Some(3000.0);
            run.latency.p99_us = p99_us;
            o.at_half_baseline = Some(run);
            o
        };
        let check = mesh_vs_redis_open_loop_p99(&[
            at_half(ConfigName::Redis, 6000),
            at_half(ConfigName::Tcp, 1500),
            at_half(ConfigName::Quic, 3000),
        ]);
        assert_eq!(check.verdict, Verdict::Missed, "{check:?}");
        assert!(
            check
                .measured
                .contains("tcp: p99 1.50 vs 6.00 ms at 3,000 req/s (4.0×)"),
            "{check:?}"
        );
        assert!(
            check
                .measured
                .contains("quic: p99 3.00 vs 6.00 ms at 3,000 req/s (2.0×)"),
            "{check:?}"
        );
        assert_eq!(
            mesh_vs_redis_open_loop_p99(&[at_half(ConfigName::Tcp, 1500)]).verdict,
            Verdict::NotMeasured
        );
    }

    #[test]
    fn the_baseline_comparison_needs_the_baseline() {
        let sticky = outcome(
            ConfigName::Sticky,
            vec![sample("sticky", 64, 1000, 10_000.0)],
        );
        let quic = outcome(ConfigName::Quic, vec![sample("quic", 64, 1100, 8000.0)]);
        // Added p99: quic 3×1100 − 3×1000 = 300 µs; redis 3×2000 − 3000 = 3000 µs: 10×.
        let redis = outcome(ConfigName::Redis, vec![sample("redis", 64, 2000, 3000.0)]);
        let with = vec![sticky.clone(), quic.clone(), redis];
        let p99 = mesh_vs_redis_p99(&with, &[64]);
        assert_eq!(p99.verdict, Verdict::Met, "{p99:?}");
        assert!(p99.measured.contains("10.0×"), "{p99:?}");
        let throughput = mesh_vs_redis_throughput(&with, &[64], 2);
        assert_eq!(throughput.verdict, Verdict::Met, "{throughput:?}");
        assert!(throughput.measured.contains("2.7×"), "{throughput:?}");

        let mut unavailable = outcome(ConfigName::Redis, Vec::new());
        unavailable.not_available = Some("no such transport".into());
        let without = vec![sticky, quic, unavailable];
        assert_eq!(
            mesh_vs_redis_p99(&without, &[64]).verdict,
            Verdict::NotMeasured
        );
        assert_eq!(
            mesh_vs_redis_throughput(&without, &[64], 2).verdict,
            Verdict::NotMeasured
        );
    }

    /// A run whose every process used `us` of CPU per request in all (gateway `gateway`,
    /// the rest split between the load generator and the upstream), with the machine
    /// `busy` cores.
    fn costing(mut run: RunResult, gateway: f64, us: f64, busy: f64) -> RunResult {
        run.cpu.gateway_s_per_1k = Some(gateway / 1000.0);
        run.cpu.redis_s_per_1k = None;
        run.cpu.loadgen_s_per_1k = Some((us - gateway) / 2000.0);
        run.cpu.upstream_s_per_1k = Some((us - gateway) / 2000.0);
        run.cpu.machine_cores = Some(busy);
        run
    }

    #[test]
    fn the_cores_every_process_shares_bound_the_throughput_ratio_and_it_is_said() {
        // Local: 30 µs in the gateway + 30 µs of harness; the baseline: 70 + 30 µs.
        let sticky = outcome(
            ConfigName::Sticky,
            vec![costing(
                sample("sticky", 64, 500, 30_000.0),
                30.0,
                60.0,
                1.95,
            )],
        );
        let mut baseline = costing(sample("redis", 64, 900, 15_000.0), 70.0, 90.0, 1.95);
        baseline.cpu.redis_s_per_1k = Some(0.010);
        let redis = outcome(ConfigName::Redis, vec![baseline.clone()]);
        let tcp = outcome(ConfigName::Tcp, vec![sample("tcp", 64, 700, 20_000.0)]);
        let check = mesh_vs_redis_throughput(&[sticky.clone(), redis, tcp.clone()], &[64], 2);
        // The verdict is the measurement's; the ceiling only explains it.
        assert_eq!(check.verdict, Verdict::Missed, "{check:?}");
        assert!(
            check.measured.contains(
                "would reach at most 1.7× (CPU per request of every process under test at \
                 c=64: local 60 µs, redis 100 µs)"
            ),
            "{check:?}"
        );
        let check = mesh_vs_redis_saturation(
            &[
                sticky.clone(),
                ConfigOutcome {
                    runs: vec![baseline.clone()],
                    ..swept(ConfigName::Redis, Some(8000.0), Some(10_000.0))
                },
                swept(ConfigName::Tcp, Some(12_000.0), Some(14_000.0)),
            ],
            2,
        );
        assert_eq!(check.verdict, Verdict::Missed, "{check:?}");
        assert!(
            check
                .measured
                .contains("saturate at 1.7× the baseline's rate at most"),
            "{check:?}"
        );
        // A baseline that left a core idle was bound by latency, not cores: no ceiling.
        baseline.cpu.machine_cores = Some(1.2);
        let idle = outcome(ConfigName::Redis, vec![baseline]);
        let check = mesh_vs_redis_throughput(&[sticky, idle, tcp], &[64], 2);
        assert!(!check.measured.contains("at most"), "{check:?}");
    }

    #[test]
    fn round_robin_throughput_counts_tools_calls_at_the_best_level() {
        let mut slow = sample("round-robin", 8, 500, 5000.0);
        slow.tools_call_latency.count = 20_000; // 4,000/s over 5 s
        let mut fast = sample("round-robin", 64, 500, 12_000.0);
        fast.tools_call_latency.count = 55_000; // 11,000/s
        let check = round_robin_throughput(&[outcome(ConfigName::RoundRobin, vec![slow, fast])]);
        assert_eq!(check.verdict, Verdict::Met, "{check:?}");
        assert!(
            check.measured.starts_with("11,000 tools/call/s at c=64"),
            "{check:?}"
        );
    }

    #[test]
    fn redis_commands_per_request_are_judged_on_the_worst_run() {
        let mut busy = sample("quic", 64, 100, 1.0);
        busy.redis_commands_per_request = Some(2.0);
        let calm = sample("sticky", 64, 100, 1.0);
        let check = no_redis_per_request(&[
            outcome(ConfigName::Sticky, vec![calm.clone()]),
            outcome(ConfigName::Quic, vec![busy]),
        ]);
        assert_eq!(check.verdict, Verdict::Missed);
        // The Redis baseline is expected to use Redis; it is not judged here.
        let mut baseline = sample("redis", 64, 100, 1.0);
        baseline.redis_commands_per_request = Some(2.0);
        let check = no_redis_per_request(&[
            outcome(ConfigName::Sticky, vec![calm]),
            outcome(ConfigName::Redis, vec![baseline]),
        ]);
        assert_eq!(check.verdict, Verdict::Met);
    }
}
