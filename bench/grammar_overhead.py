"""Structured-output overhead: decode tok/s with a JSON-schema grammar vs without, same model.

For each model (the tiny random-weight test fixture and the embedded SmolLM2 default):

- decode tok/s of B sequences, unconstrained vs constrained by a JSON schema, through
  mlx-lm's `BatchGenerator` with the processors inserted the way the engine's scheduler
  inserts them (greedy; the two modes alternate over several repetitions);
- the mask cost per token, replayed on the constrained output without the model: the
  grammar engine's bitmask fill alone, and fill + unpack + masking the logits (evaluated).

    .venv/bin/python bench/grammar_overhead.py [--models tiny,default] [-n TOKENS] [-r REPS]
        [-b 1,4] [--backend llguidance|xgrammar]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# Needs a long answer (at least eight records), so both modes decode the full token budget.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 8,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "city": {"type": "string"},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "role": {"enum": ["engineer", "teacher", "doctor", "artist", "other"]},
                },
                "required": ["name", "city", "age", "role"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}
PROMPT = (
    "List eight people as JSON: an object with a `people` array; each person has a name, "
    "a city, an age and a role."
)


def _load(name: str) -> Any:
    from mlxcel.engine.loading import load_model

    if name == "default":
        return load_model(None)
    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures.tiny_models import build_tiny_model

    out = Path(tempfile.gettempdir()) / "mlxcel-bench" / "grammar-tiny-llama"
    if not (out / "model.safetensors").is_file():
        build_tiny_model(out, "llama")
    return load_model(str(out))


def _decode(
    loaded: Any, prompt: list[int], n: int, batch: int, compiled: Any | None
) -> tuple[float, int, list[list[int]]]:
    """Decode tok/s (after each sequence's first token), tokens decoded, the outputs."""
    from mlx_lm.generate import BatchGenerator, StopSequences

    from mlxcel.engine.grammar import grammar_processor

    generator = BatchGenerator(loaded.model, completion_batch_size=batch, prefill_batch_size=batch)
    eos = sorted(loaded.tokenizer.eos_token_ids)
    # Unconstrained runs ignore EOS so they decode the same budget; constrained runs stop
    # where the grammar ends (the schema asks for more than the budget).
    stops = StopSequences([[t] for t in eos] if compiled is not None else None)
    uids = generator.insert(
        [prompt] * batch,
        max_tokens=[n] * batch,
        logits_processors=[[grammar_processor(compiled)] for _ in range(batch)]
        if compiled is not None
        else None,
        stop_sequences=[stops] * batch,
    )
    outputs: dict[int, list[int]] = {uid: [] for uid in uids}
    done: set[int] = set()
    first = 0.0
    decoded = 0
    while len(done) < batch:
        _, responses = generator.next()
        now = time.perf_counter()
        for r in responses:
            outputs[r.uid].append(int(r.token))
            if r.finish_reason is not None:
                done.add(r.uid)
        if responses and not first:
            first = now  # the step that produced the first tokens ends the prefill
        elif responses:
            decoded += len(responses)
    span = time.perf_counter() - first
    return (decoded / span if span > 0 else 0.0), decoded, list(outputs.values())


def _mask_costs(loaded: Any, compiled: Any, tokens: list[int]) -> tuple[list[float], list[float]]:
    """Per-token ms: bitmask fill alone; fill + unpack + mask the logits (evaluated)."""
    import mlx.core as mx

    from mlxcel.engine.grammar.processor import apply_bitmask

    backend = compiled.backend
    logits = mx.random.normal((1, backend.vocab_size))
    mx.eval(logits)
    bitmask = backend.allocate_bitmask(1)
    fill: list[float] = []
    full: list[float] = []
    matcher = compiled.matcher()
    for token in tokens:
        start = time.perf_counter()
        matcher.fill_bitmask(bitmask, 0)
        mid = time.perf_counter()
        mx.eval(apply_bitmask(logits, bitmask))
        end = time.perf_counter()
        fill.append((mid - start) * 1000)
        full.append((end - start) * 1000)
        if matcher.is_terminated() or not matcher.accept(token):
            break
    return fill, full


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,default")
    parser.add_argument("-n", "--tokens", type=int, default=64)
    parser.add_argument("-r", "--reps", type=int, default=3)
    parser.add_argument("-b", "--batches", default="1,4")
    parser.add_argument("--backend", default="llguidance")
    args = parser.parse_args()

    from mlxcel.engine.grammar import get_grammar_backend
    from mlxcel.engine.prompting import build_prompt

    for name in args.models.split(","):
        loaded = _load(name)
        tokenizer = loaded.tokenizer
        start = time.perf_counter()
        backend = get_grammar_backend(args.backend, tokenizer)
        built = time.perf_counter() - start
        start = time.perf_counter()
        compiled = backend.compile_json_schema(SCHEMA)
        compile_ms = (time.perf_counter() - start) * 1000
        prompt = build_prompt(tokenizer, PROMPT)
        print(
            f"\n== {loaded.info.name} ({loaded.info.num_parameters / 1e6:.1f}M params, "
            f"vocab {tokenizer.vocab_size}), {args.backend}: tokenizer table {built:.2f} s, "
            f"schema compile {compile_ms:.1f} ms"
        )
        sample: list[int] = []
        for batch in (int(b) for b in args.batches.split(",")):
            _decode(loaded, prompt, 4, batch, None)  # warm-up both modes
            _decode(loaded, prompt, 4, batch, compiled)
            free: list[float] = []
            constrained: list[float] = []
            counts = [0, 0]
            for _ in range(args.reps):
                rate, count, _ = _decode(loaded, prompt, args.tokens, batch, None)
                free.append(rate)
                counts[0] += count
                rate, count, outs = _decode(loaded, prompt, args.tokens, batch, compiled)
                constrained.append(rate)
                counts[1] += count
                sample = outs[0]
            f, c = statistics.median(free), statistics.median(constrained)
            print(
                f"batch {batch}: unconstrained {f:7.1f} tok/s | constrained {c:7.1f} tok/s | "
                f"ratio {c / f:.3f} (median of {args.reps}; "
                f"{counts[0]} / {counts[1]} decoded tokens)"
            )
        fill, full = _mask_costs(loaded, compiled, sample)
        print(
            f"mask per token over {len(fill)} tokens: fill {statistics.mean(fill):.3f} ms mean, "
            f"{statistics.median(fill):.3f} median, {_pct(fill, 0.99):.3f} p99 | "
            f"fill+apply {statistics.mean(full):.3f} ms mean, {statistics.median(full):.3f} median"
        )
        text = tokenizer.decode(sample, skip_special=True)
        print(f"constrained sample: {text[:160]!r}{'...' if len(text) > 160 else ''}")


if __name__ == "__main__":
    main()
