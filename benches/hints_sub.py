#!/usr/bin/env python3
"""How many hint names a second moongate takes from a ZeroMQ publisher
(`hints.subscribe`), and the CPU it spends on them: a pyzmq PUB publishes --messages
messages of --names keys each as fast as it can; the run ends when
moongate_hints_received_total has counted them all. No master is needed (hints do not
touch it). Not part of CI.

  .venv/bin/python benches/hints_sub.py --moongate target/release/moongate
"""
import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import free_port, run, stop_all, wait_http, work_dir  # noqa: E402


def received(admin):
    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith('moongate_hints_received_total{kind="upcoming"} '):
                return float(line.split()[1])
    return 0.0


def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--moongate", required=True)
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--names", type=int, default=64, help="keys per message")
    a = p.parse_args()
    work = work_dir("hints-sub-")
    pub_port, admin = free_port(), f"127.0.0.1:{free_port()}"
    cfg = os.path.join(work, "mg.toml")
    with open(cfg, "w") as f:
        f.write(f'[master_face]\nupstream = "127.0.0.1:{free_port()}"\n'
                f'[hints]\nsubscribe = ["tcp://127.0.0.1:{pub_port}"]\n'
                f'max_names_per_second = 100000000\nmax_entries = 4194304\n')
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    log = open(os.path.join(work, "moongate.log"), "w")
    mg = subprocess.Popen([a.moongate, "run", "--config", cfg, "--listen",
                           f"127.0.0.1:{free_port()}", "--admin", admin],
                          stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://{admin}/live", 60)
        if not pub.poll(30000):
            raise SystemExit("moongate did not subscribe within 30 s")
        pub.recv()
        bodies = [json.dumps({"hints": [{"kind": "upcoming", "in_ms": 5000, "keys": [
            f"bench/{m}/{k}" for k in range(a.names)]}]}).encode() for m in range(a.messages)]
        total = a.messages * a.names
        cpu0, t0 = cpu_s(mg.pid), time.perf_counter()
        for b in bodies:
            pub.send_multipart([b"", b])
        while received(admin) < total:
            if time.perf_counter() - t0 > 120:
                raise SystemExit(f"only {received(admin)} of {total} names after 120 s")
            time.sleep(0.01)
        wall, cpu = time.perf_counter() - t0, cpu_s(mg.pid) - cpu0
        print(f"{a.messages} messages x {a.names} names: {total / wall:,.0f} names/s "
              f"({a.messages / wall:,.0f} messages/s), moongate CPU {cpu:.2f} s "
              f"= {cpu / total * 1e6:.2f} us per name")
    finally:
        stop_all([mg])
        pub.close(0)
        ctx.term()
    return 0


if __name__ == "__main__":
    run(main)
