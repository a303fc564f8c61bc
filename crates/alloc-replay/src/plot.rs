//! Hand-written SVG line charts of memory (bytes) against a generic x axis.
//!
//! [`render_svg`] draws one [`Chart`]; [`render_panels`] lays several out in a grid in one
//! SVG document. The y axis is always in bytes and labelled in binary units (see
//! [`human_bytes`]); the x axis is a plain number (event index, time, ...). Series longer
//! than [`MAX_POINTS`] are reduced with [`downsample`], which keeps every bucket's minimum
//! and maximum so that peaks survive. Non-finite points are dropped.

use std::fmt::Write as _;

/// One line on a chart.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Series {
    /// Legend text.
    pub label: String,
    /// `(x, y)` points in drawing order; y is in bytes.
    pub points: Vec<(f64, f64)>,
    /// Draw the line dashed instead of solid.
    pub dashed: bool,
}

/// A line chart: a title, axis labels and any number of series.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Chart {
    /// Title drawn above the plot area.
    pub title: String,
    /// Label of the x axis.
    pub x_label: String,
    /// Label of the y axis (the values are bytes).
    pub y_label: String,
    /// The lines, coloured by their index in this list.
    pub series: Vec<Series>,
}

/// Series with more points than this are downsampled before drawing.
pub const MAX_POINTS: usize = 4000;

/// Width of one chart panel in SVG user units.
const PANEL_W: f64 = 720.0;
/// Height of one chart panel in SVG user units.
const PANEL_H: f64 = 420.0;
const MARGIN_LEFT: f64 = 84.0;
const MARGIN_RIGHT: f64 = 24.0;
const MARGIN_TOP: f64 = 40.0;
const MARGIN_BOTTOM: f64 = 56.0;
/// Series colours (matplotlib's tab10), used in order and then repeated.
const PALETTE: [&str; 10] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

/// Renders one chart as a self-contained SVG document.
pub fn render_svg(chart: &Chart) -> String {
    render_panels(std::slice::from_ref(chart), 1)
}

/// Renders several charts in one SVG document, in a grid of `columns` columns (at least one),
/// filled row by row.
pub fn render_panels(charts: &[Chart], columns: usize) -> String {
    let columns = columns.clamp(1, charts.len().max(1));
    let rows = charts.len().div_ceil(columns).max(1);
    let (width, height) = (PANEL_W * columns as f64, PANEL_H * rows as f64);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        out,
        r#"<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>"#
    );
    for (i, chart) in charts.iter().enumerate() {
        let (col, row) = (i % columns, i / columns);
        let _ = writeln!(
            out,
            r#"<g transform="translate({},{})">"#,
            col as f64 * PANEL_W,
            row as f64 * PANEL_H
        );
        render_panel(&mut out, chart);
        out.push_str("</g>\n");
    }
    out.push_str("</svg>\n");
    out
}

/// Formats a byte count in binary units with up to two decimals: `512 B`, `1.5 KiB`,
/// `14.24 GiB`.
pub fn human_bytes(bytes: u64) -> String {
    let (value, unit) = alloc_core::scale_bytes(bytes);
    format!("{} {unit}", trim_decimals(value, 2))
}

/// Reduces `points` to at most `max_points` (at least 4) points, keeping the first and last
/// point and, for each of `(max_points - 2) / 2` consecutive index buckets of the points in
/// between, the points with the smallest and largest y, in their original order, so peaks
/// and troughs survive. Inputs no longer than `max_points` are returned unchanged.
pub fn downsample(points: &[(f64, f64)], max_points: usize) -> Vec<(f64, f64)> {
    let max_points = max_points.max(4);
    let n = points.len();
    if n <= max_points {
        return points.to_vec();
    }
    let inner = &points[1..n - 1];
    let buckets = (max_points - 2) / 2;
    let mut out = Vec::with_capacity(max_points);
    out.push(points[0]);
    for b in 0..buckets {
        let bucket = &inner[b * inner.len() / buckets..(b + 1) * inner.len() / buckets];
        if bucket.is_empty() {
            continue;
        }
        let (mut lo, mut hi) = (0, 0);
        for (i, p) in bucket.iter().enumerate() {
            if p.1 < bucket[lo].1 {
                lo = i;
            }
            if p.1 > bucket[hi].1 {
                hi = i;
            }
        }
        out.push(bucket[lo.min(hi)]);
        if lo != hi {
            out.push(bucket[lo.max(hi)]);
        }
    }
    out.push(points[n - 1]);
    out
}

/// Draws one chart into a `PANEL_W` x `PANEL_H` area at the origin.
fn render_panel(out: &mut String, chart: &Chart) {
    let series: Vec<Vec<(f64, f64)>> = chart
        .series
        .iter()
        .map(|s| {
            let finite: Vec<(f64, f64)> = s
                .points
                .iter()
                .copied()
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .collect();
            downsample(&finite, MAX_POINTS)
        })
        .collect();
    let all = || series.iter().flatten();
    let (x_min, x_max) = bounds(all().map(|p| p.0)).unwrap_or((0.0, 1.0));
    let (y_min, y_max) = bounds(all().map(|p| p.1)).unwrap_or((0.0, 0.0));
    let (x0, x1) = if x_max > x_min {
        (x_min, x_max)
    } else {
        (x_min, x_min + 1.0)
    };
    let y = ByteAxis::new(y_min.min(0.0), y_max.max(0.0));

    let (left, top) = (MARGIN_LEFT, MARGIN_TOP);
    let (pw, ph) = (
        PANEL_W - MARGIN_LEFT - MARGIN_RIGHT,
        PANEL_H - MARGIN_TOP - MARGIN_BOTTOM,
    );
    let px = |x: f64| left + (x - x0) / (x1 - x0) * pw;
    let py = |v: f64| top + ph - (v - y.lo) / (y.hi - y.lo) * ph;
    let (right, bottom) = (left + pw, top + ph);

    // Title and axis labels.
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="24" text-anchor="middle" font-size="15" font-weight="bold">{}</text>"#,
        PANEL_W / 2.0,
        escape(&chart.title)
    );
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
        left + pw / 2.0,
        PANEL_H - 12.0,
        escape(&chart.x_label)
    );
    let _ = writeln!(
        out,
        r#"<text transform="translate(16,{:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        top + ph / 2.0,
        escape(&chart.y_label)
    );

    // Y grid and ticks.
    for (value, label) in y.ticks() {
        let yy = py(value);
        let _ = writeln!(
            out,
            r##"<line x1="{left:.2}" y1="{yy:.2}" x2="{right:.2}" y2="{yy:.2}" stroke="#e0e0e0"/>"##
        );
        let _ = writeln!(
            out,
            r#"<text x="{:.2}" y="{:.2}" text-anchor="end" dominant-baseline="middle">{}</text>"#,
            left - 6.0,
            yy,
            escape(&label)
        );
    }
    // X ticks.
    for value in x_ticks(x0, x1) {
        let xx = px(value);
        let _ = writeln!(
            out,
            r#"<line x1="{xx:.2}" y1="{bottom:.2}" x2="{xx:.2}" y2="{:.2}" stroke="black"/>"#,
            bottom + 5.0
        );
        let _ = writeln!(
            out,
            r#"<text x="{xx:.2}" y="{:.2}" text-anchor="middle">{}</text>"#,
            bottom + 18.0,
            escape(&compact_number(value))
        );
    }
    // Axes.
    let _ = writeln!(
        out,
        r#"<line x1="{left:.2}" y1="{top:.2}" x2="{left:.2}" y2="{bottom:.2}" stroke="black"/>"#
    );
    let _ = writeln!(
        out,
        r#"<line x1="{left:.2}" y1="{bottom:.2}" x2="{right:.2}" y2="{bottom:.2}" stroke="black"/>"#
    );

    // Series.
    for (i, (s, points)) in chart.series.iter().zip(&series).enumerate() {
        let mut coords = String::with_capacity(points.len() * 16);
        for (j, &(x, v)) in points.iter().enumerate() {
            if j > 0 {
                coords.push(' ');
            }
            let _ = write!(coords, "{:.2},{:.2}", px(x), py(v));
        }
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{}" stroke-width="1.5"{} points="{coords}"/>"#,
            colour(i),
            dash(s.dashed)
        );
    }

    // Legend, top left inside the plot area.
    if !chart.series.is_empty() {
        let longest = chart
            .series
            .iter()
            .map(|s| s.label.chars().count())
            .max()
            .unwrap_or(0);
        let (lx, ly) = (left + 10.0, top + 8.0);
        let _ = writeln!(
            out,
            r##"<rect x="{lx:.2}" y="{ly:.2}" width="{:.2}" height="{:.2}" fill="white" fill-opacity="0.85" stroke="#c0c0c0"/>"##,
            40.0 + longest as f64 * 7.0,
            8.0 + 16.0 * chart.series.len() as f64
        );
        for (i, s) in chart.series.iter().enumerate() {
            let row = ly + 12.0 + 16.0 * i as f64;
            let _ = writeln!(
                out,
                r#"<line x1="{:.2}" y1="{row:.2}" x2="{:.2}" y2="{row:.2}" stroke="{}" stroke-width="2"{}/>"#,
                lx + 6.0,
                lx + 28.0,
                colour(i),
                dash(s.dashed)
            );
            let _ = writeln!(
                out,
                r#"<text x="{:.2}" y="{row:.2}" dominant-baseline="middle">{}</text>"#,
                lx + 34.0,
                escape(&s.label)
            );
        }
    }
}

fn colour(index: usize) -> &'static str {
    PALETTE[index % PALETTE.len()]
}

fn dash(dashed: bool) -> &'static str {
    if dashed {
        r#" stroke-dasharray="6 4""#
    } else {
        ""
    }
}

/// Minimum and maximum of an iterator of finite values, `None` when empty.
fn bounds(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values.fold(None, |acc, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    })
}

/// The "nice" step (1, 2, 2.5 or 5 times a power of ten) that divides `range` into the
/// number of intervals closest to `target`.
fn nice_step(range: f64, target: f64) -> f64 {
    let raw = range / target;
    if !(raw.is_finite() && raw > 0.0) {
        return 1.0;
    }
    let magnitude = 10f64.powf(raw.log10().floor());
    let score = |step: f64| (range / step - target).abs();
    [0.1, 1.0, 10.0]
        .iter()
        .flat_map(|scale| [1.0, 2.0, 2.5, 5.0].map(|m| m * scale * magnitude))
        .fold(magnitude, |best, step| {
            if score(step) < score(best) {
                step
            } else {
                best
            }
        })
}

/// A y axis in bytes: nice bounds, a step, and one binary unit for all tick labels.
struct ByteAxis {
    lo: f64,
    hi: f64,
    step: f64,
    unit: f64,
    unit_name: &'static str,
}

impl ByteAxis {
    /// Target number of tick intervals.
    const TICKS: f64 = 5.0;

    fn new(lo: f64, hi: f64) -> Self {
        let hi = if hi > lo { hi } else { lo + 1024.0 };
        let magnitude = lo.abs().max(hi.abs());
        let (unit, unit_name) = [
            (1u64 << 50, "PiB"),
            (1 << 40, "TiB"),
            (1 << 30, "GiB"),
            (1 << 20, "MiB"),
            (1 << 10, "KiB"),
        ]
        .into_iter()
        .map(|(u, n)| (u as f64, n))
        .find(|(u, _)| magnitude >= *u)
        .unwrap_or((1.0, "B"));
        let mut step = nice_step((hi - lo) / unit, Self::TICKS) * unit;
        if unit_name == "B" {
            step = step.max(1.0);
        }
        ByteAxis {
            lo: (lo / step).floor() * step,
            hi: (hi / step).ceil() * step,
            step,
            unit,
            unit_name,
        }
    }

    /// Tick positions and labels from `lo` to `hi`.
    fn ticks(&self) -> Vec<(f64, String)> {
        let count = ((self.hi - self.lo) / self.step).round() as i64;
        (0..=count)
            .map(|i| {
                let v = self.lo + i as f64 * self.step;
                let label = if v == 0.0 {
                    "0".to_string()
                } else {
                    format!("{} {}", trim_decimals(v / self.unit, 2), self.unit_name)
                };
                (v, label)
            })
            .collect()
    }
}

/// Tick positions: the multiples of a nice step within `[lo, hi]`.
fn x_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let step = nice_step(hi - lo, 5.0);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step).floor() as i64;
    (first..=last).map(|i| i as f64 * step).collect()
}

/// Formats a number compactly: `950`, `1.5k`, `250k`, `3M`, `1.25G`.
fn compact_number(v: f64) -> String {
    let a = v.abs();
    let (scaled, suffix) = if a >= 1e9 {
        (v / 1e9, "G")
    } else if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e3 {
        (v / 1e3, "k")
    } else {
        (v, "")
    };
    format!("{}{suffix}", trim_decimals(scaled, 2))
}

/// Formats with at most `decimals` decimals, without trailing zeros (`1.50` -> `1.5`).
fn trim_decimals(v: f64, decimals: usize) -> String {
    let s = format!("{v:.decimals$}");
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        &s
    };
    if s == "-0" {
        "0".to_string()
    } else {
        s.to_string()
    }
}

/// Escapes text for use in SVG element content and attribute values.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            _ => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests;
