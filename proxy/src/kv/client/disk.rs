//! The master's disk tier (`--root_fs_dir`): a disk replica is a file holding the value's
//! raw bytes at `DiskDescriptor.file_path`, on a filesystem every client mounts at the
//! same path (Mooncake's client writes it after the memory replicas, readers read it
//! whole when no memory replica is left). Knows files, not the master or sockets.

use bytes::Bytes;
use thiserror::Error;
use tokio::io::AsyncWriteExt;

use crate::codec::types::DiskDescriptor;

#[derive(Debug, Error)]
pub enum DiskError {
    #[error("disk replica path is not UTF-8")]
    Path,
    #[error("disk replica {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("disk replica {path} holds {got} bytes, the object has {want}")]
    Size { path: String, got: u64, want: u64 },
}

fn path_of(d: &DiskDescriptor) -> Result<&str, DiskError> {
    std::str::from_utf8(&d.file_path).map_err(|_| DiskError::Path)
}

/// Reads a disk replica whole, checking its size against the object's.
pub async fn read(d: &DiskDescriptor) -> Result<Bytes, DiskError> {
    let path = path_of(d)?;
    let data = tokio::fs::read(path)
        .await
        .map_err(|source| DiskError::Io {
            path: path.to_string(),
            source,
        })?;
    if data.len() as u64 != d.object_size {
        return Err(DiskError::Size {
            path: path.to_string(),
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
    /// Creates (or truncates) the replica's file, and its directories.
    pub async fn create(d: &DiskDescriptor) -> Result<Writer, DiskError> {
        let path = path_of(d)?.to_string();
        let io = |source| DiskError::Io {
            path: path.clone(),
            source,
        };
        if let Some(dir) = std::path::Path::new(&path).parent() {
            tokio::fs::create_dir_all(dir).await.map_err(io)?;
        }
        let file = tokio::fs::File::create(&path).await.map_err(io)?;
        Ok(Writer { file, path })
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
pub async fn write(d: &DiskDescriptor, value: &[u8]) -> Result<(), DiskError> {
    let mut w = Writer::create(d).await?;
    w.write(value).await?;
    w.finish().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn replicas_round_trip_and_sizes_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mooncake_cluster/k/e/key");
        let d = DiskDescriptor {
            file_path: Bytes::from(path.to_str().unwrap().to_string()),
            object_size: 5,
        };
        write(&d, b"hello").await.unwrap();
        assert_eq!(&read(&d).await.unwrap()[..], b"hello");
        let wrong = DiskDescriptor {
            object_size: 6,
            ..d.clone()
        };
        assert!(matches!(read(&wrong).await, Err(DiskError::Size { .. })));
        let missing = DiskDescriptor {
            file_path: Bytes::from_static(b"/nonexistent/moongate/x"),
            object_size: 1,
        };
        assert!(matches!(read(&missing).await, Err(DiskError::Io { .. })));
    }
}
