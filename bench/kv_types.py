"""KV cache types (`-ctk/-ctv`): memory, decode throughput at long contexts, greedy
agreement, in one run.

1. Memory per token and per slot (`-c` tokens) on the embedded SmolLM2-135M for each type:
   the bytes the engine's memory admission counts and the bytes a one-sequence cache of
   `--context` tokens really holds (mlx-lm grows caches in 256-token steps).
2. Decode throughput in-process (`DecodeBatch`, the engine's batch, no HTTP), 8 sequences
   against 1, at each `--contexts` length of keys, per type: every sequence's prompt is
   prefilled once per type and copied into each measurement, which times `--steps`
   batched decode steps. The types alternate within each repetition. The model is the
   bench's 20M llama as a 4-bit MLX copy with float16 scales (the kernel's int8 tiles),
   the model of the 2.6x figure at 1024 keys with the float32 cache; `-m` another.
3. Greedy agreement of each type against f16 over `-n` tokens on SmolLM2 (the shipped
   GGUF), a few prompts: tokens equal position by position, and where they first differ.
   f32 against f16 is the floor: with int8 activations (`--cpu-dtype auto` on AVX-512
   VNNI) a last-bit difference in a layer's input can flip an activation's rounding, so
   any change of the cache moves greedy text; `MLXCEL_KERNEL_INT8=off` shows the cache's
   own effect.

    .venv/bin/python bench/kv_types.py [-m MLX_DIR] [--contexts 1024,4096] [--types f32,f16]
        [--steps 32] [-r 3] [-n 128] [--skip-throughput] [--skip-agreement]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BENCH_DIR, bench_model, load_note  # noqa: E402

from mlxcel.engine.blas import blas_in_use  # noqa: E402  (before anything imports MLX)

MEMORY_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
AGREEMENT_PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how photosynthesis works.",
    "List five uses of a paperclip.",
    "What is the capital of France? Answer in one sentence.",
)


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def memory(context: int, slot_context: int) -> None:
    import mlx.core as mx

    from mlxcel.engine.loading import load_model
    from mlxcel.engine.text.kv_types import kv_type, make_cache
    from mlxcel.engine.text.memory_budget import model_shapes

    loaded = load_model(None, cpu_dtype="auto")
    model = loaded.model
    tokens = mx.array([[i % 1000 + 10 for i in range(context)]])
    print(f"## memory: {loaded.info.name}, a cache of {context} tokens; a slot of {slot_context}")
    print("| type | bytes/token (admission) | bytes/token (held) | per slot | vs f32 |")
    print("|---|---:|---:|---:|---:|")
    base = 0
    for name in MEMORY_TYPES:
        kv = kv_type(name)
        per_token = model_shapes(model, kv).kv_bytes_per_token
        cache = make_cache(model, kv)
        model(tokens, cache=cache)
        mx.eval([c.state for c in cache])
        held = sum(int(c.nbytes) for c in cache) / context
        base = base or per_token
        print(
            f"| {name} | {per_token} | {held:.0f} | {_mib(per_token * slot_context)} "
            f"| {per_token / base:.3f}x |"
        )
    print()


def _quantized_bench_model() -> Path:
    """The bench's 20M llama as MLX 4-bit (group 32) with float16 scales (cached)."""
    from mlx_lm import convert

    out = BENCH_DIR / "llama-20m-4bit-f16"
    if not (out / "config.json").is_file():
        convert(str(bench_model()), mlx_path=str(out), quantize=True, q_group_size=32,
                q_bits=4, dtype="float16")  # fmt: skip
    return out


def _prefill(model: Any, kv: Any, prompts: list[list[int]]) -> list[list[Any]]:
    import mlx.core as mx

    from mlxcel.engine.text.kv_types import make_cache

    caches = []
    for prompt in prompts:
        cache = make_cache(model, kv)
        for start in range(0, len(prompt) - 1, 512):
            model(mx.array([prompt[start : min(start + 512, len(prompt) - 1)]]), cache=cache)
            mx.eval([c.state for c in cache])
        caches.append(cache)
    return caches


def _decode_rate(
    model: Any, kv: Any, prompts: list[list[int]], caches: list[Any], steps: int
) -> float:
    """Tokens a second over `steps` batched decode steps of every prompt at once."""
    from mlxcel.engine.text.decode_batch import DecodeBatch

    n = len(prompts)
    batch = DecodeBatch(
        model, completion_batch_size=n, prefill_batch_size=n, prefill_step_size=512, kv_type=kv
    )
    batch.insert(
        [p[-1:] for p in prompts],
        max_tokens=[steps + 8] * n,
        caches=[copy.deepcopy(c) for c in caches],
        all_tokens=[p[:-1] for p in prompts],
    )
    while True:  # until every sequence is decoding
        _, generated = batch.next()
        if len(generated) == n:
            break
    start = time.perf_counter()
    made = 0
    for _ in range(steps):
        _, generated = batch.next()
        made += len(generated)
    rate = made / (time.perf_counter() - start)
    batch.close()
    return rate


def throughput(
    model_dir: Path, contexts: list[int], types: list[str], steps: int, reps: int
) -> None:
    from mlxcel.engine.loading import load_model
    from mlxcel.engine.text.kv_types import kv_type

    loaded = load_model(str(model_dir), cpu_dtype="auto")
    model = loaded.model
    vocab = loaded.tokenizer.vocab_size
    print(f"## decode, 8 sequences vs 1: {model_dir.name}, {steps} steps, {reps} repetitions")
    print("| keys | type | 1 seq tok/s | 8 seq tok/s | 8 vs 1 |")
    print("|---:|---|---:|---:|---:|")
    for context in contexts:
        prompts = [
            [(i * 7919 + s * 104729) % (vocab - 10) + 5 for i in range(context)] for s in range(8)
        ]
        prefilled = {name: _prefill(model, kv_type(name), prompts) for name in types}
        rates: dict[tuple[str, int], list[float]] = {}
        for _ in range(reps):
            for name in types:
                for n in (1, 8):
                    rate = _decode_rate(
                        model, kv_type(name), prompts[:n], prefilled[name][:n], steps
                    )
                    rates.setdefault((name, n), []).append(rate)
        for name in types:
            one, eight = rates[(name, 1)], rates[(name, 8)]
            ratios = [e / o for e, o in zip(eight, one, strict=True)]
            rate1, rate8 = statistics.median(one), statistics.median(eight)
            print(
                f"| {context} | {name} | {rate1:.0f} | {rate8:.0f} "
                f"| {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |"
            )
        if "f32" in types and "f16" in types:
            f32, f16 = rates[("f32", 8)], rates[("f16", 8)]
            gain = statistics.median(f16) / statistics.median(f32)
            print(f"|  | f16 / f32 at 8 | | | {gain:.2f}x |")
    print()


def agreement(n_tokens: int, types: list[str]) -> None:
    from mlxcel.engine.loading import load_model
    from mlxcel.engine.prompting import build_prompt
    from mlxcel.engine.sampling.params import SamplingParams
    from mlxcel.engine.text.kv_types import kv_type
    from mlxcel.engine.text.request import GenerationRequest
    from mlxcel.engine.text.scheduler import TextEngine

    loaded = load_model(None, cpu_dtype="auto")
    outputs: dict[str, list[list[int]]] = {}
    for name in ["f16", *[t for t in types if t != "f16"]]:
        engine = TextEngine(loaded, slots=1, kv_type=kv_type(name)).start()
        try:
            runs = []
            for text in AGREEMENT_PROMPTS:
                request = GenerationRequest(
                    prompt_tokens=build_prompt(loaded.tokenizer, text),
                    sampling=SamplingParams(temperature=0.0),
                    max_tokens=n_tokens,
                    ignore_eos=True,
                    cache_prompt=False,
                )
                runs.append([t for e in engine.generate(request) for t in e.token_ids])
            outputs[name] = runs
        finally:
            engine.stop()
    n_prompts = len(AGREEMENT_PROMPTS)
    print(f"## greedy agreement with f16: {loaded.info.name}, {n_tokens} tokens x {n_prompts}")
    print("| type | equal tokens (same position) | first difference (per prompt) |")
    print("|---|---:|---|")
    for name, runs in outputs.items():
        if name == "f16":
            continue
        equal = total = 0
        firsts = []
        for a, b in zip(runs, outputs["f16"], strict=True):
            equal += sum(x == y for x, y in zip(a, b, strict=False))
            total += len(b)
            first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            firsts.append("none" if first is None else str(first))
        print(f"| {name} | {equal}/{total} ({100 * equal / total:.1f}%) | {', '.join(firsts)} |")
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", type=Path, default=None, help="MLX dir (throughput)")
    parser.add_argument("--contexts", default="1024,4096", help="keys per sequence")
    parser.add_argument("--types", default="f32,f16", help="types for throughput")
    parser.add_argument("--agreement-types", default="f32,q8_0,q4_0")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("-r", "--reps", type=int, default=3)
    parser.add_argument("-n", "--tokens", type=int, default=128, help="agreement tokens")
    parser.add_argument("--memory-context", type=int, default=1024)
    parser.add_argument("--slot-context", type=int, default=4096)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-agreement", action="store_true")
    args = parser.parse_args()
    print(f"BLAS: {blas_in_use()}; {load_note()}")
    if not args.skip_memory:
        memory(args.memory_context, args.slot_context)
    if not args.skip_throughput:
        model = args.model or _quantized_bench_model()
        contexts = [int(c) for c in args.contexts.split(",")]
        throughput(model, contexts, args.types.split(","), args.steps, args.reps)
    if not args.skip_agreement:
        agreement(args.tokens, args.agreement_types.split(","))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
