//! Line charts as inline SVG for the report page: axes with round-number ticks, axis labels,
//! a title, a legend, a log scale where a value spans decades (a loss), and each series'
//! points in a `data-points` attribute that the page's script reads to show values under the
//! pointer.

use std::fmt::Write;

pub use crate::runtime::axis::{linear_ticks, tick_label};

use super::html::escape;

/// One named line of `(x, y)` points.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Its name in the legend (a run's).
    pub name: String,
    /// Its points, in x order.
    pub points: Vec<(f64, f64)>,
}

/// A chart of one quantity against another, several series overlaid.
#[derive(Clone, Debug, PartialEq)]
pub struct LineChart {
    /// The heading above the plot.
    pub title: String,
    /// What x is (`step`).
    pub x_label: String,
    /// What y is (`loss`).
    pub y_label: String,
    /// A logarithmic y axis (only positive values are drawn).
    pub log_y: bool,
    /// The lines.
    pub series: Vec<Series>,
}

/// Colours of the series, in turn (Tableau 10).
const COLOURS: [&str; 8] = [
    "#4e79a7", "#e15759", "#59a14f", "#f28e2b", "#76b7b2", "#edc948", "#b07aa1", "#9c755f",
];

const W: f64 = 640.0;
const H: f64 = 320.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 30.0;
const BOTTOM: f64 = 50.0;

/// The marks of a log axis within each decade: 1, 2 and 5 over fewer than three decades,
/// 1, 1.5, 2, 3, 5 and 7 within one (a loss that fell from 2.3 to 0.5 gets marks below 1).
fn log_marks(lo: f64, hi: f64) -> &'static [f64] {
    if hi / lo < 10.0 {
        &[1.0, 1.5, 2.0, 3.0, 5.0, 7.0]
    } else if hi / lo < 1000.0 {
        &[1.0, 2.0, 5.0]
    } else {
        &[1.0]
    }
}

/// `m` times ten to the `e`, as the nearest double to that decimal (0.7, not 7 x 0.1's
/// 0.7000000000000001): powers of ten up to 1e22 are exact, and one division rounds once.
fn decade(m: f64, e: i32) -> f64 {
    if e >= 0 {
        m * 10f64.powi(e)
    } else {
        m / 10f64.powi(-e)
    }
}

/// Ticks of a log axis over `lo..=hi` (both positive): the powers of ten inside, with the
/// finer marks (1, 1.5, 2, 3, 5, 7 within a decade; 1, 2, 5 within three) when the range
/// spans few decades.
pub fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let (a, b) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    let mut out = Vec::new();
    for e in a..=b {
        for m in log_marks(lo, hi) {
            let v = decade(*m, e);
            if v >= lo * (1.0 - 1e-9) && v <= hi * (1.0 + 1e-9) {
                out.push(v);
            }
        }
    }
    out
}

/// The largest mark of a log axis over `lo..hi` at or below `lo`: where the axis starts, so
/// that its lowest value lies above a labelled tick.
fn log_floor(lo: f64, hi: f64) -> f64 {
    let e = lo.log10().floor() as i32;
    log_marks(lo, hi)
        .iter()
        .map(|m| decade(*m, e))
        .filter(|v| *v <= lo * (1.0 + 1e-9))
        .fold(decade(1.0, e), f64::max)
}

/// The ticks of an x axis over `lo..=hi`, about `n`: whole numbers only when the values are
/// (steps: no 199.5 between two steps).
pub fn x_ticks(lo: f64, hi: f64, n: usize, whole: bool) -> Vec<f64> {
    linear_ticks(lo, hi, n)
        .into_iter()
        .filter(|t| !whole || t.fract() == 0.0)
        .collect()
}

/// A y axis over the values `lo..=hi`: where it starts (a log axis at the mark below `lo`, so
/// that the lowest value lies above a labelled tick) and its ticks (a log axis's 1-2-5 marks,
/// or round linear values where a decade holds fewer than three of them).
pub fn y_axis(lo: f64, hi: f64, log: bool) -> (f64, Vec<f64>) {
    if !log {
        return (lo, linear_ticks(lo, hi, 5));
    }
    let lo = log_floor(lo, hi);
    let ticks = Some(log_ticks(lo, hi))
        .filter(|t| t.len() >= 3)
        .unwrap_or_else(|| linear_ticks(lo, hi, 5));
    (lo, ticks)
}

impl LineChart {
    /// The chart as an SVG element (an empty-data chart says so instead of drawing axes).
    pub fn svg(&self) -> String {
        let Some(f) = self.frame() else {
            return format!(
                "<p class=\"missing\">{}: nothing to draw (no values logged)</p>",
                escape(&self.title)
            );
        };
        let mut s = String::new();
        let _ = write!(
            s,
            "<svg class=\"chart\" viewBox=\"0 0 {W} {H}\" width=\"{W}\" height=\"{H}\" \
             data-x0=\"{}\" data-x1=\"{}\" data-left=\"{LEFT}\" data-right=\"{}\" \
             role=\"img\" aria-label=\"{}\">\
             <text x=\"{}\" y=\"18\" class=\"title\" text-anchor=\"middle\">{}</text>",
            f.x0,
            f.x1,
            W - RIGHT,
            escape(&self.title),
            W / 2.0,
            escape(&self.title)
        );
        s.push_str(&self.axes(&f));
        for (i, series) in self.series.iter().enumerate() {
            s.push_str(&self.line(&f, i, series));
        }
        s.push_str("<line class=\"cursor\" x1=\"0\" x2=\"0\" y1=\"30\" y2=\"270\" visibility=\"hidden\"/></svg>");
        s
    }

    /// Whether a point is drawn: finite, and positive on a log axis.
    fn keep(&self, (x, y): (f64, f64)) -> bool {
        x.is_finite() && y.is_finite() && (!self.log_y || y > 0.0)
    }

    /// The drawn points of every series.
    fn points(&self) -> impl Iterator<Item = (f64, f64)> + '_ {
        self.series
            .iter()
            .flat_map(|s| s.points.iter().copied().filter(|&p| self.keep(p)))
    }

    /// The plot's ranges and y ticks, from the drawn points (`None` without any): one step
    /// gets an axis from 0 to it (steps count from 1), not a window around it; one value a
    /// tenth of itself either way.
    fn frame(&self) -> Option<Frame> {
        self.points().next()?;
        let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for (x, y) in self.points() {
            (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
        }
        if x1 <= x0 {
            (x0, x1) = match x0 > 0.0 {
                true => (0.0, x0),
                false => (x0 - 1.0, x1 + 1.0),
            };
        }
        if y1 <= y0 {
            let pad = if y0 == 0.0 { 1.0 } else { y0.abs() * 0.1 };
            (y0, y1) = (y0 - pad, y1 + pad);
            if self.log_y {
                y0 = y0.max(y1 / 10.0);
            }
        }
        let (y0, yticks) = y_axis(y0, y1, self.log_y);
        Some(Frame {
            x0,
            x1,
            y0,
            y1,
            log_y: self.log_y,
            yticks,
            whole_x: self.points().all(|p| p.0.fract() == 0.0),
        })
    }

    /// The axes, their ticks and grid lines, and their labels.
    fn axes(&self, f: &Frame) -> String {
        let mut s = String::new();
        let (bottom, right) = (H - BOTTOM, W - RIGHT);
        let _ = write!(
            s,
            "<line x1=\"{LEFT}\" y1=\"{bottom}\" x2=\"{right}\" y2=\"{bottom}\" class=\"axis\"/>\
             <line x1=\"{LEFT}\" y1=\"{TOP}\" x2=\"{LEFT}\" y2=\"{bottom}\" class=\"axis\"/>"
        );
        for t in x_ticks(f.x0, f.x1, 6, f.whole_x) {
            let x = f.px(t);
            let _ = write!(
                s,
                "<line x1=\"{x}\" y1=\"{bottom}\" x2=\"{x}\" y2=\"{}\" class=\"axis\"/>\
                 <text x=\"{x}\" y=\"{}\" text-anchor=\"middle\" class=\"tick\">{}</text>",
                bottom + 5.0,
                bottom + 18.0,
                tick_label(t)
            );
        }
        for &t in &f.yticks {
            let y = f.py(t);
            let _ = write!(
                s,
                "<line x1=\"{LEFT}\" y1=\"{y}\" x2=\"{right}\" y2=\"{y}\" class=\"grid\"/>\
                 <text x=\"{}\" y=\"{}\" text-anchor=\"end\" class=\"tick\">{}</text>",
                LEFT - 6.0,
                y + 4.0,
                tick_label(t)
            );
        }
        let scale = if self.log_y { " (log scale)" } else { "" };
        let _ = write!(
            s,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" class=\"label\">{}</text>\
             <text transform=\"translate(16 {}) rotate(-90)\" text-anchor=\"middle\" \
             class=\"label\">{}{scale}</text>",
            (LEFT + right) / 2.0,
            H - 10.0,
            escape(&self.x_label),
            (TOP + bottom) / 2.0,
            escape(&self.y_label)
        );
        s
    }

    /// Series `i`'s line (a dot when it has one point), with its points for the page's
    /// script, and its legend entry.
    fn line(&self, f: &Frame, i: usize, series: &Series) -> String {
        let mut s = String::new();
        let colour = COLOURS[i % COLOURS.len()];
        let drawn: Vec<(f64, f64)> = series
            .points
            .iter()
            .copied()
            .filter(|&p| self.keep(p))
            .collect();
        let path: Vec<String> = drawn
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", f.px(x), f.py(y)))
            .collect();
        let data: Vec<String> = drawn.iter().map(|(x, y)| format!("[{x},{y}]")).collect();
        let _ = write!(
            s,
            "<polyline class=\"series\" fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.5\" \
             points=\"{}\" data-name=\"{}\" data-points=\"[{}]\"/>",
            path.join(" "),
            escape(&series.name),
            data.join(",")
        );
        if drawn.len() == 1 {
            let _ = write!(
                s,
                "<circle cx=\"{}\" cy=\"{}\" r=\"3\" fill=\"{colour}\"/>",
                f.px(drawn[0].0),
                f.py(drawn[0].1)
            );
        }
        let right = W - RIGHT;
        let _ = write!(
            s,
            "<rect x=\"{}\" y=\"{}\" width=\"10\" height=\"3\" fill=\"{colour}\"/>\
             <text x=\"{}\" y=\"{}\" class=\"legend\">{}</text>",
            right - 150.0,
            TOP + 6.0 + 14.0 * i as f64,
            right - 136.0,
            TOP + 10.0 + 14.0 * i as f64,
            escape(&series.name)
        );
        s
    }
}

/// Where a chart's values fall on its plot: the ranges, the y ticks, and whether x takes whole
/// numbers only (steps).
struct Frame {
    x0: f64,
    x1: f64,
    y0: f64,
    y1: f64,
    log_y: bool,
    yticks: Vec<f64>,
    whole_x: bool,
}

impl Frame {
    fn fy(&self, y: f64) -> f64 {
        if self.log_y {
            y.log10()
        } else {
            y
        }
    }

    /// The plot's x coordinate of `x`.
    fn px(&self, x: f64) -> f64 {
        LEFT + (x - self.x0) / (self.x1 - self.x0) * (W - LEFT - RIGHT)
    }

    /// The plot's y coordinate of `y`.
    fn py(&self, y: f64) -> f64 {
        let (ly0, ly1) = (self.fy(self.y0), self.fy(self.y1));
        TOP + (ly1 - self.fy(y)) / (ly1 - ly0) * (H - TOP - BOTTOM)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_one_point_chart_starts_its_axis_at_zero() {
        let chart = LineChart {
            title: "accuracy".into(),
            x_label: "step".into(),
            y_label: "accuracy".into(),
            log_y: false,
            series: vec![Series {
                name: "run".into(),
                points: vec![(200.0, 0.5)],
            }],
        };
        let svg = chart.svg();
        let ticks: Vec<&str> = svg
            .split("class=\"tick\">")
            .skip(1)
            .map(|t| t.split('<').next().unwrap())
            .collect();
        assert!(ticks.contains(&"0") && ticks.contains(&"200"), "{ticks:?}");
        assert!(
            !ticks.contains(&"199") && !ticks.contains(&"201"),
            "{ticks:?}"
        );
        assert!(svg.contains("<circle"), "the one point is drawn: {svg}");
    }

    #[test]
    fn ticks_are_round_numbers_inside_the_range() {
        assert_eq!(
            linear_ticks(0.0, 30.0, 6),
            vec![0.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0]
        );
        assert_eq!(
            linear_ticks(1.0, 29.0, 6),
            vec![5.0, 10.0, 15.0, 20.0, 25.0]
        );
        assert_eq!(log_ticks(0.03, 2.5), vec![0.05, 0.1, 0.2, 0.5, 1.0, 2.0]);
        assert_eq!(
            log_ticks(1e-4, 10.0),
            vec![1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0]
        );
        assert_eq!(
            log_ticks(0.5, 2.3),
            vec![0.5, 0.7, 1.0, 1.5, 2.0],
            "within a decade the finer marks, below 1 too"
        );
        assert_eq!(log_floor(0.51, 2.3), 0.5);
        assert_eq!(log_floor(0.03, 2.5), 0.02);
        assert_eq!(tick_label(0.25), "0.25");
        assert_eq!(tick_label(199.5), "199.5");
        assert_eq!(tick_label(1500.0), "1500");
        assert_eq!(tick_label(2e-5), "2e-5");
    }

    #[test]
    fn a_log_chart_draws_positive_points_and_says_so() {
        let c = LineChart {
            title: "loss".into(),
            x_label: "step".into(),
            y_label: "loss".into(),
            log_y: true,
            series: vec![Series {
                name: "a<b".into(),
                points: vec![(1.0, 2.0), (2.0, 0.0), (3.0, 0.5)],
            }],
        };
        let svg = c.svg();
        assert!(svg.contains("(log scale)"));
        assert!(svg.contains("data-points=\"[[1,2],[3,0.5]]\""), "{svg}");
        assert!(svg.contains("a&lt;b"));
        let empty = LineChart {
            series: vec![],
            ..c
        };
        assert!(empty.svg().contains("nothing to draw"));
        // One point at step 200: whole-step ticks only, each label once.
        let one = LineChart {
            log_y: false,
            series: vec![Series {
                name: "m".into(),
                points: vec![(200.0, 0.655)],
            }],
            ..empty
        };
        let svg = one.svg();
        let labels: Vec<&str> = svg
            .split("class=\"tick\">")
            .skip(1)
            .filter_map(|r| r.split('<').next())
            .collect();
        assert_eq!(
            labels.iter().filter(|l| **l == "200").count(),
            1,
            "{labels:?}"
        );
        assert!(!labels.contains(&"199.5"), "{labels:?}");
    }
}
