"""A small seeded Llama (Hugging Face transformers) whose KV cache goes
through kvtier: what test_model_e2e.py, bench/ttft.py and gpu_model_e2e.py
share.

The model is built from a config with weights drawn from a seeded generator,
so two processes that build the same ``TinyLlama`` hold the same weights and
nothing is downloaded. The engine's KV memory (``EngineKv``) is paged: one
torch tensor per layer, blocks of ``block_tokens`` tokens, each block's K and
V in transformers' own order (heads, then tokens, then head_dim); explicit
``kvtier.Placement``s, taken from the tensors' strides, tell kvtierd where
each row is (common/kv_cache_layout.h). A prompt's KV moves between those
blocks and transformers' ``DynamicCache`` by one copy each way.

The model and the engine's KV memory are on the CPU unless a ``device`` is
given (``TinyLlama.build``, ``EngineKv``): on "cuda" the KV tensors are
registered through CUDA IPC, and kvtierd copies on its own CUDA stream, so
``EngineKv`` waits for this process's writes to its tensors (``put``,
``zero``) before returning: a store or load issued next cannot race them.

Every call that talks to kvtierd blocks (the GIL is released while it
waits). Thread-compatible: one engine (model, client, EngineKv) per thread.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import time
from typing import Sequence

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvtier

# kvtier's dtype names (kvtier.Layout) by the torch dtypes the model runs in.
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Most keys one lookup, load or store carries: kvtierd's default
# limits.max_keys_per_request (4096 blocks: 64k tokens of 16-token blocks).
MAX_KEYS_PER_REQUEST = 4096


@dataclasses.dataclass(frozen=True)
class TinyLlama:
    """A Llama-architecture model small enough for a CPU; weights from ``seed``.

    The weights are drawn in fp32 and then rounded to ``dtype``, so the bf16
    model is the fp32 one rounded, and the two can be compared.
    """

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 512
    dtype: str = "fp32"  # "fp32" or "bf16" (kvtier.Layout's names)
    seed: int = 0
    max_positions: int = 4096
    attn_implementation: str = "sdpa"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def model_id(self) -> str:
        # Names the kvtier namespace: another shape or seed is another model.
        # (The dtype is part of the layout already.)
        return (
            f"kvtier-tests/tiny-llama-h{self.hidden_size}-l{self.num_layers}-a{self.num_heads}"
            f"-kv{self.num_kv_heads}-i{self.intermediate_size}-v{self.vocab_size}-s{self.seed}"
        )

    def config(self) -> LlamaConfig:
        config = LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_positions,
            attn_implementation=self.attn_implementation,
        )
        return config

    def build(self, device: str | torch.device = "cpu") -> LlamaForCausalLM:
        """The model in eval mode, in ``dtype``, on ``device``. Same spec, same
        weights, whatever the device: they are drawn on the CPU, then moved."""
        torch.manual_seed(self.seed)
        model = LlamaForCausalLM(self.config()).eval()
        return model.to(self.torch_dtype).to(device)

    def layout(self, block_tokens: int = 16) -> kvtier.Layout:
        return kvtier.Layout(
            self.model_id,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            block_tokens=block_tokens,
        )


# The KV of some tokens, per layer: (K, V), each [1, kv_heads, tokens, head_dim].
LayerKv = tuple[torch.Tensor, torch.Tensor]


def new_cache(config: LlamaConfig) -> DynamicCache:
    """An empty DynamicCache for the model (transformers before 4.56 took no config)."""
    try:
        return DynamicCache(config=config)
    except TypeError:
        return DynamicCache()


def kv_of(cache: DynamicCache, num_tokens: int) -> list[LayerKv]:
    """The first num_tokens tokens of a DynamicCache's K and V, per layer (views)."""
    if not hasattr(cache, "layers"):  # transformers before 4.56: key_cache and value_cache lists
        return [(k[:, :, :num_tokens], v[:, :, :num_tokens]) for k, v in zip(cache.key_cache, cache.value_cache)]
    return [(layer.keys[:, :, :num_tokens], layer.values[:, :, :num_tokens]) for layer in cache.layers]


def cache_from(kv: Sequence[LayerKv], config: LlamaConfig) -> DynamicCache:
    """A DynamicCache holding copies of kv (the first update concatenates);
    empty when kv holds no token."""
    cache = new_cache(config)
    if not kv or kv[0][0].shape[2] == 0:
        return cache
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache


def own_pages(shape: tuple[int, ...], dtype: torch.dtype, count: int) -> list[torch.Tensor]:
    """count zeroed CPU tensors of shape and dtype, back to back in whole pages
    that no other allocation uses.

    kvtierd adopts the pages of a registered CPU cache (register_tensors), and
    refuses a page that a live cache holds already: two EngineKv in one
    process whose tensors malloc put side by side on the heap would share one.
    """
    page = mmap.PAGESIZE
    each = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    pages = (each * count + page - 1) // page
    buffer = torch.zeros((pages + 1) * page, dtype=torch.uint8)
    start = -buffer.data_ptr() % page
    return [buffer[start + i * each : start + (i + 1) * each].view(dtype).view(shape) for i in range(count)]


class EngineKv:
    """The engine's KV memory, paged, registered with kvtierd in place.

    One tensor per layer, ``[2, capacity_blocks, kv_heads, block_tokens,
    head_dim]``: K then V, each block holding its tokens as transformers does
    (heads outside, tokens inside: vLLM's HND). kvtierd wants each block's
    bytes apart from the others' (a block outside its heads and tokens), so
    a sequence's KV is gathered into a DynamicCache (``kv``) rather than
    viewed in place. Keep the object while the client uses the cache (the
    daemon copies into and out of the tensors).

    On ``device`` "cuda" (or "cuda:N") the tensors are GPU memory, which
    ``register_tensors`` sends through CUDA IPC (``cache.kind`` "cuda").
    """

    def __init__(
        self,
        client: kvtier.Client,
        layout: kvtier.Layout,
        capacity_blocks: int,
        device: str | torch.device = "cpu",
        codec: str = "none",
    ) -> None:
        self.layout = layout
        self.capacity_blocks = capacity_blocks
        self.device = torch.device(device)
        dtype = TORCH_DTYPES[layout.dtype]
        shape = (2, capacity_blocks, layout.num_kv_heads, layout.block_tokens, layout.head_dim)
        if self.device.type == "cpu":
            self.tensors = own_pages(shape, dtype, layout.num_layers)
        else:
            self.tensors = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layout.num_layers)]
        self.sync()  # the zeros are written before the daemon maps the memory
        self.cache = client.register_tensors(layout, capacity_blocks, self.tensors, self.placements(), codec=codec)

    def placements(self) -> list[kvtier.Placement]:
        """Where row (token t, head h) of engine block b is, per (layer, K/V)
        piece, from the tensors' strides (the same as kvtier's "vllm_hnd")."""
        e = self.tensors[0].element_size()
        _, block, head, token, _ = (s * e for s in self.tensors[0].stride())
        out = []
        for layer in range(self.layout.num_layers):
            for k_or_v in (0, 1):
                out.append(
                    kvtier.Placement(
                        region=layer,
                        offset_bytes=k_or_v * self.capacity_blocks * block,
                        block_stride_bytes=block,
                        token_stride_bytes=token,
                        head_stride_bytes=head,
                    )
                )
        return out

    def put(self, kv: Sequence[LayerKv]) -> None:
        """Copies per-layer K and V (batch 1, a whole number of blocks long)
        into engine blocks 0, 1, ..."""
        bt = self.layout.block_tokens
        for tensor, (k, v) in zip(self.tensors, kv):
            n = k.shape[2] // bt
            for part, t in enumerate((k, v)):
                # [heads, n * bt, head_dim] -> [n, heads, bt, head_dim]
                tensor[part, :n].copy_(t[0].unflatten(1, (n, bt)).transpose(0, 1))
        self.sync()

    def kv(self, num_blocks: int) -> list[LayerKv]:
        """Engine blocks 0 .. num_blocks - 1 gathered into per-layer (K, V),
        each [1, kv_heads, num_blocks * block_tokens, head_dim]."""
        return [self.layer_kv(layer, num_blocks) for layer in range(self.layout.num_layers)]

    def layer_kv(self, layer: int, num_blocks: int) -> LayerKv:
        """One layer's (K, V) of engine blocks 0 .. num_blocks - 1, as ``kv``'s."""
        tensor = self.tensors[layer]
        k, v = (tensor[part, :num_blocks].transpose(0, 1).flatten(1, 2).unsqueeze(0) for part in (0, 1))
        return k, v

    def zero(self) -> None:
        for t in self.tensors:
            t.zero_()
        self.sync()

    def sync(self) -> None:
        """Waits until this process's GPU work on the tensors is done (kvtierd
        reads and writes them on its own stream, ordered by nothing else).
        Nothing to wait for on the CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@torch.no_grad()
def forward(model: LlamaForCausalLM, tokens: Sequence[int], cache: DynamicCache) -> torch.Tensor:
    """Runs tokens after what cache holds (updating it); returns the last position's logits [vocab]
    (on the model's device)."""
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=model.device)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


@torch.no_grad()
def decode(
    model: LlamaForCausalLM,
    cache: DynamicCache,
    logits: torch.Tensor,
    steps: int,
    forced: Sequence[int] | None = None,
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding from a prefilled cache and its last logits.

    Returns (tokens, logits): steps tokens and steps + 1 logits (the given
    ones first). With ``forced``, those tokens are fed instead of the argmax
    (teacher forcing), so two models' logits are compared at the same inputs.
    """
    tokens: list[int] = []
    all_logits = [logits]
    for i in range(steps):
        token = int(forced[i]) if forced is not None else int(torch.argmax(all_logits[-1]))
        tokens.append(token)
        all_logits.append(forward(model, [token], cache))
    return tokens, all_logits


@dataclasses.dataclass
class Prefill:
    """A prompt prefilled with its prefix from kvtier."""

    logits: torch.Tensor  # the last prompt position's, [vocab]
    cache: DynamicCache  # the whole prompt's KV
    hits: int  # leading blocks the lookup found
    tiers: list[str]  # the tier of each hit, as the lookup said
    loaded_blocks: int  # blocks the load copied in (the hits unless one left meanwhile)
    # Where the time went, in seconds: keys, lookup and load ("kvtier"), the
    # gather of the loaded blocks into the DynamicCache ("gather"), the rest of
    # the prompt's forward pass ("compute").
    seconds: dict[str, float]


def store_prefix(
    client: kvtier.Client, engine: EngineKv, kv: Sequence[LayerKv], tokens: Sequence[int]
) -> list[bytes]:
    """Stores the full blocks of tokens, whose KV is kv (at least that long).

    Copies kv into engine blocks 0 .. n - 1 and stores them; returns their
    keys. Raises kvtier.Error (e.g. ResourceExhaustedError when the tiers
    are full).
    """
    keys = client.compute_keys(engine.cache, list(tokens))
    n = len(keys) * engine.layout.block_tokens
    engine.put([(k[:, :, :n], v[:, :, :n]) for k, v in kv])
    for i in range(0, len(keys), MAX_KEYS_PER_REQUEST):
        batch = keys[i : i + MAX_KEYS_PER_REQUEST]
        client.store(engine.cache, batch, list(range(i, i + len(batch))), parent=keys[i - 1] if i else None)
    return keys


def prefill_with_kvtier(
    client: kvtier.Client,
    engine: EngineKv,
    model: LlamaForCausalLM,
    prompt: Sequence[int],
    by_layer: bool = False,
    stream_waits: bool = True,
) -> Prefill:
    """Prefills prompt as an engine with kvtier does: keys, lookup, load of
    the cached leading blocks into engine blocks 0 .. hits - 1, then the rest
    of the prompt on top of them.

    Whole (by_layer False): the load ends, then the forward pass starts. By
    layer: the load is started by layer and the forward pass at once; each
    decoder layer first waits until the load has that layer in place in
    every block, so layer i's compute runs while later layers are still
    being copied. On cuda, with stream_waits, the wait is the model's
    stream's, on the GPU (``Op.stream_wait_layers``: no host thread waits,
    the pass is queued whole at once); otherwise, or where the GPU cannot,
    this thread waits (``Op.wait_layers``; seconds["stream_waits"] says
    which). Where a by-layer load ends short (a block evicted since the
    lookup), the pass read blocks that are not there: it is thrown away and
    the prompt is prefilled again on what did arrive ("redone" in seconds).

    At least the last token is computed (its logits are needed), so a fully
    cached prompt loads one block less. Blocks the engine cannot hold are not
    looked up. Raises kvtier.Error from the daemon (UnavailableError: a
    miss for an engine; here the caller decides).
    """
    start = time.perf_counter()
    bt = engine.layout.block_tokens
    usable = min((len(prompt) - 1) // bt, engine.capacity_blocks)
    keys = client.compute_keys(engine.cache, list(prompt[: usable * bt]))
    hits, tiers = 0, []
    while hits < len(keys):  # a lookup says how many leading keys are cached
        hit = client.lookup(engine.cache, keys[hits : hits + MAX_KEYS_PER_REQUEST])
        hits, tiers = hits + hit.hits, tiers + list(hit.tiers)
        if hit.hits < MAX_KEYS_PER_REQUEST:
            break
    engine.sync()  # nothing of this process's still reads or writes the blocks the daemon writes
    if by_layer and hits:
        return _prefill_by_layer(client, engine, model, prompt, keys[:hits], tiers, start, stream_waits)
    loaded = 0
    while loaded < hits:
        n = min(hits - loaded, MAX_KEYS_PER_REQUEST)
        done = client.load(engine.cache, keys[loaded : loaded + n], list(range(loaded, loaded + n))).blocks
        loaded += done
        if done < n:  # evicted since the lookup
            break
    loaded_at = time.perf_counter()
    cache = cache_from(engine.kv(loaded), model.config)
    gathered_at = time.perf_counter()
    logits = forward(model, prompt[loaded * bt :], cache)
    seconds = {
        "kvtier": loaded_at - start,
        "gather": gathered_at - loaded_at,
        "compute": time.perf_counter() - gathered_at,
    }
    return Prefill(logits, cache, hits, tiers, loaded, seconds)


def _prefill_by_layer(
    client: kvtier.Client,
    engine: EngineKv,
    model: LlamaForCausalLM,
    prompt: Sequence[int],
    keys: Sequence[bytes],
    tiers: list[str],
    start: float,
    stream_waits: bool = True,
) -> Prefill:
    """prefill_with_kvtier's by-layer path, for the hits' keys."""
    bt = engine.layout.block_tokens
    hits = len(keys)
    ops = [
        client.load_async(engine.cache, keys[i : i + MAX_KEYS_PER_REQUEST], list(range(i, min(i + MAX_KEYS_PER_REQUEST, hits))), by_layer=True)
        for i in range(0, hits, MAX_KEYS_PER_REQUEST)
    ]
    started_at = time.perf_counter()
    # The prefix's room in the DynamicCache, filled layer by layer: the
    # model reads the cache's length before its first layer runs.
    dtype, device = TORCH_DTYPES[engine.layout.dtype], model.device
    shape = (1, engine.layout.num_kv_heads, hits * bt, engine.layout.head_dim)
    cache = cache_from([(torch.empty(shape, dtype=dtype, device=device),) * 2] * engine.layout.num_layers, model.config)
    room = kv_of(cache, hits * bt)
    waited, complete = 0.0, True
    on_gpu = stream_waits and device.type == "cuda"

    def fill(layer: int):
        def hook(module: torch.nn.Module, args: object) -> None:
            nonlocal waited, complete, on_gpu
            t = time.perf_counter()
            if on_gpu:
                stream = torch.cuda.current_stream(device).cuda_stream
                try:
                    for op in ops:  # the copy below, and the layer, wait on the GPU
                        op.stream_wait_layers(layer + 1, stream)
                except kvtier.UnavailableError:
                    on_gpu = False  # no 64-bit stream waits on this GPU: wait here
            if not on_gpu:
                # False: the op is over without this layer (a block short);
                # the pass is redone below.
                complete = all([op.wait_layers(layer + 1) for op in ops]) and complete
            waited += time.perf_counter() - t
            for dst, src in zip(room[layer], engine.layer_kv(layer, hits)):
                dst.copy_(src)

        return hook

    hooks = [block.register_forward_pre_hook(fill(i)) for i, block in enumerate(model.model.layers)]
    try:
        logits = forward(model, prompt[hits * bt :], cache)
    finally:
        for h in hooks:
            h.remove()
    loaded = 0
    for i, op in enumerate(ops):  # the leading blocks that arrived
        got = op.wait().blocks
        if loaded == i * MAX_KEYS_PER_REQUEST:
            loaded += got
    computed_at = time.perf_counter()
    seconds = {
        "kvtier": started_at - start,
        "gather": 0.0,
        "compute": computed_at - started_at,
        "waited": waited,
        "stream_waits": float(on_gpu),
    }
    if complete and loaded == hits:
        return Prefill(logits, cache, hits, tiers, loaded, seconds)
    cache = cache_from(engine.kv(loaded), model.config)
    logits = forward(model, prompt[loaded * bt :], cache)
    seconds["redone"] = time.perf_counter() - computed_at
    return Prefill(logits, cache, hits, tiers, loaded, seconds)
