"""moongate_kv.paged against a live moongate, on CPU tensors (the vLLM connector's data
path without vLLM): every layout vLLM 0.32 can give a layer (a tensor per layer, one
tensor with the block outermost across layers, heads outside the block), blocks stored
from one cache and loaded into other blocks of another, bytes compared; what cannot be
loaded reported and left untouched; a stored key refused as stored. Prints "all ok".

    python tests/py/paged_kv.py --address unix:/path/kv.sock
"""
import argparse

import torch

import moongate_kv
from moongate_kv.paged import PagedKV, block_runs

L, B, H, N, C = 3, 12, 2, 4, 16  # layers, blocks, heads, tokens, content (bf16)


def layouts():
    """name -> a function making the per-layer logical [B, H, N, C] views."""
    def lbhnc():
        return [torch.zeros((B, H, N, C), dtype=torch.bfloat16) for _ in range(L)]

    def blhnc():
        whole = torch.zeros((B, L, H, N, C), dtype=torch.bfloat16)
        return [whole[:, i] for i in range(L)]

    def lhbnc():
        return [torch.zeros((H, B, N, C), dtype=torch.bfloat16).permute(1, 0, 2, 3)
                for _ in range(L)]

    return {"LBHNC": lbhnc, "BLHNC": blhnc, "LHBNC": lhbnc}


def fill(layers, blocks, seed):
    g = torch.Generator().manual_seed(seed)
    for t in layers:
        for b in blocks:
            t[b].copy_(torch.randint(-3000, 3000, t[b].shape, generator=g,
                                     dtype=torch.int16).view(torch.bfloat16))


def same(x, y):
    """Bitwise (random bf16 bits include NaNs, which compare unequal)."""
    return torch.equal(x.view(torch.int16), y.view(torch.int16))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    a = ap.parse_args()
    c = moongate_kv.Client(a.address)
    page = H * N * C * 2

    # The runs of one block: one dense run, or one per head where heads lie outside.
    make = layouts()
    assert block_runs(make["LBHNC"]()[0]) == [(0, page)]
    assert block_runs(make["BLHNC"]()[0]) == [(0, page)]
    assert block_runs(make["LHBNC"]()[0]) == [(h * B * N * C * 2, N * C * 2) for h in range(H)]

    for name, mk in make.items():
        src = mk()
        fill(src, range(B), seed=len(name))
        kv = PagedKV(c, src, batch=5)  # several calls per batch of blocks
        assert kv.value_bytes == L * page, (name, kv.value_bytes)
        # A block across layers in one run where layers follow each other (BLHNC).
        assert len(kv.whole) == (1 if name == "BLHNC" else L * len(kv.plan[0][2])), name
        keys = [f"paged/{name}/{i}" for i in range(B)]
        stored, skipped = kv.store(keys[:8], list(range(8)))
        assert stored == keys[:8] and not skipped, (stored, skipped)
        # Stored once: a second store of a key is refused as existing, nothing else.
        stored, skipped = kv.store(keys[:2], [0, 1])
        assert stored == [] and set(skipped) == set(keys[:2]), skipped
        assert all(code == moongate_kv.ERR_EXISTS for code in skipped.values()), skipped

        # Another cache (another process would do the same): blocks land elsewhere,
        # layer by layer as the connector's worker does.
        dst = mk()
        kv2 = PagedKV(c, dst)
        targets = [11, 10, 9, 8, 7, 6, 5, 4]
        job = kv2.load_job(keys[:8], targets)
        for layer in range(L):
            job.copy_layer(layer)
            job.wait_layer(layer)
        job.finish()
        assert not job.failed, job.failed
        for layer in range(L):
            for i, t in enumerate(targets):
                assert same(dst[layer][t], src[layer][i]), (name, layer, i)

        # Missing keys and a value of another size fail their blocks alone; a failed
        # block is never written.
        c.put(f"paged/{name}/odd", b"not a block")
        before = [t.clone() for t in dst]
        failed = kv2.load([keys[0], keys[9], f"paged/{name}/odd", keys[1]], [0, 1, 2, 3])
        assert failed == {1, 2}, failed
        for layer in range(L):
            assert same(dst[layer][0], src[layer][0])
            assert same(dst[layer][3], src[layer][1])
            assert same(dst[layer][1], before[layer][1])
            assert same(dst[layer][2], before[layer][2])
        # Views are released: the keys can be viewed again at once, and removed.
        assert not kv2.load(keys[:1], [5])

    # A move of 8 MiB and more is cut over the copy threads (9 MiB here): every run
    # lands where it belongs.
    big = [torch.zeros((48, 4, 32, 512), dtype=torch.bfloat16) for _ in range(3)]
    fill(big, range(24), seed=99)
    kvb = PagedKV(c, big)
    keys = [f"paged/big/{i}" for i in range(24)]
    assert kvb.store(keys, list(range(24)))[0] == keys
    assert 24 * kvb.value_bytes >= 8 << 20
    assert not kvb.load(keys, list(range(24, 48)))
    for t in big:
        assert same(t[24:48], t[:24])

    # A cache spread over devices, or layers of different block counts, is refused.
    try:
        PagedKV(c, [torch.zeros((4, 2)), torch.zeros((5, 2))])
        raise AssertionError("layers with different block counts accepted")
    except ValueError:
        pass
    print("all ok")


if __name__ == "__main__":
    main()
