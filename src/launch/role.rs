//! `tessera train` started by torchrun or by Slurm's `srun`: every rank runs the same command,
//! and the launcher's variables say which rank this process is. Rank 0 becomes the coordinator
//! (listening on `MASTER_PORT`, UDP) with an agent of its own for rank 0; every other rank
//! becomes an agent that joins it with its own rank. The result is one job of `WORLD_SIZE`
//! ranks, the same as `train --nprocs N` on one machine or `tessera launch` across hosts.
//!
//! # Which launcher
//! - torchrun: `TORCHELASTIC_RUN_ID`, or `RANK` and `WORLD_SIZE`, are set. Rank `RANK`, world
//!   `WORLD_SIZE`, coordinator `MASTER_ADDR:MASTER_PORT` (torchrun's TCP store has that TCP port;
//!   Tessera's coordinator takes the UDP port of the same number), one host when
//!   `LOCAL_WORLD_SIZE` = `WORLD_SIZE`.
//! - Slurm: `SLURM_PROCID` and `SLURM_STEP_ID` are set (a task of an `srun` step; the batch
//!   script itself is no rank). Rank `SLURM_PROCID`, world `SLURM_STEP_NUM_TASKS` (else
//!   `SLURM_NTASKS`), hosts `SLURM_STEP_NODELIST` (else `SLURM_NODELIST`); the coordinator is
//!   `MASTER_ADDR` (else the list's first host) on `MASTER_PORT` (else [`slurm_default_port`]).
//!   torchrun's variables win when both are set (`srun torchrun …`).
//!
//! # Trust (how the ranks know each other)
//! The launcher hands the ranks no secret, so one of these must:
//! - `--certs DIR` (`tessera cluster init DIR --nodes WORLD_SIZE`, readable at the same path on
//!   every host): mutual TLS; rank r presents `node-r`, rank 0's coordinator `coordinator`.
//! - `--token-file PATH`: rank 0 makes the run's CA and join token as `tessera coordinator` does,
//!   and writes the token to PATH (mode 0600, renamed into place whole) once it listens; the
//!   other ranks wait for the file and join with it (the token pins rank 0's CA, so a token of
//!   an earlier run is recognised at the first handshake and the file read again). PATH must be
//!   on storage every host reads; rank 0 removes it when the run ends.
//! - Neither, with every rank on one host: the token file defaults to
//!   `$TMPDIR/tessera-<uid>/join-<launch>` (a directory of this user's, mode 0700, checked), so
//!   only this user's processes can read it, as with `train --nprocs`.
//!
//! On several hosts with neither, every rank refuses at once with the commands to use.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::{env_number, host_port, nodelist};

/// Which launcher started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    Torchrun,
    Slurm,
}

impl Launcher {
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "srun",
        }
    }
}

/// What the launcher's variables say about this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LauncherEnv {
    pub launcher: Launcher,
    pub rank: usize,
    pub world: usize,
    /// `LOCAL_RANK` / `SLURM_LOCALID`: this rank's index among those of its host.
    pub local_rank: Option<usize>,
    /// Whether every rank runs on this host.
    pub single_host: bool,
    /// The coordinator's host (`MASTER_ADDR`, or Slurm's first host) and UDP port.
    pub master_host: String,
    pub master_port: u16,
    /// Names this launch among others of the same user (the default token file's name).
    pub launch_id: String,
    /// The variables it came from, for messages: "RANK=1, WORLD_SIZE=2".
    pub describe: String,
}

impl LauncherEnv {
    /// `MASTER_ADDR:MASTER_PORT` (IPv6 bracketed; `localhost` as 127.0.0.1, which rank 0
    /// listens on, whatever order the resolver gives its addresses in).
    pub fn master(&self) -> String {
        match self.master_host.as_str() {
            "localhost" => host_port("127.0.0.1", self.master_port),
            h => host_port(h, self.master_port),
        }
    }
}

/// The port Slurm ranks meet on without `MASTER_PORT`: 29500 plus the job id modulo 1000, so two
/// jobs sharing a node rarely collide (set `MASTER_PORT` in the job script to choose).
pub fn slurm_default_port(job_id: u64) -> u16 {
    29_500 + (job_id % 1000) as u16
}

fn number(get: &dyn Fn(&str) -> Option<String>, name: &'static str) -> Result<Option<usize>> {
    Ok(env_number(get, &[name])?.map(|(n, _)| n))
}

fn required(get: &dyn Fn(&str) -> Option<String>, name: &'static str, launcher: &str) -> Result<usize> {
    number(get, name)?.with_context(|| format!("{launcher} started this process but {name} is not set"))
}

fn port_of(v: &str, name: &str) -> Result<u16> {
    match v.trim().parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => bail!("{name}={v:?} is not a port number (expected 1 to 65535)"),
    }
}

/// The launcher this process runs under, if any. `None` also for a Slurm batch script outside
/// `srun` (see [`slurm_batch_note`]).
pub fn detect(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<LauncherEnv>> {
    let env = if get("TORCHELASTIC_RUN_ID").is_some() || (get("RANK").is_some() && get("WORLD_SIZE").is_some()) {
        torchrun(get)?
    } else if get("SLURM_PROCID").is_some() && get("SLURM_STEP_ID").is_some() {
        slurm(get)?
    } else {
        return Ok(None);
    };
    if env.world == 0 {
        bail!("{}: the world size is 0", env.describe);
    }
    if env.rank >= env.world {
        bail!("{}: rank {} is not a rank of a world of {}", env.describe, env.rank, env.world);
    }
    Ok(Some(env))
}

fn torchrun(get: &dyn Fn(&str) -> Option<String>) -> Result<LauncherEnv> {
    let rank = required(get, "RANK", "torchrun")?;
    let world = required(get, "WORLD_SIZE", "torchrun")?;
    let local_rank = number(get, "LOCAL_RANK")?;
    let local_world = number(get, "LOCAL_WORLD_SIZE")?;
    let host = get("MASTER_ADDR").filter(|a| !a.trim().is_empty()).context("torchrun started this process but MASTER_ADDR is not set")?;
    let port = port_of(&get("MASTER_PORT").context("torchrun started this process but MASTER_PORT is not set")?, "MASTER_PORT")?;
    let run_id = get("TORCHELASTIC_RUN_ID").unwrap_or_default();
    Ok(LauncherEnv {
        launcher: Launcher::Torchrun,
        rank,
        world,
        local_rank,
        single_host: local_world == Some(world),
        master_host: host.trim().to_string(),
        master_port: port,
        launch_id: format!("torchrun-{}-{}-{port}", run_id, host.trim()),
        describe: format!(
            "torchrun (RANK={rank}, WORLD_SIZE={world}, LOCAL_WORLD_SIZE={})",
            local_world.map_or("unset".into(), |l| l.to_string())
        ),
    })
}

fn slurm(get: &dyn Fn(&str) -> Option<String>) -> Result<LauncherEnv> {
    let rank = required(get, "SLURM_PROCID", "srun")?;
    let world = match number(get, "SLURM_STEP_NUM_TASKS")? {
        Some(w) => w,
        None => required(get, "SLURM_NTASKS", "srun")?,
    };
    let list_var = ["SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"].into_iter().find(|v| get(v).is_some());
    let hosts = match list_var {
        Some(v) => nodelist::expand(&get(v).unwrap_or_default()).context(v)?,
        None => Vec::new(),
    };
    let host = match (get("MASTER_ADDR").filter(|a| !a.trim().is_empty()), hosts.first()) {
        (Some(a), _) => a.trim().to_string(),
        (None, Some(h)) => h.clone(),
        (None, None) => bail!("srun started this process but neither MASTER_ADDR nor SLURM_NODELIST names the coordinator's host"),
    };
    // Without MASTER_ADDR the coordinator is the list's first host, where srun's default
    // (block) distribution puts rank 0; rank 0 checks that it runs there.
    if let (0, None, Some(me), Some(first)) = (rank, get("MASTER_ADDR"), get("SLURMD_NODENAME"), hosts.first()) {
        if me.trim() != first {
            bail!(
                "srun put rank 0 on {}, but the other ranks look for it on {first}, the first host of the node list: set \
                 MASTER_ADDR={} (and MASTER_PORT) in the job script",
                me.trim(),
                me.trim()
            );
        }
    }
    let job = get("SLURM_JOB_ID").unwrap_or_default();
    let port = match get("MASTER_PORT") {
        Some(p) => port_of(&p, "MASTER_PORT")?,
        None => {
            let id: u64 = job.trim().parse().map_err(|_| anyhow::anyhow!("SLURM_JOB_ID={job:?} is not a job number (set MASTER_PORT)"))?;
            slurm_default_port(id)
        }
    };
    let step = get("SLURM_STEP_ID").unwrap_or_default();
    Ok(LauncherEnv {
        launcher: Launcher::Slurm,
        rank,
        world,
        local_rank: number(get, "SLURM_LOCALID")?,
        single_host: hosts.len() == 1,
        master_host: host,
        master_port: port,
        launch_id: format!("slurm-{}.{}", job.trim(), step.trim()),
        describe: format!("srun (SLURM_PROCID={rank}, {world} tasks on {} host(s))", hosts.len()),
    })
}

/// A warning for `tessera train` run by a Slurm batch script of several tasks outside `srun`:
/// it trains alone, which is seldom what the job asked for.
pub fn slurm_batch_note(get: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    let tasks = get("SLURM_NTASKS")?.trim().parse::<usize>().ok().filter(|n| *n > 1)?;
    match get("SLURM_STEP_ID").is_none() && get("TORCHELASTIC_RUN_ID").is_none() {
        true => Some(format!(
            "this is a Slurm job of {tasks} tasks, but not an srun step: this process trains alone; `srun tessera train …` runs one job of {tasks} ranks"
        )),
        false => None,
    }
}

/// How the ranks of a launcher's job prove they belong to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trust {
    /// A cluster directory (`tessera cluster init`).
    Certs(PathBuf),
    /// Rank 0 writes the run's join token there; the others read it.
    TokenFile(PathBuf),
}

/// The trust of this launch: `--certs`, else `--token-file`, else (one host) the default token
/// file under `tmp`; on several hosts without either, the refusal says what to run.
pub fn trust(env: &LauncherEnv, certs: Option<&Path>, token_file: Option<&Path>, tmp: &Path, command: &str) -> Result<Trust> {
    match (certs, token_file) {
        (Some(c), Some(t)) => bail!("--certs {} and --token-file {}: give one of the two", c.display(), t.display()),
        (Some(c), None) => Ok(Trust::Certs(c.to_path_buf())),
        (None, Some(t)) => Ok(Trust::TokenFile(t.to_path_buf())),
        (None, None) if env.single_host => Ok(Trust::TokenFile(private_dir(tmp)?.join(format!("join-{}", file_safe(&env.launch_id))))),
        (None, None) => bail!(
            "{}: the ranks run on several hosts and need a secret every rank can read, which {} does not hand out. Either make \
             certificates once, on storage every host reads:\n  tessera cluster init /shared/tessera-certs --nodes {}\n  \
             {command} --certs /shared/tessera-certs\nor let rank 0 write a join token to a file system every host shares:\n  \
             {command} --token-file /shared/tessera-join-token",
            env.describe,
            env.launcher.name(),
            env.world
        ),
    }
}

/// `s` with anything but letters, digits, `.`, `_` and `-` replaced by `_`.
fn file_safe(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') { c } else { '_' }).collect()
}

/// `tmp/tessera-<uid>`, made mode 0700 if missing; refused unless it is a directory (not a
/// link) of this user that no one else can enter.
pub fn private_dir(tmp: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    let dir = tmp.join(format!("tessera-{uid}"));
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e).with_context(|| format!("creating {}", dir.display())),
    }
    let meta = std::fs::symlink_metadata(&dir).with_context(|| format!("reading {}", dir.display()))?;
    if !meta.is_dir() || meta.uid() != uid || meta.permissions().mode() & 0o077 != 0 {
        bail!(
            "{} must be a directory of user {uid} that only it can enter (mode 0700) to hold the join token; it is not: remove it, \
             or give --token-file PATH",
            dir.display()
        );
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k: &str| m.get(k).cloned()
    }

    /// Exactly what torchrun 2.x sets for `--nproc_per_node 2` (rank 1), less the paths.
    const TORCHRUN: &[(&str, &str)] = &[
        ("RANK", "1"),
        ("LOCAL_RANK", "1"),
        ("GROUP_RANK", "0"),
        ("ROLE_RANK", "1"),
        ("ROLE_NAME", "default"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("WORLD_SIZE", "2"),
        ("GROUP_WORLD_SIZE", "1"),
        ("ROLE_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_RESTART_COUNT", "0"),
        ("TORCHELASTIC_MAX_RESTARTS", "0"),
        ("TORCHELASTIC_RUN_ID", "none"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    ];

    #[test]
    fn torchrun_variables_make_a_rank_of_one_job() {
        let e = detect(&env(TORCHRUN)).unwrap().unwrap();
        assert_eq!((e.launcher, e.rank, e.world, e.local_rank, e.single_host), (Launcher::Torchrun, 1, 2, Some(1), true));
        assert_eq!(e.master(), "127.0.0.1:29500");
        // Two nodes of two: not one host.
        let mut two: Vec<(&str, &str)> = TORCHRUN.to_vec();
        two.retain(|(k, _)| *k != "WORLD_SIZE");
        two.push(("WORLD_SIZE", "4"));
        assert!(!detect(&env(&two)).unwrap().unwrap().single_host);
        assert_eq!(detect(&env(&[])).unwrap(), None);
        assert_eq!(detect(&env(&[("RANK", "0")])).unwrap(), None, "RANK alone is no launcher");
    }

    #[test]
    fn slurm_variables_make_a_rank_with_the_first_host_and_a_default_port() {
        let s = [
            ("SLURM_PROCID", "3"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_JOB_ID", "123456"),
            ("SLURM_NODELIST", "node[07-08]"),
        ];
        let e = detect(&env(&s)).unwrap().unwrap();
        assert_eq!((e.launcher, e.rank, e.world, e.local_rank, e.single_host), (Launcher::Slurm, 3, 4, Some(1), false));
        assert_eq!((e.master_host.as_str(), e.master_port), ("node07", 29_956));
        assert_eq!(e.launch_id, "slurm-123456.0");
        let mut one = s.to_vec();
        one.extend([("SLURM_STEP_NODELIST", "node07"), ("MASTER_PORT", "7000"), ("MASTER_ADDR", "head")]);
        let e = detect(&env(&one)).unwrap().unwrap();
        assert_eq!((e.master(), e.single_host), ("head:7000".to_string(), true));
        // The batch script (no step) is no rank, but it is told.
        let batch = env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4"), ("SLURM_NODELIST", "n1")]);
        assert_eq!(detect(&batch).unwrap(), None);
        assert!(slurm_batch_note(&batch).unwrap().contains("srun tessera train"));
        assert_eq!(slurm_batch_note(&env(&s)), None);
        // Rank 0 away from the first host, without MASTER_ADDR, would wait alone.
        let mut away = s.to_vec();
        away.retain(|(k, _)| *k != "SLURM_PROCID");
        away.extend([("SLURM_PROCID", "0"), ("SLURMD_NODENAME", "node08")]);
        let e = detect(&env(&away)).unwrap_err().to_string();
        assert!(e.contains("rank 0 on node08") && e.contains("MASTER_ADDR=node08"), "{e}");
        away.push(("SLURMD_NODENAME", "node07"));
        assert_eq!(detect(&env(&away)).unwrap().unwrap().rank, 0);
        // torchrun under srun: torchrun's ranks.
        let mut both = s.to_vec();
        both.extend_from_slice(TORCHRUN);
        assert_eq!(detect(&env(&both)).unwrap().unwrap().launcher, Launcher::Torchrun);
    }

    #[test]
    fn bad_launcher_variables_are_named() {
        let without = |k: &str| TORCHRUN.iter().copied().filter(|(n, _)| *n != k).collect::<Vec<_>>();
        for (pairs, what) in [
            (without("MASTER_PORT"), "MASTER_PORT is not set"),
            (without("MASTER_ADDR"), "MASTER_ADDR is not set"),
            (without("WORLD_SIZE"), "WORLD_SIZE is not set"),
            ([&without("RANK")[..], &[("RANK", "2")]].concat(), "rank 2 is not a rank of a world of 2"),
            ([&without("MASTER_PORT")[..], &[("MASTER_PORT", "0")]].concat(), "MASTER_PORT=\"0\""),
            (vec![("SLURM_PROCID", "0"), ("SLURM_STEP_ID", "0"), ("SLURM_NTASKS", "2")], "neither MASTER_ADDR nor SLURM_NODELIST"),
            (vec![("SLURM_PROCID", "0"), ("SLURM_STEP_ID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_NODELIST", "n[1-")], "SLURM_NODELIST"),
            (vec![("SLURM_PROCID", "0"), ("SLURM_STEP_ID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_NODELIST", "n1")], "SLURM_JOB_ID"),
        ] {
            let e = format!("{:#}", detect(&env(&pairs)).unwrap_err());
            assert!(e.contains(what), "{pairs:?}: {e}");
        }
    }

    #[test]
    fn trust_comes_from_certs_a_token_file_or_a_private_directory_on_one_host() {
        let tmp = tempfile::tempdir().unwrap();
        let mut e = detect(&env(TORCHRUN)).unwrap().unwrap();
        let t = trust(&e, None, None, tmp.path(), "tessera train --config c.json").unwrap();
        let Trust::TokenFile(path) = t else { panic!("{t:?}") };
        assert!(
            path.starts_with(tmp.path()) && path.file_name().unwrap().to_str().unwrap().starts_with("join-torchrun-none-127.0.0.1-29500")
        );
        use std::os::unix::fs::PermissionsExt;
        let dir = path.parent().unwrap();
        assert_eq!(std::fs::metadata(dir).unwrap().permissions().mode() & 0o777, 0o700);
        // A directory others can enter is refused.
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(trust(&e, None, None, tmp.path(), "x").unwrap_err().to_string().contains("mode 0700"));
        assert_eq!(trust(&e, Some(Path::new("/c")), None, tmp.path(), "x").unwrap(), Trust::Certs("/c".into()));
        assert_eq!(trust(&e, None, Some(Path::new("/t")), tmp.path(), "x").unwrap(), Trust::TokenFile("/t".into()));
        assert!(trust(&e, Some(Path::new("/c")), Some(Path::new("/t")), tmp.path(), "x").is_err());
        e.single_host = false;
        let refusal = trust(&e, None, None, tmp.path(), "tessera train --config c.json").unwrap_err().to_string();
        assert!(refusal.contains("tessera cluster init /shared/tessera-certs --nodes 2"), "{refusal}");
        assert!(refusal.contains("tessera train --config c.json --certs /shared/tessera-certs"), "{refusal}");
        assert!(refusal.contains("tessera train --config c.json --token-file /shared/tessera-join-token"), "{refusal}");
    }
}
