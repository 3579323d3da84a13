#!/usr/bin/env python3
"""CPU instructions moongate spends per kv-face GET, counted by valgrind (callgrind), for
one or two builds: the same owner segment (a real Mooncake client holding kv/4k and
kv/16m), the same keep-alive GETs from examples/kv_bench, instrumentation on only while
they run. Instruction counts repeat where latency on a shared 2-core VM does not: this
is how a change to the kv face's request path is priced.

  python benches/kv_cpu.py --moongate target/release/moongate \\
      [--baseline OTHER_BUILD] [--kv-bench target/release/examples/kv_bench] [--gets 300]
      [--keep-profiles DIR]

--keep-profiles keeps each build's callgrind output per key in DIR
(`callgrind_annotate --inclusive=yes DIR/FILE` shows where the instructions go).
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import free_port, master_cmd, run, spawn_owner, stop_all, wait_http, work_dir  # noqa: E402

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
OWNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kv_face.py")


def measure(binary, label, rpc, metadata, kv_bench, gets, work, keep=None):
    listen, admin, kv = free_port(), free_port(), free_port()
    cfg = os.path.join(work, f"{label}.toml")
    with open(cfg, "w") as f:
        f.write("[policy]\nmax_instances = 1\n")
    out = os.path.join(work, f"callgrind.{label}")
    mg = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
         binary, "run", "--config", cfg, "--listen", f"127.0.0.1:{listen}",
         "--upstream", f"127.0.0.1:{rpc}", "--admin", f"127.0.0.1:{admin}",
         "--kv", f"127.0.0.1:{kv}", "--metadata", metadata],
        stdout=open(os.path.join(work, f"{label}.log"), "w"), stderr=subprocess.STDOUT,
        env={**os.environ, "RUST_LOG": "warn"})
    counts = {}
    try:
        wait_http(f"http://127.0.0.1:{admin}/ready", secs=300)
        for key, n in (("kv%2F4k", gets), ("kv%2F16m", max(4, gets // 50))):
            subprocess.run([kv_bench, f"127.0.0.1:{kv}", key, "5"], check=True,
                           capture_output=True)
            subprocess.run(["callgrind_control", "-z", str(mg.pid)], check=True,
                           stdout=subprocess.DEVNULL)
            subprocess.run(["callgrind_control", "-i", "on", str(mg.pid)], check=True,
                           stdout=subprocess.DEVNULL)
            subprocess.run([kv_bench, f"127.0.0.1:{kv}", key, str(n)], check=True,
                           capture_output=True)
            subprocess.run(["callgrind_control", "-i", "off", str(mg.pid)], check=True,
                           stdout=subprocess.DEVNULL)
            dump = subprocess.run(["callgrind_control", "-d", str(mg.pid)], check=True,
                                  capture_output=True, text=True)
            del dump
            total = 0
            for f in sorted(os.listdir(work)):
                if f.startswith(f"callgrind.{label}."):
                    path = os.path.join(work, f)
                    with open(path) as fh:
                        for line in fh:
                            m = re.match(r"totals:\s+(\d+)", line)
                            if m:
                                total += int(m.group(1))
                    if keep:
                        shutil.copy(path, os.path.join(keep, f"{label}.{key}.{f}"))
                    os.remove(path)
            counts[key] = total / n
    finally:
        mg.send_signal(signal.SIGTERM)
        try:
            mg.wait(timeout=120)
        except subprocess.TimeoutExpired:
            mg.kill()
    return counts


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role")
    p.add_argument("--moongate", default="target/release/moongate")
    p.add_argument("--baseline")
    p.add_argument("--kv-bench", default="target/release/examples/kv_bench")
    p.add_argument("--gets", type=int, default=300)
    p.add_argument("--keep-profiles", help="keep the callgrind outputs in this directory")
    a = p.parse_args()
    work = work_dir("moongate-kvcpu-")
    rpc, http = free_port(), free_port()
    metadata = f"http://127.0.0.1:{http}/metadata"
    procs = [subprocess.Popen(master_cmd(rpc, http), stdout=open(f"{work}/master.log", "w"),
                              stderr=subprocess.STDOUT)]
    try:
        owner = spawn_owner(OWNER, f"127.0.0.1:{rpc}", metadata, work)
        procs.append(owner)
        builds = [("this", a.moongate)] + ([("base", a.baseline)] if a.baseline else [])
        if a.keep_profiles:
            os.makedirs(a.keep_profiles, exist_ok=True)
        res = {label: measure(b, label, rpc, metadata, a.kv_bench, a.gets, work,
                              a.keep_profiles)
               for label, b in builds}
        owner.stdin.close()
    finally:
        stop_all(procs)
    print(f"{'instructions per GET':<24}" + "".join(f"{label:>16}" for label in res))
    for key in ("kv%2F4k", "kv%2F16m"):
        print(f"{key:<24}" + "".join(f"{res[label][key]:>16.0f}" for label in res))
    if a.baseline:
        for key in ("kv%2F4k", "kv%2F16m"):
            print(f"{key} this/base: {res['this'][key] / res['base'][key]:.3f}")


if __name__ == "__main__":
    run(main)
