//! Self-contained SVG line chart of loss curves (one polyline per series vs step), written at
//! the end of a run so users can see their training/validation loss as a picture.

use std::fmt::Write as _;
use std::io;
use std::path::Path;

const WIDTH: f64 = 800.0;
const HEIGHT: f64 = 480.0;
const LEFT: f64 = 75.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 55.0;
const COLORS: [&str; 8] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

/// Escape text for XML content and attribute values.
pub(crate) fn xml_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if (c as u32) < 0x20 && c != '\t' => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// Tick spacing of 1, 2 or 5 times a power of ten giving about `target` ticks over `span`.
fn nice_step(span: f64, target: f64) -> f64 {
    let raw = (span / target).max(f64::MIN_POSITIVE);
    let mag = 10f64.powf(raw.log10().floor());
    let frac = raw / mag;
    let nice = if frac <= 1.0 {
        1.0
    } else if frac <= 2.0 {
        2.0
    } else if frac <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

/// Axis range covering all finite values; degenerate ranges are widened.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Range {
    lo: f64,
    hi: f64,
}

impl Range {
    fn of(values: impl Iterator<Item = f64>, pad_frac: f64) -> Range {
        let (lo, hi) = values.filter(|v| v.is_finite()).fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
        if !lo.is_finite() {
            return Range { lo: 0.0, hi: 1.0 };
        }
        if hi - lo <= f64::EPSILON * lo.abs().max(1.0) {
            return Range { lo: lo - 0.5, hi: hi + 0.5 };
        }
        let pad = (hi - lo) * pad_frac;
        Range { lo: lo - pad, hi: hi + pad }
    }

    fn ticks(&self) -> (Vec<f64>, f64) {
        let step = nice_step(self.hi - self.lo, 6.0);
        let first = (self.lo / step).ceil() as i64;
        let last = (self.hi / step).floor() as i64;
        ((first..=last).map(|k| k as f64 * step).collect(), step)
    }
}

/// Label with just enough decimals for the tick spacing.
fn tick_label(v: f64, step: f64) -> String {
    let decimals = (-step.log10().floor()).clamp(0.0, 8.0) as usize;
    format!("{v:.decimals$}")
}

struct Frame {
    x: Range,
    y: Range,
}

impl Frame {
    fn px(&self, x: f64) -> f64 {
        LEFT + (x - self.x.lo) / (self.x.hi - self.x.lo) * (WIDTH - LEFT - RIGHT)
    }
    fn py(&self, y: f64) -> f64 {
        HEIGHT - BOTTOM - (y - self.y.lo) / (self.y.hi - self.y.lo) * (HEIGHT - TOP - BOTTOM)
    }
}

fn draw_axes(svg: &mut String, f: &Frame) {
    let (x0, x1, y0, y1) = (LEFT, WIDTH - RIGHT, TOP, HEIGHT - BOTTOM);
    let _ = writeln!(svg, r##"<rect x="{x0}" y="{y0}" width="{}" height="{}" fill="none" stroke="#444"/>"##, x1 - x0, y1 - y0);
    let (xt, xs) = f.x.ticks();
    for t in xt {
        let x = f.px(t);
        let _ = writeln!(svg, r##"<line x1="{x:.1}" y1="{y1}" x2="{x:.1}" y2="{:.1}" stroke="#444"/>"##, y1 + 5.0);
        let _ = writeln!(svg, r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#, y1 + 20.0, tick_label(t, xs.max(1.0)));
    }
    let (yt, ys) = f.y.ticks();
    for t in yt {
        let y = f.py(t);
        let _ = writeln!(svg, r##"<line x1="{:.1}" y1="{y:.1}" x2="{x1}" y2="{y:.1}" stroke="#ddd"/>"##, x0 - 5.0);
        let _ = writeln!(svg, r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#, x0 - 8.0, y + 4.0, tick_label(t, ys));
    }
    let _ = writeln!(svg, r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">step</text>"#, (x0 + x1) / 2.0, HEIGHT - 12.0);
    let _ = writeln!(
        svg,
        r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">loss</text>"#,
        (y0 + y1) / 2.0,
        (y0 + y1) / 2.0
    );
    let _ = writeln!(svg, r#"<text x="{:.1}" y="24" text-anchor="middle" font-size="16">Loss curve</text>"#, (x0 + x1) / 2.0);
}

/// Render the chart as an SVG document string.
pub(crate) fn render_loss_curve_svg(series: &[(&str, &[(u64, f64)])]) -> String {
    let points = || series.iter().flat_map(|(_, pts)| pts.iter().filter(|p| p.1.is_finite()));
    let frame = Frame { x: Range::of(points().map(|p| p.0 as f64), 0.0), y: Range::of(points().map(|p| p.1), 0.05) };
    let mut svg = String::new();
    let _ = writeln!(svg, r#"<?xml version="1.0" encoding="UTF-8"?>"#);
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    draw_axes(&mut svg, &frame);
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let coords: Vec<String> =
            pts.iter().filter(|p| p.1.is_finite()).map(|&(s, v)| format!("{:.1},{:.1}", frame.px(s as f64), frame.py(v))).collect();
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{}"><title>{}</title></polyline>"#,
            coords.join(" "),
            xml_escape(name)
        );
        let ly = TOP + 10.0 + 20.0 * i as f64;
        let lx = WIDTH - RIGHT + 15.0;
        let _ = writeln!(svg, r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="3"/>"#, lx + 20.0);
        let _ = writeln!(svg, r#"<text x="{}" y="{:.1}">{}</text>"#, lx + 26.0, ly + 4.0, xml_escape(name));
    }
    svg.push_str("</svg>\n");
    svg
}

/// Write an SVG line chart of `series` (name, [(step, loss)]) to `path`, e.g.
/// `[("train", &train), ("val", &val)]`. Non-finite values are skipped.
pub fn write_loss_curve_svg(path: &Path, series: &[(&str, &[(u64, f64)])]) -> io::Result<()> {
    std::fs::write(path, render_loss_curve_svg(series)).map_err(|e| super::with_path(path, e))
}
