//! The faulted run as a picture: `timeline.svg` beside the chaos report. Time runs left to
//! right (seconds since the run started). The top panel is the committed-step count, so a
//! recovery shows as a flat stretch; below it, one row per worker id with a bar while the worker
//! is a member of a plan epoch (shaded by epoch), a red cross where the run declared it lost, and
//! marks where it asked to join or to drain; every fault is a band from its injection to its end
//! (a line when it has no duration) labelled with its kind, and every "training again" a green
//! tick on the step panel. Self-contained SVG, written by hand.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::Value;

use crate::runner::FaultReport;

const WIDTH: f64 = 1000.0;
const LEFT: f64 = 90.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 40.0;
const STEPS_H: f64 = 130.0;
const GAP: f64 = 30.0;
const ROW_H: f64 = 22.0;
const BOTTOM: f64 = 60.0;
/// Fault bands narrower than this many pixels are drawn as lines.
const BAND_MIN_PX: f64 = 2.0;
/// At most this many worker rows (a run with more ids draws the first ones).
const ROWS_MAX: usize = 64;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Tick spacing of 1, 2 or 5 × 10^k giving about `target` ticks over `span`.
fn tick(span: f64, target: f64) -> f64 {
    let raw = (span / target).max(1e-9);
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    mag * if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    }
}

fn fault_color(kind: &str) -> &'static str {
    match kind {
        "kill" | "kill_in_commit" | "partition" => "#d62728",
        "stop" | "slow" => "#ff7f0e",
        "term" | "usr1" => "#bcbd22",
        "join" => "#2ca02c",
        "delay" | "loss" | "reorder" | "duplicate" | "throttle" => "#9467bd",
        _ => "#8c564b", // checkpoint and disk faults
    }
}

/// One membership bar: worker `id` was a member from `t0` to `t1` (ms since start) in epoch `epoch`.
struct Bar {
    id: u64,
    t0: f64,
    t1: f64,
    epoch: u64,
}

/// The timeline SVG of a run whose event log is `events` (lines of `elastic_events.jsonl`,
/// wall-clock `t_ms`), that started at `start_ms` and ran `wall_s`, with `faults` as reported.
pub fn render(events: &[Value], faults: &[FaultReport], start_ms: u64, wall_s: f64) -> String {
    let rel = |e: &Value| e["t_ms"].as_u64().map_or(0.0, |t| t.saturating_sub(start_ms) as f64);
    let end = (wall_s * 1e3).max(events.iter().map(rel).fold(1.0, f64::max));
    let of = |kind: &'static str| events.iter().filter(move |e| e["event"] == kind);
    // Membership bars from consecutive epochs.
    let epochs: Vec<&Value> = of("epoch").collect();
    let mut bars = Vec::new();
    for (i, e) in epochs.iter().enumerate() {
        let t1 = epochs.get(i + 1).map_or(end, |n| rel(n));
        for m in e["members"].as_array().into_iter().flatten() {
            if let Some(id) = m["id"].as_u64() {
                bars.push(Bar { id, t0: rel(e), t1, epoch: e["epoch"].as_u64().unwrap_or(0) });
            }
        }
    }
    let mut ids: Vec<u64> = bars.iter().map(|b| b.id).chain(of("lost").filter_map(|e| e["id"].as_u64())).collect();
    ids.sort_unstable();
    ids.dedup();
    ids.truncate(ROWS_MAX);
    let row: BTreeMap<u64, usize> = ids.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    let rows_top = TOP + STEPS_H + GAP;
    let height = rows_top + ROW_H * ids.len().max(1) as f64 + BOTTOM;
    let plot_w = WIDTH - LEFT - RIGHT;
    let x = |ms: f64| LEFT + plot_w * (ms / end).clamp(0.0, 1.0);
    let row_y = |id: u64| row.get(&id).map(|&r| rows_top + ROW_H * r as f64);
    let steps: Vec<(f64, u64)> = of("step").filter_map(|e| Some((rel(e), e["step"].as_u64()?))).collect();
    let max_step = steps.iter().map(|s| s.1).max().unwrap_or(1).max(1) as f64;
    let sy = |s: f64| TOP + STEPS_H * (1.0 - s / max_step);

    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0}" viewBox="0 0 {WIDTH} {height:.0}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(svg, r##"<rect width="100%" height="100%" fill="#ffffff"/>"##);
    let _ = writeln!(svg, r#"<text x="{LEFT}" y="20" font-size="14">chaos run: the faulted run over time</text>"#);
    // Fault bands first, so everything else draws on top.
    for f in faults.iter().filter(|f| f.injected) {
        // A fault with a duration that outlasted the run lasts to its end.
        let until = match (f.until_ms, f.duration_ms) {
            (Some(u), _) => u as f64,
            (None, Some(_)) => end,
            (None, None) => f.injected_ms as f64,
        };
        let (a, b) = (x(f.injected_ms as f64), x(until));
        let c = fault_color(f.kind);
        let bottom = height - BOTTOM;
        if b - a >= BAND_MIN_PX {
            let _ = writeln!(
                svg,
                r#"<rect x="{a:.1}" y="{TOP}" width="{:.1}" height="{:.1}" fill="{c}" fill-opacity="0.12"/>"#,
                b - a,
                bottom - TOP
            );
        }
        let _ = writeln!(svg, r#"<line x1="{a:.1}" y1="{TOP}" x2="{a:.1}" y2="{bottom:.1}" stroke="{c}" stroke-dasharray="3,2"/>"#);
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" fill="{c}" transform="rotate(-90 {:.1} {:.1})">{}</text>"#,
            a - 2.0,
            TOP + 4.0,
            a - 2.0,
            TOP + 4.0,
            esc(f.kind)
        );
    }
    // Step panel.
    let _ = writeln!(svg, r##"<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{STEPS_H}" fill="none" stroke="#999"/>"##);
    let _ = writeln!(svg, r#"<text x="8" y="{:.1}">steps</text>"#, TOP + STEPS_H / 2.0);
    let _ = writeln!(svg, r#"<text x="8" y="{:.1}">committed</text>"#, TOP + STEPS_H / 2.0 + 13.0);
    let _ = writeln!(svg, r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{max_step:.0}</text>"#, LEFT - 4.0, TOP + 10.0);
    let _ = writeln!(svg, r#"<text x="{:.1}" y="{:.1}" text-anchor="end">0</text>"#, LEFT - 4.0, TOP + STEPS_H);
    if !steps.is_empty() {
        let mut pts = format!("{:.1},{:.1}", x(0.0), sy(0.0));
        let mut last = 0.0;
        for &(t, s) in &steps {
            let _ = write!(pts, " {:.1},{:.1} {:.1},{:.1}", x(t), sy(last), x(t), sy(s as f64));
            last = s as f64;
        }
        let _ = write!(pts, " {:.1},{:.1}", x(end), sy(last));
        let _ = writeln!(svg, r##"<polyline points="{pts}" fill="none" stroke="#1f77b4" stroke-width="1.5"/>"##);
    }
    for e in of("resumed") {
        let (t, s) = (x(rel(e)), sy(e["step"].as_f64().unwrap_or(0.0)));
        let _ = writeln!(
            svg,
            r##"<line x1="{t:.1}" y1="{:.1}" x2="{t:.1}" y2="{:.1}" stroke="#2ca02c" stroke-width="2"><title>training again</title></line>"##,
            s - 6.0,
            s + 6.0
        );
    }
    // Worker rows.
    for (&id, &r) in &row {
        let y = rows_top + ROW_H * r as f64;
        let _ = writeln!(svg, r#"<text x="8" y="{:.1}">worker {id}</text>"#, y + ROW_H * 0.65);
    }
    for b in &bars {
        let Some(y) = row_y(b.id) else { continue };
        let fill = if b.epoch % 2 == 0 { "#4c78a8" } else { "#72a0cf" };
        let _ = writeln!(
            svg,
            r#"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{fill}"><title>worker {} in epoch {}</title></rect>"#,
            x(b.t0),
            y + 3.0,
            (x(b.t1) - x(b.t0)).max(0.5),
            ROW_H - 6.0,
            b.id,
            b.epoch
        );
    }
    let mark = |svg: &mut String, kind: &'static str, color: &str, title: &str| {
        for e in of(kind) {
            let (Some(id), t) = (e["id"].as_u64(), x(rel(e))) else { continue };
            let Some(y) = row_y(id) else { continue };
            let (cy, d) = (y + ROW_H / 2.0, 6.0);
            let _ = writeln!(
                svg,
                r#"<path d="M{:.1},{:.1} L{:.1},{:.1} M{:.1},{:.1} L{:.1},{:.1}" stroke="{color}" stroke-width="2.5"><title>{title}</title></path>"#,
                t - d,
                cy - d,
                t + d,
                cy + d,
                t - d,
                cy + d,
                t + d,
                cy - d
            );
        }
    };
    mark(&mut svg, "lost", "#d62728", "declared lost");
    mark(&mut svg, "drain_requested", "#bcbd22", "asked to drain");
    mark(&mut svg, "join_requested", "#2ca02c", "asked to join");
    // Time axis.
    let axis_y = height - BOTTOM + 8.0;
    let step_s = tick(end / 1e3, 8.0);
    let mut s = 0.0;
    while s * 1e3 <= end + 1e-6 {
        let tx = x(s * 1e3);
        let _ = writeln!(svg, r##"<line x1="{tx:.1}" y1="{:.1}" x2="{tx:.1}" y2="{axis_y:.1}" stroke="#999"/>"##, axis_y - 5.0);
        let _ = writeln!(svg, r#"<text x="{tx:.1}" y="{:.1}" text-anchor="middle">{}</text>"#, axis_y + 13.0, (s * 100.0).round() / 100.0);
        s += step_s;
    }
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">seconds since the run started</text>"#,
        LEFT + plot_w / 2.0,
        axis_y + 30.0
    );
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::plan::FaultKind;

    fn report(kind: FaultKind, at: u64, until: Option<u64>) -> FaultReport {
        let mut r = FaultReport::new(kind, true, String::new());
        r.injected_ms = at;
        r.until_ms = until;
        r
    }

    #[test]
    fn the_timeline_shows_members_losses_faults_and_steps() {
        let t0 = 1_000_000;
        let members = |ids: &[u64]| ids.iter().enumerate().map(|(r, id)| json!({"rank": r, "id": id, "pid": 100 + id})).collect::<Vec<_>>();
        let events = vec![
            json!({"event": "epoch", "epoch": 1, "step": 0, "members": members(&[0, 1, 2]), "t_ms": t0 + 100}),
            json!({"event": "step", "step": 1, "t_ms": t0 + 400}),
            json!({"event": "step", "step": 2, "t_ms": t0 + 700}),
            json!({"event": "lost", "id": 1, "pid": 101, "t_ms": t0 + 900}),
            json!({"event": "join_requested", "id": 3, "pid": 103, "t_ms": t0 + 950}),
            json!({"event": "epoch", "epoch": 2, "step": 2, "members": members(&[0, 2, 3]), "t_ms": t0 + 1500}),
            json!({"event": "resumed", "step": 2, "t_ms": t0 + 1550}),
            json!({"event": "step", "step": 3, "t_ms": t0 + 1800}),
        ];
        let faults = [report(FaultKind::Kill, 880, None), report(FaultKind::Delay, 200, Some(1200))];
        let svg = render(&events, &faults, t0, 2.0);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        for want in
            ["worker 0", "worker 1", "worker 2", "worker 3", "declared lost", "asked to join", "training again", ">kill<", ">delay<"]
        {
            assert!(svg.contains(want), "missing {want:?} in\n{svg}");
        }
        // Worker 1 is a member of epoch 1 only; worker 3 of epoch 2 only.
        assert!(svg.contains("worker 1 in epoch 1") && !svg.contains("worker 1 in epoch 2"));
        assert!(svg.contains("worker 3 in epoch 2") && !svg.contains("worker 3 in epoch 1"));
        // The delay has a duration: a band; the kill has none: only its line.
        assert_eq!(svg.matches("fill-opacity=\"0.12\"").count(), 1, "{svg}");
    }

    #[test]
    fn an_empty_run_still_gives_a_picture() {
        let svg = render(&[], &[], 0, 0.0);
        assert!(svg.contains("seconds since the run started"));
    }
}
