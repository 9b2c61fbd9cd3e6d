//! ZeRO-Offload on CPU ranks: the optimizer states (and at stage 3 the parameter shard) leave
//! the rank's device budget for host memory or NVMe swap files without changing a bit; a run
//! over `tessera.device_memory_bytes_max` is refused at start and fits with offload; a bad
//! `nvme_path`, a full disk and a failing write are clear errors that leave every checkpoint
//! loadable.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;

/// gpt-tiny, 3 steps of 4 micro-batches of 1 sequence of 32 tokens, on `world` ranks.
fn args(out: &Path, world: usize, stage: u8, extra: &[&str]) -> Vec<String> {
    let cfg = repo().join("configs/gpt-tiny.json");
    let mut a: Vec<String> =
        ["train", "--config", cfg.to_str().unwrap(), "--output", out.to_str().unwrap(), "--steps", "3", "--no-progress"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    a.extend(["--world".into(), world.to_string(), "--set".into(), format!("zero_optimization.stage={stage}")]);
    for s in [
        "train_batch_size=4",
        "train_micro_batch_size_per_gpu=1",
        "tessera.seq_len=32",
        "tessera.eval_iters=1",
        "tessera.eval_interval=0",
        "scheduler.params.warmup_min_ratio=0.5",
    ] {
        a.extend(["--set".into(), s.into()]);
    }
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

fn train(dir: &Path, name: &str, world: usize, stage: u8, extra: &[&str]) -> (serde_json::Value, String) {
    let out = dir.join(name);
    let a = args(&out, world, stage, extra);
    let text = ok(&a.iter().map(String::as_str).collect::<Vec<_>>(), dir);
    (summary(&out), text)
}

fn refused(dir: &Path, name: &str, world: usize, stage: u8, extra: &[&str]) -> String {
    let a = args(&dir.join(name), world, stage, extra);
    fails(&a.iter().map(String::as_str).collect::<Vec<_>>(), dir)
}

fn nvme(dir: &Path) -> Vec<String> {
    vec![
        "--set".into(),
        "zero_optimization.offload_optimizer.device=\"nvme\"".into(),
        "--set".into(),
        format!("zero_optimization.offload_optimizer.nvme_path=\"{}\"", dir.display()),
    ]
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn per_rank(s: &serde_json::Value, list: &str, key: &str) -> Vec<u64> {
    s[list].as_array().unwrap().iter().map(|r| r[key].as_u64().unwrap()).collect()
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default()
}

#[test]
fn offload_changes_no_bit_and_moves_the_states_out_of_the_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let swap = tmp.path().join("swap");
    std::fs::create_dir(&swap).unwrap();
    let (plain, _) = train(tmp.path(), "plain", 2, 1, &[]);
    let want = plain["params_blake3"].clone();
    let optim = per_rank(&plain, "model_state_bytes_per_rank", "optimizer_states");
    let total = per_rank(&plain, "model_state_bytes_per_rank", "total");
    // A budget that stage 1 fits only once the fp32 masters and moments (12 bytes a
    // parameter, half the model per rank) leave the device.
    let budget = total.iter().zip(&optim).map(|(t, o)| t - o).max().unwrap() + 1000;
    let budget_set = format!("tessera.device_memory_bytes_max={budget}");

    let text = refused(tmp.path(), "over", 2, 1, &["--set", &budget_set]);
    assert!(text.contains("needs") && text.contains(&format!("tessera.device_memory_bytes_max = {budget}")), "{text}");
    assert!(text.contains("offload_optimizer.device") && text.contains(&optim[0].to_string()), "{text}");
    assert!(!tmp.path().join("over").exists(), "a refused run writes nothing");

    let cpu = ["--set", "zero_optimization.offload_optimizer.device=\"cpu\"", "--set", &budget_set];
    let (host, _) = train(tmp.path(), "cpu", 2, 1, &cpu);
    assert_eq!(host["params_blake3"], want, "cpu offload changed the parameters");
    assert_eq!(per_rank(&host, "model_state_bytes_per_rank", "optimizer_states"), vec![0, 0]);
    assert_eq!(per_rank(&host, "offloaded_bytes_per_rank", "host"), optim);
    assert_eq!(per_rank(&host, "offloaded_bytes_per_rank", "nvme"), vec![0, 0]);

    // NVMe, sub-groups of 65,536 elements (several per rank), reads and writes pipelined,
    // split among 2 threads with small requests.
    let mut extra = nvme(&swap);
    for s in [
        "zero_optimization.sub_group_size=65536",
        "zero_optimization.offload_optimizer.pipeline_read=true",
        "zero_optimization.offload_optimizer.pipeline_write=true",
        "aio.block_size=65536",
        "aio.thread_count=2",
        "aio.queue_depth=4",
    ] {
        extra.extend(["--set".into(), s.into()]);
    }
    extra.extend(["--set".into(), budget_set.clone()]);
    let (disk, _) = train(tmp.path(), "nvme1", 2, 1, &strs(&extra));
    assert_eq!(disk["params_blake3"], want, "nvme offload changed the parameters");
    assert_eq!(per_rank(&disk, "offloaded_bytes_per_rank", "nvme"), optim);
    assert_eq!(per_rank(&disk, "model_state_bytes_per_rank", "optimizer_states"), vec![0, 0]);
    assert!(files_in(&swap).is_empty(), "swap files left after a clean exit: {:?}", files_in(&swap));

    // Stage 3: NVMe without pipelining (one sub-group per rank), and host-tier optimizer
    // states with the parameter shard in host memory too.
    let (disk3, _) = train(tmp.path(), "nvme3", 2, 3, &strs(&nvme(&swap)));
    assert_eq!(disk3["params_blake3"], want, "stage 3 nvme offload changed the parameters");
    let both = ["--set", "zero_optimization.offload_optimizer.device=\"cpu\"", "--set", "zero_optimization.offload_param.device=\"cpu\""];
    let (host3, _) = train(tmp.path(), "cpu3", 2, 3, &both);
    assert_eq!(host3["params_blake3"], want, "stage 3 cpu offload changed the parameters");
    let shard: Vec<u64> = per_rank(&host3, "offloaded_bytes_per_rank", "host").iter().zip(&optim).map(|(h, o)| h - o).collect();
    assert!(shard.iter().all(|&b| b > 0), "the parameter shards are not in the host tier: {shard:?}");
    let p3 = per_rank(&disk3, "model_state_bytes_per_rank", "params");
    let p3_host = per_rank(&host3, "model_state_bytes_per_rank", "params");
    for r in 0..2 {
        assert_eq!(p3[r] - p3_host[r], shard[r], "rank {r}: resident params with and without offload_param");
    }
    assert!(files_in(&swap).is_empty(), "swap files left after a clean exit: {:?}", files_in(&swap));
}

#[test]
fn a_bad_nvme_path_or_setting_is_refused_at_start() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-dir");
    let text = refused(tmp.path(), "missing", 2, 1, &strs(&nvme(&missing)));
    assert!(text.contains("nvme_path") && text.contains(missing.to_str().unwrap()), "{text}");
    assert!(!tmp.path().join("missing").exists(), "a refused run writes nothing");
    let file = write(tmp.path(), "a-file", "x");
    let text = refused(tmp.path(), "file", 2, 1, &strs(&nvme(&file)));
    assert!(text.contains("is not a directory") && text.contains(file.to_str().unwrap()), "{text}");
    let text = refused(tmp.path(), "nopath", 2, 1, &["--set", "zero_optimization.offload_optimizer.device=\"nvme\""]);
    assert!(text.contains("needs zero_optimization.offload_optimizer.nvme_path"), "{text}");
    let text = refused(tmp.path(), "param", 2, 1, &["--set", "zero_optimization.offload_param.device=\"cpu\""]);
    assert!(text.contains("offload_param needs ZeRO stage 3"), "{text}");
    let mut extra = nvme(tmp.path());
    extra.extend(["--set".into(), "aio.block_size=5000".into()]);
    let text = refused(tmp.path(), "block", 2, 1, &strs(&extra));
    assert!(text.contains("aio.block_size = 5000"), "{text}");
}

#[test]
fn a_failed_swap_write_stops_the_run_and_the_last_checkpoint_resumes_to_the_same_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let swap = tmp.path().join("swap");
    std::fs::create_dir(&swap).unwrap();
    let (plain, _) = train(tmp.path(), "plain", 2, 1, &[]);
    let out = tmp.path().join("failing");
    let mut a = args(&out, 2, 1, &["--set", "tessera.checkpoint_interval=1", "--set", "zero_optimization.sub_group_size=65536"]);
    a.extend(nvme(&swap));
    // The write-back of step 2's second sub-group fails (a test-only fault hook, chaos/src/hooks.rs).
    let res =
        Command::new(bin()).args(&a).env("TESSERA_TEST_FAULTS", "offload_fail_write_at_step=2").current_dir(tmp.path()).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&res.stdout), String::from_utf8_lossy(&res.stderr));
    assert_eq!(res.status.code(), Some(1), "{text}");
    assert!(
        text.contains("injected write error") && text.contains("optimizer swap file") && text.contains(swap.to_str().unwrap()),
        "{text}"
    );
    // Step 1's checkpoint was saved before the failing step; step 2's never was.
    let ckpts = out.join("checkpoints");
    let (resumed, _) = {
        let again = tmp.path().join("resumed");
        let b = args(&again, 2, 1, &["--resume", ckpts.to_str().unwrap()]);
        let t = ok(&strs(&b), tmp.path());
        (summary(&again), t)
    };
    assert_eq!(resumed["params_blake3"], plain["params_blake3"], "resuming the last checkpoint did not reproduce the run");
}

/// A tmpfs of `size` mounted at a fresh directory, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: PathBuf, size: &str) -> Result<Tmpfs, String> {
        std::fs::create_dir_all(&at).map_err(|e| e.to_string())?;
        let out = Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"]).arg(&at).output();
        match out {
            Ok(o) if o.status.success() => Ok(Tmpfs(at)),
            Ok(o) => Err(String::from_utf8_lossy(&o.stderr).trim().to_string()),
            Err(e) => Err(e.to_string()),
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn a_full_disk_is_refused_at_start_and_a_tmpfs_without_o_direct_still_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let small = match Tmpfs::mount(tmp.path().join("small"), "2m") {
        Ok(m) => m,
        Err(why) => {
            println!("skipped: mounting a tmpfs is not permitted here ({why})");
            return;
        }
    };
    // gpt-tiny's swap files at stage 1 on 2 ranks take 3 × 1.7 MB a rank.
    let text = refused(tmp.path(), "full", 2, 1, &strs(&nvme(&small.0)));
    assert!(text.contains("bytes free") && text.contains(small.0.to_str().unwrap()), "{text}");
    assert!(!tmp.path().join("full").exists(), "a refused run writes nothing");
    let big = Tmpfs::mount(tmp.path().join("big"), "64m").expect("a second tmpfs");
    let (plain, _) = train(tmp.path(), "plain", 2, 3, &[]);
    let (s, text) = train(tmp.path(), "tmpfs", 2, 3, &strs(&nvme(&big.0)));
    assert_eq!(s["params_blake3"], plain["params_blake3"]);
    // Kernels before 6.6 refuse O_DIRECT on tmpfs; later ones accept it.
    println!("O_DIRECT on tmpfs: {}", if text.contains("refuses O_DIRECT") { "refused, buffered fallback" } else { "accepted" });
    assert!(files_in(&big.0).is_empty(), "swap files left: {:?}", files_in(&big.0));
}
