"""The vLLM connector's scheduler side (kvtier/vllm.py is its entry): lookups
on a thread of its own, what each request may load, and the loads and stores
it plans for the workers."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import kvtier

from ._vllm_common import (
    KvtierMetadata,
    RequestHint,
    TransferSpec,
    _Connection,
    _keys,
    _Refusals,
    _Settings,
    logger,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

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

    def __init__(self, settings: _Settings, layouts: list[kvtier.Layout]) -> None:
        self._settings = settings
        self._layouts = layouts  # one per distinct shard of a block (_Shards)
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
        refusals = _Refusals()
        # Keys and lookups name a namespace through a registered cache: one
        # per shard, each of one block, moving none. Registered once and
        # kept for the connection's life: the client registers them again
        # by itself whenever it reconnects (after a timeout dropped the
        # connection, or a daemon restart).
        caches: list[kvtier.KvCache] = []
        cpus: list[kvtier.CpuKvCache] = []
        while (item := self._queue.get()) is not None:
            req_id, hashes = item
            if self._stale(req_id, hashes):
                continue
            hits = 0
            try:
                client = connection.client()
                if client is not None:
                    while len(caches) < len(self._layouts):
                        cpus.append(kvtier.CpuKvCache(self._layouts[len(caches)], 1))
                        caches.append(client.register_cpu_cache(cpus[-1]))
                    # As far as every shard is cached; each prefetch asks
                    # only about what the shards before it hold.
                    hits = len(hashes)
                    for cache in caches:
                        hits = client.prefetch(cache, _keys(client, cache, hashes[:hits])) if hits else 0
            except kvtier.Error as error:
                hits = 0
                registered = len(caches) == len(self._layouts)
                refusals.note(error, f"a lookup of {len(hashes)} blocks" if registered else "the lookups' registration")
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
    def __init__(self, settings: _Settings, layouts: list[kvtier.Layout]) -> None:
        self._block_tokens = layouts[0].block_tokens
        self._lookups = _Lookups(settings, layouts)
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
