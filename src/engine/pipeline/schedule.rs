//! Pipeline schedules as pure instruction streams: what each stage runs, in order, for one
//! step of `M` micro-batches over `S` stages ([`streams`]), and the step's timeline in unit time
//! ([`simulate`]) that the tests and the schedule picture read (the bubble of a timeline is
//! [`super::timeline::bubble`]'s, for unit time and measured steps alike).
//!
//! - **GPipe**: every forward, then every backward (at most `M` micro-batches in flight).
//! - **1F1B** (PipeDream-flush, DeepSpeed's `TrainSchedule`): stage `p` runs `S − p − 1` warm-up
//!   forwards, then alternates one forward and one backward, then drains the backwards; at most
//!   `S − p` micro-batches in flight on stage `p`.
//! - **Interleaved 1F1B** (Megatron-LM's virtual pipeline): the model is cut into `S·v` spans
//!   and stage `p` runs chunks `c = 0..v`, the spans `c·S + p`; micro-batches go through the
//!   chunks in groups of `S`, forwards in chunk order and backwards in reverse, with
//!   `2(S − p − 1) + (v − 1)·S` warm-up forwards. The bubble shrinks by `v` (each chunk is
//!   `1/v` of a stage's work) for `v` times the point-to-point messages.
//! - **ZB-H1** (zero bubble, Qi et al. 2023): each backward split into its input-gradient half
//!   B, which the previous stage waits for, and its weight-gradient half W, which nobody waits
//!   for. Forwards and B's run in 1F1B's order; a W runs when the stage would otherwise idle,
//!   or before a forward once `p + 1` W's wait, so stage `p` holds 1F1B's `S − p` micro-batches
//!   of activations plus at most `p + 1` weight stashes, and the W's fill the bubbles: `S − 1`
//!   idle units a stage against 1F1B's `3(S − 1)` when F, B and W cost one unit each.
//!
//! Besides these, the last stage runs each micro-batch's embeddings backward
//! ([`Kind::EmbedBackward`]) once the first stage's backward of it has sent d(embeddings):
//! unit 0 (embeddings, final norm, tied head) has its gradients summed there, head first, as
//! one worker does. [`streams`] places it at the first point of the last stage's stream at
//! which, in the unit-time timeline, that backward has finished (and after the micro-batch's
//! own weight gradients there), so a stage never holds more unfinished unit-0 gradients than
//! the schedule keeps micro-batches in flight.
//!
//! A stream is a total order per stage; stages exchange activations point to point (a forward
//! receives its input from the previous span and sends its output to the next; a backward the
//! reverse), each send eager and each receive blocking, so streams that [`simulate`] completes
//! cannot deadlock. Unit time: a forward, an input-gradient half and a weight-gradient half
//! cost one unit each, a fused backward two, the embeddings' backward (a scatter) none.

use std::fmt;

/// A pipeline schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    GPipe,
    OneFOneB,
    Interleaved,
    ZeroBubbleH1,
}

impl Schedule {
    pub const ALL: [Schedule; 4] = [Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved, Schedule::ZeroBubbleH1];

    /// The name the config uses (`tessera.pipeline.schedule`).
    pub fn name(self) -> &'static str {
        match self {
            Schedule::GPipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
            Schedule::Interleaved => "interleaved",
            Schedule::ZeroBubbleH1 => "zb-h1",
        }
    }

    pub fn parse(s: &str) -> Option<Schedule> {
        Schedule::ALL.into_iter().find(|k| k.name() == s)
    }

    /// Whether each stage runs several chunks (virtual stages).
    pub fn chunked(self) -> bool {
        self == Schedule::Interleaved
    }

    /// Whether backwards are split into input- and weight-gradient halves.
    pub fn split_backward(self) -> bool {
        self == Schedule::ZeroBubbleH1
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What an instruction runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Receive the input stream (not on the model's first span), run the span's forward, send
    /// the output to the next span (not on the last; there the loss).
    Forward,
    /// Receive d(output) (not on the last span), run the span's backward, send d(input) to the
    /// previous span (from the first: to the last stage, for its embeddings backward).
    Backward,
    /// The backward's input-gradient half: as [`Kind::Backward`] for what it receives and
    /// sends; the weight gradients' inputs are kept for [`Kind::Weight`].
    Input,
    /// The backward's weight-gradient half, from what [`Kind::Input`] kept.
    Weight,
    /// Last stage only: receive d(embeddings) from the first stage and run the embeddings'
    /// backward, finishing the micro-batch's unit-0 gradients.
    EmbedBackward,
}

/// One instruction of a stage's stream: `mb` is the micro-batch's index among the stage's
/// data-parallel replica's micro-batches (`0..M`), `chunk` the stage's span (`0..v`; 0 but for
/// the interleaved schedule).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Op {
    pub kind: Kind,
    pub mb: usize,
    pub chunk: usize,
}

impl Op {
    pub fn forward(mb: usize, chunk: usize) -> Op {
        Op { kind: Kind::Forward, mb, chunk }
    }
    pub fn backward(mb: usize, chunk: usize) -> Op {
        Op { kind: Kind::Backward, mb, chunk }
    }
    pub fn input(mb: usize, chunk: usize) -> Op {
        Op { kind: Kind::Input, mb, chunk }
    }
    pub fn weight(mb: usize, chunk: usize) -> Op {
        Op { kind: Kind::Weight, mb, chunk }
    }
    pub fn embed(mb: usize) -> Op {
        Op { kind: Kind::EmbedBackward, mb, chunk: 0 }
    }

    /// Its time in unit time.
    pub fn cost(self) -> usize {
        match self.kind {
            Kind::Forward | Kind::Input | Kind::Weight => 1,
            Kind::Backward => 2,
            Kind::EmbedBackward => 0,
        }
    }

    /// Whether it is a backward that sends d(input) ([`Kind::Backward`] or [`Kind::Input`]).
    pub fn sends_grad(self) -> bool {
        matches!(self.kind, Kind::Backward | Kind::Input)
    }

    /// Whether it finishes the micro-batch's gradients of its chunk's blocks (the fused
    /// backward or the weight half).
    pub fn finishes(self) -> bool {
        matches!(self.kind, Kind::Backward | Kind::Weight)
    }

    /// A short label: `F3`, `B3`, `b3` (input half), `W3`, `E3`, with `.c` for chunk `c` > 0.
    pub fn label(self) -> String {
        let k = match self.kind {
            Kind::Forward => "F",
            Kind::Backward => "B",
            Kind::Input => "b",
            Kind::Weight => "W",
            Kind::EmbedBackward => "E",
        };
        if self.chunk > 0 {
            format!("{k}{}.{}", self.mb, self.chunk)
        } else {
            format!("{k}{}", self.mb)
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

/// GPipe's stream: every forward, then every backward.
fn gpipe(m: usize) -> Vec<Op> {
    (0..m).map(|i| Op::forward(i, 0)).chain((0..m).map(|i| Op::backward(i, 0))).collect()
}

/// 1F1B's stream of stage `p`.
fn one_f_one_b(stages: usize, p: usize, m: usize) -> Vec<Op> {
    let warmup = (stages - p - 1).min(m);
    let mut ops: Vec<Op> = (0..warmup).map(|i| Op::forward(i, 0)).collect();
    for i in 0..m - warmup {
        ops.push(Op::forward(warmup + i, 0));
        ops.push(Op::backward(i, 0));
    }
    ops.extend((m - warmup..m).map(|i| Op::backward(i, 0)));
    ops
}

/// Interleaved 1F1B's stream of stage `p` with `chunks` chunks and `warmup` warm-up forwards:
/// the micro-batches in groups of `S`, each group's forwards chunk by chunk and its backwards
/// in the reverse chunk order, the two orders zipped after the warm-up (Megatron-LM's order).
fn interleaved(stages: usize, chunks: usize, m: usize, warmup: usize) -> Vec<Op> {
    let (mut fwd, mut bwd) = (Vec::with_capacity(m * chunks), Vec::with_capacity(m * chunks));
    for g in (0..m).step_by(stages) {
        let group = g..(g + stages).min(m);
        for c in 0..chunks {
            fwd.extend(group.clone().map(|i| Op::forward(i, c)));
        }
        for c in (0..chunks).rev() {
            bwd.extend(group.clone().map(|i| Op::backward(i, c)));
        }
    }
    let total = m * chunks;
    let warmup = warmup.min(total);
    let mut ops = fwd[..warmup].to_vec();
    for i in 0..total - warmup {
        ops.push(fwd[warmup + i]);
        ops.push(bwd[i]);
    }
    ops.extend_from_slice(&bwd[total - warmup..]);
    ops
}

/// Every stage's interleaved stream: Megatron-LM's `2(S − p − 1) + (v − 1)·S` warm-up forwards,
/// which complete when `S` divides `M`; when the last group is short, a stage that would wait
/// on a backward while its neighbours wait on its forwards gets one more warm-up forward,
/// until the streams complete (all forwards first always does). One chunk is 1F1B.
fn interleaved_streams(stages: usize, chunks: usize, m: usize) -> Vec<Vec<Op>> {
    if chunks == 1 {
        return (0..stages).map(|p| one_f_one_b(stages, p, m)).collect();
    }
    let mut warmup: Vec<usize> = (0..stages).map(|p| 2 * (stages - p - 1) + (chunks - 1) * stages).collect();
    loop {
        let all: Vec<Vec<Op>> = (0..stages).map(|p| interleaved(stages, chunks, m, warmup[p])).collect();
        match run(&all) {
            Ok(_) => return all,
            Err(stuck) => {
                let at_backward: Vec<usize> = stuck.iter().copied().filter(|&(_, op)| op.kind == Kind::Backward).map(|(p, _)| p).collect();
                let bump = if at_backward.is_empty() { stuck.iter().map(|&(p, _)| p).collect() } else { at_backward };
                assert!(bump.iter().any(|&p| warmup[p] < m * chunks), "interleaved S={stages} v={chunks} M={m} cannot complete");
                bump.into_iter().for_each(|p| warmup[p] += 1);
            }
        }
    }
}

/// ZB-H1's streams: forwards and input halves in 1F1B's order; a stage whose next instruction
/// cannot start (its message has not arrived, or it is a forward while `p + 1` weight halves
/// wait) runs its oldest pending weight half instead, in unit time. So stage `p` holds the
/// activations of at most 1F1B's `S − p` micro-batches (they go at the input half) and at most
/// `p + 1` weight stashes.
fn zero_bubble_h1(stages: usize, m: usize) -> Vec<Vec<Op>> {
    let order: Vec<Vec<Op>> = (0..stages)
        .map(|p| one_f_one_b(stages, p, m).into_iter().map(|o| if o.kind == Kind::Backward { Op::input(o.mb, 0) } else { o }).collect())
        .collect();
    let mut out: Vec<Vec<Op>> = vec![Vec::with_capacity(3 * m); stages];
    let mut next = vec![0usize; stages];
    let mut pending: Vec<std::collections::VecDeque<usize>> = vec![Default::default(); stages];
    let mut live = vec![0usize; stages];
    // When each stage's forward output and d(input) of each micro-batch became available.
    let mut fwd_at = vec![vec![usize::MAX; m]; stages];
    let mut bwd_at = vec![vec![usize::MAX; m]; stages];
    let mut t = 0;
    while (0..stages).any(|p| next[p] < order[p].len() || !pending[p].is_empty()) {
        for p in 0..stages {
            let can_run = |o: &Op| {
                let at = match o.kind {
                    Kind::Forward if p > 0 => fwd_at[p - 1][o.mb],
                    Kind::Input if p + 1 < stages => bwd_at[p + 1][o.mb],
                    _ => 0,
                };
                at <= t && (o.kind != Kind::Forward || pending[p].len() <= p)
            };
            let op = match order[p].get(next[p]).filter(|o| can_run(o)) {
                Some(&o) => {
                    next[p] += 1;
                    o
                }
                None => match pending[p].pop_front() {
                    Some(i) => Op::weight(i, 0),
                    None => continue,
                },
            };
            match op.kind {
                Kind::Forward => {
                    live[p] += 1;
                    fwd_at[p][op.mb] = t + 1;
                }
                Kind::Input => {
                    bwd_at[p][op.mb] = t + 1;
                    pending[p].push_back(op.mb);
                }
                _ => live[p] -= 1,
            }
            out[p].push(op);
        }
        t += 1;
    }
    out
}

/// Every stage's stream for one step: `streams[p]` is stage `p`'s instructions in order.
/// `chunks` is the interleaved schedule's chunks per stage (1 for the others).
///
/// # Panics
/// If `stages` or `chunks` is 0, or `chunks` > 1 for a schedule without chunks.
pub fn streams(schedule: Schedule, stages: usize, chunks: usize, m: usize) -> Vec<Vec<Op>> {
    assert!(stages >= 1 && chunks >= 1, "a pipeline has stages and chunks");
    assert!(chunks == 1 || schedule.chunked(), "{schedule} runs one chunk a stage");
    if m == 0 {
        // A replica without micro-batches this step (more replicas than micro-batches).
        return vec![Vec::new(); stages];
    }
    let mut out: Vec<Vec<Op>> = match schedule {
        Schedule::GPipe => (0..stages).map(|_| gpipe(m)).collect(),
        Schedule::OneFOneB => (0..stages).map(|p| one_f_one_b(stages, p, m)).collect(),
        Schedule::Interleaved => interleaved_streams(stages, chunks, m),
        Schedule::ZeroBubbleH1 => zero_bubble_h1(stages, m),
    };
    place_embed_backwards(&mut out, chunks, m);
    out
}

/// Inserts each micro-batch's embeddings backward into the last stage's stream, in micro-batch
/// order, before the first instruction that starts (in unit time) at or after the first
/// stage's backward of chunk 0 sent d(embeddings), and after the last stage's own gradients of
/// the micro-batch are finished (the head's before the embeddings', as one worker adds them).
fn place_embed_backwards(out: &mut [Vec<Op>], chunks: usize, m: usize) {
    let last = out.len() - 1;
    let timeline = simulate(out).expect("the core schedules complete");
    let mut sent_at = vec![0usize; m];
    for e in timeline.iter().filter(|e| e.stage == 0 && e.op.chunk == 0 && e.op.sends_grad()) {
        sent_at[e.op.mb] = e.end;
    }
    let starts: Vec<usize> = timeline.iter().filter(|e| e.stage == last).map(|e| e.start).collect();
    let mut merged = Vec::with_capacity(out[last].len() + m);
    let mut finished = vec![false; m];
    let mut next = 0;
    for (op, &start) in out[last].iter().zip(&starts) {
        while next < m && sent_at[next] <= start && finished[next] {
            merged.push(Op::embed(next));
            next += 1;
        }
        if op.finishes() && op.chunk + 1 == chunks {
            finished[op.mb] = true;
        }
        merged.push(*op);
    }
    merged.extend((next..m).map(Op::embed));
    out[last] = merged;
}

/// Stage `p`'s stream ([`streams`]).
pub fn stream(schedule: Schedule, stages: usize, chunks: usize, p: usize, m: usize) -> Vec<Op> {
    streams(schedule, stages, chunks, m).swap_remove(p)
}

/// One instruction as it ran in unit time ([`Op::cost`]); messages arrive at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub stage: usize,
    pub op: Op,
    pub start: usize,
    pub end: usize,
}

/// Runs the streams with blocking receives and eager sends, each instruction taking its unit
/// time, and returns every instruction's time span; `Err` names the stuck stages if they
/// deadlock or wait for a message no stage sends. Chunk `c` of stage `p` is the model's span
/// `c·S + p`.
pub fn simulate(streams: &[Vec<Op>]) -> Result<Vec<Span>, String> {
    run(streams).map_err(|stuck| {
        let stuck: Vec<String> = stuck.iter().map(|(p, op)| format!("stage {p} at {op}")).collect();
        format!("the streams deadlock: {}", stuck.join(", "))
    })
}

/// [`simulate`], with the stuck stages and their instructions as the error.
fn run(streams: &[Vec<Op>]) -> Result<Vec<Span>, Vec<(usize, Op)>> {
    let s = streams.len();
    let m = streams.iter().flatten().map(|o| o.mb + 1).max().unwrap_or(0);
    let spans_n = s * streams.iter().flatten().map(|o| o.chunk + 1).max().unwrap_or(1);
    // When each message became available, by the span that sent it: forward outputs, and
    // d(input) (span 0's for the last stage's embeddings backward).
    let mut fwd_out: Vec<Vec<Option<usize>>> = vec![vec![None; m]; spans_n];
    let mut bwd_out: Vec<Vec<Option<usize>>> = vec![vec![None; m]; spans_n];
    let mut pc = vec![0usize; s];
    let mut clock = vec![0usize; s];
    let mut spans = Vec::new();
    loop {
        let mut progressed = false;
        for p in 0..s {
            while let Some(&op) = streams[p].get(pc[p]) {
                let j = op.chunk * s + p;
                let ready = match op.kind {
                    Kind::Forward if j > 0 => fwd_out[j - 1][op.mb],
                    Kind::Backward | Kind::Input if j + 1 < spans_n => bwd_out[j + 1][op.mb],
                    Kind::EmbedBackward if s > 1 => bwd_out[0][op.mb],
                    _ => Some(0),
                };
                let Some(at) = ready else { break };
                let start = clock[p].max(at);
                let end = start + op.cost();
                match op.kind {
                    Kind::Forward => fwd_out[j][op.mb] = Some(end),
                    Kind::Backward | Kind::Input => bwd_out[j][op.mb] = Some(end),
                    Kind::Weight | Kind::EmbedBackward => {}
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
            return Err((0..s).filter(|&p| pc[p] < streams[p].len()).map(|p| (p, streams[p][pc[p]])).collect());
        }
    }
}

/// The most micro-batch chunks stage `p` holds activations of at once (forwarded, their
/// backward or input half not yet run) in its stream.
pub fn peak_in_flight(stream: &[Op]) -> usize {
    let (mut live, mut peak) = (0usize, 0usize);
    for op in stream {
        if op.kind == Kind::Forward {
            live += 1;
            peak = peak.max(live);
        } else if op.sends_grad() {
            live -= 1;
        }
    }
    peak
}

/// The most weight stashes stage `p` holds at once (input halves whose weight half has not
/// run): 0 but for ZB-H1.
pub fn peak_weight_stashes(stream: &[Op]) -> usize {
    let (mut live, mut peak) = (0usize, 0usize);
    for op in stream {
        match op.kind {
            Kind::Input => {
                live += 1;
                peak = peak.max(live);
            }
            Kind::Weight => live -= 1,
            _ => {}
        }
    }
    peak
}

/// The schedule's bubble in unit time ([`simulate`]): `(S − 1)/(M + S − 1)` for GPipe and
/// 1F1B, `(S − 1)/(v·M + S − 1)` for the interleaved schedule when `S` divides `M`, about a
/// third of 1F1B's for ZB-H1.
pub fn bubble_in_theory(schedule: Schedule, stages: usize, chunks: usize, m: usize) -> f64 {
    let all = streams(schedule, stages, chunks, m);
    let spans = simulate(&all).expect("the schedules complete");
    super::timeline::bubble(&super::timeline::Timed::from_units(&spans), stages)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunk counts a schedule is tested with.
    fn chunk_counts(schedule: Schedule) -> Vec<usize> {
        if schedule.chunked() {
            vec![1, 2, 3]
        } else {
            vec![1]
        }
    }

    /// Every stream of every schedule runs each micro-batch chunk's forward once and its
    /// gradients once (a fused backward, or an input half then a weight half), forward first;
    /// the last stage runs each embeddings backward once, after the micro-batch's last chunk's
    /// gradients there; the streams complete without deadlock.
    #[test]
    fn schedules_are_complete_and_deadlock_free() {
        for schedule in Schedule::ALL {
            for v in chunk_counts(schedule) {
                for stages in 1..=6 {
                    for m in 1..=12 {
                        let all = streams(schedule, stages, v, m);
                        let what = format!("{schedule} S={stages} v={v} M={m}");
                        for (p, st) in all.iter().enumerate() {
                            let at = |o: Op| st.iter().position(|&x| x == o);
                            let count = |o: Op| st.iter().filter(|&&x| x == o).count();
                            for i in 0..m {
                                for c in 0..v {
                                    let f = at(Op::forward(i, c)).unwrap_or_else(|| panic!("{what} stage {p}: no F{i}.{c}"));
                                    assert_eq!(count(Op::forward(i, c)), 1, "{what} stage {p}");
                                    let done = if schedule.split_backward() {
                                        let b = at(Op::input(i, c));
                                        let w = at(Op::weight(i, c));
                                        assert!(b > Some(f) && w > b, "{what} stage {p}: mb {i} F {f} b {b:?} W {w:?}");
                                        w
                                    } else {
                                        let b = at(Op::backward(i, c));
                                        assert!(b > Some(f), "{what} stage {p}: mb {i} F {f} B {b:?}");
                                        b
                                    };
                                    if p + 1 == stages && c + 1 == v {
                                        assert!(at(Op::embed(i)) > done, "{what}: E{i} before the last chunk's gradients");
                                    }
                                }
                                assert_eq!(count(Op::embed(i)), usize::from(p + 1 == stages), "{what} stage {p}: E{i}");
                            }
                            let per_mb = if schedule.split_backward() { 3 } else { 2 };
                            assert_eq!(st.len(), per_mb * m * v + if p + 1 == stages { m } else { 0 }, "{what} stage {p}");
                        }
                        simulate(&all).unwrap_or_else(|e| panic!("{what}: {e}"));
                    }
                }
            }
        }
    }

    /// The bubble in unit time is the theory's: `(S − 1)/(M + S − 1)` for GPipe and 1F1B,
    /// `(S − 1)/(v·M + S − 1)` for the interleaved schedule when `S` divides `M` (Megatron-LM
    /// requires it; here other `M` run, with more bubble), `(S − 1)/(3M + S − 1)` for ZB-H1
    /// once `M ≥ S` — a third of 1F1B's idle time — and never more than 1F1B's.
    #[test]
    fn bubbles_meet_the_theory() {
        for stages in 1..=6usize {
            for m in 1..=12usize {
                let (s, mf) = (stages as f64, m as f64);
                let one = (s - 1.0) / (mf + s - 1.0);
                for schedule in [Schedule::GPipe, Schedule::OneFOneB] {
                    let got = bubble_in_theory(schedule, stages, 1, m);
                    assert!((got - one).abs() < 1e-12, "{schedule} S={stages} M={m}: {got} against {one}");
                }
                for v in [2usize, 3] {
                    let got = bubble_in_theory(Schedule::Interleaved, stages, v, m);
                    let want = (s - 1.0) / (v as f64 * mf + s - 1.0);
                    if m % stages == 0 {
                        assert!((got - want).abs() < 1e-12, "interleaved S={stages} v={v} M={m}: {got} against {want}");
                    }
                }
                let got = bubble_in_theory(Schedule::ZeroBubbleH1, stages, 1, m);
                let want = (s - 1.0) / (3.0 * mf + s - 1.0);
                if m >= stages {
                    assert!((got - want).abs() < 1e-12, "zb-h1 S={stages} M={m}: {got} against {want}");
                }
                assert!(got <= one + 1e-12, "zb-h1 S={stages} M={m}: {got} above 1F1B's {one}");
            }
        }
    }

    /// Memory follows the schedule: GPipe holds all `M` micro-batches, 1F1B and ZB-H1 at most
    /// `S − p` on stage `p` (ZB-H1 also at most `p + 1` weight stashes), the interleaved
    /// schedule `2(S − p − 1) + (v − 1)·S + 1` chunks when `S` divides `M`.
    #[test]
    fn micro_batches_in_flight_are_bounded_by_the_schedule() {
        for stages in 1..=6usize {
            for m in 1..=12usize {
                for p in 0..stages {
                    let peak = |schedule, v| peak_in_flight(&stream(schedule, stages, v, p, m));
                    assert_eq!(peak(Schedule::GPipe, 1), m);
                    assert_eq!(peak(Schedule::OneFOneB, 1), (stages - p).min(m), "1f1b S={stages} M={m} p={p}");
                    assert_eq!(peak(Schedule::ZeroBubbleH1, 1), (stages - p).min(m), "zb-h1 S={stages} M={m} p={p}");
                    let stashes = peak_weight_stashes(&stream(Schedule::ZeroBubbleH1, stages, 1, p, m));
                    assert!(stashes <= (p + 1).min(m), "zb-h1 S={stages} M={m} p={p}: {stashes} weight stashes");
                    for v in [2usize, 3] {
                        let want = (2 * (stages - p - 1) + (v - 1) * stages + 1).min(v * m);
                        let got = peak(Schedule::Interleaved, v);
                        if m % stages == 0 {
                            assert_eq!(got, want, "interleaved S={stages} v={v} M={m} p={p}");
                        } else {
                            assert!(got <= v * m, "interleaved S={stages} v={v} M={m} p={p}: {got}");
                        }
                    }
                }
            }
        }
    }

    /// The simulator finds a deadlock: a first stage that waits for a backward before sending
    /// the forward it depends on.
    #[test]
    fn a_deadlocked_pair_of_streams_is_named() {
        let bad = vec![vec![Op::backward(0, 0), Op::forward(0, 0)], vec![Op::forward(0, 0), Op::backward(0, 0), Op::embed(0)]];
        let e = simulate(&bad).unwrap_err();
        assert!(e.contains("stage 0 at B0") && e.contains("stage 1 at F0"), "{e}");
    }

    /// 1F1B on 4 stages and 8 micro-batches, as DeepSpeed's `TrainSchedule` orders it.
    #[test]
    fn one_f_one_b_orders_as_pipedream_flush() {
        let s: Vec<String> = stream(Schedule::OneFOneB, 4, 1, 1, 8).iter().map(|o| o.label()).collect();
        assert_eq!(s.join(" "), "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7");
    }

    /// The interleaved schedule on 2 stages, 2 chunks and 4 micro-batches, as Megatron-LM's
    /// `forward_backward_pipelining_with_interleaving` orders it.
    #[test]
    fn interleaved_orders_as_megatron() {
        let s: Vec<String> = stream(Schedule::Interleaved, 2, 2, 0, 4).iter().map(|o| o.label()).collect();
        assert_eq!(s.join(" "), "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3");
    }

    /// ZB-H1 on 4 stages and 8 micro-batches: the first stage runs a weight half before each
    /// forward after the warm-up (it holds at most one stash); the last stage defers up to four
    /// into the time it would wait for forwards.
    #[test]
    fn zero_bubble_defers_weight_halves_by_stage() {
        let label = |p| stream(Schedule::ZeroBubbleH1, 4, 1, p, 8).iter().map(|o| o.label()).collect::<Vec<_>>().join(" ");
        assert!(label(0).starts_with("F0 F1 F2 F3 b0 W0 F4 b1 W1 F5"), "{}", label(0));
        assert!(label(3).starts_with("F0 b0 F1 b1 F2 b2 F3 b3 W0 E0 F4"), "{}", label(3));
    }
}
