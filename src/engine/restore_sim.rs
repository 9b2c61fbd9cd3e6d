//! A seeded simulation of checkpoint history and of the restore choice: real saves
//! (`checkpoint::save`) of small states into a real folder, with faults drawn per seed — a save
//! that fails at one of its operations or when the disk fills at a byte of one of its files, a
//! crash at either (the folder left as it was at that moment), a byte flipped, a file truncated
//! or deleted in a checkpoint, a checkpoint folder holding another step's files, leftover
//! temporary folders and files, the checkpoint folder unreadable when a restore looks — and
//! restores at drawn steps through `run.rs`'s [`restore_choice`] (what `restore_from_disk`
//! runs), loading each folder as `checkpoint_start` does (`checkpoint::resolve_resume`; the
//! checks against the run's config are left out: the states are not a model's).
//!
//! The oracle keeps its own books of every checkpoint folder (the state saved into it, the
//! blake3 of its files as written, or the damage done to it) and checks that a restore loads
//! the newest intact checkpoint at or before `at`, else where the run resumed, else step 0;
//! that the state loaded equals the state saved bit for bit; that every checkpoint passed over
//! was damaged and is reported with a reason naming the damaged file (or the step it claims);
//! and that a save, failed or crashed, never changes or removes an intact checkpoint it should
//! not (pruning aside).
//!
//! `cargo test --release -p tessera --lib restore_many_seeds` runs the seeds (`TESSERA_SIM_SEEDS`
//! to change how many); `TESSERA_SIM_SEED=<seed> cargo test --release -p tessera --lib
//! restore_replay -- --nocapture` replays one and prints its world and trace.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use anyhow::Result;
use tessera_actors::sim_support;
use tessera_kernels::tensor::Rng;

use super::run::restore_choice;
use crate::checkpoint::{
    self, old_dir_step_name, parse_step_dir_name, step_dir_name, CheckpointState, NamedTensor, FAULT_HOOK, LATEST_FILE, MANIFEST_FILE,
    OPTIM_FILE, PARAMS_FILE, WRITE_HOOK,
};

/// The files of a step folder.
const FILES: [&str; 3] = [PARAMS_FILE, OPTIM_FILE, MANIFEST_FILE];

/// Where the run started.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Resume {
    /// No `--resume`: the seeded state at step 0.
    Fresh,
    /// `--resume` of another run's checkpoint (outside this run's folder).
    Other,
    /// `--resume` of this run's own checkpoint folder (a checkpoint at the start step in it).
    Own,
}

/// What goes wrong in a save.
#[derive(Debug, Clone, Copy)]
enum SaveFault {
    /// The save's `op`-th operation (mkdir, write, fsync, rename, move aside, prune, remove)
    /// fails; with `crash` the process dies there instead (the folder stays as it is).
    Op { op: u64, crash: bool },
    /// The disk fills at byte `at` of the save's `file`-th file (0–2: the step's files, 3: the
    /// `latest` pointer's temporary file); with `crash` the process dies there instead.
    Bytes { file: usize, at: u64, crash: bool },
}

/// Damage done to a checkpoint folder between saves.
#[derive(Debug, Clone, Copy)]
enum Damage {
    /// XOR `mask` (non-zero) into the byte at `pos` (modulo the length) of `FILES[file]`.
    Flip {
        file: usize,
        pos: u64,
        mask: u8,
    },
    /// Cut `FILES[file]` to `permille`/1000 of its length (always shorter).
    Truncate {
        file: usize,
        permille: u64,
    },
    Delete {
        file: usize,
    },
    /// Copy another folder's (`from`-th) files over this one's.
    ClaimOther {
        from: u64,
    },
    /// Rename this folder to the unused step `to`.
    Move {
        to: u64,
    },
}

/// Leftovers that are not checkpoints.
#[derive(Debug, Clone, Copy)]
enum Leftover {
    /// `.tmp-step_<step>-99999`: a copy of the `copy_of`-th folder (a complete decoy), or junk.
    TmpDir { step: u64, copy_of: Option<u64> },
    /// `.latest.tmp-99999` with junk.
    LatestTmp,
    /// A file named like a step folder.
    StepFile { step: u64 },
}

#[derive(Debug, Clone)]
enum Event {
    Save {
        step: u64,
        version: u64,
        fault: Option<SaveFault>,
    },
    /// Damage the `pick`-th folder of the books (modulo their count).
    Damage {
        pick: u64,
        how: Damage,
    },
    Leftover(Leftover),
    /// A restore at or before `at`; `unreadable`: the folder's path leads to a file meanwhile
    /// (as the chaos fault `fail_writes` leaves it).
    Restore {
        at: u64,
        unreadable: bool,
    },
}

/// What a seed draws.
#[derive(Debug, Clone)]
struct World {
    seed: u64,
    keep_last: usize,
    resume: Resume,
    start: u64,
    events: Vec<Event>,
}

fn below(rng: &mut Rng, n: u64) -> u64 {
    rng.next_u64() % n.max(1)
}

fn build(seed: u64) -> World {
    let mut rng = Rng::derive(seed, &[0x7265_7374]);
    let keep_last = [0, 0, 1, 2, 3][below(&mut rng, 5) as usize];
    let resume = [Resume::Fresh, Resume::Other, Resume::Own][below(&mut rng, 3) as usize];
    let start = if resume == Resume::Fresh { 0 } else { 1 + below(&mut rng, 5) };
    let (mut step, mut events) = (start, Vec::new());
    for _ in 0..4 + below(&mut rng, 14) {
        let event = match below(&mut rng, 20) {
            0..=8 => {
                // Mostly forward; sometimes back (a restore from an older checkpoint, replayed):
                // the same steps are saved again.
                step = match below(&mut rng, 5) {
                    0 => start + below(&mut rng, step - start + 1),
                    _ => step + 1 + below(&mut rng, 3),
                };
                let fault = match below(&mut rng, 10) {
                    0..=3 => None,
                    4..=6 => Some(SaveFault::Op { op: below(&mut rng, 18), crash: below(&mut rng, 3) == 0 }),
                    _ => Some(SaveFault::Bytes {
                        file: below(&mut rng, 4) as usize,
                        at: below(&mut rng, 700),
                        crash: below(&mut rng, 3) == 0,
                    }),
                };
                Event::Save { step, version: below(&mut rng, 1 << 20), fault }
            }
            9..=12 => {
                let file = below(&mut rng, 3) as usize;
                let how = match below(&mut rng, 7) {
                    0 | 1 => Damage::Flip { file, pos: rng.next_u64(), mask: 1 + below(&mut rng, 255) as u8 },
                    2 => Damage::Truncate { file, permille: below(&mut rng, 1000) },
                    3 => Damage::Delete { file },
                    4 | 5 => Damage::ClaimOther { from: below(&mut rng, 64) },
                    _ => Damage::Move { to: start + below(&mut rng, step - start + 4) },
                };
                Event::Damage { pick: below(&mut rng, 64), how }
            }
            13 | 14 => Event::Leftover(match below(&mut rng, 3) {
                0 => Leftover::TmpDir { step: start + below(&mut rng, step - start + 3), copy_of: rng_opt(&mut rng) },
                1 => Leftover::LatestTmp,
                _ => Leftover::StepFile { step: 90_000 + below(&mut rng, 10) },
            }),
            _ => Event::Restore { at: start + below(&mut rng, step - start + 2), unreadable: below(&mut rng, 8) == 0 },
        };
        events.push(event);
    }
    events.push(Event::Restore { at: step, unreadable: false });
    World { seed, keep_last, resume, start, events }
}

fn rng_opt(rng: &mut Rng) -> Option<u64> {
    (below(rng, 2) == 0).then(|| below(rng, 64))
}

/// The state saved at `step` in its `version`: raw random bits (subnormals, -0, and in the
/// optimizer state NaN payloads and infinities: a save refuses a non-finite parameter) in the
/// tensors, numbers in the manifest's fields.
fn state(seed: u64, step: u64, version: u64) -> CheckpointState {
    let mut rng = Rng::derive(seed, &[0x5eed, step, version]);
    let mut t = |name: &str, shape: &[usize], finite: bool| {
        let data = (0..shape.iter().product::<usize>())
            .map(|_| {
                let bits = rng.next_u64() as u32;
                // An all-ones exponent (NaN, infinity) loses its top bit: a finite number.
                let nonfinite = (bits >> 23) & 0xff == 0xff;
                f32::from_bits(if finite && nonfinite { bits & !(1 << 30) } else { bits })
            })
            .collect();
        NamedTensor { name: name.to_string(), shape: shape.to_vec(), data }
    };
    let params = vec![t("wte.weight", &[4, 3], true), t("ln_f.bias", &[3], true)];
    let optim = vec![t("optim.exp_avg", &[15], false), t("optim.exp_avg_sq", &[15], false)];
    CheckpointState {
        step,
        config_hash: format!("cfg-{seed:x}"),
        model: "sim-tiny".into(),
        data_cursor: serde_json::json!({"seed": seed % 1000, "cursor": step * 4}),
        rng: serde_json::json!({"seed": seed % 1000}),
        extra: serde_json::json!({"optimizer_steps": step, "applied_steps": step, "skipped_steps": version % 7, "version": version,
            "loss_scaler": {"scale": 65536.0, "good_steps": version % 100}}),
        params,
        optim,
    }
}

fn bits(s: &CheckpointState) -> String {
    let t = |ts: &[NamedTensor]| -> Vec<(String, Vec<usize>, Vec<u32>)> {
        ts.iter().map(|t| (t.name.clone(), t.shape.clone(), t.data.iter().map(|x| x.to_bits()).collect())).collect()
    };
    format!("{} {} {} {} {} {} {:?} {:?}", s.step, s.config_hash, s.model, s.data_cursor, s.rng, s.extra, t(&s.params), t(&s.optim))
}

/// What the oracle's books say a folder holds.
#[derive(Debug, Clone)]
enum Held {
    /// The state saved at the folder's step in `version`, its files hashing to `files`.
    Intact { version: u64, files: String },
    /// Damaged by `what`; a restore passing it over must name one of `names` (`|` between
    /// them; empty: anything) in its reason.
    Damaged { what: String, names: String },
}

/// The step of a folder the restore may load: `step_N`, or `.old-step_N-<pid>`.
fn name_step(name: &str) -> Option<u64> {
    parse_step_dir_name(name).or_else(|| old_dir_step_name(name).and_then(|s| parse_step_dir_name(&s)))
}

/// blake3 of a folder's files as they are (the oracle's own reading).
fn fingerprint(dir: &Path) -> String {
    let mut h = blake3::Hasher::new();
    for f in FILES {
        h.update(f.as_bytes());
        match fs::read(dir.join(f)) {
            Ok(b) => h.update(&(b.len() as u64).to_le_bytes()).update(&b),
            Err(_) => h.update(b"<missing>"),
        };
    }
    h.finalize().to_hex().to_string()
}

fn copy_tree(from: &Path, to: &Path) -> io::Result<()> {
    fs::create_dir(to)?;
    for e in fs::read_dir(from)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            copy_tree(&e.path(), &to.join(e.file_name()))?;
        } else {
            fs::copy(e.path(), to.join(e.file_name()))?;
        }
    }
    Ok(())
}

/// The folders of `root` a restore may load by the oracle's rule: `step_*` folders, and
/// `.old-step_N-*` folders whose `step_N` is missing.
fn restorable_on_disk(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in fs::read_dir(root).map(|rd| rd.flatten().collect::<Vec<_>>()).unwrap_or_default() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !e.path().is_dir() {
            continue;
        }
        if parse_step_dir_name(&name).is_some() {
            out.push(name);
        } else if let Some(step_name) = old_dir_step_name(&name) {
            if !root.join(step_name).exists() {
                out.push(name);
            }
        }
    }
    out.sort();
    out
}

/// What the restores of a seed came to.
#[derive(Debug, Default, Clone, Copy)]
struct Outcome {
    saves_ok: u64,
    saves_failed: u64,
    crashes: u64,
    damages: u64,
    from_checkpoint: u64,
    from_resume: u64,
    from_fresh: u64,
    refused: u64,
    skips_reported: u64,
}

/// A loaded state: a checkpoint's, or the seeded start's.
#[derive(Debug)]
enum Loaded {
    Checkpoint(Box<CheckpointState>),
    Fresh,
}

struct Sim<'t> {
    w: World,
    base: PathBuf,
    root: PathBuf,
    resume: Option<PathBuf>,
    /// The state in the resume folder, when `--resume` named one.
    resume_state: Option<CheckpointState>,
    books: BTreeMap<String, Held>,
    /// Every checkpoint saved intact: the blake3 of its files, its step and version.
    known: BTreeMap<String, (u64, u64)>,
    out: Outcome,
    trace: Option<&'t mut Vec<String>>,
}

impl Sim<'_> {
    fn tracing(&self) -> bool {
        self.trace.is_some()
    }

    fn log(&mut self, line: String) {
        if let Some(t) = self.trace.as_deref_mut() {
            t.push(line);
        }
    }

    fn rel(&self, p: &Path) -> String {
        p.strip_prefix(&self.base).unwrap_or(p).display().to_string()
    }

    /// The books' folders a restore may load (see [`restorable_on_disk`]).
    fn candidates(&self) -> Vec<(u64, String)> {
        let mut c: Vec<(u64, String)> = self
            .books
            .keys()
            .filter(|n| match old_dir_step_name(n) {
                Some(step_name) => !self.books.contains_key(&step_name),
                None => true,
            })
            .filter_map(|n| name_step(n).map(|s| (s, n.clone())))
            .collect();
        c.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        c
    }

    /// Every folder of the books is on disk as booked (an intact one byte for byte), and no
    /// other folder a restore may load is.
    fn check_books(&self, after: &str) -> Result<(), String> {
        for (name, held) in &self.books {
            let dir = self.root.join(name);
            if !dir.is_dir() {
                return Err(format!("after {after}: {name} ({held:?}) is gone"));
            }
            if let Held::Intact { files, .. } = held {
                if fingerprint(&dir) != *files {
                    return Err(format!("after {after}: the intact checkpoint {name} changed"));
                }
            }
        }
        let booked: Vec<String> =
            self.candidates().into_iter().map(|(_, n)| n).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
        let on_disk = restorable_on_disk(&self.root);
        if booked != on_disk {
            return Err(format!("after {after}: the folder holds {on_disk:?}, the books {booked:?}"));
        }
        Ok(())
    }

    fn save(&mut self, step: u64, version: u64, fault: Option<SaveFault>) -> Result<(), String> {
        let st = state(self.w.seed, step, version);
        let name = step_dir_name(step);
        // What every save does first: a folder a same-step re-save moved aside comes back when
        // its step is missing, and goes otherwise.
        for old in self.books.keys().filter(|n| old_dir_step_name(n).is_some()).cloned().collect::<Vec<_>>() {
            let held = self.books.remove(&old).expect("booked");
            let step_name = old_dir_step_name(&old).expect("an old folder");
            self.books.entry(step_name).or_insert(held);
        }
        let passed: Rc<RefCell<Vec<(String, String)>>> = Rc::default();
        let fired = Rc::new(Cell::new(false));
        let crash_copy = self.base.join("crash");
        let (root, crash_to) = (self.root.clone(), crash_copy.clone());
        let crash_at = Rc::new(move || copy_tree(&root, &crash_to).expect("copy the folder at the crash"));
        {
            let (passed, fired, crash_at) = (Rc::clone(&passed), Rc::clone(&fired), Rc::clone(&crash_at));
            let mut count = 0;
            let hook = move |op: &str, name: &str| {
                count += 1;
                if let Some(SaveFault::Op { op: k, crash }) = fault {
                    if count - 1 == k && !fired.get() {
                        fired.set(true);
                        if crash {
                            crash_at();
                        }
                        return Err(io::Error::other(format!("injected: {op} {name} fails")));
                    }
                }
                passed.borrow_mut().push((op.to_string(), name.to_string()));
                Ok(())
            };
            FAULT_HOOK.with(|h| *h.borrow_mut() = Some(Box::new(hook)));
        }
        {
            let (fired, crash_at) = (Rc::clone(&fired), Rc::clone(&crash_at));
            let hook = move |file: &str, offset: u64, len: usize| -> io::Result<usize> {
                let Some(SaveFault::Bytes { file: k, at, crash }) = fault else { return Ok(len) };
                let target = match k {
                    0..=2 => file == FILES[k],
                    _ => file.starts_with(&format!(".{LATEST_FILE}")),
                };
                if !target || fired.get() || offset + len as u64 <= at {
                    return Ok(len);
                }
                if offset < at {
                    return Ok((at - offset) as usize);
                }
                fired.set(true);
                if crash {
                    crash_at();
                }
                Err(io::Error::new(io::ErrorKind::StorageFull, format!("injected: no space left at byte {at} of {file}")))
            };
            WRITE_HOOK.with(|h| *h.borrow_mut() = Some(Box::new(hook)));
        }
        let before = self.books.get(&name).cloned();
        let res = checkpoint::save(&self.root, &st, self.w.keep_last);
        FAULT_HOOK.with(|h| *h.borrow_mut() = None);
        WRITE_HOOK.with(|h| *h.borrow_mut() = None);
        let crashed = fired.get() && matches!(fault, Some(SaveFault::Op { crash: true, .. } | SaveFault::Bytes { crash: true, .. }));
        let passed = passed.borrow().clone();
        let has = |op: &str, n: &str| passed.iter().any(|(o, m)| o == op && m == n);
        let (installed, moved_aside) = (has("rename", &name), has("move aside", &name));
        let what = format!("save of {name} v{version} ({fault:?})");
        if self.tracing() {
            let got = match &res {
                Ok(_) => "ok".to_string(),
                Err(e) => format!("error: {}", e.to_string().replace(&self.base.display().to_string(), "")),
            };
            self.log(format!("{what}: {got}{}", if crashed { "; crashed there" } else { "" }));
        }
        match (&res, fired.get()) {
            (Err(e), false) => return Err(format!("{what}: failed with no fault injected: {e}")),
            (Ok(_), true) => return Err(format!("{what}: the injected fault was not reported")),
            _ => {}
        }
        if crashed {
            fs::remove_dir_all(&self.root).map_err(|e| e.to_string())?;
            fs::rename(&crash_copy, &self.root).map_err(|e| e.to_string())?;
            self.out.crashes += 1;
        } else if res.is_ok() {
            self.out.saves_ok += 1;
        } else {
            self.out.saves_failed += 1;
        }
        if installed {
            let files = fingerprint(&self.root.join(&name));
            self.known.insert(files.clone(), (step, version));
            self.books.insert(name.clone(), Held::Intact { version, files });
            self.books.retain(|n, _| old_dir_step_name(n).as_deref() != Some(name.as_str()));
            // The replaced folder stays aside when its removal failed or the crash came first
            // (no candidate while the step's folder is there; the next save removes it).
            let old = format!(".old-{name}-{}", std::process::id());
            if let (true, false, Some(held)) = (moved_aside, has("remove", &old), before) {
                self.books.insert(old, held);
            }
            if self.w.keep_last > 0 {
                let mut steps: Vec<(u64, String)> =
                    self.books.keys().filter_map(|n| parse_step_dir_name(n).map(|s| (s, n.clone()))).collect();
                steps.sort_by_key(|s| std::cmp::Reverse(s.0));
                for (s, n) in steps.into_iter().skip(self.w.keep_last).filter(|(s, _)| *s != step) {
                    let gone = !self.root.join(&n).is_dir();
                    if res.is_ok() && !gone {
                        return Err(format!("{what}: step {s} was not pruned (keep_last {})", self.w.keep_last));
                    }
                    if gone {
                        self.books.remove(&n);
                    }
                }
            }
        } else if crashed && moved_aside {
            if let Some(held) = self.books.remove(&name) {
                self.books.insert(format!(".old-{name}-{}", std::process::id()), held);
            }
        }
        self.check_books(&what)
    }

    fn damage(&mut self, pick: u64, how: Damage) -> Result<(), String> {
        let names: Vec<String> = self.books.keys().cloned().collect();
        if names.is_empty() {
            return Ok(());
        }
        let mut name = names[(pick % names.len() as u64) as usize].clone();
        let dir = self.root.join(&name);
        let io = |e: io::Error| e.to_string();
        // What was done, and what a reason for passing the folder over must name (`|` between
        // alternatives; empty: anything).
        let (what, names_in_reason) = match how {
            Damage::Flip { file, pos, mask } => {
                let path = dir.join(FILES[file]);
                let Ok(mut b) = fs::read(&path) else { return Ok(()) };
                if b.is_empty() {
                    return Ok(());
                }
                let at = (pos % b.len() as u64) as usize;
                b[at] ^= mask;
                fs::write(&path, &b).map_err(io)?;
                (format!("byte {at} of {} flipped by {mask:#04x}", FILES[file]), FILES[file].to_string())
            }
            Damage::Truncate { file, permille } => {
                let path = dir.join(FILES[file]);
                let Ok(len) = fs::metadata(&path).map(|m| m.len()) else { return Ok(()) };
                if len == 0 {
                    return Ok(());
                }
                let keep = len * permille / 1000;
                fs::OpenOptions::new().write(true).open(&path).and_then(|f| f.set_len(keep)).map_err(io)?;
                (format!("{} cut from {len} to {keep} bytes", FILES[file]), FILES[file].to_string())
            }
            Damage::Delete { file } => {
                if fs::remove_file(dir.join(FILES[file])).is_err() {
                    return Ok(());
                }
                (format!("{} deleted", FILES[file]), FILES[file].to_string())
            }
            Damage::ClaimOther { from } => {
                let other = names[(from % names.len() as u64) as usize].clone();
                if other == name || parse_step_dir_name(&name).is_none() {
                    return Ok(());
                }
                for f in FILES {
                    let _ = fs::remove_file(dir.join(f));
                    if let Ok(b) = fs::read(self.root.join(&other).join(f)) {
                        fs::write(dir.join(f), b).map_err(io)?;
                    }
                }
                self.books.remove(&name);
                (format!("holds {other}'s files"), String::new())
            }
            Damage::Move { to } => {
                let to_name = step_dir_name(to);
                if self.books.contains_key(&to_name) || self.root.join(&to_name).exists() {
                    return Ok(());
                }
                fs::rename(&dir, self.root.join(&to_name)).map_err(io)?;
                self.books.remove(&name);
                let what = format!("{name} renamed to {to_name}");
                name = to_name;
                (what, String::new())
            }
        };
        self.out.damages += 1;
        self.log(format!("damage: {name}: {what}"));
        // The folder is intact when its bytes are a checkpoint of its step saved before (a
        // copy or rename that puts them back, or another save of that step); bytes of another
        // step's checkpoint must be reported as that step's; damage on damage may be reported
        // by either.
        let files = fingerprint(&self.root.join(&name));
        let held = match (self.known.get(&files), self.books.get(&name)) {
            (Some(&(step, version)), _) if Some(step) == name_step(&name) => Held::Intact { version, files },
            (Some(_), _) => Held::Damaged { what, names: "key `step`|holds step".to_string() },
            (None, Some(Held::Damaged { what: before, names })) if !names.is_empty() && !names_in_reason.is_empty() => {
                Held::Damaged { what: format!("{before}; {what}"), names: format!("{names}|{names_in_reason}") }
            }
            (None, Some(Held::Damaged { what: before, .. })) => Held::Damaged { what: format!("{before}; {what}"), names: String::new() },
            (None, _) => Held::Damaged { what, names: names_in_reason },
        };
        self.books.insert(name, held);
        self.check_books("damage")
    }

    fn leftover(&mut self, l: Leftover) -> Result<(), String> {
        let io = |e: io::Error| e.to_string();
        match l {
            Leftover::TmpDir { step, copy_of } => {
                let tmp = self.root.join(format!(".tmp-{}-99999", step_dir_name(step)));
                if tmp.exists() || !self.root.is_dir() {
                    return Ok(());
                }
                let names: Vec<String> = self.books.keys().cloned().collect();
                match copy_of.filter(|_| !names.is_empty()) {
                    Some(k) => copy_tree(&self.root.join(&names[(k % names.len() as u64) as usize]), &tmp).map_err(io)?,
                    None => {
                        fs::create_dir(&tmp).map_err(io)?;
                        fs::write(tmp.join(PARAMS_FILE), b"half written").map_err(io)?;
                    }
                }
            }
            Leftover::LatestTmp => fs::write(self.root.join(format!(".{LATEST_FILE}.tmp-99999")), b"step_0000").map_err(io)?,
            Leftover::StepFile { step } => fs::write(self.root.join(step_dir_name(step)), b"not a folder").map_err(io)?,
        }
        self.log(format!("leftover: {l:?}"));
        self.check_books("a leftover")
    }

    fn restore(&mut self, at: u64, unreadable: bool) -> Result<(), String> {
        let unreadable = unreadable && self.root.is_dir();
        // The oracle's answer first: the newest intact candidate at or before `at`, and the
        // damaged ones above it that must be reported.
        let candidates: Vec<(u64, String)> = self.candidates().into_iter().filter(|(s, _)| *s <= at).collect();
        let chosen = if unreadable { None } else { candidates.iter().find(|(_, n)| matches!(self.books[n], Held::Intact { .. })).cloned() };
        let must_skip: Vec<(String, String, String)> = match unreadable {
            true => Vec::new(),
            false => candidates
                .iter()
                .take_while(|c| Some(*c) != chosen.as_ref())
                .map(|(_, n)| match &self.books[n] {
                    Held::Damaged { names, what } => (n.clone(), names.clone(), what.clone()),
                    Held::Intact { .. } => unreachable!("an intact candidate above the chosen one"),
                })
                .collect(),
        };
        let held_away = self.base.join("held");
        if unreadable {
            fs::rename(&self.root, &held_away).map_err(|e| e.to_string())?;
            fs::write(&self.root, b"chaos: writes fail here\n").map_err(|e| e.to_string())?;
        }
        let reports: RefCell<Vec<(PathBuf, String)>> = RefCell::default();
        let load = |dir: &Path| -> Result<(u64, Loaded)> {
            let r = checkpoint::resolve_resume(dir)?;
            Ok((r.state.step, Loaded::Checkpoint(Box::new(r.state))))
        };
        let skipped = |dir: &Path, why: &str| reports.borrow_mut().push((dir.to_path_buf(), why.to_string()));
        let got = restore_choice(&self.root, self.resume.as_deref(), at, &load, &|| Loaded::Fresh, &skipped);
        if unreadable {
            fs::remove_file(&self.root).map_err(|e| e.to_string())?;
            fs::rename(&held_away, &self.root).map_err(|e| e.to_string())?;
        }
        let reports = reports.into_inner();
        let base = self.base.display().to_string();
        if self.tracing() {
            let r: Vec<String> = reports.iter().map(|(d, w)| format!("{} ({})", self.rel(d), w.replace(&base, ""))).collect();
            let g = match &got {
                Ok((s, _, src)) => format!("step {s} from {}", src.replace(&base, "")),
                Err(e) => format!("error: {}", format!("{e:#}").replace(&base, "")),
            };
            self.log(format!("restore at {at}{}: {g}; skipped {r:?}", if unreadable { " (folder unreadable)" } else { "" }));
        }
        let what = format!("restore at {at}");
        self.out.skips_reported += reports.len() as u64;
        // Every report names a folder the oracle holds damaged (or the unreadable folder), in
        // order, with the reason naming the damage.
        if unreadable {
            let named = reports.iter().any(|(d, _)| d == &self.root);
            if !named {
                return Err(format!("{what}: the unreadable checkpoint folder was not reported ({reports:?})"));
            }
        } else {
            let dirs: Vec<String> = reports.iter().map(|(d, _)| self.rel(d)).collect();
            let want: Vec<String> = must_skip.iter().map(|(n, _, _)| self.rel(&self.root.join(n))).collect();
            if dirs != want {
                return Err(format!("{what}: reported skipped {dirs:?}, the damaged candidates above the chosen one are {want:?}"));
            }
            for ((_, why), (n, names, damage)) in reports.iter().zip(&must_skip) {
                if !names.split('|').any(|n| why.contains(n)) {
                    return Err(format!("{what}: {n} ({damage}) skipped for `{why}`, which does not name `{names}`"));
                }
            }
        }
        // The state loaded.
        let want: Option<(u64, Option<CheckpointState>)> = match (&chosen, self.w.resume) {
            (Some((s, n)), _) => match &self.books[n] {
                Held::Intact { version, .. } => Some((*s, Some(state(self.w.seed, *s, *version)))),
                Held::Damaged { .. } => unreachable!("chosen is intact"),
            },
            (None, Resume::Fresh) => Some((0, None)),
            (None, Resume::Other) => self.resume_state.clone().map(|st| (st.step, Some(st))),
            // The run's own start checkpoint is in the folder: were it intact it would have
            // been chosen above (the start is at or before any restore's step).
            (None, Resume::Own) => None,
        };
        match (got, want) {
            (Ok((step, loaded, _)), Some((want_step, want_state))) => {
                if step != want_step {
                    return Err(format!("{what}: loaded step {step}, want step {want_step} ({chosen:?})"));
                }
                match (loaded, want_state) {
                    (Loaded::Fresh, None) => self.out.from_fresh += 1,
                    (Loaded::Checkpoint(s), Some(w)) => {
                        if bits(&s) != bits(&w) {
                            return Err(format!("{what}: the state loaded at step {step} is not the state saved"));
                        }
                        match chosen {
                            Some(_) => self.out.from_checkpoint += 1,
                            None => self.out.from_resume += 1,
                        }
                    }
                    (l, w) => return Err(format!("{what}: loaded {l:?}, want {w:?}")),
                }
            }
            (Err(_), None) => self.out.refused += 1,
            (Ok((step, _, src)), None) => {
                return Err(format!(
                    "{what}: loaded step {step} from {}, but no valid state at or before it is left",
                    src.replace(&base, "")
                ))
            }
            (Err(e), Some((s, _))) => return Err(format!("{what}: failed ({e:#}), want step {s}")),
        }
        self.check_books(&what)
    }
}

/// The folder the simulations write in: memory-backed when the machine has one (thousands of
/// fsyncs otherwise dominate), else the system's temporary folder.
fn scratch() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    match shm.is_dir() {
        true => tempfile::Builder::new().prefix("tessera-restore-sim").tempdir_in(shm),
        false => tempfile::tempdir(),
    }
    .or_else(|_| tempfile::tempdir())
    .expect("a scratch folder")
}

fn run_seed(seed: u64, trace: Option<&mut Vec<String>>) -> Result<Outcome, String> {
    let w = build(seed);
    let tmp = scratch();
    let base = tmp.path().to_path_buf();
    let root = base.join("checkpoints");
    let mut sim = Sim {
        root: root.clone(),
        base,
        resume: None,
        resume_state: None,
        books: BTreeMap::new(),
        known: BTreeMap::new(),
        out: Outcome::default(),
        trace,
        w,
    };
    let start = sim.w.start;
    fs::create_dir(&root).map_err(|e| e.to_string())?;
    match sim.w.resume {
        Resume::Fresh => {}
        Resume::Other => {
            let st = state(seed, start, 1 << 30);
            let dir = checkpoint::save(&sim.base.join("other"), &st, 0).map_err(|e| e.to_string())?;
            sim.resume = Some(dir);
            sim.resume_state = Some(st);
        }
        Resume::Own => {
            let dir = checkpoint::save(&root, &state(seed, start, 0), 0).map_err(|e| e.to_string())?;
            sim.known.insert(fingerprint(&dir), (start, 0));
            sim.books.insert(step_dir_name(start), Held::Intact { version: 0, files: fingerprint(&dir) });
            // `--resume` of the root: the driver keeps the step directory it resolved to.
            sim.resume = Some(checkpoint::resolve_resume(&root).map_err(|e| e.to_string())?.dir);
        }
    }
    for event in sim.w.events.clone() {
        match event {
            Event::Save { step, version, fault } => sim.save(step, version, fault)?,
            Event::Damage { pick, how } => sim.damage(pick, how)?,
            Event::Leftover(l) => sim.leftover(l)?,
            Event::Restore { at, unreadable } => sim.restore(at, unreadable)?,
        }
    }
    Ok(sim.out)
}

/// Runs the seed `TESSERA_SIM_SEED` names (7 when unset) and prints its world, its trace and its
/// outcome; panics with the broken rule when it fails.
#[test]
fn restore_replay() {
    sim_support::replay(build, run_seed);
}

/// Seeds 1, 2 and 3, each run twice, give the same outcome and the same trace.
#[test]
fn restore_sim_is_deterministic() {
    sim_support::assert_deterministic(run_seed);
}

/// Runs seeds `0..n` (`TESSERA_SIM_SEEDS`, else 1000); a seed that breaks a rule fails the test
/// with the command that replays it.
#[test]
fn restore_many_seeds() {
    let mut total = Outcome::default();
    let n = sim_support::many_seeds("restore", "-p tessera --lib restore_replay", 1000, run_seed, |o| {
        total.saves_ok += o.saves_ok;
        total.saves_failed += o.saves_failed;
        total.crashes += o.crashes;
        total.damages += o.damages;
        total.from_checkpoint += o.from_checkpoint;
        total.from_resume += o.from_resume;
        total.from_fresh += o.from_fresh;
        total.refused += o.refused;
        total.skips_reported += o.skips_reported;
    });
    println!("{total:?}");
    assert!(n < 200 || (total.crashes > 0 && total.saves_failed > 0 && total.from_resume > 0 && total.from_fresh > 0 && total.refused > 0));
}

/// The last resort of a restore is the checkpoint the run resumed from; when the run's
/// `--resume` named its own checkpoint root, that root re-resolved by then to a newer
/// checkpoint, past `at` (the simulation's seed 1 before the fix), which is refused.
#[test]
fn a_last_resort_past_the_restore_step_is_refused() {
    let tmp = scratch();
    let root = tmp.path().join("checkpoints");
    checkpoint::save(&root, &state(1, 2, 0), 0).unwrap();
    checkpoint::save(&root, &state(1, 6, 0), 0).unwrap();
    let params = root.join(step_dir_name(2)).join(PARAMS_FILE);
    let mut bytes = fs::read(&params).unwrap();
    bytes[100] ^= 0x10;
    fs::write(&params, bytes).unwrap();
    let load = |dir: &Path| -> Result<(u64, ())> { Ok((checkpoint::resolve_resume(dir)?.state.step, ())) };
    let skipped = RefCell::new(Vec::new());
    let report = |dir: &Path, why: &str| skipped.borrow_mut().push(format!("{}: {why}", dir.display()));
    let err = restore_choice(&root, Some(&root), 5, &load, &|| (), &report).unwrap_err();
    assert!(format!("{err:#}").contains("past") || format!("{err:#}").contains("step 6"), "{err:#}");
    assert!(skipped.borrow()[0].contains(PARAMS_FILE), "{:?}", skipped.borrow());
}

/// A checkpoint folder that cannot be listed (its path leads to a file, as `fail_writes`
/// leaves it) is reported, not taken for an empty one in silence; and the step a same-step
/// re-save moved aside before it crashed is a candidate again.
#[test]
fn an_unreadable_folder_is_reported_and_a_step_moved_aside_is_restored() {
    let tmp = scratch();
    let root = tmp.path().join("checkpoints");
    fs::write(&root, b"chaos: writes fail here\n").unwrap();
    let load = |dir: &Path| -> Result<(u64, u64)> {
        let s = checkpoint::resolve_resume(dir)?.state;
        Ok((s.step, s.extra["version"].as_u64().unwrap()))
    };
    let skipped = RefCell::new(Vec::new());
    let report = |dir: &Path, why: &str| skipped.borrow_mut().push((dir.to_path_buf(), why.to_string()));
    let (step, _, from) = restore_choice(&root, None, 9, &load, &|| 0, &report).unwrap();
    assert_eq!((step, from.as_str()), (0, "the seeded initial state (step 0)"));
    assert_eq!(skipped.borrow().len(), 1);
    assert_eq!(skipped.borrow()[0].0, root, "{:?}", skipped.borrow());
    fs::remove_file(&root).unwrap();
    checkpoint::save(&root, &state(1, 3, 0), 0).unwrap();
    checkpoint::save(&root, &state(1, 5, 11), 0).unwrap();
    fs::rename(root.join(step_dir_name(5)), root.join(format!(".old-{}-4242", step_dir_name(5)))).unwrap();
    assert_eq!(checkpoint::list_restorable(&root).unwrap().iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![5, 3]);
    let (step, version, from) = restore_choice(&root, None, 9, &load, &|| 0, &report).unwrap();
    assert_eq!((step, version), (5, 11), "{from}");
}
