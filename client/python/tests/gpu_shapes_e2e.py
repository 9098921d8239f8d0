"""The model shapes beyond K and V per layer, end to end through CUDA IPC
(tools/gpu-check.sh runs it): MLA's latent cache, and the KV cache groups of
vLLM's hybrid manager (two groups of layers over the same tensors, each with
block ids of its own, as a model of sliding-window and full-attention
layers has them).

One process fills the tensors from a seed and stores blocks of each shape
through a kvtierd on the cuda backend; a second registers fresh zeroed
tensors the same way, loads the blocks into other block ids, and compares
every byte with the first process's. Exit status 0 when every byte matches.

Usage: python3 gpu_shapes_e2e.py KVTIERD_PATH [--host]
  --host: the same on CPU tensors and the daemon's host backend (a dry run
  on a machine without a GPU: test_gpu_shapes.py runs it in CI).
"""

from __future__ import annotations

import sys

from gpu_e2e import run_with_daemon

BLOCK_TOKENS, NUM_BLOCKS, STORED, SEED = 16, 256, 16, 4321
MLA_LAYERS, LATENT = 2, 576  # DeepSeek-V2/V3: kv_lora_rank 512 + qk_rope_head_dim 64
SLOTS, HEADS, HEAD_DIM = 2, 4, 64  # each tensor slot holds one layer of each hybrid group
ELEMENT = 2  # bf16
# Where each shape's blocks are stored from and loaded into.
MLA_FROM, MLA_TO = 0, 100
GROUP_FROM, GROUP_TO = [0, STORED], [150, 200]  # group 0 and group 1, in the same tensors


def allocations(device: str, fill: bool):  # type: ignore[no-untyped-def]
    """MLA: one allocation, each layer a [blocks, block_tokens, 576] view
    (vLLM's MLA cache). Hybrid: one allocation of SLOTS tensors [blocks, K/V,
    block_tokens, heads, head_dim], slot i holding layer i of both groups."""
    import torch

    mla = torch.zeros((MLA_LAYERS, NUM_BLOCKS, BLOCK_TOKENS, LATENT), dtype=torch.bfloat16, device=device)
    hybrid = torch.zeros((SLOTS, NUM_BLOCKS, 2, BLOCK_TOKENS, HEADS, HEAD_DIM), dtype=torch.bfloat16, device=device)
    if fill:
        generator = torch.Generator(device=device).manual_seed(SEED)
        for t in (mla, hybrid):
            t.copy_(torch.randn(t.shape, generator=generator, device=device).to(torch.bfloat16))
    if device == "cuda":
        torch.cuda.synchronize()
    return mla, hybrid


def layouts_and_placements():  # type: ignore[no-untyped-def]
    import kvtier

    mla_layout = kvtier.Layout("kvtier/shapes-e2e-mla", MLA_LAYERS, 1, LATENT, "bf16", BLOCK_TOKENS, kv_kind="latent")
    block = BLOCK_TOKENS * LATENT * ELEMENT
    mla_placements = [
        kvtier.Placement(0, layer * NUM_BLOCKS * block, block, LATENT * ELEMENT, LATENT * ELEMENT) for layer in range(MLA_LAYERS)
    ]
    half = BLOCK_TOKENS * HEADS * HEAD_DIM * ELEMENT  # K (or V) of one block
    slot = NUM_BLOCKS * 2 * half
    group_layouts = [kvtier.Layout(f"kvtier/shapes-e2e|kv-group={g}/2", SLOTS, HEADS, HEAD_DIM, "bf16", BLOCK_TOKENS) for g in range(2)]
    group_placements = [
        kvtier.Placement(0, i * slot + part * half, 2 * half, HEADS * HEAD_DIM * ELEMENT, HEAD_DIM * ELEMENT)
        for i in range(SLOTS)
        for part in (0, 1)
    ]
    return mla_layout, mla_placements, group_layouts, group_placements


def engine(mode: str, device: str, socket: str) -> int:
    import torch

    import kvtier

    client = kvtier.Client.connect(socket, name=f"shapes-e2e-{mode}")
    mla, hybrid = allocations(device, fill=mode == "store")
    mla_layout, mla_placements, group_layouts, group_placements = layouts_and_placements()

    def register(layout, tensor, placements, same_as=None):  # type: ignore[no-untyped-def]
        region = [(tensor.data_ptr(), tensor.numel() * ELEMENT)]
        if device == "cuda":
            return client.register_cuda_memory(layout, NUM_BLOCKS, region, placements)
        return client.register_host_memory(layout, NUM_BLOCKS, region, placements, same_memory_as=same_as)

    mla_cache = register(mla_layout, mla, mla_placements)
    groups = [register(group_layouts[0], hybrid, group_placements)]
    groups.append(register(group_layouts[1], hybrid, group_placements, groups[0]))
    tokens = list(range(5000, 5000 + STORED * BLOCK_TOKENS))
    jobs = [(mla_cache, MLA_FROM, MLA_TO)] + [(groups[g], GROUP_FROM[g], GROUP_TO[g]) for g in range(2)]
    if mode == "store":
        for cache, first, _ in jobs:
            result = client.store(cache, client.compute_keys(cache, tokens), list(range(first, first + STORED)))
            if result.blocks + result.already != STORED:
                print(f"store: {result.blocks} of {STORED} blocks stored into {cache.layout.model_id}")
                return 1
        print(f"store: {STORED} blocks of MLA and of each hybrid group stored")
        return 0
    for cache, _, to in jobs:
        result = client.load(cache, client.compute_keys(cache, tokens), list(range(to, to + STORED)))
        if result.blocks != STORED:
            print(f"load: {result.blocks} of {STORED} blocks loaded into {cache.layout.model_id}")
            return 1
    if device == "cuda":
        torch.cuda.synchronize()
    want_mla, want_hybrid = allocations(device, fill=True)
    bad = []
    if not torch.equal(mla[:, MLA_TO : MLA_TO + STORED], want_mla[:, MLA_FROM : MLA_FROM + STORED]):
        bad.append("MLA")
    for g in range(2):
        got = hybrid[:, GROUP_TO[g] : GROUP_TO[g] + STORED]
        if not torch.equal(got, want_hybrid[:, GROUP_FROM[g] : GROUP_FROM[g] + STORED]):
            bad.append(f"hybrid group {g}")
    untouched = torch.ones(NUM_BLOCKS, dtype=torch.bool)
    for to in [MLA_TO, *GROUP_TO]:
        untouched[to : to + STORED] = False
    if hybrid[:, untouched.to(device)].any() or mla[:, untouched.to(device)].any():
        bad.append("blocks outside the loads' targets written")
    print(f"load: MLA and both hybrid groups loaded; {'differ: ' + ', '.join(bad) if bad else 'every byte matches'}")
    return 1 if bad else 0


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] in ("store", "load"):
        return engine(sys.argv[1], sys.argv[2], sys.argv[3])
    if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and sys.argv[2] != "--host"):
        print(__doc__)
        return 2
    backend, device = ("host", "cpu") if len(sys.argv) == 3 else ("cuda", "cuda")
    rc = run_with_daemon(sys.argv[1], __file__, [["store", device], ["load", device]], backend)
    print("shapes e2e: " + (f"PASS (MLA and hybrid groups on the {backend} backend, stored by one process, loaded by another, byte-exact)"
                            if rc == 0 else "FAIL"))
    return rc


if __name__ == "__main__":
    sys.exit(main())
