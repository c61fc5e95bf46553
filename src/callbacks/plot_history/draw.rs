//! The drawing behind [`plot_history`](super::plot_history): the bundled font, the loss and
//! accuracy panels, and their series, rendered with plotters into a PNG.

use std::path::Path;
use std::sync::OnceLock;

use plotters::backend::BitMapBackend;
use plotters::chart::{ChartBuilder, SeriesLabelPosition};
use plotters::drawing::{DrawingArea, IntoDrawingArea};
use plotters::element::{Circle, PathElement};
use plotters::series::LineSeries;
use plotters::style::{Color, FontStyle, RGBColor, BLACK, WHITE};

use crate::callbacks::History;

/// DejaVu Sans, bundled so that text renders without system fonts.
static FONT_BYTES: &[u8] = include_bytes!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/assets/fonts/DejaVuSans.ttf"
));

/// Registers the bundled font as plotters' `sans-serif`, once per process.
pub(super) fn register_font() -> Result<(), String> {
    static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            plotters::style::register_font("sans-serif", FontStyle::Normal, FONT_BYTES)
                .map_err(|_| "the bundled DejaVuSans.ttf is not a valid font".to_string())
        })
        .clone()
}

/// Matplotlib's first two colours: training in blue, validation in orange.
const TRAIN_COLOR: RGBColor = RGBColor(31, 119, 180);
const VAL_COLOR: RGBColor = RGBColor(255, 127, 14);
/// The size of one panel, in pixels.
pub(super) const PANEL_WIDTH: u32 = 640;
/// The picture's height, in pixels.
pub(super) const HEIGHT: u32 = 480;
/// The family the bundled font is registered under.
pub(super) const FONT: &str = "sans-serif";

/// One panel: its caption, y-axis label, the keys drawn in it with their legend names, and the
/// corner where its curves usually leave room for the legend.
struct Panel {
    caption: String,
    y_label: String,
    series: [(String, String, RGBColor); 2],
    legend: SeriesLabelPosition,
}

impl Panel {
    /// The panel of log key `key` and its `val_` twin. Curves that fall (a loss, an error) keep
    /// the legend in the upper right, the others in the lower right.
    fn of(key: &str) -> Self {
        let caption = key
            .split('_')
            .enumerate()
            .map(|(i, w)| match (i, w.chars().next()) {
                (0, Some(c)) => c.to_uppercase().chain(w.chars().skip(1)).collect(),
                _ => w.to_string(),
            })
            .collect::<Vec<String>>()
            .join(" ");
        let legend = if crate::callbacks::Mode::Auto.maximizes(key) {
            SeriesLabelPosition::LowerRight
        } else {
            SeriesLabelPosition::UpperRight
        };
        Self {
            caption,
            y_label: key.to_string(),
            series: [
                (key.to_string(), format!("train {key}"), TRAIN_COLOR),
                (format!("val_{key}"), format!("val {key}"), VAL_COLOR),
            ],
            legend,
        }
    }
}

/// Draws `history` into the PNG `file`: the loss panel, then one panel for each of `metrics`
/// that the history has (under its own key or with a `val_` prefix).
pub(super) fn render(
    history: &History,
    file: &Path,
    title: &str,
    metrics: &[String],
) -> Result<(), String> {
    register_font()?;
    let has = |key: &str| {
        let val = format!("val_{key}");
        history
            .logs
            .iter()
            .any(|l| l.get(key).is_some() || l.get(&val).is_some())
    };
    let panels: Vec<Panel> = std::iter::once(Panel::of("loss"))
        .chain(metrics.iter().filter(|m| has(m)).map(|m| Panel::of(m)))
        .collect();
    draw(history, file, title, &panels)
}

/// Renders the figure into the PNG `file`.
fn draw(history: &History, file: &Path, title: &str, panels: &[Panel]) -> Result<(), String> {
    let width = PANEL_WIDTH * panels.len() as u32;
    let root = BitMapBackend::new(file, (width, HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let body = root.titled(title, (FONT, 26)).map_err(|e| e.to_string())?;
    for (area, panel) in body.split_evenly((1, panels.len())).iter().zip(panels) {
        draw_panel(area, history, panel)?;
    }
    root.present().map_err(|e| e.to_string())
}

/// The finite points of `key`, as `(1-based epoch, value)`, split into runs at gaps.
fn segments(history: &History, key: &str) -> Vec<Vec<(f64, f64)>> {
    let mut runs = vec![Vec::new()];
    for (i, logs) in history.logs.iter().enumerate() {
        let epoch = history.epochs.get(i).map_or(i, |&e| e) as f64 + 1.0;
        match logs.get(key).filter(|v| v.is_finite()) {
            Some(v) => runs.last_mut().map_or((), |run| run.push((epoch, v))),
            None if runs.last().is_some_and(|r| !r.is_empty()) => runs.push(Vec::new()),
            None => {}
        }
    }
    runs.retain(|r| !r.is_empty());
    runs
}

/// `[lo, hi]` widened by 5% (or by a unit around a single value) so lines clear the frame.
fn padded(lo: f64, hi: f64) -> (f64, f64) {
    if !lo.is_finite() || !hi.is_finite() {
        return (0.0, 1.0);
    }
    let span = hi - lo;
    if span <= f64::EPSILON * hi.abs().max(1.0) {
        let pad = (hi.abs() * 0.1).max(0.05);
        return (lo - pad, hi + pad);
    }
    (lo - 0.05 * span, hi + 0.05 * span)
}

fn draw_panel(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    history: &History,
    panel: &Panel,
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let lines: Vec<_> = panel
        .series
        .iter()
        .map(|(key, name, color)| (segments(history, key), name.as_str(), *color))
        .filter(|(runs, _, _)| !runs.is_empty())
        .collect();
    let points = lines.iter().flat_map(|(runs, _, _)| runs.iter().flatten());
    let (x_max, y_lo, y_hi) = points.fold(
        (1.0f64, f64::INFINITY, f64::NEG_INFINITY),
        |(x, lo, hi), &(e, v)| (x.max(e), lo.min(v), hi.max(v)),
    );
    let (y_lo, y_hi) = padded(y_lo, y_hi);
    // Room around the first and last epochs so their markers are not clipped.
    let x_pad = (0.03 * (x_max - 1.0)).max(0.1);
    let x_range = (1.0 - x_pad)..(x_max + x_pad);
    // Enough decimals to tell ticks about a tenth of the range apart.
    let decimals = (-((y_hi - y_lo) / 10.0).log10().floor()).clamp(0.0, 8.0) as usize;
    let y_format = move |y: &f64| format!("{y:.decimals$}");

    let mut chart = ChartBuilder::on(area)
        .caption(&panel.caption, (FONT, 20))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(65)
        .build_cartesian_2d(x_range, y_lo..y_hi)
        .map_err(|e| err(&e))?;
    let whole_epochs = |x: &f64| {
        if (x - x.round()).abs() < 1e-6 {
            format!("{}", x.round() as i64)
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .x_desc("epoch")
        .y_desc(&panel.y_label)
        .x_labels((x_max as usize).clamp(2, 12))
        .x_label_formatter(&whole_epochs)
        .y_label_formatter(&y_format)
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 16))
        .light_line_style(WHITE.mix(0.0))
        .bold_line_style(BLACK.mix(0.08))
        .draw()
        .map_err(|e| err(&e))?;

    for (runs, name, color) in &lines {
        let style = color.stroke_width(2);
        for (i, run) in runs.iter().enumerate() {
            let series = chart
                .draw_series(LineSeries::new(run.iter().copied(), style))
                .map_err(|e| err(&e))?;
            if i == 0 {
                let color = *color;
                series.label(*name).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
            }
            chart
                .draw_series(run.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(|e| err(&e))?;
        }
    }
    if !lines.is_empty() {
        chart
            .configure_series_labels()
            .position(panel.legend.clone())
            .label_font((FONT, 14))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .draw()
            .map_err(|e| err(&e))?;
    }
    Ok(())
}
