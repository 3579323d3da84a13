//! A keep-alive HTTP/1.1 client for the kv face benchmark (`benches/kv_face.py`):
//! `kv_bench ADDR KEY COUNT` GETs KEY COUNT times on one connection and prints one JSON
//! line: p50/p99 latency in microseconds, bytes per GET, GB/s over the whole loop.
//! The last body is checked against the first one; the loop reads into one reused
//! buffer, as Mooncake's `get_into` does into its registered buffer (a fresh zeroed
//! allocation and a full compare per GET would bill the caller's own work to moongate).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

fn get(
    r: &mut BufReader<TcpStream>,
    w: &mut TcpStream,
    addr: &str,
    path: &str,
    body: &mut Vec<u8>,
) {
    write!(w, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").expect("send");
    let mut line = String::new();
    r.read_line(&mut line).expect("status line");
    assert!(
        line.starts_with("HTTP/1.1 200"),
        "unexpected answer: {line}"
    );
    let mut len = 0usize;
    loop {
        line.clear();
        r.read_line(&mut line).expect("header");
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some(v) = l
            .to_ascii_lowercase()
            .strip_prefix("content-length:")
            .map(|v| v.trim().to_string())
        {
            len = v.parse().expect("content-length");
        }
    }
    body.resize(len, 0);
    r.read_exact(body).expect("body");
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, addr, key, count] = &args[..] else {
        eprintln!("usage: kv_bench ADDR KEY COUNT");
        std::process::exit(2);
    };
    let count: usize = count.parse().expect("COUNT");
    let s = TcpStream::connect(addr).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let mut w = s.try_clone().expect("clone");
    let mut r = BufReader::with_capacity(1 << 20, s);
    let path = format!("/v1/kv/{key}");
    let mut first = Vec::new();
    get(&mut r, &mut w, addr, &path, &mut first);
    let mut body = Vec::with_capacity(first.len());
    let mut lat = Vec::with_capacity(count);
    let start = Instant::now();
    for _ in 0..count {
        let t = Instant::now();
        get(&mut r, &mut w, addr, &path, &mut body);
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let total = start.elapsed().as_secs_f64();
    assert!(body == first, "body changed between reads");
    lat.sort_by(f64::total_cmp);
    let p = |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)];
    println!(
        "{{\"bytes\": {}, \"p50_us\": {:.1}, \"p99_us\": {:.1}, \"GBps\": {:.3}}}",
        first.len(),
        p(0.5),
        p(0.99),
        (first.len() * count) as f64 / total / 1e9
    );
}
