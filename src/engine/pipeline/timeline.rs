//! The picture of one pipeline step ([`svg`]): a row per stage, a box per instruction
//! (forwards blue, backwards green — the zero-bubble schedule's input halves light green and
//! weight halves orange —, embeddings backwards grey, each labelled with its micro-batch and
//! chunk, [`Op::label`]), time to the right, the bubbles left blank; the title gives the bubble
//! fraction.

use std::fmt::Write;

use tessera_actors::compute::TimedOp;

use super::schedule::{Kind, Op, Span};

/// One instruction as a stage ran it, in seconds from the step's start.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timed {
    pub stage: usize,
    pub op: Op,
    pub start_s: f64,
    pub end_s: f64,
}

impl Timed {
    /// As a worker reports it ([`TimedOp`]).
    pub fn op(&self) -> TimedOp {
        let kind = match self.op.kind {
            Kind::Forward => 0,
            Kind::Backward => 1,
            Kind::EmbedBackward => 2,
            Kind::Input => 3,
            Kind::Weight => 4,
        };
        TimedOp { kind, chunk: self.op.chunk as u32, micro_batch: self.op.mb as u32, start_s: self.start_s, end_s: self.end_s }
    }

    /// A worker's report back as an instruction of stage `stage`.
    pub fn from_op(stage: usize, o: &TimedOp) -> Timed {
        let kind = match o.kind {
            0 => Kind::Forward,
            1 => Kind::Backward,
            3 => Kind::Input,
            4 => Kind::Weight,
            _ => Kind::EmbedBackward,
        };
        let op = Op { kind, mb: o.micro_batch as usize, chunk: o.chunk as usize };
        Timed { stage, op, start_s: o.start_s, end_s: o.end_s }
    }

    /// The unit-time timeline of [`super::schedule::simulate`], one unit a second.
    pub fn from_units(spans: &[Span]) -> Vec<Timed> {
        spans.iter().map(|s| Timed { stage: s.stage, op: s.op, start_s: s.start as f64, end_s: s.end as f64 }).collect()
    }
}

/// Idle share of the stages' time between the step's first start and last end, counting
/// forwards and backwards as busy.
pub fn bubble(ops: &[Timed], stages: usize) -> f64 {
    let t0 = ops.iter().map(|o| o.start_s).fold(f64::INFINITY, f64::min);
    let t1 = ops.iter().map(|o| o.end_s).fold(f64::NEG_INFINITY, f64::max);
    let busy: f64 = ops.iter().filter(|o| o.op.kind != Kind::EmbedBackward).map(|o| o.end_s - o.start_s).sum();
    if t1.partial_cmp(&t0) != Some(std::cmp::Ordering::Greater) || stages == 0 {
        return 0.0;
    }
    1.0 - busy / (stages as f64 * (t1 - t0))
}

const ROW: f64 = 34.0;
const LEFT: f64 = 78.0;
const WIDTH: f64 = 900.0;

/// The SVG of one step's instructions on `stages` stages, titled `title` (the bubble
/// fraction is added).
pub fn svg(ops: &[Timed], stages: usize, title: &str, unit: &str) -> String {
    let t0 = ops.iter().map(|o| o.start_s).fold(f64::INFINITY, f64::min);
    let t1 = ops.iter().map(|o| o.end_s).fold(f64::NEG_INFINITY, f64::max);
    let span = if t1 > t0 { t1 - t0 } else { 1.0 };
    let x = |t: f64| LEFT + (t - t0) / span * WIDTH;
    let height = 60.0 + ROW * stages as f64 + 30.0;
    let mut s = String::new();
    let _ = write!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{height}" font-family="sans-serif" font-size="11">
<rect width="100%" height="100%" fill="white"/>
<text x="{LEFT}" y="20" font-size="14">{title} — bubble {b:.1} %</text>
<text x="{LEFT}" y="38" fill="#555">forward <tspan fill="#3b6fb6">■</tspan>  backward <tspan fill="#3a9a4a">■</tspan>  input half <tspan fill="#7cc47f">■</tspan>  weight half <tspan fill="#e08a2c">■</tspan>  embeddings backward <tspan fill="#999">■</tspan>  (F3.1: micro-batch 3, chunk 1)  idle: blank</text>
"##,
        w = LEFT + WIDTH + 20.0,
        title = escape(title),
        b = 100.0 * bubble(ops, stages),
    );
    for p in 0..stages {
        let y = 50.0 + ROW * p as f64;
        let _ = writeln!(s, r##"<text x="8" y="{:.1}">stage {p}</text>"##, y + ROW / 2.0 + 4.0);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#ddd"/>"##,
            y + ROW - 2.0,
            LEFT + WIDTH,
            y + ROW - 2.0
        );
    }
    for o in ops {
        let y = 50.0 + ROW * o.stage as f64;
        let fill = match o.op.kind {
            Kind::Forward => "#3b6fb6",
            Kind::Backward => "#3a9a4a",
            Kind::Input => "#7cc47f",
            Kind::Weight => "#e08a2c",
            Kind::EmbedBackward => "#999999",
        };
        let label = o.op.label();
        let (a, b) = (x(o.start_s), x(o.end_s).max(x(o.start_s) + 1.5));
        let _ = writeln!(
            s,
            r##"<rect x="{a:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{fill}" stroke="white" stroke-width="0.5"><title>stage {} {label}: {:.4}–{:.4} {unit}</title></rect>"##,
            y + 2.0,
            b - a,
            ROW - 6.0,
            o.stage,
            o.start_s - t0,
            o.end_s - t0
        );
        if b - a > 16.0 {
            let _ = writeln!(
                s,
                r##"<text x="{:.1}" y="{:.1}" fill="white" text-anchor="middle">{label}</text>"##,
                (a + b) / 2.0,
                y + ROW / 2.0 + 2.0
            );
        }
    }
    let y = 50.0 + ROW * stages as f64 + 16.0;
    let _ = writeln!(
        s,
        r##"<text x="{LEFT}" y="{y:.1}" fill="#555">0</text><text x="{:.1}" y="{y:.1}" fill="#555" text-anchor="end">{span:.4} {unit}</text>"##,
        LEFT + WIDTH
    );
    s.push_str("</svg>\n");
    s
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::super::schedule::{simulate, streams, Schedule};
    use super::*;

    /// The picture of 1F1B on 4 stages and 8 micro-batches has a box per instruction and the
    /// theory's bubble, 3/11.
    #[test]
    fn the_schedule_picture_shows_every_instruction_and_the_bubble() {
        let spans = simulate(&streams(Schedule::OneFOneB, 4, 1, 8)).expect("completes");
        let ops = Timed::from_units(&spans);
        assert!((bubble(&ops, 4) - 3.0 / 11.0).abs() < 1e-12);
        let svg = svg(&ops, 4, "1f1b, 4 stages, 8 micro-batches", "units");
        assert_eq!(svg.matches("<rect x=").count(), 4 * 16 + 8);
        assert!(svg.contains("bubble 27.3 %"), "{svg}");
    }
}
