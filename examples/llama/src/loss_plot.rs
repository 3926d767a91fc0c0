//! The loss plot: training and validation loss against step, drawn with plotters' SVG backend
//! (no font is read: the SVG's text is laid out by whatever shows it).

use std::fs;
use std::ops::Range;
use std::path::Path;

use plotters::prelude::*;

use crate::Error;

/// The plot's size in pixels.
const SIZE: (u32, u32) = (800, 500);

/// Line colours, one per curve in order (repeating after the last).
const COLORS: [RGBColor; 3] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
];

/// One named curve of a loss plot: `(step, loss)` points.
#[derive(Debug, Clone, Copy)]
pub struct Curve<'a> {
    /// The legend's text for the curve.
    pub label: &'a str,
    /// The points, in any order.
    pub points: &'a [(u64, f64)],
}

/// A curve's finite points in step order.
fn finite_points(curve: &Curve<'_>) -> Vec<(u64, f64)> {
    let mut points: Vec<(u64, f64)> = curve
        .points
        .iter()
        .copied()
        .filter(|(_, loss)| loss.is_finite())
        .collect();
    points.sort_by_key(|&(step, _)| step);
    points
}

/// The axes' ranges over every point: at least two steps wide, the losses with a margin of a
/// twentieth of their span, a constant loss padded by a tenth of itself (by 1 at 0). Before
/// any point, steps 0..1 and losses 0..1.
fn axes(points: &[(u64, f64)]) -> (Range<u64>, Range<f64>) {
    let (Some(x_lo), Some(x_hi)) = (
        points.iter().map(|p| p.0).min(),
        points.iter().map(|p| p.0).max(),
    ) else {
        return (0..1, 0.0..1.0);
    };
    let x_lo = match x_hi - x_lo < 2 {
        true => x_lo.saturating_sub(1),
        false => x_lo,
    };
    let x_hi = x_hi.max(x_lo + 2);
    let y_lo = points.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let y_hi = points.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    let y = match y_hi - y_lo <= f64::EPSILON * y_hi.abs().max(1.0) {
        true => {
            let pad = if y_lo == 0.0 { 1.0 } else { y_lo.abs() * 0.1 };
            (y_lo - pad)..(y_hi + pad)
        }
        false => {
            let margin = (y_hi - y_lo) * 0.05;
            (y_lo - margin)..(y_hi + margin)
        }
    };
    (x_lo..x_hi, y)
}

/// Renders a self-contained SVG line chart of loss curves against step, with a legend when
/// there is more than one curve.
///
/// Non-finite losses are skipped and points are drawn in step order; a lone point is drawn as
/// a dot. With no finite point the chart says so.
///
/// # Errors
///
/// [`Error::Format`] if plotters fails to draw (it writes into memory, so only on a bug).
pub fn loss_curves_svg(curves: &[Curve<'_>], title: &str) -> Result<String, Error> {
    let series: Vec<Vec<(u64, f64)>> = curves.iter().map(finite_points).collect();
    let all: Vec<(u64, f64)> = series.iter().flatten().copied().collect();
    let (x_range, y_range) = axes(&all);
    let mut svg = String::new();
    draw(&mut svg, curves, &series, (x_range, y_range), title).map_err(|e| Error::Format {
        path: None,
        what: "the loss plot".into(),
        expected: "an SVG drawing".into(),
        source: e.to_string().into(),
    })?;
    Ok(svg)
}

/// Draws the chart into `svg`.
fn draw(
    svg: &mut String,
    curves: &[Curve<'_>],
    series: &[Vec<(u64, f64)>],
    (x_range, y_range): (Range<u64>, Range<f64>),
    title: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::with_string(svg, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(20)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x_range, y_range)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss")
        .light_line_style(WHITE)
        .draw()?;
    if series.iter().all(Vec::is_empty) {
        let (width, height) = SIZE;
        let at = (width as i32 / 2 - 70, height as i32 / 2);
        root.draw(&Text::new("no finite loss values", at, ("sans-serif", 14)))?;
    }
    for (i, (curve, points)) in curves.iter().zip(series).enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))?
            .label(curve.label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
        if let [point] = points[..] {
            chart.draw_series(std::iter::once(Circle::new(point, 3, color.filled())))?;
        }
    }
    if curves.len() > 1 {
        chart
            .configure_series_labels()
            .background_style(WHITE)
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

/// Writes [`loss_curves_svg`] of `curves` to `path`.
///
/// # Errors
///
/// [`Error::Io`] if the file cannot be written; as [`loss_curves_svg`].
pub fn write_loss_plot_svg(curves: &[Curve<'_>], path: &Path, title: &str) -> Result<(), Error> {
    let svg = loss_curves_svg(curves, title)?;
    fs::write(path, svg).map_err(Error::io("write the loss plot", path))
}

#[cfg(test)]
mod tests {
    use super::*;

    use xml::reader::{EventReader, XmlEvent};

    /// An SVG element: its name and attributes.
    struct Element {
        name: String,
        attributes: Vec<(String, String)>,
    }

    impl Element {
        fn get(&self, name: &str) -> Option<&str> {
            self.attributes
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        }
    }

    /// Every element of `svg`, after checking that it is well-formed XML whose root is an
    /// `<svg>` element of the SVG namespace, and every text in it.
    fn parse_svg(svg: &str) -> (Vec<Element>, Vec<String>) {
        let (mut elements, mut texts) = (Vec::new(), Vec::new());
        for event in EventReader::from_str(svg) {
            match event.expect("well-formed XML") {
                XmlEvent::StartElement {
                    name, attributes, ..
                } => {
                    if elements.is_empty() {
                        assert_eq!(name.local_name, "svg");
                        assert_eq!(
                            name.namespace.as_deref(),
                            Some("http://www.w3.org/2000/svg")
                        );
                    }
                    elements.push(Element {
                        name: name.local_name,
                        attributes: attributes
                            .into_iter()
                            .map(|a| (a.name.local_name, a.value))
                            .collect(),
                    });
                }
                XmlEvent::Characters(text) => texts.push(text.trim().to_string()),
                _ => {}
            }
        }
        (elements, texts)
    }

    /// The points of each polyline stroked in `color`.
    fn lines_in(elements: &[Element], color: RGBColor) -> Vec<Vec<(f64, f64)>> {
        let stroke = format!("#{:02X}{:02X}{:02X}", color.0, color.1, color.2);
        elements
            .iter()
            .filter(|e| e.name == "polyline" && e.get("stroke") == Some(stroke.as_str()))
            .map(|e| {
                e.get("points")
                    .unwrap_or("")
                    .split_whitespace()
                    .map(|p| {
                        let (x, y) = p.split_once(',').expect("x,y");
                        (x.parse().expect("x"), y.parse().expect("y"))
                    })
                    .collect()
            })
            .collect()
    }

    fn svg(curves: &[Curve<'_>]) -> String {
        loss_curves_svg(curves, "loss <tiny> & \"llama\"").unwrap()
    }

    #[test]
    fn the_plot_is_an_svg_holding_each_loss_series() {
        let train: Vec<(u64, f64)> = (1..=50).map(|s| (s * 10, 5.0 / s as f64)).collect();
        let val = [(100, 2.0), (500, 1.0), (250, 1.5)];
        let (elements, texts) = parse_svg(&svg(&[
            Curve {
                label: "training",
                points: &train,
            },
            Curve {
                label: "validation",
                points: &val,
            },
        ]));
        assert!(
            texts.iter().any(|t| t == "loss <tiny> & \"llama\""),
            "{texts:?}"
        );
        assert!(texts.iter().any(|t| t == "training"));
        assert!(texts.iter().any(|t| t == "validation"));
        assert!(texts.iter().any(|t| t == "step") && texts.iter().any(|t| t == "loss"));
        // One line per series (and its legend entry), one point per loss; x grows with the step
        // and y (downwards, in whole pixels) with a falling loss.
        for (color, len) in [(COLORS[0], 50), (COLORS[1], 3)] {
            let lines = lines_in(&elements, color);
            let series = lines.iter().find(|l| l.len() == len).expect("the series");
            assert!(
                series
                    .windows(2)
                    .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1),
                "{series:?}"
            );
            assert!(series[0].1 < series[len - 1].1, "{series:?}");
            let (width, height) = SIZE;
            assert!(series.iter().all(|&(x, y)| x > 0.0
                && x < f64::from(width)
                && y > 0.0
                && y < f64::from(height)));
        }
    }

    #[test]
    fn non_finite_losses_are_skipped_and_a_lone_point_is_a_dot() {
        let points = [(1, 2.0), (2, f64::NAN), (3, f64::INFINITY), (4, 1.0)];
        let (elements, _) = parse_svg(&svg(&[Curve {
            label: "loss",
            points: &points,
        }]));
        assert!(lines_in(&elements, COLORS[0]).iter().any(|l| l.len() == 2));
        let (elements, _) = parse_svg(&svg(&[Curve {
            label: "loss",
            points: &[(7, 2.5)],
        }]));
        assert!(elements.iter().any(|e| e.name == "circle"));
        // A constant loss and a constant zero loss draw a flat line, no NaN anywhere.
        for value in [3.0, 0.0] {
            let flat = [(1, value), (2, value), (3, value)];
            let text = svg(&[Curve {
                label: "loss",
                points: &flat,
            }]);
            assert!(!text.contains("NaN") && !text.contains("inf"), "{text}");
            let (elements, _) = parse_svg(&text);
            let line = lines_in(&elements, COLORS[0])
                .into_iter()
                .find(|l| l.len() == 3);
            let line = line.expect("the flat series");
            assert!(line.iter().all(|p| p.1 == line[0].1), "{line:?}");
        }
    }

    #[test]
    fn a_plot_without_finite_losses_says_so() {
        for points in [&[(1, f64::NAN)][..], &[]] {
            let (_, texts) = parse_svg(&svg(&[Curve {
                label: "loss",
                points,
            }]));
            assert!(
                texts.iter().any(|t| t == "no finite loss values"),
                "{texts:?}"
            );
        }
    }

    #[test]
    fn the_axes_cover_every_point_and_pad_a_constant() {
        assert_eq!(axes(&[]), (0..1, 0.0..1.0));
        let (x, y) = axes(&[(5, 2.0), (9, 1.0)]);
        assert_eq!(x, 5..9);
        assert!((y.start - 0.95).abs() < 1e-12 && (y.end - 2.05).abs() < 1e-12);
        let (x, y) = axes(&[(0, 2.0)]);
        assert_eq!(x, 0..2);
        assert!((y.start - 1.8).abs() < 1e-12 && (y.end - 2.2).abs() < 1e-12);
        assert_eq!(axes(&[(3, 0.0), (4, 0.0)]).1, -1.0..1.0);
    }

    #[test]
    fn the_file_holds_the_plot() {
        let dir = distflash_test_support::TempDir::new("loss-plot");
        let path = dir.path().join("loss.svg");
        let curve = Curve {
            label: "loss",
            points: &[(1, 2.0), (2, 1.0)],
        };
        write_loss_plot_svg(&[curve], &path, "t").unwrap();
        assert_eq!(
            fs::read_to_string(&path).unwrap(),
            loss_curves_svg(&[curve], "t").unwrap()
        );
    }
}
