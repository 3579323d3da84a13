#!/usr/bin/env python3
"""The prefix gate on a GPU: a Llama-architecture transformer (transformers' Llama,
random weights, bf16, sdpa) prefills P tokens; its KV (K and V per layer) is stored
through moongate from GPU memory (reservations, DMA); the engine process exits; a new
engine process loads the prefix into GPU memory (views, DMA) and computes the next
token. Checked: the KV bytes identical (checksums on the GPU), the next-token logits
bitwise equal to those computed from KV that never left the GPU. Reported per model
shape and P: recompute time, load GB/s, TTFT with the cache vs recompute, store GB/s.

Beside it, in the same run, the same bytes (1 GiB as 64 values) moved into GPU memory
by: the host's pinned H2D copy (the link), moongate's views, moongate's copying path
(mg_batch_get_into into registered mg_alloc memory, then H2D), Mooncake's embedded
client (batch_get_into a registered pinned buffer over TE-TCP from moongate's segment,
then H2D), and Mooncake's owner with a dummy client (its shared-memory path, then H2D);
and Mooncake's CUDA client (0.3.14) through moongate's master face, reading straight
into GPU memory over TCP (bytes and moongate's frame errors checked).

Runs on the GPU host (docs/results.md names it); not CI. Everything it needs travels in
.gpu/ (scripts/gpu_pack.sh) and the repository:

    python3 benches/gpu_gate.py --pack .gpu --out OUT [--shapes 8b,70b10] [--tokens 2048,8192,32768]

Prints one JSON document (also OUT/gpu_gate.json) and a table.
"""
import argparse
import ctypes
import json
import os
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.environ.get("GPU_PYTHON", os.path.join(ROOT, "clients", "python")))
from benchlib import free_port, stop_all, wait_http  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
SHAPES = {
    # Llama-3-8B.
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8),
    # Llama-3-70B's layer shape, 10 layers (prefill and KV both scale with layers).
    "70b10": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=10,
                  num_attention_heads=64, num_key_value_heads=8),
}
MICRO_N, MICRO_SIZE = 64, 16 * MiB  # 1 GiB as 64 values
# `--device cpu --shapes tiny` runs the gate's logic on a machine without a GPU (a
# smoke test of the script itself; its figures mean nothing).
SHAPES["tiny"] = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
DEVICE = os.environ.get("GATE_DEVICE", "cuda")


def sync():
    import torch
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- engine processes --

def model_of(shape, seed=0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    vocab = 1000 if shape == "tiny" else 128256
    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=131072, rope_theta=500000.0,
                      **SHAPES[shape])
    try:
        cfg._attn_implementation = "sdpa"
    except Exception:  # a release where it is read-only: sdpa is its default
        pass
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(DEVICE):
        m = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    m.eval()
    # The same weights in every process (seeded on the GPU): checked by their sum.
    with torch.no_grad():
        fp = float(sum(p.float().sum().item() for p in list(m.parameters())[:8]))
    return m, fp


def kv_of(cache):
    if hasattr(cache, "layers"):
        return [(l.keys, l.values) for l in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def cache_of(kv):
    from transformers import DynamicCache
    c = DynamicCache()
    for i, (k, v) in enumerate(kv):
        c.update(k, v, i)
    return c


def checksum(tensors):
    """A position-weighted sum of every tensor's bytes (as int32 words), on the GPU."""
    import torch
    total = 0
    for t in tensors:
        w = t.contiguous().view(torch.int32).reshape(-1).to(torch.int64)
        idx = torch.arange(w.numel(), device=w.device, dtype=torch.int64) % 65521 + 1
        total = (total + int((w * idx).sum().item())) % (1 << 61)
    return total


def tokens(p, seed=1, vocab=1000):
    import torch
    g = torch.Generator().manual_seed(seed * 1000003 + p)
    return torch.randint(0, vocab, (1, p + 1), generator=g).to(DEVICE)


def keys_for(shape, p, layers):
    return [f"gate/{shape}/{p}/{i}/{kv}" for i in range(layers) for kv in ("k", "v")]


def role_prefill(a):
    """Prefills each P, stores its KV through moongate, computes the reference next-token
    logits from the KV still on the GPU; writes what the loader checks."""
    import torch
    import moongate_kv
    import moongate_kv.torch as mgt
    m, fp = model_of(a.shape)
    c = moongate_kv.Client(f"unix:{a.sock}")
    t = time.perf_counter()
    mgt.register(c, read=False, write=True)
    reg_s = time.perf_counter() - t
    out = {"weights": fp, "register_s": reg_s, "runs": {}}
    with torch.no_grad():
        # Warm-up: kernels, cuBLAS handles.
        m(tokens(256)[:, :256], use_cache=True, logits_to_keep=1)
        for p in [int(x) for x in a.tokens.split(",")]:
            ids = tokens(p)
            # Recompute: the whole prompt (P + 1 tokens), next-token logits only; once
            # at this P untimed (the first call of a shape picks its kernels), then the
            # median of --reps.
            times = []
            for _ in range(a.reps + 1):
                sync()
                t = time.perf_counter()
                m(ids, use_cache=True, logits_to_keep=1)
                sync()
                times.append(time.perf_counter() - t)
            recompute = statistics.median(times[1:])
            r = m(ids[:, :p], use_cache=True, logits_to_keep=1)
            kv = kv_of(r.past_key_values)
            flat = [x for pair in kv for x in pair]
            keys = keys_for(a.shape, p, len(kv))
            nbytes = sum(x.numel() * x.element_size() for x in flat)
            sync()
            t = time.perf_counter()
            staged = mgt.store(c, keys, flat)
            store_s = time.perf_counter() - t
            # The reference: the next token from the same KV never moved, laid out as a
            # loader lays it (contiguous tensors): the model's own cache may be strided
            # views, for which attention can pick other kernels and round differently.
            ref = m(ids[:, p:], past_key_values=cache_of([(k.contiguous(), v.contiguous())
                                                           for k, v in kv]),
                    use_cache=True).logits
            torch.save(ref.cpu(), os.path.join(a.work, f"ref-{a.shape}-{p}.pt"))
            out["runs"][str(p)] = {
                "kv_bytes": nbytes, "values": len(flat), "recompute_s": recompute,
                "store_s": store_s, "store_GBps": nbytes / store_s / 1e9, "staged": staged,
                "checksum": checksum(flat),
                "shapes": [list(x.shape) for x in flat[:2]], "dtype": str(flat[0].dtype)}
            log(f"prefill {a.shape} P={p}: recompute {recompute*1e3:.1f} ms, "
                f"store {nbytes / store_s / 1e9:.2f} GB/s ({staged} staged)")
            del r, kv, flat
            torch.cuda.empty_cache()
    c.close()
    print(json.dumps(out), flush=True)


def role_load(a):
    """A new engine: loads each P's KV into GPU memory through moongate's views, builds
    the cache, computes the next token; checks bytes and logits."""
    import torch
    import moongate_kv
    import moongate_kv.torch as mgt
    stored = json.loads(open(os.path.join(a.work, f"prefill-{a.shape}.json")).read())
    m, fp = model_of(a.shape)
    assert fp == stored["weights"], f"weights differ across processes: {fp} {stored['weights']}"
    c = moongate_kv.Client(f"unix:{a.sock}")
    t = time.perf_counter()
    mgt.register(c, read=True, write=False)
    out = {"register_s": time.perf_counter() - t, "runs": {}}
    sh = SHAPES[a.shape]
    layers = sh["num_hidden_layers"]
    kvh, hd = sh["num_key_value_heads"], sh["hidden_size"] // sh["num_attention_heads"]
    with torch.no_grad():
        # Warm-up decode on a small cache (a serving engine is warm).
        small = [torch.randn(1, kvh, 16, hd, device=DEVICE, dtype=torch.bfloat16)
                 for _ in range(2 * layers)]
        m(tokens(16)[:, 16:], past_key_values=cache_of(list(zip(small[::2], small[1::2]))),
          use_cache=True)
        for p in [int(x) for x in a.tokens.split(",")]:
            s = stored["runs"][str(p)]
            ids = tokens(p)
            keys = keys_for(a.shape, p, layers)
            dst = [torch.empty(1, kvh, p, hd, device=DEVICE, dtype=torch.bfloat16)
                   for _ in keys]
            loads = []
            for _ in range(a.reps):
                sync()
                t = time.perf_counter()
                staged = mgt.load(c, keys, dst)
                sync()
                loads.append(time.perf_counter() - t)
            ok_bytes = checksum(dst) == s["checksum"]
            ref = torch.load(os.path.join(a.work, f"ref-{a.shape}-{p}.pt"))
            # TTFT with the cache: load, cache, next token, whole; once untimed at this
            # P, then the median of --reps.
            ttfts, decodes = [], []
            for _ in range(a.reps + 1):
                sync()
                t = time.perf_counter()
                mgt.load(c, keys, dst)
                sync()
                t1 = time.perf_counter()
                cache = cache_of(list(zip(dst[::2], dst[1::2])))
                logits = m(ids[:, p:], past_key_values=cache, use_cache=True).logits
                sync()
                ttfts.append(time.perf_counter() - t)
                decodes.append(time.perf_counter() - t1)
                del cache
            ttft = statistics.median(ttfts[1:])
            got = logits.cpu()
            # Against the storing process's reference: kernels may differ between
            # processes (measured: bf16 rounding, at most a few hundredths).
            equal = torch.equal(got, ref)
            diff = float((got.float() - ref.float()).abs().max())
            same_token = bool(torch.equal(got[..., -1, :].argmax(-1), ref[..., -1, :].argmax(-1)))
            # The never-stored path in this same process: the prompt prefilled here, its
            # KV never leaving the GPU (laid out as loaded), the same next-token step.
            r = m(ids[:, :p], use_cache=True, logits_to_keep=1)
            own = [(k.contiguous(), v.contiguous()) for k, v in kv_of(r.past_key_values)]
            del r
            same_kv = checksum([x for pair in own for x in pair]) == s["checksum"]
            local = m(ids[:, p:], past_key_values=cache_of(own), use_cache=True).logits.cpu()
            del own
            equal_here = torch.equal(got, local)
            load_s = statistics.median(loads)
            out["runs"][str(p)] = {
                "load_s": load_s, "load_GBps": s["kv_bytes"] / load_s / 1e9,
                "loads_s": loads, "staged": staged, "bytes_identical": ok_bytes,
                "logits_bitwise_equal": equal, "logits_max_abs_diff": diff,
                "logits_bitwise_equal_same_process": equal_here,
                "prefill_kv_equal_across_processes": same_kv,
                "next_token_equal": same_token, "ttft_cache_s": ttft,
                "decode_s": statistics.median(decodes[1:]), "recompute_s": s["recompute_s"],
                "ttft_speedup": s["recompute_s"] / ttft, "store_GBps": s["store_GBps"],
                "kv_bytes": s["kv_bytes"], "values": s["values"]}
            log(f"load {a.shape} P={p}: {s['kv_bytes'] / load_s / 1e9:.2f} GB/s, TTFT "
                f"{ttft*1e3:.1f} ms vs recompute {s['recompute_s']*1e3:.1f} ms "
                f"({s['recompute_s'] / ttft:.2f}x), bytes {ok_bytes}, logits {equal}")
            del dst
            torch.cuda.empty_cache()
    c.close()
    print(json.dumps(out), flush=True)


# ----------------------------------------------------------------- the same bytes --

def gbps(secs, n=MICRO_N * MICRO_SIZE):
    return {"median_GBps": n / statistics.median(secs) / 1e9, "best_GBps": n / min(secs) / 1e9,
            "runs": len(secs)}


def micro_values():
    """64 GPU tensors of 16 MiB with distinct bytes."""
    import torch
    g = torch.Generator(device=DEVICE).manual_seed(7)
    return [torch.randint(0, 255, (MICRO_SIZE,), dtype=torch.uint8, device=DEVICE, generator=g)
            for _ in range(MICRO_N)]


def role_micro(a):
    """1 GiB as 64 values into GPU memory: the link, moongate's views, moongate's copying
    path; and the store from GPU memory through reservations."""
    import torch
    import moongate_kv
    import moongate_kv.torch as mgt
    out = {}
    vals = micro_values()
    n = MICRO_N * MICRO_SIZE
    # The link: one pinned buffer of 1 GiB to the GPU and back.
    host = torch.empty(n, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
    dev = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    for name, f in [("pinned_h2d", lambda: dev.copy_(host, non_blocking=True)),
                    ("pinned_d2h", lambda: host.copy_(dev, non_blocking=True))]:
        secs = []
        for _ in range(a.reps + 1):
            sync()
            t = time.perf_counter()
            f()
            sync()
            secs.append(time.perf_counter() - t)
        out[name] = gbps(secs[1:])
    del host, dev
    c = moongate_kv.Client(f"unix:{a.sock}")
    t = time.perf_counter()
    maps = mgt.register(c)
    out["register"] = {"seconds": time.perf_counter() - t,
                       "bytes": sum(length for _, length, _ in maps)}
    keys = [f"micro/{i}" for i in range(MICRO_N)]
    # Store from GPU memory: new keys each round, removed after it (untimed).
    secs = []
    for r in range(a.reps):
        ks = [f"micro/s{r}/{i}" for i in range(MICRO_N)]
        sync()
        t = time.perf_counter()
        mgt.store(c, ks, vals)
        secs.append(time.perf_counter() - t)
        for k in ks:
            for _ in range(100):
                try:
                    c.remove(k)
                    break
                except moongate_kv.MoongateError:
                    time.sleep(0.05)
    out["moongate_store_from_gpu"] = gbps(secs)
    mgt.store(c, keys, vals)
    dst = [torch.empty(MICRO_SIZE, dtype=torch.uint8, device=DEVICE) for _ in keys]
    secs = []
    for _ in range(a.reps + 1):
        sync()
        t = time.perf_counter()
        mgt.load(c, keys, dst)
        sync()
        secs.append(time.perf_counter() - t)
    out["moongate_view_to_gpu"] = gbps(secs[1:])
    out["moongate_view_bytes_equal"] = all(torch.equal(x, y) for x, y in zip(dst, vals))
    # The copying path: mg_batch_get_into registered mg_alloc memory, then H2D.
    lib = ctypes.CDLL(moongate_kv.library_path())
    lib.mg_connect.restype = ctypes.c_void_p
    lib.mg_connect.argtypes = [ctypes.c_char_p]
    lib.mg_alloc.restype = ctypes.c_void_p
    lib.mg_alloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.mg_batch_get_into.argtypes = [
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t, ctypes.POINTER(ctypes.c_int64)]
    h = lib.mg_connect(f"unix:{a.sock}".encode())
    buf = lib.mg_alloc(h, n)
    if DEVICE == "cuda":
        torch.cuda.cudart().cudaHostRegister(buf, n, 1)
    hostbuf = torch.frombuffer((ctypes.c_uint8 * n).from_address(buf), dtype=torch.uint8)
    ks = (ctypes.c_char_p * MICRO_N)(*[k.encode() for k in keys])
    ptrs = (ctypes.c_void_p * MICRO_N)(*[buf + i * MICRO_SIZE for i in range(MICRO_N)])
    caps = (ctypes.c_size_t * MICRO_N)(*[MICRO_SIZE] * MICRO_N)
    res = (ctypes.c_int64 * MICRO_N)()
    secs, into = [], []
    for _ in range(a.reps + 1):
        sync()
        t = time.perf_counter()
        assert lib.mg_batch_get_into(h, ks, ptrs, caps, MICRO_N, res) == 0
        t1 = time.perf_counter()
        for i, d in enumerate(dst):
            d.copy_(hostbuf[i * MICRO_SIZE:(i + 1) * MICRO_SIZE], non_blocking=True)
        sync()
        secs.append(time.perf_counter() - t)
        into.append(t1 - t)
    assert list(res) == [MICRO_SIZE] * MICRO_N, list(res)
    out["moongate_copy_to_gpu"] = gbps(secs[1:])
    out["moongate_copy_into_host"] = gbps(into[1:])
    out["moongate_copy_bytes_equal"] = all(torch.equal(x, y) for x, y in zip(dst, vals))
    c.close()
    print(json.dumps(out), flush=True)


def role_mooncake(a):
    """Mooncake's own clients moving the same 64 values into GPU memory: `embedded`
    (no segment; batch_get_into a registered pinned buffer, then H2D) or `dummy` (of the
    owner at --owner; its shared-memory buffer registered with CUDA, then H2D)."""
    import torch
    from mooncake.store import MooncakeDistributedStore
    vals = micro_values()
    n = MICRO_N * MICRO_SIZE
    keys = [f"micro/{i}" for i in range(MICRO_N)]
    s = MooncakeDistributedStore()
    if a.kind == "dummy":
        assert s.setup_dummy(n + 64 * MiB, 64 * MiB, a.owner) == 0, "setup_dummy"
        base = s.alloc_from_mem_pool(n)
        assert base, "alloc_from_mem_pool"
        assert s.register_buffer(base, n) == 0
        host = torch.frombuffer((ctypes.c_uint8 * n).from_address(base), dtype=torch.uint8)
        if DEVICE == "cuda":
            torch.cuda.cudart().cudaHostRegister(base, n, 1)
        for i, k in enumerate(keys):
            host[i * MICRO_SIZE:(i + 1) * MICRO_SIZE].copy_(vals[i])
            if not s.is_exist(k):
                assert s.put_from(k, base + i * MICRO_SIZE, MICRO_SIZE) == 0, k
    else:
        assert s.setup("127.0.0.1", a.metadata, 0, 64 * MiB, "tcp", "", a.master) == 0, "setup"
        host = torch.empty(n, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
        base = host.data_ptr()
        assert s.register_buffer(base, n) == 0
    ptrs = [base + i * MICRO_SIZE for i in range(MICRO_N)]
    sizes = [MICRO_SIZE] * MICRO_N
    dst = [torch.empty(MICRO_SIZE, dtype=torch.uint8, device=DEVICE) for _ in keys]
    secs, into = [], []
    for _ in range(a.reps + 1):
        sync()
        t = time.perf_counter()
        got = list(s.batch_get_into(keys, ptrs, sizes))
        t1 = time.perf_counter()
        for i, d in enumerate(dst):
            d.copy_(host[i * MICRO_SIZE:(i + 1) * MICRO_SIZE], non_blocking=True)
        sync()
        secs.append(time.perf_counter() - t)
        into.append(t1 - t)
        assert got == sizes, got
    out = {"to_gpu": gbps(secs[1:]), "into_host": gbps(into[1:]),
           "bytes_equal": all(torch.equal(x, y) for x, y in zip(dst, vals))}
    s.close()
    print(json.dumps(out), flush=True)


def role_cuda_client(a):
    """Mooncake 0.3.14's CUDA client with the real driver, through moongate's master
    face: puts from GPU memory and gets straight into GPU memory over TCP."""
    import torch
    from mooncake.store import MooncakeDistributedStore
    vals = micro_values()[:16]
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", a.metadata, 0, 64 * MiB, "tcp", "", a.master) == 0, "setup"
    src = torch.cat(vals)
    dst = torch.zeros_like(src)
    for t in (src, dst):
        assert s.register_buffer(t.data_ptr(), t.numel()) == 0, "register GPU memory"
    keys = [f"cuda/{i}" for i in range(len(vals))]
    rcs = [s.put_from(k, src.data_ptr() + i * MICRO_SIZE, MICRO_SIZE) for i, k in enumerate(keys)]
    secs = []
    for _ in range(a.reps + 1):
        dst.zero_()
        sync()
        t = time.perf_counter()
        got = [s.get_into(k, dst.data_ptr() + i * MICRO_SIZE, MICRO_SIZE)
               for i, k in enumerate(keys)]
        sync()
        secs.append(time.perf_counter() - t)
    out = {"put_rcs": rcs, "get_sizes": got, "bytes_equal": torch.equal(src, dst),
           "to_gpu": gbps(secs[1:], len(vals) * MICRO_SIZE)}
    for k in keys:
        s.remove(k)
    s.close()
    print(json.dumps(out), flush=True)


# --------------------------------------------------------------------------- driver --

# ------------------------------------------------- vLLM's paged layout (the connector) --

# A Llama-3-8B-shaped paged KV cache as vLLM 0.32 lays it out: per layer the logical
# [blocks, kv heads, block tokens, K and V content], bf16, 16-token blocks; LBHNC is a
# tensor per layer (a block is 32 runs of 64 KiB), BLHNC one tensor with the block
# outermost (a block is one run of 2 MiB across layers).
PAGED = dict(layers=32, heads=8, block=16, content=256)


def paged_cache(layout, num_blocks):
    import torch
    L, H, N, C = PAGED["layers"], PAGED["heads"], PAGED["block"], PAGED["content"]
    if layout == "BLHNC":
        whole = torch.empty((num_blocks, L, H, N, C), dtype=torch.bfloat16, device=DEVICE)
        return [whole[:, i] for i in range(L)]
    return [torch.empty((num_blocks, H, N, C), dtype=torch.bfloat16, device=DEVICE)
            for _ in range(L)]


def paged_fill(layers, block_ids, seed):
    """Distinct, reproducible contents for these blocks (the loader regenerates them)."""
    import torch
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    for t in layers:
        for b in block_ids:
            t[b].copy_(torch.randint(-30000, 30000, t[b].shape, dtype=torch.int16,
                                     device=DEVICE, generator=g).view(torch.bfloat16))


def role_paged_store(a):
    """Stores a prefix of P tokens per P from a paged cache in GPU memory (blocks 0..n)."""
    import torch
    import moongate_kv
    from moongate_kv.paged import PagedKV
    c = moongate_kv.Client(f"unix:{a.sock}")
    out = {}
    for p in map(int, a.tokens.split(",")):
        n = p // PAGED["block"]
        layers = paged_cache(a.kind, n)
        paged_fill(layers, range(n), seed=p)
        kv = PagedKV(c, layers)
        keys = [f"paged/{a.kind}/{p}/{i}" for i in range(n)]
        sync()
        t = time.perf_counter()
        stored, skipped = kv.store(keys, list(range(n)))
        sync()
        secs = time.perf_counter() - t
        assert len(stored) == n, (len(stored), list(skipped.items())[:3])
        out[p] = {"blocks": n, "value_bytes": kv.value_bytes, "store_s": secs,
                  "store_GBps": n * kv.value_bytes / secs / 1e9}
        del layers, kv
        torch.cuda.empty_cache() if DEVICE == "cuda" else None
    c.close()
    print(json.dumps(out), flush=True)


def role_paged_load(a):
    """A process that stored nothing loads each prefix into other blocks (reversed
    order, after n scratch blocks), timed per repetition; bytes checked against the
    regenerated contents; the link measured in the same process."""
    import torch
    import moongate_kv
    from moongate_kv.paged import PagedKV
    c = moongate_kv.Client(f"unix:{a.sock}")
    out = {}
    for p in map(int, a.tokens.split(",")):
        n = p // PAGED["block"]
        layers = paged_cache(a.kind, 2 * n)
        kv = PagedKV(c, layers)
        keys = [f"paged/{a.kind}/{p}/{i}" for i in range(n)]
        dst = [2 * n - 1 - i for i in range(n)]
        secs = []
        for _ in range(a.reps + 1):
            sync()
            t = time.perf_counter()
            failed = kv.load(keys, dst)
            sync()
            secs.append(time.perf_counter() - t)
            assert not failed, sorted(failed)[:5]
        # The same loads one cudaMemcpyAsync per run (what runtimes without the batched
        # call get), for the batched call's worth.
        per_run = None
        if getattr(kv._copier, "batch", None) is not None:
            saved, kv._copier.batch = kv._copier.batch, None
            ps = []
            for _ in range(a.reps):
                sync()
                t = time.perf_counter()
                assert not kv.load(keys, dst)
                sync()
                ps.append(time.perf_counter() - t)
            kv._copier.batch = saved
            per_run = n * kv.value_bytes / statistics.median(ps) / 1e9
        ref = paged_cache(a.kind, n)
        paged_fill(ref, range(n), seed=p)
        equal = all(torch.equal(t[dst[i]].view(torch.int16), r[i].view(torch.int16)) for t, r in zip(layers, ref) for i in range(n))
        nbytes = n * kv.value_bytes
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
        dev = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
        link = []
        for _ in range(a.reps + 1):
            sync()
            t = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            sync()
            link.append(time.perf_counter() - t)
        load = nbytes / statistics.median(secs[1:]) / 1e9
        h2d = nbytes / statistics.median(link[1:]) / 1e9
        out[p] = {"blocks": n, "value_bytes": kv.value_bytes, "bytes_equal": equal,
                  "load_GBps": load, "load_best_GBps": nbytes / min(secs[1:]) / 1e9,
                  "first_load_s": secs[0], "link_GBps": h2d, "load_vs_link": load / h2d,
                  "load_per_run_copies_GBps": per_run,
                  "batched_copy": getattr(kv._copier, "batch", None) is not None,
                  "batch_error": getattr(kv._copier, "batch_error", None)}
        del layers, kv, ref, host, dev
        torch.cuda.empty_cache() if DEVICE == "cuda" else None
    c.close()
    print(json.dumps(out), flush=True)


def role_paged_mooncake(a):
    """Mooncake 0.3.14's CUDA client through moongate's master face loading the blocks
    `paged_store` stored (BLHNC: a block is one 2 MiB run across layers) straight into
    the paged cache in GPU memory over TCP (`batch_get_into` on registered GPU memory, as
    vLLM's Mooncake connector does), other blocks than they came from; bytes checked."""
    import torch
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", a.metadata, 0, 64 * MiB, "tcp", "", a.master) == 0, "setup"
    out = {}
    for p in map(int, a.tokens.split(",")):
        n = p // PAGED["block"]
        layers = paged_cache("BLHNC", 2 * n)
        whole = layers[0]._base if layers[0]._base is not None else layers[0]
        assert s.register_buffer(whole.data_ptr(), whole.numel() * whole.element_size()) == 0
        block = whole.stride(0) * whole.element_size()
        keys = [f"paged/BLHNC/{p}/{i}" for i in range(n)]
        dst = [2 * n - 1 - i for i in range(n)]
        ptrs = [whole.data_ptr() + b * block for b in dst]
        secs = []
        for _ in range(a.reps + 1):
            sync()
            t = time.perf_counter()
            got = s.batch_get_into(keys, ptrs, [block] * n)
            sync()
            secs.append(time.perf_counter() - t)
            assert all(g == block for g in got), got[:4]
        ref = paged_cache("BLHNC", n)
        paged_fill(ref, range(n), seed=p)
        equal = all(torch.equal(t[dst[i]].view(torch.int16), r[i].view(torch.int16))
                    for t, r in zip(layers, ref) for i in range(n))
        out[p] = {"blocks": n, "bytes_equal": equal,
                  "load_GBps": n * block / statistics.median(secs[1:]) / 1e9}
        s.unregister_buffer(whole.data_ptr())
        del layers, whole, ref
        torch.cuda.empty_cache() if DEVICE == "cuda" else None
    s.close()
    print(json.dumps(out), flush=True)


# --------------------------------------------------------------- small values --

SMALL_TOTAL = 1 * GiB


def small_values(size, seed):
    """1 GiB as values of `size` bytes in GPU memory: slices of one tensor with
    distinct, reproducible bytes (the loader regenerates them to check)."""
    import torch
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    whole = torch.randint(0, 255, (SMALL_TOTAL,), dtype=torch.uint8, device=DEVICE, generator=g)
    return whole, [whole[i * size:(i + 1) * size] for i in range(SMALL_TOTAL // size)]


def _workers(a):
    """The torch helpers' `workers`, where this package's helpers take it (an earlier
    build's, run for an A/B on one card, may not)."""
    import inspect
    import moongate_kv.torch as mgt
    return {"workers": a.workers} if "workers" in inspect.signature(mgt.load).parameters else {}


def role_small_store(a):
    """Stores 1 GiB as values of each size from GPU memory through the torch helpers
    (reservations, one batched copy a group)."""
    import torch
    import moongate_kv
    import moongate_kv.torch as mgt
    c = moongate_kv.Client(f"unix:{a.sock}")
    mgt.register(c)
    out = {}
    for size in map(int, a.sizes.split(",")):
        whole, vals = small_values(size, seed=size)
        keys = [f"small/{size}/{i}" for i in range(len(vals))]
        sync()
        t = time.perf_counter()
        staged = mgt.store(c, keys, vals, group=a.group, **_workers(a))
        sync()
        secs = time.perf_counter() - t
        out[size] = {"values": len(vals), "staged": staged, "store_GBps": SMALL_TOTAL / secs / 1e9,
                     "store_us_per_value": secs / len(vals) * 1e6}
        del whole, vals
        torch.cuda.empty_cache() if DEVICE == "cuda" else None
    c.close()
    print(json.dumps(out), flush=True)


def role_small_load(a):
    """A process that stored nothing loads each size's 1 GiB into GPU memory through the
    torch helpers (views, one batched copy a group), bytes checked; the link (pinned H2D
    of the same 1 GiB) measured in this process."""
    import torch
    import moongate_kv
    import moongate_kv.torch as mgt
    c = moongate_kv.Client(f"unix:{a.sock}")
    mgt.register(c)
    host = torch.empty(SMALL_TOTAL, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
    dev = torch.empty(SMALL_TOTAL, dtype=torch.uint8, device=DEVICE)
    link = []
    for _ in range(a.reps + 1):
        sync()
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        sync()
        link.append(time.perf_counter() - t)
    h2d = SMALL_TOTAL / statistics.median(link[1:]) / 1e9
    del host
    out = {"link_GBps": h2d}
    for size in map(int, a.sizes.split(",")):
        n = SMALL_TOTAL // size
        keys = [f"small/{size}/{i}" for i in range(n)]
        dst = [dev[i * size:(i + 1) * size] for i in range(n)]
        secs = []
        for _ in range(a.reps + 1):
            dev.zero_()
            sync()
            t = time.perf_counter()
            staged = mgt.load(c, keys, dst, group=a.group, **_workers(a))
            sync()
            secs.append(time.perf_counter() - t)
        ref, _ = small_values(size, seed=size)
        equal = torch.equal(ref, dev)
        del ref
        load = SMALL_TOTAL / statistics.median(secs[1:]) / 1e9
        out[size] = {"values": n, "load_GBps": load, "load_vs_link": load / h2d,
                     "load_best_GBps": SMALL_TOTAL / min(secs[1:]) / 1e9,
                     "load_us_per_value": statistics.median(secs[1:]) / n * 1e6,
                     "first_load_s": secs[0], "staged": staged, "bytes_equal": equal}
        torch.cuda.empty_cache() if DEVICE == "cuda" else None
    c.close()
    print(json.dumps(out), flush=True)


def sub(a, role, extra, env, timeout=900):
    cmd = [sys.executable, __file__, "--role", role, "--sock", a.sock, "--work", a.work,
           "--reps", str(a.reps)] + extra
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    sys.stderr.write(r.stderr[-4000:] if r.returncode else "".join(
        l + "\n" for l in r.stderr.splitlines() if not l.startswith(("W", "I")) or "GB/s" in l))
    if r.returncode != 0:
        raise SystemExit(f"{role} {extra}: exit {r.returncode}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def part(a, out, key, fn):
    """One part of the run: its result, or its error (the other parts still run), and
    everything so far written out at once (a run cut short keeps what it measured)."""
    try:
        out[key] = fn()
    except (SystemExit, Exception) as e:  # noqa: BLE001 - recorded, not hidden
        log(f"{key}: {e}")
        out[key] = {"error": str(e)[-2000:]}
    with open(os.path.join(a.out, "gpu_gate.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out[key]


def metric(admin, name):
    import urllib.request
    with urllib.request.urlopen(f"{admin}/metrics", timeout=5) as r:
        total = 0.0
        for line in r.read().decode().splitlines():
            if line.startswith(name):
                total += float(line.split()[-1])
        return total


def driver(a):
    import torch
    pack = os.path.abspath(a.pack)
    os.makedirs(a.out, exist_ok=True)
    a.work = os.path.abspath(os.path.join(a.out, "work"))
    os.makedirs(a.work, exist_ok=True)
    env = dict(os.environ)
    env["MOONGATE_KV_LIB"] = os.path.join(pack, "libmoongate_kv.so")
    import mooncake
    mc = os.path.dirname(mooncake.__file__)
    gpu = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "none (--device cpu)"
    out = {"host": {"cores": os.cpu_count(), "gpu": gpu,
                    "torch": torch.__version__, "mooncake": getattr(mooncake, "__version__", "?"),
                    "date": time.strftime("%Y-%m-%d")}}
    procs = []
    try:
        mport, hport = free_port(), free_port()
        master = f"127.0.0.1:{mport}"
        metadata = f"http://127.0.0.1:{hport}/metadata"
        procs.append(subprocess.Popen(
            [os.path.join(mc, "mooncake_master"), f"--rpc_port={mport}",
             "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
             "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={hport}",
             f"--metrics_port={free_port()}"],
            stdout=subprocess.DEVNULL, stderr=open(f"{a.work}/master.log", "w")))
        a.sock = f"{a.work}/kv.sock"
        kv, seg, admin, listen = free_port(), free_port(), free_port(), free_port()
        with open(f"{a.work}/mg.toml", "w") as f:
            f.write(f'[master_face]\nupstream = "{master}"\n'
                    f'[kv]\nlisten = "127.0.0.1:{kv}"\nunix_path = "{a.sock}"\n'
                    f'metadata_url = "{metadata}"\nsegment_bytes = {a.segment_gib * GiB}\n'
                    f'segment_listen = "127.0.0.1:{seg}"\nmax_value_bytes = {1 << 30}\n')
        mg = subprocess.Popen(
            [os.path.join(pack, "moongate"), "run", "--config", f"{a.work}/mg.toml",
             "--listen", f"127.0.0.1:{listen}", "--admin", f"127.0.0.1:{admin}"],
            stdout=subprocess.DEVNULL, stderr=open(f"{a.work}/moongate.log", "w"),
            env={**env, "RUST_LOG": "info"})
        procs.append(mg)
        admin_url = f"http://127.0.0.1:{admin}"
        wait_http(f"{admin_url}/ready", 60)
        deadline = time.time() + 60
        while "own segment mounted" not in open(f"{a.work}/moongate.log").read():
            if time.time() > deadline:
                raise SystemExit("own segment not mounted")
            time.sleep(0.2)
        if "micro" in a.parts:
            part(a, out, "micro", lambda: sub(a, "micro", [], env))
            part(a, out, "mooncake_embedded", lambda: sub(
                a, "mooncake", ["--kind", "embedded", "--master", master, "--metadata", metadata],
                env))
        if "cuda" in a.parts:
            def cuda_client():
                r = sub(a, "cuda_client",
                        ["--master", f"127.0.0.1:{listen}", "--metadata", metadata], env)
                r["moongate_frame_errors"] = metric(admin_url, "moongate_master_frame_errors")
                return r
            part(a, out, "mooncake_0_3_14_cuda_client_through_moongate", cuda_client)
        if "gate" in a.parts:
            gate = out.setdefault("gate", {})
            for shape in a.shapes.split(","):
                def one(shape=shape):
                    pre = sub(a, "prefill", ["--shape", shape, "--tokens", a.tokens], env)
                    with open(f"{a.work}/prefill-{shape}.json", "w") as f:
                        json.dump(pre, f)
                    load = sub(a, "load", ["--shape", shape, "--tokens", a.tokens], env)
                    return {"prefill": pre, "load": load}
                part(a, gate, shape, one)
        if "small" in a.parts:
            def small():
                ex = ["--sizes", a.sizes, "--group", str(a.group), "--workers", str(a.workers)]
                return {"store": sub(a, "small_store", ex, env),
                        "load": sub(a, "small_load", ex, env)}
            part(a, out, "small", small)
        if "paged" in a.parts:
            paged = out.setdefault("paged", {})
            for layout in ["BLHNC", "LBHNC"]:
                def one(layout=layout):
                    st = sub(a, "paged_store", ["--kind", layout, "--tokens", a.paged_tokens], env)
                    ld = sub(a, "paged_load", ["--kind", layout, "--tokens", a.paged_tokens], env)
                    r = {"store": st, "load": ld}
                    if layout == "BLHNC" and DEVICE == "cuda":
                        try:
                            r["mooncake_cuda_client"] = sub(
                                a, "paged_mooncake", ["--tokens", a.paged_tokens, "--master",
                                                      f"127.0.0.1:{listen}", "--metadata", metadata], env)
                        except (SystemExit, Exception) as e:  # noqa: BLE001 - recorded
                            r["mooncake_cuda_client"] = {"error": str(e)[-2000:]}
                    return r
                part(a, paged, layout, one)
        mg.send_signal(signal.SIGTERM)
        mg.wait(timeout=60)
        procs.remove(mg)
        if "micro" in a.parts:
            oport = free_port()
            procs.append(subprocess.Popen(
                [os.path.join(mc, "mooncake_client"), "--host=127.0.0.1", f"--port={oport}",
                 f"--master_server_address={master}", f"--metadata_server={metadata}",
                 "--global_segment_size=2 GB", "--protocol=tcp", "--logtostderr"],
                stdout=subprocess.DEVNULL, stderr=open(f"{a.work}/owner.log", "w")))
            def dummy():
                deadline = time.time() + 60
                while True:
                    try:
                        return sub(a, "mooncake", ["--kind", "dummy", "--owner",
                                                   f"127.0.0.1:{oport}"], env)
                    except SystemExit:
                        if time.time() > deadline:
                            raise
                        time.sleep(1)
            part(a, out, "mooncake_dummy", dummy)
    finally:
        stop_all(procs)
    summarize(out)
    text = json.dumps(out, indent=1)
    with open(os.path.join(a.out, "gpu_gate.json"), "w") as f:
        f.write(text)
    print(text)
    table(out)


def summarize(out):
    m = out.get("micro")
    if not m or "error" in m:
        return
    link = m["pinned_h2d"]["median_GBps"]
    view = m["moongate_view_to_gpu"]["median_GBps"]
    r = {"view_vs_link": view / link}
    if "to_gpu" in out.get("mooncake_dummy", {}):
        r["view_vs_mooncake_dummy"] = view / out["mooncake_dummy"]["to_gpu"]["median_GBps"]
    if "to_gpu" in out.get("mooncake_embedded", {}):
        r["view_vs_mooncake_embedded"] = view / out["mooncake_embedded"]["to_gpu"]["median_GBps"]
    out["ratios"] = r


def table(out):
    h = out["host"]
    print(f"\nhost: {h['gpu']}, {h['cores']} cores, torch {h['torch']}, {h['date']}")
    m = out.get("micro")
    if m and "error" not in m:
        print("1 GiB as 64 values into GPU memory (median GB/s):")
        rows = [("pinned H2D (the link)", m["pinned_h2d"]), ("moongate views", m["moongate_view_to_gpu"]),
                ("moongate copy path", m["moongate_copy_to_gpu"]),
                ("moongate store from GPU", m["moongate_store_from_gpu"])]
        for k in ["mooncake_embedded", "mooncake_dummy"]:
            if "to_gpu" in out.get(k, {}):
                rows.append((k.replace("_", " "), out[k]["to_gpu"]))
        for name, v in rows:
            print(f"  {name:28s} {v['median_GBps']:7.2f}")
        print("  ratios:", json.dumps(out.get("ratios", {})))
    for key, v in out.items():
        if isinstance(v, dict) and "error" in v:
            print(f"{key}: FAILED: {v['error'][-300:]}")
    sm = out.get("small", {})
    if sm and "error" not in sm:
        ld, st = sm["load"], sm["store"]
        print(f"1 GiB as small values through the torch helpers (link {ld['link_GBps']:.2f} GB/s): "
              "size | load GB/s | vs link | us/value | store GB/s | vs link | bytes")
        for size, r in ld.items():
            if size == "link_GBps":
                continue
            w = st.get(size, {}).get("store_GBps", float("nan"))
            print(f"  {int(size) // 1024:6d} KiB | {r['load_GBps']:8.2f} | {r['load_vs_link']:5.2f}x | "
                  f"{r['load_us_per_value']:6.1f} | {w:8.2f} | {w / ld['link_GBps']:5.2f}x | {r['bytes_equal']}")
    for layout, g in out.get("paged", {}).items():
        if "error" in g:
            print(f"paged {layout}: FAILED: {g['error'][-300:]}")
            continue
        print(f"paged {layout} (Llama-3-8B shape, 16-token blocks): P | blocks | load GB/s | vs link | store GB/s | bytes | batched")
        for p, r in g["load"].items():
            st = g["store"].get(p, {})
            print(f"  {p:>6} | {r['blocks']:6d} | {r['load_GBps']:8.2f} | {r['load_vs_link']:5.2f}x | "
                  f"{st.get('store_GBps', float('nan')):8.2f} | {r['bytes_equal']} | {r['batched_copy']}")
        mc = g.get("mooncake_cuda_client", {})
        for p, r in (mc.items() if "error" not in mc else []):
            print(f"  Mooncake 0.3.14 CUDA client, {p} tokens: {r['load_GBps']:.2f} GB/s, bytes {r['bytes_equal']}")
    for shape, g in out.get("gate", {}).items():
        if "error" in g:
            print(f"gate {shape}: FAILED: {g['error'][-300:]}")
            continue
        print(f"gate {shape}: P | KV MiB | recompute ms | load GB/s | TTFT ms | speedup | store GB/s | bytes | logits here | logits vs storer (max diff, next token)")
        for p, r in g["load"]["runs"].items():
            print(f"  {p:>6} | {r['kv_bytes'] / MiB:7.0f} | {r['recompute_s'] * 1e3:9.1f} | "
                  f"{r['load_GBps']:8.2f} | {r['ttft_cache_s'] * 1e3:7.1f} | {r['ttft_speedup']:6.2f}x | "
                  f"{r['store_GBps']:8.2f} | {r['bytes_identical']} | "
                  f"{'bitwise' if r.get('logits_bitwise_equal_same_process') else 'differ'} | "
                  f"{'bitwise' if r['logits_bitwise_equal'] else 'differ'} "
                  f"({r.get('logits_max_abs_diff', float('nan')):.3g}, "
                  f"{'same' if r.get('next_token_equal') else 'other'})")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="driver")
    p.add_argument("--pack", default=os.path.join(ROOT, ".gpu"))
    p.add_argument("--out", default="/tmp/gpu_gate")
    p.add_argument("--work")
    p.add_argument("--sock")
    p.add_argument("--shape", default="8b")
    p.add_argument("--shapes", default="8b,70b10")
    p.add_argument("--tokens", default="2048,8192,32768")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--segment-gib", type=int, default=10)
    p.add_argument("--parts", default="micro,cuda,gate")
    p.add_argument("--kind", default="embedded")
    p.add_argument("--paged-tokens", default="2048,8192,32768")
    p.add_argument("--sizes", default="65536,262144,2097152")
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--master")
    p.add_argument("--metadata")
    p.add_argument("--owner")
    p.add_argument("--device", default=os.environ.get("GATE_DEVICE", "cuda"),
                   help="cpu: a smoke test of this script on a machine without a GPU")
    a = p.parse_args()
    global DEVICE
    DEVICE = a.device
    os.environ["GATE_DEVICE"] = a.device  # for the roles it starts
    roles = {"prefill": role_prefill, "load": role_load, "micro": role_micro,
             "mooncake": role_mooncake, "cuda_client": role_cuda_client,
             "paged_store": role_paged_store, "paged_load": role_paged_load,
             "paged_mooncake": role_paged_mooncake, "small_store": role_small_store,
             "small_load": role_small_load}
    if a.role in roles:
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        prof = os.environ.get("GATE_PROFILE")  # a directory: each role's cProfile, top 40
        if prof:
            import cProfile
            import io
            import pstats
            pr = cProfile.Profile()
            pr.runcall(roles[a.role], a)
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40)
            with open(os.path.join(prof, f"{a.role}.prof.txt"), "w") as f:
                f.write(s.getvalue())
        else:
            roles[a.role](a)
    else:
        driver(a)


if __name__ == "__main__":
    main()
