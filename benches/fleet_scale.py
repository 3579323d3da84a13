#!/usr/bin/env python3
"""What a fleet costs: N moongates (`[fleet]` on, one worker thread each) against one
mooncake_master and one etcd (Debian's etcd-server), all on this machine.

Measures, over --seconds: etcd writes per second (etcd's own put counter: an idle
member's record does not change, so it writes nothing), lease renewals per second, and
moongate CPU per member (from /proc); then the time for a membership change to reach
every member: one member SIGKILLed (its lease must run out) and one new member started
(its first write).

Idle by default. With --traffic OPS, benches/fleet_traffic.py drives OPS steps per
second through every member (a put through one, a get of an earlier key through
another: access records travel), with [eviction] on at 0.8 / 0.7 since the writes
outgrow the pool; --records false turns access records off for the comparison.

  python benches/fleet_scale.py --moongate target/release/moongate [--members 32] \
      [--seconds 60] [--interval-ms 1000] [--lease-s 5] [--traffic 200] [--records true]
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
from benchlib import (free_port, master_cmd, run, start_etcd, start_moongate,  # noqa: E402
                      stop_all, wait_http, work_dir)


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
    p.add_argument("--traffic", type=float, default=0, help="steps per second (0: idle)")
    p.add_argument("--records", choices=["true", "false"], default="true")
    a = p.parse_args()
    if not shutil.which("etcd"):
        raise SystemExit("needs Debian's etcd-server (scripts/bootstrap.sh installs it)")
    work = work_dir("moongate-fleet-")
    procs = []
    try:
        etcd = start_etcd(work, procs)
        rpc, http = free_port(), free_port()
        mcmd = master_cmd(rpc, http)
        master_metrics = next(x.split("=", 1)[1] for x in mcmd if x.startswith("--metrics_port="))
        procs.append(subprocess.Popen(mcmd, stdout=open(f"{work}/master.log", "w"),
                                      stderr=subprocess.STDOUT))
        members = {}

        def start(i):
            eviction = ""
            if a.traffic:
                eviction = (f"[eviction]\nenabled = true\nmaster_metrics_url = "
                            f"\"http://127.0.0.1:{master_metrics}/metrics\"\n"
                            f"high_watermark = 0.8\nlow_watermark = 0.7\n")
            members[i] = start_moongate(
                a.moongate, work, f"m{i}",
                f"[master_face]\nupstream = \"127.0.0.1:{rpc}\"\n{eviction}"
                f"[fleet]\nenabled = true\netcd = \"{etcd}\"\ncluster = \"bench\"\n"
                f"member = \"m{i}\"\ninterval_ms = {a.interval_ms}\n"
                f"lease_ttl_s = {a.lease_s}\nrecords = {a.records}\n", procs)

        for i in range(a.members):
            start(i)
        for _, url, _ in members.values():
            wait_http(f"{url}/live")

        def seen(url):
            try:
                return len(json.loads(get(f"{url}/fleet"))["members"])
            except Exception:
                return -1

        def wait_all(n, limit=60):
            t0 = time.monotonic()
            while time.monotonic() - t0 < limit:
                if all(seen(u) == n for _, u, _ in members.values()):
                    return time.monotonic() - t0
                time.sleep(0.05)
            raise SystemExit(f"not every member saw {n} within {limit} s; see {work}")

        wait_all(a.members)
        print(f"{a.members} members see each other (interval {a.interval_ms} ms, "
              f"lease {a.lease_s} s)", flush=True)
        writer = None
        if a.traffic:
            masters = ",".join(m for _, _, m in members.values())
            writer = subprocess.Popen(
                [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                              "fleet_traffic.py"),
                 "--masters", masters, "--metadata", f"http://127.0.0.1:{http}/metadata",
                 "--ops", str(a.traffic), "--seconds", str(a.seconds + 120)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                stderr=open(f"{work}/traffic.log", "w"))
            procs.append(writer)
            if writer.stdout.readline().strip() != "READY":
                raise SystemExit(f"the traffic driver did not start; see {work}/traffic.log")
            time.sleep(5)  # past the clients' set-up and the first records
        m0 = get(f"http://{etcd}/metrics")
        c0 = {i: cpu_s(pr.pid) for i, (pr, _, _) in members.items()}
        etcd_pid = procs[0].pid
        e0 = cpu_s(etcd_pid)
        time.sleep(a.seconds)
        m1 = get(f"http://{etcd}/metrics")
        c1 = {i: cpu_s(pr.pid) for i, (pr, _, _) in members.items()}
        e1 = cpu_s(etcd_pid)
        # etcd 3.4 (Debian's) exports the put counter under both names (the same count:
        # summing them counted every put twice); later releases only etcd_mvcc_*.
        def count(m, names):
            return max(sample(m, n) for n in names)
        put_names = ["etcd_mvcc_put_total", "etcd_debugging_mvcc_put_total"]
        renew_names = ["etcd_debugging_lease_renewed_total"]
        puts = count(m1, put_names) - count(m0, put_names)
        renew = count(m1, renew_names) - count(m0, renew_names)
        cpu = sorted((c1[i] - c0[i]) / a.seconds * 1000 for i in c0)
        mode = (f"{a.traffic:.0f} steps/s, records {a.records}" if a.traffic else "idle")
        if writer:
            writer.stdin.close()
            print(f"traffic: {writer.stdout.readline().strip()}", flush=True)
        print(f"{mode} fleet over {a.seconds:.0f} s: etcd puts {puts / a.seconds:.2f}/s, "
              f"lease renewals {renew / a.seconds:.1f}/s, etcd CPU "
              f"{(e1 - e0) / a.seconds * 1000:.1f} ms/s; moongate CPU per member: median "
              f"{cpu[len(cpu) // 2]:.2f} ms/s, max {cpu[-1]:.2f} ms/s", flush=True)

        victim = a.members - 1
        pr, _, _ = members.pop(victim)
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
