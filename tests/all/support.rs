//! Test harness: real `mooncake_master`, real moongate binary, real Mooncake Python
//! client, all on free loopback ports.
//!
//! Every server is waited for with a real readiness probe (a `ServiceReady` answer, an
//! HTTP answer), its log is captured into a file that failure messages quote, and it is
//! stopped by PID (SIGTERM, then SIGKILL) when its handle drops.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The virtualenv Python with the pinned Mooncake wheel (`scripts/bootstrap.sh`).
pub fn python() -> PathBuf {
    let p = std::env::var_os("MOONGATE_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv/bin/python"));
    assert!(
        p.exists(),
        "{} not found: run scripts/bootstrap.sh (the test command does) to install the \
         pinned Mooncake wheel",
        p.display()
    );
    p
}

pub fn master_binary() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let out = Command::new(python())
            .args([
                "-c",
                "import os, mooncake; print(os.path.join(os.path.dirname(mooncake.__file__), 'mooncake_master'))",
            ])
            .output()
            .expect("run python");
        let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        assert!(p.exists(), "mooncake_master not at {}", p.display());
        p
    })
    .clone()
}

/// An older Mooncake release the tests also run against: its own virtualenv
/// (`.venv-<release>`, installed by scripts/bootstrap.sh), master binary and client.
#[derive(Clone, Debug)]
pub struct Release {
    pub python: PathBuf,
    /// Where the release's wheel finds the libraries it links that are not on the
    /// system: 0.3.12.post1's "non-cuda" wheel links libcudart.so.12; 0.3.14's CUDA 13
    /// wheel links libcudart.so.13 and the driver's libcuda.so.1, for which bootstrap
    /// builds a stand-in (scripts/cuda_driver_stand_in.sh).
    pub lib_path: Vec<PathBuf>,
}

impl Release {
    /// The release installed in `.venv-<name>` (`0.3.11.post1`, `0.3.12.post1`,
    /// `0.3.14`).
    pub fn older(name: &'static str) -> Release {
        let venv = repo_root().join(format!(".venv-{name}"));
        let python = venv.join("bin/python");
        assert!(
            python.exists(),
            "{} not found: run scripts/bootstrap.sh (the test command does)",
            python.display()
        );
        let site = venv.join("lib/python3.11/site-packages");
        let lib_path = [
            venv.join("cuda-stand-in"),
            site.join("nvidia/cuda_runtime/lib"),
            site.join("nvidia/cu13/lib"),
        ]
        .into_iter()
        .filter(|p| p.exists())
        .collect();
        Release { python, lib_path }
    }

    /// Sets what the release's processes need in their environment.
    pub fn apply(&self, cmd: &mut Command) {
        if !self.lib_path.is_empty() {
            let joined = std::env::join_paths(&self.lib_path).expect("library paths");
            cmd.env("LD_LIBRARY_PATH", joined);
        }
    }

    pub fn master(&self) -> PathBuf {
        let out = Command::new(&self.python)
            .args([
                "-c",
                "import os, mooncake; print(os.path.join(os.path.dirname(mooncake.__file__), 'mooncake_master'))",
            ])
            .output()
            .expect("run python");
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
    }
}

pub fn scenario() -> PathBuf {
    repo_root().join("tests/py/scenario.py")
}

/// A port that was free a moment ago (bind to 0, read it, release it).
/// A loopback port nothing listens on now, never the same one twice in this test
/// process: the kernel may hand a just-closed port out again, and two servers told the
/// same port (seen: a master whose RPC and metrics ports collided) fail to start.
/// What a Python role recorded under `name` (its results are `[name, value]` pairs).
pub fn result<'a>(r: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    r.as_array()
        .and_then(|ops| ops.iter().find(|o| o[0] == name))
        .map(|o| &o[1])
        .unwrap_or_else(|| panic!("the role recorded no {name:?}: {r}"))
}

pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("moongate-test-")
        .tempdir()
        .unwrap()
}

/// A child process stopped by PID on drop, with its output captured to `log`.
pub struct Proc {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    pub fn spawn(name: &str, mut cmd: Command, log: PathBuf) -> Proc {
        let f = std::fs::File::create(&log).unwrap();
        cmd.stdout(f.try_clone().unwrap()).stderr(f);
        cmd.env("MC_TCP_BIND_ADDRESS", "127.0.0.1");
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Proc {
            name: name.to_string(),
            child,
            log,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn log_text(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        // keep failure messages readable: the last 6 KB
        let cut = s.len().saturating_sub(6000);
        let cut = (cut..s.len()).find(|&i| s.is_char_boundary(i)).unwrap_or(0);
        format!(
            "--- {} log ({}) ---\n{}",
            self.name,
            self.log.display(),
            &s[cut..]
        )
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid has no memory effects.
        unsafe {
            libc::kill(self.pid(), sig);
        }
    }

    /// Waits for exit up to `limit`; `None` if still running.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + limit;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return Some(st);
            }
            if Instant::now() > end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn stop(&mut self) {
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        self.signal(libc::SIGTERM);
        if self.wait_exit(Duration::from_secs(5)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Polls `probe` until it succeeds or `limit` passes; the panic quotes the logs.
pub fn wait_for(what: &str, limit: Duration, procs: &[&Proc], probe: impl FnMut() -> bool) {
    if poll_until(limit, probe) {
        return;
    }
    let logs: Vec<String> = procs.iter().map(|p| p.log_text()).collect();
    panic!("{what} not ready after {limit:?}\n{}", logs.join("\n"));
}

/// Polls `probe` every 25 ms until it holds (true) or `limit` passes (false).
pub fn poll_until(limit: Duration, mut probe: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if probe() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    false
}

/// One `ServiceReady` round trip on a fresh connection: the master's own readiness.
pub fn service_ready(addr: &str) -> bool {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let mut req = Vec::new();
    req.extend_from_slice(&[21, 0, 0, 0]);
    req.extend_from_slice(&0u32.to_le_bytes());
    req.extend_from_slice(
        &moongate::codec::Method::ServiceReady
            .function_id()
            .to_le_bytes(),
    );
    req.extend_from_slice(&[0; 8]);
    if s.write_all(&req).is_err() {
        return false;
    }
    let mut h = [0u8; 16];
    s.read_exact(&mut h).is_ok() && h[2] == 0
}

/// Minimal HTTP/1.1 GET over loopback: (status, body).
pub fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    http(addr, "GET", path, &[])
}

/// Minimal HTTP/1.1 request over loopback: (status, body).
pub fn http(addr: &str, method: &str, path: &str, body: &[u8]) -> Option<(u16, String)> {
    http_bytes(addr, method, path, body).map(|(s, b)| (s, String::from_utf8_lossy(&b).into_owned()))
}

/// As [`http`], with the body as bytes (values are binary).
pub fn http_bytes(addr: &str, method: &str, path: &str, body: &[u8]) -> Option<(u16, Vec<u8>)> {
    http_with(addr, method, path, &[], body)
}

/// As [`http_bytes`], with extra request headers.
pub fn http_with(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Option<(u16, Vec<u8>)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(60))).ok()?;
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{extra}Content-Length: {}\r\n\r\n",
        body.len()
    )
    .ok()?;
    // The server may answer (e.g. 413) and close before the whole body is sent.
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let head_end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&raw[..head_end]).into_owned();
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let body = &raw[head_end + 4..];
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return Some((status, dechunk(body)?));
    }
    Some((status, body.to_vec()))
}

/// The payload of an HTTP/1.1 chunked body; `None` when it is not whole.
fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n")?;
        let size_hex = std::str::from_utf8(&b[..eol]).ok()?;
        let size = usize::from_str_radix(size_hex.split(';').next()?.trim(), 16).ok()?;
        b = &b[eol + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(b.get(..size)?);
        b = b.get(size + 2..)?;
    }
}

pub struct Master {
    pub proc: Proc,
    pub rpc: String,
    pub rpc_port: u16,
    pub http_port: u16,
    pub metadata: String,
    /// The master's Prometheus page (`--metrics_port`).
    pub metrics_url: String,
    /// Its work directory, removed when the handle drops.
    _dir: tempfile::TempDir,
}

#[derive(Default, Clone)]
pub struct MasterOpts {
    /// `--root_fs_dir`: the master adds disk replicas.
    pub root_fs_dir: Option<PathBuf>,
    /// Reuse these ports (a restart).
    pub ports: Option<(u16, u16)>,
    /// Run this older release's master instead of the pinned one.
    pub release: Option<Release>,
    /// More flags (`--enable_offload=true`, a lease, ...).
    pub extra: Vec<String>,
}

impl Master {
    pub fn start() -> Master {
        Master::start_with(MasterOpts::default())
    }

    pub fn start_with(opts: MasterOpts) -> Master {
        let dir = tempdir();
        let (rpc_port, http_port) = opts.ports.unwrap_or_else(|| (free_port(), free_port()));
        let metrics_port = free_port();
        let mut cmd = Command::new(
            opts.release
                .as_ref()
                .map_or_else(master_binary, Release::master),
        );
        cmd.args([
            format!("--rpc_port={rpc_port}"),
            "--rpc_address=127.0.0.1".into(),
            "--enable_http_metadata_server=true".into(),
            "--http_metadata_server_host=127.0.0.1".into(),
            format!("--http_metadata_server_port={http_port}"),
            format!("--metrics_port={metrics_port}"),
            "--enable_metric_reporting=false".into(),
        ]);
        match &opts.release {
            // 0.3.11 / 0.3.12 masters exit on a flag they do not know.
            Some(r) => r.apply(&mut cmd),
            None => {
                cmd.arg("--metrics_host=127.0.0.1");
            }
        }
        if let Some(root) = &opts.root_fs_dir {
            cmd.arg(format!("--root_fs_dir={}", root.display()));
        }
        cmd.args(&opts.extra);
        cmd.current_dir(dir.path());
        let proc = Proc::spawn("mooncake_master", cmd, dir.path().join("master.log"));
        let rpc = format!("127.0.0.1:{rpc_port}");
        let http = format!("127.0.0.1:{http_port}");
        wait_for("mooncake_master", Duration::from_secs(30), &[&proc], || {
            service_ready(&rpc) && http_get(&http, "/metadata?key=probe").is_some()
        });
        Master {
            proc,
            rpc,
            rpc_port,
            http_port,
            metadata: format!("http://127.0.0.1:{http_port}/metadata"),
            metrics_url: format!("http://127.0.0.1:{metrics_port}/metrics"),
            _dir: dir,
        }
    }
}

impl Master {
    /// The master's own Prometheus page (its request counters per method).
    pub fn metrics(&self) -> String {
        let rest = self.metrics_url.trim_start_matches("http://");
        let (addr, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        match http_get(addr, path) {
            Some((200, b)) => b,
            other => panic!("master GET {path}: {other:?}\n{}", self.proc.log_text()),
        }
    }
}

pub struct Moongate {
    pub proc: Proc,
    pub listen: String,
    pub admin: String,
    /// Its config and log directory, removed when the handle drops.
    _dir: tempfile::TempDir,
}

impl Moongate {
    pub fn start(upstream: &str) -> Moongate {
        Moongate::start_with(upstream, "")
    }

    /// Starts moongate with `extra` TOML appended under `[master_face]` and waits for
    /// `/live`. (Readiness depends on the master, which some tests keep down.)
    pub fn start_with(upstream: &str, extra_master_face: &str) -> Moongate {
        Moongate::start_config(&format!(
            "[master_face]\nupstream = \"{upstream}\"\n{extra_master_face}\n"
        ))
    }

    /// How long a moongate may take to answer `/live` (and `/ready`) after its start.
    const MOONGATE_START: Duration = Duration::from_secs(90);

    /// Starts moongate with `config` (without listen addresses, which are chosen here).
    pub fn start_config(config: &str) -> Moongate {
        let dir = tempdir();
        let listen = format!("127.0.0.1:{}", free_port());
        let admin = format!("127.0.0.1:{}", free_port());
        let cfg = dir.path().join("moongate.toml");
        std::fs::write(&cfg, config).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_moongate"));
        cmd.arg("run")
            .arg("--config")
            .arg(&cfg)
            .args(["--listen", &listen, "--admin", &admin])
            .env("RUST_LOG", "moongate=debug");
        let proc = Proc::spawn("moongate", cmd, dir.path().join("moongate.log"));
        // A bound, not a speed check: a debug build compiles each configured plugin
        // in ~3 s on a quiet 2-core machine, and beside busy processes and other tests
        // a two-plugin start went past 20 s (CI, 2026-12-02: four tests at once).
        wait_for("moongate /live", Self::MOONGATE_START, &[&proc], || {
            http_get(&admin, "/live").is_some_and(|(s, _)| s == 200)
        });
        Moongate {
            proc,
            listen,
            admin,
            _dir: dir,
        }
    }

    pub fn wait_ready(&self, master: &Master) {
        wait_for(
            "moongate /ready",
            Self::MOONGATE_START,
            &[&self.proc, &master.proc],
            || http_get(&self.admin, "/ready").is_some_and(|(s, _)| s == 200),
        );
    }

    /// The metrics page; fails the test when it cannot be fetched (an empty page would
    /// make every assertion about a zero pass).
    pub fn metrics(&self) -> String {
        match http_get(&self.admin, "/metrics") {
            Some((200, b)) => b,
            other => panic!("GET /metrics failed: {other:?}\n{}", self.proc.log_text()),
        }
    }

    /// Value of one sample line (`name{labels}`); fails the test when it is absent.
    pub fn metric(&self, sample: &str) -> f64 {
        metric_value(&self.metrics(), sample)
    }
}

/// Value of one sample line (`name{labels}`) of a metrics page, if present.
pub fn sample_of(text: &str, sample: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(sample)?.strip_prefix(' ')?.parse().ok())
}

/// Value of one sample line (`name{labels}`) of a metrics page; fails the test when it
/// is absent, so a renamed metric or label cannot pass an assertion about zero.
pub fn metric_value(text: &str, sample: &str) -> f64 {
    sample_of(text, sample).unwrap_or_else(|| {
        let name = sample.split('{').next().unwrap_or(sample);
        let near: Vec<&str> = text.lines().filter(|l| l.starts_with(name)).collect();
        panic!("no sample {sample} on the metrics page; samples of {name}: {near:#?}")
    })
}

/// A built plugin component (`target/plugins/NAME.wasm`).
pub use moongate::policy::registry::built_plugin as plugin_path;

/// Runs one scenario role to completion; returns its result JSON.
pub fn run_role(
    role: &str,
    master: &str,
    metadata: &str,
    extra: &[&str],
    logs: &[&Proc],
) -> serde_json::Value {
    run_role_on(None, role, master, metadata, extra, logs)
}

/// [`run_role`] with the client of an older `release`.
pub fn run_role_on(
    release: Option<&Release>,
    role: &str,
    master: &str,
    metadata: &str,
    extra: &[&str],
    logs: &[&Proc],
) -> serde_json::Value {
    let dir = tempdir();
    let out = dir.path().join("out.json");
    let mut cmd = Command::new(release.map_or_else(python, |r| r.python.clone()));
    if let Some(r) = release {
        r.apply(&mut cmd);
    }
    cmd.arg(scenario())
        .args(["--role", role, "--master", master, "--metadata", metadata])
        .arg("--out")
        .arg(&out)
        .args(extra);
    let mut p = Proc::spawn(role, cmd, dir.path().join("client.log"));
    let st = p.wait_exit(Duration::from_secs(180));
    let all: Vec<String> = logs.iter().map(|l| l.log_text()).collect();
    let status = st.unwrap_or_else(|| panic!("{role} hung\n{}\n{}", p.log_text(), all.join("\n")));
    let text = std::fs::read_to_string(&out).unwrap_or_else(|_| {
        panic!(
            "{role} wrote no result (exit {status})\n{}\n{}",
            p.log_text(),
            all.join("\n")
        )
    });
    assert!(
        status.success(),
        "{role} exited {status}\n{text}\n{}",
        p.log_text()
    );
    serde_json::from_str(&text).unwrap()
}

/// The JSON a role's `READY {...}` line carries.
fn ready_json(line: &str) -> Result<serde_json::Value, serde_json::Error> {
    serde_json::from_str(line.trim_start_matches("READY").trim())
}

/// The next `READY` line within `limit` (other lines are output the caller did not ask
/// for, skipped).
fn next_ready(lines: &std::sync::mpsc::Receiver<String>, limit: Duration) -> Option<String> {
    let end = Instant::now() + limit;
    loop {
        let left = end.checked_duration_since(Instant::now())?;
        match lines.recv_timeout(left) {
            Ok(l) if l.starts_with("READY") => return Some(l),
            Ok(_) => continue,
            Err(_) => return None,
        }
    }
}

/// A scenario role kept running in the background, talking over stdin/stdout.
pub struct Background {
    pub proc: Proc,
    pub stdin: Option<ChildStdin>,
    pub ready_line: String,
    pub out: PathBuf,
    /// Every later line of its stdout, for [`Background::step`] and [`Background::ask`].
    lines: std::sync::mpsc::Receiver<String>,
    _dir: tempfile::TempDir,
}

impl Background {
    /// Starts `role` and waits for its `READY <endpoint>` line.
    pub fn start(role: &str, master: &str, metadata: &str, logs: &[&Proc]) -> Background {
        Background::start_args(role, master, metadata, &[], logs)
    }

    /// As [`Background::start`], with extra role arguments.
    pub fn start_args(
        role: &str,
        master: &str,
        metadata: &str,
        extra: &[&str],
        logs: &[&Proc],
    ) -> Background {
        Background::start_on(None, role, master, metadata, extra, logs)
    }

    /// As [`Background::start_args`], with the client of an older `release`.
    pub fn start_on(
        release: Option<&Release>,
        role: &str,
        master: &str,
        metadata: &str,
        extra: &[&str],
        logs: &[&Proc],
    ) -> Background {
        let dir = tempdir();
        let out = dir.path().join("out.json");
        let mut cmd = Command::new(release.map_or_else(python, |r| r.python.clone()));
        if let Some(r) = release {
            r.apply(&mut cmd);
        }
        cmd.arg(scenario())
            .args(["--role", role, "--master", master, "--metadata", metadata])
            .arg("--out")
            .arg(&out)
            .args(extra);
        Background::spawn(role, cmd, dir, logs)
    }

    /// Starts `cmd` (which writes its results to `dir/out.json`, given to it by the
    /// caller) and waits for its first `READY` line on stdout.
    pub fn spawn(
        name: &str,
        mut cmd: Command,
        dir: tempfile::TempDir,
        logs: &[&Proc],
    ) -> Background {
        let out = dir.path().join("out.json");
        let log = dir.path().join("client.log");
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .env("MC_TCP_BIND_ADDRESS", "127.0.0.1");
        let mut child = cmd.spawn().expect("start python");
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let proc = Proc {
            name: name.to_string(),
            child,
            log,
        };
        let ready_line = match next_ready(&rx, Duration::from_secs(60)) {
            Some(l) => l,
            None => {
                let all: Vec<String> = logs.iter().map(|l| l.log_text()).collect();
                panic!(
                    "{name} never got ready\n{}\n{}",
                    proc.log_text(),
                    all.join("\n")
                )
            }
        };
        Background {
            proc,
            stdin,
            ready_line,
            out,
            lines: rx,
            _dir: dir,
        }
    }

    /// Waits for its next `READY` line without sending anything.
    pub fn wait_ready(&self, what: &str, limit: Duration) -> String {
        next_ready(&self.lines, limit).unwrap_or_else(|| {
            panic!(
                "{}: no {what} within {limit:?}\n{}",
                self.proc.name,
                self.proc.log_text()
            )
        })
    }

    /// Sends `line` and returns the next line it prints (any line, not only `READY`).
    pub fn ask(&mut self, line: &str, limit: Duration) -> String {
        if let Some(s) = self.stdin.as_mut() {
            writeln!(s, "{line}").expect("write to the role's stdin");
            s.flush().expect("flush the role's stdin");
        }
        self.lines.recv_timeout(limit).unwrap_or_else(|_| {
            panic!(
                "{} did not answer {line:?}\n{}",
                self.proc.name,
                self.proc.log_text()
            )
        })
    }

    /// Sends `line` and returns the JSON of the `READY {...}` line it answers with.
    pub fn step_json(&mut self, line: &str) -> serde_json::Value {
        let answer = self.step(line);
        ready_json(&answer).unwrap_or_else(|e| {
            panic!(
                "{} answered {line:?} with {answer:?}: {e}\n{}",
                self.proc.name,
                self.proc.log_text()
            )
        })
    }

    /// Sends `line` and waits for the next `READY` line (returned).
    pub fn step(&mut self, line: &str) -> String {
        if let Some(s) = self.stdin.as_mut() {
            writeln!(s, "{line}").expect("write to the role's stdin");
            s.flush().expect("flush the role's stdin");
        }
        next_ready(&self.lines, Duration::from_secs(120)).unwrap_or_else(|| {
            panic!(
                "{} did not answer {line:?}\n{}",
                self.proc.name,
                self.proc.log_text()
            )
        })
    }

    pub fn endpoint(&self) -> &str {
        self.ready_line.trim_start_matches("READY").trim()
    }

    /// Ends its input (EOF on stdin) and waits up to `limit` for it to exit 0 on its
    /// own. Why not stop it: a role that still has work queued when its input ends (a
    /// router's published hint in its ZeroMQ socket) loses that work to a SIGTERM; one
    /// such hint was lost in a quarter to a half of busy runs before this.
    pub fn end(mut self, limit: Duration) {
        drop(self.stdin.take());
        match self.proc.wait_exit(limit) {
            Some(st) if st.success() => {}
            st => panic!(
                "{} did not exit 0 within {limit:?} after its input ended ({st:?})\n{}",
                self.proc.name,
                self.proc.log_text()
            ),
        }
    }

    /// Tells the role to go on (one line) without waiting.
    pub fn tell(&mut self) {
        if let Some(mut s) = self.stdin.take() {
            let _ = writeln!(s, "go");
        }
    }

    /// Tells the role to go on (one line), waits for it, checks that it exited 0 and
    /// returns its results.
    #[must_use = "a background role's results are what it proves"]
    pub fn finish(mut self) -> serde_json::Value {
        self.tell();
        let st = self
            .proc
            .wait_exit(Duration::from_secs(120))
            .unwrap_or_else(|| {
                panic!(
                    "{} did not finish\n{}",
                    self.proc.name,
                    self.proc.log_text()
                )
            });
        let text = std::fs::read_to_string(&self.out).unwrap_or_else(|_| {
            panic!(
                "{} wrote no result\n{}",
                self.proc.name,
                self.proc.log_text()
            )
        });
        assert!(
            st.success(),
            "{} exited {st}\n{text}\n{}",
            self.proc.name,
            self.proc.log_text()
        );
        serde_json::from_str(&text).unwrap()
    }
}

/// The deterministic value of a key, as tests/py/scenario.py makes it (its SHA-256
/// repeated), so either side can check the other's bytes.
pub fn value_of(key: &str, size: usize) -> Vec<u8> {
    use sha2::Digest;
    let seed = sha2::Sha256::digest(key.as_bytes());
    seed.iter().copied().cycle().take(size).collect()
}

/// moongate with the kv face on a free port (plus `extra` lines in `[kv]`), ready.
pub fn kv_moongate(master: &Master, extra: &str) -> (Moongate, String) {
    let kv = format!("127.0.0.1:{}", free_port());
    let mg = Moongate::start_config(&format!(
        "[master_face]\nupstream = \"{}\"\n[kv]\nlisten = \"{kv}\"\nmetadata_url = \"{}\"\n{extra}",
        master.rpc, master.metadata
    ));
    mg.wait_ready(master);
    (mg, kv)
}

/// moongate with the kv face on TCP and on `DIR/kv.sock`, and an own segment of
/// `segment_bytes` (mounted before this returns); `extra` adds `[kv]` keys:
/// (moongate, TCP address, socket path).
pub fn kv_unix_moongate(
    master: &Master,
    dir: &std::path::Path,
    segment_bytes: u64,
    extra: &str,
) -> (Moongate, String, std::path::PathBuf) {
    let sock = dir.join("kv.sock");
    let (mg, kv) = kv_moongate(
        master,
        &format!(
            "segment_bytes = {segment_bytes}\nunix_path = \"{}\"\n{extra}",
            sock.display()
        ),
    );
    wait_segment_mounted(&mg);
    (mg, kv, sock)
}

/// Waits until moongate logs its own segment mounted; returns the segment's name
/// (`host:port` of its TE-TCP listener).
pub fn wait_segment_mounted(mg: &Moongate) -> String {
    wait_for(
        "own segment mounted",
        Duration::from_secs(15),
        &[&mg.proc],
        || mg.proc.log_text().contains("own segment mounted"),
    );
    mg.proc
        .log_text()
        .split("own segment mounted segment=")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .expect("segment name in the log")
        .to_string()
}

/// Runs `benches/replay` over the shipped trace through moongate (its experiment arms
/// learned from the admin endpoint) with `args` (limit, speed, sizes), within `limit`;
/// returns its JSON report. The panic quotes the replay's, moongate's and the master's
/// logs.
pub fn run_replay(
    master: &Master,
    mg: &Moongate,
    args: &[&str],
    limit: Duration,
) -> serde_json::Value {
    let dir = tempdir();
    let out = dir.path().join("replay.json");
    let mut cmd = Command::new("bash");
    cmd.arg(repo_root().join("benches/replay"))
        .arg("--trace")
        .arg(repo_root().join("benches/traces/mooncake_fast25_synthetic.jsonl"))
        .args(["--master", &mg.listen, "--metadata", &master.metadata])
        .args(["--admin", &mg.admin])
        .args(args)
        .arg("--json")
        .arg(&out)
        .env("MOONGATE_PYTHON", python());
    let mut p = Proc::spawn("replay", cmd, dir.path().join("replay.log"));
    let st = p.wait_exit(limit);
    let logs = || {
        format!(
            "{}\n{}\n{}",
            p.log_text(),
            mg.proc.log_text(),
            master.proc.log_text()
        )
    };
    let st = st.unwrap_or_else(|| panic!("replay hung\n{}", logs()));
    assert!(st.success(), "replay failed ({st})\n{}", logs());
    serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap()
}

/// What every client of a fault test must show afterwards (the `failover` role's
/// results): no value read back wrong (absent is allowed: a put that reached a lost
/// master), good rounds after its last failed one, and no failed round slower than
/// `slowest_failure_s` (no call hung).
pub fn assert_recovered(results: &[serde_json::Value], slowest_failure_s: f64) {
    for r in results {
        assert_eq!(result(r, "wrong"), 0, "never a wrong value: {r}");
        assert!(
            result(r, "ok_after_last_failure").as_u64().unwrap() >= 1,
            "recovered: {r}"
        );
        assert!(
            result(r, "slowest_failed_round_s").as_f64().unwrap() < slowest_failure_s,
            "failed rounds return within {slowest_failure_s} s: {r}"
        );
    }
}

/// Waits until moongate holds no client and no upstream connection (nothing leaked).
pub fn wait_no_connections(mg: &Moongate, logs: &[&Proc]) {
    wait_for("connections closed", Duration::from_secs(10), logs, || {
        mg.metric("moongate_master_connections_open") == 0.0
            && mg.metric("moongate_upstream_connections_open") == 0.0
    });
}

/// A real etcd (Debian's etcd-server) on loopback ports, for HA masters and fleets.
pub struct Etcd {
    pub proc: Proc,
    pub endpoint: String,
    cmd: Vec<String>,
    dir: tempfile::TempDir,
}

impl Etcd {
    pub fn start() -> Etcd {
        let dir = tempdir();
        let (client, peer) = (free_port(), free_port());
        let endpoint = format!("127.0.0.1:{client}");
        let cmd = vec![
            "--name".to_string(),
            "t".into(),
            "--data-dir".into(),
            dir.path().join("data").to_str().unwrap().into(),
            "--listen-client-urls".into(),
            format!("http://{endpoint}"),
            "--advertise-client-urls".into(),
            format!("http://{endpoint}"),
            "--listen-peer-urls".into(),
            format!("http://127.0.0.1:{peer}"),
            "--initial-advertise-peer-urls".into(),
            format!("http://127.0.0.1:{peer}"),
            "--initial-cluster".into(),
            format!("t=http://127.0.0.1:{peer}"),
        ];
        let proc = Etcd::spawn(&cmd, &dir, &endpoint, "etcd.log");
        Etcd {
            proc,
            endpoint,
            cmd,
            dir,
        }
    }

    fn spawn(args: &[String], dir: &tempfile::TempDir, endpoint: &str, log: &str) -> Proc {
        let mut cmd = Command::new("etcd");
        cmd.args(args);
        let proc = Proc::spawn("etcd", cmd, dir.path().join(log));
        wait_for("etcd healthy", Duration::from_secs(30), &[&proc], || {
            http_get(endpoint, "/health").is_some_and(|(s, b)| s == 200 && b.contains("true"))
        });
        proc
    }

    /// Crashes etcd (SIGKILL), as a lost etcd node would.
    pub fn kill(&mut self) {
        self.proc.signal(libc::SIGKILL);
        assert!(self.proc.wait_exit(Duration::from_secs(10)).is_some());
    }

    /// Starts it again on the same ports and data.
    pub fn restart(&mut self) {
        self.proc = Etcd::spawn(&self.cmd, &self.dir, &self.endpoint, "etcd-restarted.log");
    }
}

/// One HTTP/1.1 request with a body on a stream (`Connection: close`): the status and
/// the answer's body (the kv face's answers carry a Content-Length or end the stream).
pub fn request_over<S: std::io::Read + std::io::Write>(
    mut s: S,
    method: &str,
    path: &str,
    body: &[u8],
) -> std::io::Result<(u16, Vec<u8>)> {
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    s.write_all(body)?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    let head_end = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(out.len(), |p| p + 4);
    let status = String::from_utf8_lossy(&out[..head_end])
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((status, out[head_end..].to_vec()))
}

/// What a test program printed (stdout then stderr), after checking that it exited 0 and
/// said "all ok"; the panic quotes it and moongate's log, named `what`.
pub fn all_ok(what: &str, o: &std::process::Output, mg: &Moongate) -> String {
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        o.status.success() && said.contains("all ok"),
        "{what}: {}\n{said}\n--- moongate ---\n{}",
        o.status,
        mg.proc.log_text()
    );
    said
}

/// The moongate_kv wheel as users get it (`scripts/wheel.sh`: the library built by
/// setuptools-rust into the package, manylinux-tagged), built once per test run so the
/// tests always meet the wheel of the sources they run with.
pub fn wheel() -> &'static PathBuf {
    static WHEEL: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    WHEEL.get_or_init(|| {
        let o = Command::new("bash")
            .arg(repo_root().join("scripts/wheel.sh"))
            .current_dir(repo_root())
            .output()
            .expect("bash scripts/wheel.sh");
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "scripts/wheel.sh failed:\n{out}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
        PathBuf::from(out.lines().last().expect("the wheel's path").trim())
    })
}

/// Installs the wheel into the virtualenv of `python` (no dependencies, no index).
pub fn install_wheel(python: &Path) {
    let o = Command::new(python)
        .args(["-m", "pip", "install", "-q", "--disable-pip-version-check"])
        .args(["--no-deps", "--no-index", "--force-reinstall"])
        .arg(wheel())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "pip install {}:\n{}",
        wheel().display(),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A command for `python` as a user's would run it: the environment emptied but for a
/// PATH without Rust's tools (no cargo, no MOONGATE_KV_LIB, no PYTHONPATH), so what it
/// imports is what is installed in its virtualenv.
pub fn installed_python(python: &Path) -> Command {
    let mut cmd = Command::new(python);
    cmd.env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", std::env::temp_dir())
        .env("MC_TCP_BIND_ADDRESS", "127.0.0.1");
    cmd
}

/// The workspace's version (Cargo.toml `[workspace.package]`): moongate's, the library's
/// and the wheel's.
pub fn workspace_version() -> String {
    let text = std::fs::read_to_string(repo_root().join("Cargo.toml")).unwrap();
    let section = text.split("[workspace.package]").nth(1).unwrap();
    section
        .lines()
        .find_map(|l| l.strip_prefix("version = "))
        .expect("version in [workspace.package]")
        .trim_matches('"')
        .to_string()
}
