"""How much of serve.py's prompts vLLM's own cache and kvtier's host tier
can serve together, simulated block by block: no engine, no daemon, no
timing, only which blocks each cache holds when a request asks.

vLLM's cache is its block pool with prefix caching (blocks held by running
requests; a free queue evicted from its head; a request's blocks freed last
block first). A step schedules its requests one after the other: each one's
own hit, then kvtier's answer, then its blocks, whose allocation may evict
what the next request of the step wanted. kvtier's host tier keeps blocks
vLLM holds in a low queue that goes first (exclusive caching), the rest LRU.
The workload is serve.py's default: 16 chats over 4 shared 1k-token system
prompts, 3 turns of 96 tokens (16 generated), 2 requests a step, blocks of
32 tokens (512 KiB of the benchmark's model).

    python3 client/python/bench/cache_sim.py [--turns 3] [--offload-blocks 96 163 192 288]

Prints the fraction of prompt tokens served from a cache (serve.py's
"prefill saved") per configuration and kvtier size in blocks (serve.py's
96 MiB is 192; kvtierd's host watermarks keep it between 85% and 92% full,
163 to 176):
  vllm-same-memory  vLLM alone, its cache larger by the offload's blocks;
  duplicates        kvtier fed by vLLM's stores, kept as any block;
  exclusive         the stores vLLM holds go first, and come back among the
                    rest once vLLM lets go of them (the connector's
                    exclusive_caching, shipped);
  keep-ideal        also a copy into kvtier of each block vLLM lets go of,
                    in time for the lookups of the step that evicted it, and
                    loads marked as held by vLLM: one LRU over both caches;
  keep              the same copies as vLLM's hooks allow them: taken
                    before the step's forward pass (handle_preemptions),
                    after that step's lookups were answered;
  keep-pending      as keep, with lookups also counting blocks let go of
                    earlier in the same step (their copies land before the
                    loads).
"""

from __future__ import annotations

import argparse
import dataclasses
import collections
import random

BLOCK = 32
MODES = ["vllm-same-memory", "duplicates", "exclusive", "keep-ideal", "keep", "keep-pending"]


def _tokens(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, 1000) for _ in range(n)]


class VllmCache:
    """vLLM's block pool with prefix caching; on_drop(hash) as a block id is
    given to other content."""

    def __init__(self, blocks: int) -> None:
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict((b, None) for b in range(blocks))
        self.hash_of: dict[int, int] = {}
        self.block_of: dict[int, int] = {}
        self.refs = [0] * blocks
        self.on_drop = lambda block_hash: None

    def hit(self, hashes: list[int], tokens: int) -> list[int]:
        out = []
        for h in hashes[: (tokens - 1) // BLOCK]:  # a token is always left to compute
            if h not in self.block_of:
                break
            out.append(self.block_of[h])
        for b in out:
            if self.refs[b] == 0:
                self.free.pop(b)
            self.refs[b] += 1
        return out

    def allocate(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            if b in self.hash_of:
                h = self.hash_of.pop(b)
                del self.block_of[h]
                self.on_drop(h)
            self.refs[b] = 1
            out.append(b)
        return out

    def cache(self, block: int, block_hash: int) -> None:
        if block_hash not in self.block_of:
            self.hash_of[block] = block_hash
            self.block_of[block_hash] = block

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free[b] = None


class KvtierCache:
    """kvtier's host tier under exclusive caching: `held` (the low queue)
    goes first, oldest first, then `lru`."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self.held: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.held or block_hash in self.lru

    def use(self, block_hash: int, engine_holds: bool = False) -> None:
        if block_hash in self:
            self.held.pop(block_hash, None)
            self.lru.pop(block_hash, None)
            (self.held if engine_holds else self.lru)[block_hash] = None

    def store(self, block_hash: int, engine_holds: bool) -> None:
        if block_hash in self:
            return
        (self.held if engine_holds else self.lru)[block_hash] = None
        while len(self.held) + len(self.lru) > self.blocks:
            (self.held if self.held else self.lru).popitem(last=False)

    def let_go(self, block_hash: int, copy: bool) -> None:
        """vLLM let go of it: back among the rest (Hint.engine_dropped), or
        copied in where absent."""
        if block_hash in self.held:
            self.held.pop(block_hash)
            self.lru[block_hash] = None
        elif copy and block_hash not in self:
            self.store(block_hash, engine_holds=False)


@dataclasses.dataclass
class Workload:
    """serve.py's workload arguments."""

    systems: int = 4
    system_tokens: int = 1024
    conversations: int = 16
    user_tokens: int = 96


def run(engine_blocks: int, offload_blocks: int, mode: str, turns: int, workload: Workload | None = None) -> float:
    w = workload or Workload()
    if mode == "vllm-same-memory":
        engine_blocks, offload_blocks = engine_blocks + offload_blocks, 0
    vllm = VllmCache(engine_blocks)
    kv = KvtierCache(offload_blocks)
    keep = mode.startswith("keep")
    step_drops: list[int] = []  # let go of this step, in order
    if mode == "keep-ideal":
        vllm.on_drop = lambda h: kv.let_go(h, copy=True)
    else:
        vllm.on_drop = step_drops.append
    systems = [_tokens(1000 + s, w.system_tokens) for s in range(w.systems)]
    chats = [list(systems[c % w.systems]) for c in range(w.conversations)]
    prompt_tokens = cached_tokens = 0
    for turn in range(turns):
        for c in range(w.conversations):
            chats[c] += _tokens(2000 + 100 * c + turn, w.user_tokens)
        for first in range(0, w.conversations, 2):
            pair = [c for c in (first, first + 1) if c < w.conversations]
            waiting = list(pair)
            while waiting:  # steps: a request vLLM has no room for waits for the next
                step = []  # (hashes, own hit, kvtier's answer, blocks) of each request
                while waiting:
                    prompt = chats[waiting[0]]
                    hashes = [hash(tuple(prompt[: (i + 1) * BLOCK])) for i in range(len(prompt) // BLOCK)]
                    own = [vllm.block_of[h] for h in hashes[: (len(prompt) - 1) // BLOCK] if h in vllm.block_of]
                    if step and -(-(len(prompt) + 16) // BLOCK) - len(own) > len(vllm.free):
                        break
                    waiting.pop(0)
                    local = vllm.hit(hashes, len(prompt))
                    pending = set(step_drops) if mode == "keep-pending" else set()
                    answer = 0
                    for h in hashes[len(local) : (len(prompt) - 1) // BLOCK] if offload_blocks else ():
                        if h not in kv and h not in pending:
                            break
                        kv.use(h)  # a lookup's hit is a use
                        answer += 1
                    blocks = local + vllm.allocate(-(-(len(prompt) + 16) // BLOCK) - len(local))
                    for i in range(len(local), len(hashes)):
                        vllm.cache(blocks[i], hashes[i])
                    step.append((hashes, len(local), answer, blocks))
                    prompt_tokens += len(prompt)
                for h in step_drops:  # the step's copies (handle_preemptions), or hints
                    kv.let_go(h, copy=keep)
                step_drops.clear()
                for hashes, local, answer, _ in step:
                    loaded = 0
                    for h in hashes[local : local + answer]:
                        if h not in kv:
                            break  # a load that falls short: vLLM computes the rest
                        kv.use(h, engine_holds=keep)
                        loaded += 1
                    for h in hashes[local + loaded :] if offload_blocks else ():
                        kv.store(h, engine_holds=mode != "duplicates")
                    cached_tokens += (local + loaded) * BLOCK
                for _, _, _, blocks in step:
                    vllm.release(blocks)
            for c in pair:
                chats[c] += _tokens(5000 + 100 * c + turn, 16)
    return cached_tokens / prompt_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-blocks", type=int, default=96, help="vLLM's own cache (serve.py's default)")
    parser.add_argument("--offload-blocks", type=int, nargs="+", default=[96, 163, 192, 288])
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--systems", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--user-tokens", type=int, default=96)
    args = parser.parse_args()
    workload = Workload(args.systems, args.system_tokens, args.conversations, args.user_tokens)
    print(f"{'offload blocks':>14} " + " ".join(f"{m:>16}" for m in MODES))
    for offload in args.offload_blocks:
        row = [run(args.engine_blocks, offload, mode, args.turns, workload) for mode in MODES]
        print(f"{offload:>14} " + " ".join(f"{r:>16.1%}" for r in row))


if __name__ == "__main__":
    main()
