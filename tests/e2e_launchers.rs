//! `tessera train` under torchrun and Slurm's srun: every rank runs the same command with the
//! launcher's variables, and together they form one job whose bits are those of `--world N`
//! (rank 0 coordinates, the others join it as agents; docs/MULTIHOST.md). The variables are set
//! exactly as torchrun 2.x and srun set them (torchrun itself needs PyTorch; when a `torchrun`
//! is on PATH the real one runs too). Also `tessera launch` with DeepSpeed's host selection.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::common::*;

/// gpt-tiny, ZeRO-1, 3 steps of 12 one-sequence micro-batches.
fn train_args(out: &Path) -> Vec<String> {
    let cfg = repo().join("configs/gpt-tiny.json");
    let mut a: Vec<String> =
        ["train", "--config", cfg.to_str().unwrap(), "--output", out.to_str().unwrap(), "--no-progress", "--steps", "3"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    for set in [
        "zero_optimization.stage=1",
        "train_batch_size=12",
        "train_micro_batch_size_per_gpu=1",
        "tessera.seq_len=32",
        "tessera.eval_iters=1",
        "tessera.eval_interval=0",
    ] {
        a.extend(["--set".to_string(), set.to_string()]);
    }
    a
}

/// Every variable a launcher sets, removed so the test's own environment cannot leak in.
const LAUNCHER_VARS: &[&str] = &[
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_STEP_ID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NODELIST",
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_ID",
    "SLURMD_NODENAME",
    "TESSERA_JOIN_TOKEN",
];

/// A UDP port free right now (the coordinator's `MASTER_PORT`).
fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// One rank: `tessera train …` with `vars` (and `TMPDIR`, where the default token file goes).
fn rank(dir: &Path, tmp: &Path, args: &[String], vars: &[(String, String)]) -> Child {
    let mut c = Command::new(bin());
    c.args(args).current_dir(dir).env("TMPDIR", tmp).stdout(Stdio::piped()).stderr(Stdio::piped());
    for v in LAUNCHER_VARS {
        c.env_remove(v);
    }
    c.envs(vars.iter().map(|(k, v)| (k, v)));
    c.spawn().expect("spawning tessera")
}

/// Reads `c`'s standard error until a line holds `what` (or it ends); returns whether one did,
/// what was read, and a thread that reads the rest.
fn stderr_until(c: &mut Child, what: &str) -> (bool, String, std::thread::JoinHandle<String>) {
    use std::io::{BufRead, Read};
    let err = c.stderr.take().expect("piped standard error");
    let mut reader = std::io::BufReader::new(err);
    let mut text = String::new();
    let mut found = false;
    loop {
        let mut line = String::new();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                text.push_str(&line);
                if line.contains(what) {
                    found = true;
                    break;
                }
            }
        }
    }
    let rest = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = reader.read_to_string(&mut rest);
        rest
    });
    (found, text, rest)
}

fn finish(c: Child) -> (bool, String) {
    let out = c.wait_with_output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// Exactly what torchrun 2.x sets for `--nproc_per_node N` on one node (plus the paths and
/// NCCL/OMP settings, which Tessera does not read).
fn torchrun_vars(r: usize, world: usize, local_world: usize, port: u16) -> Vec<(String, String)> {
    [
        ("RANK", r.to_string()),
        ("LOCAL_RANK", (r % local_world).to_string()),
        ("GROUP_RANK", (r / local_world).to_string()),
        ("ROLE_RANK", r.to_string()),
        ("ROLE_NAME", "default".into()),
        ("LOCAL_WORLD_SIZE", local_world.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("GROUP_WORLD_SIZE", (world / local_world).to_string()),
        ("ROLE_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.to_string()),
        ("TORCHELASTIC_RESTART_COUNT", "0".into()),
        ("TORCHELASTIC_MAX_RESTARTS", "0".into()),
        ("TORCHELASTIC_RUN_ID", "none".into()),
        ("TORCHELASTIC_USE_AGENT_STORE", "True".into()),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1".into()),
        ("OMP_NUM_THREADS", "1".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// What srun sets for task `r` of `world` on the nodes `nodelist`.
fn slurm_vars(r: usize, world: usize, nodelist: &str, port: u16) -> Vec<(String, String)> {
    [
        ("SLURM_PROCID", r.to_string()),
        ("SLURM_LOCALID", r.to_string()),
        ("SLURM_NTASKS", world.to_string()),
        ("SLURM_STEP_NUM_TASKS", world.to_string()),
        ("SLURM_STEP_ID", "0".into()),
        ("SLURM_JOB_ID", "4242".into()),
        ("SLURM_NODELIST", nodelist.into()),
        ("SLURM_STEP_NODELIST", nodelist.into()),
        ("MASTER_PORT", port.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// The user's id, as the default token file's directory is named by it.
fn uid() -> u32 {
    let probe = tempfile::NamedTempFile::new().unwrap();
    probe.as_file().metadata().unwrap().uid()
}

/// The `params_blake3` of the test config on `--world 2` in one process: the bits every job of
/// two ranks must end on.
fn world2_bits(dir: &Path) -> serde_json::Value {
    let out = dir.join("world2");
    let mut a = train_args(&out);
    a.extend(["--world".into(), "2".into()]);
    let refs: Vec<&str> = a.iter().map(String::as_str).collect();
    ok(&refs, dir);
    summary(&out)["params_blake3"].clone()
}

/// A well-formed join token that no coordinator of this test made (an earlier run's).
const STALE_TOKEN: &str = "tsr1-000102030405060708090a0b0c0d0e0f-00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

#[test]
fn torchrun_and_srun_ranks_form_one_job_with_the_bits_of_world_2() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let want = world2_bits(dir);

    // torchrun: rank 1 first, finding an earlier run's token in the default file; it must wait
    // for rank 0's instead of failing.
    let port = free_udp_port();
    let tdir = dir.join("tmp-torchrun");
    std::fs::create_dir_all(&tdir).unwrap();
    let private = tdir.join(format!("tessera-{}", uid()));
    std::fs::create_dir(&private).unwrap();
    std::fs::set_permissions(&private, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let token_file = private.join(format!("join-torchrun-none-127.0.0.1-{port}"));
    std::fs::write(&token_file, format!("{STALE_TOKEN}\n")).unwrap();
    let out = dir.join("torchrun");
    let mut r1 = rank(dir, &tdir, &train_args(&out), &torchrun_vars(1, 2, 2, port));
    // Rank 0 starts once rank 1 has read the stale token.
    let (read, head, rest) = stderr_until(&mut r1, "with the join token in");
    assert!(read, "rank 1 never read the token file:\n{head}");
    let r0 = rank(dir, &tdir, &train_args(&out), &torchrun_vars(0, 2, 2, port));
    let (ok0, t0) = finish(r0);
    let (ok1, stdout1) = finish(r1);
    let t1 = format!("{stdout1}{head}{}", rest.join().unwrap());
    assert!(ok0 && ok1, "rank 0:\n{t0}\nrank 1:\n{t1}");
    assert!(t0.contains("rank 0 of torchrun (RANK=0, WORLD_SIZE=2"), "{t0}");
    assert!(t1.contains("rank 1 of 2"), "rank 1 is an agent of rank 1:\n{t1}");
    assert!(t1.contains("holds an earlier run's join token"), "{t1}");
    let s = summary(&out);
    assert_eq!((s["world_size"].as_u64(), &s["params_blake3"]), (Some(2), &want), "torchrun's two ranks differ from --world 2");
    assert!(!token_file.exists(), "rank 0 leaves its token file behind");

    // srun: the coordinator is the node list's first host.
    let port = free_udp_port();
    let sdir = dir.join("tmp-srun");
    std::fs::create_dir_all(&sdir).unwrap();
    let out = dir.join("srun");
    let ranks: Vec<Child> = (0..2).map(|r| rank(dir, &sdir, &train_args(&out), &slurm_vars(r, 2, "localhost", port))).collect();
    let done: Vec<(bool, String)> = ranks.into_iter().map(finish).collect();
    assert!(done.iter().all(|(ok, _)| *ok), "{done:?}");
    assert!(done[0].1.contains("rank 0 of srun (SLURM_PROCID=0, 2 tasks on 1 host(s))"), "{}", done[0].1);
    assert_eq!(summary(&out)["params_blake3"], want, "srun's two ranks differ from --world 2");

    // The real torchrun, where one is installed (the lead's GPU machines have PyTorch).
    if let Some(torchrun) = which("torchrun") {
        let out = dir.join("real-torchrun");
        let mut c = Command::new(torchrun);
        c.args(["--nproc_per_node", "2", "--master_port", &free_udp_port().to_string(), "--no-python"]).arg(bin());
        c.args(train_args(&out)).current_dir(dir).env("TMPDIR", &sdir);
        for v in LAUNCHER_VARS {
            c.env_remove(v);
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(summary(&out)["params_blake3"], want, "the real torchrun's ranks differ from --world 2");
    }
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?).map(|d| d.join(program)).find(|p| p.is_file())
}

#[test]
fn launcher_ranks_refuse_what_they_cannot_do_securely_or_at_all() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let out = dir.join("x");
    let port = free_udp_port();
    // Two hosts of one rank each, no certificates, no shared token file: refused with the commands.
    for r in 0..2 {
        let (ok, text) = finish(rank(dir, dir, &train_args(&out), &torchrun_vars(r, 2, 1, port)));
        assert!(!ok, "{text}");
        assert!(text.contains("tessera cluster init /shared/tessera-certs --nodes 2"), "{text}");
        assert!(text.contains("torchrun … tessera train --config") && text.contains("--token-file /shared/tessera-join-token"), "{text}");
    }
    let mut a = train_args(&out);
    a.extend(["--nprocs".into(), "2".into()]);
    let (ok, text) = finish(rank(dir, dir, &a, &torchrun_vars(0, 2, 2, port)));
    assert!(!ok && text.contains("--nprocs 2 under torchrun") && text.contains("drop --nprocs"), "{text}");
    let mut a = train_args(&out);
    a.extend(["--device".into(), "cuda".into()]);
    let (ok, text) = finish(rank(dir, dir, &a, &torchrun_vars(1, 2, 2, port)));
    assert!(!ok && text.contains("--device cuda --nprocs 2") && text.contains("without the launcher"), "{text}");
    let mut a = train_args(&out);
    a.extend(["--world".into(), "3".into()]);
    let (ok, text) = finish(rank(dir, dir, &a, &torchrun_vars(0, 2, 2, port)));
    assert!(!ok && text.contains("--world 3") && text.contains("starts 2 ranks"), "{text}");
    // Without a launcher the trust flags mean nothing, so they are refused.
    let mut a = train_args(&out);
    a.extend(["--token-file".into(), "t".into()]);
    let (ok, text) = finish(rank(dir, dir, &a, &[]));
    assert!(!ok && text.contains("--token-file is for `tessera train` started by torchrun or srun"), "{text}");
    assert!(!out.exists(), "a refused run made its output directory");
}

#[test]
fn launch_selects_hosts_and_slots_as_deepspeed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let want = world2_bits(dir);
    let hostfile = write(dir, "hostfile", "localhost slots=4\n");
    let out = dir.join("launched");
    let mut a = train_args(&out);
    a[0] = "launch".into();
    a.extend(["--hostfile".into(), hostfile.display().to_string(), "--exclude".into(), "localhost:0,3".into()]);
    let refs: Vec<&str> = a.iter().map(String::as_str).collect();
    let text = ok(&refs, dir);
    assert!(text.contains("agent localhost-1: rank 0 of 2") && text.contains("agent localhost-2: rank 1 of 2"), "{text}");
    assert_eq!(summary(&out)["params_blake3"], want, "launch --exclude differs from --world 2");
    // DeepSpeed's spellings, and their refusals.
    let mut b = train_args(&dir.join("bad"));
    b[0] = "launch".into();
    b.extend(["--hostfile".into(), hostfile.display().to_string(), "--include".into(), "localhost:4".into()]);
    let refs: Vec<&str> = b.iter().map(String::as_str).collect();
    let text = fails(&refs, dir);
    assert!(text.contains("host localhost has no slot 4"), "{text}");
    let mut c = train_args(&dir.join("bad"));
    c[0] = "launch".into();
    c.extend(["--num_nodes".into(), "2".into(), "--num_gpus".into(), "1".into()]);
    let refs: Vec<&str> = c.iter().map(String::as_str).collect();
    let text = fails(&refs, dir);
    assert!(text.contains("--num_nodes 2: 1 host(s)"), "{text}");
}
