//! The picture of `cargo xtask replay`: one row per trace, each setting's
//! peak reserved memory as a ratio to PyTorch's best setting (a mark per
//! setting, a line at 1, what lies left of it reserves less than PyTorch
//! can), and at the right the recommended setting with its cost in pages
//! moved per step; written as SVG and as PNG.
//!
//! Ratios rather than bytes over time: on axes from zero the settings of
//! one trace differ by a few pixels, while the claim (ours below PyTorch's
//! best, PyTorch's default above it) is about those few percent.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::{register_font, FontStyle};

/// A mark's role, which fixes its colour, place in the row and legend text.
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
    /// Peak allocated bytes (live tensors, rounded as PyTorch rounds them):
    /// the floor no setting goes below.
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

    /// The role of a setting of [`alloc_replay::SETTINGS`], if drawn.
    pub fn of_setting(name: &str) -> Option<Role> {
        match name {
            "default" => Some(Role::PyTorchDefault),
            "expandable" => Some(Role::PyTorchExpandable),
            "unmap16" => Some(Role::Unmap16),
            "unmap8" => Some(Role::Unmap8),
            "bound" => Some(Role::Bound),
            _ => None,
        }
    }

    fn legend(self) -> &'static str {
        match self {
            Role::PyTorchDefault => "PyTorch default",
            Role::PyTorchExpandable => "PyTorch expandable_segments",
            Role::Unmap16 => "ours: unmap16",
            Role::Unmap8 => "ours: unmap8",
            Role::Bound => "ours: bound",
            Role::Allocated => "peak allocated (the floor)",
        }
    }

    /// Okabe-Ito colours (distinct under colour blindness); PyTorch's in
    /// grey and blue, ours in orange, green and vermillion.
    fn colour(self) -> RGBColor {
        match self {
            Role::PyTorchDefault => RGBColor(0x66, 0x66, 0x66),
            Role::PyTorchExpandable => RGBColor(0x00, 0x72, 0xB2),
            Role::Unmap16 => RGBColor(0xE6, 0x9F, 0x00),
            Role::Unmap8 => RGBColor(0x00, 0x9E, 0x73),
            Role::Bound => RGBColor(0xD5, 0x5E, 0x00),
            Role::Allocated => RGBColor(0x22, 0x22, 0x22),
        }
    }

    /// Where in its row the mark sits (row heights, from the centre), so
    /// that settings with equal ratios stay apart.
    fn offset(self) -> f64 {
        match self {
            Role::PyTorchDefault => 0.24,
            Role::PyTorchExpandable => 0.12,
            Role::Unmap16 => 0.0,
            Role::Unmap8 => -0.12,
            Role::Bound => -0.24,
            Role::Allocated => 0.0,
        }
    }
}

/// One setting's peak reserved memory in a row.
pub struct Mark {
    /// Which setting (or the floor).
    pub role: Role,
    /// Peak reserved / PyTorch's best setting's.
    pub ratio: f64,
}

/// One trace's row.
pub struct Row {
    /// Trace name.
    pub trace: String,
    /// Its marks.
    pub marks: Vec<Mark>,
    /// The recommendation, in a few words (right of the row).
    pub pick: String,
    /// The recommended setting's role, for the text's colour.
    pub pick_role: Option<Role>,
}

const WIDTH: u32 = 1200;
const HEADER_H: u32 = 128;
const ROW_H: u32 = 36;
/// Space above the rows (the labels either side of the line at 1) and below
/// them (the axis).
const ABOVE_ROWS: u32 = 30;
const AXIS_H: u32 = 50;
const NAME_W: u32 = 210;
const PICK_W: u32 = 300;
const FONT: &str = "sans-serif";

/// Writes the rows to `svg` and to `png`.
pub fn write(rows: &[Row], title: &str, svg: &Path, png: &Path) -> Result<(), String> {
    // Text is measured and drawn with a bundled font, so the picture does
    // not depend on the fonts installed.
    register_font(FONT, FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| "the bundled font does not load".to_string())?;
    let size = (
        WIDTH,
        HEADER_H + ABOVE_ROWS + ROW_H * rows.len().max(1) as u32 + AXIS_H,
    );
    for path in [svg, png] {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
    }
    draw(SVGBackend::new(svg, size).into_drawing_area(), rows, title)
        .map_err(|e| format!("{}: {e}", svg.display()))?;
    let mut rgb = vec![0u8; size.0 as usize * size.1 as usize * 3];
    draw(
        BitMapBackend::with_buffer(&mut rgb, size).into_drawing_area(),
        rows,
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

/// The x axis: from below the lowest ratio to as far right of 1 as that
/// is left of it (at least 1.1), so that the few percent between ours and
/// PyTorch's best stay visible; ratios beyond it are drawn at the right
/// edge with their value.
fn x_range(rows: &[Row]) -> (f64, f64) {
    let lowest = rows
        .iter()
        .flat_map(|r| r.marks.iter().map(|m| m.ratio))
        .filter(|r| r.is_finite())
        .fold(1.0f64, f64::min);
    let below = (1.0 - lowest).max(0.1);
    let highest = rows
        .iter()
        .flat_map(|r| r.marks.iter().map(|m| m.ratio))
        .filter(|r| r.is_finite())
        .fold(1.0f64, f64::max)
        .min(1.0 + below);
    let pad = 0.05 * below;
    (1.0 - below - pad, highest + 2.0 * pad)
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, rows: &[Row], title: &str) -> Drawn<DB> {
    root.fill(&WHITE)?;
    let (header, body) = root.split_vertically(HEADER_H);
    header.draw(&Text::new(title, (16, 10), (FONT, 20).into_font()))?;
    for (i, line) in [
        "1 = the lower of PyTorch's default and its expandable_segments, which the replay \
         reproduces byte for byte.",
        "Left of 1: less memory than PyTorch can reserve. Ratios past the right edge are \
         written beside it.",
    ]
    .into_iter()
    .enumerate()
    {
        header.draw(&Text::new(
            line,
            (16, 40 + 18 * i as i32),
            (FONT, 13).into_font().color(&RGBColor(0x33, 0x33, 0x33)),
        ))?;
    }
    legend(&header)?;

    let (plot_side, _) = body.split_horizontally(WIDTH - PICK_W);
    let n = rows.len().max(1) as f64;
    let (lo, hi) = x_range(rows);
    let mut chart = ChartBuilder::on(&plot_side)
        .margin_top(ABOVE_ROWS)
        .margin_right(16)
        .x_label_area_size(AXIS_H)
        .y_label_area_size(NAME_W)
        .build_cartesian_2d(lo..hi, 0.0..n)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(0)
        .x_labels(10)
        .light_line_style(WHITE)
        .bold_line_style(RGBColor(0xE4, 0xE4, 0xE4))
        .x_label_formatter(&|x| format!("{x:.2}"))
        .x_desc("peak reserved / PyTorch's best setting's (lower is better)")
        .label_style((FONT, 12))
        .axis_desc_style((FONT, 13))
        .draw()?;
    let green = Role::Unmap8.colour();
    chart.draw_series(std::iter::once(Rectangle::new(
        [(lo, 0.0), (1.0, n)],
        green.mix(0.08).filled(),
    )))?;
    for i in 1..rows.len() {
        let y = i as f64;
        chart.draw_series(std::iter::once(PathElement::new(
            vec![(lo, y), (hi, y)],
            RGBColor(0xDD, 0xDD, 0xDD).stroke_width(1),
        )))?;
    }
    chart.draw_series(std::iter::once(PathElement::new(
        vec![(1.0, 0.0), (1.0, n)],
        BLACK.stroke_width(2),
    )))?;

    // Above the rows, either side of the line at 1.
    let (one_x, top_y) = chart.backend_coord(&(1.0, n));
    root.draw(&Text::new(
        "less memory than PyTorch's best  ",
        (one_x, top_y - 14),
        text(13, &green, HPos::Right),
    ))?;
    root.draw(&Text::new(
        "  more",
        (one_x, top_y - 14),
        text(13, &RGBColor(0x55, 0x55, 0x55), HPos::Left),
    ))?;
    let pick_x = (WIDTH - PICK_W) as i32 + 4;
    root.draw(&Text::new(
        "recommended (pages moved per step)",
        (pick_x, top_y - 14),
        text(13, &BLACK, HPos::Left),
    ))?;

    for (i, row) in rows.iter().enumerate() {
        let centre = n - i as f64 - 0.5;
        for mark in row.marks.iter().filter(|m| m.ratio.is_finite()) {
            let colour = mark.role.colour();
            if mark.role == Role::Allocated {
                chart.draw_series(std::iter::once(PathElement::new(
                    vec![(mark.ratio, centre - 0.38), (mark.ratio, centre + 0.38)],
                    colour.stroke_width(2),
                )))?;
            } else if mark.ratio <= hi {
                let at = (mark.ratio, centre + mark.role.offset());
                chart.draw_series(std::iter::once(Circle::new(at, 5, colour.filled())))?;
            } else {
                // Off the scale: at the right edge, with its value.
                let (x, y) = chart.backend_coord(&(hi, centre + mark.role.offset()));
                root.draw(&Circle::new((x - 6, y), 5, colour.filled()))?;
                root.draw(&Text::new(
                    format!("{:.2}", mark.ratio),
                    (x - 16, y),
                    text(12, &colour, HPos::Right),
                ))?;
            }
        }
        let (_, y) = chart.backend_coord(&(lo, centre));
        root.draw(&Text::new(
            row.trace.as_str(),
            (16, y),
            text(14, &BLACK, HPos::Left),
        ))?;
        let colour = row.pick_role.map_or(BLACK, Role::colour);
        root.draw(&Text::new(
            row.pick.as_str(),
            (pick_x, y),
            text(14, &colour, HPos::Left),
        ))?;
    }
    root.present()
}

/// Text of `size` in `colour`, anchored at its vertical centre.
fn text(size: u32, colour: &RGBColor, h: HPos) -> TextStyle<'static> {
    TextStyle {
        font: (FONT, size).into_font(),
        color: colour.to_backend_color(),
        pos: Pos::new(h, VPos::Center),
    }
}

/// The legend: one row above the plot, outside it.
fn legend<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>) -> Drawn<DB> {
    let (mut x, y) = (16, 98);
    for role in Role::ALL {
        let colour = role.colour();
        if role == Role::Allocated {
            area.draw(&PathElement::new(
                vec![(x + 6, y - 9), (x + 6, y + 9)],
                colour.stroke_width(2),
            ))?;
        } else {
            area.draw(&Circle::new((x + 6, y), 5, colour.filled()))?;
        }
        let label = role.legend();
        area.draw(&Text::new(label, (x + 18, y), text(14, &BLACK, HPos::Left)))?;
        x += 48 + 8 * label.len() as i32;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(trace: &str, ratios: &[(Role, f64)]) -> Row {
        Row {
            trace: trace.into(),
            marks: ratios
                .iter()
                .map(|&(role, ratio)| Mark { role, ratio })
                .collect(),
            pick: "bound: 0.889x (49)".into(),
            pick_role: Some(Role::Bound),
        }
    }

    #[test]
    fn the_axis_holds_every_ratio_and_one() {
        let rows = [
            row("a", &[(Role::PyTorchDefault, 1.4), (Role::Bound, 0.9)]),
            row("b", &[(Role::Unmap8, 0.7), (Role::Allocated, f64::NAN)]),
        ];
        let (lo, hi) = x_range(&rows);
        assert!(lo < 0.7 && lo > 0.65, "{lo}");
        assert!(hi > 1.3 && hi < 1.35, "as far right of 1 as left: {hi}");
        let (lo, hi) = x_range(&[row("c", &[(Role::Unmap16, 0.95), (Role::Bound, 1.05)])]);
        assert!(
            lo < 0.9 && hi > 1.05 && hi < 1.1,
            "at least 0.1 either side: {lo} {hi}"
        );
    }

    #[test]
    fn both_files_are_written() {
        let dir = std::env::temp_dir().join(format!("xtask-figure-{}", std::process::id()));
        let rows = [row(
            "gpt2_train",
            &[
                (Role::PyTorchDefault, 1.01),
                (Role::PyTorchExpandable, 1.0),
                (Role::Bound, 0.918),
                (Role::Allocated, 0.9),
            ],
        )];
        let (svg, png) = (dir.join("f.svg"), dir.join("f.png"));
        write(&rows, "a title", &svg, &png).unwrap();
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(text.contains("<svg") && text.contains("gpt2_train"));
        assert!(text.contains("bound: 0.889x (49)"), "the pick is written");
        assert!(text.contains("PyTorch default"), "the legend is drawn");
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
