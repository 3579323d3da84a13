"""vLLM's KV connector for moongate: prefixes loaded through views of moongate's memory
and stored through reservations in it, with no Mooncake client in the vLLM process.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "MoongateConnector",
        "kv_connector_module_path": "moongate_kv.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"moongate_address": "unix:/run/moongate/kv.sock"}}'

Scheduler side: one batched existence call per request finds how many of its prompt's
full blocks moongate holds (blocks are keyed by vLLM's chained block hashes, so a hit is
always a prefix); the worker loads them before the forward pass that needs them.
Requests waiting in the queue are announced to moongate as `upcoming` hints, and the
blocks of a finished request that no other live request shares as `done`.

Worker side: a request's full prompt blocks are stored once computed (reserved at the
first layer's save, copied layer by layer, committed at the end of the step); loads are
viewed at the start of the step and copied layer by layer, each layer waited for just
before its attention runs. On CUDA the copies are DMAs from / into moongate's mappings
(registered with CUDA once); on CPU they are memory copies (`moongate_kv.paged`).

A block that cannot be loaded (evicted between lookup and load, moongate gone, a value of
another size) is reported to vLLM (`get_block_ids_with_load_errors`), which recomputes
it; the connector sets vLLM's `kv_load_failure_policy` to "recompute" unless
`load_failure_policy` says otherwise. moongate unreachable: every lookup misses and
nothing is stored until it answers again (tried again every `retry_s`); vLLM serves as
without the connector.

Keys: `{namespace}/{tag}/{block hash hex}`, where `tag` names the KV layout, dtype, block
size, tensor-parallel rank and size, and a digest of everything else that decides the
bytes (model, revision, cache dtype, heads, head size, layers): different models, ranks
or layouts never read each other's values. docs/engines.md has the scheme and every key
of `kv_connector_extra_config`.

Not covered yet: pipeline parallelism, models with more than one KV cache group (hybrid
attention, sliding-window groups, Mamba), MLA with TP replication (each rank stores its
own copy), decode-time saves, asynchronous (between-step) loads.
"""
import hashlib
import json
import os
import queue
import re
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.client import HTTPConnection

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger

import moongate_kv
from moongate_kv.paged import PagedKV

logger = init_logger(__name__)

__all__ = ["MoongateConnector", "KeyScheme", "DEFAULTS"]

# Every key of kv_connector_extra_config, its default, and why (docs/engines.md).
DEFAULTS = {
    # moongate's kv face on this host, "unix:PATH" (its `kv.unix_path`): views and
    # reservations need its shared memory, so a TCP address is refused.
    "moongate_address": None,
    # The first part of every key: by default "vllm/<model name>"; set one name on
    # every instance that serves the same weights from different paths.
    "key_namespace": None,
    # "recompute": blocks that fail to load are recomputed (vLLM's own default is to
    # fail the request); "vllm": keep whatever kv_load_failure_policy says.
    "load_failure_policy": "recompute",
    # Load prefixes found in moongate / store computed prompt blocks in it.
    "load": True,
    "save": True,
    # Post `upcoming` hints for queued requests and `done` hints for finished ones.
    "hints": True,
    # At most this many blocks named per hint (the prefix's first ones): a 128k-token
    # prompt is 8,000 blocks, and a hint is worth its first blocks most.
    "hints_max_blocks": 512,
    # Hints waiting to be sent; beyond, new ones are dropped (counted): hints never
    # hold the scheduler up.
    "hints_queue": 256,
    # The KV cache layout asked of vLLM on GPUs: BLHNC lays a block out contiguously
    # across layers, so a block's value moves as one copy; vLLM keeps its own choice
    # (with a warning) where the attention backend cannot use it. None: no preference.
    "kv_layout": "BLHNC",
    # Keys per kv-face call (moongate's kv.max_batch_keys is 10,000 by default).
    "batch_keys": 1024,
    # After moongate failed to answer, seconds before it is asked again.
    "retry_s": 5.0,
}


def _cfg(vllm_config):
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    unknown = sorted(set(extra) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"MoongateConnector: unknown kv_connector_extra_config keys "
                         f"{unknown}; known: {sorted(DEFAULTS)}")
    cfg = {**DEFAULTS, **extra}
    if not cfg["moongate_address"]:
        raise ValueError("MoongateConnector: kv_connector_extra_config.moongate_address "
                         "is required (e.g. \"unix:/run/moongate/kv.sock\")")
    if not str(cfg["moongate_address"]).startswith("unix:"):
        raise ValueError("MoongateConnector: moongate_address must be \"unix:PATH\" "
                         "(moongate's kv face on this host: views and reservations need "
                         "its shared memory)")
    if cfg["load_failure_policy"] not in ("recompute", "vllm"):
        raise ValueError("MoongateConnector: load_failure_policy must be \"recompute\" "
                         "or \"vllm\"")
    return cfg


class KeyScheme:
    """The keys of one rank's blocks. Built from vLLM's config alone, so the scheduler
    (which holds no KV tensors) and every worker name the same values."""

    def __init__(self, vllm_config, kv_cache_config, cfg):
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"MoongateConnector supports models with one KV cache group; "
                             f"this one has {len(groups)} (hybrid attention)")
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size != 1:
            raise ValueError("MoongateConnector does not support pipeline parallelism yet")
        spec = groups[0].kv_cache_spec
        mc = vllm_config.model_config
        self.block_size = spec.block_size
        self.tp_size = pc.tensor_parallel_size
        layout = (getattr(kv_cache_config, "kv_cache_layout", None)
                  or vllm_config.cache_config.kv_cache_layout or "default")
        dtype = str(spec.dtype).replace("torch.", "")
        facts = {
            "model": mc.model, "revision": mc.revision, "dtype": dtype,
            "cache_dtype": vllm_config.cache_config.cache_dtype, "layout": layout,
            "spec": type(spec).__name__, "block_size": spec.block_size,
            "heads": getattr(spec, "num_kv_heads", None),
            "head_size": getattr(spec, "head_size", None),
            "head_size_v": getattr(spec, "head_size_v", None),
            "page_bytes": spec.page_size_bytes,
            "layers": list(groups[0].layer_names), "tp": self.tp_size,
        }
        digest = hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode())
        self.digest = digest.hexdigest()[:12]
        ns = cfg["key_namespace"]
        if not ns:
            name = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(str(mc.model).rstrip("/")))
            ns = f"vllm/{name or 'model'}"
        self.namespace = ns
        self._tags = [f"{layout}-{dtype}-bs{spec.block_size}-tp{r}of{self.tp_size}-{self.digest}"
                      for r in range(self.tp_size)]

    def keys(self, rank, hashes_hex):
        base = f"{self.namespace}/{self._tags[rank]}/"
        return [base + h for h in hashes_hex]

    def all_ranks(self, hashes_hex):
        """Per tensor-parallel rank, the keys of `hashes_hex`."""
        return [self.keys(r, hashes_hex) for r in range(self.tp_size)]


class _Link:
    """The connector's handle on moongate, opened when first needed and again after a
    failure once `retry_s` has passed: moongate down never stops vLLM."""

    def __init__(self, address, retry_s):
        self.address, self.retry_s = address, float(retry_s)
        self._client, self._down_until = None, 0.0
        self._lock = threading.Lock()
        self.failures = 0

    def get(self):
        with self._lock:
            if self._client is not None:
                return self._client
            if time.monotonic() < self._down_until:
                return None
            try:
                self._client = moongate_kv.Client(self.address)
            except (moongate_kv.MoongateError, OSError) as e:
                self._fail_locked(e)
            return self._client

    def failed(self, err):
        with self._lock:
            self._fail_locked(err)

    def _fail_locked(self, err):
        self.failures += 1
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
        self._client = None
        self._down_until = time.monotonic() + self.retry_s
        logger.warning("moongate at %s unavailable (%s); lookups miss and nothing is "
                       "stored for %.0f s", self.address, err, self.retry_s)


class _Hints:
    """Hints posted to moongate's kv face (`POST /v1/hints`) from a thread of their own,
    through a bounded queue: a full queue drops the newest (`dropped`)."""

    def __init__(self, address, depth):
        self.address = address
        self.q = queue.Queue(maxsize=max(1, int(depth)))
        self.dropped = 0
        self.sent = 0
        self.failed = 0
        self._busy = False
        self._t = threading.Thread(target=self._run, name="moongate-hints", daemon=True)
        self._t.start()

    def post(self, hints):
        if not hints:
            return
        try:
            self.q.put_nowait(hints)
        except queue.Full:
            self.dropped += 1

    def _conn(self):
        path = self.address[len("unix:"):]

        class _Unix(HTTPConnection):
            def connect(self):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(self.timeout)
                s.connect(path)
                self.sock = s
        return _Unix("localhost", timeout=5)

    def flush(self, timeout=5.0):
        """Waits (up to `timeout`) until every hint queued so far was sent or failed."""
        end = time.monotonic() + timeout
        while (self.q.unfinished_tasks or self._busy) and time.monotonic() < end:
            time.sleep(0.01)

    def _run(self):
        while True:
            hints = self.q.get()
            self._busy = True
            self.q.task_done()
            # Whatever else queued meanwhile goes in the same call.
            while len(hints) < 64:
                try:
                    hints = hints + self.q.get_nowait()
                    self.q.task_done()
                except queue.Empty:
                    break
            body = json.dumps({"hints": hints}).encode()
            try:
                c = self._conn()
                c.request("POST", "/v1/hints", body, {"content-type": "application/json"})
                r = c.getresponse()
                r.read()
                c.close()
                if r.status == 200:
                    self.sent += len(hints)
                else:
                    self.failed += len(hints)
            except OSError:
                self.failed += len(hints)
            self._busy = False


@dataclass
class _Move:
    req_id: str
    hashes: list  # hex digests, in prefix order
    block_ids: list


@dataclass
class MoongateConnectorMetadata(KVConnectorMetadata):
    loads: list = field(default_factory=list)
    saves: list = field(default_factory=list)


@dataclass
class MoongateWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: block hashes stored, and those whose store ended
    without storing (already stored, refused), for KV events."""

    stored: list = field(default_factory=list)
    skipped: list = field(default_factory=list)

    def aggregate(self, other):
        return MoongateWorkerMetadata(stored=self.stored + list(other.stored),
                                      skipped=self.skipped + list(other.skipped))


# Blocks waiting for their store's outcome (for KV events), at most: a store that never
# reports (moongate gone mid-step) must not hold its entries forever.
_MAX_PENDING_EVENTS = 1 << 16


class _Req:
    __slots__ = ("request", "saved_upto", "load", "lookup", "computed")

    def __init__(self, request):
        self.request = request
        self.saved_upto = None  # blocks [0, saved_upto) need no save
        self.computed = 0  # tokens computed when last scheduled
        self.load = None  # (start, end) blocks to load
        self.lookup = None  # (first block, hashes seen, hit blocks)


class MoongateConnector(KVConnectorBase_V1):
    """A `KVConnectorBase_V1` over moongate's views and reservations (module doc)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.cfg = _cfg(vllm_config)
        if kv_cache_config is None:
            raise ValueError("MoongateConnector needs vLLM's kv_cache_config")
        self.scheme = KeyScheme(vllm_config, kv_cache_config, self.cfg)
        self.bs = self.scheme.block_size
        self.link = _Link(self.cfg["moongate_address"], self.cfg["retry_s"])
        if role == KVConnectorRole.SCHEDULER:
            if self.cfg["load_failure_policy"] == "recompute":
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            self._reqs = {}
            self._live = Counter()
            self._hints = _Hints(self.cfg["moongate_address"], self.cfg["hints_queue"]) \
                if self.cfg["hints"] else None
            kv_events = vllm_config.kv_events_config
            self._events_on = bool(kv_events and kv_events.enable_kv_cache_events)
            self._event_info = {}  # hash hex -> (parent hash hex, token ids)
            self._events = []
            logger.info("MoongateConnector (scheduler): moongate at %s, keys %s/%s",
                        self.cfg["moongate_address"], self.scheme.namespace,
                        self.scheme._tags[0])
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            try:
                self.rank = get_tensor_model_parallel_rank()
            except Exception:
                self.rank = 0
            self.kv = None
            self._layers = {}
            self._load = None
            self._store = None
            self._store_layers = set()
            self._load_errors = set()
            self._failed_reqs = set()  # requests with a block not loaded this step
            self._stored = []
            self._skipped = []
            self.stats = Counter()

    # ======================= scheduler side =======================

    def _hex(self, hashes):
        return [bytes(h).hex() for h in hashes]

    def _state(self, request):
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Req(request)
        return st

    def on_new_request(self, request):
        st = self._state(request)
        hashes = self._hex(request.block_hashes)
        self._live.update(hashes)
        if self._hints is not None and hashes:
            keys = self.scheme.keys(0, hashes[: int(self.cfg["hints_max_blocks"])])
            self._hints.post([{"kind": "upcoming", "keys": keys,
                               "session": str(request.request_id)[:256]}])
        st.lookup = None

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if not self.cfg["load"]:
            return 0, False
        st = self._state(request)
        hashes = request.block_hashes
        # At least one token must be computed, so a fully cached prompt loads all but
        # its last block.
        end = min(len(hashes), (request.num_tokens - 1) // self.bs)
        start = num_computed_tokens // self.bs
        if end <= start:
            st.load = None
            return 0, False
        if st.lookup is not None and st.lookup[:2] == (start, end):
            hit = st.lookup[2]
        else:
            hit = self._lookup(self._hex(hashes[start:end]))
            st.lookup = (start, end, hit)
        if hit == 0:
            st.load = None
            return 0, False
        st.load = (start, start + hit)
        return (start + hit) * self.bs - num_computed_tokens, False

    def _lookup(self, hashes_hex):
        """How many of these blocks, from the first, moongate holds for every rank."""
        client = self.link.get()
        if client is None:
            return 0
        per_rank = self.scheme.all_ranks(hashes_hex)
        keys = [k for ks in per_rank for k in ks]
        found = []
        try:
            b = int(self.cfg["batch_keys"])
            for a in range(0, len(keys), b):
                found += client.exists(keys[a:a + b])
        except moongate_kv.MoongateError as e:
            self.link.failed(e)
            return 0
        n = len(hashes_hex)
        hit = 0
        while hit < n and all(found[r * n + hit] for r in range(self.scheme.tp_size)):
            hit += 1
        return hit

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        st = self._state(request)
        if num_external_tokens == 0 or st.load is None:
            st.load = None
            return
        start, end = st.load
        ids = blocks.get_block_ids()[0]
        if len(ids) < end or (end - start) * self.bs < num_external_tokens:
            logger.warning("MoongateConnector: request %s: %d blocks allocated for a load "
                           "of blocks %d-%d; not loading", request.request_id, len(ids),
                           start, end)
            st.load = None
            return
        st.load = _Move(request.request_id,
                        self._hex(request.block_hashes[start:end]), ids[start:end])

    def build_connector_meta(self, scheduler_output):
        meta = MoongateConnectorMetadata()
        for rid in scheduler_output.finished_req_ids:
            self._reqs.pop(rid, None)
        block_state = scheduler_output.kv_connector_block_state
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is None:
                continue
            if isinstance(st.load, _Move):
                meta.loads.append(st.load)
            st.load = None
            st.lookup = None
            if not self.cfg["save"]:
                continue
            req = st.request
            if st.saved_upto is None:
                # What is computed at its first step came from vLLM's own cache or from
                # moongate: stored already.
                st.saved_upto = req.num_computed_tokens // self.bs
            elif req.num_computed_tokens < st.computed:
                # Fewer tokens than last time: a failed load vLLM recomputes (the block
                # may be missing from moongate) or a preemption. Store from there again;
                # blocks moongate holds are refused as existing, at no cost but a call.
                st.saved_upto = min(st.saved_upto, req.num_computed_tokens // self.bs)
            st.computed = req.num_computed_tokens
            done = min(req.num_computed_tokens + n, req.num_prompt_tokens)
            upto = min(done // self.bs, len(req.block_hashes))
            if upto <= st.saved_upto or block_state is None:
                continue
            ids = block_state.get_block_ids(rid)
            if ids is None or len(ids[0]) < upto:
                continue
            hashes = self._hex(req.block_hashes[st.saved_upto:upto])
            meta.saves.append(_Move(rid, hashes, ids[0][st.saved_upto:upto]))
            if self._events_on:
                toks = req.all_token_ids
                for i, h in enumerate(hashes):
                    b = st.saved_upto + i
                    parent = bytes(req.block_hashes[b - 1]).hex() if b else None
                    self._event_info[h] = (parent, list(toks[b * self.bs:(b + 1) * self.bs]))
                while len(self._event_info) > _MAX_PENDING_EVENTS:
                    self._event_info.pop(next(iter(self._event_info)))
            st.saved_upto = upto
        return meta

    def update_connector_output(self, connector_output):
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, MoongateWorkerMetadata) or not self._events_on:
            return
        from vllm.distributed.kv_events import BlockStored
        for h in meta.skipped:
            self._event_info.pop(h, None)
        for h in meta.stored:
            info = self._event_info.pop(h, None)
            if info is None:
                continue
            parent, toks = info
            self._events.append(BlockStored(
                block_hashes=[_external(h)],
                parent_block_hash=_external(parent) if parent else None,
                token_ids=toks, block_size=self.bs, lora_id=None, medium="moongate",
                lora_name=None))

    def take_events(self):
        events, self._events = self._events, []
        return events

    def request_finished(self, request, block_ids):
        # The prompt's blocks: those a live request took a count on (decode blocks are
        # not stored).
        hashes = self._hex(request.block_hashes[: request.num_prompt_tokens // self.bs])
        done = []
        for h in hashes:
            c = self._live[h] - 1
            if c <= 0:
                self._live.pop(h, None)
                done.append(h)
            else:
                self._live[h] = c
        if self._hints is not None and done:
            keys = self.scheme.keys(0, done[: int(self.cfg["hints_max_blocks"])])
            self._hints.post([{"kind": "done", "keys": keys,
                               "session": str(request.request_id)[:256]}])
        return False, None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        layout = extra.get("kv_layout", DEFAULTS["kv_layout"])
        try:
            from vllm.platforms import current_platform
            if current_platform.is_cpu():
                return None  # the CPU backend has one layout
        except Exception:
            pass
        return layout

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config):
        # Loads are waited for, and saves queued, layer by layer.
        return True

    # ======================= worker side =======================

    def register_kv_caches(self, kv_caches):
        names = list(self._kv_cache_config.kv_cache_groups[0].layer_names)
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise ValueError(f"MoongateConnector: no KV cache for layers {missing[:4]}")
        self._layers = {n: i for i, n in enumerate(names)}
        self._tensors = [kv_caches[n] for n in names]
        logger.info("MoongateConnector (worker, tp rank %d): %d layers, %s", self.rank,
                    len(names), tuple(self._tensors[0].shape))

    def _paged(self):
        if self.kv is not None:
            return self.kv
        client = self.link.get()
        if client is None:
            return None
        try:
            self.kv = PagedKV(client, self._tensors, batch=int(self.cfg["batch_keys"]))
        except moongate_kv.MoongateError as e:
            self.link.failed(e)
            return None
        page = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
        if self.kv.value_bytes != page * len(self._tensors):
            logger.warning("MoongateConnector: a block is %d bytes across layers here, "
                           "%d by the KV spec", self.kv.value_bytes, page * len(self._tensors))
        return self.kv

    def _lost_link(self, err):
        self.link.failed(err)
        self.kv = None

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        if not isinstance(meta, MoongateConnectorMetadata) or not meta.loads:
            return
        t0 = time.perf_counter()
        try:
            self._start_load(meta)
        finally:
            self.stats["load_us"] += int((time.perf_counter() - t0) * 1e6)

    def _start_load(self, meta):
        keys, ids = [], []
        for m in meta.loads:
            keys += self.scheme.keys(self.rank, m.hashes)
            ids += m.block_ids
        kv = self._paged()
        if kv is None:
            self._failed(meta, set(ids))
            return
        try:
            job = kv.load_job(keys, ids)
            if kv.cuda:
                for i in range(len(self._tensors)):
                    job.copy_layer(i)
            else:
                job.copy_all()
        except moongate_kv.MoongateError as e:
            self._lost_link(e)
            self._failed(meta, set(ids))
            return
        if job.failed:
            self._failed(meta, job.failed)
            logger.warning("MoongateConnector: %d of %d blocks not loaded (%s); vLLM "
                           "recomputes them", len(job.failed), len(ids),
                           sorted(set(map(str, job.codes.values())))[:4])
        self.stats["loaded_blocks"] += len(ids) - len(job.failed)
        self._load = job

    def _failed(self, meta, failed):
        """Blocks not loaded: reported to vLLM, and their requests' saves of this step
        dropped. The step computes those requests' later blocks against KV that was not
        loaded; vLLM throws that away and recomputes, and so must the pool: what this
        step would store of them is wrong."""
        self._load_errors.update(failed)
        self.stats["load_failed_blocks"] += len(failed)
        self._failed_reqs.update(m.req_id for m in meta.loads
                                 if not failed.isdisjoint(m.block_ids))

    def wait_for_layer_load(self, layer_name):
        job = self._load
        if job is None:
            return
        i = self._layers.get(layer_name)
        if i is not None:
            job.wait_layer(i)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        i = self._layers.get(layer_name)
        if i is None:
            return
        job = self._store_job()
        if job is not None and self.kv.cuda:
            job.copy_layer(i)
            self._store_layers.add(i)

    def _store_job(self):
        if self._store is not None:
            return self._store
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if not isinstance(meta, MoongateConnectorMetadata) or not meta.saves:
            return None
        kv = self._paged()
        if kv is None:
            return None
        keys, ids = [], []
        for m in meta.saves:
            if m.req_id in self._failed_reqs:
                self.stats["saves_dropped_after_failed_load"] += len(m.block_ids)
                continue
            keys += self.scheme.keys(self.rank, m.hashes)
            ids += m.block_ids
        if not keys:
            return None
        try:
            self._store = kv.store_job(keys, ids)
        except moongate_kv.MoongateError as e:
            self._lost_link(e)
            return None
        self._store_layers = set()
        return self._store

    def wait_for_save(self):
        t0 = time.perf_counter()
        try:
            self._wait_for_save()
        finally:
            self._failed_reqs = set()
            self.stats["save_us"] += int((time.perf_counter() - t0) * 1e6)

    def _wait_for_save(self):
        # Loads first: their views are released once every layer's copies are done.
        if self._load is not None:
            job, self._load = self._load, None
            job.finish()
        job = self._store_job()
        if job is None:
            return
        self._store = None
        try:
            if len(self._store_layers) < len(self._tensors):
                if not self._store_layers:
                    job.copy_all()
                else:
                    for i in range(len(self._tensors)):
                        if i not in self._store_layers:
                            job.copy_layer(i)
            stored, skipped = job.finish()
        except moongate_kv.MoongateError as e:
            job.abort()
            self._lost_link(e)
            return
        except BaseException:
            job.abort()
            raise
        self.stats["stored_blocks"] += len(stored)
        self.stats["store_skipped_blocks"] += len(skipped)
        prefix = len(self.scheme.keys(self.rank, [""])[0])
        self._stored += [k[prefix:] for k in stored]
        self._skipped += [k[prefix:] for k in skipped]

    def get_block_ids_with_load_errors(self):
        errs, self._load_errors = self._load_errors, set()
        return errs

    def build_connector_worker_meta(self):
        if not self._stored and not self._skipped:
            return None
        meta = MoongateWorkerMetadata(stored=self._stored, skipped=self._skipped)
        self._stored, self._skipped = [], []
        return meta

    def shutdown(self):
        if getattr(self, "_load", None) is not None:
            self._load.finish()
            self._load = None
        if getattr(self, "_store", None) is not None:
            self._store.abort()
            self._store = None


def _external(hex_digest):
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    return maybe_convert_block_hash(bytes.fromhex(hex_digest))


def prompt_block_hashes(vllm_config, token_ids):
    """The hex block hashes vLLM gives a plain-text prompt of `token_ids` under this
    config (its hash function and seed): what a router needs to name a prompt's keys
    (`KeyScheme.keys`) in hints, before any engine has seen it."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    kcu.init_none_hash(hash_fn)
    bs = vllm_config.cache_config.block_size
    out, parent = [], None
    for i in range(len(token_ids) // bs):
        parent = kcu.hash_block_tokens(hash_fn, parent, token_ids[i * bs:(i + 1) * bs], None)
        out.append(bytes(parent).hex())
    return out


__all__ += ["prompt_block_hashes", "MoongateConnectorMetadata", "MoongateWorkerMetadata"]
