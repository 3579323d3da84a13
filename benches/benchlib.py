"""Helpers the benchmark drivers share: free loopback ports, readiness waits,
percentiles, the mooncake_master command line, stopping what a driver started, and
scratch directories that do not outlive a clean run."""
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

MiB = 1 << 20


_scratch = []


def work_dir(prefix):
    """A scratch directory for this run's logs and data (an etcd's WAL alone is 62 MB):
    `run` removes it when the run succeeds and keeps it, named, when it fails.
    MOONGATE_KEEP_WORK=1 keeps it always."""
    work = tempfile.mkdtemp(prefix=prefix)
    _scratch.append(work)
    return work


def run(main):
    """Run a driver's main: exit with its code, removing its scratch directories if it
    succeeded (returned 0 or None) and naming them if it did not."""
    try:
        rc = main()
    except BaseException:
        for w in _scratch:
            print(f"(kept {w})", file=sys.stderr)
        raise
    for w in _scratch:
        if rc or os.environ.get("MOONGATE_KEEP_WORK") == "1":
            print(f"(kept {w})", file=sys.stderr)
        else:
            shutil.rmtree(w, ignore_errors=True)
    sys.exit(rc or 0)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def wait_http(url, secs=30):
    end = time.time() + secs
    while time.time() < end:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except Exception:
            time.sleep(0.1)
    raise SystemExit(f"{url} not ready")


def wait_port(port, secs=30):
    """Waits until something accepts TCP connections on 127.0.0.1:port."""
    end = time.time() + secs
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"127.0.0.1:{port} not accepting")


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


def master_cmd(rpc, http):
    """mooncake_master on loopback with its HTTP metadata server (and metrics page), of
    the Mooncake release this Python runs (benchmarks run per release with that
    release's virtualenv)."""
    import mooncake
    binary = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    cmd = [binary, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
           "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
           f"--http_metadata_server_port={http}", f"--metrics_port={free_port()}"]
    # 0.3.11 / 0.3.12 masters exit on --metrics_host (they do not have it).
    flags = subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
    if "metrics_host" in flags:
        cmd.append("--metrics_host=127.0.0.1")
    return cmd


def stop_all(procs):
    for pr in reversed(procs):
        if pr.poll() is None:
            pr.terminate()
            try:
                pr.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pr.kill()


def start_moongate(binary, work, name, config, procs):
    """Writes `config` to WORK/NAME.toml and starts `binary run` with it on free loopback
    ports (log WORK/NAME.log; RUST_LOG from the environment, else warn), appended to
    `procs`. Returns (process, admin URL, listen address); the caller waits for it."""
    admin, listen = free_port(), free_port()
    cfg = f"{work}/{name}.toml"
    with open(cfg, "w") as f:
        f.write(config)
    pr = subprocess.Popen(
        [binary, "run", "--config", cfg, "--listen", f"127.0.0.1:{listen}",
         "--admin", f"127.0.0.1:{admin}"],
        stdout=open(f"{work}/{name}.log", "w"), stderr=subprocess.STDOUT,
        env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")})
    procs.append(pr)
    return pr, f"http://127.0.0.1:{admin}", f"127.0.0.1:{listen}"


def start_kv_moongate(binary, work, rpc, metadata, segment_bytes, procs):
    """moongate in front of the master at 127.0.0.1:`rpc` with its kv face on TCP and on
    WORK/kv.sock and an own segment of `segment_bytes`; returns (admin URL, master-face
    address, socket path) once its segment is mounted (logged at info)."""
    os.environ.setdefault("RUST_LOG", "info")
    sock = f"{work}/kv.sock"
    _, admin, listen = start_moongate(
        binary, work, "moongate",
        f'[master_face]\nupstream = "127.0.0.1:{rpc}"\n[kv]\n'
        f'listen = "127.0.0.1:{free_port()}"\nunix_path = "{sock}"\n'
        f'metadata_url = "{metadata}"\nsegment_bytes = {segment_bytes}\n', procs)
    wait_http(f"{admin}/ready", 60)
    deadline = time.time() + 60
    while "own segment mounted" not in open(f"{work}/moongate.log").read():
        if time.time() > deadline:
            raise SystemExit("moongate's own segment not mounted")
        time.sleep(0.2)
    return admin, listen, sock


def run_owner(master, metadata, segment_bytes, put=None):
    """The owner role: mounts a segment of `segment_bytes`, puts `put` ({key: bytes}),
    prints READY and holds the segment until stdin closes."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    import sys
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", metadata, segment_bytes, 64 * MiB, "tcp", "", master)
    if rc:
        raise SystemExit(f"owner setup {rc}")
    for k, v in (put or {}).items():
        assert s.put(k, v) == 0, k
    print("READY", s.get_hostname(), flush=True)
    sys.stdin.read()
    s.close()


def spawn_owner(script, master, metadata, work):
    """Starts `script --role owner` against `master` and waits for its READY line."""
    import sys
    owner = subprocess.Popen(
        [sys.executable, script, "--role", "owner", "--master", master, "--metadata", metadata],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=open(f"{work}/owner.log", "w"), text=True)
    if not owner.stdout.readline().startswith("READY"):
        owner.kill()
        raise SystemExit(f"owner failed; see {work}/owner.log")
    return owner


def start_etcd(work, procs):
    """Starts Debian's etcd-server on free loopback ports (data and log under `work`),
    appends it to `procs`, waits for /health and returns its `host:port`."""
    import subprocess
    cport, pport = free_port(), free_port()
    etcd = f"127.0.0.1:{cport}"
    procs.append(subprocess.Popen(
        ["etcd", "--name", "b", "--data-dir", f"{work}/etcd",
         "--listen-client-urls", f"http://{etcd}", "--advertise-client-urls", f"http://{etcd}",
         "--listen-peer-urls", f"http://127.0.0.1:{pport}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
         "--initial-cluster", f"b=http://127.0.0.1:{pport}"],
        stdout=open(f"{work}/etcd.log", "w"), stderr=subprocess.STDOUT))
    wait_http(f"http://{etcd}/health")
    return etcd
