//! The compare chart, as hand-written SVG (no plotting dependency): latency bars
//! (p50 and p99) and throughput bars per configuration at one concurrency level,
//! then p99 latency and throughput over concurrency, one line per configuration,
//! and, after an open-loop sweep (`--rates`), p99 latency over the offered rate.
//! Latency axes are logarithmic, because the configurations differ by orders of
//! magnitude under load; throughput axes are linear from zero.

use std::fmt::Write;

use super::compare::CompareReport;

/// One configuration's figures at one concurrency level.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub rps: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    /// Aligned with [`ChartData::concurrency`]; None where the run is missing.
    pub points: Vec<Option<Point>>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ChartData {
    pub title: String,
    pub concurrency: Vec<usize>,
    pub series: Vec<Series>,
    /// Offered rates of the open-loop sweep (req/s); empty without one.
    pub rates: Vec<f64>,
    /// Aligned with [`ChartData::rates`]; `rps` is the achieved rate.
    pub rate_series: Vec<Series>,
}

impl ChartData {
    pub fn from_report(report: &CompareReport) -> ChartData {
        let concurrency = report.settings.concurrency.clone();
        let series = report
            .configurations
            .iter()
            .filter(|c| !c.runs.is_empty())
            .map(|c| Series {
                name: c.name.to_string(),
                points: concurrency
                    .iter()
                    .map(|&level| {
                        c.runs.iter().find(|r| r.sessions == level).map(|r| Point {
                            p50_ms: r.latency.p50_us as f64 / 1000.0,
                            p99_ms: r.latency.p99_us as f64 / 1000.0,
                            rps: r.throughput_rps,
                        })
                    })
                    .collect(),
            })
            .collect();
        let rates = report.settings.rates.clone();
        let rate_series = report
            .configurations
            .iter()
            .filter(|c| !c.sweep.is_empty())
            .map(|c| Series {
                name: c.name.to_string(),
                points: rates
                    .iter()
                    .map(|&rate| {
                        c.sweep
                            .iter()
                            .find(|r| r.offered_rps == Some(rate))
                            .map(|r| Point {
                                p50_ms: r.latency.p50_us as f64 / 1000.0,
                                p99_ms: r.latency.p99_us as f64 / 1000.0,
                                rps: r.throughput_rps,
                            })
                    })
                    .collect(),
            })
            .collect();
        ChartData {
            title: format!(
                "mcpgw-bench compare {} — {} cores, {} workers, mix {}",
                report.started_utc,
                report.machine.cores,
                report.settings.workers,
                report.settings.mix
            ),
            concurrency,
            series,
            rates,
            rate_series,
        }
    }

    /// The level the bar panels show: the middle of the sweep (the upper middle of
    /// an even count, where the machine is busy but not yet saturated).
    fn reference(&self) -> Option<(usize, usize)> {
        let index = self.concurrency.len() / 2;
        Some((index, *self.concurrency.get(index)?))
    }
}

const WIDTH: f64 = 1000.0;
const HEIGHT: f64 = 800.0;
/// Extra height for the open-loop panel, drawn only after a rate sweep.
const RATE_PANEL_HEIGHT: f64 = 340.0;
const PALETTE: [&str; 8] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#9c755f",
];

fn color(index: usize) -> &'static str {
    PALETTE[index % PALETTE.len()]
}

/// A rectangle of the canvas a panel draws into.
#[derive(Debug, Clone, Copy)]
struct Frame {
    x: f64,
    y: f64,
    w: f64,
    h: f64,
}

/// A value axis: linear from zero, or logarithmic over whole decades.
#[derive(Debug, Clone, Copy)]
enum Scale {
    Linear { max: f64 },
    Log { lo_exp: i32, hi_exp: i32 },
}

impl Scale {
    fn linear(values: impl Iterator<Item = f64>) -> Scale {
        Scale::Linear {
            max: nice_ceiling(values.fold(0.0, f64::max)),
        }
    }

    fn log(values: impl Iterator<Item = f64>) -> Scale {
        let (lo, hi) = values
            .filter(|v| *v > 0.0 && v.is_finite())
            .fold((f64::INFINITY, 0.0f64), |(lo, hi), v| {
                (lo.min(v), hi.max(v))
            });
        if !lo.is_finite() {
            return Scale::Log {
                lo_exp: -1,
                hi_exp: 1,
            };
        }
        let lo_exp = lo.log10().floor() as i32;
        let hi_exp = (hi.log10().ceil() as i32).max(lo_exp + 1);
        Scale::Log { lo_exp, hi_exp }
    }

    /// 0.0 at the bottom of the axis, 1.0 at the top.
    fn fraction(self, value: f64) -> f64 {
        let f = match self {
            Scale::Linear { max } => value / max,
            Scale::Log { lo_exp, hi_exp } => {
                if value <= 0.0 {
                    0.0
                } else {
                    (value.log10() - f64::from(lo_exp)) / f64::from(hi_exp - lo_exp)
                }
            }
        };
        if f.is_finite() {
            f.clamp(0.0, 1.0)
        } else {
            0.0
        }
    }

    fn ticks(self) -> Vec<f64> {
        match self {
            Scale::Linear { max } => (0..=4).map(|i| max * f64::from(i) / 4.0).collect(),
            Scale::Log { lo_exp, hi_exp } => (lo_exp..=hi_exp).map(|e| 10f64.powi(e)).collect(),
        }
    }
}

/// The smallest 1, 2 or 5 × 10^k at or above `value` (1 for nothing).
pub fn nice_ceiling(value: f64) -> f64 {
    if value <= 0.0 || !value.is_finite() {
        return 1.0;
    }
    let magnitude = 10f64.powf(value.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|candidate| *candidate >= value * (1.0 - 1e-12))
        .unwrap_or(10.0 * magnitude)
}

fn label(value: f64) -> String {
    if value >= 1000.0 {
        let thousands = value / 1000.0;
        if thousands.fract().abs() < 1e-9 {
            format!("{thousands:.0}k")
        } else {
            format!("{thousands:.1}k")
        }
    } else if value >= 1.0 || value == 0.0 {
        format!("{value:.0}")
    } else {
        // 0.1, 0.01: as many decimals as the value needs.
        let decimals = (-value.log10()).ceil().max(1.0) as usize;
        format!("{value:.decimals$}")
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Renders the chart. Every coordinate is finite whatever the data.
pub fn chart(data: &ChartData) -> String {
    let mut svg = String::new();
    let height = if data.rates.is_empty() {
        HEIGHT
    } else {
        HEIGHT + RATE_PANEL_HEIGHT
    };
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        svg,
        r#"<rect width="{WIDTH}" height="{height}" fill="white"/>"#
    );
    text(&mut svg, WIDTH / 2.0, 24.0, "middle", 15.0, &data.title);
    legend(&mut svg, data);
    if let Some((index, level)) = data.reference() {
        latency_bars(
            &mut svg,
            data,
            index,
            Frame {
                x: 70.0,
                y: 90.0,
                w: 520.0,
                h: 270.0,
            },
            &format!("Latency at {level} sessions (ms, log scale): p50 solid, p99 light"),
        );
        throughput_bars(
            &mut svg,
            data,
            index,
            Frame {
                x: 680.0,
                y: 90.0,
                w: 290.0,
                h: 270.0,
            },
            &format!("Throughput at {level} sessions (req/s)"),
        );
    }
    over_concurrency(
        &mut svg,
        data,
        Frame {
            x: 70.0,
            y: 460.0,
            w: 400.0,
            h: 270.0,
        },
        "p99 latency by concurrency (ms, log scale)",
        true,
    );
    over_concurrency(
        &mut svg,
        data,
        Frame {
            x: 570.0,
            y: 460.0,
            w: 400.0,
            h: 270.0,
        },
        "Throughput by concurrency (req/s)",
        false,
    );
    if !data.rates.is_empty() {
        let labels: Vec<String> = data.rates.iter().map(|&r| label(r)).collect();
        over_levels(
            &mut svg,
            &labels,
            &data.rate_series,
            Frame {
                x: 70.0,
                y: HEIGHT + 20.0,
                w: 900.0,
                h: RATE_PANEL_HEIGHT - 80.0,
            },
            "Open loop: p99 latency by offered rate (ms, log scale; from the intended send time)",
            "offered requests/s",
            true,
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn text(svg: &mut String, x: f64, y: f64, anchor: &str, size: f64, content: &str) {
    let _ = writeln!(
        svg,
        r#"<text x="{x:.1}" y="{y:.1}" text-anchor="{anchor}" font-size="{size}">{}</text>"#,
        escape(content)
    );
}

fn legend(svg: &mut String, data: &ChartData) {
    let mut x = 70.0;
    for (i, series) in data.series.iter().enumerate() {
        let _ = writeln!(
            svg,
            r#"<rect x="{x:.1}" y="42" width="12" height="12" fill="{}"/>"#,
            color(i)
        );
        text(svg, x + 16.0, 52.0, "start", 12.0, &series.name);
        x += 28.0 + 7.5 * series.name.len() as f64;
    }
}

/// Axis lines, tick labels and grid for a value axis on the left of `frame`.
fn axes(svg: &mut String, frame: Frame, scale: Scale, title: &str) {
    text(svg, frame.x, frame.y - 12.0, "start", 13.0, title);
    for tick in scale.ticks() {
        let y = frame.y + frame.h * (1.0 - scale.fraction(tick));
        let _ = writeln!(
            svg,
            r##"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/>"##,
            frame.x,
            frame.x + frame.w
        );
        text(svg, frame.x - 6.0, y + 4.0, "end", 11.0, &label(tick));
    }
    let _ = writeln!(
        svg,
        r##"<polyline points="{:.1},{:.1} {:.1},{:.1} {:.1},{:.1}" fill="none" stroke="#333"/>"##,
        frame.x,
        frame.y,
        frame.x,
        frame.y + frame.h,
        frame.x + frame.w,
        frame.y + frame.h
    );
}

/// A bar from the bottom of `frame`; `(x, w)` is its horizontal span.
fn bar(
    svg: &mut String,
    frame: Frame,
    scale: Scale,
    (x, w): (f64, f64),
    value: f64,
    fill: &str,
    opacity: f64,
) {
    let h = frame.h * scale.fraction(value);
    let _ = writeln!(
        svg,
        r#"<rect x="{x:.1}" y="{:.1}" width="{w:.1}" height="{h:.1}" fill="{fill}" fill-opacity="{opacity}"><title>{}</title></rect>"#,
        frame.y + frame.h - h,
        label_value(value)
    );
}

/// A latency in ms with two significant digits or more: 0.46, 1.6, 38.
fn short_ms(value: f64) -> String {
    if value >= 10.0 {
        format!("{value:.0}")
    } else if value >= 1.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

fn label_value(value: f64) -> String {
    if value >= 100.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.3}")
    }
}

fn latency_bars(svg: &mut String, data: &ChartData, index: usize, frame: Frame, title: &str) {
    let points: Vec<(usize, &Series, Point)> = data
        .series
        .iter()
        .enumerate()
        .filter_map(|(i, s)| Some((i, s, (*s.points.get(index)?)?)))
        .collect();
    let scale = Scale::log(points.iter().flat_map(|(_, _, p)| [p.p50_ms, p.p99_ms]));
    axes(svg, frame, scale, title);
    let slot = frame.w / points.len().max(1) as f64;
    for (n, (i, series, point)) in points.iter().enumerate() {
        let x = frame.x + slot * n as f64 + slot * 0.15;
        let w = slot * 0.35;
        bar(svg, frame, scale, (x, w), point.p50_ms, color(*i), 1.0);
        bar(svg, frame, scale, (x + w, w), point.p99_ms, color(*i), 0.45);
        for (offset, value) in [(0.0, point.p50_ms), (w, point.p99_ms)] {
            let y = frame.y + frame.h * (1.0 - scale.fraction(value)) - 3.0;
            text(
                svg,
                x + offset + w / 2.0,
                y,
                "middle",
                9.0,
                &short_ms(value),
            );
        }
        text(
            svg,
            x + w,
            frame.y + frame.h + 16.0,
            "middle",
            11.0,
            &series.name,
        );
    }
}

fn throughput_bars(svg: &mut String, data: &ChartData, index: usize, frame: Frame, title: &str) {
    // Bars in legend colours; the panel is too narrow for names under them.
    let points: Vec<(usize, Point)> = data
        .series
        .iter()
        .enumerate()
        .filter_map(|(i, s)| Some((i, (*s.points.get(index)?)?)))
        .collect();
    let scale = Scale::linear(points.iter().map(|(_, p)| p.rps));
    axes(svg, frame, scale, title);
    let slot = frame.w / points.len().max(1) as f64;
    for (n, (i, point)) in points.iter().enumerate() {
        let x = frame.x + slot * n as f64 + slot * 0.15;
        bar(
            svg,
            frame,
            scale,
            (x, slot * 0.7),
            point.rps,
            color(*i),
            1.0,
        );
        let y = frame.y + frame.h * (1.0 - scale.fraction(point.rps)) - 3.0;
        text(
            svg,
            x + slot * 0.35,
            y,
            "middle",
            9.0,
            &label(point.rps.round()),
        );
    }
}

fn over_concurrency(svg: &mut String, data: &ChartData, frame: Frame, title: &str, latency: bool) {
    let labels: Vec<String> = data.concurrency.iter().map(usize::to_string).collect();
    over_levels(
        svg,
        &labels,
        &data.series,
        frame,
        title,
        "concurrent sessions",
        latency,
    );
}

/// One line per series over evenly spaced levels (concurrency, offered rate).
fn over_levels(
    svg: &mut String,
    labels: &[String],
    series: &[Series],
    frame: Frame,
    title: &str,
    x_title: &str,
    latency: bool,
) {
    let value = |p: &Point| if latency { p.p99_ms } else { p.rps };
    let all = series
        .iter()
        .flat_map(|s| s.points.iter().flatten().map(value));
    let scale = if latency {
        Scale::log(all)
    } else {
        Scale::linear(all)
    };
    axes(svg, frame, scale, title);
    let levels = labels.len().max(1);
    let step = frame.w / levels as f64;
    let x_of = |i: usize| frame.x + step * (i as f64 + 0.5);
    for (i, level) in labels.iter().enumerate() {
        text(
            svg,
            x_of(i),
            frame.y + frame.h + 16.0,
            "middle",
            11.0,
            level,
        );
    }
    text(
        svg,
        frame.x + frame.w / 2.0,
        frame.y + frame.h + 32.0,
        "middle",
        11.0,
        x_title,
    );
    for (s, series) in series.iter().enumerate() {
        let coords: Vec<String> = series
            .points
            .iter()
            .enumerate()
            .filter_map(|(i, p)| {
                let p = p.as_ref()?;
                let y = frame.y + frame.h * (1.0 - scale.fraction(value(p)));
                Some(format!("{:.1},{y:.1}", x_of(i)))
            })
            .collect();
        if coords.is_empty() {
            continue;
        }
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"/>"#,
            coords.join(" "),
            color(s)
        );
        for coord in &coords {
            if let Some((x, y)) = coord.split_once(',') {
                let _ = writeln!(
                    svg,
                    r#"<circle cx="{x}" cy="{y}" r="3" fill="{}"/>"#,
                    color(s)
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data() -> ChartData {
        let point = |p50_ms, rps| {
            Some(Point {
                p50_ms,
                p99_ms: p50_ms * 4.0,
                rps,
            })
        };
        ChartData {
            title: "compare <test> & co".into(),
            concurrency: vec![8, 64, 512],
            series: vec![
                Series {
                    name: "sticky".into(),
                    points: vec![
                        point(0.2, 9000.0),
                        point(2.0, 20000.0),
                        point(20.0, 21000.0),
                    ],
                },
                Series {
                    name: "redis".into(),
                    points: vec![point(0.9, 3000.0), None, point(90.0, 4000.0)],
                },
            ],
            rates: vec![],
            rate_series: vec![],
        }
    }

    #[test]
    fn a_rate_sweep_adds_a_line_per_configuration_over_the_offered_rate() {
        let mut data = data();
        let without = chart(&data);
        assert!(!without.contains("offered requests/s"));
        data.rates = vec![1000.0, 2000.0, 4000.0];
        data.rate_series = data.series.clone();
        let svg = chart(&data);
        assert!(svg.contains("offered requests/s") && svg.contains(">2k</text>"));
        assert!(
            svg.contains(r#"height="1140""#),
            "the canvas grows for the panel"
        );
        // Four lines as before, plus one per configuration over the offered rate.
        assert_eq!(svg.matches("stroke-width=\"2\"").count(), 6);
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
    }

    #[test]
    fn the_chart_is_one_wellformed_svg_with_every_series() {
        let svg = chart(&data());
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(
            svg.contains("compare &lt;test&gt; &amp; co"),
            "titles are escaped"
        );
        for name in ["sticky", "redis"] {
            assert!(
                svg.contains(&format!(">{name}</text>")),
                "{name} in the legend"
            );
        }
        // Two lines per panel at most, one per series.
        assert_eq!(svg.matches("stroke-width=\"2\"").count(), 4);
        // Reference level 64: redis has no run there, so only sticky's bars are drawn.
        assert!(svg.contains("Latency at 64 sessions"));
        assert_eq!(
            svg.matches("<title>").count(),
            3,
            "p50, p99 and throughput of sticky"
        );
        for bad in ["NaN", "inf"] {
            assert!(!svg.contains(bad), "{bad} in the chart");
        }
        assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count());
    }

    #[test]
    fn an_empty_report_still_renders() {
        let svg = chart(&ChartData {
            title: "empty".into(),
            concurrency: vec![],
            series: vec![],
            rates: vec![],
            rate_series: vec![],
        });
        assert!(svg.contains("</svg>") && !svg.contains("NaN"));
    }

    #[test]
    fn axes_round_to_readable_values() {
        assert_eq!(nice_ceiling(0.0), 1.0);
        assert_eq!(nice_ceiling(7.0), 10.0);
        assert_eq!(nice_ceiling(12_345.0), 20_000.0);
        assert_eq!(nice_ceiling(5000.0), 5000.0);
        assert_eq!(label(20_000.0), "20k");
        assert_eq!(label(2500.0), "2.5k");
        assert_eq!(label(0.01), "0.01");
        assert_eq!(label(1.0), "1");
        let scale = Scale::log([0.25, 40.0].into_iter());
        assert_eq!(scale.ticks(), vec![0.1, 1.0, 10.0, 100.0]);
        assert_eq!(scale.fraction(1.0), 1.0 / 3.0);
    }
}
