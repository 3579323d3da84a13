#!/usr/bin/env python3
"""A small client for moongate's kv face (docs/kv-api.md), standard library only.

    from kv_client import KvClient
    kv = KvClient("127.0.0.1:50060")          # or KvClient(unix="/run/moongate/kv.sock")
    kv.put("model/0/blk42", block_bytes)
    data = kv.get("model/0/blk42")           # None when absent
    kv.exists(["model/0/blk42", "other"])    # [True, False]
    kv.delete("model/0/blk42")               # False when absent
    kv.batch_put([("a", b"1"), ("b", b"2")])  # [None, None] (or a KvError per item)
    kv.batch_get(["a", "b", "c"])            # [b"1", b"2", None] (or a KvError per key)

Errors other than "absent" raise KvError with the status and moongate's reason; 503
means the node's byte budget is full (retry later), 409 on delete means a reader holds
a lease on the key (Mooncake leases a key for 10 s after every lookup that found it,
reads included). One keep-alive connection per
client object; not thread-safe (make one per thread).

Run as a script for a round trip: `python kv_client.py (--addr HOST:PORT | --unix PATH)`.
"""
import argparse
import http.client
import json
import os
import socket
import struct
import sys
import urllib.parse


class KvError(Exception):
    def __init__(self, status, reason):
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path, timeout):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self._path)
        self.sock = s


class KvClient:
    def __init__(self, addr=None, unix=None, timeout=30.0):
        if (addr is None) == (unix is None):
            raise ValueError("give addr=HOST:PORT or unix=PATH")
        if unix:
            self._conn = _UnixConnection(unix, timeout)
        else:
            host, port = addr.rsplit(":", 1)
            self._conn = http.client.HTTPConnection(host, int(port), timeout=timeout)

    def _call(self, method, path, body=None):
        self._conn.request(method, path, body=body)
        r = self._conn.getresponse()
        data = r.read()
        return r.status, data

    @staticmethod
    def _path(key):
        return "/v1/kv/" + urllib.parse.quote(key, safe="")

    @staticmethod
    def _fail(status, data):
        try:
            reason = json.loads(data)["error"]
        except Exception:
            reason = data.decode(errors="replace")
        raise KvError(status, reason)

    def put(self, key, value):
        status, data = self._call("PUT", self._path(key), bytes(value))
        if status != 201:
            self._fail(status, data)

    def get(self, key):
        status, data = self._call("GET", self._path(key))
        if status == 404:
            return None
        if status != 200:
            self._fail(status, data)
        return data

    def delete(self, key):
        status, data = self._call("DELETE", self._path(key))
        if status == 404:
            return False
        if status != 204:
            self._fail(status, data)
        return True

    def exists(self, keys):
        status, data = self._call("POST", "/v1/kv/exists", json.dumps(list(keys)).encode())
        if status != 200:
            self._fail(status, data)
        return json.loads(data)

    def batch_get(self, keys):
        """Values in key order: bytes, None when absent, or a KvError (503: busy, retry)."""
        keys = list(keys)
        status, data = self._call("POST", "/v1/kv/batch/get", json.dumps(keys).encode())
        if status != 200:
            self._fail(status, data)
        out, at = [], 0
        while at < len(data):  # u16 status | u64 len | payload, little-endian
            st, n = struct.unpack_from("<HQ", data, at)
            payload = data[at + 10:at + 10 + n]
            at += 10 + n
            if st == 200:
                out.append(payload)
            elif st == 404:
                out.append(None)
            else:
                out.append(KvError(st, json.loads(payload).get("error", "")))
        if len(out) != len(keys):
            raise KvError(0, f"{len(out)} answers for {len(keys)} keys")
        return out

    def batch_put(self, items):
        """Stores (key, value) pairs in one call: None per stored item, else a KvError."""
        body = bytearray()
        for key, value in items:  # u16 key_len | key | u64 value_len | value
            k = key.encode()
            body += struct.pack("<H", len(k)) + k + struct.pack("<Q", len(value)) + bytes(value)
        status, data = self._call("POST", "/v1/kv/batch/put", bytes(body))
        if status != 200:
            self._fail(status, data)
        return [None if o["status"] == 201 else KvError(o["status"], o.get("error", ""))
                for o in json.loads(data)]


def main():
    p = argparse.ArgumentParser(description="kv face round trip")
    p.add_argument("--addr")
    p.add_argument("--unix")
    p.add_argument("--key", default="example/block")
    p.add_argument("--size", type=int, default=1 << 20)
    a = p.parse_args()
    kv = KvClient(addr=a.addr, unix=a.unix)
    value = os.urandom(a.size)
    kv.put(a.key, value)
    back = kv.get(a.key)
    found = kv.exists([a.key, a.key + "/absent"])
    # A key just read is leased: delete one that was only written.
    kv.put(a.key + "/tmp", b"short-lived")
    stored = kv.batch_put([(a.key + "/b1", b"one"), (a.key, b"again")])
    batch = kv.batch_get([a.key + "/b1", a.key + "/absent", a.key])
    result = {"roundtrip_ok": back == value, "exists": found,
              "absent_get": kv.get(a.key + "/absent"), "deleted": kv.delete(a.key + "/tmp"),
              "after_delete": kv.get(a.key + "/tmp"),
              "batch_put": [None if e is None else e.status for e in stored],
              "batch_ok": batch[0] == b"one" and batch[1] is None and batch[2] == value}
    print(json.dumps(result))
    ok = result["roundtrip_ok"] and found == [True, False] and result["batch_ok"]
    sys.exit(0 if ok and result["batch_put"] == [None, 409] else 1)


if __name__ == "__main__":
    main()
