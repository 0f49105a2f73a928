"""mlxcel's generation path vs `mlx_lm.stream_generate` on the same model, in one run.

Loads one model once, then alternates the two paths over several repetitions with the
same prompt and greedy settings, and prints prefill and decode tok/s with the ratio
mlxcel / mlx-lm (target: decode >= 0.98x).

    .venv/bin/python bench/generate_vs_mlx_lm.py [-m MODEL] [-p PROMPT_TOKENS] [-n TOKENS] [-r REPS]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _mlx_lm_run(model, tokenizer, prompt: list[int], n: int) -> tuple[float, float, int]:
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    # No end-of-sequence ids: like mlxcel's `ignore_eos`, so both decode exactly `n` tokens.
    wrapper = TokenizerWrapper(tokenizer.hf, eos_token_ids=[])
    last = None
    for response in stream_generate(
        model, wrapper, prompt, max_tokens=n, sampler=make_sampler(temp=0.0)
    ):
        last = response
    assert last is not None
    return last.prompt_tps, last.generation_tps, last.generation_tokens


def _mlxcel_run(engine, prompt: list[int], n: int) -> tuple[float, float, int]:
    from mlxcel.engine.sampling.params import SamplingParams
    from mlxcel.engine.text.request import GenerationRequest

    request = GenerationRequest(
        prompt_tokens=prompt,
        max_tokens=n,
        sampling=SamplingParams(temperature=0.0),
        ignore_eos=True,
        cache_prompt=False,
    )
    final = None
    for event in engine.generate(request):
        if event.finished:
            final = event
    assert final is not None and final.timings is not None
    t = final.timings
    # mlx-lm counts the first token in prefill time and rates the rest: do the same.
    return t.prompt_per_second, t.predicted_per_second, t.predicted_n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default=None, help="model (default: embedded SmolLM2)")
    parser.add_argument("-p", "--prompt-tokens", type=int, default=64)
    parser.add_argument("-n", "--tokens", type=int, default=32)
    parser.add_argument("-r", "--reps", type=int, default=3)
    args = parser.parse_args()

    from mlxcel.engine.loading import load_model
    from mlxcel.engine.text.scheduler import TextEngine

    loaded = load_model(args.model)
    text = "The quick brown fox jumps over the lazy dog. " * 64
    prompt = loaded.tokenizer.encode(text, add_special=True)[: args.prompt_tokens]
    engine = TextEngine(loaded, slots=1).start()
    try:
        _mlxcel_run(engine, prompt, 4)  # warm-up both paths
        _mlx_lm_run(loaded.model, loaded.tokenizer, prompt, 4)
        ours: list[tuple[float, float, int]] = []
        theirs: list[tuple[float, float, int]] = []
        for _ in range(args.reps):
            ours.append(_mlxcel_run(engine, prompt, args.tokens))
            theirs.append(_mlx_lm_run(loaded.model, loaded.tokenizer, prompt, args.tokens))
    finally:
        engine.stop()

    def med(rows: list[tuple[float, float, int]], i: int) -> float:
        return statistics.median(r[i] for r in rows)

    print(f"model: {loaded.info.name}  prompt: {len(prompt)} tokens  generate: {args.tokens}")
    print(f"{'':10} {'prefill tok/s':>14} {'decode tok/s':>13}")
    print(f"{'mlxcel':10} {med(ours, 0):14.1f} {med(ours, 1):13.2f}")
    print(f"{'mlx-lm':10} {med(theirs, 0):14.1f} {med(theirs, 1):13.2f}")
    print(
        f"ratio mlxcel/mlx-lm: prefill {med(ours, 0) / med(theirs, 0):.3f}x  "
        f"decode {med(ours, 1) / med(theirs, 1):.3f}x"
    )


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"({time.perf_counter() - start:.1f} s)")
