#!/usr/bin/env python3
"""SSD reads in vLLM's owner-client topology: a requester-only rank's batch load of
values that sit on the owner's SSD, read by Mooncake's client directly from the owner
and through moongate's owner face (whole, and cut into parts the owner serves in
parallel), in one run, rounds interleaved.

One mooncake_master (offload on), one owner (mooncake_client --enable_offload=true,
64 MB pool, SSD in a scratch directory), a writer that puts --keys values of 1 MiB
(most land only on the SSD), then one reader process per variant, each doing
batch_get_into of every key, --rounds times, the variants' order rotated each round:

  direct   the reader's master is the master: Mooncake alone
  off      through moongate, [owner_face] off (lookups through moongate, SSD reads direct)
  whole    [owner_face] on, reads relayed whole
  cutN     [owner_face] on, part_keys = N (for each N in --cuts)

Reported per variant: median and best load time, GB/s of the bytes read, and (owner
face variants) the keys moongate saw staged from the SSD per load. Not part of CI
(timing noise); run with benches/run_owner_face.sh.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import free_port, run, stop_all, wait_http, wait_port, work_dir  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests/py/owner_topology.py")
OWNER_ENV = {
    "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "bucket_storage_backend",
    "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT": "10",
    "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES": "10485760",
    "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": "1",
    "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": "268435456",
    "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": "4294967296",
}


def metrics(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def sample(text, name):
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--moongate", required=True)
    p.add_argument("--keys", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cuts", default="16,4")
    a = p.parse_args()
    work = work_dir("owner-face-")
    procs = []
    try:
        import mooncake
        bindir = os.path.dirname(mooncake.__file__)
        rpc, http, mport = free_port(), free_port(), free_port()
        procs.append(subprocess.Popen(
            [os.path.join(bindir, "mooncake_master"), f"--rpc_port={rpc}",
             "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
             "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
             f"--metrics_port={mport}", "--metrics_host=127.0.0.1", "--enable_offload=true"],
            stdout=open(f"{work}/master.log", "w"), stderr=subprocess.STDOUT))
        master, metadata = f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"
        wait_port(http)
        wait_port(rpc)

        variants = [("off", {"enabled": "false"}), ("whole", {"enabled": "true"})]
        variants += [(f"cut{n}", {"enabled": "true", "part_keys": n})
                     for n in map(int, a.cuts.split(","))]
        gates = {}
        for name, face in variants:
            port, admin = free_port(), free_port()
            cfg = f"{work}/{name}.toml"
            with open(cfg, "w") as f:
                f.write(f'[master_face]\nlisten = "127.0.0.1:{port}"\nupstream = "{master}"\n'
                        f'[admin]\nlisten = "127.0.0.1:{admin}"\n[owner_face]\n')
                for k, v in face.items():
                    f.write(f"{k} = {v}\n")
            procs.append(subprocess.Popen([a.moongate, "run", "--config", cfg],
                                          stdout=open(f"{work}/{name}.log", "w"),
                                          stderr=subprocess.STDOUT))
            wait_http(f"http://127.0.0.1:{admin}/ready")
            gates[name] = (f"127.0.0.1:{port}", f"http://127.0.0.1:{admin}/metrics")

        ssd = f"{work}/ssd"
        os.makedirs(ssd)
        env = dict(os.environ, MOONCAKE_OFFLOAD_FILE_STORAGE_PATH=ssd, **OWNER_ENV)
        owner_port = free_port()
        procs.append(subprocess.Popen(
            [os.path.join(bindir, "mooncake_client"), "--host=127.0.0.1",
             f"--port={owner_port}", f"--master_server_address={master}",
             f"--metadata_server={metadata}", "--global_segment_size=64 MB", "--protocol=tcp",
             "--enable_offload=true", "--start_offload_rpc_server=true", "--logtostderr"],
            env=env, stdout=open(f"{work}/owner.log", "w"), stderr=subprocess.STDOUT))
        # The owner is up once it reported its SSD to the master.
        end = time.time() + 60
        while sample(metrics(f"http://127.0.0.1:{mport}/metrics"),
                     "master_total_file_capacity_bytes") <= 0 and time.time() < end:
            time.sleep(0.2)

        role = [sys.executable, SCRIPT, "--metadata", metadata,
                "--owner", f"127.0.0.1:{owner_port}"]
        w = subprocess.run(role + ["--role", "writer", "--master", master, "--out",
                                   f"{work}/writer.json", "--keys", str(a.keys),
                                   "--pace-ms", "20"],
                           stdout=open(f"{work}/writer.log", "w"), stderr=subprocess.STDOUT)
        if w.returncode != 0:
            print("writer failed; see", work)
            return 1
        # Offloads land within a few heartbeats; wait until the SSD stops growing.
        last, still = -1.0, 0
        while still < 5:
            used = sample(metrics(f"http://127.0.0.1:{mport}/metrics"),
                          "master_allocated_file_size_bytes")
            still = still + 1 if used == last else 0
            last = used
            time.sleep(0.5)
        print(f"SSD holds {last / 2**20:.0f} MiB of {a.keys} MiB written")

        readers = {}
        for name, addr in [("direct", master)] + [(n, gates[n][0]) for n, _ in variants]:
            r = subprocess.Popen(role + ["--role", "reader", "--master", addr, "--out",
                                         f"{work}/{name}.json"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=open(f"{work}/reader-{name}.log", "w"), text=True)
            if not r.stdout.readline().startswith("READY"):
                print("reader", name, "did not start; see", work)
                return 1
            readers[name] = r

        names = list(readers)
        times = {n: [] for n in names}
        disk = {n: [] for n in names}
        exact = {n: set() for n in names}
        for rnd in range(a.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for n in order:
                before = sample(metrics(gates[n][1]), "moongate_owner_face_read_keys_total") \
                    if n in gates else 0
                readers[n].stdin.write(f"load 0 {a.keys}\n")
                readers[n].stdin.flush()
                out = json.loads(readers[n].stdout.readline().split(" ", 1)[1])
                if out["corrupt"]:
                    print("corrupt values read by", n)
                    return 1
                times[n].append(out["elapsed_s"])
                exact[n].add(out["exact"])
                if n in gates:
                    disk[n].append(sample(metrics(gates[n][1]),
                                          "moongate_owner_face_read_keys_total") - before)
        mib = max(max(e) for e in exact.values())
        base = statistics.median(times["direct"])
        print(f"{a.keys} keys of 1 MiB, {a.rounds} rounds; values read per load: "
              + ", ".join(f"{n} {sorted(exact[n])}" for n in names))
        print(f"{'variant':8} {'median ms':>10} {'best ms':>8} {'GB/s':>6} {'x direct':>9} "
              f"{'SSD keys/load':>14}")
        for n in names:
            med = statistics.median(times[n])
            ssd_keys = f"{statistics.median(disk[n]):.0f}" if disk[n] else "-"
            print(f"{n:8} {med * 1e3:10.1f} {min(times[n]) * 1e3:8.1f} "
                  f"{mib * 2**20 / med / 1e9:6.2f} {med / base:9.2f} {ssd_keys:>14}")
        for r in readers.values():
            r.stdin.write("quit\n")
            r.stdin.flush()
            r.wait(timeout=30)
        return 0
    finally:
        stop_all(procs)


if __name__ == "__main__":
    run(main)
