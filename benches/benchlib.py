"""Helpers the benchmark drivers share: free loopback ports, readiness waits,
percentiles, the mooncake_master command line, and stopping what a driver started."""
import os
import socket
import subprocess
import time
import urllib.request

MiB = 1 << 20


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


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


def master_cmd(rpc, http):
    """mooncake_master on loopback with its HTTP metadata server (and metrics page)."""
    import mooncake
    binary = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    return [binary, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}", f"--metrics_port={free_port()}",
            "--metrics_host=127.0.0.1"]


def stop_all(procs):
    for pr in reversed(procs):
        if pr.poll() is None:
            pr.terminate()
            try:
                pr.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pr.kill()
