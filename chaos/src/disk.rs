//! A faulted run's checkpoint folder on a small file system of its own, for `disk_full`: a
//! tmpfs mounted on `<output>/checkpoints` before the run starts (root), sized from the
//! fault-free run's checkpoints, which a fault fills with one file ([`Disk::fill`]) so every
//! checkpoint write fails with ENOSPC until the file is removed. After the run the folder is
//! checked for half-written leftovers ([`Disk::leftovers`]), copied to disk and unmounted
//! ([`Disk::finish`]); a `Disk` dropped before that unmounts (lazily) and loses the contents.
//! `fail_writes` puts a file in the folder's place and back, each in one atomic step
//! ([`block_writes`], [`unblock_writes`]).

use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The filler's name in the checkpoint folder (no checkpoint is named like it).
pub const FILL_FILE: &str = ".chaos-disk-full";
/// The smallest file system made (bytes).
pub const DISK_BYTES_MIN: u64 = 16 << 20;
/// Room beyond twice what the fault-free run left (bytes).
const DISK_MARGIN_BYTES: u64 = 8 << 20;
/// Filler writes (bytes): big ones first, then small ones for the last pages.
const FILL_CHUNKS_BYTES: [usize; 2] = [1 << 20, 4 << 10];

/// The size for a run whose fault-free twin left `clean_bytes` of checkpoints: room for those,
/// one more being written and a margin.
pub fn size_for(clean_bytes: u64) -> u64 {
    (2 * clean_bytes + DISK_MARGIN_BYTES).max(DISK_BYTES_MIN)
}

/// Bytes under `p` (files, recursively; 0 when missing).
pub fn dir_bytes(p: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(p) else { return 0 };
    rd.flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            _ => e.metadata().map_or(0, |m| m.len()),
        })
        .sum()
}

fn run(cmd: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(cmd).args(args).output().map_err(|e| format!("running {cmd}: {e}"))?;
    match out.status.success() {
        true => Ok(()),
        false => Err(format!("{cmd} {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim())),
    }
}

fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        let dest = to.join(e.file_name());
        if e.file_type()?.is_dir() {
            copy_tree(&e.path(), &dest)?;
        } else {
            std::fs::copy(e.path(), dest)?;
        }
    }
    Ok(())
}

/// A mounted checkpoint file system.
pub struct Disk {
    root: PathBuf,
    bytes: u64,
    mounted: bool,
}

impl Disk {
    /// Mounts a tmpfs of `bytes` on `root` (created; it must be empty).
    pub fn mount(root: &Path, bytes: u64) -> Result<Disk, String> {
        std::fs::create_dir_all(root).map_err(|e| format!("creating {}: {e}", root.display()))?;
        let path = root.to_str().ok_or_else(|| format!("{} is not valid UTF-8", root.display()))?;
        run("mount", &["-t", "tmpfs", "-o", &format!("size={bytes},mode=0755"), "tessera-chaos", path])
            .map_err(|e| format!("disk_full needs a small file system on {}: {e}", root.display()))?;
        Ok(Disk { root: root.to_path_buf(), bytes, mounted: true })
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Fills the file system: appends to [`FILL_FILE`] until a write fails with ENOSPC (so a
    /// second call tops up what freed since). Returns the filler's path and the bytes added.
    pub fn fill(&self) -> Result<(PathBuf, u64), String> {
        let path = self.root.join(FILL_FILE);
        let mut f = match std::fs::OpenOptions::new().create(true).append(true).open(&path) {
            Ok(f) => f,
            // Not even an inode left: full already.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => return Ok((path, 0)),
            Err(e) => return Err(format!("opening {}: {e}", path.display())),
        };
        let mut added = 0u64;
        for chunk in FILL_CHUNKS_BYTES {
            let zeros = vec![0u8; chunk];
            loop {
                match f.write(&zeros) {
                    Ok(0) => break,
                    Ok(n) => added += n as u64,
                    Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => return Err(format!("filling {}: {e}", path.display())),
                }
            }
        }
        Ok((path, added))
    }

    /// Removes the filler.
    pub fn free(&self) {
        let _ = std::fs::remove_file(self.root.join(FILL_FILE));
    }

    /// Copies the checkpoints to disk, unmounts, and puts the copy where the mount was.
    pub fn finish(mut self) -> Result<(), String> {
        self.free();
        let copy = self.root.with_extension("copy");
        let _ = std::fs::remove_dir_all(&copy);
        copy_tree(&self.root, &copy).map_err(|e| format!("copying {} out: {e}", self.root.display()))?;
        self.unmount()?;
        std::fs::remove_dir(&self.root).map_err(|e| format!("removing the mount point {}: {e}", self.root.display()))?;
        std::fs::rename(&copy, &self.root).map_err(|e| format!("moving the checkpoints to {}: {e}", self.root.display()))
    }

    fn unmount(&mut self) -> Result<(), String> {
        if !self.mounted {
            return Ok(());
        }
        let path = self.root.display().to_string();
        // A process that still holds the file system open would block a plain umount.
        let r = run("umount", &[&path]).or_else(|_| run("umount", &["-l", &path]));
        self.mounted = r.is_err();
        r
    }
}

impl Drop for Disk {
    fn drop(&mut self) {
        let _ = self.unmount();
    }
}

/// Swaps what the paths `a` and `b` name, in one step (`renameat2` with `RENAME_EXCHANGE`), so
/// that no process ever finds either path missing.
pub fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other);
    let (a, b) = (c(a)?, c(b)?);
    // SAFETY: two NUL-terminated paths, relative to the working directory.
    let r = unsafe { libc::renameat2(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), libc::RENAME_EXCHANGE) };
    match r {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// The `fail_writes` fault: the checkpoint folder `root` (created when missing) moves to `held`
/// and a file takes its path, so every write under `root` fails (even for root) until
/// [`unblock_writes`]. Both happen in one step ([`exchange`] with a file written at `held`
/// first): a save that starts meanwhile finds either the folder or the file at `root`, never
/// nothing — which it would create a fresh folder for, that the fault's file could then not
/// replace and that the folder could not be moved back onto.
pub fn block_writes(root: &Path, held: &Path) -> Result<(), String> {
    let _ = std::fs::create_dir_all(root);
    std::fs::write(held, b"chaos: writes fail here\n").map_err(|e| format!("writing {}: {e}", held.display()))?;
    exchange(root, held).map_err(|e| {
        let _ = std::fs::remove_file(held);
        format!("putting {} in place of {}: {e}", held.display(), root.display())
    })
}

/// Undoes [`block_writes`]: the folder back at `root` in one step, then the file (now at
/// `held`) removed.
pub fn unblock_writes(root: &Path, held: &Path) -> Result<(), String> {
    exchange(held, root).map_err(|e| format!("putting {} back: {e}", root.display()))?;
    std::fs::remove_file(held).map_err(|e| format!("removing {}: {e}", held.display()))
}

/// What a checkpoint folder must not hold once its run ended: temporary step folders and files
/// (`.tmp-…`, also inside a step folder), folders moved aside (`.old-…`). The harness's own
/// filler ([`FILL_FILE`]) is not one. Paths are relative to `root`; a missing folder holds
/// nothing.
pub fn checkpoint_leftovers(root: &Path) -> Vec<String> {
    let names = |dir: &Path| -> Vec<(String, bool)> {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| (e.file_name().to_string_lossy().into_owned(), e.file_type().is_ok_and(|t| t.is_dir())))
            .collect()
    };
    let half = |n: &str| (n.starts_with('.') || n.contains(".tmp-")) && n != FILL_FILE;
    let mut v = Vec::new();
    for (name, is_dir) in names(root) {
        if half(&name) {
            v.push(name);
        } else if is_dir {
            v.extend(names(&root.join(&name)).into_iter().filter(|(n, _)| half(n)).map(|(n, _)| format!("{name}/{n}")));
        }
    }
    v.sort();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocked_writes_fail_and_the_folder_comes_back_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let (root, held) = (tmp.path().join("checkpoints"), tmp.path().join("checkpoints.held"));
        std::fs::create_dir(&root).unwrap();
        std::fs::write(root.join("latest"), b"step_00000002\n").unwrap();
        block_writes(&root, &held).unwrap();
        assert!(root.is_file() && held.join("latest").is_file());
        assert!(std::fs::create_dir(root.join("step_00000004")).is_err(), "writes under the folder's path fail");
        unblock_writes(&root, &held).unwrap();
        assert_eq!(std::fs::read(root.join("latest")).unwrap(), b"step_00000002\n");
        assert!(!held.exists());
        assert_eq!(checkpoint_leftovers(&root), Vec::<String>::new());
    }
}
