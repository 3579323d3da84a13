#!/usr/bin/env python3
"""Replays a Mooncake request trace through a master address (moongate or the master
itself) with the real Mooncake client, and reports hit rate, bytes per tier, denials and
latency per experiment arm.

Each trace line is a request with prefix block hashes (`hash_ids`). Every block is one
key of --value-size bytes. For each request, in arrival order (timestamps divided by
--speed): look the whole prefix up with one batch_is_exist; the leading run of hits is
reusable (a miss breaks the prefix: later blocks are recomputed anyway); read the hits
with one get_batch and check every byte; put the rest with one put_batch.

Arms: with --admin (moongate's admin address) and an experiment assigned by client,
the replay starts worker clients one at a time and learns each one's arm from moongate's
own metrics (the MountSegment it just sent), until every arm has --workers-per-arm
workers; extra workers are closed. --master may list several addresses (one moongate
per rank, comma-separated): without --admin, worker i uses address i modulo the list
(set --workers-per-arm to the list's length for one rank per moongate). Keys are prefixed with the arm, so the arms are
separate caches competing for the same memory. --split mirror (default) gives every arm
the whole trace: identical workloads, so the arms' numbers compare the policies and
nothing else. --split route sends each request to one arm by its first block (a
conversation stays in one arm; half the load each). Within an arm, requests go to its
workers by first block too (--route sticky), or each to a random one (--route random,
seeded: what a router that does not know the caches does). Without --admin there is one arm, "all".

Hints (--hints SPEC, with --admin): the serving stack's knowledge sent to moongate's
POST /hints as the replay runs, by the model of `moongate sim --hints` (proxy/src/sim/
hints.rs): `queue:W` (when request i arrives, the blocks of requests i+1..i+W are
announced upcoming, due when they arrive), `last:P[@D]` (for a seeded share P of the
requests, their blocks the trace never reads again are announced done: by the worker
that served the request, right after it, when D is 0; by the replay D trace-ms after the
request arrived otherwise), `expect:P[@W]` (for a seeded share P of the requests, their
blocks the trace reads again within W trace-ms, default 60,000, are announced expect
within W), `wrong:F` (a share F of the done announcements name a block that
the trace does read again, drawn from the last 4,096 such blocks), `seed:N`. The same
model, not the same draws as the simulator (Python's random, not its mixer). Every
hint names the block's key in every arm (mirror: the same hints reach every policy; a
plugin without `evict-hinted` ignores them). Times follow --speed; every upcoming read
names its `in_ms`.

Run through the wrapper `benches/replay` (it picks the project's virtualenv).
"""
import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import re
import sys
import threading
import time
import urllib.request

MiB = 1 << 20


def value(key, size):
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def pct(v, q):
    if not v:
        return 0.0
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


# ---------------------------------------------------------------- worker process

def worker(conn, master, metadata, segment_mib):
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", metadata, segment_mib * MiB, 64 * MiB, "tcp", "", master)
    conn.send(("ready", rc))
    if rc != 0:
        return
    msg = conn.recv()
    if msg[0] == "run":
        _, reqs, t0, speed, size, prefix, hints_url = msg
        conn.send(("done", replay(s, reqs, t0, speed, size, prefix, hints_url)))
    s.close()


def wait_until(due, lag_ms):
    """Sleeps until `due` (wall clock), or notes how late it already is."""
    now = time.time()
    if due > now:
        time.sleep(due - now)
    else:
        lag_ms.append((now - due) * 1000)


def replay(s, reqs, t0, speed, size, prefix, hints_url=None):
    st = {"requests": 0, "blocks": 0, "hits": 0, "read_ok": 0, "read_miss": 0,
          "corrupt": 0, "put_keys": 0, "put_calls": 0, "put_failed": {}, "lag_ms": [],
          "put_existing": 0,
          "lookup_us": [], "get_us": [], "put_us": [], "read_bytes": 0, "put_bytes": 0,
          "done_hints": 0, "done_hint_errors": 0}
    poster = HintPoster(hints_url) if hints_url else None
    for ts, ids, done in reqs:
        wait_until(t0 + ts / 1000.0 / speed, st["lag_ms"])
        keys = [f"{prefix}/{i}" for i in ids]
        st["requests"] += 1
        st["blocks"] += len(keys)
        t = time.perf_counter()
        found = s.batch_is_exist(keys)
        st["lookup_us"].append((time.perf_counter() - t) * 1e6)
        n = 0
        while n < len(keys) and found[n] == 1:
            n += 1
        st["hits"] += n
        # Blocks after the first miss are put again even where they exist (their prefix
        # broke): the master answers those OBJECT_ALREADY_EXISTS, which moongate counts
        # as an error of the put and Mooncake's client as success.
        st["put_existing"] += sum(1 for f in found[n:] if f == 1)
        hits, misses = keys[:n], keys[n:]
        if hits:
            t = time.perf_counter()
            got = s.get_batch(hits)
            st["get_us"].append((time.perf_counter() - t) * 1e6)
            good = 0
            for k, v in zip(hits, got):
                if len(v) == 0:
                    st["read_miss"] += 1
                    misses.append(k)  # evicted between lookup and read: recompute
                elif bytes(v) == value(k, size):
                    good += 1
                else:
                    st["corrupt"] += 1
            st["read_ok"] += good
            st["read_bytes"] += good * size
        if misses:
            t = time.perf_counter()
            rc = s.put_batch(misses, [value(k, size) for k in misses])
            st["put_us"].append((time.perf_counter() - t) * 1e6)
            st["put_calls"] += 1
            if rc == 0:
                st["put_keys"] += len(misses)
                st["put_bytes"] += len(misses) * size
            else:
                st["put_failed"][str(rc)] = st["put_failed"].get(str(rc), 0) + 1
        if done and poster:
            # Served: the session's end is told now (the `last` model with no delay).
            ok = poster.post({"kind": "done", "keys": [f"{prefix}/{b}" for b in done]})
            st["done_hints" if ok else "done_hint_errors"] += len(done)
    return st


class HintPoster:
    """POST /hints over one kept-alive connection; reconnects after an error."""

    def __init__(self, url):
        import urllib.parse
        self.url = urllib.parse.urlparse(url)
        self.conn = None

    def post(self, hint):
        """True when moongate took it (200); the status or error otherwise."""
        import http.client
        body = json.dumps({"hints": [hint]}).encode()
        try:
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.url.hostname, self.url.port,
                                                       timeout=10)
            self.conn.request("POST", self.url.path, body,
                              {"Content-Type": "application/json"})
            r = self.conn.getresponse()
            answer = r.read()
        except (OSError, http.client.HTTPException) as e:
            if self.conn:
                self.conn.close()
            self.conn = None
            return type(e).__name__
        return True if r.status == 200 and json.loads(answer).get("accepted") is not None \
            else str(r.status)


# ---------------------------------------------------------------- hints (--hints)

def parse_hints(spec):
    h = {"queue": 0, "last": 0.0, "delay_ms": 0.0, "expect": 0.0, "within_ms": 60000.0,
         "wrong": 0.0, "seed": 1}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, sep, v = part.partition(":")
        if not sep:
            raise SystemExit(f"--hints {part!r}: expected KIND:VALUE")
        try:
            if kind == "queue":
                h["queue"] = int(v)
            elif kind == "last":
                p_, _, d = v.partition("@")
                h["last"] = float(p_)
                h["delay_ms"] = float(d) if d else 0.0
            elif kind == "expect":
                p_, _, w_ = v.partition("@")
                h["expect"] = float(p_)
                h["within_ms"] = float(w_) if w_ else 60000.0
            elif kind == "wrong":
                h["wrong"] = float(v)
            elif kind == "seed":
                h["seed"] = int(v)
            else:
                raise SystemExit(f"--hints {part!r}: unknown model (queue, last, expect, wrong, seed)")
        except ValueError:
            raise SystemExit(f"--hints {part!r}: bad value")
    if not (0 <= h["last"] <= 1 and 0 <= h["expect"] <= 1 and 0 <= h["wrong"] < 1
            and h["queue"] >= 0 and h["within_ms"] > 0):
        raise SystemExit(f"--hints {spec!r}: shares from 0 to 1 (wrong below 1), queue >= 0")
    return h


def hint_schedule(reqs, h):
    """The hints of the trace, in trace time: [(ms, kind, [block], due_ms)]; per
    request the blocks its worker announces done after serving it (the `last` model
    without a delay; with one, they are in the schedule); and how many of the done
    blocks are wrong ones."""
    rng = random.Random(h["seed"])
    rng_expect = random.Random(h["seed"] + 1)
    # Per request, per block position: the next request that reads that block (None:
    # never again).
    last, nxt = {}, [None] * len(reqs)
    for i in range(len(reqs) - 1, -1, -1):
        ids = reqs[i][1]
        nxt[i] = [last.get(b) for b in ids]
        for b in ids:
            last[b] = i
    out, recent, after, wrong_blocks = [], [], [None] * len(reqs), 0
    p_wrong = h["wrong"] / (1 - h["wrong"]) if h["wrong"] else 0.0
    n, w = len(reqs), h["queue"]
    for i, (ts, ids) in enumerate(reqs):
        if w:
            for j in (range(1, min(w, n - 1) + 1) if i == 0 else
                      ([i + w] if i + w < n else [])):
                out.append((ts, "upcoming", reqs[j][1], reqs[j][0]))
        if h["expect"] and rng_expect.random() < h["expect"]:
            soon = [b for b, nx in zip(ids, nxt[i])
                    if nx is not None and reqs[nx][0] - ts <= h["within_ms"]]
            if soon:
                out.append((ts, "expect", soon, ts + h["within_ms"]))
        if h["last"] <= 0:
            continue
        if h["wrong"]:
            recent.extend((b, nx) for b, nx in zip(ids, nxt[i]) if nx is not None)
            del recent[:-4096]
        if rng.random() >= h["last"]:
            continue
        done = [b for b, nx in zip(ids, nxt[i]) if nx is None]
        wrong = []
        for _ in done:
            if recent and rng.random() < p_wrong:
                for _try in range(8):
                    b, nx = recent[rng.randrange(len(recent))]
                    if nx > i:
                        wrong.append(b)
                        break
        if done or wrong:
            if h["delay_ms"]:
                out.append((ts + h["delay_ms"], "done", done + wrong, None))
            else:
                after[i] = done + wrong
            wrong_blocks += len(wrong)
    out.sort(key=lambda e: e[0])
    return out, after, wrong_blocks


def send_hints(url, schedule, prefixes, t0, speed, stop, max_names=4096):
    """Posts the schedule on time (trace ms / speed); returns what happened."""
    poster = HintPoster(url)
    st = {"calls": 0, "names": 0, "accepted": 0, "refused": {}, "lag_ms": []}
    for ms, kind, blocks, due_ms in schedule:
        if stop.is_set():
            break
        wait_until(t0 + ms / 1000.0 / speed, st["lag_ms"])
        names = [f"{p}/{b}" for p in prefixes for b in blocks]
        for at in range(0, len(names), max_names):
            hint = {"kind": kind, "keys": names[at:at + max_names]}
            if kind == "upcoming":
                hint["in_ms"] = max(0, int((due_ms - ms) / speed))
            elif kind == "expect":
                hint["within_ms"] = max(1, int((due_ms - ms) / speed))
            ok = poster.post(hint)
            st["calls"] += 1
            st["names"] += len(hint["keys"])
            if ok is True:
                st["accepted"] += len(hint["keys"])
            else:
                st["refused"][ok] = st["refused"].get(ok, 0) + 1
    return st


# ---------------------------------------------------------------- parent

def metrics(admin):
    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=5) as r:
        return r.read().decode()


def master_values(text):
    """The master's unlabelled samples ({name: value})."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, val = line.partition(" ")
            try:
                out[name] = float(val)
            except ValueError:
                pass
    return out


def samples(text, name):
    """{labels-dict-as-tuple: value} for one metric name."""
    out = {}
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        labels, val = line[len(name) + 1:].rsplit("} ", 1)
        out[tuple(sorted(re.findall(r'(\w+)="([^"]*)"', labels)))] = float(val)
    return out


def mounts_by_arm(admin):
    m = samples(metrics(admin), "moongate_arm_requests_total")
    return {dict(k)["arm"]: v for k, v in m.items() if dict(k).get("method") == "MountSegment"}


def start_workers(a):
    ctx = mp.get_context("spawn")
    arms = {}  # arm -> [(proc, conn)]
    extra = []
    for attempt in range(a.max_workers):
        before = mounts_by_arm(a.admin) if a.admin else {}
        parent, child = ctx.Pipe()
        masters = a.master.split(",")
        master = masters[attempt % len(masters)]
        p = ctx.Process(target=worker, args=(child, master, a.metadata, a.segment_mib))
        p.start()
        kind, rc = parent.recv()
        if rc != 0:
            raise SystemExit(f"worker setup failed: {rc}")
        if a.admin:
            after = mounts_by_arm(a.admin)
            arm = next((k for k, v in after.items() if v > before.get(k, 0)), None)
            if arm is None:
                raise SystemExit("could not tell the new worker's arm from moongate's metrics")
        else:
            arm = "all"
        if len(arms.get(arm, [])) < a.workers_per_arm:
            arms.setdefault(arm, []).append((p, parent))
        else:
            extra.append((p, parent))
        n_arms = len(after) if a.admin else 1
        if len(arms) == n_arms and all(len(w) == a.workers_per_arm for w in arms.values()):
            break
    for p, c in extra:
        c.send(("close",))
        p.join(30)
    if a.admin and len(arms) < len(mounts_by_arm(a.admin)):
        raise SystemExit(f"only arms {sorted(arms)} got workers in {a.max_workers} tries")
    return arms


def load_trace(path, limit):
    reqs = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            reqs.append((r["timestamp"], r["hash_ids"]))
            if limit and len(reqs) >= limit:
                break
    return reqs


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True)
    p.add_argument("--master", required=True, help="HOST:PORT clients use (moongate's master face)")
    p.add_argument("--metadata", required=True, help="the metadata URL, http://HOST:PORT/metadata")
    p.add_argument("--value-size", type=int, default=64 << 10, help="bytes per block (64 KiB)")
    p.add_argument("--speed", type=float, default=1.0, help="divide arrival times by this")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--admin", help="moongate's admin HOST:PORT: per-arm workers and metrics")
    p.add_argument("--segment-mib", type=int, default=64, help="memory segment per worker")
    p.add_argument("--workers-per-arm", type=int, default=1)
    p.add_argument("--max-workers", type=int, default=16, help="tries to fill every arm")
    p.add_argument("--limit", type=int, default=0, help="replay only the first N requests")
    p.add_argument("--master-metrics", help="the master's Prometheus URL: its memory usage is "
                   "sampled every 200 ms and its own evictions counted")
    p.add_argument("--split", choices=["mirror", "route"], default="mirror",
                   help="mirror: every arm replays the whole trace; route: one arm per request")
    p.add_argument("--route", choices=["sticky", "random"], default="sticky",
                   help="within an arm: a request goes to the worker its first block picks, "
                        "or to a random one")
    p.add_argument("--hints", help="send hints by this model (see above) to moongate's "
                   "admin POST /hints; needs --admin")
    a = p.parse_args()
    if a.hints and not a.admin:
        p.error("--hints needs --admin (hints go to its POST /hints)")
    hint_model = parse_hints(a.hints) if a.hints else None

    reqs = load_trace(a.trace, a.limit)
    schedule, after, wrong_blocks = (hint_schedule(reqs, hint_model) if hint_model
                                     else ([], [None] * len(reqs), 0))
    arms = start_workers(a)
    names = sorted(arms)
    per_worker = {(arm, i): [] for arm in names for i in range(len(arms[arm]))}
    rng = random.Random(11)
    for (ts, ids), done in zip(reqs, after):
        first = ids[0] if ids else 0
        targets = names if a.split == "mirror" else [names[first % len(names)]]
        for arm in targets:
            # A conversation stays with one worker: its first block decides.
            n = len(arms[arm])
            i = rng.randrange(n) if a.route == "random" else first % n
            per_worker[(arm, i)].append((ts, ids, done))
    t0 = time.time() + 0.5
    usage, done = [], threading.Event()
    if a.master_metrics:
        def sample():
            while not done.wait(0.2):
                try:
                    with urllib.request.urlopen(a.master_metrics, timeout=2) as r:
                        m = master_values(r.read().decode())
                    if m.get("master_total_capacity_bytes"):
                        usage.append(m["master_allocated_bytes"] / m["master_total_capacity_bytes"])
                except OSError:
                    pass
        threading.Thread(target=sample, daemon=True).start()
    for arm in names:
        for i, (proc, conn) in enumerate(arms[arm]):
            conn.send(("run", per_worker[(arm, i)], t0, a.speed, a.value_size, f"{arm}/blk",
                       f"http://{a.admin}/hints" if hint_model else None))
    hint_result = {}
    if schedule:
        def hints_thread():
            hint_result.update(send_hints(f"http://{a.admin}/hints", schedule,
                                          [f"{arm}/blk" for arm in names], t0, a.speed, done))
        hinter = threading.Thread(target=hints_thread, daemon=True)
        hinter.start()
    results = {arm: [] for arm in names}
    for arm in names:
        for proc, conn in arms[arm]:
            kind, st = conn.recv()
            results[arm].append(st)
            proc.join(60)
    wall = time.time() - t0
    done.set()
    if schedule:
        hinter.join(30)
    mtext = metrics(a.admin) if a.admin else ""
    report = {"trace": os.path.basename(a.trace), "requests": len(reqs), "split": a.split,
              "route": a.route, "masters": len(a.master.split(",")),
              "value_size": a.value_size, "speed": a.speed, "segment_mib": a.segment_mib,
              "wall_s": round(wall, 1), "arms": {}}
    if a.master_metrics:
        with urllib.request.urlopen(a.master_metrics, timeout=5) as r:
            m = master_values(r.read().decode())
        report["master"] = {
            "usage_mean": round(sum(usage) / len(usage), 4) if usage else None,
            "usage_samples": len(usage),
            "evicted_keys": m.get("master_evicted_key_count", 0.0),
            "capacity_bytes": m.get("master_total_capacity_bytes", 0.0),
        }
    for arm in names:
        agg = {}
        for st in results[arm]:
            for k, v in st.items():
                if isinstance(v, list):
                    agg.setdefault(k, []).extend(v)
                elif isinstance(v, dict):
                    d = agg.setdefault(k, {})
                    for kk, vv in v.items():
                        d[kk] = d.get(kk, 0) + vv
                else:
                    agg[k] = agg.get(k, 0) + v
        r = {k: agg[k] for k in ("requests", "blocks", "hits", "read_ok", "read_miss",
                                  "corrupt", "put_keys", "put_calls", "put_failed",
                                  "read_bytes", "put_bytes", "put_existing")}
        r["workers"] = len(arms[arm])
        r["hit_rate"] = round(agg["read_ok"] / agg["blocks"], 4) if agg["blocks"] else 0.0
        for op in ("lookup", "get", "put"):
            r[f"{op}_p50_us"] = round(pct(agg[f"{op}_us"], 0.5), 1)
            r[f"{op}_p99_us"] = round(pct(agg[f"{op}_us"], 0.99), 1)
        r["lag_p99_ms"] = round(pct(agg["lag_ms"], 0.99), 1)
        if mtext:
            tb = samples(mtext, "moongate_tier_bytes_total")
            r["tier_bytes"] = {dict(k)["tier"]: v for k, v in tb.items()
                               if dict(k).get("arm") == arm and dict(k).get("outcome") == "found" and v}
            ae = samples(mtext, "moongate_arm_errors_total")
            r["denied_keys"] = sum(v for k, v in ae.items() if dict(k).get("arm") == arm
                                   and dict(k).get("method") in ("BatchPutStart", "PutStart")
                                   and dict(k).get("kind") == "app")
            # What is left once the existing keys are taken out: puts the master
            # refused for want of room (NO_AVAILABLE_HANDLE), within the races of
            # keys evicted between the lookup and the put.
            r["refused_keys"] = max(0, r["denied_keys"] - r["put_existing"])
        report["arms"][arm] = r
    if hint_model:
        hr = dict(hint_result)
        lag = hr.pop("lag_ms", [])
        hr["lag_p99_ms"] = round(pct(lag, 0.99), 1)
        hr["spec"] = a.hints
        hr["wrong_blocks"] = wrong_blocks
        for k in ("done_hints", "done_hint_errors"):
            hr[f"worker_{k}"] = sum(st[k] for rs in results.values() for st in rs)
        if mtext:
            hm = samples(mtext, "moongate_hints_matched_total")
            hr["matched"] = {dict(k)["kind"]: v for k, v in hm.items()}
        report["hints"] = hr
    if mtext:
        ev = samples(mtext, "moongate_eviction_keys_total")
        report["evictions"] = {dict(k)["result"]: v for k, v in ev.items()}
        # What the plugins said of themselves (their own counters and gauges).
        report["plugin_metrics"] = [ln for ln in mtext.splitlines()
                                    if ln.startswith("moongate_plugin_")]
    print_table(report)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    bad = sum(r["corrupt"] for r in report["arms"].values())
    sys.exit(1 if bad else 0)


def print_table(rep):
    arms = list(rep["arms"])
    rows = [("workers", "workers"), ("requests", "requests"), ("block lookups", "blocks"),
            ("prefix hits", "hits"), ("hit rate (read byte-exact)", "hit_rate"),
            ("read misses after hit", "read_miss"), ("corrupt reads", "corrupt"),
            ("keys put", "put_keys"), ("put_batch failed (by rc)", "put_failed"),
            ("put keys with an ErrorCode", "denied_keys"),
            ("  of them, keys that existed", "put_existing"),
            ("  the rest, refused for room", "refused_keys"), ("read bytes", "read_bytes"),
            ("put bytes", "put_bytes"), ("tier bytes found (moongate)", "tier_bytes"),
            ("lookup p50 / p99 us", ("lookup_p50_us", "lookup_p99_us")),
            ("get p50 / p99 us", ("get_p50_us", "get_p99_us")),
            ("put p50 / p99 us", ("put_p50_us", "put_p99_us")),
            ("arrival lag p99 ms", "lag_p99_ms")]
    print(f"replay of {rep['trace']}: {rep['requests']} requests ({rep['split']}), "
          f"{rep['value_size']} B blocks, "
          f"speed x{rep['speed']}, {rep['segment_mib']} MiB segment per worker, {rep['wall_s']} s")
    w = 30
    print("| " + "metric".ljust(w) + " | " + " | ".join(a.ljust(18) for a in arms) + " |")
    print("|" + "-" * (w + 2) + "|" + "|".join("-" * 20 for _ in arms) + "|")
    for label, key in rows:
        cells = []
        for a in arms:
            r = rep["arms"][a]
            if isinstance(key, tuple):
                cells.append(f"{r[key[0]]} / {r[key[1]]}")
            else:
                v = r.get(key, "")
                cells.append(json.dumps(v) if isinstance(v, dict) else str(v))
        print("| " + label.ljust(w) + " | " + " | ".join(c.ljust(18) for c in cells) + " |")
    if "evictions" in rep:
        print(f"moongate evictions: {rep['evictions']}")
    if "master" in rep:
        print(f"master: {rep['master']}")
    if "hints" in rep:
        print(f"hints: {rep['hints']}")


if __name__ == "__main__":
    main()
