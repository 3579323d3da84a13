#!/usr/bin/env python3
"""What a fleet costs: N moongates (`[fleet]` on, one worker thread each) against one
mooncake_master and one etcd (Debian's etcd-server), all on this machine.

Measures, for an idle fleet over --seconds: etcd writes per second (etcd's own put
counter: an idle member's record does not change, so it writes nothing), lease renewals
per second, and moongate CPU per member (from
/proc); then the time for a membership change to reach every member: one member
SIGKILLed (its lease must run out) and one new member started (its first write).

  python benches/fleet_scale.py --moongate target/release/moongate [--members 32] \
      [--seconds 60] [--interval-ms 1000] [--lease-s 5]
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import free_port, master_cmd, run, start_etcd, stop_all, wait_http, work_dir  # noqa: E402


def get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def sample(text, name):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--moongate", default="target/release/moongate")
    p.add_argument("--members", type=int, default=32)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--interval-ms", type=int, default=1000)
    p.add_argument("--lease-s", type=int, default=5)
    a = p.parse_args()
    if not shutil.which("etcd"):
        raise SystemExit("needs Debian's etcd-server (scripts/bootstrap.sh installs it)")
    work = work_dir("moongate-fleet-")
    procs = []
    try:
        etcd = start_etcd(work, procs)
        rpc, http = free_port(), free_port()
        procs.append(subprocess.Popen(master_cmd(rpc, http), stdout=open(f"{work}/master.log", "w"),
                                      stderr=subprocess.STDOUT))
        members = {}

        def start(i):
            admin, listen = free_port(), free_port()
            cfg = f"{work}/m{i}.toml"
            with open(cfg, "w") as f:
                f.write(f"[master_face]\nupstream = \"127.0.0.1:{rpc}\"\n"
                        f"[fleet]\nenabled = true\netcd = \"{etcd}\"\ncluster = \"bench\"\n"
                        f"member = \"m{i}\"\ninterval_ms = {a.interval_ms}\n"
                        f"lease_ttl_s = {a.lease_s}\n")
            pr = subprocess.Popen([a.moongate, "run", "--config", cfg, "--listen",
                                   f"127.0.0.1:{listen}", "--admin", f"127.0.0.1:{admin}"],
                                  stdout=open(f"{work}/m{i}.log", "w"), stderr=subprocess.STDOUT,
                                  env={**os.environ, "RUST_LOG": "warn"})
            procs.append(pr)
            members[i] = (pr, f"http://127.0.0.1:{admin}")

        for i in range(a.members):
            start(i)
        for _, url in members.values():
            wait_http(f"{url}/live")

        def seen(url):
            try:
                return len(json.loads(get(f"{url}/fleet"))["members"])
            except Exception:
                return -1

        def wait_all(n, limit=60):
            t0 = time.monotonic()
            while time.monotonic() - t0 < limit:
                if all(seen(u) == n for _, u in members.values()):
                    return time.monotonic() - t0
                time.sleep(0.05)
            raise SystemExit(f"not every member saw {n} within {limit} s; see {work}")

        wait_all(a.members)
        print(f"{a.members} members see each other (interval {a.interval_ms} ms, "
              f"lease {a.lease_s} s)", flush=True)
        m0 = get(f"http://{etcd}/metrics")
        c0 = {i: cpu_s(pr.pid) for i, (pr, _) in members.items()}
        etcd_pid = procs[0].pid
        e0 = cpu_s(etcd_pid)
        time.sleep(a.seconds)
        m1 = get(f"http://{etcd}/metrics")
        c1 = {i: cpu_s(pr.pid) for i, (pr, _) in members.items()}
        e1 = cpu_s(etcd_pid)
        # etcd 3.4 (Debian's) names them etcd_debugging_*; later ones etcd_mvcc_*.
        def count(m, names):
            return sum(sample(m, n) for n in names)
        put_names = ["etcd_mvcc_put_total", "etcd_debugging_mvcc_put_total"]
        renew_names = ["etcd_debugging_lease_renewed_total"]
        puts = count(m1, put_names) - count(m0, put_names)
        renew = count(m1, renew_names) - count(m0, renew_names)
        cpu = sorted((c1[i] - c0[i]) / a.seconds * 1000 for i in c0)
        print(f"idle fleet over {a.seconds:.0f} s: etcd puts {puts / a.seconds:.2f}/s, "
              f"lease renewals {renew / a.seconds:.1f}/s, etcd CPU "
              f"{(e1 - e0) / a.seconds * 1000:.1f} ms/s; moongate CPU per member: median "
              f"{cpu[len(cpu) // 2]:.2f} ms/s, max {cpu[-1]:.2f} ms/s", flush=True)

        victim = a.members - 1
        pr, _ = members.pop(victim)
        t0 = time.monotonic()
        pr.send_signal(signal.SIGKILL)
        pr.wait()
        wait_all(a.members - 1)
        left = time.monotonic() - t0
        t0 = time.monotonic()
        start(a.members)
        wait_all(a.members)
        joined = time.monotonic() - t0
        print(f"membership changes reached all members: a SIGKILLed member left every view "
              f"in {left:.2f} s (lease {a.lease_s} s); a new member was in every view "
              f"{joined:.2f} s after its start (process start included)", flush=True)
    finally:
        stop_all(procs)


if __name__ == "__main__":
    run(main)
