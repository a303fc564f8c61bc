//! The picture of `cargo xtask replay`: one small panel per trace, reserved
//! memory over the trace under PyTorch's two settings and ours, on the same
//! axes, with one legend above the panels; written as SVG and as PNG.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

/// A line's role, which fixes its colour, width and legend text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// PyTorch's default (ours reproduce it).
    PyTorchDefault,
    /// PyTorch's expandable segments.
    PyTorchExpandable,
    /// `unmap_free_pages` with 16 MiB pages.
    Unmap16,
    /// `unmap_free_pages` with 8 MiB pages.
    Unmap8,
    /// The setting recommended for memory at the bound (8 MiB pages, a
    /// planned layout, first fit from 8 MiB).
    Bound,
    /// Live tensors' bytes (the same under every setting): the floor.
    Allocated,
}

impl Role {
    /// Every role, in legend order.
    pub const ALL: [Role; 6] = [
        Role::PyTorchDefault,
        Role::PyTorchExpandable,
        Role::Unmap16,
        Role::Unmap8,
        Role::Bound,
        Role::Allocated,
    ];

    fn legend(self) -> &'static str {
        match self {
            Role::PyTorchDefault => "PyTorch default",
            Role::PyTorchExpandable => "PyTorch expandable_segments",
            Role::Unmap16 => "ours: unmap_free_pages (16 MiB pages)",
            Role::Unmap8 => "ours: unmap_page_mb:8",
            Role::Bound => "ours: bound (8 MiB pages, plan, first fit)",
            Role::Allocated => "allocated (live tensors)",
        }
    }

    /// Okabe-Ito colours (distinct under colour blindness); PyTorch's in
    /// grey and blue, ours in orange, green and vermillion.
    fn style(self) -> ShapeStyle {
        let (colour, width) = match self {
            Role::PyTorchDefault => (RGBColor(0x55, 0x55, 0x55), 2),
            Role::PyTorchExpandable => (RGBColor(0x00, 0x72, 0xB2), 2),
            Role::Unmap16 => (RGBColor(0xE6, 0x9F, 0x00), 2),
            Role::Unmap8 => (RGBColor(0x00, 0x9E, 0x73), 2),
            Role::Bound => (RGBColor(0xD5, 0x5E, 0x00), 2),
            Role::Allocated => (RGBColor(0xBB, 0xBB, 0xBB), 1),
        };
        colour.stroke_width(width)
    }
}

/// One line of a panel: `(event index, bytes)` points.
pub struct Line {
    /// What it shows.
    pub role: Role,
    /// Points in drawing order.
    pub points: Vec<(f64, f64)>,
}

/// One trace's panel.
pub struct Panel {
    /// Trace name.
    pub title: String,
    /// The recommendation, in a few words (second title line).
    pub subtitle: String,
    /// Its lines.
    pub lines: Vec<Line>,
}

const COLUMNS: usize = 3;
const PANEL_W: u32 = 440;
const PANEL_H: u32 = 270;
const HEADER_H: u32 = 96;
const FONT: &str = "sans-serif";

/// Writes the panels to `svg` and to `png`.
pub fn write(panels: &[Panel], title: &str, svg: &Path, png: &Path) -> Result<(), String> {
    // Text is measured and drawn with a bundled font, so the picture does
    // not depend on the fonts installed.
    register_font(FONT, FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| "the bundled font does not load".to_string())?;
    let rows = panels.len().div_ceil(COLUMNS).max(1) as u32;
    let size = (PANEL_W * COLUMNS as u32, HEADER_H + PANEL_H * rows);
    for path in [svg, png] {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
    }
    draw(
        SVGBackend::new(svg, size).into_drawing_area(),
        panels,
        title,
    )
    .map_err(|e| format!("{}: {e}", svg.display()))?;
    let mut rgb = vec![0u8; size.0 as usize * size.1 as usize * 3];
    draw(
        BitMapBackend::with_buffer(&mut rgb, size).into_drawing_area(),
        panels,
        title,
    )
    .map_err(|e| format!("{}: {e}", png.display()))?;
    encode_png(png, size, &rgb)
}

fn encode_png(path: &Path, (w, h): (u32, u32), rgb: &[u8]) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let file = std::fs::File::create(path).map_err(|e| err(&e))?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), w, h);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder
        .write_header()
        .and_then(|mut writer| writer.write_image_data(rgb))
        .map_err(|e| err(&e))
}

type Drawn<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    panels: &[Panel],
    title: &str,
) -> Drawn<DB> {
    root.fill(&WHITE)?;
    let (header, body) = root.split_vertically(HEADER_H);
    header.draw(&Text::new(title, (16, 12), (FONT, 20).into_font()))?;
    legend(&header)?;
    let areas = body.split_evenly((panels.len().div_ceil(COLUMNS).max(1), COLUMNS));
    for (area, panel) in areas.iter().zip(panels) {
        draw_panel(area, panel)?;
    }
    root.present()
}

/// The legend: one row above the panels, outside every plot area.
fn legend<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>) -> Drawn<DB> {
    let (mut x, mut y) = (16, 48);
    for role in Role::ALL {
        let label = role.legend();
        let width = 44 + 8 * label.len() as i32;
        if x + width > (PANEL_W * COLUMNS as u32) as i32 - 8 {
            x = 16;
            y += 22;
        }
        area.draw(&PathElement::new(
            vec![(x, y + 7), (x + 30, y + 7)],
            role.style(),
        ))?;
        area.draw(&Text::new(label, (x + 36, y), (FONT, 14).into_font()))?;
        x += width;
    }
    Ok(())
}

fn draw_panel<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, panel: &Panel) -> Drawn<DB> {
    let x_max = panel
        .lines
        .iter()
        .flat_map(|l| l.points.iter().map(|p| p.0))
        .fold(1.0, f64::max);
    let y_max = panel
        .lines
        .iter()
        .flat_map(|l| l.points.iter().map(|p| p.1))
        .fold(1.0, f64::max);
    let (unit, unit_name) = if y_max >= 2.0 * (1u64 << 30) as f64 {
        ((1u64 << 30) as f64, "GiB")
    } else {
        ((1u64 << 20) as f64, "MiB")
    };
    let (head, plot) = area.split_vertically(40);
    head.draw(&Text::new(
        panel.title.as_str(),
        (56, 6),
        (FONT, 15).into_font(),
    ))?;
    head.draw(&Text::new(
        panel.subtitle.as_str(),
        (56, 24),
        (FONT, 12).into_font().color(&RGBColor(0x33, 0x33, 0x33)),
    ))?;
    let mut chart = ChartBuilder::on(&plot)
        .margin_right(14)
        .margin_bottom(6)
        .x_label_area_size(24)
        .y_label_area_size(58)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max * 1.05 / unit)?;
    chart
        .configure_mesh()
        .x_labels(4)
        .y_labels(5)
        .light_line_style(WHITE)
        .bold_line_style(RGBColor(0xE8, 0xE8, 0xE8))
        .x_label_formatter(&|x| compact(*x))
        .y_label_formatter(&|y| format!("{} {unit_name}", trim(*y)))
        .label_style((FONT, 11))
        .draw()?;
    // Ours last, so that they are on top where the lines meet.
    for line in &panel.lines {
        let points = line.points.iter().map(|&(x, y)| (x, y / unit));
        chart.draw_series(LineSeries::new(points, line.role.style()))?;
    }
    Ok(())
}

/// `950`, `12k`, `1.5M`: event counts on the x axis.
fn compact(v: f64) -> String {
    match v.abs() {
        a if a >= 1e6 => format!("{}M", trim(v / 1e6)),
        a if a >= 1e3 => format!("{}k", trim(v / 1e3)),
        _ => trim(v),
    }
}

/// At most one decimal, without a trailing `.0`.
fn trim(v: f64) -> String {
    let s = format!("{v:.1}");
    s.strip_suffix(".0").map(str::to_string).unwrap_or(s)
}

/// At most `max_points` of `points`: the first, the last, and each bucket's
/// lowest and highest point in order, so that peaks survive.
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
        let Some(lo) = (0..bucket.len()).min_by(|&i, &j| bucket[i].1.total_cmp(&bucket[j].1))
        else {
            continue;
        };
        let hi = (0..bucket.len())
            .max_by(|&i, &j| bucket[i].1.total_cmp(&bucket[j].1))
            .unwrap_or(lo);
        out.push(bucket[lo.min(hi)]);
        if lo != hi {
            out.push(bucket[lo.max(hi)]);
        }
    }
    out.push(points[n - 1]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downsampling_keeps_the_peak_and_the_ends() {
        let points: Vec<(f64, f64)> = (0..10_000)
            .map(|i| (i as f64, if i == 4321 { 1e9 } else { (i % 7) as f64 }))
            .collect();
        let small = downsample(&points, 100);
        assert!(small.len() <= 100);
        assert!(small.contains(&(4321.0, 1e9)));
        assert_eq!(small.first(), points.first());
        assert_eq!(small.last(), points.last());
        assert!(small.windows(2).all(|w| w[0].0 < w[1].0), "in order");
        assert_eq!(downsample(&points[..50], 100), points[..50].to_vec());
    }

    #[test]
    fn labels_are_compact() {
        assert_eq!(compact(950.0), "950");
        assert_eq!(compact(12_000.0), "12k");
        assert_eq!(compact(1_500_000.0), "1.5M");
        assert_eq!(trim(2.0), "2");
        assert_eq!(trim(2.5), "2.5");
    }

    #[test]
    fn both_files_are_written() {
        let dir = std::env::temp_dir().join(format!("xtask-figure-{}", std::process::id()));
        let line = |role, scale: f64| Line {
            role,
            points: (0..50)
                .map(|i| (i as f64, scale * (i % 10) as f64 * 1e8))
                .collect(),
        };
        let panel = Panel {
            title: "t".into(),
            subtitle: "recommended: unmap16".into(),
            lines: vec![line(Role::PyTorchDefault, 1.0), line(Role::Unmap16, 0.8)],
        };
        let (svg, png) = (dir.join("f.svg"), dir.join("f.png"));
        write(&[panel], "a title", &svg, &png).unwrap();
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(text.contains("<svg") && text.contains("recommended: unmap16"));
        assert!(text.contains("PyTorch default"), "the legend is drawn");
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
