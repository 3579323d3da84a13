//! A keep-alive HTTP/1.1 client for the kv face benchmark (`benches/kv_face.py`):
//! `kv_bench ADDR KEY COUNT` GETs KEY COUNT times on one connection and prints one JSON
//! line: p50/p99 latency in microseconds, bytes per GET, GB/s over the whole loop.
//! `kv_bench ADDR batch:PREFIX:N COUNT` instead asks `POST /v1/kv/batch/get` for the N
//! keys PREFIX0..PREFIX{N-1} per call (bytes = all N values).
//! `kv_bench ADDR each:PREFIX:N COUNT` GETs PREFIX0, PREFIX1, .. PREFIX{N-1}, then again
//! from PREFIX0, COUNT GETs in all: with N >= COUNT each key is read once (a first read,
//! not a replica-cache hit; every value must have the first one's size).
//! `kv_bench ADDR put:PREFIX:SIZE COUNT` PUTs COUNT values of SIZE bytes (PREFIX0..,
//! one 201 each) and DELETEs each after its PUT; only the PUTs are timed.
//! The last body is checked against the first one; the loop reads into one reused
//! buffer, as Mooncake's `get_into` does into its registered buffer (a fresh zeroed
//! allocation and a full compare per GET would bill the caller's own work to moongate).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

/// Sends one request and reads the answer's body (Content-Length or chunked) into
/// `body`.
fn call(
    r: &mut BufReader<TcpStream>,
    w: &mut TcpStream,
    head: &str,
    req_body: &[u8],
    body: &mut Vec<u8>,
) {
    w.write_all(head.as_bytes()).expect("send");
    w.write_all(req_body).expect("send body");
    let mut line = String::new();
    r.read_line(&mut line).expect("status line");
    assert!(
        ["HTTP/1.1 200", "HTTP/1.1 201", "HTTP/1.1 204"]
            .iter()
            .any(|ok| line.starts_with(ok)),
        "unexpected answer: {line}"
    );
    let mut len = None;
    let mut chunked = false;
    loop {
        line.clear();
        r.read_line(&mut line).expect("header");
        let l = line.trim_end().to_ascii_lowercase();
        if l.is_empty() {
            break;
        }
        if let Some(v) = l.strip_prefix("content-length:") {
            len = Some(v.trim().parse::<usize>().expect("content-length"));
        }
        if l == "transfer-encoding: chunked" {
            chunked = true;
        }
    }
    if !chunked {
        body.resize(len.unwrap_or(0), 0);
        r.read_exact(body).expect("body");
        return;
    }
    body.clear();
    loop {
        line.clear();
        r.read_line(&mut line).expect("chunk size");
        let n = usize::from_str_radix(line.trim_end(), 16).expect("chunk size");
        if n == 0 {
            line.clear();
            r.read_line(&mut line).expect("last line");
            return;
        }
        let at = body.len();
        body.resize(at + n, 0);
        r.read_exact(&mut body[at..]).expect("chunk");
        let mut crlf = [0u8; 2];
        r.read_exact(&mut crlf).expect("chunk end");
    }
}

/// Checks a batch answer: `n` records, all status 200; returns the value bytes.
fn batch_bytes(b: &[u8], n: usize) -> usize {
    let (mut at, mut total) = (0, 0);
    for _ in 0..n {
        let status = u16::from_le_bytes([b[at], b[at + 1]]);
        let len = u64::from_le_bytes(b[at + 2..at + 10].try_into().expect("len")) as usize;
        assert_eq!(status, 200, "a key of the batch was not read");
        total += len;
        at += 10 + len;
    }
    assert_eq!(at, b.len(), "trailing bytes after the records");
    total
}

/// PUTs `count` values of `size` bytes, each DELETEd after its (timed) PUT.
fn puts(
    r: &mut BufReader<TcpStream>,
    w: &mut TcpStream,
    addr: &str,
    prefix: &str,
    size: usize,
    count: usize,
) {
    let value: Vec<u8> = (0..size).map(|i| (i * 31 + 7) as u8).collect();
    let mut answer = Vec::new();
    let mut lat = Vec::with_capacity(count);
    let mut busy = 0.0;
    for i in 0..count + 2 {
        let path = format!("/v1/kv/{prefix}{i}");
        let head = format!("PUT {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {size}\r\n\r\n");
        let t = Instant::now();
        call(r, w, &head, &value, &mut answer);
        let took = t.elapsed().as_secs_f64();
        if i >= 2 {
            // the first two warm connections and caches up
            lat.push(took * 1e6);
            busy += took;
        }
        let del = format!("DELETE {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n");
        call(r, w, &del, &[], &mut answer);
    }
    report(size, lat, (size * count) as f64 / busy / 1e9);
}

/// Prints the JSON line: bytes a call, calls timed, p50 and p99 of `lat` (us), GB/s.
fn report(bytes: usize, mut lat: Vec<f64>, gbps: f64) {
    lat.sort_by(f64::total_cmp);
    let p = |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)];
    println!(
        "{{\"bytes\": {bytes}, \"calls\": {}, \"p50_us\": {:.1}, \"p99_us\": {:.1}, \"GBps\": {gbps:.3}}}",
        lat.len(),
        p(0.5),
        p(0.99),
    );
}

/// GETs `count` keys in turn from PREFIX0..PREFIX{n-1} (each once when `n >= count`).
fn each(
    r: &mut BufReader<TcpStream>,
    w: &mut TcpStream,
    addr: &str,
    prefix: &str,
    n: usize,
    count: usize,
) {
    let heads: Vec<String> = (0..n.max(1))
        .map(|i| format!("GET /v1/kv/{prefix}{i} HTTP/1.1\r\nHost: {addr}\r\n\r\n"))
        .collect();
    let mut body = Vec::new();
    let mut lat = Vec::with_capacity(count);
    let mut bytes = None;
    let start = Instant::now();
    for i in 0..count {
        let t = Instant::now();
        call(r, w, &heads[i % heads.len()], &[], &mut body);
        lat.push(t.elapsed().as_secs_f64() * 1e6);
        assert_eq!(*bytes.get_or_insert(body.len()), body.len(), "sizes differ");
    }
    let total = start.elapsed().as_secs_f64();
    let bytes = bytes.unwrap_or(0);
    report(bytes, lat, (bytes * count) as f64 / total / 1e9);
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, addr, key, count] = &args[..] else {
        eprintln!("usage: kv_bench ADDR (KEY | batch:PREFIX:N) COUNT");
        std::process::exit(2);
    };
    let count: usize = count.parse().expect("COUNT");
    let s = TcpStream::connect(addr).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let mut w = s.try_clone().expect("clone");
    let mut r = BufReader::with_capacity(1 << 20, s);
    if let Some(spec) = key.strip_prefix("put:") {
        let (prefix, size) = spec.rsplit_once(':').expect("put:PREFIX:SIZE");
        let size: usize = size.parse().expect("SIZE");
        return puts(&mut r, &mut w, addr, prefix, size, count);
    }
    if let Some(spec) = key.strip_prefix("each:") {
        let (prefix, n) = spec.rsplit_once(':').expect("each:PREFIX:N");
        let n: usize = n.parse().expect("N");
        return each(&mut r, &mut w, addr, prefix, n, count);
    }
    let (head, req_body, batch) = match key.strip_prefix("batch:") {
        Some(spec) => {
            let (prefix, n) = spec.rsplit_once(':').expect("batch:PREFIX:N");
            let n: usize = n.parse().expect("N");
            let keys: Vec<String> = (0..n).map(|i| format!("\"{prefix}{i}\"")).collect();
            let json = format!("[{}]", keys.join(","));
            let head = format!(
                "POST /v1/kv/batch/get HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\n\r\n",
                json.len()
            );
            (head, json.into_bytes(), Some(n))
        }
        None => (
            format!("GET /v1/kv/{key} HTTP/1.1\r\nHost: {addr}\r\n\r\n"),
            Vec::new(),
            None,
        ),
    };
    let mut first = Vec::new();
    call(&mut r, &mut w, &head, &req_body, &mut first);
    let bytes = batch.map_or(first.len(), |n| batch_bytes(&first, n));
    let mut body = Vec::with_capacity(first.len());
    let mut lat = Vec::with_capacity(count);
    let start = Instant::now();
    for _ in 0..count {
        let t = Instant::now();
        call(&mut r, &mut w, &head, &req_body, &mut body);
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let total = start.elapsed().as_secs_f64();
    assert!(body == first, "body changed between reads");
    report(bytes, lat, (bytes * count) as f64 / total / 1e9);
}
