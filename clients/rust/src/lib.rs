//! A small blocking client for moongate's kv face (`docs/kv-api.md`), standard library
//! only: one keep-alive HTTP/1.1 connection over TCP or a Unix socket.
//!
//! ```no_run
//! let mut kv = moongate_kv::Client::connect_tcp("127.0.0.1:50060")?;
//! kv.put("model/0/blk42", b"...")?;
//! assert_eq!(kv.get("model/0/blk42")?.as_deref(), Some(&b"..."[..]));
//! assert_eq!(kv.exists(&["model/0/blk42", "other"])?, [true, false]);
//! # Ok::<(), moongate_kv::Error>(())
//! ```
//!
//! Not thread-safe by design: make one client per thread (connections are cheap on
//! loopback). A 503 ([`Error::Status`] with status 503) means the node's byte budget is
//! full: retry later. A 409 on delete means a reader holds a lease on the key.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::Path;

/// What a call can fail with.
#[derive(Debug)]
pub enum Error {
    Io(io::Error),
    /// moongate answered with an error status and this reason.
    Status {
        status: u16,
        reason: String,
    },
    /// The answer was not the HTTP moongate speaks.
    Protocol(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Io(e) => write!(f, "kv face: {e}"),
            Error::Status { status, reason } => write!(f, "kv face answered {status}: {reason}"),
            Error::Protocol(m) => write!(f, "kv face: unexpected answer: {m}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Self {
        Error::Io(e)
    }
}

trait Stream: Read + Write {}
impl<T: Read + Write> Stream for T {}

/// A connection to one moongate kv face.
pub struct Client {
    reader: BufReader<Box<dyn Stream>>,
    host: String,
}

/// Percent-encodes a key as one path segment (everything but `A-Za-z0-9-._~`).
pub fn encode_key(key: &str) -> String {
    let mut out = String::with_capacity(key.len() * 3);
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn json_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

fn parse_bools(body: &[u8]) -> Result<Vec<bool>, Error> {
    let text = std::str::from_utf8(body).map_err(|e| Error::Protocol(e.to_string()))?;
    let inner = text
        .trim()
        .strip_prefix('[')
        .and_then(|t| t.strip_suffix(']'))
        .ok_or_else(|| Error::Protocol(format!("not a JSON array: {text}")))?;
    if inner.trim().is_empty() {
        return Ok(Vec::new());
    }
    inner
        .split(',')
        .map(|v| match v.trim() {
            "true" => Ok(true),
            "false" => Ok(false),
            other => Err(Error::Protocol(format!("not a boolean: {other}"))),
        })
        .collect()
}

impl Client {
    pub fn connect_tcp(addr: &str) -> Result<Client, Error> {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        Ok(Client {
            reader: BufReader::with_capacity(1 << 20, Box::new(s)),
            host: addr.to_string(),
        })
    }

    pub fn connect_unix(path: impl AsRef<Path>) -> Result<Client, Error> {
        let s = UnixStream::connect(path)?;
        Ok(Client {
            reader: BufReader::with_capacity(1 << 20, Box::new(s)),
            host: "localhost".into(),
        })
    }

    fn call(&mut self, method: &str, path: &str, body: &[u8]) -> Result<(u16, Vec<u8>), Error> {
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\n\r\n",
            self.host,
            body.len()
        );
        let w = self.reader.get_mut();
        w.write_all(head.as_bytes())?;
        w.write_all(body)?;
        w.flush()?;
        let mut line = String::new();
        self.reader.read_line(&mut line)?;
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| Error::Protocol(format!("status line {line:?}")))?;
        let mut len = None;
        loop {
            line.clear();
            if self.reader.read_line(&mut line)? == 0 {
                return Err(Error::Protocol("connection closed in the headers".into()));
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((name, value)) = l.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                len = value.trim().parse::<usize>().ok();
            }
        }
        let len = len.ok_or_else(|| Error::Protocol("no Content-Length".into()))?;
        let mut data = vec![0u8; len];
        self.reader.read_exact(&mut data)?;
        Ok((status, data))
    }

    fn fail(status: u16, body: &[u8]) -> Error {
        let text = String::from_utf8_lossy(body);
        // {"error": "..."}: keep the reason, not the JSON around it
        let reason = text
            .split_once("\"error\":")
            .map(|(_, r)| {
                r.trim()
                    .trim_start_matches('"')
                    .trim_end_matches(['}', '"'])
                    .to_string()
            })
            .unwrap_or_else(|| text.into_owned());
        Error::Status { status, reason }
    }

    /// Stores `value` under `key`.
    pub fn put(&mut self, key: &str, value: &[u8]) -> Result<(), Error> {
        match self.call("PUT", &format!("/v1/kv/{}", encode_key(key)), value)? {
            (201, _) => Ok(()),
            (s, b) => Err(Self::fail(s, &b)),
        }
    }

    /// The value of `key`, or `None` when the store does not have it.
    pub fn get(&mut self, key: &str) -> Result<Option<Vec<u8>>, Error> {
        match self.call("GET", &format!("/v1/kv/{}", encode_key(key)), &[])? {
            (200, b) => Ok(Some(b)),
            (404, _) => Ok(None),
            (s, b) => Err(Self::fail(s, &b)),
        }
    }

    /// Removes `key`; `false` when it was not there.
    pub fn delete(&mut self, key: &str) -> Result<bool, Error> {
        match self.call("DELETE", &format!("/v1/kv/{}", encode_key(key)), &[])? {
            (204, _) => Ok(true),
            (404, _) => Ok(false),
            (s, b) => Err(Self::fail(s, &b)),
        }
    }

    /// Whether each of `keys` is stored, in order.
    pub fn exists(&mut self, keys: &[&str]) -> Result<Vec<bool>, Error> {
        let mut body = String::from("[");
        for (i, k) in keys.iter().enumerate() {
            if i > 0 {
                body.push(',');
            }
            json_string(k, &mut body);
        }
        body.push(']');
        match self.call("POST", "/v1/kv/exists", body.as_bytes())? {
            (200, b) => parse_bools(&b),
            (s, b) => Err(Self::fail(s, &b)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_json() {
        assert_eq!(encode_key("a/b c"), "a%2Fb%20c");
        let mut s = String::new();
        json_string("q\"\\\n", &mut s);
        assert_eq!(s, r#""q\"\\\u000a""#);
        assert_eq!(parse_bools(b"[true,false]").unwrap(), [true, false]);
        assert_eq!(parse_bools(b"[]").unwrap(), Vec::<bool>::new());
        assert!(parse_bools(b"{}").is_err());
    }
}
