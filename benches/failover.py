#!/usr/bin/env python3
"""Master failover, directly and through moongate, in one run.

A real etcd, two `mooncake_master --enable_ha` (the pinned release), Mooncake's standalone
metadata server and moongate (`upstream = "etcd://..."`). A real client puts small values
in a loop, either directly (`master_server_address = "etcd://..."`, Mooncake's own
discovery) or through moongate (`master_server_address` = moongate). For each kill the
leader gets SIGKILL; measured: the time until the standby serves (its admin `/health`
says `serving`) and until the client's first good put after the kill. The killed master
is started again (it stands by) before the next kill. Sides alternate, --kills each.
`--sides direct,moongate,moongate-no-hold` adds a second moongate with
`master_face.failover_hold_ms = 0` (its client's ping not held for the new leader: it
remounts at its next once-a-second retry), for the hold's A/B in one run.

  benches/run_failover.sh --kills 5      (builds moongate in release mode first)

Needs Debian's etcd-server. Not part of CI: each kill costs ~10 s of lease expiry and
warm-up.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import free_port, run, start_etcd, stop_all, wait_http, work_dir  # noqa: E402

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


def role_putter(a):
    """Puts until stdin closes; prints `OK <wall time>` at the first good put after a
    failure (and at the very first), so the driver sees recovery times."""
    import select
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", a.metadata, 16 << 20, 16 << 20, "tcp", "", a.master)
    if rc != 0:
        raise SystemExit(f"setup failed: {rc}")
    print("READY", flush=True)
    failing = True
    i = 0
    while not select.select([sys.stdin], [], [], 0)[0]:
        ok = s.upsert(f"fo/{i % 64}", b"x" * 4096) == 0
        if ok and failing:
            print(f"OK {time.time():.6f}", flush=True)
        failing = not ok
        i += 1
        if not ok:
            time.sleep(0.01)
    s.close()


def health(admin):
    try:
        with urllib.request.urlopen(f"http://{admin}/health", timeout=1) as r:
            return json.loads(r.read()).get("ha_state", "")
    except (OSError, ValueError):
        return ""


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="driver")
    p.add_argument("--master")
    p.add_argument("--metadata")
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--moongate", default="target/release/moongate")
    p.add_argument("--json")
    p.add_argument("--sides", default="direct,moongate",
                   help="direct, moongate, moongate-no-hold (comma-separated, in turn)")
    a = p.parse_args()
    if a.role == "putter":
        return role_putter(a)
    import mooncake
    master_bin = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    work = work_dir("moongate-failover-")
    procs = []
    masters = {}

    def start_master(name):
        rpc, admin = free_port(), free_port()
        pr = subprocess.Popen(
            [master_bin, "--enable_ha=true", f"--etcd_endpoints={etcd}", f"--rpc_port={rpc}",
             "--rpc_address=127.0.0.1", f"--metrics_port={admin}", "--metrics_host=127.0.0.1",
             "--enable_metric_reporting=false"],
            cwd=work, stdout=open(f"{work}/{name}.log", "a"), stderr=subprocess.STDOUT)
        procs.append(pr)
        masters[name] = (pr, f"127.0.0.1:{admin}")

    def leader():
        for name, (pr, admin) in masters.items():
            if pr.poll() is None and health(admin) == "serving":
                return name
        return None

    def wait(pred, secs, what):
        end = time.time() + secs
        while time.time() < end:
            v = pred()
            if v:
                return v
            time.sleep(0.02)
        raise SystemExit(f"timed out waiting for {what}; see {work}")

    sides = [x for x in a.sides.split(",") if x]
    if not sides or set(sides) - {"direct", "moongate", "moongate-no-hold"}:
        raise SystemExit(f"--sides: {a.sides!r}")
    res = {x: [] for x in sides}
    try:
        etcd = start_etcd(work, procs)
        mdport = free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "mooncake.http_metadata_server", "--host", "127.0.0.1",
             "--port", str(mdport)],
            stdout=open(f"{work}/metadata.log", "w"), stderr=subprocess.STDOUT))
        metadata = f"http://127.0.0.1:{mdport}/metadata"
        wait(lambda: subprocess.run(["curl", "-s", "-o", "/dev/null", metadata + "?key=x"])
             .returncode == 0, 30, "the metadata server")
        start_master("m0")
        start_master("m1")
        wait(leader, 30, "a leader")
        # One moongate a moongate side (the second with the hold off).
        mg_ports = {}
        for side in [x for x in sides if x != "direct"]:
            mg_port, mg_admin = free_port(), f"127.0.0.1:{free_port()}"
            hold = "failover_hold_ms = 0\n" if side == "moongate-no-hold" else ""
            with open(f"{work}/{side}.toml", "w") as f:
                f.write(f'[master_face]\nlisten = "127.0.0.1:{mg_port}"\nupstream = "etcd://{etcd}"\n'
                        f'{hold}[admin]\nlisten = "{mg_admin}"\n')
            procs.append(subprocess.Popen(
                [a.moongate, "run", "--config", f"{work}/{side}.toml"],
                stdout=open(f"{work}/{side}.log", "w"), stderr=subprocess.STDOUT,
                env={**os.environ, "RUST_LOG": "info"}))
            wait_http(f"http://{mg_admin}/ready")
            mg_ports[side] = mg_port
        for k in range(len(sides) * a.kills):
            side = sides[k % len(sides)]
            master = f"etcd://{etcd}" if side == "direct" else f"127.0.0.1:{mg_ports[side]}"
            putter = subprocess.Popen(
                [sys.executable, __file__, "--role", "putter", "--master", master,
                 "--metadata", metadata],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                stderr=open(f"{work}/putter-{k}.log", "w"))
            if putter.stdout.readline().strip() != "READY":
                raise SystemExit(f"putter did not start; see {work}")
            first = putter.stdout.readline()  # its first good put
            if not first.startswith("OK"):
                raise SystemExit(f"putter: {first!r}; see {work}")
            old = wait(leader, 30, "a leader")
            killed = time.time()
            masters[old][0].send_signal(signal.SIGKILL)
            new = wait(lambda: (lambda n: n if n and n != old else None)(leader()), 60,
                       "the standby serving")
            serving = time.time()
            line = putter.stdout.readline()
            if not line.startswith("OK"):
                raise SystemExit(f"putter did not recover: {line!r}; see {work}")
            good = float(line.split()[1])
            putter.stdin.close()
            try:
                putter.wait(15)
            except subprocess.TimeoutExpired:
                # Mooncake's close() can hang after a failover (direct mode seen); the
                # measurement is taken, the process is not needed any more.
                putter.kill()
                putter.wait(5)
            res[side].append({"serving_s": serving - killed, "first_put_s": good - killed,
                              "after_serving_s": good - serving})
            print(f"kill {k + 1}/{len(sides) * a.kills} ({side}): standby serving after "
                  f"{serving - killed:.2f} s, first good put after {good - killed:.2f} s",
                  file=sys.stderr, flush=True)
            masters[old][0].wait(10)
            start_master(old)  # back as the standby for the next kill
            wait(lambda: health(masters[old][1]) == "standby", 30, "the restarted standby")
    finally:
        stop_all(procs)
    med = lambda s, m: statistics.median(r[m] for r in res[s])
    print(f"\nmedians over {a.kills} kills per side (SIGKILL of the leader)")
    print(f"{'':<34}" + "".join(f"{x:>18}" for x in sides))
    for m, label in (("serving_s", "standby serving after kill (s)"),
                     ("first_put_s", "first good put after kill (s)"),
                     ("after_serving_s", "first good put after serving (s)")):
        d = med("direct", m) if "direct" in res else None
        cells = []
        for x in sides:
            v = med(x, m)
            ratio = f" ({v / d:.2f}x)" if d and x != "direct" else ""
            cells.append(f"{v:.2f}{ratio}")
        print(f"{label:<34}" + "".join(f"{c:>18}" for c in cells))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    run(main)
