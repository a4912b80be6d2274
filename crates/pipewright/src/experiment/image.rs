//! Pictures for the recorder: an RGB image encoded as PNG, and line plots (a loss curve, a
//! schedule's timeline as lines) drawn into one without any font or plotting system: a frame,
//! grid lines at the round values of each axis, and one coloured polyline per series.

use super::report::chart::linear_ticks;
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

/// Series of (x, y) points to draw as lines.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LinePlot {
    /// The curves, each a list of (x, y) points.
    pub series: Vec<Vec<(f64, f64)>>,
}

const COLOURS: [[u8; 3]; 4] = [[78, 121, 167], [225, 87, 89], [89, 161, 79], [242, 142, 43]];

impl LinePlot {
    /// One series.
    pub fn new(points: Vec<(f64, f64)>) -> Self {
        Self {
            series: vec![points],
        }
    }

    /// The plot drawn into a `width` x `height` image: white, a frame, grey grid lines, each
    /// series in its colour (non-finite points skipped).
    pub fn render(&self, width: u32, height: u32) -> RgbImage {
        let mut img = RgbImage::filled(width, height, [255, 255, 255]);
        let pts = self
            .series
            .iter()
            .flatten()
            .filter(|p| p.0.is_finite() && p.1.is_finite());
        let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for &(x, y) in pts {
            (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
        }
        if x0 > x1 {
            return img;
        }
        if x1 - x0 < 1e-12 {
            x1 = x0 + 1.0;
        }
        if y1 - y0 < 1e-12 {
            (y0, y1) = (y0 - 0.5, y1 + 0.5);
        }
        let (m, w, h) = (8i64, width as i64, height as i64);
        let px = |x: f64| m + ((x - x0) / (x1 - x0) * (w - 2 * m - 1) as f64).round() as i64;
        let py =
            |y: f64| h - 1 - m - ((y - y0) / (y1 - y0) * (h - 2 * m - 1) as f64).round() as i64;
        let grey = [225, 225, 225];
        for t in linear_ticks(x0, x1, 5) {
            img.line((px(t), m), (px(t), h - 1 - m), grey);
        }
        for t in linear_ticks(y0, y1, 5) {
            img.line((m, py(t)), (w - 1 - m, py(t)), grey);
        }
        let black = [60, 60, 60];
        for (a, b) in [
            ((m, m), (w - 1 - m, m)),
            ((w - 1 - m, m), (w - 1 - m, h - 1 - m)),
        ] {
            img.line(a, b, black);
        }
        img.line((m, h - 1 - m), (w - 1 - m, h - 1 - m), black);
        img.line((m, m), (m, h - 1 - m), black);
        for (s, points) in self.series.iter().enumerate() {
            let colour = COLOURS[s % COLOURS.len()];
            let finite: Vec<_> = points
                .iter()
                .filter(|p| p.0.is_finite() && p.1.is_finite())
                .collect();
            for pair in finite.windows(2) {
                img.line(
                    (px(pair[0].0), py(pair[0].1)),
                    (px(pair[1].0), py(pair[1].1)),
                    colour,
                );
            }
            if let [only] = finite[..] {
                img.put(px(only.0), py(only.1), colour);
            }
        }
        img
    }
}
