#!/usr/bin/env python3
"""Master-face latency, targets paired call by call: the master directly, a bare byte
relay, moongate, and optionally a second moongate build (or config).

`benches/e2e_master_face.py` runs Mooncake's own client against each side one after the
other; on a shared 2-core VM the sides' runs drift apart by tens of microseconds (a bare
relay measured +20 us over direct in one run and +90 us in the next). Here one process
(`proxy/examples/latency_ab.rs`) sends each call to every target in turn, one at a time,
in rotating order, so drift falls on all targets alike, and reports the median of the
per-round differences against the relay: the cost of moongate's work over the hop
itself.

Setup (real processes on loopback): mooncake_master; moongate (and the baseline) in
front of it; the bare relay; an owner (the real Mooncake client) that puts the keys the
calls look up, directly on the master, and holds them.

  python benches/latency_ab.py --moongate target/release/moongate \
      --relay target/release/examples/bare_relay --tool target/release/examples/latency_ab \
      [--baseline OTHER_BUILD] [--calls 4000] [--repeat 3]
(`benches/run_latency_ab.sh` builds the three and runs this.)
"""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import free_port, master_cmd, run, run_owner, stop_all, wait_http, work_dir  # noqa: E402

MiB = 1 << 20
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
PREFIX = "ab"
KEYS = 64


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="driver")
    p.add_argument("--master")
    p.add_argument("--metadata")
    p.add_argument("--moongate", default="target/release/moongate")
    p.add_argument("--moongate-config", default="")
    p.add_argument("--baseline", default="")
    p.add_argument("--baseline-config", default=None)
    p.add_argument("--relay", default="target/release/examples/bare_relay")
    p.add_argument("--tool", default="target/release/examples/latency_ab")
    p.add_argument("--calls", type=int, default=4000)
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of the tool (each on fresh connections)")
    a = p.parse_args()
    if a.role == "owner":
        return run_owner(a.master, a.metadata, 64 * MiB,
                         put={f"{PREFIX}/{i}": b"v" * 64 for i in range(KEYS)})

    work = work_dir("moongate-ab-")
    rpc, http, listen, admin, relay, b_listen, b_admin = (free_port() for _ in range(7))
    metadata = f"http://127.0.0.1:{http}/metadata"
    procs = []

    def moongate(binary, cfg, port, adm, log):
        procs.append(subprocess.Popen(
            [binary, "run"] + (["--config", cfg] if cfg else [])
            + ["--listen", f"127.0.0.1:{port}", "--upstream", f"127.0.0.1:{rpc}",
               "--admin", f"127.0.0.1:{adm}"],
            stdout=open(f"{work}/{log}", "w"), stderr=subprocess.STDOUT,
            env={**os.environ, "RUST_LOG": "warn"}))
        wait_http(f"http://127.0.0.1:{adm}/ready")

    try:
        procs.append(subprocess.Popen(master_cmd(rpc, http), stdout=open(f"{work}/master.log", "w"),
                                      stderr=subprocess.STDOUT))
        moongate(a.moongate, a.moongate_config, listen, admin, "moongate.log")
        targets = [f"relay=127.0.0.1:{relay}", f"direct=127.0.0.1:{rpc}",
                   f"moongate=127.0.0.1:{listen}"]
        if a.baseline:
            cfg = a.moongate_config if a.baseline_config is None else a.baseline_config
            moongate(a.baseline, cfg, b_listen, b_admin, "baseline.log")
            targets.append(f"baseline=127.0.0.1:{b_listen}")
        procs.append(subprocess.Popen([a.relay, f"127.0.0.1:{relay}", f"127.0.0.1:{rpc}"],
                                      stdout=open(f"{work}/relay.log", "w"),
                                      stderr=subprocess.STDOUT))
        owner = subprocess.Popen(
            [sys.executable, __file__, "--role", "owner", "--master", f"127.0.0.1:{rpc}",
             "--metadata", metadata], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=open(f"{work}/owner.log", "w"), text=True)
        procs.append(owner)
        if not owner.stdout.readline().startswith("READY"):
            raise SystemExit(f"owner failed; see {work}/owner.log")
        for r in range(a.repeat):
            print(f"== run {r + 1}/{a.repeat}", flush=True)
            subprocess.run([a.tool, "--calls", str(a.calls), "--prefix", PREFIX,
                            "--keys", str(KEYS)] + targets, check=True)
        owner.stdin.close()
        owner.wait(timeout=30)
    finally:
        stop_all(procs)


if __name__ == "__main__":
    run(main)
