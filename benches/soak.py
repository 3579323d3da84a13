#!/usr/bin/env python3
"""moongate over time, with faults: a soak (not CI).

What runs, all real and on loopback: etcd, an HA pair of `mooncake_master` (the pinned
release, `--enable_oplog` so objects survive a failover), Mooncake's metadata server, an
owner (a Mooncake client mounting a 1 GiB segment, the pool's memory), and moongate
in front of the pair (`upstream = "etcd://..."`) with the kv face (TCP, a Unix socket, a
64 MiB own segment), hints, KV events and eviction on (0.4 / 0.35 of the pool, which
the traffic's working sets, ~43 %, keep it busy at; the masters' own eviction set out
of the way at 0.98, so every eviction is moongate's and accounted).

Traffic, each a process of its own, each writing fresh keys whose bytes follow from the
key, reading back keys it was acknowledged, and checking every byte:
- `mc`: a Mooncake client (`MooncakeDistributedStore`) through the master face;
- `http`: an engine on the kv face over TCP, which also posts hints (`done` for keys it
  will not read again, `upcoming` for the next ones);
- `lib`: an engine through `libmoongate_kv` on the Unix socket (the C library);
- a KV-events subscriber counting what moongate publishes.
A key read back missing is asked of moongate (`/keys/KEY`): evicted by moongate is an
eviction, accounted per key; the others are accounted by count against the masters' own
evictions (their logs' EVICT-RESULT lines: the master does not say which keys), and any
beyond those are lost puts. Bytes that differ are a wrong read. moongate's usage trigger
reads both masters' pages, so it follows the failovers.

Faults, on a schedule (one every `--fault-every` seconds, in turn; `--faults` picks some):
SIGKILL of the leading master (restarted as the standby), SIGSTOP of the owner for 5 s (a
stall within the masters' 10 s client_ttl: nothing may be lost), SIGSTOP of the owner for
15 s (past client_ttl: the masters declare it dead and drop its segment, and every object
in it, by Mooncake's rules: reported as `dropped_with_owner`, not as lost puts), etcd
stopped for 10 s and started again, a faulty plugin activated (it traps on every second
put: moongate rolls back), a flood of 300 stalled bodies on the kv face for 20 s, and a
client sending garbage to the master face and the kv face. A plugin swap (lru <-> the
default) every minute besides. For each fault: the time until every traffic process that
failed after it succeeded again (0 when none failed).

Each key read back missing that moongate did not remove is placed by the first fault
between its put and that read (`lost_by_fault`: per fault kind, how many, moongate's
reason, and how long before the fault they were put; `no_fault_between` for the rest).
A key put after the new leader that followed a master kill or etcd stop began serving
was acknowledged by that leader: gone later, it is `put_to_a_new_leader_then_dropped_by_it`
(that leader's own evictions: the masters' logs give each new leader's evictions in
its first 30 s; a restored leader has evicted the freshest puts of every client at
once), not a loss to the change.

moongate's RSS, open descriptors and heap (`moongate_heap_bytes`: in use, kept free) are
sampled every 5 s; growth is the median of the last tenth of the run over the median of
the tenth after warm-up (the first 10 %).

Two arms, run side by side on the same host with the same seed, schedule and faults
(`--arms moongate,control`, the default): `moongate` as above, and `control`, the same
`mc` traffic and owner with Mooncake's clients talking to the masters directly
(`etcd://`), no moongate, no kv-face engines (they have no direct equivalent). The
faults that need moongate (the faulty plugin, the kv-face flood) are skipped there at
their turn; garbage goes to the leader's RPC port. Both arms' lost puts per fault kind
go in one table (`arms.md` in --out). `mc` keeps its working set bounded (it removes
its keys beyond the last 2,500, 160 MiB, which the pool holds) so that in the control
arm, where no moongate evicts, the masters never evict either: every key read back
missing there is a lost put.

Memory growth is measured from the moment moongate's bounded tables are full or level
(the key table, its history, the hint table, the kv face's known keys and failover
window: their sizes are sampled from the metrics with the others; a table is level from
the first sample after which it never grows by more than 2 %), to the end
(`bounds_filled_s`, `rss_growth_pct` and the heap's from there).

    bash benches/soak.sh --minutes 30          (builds moongate in release mode first)

Ends by printing one JSON line: requests, wrong_reads, lost_puts, evicted,
dropped_with_owner, lost_by_fault, rss_growth_pct, fd_growth_pct, faults [{kind, at_s,
recovered_s}], errors by kind, and where the samples (CSV) and the plot (SVG) were
written (--out).
"""
import argparse
import collections
import datetime
import hashlib
import json
import os
import random
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import free_port, run, start_etcd, stop_all, wait_http, work_dir  # noqa: E402

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VALUE = 64 << 10
# Each traffic process reads back among its last this many acknowledged keys and
# removes its keys beyond KEEP (a working set of 2,500 x 64 KiB = 160 MiB each, which the
# pool holds: the masters never need to evict, so every key read back missing is
# accounted for by what moongate says of it, or lost).
READ_WINDOW = 2000
KEEP = 2500
# Keys read back missing that each traffic process reads again at its end.
LOST_RECHECK = 5000
# A key read back missing is read again this long after (once), and at the end: one
# found then was missing for a while (a leader change's recovery: restored keys answer
# 404 until their owner remounts, lost ones until moongate puts them again), not lost.
# Found, it is tracked again (read and removed in turn), so that a later fault that
# loses it counts it then.
MISSING_RECHECK_S = 20


def value_of(key, size=VALUE):
    block = hashlib.sha256(key.encode()).digest()
    return (block * (size // len(block) + 1))[:size]


def why_gone(admin, key):
    """What moongate's history says of a key that read back missing."""
    if not admin:
        return "no_moongate"
    try:
        url = f"{admin}/keys/{urllib.parse.quote(key, safe='')}"
        with urllib.request.urlopen(url, timeout=5) as r:
            v = json.loads(r.read())
        end = v.get("last_end") or {}
        return end.get("why") or ("stored" if v.get("stored") else "unknown")
    except Exception as e:  # noqa: BLE001
        return f"unreadable: {e}"


class Traffic:
    """One traffic process's loop: put a fresh key, read back an acknowledged one; the
    counts, and `FAIL` / `OK` lines at each change, go to stdout."""

    def __init__(self, name, admin):
        self.name, self.admin = name, admin
        self.rate = float(os.environ.get("SOAK_RATE", "0"))
        self.acked = []
        # When each acknowledged key was put, to place a lost one among the faults.
        self.put_at = {}
        self.counts = {"requests": 0, "wrong_reads": 0, "missing_other": 0, "evicted": 0,
                       "errors": {}}
        self.failing = False
        self.lost = []
        self.wrong = []
        # How the last read was served, where a role tells paths apart.
        self.path = ""

    def said(self, ok, kind=""):
        if ok and self.failing:
            print(f"OK {time.time():.3f}", flush=True)
        elif not ok and not self.failing:
            print(f"FAIL {time.time():.3f} {kind}", flush=True)
        self.failing = not ok
        if not ok:
            self.counts["errors"][kind] = self.counts["errors"].get(kind, 0) + 1

    def loop(self, put, get, extra=None, remove=None, keep=0):
        i, last = 0, time.time()
        # Keys to remove (beyond the last `keep`), retried while leased.
        doomed = []
        # Keys read back missing, with when to read them again.
        again = collections.deque()
        while not select.select([sys.stdin], [], [], 0)[0]:
            # The default policy names `PREFIX/blk/N` as block N, so KV events are
            # published for these keys.
            key = f"soak-{self.name}/blk/{i}"
            i += 1
            self.counts["requests"] += 1
            try:
                ok = put(key, value_of(key))
                kind = "" if ok is True else f"put:{ok}"
                ok = ok is True
            except Exception as e:  # noqa: BLE001
                ok, kind = False, f"put:{type(e).__name__}"
            self.said(ok, kind)
            if ok:
                self.acked.append(key)
                self.put_at[key] = time.time()
                if remove and len(self.acked) > keep:
                    old = self.acked.pop(0)
                    self.put_at.pop(old, None)
                    doomed.append(old)
            # A leased key (read lately) cannot be removed yet: tried again later, a few
            # at a time so that the backlog drains.
            for _ in range(min(3, len(doomed))):
                k = doomed.pop(0)
                try:
                    gone = remove(k)
                except Exception:  # noqa: BLE001
                    gone = False
                if not gone:
                    doomed.append(k)
            if self.acked:
                k = random.choice(self.acked[-READ_WINDOW:])
                self.counts["requests"] += 1
                try:
                    got = get(k)
                    if got is None:
                        why = why_gone(self.admin, k)
                        if why == "evicted_by_moongate":
                            self.counts["evicted"] += 1
                        else:
                            self.counts["missing_other"] += 1
                            self.lost.append((k, why))
                            again.append((time.time() + MISSING_RECHECK_S, k))
                            print(f"LOST {k} {why} {self.put_at.get(k, 0):.3f} "
                                  f"{time.time():.3f}", flush=True)
                        self.acked.remove(k)
                        self.said(True)
                    elif got != value_of(k):
                        self.counts["wrong_reads"] += 1
                        want = value_of(k)
                        at = next((j for j, (x, y) in enumerate(zip(got, want)) if x != y),
                                  min(len(got), len(want)))
                        self.wrong.append({"key": k, "len": len(got), "first_diff": at,
                                           "at": round(time.time(), 1), "path": self.path,
                                           "put_at": round(self.put_at.get(k, 0), 1),
                                           "is_other_key": next(
                                               (o for o in self.acked[-4000:]
                                                if value_of(o)[:32] == got[:32]), None)})
                        print(f"WRONG {json.dumps(self.wrong[-1])}", flush=True)
                        self.said(True)
                    else:
                        self.said(True)
                except Exception as e:  # noqa: BLE001
                    self.said(False, f"get:{type(e).__name__}")
            while again and again[0][0] <= time.time():
                _, k = again.popleft()
                try:
                    back = get(k) == value_of(k)
                except Exception:  # noqa: BLE001
                    back = False
                if back:
                    print(f"FOUND {k} {time.time():.3f}", flush=True)
                    self.acked.append(k)
                    self.put_at[k] = time.time()
                elif why_gone(self.admin, k) == "evicted_by_moongate":
                    # Back for a while (put again after a leader change), then evicted
                    # by moongate: not lost.
                    print(f"FOUND {k} {time.time():.3f} evicted_by_moongate", flush=True)
            if extra:
                extra(i)
            if not ok:
                time.sleep(0.05)
            elif self.rate:
                time.sleep(1.0 / self.rate)
            if time.time() - last > 5:
                last = time.time()
                print("COUNTS " + json.dumps(self.counts), flush=True)
        # Keys read back missing, read again now that the faults are over: one that
        # reads back with its bytes was missing for a while (a leader change's
        # recovery), not lost.
        found = 0
        for k, _ in self.lost[:LOST_RECHECK]:
            try:
                got = get(k)
            except Exception:  # noqa: BLE001
                got = None
            if got == value_of(k):
                found += 1
                print(f"FOUND {k} {time.time():.3f}", flush=True)
        self.counts["found_at_end"] = found
        self.counts["lost_keys"] = self.lost[:20]
        self.counts["wrong"] = self.wrong[:20]
        print("COUNTS " + json.dumps(self.counts), flush=True)


def role_mc(a):
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", a.metadata, 32 << 20, 32 << 20, "tcp", "", a.master)
    if rc != 0:
        raise SystemExit(f"setup failed: {rc}")
    print("READY", flush=True)
    t = Traffic("mc", a.admin)

    def get(k):
        b = s.get(k)
        if b:
            return b
        # An empty answer is any failure of the read; the key is missing only when the
        # master says so.
        if s.is_exist(k) != 0:
            raise RuntimeError("empty read of a key that exists")
        return None

    t.loop(lambda k, v: s.put(k, v) == 0 or "rc", get,
           remove=lambda k: s.remove(k) == 0 or s.is_exist(k) == 0, keep=KEEP)
    os._exit(0)  # Mooncake's close() can hang after a failover


def role_owner(a):
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", a.metadata, 1 << 30, 16 << 20, "tcp", "", a.master)
    if rc != 0:
        raise SystemExit(f"owner setup failed: {rc}")
    print("READY", flush=True)
    sys.stdin.read()
    os._exit(0)


def role_http(a):
    import http.client
    host, port = a.kv.split(":")
    conn = [None]

    def call(method, path, body=None):
        for attempt in range(2):
            if conn[0] is None:
                conn[0] = http.client.HTTPConnection(host, int(port), timeout=30)
            try:
                conn[0].request(method, path, body=body)
                r = conn[0].getresponse()
                return r.status, r.read()
            except (OSError, http.client.HTTPException):
                conn[0].close()
                conn[0] = None
                if attempt:
                    raise

    def put(k, v):
        st, _ = call("PUT", "/v1/kv/" + urllib.parse.quote(k, safe=""), v)
        return st in (200, 201) or st

    def get(k):
        st, b = call("GET", "/v1/kv/" + urllib.parse.quote(k, safe=""))
        if st == 404:
            return None
        if st != 200:
            raise RuntimeError(f"GET {st}")
        return b

    def hints(i):
        if i % 20:
            return
        done = [f"soak-http/blk/{j}" for j in range(max(0, i - 400), i - 380)]
        nxt = [f"soak-http/blk/{j}" for j in range(i, i + 20)]
        body = json.dumps({"hints": [{"kind": "done", "keys": done},
                                     {"kind": "upcoming", "keys": nxt, "in_ms": 500}]})
        try:
            call("POST", "/v1/hints", body.encode())
        except Exception:  # noqa: BLE001
            pass

    def remove(k):
        st, _ = call("DELETE", "/v1/kv/" + urllib.parse.quote(k, safe=""))
        return st in (200, 204, 404)

    print("READY", flush=True)
    Traffic("http", a.admin).loop(put, get, hints, remove=remove, keep=KEEP)


def role_lib(a):
    sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
    import moongate_kv
    c = moongate_kv.Client("unix:" + a.sock)

    def put(k, v):
        c.put(k, v)
        return True

    t = Traffic("lib", a.admin)

    def get(k):
        # Client.get's two paths, apart, so that a wrong read says which one it took.
        try:
            try:
                with c.view(k) as v:
                    t.path = "view"
                    return bytes(v.buffer)
            except moongate_kv.NotLocal:
                t.path = "get_into"
                return bytes(c.get(k))
        except moongate_kv.NotFound:
            return None

    def remove(k):
        try:
            c.remove(k)
        except moongate_kv.NotFound:
            pass
        return True

    print("READY", flush=True)
    t.loop(put, get, remove=remove, keep=KEEP)


def role_events(a):
    import zmq
    ctx = zmq.Context()
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(a.endpoint)
    print("READY", flush=True)
    n, last = 0, time.time()
    while not select.select([sys.stdin], [], [], 0)[0]:
        if s.poll(200):
            s.recv_multipart()
            n += 1
        if time.time() - last > 5:
            last = time.time()
            print("COUNTS " + json.dumps({"events": n}), flush=True)
    print("COUNTS " + json.dumps({"events": n}), flush=True)


def proc_stat(pid):
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


class Role:
    """A traffic process, its latest counts and its FAIL / OK lines."""

    def __init__(self, name, args, work):
        self.name = name
        self.p = subprocess.Popen([sys.executable, __file__, "--role", name,
                                   "--seed", os.environ.get("SOAK_SEED", "1")] + args,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  stderr=open(f"{work}/{name}.log", "w"))
        line = self.p.stdout.readline()
        if not line.startswith("READY"):
            raise SystemExit(f"{name} did not start ({line!r}); see {work}/{name}.log")
        self.counts, self.changes = {}, []
        # (key, why, put at, read missing at) of each key gone that moongate did not remove.
        self.lost = []
        # Those of them that read back later (a minute after, or at the end): missing
        # for a while, not lost; when each was found.
        self.found = {}
        threading.Thread(target=self.read, daemon=True).start()

    def read(self):
        for line in self.p.stdout:
            w = line.split(maxsplit=1)
            if not w:
                continue
            if w[0] == "COUNTS":
                self.counts = json.loads(w[1])
            elif w[0] in ("FAIL", "OK"):
                self.changes.append((w[0], float(w[1].split()[0])))
            elif w[0] == "LOST":
                k, why, put, gone = w[1].split()
                self.lost.append((k, why, float(put), float(gone)))
            elif w[0] == "FOUND":
                k, at = w[1].split()[:2]
                self.found.setdefault(k, []).append(float(at))

    def recovered(self, since):
        """Seconds from `since` to the first OK after a failure at or after it (0 when it
        did not fail; None when it has not recovered)."""
        fails = [t for s, t in self.changes if s == "FAIL" and t >= since - 0.5]
        if not fails:
            # A failure that began just before and was still on counts too.
            state = [s for s, t in self.changes if t < since]
            if not state or state[-1] != "FAIL":
                return 0.0
        oks = [t for s, t in self.changes if s == "OK" and t >= since]
        return (oks[0] - since) if oks else None

    def stop(self):
        try:
            self.p.stdin.close()
            # It reads its missing keys again before it exits.
            self.p.wait(240)
        except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
            self.p.kill()


def svg_plot(samples, path):
    """RSS, the heap in use and the heap kept free (MiB, one scale) and open descriptors
    (their own scale) over time, one SVG, no plotting library."""
    W, H, P = 720, 300, 50
    t = [s[0] for s in samples]
    mib = [("RSS MiB", [s[1] / 1024 for s in samples], "#1f77b4"),
           ("heap in use MiB", [s[3] / 1024 for s in samples], "#2ca02c"),
           ("heap kept free MiB", [s[4] / 1024 for s in samples], "#ff7f0e")]
    top = max(max(ys) for _, ys, _ in mib) * 1.1 or 1
    series = [(label, ys, colour, top) for label, ys, colour in mib]
    fds = [s[2] for s in samples]
    series.append(("open fds", fds, "#d62728", max(fds) * 1.1 or 1))
    tmax = max(t) or 1
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{W}" height="{H}" fill="white"/>']
    for n, (label, ys, colour, ymax) in enumerate(series):
        pts = " ".join(f"{P + (x / tmax) * (W - 2 * P):.1f},{H - P - (y / ymax) * (H - 2 * P):.1f}"
                       for x, y in zip(t, ys))
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{pts}"/>')
        out.append(f'<text x="{P + n * 165}" y="20" fill="{colour}">{label} (0 to {ymax:.0f})</text>')
    out.append(f'<line x1="{P}" y1="{H - P}" x2="{W - P}" y2="{H - P}" stroke="black"/>')
    out.append(f'<text x="{W // 2 - 40}" y="{H - 15}">minutes (0 to {tmax / 60:.0f})</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def glog_epoch(line):
    """The UTC epoch of a glog line (`E1206 14:15:05.389674 ...`: month, day and time;
    this year), or None."""
    try:
        md, hms = line[1:5], line.split()[1]
        t = datetime.datetime.strptime(f"{datetime.date.today().year}{md} {hms}",
                                       "%Y%m%d %H:%M:%S.%f")
        return t.replace(tzinfo=datetime.timezone.utc).timestamp()
    except (ValueError, IndexError):
        return None


def fault_of(x, faults, t0, why_now=None):
    """The index of the fault a missing key is placed against (as `place_lost` does),
    or None (none between its put and its miss, or evicted by moongate). A key put after
    the new leader that followed a master kill or etcd stop began serving
    (`new_leader_s`) was acknowledged by that leader, not lost to the change: it is
    placed against the next fault, if any."""
    k, _, put, gone = x
    if why_now is not None and why_now.get(k) == "evicted_by_moongate":
        return None
    return next((i for i, f in enumerate(faults)
                 if put <= t0 + f["over_s"] + 30 and t0 + f["at_s"] <= gone
                 and not after_new_leader(put, f, t0)), None)


def after_new_leader(put, f, t0):
    """Whether a put at `put` came after the new leader that followed fault `f` began
    serving (so that leader acknowledged it)."""
    return f.get("new_leader_s") is not None and put >= t0 + f["new_leader_s"]


def new_leader_dropped(x, faults, t0):
    """The index of the leader change whose new leader acknowledged a missing key
    (put after it began serving, within the fault's window, and missing after), or
    None: a key that leader let go (its own evictions), not one lost to the change."""
    _, _, put, gone = x
    return next((i for i, f in enumerate(faults)
                 if after_new_leader(put, f, t0) and put <= t0 + f["over_s"] + 30
                 and t0 + f["at_s"] <= gone), None)


def place_lost(lost, faults, t0, why_now=None):
    """Each key gone that moongate did not remove, by the first fault in progress or
    begun between its put and the read that found it missing (a fault lasts from its
    start to 30 s after it ended: puts acknowledged during an etcd outage are lost at
    its end): per fault kind, how many, what moongate said of them when read missing
    (`by_why`) and at the end (`by_why_at_end`, with `why_now`), and how long before the
    fault they were put (median and largest, s); `no_fault_between` for those with none
    (the masters' own evictions, or a loss no fault explains)."""
    out = {}
    for k, why, put, gone in lost:
        if why_now is not None and why_now.get(k) == "evicted_by_moongate":
            # Missing for a while (a leader change), then evicted by moongate: an
            # eviction, accounted per key, not a loss.
            continue
        i = fault_of((k, why, put, gone), faults, t0)
        hit = None if i is None else faults[i]
        kind = hit["kind"] if hit else "no_fault_between"
        if hit is None and new_leader_dropped((k, why, put, gone), faults, t0) is not None:
            kind = "put_to_a_new_leader_then_dropped_by_it"
        o = out.setdefault(kind, {"keys": 0, "by_why": {}, "put_before_s": []})
        o["keys"] += 1
        o["by_why"][why] = o["by_why"].get(why, 0) + 1
        if why_now is not None:
            w = why_now.get(k, "not_asked")
            o.setdefault("by_why_at_end", {})[w] = o.setdefault("by_why_at_end", {}).get(w, 0) + 1
        if hit:
            o["put_before_s"].append(round(t0 + hit["at_s"] - put, 1))
    for o in out.values():
        b = sorted(o.pop("put_before_s"))
        if b:
            o["put_before_s_median_max"] = [round(b[len(b) // 2], 1), round(b[-1], 1)]
    return out


# moongate's bounded tables, sampled from its metrics with RSS: memory growth counts
# from when they are all full or level.
TABLES = ("moongate_eviction_table_keys", "moongate_key_history_keys", "moongate_hints_entries",
          'moongate_kv_table_entries{table="known_keys"}',
          'moongate_kv_table_entries{table="failover_window"}',
          'moongate_kv_table_entries{table="failover_held"}')
TABLE_NAMES = ("key_table", "key_history", "hints", "known_keys", "failover_window",
               "failover_held")


def level_from(vals, tol=0.02):
    """The first index after which the series never exceeds its value there by more
    than `tol` (a table at its bound, or one whose size stopped growing)."""
    top = 0.0
    first = len(vals)
    for i in range(len(vals) - 1, -1, -1):
        top = max(top, vals[i])
        if top <= vals[i] * (1 + tol) + 1:
            first = i
    return first


def memory(samples, tables):
    """RSS, heap and descriptor growth from the moment every bounded table is full or
    level to the end (medians of a tenth of the run there and at the end)."""
    if not samples:
        return {}
    n = len(samples)
    at = max([level_from([t[k] for t in tables]) for k in TABLES] or [0])
    k = max(1, n // 10)
    out = {"bounds_filled_s": round(samples[min(at, n - 1)][0]),
           "tables_last": {name: tables[-1][t] for name, t in zip(TABLE_NAMES, TABLES)}
           if tables else {}}
    if at + 2 * k > n:
        out["growth_after_bounds"] = "not measured: the tables were still growing in the last fifth"
        at = n // 10
    for name, col in (("rss", 1), ("fd", 2), ("heap_in_use", 3)):
        vals = [s[col] for s in samples]
        base = statistics.median(vals[at:at + k])
        end = statistics.median(vals[-k:])
        out[f"{name}_growth_pct"] = round(100.0 * (end - base) / base, 2) if base else 0.0
        out[f"{name}_from_bounds_to_end"] = [base, end]
    return out


def flood_fds(samples, faults):
    """Open descriptors before each flood, at its peak and one minute after it ended."""
    out = []
    for f in faults:
        if f["kind"] != "flood_of_stalled_bodies" or f.get("skipped"):
            continue
        before = [s[2] for s in samples if s[0] < f["at_s"]][-1:]
        during = [s[2] for s in samples if f["at_s"] <= s[0] <= f["over_s"]]
        after = [s[2] for s in samples if s[0] >= f["over_s"] + 60][:1]
        out.append({"at_s": f["at_s"], "before": before[0] if before else None,
                    "peak": max(during) if during else None,
                    "a_minute_after": after[0] if after else None})
    return out


def arms(a):
    """Runs each arm of `--arms` as its own driver, side by side, with the same
    arguments; one table of their lost puts by fault kind (arms.md in --out), one JSON
    line with both results. Fails when the moongate arm read wrong bytes, lost a kv-face
    put, or lost more master-face puts than the control arm."""
    names = [x for x in a.arms.split(",") if x]
    unknown = set(names) - {"moongate", "control"}
    if unknown or not names:
        raise SystemExit(f"--arms: {a.arms!r}: the arms are moongate and control")
    out = a.out or work_dir("moongate-soak-arms-")
    os.makedirs(out, exist_ok=True)
    rest = [x for x in sys.argv[1:] if not x.startswith("--arms") and x != a.arms]
    if "--out" in rest:
        i = rest.index("--out")
        del rest[i:i + 2]
    procs = {}
    for name in names:
        os.makedirs(f"{out}/{name}", exist_ok=True)
        procs[name] = subprocess.Popen(
            [sys.executable, __file__, "--arm", name, "--out", f"{out}/{name}"] + rest,
            stdout=subprocess.PIPE, stderr=open(f"{out}/{name}/driver.log", "w"), text=True)
    results = {}
    for name, pr in procs.items():
        lines = [l for l in pr.communicate()[0].splitlines() if l.startswith("{")]
        results[name] = json.loads(lines[-1]) if lines else {
            "error": f"no result (exit {pr.returncode}); see {out}/{name}/driver.log"}
    kinds = []
    for r in results.values():
        for by in r.get("lost_by_fault_by_client", {}).values():
            kinds += [k for k in by if k not in kinds]
    cols = [("control", "mc"), ("moongate", "mc"), ("moongate", "http"), ("moongate", "lib")]
    cols = [c for c in cols if c[0] in results]
    head = {"mc": "master face (Mooncake client)", "http": "kv face HTTP", "lib": "kv face C library"}

    def cell(arm, role, kind):
        by = results[arm].get("lost_by_fault_by_client", {}).get(role, {}).get(kind, {})
        n = by.get("keys", 0)
        # What moongate said of them when they were read missing (its history at the
        # end forgets the oldest).
        why = by.get("by_why") if arm == "moongate" else None
        if n and why:
            # What moongate says of them: lost in a failover, or gone otherwise
            # (evicted_by_master: the masters' own evictions, or gone unseen).
            return f"{n} ({', '.join(f'{w} {c}' for w, c in sorted(why.items()))})"
        return str(n)

    lines = ["| fault | " + " | ".join(f"{arm}: {head[role]}" for arm, role in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for kind in kinds:
        lines.append(f"| {kind} | " + " | ".join(cell(arm, role, kind) for arm, role in cols) + " |")
    lines.append("| new leaders restored / whose restore failed (no objects) | " + " | ".join(
        "{restored} / {failed}".format(**results[arm].get("leader_restores", {"restored": 0, "failed": 0}))
        for arm, role in cols) + " |")
    # Master face against the control where the arms' new leaders did alike (a leader
    # whose restore fails loses every key: which one fails is Mooncake's draw).
    alike = []
    if "control" in results and "moongate" in results:
        fc, fm = results["control"].get("faults", []), results["moongate"].get("faults", [])
        alike = [i for i, (c, m) in enumerate(zip(fc, fm))
                 if c.get("new_leader") and c.get("new_leader") == m.get("new_leader")]
        for arm, f in (("control", fc), ("moongate", fm)):
            results[arm]["master_face_lost_at_alike_leader_changes"] = sum(
                f[i].get("lost_by_client", {}).get("mc", 0) for i in alike)
        lines.append("| new leader per kill / etcd stop, in order | " + " | ".join(
            ", ".join(f"{x['kind'].split('_')[0]}:{x.get('new_leader')}"
                      for x in results[arm].get("faults", []) if "new_leader" in x)
            if role == "mc" else "" for arm, role in cols) + " |")
        lines.append("| evicted by each new leader in its first 30 s (the masters' logs), in order | " + " | ".join(
            ", ".join(str(x.get("new_leader_evicted_30s", 0))
                      for x in results[arm].get("faults", []) if "new_leader" in x)
            if role == "mc" else "" for arm, role in cols) + " |")
        lines.append(f"| master face lost at the {len(alike)} leader changes that went alike | " + " | ".join(
            str(results[arm]["master_face_lost_at_alike_leader_changes"]) if role == "mc" else ""
            for arm, role in cols) + " |")
    lines.append("| **requests** | " + " | ".join(
        str(results[arm].get("by_client", {}).get(role, {}).get("requests", 0)) for arm, role in cols) + " |")
    table = "\n".join(lines)
    with open(f"{out}/arms.md", "w") as f:
        f.write("Keys read back missing that moongate did not remove and that did not read back "
                "a minute later or at the end either, by the first fault in progress or begun between their put "
                "and the read (owner_declared_dead: the masters drop a dead owner's segment and "
                "what it held, by Mooncake's rules; put_to_a_new_leader_then_dropped_by_it: put "
                "after the new leader that followed a kill or etcd stop began serving, so "
                "acknowledged by it, and gone after: that leader's own evictions, not the change's); "
                "in brackets, what moongate's key history "
                "said of them when they were read missing:\n\n" + table + "\n")
    print(table, file=sys.stderr)
    print(json.dumps({"arms": results, "table": f"{out}/arms.md"}), flush=True)
    mg = results.get("moongate", {})
    ok = "error" not in mg and mg.get("wrong_reads", 1) == 0 and mg.get("lost_in_failover", 1) == 0
    if "control" in results and "moongate" in results:
        # Like for like: where one arm's new leader came up empty and the other's did not,
        # the difference is Mooncake's, not moongate's.
        ok = ok and (mg.get("master_face_lost_at_alike_leader_changes", 0)
                     <= results["control"].get("master_face_lost_at_alike_leader_changes", 0))
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="driver")
    for f in ("master", "metadata", "admin", "kv", "sock", "endpoint"):
        p.add_argument(f"--{f}")
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--fault-every", type=float, default=120)
    p.add_argument("--moongate", default="target/release/moongate")
    p.add_argument("--out", default="")
    p.add_argument("--faults", default="",
                   help="comma list of the fault kinds to run, in the schedule's order "
                        "(default: all of them)")
    p.add_argument("--rate", type=float, default=100,
                   help="puts per second per traffic process (0: as fast as it goes)")
    p.add_argument("--arms", default="moongate,control",
                   help="the arms to run side by side (moongate, control)")
    p.add_argument("--arm", default="", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    roles = {"mc": role_mc, "owner": role_owner, "http": role_http, "lib": role_lib,
             "events": role_events}
    if a.role in roles:
        random.seed(f"{a.seed}/{a.role}")
        return roles[a.role](a)
    if not a.arm:
        return arms(a)
    control = a.arm == "control"
    import mooncake
    master_bin = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    work = work_dir("moongate-soak-")
    os.environ["SOAK_RATE"] = str(a.rate)
    os.environ["SOAK_SEED"] = str(a.seed)
    out = a.out or work
    os.makedirs(out, exist_ok=True)
    procs, masters = [], {}
    t0 = time.time()

    def log(msg):
        print(f"[{(time.time() - t0) / 60:6.2f} min] {msg}", file=sys.stderr, flush=True)

    def health(admin):
        try:
            with urllib.request.urlopen(f"http://{admin}/health", timeout=1) as r:
                return json.loads(r.read()).get("ha_state", "")
        except (OSError, ValueError):
            return ""

    def wait(pred, secs, what):
        end = time.time() + secs
        while time.time() < end:
            v = pred()
            if v:
                return v
            time.sleep(0.05)
        raise SystemExit(f"timed out waiting for {what}; see {work}")

    etcd_state = {}
    # Each master keeps its metrics port across restarts: moongate reads both pages.
    pages = {"m0": free_port(), "m1": free_port()}

    def start_master(name):
        rpc, admin = free_port(), pages[name]
        pr = subprocess.Popen(
            [master_bin, "--enable_ha=true", f"--etcd_endpoints={etcd_state['addr']}",
             "--enable_oplog=true", f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
             f"--metrics_port={admin}", "--metrics_host=127.0.0.1",
             "--enable_metric_reporting=false", "--eviction_high_watermark_ratio=0.98"],
            cwd=work, stdout=open(f"{work}/{name}.log", "a"), stderr=subprocess.STDOUT)
        procs.append(pr)
        masters[name] = (pr, f"127.0.0.1:{admin}", rpc)

    def leader():
        for name, (pr, admin, _) in masters.items():
            if pr.poll() is None and health(admin) == "serving":
                return name
        return None

    roles_up, faults, samples, tables = [], [], [], []
    try:
        etcd_state["addr"] = start_etcd(work, procs)
        etcd_proc = procs[-1]
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
        wait(leader, 60, "a leader")
        mg_port, mg_admin, kv_port = free_port(), f"127.0.0.1:{free_port()}", free_port()
        events_port = free_port()
        sock = f"{work}/kv.sock"
        plugins = os.path.join(ROOT, "target", "plugins")
        if control:
            # Mooncake's clients on the masters directly: the mc traffic alone.
            mg, admin, master = None, "", f"etcd://{etcd_state['addr']}"
            owner = Role("owner", ["--master", master, "--metadata", metadata], work)
            roles_up.append(owner)
            traffic = [Role("mc", ["--master", master, "--metadata", metadata, "--admin", ""],
                            work)]
            roles_up.extend(traffic)
            events = None
            log(f"up (control): clients on {master}, work {work}")
        else:
            with open(f"{work}/moongate.toml", "w") as f:
                f.write(
                    f'[master_face]\nlisten = "127.0.0.1:{mg_port}"\n'
                    f'upstream = "etcd://{etcd_state["addr"]}"\n'
                    f'[admin]\nlisten = "{mg_admin}"\n'
                    f'[kv]\nlisten = "127.0.0.1:{kv_port}"\nunix_path = "{sock}"\n'
                    f'metadata_url = "{metadata}"\nsegment_bytes = {64 << 20}\n'
                    f'known_keys = 262144\nfailover_window_ms = 300000\n'
                    f'failover_window_keys = 65536\n'
                    f'[eviction]\nenabled = true\n'
                    f'master_metrics_url = "http://{masters["m0"][1]}/metrics, '
                    f'http://{masters["m1"][1]}/metrics"\n'
                    f'high_watermark = 0.4\nlow_watermark = 0.35\ninterval_ms = 500\n'
                    # The bounds, written out (the defaults): the tables' growth is
                    # read against them.
                    f'max_keys = 1000000\nhistory_keys = 100000\n'
                    f'[events]\nenabled = true\nendpoint = "tcp://127.0.0.1:{events_port}"\n'
                    # A hint table bound this traffic fills in minutes (the default,
                    # 131,072, took the whole 30 minutes), so that memory is measured
                    # after every table is full.
                    f'[hints]\nmax_entries = 16384\n'
                    f'[policy]\nactive = "default"\n'
                    f'[policy.rollback]\nwindow_ms = 30000\nmin_calls = 20\n'
                    f'max_failure_ratio = 0.05\n'
                    f'[[policy.plugins]]\nname = "lru"\npath = "{plugins}/lru.wasm"\n'
                    f'[[policy.plugins]]\nname = "faulty"\npath = "{plugins}/fault.wasm"\n'
                    f"config = 'every-2-trap'\n")
            mg = subprocess.Popen([a.moongate, "run", "--config", f"{work}/moongate.toml"],
                                  stdout=open(f"{work}/moongate.log", "w"),
                                  stderr=subprocess.STDOUT,
                                  env={**os.environ, "RUST_LOG": os.environ.get("SOAK_RUST_LOG", "warn")})
            procs.append(mg)
            wait_http(f"http://{mg_admin}/ready", 60)
            admin = f"http://{mg_admin}"
            master = f"127.0.0.1:{mg_port}"
            owner = Role("owner", ["--master", master, "--metadata", metadata], work)
            roles_up.append(owner)
            wait(lambda: os.path.exists(sock), 60, "the kv socket")
            traffic = [
                Role("mc", ["--master", master, "--metadata", metadata, "--admin", admin], work),
                Role("http", ["--kv", f"127.0.0.1:{kv_port}", "--admin", admin], work),
                Role("lib", ["--sock", sock, "--admin", admin], work),
            ]
            roles_up.extend(traffic)
            events = Role("events", ["--endpoint", f"tcp://127.0.0.1:{events_port}"], work)
            roles_up.append(events)
            log(f"up: moongate {master}, kv 127.0.0.1:{kv_port}, admin {admin}, work {work}")

        def admin_post(path, body=b""):
            if not admin:
                return 0
            req = urllib.request.Request(admin + path, data=body, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code
            except OSError:
                return 0

        def series(*names):
            """Every sample of these metrics, by its labels."""
            if not admin:
                return {}
            try:
                with urllib.request.urlopen(admin + "/metrics", timeout=5) as r:
                    text = r.read().decode()
            except OSError:
                return {}
            return {l.rsplit(" ", 1)[0]: float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
                    if l.startswith(names) and float(l.rsplit(" ", 1)[1]) != 0}

        def metric(name):
            """The sum of a metric's samples (0 when moongate does not answer)."""
            return sum(series(name).values())

        def kill_leader():
            old = wait(leader, 60, "a leader")
            masters[old][0].send_signal(signal.SIGKILL)
            masters[old][0].wait(10)
            wait(lambda: (lambda n: n if n and n != old else None)(leader()), 90,
                 "the standby serving")
            start_master(old)
            wait(lambda: health(masters[old][1]) == "standby", 60, "the restarted standby")

        def stop_owner(secs):
            owner.p.send_signal(signal.SIGSTOP)
            time.sleep(secs)
            owner.p.send_signal(signal.SIGCONT)

        def stop_etcd():
            etcd_proc.send_signal(signal.SIGSTOP)
            time.sleep(10)
            etcd_proc.send_signal(signal.SIGCONT)

        def faulty_plugin():
            if control:
                return "skipped: no moongate"
            before = metric("moongate_policy_rollbacks_total")
            st = admin_post("/plugins/faulty/activate")
            wait(lambda: metric("moongate_policy_rollbacks_total") > before, 120,
                 f"the faulty plugin rolled back (activate answered {st})")

        def flood():
            if control:
                return "skipped: no kv face"
            conns = []
            for i in range(300):
                try:
                    s = socket.create_connection(("127.0.0.1", kv_port), timeout=5)
                    s.sendall(f"PUT /v1/kv/flood%2F{i} HTTP/1.1\r\nHost: x\r\n"
                              "Content-Length: 1048576\r\n\r\n".encode() + b"f" * 65536)
                    conns.append(s)
                except OSError:
                    pass
            time.sleep(20)
            for s in conns:
                s.close()

        def garbage():
            rnd = random.Random(1)
            # Without moongate, at the leader's RPC port (the master face's equivalent).
            ports = (masters[wait(leader, 60, "a leader")][2],) * 100 if control else \
                (mg_port, kv_port) * 50
            for port in ports:
                try:
                    s = socket.create_connection(("127.0.0.1", port), timeout=5)
                    s.sendall(bytes(rnd.getrandbits(8) for _ in range(rnd.randint(1, 4096))))
                    s.close()
                except OSError:
                    pass

        # An owner stalled for less than the masters' client_ttl (10 s) must lose
        # nothing; one stopped past it is declared dead, and the masters drop its segment
        # with every object in it (one replica each, Mooncake's default): what it held
        # is reported as dropped with the owner, apart from lost puts.
        schedule = [("kill_leading_master", kill_leader),
                    ("sigstop_owner", lambda: stop_owner(5)),
                    ("owner_declared_dead", lambda: stop_owner(15)),
                    ("etcd_stopped", stop_etcd), ("faulty_plugin", faulty_plugin),
                    ("flood_of_stalled_bodies", flood), ("garbage_client", garbage)]
        if a.faults:
            want = a.faults.split(",")
            unknown = set(want) - {k for k, _ in schedule}
            if unknown:
                raise SystemExit(f"--faults: no such fault {sorted(unknown)}; the kinds: "
                                 f"{', '.join(k for k, _ in schedule)}")
            schedule = [(k, f) for k, f in schedule if k in want]
        end = t0 + a.minutes * 60
        # Faults at fixed offsets from the start, so that both arms meet each at the
        # same time into their runs.
        next_fault, next_swap, next_sample, n = t0 + 60, t0 + 60, t0, 0
        swap_to = ["lru", "default"]
        swaps = 0
        while time.time() < end:
            now = time.time()
            if now >= next_sample and mg:
                next_sample += 5
                try:
                    rss, fds = proc_stat(mg.pid)
                    heap = series("moongate_heap_bytes")
                    samples.append((now - t0, rss, fds,
                                    int(heap.get('moongate_heap_bytes{state="in_use"}', 0)) >> 10,
                                    int(heap.get('moongate_heap_bytes{state="free"}', 0)) >> 10))
                    sizes = series(*TABLES)
                    tables.append({t: sizes.get(t, 0.0) for t in TABLES})
                except OSError:
                    raise SystemExit(f"moongate is gone; see {work}/moongate.log")
            if now >= next_swap and mg:
                next_swap += 60
                st = admin_post(f"/plugins/{swap_to[swaps % 2]}/activate")
                swaps += 1
                if st != 200:
                    log(f"swap to {swap_to[(swaps - 1) % 2]} answered {st}")
            if now >= next_fault and now + 60 < end:
                kind, fn = schedule[n % len(schedule)]
                n += 1
                at = time.time()
                log(f"fault: {kind}")
                skipped = fn()
                over = time.time()
                settle = time.time() + 60
                rec = None
                while time.time() < settle:
                    got = [r.recovered(at) for r in traffic]
                    if all(g is not None for g in got):
                        rec = max(got)
                        break
                    time.sleep(0.2)
                faults.append({"kind": kind, "at_s": round(at - t0, 1),
                               **({"skipped": skipped} if skipped else {}),
                               "over_s": round(over - t0, 1),
                               "recovered_s": None if rec is None else round(rec, 2),
                               "by_client": {r.name: r.recovered(at) for r in traffic}})
                log(f"  recovered after {rec} s")
                # The next fault after the plugin the fault left is back, and a pause.
                admin_post(f"/plugins/{swap_to[(swaps + 1) % 2]}/activate")
                next_fault = max(next_fault + a.fault_every, time.time() + 10)
            time.sleep(0.2)
        for r in traffic + ([events] if events else []):
            r.stop()
        time.sleep(1)
        # Keys read back missing that did not read back at the end either (each traffic
        # process read its own again): what moongate says of them now.
        for r in traffic:
            # A miss is undone by a read that found the key after it.
            r.lost = [x for x in r.lost if not any(t > x[3] for t in r.found.get(x[0], []))]
        why_now = {}
        for k, _, _, _ in [x for r in traffic for x in r.lost][:3000 if mg else 0]:
            why_now[k] = why_gone(admin, k)
        recheck = {"found_again": {r.name: len(r.found) for r in traffic},
                   "why_now": {w: list(why_now.values()).count(w) for w in set(why_now.values())}}
        total = {"requests": 0, "wrong_reads": 0, "missing_other": 0, "evicted": 0}
        # The masters' own evictions (their logs' EVICT-RESULT lines): keys a client
        # read back missing that moongate did not remove are accounted against these.
        master_evicted = 0
        # How each new leader took over: restored from its standby state, or (the
        # restore refused, e.g. "overlapping memory descriptors") serving with no
        # objects at all, which loses every key the masters held.
        restores = {"restored": 0, "failed": 0}
        took_over = []
        # The masters' evictions, when (a new leader may evict at once: a restored one
        # reads its pool near full until the owners remount).
        evictions = []
        for name in masters:
            with open(f"{work}/{name}.log", errors="replace") as f:
                for line in f:
                    if "[EVICT-RESULT]" in line and "evicted_count=" in line:
                        n = int(line.split("evicted_count=")[1].split(",")[0])
                        master_evicted += n
                        evictions.append((glog_epoch(line), n))
                    elif "Restored from standby:" in line:
                        restores["restored"] += 1
                        took_over.append((glog_epoch(line), "restored"))
                    elif "Standby restore failed" in line:
                        restores["failed"] += 1
                        took_over.append((glog_epoch(line), "failed"))
        # Which leader change followed each master kill and etcd stop, and what each
        # client lost at it: arms compare alike only where their new leaders did alike.
        for f in faults:
            if f["kind"] in ("kill_leading_master", "etcd_stopped"):
                t, f["new_leader"] = next(((t, o) for t, o in sorted(took_over)
                                           if t is not None
                                           and t0 + f["at_s"] <= t <= t0 + f["over_s"] + 60),
                                          (None, None))
                if t is not None:
                    f["new_leader_s"] = round(t - t0, 2)
                    # What that leader evicted in its first 30 s.
                    f["new_leader_evicted_30s"] = sum(n for e, n in evictions
                                                      if e is not None and t <= e <= t + 30)
        for i, f in enumerate(faults):
            f["lost_by_client"] = {r.name: sum(1 for x in r.lost if fault_of(x, faults, t0,
                                                                            why_now if mg else None) == i)
                                   for r in traffic}
        errors, lost_keys = {}, []
        for r in traffic:
            for k in total:
                total[k] += r.counts.get(k, 0)
            for k, v in r.counts.get("errors", {}).items():
                errors[f"{r.name}:{k}"] = v
            lost_keys += r.counts.get("lost_keys", [])[:7]
        with open(f"{out}/soak_samples.csv", "w") as f:
            f.write("seconds,rss_kib,open_fds,heap_in_use_kib,heap_free_kib,"
                    + ",".join(TABLE_NAMES) + "\n")
            for (t, rss, fds, used, free), sizes in zip(samples, tables):
                f.write(f"{t:.0f},{rss},{fds},{used},{free},"
                        + ",".join(f"{sizes[k]:.0f}" for k in TABLES) + "\n")
        if samples:
            svg_plot(samples, f"{out}/soak.svg")
        # Every key read back missing that moongate did not remove, for a look at any
        # one of them in moongate's log (seconds from the start).
        with open(f"{out}/missing.tsv", "w") as f:
            f.write("client\tkey\twhy_when_read\twhy_at_end\tput_s\tread_missing_s\n")
            for r in traffic:
                for k, why, put, gone in r.lost:
                    f.write(f"{r.name}\t{k}\t{why}\t{why_now.get(k, '')}\t"
                            f"{put - t0:.1f}\t{gone - t0:.1f}\n")
        lost_by_fault = place_lost([x for r in traffic for x in r.lost], faults, t0,
                                   why_now if mg else None)
        # Missing keys moongate did not remove, accounted against the masters' own
        # evictions (by count: the master does not say which keys); the rest are lost.
        total.pop("missing_other")
        evicted_later = sum(1 for r in traffic for x in r.lost
                            if why_now.get(x[0]) == "evicted_by_moongate")
        other = sum(len(r.lost) for r in traffic) - evicted_later
        with_owner = lost_by_fault.get("owner_declared_dead", {}).get("keys", 0)
        result = {
            **total,
            "lost_puts": max(0, other - with_owner - master_evicted),
            "evicted": total["evicted"] + min(other - with_owner, master_evicted),
            "dropped_with_owner": with_owner,
            "evicted_by_moongate_read_missing": total["evicted"],
            "missing_not_by_moongate": other,
            "master_evicted": master_evicted,
            "leader_restores": restores,
            "lost_by_fault": lost_by_fault,
            "missing_rechecked_at_the_end": recheck,
            "by_client": {r.name: {k: r.counts.get(k, 0) for k in
                                  ("requests", "wrong_reads", "missing_other", "evicted")}
                          for r in traffic},
            "minutes": a.minutes,
            "started_epoch": round(t0, 1),
            "lost_by_fault_by_client": {r.name: place_lost(r.lost, faults, t0,
                                                           why_now if mg else None)
                                        for r in traffic},
            "lost_in_failover": list(why_now.values()).count("lost_in_failover"),
            "missing_then_evicted_by_moongate": evicted_later,
            **memory(samples, tables),
            "floods": flood_fds(samples, faults),
            "faults": faults,
            "plugin_swaps": swaps,
            "events_received": events.counts.get("events", 0) if events else 0,
            "failover": series("moongate_kv_failover_keys_total",
                               "moongate_kv_failover_rechecks_total",
                               "moongate_kv_failover_read_ahead_keys_total",
                               "moongate_kv_failover_waited_reads_total"),
            "master_idle": series("moongate_kv_master_idle_connections",
                                  "moongate_kv_master_idle_closed_total"),
            "moongate_evicted_keys": metric("moongate_eviction_keys_total{result=\"removed\"}"),
            "rollbacks": metric("moongate_policy_rollbacks_total"),
            # What moongate's evictor says of its victims and of rounds cut short: a
            # removal whose answer was lost may have taken a key moongate did not record.
            "eviction": series("moongate_eviction_keys_total", "moongate_eviction_errors_total"),
            "errors": errors,
            "lost_keys": lost_keys[:20],
            "wrong": [w for r in traffic for w in r.counts.get("wrong", [])][:20],
            "samples": f"{out}/soak_samples.csv",
            "missing": f"{out}/missing.tsv",
            "plot": f"{out}/soak.svg",
        }
        print(json.dumps(result), flush=True)
        ok = result["wrong_reads"] == 0 and result["lost_puts"] == 0
        return 0 if ok else 1
    finally:
        for r in roles_up:
            if r.p.poll() is None:
                r.p.kill()
        for pr in procs:
            if pr.poll() is None:
                pr.send_signal(signal.SIGCONT)
        stop_all(procs)


if __name__ == "__main__":
    run(main)
