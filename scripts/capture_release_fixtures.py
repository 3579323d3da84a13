#!/usr/bin/env python3
"""Captures the master-RPC bytes of one Mooncake release, for the codec's golden tests.

Starts that release's mooncake_master (from its virtualenv, see scripts/bootstrap.sh), a
recording relay in front of it, and the two-process scenario of tests/py/scenario.py
(an owner that puts, a reader on another process) with that release's client through
the relay. Writes, per client connection N, the raw streams `connN.c2s.bin` (client to
master) and `connN.s2c.bin` (master to client) under
proxy/tests/fixtures/releases/<release>/, replacing what was there.

    .venv-0.3.12.post1/bin/python scripts/capture_release_fixtures.py 0.3.12.post1

Run it with the release's own Python (its client is what is captured). Loopback only.
"""
import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_port(port, limit=30.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listens on {port} after {limit} s")


class Recorder:
    """A relay that appends every byte it forwards to per-connection files."""

    def __init__(self, upstream_port, out):
        self.upstream_port = upstream_port
        self.out = out
        self.count = 0

    async def pump(self, reader, writer, sink):
        try:
            while data := await reader.read(1 << 20):
                sink.write(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            sink.flush()
            writer.close()

    async def handle(self, c_reader, c_writer):
        self.count += 1
        n = self.count
        m_reader, m_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        with open(f"{self.out}/conn{n}.c2s.bin", "wb") as c2s, \
                open(f"{self.out}/conn{n}.s2c.bin", "wb") as s2c:
            await asyncio.gather(self.pump(c_reader, m_writer, c2s),
                                 self.pump(m_reader, c_writer, s2c))


def relay(listen_port, upstream_port, out, ready, stop):
    async def main():
        rec = Recorder(upstream_port, out)
        server = await asyncio.start_server(rec.handle, "127.0.0.1", listen_port)
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        server.close()
    asyncio.run(main())


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    release = sys.argv[1]
    out = os.path.join(ROOT, "proxy/tests/fixtures/releases", release)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    import mooncake
    master_bin = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    work = tempfile.mkdtemp(prefix="moongate-capture-")
    rpc, http, metrics, relay_port = free_port(), free_port(), free_port(), free_port()
    master = subprocess.Popen(
        [master_bin, f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
         "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
         f"--http_metadata_server_port={http}", f"--metrics_port={metrics}",
         "--enable_metric_reporting=false"],
        cwd=work, stdout=open(f"{work}/master.log", "w"), stderr=subprocess.STDOUT)
    stop = threading.Event()
    ready = threading.Event()
    t = threading.Thread(target=relay, args=(relay_port, rpc, out, ready, stop))
    try:
        wait_port(rpc)
        wait_port(http)
        t.start()
        ready.wait(10)
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        scenario = os.path.join(ROOT, "tests/py/scenario.py")
        common = ["--master", f"127.0.0.1:{relay_port}",
                  "--metadata", f"http://127.0.0.1:{http}/metadata"]
        owner = subprocess.Popen(
            [sys.executable, scenario, "--role", "owner", *common, "--out", f"{work}/owner.json"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            stderr=open(f"{work}/owner.log", "w"))
        line = owner.stdout.readline()
        if not line.startswith("READY"):
            raise SystemExit(f"owner did not get ready: {line!r}; see {work}")
        endpoint = line.split()[1]
        subprocess.run(
            [sys.executable, scenario, "--role", "reader", *common, "--owner-host", endpoint,
             "--out", f"{work}/reader.json"],
            check=True, env=env, stderr=open(f"{work}/reader.log", "w"), timeout=180)
        owner.stdin.write("go\n")
        owner.stdin.flush()
        if owner.wait(timeout=120) != 0:
            raise SystemExit(f"owner failed; see {work}")
        # Let the relay see both sides close.
        time.sleep(0.5)
    finally:
        stop.set()
        if t.is_alive():
            t.join(5)
        master.send_signal(signal.SIGTERM)
        master.wait(10)
    files = sorted(os.listdir(out))
    size = sum(os.path.getsize(os.path.join(out, f)) for f in files)
    print(f"{release}: {len(files)} files, {size} bytes in {out}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
