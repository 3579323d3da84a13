//! Interleaved latency of master-face calls through several targets (the master itself,
//! a bare relay, moongate, another moongate build), measured in one process: each round
//! sends the same call to every target in turn, one call outstanding at a time, rotating
//! the order, so the machine's drift (load, the host's scheduling, frequency) falls on
//! every target alike. The end-to-end bench (`benches/e2e_master_face.py`) runs Mooncake's
//! own client side after side, and on a shared 2-core VM its runs differ by tens of
//! microseconds; pairing the targets call by call is what shows a few.
//!
//! Calls (0.3.13 layout, encoded by moongate's codec): ExistKey of one key, BatchExistKey
//! of `--keys` keys, GetReplicaList of one key. The keys should exist (the bench driver
//! puts them with the real client first), so the master does its real work: a lookup and
//! a read lease.
//!
//! ```text
//! cargo run --release --example latency_ab -- [--calls N] [--prefix P] [--keys K]
//!     NAME=HOST:PORT ...
//! ```
//!
//! Prints per call and target the p50 and p99 and, against the first target, the
//! median of the per-round differences (each round's pair measured back to back).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use moongate::codec::frame::check_response;
use moongate::codec::message::{KeyArgs, KeysArgs};
use moongate::codec::method::Method;
use moongate::codec::pack::BodyStyle;
use moongate::codec::{Request, RequestHeader};

struct Target {
    name: String,
    conn: TcpStream,
    buf: BytesMut,
}

impl Target {
    /// One call: the request out, the whole answer in; microseconds.
    fn call(&mut self, frame: &[u8], seq: u32) -> std::io::Result<f64> {
        let t0 = Instant::now();
        self.conn.write_all(frame)?;
        self.buf.clear();
        let mut chunk = [0u8; 64 << 10];
        loop {
            // Some only once the whole answer is in.
            match check_response(&self.buf, 1 << 30) {
                Ok(Some(h)) if h.seq_num == seq => break,
                Ok(Some(h)) => {
                    return Err(std::io::Error::other(format!(
                        "{}: answer to seq {} for {seq}",
                        self.name, h.seq_num
                    )));
                }
                Ok(None) => {}
                Err(e) => {
                    return Err(std::io::Error::other(format!(
                        "{}: bad answer: {e}",
                        self.name
                    )));
                }
            }
            let n = self.conn.read(&mut chunk)?;
            if n == 0 {
                return Err(std::io::Error::other(format!("{}: closed", self.name)));
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
        Ok(t0.elapsed().as_nanos() as f64 / 1e3)
    }
}

fn frame(req: &Request, method: Method, seq: u32) -> Bytes {
    let mut body = BytesMut::new();
    req.encode_body(BodyStyle::MOONCAKE, &mut body);
    let mut out = BytesMut::new();
    RequestHeader::new(seq, method.function_id(), body.len() as u32).write(&mut out);
    out.extend_from_slice(&body);
    out.freeze()
}

fn pct(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut calls = 4000usize;
    let mut prefix = String::from("ab");
    let mut nkeys = 64usize;
    let mut targets = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--calls" => calls = args.next().ok_or("--calls N")?.parse()?,
            "--prefix" => prefix = args.next().ok_or("--prefix P")?,
            "--keys" => nkeys = args.next().ok_or("--keys K")?.parse()?,
            t => {
                let (name, addr) = t.split_once('=').ok_or("targets are NAME=HOST:PORT")?;
                let conn = TcpStream::connect(addr)?;
                conn.set_nodelay(true)?;
                targets.push(Target {
                    name: name.to_string(),
                    conn,
                    buf: BytesMut::with_capacity(64 << 10),
                });
            }
        }
    }
    if targets.len() < 2 || nkeys == 0 {
        return Err(
            "usage: latency_ab [--calls N] [--prefix P] [--keys K] NAME=ADDR NAME=ADDR...".into(),
        );
    }
    let tenant = Bytes::from_static(b"default");
    let keys: Vec<Bytes> = (0..nkeys)
        .map(|i| Bytes::from(format!("{prefix}/{i}")))
        .collect();
    let ops: [(&str, Method, Request); 3] = [
        (
            "is_exist",
            Method::ExistKey,
            Request::ExistKey(KeyArgs {
                key: keys[0].clone(),
                tenant_id: tenant.clone(),
            }),
        ),
        (
            "batch_is_exist",
            Method::BatchExistKey,
            Request::BatchExistKey(KeysArgs {
                keys: keys.clone().into(),
                tenant_id: tenant.clone(),
            }),
        ),
        (
            "get_replica_desc",
            Method::GetReplicaList,
            Request::GetReplicaList(KeyArgs {
                key: keys[nkeys.min(2) - 1].clone(),
                tenant_id: tenant.clone(),
            }),
        ),
    ];
    println!(
        "{} rounds per call, targets in rotating order; diff = median over rounds of \
         (target - {}) measured back to back",
        calls, targets[0].name
    );
    println!(
        "{:<17} {:<10} {:>9} {:>9} {:>10}",
        "call", "target", "p50 us", "p99 us", "diff us"
    );
    let n = targets.len();
    let mut seq = 1u32;
    for (name, method, req) in &ops {
        let mut lat: Vec<Vec<f64>> = vec![Vec::with_capacity(calls); n];
        let warm = calls / 10 + 50;
        for round in 0..warm + calls {
            seq = seq.wrapping_add(1);
            let f = frame(req, *method, seq);
            for k in 0..n {
                let i = (round + k) % n;
                let us = targets[i].call(&f, seq)?;
                if round >= warm {
                    lat[i].push(us);
                }
            }
        }
        for i in 0..n {
            let mut diffs: Vec<f64> = lat[i].iter().zip(&lat[0]).map(|(a, b)| a - b).collect();
            let d = pct(&mut diffs, 0.5);
            let mut v = lat[i].clone();
            println!(
                "{:<17} {:<10} {:>9.1} {:>9.1} {:>+10.1}",
                name,
                targets[i].name,
                pct(&mut v, 0.5),
                pct(&mut v, 0.99),
                d
            );
        }
    }
    Ok(())
}
