"""moongate_kv.torch against a live moongate, on CPU tensors (the GPU path runs on the
GPU host, benches/gpu_gate.py): lists of tensors of engine block sizes stored through
reservations and loaded through views in groups, bytes compared; a group of 8 MiB and
more goes through the copy threads; a missing key and a size that differs raise, and
leave nothing held. Prints "all ok".

    python tests/py/torch_helpers.py --address unix:/path/kv.sock
"""
import argparse

import torch

import moongate_kv
import moongate_kv.torch as mgt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    a = ap.parse_args()
    c = moongate_kv.Client(a.address)
    g = torch.Generator().manual_seed(3)
    for size, n, group in [(64 << 10, 100, 16), (256 << 10, 40, 64), (2 << 20, 6, 64)]:
        src = [torch.randint(0, 255, (size,), dtype=torch.uint8, generator=g) for _ in range(n)]
        keys = [f"th/{size}/{i}" for i in range(n)]
        assert mgt.store(c, keys, src, group=group) == 0  # all in the own segment
        dst = [torch.zeros(size, dtype=torch.uint8) for _ in range(n)]
        assert mgt.load(c, keys, dst, group=group) == 0
        for i, (x, y) in enumerate(zip(src, dst)):
            assert torch.equal(x, y), (size, i)
    t = torch.randn(64, 128, generator=g).to(torch.bfloat16)
    mgt.store(c, ["th/bf16"], [t])
    back = torch.empty_like(t)
    mgt.load(c, ["th/bf16"], [back])
    assert torch.equal(t.view(torch.int16), back.view(torch.int16))

    # A missing key: NotFound, and the group's views are released (the next load of the
    # same keys succeeds at once).
    try:
        mgt.load(c, ["th/65536/0", "th/missing"], [torch.empty(64 << 10, dtype=torch.uint8)] * 2)
        raise AssertionError("a missing key loaded")
    except moongate_kv.NotFound:
        pass
    # The same among several workers' groups: NotFound once every worker stopped, and
    # nothing left held (the keys load again at once, all of them, with one worker).
    ks = [f"th/65536/{i}" for i in range(100)]
    outs = [torch.empty(64 << 10, dtype=torch.uint8) for _ in ks]
    try:
        mgt.load(c, ks[:50] + ["th/missing"] + ks[50:], outs[:50] + [outs[0]] + outs[50:],
                 group=8, workers=3)
        raise AssertionError("a missing key loaded")
    except moongate_kv.NotFound:
        pass
    assert mgt.load(c, ks, outs, group=8, workers=1) == 0
    # A size that differs: ValueError, nothing copied.
    out = torch.zeros(1000, dtype=torch.uint8)
    try:
        mgt.load(c, ["th/65536/0"], [out])
        raise AssertionError("a size mismatch loaded")
    except ValueError:
        pass
    assert int(out.sum()) == 0
    one = torch.empty(64 << 10, dtype=torch.uint8)
    mgt.load(c, ["th/65536/0"], [one])
    # A stored key refused as existing: the group's reservations are aborted.
    try:
        mgt.store(c, ["th/new", "th/65536/1"], [one, one])
        raise AssertionError("an existing key stored")
    except moongate_kv.Exists:
        pass
    mgt.store(c, ["th/new"], [one])  # its reservation was aborted, not left held
    print("all ok")


if __name__ == "__main__":
    main()
