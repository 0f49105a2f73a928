"""Speculative decoding with prompt lookup: decode tok/s with and without it, on an edit task
(rewrite a given code block with one change, where the answer mostly copies the prompt) and on
free prose (where lookup rarely has anything to draft), plus the acceptance rate.

Both engines run in this process on the same loaded model (greedy, one slot, no prompt
cache, the engine's default adaptive policy), their repetitions alternating so a change in
machine load hits both; the outputs must be identical. Targets: lookup / plain >= 1.5x on
the edit task and >= 0.95x on prose.

    .venv/bin/python bench/speculative.py [-m MODEL] [-n TOKENS] [-r REPS] [--n-max N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

CODE = '''\
def summarize_orders(orders, tax_rate=0.2):
    """Return the subtotal, the tax and the total of a list of orders."""
    subtotal = 0.0
    for order in orders:
        price = order["price"]
        quantity = order.get("quantity", 1)
        if quantity <= 0:
            raise ValueError(f"bad quantity in order {order['id']}")
        subtotal += price * quantity
    tax = round(subtotal * tax_rate, 2)
    total = round(subtotal + tax, 2)
    return {"subtotal": subtotal, "tax": tax, "total": total}


def print_summary(orders):
    summary = summarize_orders(orders)
    for key, value in summary.items():
        print(f"{key:>10}: {value:10.2f}")
'''

TASKS = {
    "edit": (
        "```python\n" + CODE + "```\n\nRewrite the code above with one change: the default "
        "tax_rate becomes 0.25. Reply with the complete code only."
    ),
    "prose": (
        "Write a short story about a lighthouse keeper who finds a message in a bottle "
        "on a stormy night."
    ),
}


@dataclass
class Result:
    tokens: list[int]
    decode_tps: float
    draft_n: int
    accepted: int
    rounds: int


def _run(engine: Any, prompt: list[int], n: int) -> Result:
    from mlxcel.engine.sampling.params import SamplingParams
    from mlxcel.engine.text.request import GenerationRequest

    request = GenerationRequest(
        prompt_tokens=prompt,
        max_tokens=n,
        sampling=SamplingParams(temperature=0.0),
        cache_prompt=False,
    )
    tokens: list[int] = []
    final = None
    for event in engine.generate(request):
        tokens.extend(event.token_ids)
        if event.finished:
            final = event
    assert final is not None and final.timings is not None, final
    t = final.timings
    # Tokens after the first over the time from the first to the last (the first is prefill's).
    rate = (t.predicted_n - 1) / (t.predicted_ms / 1000) if t.predicted_ms > 0 else 0.0
    return Result(tokens, rate, t.draft_n, t.draft_n_accepted, t.draft_rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default=None, help="model (default: embedded SmolLM2)")
    parser.add_argument("-n", "--tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("-r", "--reps", type=int, default=1)
    parser.add_argument("--n-max", type=int, default=3, help="most drafted tokens per round")
    parser.add_argument(
        "--cpu-dtype", default="auto", choices=("auto", "float32", "keep"), help="as for serve"
    )
    args = parser.parse_args()

    from mlxcel.engine.loading import load_model
    from mlxcel.engine.prompting import chat_tokens
    from mlxcel.engine.text.scheduler import TextEngine
    from mlxcel.engine.text.speculative import SpeculationConfig

    loaded = load_model(args.model, cpu_dtype=args.cpu_dtype)
    config = SpeculationConfig("prompt-lookup", n_max=args.n_max)
    plain = TextEngine(loaded, slots=1).start()
    lookup = TextEngine(loaded, slots=1, speculation=config).start()
    prompts = {
        name: chat_tokens(loaded.tokenizer, [{"role": "user", "content": text}])
        for name, text in TASKS.items()
    }
    rows: dict[str, tuple[list[Result], list[Result]]] = {}
    try:
        warm = prompts["prose"][:16]
        _run(plain, warm, 4)
        _run(lookup, warm, 4)
        for name, prompt in prompts.items():
            ours: list[Result] = []
            base: list[Result] = []
            for _ in range(args.reps):
                base.append(_run(plain, prompt, args.tokens))
                ours.append(_run(lookup, prompt, args.tokens))
            rows[name] = (base, ours)
    finally:
        plain.stop()
        lookup.stop()

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"model: {loaded.info.name} ({loaded.info.quantization})  tokens: {args.tokens}  "
        f"reps: {args.reps}  n_max: {args.n_max}  load {load:.2f} on {os.cpu_count()} CPUs"
    )
    print(
        f"{'task':6} {'prompt':>6} {'gen':>4} {'plain tok/s':>11} {'lookup tok/s':>12} "
        f"{'ratio':>6} {'drafted':>7} {'accepted':>8} {'rate':>5} {'rounds':>6} same"
    )
    for name, (base, ours) in rows.items():
        b = statistics.median(r.decode_tps for r in base)
        o = statistics.median(r.decode_tps for r in ours)
        drafted = sum(r.draft_n for r in ours)
        accepted = sum(r.accepted for r in ours)
        rate = accepted / drafted if drafted else 0.0
        same = all(x.tokens == y.tokens for x, y in zip(base, ours, strict=True))
        print(
            f"{name:6} {len(prompts[name]):6d} {len(ours[0].tokens):4d} {b:11.2f} {o:12.2f} "
            f"{o / b:5.2f}x {drafted:7d} {accepted:8d} {rate:5.2f} "
            f"{sum(r.rounds for r in ours):6d} {'yes' if same else 'NO'}"
        )


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"({time.perf_counter() - start:.1f} s)")
