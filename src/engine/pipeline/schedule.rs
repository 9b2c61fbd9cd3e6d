//! Pipeline schedules as pure instruction streams: what each stage runs, in order, for one
//! step of `M` micro-batches over `S` stages ([`stream`]), and the step's timeline in unit time
//! ([`simulate`]) that the tests and the schedule picture read (the bubble of a timeline is
//! [`super::timeline::bubble`]'s, for unit time and measured steps alike).
//!
//! - **GPipe**: every forward, then every backward (at most `M` micro-batches in flight).
//! - **1F1B** (PipeDream-flush, DeepSpeed's `TrainSchedule`): stage `p` runs `S − p − 1` warm-up
//!   forwards, then alternates one forward and one backward, then drains the backwards; at most
//!   `S − p` micro-batches in flight on stage `p`.
//!
//! Both have the bubble `(S − 1)/(M + S − 1)` of a step when forward and backward cost the same.
//! Besides forwards and backwards, the last stage runs each micro-batch's embeddings backward
//! ([`Op::EmbedBackward`]) once the first stage's backward of it has sent d(embeddings): unit
//! 0 (embeddings, final norm, tied head) has its gradients summed there, head first, as one
//! worker does. [`stream`] places it at the first point of the last stage's stream at which, in
//! the unit-time timeline, that backward has finished, so a stage never holds more unfinished
//! unit-0 gradients than the schedule keeps micro-batches in flight.
//!
//! A stream is a total order per stage; stages exchange activations point to point (a forward
//! receives its input from the previous stage and sends its output to the next; a backward the
//! reverse), each send eager and each receive blocking, so streams that [`simulate`] completes
//! cannot deadlock.

use std::fmt;

/// A pipeline schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    GPipe,
    OneFOneB,
}

impl Schedule {
    pub const ALL: [Schedule; 2] = [Schedule::GPipe, Schedule::OneFOneB];

    /// The name the config uses (`tessera.pipeline.schedule`).
    pub fn name(self) -> &'static str {
        match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
        }
    }

    pub fn parse(s: &str) -> Option<Schedule> {
        Schedule::ALL.into_iter().find(|k| k.name() == s)
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One instruction of a stage's stream; `mb` is the micro-batch's index among the stage's
/// data-parallel replica's micro-batches (`0..M`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// Receive the input stream (not on the first stage), run the stage's forward, send the
    /// output to the next stage (not on the last; there the loss).
    Forward(usize),
    /// Receive d(output) (not on the last stage), run the stage's backward, send d(input) to
    /// the previous stage (on the first: to the last stage, for its embeddings backward).
    Backward(usize),
    /// Last stage only: receive d(embeddings) from the first stage and run the embeddings'
    /// backward, finishing the micro-batch's unit-0 gradients.
    EmbedBackward(usize),
}

impl Op {
    pub fn mb(self) -> usize {
        match self {
            Op::Forward(m) | Op::Backward(m) | Op::EmbedBackward(m) => m,
        }
    }
}

/// Forwards and backwards of stage `p` of `stages`, for `m` micro-batches, without the
/// embeddings' backwards.
fn core(schedule: Schedule, stages: usize, p: usize, m: usize) -> Vec<Op> {
    match schedule {
        Schedule::GPipe => (0..m).map(Op::Forward).chain((0..m).map(Op::Backward)).collect(),
        Schedule::OneFOneB => {
            let warmup = (stages - p - 1).min(m);
            let mut ops: Vec<Op> = (0..warmup).map(Op::Forward).collect();
            for i in 0..m - warmup {
                ops.push(Op::Forward(warmup + i));
                ops.push(Op::Backward(i));
            }
            ops.extend((m - warmup..m).map(Op::Backward));
            ops
        }
    }
}

/// Every stage's stream for one step: `streams[p]` is stage `p`'s instructions in order.
pub fn streams(schedule: Schedule, stages: usize, m: usize) -> Vec<Vec<Op>> {
    assert!(stages >= 1, "a pipeline has stages");
    if m == 0 {
        // A replica without micro-batches this step (more replicas than micro-batches).
        return vec![Vec::new(); stages];
    }
    let mut out: Vec<Vec<Op>> = (0..stages).map(|p| core(schedule, stages, p, m)).collect();
    if stages == 1 {
        // One stage runs the embeddings' backward right after each backward.
        out[0] = out[0]
            .iter()
            .flat_map(|&op| match op {
                Op::Backward(i) => vec![op, Op::EmbedBackward(i)],
                op => vec![op],
            })
            .collect();
        return out;
    }
    // Unit time of the streams without the embeddings' backwards: when does the first stage
    // finish each backward?
    let timeline = simulate(&out).expect("the core schedules complete");
    let mut done_at = vec![0usize; m];
    for e in timeline.iter().filter(|e| e.stage == 0) {
        if let Op::Backward(i) = e.op {
            done_at[i] = e.end;
        }
    }
    // Insert each micro-batch's embeddings backward into the last stage's stream before the
    // first instruction that starts at or after that time (or at the end).
    let last = stages - 1;
    let starts: Vec<usize> = timeline.iter().filter(|e| e.stage == last).map(|e| e.start).collect();
    let mut merged = Vec::with_capacity(out[last].len() + m);
    let mut pending: Vec<usize> = (0..m).collect();
    pending.sort_by_key(|&i| (done_at[i], i));
    let mut next = 0;
    for (op, &start) in out[last].iter().zip(&starts) {
        while next < pending.len() && done_at[pending[next]] <= start {
            merged.push(Op::EmbedBackward(pending[next]));
            next += 1;
        }
        merged.push(*op);
    }
    merged.extend(pending[next..].iter().map(|&i| Op::EmbedBackward(i)));
    out[last] = merged;
    out
}

/// Stage `p`'s stream ([`streams`]).
pub fn stream(schedule: Schedule, stages: usize, p: usize, m: usize) -> Vec<Op> {
    streams(schedule, stages, m).swap_remove(p)
}

/// One instruction as it ran in unit time: every forward and backward takes one unit, an
/// embeddings backward none (forward and backward costs are equal for the bubble formula), messages
/// arrive at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub stage: usize,
    pub op: Op,
    pub start: usize,
    pub end: usize,
}

/// Runs the streams with blocking receives and eager sends, each instruction taking one unit
/// of time, and returns every instruction's time span; `Err` names the stuck stages if they
/// deadlock or wait for a message no stage sends.
pub fn simulate(streams: &[Vec<Op>]) -> Result<Vec<Span>, String> {
    let s = streams.len();
    let m = streams.iter().flatten().map(|o| o.mb() + 1).max().unwrap_or(0);
    // When each message became available: forward outputs of stage p, backward outputs of
    // stage p (for p − 1; stage 0's for the last stage's embeddings backward).
    let mut fwd_out: Vec<Vec<Option<usize>>> = vec![vec![None; m]; s];
    let mut bwd_out: Vec<Vec<Option<usize>>> = vec![vec![None; m]; s];
    let mut pc = vec![0usize; s];
    let mut clock = vec![0usize; s];
    let mut spans = Vec::new();
    loop {
        let mut progressed = false;
        for p in 0..s {
            while let Some(&op) = streams[p].get(pc[p]) {
                let ready = match op {
                    Op::Forward(i) if p > 0 => fwd_out[p - 1][i],
                    Op::Backward(i) if p + 1 < s => bwd_out[p + 1][i],
                    Op::EmbedBackward(i) if s > 1 => bwd_out[0][i],
                    _ => Some(0),
                };
                let Some(at) = ready else { break };
                let start = clock[p].max(at);
                // The embeddings' backward is a scatter of one stream: no unit of its own, so
                // placing it moves no other instruction.
                let end = start + usize::from(!matches!(op, Op::EmbedBackward(_)));
                match op {
                    Op::Forward(i) => fwd_out[p][i] = Some(end),
                    Op::Backward(i) => bwd_out[p][i] = Some(end),
                    Op::EmbedBackward(_) => {}
                }
                clock[p] = end;
                spans.push(Span { stage: p, op, start, end });
                pc[p] += 1;
                progressed = true;
            }
        }
        if (0..s).all(|p| pc[p] == streams[p].len()) {
            return Ok(spans);
        }
        if !progressed {
            let stuck: Vec<String> =
                (0..s).filter(|&p| pc[p] < streams[p].len()).map(|p| format!("stage {p} at {:?}", streams[p][pc[p]])).collect();
            return Err(format!("the streams deadlock: {}", stuck.join(", ")));
        }
    }
}

/// The most micro-batches stage `p` holds activations of at once (forwarded, not yet
/// backwarded) in its stream.
pub fn peak_in_flight(stream: &[Op]) -> usize {
    let (mut live, mut peak) = (0usize, 0usize);
    for op in stream {
        match op {
            Op::Forward(_) => {
                live += 1;
                peak = peak.max(live);
            }
            Op::Backward(_) => live -= 1,
            Op::EmbedBackward(_) => {}
        }
    }
    peak
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every stream of every schedule runs each micro-batch's forward and backward once (the
    /// last stage also its embeddings backward), forward before backward; the streams complete
    /// without deadlock; the bubble is the theory's `(S − 1)/(M + S − 1)`; 1F1B keeps at most
    /// `S − p` micro-batches in flight on stage `p`, GPipe all `M`.
    #[test]
    fn schedules_are_complete_deadlock_free_and_meet_the_theory() {
        for schedule in Schedule::ALL {
            for stages in 1..=6 {
                for m in 1..=12 {
                    let all = streams(schedule, stages, m);
                    for (p, st) in all.iter().enumerate() {
                        for i in 0..m {
                            let f = st.iter().position(|&o| o == Op::Forward(i));
                            let b = st.iter().position(|&o| o == Op::Backward(i));
                            assert!(f.is_some() && f < b, "{schedule} S={stages} M={m} stage {p}: mb {i} forward {f:?} backward {b:?}");
                            let e = st.iter().filter(|&&o| o == Op::EmbedBackward(i)).count();
                            assert_eq!(
                                e,
                                usize::from(p + 1 == stages),
                                "{schedule} S={stages} M={m} stage {p}: embeddings backward of {i}"
                            );
                        }
                        assert_eq!(st.len(), 2 * m + if p + 1 == stages { m } else { 0 });
                        let peak = peak_in_flight(st);
                        let want = match schedule {
                            Schedule::GPipe => m,
                            Schedule::OneFOneB => (stages - p).min(m),
                        };
                        assert_eq!(peak, want, "{schedule} S={stages} M={m} stage {p}: micro-batches in flight");
                    }
                    let spans = simulate(&all).unwrap_or_else(|e| panic!("{schedule} S={stages} M={m}: {e}"));
                    let theory = (stages - 1) as f64 / (m + stages - 1) as f64;
                    let got = super::super::timeline::bubble(&super::super::timeline::Timed::from_units(&spans), stages);
                    assert!((got - theory).abs() < 1e-12, "{schedule} S={stages} M={m}: bubble {got} against {theory}");
                }
            }
        }
    }

    /// The simulator finds a deadlock: a first stage that waits for a backward before sending
    /// the forward it depends on.
    #[test]
    fn a_deadlocked_pair_of_streams_is_named() {
        let bad = vec![vec![Op::Backward(0), Op::Forward(0)], vec![Op::Forward(0), Op::Backward(0), Op::EmbedBackward(0)]];
        let e = simulate(&bad).unwrap_err();
        assert!(e.contains("stage 0 at Backward(0)") && e.contains("stage 1 at Forward(0)"), "{e}");
    }

    /// 1F1B on 4 stages and 8 micro-batches, as DeepSpeed's `TrainSchedule` orders it.
    #[test]
    fn one_f_one_b_orders_as_pipedream_flush() {
        let s = stream(Schedule::OneFOneB, 4, 1, 8);
        use Op::{Backward as B, Forward as F};
        assert_eq!(s, vec![F(0), F(1), F(2), B(0), F(3), B(1), F(4), B(2), F(5), B(3), F(6), B(4), F(7), B(5), B(6), B(7)]);
    }
}
