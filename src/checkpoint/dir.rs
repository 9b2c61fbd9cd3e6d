//! A folder held open by its descriptor: files are created, renamed, listed and removed
//! relative to it (`openat`, `mkdirat`, `renameat`, `unlinkat`, `fdopendir`), so every step of
//! a checkpoint save — its clean-up after an error included — acts on the folder the save
//! began in, whatever that folder's path names meanwhile (moved away and back, replaced by a
//! file). A save that named its files by path could create a temporary folder in the
//! checkpoint folder, lose the path when the folder moved, fail, try to remove the temporary
//! folder by a path that no longer led to it, and leave it behind in the folder once it was
//! moved back.

use std::ffi::{CStr, CString, OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

/// Deepest tree [`Dir::remove_tree`] removes (a step folder holds files only).
const TREE_DEPTH_MAX: usize = 4;

/// An open folder (see the module's documentation).
#[derive(Debug)]
pub(crate) struct Dir {
    file: File,
    /// Where it was opened, for error messages (it may have moved since).
    path: PathBuf,
}

/// What a name in a folder is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Kind {
    Folder,
    /// A file, a link or anything else that is not a folder.
    Other,
}

/// `name` as a C string, refused unless it names one entry of a folder.
fn entry_name(name: &OsStr) -> io::Result<CString> {
    let b = name.as_bytes();
    if b.is_empty() || b == b"." || b == b".." || b.contains(&b'/') {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{name:?} is not the name of an entry in a folder")));
    }
    CString::new(b).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("{name:?} holds a NUL byte")))
}

/// A libc call's result, or the error it left in `errno`.
fn checked(r: libc::c_int) -> io::Result<libc::c_int> {
    match r {
        r if r < 0 => Err(io::Error::last_os_error()),
        r => Ok(r),
    }
}

impl Dir {
    /// Opens the folder at `path`.
    pub(crate) fn open(path: &Path) -> io::Result<Dir> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY).open(path)?;
        Ok(Dir { file, path: path.to_path_buf() })
    }

    /// The folder's path as of when it was opened (for messages).
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The path of entry `name` as of when this folder was opened (for messages).
    pub(crate) fn join(&self, name: impl AsRef<Path>) -> PathBuf {
        self.path.join(name)
    }

    fn fd(&self) -> libc::c_int {
        self.file.as_raw_fd()
    }

    /// `openat` on this folder (never following a final symbolic link).
    fn open_at(&self, name: &CStr, flags: libc::c_int, mode: libc::c_uint) -> io::Result<File> {
        // SAFETY: a valid folder descriptor and a NUL-terminated name; the descriptor returned
        // is new, so the `File` owns it.
        let fd = checked(unsafe { libc::openat(self.fd(), name.as_ptr(), flags | libc::O_CLOEXEC | libc::O_NOFOLLOW, mode) })?;
        // SAFETY: `fd` was just opened and nothing else holds it.
        Ok(unsafe { File::from_raw_fd(fd) })
    }

    /// Opens the folder `name` inside this one.
    pub(crate) fn open_dir(&self, name: impl AsRef<OsStr>) -> io::Result<Dir> {
        let name = name.as_ref();
        let file = self.open_at(&entry_name(name)?, libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
        Ok(Dir { file, path: self.path.join(name) })
    }

    /// Creates the folder `name` (it must not exist).
    pub(crate) fn create_dir(&self, name: impl AsRef<OsStr>) -> io::Result<()> {
        let c = entry_name(name.as_ref())?;
        // SAFETY: a valid folder descriptor and a NUL-terminated name.
        checked(unsafe { libc::mkdirat(self.fd(), c.as_ptr(), 0o777) }).map(drop)
    }

    /// Creates the file `name` for writing (it must not exist).
    pub(crate) fn create_file(&self, name: impl AsRef<OsStr>) -> io::Result<File> {
        self.open_at(&entry_name(name.as_ref())?, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL, 0o666)
    }

    /// Renames `from` to `to`, both in this folder (replacing a file, or an empty folder, at `to`).
    pub(crate) fn rename(&self, from: impl AsRef<OsStr>, to: impl AsRef<OsStr>) -> io::Result<()> {
        let (from, to) = (entry_name(from.as_ref())?, entry_name(to.as_ref())?);
        // SAFETY: a valid folder descriptor (twice) and NUL-terminated names.
        checked(unsafe { libc::renameat(self.fd(), from.as_ptr(), self.fd(), to.as_ptr()) }).map(drop)
    }

    /// Removes the file (or link) `name`.
    pub(crate) fn remove_file(&self, name: impl AsRef<OsStr>) -> io::Result<()> {
        let c = entry_name(name.as_ref())?;
        // SAFETY: a valid folder descriptor and a NUL-terminated name.
        checked(unsafe { libc::unlinkat(self.fd(), c.as_ptr(), 0) }).map(drop)
    }

    /// What `name` is, or `None` when there is no such entry.
    pub(crate) fn kind(&self, name: impl AsRef<OsStr>) -> io::Result<Option<Kind>> {
        let c = entry_name(name.as_ref())?;
        // SAFETY: `stat` is plain data that fstatat fills in; the descriptor and name are valid.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above; `st` outlives the call.
        match checked(unsafe { libc::fstatat(self.fd(), c.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) }) {
            Ok(_) if st.st_mode & libc::S_IFMT == libc::S_IFDIR => Ok(Some(Kind::Folder)),
            Ok(_) => Ok(Some(Kind::Other)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The entries of this folder (without `.` and `..`), in no particular order.
    pub(crate) fn entries(&self) -> io::Result<Vec<(OsString, Kind)>> {
        // A descriptor of its own (its own read position), which the directory stream takes over.
        let own = self.open_at(c".", libc::O_RDONLY | libc::O_DIRECTORY, 0)?.into_raw_fd();
        // SAFETY: `own` is an open folder descriptor that nothing else uses.
        let stream = unsafe { libc::fdopendir(own) };
        if stream.is_null() {
            let e = io::Error::last_os_error();
            // SAFETY: fdopendir failed, so `own` is still ours to close.
            unsafe { libc::close(own) };
            return Err(e);
        }
        let mut out = Vec::new();
        let result = loop {
            // SAFETY: errno is this thread's; readdir reports an error only through it.
            unsafe { *libc::__errno_location() = 0 };
            // SAFETY: `stream` is an open directory stream.
            let entry = unsafe { libc::readdir(stream) };
            if entry.is_null() {
                let e = io::Error::last_os_error();
                break if e.raw_os_error() == Some(0) { Ok(()) } else { Err(e) };
            }
            // SAFETY: readdir returned an entry that stays valid until the next call on `stream`;
            // its name is NUL-terminated.
            let (name, d_type) = unsafe { (CStr::from_ptr((*entry).d_name.as_ptr()).to_bytes().to_vec(), (*entry).d_type) };
            if name == b"." || name == b".." {
                continue;
            }
            let name = OsString::from_vec(name);
            let kind = match d_type {
                libc::DT_DIR => Kind::Folder,
                libc::DT_UNKNOWN => match self.kind(&name) {
                    Ok(Some(k)) => k,
                    Ok(None) => continue,
                    Err(e) => break Err(e),
                },
                _ => Kind::Other,
            };
            out.push((name, kind));
        };
        // SAFETY: `stream` is open; closing it closes `own`.
        unsafe { libc::closedir(stream) };
        result.map(|()| out)
    }

    /// Removes `name` and, when it is a folder, everything in it (never following links).
    pub(crate) fn remove_tree(&self, name: impl AsRef<OsStr>) -> io::Result<()> {
        self.remove_tree_at(name.as_ref(), 0)
    }

    fn remove_tree_at(&self, name: &OsStr, depth: usize) -> io::Result<()> {
        if self.kind(name)? != Some(Kind::Folder) {
            return self.remove_file(name);
        }
        if depth >= TREE_DEPTH_MAX {
            return Err(io::Error::other(format!("{} is more than {TREE_DEPTH_MAX} folders deep", self.join(name).display())));
        }
        let sub = self.open_dir(name)?;
        for (entry, kind) in sub.entries()? {
            match kind {
                Kind::Folder => sub.remove_tree_at(&entry, depth + 1)?,
                Kind::Other => sub.remove_file(&entry)?,
            }
        }
        drop(sub);
        let c = entry_name(name)?;
        // SAFETY: a valid folder descriptor and a NUL-terminated name.
        checked(unsafe { libc::unlinkat(self.fd(), c.as_ptr(), libc::AT_REMOVEDIR) }).map(drop)
    }

    /// fsync: the entries created, renamed and removed in it are durable.
    pub(crate) fn sync(&self) -> io::Result<()> {
        self.file.sync_all()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_follow_the_folder_when_its_path_moves() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let dir = Dir::open(&root).unwrap();
        dir.create_dir("sub").unwrap();
        // The folder moves away and a file takes its path: the handle still reaches it.
        let held = tmp.path().join("held");
        std::fs::rename(&root, &held).unwrap();
        std::fs::write(&root, b"in the way").unwrap();
        let sub = dir.open_dir("sub").unwrap();
        sub.create_dir("deeper").unwrap();
        std::io::Write::write_all(&mut sub.create_file("f").unwrap(), b"x").unwrap();
        assert!(sub.create_file("f").is_err(), "create_file must not replace a file");
        dir.rename("sub", ".gone").unwrap();
        let mut names: Vec<_> = dir.entries().unwrap();
        names.sort();
        assert_eq!(names, vec![(OsString::from(".gone"), Kind::Folder)]);
        dir.remove_tree(".gone").unwrap();
        assert_eq!(dir.kind(".gone").unwrap(), None);
        assert!(std::fs::read_dir(&held).unwrap().next().is_none(), "the moved folder is empty");
        assert!(dir.create_file("a/b").is_err() && dir.create_file("..").is_err(), "only names of entries");
    }
}
