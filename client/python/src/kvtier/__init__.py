"""kvtier: the Python client of kvtierd, the tiered KV-cache offload daemon.

An engine connects to its node's kvtierd, registers its KV cache once,
computes chain keys for its prompts, asks how much of a prompt is cached, and
has the daemon copy blocks into (load) and out of (store) its own pages::

    import kvtier
    client = kvtier.Client.connect("/run/kvtier/kvtierd.sock")
    layout = kvtier.Layout("my/model", num_layers=32, num_kv_heads=8, head_dim=128,
                           dtype="bf16", block_tokens=16)
    cache = client.register_tensors(layout, num_blocks, per_layer_tensors, "vllm_nhd")
    keys = client.compute_keys(cache, prompt_token_ids)
    hit = client.lookup(cache, keys)                 # pins nothing
    client.load(cache, keys[:hit.hits], block_ids)   # copies into the engine's pages
    op = client.store_async(cache, new_keys, new_block_ids); op.wait()

Errors are ``kvtier.Error`` subclasses, one per status code.
``UnavailableError`` (the daemon is down or restarting) is a miss: the engine
goes on without the cache and the client reconnects by itself.

Every call that waits on the daemon releases the GIL.
"""

from __future__ import annotations

import hashlib
import string
from typing import Any, Sequence

from ._errors import (
    AbortedError,
    AlreadyExistsError,
    CancelledError,
    CorruptionError,
    DeadlineExceededError,
    Error,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    IoError,
    NotFoundError,
    OutOfRangeError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
)
from ._kvtier import __version__  # CMake's project(VERSION): one string for the wheel, kvtierd and libkvtier
from ._kvtier import (
    Client,
    CpuKvCache,
    KvCache,
    Layout,
    LookupResult,
    Op,
    OpResult,
    Placement,
    default_socket,
    default_socket_candidates,
    placements,
)

__all__ = [
    "__version__",
    "AbortedError",
    "AlreadyExistsError",
    "CancelledError",
    "Client",
    "CorruptionError",
    "CpuKvCache",
    "DeadlineExceededError",
    "Error",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "IoError",
    "KvCache",
    "Layout",
    "LookupResult",
    "NotFoundError",
    "Op",
    "OpResult",
    "OutOfRangeError",
    "PermissionDeniedError",
    "Placement",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "default_socket",
    "default_socket_candidates",
    "engine_hash_bytes",
    "placements",
]

# The dtype names of kvtier.Layout, by the torch and NumPy dtype names that
# hold them. Raw bytes (uint8) fit any layout.
_TORCH_DTYPES = {
    "float16": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
}
_NUMPY_DTYPES = {"float16": "fp16", "float32": "fp32"}
_HEX_DIGITS = frozenset(string.hexdigits)


def engine_hash_bytes(block_hash: bytes | int | str) -> bytes:
    """An engine's block hash as the 16 or 32 bytes ``Client.key_from_engine_hash`` takes.

    - bytes of 16 or 32 (vLLM's sha256 and sha256_cbor hashes) as they are;
    - an int (older vLLM releases): its low 128 bits, little-endian;
    - a str of 32 or 64 hex digits (SGLang's page hashes): those bytes;
    - anything else of those types: its SHA-256 (32 bytes; str as UTF-8).
    """
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        raw = bytes(block_hash)
        return raw if len(raw) in (16, 32) else hashlib.sha256(raw).digest()
    if isinstance(block_hash, int) and not isinstance(block_hash, bool):
        return (block_hash & ((1 << 128) - 1)).to_bytes(16, "little")
    if isinstance(block_hash, str):
        if len(block_hash) in (32, 64) and _HEX_DIGITS.issuperset(block_hash):
            return bytes.fromhex(block_hash)
        return hashlib.sha256(block_hash.encode("utf-8")).digest()
    raise TypeError(f"a block hash is bytes, an int or a str, not {type(block_hash).__name__}")


def _region_of(tensor: Any, layout: Layout, index: int) -> tuple[str, int, int]:
    """(device kind, pointer, bytes) of one engine tensor or array, checked."""
    module = type(tensor).__module__
    if module.startswith("torch"):
        if not tensor.is_contiguous():
            raise InvalidArgumentError(f"tensors[{index}] is not contiguous")
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype != "uint8" and _TORCH_DTYPES.get(dtype) != layout.dtype:
            raise InvalidArgumentError(
                f"tensors[{index}] holds {dtype}; the layout is {layout.dtype} (or pass uint8 bytes)"
            )
        kind = tensor.device.type
        if kind not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"tensors[{index}] is on {kind}; kvtier takes cpu and cuda tensors")
        return kind, int(tensor.data_ptr()), int(tensor.numel() * tensor.element_size())
    if module == "numpy":
        if not tensor.flags["C_CONTIGUOUS"]:
            raise InvalidArgumentError(f"tensors[{index}] is not C-contiguous")
        if not tensor.flags["WRITEABLE"]:
            raise InvalidArgumentError(f"tensors[{index}] is read-only; loads write into it")
        dtype = str(tensor.dtype)
        if dtype != "uint8" and _NUMPY_DTYPES.get(dtype) != layout.dtype:
            raise InvalidArgumentError(
                f"tensors[{index}] holds {dtype}; the layout is {layout.dtype} (or pass uint8 bytes)"
            )
        return "cpu", int(tensor.ctypes.data), int(tensor.nbytes)
    raise TypeError(f"tensors[{index}]: a torch tensor or a NumPy array is needed, not {type(tensor).__name__}")


def _is_pinned(tensor: Any) -> bool:
    """Whether a torch tensor lives in page-locked memory (False for NumPy
    arrays, and where torch has no CUDA)."""
    is_pinned = getattr(tensor, "is_pinned", None)
    if is_pinned is None:
        return False
    try:
        return bool(is_pinned())
    except RuntimeError:  # no CUDA in this torch: nothing can be pinned
        return False


def _register_tensors(
    self: Client,
    layout: Layout,
    num_blocks: int,
    tensors: Sequence[Any],
    placements: str | Sequence[Placement],
    *,
    codec: str = "none",
    fp8_group: int = 0,
) -> KvCache:
    """Registers an engine's own KV tensors (torch or NumPy; one per region of
    ``placements``), all on the CPU or all on one GPU, without copying them.

    CPU memory is shared with the daemon in place (kvtier/host_memory.h): the
    tensors keep their addresses and bytes, and must not be in use while this
    runs, and a tensor can be registered once (its memory is shared memory
    afterwards: keep the KvCache). Pinned tensors are refused
    (InvalidArgumentError): a pin stays on the pages the memory had, and
    pinning that torch cannot see (io_uring fixed buffers, RDMA) must not
    cover them either. Each tensor must be contiguous and of the
    layout's dtype (or uint8); tensors may be views of one storage, or share
    pages. CUDA tensors go through CUDA IPC (``UnimplementedError`` without
    CUDA). ``codec``: how the daemon stores the blocks on disk, ``"none"``,
    ``"lossless"`` (bit-exact) or ``"fp8"`` (LOSSY; docs/compression.md).
    """
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence):
        raise TypeError("tensors: a list of torch tensors or NumPy arrays is needed")
    if len(tensors) == 0:
        raise InvalidArgumentError("tensors: at least one is needed")
    regions = [_region_of(t, layout, i) for i, t in enumerate(tensors)]
    kinds = {kind for kind, _, _ in regions}
    if len(kinds) > 1:
        raise InvalidArgumentError("tensors: all on the CPU or all on one GPU, not a mix")
    pairs = [(ptr, size) for _, ptr, size in regions]
    if kinds != {"cuda"}:
        # Pinned memory (pin_memory, cudaHostRegister) keeps its pin on the
        # pages it had: once they moved into shared memory, the GPU's copies
        # would go to pages neither the engine nor the daemon reads.
        pinned = [i for i, t in enumerate(tensors) if _is_pinned(t)]
        if pinned:
            raise InvalidArgumentError(
                f"tensors{pinned}: pinned memory cannot be shared in place (its pin stays on the old pages); "
                "allocate the KV cache unpinned, or copy through Client.register_cpu_cache"
            )
    if kinds == {"cuda"}:
        devices = {t.device.index for t in tensors}
        if len(devices) > 1:
            raise InvalidArgumentError(f"tensors: all on one GPU, not on {sorted(devices)}")
        return self.register_cuda_memory(layout, num_blocks, pairs, placements, codec=codec, fp8_group=fp8_group)
    return self.register_host_memory(layout, num_blocks, pairs, placements, codec=codec, fp8_group=fp8_group)


def _enter(self: Client) -> Client:
    return self


def _exit(self: Client, *exc: object) -> None:
    self.close()


Client.register_tensors = _register_tensors  # type: ignore[attr-defined]
Client.__enter__ = _enter  # type: ignore[attr-defined]
Client.__exit__ = _exit  # type: ignore[attr-defined]
