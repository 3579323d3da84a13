#!/usr/bin/env python3
"""A cache-aware routing index fed by moongate's KV events: which rank's Mooncake pool
holds the longest prefix of a request's blocks, and in which tier.

One moongate runs beside each rank with `[events] enabled = true`. This index subscribes
to all of them, catches up from each one's replay buffer, then follows the live stream
(replaying any sequence gap), and answers queries: a JSON list of block hashes per line
on stdin -> one JSON line on stdout with each rank's matched prefix length and medium,
best first.

  python deploy/examples/kv_router.py \\
      --rank rank0=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558 \\
      --rank rank1=tcp://10.0.0.2:5557,tcp://10.0.0.2:5558
  [101, 102, 103]
  {"best": "rank0", "ranks": [{"rank": "rank0", "prefix_blocks": 3, "media": ["MEMORY"]}, ...]}

With `--hints NAME=URL` the index also tells the moongate of the rank it picked that the
query's blocks will be read soon (moongate's hint API, docs/kv-api.md#hints: `upcoming`
hints, so its eviction keeps them until the request runs). URL is the kv face's
`http://HOST:PORT/v1/hints` or the admin endpoint's `http://HOST:PORT/hints`; the answer
line then says `"hinted": N` (blocks announced) or `"hint_error"`.

  python deploy/examples/kv_router.py --rank rank0=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558 \
      --hints rank0=http://10.0.0.1:50060/v1/hints

With `--hints-pub ENDPOINT` the index publishes the same hints instead, on a ZeroMQ socket
it binds, each message tagged with the picked rank's name (its first frame); each rank's
moongate subscribes with `[hints] subscribe = ["tcp://ROUTER:PORT"]` and
`subscribe_topic = "NAME"`. A hint for a rank whose moongate has not subscribed (within
`--hints-wait-s`, 5 s by default: a moongate reconnects within a second, longer on a
busy host) is not sent: the answer line says `"hint_error"`.

  python deploy/examples/kv_router.py --rank rank0=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558 \
      --hints-pub tcp://0.0.0.0:5590

Needs pyzmq and msgspec. The structures are vLLM's (vllm/distributed/kv_events.py), so
the same index can also read vLLM's own GPU/CPU events: `--encoding map` (default) is
vLLM's current encoding and moongate's default (`[events] encoding`), `--encoding array`
the one before. A hash in a query is an integer, or hex for digests published as bytes
(`[events] block_hash = "bytes"`).
"""
import argparse
import json
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Optional, Union

import msgspec
import zmq
from msgspec.msgpack import Decoder

ExternalBlockHash = Union[bytes, int]


def structures(encoding):
    """vLLM's event structures for one of its encodings: "map" (vllm/distributed/kv_events.py
    today: tagged maps, group_idx and the other later fields) or "array" (the positional
    layout vLLM used before). Returns the batch type to decode with and the event types."""
    array_like = encoding == "array"

    class EventBatch(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: Optional[int] = None

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False,
                       tag=True):
        pass

    if array_like:
        class BlockStored(KVCacheEvent):
            block_hashes: list[ExternalBlockHash]
            parent_block_hash: Optional[ExternalBlockHash]
            token_ids: list[int]
            block_size: int
            lora_id: Optional[int]
            medium: Optional[str]

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[ExternalBlockHash]
            medium: Optional[str]
    else:
        class BlockStored(KVCacheEvent):
            block_hashes: list[ExternalBlockHash]
            parent_block_hash: Optional[ExternalBlockHash]
            token_ids: list[int]
            block_size: int
            lora_id: Optional[int]
            medium: Optional[str]
            lora_name: Optional[str]
            extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
            group_idx: Optional[int] = None
            kv_cache_spec_kind: Optional[str] = None
            kv_cache_spec_sliding_window: Optional[int] = None

        class BlockRemoved(KVCacheEvent):
            block_hashes: list[ExternalBlockHash]
            medium: Optional[str]
            group_idx: Optional[int] = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared


END_SEQ = (-1).to_bytes(8, "big", signed=True)


def replay(ctx, endpoint, start, timeout_ms=5000):
    """Every batch the publisher still buffers from sequence `start` on, as (seq,
    payload) pairs, by vLLM's replay protocol: a DEALER socket (one request, many
    answers) sends the start as 8 bytes big-endian; the answers end with END_SEQ."""
    d = ctx.socket(zmq.DEALER)
    d.connect(endpoint)
    try:
        d.send_multipart([b"", start.to_bytes(8, "big")])
        while d.poll(timeout_ms):
            _, seq_b, payload = d.recv_multipart()
            if seq_b == END_SEQ:
                return
            yield int.from_bytes(seq_b, "big"), payload
        raise TimeoutError(f"replay from {start} at {endpoint}: no end marker")
    finally:
        d.close(linger=0)


class Index:
    """block hash -> {rank: set of media}, updated from events, read by queries."""

    def __init__(self, encoding):
        self.lock = threading.Lock()
        self.blocks = {}
        self.batch, self.stored, self.removed, _ = structures(encoding)

    def apply(self, rank, batch):
        with self.lock:
            for e in batch.events:
                if isinstance(e, self.stored):
                    for h in e.block_hashes:
                        self.blocks.setdefault(h, {}).setdefault(rank, set()).add(e.medium)
                elif isinstance(e, self.removed):
                    for h in e.block_hashes:
                        ranks = self.blocks.get(h, {})
                        media = ranks.get(rank, set())
                        # No medium: the block is gone from every tier.
                        media.difference_update({e.medium} if e.medium else set(media))
                        if not media:
                            ranks.pop(rank, None)
                        if not ranks:
                            self.blocks.pop(h, None)
                else:
                    for h in list(self.blocks):
                        self.blocks[h].pop(rank, None)
                        if not self.blocks[h]:
                            del self.blocks[h]

    def query(self, hashes, ranks):
        hashes = [bytes.fromhex(h) if isinstance(h, str) else h for h in hashes]
        out = []
        with self.lock:
            for r in ranks:
                n, media = 0, set()
                for h in hashes:
                    held = self.blocks.get(h, {}).get(r)
                    if not held:
                        break
                    n += 1
                    media |= held
                out.append({"rank": r, "prefix_blocks": n, "media": sorted(m or "" for m in media)})
        out.sort(key=lambda x: -x["prefix_blocks"])
        return {"best": out[0]["rank"] if out and out[0]["prefix_blocks"] else None, "ranks": out}


def follow(ctx, rank, pub, replay_endpoint, index, caught_up):
    decoder = Decoder(type=index.batch)
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    last = -1

    def catch_up(start):
        nonlocal last
        for seq, payload in replay(ctx, replay_endpoint, start):
            if seq > last:
                index.apply(rank, decoder.decode(payload))
                last = seq

    # Everything the publisher still buffers, then the live stream.
    catch_up(0)
    caught_up.release()
    while True:
        _, seq_b, payload = sub.recv_multipart()
        seq = int.from_bytes(seq_b, "big")
        if seq <= last:
            continue
        if seq > last + 1:
            catch_up(last + 1)
            if seq <= last:
                continue
        index.apply(rank, decoder.decode(payload))
        last = seq


def send_hints(url, hashes, session, timeout_s=2.0):
    """Announces `hashes` as upcoming reads to the moongate at `url`: returns how many it
    accepted, or raises with its answer. Hashes go as the events publish them: integers,
    or hex for digests."""
    body = json.dumps({"hints": [{"kind": "upcoming", "blocks": hashes,
                                  "session": session}]}).encode()
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())["accepted"]
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{e.code} {e.read().decode(errors='replace')}") from e


class HintPublisher:
    """Hints on a ZeroMQ socket for subscribing moongates, one topic per rank. An XPUB
    socket, so the router sees who subscribed: PUB would drop a rank's hints silently
    when its moongate is not (yet) connected."""

    def __init__(self, endpoint):
        # A context of its own, so closing can wait for this socket alone (the event
        # followers' sockets live in other threads).
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.sock.bind(endpoint)
        self.topics = {}

    def _take_subscriptions(self, timeout_ms):
        while self.sock.poll(timeout_ms):
            timeout_ms = 0
            msg = self.sock.recv()
            # 1 + topic subscribes, 0 + topic unsubscribes (one per subscriber).
            delta = {1: 1, 0: -1}.get(msg[0] if msg else None, 0)
            self.topics[msg[1:]] = self.topics.get(msg[1:], 0) + delta

    def _subscribed(self, topic):
        return any(n > 0 and topic.startswith(t) for t, n in self.topics.items())

    def send(self, rank, hashes, session, wait_s):
        """Publishes `hashes` as upcoming for `rank`; returns how many were sent."""
        topic = rank.encode()
        deadline = time.monotonic() + wait_s
        self._take_subscriptions(0)
        while not self._subscribed(topic):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"no moongate subscribed to rank {rank!r}'s hints")
            self._take_subscriptions(int(left * 1000) + 1)
        body = json.dumps({"hints": [{"kind": "upcoming", "blocks": hashes,
                                      "session": session}]}).encode()
        self.sock.send_multipart([topic, body])
        return len(hashes)

    def close(self, linger_ms=5000):
        """Delivers what is still queued (for up to `linger_ms`), then closes. Without
        it, hints published just before the router exits are lost: pyzmq does not
        terminate contexts at interpreter exit, so queued messages die with the process
        (seen as a moongate that subscribed and then lost the publisher, hint unread)."""
        self.sock.close(linger=linger_ms)
        self.ctx.term()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", action="append", required=True,
                   help="NAME=PUB_ENDPOINT,REPLAY_ENDPOINT (one per moongate)")
    p.add_argument("--encoding", choices=["map", "array"], default="map",
                   help="the publishers' [events] encoding (vLLM's map or array layout)")
    p.add_argument("--hints", action="append", default=[],
                   help="NAME=URL: announce a query's blocks as upcoming to the picked "
                        "rank's moongate (its /v1/hints or admin /hints)")
    p.add_argument("--hints-pub", metavar="ENDPOINT",
                   help="publish those hints on a ZeroMQ socket bound here instead, "
                        "topic = the rank's name, for moongates' hints.subscribe")
    p.add_argument("--hints-wait-s", type=float, default=5.0,
                   help="with --hints-pub: how long a hint waits for its rank's moongate "
                        "to subscribe before it is reported as hint_error")
    a = p.parse_args()
    if a.hints and a.hints_pub:
        p.error("--hints and --hints-pub: one or the other")
    hint_urls = {}
    for h in a.hints:
        name, sep, url = h.partition("=")
        if not sep or not url.startswith("http://"):
            p.error(f"--hints {h!r}: expected NAME=http://HOST:PORT/PATH")
        hint_urls[name] = url
    ctx = zmq.Context()
    publisher = HintPublisher(a.hints_pub) if a.hints_pub else None
    index = Index(a.encoding)
    names = []
    caught_up = threading.Semaphore(0)
    for spec in a.rank:
        name, _, eps = spec.partition("=")
        pub, _, replay = eps.partition(",")
        names.append(name)
        threading.Thread(target=follow, args=(ctx, name, pub, replay, index, caught_up),
                         daemon=True).start()
    for _ in names:
        caught_up.acquire()
    print("READY", flush=True)
    # A stop (SIGTERM) ends the loop as the end of input does, so the hints already
    # published are still delivered by the publisher's close below: killed at once,
    # the process lost a hint still queued in its socket.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        serve(sys.stdin, index, names, hint_urls, publisher, a.hints_wait_s)
    finally:
        if publisher:
            publisher.close()


def serve(lines, index, names, hint_urls, publisher, hints_wait_s):
    """Answers one query (a JSON list of block hashes) per line of input."""
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        hashes = json.loads(line)
        answer = index.query(hashes, names)
        # The request goes to the best rank (any rank when none holds a prefix): its
        # moongate learns which blocks the request will read.
        rank = answer["best"] or (names[0] if names else None)
        url = hint_urls.get(rank)
        if (url or publisher) and rank and hashes:
            try:
                if publisher:
                    answer["hinted"] = publisher.send(rank, hashes, f"query-{n}",
                                                      hints_wait_s)
                else:
                    answer["hinted"] = send_hints(url, hashes, f"query-{n}")
            except (OSError, RuntimeError, ValueError, KeyError, zmq.ZMQError) as e:
                answer["hint_error"] = str(e)
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
