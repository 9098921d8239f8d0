#!/usr/bin/env python3
"""Time to first token with a prompt's prefix loaded through kvtier, against
recomputing it.

A seeded Llama-architecture model (transformers, built from a config: nothing
is downloaded) runs on the CPU. For each prompt length, every repeat times,
one after another:

  recompute  the whole prompt's prefill, and the first token (argmax);
  host       keys, lookup and load of the cached prefix from kvtierd's host
             tier, its gather into transformers' DynamicCache, the prefill of
             the rest of the prompt, and the first token;
  disk       the same, with the prefix evicted from the host tier first, so
             that the load reads it from the disk tier (before the next
             repeat's host run, a prefetch brings it back to host).

The prefix is all of the prompt's full blocks but those of the last
--suffix-tokens tokens; the first recompute's KV is what gets stored. The
lookup's tiers are checked on every load (the table says if a load came from
elsewhere), and so are the loaded KV's bytes and the first token; the exit
status is 1 when a check failed.

The script starts its own kvtierd (from --kvtierd, $KVTIER_PROGRAMS_DIR,
build/release/bin or build/debug/bin) on a temporary socket, with a host tier
and a disk tier sized for the largest prompt, write-through (every block
stored is written to disk as well, so evicting the host copy leaves the disk
one) and no promotion of disk hits to host (so every disk repeat reads the
disk). The kvtier package must be importable (PYTHONPATH=build/debug/python).

  python client/python/bench/ttft.py                     # 2k..32k, 3 repeats
  python client/python/bench/ttft.py --quick             # a smoke run
  python client/python/bench/ttft.py --lengths 4k,8k --repeats 5 --dtype bf16
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE.parent / "tests"))  # llama_kv, shared with the tests

MiB = 1 << 20


def parse_length(text: str) -> int:
    text = text.strip().lower()
    scale = 1024 if text.endswith("k") else 1
    return int(text.removesuffix("k")) * scale


def arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument(
        "--kvtierd", help="the kvtierd to start (default: in $KVTIER_PROGRAMS_DIR, build/release/bin, build/debug/bin)"
    )
    p.add_argument("--lengths", default="2k,4k,8k,16k,32k", help="prompt lengths in tokens (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each path per length; medians (default %(default)s)")
    p.add_argument("--suffix-tokens", type=int, default=16, help="tokens after the cached prefix (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="a smoke run: --lengths 512,1k --repeats 1")
    g = p.add_argument_group("model (a seeded Llama)")
    g.add_argument("--hidden", type=int, default=256, help="hidden size (default %(default)s)")
    g.add_argument("--layers", type=int, default=4, help="(default %(default)s)")
    g.add_argument("--heads", type=int, default=4, help="attention heads (default %(default)s)")
    g.add_argument("--kv-heads", type=int, default=2, help="KV heads (default %(default)s)")
    g.add_argument("--intermediate", type=int, help="MLP size (default 4 * hidden)")
    g.add_argument("--vocab", type=int, default=32000, help="(default %(default)s)")
    g.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="(default %(default)s)")
    g.add_argument("--attn", default="sdpa", help="attn_implementation (default %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="weights and prompts (default %(default)s)")
    g.add_argument("--block-tokens", type=int, default=16, help="(default %(default)s)")
    g.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    d = p.add_argument_group("kvtierd")
    d.add_argument("--work-dir", help="socket, state and log (default: a temporary directory, removed)")
    d.add_argument("--disk-dir", help="the disk tier's directory (default: WORK_DIR/disk)")
    d.add_argument("--no-direct-io", action="store_true", help="buffered disk I/O (reads may come from page cache)")
    d.add_argument("--host-bytes", help="host tier size, e.g. 1GiB (default: twice the largest prefix + 64MiB)")
    d.add_argument("--disk-bytes", help="disk tier size (default: all prefixes with room to spare)")
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more kvtierd --set overrides")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.repeats = "512,1k", 1
    args.lengths = [parse_length(x) for x in args.lengths.split(",") if x.strip()]
    if args.repeats < 1 or args.suffix_tokens < 1 or not args.lengths:
        p.error("--repeats and --suffix-tokens must be positive, and --lengths not empty")
    for n in args.lengths:
        if (n - args.suffix_tokens) // args.block_tokens < 1:
            p.error(f"a prompt of {n} tokens leaves no full block before {args.suffix_tokens} suffix tokens")
    return args


def find_kvtierd(explicit: str | None) -> pathlib.Path:
    candidates = []
    if explicit:
        candidates = [pathlib.Path(explicit)]
    elif os.environ.get("KVTIER_PROGRAMS_DIR"):
        candidates = [pathlib.Path(os.environ["KVTIER_PROGRAMS_DIR"]) / "kvtierd"]
    else:
        candidates = [ROOT / "build" / b / "bin" / "kvtierd" for b in ("release", "debug")]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    sys.exit(f"ttft: no kvtierd at {' or '.join(map(str, candidates))}: build it, or pass --kvtierd")


def build_type(kvtierd: pathlib.Path) -> str:
    """The CMake build type next to the program, when it is in a build tree."""
    cache = kvtierd.parent.parent / "CMakeCache.txt"
    try:
        for line in cache.read_text(errors="replace").splitlines():
            if line.startswith("CMAKE_BUILD_TYPE:"):
                return line.split("=", 1)[1] or "unknown"
    except OSError:
        pass
    return "unknown"


class Kvtierd:
    """A kvtierd of the benchmark's own; stopped (SIGTERM) by stop()."""

    def __init__(self, program: pathlib.Path, directory: str, settings: list[str]) -> None:
        self.program = program
        self.socket = os.path.join(directory, "kvtierd.sock")
        self.log_path = os.path.join(directory, "kvtierd.log")
        self.args = [str(program), "--foreground", "--set", f"socket.path={self.socket}"]
        self.args += ["--set", f"state_dir={directory}/state"]
        for s in settings:
            self.args += ["--set", s]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                sys.exit(f"ttft: kvtierd did not start:\n{self.log()}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""


def size_text(n: int) -> str:
    return f"{(n + MiB - 1) // MiB}MiB"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def wait_for_disk_writes(client: Any, timeout_s: float = 300) -> float:
    """Waits until kvtierd has no disk write pending; returns the seconds waited."""
    start = time.perf_counter()
    while client.stats()["counters"].get("disk_writes_pending", 0) > 0:
        if time.perf_counter() - start > timeout_s:
            sys.exit("ttft: kvtierd's disk writes did not finish in time")
        time.sleep(0.005)
    return time.perf_counter() - start


def move_to_host(client: Any, cache: Any, keys: list[bytes], timeout_s: float = 300) -> None:
    """Has kvtierd bring the blocks of keys from disk to its host tier (prefetch), and waits for it."""
    from llama_kv import MAX_KEYS_PER_REQUEST

    batches = [keys[i : i + MAX_KEYS_PER_REQUEST] for i in range(0, len(keys), MAX_KEYS_PER_REQUEST)]
    for batch in batches:
        client.prefetch(cache, batch)
    start = time.perf_counter()
    while any(set(client.lookup(cache, batch).tiers) != {"host"} for batch in batches):
        if time.perf_counter() - start > timeout_s:
            sys.exit("ttft: kvtierd did not bring the blocks back to its host tier in time")
        time.sleep(0.005)


@dataclasses.dataclass
class Row:
    """One prompt length's figures, in seconds (lists: one per repeat)."""

    tokens: int
    prefix_blocks: int
    prefix_bytes: int
    store_s: float = 0.0
    disk_write_s: float = 0.0
    recompute: list[float] = dataclasses.field(default_factory=list)
    host: list[float] = dataclasses.field(default_factory=list)
    disk: list[float] = dataclasses.field(default_factory=list)
    host_kvtier: list[float] = dataclasses.field(default_factory=list)
    disk_kvtier: list[float] = dataclasses.field(default_factory=list)
    gather: list[float] = dataclasses.field(default_factory=list)
    # The tiers the lookups of each path reported, over all its repeats.
    tiers: dict[str, list[str]] = dataclasses.field(default_factory=lambda: {"host": [], "disk": []})
    # Problems seen: a load from another tier, a partial hit, other KV bytes,
    # another first token. Empty when all is well.
    problems: list[str] = dataclasses.field(default_factory=list)
    max_logit_diff: float = 0.0

    def note(self, problem: str) -> None:
        if problem not in self.problems:
            self.problems.append(problem)


def run_length(client: Any, engine: Any, model: Any, spec: Any, n: int, args: argparse.Namespace) -> Row:
    import numpy as np
    import torch
    from transformers import DynamicCache

    from llama_kv import forward, kv_of, prefill_with_kvtier, store_prefix

    bt = args.block_tokens
    rng = np.random.default_rng(args.seed * 1_000_003 + n)
    prompt = [int(t) for t in rng.integers(0, spec.vocab_size, n)]
    prefix_blocks = (n - args.suffix_tokens) // bt
    prefix = prefix_blocks * bt
    row = Row(n, prefix_blocks, prefix_blocks * engine.layout.block_bytes)
    ref_kv = None
    ref_token = -1
    ref_logits = None
    keys: list[bytes] = []

    def check(path: str, got: Any, want_tier: str) -> None:
        row.tiers[path] = sorted(set(row.tiers[path]) | set(got.tiers))
        if got.hits != prefix_blocks or got.loaded_blocks != prefix_blocks:
            row.note(f"{path}: {got.loaded_blocks}/{prefix_blocks} blocks loaded")
        if set(got.tiers) != {want_tier}:
            row.note(f"{path}: loaded from {sorted(set(got.tiers))}, not {want_tier}")
        for (k, v), (rk, rv) in zip(kv_of(got.cache, prefix), ref_kv):
            if not (torch.equal(k, rk) and torch.equal(v, rv)):
                row.note(f"{path}: loaded KV differs")
                break
        if int(torch.argmax(got.logits)) != ref_token:
            row.note(f"{path}: another first token")
        row.max_logit_diff = max(row.max_logit_diff, float((got.logits.float() - ref_logits.float()).abs().max()))

    for r in range(args.repeats):
        start = time.perf_counter()
        cache = DynamicCache(config=model.config)
        logits = forward(model, prompt, cache)
        token = int(torch.argmax(logits))
        row.recompute.append(time.perf_counter() - start)
        if r == 0:
            ref_kv, ref_token, ref_logits = kv_of(cache, prefix), token, logits
            start = time.perf_counter()
            keys = store_prefix(client, engine, ref_kv, prompt[:prefix])
            row.store_s = time.perf_counter() - start
            row.disk_write_s = wait_for_disk_writes(client)
            if len(keys) != prefix_blocks:
                row.note(f"{len(keys)} keys for {prefix_blocks} blocks")
        elif token != ref_token:
            row.note("recompute: another first token")
        del cache

        for path in ("host", "disk"):
            if path == "host" and r > 0:
                move_to_host(client, engine.cache, keys)  # the last disk run left them on disk only
            if path == "disk":
                client.evict(tier="host")  # the write-through copies on disk stay
            engine.zero()
            start = time.perf_counter()
            got = prefill_with_kvtier(client, engine, model, prompt)
            int(torch.argmax(got.logits))
            seconds = time.perf_counter() - start
            getattr(row, path).append(seconds)
            getattr(row, f"{path}_kvtier").append(got.seconds["kvtier"])
            row.gather.append(got.seconds["gather"])
            check(path, got, path)
            del got
    client.evict()  # every tier: the next length starts empty
    return row


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}" if seconds >= 0.1 else f"{seconds * 1000:.1f}"


def table(rows: list[Row]) -> str:
    head = (
        "prompt  prefix  KV MiB | recompute ms | host ms (kvtier)  vs recompute | disk ms (kvtier)  vs recompute"
        " | loaded from | max|dlogit| | checks"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        keys = ("recompute", "host", "disk", "host_kvtier", "disk_kvtier")
        med = {k: statistics.median(getattr(row, k)) for k in keys}
        host = f"{ms(med['host'])} ({ms(med['host_kvtier'])})"
        disk = f"{ms(med['disk'])} ({ms(med['disk_kvtier'])})"
        lines.append(
            f"{row.tokens:>6}  {row.prefix_blocks:>6}  {row.prefix_bytes / MiB:>6.1f} |"
            f" {ms(med['recompute']):>12} | {host:>16}  {med['recompute'] / med['host']:>11.1f}x |"
            f" {disk:>16}  {med['recompute'] / med['disk']:>11.1f}x |"
            f" {'+'.join(row.tiers['host']) + ', ' + '+'.join(row.tiers['disk']):>11} | {row.max_logit_diff:>11.2g} |"
            f" {'ok' if not row.problems else '; '.join(row.problems)}"
        )
    return "\n".join(lines)


@dataclasses.dataclass
class Setup:
    settings: list[str]
    host_bytes: str
    disk_bytes: str
    disk_dir: str


def daemon_settings(args: argparse.Namespace, work_dir: str, block_bytes: int) -> Setup:
    bt = args.block_tokens
    prefixes = [(n - args.suffix_tokens) // bt * block_bytes for n in [min(args.lengths)] + args.lengths]
    region = 64 * MiB if max(prefixes) >= 256 * MiB else 16 * MiB
    host = args.host_bytes or size_text(2 * max(prefixes) + 64 * MiB)
    # Each length's blocks are evicted before the next, but a disk record
    # stays until its region is reclaimed: room for them all (the warm-up's
    # too), and a few regions more.
    disk_total = sum(prefixes) * 5 // 4 + 4 * region
    disk = args.disk_bytes or size_text((disk_total + region - 1) // region * region)
    disk_dir = args.disk_dir or os.path.join(work_dir, "disk")
    settings = [
        f"tiers.host.bytes={host}",
        "tiers.disk.enabled=true",
        f"tiers.disk.paths=[{disk_dir}]",
        f"tiers.disk.bytes={disk}",
        f"tiers.disk.region_bytes={size_text(region)}",
        f"tiers.disk.direct_io={'false' if args.no_direct_io else 'true'}",
        "tiers.disk.stop_flush_seconds=0",
        # Stored blocks go to disk at once, so evicting the host copy leaves
        # the disk one; disk hits are never promoted, so each disk repeat
        # reads the disk.
        "policy.write_policy=write_through",
        "policy.disk_promotion_min_hits=511",
        "metrics.enabled=false",
    ] + list(args.set)
    return Setup(settings, host, disk, disk_dir)


@contextlib.contextmanager
def work_directory(args: argparse.Namespace) -> Iterator[str]:
    if args.work_dir:
        os.makedirs(args.work_dir, exist_ok=True)
        yield args.work_dir
        return
    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-") as d:
        yield d


def header(args: argparse.Namespace, spec: Any, layout: Any, program: pathlib.Path, setup: Setup) -> str:
    import torch
    import transformers

    import kvtier

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return "\n".join(
        [
            f"machine:   {cpu_name()}, {os.cpu_count()} CPUs (load average {load}), torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
            f"Python {platform.python_version()}",
            f"kvtierd:   {program} (build type {build_type(program)}); "
            f"kvtier from {pathlib.Path(kvtier.__file__).parent}",
            f"tiers:     host {setup.host_bytes}, disk {setup.disk_bytes} at {setup.disk_dir} "
            f"({'buffered' if args.no_direct_io else 'O_DIRECT'}), write-through, no promotion of disk hits",
            f"model:     Llama, {spec.num_layers} layers, hidden {spec.hidden_size}, {spec.num_heads} heads, "
            f"{spec.num_kv_heads} KV heads of {spec.head_dim}, MLP {spec.intermediate_size}, "
            f"vocab {spec.vocab_size}, {spec.dtype}, {spec.attn_implementation}, seed {spec.seed}",
            f"KV:        {layout.block_bytes // args.block_tokens} bytes a token, blocks of {args.block_tokens} "
            f"tokens ({layout.block_bytes // 1024} KiB); suffix {args.suffix_tokens} tokens; "
            f"medians of {args.repeats} repeat(s)",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    program = find_kvtierd(args.kvtierd)

    import torch

    import kvtier
    from llama_kv import EngineKv, TinyLlama

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = TinyLlama(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=args.intermediate or 4 * args.hidden,
        vocab_size=args.vocab,
        dtype=args.dtype,
        seed=args.seed,
        max_positions=max(args.lengths) + 64,
        attn_implementation=args.attn,
    )
    layout = spec.layout(args.block_tokens)
    model = spec.build()

    with work_directory(args) as work_dir:
        setup = daemon_settings(args, work_dir, layout.block_bytes)
        print(header(args, spec, layout, program, setup))
        daemon = Kvtierd(program, work_dir, setup.settings)
        daemon.start()
        io = [line.split("] ", 1)[-1] for line in daemon.log().splitlines() if "disk I/O:" in line]
        print(f"           kvtierd's {io[0] if io else 'disk I/O: (not logged)'}", flush=True)
        rows: list[Row] = []
        try:
            with kvtier.Client.connect(daemon.socket, name="ttft") as client:
                capacity = (max(args.lengths) - args.suffix_tokens) // args.block_tokens
                engine = EngineKv(client, layout, capacity)
                # Warm-up (not reported): the smallest prompt through every path.
                warm = argparse.Namespace(**{**vars(args), "repeats": 1})
                run_length(client, engine, model, spec, min(args.lengths), warm)
                for n in args.lengths:
                    row = run_length(client, engine, model, spec, n, args)
                    rows.append(row)
                    print(
                        f"  {n} tokens: recompute {ms(statistics.median(row.recompute))} ms, "
                        f"host {ms(statistics.median(row.host))} ms, disk {ms(statistics.median(row.disk))} ms "
                        f"(store {ms(row.store_s)} ms, then {ms(row.disk_write_s)} ms until on disk)",
                        flush=True,
                    )
        finally:
            daemon.stop()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nload average at the end: {load}")
    print(
        "TTFT in ms, medians: the prefix recomputed, or loaded from kvtierd's host or disk tier (in brackets: the\n"
        "part spent in keys, lookup and load); vs recompute: the recompute's median over that path's, the same\n"
        "runs; loaded from: the tiers the lookups of the host and the disk runs named (the load's source);\n"
        "max|dlogit|: first-token logits of the loaded paths against the recompute's"
    )
    print(table(rows))
    gather = ", ".join(ms(statistics.median(r.gather)) for r in rows)
    print(
        f"\nThe loaded paths include gathering the loaded blocks into transformers' contiguous DynamicCache\n"
        f"({gather} ms), which a paged engine would not do."
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
    return 1 if any(r.problems for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
