//! The scaling picture: efficiency against the number of replicas on a log2 axis, with measured
//! points, projected curves and published reference points, drawn with plotters in kandle's
//! bundled font and written atomically as a PNG.

use std::path::Path;

use anyhow::{Context, Result};
use plotters::backend::BitMapBackend;
use plotters::chart::{ChartBuilder, SeriesLabelPosition};
use plotters::drawing::IntoDrawingArea;
use plotters::element::{Circle, Cross, PathElement, TriangleMarker};
use plotters::series::LineSeries;
use plotters::style::{Color, RGBColor, ShapeStyle, BLACK, WHITE};

/// The picture's size, in pixels.
pub const SIZE: (u32, u32) = (1100, 700);

/// How a series is drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mark {
    /// Points joined by a thin line (measurements).
    Points,
    /// A thick line without points (projections).
    Line,
    /// A large cross at each point (published figures).
    Cross,
    /// A large triangle at each point (published figures).
    Triangle,
}

/// One named series of `(replicas, efficiency)` points.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// The legend entry.
    pub label: String,
    /// `(replicas, efficiency)`, replicas at least 1, efficiency as a fraction.
    pub points: Vec<(usize, f64)>,
    /// How it is drawn.
    pub mark: Mark,
}

/// Distinct colours for up to ten series (matplotlib's `tab10`), reused in turn past that.
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Where a replica count sits on the x axis.
fn log2(replicas: usize) -> f64 {
    (replicas.max(1) as f64).log2()
}

/// What the y axis shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum YAxis {
    /// Scaling efficiency, a fraction shown in percent, from 0.
    Efficiency,
    /// Milliseconds on a log10 scale.
    LogMilliseconds,
    /// The idle share of a pipeline stage's step against the micro-batches, in percent.
    IdleFraction,
}

/// Draws `series` (efficiency against replicas) under `title` and `caption` into the PNG
/// `path`, creating its directory.
pub fn draw(path: &Path, title: &str, caption: &str, series: &[Series]) -> Result<()> {
    draw_with(path, title, caption, series, YAxis::Efficiency)
}

/// Draws `series` of `(workers, milliseconds)` on a log10 time axis (the parameter-server
/// comparison of `bench_ps`), otherwise as [`draw`] does.
pub fn draw_log_time(path: &Path, title: &str, caption: &str, series: &[Series]) -> Result<()> {
    draw_with(path, title, caption, series, YAxis::LogMilliseconds)
}

/// Draws `series` of `(micro-batches, idle fraction)` (the pipeline's bubble of
/// `bench_pipeline`), otherwise as [`draw`] does.
pub fn draw_idle(path: &Path, title: &str, caption: &str, series: &[Series]) -> Result<()> {
    draw_with(path, title, caption, series, YAxis::IdleFraction)
}

fn draw_with(
    path: &Path,
    title: &str,
    caption: &str,
    series: &[Series],
    y_axis: YAxis,
) -> Result<()> {
    let (width, height) = SIZE;
    let mut rgb = vec![0u8; width as usize * height as usize * 3];
    let series: Vec<Series> = match y_axis {
        YAxis::Efficiency | YAxis::IdleFraction => series.to_vec(),
        YAxis::LogMilliseconds => series
            .iter()
            .map(|s| Series {
                points: s
                    .points
                    .iter()
                    .filter(|&&(_, ms)| ms > 0.0)
                    .map(|&(n, ms)| (n, ms.log10()))
                    .collect(),
                ..s.clone()
            })
            .collect(),
    };
    render(&mut rgb, title, caption, &series, y_axis)?;
    let mut png = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut png, width, height);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header()?;
        writer.write_image_data(&rgb)?;
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    kandle::checkpoint::write_atomically(path, &png)?;
    Ok(())
}

fn render(
    rgb: &mut [u8],
    title: &str,
    caption: &str,
    series: &[Series],
    y_axis: YAxis,
) -> Result<()> {
    let font = kandle::callbacks::plot_font()?;
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing the scaling plot: {e}");
    let root = BitMapBackend::with_buffer(rgb, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let body = root.titled(title, (font, 26)).map_err(|e| err(&e))?;
    let points = series.iter().flat_map(|s| s.points.iter());
    let x_max = points.clone().map(|&(n, _)| log2(n)).fold(0.0, f64::max);
    let y_range = match y_axis {
        YAxis::Efficiency | YAxis::IdleFraction => {
            let y_max = points.map(|&(_, e)| e).fold(1.0, f64::max);
            0.0..(y_max * 1.05).max(1.05)
        }
        YAxis::LogMilliseconds => {
            let (lo, hi) = points.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &(_, y)| {
                (lo.min(y), hi.max(y))
            });
            if lo.is_finite() && hi.is_finite() {
                lo.floor()..hi.ceil().max(lo.floor() + 1.0)
            } else {
                0.0..1.0
            }
        }
    };
    let mut chart = ChartBuilder::on(&body)
        .caption(caption, (font, 16))
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.4..x_max + 0.4, y_range.clone())
        .map_err(|e| err(&e))?;
    let (x_desc, y_desc) = match y_axis {
        YAxis::Efficiency => (
            "replicas N (log2 scale)",
            "scaling efficiency: images/s at N / (N x images/s at 1)",
        ),
        YAxis::LogMilliseconds => (
            "workers W (log2 scale)",
            "communication per step, ms (log10 scale)",
        ),
        YAxis::IdleFraction => (
            "micro-batches M (log2 scale)",
            "idle share of each stage's step",
        ),
    };
    let y_label = |y: &f64| match y_axis {
        YAxis::Efficiency | YAxis::IdleFraction => format!("{:.0}%", y * 100.0),
        YAxis::LogMilliseconds if y.fract().abs() < 1e-6 => {
            let ms = 10f64.powf(*y);
            if ms >= 1.0 {
                format!("{ms:.0}")
            } else {
                format!("{ms}")
            }
        }
        YAxis::LogMilliseconds => String::new(),
    };
    let y_labels = match y_axis {
        YAxis::Efficiency | YAxis::IdleFraction => 10,
        YAxis::LogMilliseconds => (y_range.end - y_range.start) as usize + 1,
    };
    let powers_of_two = |x: &f64| {
        if x.fract().abs() < 1e-6 && *x >= 0.0 {
            format!("{}", 1u64 << (*x as u32))
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_labels(x_max as usize + 2)
        .y_labels(y_labels)
        .x_label_formatter(&powers_of_two)
        .y_label_formatter(&y_label)
        .label_style((font, 15))
        .axis_desc_style((font, 16))
        .light_line_style(WHITE.mix(0.0))
        .bold_line_style(BLACK.mix(0.08))
        .draw()
        .map_err(|e| err(&e))?;

    for (s, color) in series.iter().zip(PALETTE.iter().cycle()) {
        let xy: Vec<(f64, f64)> = s.points.iter().map(|&(n, e)| (log2(n), e)).collect();
        let color = *color;
        let thin = color.stroke_width(1);
        let thick = color.stroke_width(3);
        let legend = match s.mark {
            Mark::Points => {
                chart
                    .draw_series(LineSeries::new(xy.iter().copied(), thin))
                    .map_err(|e| err(&e))?;
                chart.draw_series(xy.iter().map(|&p| Circle::new(p, 5, color.filled())))
            }
            Mark::Line => chart.draw_series(LineSeries::new(xy.iter().copied(), thick)),
            Mark::Cross => chart.draw_series(xy.iter().map(|&p| Cross::new(p, 9, thick))),
            Mark::Triangle => chart.draw_series(
                xy.iter()
                    .map(|&p| TriangleMarker::new(p, 10, color.filled())),
            ),
        }
        .map_err(|e| err(&e))?;
        let mark = s.mark;
        legend
            .label(&s.label)
            .legend(move |(x, y)| legend_glyph(mark, color, (x, y)));
    }
    chart
        .configure_series_labels()
        .position(match y_axis {
            YAxis::Efficiency => SeriesLabelPosition::LowerRight,
            YAxis::LogMilliseconds => SeriesLabelPosition::LowerRight,
            YAxis::IdleFraction => SeriesLabelPosition::UpperRight,
        })
        .label_font((font, 14))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.3))
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}

/// The legend's sample of a series drawn as `mark`.
fn legend_glyph<'b>(
    mark: Mark,
    color: RGBColor,
    (x, y): (i32, i32),
) -> plotters::element::DynElement<'static, BitMapBackend<'b>, (i32, i32)> {
    use plotters::element::IntoDynElement;
    let style: ShapeStyle = color.stroke_width(3);
    match mark {
        Mark::Points => Circle::new((x + 10, y), 5, color.filled()).into_dyn(),
        Mark::Line => PathElement::new(vec![(x, y), (x + 20, y)], style).into_dyn(),
        Mark::Cross => Cross::new((x + 10, y), 7, style).into_dyn(),
        Mark::Triangle => TriangleMarker::new((x + 10, y), 8, color.filled()).into_dyn(),
    }
}
