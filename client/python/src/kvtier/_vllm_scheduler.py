"""The vLLM connector's scheduler side (kvtier/vllm.py is its entry): lookups
on a thread of its own, what each request may load, and the loads and stores
it plans for the workers."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import kvtier

from ._vllm_common import (
    KvtierMetadata,
    RequestHint,
    StepReport,
    TransferSpec,
    _Connection,
    _Group,
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


class _PrefillRate:
    """How fast the engine computes prefill, from its workers' timings of
    forward passes of at least _MIN_TOKENS tokens (StepReport): a moving
    average, each timing weighing _WEIGHT. 0 until the first. Written by the
    scheduler thread, read by the lookups' (a float: no lock)."""

    _MIN_TOKENS = 128
    _WEIGHT = 0.3

    def __init__(self) -> None:
        self.tokens_per_s = 0.0

    def observe(self, timing: StepReport) -> None:
        if timing.tokens < self._MIN_TOKENS or timing.seconds <= 0:
            return
        rate = timing.tokens / timing.seconds
        self.tokens_per_s = rate if self.tokens_per_s == 0 else (1 - self._WEIGHT) * self.tokens_per_s + self._WEIGHT * rate


@dataclass
class _Lookup:
    num_blocks: int  # leading hashes asked about
    started: float
    hits: int | None = None  # None while in flight


@dataclass
class _Dropped:
    """Blocks vLLM's own cache let go of (_EngineCache): each as its KV
    cache group, its hash, the block id that held it and its parent's
    hash (None where not known)."""

    blocks: list[tuple[int, bytes, int, bytes | None]]


class _EngineCache:
    """What vLLM's own cache holds, as far as the scheduler's outputs show
    it (exclusive caching): the KV cache group and hash each block id holds
    once full. A block id vLLM gives a request for other content than it
    held (a new block, one past the blocks the request matched, or a block
    of another group: the groups share one pool of ids) means vLLM let go of
    what it held there: dropped, for kvtierd (Hint.engine_dropped). A
    sliding-window group's null blocks (outside its window) hold nothing.
    Bounded by vLLM's block count; each step looks only at the blocks it
    gave or filled."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[int, bytes]] = {}
        self._parents: dict[int, bytes | None] = {}  # the hash before each held one's, where known
        self.dropped: list[tuple[int, bytes, int, bytes | None]] = []  # group, hash, block id, parent

    def _contents(
        self, group: int, ids: list[int], start: int, hashes: list[bytes]
    ) -> Iterator[tuple[int, int, tuple[int, bytes] | None, tuple[int, bytes] | None]]:
        """For a request's block ids in `group` from `start` on, whose first
        ones hold `hashes`: each (offset from start, block id, what it held,
        what it holds now: None for new content). Null blocks are skipped."""
        for position in range(start, len(ids)):
            block = ids[position]
            if block == _NULL_BLOCK:
                continue
            offset = position - start
            now = (group, hashes[offset]) if offset < len(hashes) else None
            yield offset, block, self._held.get(block), now

    def dropping(self, group: int, ids: list[int], start: int, hashes: list[bytes]) -> list[bytes]:
        """The hashes `seen` will find let go of for these ids (as its
        arguments), without recording anything: what a request's allocation
        just took."""
        return [held[1] for _, _, held, now in self._contents(group, ids, start, hashes) if held is not None and held != now]

    def seen(self, group: int, ids: list[int], start: int, hashes: list[bytes], before: bytes | None = None) -> None:
        """A request's block ids in `group` from `start` on: the first of
        them hold `hashes` (once this step has run), after the block of hash
        `before` (None: none, or not known); those after, new content."""
        for offset, block, held, now in self._contents(group, ids, start, hashes):
            if held is not None and held != now:
                self.dropped.append((*held, block, self._parents.get(block)))
            if now is None:
                self._held.pop(block, None)
                self._parents.pop(block, None)
            else:
                self._held[block] = now
                self._parents[block] = hashes[offset - 1] if offset > 0 else before


class _Lookups:
    """Prefetches on a thread of their own, so the scheduler waits on the
    daemon at most lookup_wait_s per request. Called by the scheduler thread
    (result, forget)."""

    def __init__(
        self, settings: _Settings, groups: list[_Group], layouts: list[list[kvtier.Layout]], prefill: _PrefillRate | None = None
    ) -> None:
        self._settings = settings
        # Given to kvtierd with each prefetch (load or recompute), when known.
        self._prefill = prefill if settings.load_or_recompute else None
        self._windows = [group.window_blocks for group in groups]
        self._layouts = layouts  # by group, one per distinct shard of a block (_Shards)
        self._lock = threading.Lock()
        self._answered = threading.Condition(self._lock)
        self._entries: dict[str, _Lookup] = {}
        self._queue: queue.SimpleQueue[tuple[str, list[bytes], int, frozenset[bytes]] | _Dropped | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvtier-lookups", daemon=True)
        self._thread.start()
        # Lookups started, and those not answered within lookup_wait_s (their
        # requests wait for a later step). Scheduler thread only.
        self.asked = 0
        self.late = 0

    def result(self, req_id: str, hashes: list[bytes], local: int = 0, pending: frozenset[bytes] = frozenset()) -> int | None:
        """Leading blocks of `hashes` cached, or None while the answer is not
        there. With full attention only, the first `local` blocks (vLLM's
        own hit) are not asked about: taken as cached, and not touched in
        kvtierd (its copies of what vLLM holds stay first to go: exclusive
        caching), nor timed for load or recompute. The first call starts
        the lookup and waits for its answer for
        at most lookup_wait_s (a round trip takes a fraction of that), so
        that a request is scheduled in the step it arrives in, not a step
        later, behind whatever that step computes. A lookup unanswered after
        lookup_timeout_s is a miss. `pending`: blocks vLLM let go of earlier
        in this scheduling pass, which the workers copy to kvtierd before
        the step's loads (keep_dropped): counted as cached."""
        now = time.monotonic()
        with self._lock:
            entry = self._entries.get(req_id)
            if entry is None or entry.num_blocks != len(hashes):
                entry = self._entries[req_id] = _Lookup(len(hashes), now)
                self._queue.put((req_id, hashes, local, pending))
                if self._settings.lookup_wait_s > 0:
                    self._answered.wait_for(lambda: entry.hits is not None, self._settings.lookup_wait_s)
                self.asked += 1
                self.late += entry.hits is None
                return entry.hits
            if entry.hits is None and now - entry.started > self._settings.lookup_timeout_s:
                entry.hits = 0
                logger.warning("kvtier: a lookup took over %.1f s; a miss", self._settings.lookup_timeout_s)
            return entry.hits

    def forget(self, req_id: str) -> None:
        with self._lock:
            self._entries.pop(req_id, None)

    def engine_dropped(self, blocks: list[tuple[int, bytes, int, bytes | None]]) -> None:
        """Blocks vLLM's own cache let go of (_Dropped's): told to kvtierd
        on this thread (Hint.engine_dropped), after the lookups queued
        before."""
        self._queue.put(_Dropped(blocks))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        if self.asked:
            logger.info(
                "kvtier: %d of %d lookups were answered after the scheduler's wait of %.1f ms (lookup_wait_ms): "
                "their requests were scheduled a step later",
                self.late, self.asked, self._settings.lookup_wait_s * 1000)

    def _stale(self, req_id: str, hashes: list[bytes]) -> bool:
        """Whether a queued lookup is no longer wanted: its request is gone,
        asked again with other blocks, or answered already (a miss, once it
        waited lookup_timeout_s)."""
        with self._lock:
            entry = self._entries.get(req_id)
            return entry is None or entry.num_blocks != len(hashes) or entry.hits is not None

    # Round trips a lookup spends looking for a shorter hit whose sliding
    # windows are all cached, before it settles for none.
    _WINDOW_TRIES = 16

    def _hits(
        self, client: kvtier.Client, caches: list[list[kvtier.KvCache]], hashes: list[bytes], pending: frozenset[bytes] = frozenset()
    ) -> int:
        """Leading blocks of `hashes` a load can bring back: every
        full-attention group's every shard holds them all, and every
        sliding-window group's every shard holds the window before the
        last of them. A window that lacks a block moves the end before that
        block, and the windows are asked again."""
        # Full attention: as far as every shard is cached; each prefetch
        # asks only about what the ones before it hold, and, given the
        # engine's prefill rate, only about the hits worth loading.
        rate = self._prefill.tokens_per_s if self._prefill is not None else 0.0
        hits = len(hashes)
        for window, shards in zip(self._windows, caches):
            if window is None:
                for cache in shards:
                    hits = self._leading(client, cache, hashes[:hits], pending, rate) if hits else 0
        tries = 0
        settled = False
        while hits and not settled:
            settled = True
            for window, shards in zip(self._windows, caches):
                if window is None:
                    continue
                for cache in shards:
                    start = max(0, hits - window)
                    held = client.prefetch(cache, _keys(client, cache, hashes[start:hits]), prefill_tokens_per_s=rate)
                    if start + held < hits:
                        hits, settled = start + held, False
                        tries += 1
                        if tries > self._WINDOW_TRIES:
                            return 0
                    if not hits:
                        return 0
        return hits

    @staticmethod
    def _leading(client: kvtier.Client, cache: kvtier.KvCache, hashes: list[bytes], pending: frozenset[bytes], rate: float) -> int:
        """Leading blocks of `hashes` cached in kvtierd, or about to be
        (`pending`): kvtierd is asked again past each run of pending ones."""
        hits = 0
        while hits < len(hashes):
            hits += client.prefetch(cache, _keys(client, cache, hashes[hits:]), prefill_tokens_per_s=rate)
            copied = hits
            while copied < len(hashes) and hashes[copied] in pending:
                copied += 1
            if copied == hits:
                break
            hits = copied
        return hits

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
        layouts = [layout for shards in self._layouts for layout in shards]
        registered: list[kvtier.KvCache] = []  # as `layouts`
        caches: list[list[kvtier.KvCache]] = []  # by group and shard, as self._layouts
        cpus: list[kvtier.CpuKvCache] = []
        while (item := self._queue.get()) is not None:
            if isinstance(item, _Dropped):
                client = connection.client() if caches else None
                by_group: dict[int, list[bytes]] = {}
                for group, block_hash, _, _ in item.blocks:
                    by_group.setdefault(group, []).append(block_hash)
                try:
                    for group, hashes in by_group.items() if client is not None else ():
                        for cache in caches[group]:
                            client.hint(cache, _keys(client, cache, hashes), engine_dropped=True)
                except kvtier.Error as error:
                    refusals.note(error, f"a hint that vLLM let go of {len(item.blocks)} blocks")
                continue
            req_id, hashes, local, pending = item
            if self._stale(req_id, hashes):
                continue
            if any(window is not None for window in self._windows):
                local = 0  # the windows before the hit's end are asked about whole
            hits = 0
            try:
                client = connection.client()
                if client is not None:
                    while len(registered) < len(layouts):
                        cpus.append(kvtier.CpuKvCache(layouts[len(registered)], 1))
                        registered.append(client.register_cpu_cache(cpus[-1]))
                    if not caches:
                        rest = iter(registered)
                        caches = [[next(rest) for _ in shards] for shards in self._layouts]
                    hits = local + self._hits(client, caches, hashes[local:], pending)
            except kvtier.Error as error:
                hits = 0
                registered_all = len(registered) == len(layouts)
                refusals.note(error, f"a lookup of {len(hashes)} blocks" if registered_all else "the lookups' registration")
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
    block_ids: list[list[int]] = field(default_factory=list)  # by KV cache group
    stored: int = 0  # leading blocks known cached or already sent to be stored
    has_stores: bool = False
    recorded: int = 0  # leading blocks whose hash _EngineCache knows vLLM holds


def _chains(dropped: list[tuple[int, bytes, int, bytes | None]]) -> list[TransferSpec]:
    """Blocks vLLM let go of (group, hash, block id, parent hash) as
    chains, each block after its parent and a chain's first after
    TransferSpec.parent: kvtierd links each copy under the block before it
    in its store, so no block may follow one that is not its parent."""
    present = {(group, block_hash) for group, block_hash, _, _ in dropped}
    children: dict[tuple[int, bytes | None], list[tuple[int, bytes, int, bytes | None]]] = {}
    for item in dropped:
        children.setdefault((item[0], item[3]), []).append(item)
    stack = [item for item in reversed(dropped) if item[3] is None or (item[0], item[3]) not in present]
    chains = []
    while stack:
        item: tuple[int, bytes, int, bytes | None] | None = stack.pop()
        assert item is not None
        spec = TransferSpec("", [], [], group=item[0], parent=item[3])
        while item is not None:
            spec.block_hashes.append(item[1])
            spec.block_ids.append(item[2])
            kids = children.pop((item[0], item[1]), [])
            stack.extend(reversed(kids[1:]))  # a branch: a chain of its own
            item = kids[0] if kids else None
        chains.append(spec)
    return chains


# vLLM's null block: where a sliding-window group holds no block (outside
# its window) its block ids say 0.
_NULL_BLOCK = 0


class _SchedulerSide:
    def __init__(self, settings: _Settings, groups: list[_Group], layouts: list[list[kvtier.Layout]]) -> None:
        self._block_tokens = layouts[0][0].block_tokens
        self._windows = [group.window_blocks for group in groups]
        self._prefill = _PrefillRate()
        self._lookups = _Lookups(settings, groups, layouts, self._prefill)
        # With several KV cache groups vLLM takes load failures only per
        # request, for loads it waits for (asynchronous): each hit's load is
        # one then, and a request whose load fell short is recomputed whole,
        # its lookups answered 0 from then on.
        self._async_loads = len(groups) > 1
        self._failed_loads: set[str] = set()
        self._requests: dict[str, _Request] = {}
        self._local_tokens: dict[str, int] = {}  # vLLM's own hit, at the last ask
        self._hits: dict[str, int] = {}
        self._loads: list[TransferSpec] = []
        self._hints: list[TransferSpec] = []  # of requests over, for the next step
        # vLLM's own copies, for exclusive caching: the workers' stores say
        # vLLM holds them (engine_holds) on the same setting, and the hints
        # from here release them.
        self._engine = _EngineCache() if settings.exclusive_caching else None
        # keep_dropped (full attention, one group): the hashes vLLM let go of
        # in this scheduling pass so far, which its lookups count as cached.
        self._keep_dropped = settings.exclusive_caching and settings.keep_dropped
        self._pending: set[bytes] = set()
        # The ranks' word on loads, for the next step's workers (StepReport),
        # and how many requests had each word, logged at shutdown.
        self._confirmed: set[str] = set()
        self._voided: set[str] = set()
        self._words = [0, 0]

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
        if blocks * self._block_tokens <= num_computed_tokens or request.request_id in self._failed_loads:
            return 0, False
        hashes = [kvtier.engine_hash_bytes(h) for h in request.block_hashes[:blocks]]
        hits = self._lookups.result(request.request_id, hashes, num_computed_tokens // self._block_tokens, frozenset(self._pending))
        if hits is None:
            return None, False
        self._local_tokens[request.request_id] = num_computed_tokens
        self._hits[request.request_id] = hits
        tokens = max(0, hits * self._block_tokens - num_computed_tokens)
        return tokens, self._async_loads and tokens > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        state = self._requests.get(req_id)
        if state is None:
            state = self._requests[req_id] = _Request(request, RequestHint.of(request))
        state.stored = max(state.stored, self._hits.get(req_id, 0))
        if self._keep_dropped and self._engine is not None and len(self._windows) == 1 and self._windows[0] is None:
            (ids,) = blocks.get_block_ids()
            local = self._local_tokens.get(req_id, 0) // self._block_tokens
            hashes = [kvtier.engine_hash_bytes(h) for h in request.block_hashes[local : len(ids)]]
            self._pending.update(self._engine.dropping(0, list(ids), local, hashes))
        if num_external_tokens <= 0:
            return
        first = self._local_tokens.get(req_id, 0) // self._block_tokens
        count = num_external_tokens // self._block_tokens
        hashes = [kvtier.engine_hash_bytes(h) for h in request.block_hashes[first : first + count]]
        # Each group loads the blocks vLLM gave it: a sliding-window group
        # none outside the window before the hit's end (null blocks there).
        for group, ids in enumerate(blocks.get_block_ids()):
            wanted = [i for i in range(count) if ids[first + i] != _NULL_BLOCK]
            if wanted:
                self._loads.append(TransferSpec(req_id, [hashes[i] for i in wanted], [ids[first + i] for i in wanted], group=group))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvtierMetadata:
        meta = KvtierMetadata(
            loads=self._loads,
            preempted=set(scheduler_output.preempted_req_ids or ()),
            hints=self._hints,
            scheduled_tokens=int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0),
            confirmed=self._confirmed,
            voided=self._voided,
        )
        self._loads, self._hints = [], []
        self._confirmed, self._voided = set(), set()
        self._pending = set()
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            # Every block id again (also a request resumed after preemption,
            # which vLLM may send as new): each is looked at again.
            state.block_ids = [list(ids) for ids in new.block_ids]
            state.recorded = 0
            self._plan_stores(meta, state, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(ids) for ids in new_ids] if new_ids else []
                state.recorded = 0
            elif new_ids:
                for ids, more in zip(state.block_ids, new_ids):
                    ids.extend(more)
            computed = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._plan_stores(meta, state, computed)
        if self._engine is not None and self._engine.dropped:
            if self._keep_dropped:
                meta.dropped = _chains(self._engine.dropped)
            self._lookups.engine_dropped(self._engine.dropped)
            self._engine.dropped = []
        return meta

    def _plan_stores(self, meta: KvtierMetadata, state: _Request, computed_tokens: int) -> None:
        """Stores the blocks that are full once this step has run: a
        full-attention group's all, a sliding-window group's only those in
        the window before the step's last full block (what a hit that ends
        there loads; the workers end those stores before the next step, as
        vLLM frees such blocks once the window moves on)."""
        request = state.request
        if not state.block_ids:
            return
        blocks = min(computed_tokens // self._block_tokens, len(request.block_hashes), *map(len, state.block_ids))
        publishable = getattr(request, "num_publishable_block_hashes", None)
        if publishable is not None:
            blocks = min(blocks, publishable)
        if self._engine is not None:
            held = [kvtier.engine_hash_bytes(h) for h in request.block_hashes[state.recorded : blocks]]
            before = kvtier.engine_hash_bytes(request.block_hashes[state.recorded - 1]) if state.recorded > 0 else None
            for group, ids in enumerate(state.block_ids):
                self._engine.seen(group, ids, state.recorded, held, before)
            state.recorded = max(state.recorded, blocks)
        if blocks <= state.stored:
            return
        hashes = [kvtier.engine_hash_bytes(h) for h in request.block_hashes[state.stored : blocks]]
        for group, (window, ids) in enumerate(zip(self._windows, state.block_ids)):
            start = state.stored if window is None else max(state.stored, blocks - window)
            wanted = [i for i in range(start, blocks) if ids[i] != _NULL_BLOCK]
            if wanted:
                meta.stores.append(
                    TransferSpec(
                        request.request_id,
                        [hashes[i - state.stored] for i in wanted],
                        [ids[i] for i in wanted],
                        state.hint,
                        group,
                    )
                )
        state.stored = blocks
        state.has_stores = True

    def step_reported(self, report: Any) -> None:
        """The workers' report of a step (StepReport, aggregated over the
        ranks), or None: its timing, and with several ranks whose loads
        were whole on all of them, or short on one."""
        if isinstance(report, StepReport):
            if report.tokens > 0:
                self._prefill.observe(report)
            self._voided |= report.loads_short
            self._confirmed |= report.loads_whole - report.loads_short
            self._words[0] += len(report.loads_whole - report.loads_short)
            self._words[1] += len(report.loads_short)

    def loads_failed(self, req_ids: set[str]) -> None:
        """Requests whose loads fell short (vLLM recomputes them whole):
        no more hits for them, and their blocks are stored again."""
        for req_id in req_ids:
            self._failed_loads.add(req_id)
            self._hits.pop(req_id, None)
            if (state := self._requests.get(req_id)) is not None:
                state.stored = 0

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._failed_loads.discard(req_id)
        self._lookups.forget(req_id)
        self._local_tokens.pop(req_id, None)
        self._hits.pop(req_id, None)
        state = self._requests.pop(req_id, None)
        if state is not None and state.hint is not None and state.stored > 0:
            hashes = [kvtier.engine_hash_bytes(h) for h in request.block_hashes[: state.stored]]
            self._hints.extend(TransferSpec(req_id, hashes, [], state.hint, group) for group in range(len(self._windows)))
        # Blocks sent to be stored stay held until the workers report the
        # request in finished_sending.
        return (state is not None and state.has_stores), None

    def close(self) -> None:
        self._lookups.close()
        if any(self._words):
            logger.info(
                "kvtier: the ranks' loads of %d requests were whole on every rank, of %d short on one "
                "(their stores of those steps landed, or were cancelled)", *self._words)
