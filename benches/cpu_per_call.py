#!/usr/bin/env python3
"""CPU instructions moongate spends per master-face call, counted by valgrind.

Latency on a shared 2-core VM swings by +-15% from run to run (see docs/results.md);
instruction counts do not. This runs one or two moongate builds under
`valgrind --tool=callgrind` with instrumentation off during start-up (plugin
compilation is not what is measured), drives the same real-client workload through
each (ExistKey, BatchExistKey of 64 keys, GetReplicaList, and 4 KiB puts: PutStart +
PutEnd through the embedded default policy), counts instructions only while that
workload runs, and prints instructions per call and the ratio between the builds.

  python benches/cpu_per_call.py --moongate target/release/moongate \
      [--baseline OTHER_BUILD] [--relay BARE_RELAY] [--calls 2000] \
      [--extra-config 'TOML'] [--misses] [--max-per-call N]

--relay counts the bare byte relay (`proxy/examples/bare_relay.rs`, built with the same
profile) under the same workload: the floor any hop pays (tokio's reads, writes and
wake-ups), so what moongate adds over a hop is the difference of the two lines.

--extra-config appends TOML to moongate's config (`\n` for new lines), e.g.
'[eviction]\nenabled = true' to price the key table and miss classification;
--misses adds one ExistKey of an absent key per iteration (a lookup miss).

--max-per-call N exits 1 when this build spends more than N instructions per call: CI
runs it as a ceiling (counts repeat within ~0.5 %, so the check cannot flake the way a
timed assertion would).

Needs Debian's valgrind (scripts/bootstrap.sh installs it).
"""
import argparse
import os
import re
import signal
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import free_port, master_cmd, run, stop_all, wait_http, wait_port, work_dir  # noqa: E402

MiB = 1 << 20
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


def role_client(a):
    """Sets up, warms up, says `ready`, waits for a line, runs the workload, says `done`."""
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", a.metadata, 128 * MiB, 64 * MiB, "tcp", "", a.master)
    if rc:
        raise SystemExit(f"client setup {rc}")
    keys = [f"cpu/{a.tag}/m{i}" for i in range(64)]
    for k in keys:
        assert s.put(k, b"v" * 64) == 0
    for _ in range(20):
        s.is_exist(keys[0])
        s.batch_is_exist(keys)
        s.get_replica_desc(keys[1])
    print("ready", flush=True)
    sys.stdin.readline()
    n = a.calls
    only = a.only
    for i in range(n):
        if only in ("", "is_exist"):
            s.is_exist(keys[i % 64])
        if only in ("", "batch_is_exist"):
            s.batch_is_exist(keys)
        if only in ("", "get_replica_desc"):
            s.get_replica_desc(keys[i % 64])
        if only in ("", "put"):
            assert s.put(f"cpu/{a.tag}/p{i}", b"x" * 4096) == 0
        if a.misses:
            s.is_exist(f"cpu/{a.tag}/absent{i}")
    print("done", flush=True)
    sys.stdin.readline()
    s.close()


def measure(binary, label, rpc, metadata, calls, work, extra_config="", misses=False, only=""):
    listen, admin = free_port(), free_port()
    out = os.path.join(work, f"callgrind.{label}")
    # The pooling allocator reserves address space per plugin instance slot; valgrind
    # cannot map the default 64 slots' worth, and one slot serves the default policy.
    cfg = os.path.join(work, f"{label}.toml")
    with open(cfg, "w") as f:
        f.write("[policy]\nmax_instances = 1\n" + extra_config.replace("\\n", "\n") + "\n")
    if label == "relay":
        args = [binary, f"127.0.0.1:{listen}", f"127.0.0.1:{rpc}"]
    else:
        args = [binary, "run", "--config", cfg, "--listen", f"127.0.0.1:{listen}",
                "--upstream", f"127.0.0.1:{rpc}", "--admin", f"127.0.0.1:{admin}"]
    mg = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
        + args,
        stdout=open(os.path.join(work, f"{label}.log"), "w"), stderr=subprocess.STDOUT,
        env={**os.environ, "RUST_LOG": "warn"})
    client = None
    try:
        if label == "relay":
            wait_port(listen, secs=300)
        else:
            wait_http(f"http://127.0.0.1:{admin}/ready", secs=300)
        client = subprocess.Popen(
            [sys.executable, __file__, "--role", "client", "--master", f"127.0.0.1:{listen}",
             "--metadata", metadata, "--calls", str(calls), "--tag", label]
            + (["--misses"] if misses else []) + (["--only", only] if only else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            stderr=open(os.path.join(work, f"client-{label}.log"), "w"))
        assert client.stdout.readline().strip() == "ready"
        subprocess.run(["callgrind_control", "-i", "on", str(mg.pid)], check=True,
                       stdout=subprocess.DEVNULL)
        client.stdin.write("go\n")
        client.stdin.flush()
        assert client.stdout.readline().strip() == "done"
        subprocess.run(["callgrind_control", "-i", "off", str(mg.pid)], check=True,
                       stdout=subprocess.DEVNULL)
        client.stdin.write("close\n")
        client.stdin.flush()
        client.wait(timeout=60)
    finally:
        stop_all([p for p in (client,) if p])
        mg.send_signal(signal.SIGTERM)
        try:
            mg.wait(timeout=120)
        except subprocess.TimeoutExpired:
            mg.kill()
    total = 0
    for f in os.listdir(work):
        if f.startswith(f"callgrind.{label}"):
            with open(os.path.join(work, f)) as fh:
                # The header's `summary:` is written before counting; `totals:` is the count.
                for line in fh:
                    m = re.match(r"totals:\s+(\d+)", line)
                    if m:
                        total += int(m.group(1))
    return total


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="driver")
    p.add_argument("--master")
    p.add_argument("--metadata")
    p.add_argument("--tag", default="a")
    p.add_argument("--calls", type=int, default=2000,
                   help="rounds of the workload (5 master-face calls each)")
    p.add_argument("--moongate", default="target/release/moongate")
    p.add_argument("--baseline", default="")
    p.add_argument("--relay", default="", help="the bare relay's binary, counted alike")
    p.add_argument("--extra-config", default="", help="TOML appended to this build's config")
    p.add_argument("--baseline-extra-config", default=None,
                   help="TOML appended to the baseline's config; without --baseline the "
                        "baseline is this build with this config (a config A/B)")
    p.add_argument("--misses", action="store_true",
                   help="one ExistKey of an absent key per round as well")
    p.add_argument("--only", default="", choices=["", "is_exist", "batch_is_exist",
                                                   "get_replica_desc", "put"],
                   help="run one operation per round instead of the mix (a put is two "
                        "calls: PutStart, PutEnd), to price one call type")
    p.add_argument("--max-per-call", type=float, default=0,
                   help="fail (exit 1) when this build's instructions per call exceed it")
    a = p.parse_args()
    if a.role == "client":
        return role_client(a)

    work = work_dir("moongate-cpu-")
    rpc, http = free_port(), free_port()
    metadata = f"http://127.0.0.1:{http}/metadata"
    master = subprocess.Popen(master_cmd(rpc, http), stdout=open(f"{work}/master.log", "w"),
                              stderr=subprocess.STDOUT)
    results = {}
    try:
        runs = [("this", a.moongate, a.extra_config)]
        if a.baseline or a.baseline_extra_config is not None:
            runs.append(("baseline", a.baseline or a.moongate,
                         a.baseline_extra_config if a.baseline_extra_config is not None
                         else a.extra_config))
        if a.relay:
            runs.append(("relay", a.relay, ""))
        for label, binary, extra in runs:
            results[label] = measure(binary, label, rpc, metadata, a.calls, work, extra,
                                     a.misses, a.only)
            print(f"{label} done", file=sys.stderr, flush=True)
    finally:
        stop_all([master])
    # Each round: ExistKey, BatchExistKey(64), GetReplicaList, PutStart, PutEnd (and an
    # ExistKey that misses).
    per_round = {"": 5, "put": 2}.get(a.only, 1) + (1 if a.misses else 0)
    calls = a.calls * per_round
    what = {"": "ExistKey, BatchExistKey x64, GetReplicaList, PutStart, PutEnd",
            "put": "PutStart, PutEnd"}.get(a.only, a.only)
    print(f"\ninstructions moongate executed while {calls} master-face calls went through "
          f"({a.calls} rounds of {what})")
    print(f"{'build':<10} {'instructions':>14} {'per call':>10}")
    for label, total in results.items():
        print(f"{label:<10} {total:>14} {total / calls:>10.0f}")
    if results.get("baseline"):
        print(f"this / baseline: {results['this'] / results['baseline']:.3f}")
    if results.get("relay"):
        print(f"this over the relay: {(results['this'] - results['relay']) / calls:.0f} per call")
    if a.max_per_call:
        per_call = results["this"] / calls
        if not results["this"]:
            print("FAIL: no instructions counted", file=sys.stderr)
            return 1
        if per_call > a.max_per_call:
            print(f"FAIL: {per_call:.0f} instructions per master-face call, above the "
                  f"ceiling of {a.max_per_call:.0f} (docs/results.md)", file=sys.stderr)
            return 1
        print(f"ok: {per_call:.0f} instructions per call, within the ceiling of "
              f"{a.max_per_call:.0f}")
    return 0


if __name__ == "__main__":
    run(main)
