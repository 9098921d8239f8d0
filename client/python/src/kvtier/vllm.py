"""kvtier.vllm: a vLLM v1 KV connector (``KVConnectorBase_V1``) over kvtierd.

Tested with vLLM 0.33.0. vLLM loads it with one flag::

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": "/run/kvtier/kvtierd.sock"}}'

plus ``--prefix-caching-hash-algo sha256_cbor`` and a fixed ``PYTHONHASHSEED``
in every process, so that vLLM's block hashes (the keys here) are the same
across processes, restarts and nodes.

Two instances run, with no state in common:

- ``role=SCHEDULER`` in the engine-core process. It waits on the daemon at
  most ``lookup_wait_ms`` per request: ``get_num_new_matched_tokens`` hands
  the lookup to a thread of its own, waits that long for the answer, and
  answers ``None`` ("ask again") while it is not there. The lookup is a
  prefetch: it counts the leading full blocks cached now and starts moving
  them to the host tier. The step plan (``KvtierMetadata``) says which blocks
  each worker loads and stores.
- ``role=WORKER`` in every model-runner process. It registers vLLM's KV tensors
  with the daemon in place (CPU memory is shared, GPU memory goes through CUDA
  IPC), loads before the forward pass (``start_load_kv``), and starts the
  stores after it (``wait_for_save``). A request whose blocks are being stored
  stays held (``request_finished`` returns True) until ``get_finished`` reports
  its stores done. A failed load is reported through
  ``get_block_ids_with_load_errors`` and vLLM recomputes those blocks.

A daemon that is down or restarting is a miss, never an exception in vLLM:
lookups answer 0 blocks, loads fail into recomputation, stores are skipped.

Engine hints, per request: an application passes them in vLLM's
``kv_transfer_params`` (``SamplingParams.extra_args["kv_transfer_params"]``,
or the OpenAI server's ``"kv_transfer_params"`` field) as
``{"kvtier": {"priority": 1, "next_use_ms": 30000, "session_over": false}}``
(docs/policy.md says what each does). Stores of the request carry
``priority`` and ``next_use_ms``; once the request is over and its stores
have landed, one hint covers all its blocks (those loaded and those stored).
A hint that is not valid is logged and ignored: the request runs unhinted.

Settings (``kv_connector_extra_config``): ``socket`` (default
``$KVTIER_SOCKET``, else ``/run/kvtier/kvtierd.sock``), ``token`` (when the
tenant is identified by a token), ``model_id`` (default: the served model's
name; it and the KV shape name the namespace), ``lookup_timeout_s`` (default
2: a lookup unanswered for that long is a miss; the scheduler's calls to the
daemon wait at most that long, and lookups that waited past it behind a hung
call are dropped, not run late), ``lookup_wait_ms`` (default
2: how long the scheduler's first ask about a request waits for the answer
before vLLM goes on without it; 0 never waits), ``op_timeout_s`` (default
10: how long a worker's call to the daemon, and a step's loads, may take; a
load not done by then is cancelled and its blocks recomputed, a store not
done when its blocks are needed is cancelled; after a call timed out the
worker leaves the daemon alone for a second, doubling to 30 s while it stays
hung, and every transfer meanwhile is a miss. A step so waits at most about
twice op_timeout_s on a hung daemon, once).

Cancelling (``Op.cancel``) needs no answer from the daemon: once it
returns, kvtierd never touches the op's blocks again, so vLLM may reuse or
recompute them at once. Only a daemon stopped in the middle of a copy (a
copy takes microseconds) makes it wait for that copy.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

import kvtier

from . import _TORCH_DTYPES
from ._hung import HungPause

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KvtierConnector", "KvtierMetadata", "RequestHint", "TransferSpec"]

# A child of vLLM's "vllm" logger, so that vLLM's logging settings (its handler and
# format, VLLM_LOGGING_LEVEL, VLLM_CONFIGURE_LOGGING, VLLM_LOGGING_CONFIG_PATH)
# apply to the connector's lines as to its own: a logger of another name has
# no handler inside vLLM, and its INFO lines were lost.
logger = init_logger("vllm.kvtier")

_DEFAULT_SOCKET = "/run/kvtier/kvtierd.sock"
# How long a process waits between attempts to reach a daemon that was down.
_RECONNECT_INTERVAL_S = 1.0


# --------------------------------------------------------------------------
# What both sides derive alike: settings, the layout, keys.


@dataclass(frozen=True)
class _Settings:
    socket: str
    token: str | None
    model_id: str
    lookup_timeout_s: float
    lookup_wait_s: float
    op_timeout_s: float

    @staticmethod
    def of(vllm_config: VllmConfig) -> _Settings:
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        return _Settings(
            socket=str(extra.get("socket") or os.environ.get("KVTIER_SOCKET") or _DEFAULT_SOCKET),
            token=extra.get("token"),
            model_id=str(extra.get("model_id") or vllm_config.model_config.model),
            lookup_timeout_s=float(extra.get("lookup_timeout_s", 2.0)),
            lookup_wait_s=float(extra.get("lookup_wait_ms", 2.0)) / 1000,
            op_timeout_s=float(extra.get("op_timeout_s", 10.0)),
        )


def _layout(settings: _Settings, kv_cache_config: KVCacheConfig, tp_rank: int, tp_size: int) -> kvtier.Layout:
    """The kvtier layout of vLLM's KV cache: one group of full-attention layers.

    Both roles derive it from the same KVCacheConfig, so the scheduler's
    lookups and the workers' loads and stores name one namespace."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise NotImplementedError(
            f"KvtierConnector takes one KV cache group (uniform full attention); this model has {len(groups)}: "
            "run vLLM with --disable-hybrid-kv-cache-manager"
        )
    spec = groups[0].kv_cache_spec
    for attribute in ("block_size", "num_kv_heads", "head_size", "dtype"):
        if not hasattr(spec, attribute):
            raise NotImplementedError(f"KvtierConnector takes attention KV caches, not {type(spec).__name__}")
    if "MLA" in type(spec).__name__:
        raise NotImplementedError("KvtierConnector does not take MLA (latent) KV caches yet")
    dtype = _TORCH_DTYPES.get(str(spec.dtype).removeprefix("torch."))
    if dtype is None:
        raise NotImplementedError(f"KvtierConnector does not take {spec.dtype} KV caches")
    return kvtier.Layout(
        settings.model_id,
        num_layers=len(groups[0].layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        dtype=dtype,
        block_tokens=spec.block_size,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


def _keys(client: kvtier.Client, cache: kvtier.KvCache, hashes: list[bytes]) -> list[bytes]:
    return [client.key_from_engine_hash(cache, h) for h in hashes]


class _Connection:
    """A client of the daemon, connected on first use and again after a
    failed attempt at most once per _RECONNECT_INTERVAL_S. `register` makes the
    caller's KV cache once connected. Once connected, the client itself
    reconnects after a daemon restart and registers the cache again.
    Owned by one thread at a time."""

    def __init__(self, settings: _Settings, name: str, call_timeout_s: float | None = None) -> None:
        self._settings = settings
        self._name = name
        self._call_timeout_s = call_timeout_s
        self._client: kvtier.Client | None = None
        self._next_attempt = 0.0
        self._warned = False
        self._hung = HungPause()

    def client(self) -> kvtier.Client | None:
        now = time.monotonic()
        if self._hung.active():
            return None
        if self._client is not None:
            return self._client
        if now < self._next_attempt:
            return None
        try:
            self._client = kvtier.Client.connect(
                self._settings.socket, token=self._settings.token, name=self._name, call_timeout=self._call_timeout_s
            )
            logger.info("kvtier: connected to %s as tenant %s", self._settings.socket, self._client.tenant)
            self._warned = False
        except kvtier.Error as error:
            self._next_attempt = now + _RECONNECT_INTERVAL_S
            if not self._warned:
                logger.warning("kvtier: %s unreachable (%s); every lookup is a miss until it is back", self._settings.socket, error)
                self._warned = True
        return self._client

    def note(self, error: kvtier.Error | None) -> None:
        """What a call to the daemon ended with (None: it answered). After a
        call that timed out, client() is None for a while (HungPause): a hung
        daemon costs each step nothing more, not a call_timeout per step."""
        connected = self._client is None or self._client.connected
        if (pause := self._hung.note(error, connected)) is not None:
            logger.warning("kvtier: %s did not answer in time (%s); transfers are misses for %.0f s", self._settings.socket, error, pause)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


# --------------------------------------------------------------------------
# The step plan, scheduler to workers.

# The most next_use_ms the daemon takes (an hour; ipc::kMaxNextUseMs).
_MAX_NEXT_USE_MS = 3_600_000


@dataclass(frozen=True)
class RequestHint:
    """A request's retention hint (docs/policy.md), from its kv_transfer_params."""

    priority: int = 0
    next_use_ms: int = 0
    session_over: bool = False

    @staticmethod
    def of(request: Request) -> RequestHint | None:
        """The hint in ``request.kv_transfer_params["kvtier"]``; None when it has
        none, or one that is not valid (logged: the request runs unhinted)."""
        params = getattr(request, "kv_transfer_params", None)
        raw = params.get("kvtier") if isinstance(params, dict) else None
        if raw is None:
            return None
        try:
            if not isinstance(raw, dict) or set(raw) - {"priority", "next_use_ms", "session_over"}:
                raise ValueError("an object with priority, next_use_ms and session_over is wanted")
            priority, next_use_ms = raw.get("priority", 0), raw.get("next_use_ms", 0)
            session_over = raw.get("session_over", False)
            if type(priority) is not int or priority not in (-1, 0, 1):
                raise ValueError(f"priority {priority!r}: -1 (evict first), 0 (no hint) or 1 (keep)")
            if type(next_use_ms) is not int or not 0 <= next_use_ms <= _MAX_NEXT_USE_MS:
                raise ValueError(f"next_use_ms {next_use_ms!r}: an integer from 0 to {_MAX_NEXT_USE_MS}")
            if not isinstance(session_over, bool):
                raise ValueError(f"session_over {session_over!r}: true or false")
        except ValueError as error:
            logger.warning("kvtier: request %s: kv_transfer_params.kvtier ignored (%s)", request.request_id, error)
            return None
        hint = RequestHint(priority, next_use_ms, session_over)
        return hint if hint != RequestHint() else None


@dataclass
class TransferSpec:
    """Blocks of one request to move: vLLM block hashes and block ids, alike
    in length, and the request's hint (stores carry it)."""

    req_id: str
    block_hashes: list[bytes]
    block_ids: list[int]
    hint: RequestHint | None = None


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    """One step's plan: loads before the forward pass, stores after it, the
    requests preempted (their blocks may be reused once this step ends), and
    the hints of hinted requests that are over (block_ids empty: every block
    of the request, sent once its stores have landed)."""

    loads: list[TransferSpec] = field(default_factory=list)
    stores: list[TransferSpec] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    hints: list[TransferSpec] = field(default_factory=list)


# --------------------------------------------------------------------------
# Scheduler side.


@dataclass
class _Lookup:
    num_blocks: int  # leading hashes asked about
    started: float
    hits: int | None = None  # None while in flight


class _Lookups:
    """Prefetches on a thread of their own, so the scheduler waits on the
    daemon at most lookup_wait_s per request. Called by the scheduler thread
    (result, forget)."""

    def __init__(self, settings: _Settings, layout: kvtier.Layout) -> None:
        self._settings = settings
        self._layout = layout
        self._lock = threading.Lock()
        self._answered = threading.Condition(self._lock)
        self._entries: dict[str, _Lookup] = {}
        self._queue: queue.SimpleQueue[tuple[str, list[bytes]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvtier-lookups", daemon=True)
        self._thread.start()

    def result(self, req_id: str, hashes: list[bytes]) -> int | None:
        """Leading blocks of `hashes` cached, or None while the answer is not
        there. The first call starts the lookup and waits for its answer for
        at most lookup_wait_s (a round trip takes a fraction of that), so
        that a request is scheduled in the step it arrives in, not a step
        later, behind whatever that step computes. A lookup unanswered after
        lookup_timeout_s is a miss."""
        now = time.monotonic()
        with self._lock:
            entry = self._entries.get(req_id)
            if entry is None or entry.num_blocks != len(hashes):
                entry = self._entries[req_id] = _Lookup(len(hashes), now)
                self._queue.put((req_id, hashes))
                if self._settings.lookup_wait_s > 0:
                    self._answered.wait_for(lambda: entry.hits is not None, self._settings.lookup_wait_s)
                return entry.hits
            if entry.hits is None and now - entry.started > self._settings.lookup_timeout_s:
                entry.hits = 0
                logger.warning("kvtier: a lookup took over %.1f s; a miss", self._settings.lookup_timeout_s)
            return entry.hits

    def forget(self, req_id: str) -> None:
        with self._lock:
            self._entries.pop(req_id, None)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _stale(self, req_id: str, hashes: list[bytes]) -> bool:
        """Whether a queued lookup is no longer wanted: its request is gone,
        asked again with other blocks, or answered already (a miss, once it
        waited lookup_timeout_s)."""
        with self._lock:
            entry = self._entries.get(req_id)
            return entry is None or entry.num_blocks != len(hashes) or entry.hits is not None

    def _run(self) -> None:
        # Each call waits for the daemon at most lookup_timeout_s: a hung
        # daemon costs this thread that, then the connection is dropped, and
        # lookups that waited meanwhile are dropped, not run late.
        connection = _Connection(self._settings, "vllm-scheduler", call_timeout_s=self._settings.lookup_timeout_s)
        cache: kvtier.KvCache | None = None
        cpu: kvtier.CpuKvCache | None = None
        while (item := self._queue.get()) is not None:
            req_id, hashes = item
            if self._stale(req_id, hashes):
                continue
            hits = 0
            try:
                client = connection.client()
                if client is not None:
                    if cache is None:
                        # Keys and lookups name a namespace through a registered
                        # cache; the scheduler's holds one block and moves none.
                        cpu = kvtier.CpuKvCache(self._layout, 1)
                        cache = client.register_cpu_cache(cpu)
                    hits = client.prefetch(cache, _keys(client, cache, hashes))
            except kvtier.Error as error:
                logger.debug("kvtier: lookup failed (%s); a miss", error)
                if isinstance(error, kvtier.DeadlineExceededError):
                    cache = None  # the connection was dropped: registered again on the next
            with self._lock:
                entry = self._entries.get(req_id)
                if entry is not None and entry.num_blocks == len(hashes) and entry.hits is None:
                    entry.hits = hits
                    self._answered.notify_all()
        connection.close()


@dataclass
class _Request:
    """What the scheduler side keeps of a running request."""

    request: Request
    hint: RequestHint | None
    block_ids: list[int] = field(default_factory=list)
    stored: int = 0  # leading blocks known cached or already sent to be stored
    has_stores: bool = False


class _SchedulerSide:
    def __init__(self, settings: _Settings, layout: kvtier.Layout) -> None:
        self._block_tokens = layout.block_tokens
        self._lookups = _Lookups(settings, layout)
        self._requests: dict[str, _Request] = {}
        self._local_tokens: dict[str, int] = {}  # vLLM's own hit, at the last ask
        self._hits: dict[str, int] = {}
        self._loads: list[TransferSpec] = []
        self._hints: list[TransferSpec] = []  # of requests over, for the next step

    def _full_blocks(self, request: Request) -> int:
        """Full blocks of the prompt so far that may come from kvtier: at
        least one token is always left for vLLM to compute."""
        limit = (request.num_tokens - 1) // self._block_tokens
        publishable = getattr(request, "num_publishable_block_hashes", None)
        if publishable is not None:
            limit = min(limit, publishable)
        return min(len(request.block_hashes), limit)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        blocks = self._full_blocks(request)
        if blocks * self._block_tokens <= num_computed_tokens:
            return 0, False
        hashes = [kvtier.engine_hash_bytes(h) for h in request.block_hashes[:blocks]]
        hits = self._lookups.result(request.request_id, hashes)
        if hits is None:
            return None, False
        self._local_tokens[request.request_id] = num_computed_tokens
        self._hits[request.request_id] = hits
        return max(0, hits * self._block_tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        state = self._requests.get(req_id)
        if state is None:
            state = self._requests[req_id] = _Request(request, RequestHint.of(request))
        state.stored = max(state.stored, self._hits.get(req_id, 0))
        if num_external_tokens <= 0:
            return
        first = self._local_tokens.get(req_id, 0) // self._block_tokens
        count = num_external_tokens // self._block_tokens
        block_ids = list(blocks.get_block_ids()[0])
        hashes = [kvtier.engine_hash_bytes(h) for h in request.block_hashes[first : first + count]]
        self._loads.append(TransferSpec(req_id, hashes, block_ids[first : first + count]))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvtierMetadata:
        meta = KvtierMetadata(
            loads=self._loads, preempted=set(scheduler_output.preempted_req_ids or ()), hints=self._hints
        )
        self._loads, self._hints = [], []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            self._plan_stores(meta, state, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            computed = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._plan_stores(meta, state, computed)
        return meta

    def _plan_stores(self, meta: KvtierMetadata, state: _Request, computed_tokens: int) -> None:
        """Stores the blocks that are full once this step has run."""
        request = state.request
        blocks = min(computed_tokens // self._block_tokens, len(request.block_hashes), len(state.block_ids))
        publishable = getattr(request, "num_publishable_block_hashes", None)
        if publishable is not None:
            blocks = min(blocks, publishable)
        if blocks <= state.stored:
            return
        hashes = [kvtier.engine_hash_bytes(h) for h in request.block_hashes[state.stored : blocks]]
        meta.stores.append(TransferSpec(request.request_id, hashes, state.block_ids[state.stored : blocks], state.hint))
        state.stored = blocks
        state.has_stores = True

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._lookups.forget(req_id)
        self._local_tokens.pop(req_id, None)
        self._hits.pop(req_id, None)
        state = self._requests.pop(req_id, None)
        if state is not None and state.hint is not None and state.stored > 0:
            hashes = [kvtier.engine_hash_bytes(h) for h in request.block_hashes[: state.stored]]
            self._hints.append(TransferSpec(req_id, hashes, [], state.hint))
        # Blocks sent to be stored stay held until the workers report the
        # request in finished_sending.
        return (state is not None and state.has_stores), None

    def close(self) -> None:
        self._lookups.close()


# --------------------------------------------------------------------------
# Worker side.


def _placements(layer_tensors: list[torch.Tensor], head_size: int) -> tuple[list[tuple[int, int]], list[kvtier.Placement]]:
    """Regions (one per distinct storage) and placements of vLLM's per-layer
    KV views, in layer order.

    vLLM 0.33 hands each layer a view [blocks, heads, block_tokens, 2 * head_size]
    of one shared allocation: K is the first head_size elements of the last
    dimension, V the second. Its layout (LBNHC, LBHNC, the blocks-first BLNHC,
    ...) is only the strides of those views, so they are read from the views."""
    regions: list[tuple[int, int]] = []
    region_of: dict[int, int] = {}
    placements: list[kvtier.Placement] = []
    for index, tensor in enumerate(layer_tensors):
        if tensor.dim() != 4 or tensor.shape[3] != 2 * head_size or tensor.stride(3) != 1:
            raise kvtier.InvalidArgumentError(
                f"layer {index}: a KV view [blocks, heads, block_tokens, 2 x {head_size}] with a contiguous last "
                f"dimension is needed, not shape {tuple(tensor.shape)} strides {tensor.stride()}"
            )
        storage = tensor.untyped_storage()
        base = storage.data_ptr()
        if base not in region_of:
            region_of[base] = len(regions)
            regions.append((base, storage.nbytes()))
        element = tensor.element_size()
        offset = tensor.storage_offset() * element
        strides = [s * element for s in tensor.stride()]
        for part in (0, 1):  # K, V
            placements.append(
                kvtier.Placement(
                    region=region_of[base],
                    offset_bytes=offset + part * head_size * element,
                    block_stride_bytes=strides[0],
                    token_stride_bytes=strides[2],
                    head_stride_bytes=strides[1],
                )
            )
    return regions, placements


class _WorkerSide:
    def __init__(self, settings: _Settings, kv_cache_config: KVCacheConfig, tp_rank: int, tp_size: int) -> None:
        self._settings = settings
        self._kv_cache_config = kv_cache_config
        self._layout = _layout(settings, kv_cache_config, tp_rank, tp_size)
        # Every call waits at most op_timeout_s: a hung daemon never holds a
        # step for long (docs: op_timeout_s).
        self._connection = _Connection(settings, f"vllm-worker-{tp_rank}", call_timeout_s=settings.op_timeout_s)
        self._cache: kvtier.KvCache | None = None
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._invalid: set[int] = set()
        self._stores: dict[str, list[kvtier.Op]] = {}  # in flight, by request
        self._finishing: set[str] = set()  # finished requests with stores
        self._hints: dict[str, TransferSpec] = {}  # to send once their request's stores landed
        self._store_started: dict[int, float] = {}  # id(op) -> when get_finished first found it running

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches
        self._ensure_registered()

    def _ensure_registered(self) -> kvtier.KvCache | None:
        """The registered cache; registers it on first reaching the daemon."""
        if self._cache is not None or not self._kv_caches:
            return self._cache
        client = self._connection.client()
        if client is None:
            return None
        names = self._kv_cache_config.kv_cache_groups[0].layer_names
        tensors = [self._kv_caches[name] for name in names]
        regions, placements = _placements(tensors, self._layout.head_dim)
        num_blocks = tensors[0].shape[0]
        started = time.monotonic()
        if tensors[0].is_cuda:
            self._cache = client.register_cuda_memory(self._layout, num_blocks, regions, placements)
        else:
            self._cache = client.register_host_memory(self._layout, num_blocks, regions, placements)
        logger.info(
            "kvtier: registered vLLM's KV cache (%d blocks, %.2f GiB, %s) in %.2f s",
            num_blocks,
            sum(size for _, size in regions) / (1 << 30),
            "cuda" if tensors[0].is_cuda else "cpu",
            time.monotonic() - started,
        )
        return self._cache

    def _ready(self) -> tuple[kvtier.Client, kvtier.KvCache] | None:
        """The client and the registered cache, or None while the daemon is
        out of reach (every transfer is then a miss)."""
        try:
            cache = self._ensure_registered()
        except kvtier.Error as error:
            logger.warning("kvtier: registering the KV cache failed: %s", error)
            return None
        client = self._connection.client()
        return None if cache is None or client is None else (client, cache)

    def start_load_kv(self, meta: KvtierMetadata) -> None:
        # vLLM calls this every step, with or without a forward pass.
        for spec in meta.hints:
            if self._stores.get(spec.req_id):
                self._hints[spec.req_id] = spec  # get_finished sends it
            else:
                self._send_hint(spec)
        if not meta.loads:
            return
        ready = self._ready()
        pending: list[tuple[TransferSpec, kvtier.Op | None]] = []
        for spec in meta.loads:
            op = None
            if ready is not None:
                client, cache = ready
                try:
                    op = client.load_async(cache, _keys(client, cache, spec.block_hashes), spec.block_ids)
                except kvtier.Error as error:
                    # No copy of it runs now (a failed start cancels them).
                    self._connection.note(error)
                    logger.info("kvtier: a load of %d blocks failed to start (%s); vLLM recomputes them", len(spec.block_ids), error)
            pending.append((spec, op))
        # The forward pass reads these blocks: every load ends, or is
        # cancelled, before it starts.
        deadline = time.monotonic() + self._settings.op_timeout_s
        for spec, op in pending:
            loaded = 0
            if op is not None:
                result = self._finish(op, deadline - time.monotonic(), f"a load of {len(spec.block_ids)} blocks")
                loaded = result.blocks if result is not None else 0
            self._invalid.update(spec.block_ids[loaded:])

    def _finish(self, op: kvtier.Op, timeout: float, what: str) -> kvtier.OpResult | None:
        """The op's result within `timeout`, else None once it is cancelled:
        either way, no copy of it touches its blocks any more."""
        try:
            result = op.wait(max(timeout, 0.0))
            self._connection.note(None)
            return result
        except kvtier.DeadlineExceededError as error:
            self._connection.note(error)
            logger.warning("kvtier: %s is not done in time (%s); cancelled", what, error)
        except kvtier.Error as error:
            # Over, or lost with its connection: its copies are cancelled.
            logger.info("kvtier: %s failed (%s)", what, error)
            if not isinstance(error, kvtier.AbortedError):
                return None
        self._cancel(op)
        return None

    @staticmethod
    def _cancel(op: kvtier.Op) -> None:
        try:
            op.cancel(timeout=1.0)
        except kvtier.DeadlineExceededError:
            # The daemon stopped in the middle of one of the op's copies: its
            # blocks are not vLLM's again until that copy is over.
            logger.error("kvtier: kvtierd stopped in the middle of a copy; waiting for it before vLLM reuses the blocks")
            op.cancel()

    def wait_for_save(self, meta: KvtierMetadata) -> None:
        if not meta.stores:
            return
        if any(t.is_cuda for t in self._kv_caches.values()):
            # The daemon copies from the GPU on its own stream: the forward
            # pass that wrote these blocks must be over first.
            torch.cuda.current_stream().synchronize()
        ready = self._ready()
        for spec in meta.stores:
            ops = self._stores.setdefault(spec.req_id, [])
            if ready is None:
                continue
            client, cache = ready
            hint = spec.hint or RequestHint()
            try:
                ops.append(
                    client.store_async(
                        cache,
                        _keys(client, cache, spec.block_hashes),
                        spec.block_ids,
                        priority=hint.priority,
                        next_use_ms=hint.next_use_ms,
                    )
                )
            except kvtier.Error as error:
                self._connection.note(error)
                logger.info("kvtier: a store of %d blocks failed to start (%s)", len(spec.block_ids), error)

    def handle_preemptions(self, meta: KvtierMetadata) -> None:
        """A preempted request's blocks are reused after this step: its
        stores must have read them first, or be cancelled."""
        for req_id in meta.preempted:
            self._end_stores(self._stores.get(req_id, []))
            if req_id in self._stores:
                self._stores[req_id] = []

    def _end_stores(self, ops: list[kvtier.Op]) -> None:
        """Collects stores within op_timeout_s in all, cancelling those not
        done by then."""
        deadline = time.monotonic() + self._settings.op_timeout_s
        for op in ops:
            self._finish(op, deadline - time.monotonic(), "a store")

    def _poll_store(self, op: kvtier.Op) -> bool:
        """Collects a store's result if it is over; False while it still
        runs. One running past op_timeout_s is cancelled (so the request's
        blocks are vLLM's again)."""
        if self._connection.client() is None:
            self._cancel(op)  # the daemon is hung or gone: do not wait on it
            return True
        try:
            op.wait(0)
        except kvtier.DeadlineExceededError as error:
            self._connection.note(error)
            started = self._store_started.setdefault(id(op), time.monotonic())
            if self._connection.client() is not None and time.monotonic() - started < self._settings.op_timeout_s:
                return False
            logger.warning("kvtier: a store is not done after %.1f s; cancelled", self._settings.op_timeout_s)
            self._cancel(op)
        except kvtier.Error as error:
            logger.info("kvtier: a store failed (%s)", error)
            if isinstance(error, kvtier.AbortedError):
                self._cancel(op)
        self._store_started.pop(id(op), None)
        return True

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._finishing.update(r for r in finished_req_ids if r in self._stores)
        done: set[str] = set()
        for req_id in self._finishing:
            ops = self._stores[req_id]
            # Polled in order, at most one still running per request.
            while ops and self._poll_store(ops[0]):
                ops.pop(0)
            if not ops:
                done.add(req_id)
        for req_id in done:
            self._finishing.discard(req_id)
            del self._stores[req_id]
            if (spec := self._hints.pop(req_id, None)) is not None:
                self._send_hint(spec)
        return (done or None), None

    def _send_hint(self, spec: TransferSpec) -> None:
        """The hint of a request that is over, for all its blocks (one round trip)."""
        ready = self._ready()
        if ready is None or spec.hint is None:
            return
        client, cache = ready
        hint = spec.hint
        try:
            client.hint(
                cache,
                _keys(client, cache, spec.block_hashes),
                priority=hint.priority,
                next_use_ms=hint.next_use_ms,
                session_over=hint.session_over,
            )
        except kvtier.Error as error:
            self._connection.note(error)
            logger.info("kvtier: a hint for %d blocks failed (%s)", len(spec.block_hashes), error)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def shutdown(self) -> None:
        self._end_stores([op for ops in self._stores.values() for op in ops])
        self._stores.clear()
        # The registration goes before vLLM frees its tensors.
        self._cache = None
        self._connection.close()


# --------------------------------------------------------------------------
# The connector vLLM constructs.


def _tp_rank_and_size(vllm_config: VllmConfig) -> tuple[int, int]:
    size = vllm_config.parallel_config.tensor_parallel_size
    if size == 1:
        return 0, 1
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), size


class KvtierConnector(KVConnectorBase_V1):
    """vLLM's KV connector for kvtier; vLLM constructs one per role."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        settings = _Settings.of(vllm_config)
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            # Lookups use tensor-parallel rank 0's namespace: every rank stores
            # the same blocks; a rank that lacks one fails its load, and vLLM
            # recomputes the block.
            layout = _layout(settings, kv_cache_config, 0, vllm_config.parallel_config.tensor_parallel_size)
            self._scheduler = _SchedulerSide(settings, layout)
        else:
            tp_rank, tp_size = _tp_rank_and_size(vllm_config)
            self._worker = _WorkerSide(settings, kv_cache_config, tp_rank, tp_size)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a store that is dropped is a later miss

    # Scheduler side.

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    # Worker side.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loads every block before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # wait_for_save stores whole blocks after the forward pass

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save(self._meta())

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self._worker is not None
        if isinstance(kv_connector_metadata, KvtierMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.shutdown()

    def _meta(self) -> KvtierMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierMetadata)
        return meta
