"""One vLLM process (its CPU build) running one prompt, with moongate's connector, with
vLLM's own Mooncake store connector, or with none; prints one JSON line:
{"tokens": [...], "prompt_tokens": N, "cached_tokens": C, "ttft_s": T, ...}.

    python tests/py/vllm_connector.py --model DIR --mode moongate \
        --address unix:/run/moongate/kv.sock [--prompt-tokens 601] [--keys-out F]

--keys-out writes the moongate keys of the prompt's full blocks, one a line, as this
engine names them (its own config, its own hashes): the tests replace or remove some.
The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that one process
is one engine whose connector the tests can ask.
"""
import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=["plain", "moongate", "mooncake"], required=True)
    ap.add_argument("--address", help="moongate's kv face (moongate mode)")
    ap.add_argument("--extra", default="{}", help="more kv_connector_extra_config (JSON)")
    ap.add_argument("--prompt-tokens", type=int, default=601)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--keys-out")
    ap.add_argument("--events", action="store_true",
                    help="vLLM's KV events on; count the connector's BlockStored by medium")
    ap.add_argument("--block-size", type=int, default=32,
                    help="vLLM's block size (its CPU build takes multiples of 32)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of the prompt (timed each)")
    a = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=a.model, enforce_eager=True, max_model_len=8192, seed=0,
              enable_prefix_caching=True, block_size=a.block_size,
              # The KV cache's size, so the engine does not ask for a share of the
              # machine's memory (its CPU build refuses to start when other processes
              # hold more than 8 % of it).
              kv_cache_memory_bytes=1 << 30)
    if a.mode == "moongate":
        extra = {"moongate_address": a.address, **json.loads(a.extra)}
        kw["kv_transfer_config"] = {
            "kv_connector": "MoongateConnector",
            "kv_connector_module_path": "moongate_kv.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    elif a.mode == "mooncake":
        # Settings from the JSON file named by MOONCAKE_CONFIG_PATH (the test writes it).
        kw["kv_transfer_config"] = {
            "kv_connector": "MooncakeStoreConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": json.loads(a.extra),
        }
    if a.events:
        # vLLM's KV events on; what the scheduler takes from the connector is counted
        # below (the publisher itself is vLLM's: "null" here, ZeroMQ in a deployment).
        from vllm.config import KVEventsConfig
        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    t0 = time.monotonic()
    llm = LLM(**kw)
    started = time.monotonic() - t0
    media = {}
    if a.events and a.mode == "moongate":
        from vllm.distributed.kv_events import BlockStored
        conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
        take = conn.take_events

        def counted():
            events = list(take())
            for e in events:
                if isinstance(e, BlockStored):
                    media[e.medium] = media.get(e.medium, 0) + len(e.block_hashes)
            return events
        conn.take_events = counted
    tok = llm.get_tokenizer()
    vocab = len(tok)
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    # --repeat R: R distinct prompts (seeds seed, seed+1, ...), one generation each, so
    # that no run finds another's prefix in vLLM's own cache (a reset of that cache is
    # refused while a connector holds blocks).
    runs, outs = [], []
    for i in range(a.repeat):
        rng = random.Random(a.seed + i)
        prompt = [rng.randrange(3, vocab) for _ in range(a.prompt_tokens)]
        t = time.monotonic()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
        total = time.monotonic() - t
        runs.append({"total_s": total, "cached_tokens": out.num_cached_tokens,
                     "tokens": list(out.outputs[0].token_ids)})
        outs.append((prompt, out))
    prompt, out = outs[0]
    res = {
        "mode": a.mode,
        "tokens": list(out.outputs[0].token_ids),
        "prompt_tokens": len(prompt),
        "cached_tokens": out.num_cached_tokens,
        "runs": runs,
        "engine_start_s": started,
    }
    if a.mode == "moongate":
        core = llm.llm_engine.engine_core.engine_core
        conn = core.scheduler.connector
        res["block_size"] = conn.bs
        res["key_prefix"] = conn.scheme.keys(0, [""])[0]
        if conn._hints is not None:
            conn._hints.flush()
            res["hints"] = {"sent": conn._hints.sent, "failed": conn._hints.failed,
                            "dropped": conn._hints.dropped}
        wconn = _worker_connector()
        if wconn is not None:
            res["worker_stats"] = dict(wconn.stats)
        if a.keys_out:
            from moongate_kv.vllm import prompt_block_hashes
            hashes = prompt_block_hashes(llm.llm_engine.vllm_config, prompt)
            with open(a.keys_out, "w") as f:
                f.write("\n".join(conn.scheme.keys(0, hashes)) + "\n")
    if a.events:
        res["events"] = media
    print(json.dumps(res))
    sys.stdout.flush()
    os._exit(0)  # an engine's threads need not wind down for the test's answer


def _worker_connector():
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        return get_kv_transfer_group()
    except Exception:
        return None


if __name__ == "__main__":
    main()
