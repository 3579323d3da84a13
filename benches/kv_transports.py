#!/usr/bin/env python3
"""QUIC vs TE-TCP between two moongates, in one run: moongate B owns a segment (served
over TE-TCP and QUIC); moongate A (QUIC client) and moongate C (quic_client = false)
read the same 16 MiB and 4 KiB values from it through their kv faces with
examples/kv_bench, alternating, --rounds times. Prints medians and QUIC / TCP ratios,
after checking from each reader's metrics that every read went over the transport it
is named for (a silent fallback would make the ratio meaningless).
`benches/run_kv_face.sh` builds the release binaries; run this after it:
  .venv/bin/python benches/kv_transports.py --rounds 3
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import free_port, master_cmd, run, stop_all, wait_http, work_dir  # noqa: E402


def reads(admin, transport):
    """moongate_kv_transfers_total{transport,direction="read"} of one moongate."""
    page = urllib.request.urlopen(f"http://{admin}/metrics", timeout=10).read().decode()
    sample = f'moongate_kv_transfers_total{{transport="{transport}",direction="read"}} '
    for line in page.splitlines():
        if line.startswith(sample):
            return float(line[len(sample):])
    raise SystemExit(f"no {sample.strip()} on {admin}")


def put_when_mounted(kv, key, body, limit_s=30.0):
    """PUT until B's segment is mounted (until then the master has no room: 507)."""
    deadline = time.monotonic() + limit_s
    while True:
        req = urllib.request.Request(f"http://{kv}/v1/kv/{key}", data=body, method="PUT")
        try:
            urllib.request.urlopen(req, timeout=30).read()
            return
        except urllib.error.HTTPError as e:
            if e.code != 507 or time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--moongate", default="target/release/moongate")
    p.add_argument("--kv-bench", default="target/release/examples/kv_bench")
    p.add_argument("--json")
    p.add_argument("--quic-streams", type=int,
                   help="kv.quic_streams of the QUIC reader (default: moongate's)")
    a = p.parse_args()
    work = work_dir("moongate-transports-")
    rpc, http = free_port(), free_port()
    metadata = f"http://127.0.0.1:{http}/metadata"
    procs = []
    kv = {}
    admins = {}
    res = {"quic": [], "tcp": []}
    try:
        procs.append(subprocess.Popen(
            master_cmd(rpc, http),
            stdout=open(f"{work}/master.log", "w"), stderr=subprocess.STDOUT))
        wait_http(f"http://127.0.0.1:{http}/health")
        for name, extra in (("b", 'segment_bytes = 268435456\nquic_listen = "127.0.0.1:0"\n'),
                            ("quic", f"quic_streams = {a.quic_streams}\n" if a.quic_streams else ""),
                            ("tcp", "quic_client = false\n")):
            kv[name] = f"127.0.0.1:{free_port()}"
            admin = admins[name] = f"127.0.0.1:{free_port()}"
            cfg = f"{work}/{name}.toml"
            with open(cfg, "w") as f:
                f.write(f'[master_face]\nlisten = "127.0.0.1:{free_port()}"\nupstream = "127.0.0.1:{rpc}"\n'
                        f'[admin]\nlisten = "{admin}"\n[kv]\nlisten = "{kv[name]}"\n'
                        f'metadata_url = "{metadata}"\n{extra}')
            procs.append(subprocess.Popen([a.moongate, "run", "--config", cfg],
                                          stdout=open(f"{work}/{name}.log", "w"),
                                          stderr=subprocess.STDOUT,
                                          env={**os.environ, "RUST_LOG": "warn"}))
            wait_http(f"http://{admin}/ready")
        for key, size in (("t%2F4k", 4096), ("t%2F16m", 16 << 20)):
            put_when_mounted(kv["quic"], key, os.urandom(size))
        for i in range(a.rounds):
            for side in (["quic", "tcp"] if i % 2 == 0 else ["tcp", "quic"]):
                r = {}
                other = "tcp" if side == "quic" else "quic"
                before = (reads(admins[side], side), reads(admins[side], other))
                n_reads = 0
                for key, n in (("t%2F4k", a.count), ("t%2F16m", max(8, a.count // 50))):
                    out = subprocess.run([a.kv_bench, kv[side], key, str(n)], check=True,
                                         capture_output=True, text=True).stdout
                    r[key] = json.loads(out)
                    n_reads += n
                after = (reads(admins[side], side), reads(admins[side], other))
                if after[0] - before[0] < n_reads or after[1] != before[1]:
                    raise SystemExit(f"{side} reader: {after[0] - before[0]:.0f} {side} reads "
                                     f"and {after[1] - before[1]:.0f} {other} reads for "
                                     f"{n_reads} GETs: not the transport under test")
                res[side].append(r)
                print(f"round {i + 1}/{a.rounds} {side} done", file=sys.stderr, flush=True)
    finally:
        stop_all(procs)
    med = lambda s, k, m: statistics.median(r[k][m] for r in res[s])
    print(f"\nmedians over {a.rounds} rounds: kv GET from a peer moongate's segment")
    print(f"{'':<22}{'TE-TCP':>12}{'QUIC':>12}{'QUIC/TCP':>10}")
    for key, m in (("t%2F4k", "p50_us"), ("t%2F16m", "GBps")):
        t, q = med("tcp", key, m), med("quic", key, m)
        print(f"{key.replace('%2F', '/') + ' ' + m:<22}{t:>12.2f}{q:>12.2f}{q / t:>10.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    run(main)
