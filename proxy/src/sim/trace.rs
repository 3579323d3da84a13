//! A Mooncake request trace (the FAST'25 release's JSONL: one request a line with its
//! arrival `timestamp` in ms and the prefix block hashes `hash_ids`), held as dense
//! block numbers so the simulator indexes arrays instead of hashing.

use std::collections::HashMap;

use serde::Deserialize;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum TraceError {
    #[error("line {line}: {error}")]
    Line {
        line: usize,
        error: serde_json::Error,
    },
    #[error("the trace has no request with a block")]
    Empty,
}

#[derive(Deserialize)]
struct Line {
    #[serde(default)]
    timestamp: u64,
    hash_ids: Vec<u64>,
}

/// One request: when it arrived and its blocks, in prefix order.
#[derive(Debug, Clone, Copy)]
pub struct Request {
    pub ts_ms: u64,
    /// Its blocks: `Trace::blocks[start..end]`.
    pub start: u32,
    pub end: u32,
}

#[derive(Debug, Clone)]
pub struct Trace {
    pub requests: Vec<Request>,
    /// Every request's blocks, one after another, as dense numbers `0..distinct`.
    pub blocks: Vec<u32>,
    /// The trace's own hash of each dense number (what keys are named after).
    pub hashes: Vec<u64>,
}

impl Trace {
    /// Parses JSONL text; blank lines are skipped, requests without blocks kept (they
    /// look nothing up).
    pub fn parse(text: &str) -> Result<Trace, TraceError> {
        let mut dense: HashMap<u64, u32> = HashMap::new();
        let mut t = Trace {
            requests: Vec::new(),
            blocks: Vec::new(),
            hashes: Vec::new(),
        };
        for (i, raw) in text.lines().enumerate() {
            if raw.trim().is_empty() {
                continue;
            }
            let line: Line = serde_json::from_str(raw)
                .map_err(|error| TraceError::Line { line: i + 1, error })?;
            let start = t.blocks.len() as u32;
            for h in line.hash_ids {
                let next = t.hashes.len() as u32;
                let id = *dense.entry(h).or_insert(next);
                if id == next {
                    t.hashes.push(h);
                }
                t.blocks.push(id);
            }
            t.requests.push(Request {
                ts_ms: line.timestamp,
                start,
                end: t.blocks.len() as u32,
            });
        }
        if t.blocks.is_empty() {
            return Err(TraceError::Empty);
        }
        Ok(t)
    }

    /// Blocks that occur in the trace.
    pub fn distinct(&self) -> usize {
        self.hashes.len()
    }

    pub fn blocks_of(&self, r: &Request) -> &[u32] {
        &self.blocks[r.start as usize..r.end as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_numbers_follow_first_sight() {
        let t = Trace::parse(
            "{\"timestamp\": 5, \"hash_ids\": [70, 71]}\n\n{\"timestamp\": 9, \"hash_ids\": [70, 72]}\n",
        )
        .unwrap();
        assert_eq!(t.blocks, [0, 1, 0, 2]);
        assert_eq!(t.hashes, [70, 71, 72]);
        assert_eq!(t.distinct(), 3);
        assert_eq!(t.requests[1].ts_ms, 9);
        assert_eq!(t.blocks_of(&t.requests[1]), [0, 2]);
    }

    #[test]
    fn a_bad_line_is_named() {
        let e = Trace::parse("{\"hash_ids\": [1]}\n{\"hash_ids\": \"x\"}\n").unwrap_err();
        assert!(e.to_string().starts_with("line 2:"), "{e}");
        assert!(matches!(Trace::parse("\n"), Err(TraceError::Empty)));
    }
}
