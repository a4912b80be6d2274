//! Pictures for the recorder: an RGB image encoded as PNG, and line plots (a loss curve, a
//! schedule's timeline as lines) drawn into one without a font file or a plotting system: a
//! title, a frame with tick marks and their values at the round numbers the report page uses,
//! grid lines, the axes' labels in an 8 x 8 bitmap font, a log scale where asked, and one
//! coloured polyline per series.

use font8x8::legacy::BASIC_LEGACY;

use super::report::chart::{tick_label, x_ticks, y_axis};
use crate::{invalid, Result};

/// An 8-bit RGB image, rows top to bottom.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RgbImage {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// `width * height * 3` bytes.
    pub data: Vec<u8>,
}

impl RgbImage {
    /// A `width` x `height` image of one colour.
    pub fn filled(width: u32, height: u32, rgb: [u8; 3]) -> Self {
        let n = (width * height) as usize;
        Self {
            width,
            height,
            data: rgb.iter().copied().cycle().take(n * 3).collect(),
        }
    }

    /// Sets pixel (x, y) when it lies inside.
    pub fn put(&mut self, x: i64, y: i64, rgb: [u8; 3]) {
        if x >= 0 && y >= 0 && (x as u32) < self.width && (y as u32) < self.height {
            let i = (y as usize * self.width as usize + x as usize) * 3;
            self.data[i..i + 3].copy_from_slice(&rgb);
        }
    }

    /// A straight line from (x0, y0) to (x1, y1) (Bresenham).
    pub fn line(&mut self, (mut x0, mut y0): (i64, i64), (x1, y1): (i64, i64), rgb: [u8; 3]) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let mut err = dx + dy;
        loop {
            self.put(x0, y0, rgb);
            if x0 == x1 && y0 == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x0 += sx;
            }
            if e2 <= dx {
                err += dx;
                y0 += sy;
            }
        }
    }

    /// The image as a PNG file's bytes.
    pub fn png(&self) -> Result<Vec<u8>> {
        if self.data.len() != (self.width * self.height * 3) as usize || self.width == 0 {
            return Err(invalid!(
                "an RGB image of {}x{} needs {} bytes, not {}",
                self.width,
                self.height,
                self.width * self.height * 3,
                self.data.len()
            ));
        }
        let mut out = Vec::new();
        let mut enc = png::Encoder::new(&mut out, self.width, self.height);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut w = enc
            .write_header()
            .map_err(|e| invalid!("PNG encoding failed: {e}"))?;
        w.write_image_data(&self.data)
            .map_err(|e| invalid!("PNG encoding failed: {e}"))?;
        w.finish()
            .map_err(|e| invalid!("PNG encoding failed: {e}"))?;
        Ok(out)
    }
}

/// Series of (x, y) points to draw as lines, with what they are.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LinePlot {
    /// The curves, each a list of (x, y) points.
    pub series: Vec<Vec<(f64, f64)>>,
    /// The heading above the plot (empty: none).
    pub title: String,
    /// What x is, under the axis (`step`).
    pub x_label: String,
    /// What y is, above the axis (`loss`).
    pub y_label: String,
    /// A logarithmic y axis (only positive values are drawn): a loss that falls by decades
    /// stays readable after its first hundred steps.
    pub log_y: bool,
}

const COLOURS: [[u8; 3]; 4] = [[78, 121, 167], [225, 87, 89], [89, 161, 79], [242, 142, 43]];

/// Pixels a character of the 8 x 8 bitmap font takes across (and down).
const GLYPH: i64 = 8;

/// Pixels `s` takes across in the bitmap font.
fn text_width(s: &str) -> i64 {
    s.chars().count() as i64 * GLYPH
}

impl RgbImage {
    /// `s` in an 8 x 8 bitmap font, its top-left corner at (x, y); a character the font lacks
    /// is drawn as `?`.
    pub fn text(&mut self, x: i64, y: i64, s: &str, rgb: [u8; 3]) {
        for (i, c) in s.chars().enumerate() {
            let rows = BASIC_LEGACY[if c.is_ascii() {
                c as usize
            } else {
                '?' as usize
            }];
            for (dy, row) in rows.iter().enumerate() {
                for dx in 0..GLYPH {
                    if row >> dx & 1 == 1 {
                        self.put(x + i as i64 * GLYPH + dx, y + dy as i64, rgb);
                    }
                }
            }
        }
    }
}

impl LinePlot {
    /// One series, no title or labels, a linear y axis.
    pub fn new(points: Vec<(f64, f64)>) -> Self {
        Self {
            series: vec![points],
            ..Self::default()
        }
    }

    /// A training loss against the step, on a log scale ("training loss", "step", "loss"):
    /// the curve `train` and the experiments record at each evaluation.
    pub fn loss_curve(points: Vec<(f64, f64)>) -> Self {
        Self {
            title: "training loss".into(),
            x_label: "step".into(),
            y_label: "loss".into(),
            log_y: true,
            ..Self::new(points)
        }
    }

    /// The plot drawn into a `width` x `height` image: white, the title above, a frame with
    /// tick marks and their values at round numbers (the report page's axes: whole steps, a
    /// log axis's 1-2-5 marks), grey grid lines, the axes' labels, and each series in its
    /// colour (non-finite points, and under a log axis non-positive ones, skipped).
    pub fn render(&self, width: u32, height: u32) -> RgbImage {
        let mut img = RgbImage::filled(width, height, [255, 255, 255]);
        let (dark, grey) = ([60, 60, 60], [225, 225, 225]);
        let keep =
            |p: &&(f64, f64)| p.0.is_finite() && p.1.is_finite() && (!self.log_y || p.1 > 0.0);
        let pts = || self.series.iter().flatten().filter(keep);
        let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for &(x, y) in pts() {
            (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
        }
        let (w, h) = (width as i64, height as i64);
        let scale = if self.log_y { " (log scale)" } else { "" };
        img.text((w - text_width(&self.title)) / 2, 4, &self.title, dark);
        img.text(4, 16, &format!("{}{scale}", self.y_label), dark);
        if x0 > x1 {
            return img;
        }
        if x1 - x0 < 1e-12 {
            (x0, x1) = (x0 - 1.0, x1 + 1.0);
        }
        if y1 - y0 < 1e-12 {
            (y0, y1) = if self.log_y {
                (y0 / 2.0, y1 * 2.0)
            } else {
                (y0 - 0.5, y1 + 0.5)
            };
        }
        let (y0, yticks) = y_axis(y0, y1, self.log_y);
        let xticks = x_ticks(x0, x1, 5, pts().all(|p| p.0.fract() == 0.0));
        let ylabels: Vec<String> = yticks.iter().map(|t| tick_label(*t)).collect();
        let left = 10 + ylabels.iter().map(|l| text_width(l)).max().unwrap_or(0);
        let (top, right, bottom) = (30, w - 14, h - 36);
        let fy = |y: f64| if self.log_y { y.log10() } else { y };
        let px = |x: f64| left + ((x - x0) / (x1 - x0) * (right - left) as f64).round() as i64;
        let py = |y: f64| {
            bottom - ((fy(y) - fy(y0)) / (fy(y1) - fy(y0)) * (bottom - top) as f64).round() as i64
        };
        for t in &xticks {
            let (x, label) = (px(*t), tick_label(*t));
            img.line((x, top), (x, bottom), grey);
            img.line((x, bottom), (x, bottom + 4), dark);
            img.text(x - text_width(&label) / 2, bottom + 7, &label, dark);
        }
        for (t, label) in yticks.iter().zip(&ylabels) {
            let y = py(*t);
            img.line((left, y), (right, y), grey);
            img.line((left - 4, y), (left, y), dark);
            img.text(left - 6 - text_width(label), y - 4, label, dark);
        }
        for (a, b) in [
            ((left, top), (right, top)),
            ((right, top), (right, bottom)),
            ((left, bottom), (right, bottom)),
            ((left, top), (left, bottom)),
        ] {
            img.line(a, b, dark);
        }
        let x_label_at = (left + right - text_width(&self.x_label)) / 2;
        img.text(x_label_at, h - 12, &self.x_label, dark);
        for (s, points) in self.series.iter().enumerate() {
            let colour = COLOURS[s % COLOURS.len()];
            let drawn: Vec<_> = points.iter().filter(keep).collect();
            for pair in drawn.windows(2) {
                img.line(
                    (px(pair[0].0), py(pair[0].1)),
                    (px(pair[1].0), py(pair[1].1)),
                    colour,
                );
            }
            if let [only] = drawn[..] {
                img.put(px(only.0), py(only.1), colour);
            }
        }
        img
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DARK: [u8; 3] = [60, 60, 60];

    /// Whether the pixels of `rect` (x, y, width, height) are the same in `a` and `b`.
    fn same(a: &RgbImage, b: &RgbImage, (x0, y0, w, h): (usize, usize, usize, usize)) -> bool {
        (y0..y0 + h).all(|y| {
            (x0..x0 + w).all(|x| {
                let i = (y * a.width as usize + x) * 3;
                a.data[i..i + 3] == b.data[i..i + 3]
            })
        })
    }

    #[test]
    fn text_draws_each_character_left_to_right_top_down() {
        // font8x8's '1': a stem two pixels wide at columns 2-3 of the top row, a base six
        // pixels wide (columns 0-5) on row 6, row 7 empty.
        let mut img = RgbImage::filled(8, 8, [255; 3]);
        img.text(0, 0, "1", [0; 3]);
        let dark = |x: usize, y: usize| img.data[(y * 8 + x) * 3] == 0;
        assert!(dark(2, 0) && dark(3, 0) && !dark(1, 0) && !dark(4, 0));
        assert!((0..6).all(|x| dark(x, 6)) && !dark(6, 6) && !dark(7, 6));
        assert!((0..8).all(|x| !dark(x, 7)));
        // A character the font lacks is drawn as '?'.
        let (mut a, mut b) = (
            RgbImage::filled(8, 8, [255; 3]),
            RgbImage::filled(8, 8, [255; 3]),
        );
        a.text(0, 0, "é", [0; 3]);
        b.text(0, 0, "?", [0; 3]);
        assert_eq!(a, b);
    }

    #[test]
    fn a_log_plot_labels_its_lowest_mark_and_centres_its_title() {
        let plot = LinePlot {
            title: "T".into(),
            x_label: "step".into(),
            y_label: "loss".into(),
            log_y: true,
            ..LinePlot::new(vec![(1.0, 2.3), (50.0, 1.2), (100.0, 0.51)])
        };
        let img = plot.render(320, 200);
        let blank = || RgbImage::filled(320, 200, [255; 3]);
        // The title's glyph centred at the top.
        let mut title = blank();
        title.text((320 - 8) / 2, 4, "T", DARK);
        assert!(same(&img, &title, (156, 4, 8, 8)));
        // The axis starts at the 1-1.5-2-3-5-7 mark below 0.51: "0.5", its label right-aligned
        // beside the frame's bottom (y 164, the 36 pixels below it hold the x axis), left of a
        // frame at 10 + the widest label's 24 pixels.
        let mut low = blank();
        low.text(34 - 6 - 24, 164 - 4, "0.5", DARK);
        assert!(same(&img, &low, (4, 160, 24, 8)));
        // The y axis says what it is, and that it is a log scale.
        let mut label = blank();
        label.text(4, 16, "loss (log scale)", DARK);
        assert!(same(&img, &label, (4, 16, 16 * 8, 8)));
    }
}
