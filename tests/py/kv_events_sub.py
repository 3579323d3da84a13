#!/usr/bin/env python3
"""A KV-events subscriber as routers write them: vLLM's declared structures (msgspec,
taken from deploy/examples/kv_router.py),
a SUB socket for batches, the replay socket for sequence gaps.

Commands on stdin, each answered with a "READY <what>" line on stdout:
  pause        close the SUB socket (events published meanwhile are missed)
  resume       subscribe again; the next batch shows the gap, which is replayed
  finish N     make sure batches 0..N-1 were all received (replaying what is missing),
               write the result JSON to --out and exit
"""
import argparse
import json
import os
import queue
import sys
import threading
import time

import zmq
from msgspec.msgpack import Decoder

# The structures as vllm/distributed/kv_events.py declares them, from the router
# example (the code a router would run; this test proves it reads moongate's events).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../deploy/examples"))
from kv_router import replay, structures  # noqa: E402


def hash_json(h):
    """Digests published as bytes become hex; ints stay ints."""
    return h.hex() if isinstance(h, bytes) else h


def as_json(e, stored, removed):
    group = getattr(e, "group_idx", None)
    if isinstance(e, stored):
        out = {"type": "BlockStored", "hashes": [hash_json(h) for h in e.block_hashes],
               "parent": None if e.parent_block_hash is None else hash_json(e.parent_block_hash),
               "block_size": e.block_size, "medium": e.medium}
    elif isinstance(e, removed):
        out = {"type": "BlockRemoved", "hashes": [hash_json(h) for h in e.block_hashes],
               "medium": e.medium}
    else:
        return {"type": "AllBlocksCleared"}
    if group is not None:
        out["group"] = group
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--replay", required=True)
    p.add_argument("--topic", default="")
    p.add_argument("--out", required=True)
    p.add_argument("--encoding", choices=["map", "array"], default="map")
    a = p.parse_args()
    batch, stored, removed, _ = structures(a.encoding)
    decoder = Decoder(type=batch)
    ctx = zmq.Context()
    got = {}
    replayed = []
    gaps = 0

    def subscribe():
        s = ctx.socket(zmq.SUB)
        s.connect(a.endpoint)
        s.setsockopt_string(zmq.SUBSCRIBE, a.topic)
        return s

    def catch_up(start):
        for seq, payload in replay(ctx, a.replay, start):
            if seq not in got:
                got[seq] = decoder.decode(payload)
                replayed.append(seq)

    def last():
        return max(got) if got else -1

    cmds = queue.Queue()
    threading.Thread(target=lambda: [cmds.put(l.strip()) for l in sys.stdin], daemon=True).start()
    sub = subscribe()
    # The slow-joiner: a SUB socket receives only after its subscription reached the
    # publisher. Nothing to wait for here: a missed first batch is replayed.
    print("READY subscribed", flush=True)
    while True:
        if sub is not None and sub.poll(20):
            topic, seq_b, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if seq > last() + 1:
                gaps += 1
                catch_up(last() + 1)
            if seq not in got:
                got[seq] = decoder.decode(payload)
        try:
            cmd = cmds.get_nowait()
        except queue.Empty:
            continue
        if cmd == "pause":
            sub.close(linger=0)
            sub = None
            print("READY paused", flush=True)
        elif cmd == "resume":
            sub = subscribe()
            print("READY resumed", flush=True)
        elif cmd.startswith("finish"):
            n = int(cmd.split()[1])
            deadline = time.time() + 10
            while len([s for s in got if s < n]) < n and time.time() < deadline:
                if sub is not None and sub.poll(100):
                    topic, seq_b, payload = sub.recv_multipart()
                    seq = int.from_bytes(seq_b, "big")
                    got.setdefault(seq, decoder.decode(payload))
                missing = [s for s in range(n) if s not in got]
                if missing:
                    catch_up(missing[0])
            out = {
                "batches": [{"seq": s, "ts": got[s].ts, "events": [as_json(e, stored, removed) for e in got[s].events]}
                            for s in sorted(got)],
                "replayed": sorted(replayed),
                "gaps": gaps,
            }
            with open(a.out, "w") as f:
                json.dump(out, f)
            print("READY finished", flush=True)
            return


if __name__ == "__main__":
    main()
