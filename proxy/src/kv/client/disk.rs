//! The master's disk tier (`--root_fs_dir`): a disk replica is a file holding the value's
//! raw bytes at `DiskDescriptor.file_path`, on a filesystem every client mounts at the
//! same path (Mooncake's client writes it after the memory replicas, readers read it
//! whole when no memory replica is left). Knows files, not the master or sockets.
//!
//! The paths come from the master, so they are confined to [`Root`] (`kv.disk_root`):
//! absolute, no `..`, under the root (also once symlinks are resolved), and a file's
//! size is checked before it is read.

use std::path::{Component, Path, PathBuf};

use bytes::Bytes;
use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::codec::types::DiskDescriptor;

#[derive(Debug, Error)]
pub enum DiskError {
    #[error("disk replica path is not UTF-8")]
    Path,
    #[error("disk replicas are not touched: kv.disk_root is not set")]
    NoRoot,
    #[error("disk replica {path} is outside kv.disk_root {root}")]
    Outside { path: String, root: String },
    #[error("disk replica {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("disk replica {path} holds {got} bytes, the object has {want}")]
    Size { path: String, got: u64, want: u64 },
}

/// The directory disk replicas must lie under (`kv.disk_root`); none = the disk tier
/// is not touched.
#[derive(Debug, Clone, Default)]
pub struct Root(Option<PathBuf>);

impl Root {
    /// `dir` empty = no disk tier. Resolved once (symlinks included) so confinement
    /// compares like with like.
    pub fn new(dir: &str) -> Root {
        if dir.is_empty() {
            return Root(None);
        }
        let p = PathBuf::from(dir);
        Root(Some(std::fs::canonicalize(&p).unwrap_or(p)))
    }

    fn dir(&self) -> Result<&Path, DiskError> {
        self.0.as_deref().ok_or(DiskError::NoRoot)
    }

    fn outside(&self, path: &Path) -> DiskError {
        DiskError::Outside {
            path: path.display().to_string(),
            root: self
                .0
                .as_deref()
                .unwrap_or(Path::new(""))
                .display()
                .to_string(),
        }
    }

    /// The replica's path if it lies under the root as written: absolute, only normal
    /// components, below the root.
    fn confine(&self, d: &DiskDescriptor) -> Result<PathBuf, DiskError> {
        let root = self.dir()?;
        let raw = std::str::from_utf8(&d.file_path).map_err(|_| DiskError::Path)?;
        let path = Path::new(raw);
        let plain = path.is_absolute()
            && path
                .components()
                .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
        if !plain || !path.starts_with(root) || path == root {
            return Err(self.outside(path));
        }
        Ok(path.to_path_buf())
    }

    /// `path` (which exists) still lies under the root once symlinks are resolved.
    async fn check_resolved(&self, path: &Path) -> Result<(), DiskError> {
        let real = tokio::fs::canonicalize(path)
            .await
            .map_err(|source| io_error(path, source))?;
        if real.starts_with(self.dir()?) {
            Ok(())
        } else {
            Err(self.outside(path))
        }
    }
}

fn io_error(path: &Path, source: std::io::Error) -> DiskError {
    DiskError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Reads a disk replica whole, after checking its file's size against the object's
/// (a wrong size is refused before any byte is read).
pub async fn read(root: &Root, d: &DiskDescriptor) -> Result<Bytes, DiskError> {
    let path = root.confine(d)?;
    root.check_resolved(&path).await?;
    let mut file = tokio::fs::File::open(&path)
        .await
        .map_err(|source| io_error(&path, source))?;
    let got = file
        .metadata()
        .await
        .map_err(|source| io_error(&path, source))?
        .len();
    if got != d.object_size {
        return Err(DiskError::Size {
            path: path.display().to_string(),
            got,
            want: d.object_size,
        });
    }
    let mut data = Vec::with_capacity(got as usize);
    // At most the checked size, even if the file grows meanwhile.
    (&mut file)
        .take(got)
        .read_to_end(&mut data)
        .await
        .map_err(|source| io_error(&path, source))?;
    if data.len() as u64 != got {
        return Err(DiskError::Size {
            path: path.display().to_string(),
            got: data.len() as u64,
            want: d.object_size,
        });
    }
    Ok(Bytes::from(data))
}

/// A disk replica being written, chunk by chunk.
pub struct Writer {
    file: tokio::fs::File,
    path: String,
}

impl Writer {
    /// Creates (or truncates) the replica's file, and its directories, under the root.
    pub async fn create(root: &Root, d: &DiskDescriptor) -> Result<Writer, DiskError> {
        let path = root.confine(d)?;
        if let Some(dir) = path.parent() {
            tokio::fs::create_dir_all(dir)
                .await
                .map_err(|source| io_error(dir, source))?;
            root.check_resolved(dir).await?;
        }
        let file = tokio::fs::File::create(&path)
            .await
            .map_err(|source| io_error(&path, source))?;
        Ok(Writer {
            file,
            path: path.display().to_string(),
        })
    }

    pub async fn write(&mut self, chunk: &[u8]) -> Result<(), DiskError> {
        self.file
            .write_all(chunk)
            .await
            .map_err(|source| DiskError::Io {
                path: self.path.clone(),
                source,
            })
    }

    /// Flushes the file (its bytes are in the OS, as with Mooncake's own writer; no
    /// fsync).
    pub async fn finish(mut self) -> Result<(), DiskError> {
        self.file.flush().await.map_err(|source| DiskError::Io {
            path: self.path.clone(),
            source,
        })
    }
}

/// Writes a whole value as a disk replica.
pub async fn write(root: &Root, d: &DiskDescriptor, value: &[u8]) -> Result<(), DiskError> {
    let mut w = Writer::create(root, d).await?;
    w.write(value).await?;
    w.finish().await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(path: &str, object_size: u64) -> DiskDescriptor {
        DiskDescriptor {
            file_path: Bytes::from(path.to_string()),
            object_size,
        }
    }

    #[tokio::test]
    async fn replicas_round_trip_and_sizes_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let root = Root::new(dir.path().to_str().unwrap());
        let base = std::fs::canonicalize(dir.path()).unwrap();
        let path = base.join("mooncake_cluster/k/e/key");
        let d = at(path.to_str().unwrap(), 5);
        write(&root, &d, b"hello").await.unwrap();
        assert_eq!(&read(&root, &d).await.unwrap()[..], b"hello");
        let wrong = DiskDescriptor {
            object_size: 6,
            ..d.clone()
        };
        assert!(matches!(
            read(&root, &wrong).await,
            Err(DiskError::Size {
                got: 5,
                want: 6,
                ..
            })
        ));
        let missing = at(base.join("nothing/here").to_str().unwrap(), 1);
        assert!(matches!(
            read(&root, &missing).await,
            Err(DiskError::Io { .. })
        ));
    }

    #[tokio::test]
    async fn paths_outside_the_root_are_refused_and_nothing_is_created() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let base = std::fs::canonicalize(dir.path()).unwrap();
        let root = Root::new(base.to_str().unwrap());
        let escape = format!("{}/../{}/made/x", base.display(), "esc");
        let bad = [
            "/etc/passwd".to_string(),
            "relative/key".to_string(),
            escape.clone(),
            base.display().to_string(),
        ];
        for p in &bad {
            assert!(
                matches!(read(&root, &at(p, 1)).await, Err(DiskError::Outside { .. })),
                "{p}"
            );
            assert!(
                matches!(
                    write(&root, &at(p, 1), b"x").await,
                    Err(DiskError::Outside { .. })
                ),
                "{p}"
            );
        }
        assert!(!base.parent().unwrap().join("esc").exists());
        // A symlink inside the root that leads out is refused once resolved.
        std::os::unix::fs::symlink(outside.path(), base.join("link")).unwrap();
        std::fs::write(outside.path().join("secret"), b"s").unwrap();
        let via = base.join("link/secret");
        assert!(matches!(
            read(&root, &at(via.to_str().unwrap(), 1)).await,
            Err(DiskError::Outside { .. })
        ));
        let made = base.join("link/sub/x");
        assert!(matches!(
            write(&root, &at(made.to_str().unwrap(), 1), b"x").await,
            Err(DiskError::Outside { .. })
        ));
        assert!(
            !outside.path().join("sub/x").exists(),
            "no file written outside"
        );
        // No root: the disk tier is not touched at all.
        let none = Root::new("");
        let inside = base.join("k");
        assert!(matches!(
            read(&none, &at(inside.to_str().unwrap(), 1)).await,
            Err(DiskError::NoRoot)
        ));
    }
}
