//! The master's memory usage, read from its Prometheus page (`--metrics_port`): the
//! evictor's usage trigger. No master RPC exposes usage.

use std::time::Duration;

use thiserror::Error;

use crate::upstream::http::{HttpError, HttpUrl, http_get};

/// The master's memory usage, from its Prometheus endpoint.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Usage {
    pub allocated_bytes: u64,
    pub capacity_bytes: u64,
    /// Bytes the master counts on owners' SSDs (`master_allocated_file_size_bytes`,
    /// pool-wide: the master does not split it by owner); `None` on a page without it.
    pub ssd_bytes: Option<u64>,
}

#[derive(Debug, Error)]
pub enum UsageError {
    #[error("{0}")]
    Http(#[from] HttpError),
    #[error("answered HTTP {0}")]
    Status(u16),
    #[error("no {0} sample in the master's metrics")]
    Missing(&'static str),
}

/// Reads `master_allocated_bytes`, `master_total_capacity_bytes` and, where the master
/// has it, `master_allocated_file_size_bytes`.
pub async fn master_usage(url: &HttpUrl, timeout: Duration) -> Result<Usage, UsageError> {
    let (status, body) = http_get(&url.authority, &url.path, timeout).await?;
    if !(200..300).contains(&status) {
        return Err(UsageError::Status(status));
    }
    parse_usage(&String::from_utf8_lossy(&body))
}

/// Finds the samples in a Prometheus text page.
pub fn parse_usage(text: &str) -> Result<Usage, UsageError> {
    let sample = |name: &'static str| {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| {
                let (n, v) = l.split_once(' ')?;
                (n == name).then(|| v.trim().parse::<f64>().ok()).flatten()
            })
            .map(|v| v as u64)
    };
    let need = |name: &'static str| sample(name).ok_or(UsageError::Missing(name));
    Ok(Usage {
        allocated_bytes: need("master_allocated_bytes")?,
        capacity_bytes: need("master_total_capacity_bytes")?,
        ssd_bytes: sample("master_allocated_file_size_bytes"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_from_the_masters_page() {
        let page = "# HELP x\nmaster_allocated_bytes 1048576\nmaster_total_capacity_bytes 4.194304e+06\nmaster_key_count 3\n";
        assert_eq!(
            parse_usage(page).unwrap(),
            Usage {
                allocated_bytes: 1 << 20,
                capacity_bytes: 4 << 20,
                ssd_bytes: None,
            }
        );
        let with_ssd = format!("{page}master_allocated_file_size_bytes 186646528\n");
        assert_eq!(parse_usage(&with_ssd).unwrap().ssd_bytes, Some(186_646_528));
        assert!(matches!(
            parse_usage("master_allocated_bytes 1\n"),
            Err(UsageError::Missing("master_total_capacity_bytes"))
        ));
    }
}
