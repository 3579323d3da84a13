#!/usr/bin/env python3
"""Real vLLM (its CPU build) loading a prompt's prefix by both connectors in one run:
time to first token and tokens loaded per second, against recompute.

    bash benches/run_vllm_prefix.sh [--tokens 4096] [--layers 8] [--hidden 1024] [--repeat 5]

- recompute: the prompts with no connector;
- moongate's connector (`moongate_kv.vllm`): one process stores the prompts' blocks
  through reservations, another one loads them through views;
- vLLM's `MooncakeStoreConnector` in standalone-store mode through moongate's master face,
  a Mooncake owner (`mooncake_client`) holding the pool: the same store, then load.

Each process runs R distinct prompts (`--repeat`), one generation each, so that no run
finds another's prefix in vLLM's own cache; each figure is the median of the runs after
the first (the first is reported apart: it includes connecting and mapping). TTFT is the time of a one-token generation. The model
is a Llama built locally (random weights; `tests/py/vllm_tiny_model.py`) large enough
that a prefill takes time on a CPU: 8 layers, hidden 1024, 8 KV heads of 128 by default
(32 KiB of KV per token). Needs .venv-vllm (scripts/vllm_env.sh) and release builds.
Prints one JSON document and a table.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from benchlib import free_port, master_cmd, run, start_kv_moongate, stop_all, work_dir  # noqa: E402

GiB = 1 << 30


def engine(a, work, name, mode, extra_args, env):
    cmd = [sys.executable, os.path.join(ROOT, "tests/py/vllm_connector.py"), "--model", a.model,
           "--mode", mode, "--prompt-tokens", str(a.tokens), "--max-tokens", "1",
           "--repeat", str(a.repeat)] + extra_args
    with open(f"{work}/{name}.log", "w") as log:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                           timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{name}: exit {r.returncode}; see {work}/{name}.log")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    runs = res["runs"]
    later = runs[1:] or runs
    res["ttft_first_s"] = runs[0]["total_s"]
    res["ttft_s"] = statistics.median(x["total_s"] for x in later)
    res["cached"] = statistics.median(x["cached_tokens"] for x in later)
    print(f"{name}: TTFT {res['ttft_s'] * 1e3:.1f} ms (first {res['ttft_first_s'] * 1e3:.1f}), "
          f"cached {res['cached']:.0f} of {res['prompt_tokens']}", file=sys.stderr, flush=True)
    return res


def _mounted(admin):
    """Whether moongate relayed a MountSegment (the owner's) to the master."""
    import urllib.request
    with urllib.request.urlopen(f"{admin}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith('moongate_master_requests_total{method="MountSegment"}'):
                return float(line.split()[-1]) >= 1
    return False


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--moongate", default=os.path.join(ROOT, "target/release/moongate"))
    p.add_argument("--lib", default=os.path.join(ROOT, "target/release/libmoongate_kv.so"))
    p.add_argument("--model", help="a model directory (default: built here)")
    a = p.parse_args()
    work = work_dir("vllm-prefix-")
    if not a.model:
        a.model = f"{work}/model"
        subprocess.run([sys.executable, os.path.join(ROOT, "tests/py/vllm_tiny_model.py"), a.model,
                        "--layers", str(a.layers), "--hidden", str(a.hidden), "--heads",
                        str(a.heads), "--kv-heads", str(a.kv_heads)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "clients/python"),
           "MOONGATE_KV_LIB": a.lib, "MC_TCP_BIND_ADDRESS": "127.0.0.1",
           "VLLM_HOST_IP": "127.0.0.1"}
    procs = []
    out = {"host": {"cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")},
           "model": {"layers": a.layers, "hidden": a.hidden, "kv_heads": a.kv_heads},
           "prompt_tokens": a.tokens}
    try:
        rpc, http = free_port(), free_port()
        procs.append(subprocess.Popen(master_cmd(rpc, http), stdout=subprocess.DEVNULL,
                                      stderr=open(f"{work}/master.log", "w")))
        metadata = f"http://127.0.0.1:{http}/metadata"
        admin, listen, sock = start_kv_moongate(a.moongate, work, rpc, metadata, 2 * GiB, procs)
        out["recompute"] = engine(a, work, "recompute", "plain", [], env)
        mg = ["--address", f"unix:{sock}"]
        out["moongate_store"] = engine(a, work, "moongate-store", "moongate", mg, env)
        out["moongate"] = engine(a, work, "moongate-load", "moongate", mg, env)
        # vLLM's own connector: an owner holding the pool, ranks with no segment, all
        # pointed at moongate's master face.
        import mooncake
        owner = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_client")
        procs.append(subprocess.Popen(
            [owner, "--host=127.0.0.1", f"--port={free_port()}",
             f"--master_server_address={listen}", f"--metadata_server={metadata}",
             "--global_segment_size=2 GB", "--protocol=tcp", "--logtostderr"],
            stdout=subprocess.DEVNULL, stderr=open(f"{work}/owner.log", "w"), env=env))
        cfg = f"{work}/mooncake.json"
        with open(cfg, "w") as f:
            json.dump({"metadata_server": metadata, "master_server_address": listen,
                       "protocol": "tcp", "device_name": "", "mode": "standalone-store",
                       "global_segment_size": 0, "local_buffer_size": "1GB"}, f)
        menv = {**env, "MOONCAKE_CONFIG_PATH": cfg}
        # The owner mounts its segment through moongate: a store before then has no room.
        deadline = time.time() + 60
        while not _mounted(admin):
            if time.time() > deadline:
                raise SystemExit(f"the owner's segment not mounted; see {work}/owner.log")
            time.sleep(0.2)
        out["mooncake_store"] = engine(a, work, "mooncake-store", "mooncake", [], menv)
        out["mooncake"] = engine(a, work, "mooncake-load", "mooncake", [], menv)
    finally:
        stop_all(procs)
    rec = out["recompute"]["ttft_s"]
    kv_per_token = 2 * a.layers * a.kv_heads * (a.hidden // a.heads) * 2
    rows = []
    for name in ["recompute", "moongate", "mooncake"]:
        r = out[name]
        same = [x["tokens"] for x in r["runs"]] == [x["tokens"] for x in out["recompute"]["runs"]]
        loaded = r["cached"]
        rows.append({"path": name, "ttft_ms": r["ttft_s"] * 1e3,
                     "ttft_first_ms": r["ttft_first_s"] * 1e3,
                     "vs_recompute": rec / r["ttft_s"], "loaded_tokens": loaded,
                     "loaded_tokens_per_s": loaded / r["ttft_s"] if loaded else 0.0,
                     "loaded_GBps": loaded * kv_per_token / r["ttft_s"] / 1e9,
                     "same_token": same})
    out["table"] = rows
    print(json.dumps(out, indent=1))
    print(f"\nhost: {out['host']['cores']} cores, {out['host']['date']}; prompt {a.tokens} tokens, "
          f"{kv_per_token // 1024} KiB of KV per token", file=sys.stderr)
    print("path      | TTFT ms | first ms | vs recompute | loaded | tokens/s loaded | GB/s | same token",
          file=sys.stderr)
    for r in rows:
        print(f"{r['path']:9s} | {r['ttft_ms']:7.1f} | {r['ttft_first_ms']:8.1f} | "
              f"{r['vs_recompute']:11.2f}x | {r['loaded_tokens']:6.0f} | "
              f"{r['loaded_tokens_per_s']:15.0f} | {r['loaded_GBps']:4.2f} | {r['same_token']}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    run(main)
