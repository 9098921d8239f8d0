#!/usr/bin/env python3
"""A real model end to end on a GPU, through CUDA IPC (tools/gpu-check.sh runs it).

test_model_e2e.py's seeded Llama (llama_kv.TinyLlama: transformers, built
from a config, nothing downloaded) on cuda, with the engine's paged KV memory
as CUDA tensors that ``register_tensors`` sends to kvtierd through CUDA IPC.
The script starts a kvtierd of its own on the cuda backend (an hbm tier and a
host tier, as gpu_e2e.py does). For fp32 and bf16:

  this process   prefills prompt A (8k tokens by default) and stores its full
                 blocks through kvtierd;
  another one    (its own model from the same seed, its own client and CUDA KV
                 tensors) looks up prompt B, which shares all but A's and its
                 own last 22 tokens, loads the hits into its KV tensors,
                 computes the rest of B and decodes 4 tokens greedily; then
                 times B's first token three ways (TTFT, medians): loaded
                 through kvtier whole, then computed; loaded by layer, each
                 layer's compute waiting only for that layer (the cuda
                 backend's per-layer kernels and events), on the GPU (the
                 model's stream waits: Op.stream_wait_layers) and on the
                 host (Op.wait_layers); and recomputed from scratch.

Then, here, the same computation without kvtier (the stored prefix's KV, the
rest of B, the same decoding) and B in one pass, both on the GPU. Required:
every full block of the shared prefix hits and loads, the loaded KV is the
stored bytes, fp32 logits and tokens are bit-exact against the same
computation (torch.equal on the bits), every load by layer gives the whole
load's logits bit for bit, and bf16 logits are within
test_model_e2e.py's tolerance of the bf16 single pass and of the fp32 model
(8 u * max|logit|, u = 2^-8). One line says the verdict, with the figures:
"model e2e: PASS (...)" or "model e2e: FAIL (reasons; ...)".

Usage: python3 gpu_model_e2e.py KVTIERD_PATH [--device cuda|cpu] [--tokens N] [--repeats N]
(the kvtier package on sys.path; llama_kv.py next to this file; torch and
transformers installed). --device cpu runs the same steps on the CPU (the
host backend, CPU tensors): the script's logic where no GPU is.
Exit status: 0 PASS, 1 FAIL, 2 usage, 3 no usable GPU (nothing run),
4 torch, transformers or kvtier missing (nothing run).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # llama_kv

BLOCK_TOKENS = 16
OWN_TOKENS = 22  # each prompt's tokens after the shared ones
STEPS = 4  # tokens decoded after prompt B
DTYPES = ("fp32", "bf16")
# test_model_e2e.py's bf16 tolerance (_BF16_TOLERANCE_U, _BF16_U there, which
# says why): 8 units of bf16 roundoff times the fp32 model's largest |logit|.
BF16_TOLERANCE_U = 8
BF16_U = 2.0**-8
MiB = 1 << 20
STARTED = time.monotonic()


def say(text: str) -> None:
    print(text, flush=True)


def arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kvtierd", nargs="?", help="the kvtierd to start (the loading process: unused)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="(default %(default)s)")
    p.add_argument("--tokens", type=int, default=8192, help="prompt length (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="TTFT runs of each path; medians (default %(default)s)")
    p.add_argument("--timeout", type=float, default=90, help="seconds the loading process may take (default %(default)s)")
    # The loading process's own arguments (the script starts it).
    p.add_argument("--role", choices=("store", "load"), default="store", help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tokens - OWN_TOKENS < BLOCK_TOKENS or args.repeats < 1:
        p.error(f"--tokens must be at least {OWN_TOKENS + BLOCK_TOKENS} and --repeats positive")
    if args.role == "store" and not args.kvtierd:
        p.error("KVTIERD_PATH is needed")
    if args.role == "load" and not (args.socket and args.work):
        p.error("--role load needs --socket and --work")
    return args


class Setup:
    """What both processes derive from the arguments: the prompts and the specs."""

    def __init__(self, args: argparse.Namespace) -> None:
        from llama_kv import TinyLlama

        n = args.tokens
        self.specs = {d: TinyLlama(dtype=d, max_positions=n + STEPS + BLOCK_TOKENS) for d in DTYPES}
        vocab = self.specs["fp32"].vocab_size
        rng = [random.Random(seed) for seed in (1, 2, 3)]
        shared = [rng[0].randrange(vocab) for _ in range(n - OWN_TOKENS)]
        self.prompt_a = shared + [rng[1].randrange(vocab) for _ in range(OWN_TOKENS)]
        self.prompt_b = shared + [rng[2].randrange(vocab) for _ in range(OWN_TOKENS)]
        # Prompt B hits the full blocks of the shared tokens and nothing after
        # them (a block that mixes shared and own tokens has another key).
        self.shared_blocks = len(shared) // BLOCK_TOKENS
        self.prefix = self.shared_blocks * BLOCK_TOKENS
        self.capacity = (n + BLOCK_TOKENS - 1) // BLOCK_TOKENS  # engine blocks: a whole prompt


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


# ---------------------------------------------------------------- the loading process


def load_role(args: argparse.Namespace) -> int:
    """Loads prompt B's prefix through kvtier once "go" comes on stdin, decodes,
    times TTFT three ways (recomputed, loaded whole, loaded by layer under the
    forward pass); writes WORK/loaded-DTYPE.pt for the storing process."""
    import torch

    import kvtier
    from llama_kv import EngineKv, decode, forward, new_cache, prefill_with_kvtier

    if args.threads:
        torch.set_num_threads(args.threads)  # as the storing process: the same BLAS splits on the CPU
    setup = Setup(args)
    models = {d: spec.build(args.device) for d, spec in setup.specs.items()}
    prompt = setup.prompt_b

    def synced() -> float:
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    with kvtier.Client.connect(args.socket, name="model-e2e-load") as client:
        engines = {d: EngineKv(client, s.layout(BLOCK_TOKENS), setup.capacity, args.device)
                   for d, s in setup.specs.items()}
        say(f"load: pid {os.getpid()} ready ({engines['fp32'].cache.kind} KV cache), waiting for the stores")
        if sys.stdin.readline().strip() != "go":
            say("load: no go from the storing process")
            return 1
        for dtype in DTYPES:
            model, engine = models[dtype], engines[dtype]
            got = prefill_with_kvtier(client, engine, model, prompt)
            tokens, logits = decode(model, got.cache, got.logits, STEPS)
            kv = [(k.cpu(), v.cpu()) for k, v in engine.kv(got.loaded_blocks)]
            # TTFT: B's first token, recomputed, loaded whole and loaded by
            # layer, one after another; one recompute first to warm the
            # kernels of the whole prompt. A load by layer must give the
            # whole load's logits, bit for bit.
            recompute, loaded, kvtier_s, partial = [], [], [], 0
            # By layer: each layer waited for on the model's stream (on cuda)
            # and, again, by this thread.
            layered, layered_host, layered_waited, layered_wrong, stream_waits = [], [], [], 0, 1.0
            forward(model, prompt, new_cache(model.config))
            for _ in range(args.repeats):
                start = synced()
                int(torch.argmax(forward(model, prompt, new_cache(model.config))))
                recompute.append(time.perf_counter() - start)
                engine.zero()
                start = synced()
                again = prefill_with_kvtier(client, engine, model, prompt)
                int(torch.argmax(again.logits))
                loaded.append(time.perf_counter() - start)
                kvtier_s.append(again.seconds["kvtier"])
                partial += again.loaded_blocks != got.loaded_blocks
                del again
                for on_stream, times in ((True, layered), (False, layered_host)):
                    engine.zero()
                    start = synced()
                    again = prefill_with_kvtier(client, engine, model, prompt, by_layer=True, stream_waits=on_stream)
                    int(torch.argmax(again.logits))
                    times.append(time.perf_counter() - start)
                    if on_stream:
                        layered_waited.append(again.seconds.get("waited", 0.0))
                        stream_waits = min(stream_waits, again.seconds.get("stream_waits", 0.0))
                    partial += again.loaded_blocks != got.loaded_blocks or "redone" in again.seconds
                    layered_wrong += not torch.equal(bits(again.logits), bits(got.logits))
                    del again
            result = {
                "pid": os.getpid(),
                "kind": engine.cache.kind,
                "hits": got.hits,
                "tiers": list(got.tiers),
                "loaded_blocks": got.loaded_blocks,
                "kv": kv,
                "tokens": tokens,
                "logits": [t.cpu() for t in logits],
                "ttft_recompute": statistics.median(recompute),
                "ttft_load": statistics.median(loaded),
                "ttft_load_kvtier": statistics.median(kvtier_s),
                "ttft_load_by_layer": statistics.median(layered),
                "ttft_load_by_layer_host": statistics.median(layered_host),
                "by_layer_waited": statistics.median(layered_waited),
                "by_layer_stream_waits": bool(stream_waits) and args.device == "cuda",
                "by_layer_wrong": layered_wrong,
                "partial_reloads": partial,
            }
            torch.save(result, os.path.join(args.work, f"loaded-{dtype}.pt"))
            say(
                f"load: {dtype}: {got.hits} hits ({'+'.join(sorted(set(got.tiers))) or 'none'}), "
                f"{got.loaded_blocks} blocks loaded, {STEPS} tokens decoded; TTFT of {len(prompt)} tokens "
                f"(median of {args.repeats}): loaded {ms(result['ttft_load'])} ms "
                f"(kvtier {ms(result['ttft_load_kvtier'])} ms), by layer {ms(result['ttft_load_by_layer'])} ms "
                f"({'the stream waiting on the GPU' if result['by_layer_stream_waits'] else 'this thread waiting'}: "
                f"{ms(result['by_layer_waited'])} ms), by layer waited here {ms(result['ttft_load_by_layer_host'])} ms, "
                f"recomputed {ms(result['ttft_recompute'])} ms"
            )
    return 0


# ---------------------------------------------------------------- the storing process


def bits(t: Any) -> Any:
    """The tensor's bytes as integers: torch.equal on floats calls -0 and +0 equal."""
    import torch

    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def max_diff(a: list[Any], b: list[Any]) -> float:
    return max(float((x.cpu().float() - y.cpu().float()).abs().max()) for x, y in zip(a, b))


def start_kvtierd(program: str, directory: str, device: str) -> tuple[subprocess.Popen[bytes], str, str]:
    socket = os.path.join(directory, "kvtierd.sock")
    log_path = os.path.join(directory, "kvtierd.log")
    args = [program, "--foreground"]
    for s in (f"socket.path={socket}", f"state_dir={directory}/state",
              f"device.backend={'cuda' if device == 'cuda' else 'host'}",
              "tiers.hbm.enabled=true", "tiers.hbm.bytes=256MiB", "tiers.host.bytes=256MiB",
              "tiers.disk.enabled=false", "metrics.enabled=false"):
        args += ["--set", s]
    with open(log_path, "wb") as log:
        daemon = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    return daemon, socket, log_path


def tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def stop(process: subprocess.Popen[bytes] | None, wait_s: float) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def check(setup: Setup, args: argparse.Namespace, stored: dict[str, Any], work: str) -> tuple[list[str], list[str]]:
    """Compares what the loading process got with recomputes here; returns (problems, figures)."""
    import torch

    from llama_kv import cache_from, decode, forward, kv_of, new_cache

    problems: list[str] = []
    figures: list[str] = []
    prompt = setup.prompt_b
    got_all = {d: torch.load(os.path.join(work, f"loaded-{d}.pt")) for d in DTYPES}
    for dtype in DTYPES:
        got, (model, cache_a, _) = got_all[dtype], stored[dtype]
        config = model.config
        if got["pid"] == os.getpid():
            problems.append(f"{dtype}: loaded in the storing process")
        want_kind = "cuda" if args.device == "cuda" else "host"
        if got["kind"] != want_kind:
            problems.append(f"{dtype}: the loading process's KV tensors were registered as {got['kind']}, "
                            f"not {want_kind}")
        if (got["hits"], got["loaded_blocks"]) != (setup.shared_blocks, setup.shared_blocks):
            problems.append(f"{dtype}: {got['hits']} hits, {got['loaded_blocks']} loaded of {setup.shared_blocks}")
            continue
        stored_kv = kv_of(cache_a, setup.prefix)
        if not all(torch.equal(bits(k.cpu()), bits(gk)) and torch.equal(bits(v.cpu()), bits(gv))
                   for (k, v), (gk, gv) in zip(stored_kv, got["kv"])):
            problems.append(f"{dtype}: the loaded KV differs from the stored bytes")
        if got["partial_reloads"]:
            problems.append(f"{dtype}: {got['partial_reloads']} TTFT loads loaded fewer blocks")

        # The same computation without kvtier: the stored prefix's KV, the
        # rest of B, the same decoding.
        reference = cache_from(stored_kv, config)
        ref_tokens, ref_logits = decode(model, reference, forward(model, prompt[setup.prefix:], reference), STEPS)
        exact = got["tokens"] == ref_tokens and len(got["logits"]) == len(ref_logits) and all(
            torch.equal(bits(a), bits(b.cpu())) for a, b in zip(got["logits"], ref_logits))
        diff_same = max_diff(got["logits"], ref_logits)
        # B in one pass, the loaded process's tokens fed (teacher forcing).
        full = new_cache(config)
        _, full_logits = decode(model, full, forward(model, prompt, full), STEPS, forced=got["tokens"])
        diff_full = max_diff(got["logits"], full_logits)
        tiers = "+".join(sorted(set(got["tiers"])))
        if got["by_layer_wrong"]:
            problems.append(f"{dtype}: {got['by_layer_wrong']} loads by layer gave other logits than the whole load")
        if args.device == "cuda" and not got["by_layer_stream_waits"]:
            problems.append(f"{dtype}: no stream waited for a layer on the GPU (no 64-bit stream memory operations)")
        ttft = (f"TTFT {ms(got['ttft_load'])} ms loaded, {ms(got['ttft_load_by_layer'])} ms by layer "
                f"({ms(got['ttft_load_by_layer_host'])} ms waited on the host), {ms(got['ttft_recompute'])} ms recomputed")
        if dtype == "fp32":
            if not exact:
                problems.append(f"fp32: logits or tokens differ from the same computation without kvtier "
                                f"(max |dlogit| {diff_same:.3g})")
            figures.append(f"fp32: {got['hits']}/{setup.shared_blocks} hits ({tiers}), logits "
                           f"{'bit-exact' if exact else f'NOT bit-exact (max |dlogit| {diff_same:.3g})'}, {ttft}")
            say(f"check: fp32: {got['hits']} hits, logits and tokens bit-exact against the same computation "
                f"without kvtier: {exact} (max |dlogit| {diff_same:.3g}, over {STEPS + 1} positions); "
                f"{diff_full:.3g} from B in one pass")
            continue
        # bf16: within bf16 rounding of the bf16 single pass and of the fp32 model.
        model32 = stored["fp32"][0]
        full32 = new_cache(model32.config)
        _, logits32 = decode(model32, full32, forward(model32, prompt, full32), STEPS, forced=got["tokens"])
        scale = max(float(t.abs().max()) for t in logits32)
        bound = BF16_TOLERANCE_U * BF16_U * scale
        diff_fp32 = max_diff(got["logits"], logits32)
        if not (diff_full <= bound and diff_fp32 <= bound):
            problems.append(f"bf16: max |dlogit| {diff_full:.3g} from the bf16 single pass, {diff_fp32:.3g} from "
                            f"fp32: over the bound {bound:.3g}")
        figures.append(f"bf16: {got['hits']}/{setup.shared_blocks} hits ({tiers}), max |dlogit| {diff_fp32:.3g} "
                       f"from fp32 = {diff_fp32 / (BF16_U * scale):.2f} u (bound {BF16_TOLERANCE_U} u), {ttft}")
        say(f"check: bf16: {got['hits']} hits, max |dlogit| {diff_fp32:.3g} from the fp32 model, {diff_full:.3g} "
            f"from the bf16 single pass, bound {bound:.3g} ({BF16_TOLERANCE_U} u * max|logit| {scale:.3g}); "
            f"bit-exact against the same computation without kvtier: {exact} (max |dlogit| {diff_same:.3g})")
    return problems, figures


def store_role(args: argparse.Namespace) -> int:
    if not (os.path.isfile(args.kvtierd) and os.access(args.kvtierd, os.X_OK)):
        say(f"model e2e: FAIL (no kvtierd at {args.kvtierd})")
        return 2
    try:
        import torch
    except ImportError as e:
        say(f"model e2e: NOT RUN (no torch for {sys.executable}: {e})")
        return 4
    if args.device == "cuda" and not torch.cuda.is_available():
        why = ("a CPU-only torch" if torch.version.cuda is None
               else f"torch built for CUDA {torch.version.cuda}, but no usable CUDA device or driver")
        say(f"model e2e: NO GPU (torch {torch.__version__}: {why}). This check needs an NVIDIA GPU; "
            f"--device cpu runs its steps on the CPU")
        return 3
    try:
        import transformers

        import kvtier
        from llama_kv import EngineKv, forward, kv_of, new_cache, store_prefix
    except ImportError as e:
        say(f"model e2e: NOT RUN ({e}; it needs torch, transformers and the kvtier package)")
        return 4
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    say(f"setup: torch {torch.__version__}, transformers {transformers.__version__}, {where}, "
        f"kvtier from {os.path.dirname(kvtier.__file__)}")
    setup = Setup(args)
    spec = setup.specs["fp32"]
    say(f"setup: Llama {spec.num_layers} layers, hidden {spec.hidden_size}, {spec.num_kv_heads} KV heads of "
        f"{spec.head_dim}, seed {spec.seed}; prompts of {args.tokens} tokens, {len(setup.prompt_a) - OWN_TOKENS} "
        f"shared ({setup.shared_blocks} full blocks of {BLOCK_TOKENS})")
    want_kind = "cuda" if args.device == "cuda" else "host"
    daemon = loader = None
    problems: list[str] = []
    figures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-model-e2e-") as work:
        try:
            daemon, socket, log_path = start_kvtierd(args.kvtierd, work, args.device)
            deadline = time.monotonic() + 30
            while not os.path.exists(socket):
                if daemon.poll() is not None or time.monotonic() > deadline:
                    say(tail(log_path))
                    say("model e2e: FAIL (kvtierd did not start)")
                    return 1
                time.sleep(0.02)
            # The loading process imports torch and transformers while this one stores.
            loader = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--role", "load", "--socket", socket, "--work", work,
                 "--device", args.device, "--tokens", str(args.tokens), "--repeats", str(args.repeats),
                 "--threads", str(torch.get_num_threads())],
                stdin=subprocess.PIPE,
            )
            stored: dict[str, Any] = {}
            with kvtier.Client.connect(socket, name="model-e2e-store") as client:
                for dtype, s in setup.specs.items():
                    model = s.build(args.device)
                    engine = EngineKv(client, s.layout(BLOCK_TOKENS), setup.capacity, args.device)
                    if engine.cache.kind != want_kind:
                        problems.append(f"the KV tensors were registered as {engine.cache.kind}, not {want_kind}")
                    cache_a = new_cache(model.config)
                    forward(model, setup.prompt_a, cache_a)
                    keys = store_prefix(client, engine, kv_of(cache_a, len(setup.prompt_a)), setup.prompt_a)
                    say(f"store: {dtype}: {len(keys)} blocks of prompt A stored "
                        f"({len(keys) * engine.layout.block_bytes / MiB:.1f} MiB, {engine.cache.kind} KV cache)")
                    stored[dtype] = (model, cache_a, engine)  # the engine's memory stays registered
                assert loader.stdin is not None
                loader.stdin.write(b"go\n")
                loader.stdin.close()
                try:
                    rc = loader.wait(timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    problems.append(f"the loading process ran past {args.timeout:.0f} s")
                    rc = None
                if rc is not None and rc != 0:
                    problems.append(f"the loading process exited {rc}")
                elif rc == 0:
                    more, figures = check(setup, args, stored, work)
                    problems += more
        except Exception as e:  # a verdict line, not a traceback only
            import traceback

            traceback.print_exc()
            problems.append(f"{type(e).__name__}: {e}")
        finally:
            stop(loader, 5)
            stop(daemon, 30)
            if problems and daemon is not None:
                say("kvtierd's log (its end):\n" + tail(log_path))
    via = "CUDA IPC" if args.device == "cuda" else "host memory"
    summary = "; ".join([f"{where}, KV through {via}, {args.tokens}-token prompt loaded by another process"] + figures)
    elapsed = f"{time.monotonic() - STARTED:.0f} s"
    if problems:
        say(f"model e2e: FAIL ({'; '.join(problems)}; {summary}; {elapsed})")
        return 1
    say(f"model e2e: PASS ({summary}; {elapsed})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if args.role == "load":
        return load_role(args)

    # gpu-check's timeout sends SIGTERM: stop the loading process and kvtierd
    # too (the finally blocks), and say why.
    def terminated(signum: int, frame: types.FrameType | None) -> None:
        raise SystemExit(f"model e2e: FAIL (stopped by signal {signum}: out of time?)")

    signal.signal(signal.SIGTERM, terminated)
    return store_role(args)


if __name__ == "__main__":
    sys.exit(main())
