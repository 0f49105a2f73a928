"""mlxcel embeddings vs a plain direct-MLX BERT on all-MiniLM-L6-v2, in one run.

Embeds the same texts in calls of 1, 8 and 32 texts, alternating the two paths over
several repetitions, and prints texts/s with the ratio mlxcel / baseline.

- mlxcel: `Embedder.embed` (Rust tokenizer, length-bucketed batches, fused attention,
  pooling and normalization), and the same through the server's `EmbeddingWorker`
  (queue, worker thread, futures).
- baseline: a straightforward MLX BERT written here from the checkpoint's tensors
  (tokenizer padding to the longest input, explicit softmax attention, mean pooling,
  L2 normalization): what a user would write by hand with `mlx.core`.

Both paths must agree (max |difference| of the vectors is printed).

    .venv/bin/python bench/embeddings.py [-n TEXTS] [-r REPS] [-b 1,8,32]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

WORDS = [
    "the",
    "a",
    "man",
    "woman",
    "child",
    "dog",
    "cat",
    "eats",
    "reads",
    "writes",
    "bread",
    "food",
    "book",
    "river",
    "city",
    "market",
    "quickly",
    "slowly",
    "today",
    "yesterday",
    "under",
    "over",
    "near",
    "with",
    "without",
    "because",
    "while",
    "green",
    "red",
    "small",
    "large",
    "old",
    "new",
    "bright",
    "dark",
    "happy",
    "quiet",
    "loud",
    "morning",
    "evening",
    "street",
    "house",
    "garden",
]


def make_texts(n: int, seed: int = 0) -> list[str]:
    """`n` sentences of 6 to 40 words (a realistic spread of lengths)."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 40))).capitalize() + "."
        for _ in range(n)
    ]


class PlainBert:
    """A direct MLX BERT with mean pooling: the baseline."""

    def __init__(self, path: Path) -> None:
        import json

        import mlx.core as mx
        from tokenizers import Tokenizer

        self.mx = mx
        self.w: dict[str, Any] = dict(mx.load(str(path / "model.safetensors")))  # type: ignore[arg-type]
        config = json.loads((path / "config.json").read_text())
        self.layers = int(config["num_hidden_layers"])
        self.heads = int(config["num_attention_heads"])
        self.eps = float(config["layer_norm_eps"])
        self.tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tok.enable_truncation(256)
        self.tok.enable_padding()  # to the longest input of each call

    def _ln(self, x: Any, name: str) -> Any:
        mx = self.mx
        mean = x.mean(axis=-1, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
        return (x - mean) / mx.sqrt(var + self.eps) * self.w[name + ".weight"] + self.w[
            name + ".bias"
        ]

    def _lin(self, x: Any, name: str) -> Any:
        return x @ self.w[name + ".weight"].T + self.w[name + ".bias"]

    def embed(self, texts: list[str]) -> Any:
        import numpy as np

        mx = self.mx
        enc = self.tok.encode_batch(texts)
        ids = mx.array([e.ids for e in enc])
        mask = mx.array([e.attention_mask for e in enc]).astype(mx.float32)
        b, t = ids.shape
        w = self.w
        x = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][mx.arange(t)][None]
            + w["embeddings.token_type_embeddings.weight"][0]
        )
        x = self._ln(x, "embeddings.LayerNorm")
        bias = ((1.0 - mask) * -1e9)[:, None, None, :]
        d = x.shape[-1] // self.heads
        for i in range(self.layers):
            p = f"encoder.layer.{i}."

            def heads(y: Any) -> Any:
                return y.reshape(b, t, self.heads, d).transpose(0, 2, 1, 3)

            q = heads(self._lin(x, p + "attention.self.query"))
            k = heads(self._lin(x, p + "attention.self.key"))
            v = heads(self._lin(x, p + "attention.self.value"))
            att = mx.softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + bias, axis=-1)
            ctx = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, -1)
            x = self._ln(
                x + self._lin(ctx, p + "attention.output.dense"), p + "attention.output.LayerNorm"
            )
            h = self._lin(x, p + "intermediate.dense")
            h = 0.5 * h * (1.0 + mx.erf(h / math.sqrt(2.0)))
            x = self._ln(x + self._lin(h, p + "output.dense"), p + "output.LayerNorm")
        pooled = (x * mask[..., None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
        pooled = pooled / mx.linalg.norm(pooled, axis=-1, keepdims=True)
        mx.eval(pooled)
        return np.array(pooled)


def _rate(run: Any, texts: list[str], batch: int) -> tuple[float, Any]:
    import numpy as np

    start = time.perf_counter()
    parts = [run(texts[i : i + batch]) for i in range(0, len(texts), batch)]
    elapsed = time.perf_counter() - start
    return len(texts) / elapsed, np.concatenate(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--texts", type=int, default=64, help="texts per measurement")
    parser.add_argument("-r", "--reps", type=int, default=3)
    parser.add_argument("-b", "--batches", default="1,8,32", help="texts per call")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    import mlx.core as mx
    import numpy as np

    from mlxcel.engine.embeddings import default_embedding_model_dir, load_embedder
    from mlxcel.engine.workers import EmbeddingWorker

    path = default_embedding_model_dir()
    ours = load_embedder(None)
    plain = PlainBert(path)
    texts = make_texts(args.texts)
    worker = EmbeddingWorker(embedder=ours, batch_size=max(batches)).start()

    def run_ours(chunk: list[str]) -> Any:
        return ours.embed(chunk, batch_size=len(chunk)).matrix()

    def run_worker(chunk: list[str]) -> Any:
        return worker.embed(chunk).result().matrix()

    # Warm up every shape family once (MLX builds kernels on first use).
    for run in (run_ours, run_worker, plain.embed):
        _rate(run, texts[:8], 8)

    print(
        f"mlxcel embeddings benchmark: all-MiniLM-L6-v2, {len(texts)} texts of 6-40 words, "
        f"{args.reps} reps, device {mx.default_device()}"
    )
    print(
        f"{'batch':>5} {'mlxcel t/s':>11} {'worker t/s':>11} {'plain t/s':>10} "
        f"{'ratio':>6} {'worker':>7} {'max|diff|':>10}"
    )
    try:
        for batch in batches:
            ours_rates, worker_rates, plain_rates = [], [], []
            diff = 0.0
            for _ in range(args.reps):
                r1, a = _rate(run_ours, texts, batch)
                r2, b = _rate(run_worker, texts, batch)
                r3, c = _rate(plain.embed, texts, batch)
                ours_rates.append(r1)
                worker_rates.append(r2)
                plain_rates.append(r3)
                diff = max(diff, float(np.abs(a - c).max()), float(np.abs(b - c).max()))
            o, w, p = (statistics.median(x) for x in (ours_rates, worker_rates, plain_rates))
            print(
                f"{batch:>5} {o:>11.1f} {w:>11.1f} {p:>10.1f} {o / p:>5.2f}x {w / p:>6.2f}x "
                f"{diff:>10.2e}"
            )
    finally:
        worker.stop()


if __name__ == "__main__":
    main()
