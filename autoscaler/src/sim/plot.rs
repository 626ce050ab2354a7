//! The figures, as SVG: utilisation and running trainers over time ([`svg`]), and the
//! distribution of job completion times ([`jct_cdf`]), one line per policy.

use std::fmt::Write as _;

use crate::sim::SimResult;

const COLORS: [&str; 4] = ["#7f7f7f", "#d62728", "#1f77b4", "#2ca02c"];
const W: f64 = 900.0;
const PANEL_H: f64 = 220.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const GAP: f64 = 60.0;

/// An SVG with two panels for `results` (one run per policy on one scenario):
/// utilisation (GPU when the cluster has GPUs, else CPU) and trainers running.
pub fn svg(title: &str, results: &[SimResult]) -> String {
    let gpu = results.iter().any(|r| r.gpu_util.is_some());
    let t_max = results
        .iter()
        .flat_map(|r| r.samples.iter().map(|s| s.t))
        .fold(1.0, f64::max);
    let trainers_max = results
        .iter()
        .flat_map(|r| r.samples.iter().map(|s| s.trainers))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let h = TOP + 2.0 * PANEL_H + GAP + 50.0;
    let mut out = header(title, h);
    let (hours, unit) = if t_max > 4.0 * 3600.0 {
        (3600.0, "h")
    } else {
        (1.0, "s")
    };
    let panels = [
        (
            if gpu {
                "GPU utilisation (%)"
            } else {
                "CPU utilisation (%)"
            },
            100.0,
            TOP,
        ),
        ("trainers running", trainers_max, TOP + PANEL_H + GAP),
    ];
    let pw = W - LEFT - RIGHT;
    for (p, (label, y_max, y0)) in panels.iter().enumerate() {
        let _ = writeln!(
            out,
            r##"<rect x="{LEFT}" y="{y0}" width="{pw}" height="{PANEL_H}" fill="none" stroke="#333"/>"##
        );
        let _ = writeln!(
            out,
            r#"<text x="14" y="{}" transform="rotate(-90 14 {})" text-anchor="middle">{label}</text>"#,
            y0 + PANEL_H / 2.0,
            y0 + PANEL_H / 2.0
        );
        for k in 0..=4 {
            let v = y_max * f64::from(k) / 4.0;
            let y = y0 + PANEL_H - PANEL_H * f64::from(k) / 4.0;
            let _ = writeln!(
                out,
                r##"<line x1="{LEFT}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{v:.0}</text>"##,
                LEFT + pw,
                LEFT - 6.0,
                y + 4.0
            );
        }
        for k in 0..=5 {
            let t = t_max * f64::from(k) / 5.0;
            let x = LEFT + pw * f64::from(k) / 5.0;
            let _ = writeln!(
                out,
                r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{:.0}{unit}</text>"#,
                y0 + PANEL_H + 16.0,
                t / hours
            );
        }
        for (i, r) in results.iter().enumerate() {
            let mut points = String::new();
            for s in &r.samples {
                let v = if p == 0 {
                    100.0 * if gpu { s.gpu } else { s.cpu }
                } else {
                    f64::from(s.trainers)
                };
                let x = LEFT + pw * s.t / t_max;
                let y = y0 + PANEL_H - PANEL_H * (v / y_max).clamp(0.0, 1.0);
                let _ = write!(points, "{x:.1},{y:.1} ");
            }
            polyline(&mut out, i, &points);
        }
    }
    legend(&mut out, results, h);
    out
}

/// An SVG of the cumulative distribution of job completion times, one step line per
/// policy, the times on a log scale (they span seconds to days on real workloads).
pub fn jct_cdf(title: &str, results: &[SimResult]) -> String {
    let jcts: Vec<Vec<f64>> = results
        .iter()
        .map(|r| {
            let mut v: Vec<f64> = r
                .jobs
                .iter()
                .filter_map(|j| j.completion)
                .filter(|t| *t > 0.0)
                .collect();
            v.sort_by(f64::total_cmp);
            v
        })
        .collect();
    let lo = jcts.iter().flatten().copied().fold(f64::INFINITY, f64::min);
    let hi = jcts.iter().flatten().copied().fold(0.0, f64::max);
    let (lo, hi) = if lo.is_finite() && hi > lo {
        (lo.log10().floor(), hi.log10().ceil())
    } else {
        (0.0, 1.0)
    };
    let h = TOP + PANEL_H + 80.0;
    let pw = W - LEFT - RIGHT;
    let x_of = |t: f64| LEFT + pw * (t.log10() - lo) / (hi - lo);
    let y_of = |f: f64| TOP + PANEL_H - PANEL_H * f;
    let mut out = header(title, h);
    let _ = writeln!(
        out,
        r##"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{PANEL_H}" fill="none" stroke="#333"/>"##
    );
    let _ = writeln!(
        out,
        r#"<text x="14" y="{0}" transform="rotate(-90 14 {0})" text-anchor="middle">jobs done (%)</text>"#,
        TOP + PANEL_H / 2.0
    );
    for k in 0..=4 {
        let y = y_of(f64::from(k) / 4.0);
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT + pw,
            LEFT - 6.0,
            y + 4.0,
            25 * k
        );
    }
    let mut decade = lo;
    while decade <= hi {
        let x = x_of(10f64.powf(decade));
        let _ = writeln!(
            out,
            r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}s</text>"#,
            TOP + PANEL_H + 16.0,
            10f64.powf(decade)
        );
        decade += 1.0;
    }
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">job completion time (log scale)</text>"#,
        LEFT + pw / 2.0,
        TOP + PANEL_H + 34.0
    );
    for (i, (r, v)) in results.iter().zip(&jcts).enumerate() {
        let n = r.jobs.len().max(1) as f64;
        let mut points = format!("{:.1},{:.1} ", LEFT, y_of(0.0));
        for (k, t) in v.iter().enumerate() {
            let x = x_of(*t);
            let _ = write!(
                points,
                "{x:.1},{:.1} {x:.1},{:.1} ",
                y_of(k as f64 / n),
                y_of((k + 1) as f64 / n)
            );
        }
        polyline(&mut out, i, &points);
    }
    legend(&mut out, results, h);
    out
}

/// Policy `i`'s line through `points` ("x,y x,y ...").
fn polyline(out: &mut String, i: usize, points: &str) {
    let _ = writeln!(
        out,
        r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>"#,
        COLORS[i % COLORS.len()],
        points.trim_end()
    );
}

/// The start of a figure `h` high: its size, a white ground and `title`.
fn header(title: &str, h: f64) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="22" font-size="15">{}</text>"#,
        escape(title)
    );
    out
}

/// The policies' colours along the bottom of a figure `h` high, and its end.
fn legend(out: &mut String, results: &[SimResult], h: f64) {
    let legend_y = h - 18.0;
    for (i, r) in results.iter().enumerate() {
        let x = LEFT + 160.0 * i as f64;
        let _ = writeln!(
            out,
            r#"<line x1="{x}" x2="{}" y1="{legend_y}" y2="{legend_y}" stroke="{}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            x + 24.0,
            COLORS[i % COLORS.len()],
            x + 30.0,
            legend_y + 4.0,
            escape(&r.policy)
        );
    }
    out.push_str("</svg>\n");
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
