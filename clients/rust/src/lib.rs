//! A small blocking client for moongate's kv face (`docs/kv-api.md`): one keep-alive
//! HTTP/1.1 connection over TCP or a Unix socket (standard library only; the C ABI in
//! [`capi`] adds libc), or over a stream of a QUIC connection ([`quic`]) for callers on
//! other hosts.
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

pub mod capi;
pub mod quic;
pub mod records;
pub mod shm;

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
    /// The caller's buffer is smaller than the value (`needed` bytes).
    TooSmall {
        needed: usize,
    },
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Io(e) => write!(f, "kv face: {e}"),
            Error::Status { status, reason } => write!(f, "kv face answered {status}: {reason}"),
            Error::Protocol(m) => write!(f, "kv face: unexpected answer: {m}"),
            Error::TooSmall { needed } => {
                write!(
                    f,
                    "the value has {needed} bytes, more than the buffer holds"
                )
            }
        }
    }
}

impl std::error::Error for Error {}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Self {
        Error::Io(e)
    }
}

/// How an answer's body arrives.
enum Body {
    Length(usize),
    Chunked,
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

/// The key a path segment names: [`encode_key`]'s inverse, the one definition both the
/// client and the kv face use. `None` for a bad escape (a `%` not followed by two hex
/// digits). No `+` rule: that is for query strings.
pub fn decode_key(segment: &str) -> Option<Vec<u8>> {
    let b = segment.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b.get(i + 1..i + 3)?;
            let v = u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?;
            out.push(v);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Some(out)
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

/// `keys` as a JSON array of strings.
fn json_array(keys: &[&str]) -> String {
    let mut body = String::from("[");
    for (i, k) in keys.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        json_string(k, &mut body);
    }
    body.push(']');
    body
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

    /// A connection on a new stream of `link`'s QUIC connection (see [`quic::Link`]).
    pub fn connect_quic(link: &std::sync::Arc<quic::Link>) -> Result<Client, Error> {
        let s = link.open()?;
        Ok(Client {
            reader: BufReader::with_capacity(1 << 20, Box::new(s)),
            host: "moongate".into(),
        })
    }

    fn call(&mut self, method: &str, path: &str, body: &[u8]) -> Result<(u16, Vec<u8>), Error> {
        let (status, body) = self.request(method, path, body)?;
        Ok((status, self.read_body(body)?))
    }

    /// Sends a request and reads the answer's head; the body is the caller's to read.
    fn request(&mut self, method: &str, path: &str, body: &[u8]) -> Result<(u16, Body), Error> {
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
        let mut chunked = false;
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
            if let Some((name, value)) = l.split_once(':')
                && name.eq_ignore_ascii_case("transfer-encoding")
            {
                chunked = value.trim().eq_ignore_ascii_case("chunked");
            }
        }
        // 204 and 304 answers have no body, whatever their headers say (RFC 9112 6.3);
        // moongate answers a DELETE with 204 and no Content-Length.
        if matches!(status, 204 | 304) {
            return Ok((status, Body::Length(0)));
        }
        if chunked {
            return Ok((status, Body::Chunked));
        }
        let len = len.ok_or_else(|| Error::Protocol("no Content-Length".into()))?;
        Ok((status, Body::Length(len)))
    }

    fn read_body(&mut self, body: Body) -> Result<Vec<u8>, Error> {
        match body {
            Body::Chunked => self.read_chunked(),
            Body::Length(len) => {
                // Grown as bytes arrive: a wrong length costs an error, not its size.
                let mut data = Vec::new();
                let got = (&mut self.reader).take(len as u64).read_to_end(&mut data)?;
                if got < len {
                    return Err(Error::Protocol(format!(
                        "body ended after {got} of {len} bytes"
                    )));
                }
                Ok(data)
            }
        }
    }

    /// A streamed (chunked) body: batch get answers are sent as they are read.
    fn read_chunked(&mut self) -> Result<Vec<u8>, Error> {
        let mut data = Vec::new();
        let mut line = String::new();
        loop {
            line.clear();
            self.reader.read_line(&mut line)?;
            let size = line.trim_end().split(';').next().unwrap_or("");
            let size = usize::from_str_radix(size.trim(), 16)
                .map_err(|_| Error::Protocol(format!("chunk size {line:?}")))?;
            if size == 0 {
                // No trailers are sent; the empty line ends the body.
                line.clear();
                self.reader.read_line(&mut line)?;
                return Ok(data);
            }
            // Grown as bytes arrive: a wrong chunk size costs an error, not its size.
            let got = (&mut self.reader)
                .take(size as u64)
                .read_to_end(&mut data)?;
            if got < size {
                return Err(Error::Protocol("connection closed in a chunk".into()));
            }
            let mut crlf = [0u8; 2];
            self.reader.read_exact(&mut crlf)?;
        }
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

    /// Reads the value of `key` into `dst` without another copy: `Ok(Some(n))` when its
    /// `n` bytes are in `dst[..n]`, `Ok(None)` when the store does not have it, and
    /// [`Error::TooSmall`] (with the value's length) when `dst` cannot hold it; the
    /// connection stays usable after each.
    pub fn get_into(&mut self, key: &str, dst: &mut [u8]) -> Result<Option<usize>, Error> {
        let (status, body) = self.request("GET", &format!("/v1/kv/{}", encode_key(key)), &[])?;
        match (status, body) {
            (200, Body::Length(n)) if n <= dst.len() => {
                self.reader.read_exact(&mut dst[..n])?;
                Ok(Some(n))
            }
            (200, Body::Length(n)) => {
                let skipped = io::copy(&mut (&mut self.reader).take(n as u64), &mut io::sink())?;
                if skipped < n as u64 {
                    return Err(Error::Protocol("connection closed in a body".into()));
                }
                Err(Error::TooSmall { needed: n })
            }
            (200, body) => {
                let v = self.read_body(body)?;
                let to = dst
                    .get_mut(..v.len())
                    .ok_or(Error::TooSmall { needed: v.len() })?;
                to.copy_from_slice(&v);
                Ok(Some(v.len()))
            }
            (404, body) => {
                self.read_body(body)?;
                Ok(None)
            }
            (s, body) => {
                let b = self.read_body(body)?;
                Err(Self::fail(s, &b))
            }
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
        let body = json_array(keys);
        match self.call("POST", "/v1/kv/exists", body.as_bytes())? {
            (200, b) => parse_bools(&b),
            (s, b) => Err(Self::fail(s, &b)),
        }
    }

    /// The values of `keys` in one call, in order: `Ok(None)` for an absent key, `Err`
    /// for a key that could not be read (503: the node was busy; retry it later).
    pub fn batch_get(&mut self, keys: &[&str]) -> Result<Vec<KeyResult>, Error> {
        let body = json_array(keys);
        let (status, b) = self.call("POST", "/v1/kv/batch/get", body.as_bytes())?;
        if status != 200 {
            return Err(Self::fail(status, &b));
        }
        let recs = get_records(&b)?;
        if recs.len() != keys.len() {
            return Err(Error::Protocol(format!(
                "{} answers for {} keys",
                recs.len(),
                keys.len()
            )));
        }
        Ok(recs
            .into_iter()
            .map(|(s, v)| match s {
                200 => Ok(Some(v.to_vec())),
                404 => Ok(None),
                s => Err(Self::fail(s, v)),
            })
            .collect())
    }

    /// Stores `items` in one call; one result per item, in order (a 503 item was not
    /// stored because the node was busy: retry it later).
    pub fn batch_put(&mut self, items: &[(&str, &[u8])]) -> Result<Vec<Result<(), Error>>, Error> {
        let (status, b) = self.call("POST", "/v1/kv/batch/put", &put_records(items)?)?;
        if status != 200 {
            return Err(Self::fail(status, &b));
        }
        let text = String::from_utf8_lossy(&b);
        let outcomes = parse_outcomes(&text)?;
        if outcomes.len() != items.len() {
            return Err(Error::Protocol(format!(
                "{} outcomes for {} items",
                outcomes.len(),
                items.len()
            )));
        }
        Ok(outcomes
            .into_iter()
            .map(|(s, reason)| match s {
                201 => Ok(()),
                status => Err(Error::Status { status, reason }),
            })
            .collect())
    }
}

/// One key of a batch get: the value, `None` when absent, or why it was not read.
pub type KeyResult = Result<Option<Vec<u8>>, Error>;

/// A batch put body ([`records`]).
fn put_records(items: &[(&str, &[u8])]) -> Result<Vec<u8>, Error> {
    let mut b = Vec::new();
    for (k, v) in items {
        records::put_record(&mut b, k.as_bytes(), v)
            .ok_or_else(|| Error::Protocol(format!("key of {} bytes", k.len())))?;
    }
    Ok(b)
}

/// A batch get answer ([`records`]): `(status, payload)` per key.
fn get_records(b: &[u8]) -> Result<Vec<(u16, &[u8])>, Error> {
    records::parse_get_answer(b)
        .ok_or_else(|| Error::Protocol("a batch answer ends inside a record".into()))
}

/// The `(status, error)` of each entry of a batch put answer
/// (`[{"status":201},{"error":"...","status":409}]`: flat objects, keys in any order).
fn parse_outcomes(text: &str) -> Result<Vec<(u16, String)>, Error> {
    let bad = || Error::Protocol(format!("batch put answer {text:?}"));
    let mut out = Vec::new();
    let (mut status, mut error) = (None, String::new());
    let mut key: Option<String> = None;
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        rest = &rest[c.len_utf8()..];
        match c {
            '"' => {
                let s = json_unescape(rest).ok_or_else(bad)?;
                // Skip the string itself: up to its closing, unescaped quote.
                let mut esc = false;
                let end = rest
                    .char_indices()
                    .find(|&(_, ch)| {
                        let closes = ch == '"' && !esc;
                        esc = ch == '\\' && !esc;
                        closes
                    })
                    .ok_or_else(bad)?
                    .0;
                rest = &rest[end + 1..];
                match key.take() {
                    Some(k) if k == "error" => error = s,
                    Some(_) => {}
                    None => key = Some(s),
                }
            }
            '0'..='9' => {
                let digits: String = std::iter::once(c)
                    .chain(rest.chars().take_while(char::is_ascii_digit))
                    .collect();
                rest = &rest[digits.len() - 1..];
                if key.take().as_deref() == Some("status") {
                    status = Some(digits.parse().map_err(|_| bad())?);
                }
            }
            '}' => {
                out.push((status.take().ok_or_else(bad)?, std::mem::take(&mut error)));
                key = None;
            }
            _ => {}
        }
    }
    Ok(out)
}

/// The JSON string starting at `s` (after its opening quote), unescaped.
fn json_unescape(s: &str) -> Option<String> {
    let mut out = String::new();
    let mut it = s.chars();
    loop {
        match it.next()? {
            '"' => return Some(out),
            '\\' => match it.next()? {
                'n' => out.push('\n'),
                't' => out.push('\t'),
                'r' => out.push('\r'),
                'u' => {
                    let hex: String = it.by_ref().take(4).collect();
                    out.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?).unwrap_or('?'));
                }
                c => out.push(c),
            },
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_json() {
        assert_eq!(encode_key("a/b c"), "a%2Fb%20c");
        for k in ["a/b c", "plain", "100%+é", ""] {
            assert_eq!(decode_key(&encode_key(k)).as_deref(), Some(k.as_bytes()));
        }
        assert_eq!(
            decode_key("a+b").as_deref(),
            Some(&b"a+b"[..]),
            "no + rule in paths"
        );
        assert_eq!(decode_key("a%2"), None, "a cut escape");
        assert_eq!(decode_key("a%zz"), None, "not hex");
        let mut s = String::new();
        json_string("q\"\\\n", &mut s);
        assert_eq!(s, r#""q\"\\\u000a""#);
        assert_eq!(parse_bools(b"[true,false]").unwrap(), [true, false]);
        assert_eq!(parse_bools(b"[]").unwrap(), Vec::<bool>::new());
        assert!(parse_bools(b"{}").is_err());
        assert_eq!(
            parse_outcomes(r#"[{"status":201},{"error":"key \"k\" {exists}","status":409}]"#)
                .unwrap(),
            [
                (201, String::new()),
                (409, "key \"k\" {exists}".to_string())
            ]
        );
        let mut b = vec![200, 0, 2, 0, 0, 0, 0, 0, 0, 0, b'h', b'i'];
        b.extend_from_slice(&[148, 1, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            get_records(&b).unwrap(),
            [(200, &b"hi"[..]), (404, &b""[..])]
        );
        assert!(get_records(&b[..11]).is_err());
        assert_eq!(
            put_records(&[("k", b"v")]).unwrap(),
            [1, 0, b'k', 1, 0, 0, 0, 0, 0, 0, 0, b'v']
        );
    }
}
