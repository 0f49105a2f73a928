"""Local throughput benchmark: prefill and decode tok/s of the text engine (and of mlx-lm).

Tests follow llama-bench's naming: `ppN` processes a prompt of exactly N tokens and rates
prompt tokens per second; `tgN` generates N tokens (greedy, EOS ignored, no prompt cache)
after a short prompt and rates the tokens after the first one, from the first token to the
last; with a batch B > 1 it runs B sequences at once and reports the aggregate rate. Every
test runs once untimed (warm-up), then `repetitions` times. With `compare_mlx_lm` the same
workload also runs through mlx-lm (`stream_generate` for one sequence, its `BatchGenerator`
for several) on the same model object, repetitions interleaved so drift hits both alike.
"""

from __future__ import annotations

import math
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlxcel.engine.errors import EngineError
from mlxcel.engine.loading.model import LoadedModel

ENGINE = "mlxcel"
MLX_LM = "mlx-lm"
TG_PROMPT_TOKENS = 8
"""Prompt length of the decode tests (llama-bench's tg runs from an almost empty context)."""

_FILLER = (
    "The quick brown fox jumps over the lazy dog while the morning train leaves the "
    "station, and a small crowd waits by the river for the market to open. "
)

Progress = Callable[[str], None]


class BenchError(EngineError):
    """The benchmark cannot run as asked (bad sizes, context too small, a failed run)."""


@dataclass(frozen=True)
class BenchConfig:
    """What to measure; `n_prompt` 0 skips prefill tests, `n_gen` 0 skips decode tests."""

    n_prompt: int = 512
    n_gen: int = 128
    repetitions: int = 3
    batches: tuple[int, ...] = (1,)
    prefill_chunk: int = 2048
    warmup: bool = True
    compare_mlx_lm: bool = False

    def validate(self) -> None:
        """Raise BenchError (one line) for the first invalid field."""
        if self.n_prompt < 0 or self.n_gen < 0:
            raise BenchError("-p and -n must be >= 0")
        if self.n_prompt == 0 and self.n_gen == 0:
            raise BenchError("nothing to measure: -p and -n are both 0")
        if self.n_gen == 1:
            raise BenchError("-n must be 0 (skip decode) or >= 2 (decode is timed after token 1)")
        if self.repetitions < 1:
            raise BenchError("-r must be >= 1")
        if not self.batches or any(b < 1 for b in self.batches):
            raise BenchError("--batch sizes must be >= 1")


@dataclass(frozen=True)
class ModelSummary:
    """The model and backend a report was measured on."""

    name: str
    path: str
    architecture: str
    quantization: str
    size_bytes: int
    n_params: int
    backend: str  # "CPU" | "Metal" | "CUDA"
    blas: str  # what MLX's CPU matmuls run on ("" off the CPU backend)
    cpu_kernels: str = ""  # mlxcel's CPU kernel status ("" off the CPU backend)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "architecture": self.architecture,
            "quantization": self.quantization,
            "size_bytes": self.size_bytes,
            "n_params": self.n_params,
            "backend": self.backend,
            "blas": self.blas,
            "cpu_kernels": self.cpu_kernels,
        }


@dataclass
class TestResult:
    """One test on one engine: tok/s per repetition, and the peak memory it reached."""

    engine: str  # "mlxcel" | "mlx-lm"
    kind: str  # "pp" | "tg"
    n_prompt: int
    n_gen: int
    batch: int
    samples: list[float] = field(default_factory=list)
    peak_memory_bytes: int = 0

    @property
    def name(self) -> str:
        """llama-bench's test name: `pp512`, `tg128`."""
        return f"pp{self.n_prompt}" if self.kind == "pp" else f"tg{self.n_gen}"

    @property
    def mean(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples else 0.0

    @property
    def stddev(self) -> float:
        """Sample standard deviation (0 with a single repetition)."""
        n = len(self.samples)
        if n < 2:
            return 0.0
        mean = self.mean
        return math.sqrt(sum((s - mean) ** 2 for s in self.samples) / (n - 1))

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "test": self.name,
            "kind": self.kind,
            "n_prompt": self.n_prompt,
            "n_gen": self.n_gen,
            "batch": self.batch,
            "tokens_per_second": self.mean,
            "stddev": self.stddev,
            "samples": list(self.samples),
            "peak_memory_bytes": self.peak_memory_bytes,
        }


@dataclass(frozen=True)
class Comparison:
    """mlxcel's mean over mlx-lm's mean for one test."""

    test: str
    batch: int
    mlxcel: float
    mlx_lm: float

    @property
    def ratio(self) -> float:
        return self.mlxcel / self.mlx_lm if self.mlx_lm > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "test": self.test,
            "batch": self.batch,
            "mlxcel": self.mlxcel,
            "mlx_lm": self.mlx_lm,
            "ratio": self.ratio,
        }


@dataclass
class BenchReport:
    """Everything `mlxcel bench` prints."""

    model: ModelSummary
    config: BenchConfig
    results: list[TestResult]

    def comparisons(self) -> list[Comparison]:
        """One entry per test measured on both engines."""
        theirs = {(r.name, r.batch): r for r in self.results if r.engine == MLX_LM}
        out: list[Comparison] = []
        for r in self.results:
            other = theirs.get((r.name, r.batch))
            if r.engine == ENGINE and other is not None:
                out.append(Comparison(r.name, r.batch, r.mean, other.mean))
        return out

    def to_dict(self) -> dict[str, Any]:
        """The documented JSON shape (docs/bench.md)."""
        data: dict[str, Any] = {
            "model": self.model.to_dict(),
            "config": {
                "n_prompt": self.config.n_prompt,
                "n_gen": self.config.n_gen,
                "repetitions": self.config.repetitions,
                "batch": list(self.config.batches),
                "prefill_chunk": self.config.prefill_chunk,
                "tg_prompt_tokens": TG_PROMPT_TOKENS,
            },
            "results": [r.to_dict() for r in self.results],
        }
        if self.config.compare_mlx_lm:
            data["compare"] = [c.to_dict() for c in self.comparisons()]
        return data


# --------------------------------------------------------------------------- public API


def summarize_model(loaded: LoadedModel) -> ModelSummary:
    """Name, size in memory, parameter count (quantized weights unpacked) and backend."""
    import mlx.core as mx

    from mlxcel.engine.blas import blas_in_use
    from mlxcel.engine.cpu_kernels.build import kernel_status

    size, n_params = _weights(loaded.model)
    if mx.default_device().type == mx.DeviceType.gpu:
        backend = "Metal" if mx.metal.is_available() else "CUDA"
        blas = kernels = ""
    else:
        backend, blas, kernels = "CPU", blas_in_use(), kernel_status()
    info = loaded.info
    return ModelSummary(
        name=info.name,
        path=str(info.path),
        architecture=info.architecture,
        quantization=info.quantization,
        size_bytes=size,
        n_params=n_params,
        backend=backend,
        blas=blas,
        cpu_kernels=kernels,
    )


def synthetic_prompt(loaded: LoadedModel, n_tokens: int) -> list[int]:
    """Exactly `n_tokens` ids: repeated English text, BOS first when the model wants one."""
    tokenizer = loaded.tokenizer
    ids = tokenizer.encode(_FILLER, add_special=True)
    body = tokenizer.encode(_FILLER, add_special=False) or ids
    while len(ids) < n_tokens:  # repeat ids, not text: no over-long encode warnings
        ids += body
    return ids[:n_tokens]


def run_bench(
    loaded: LoadedModel, config: BenchConfig, *, progress: Progress | None = None
) -> BenchReport:
    """Run every test of `config` on `loaded`; raise BenchError when it cannot."""
    config.validate()
    _check_context(loaded, config)
    say = progress or (lambda _message: None)
    runners: list[_Runner] = [_EngineRunner(loaded, config.prefill_chunk)]
    if config.compare_mlx_lm:
        runners.append(_MlxLmRunner(loaded, config.prefill_chunk))
    results: list[TestResult] = []
    try:
        for kind, n_prompt, n_gen, batch in _tests(config):
            prompt = synthetic_prompt(loaded, n_prompt)
            prompts = [prompt] * batch
            max_tokens = 1 if kind == "pp" else n_gen
            name = f"pp{n_prompt}" if kind == "pp" else f"tg{n_gen}"
            label = name if batch == 1 else f"{name} x{batch}"
            rows = [TestResult(r.name, kind, n_prompt, n_gen, batch) for r in runners]
            if config.warmup:
                for runner in runners:
                    say(f"{label}: warm-up ({runner.name})")
                    runner.run(prompts, max_tokens if kind == "pp" else min(n_gen, 4))
            for rep in range(config.repetitions):
                for runner, row in zip(runners, rows, strict=True):
                    say(f"{label}: run {rep + 1}/{config.repetitions} ({runner.name})")
                    row.samples.append(_measure(runner, row, prompts, max_tokens))
            results.extend(rows)
    finally:
        for runner in runners:
            runner.close()
    return BenchReport(summarize_model(loaded), config, results)


# ----------------------------------------------------------------------------- internals


def _tests(config: BenchConfig) -> list[tuple[str, int, int, int]]:
    tests: list[tuple[str, int, int, int]] = []
    if config.n_prompt > 0:
        tests.append(("pp", config.n_prompt, 0, 1))
    if config.n_gen > 0:
        tests.extend(("tg", TG_PROMPT_TOKENS, config.n_gen, b) for b in config.batches)
    return tests


def _check_context(loaded: LoadedModel, config: BenchConfig) -> None:
    context = loaded.info.context_length
    if config.n_prompt > 0 and config.n_prompt >= context:
        raise BenchError(f"-p {config.n_prompt} does not fit the model's context ({context})")
    if config.n_gen > 0 and TG_PROMPT_TOKENS + config.n_gen > context:
        raise BenchError(f"-n {config.n_gen} does not fit the model's context ({context})")


def _measure(runner: _Runner, row: TestResult, prompts: list[list[int]], max_tokens: int) -> float:
    """One timed repetition: its tok/s; folds the run's peak memory into `row`."""
    import mlx.core as mx

    mx.reset_peak_memory()
    runs = runner.run(prompts, max_tokens)
    row.peak_memory_bytes = max(row.peak_memory_bytes, int(mx.get_peak_memory()))
    if row.kind == "pp":
        return _prefill_rate(runs)
    return _decode_rate(runs)


@dataclass(frozen=True)
class _Run:
    """One sequence's clock: `start` (work began), first and last token, tokens made."""

    start: float
    first: float
    last: float
    prompt_n: int
    tokens: int


def _prefill_rate(runs: Sequence[_Run]) -> float:
    prompt = sum(r.prompt_n for r in runs)
    span = max(r.first for r in runs) - min(r.start for r in runs)
    if span <= 0:
        raise BenchError("prefill finished in no measurable time")
    return prompt / span


def _decode_rate(runs: Sequence[_Run]) -> float:
    """Tokens after each sequence's first one, over first-token-to-last-token time."""
    tokens = sum(max(0, r.tokens - 1) for r in runs)
    span = max(r.last for r in runs) - min(r.first for r in runs)
    if tokens == 0 or span <= 0:
        raise BenchError("decode produced fewer than two tokens per sequence")
    return tokens / span


class _Runner:
    name = ""

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[_Run]:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the runner holds."""


class _EngineRunner(_Runner):
    """mlxcel's `TextEngine`, one per batch size (slots = the batch)."""

    name = ENGINE

    def __init__(self, loaded: LoadedModel, prefill_chunk: int) -> None:
        self.loaded = loaded
        self.prefill_chunk = prefill_chunk
        self.engines: dict[int, Any] = {}

    def _engine(self, slots: int) -> Any:
        from mlxcel.engine.text.scheduler import TextEngine

        engine = self.engines.get(slots)
        if engine is None:
            engine = TextEngine(
                self.loaded,
                slots=slots,
                prefill_chunk=self.prefill_chunk,
                max_queue_depth=max(64, slots),
            )
            self.engines[slots] = engine.start()
        return engine

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[_Run]:
        from mlxcel.engine.sampling.params import SamplingParams
        from mlxcel.engine.text.request import GenerationEvent, GenerationRequest

        engine = self._engine(len(prompts))
        done: queue.SimpleQueue[tuple[GenerationEvent, float]] = queue.SimpleQueue()

        def sink(event: GenerationEvent) -> None:
            if event.finished:
                done.put((event, time.perf_counter()))

        greedy = SamplingParams(temperature=0.0)
        try:
            for prompt in prompts:
                request = GenerationRequest(
                    prompt_tokens=list(prompt),
                    max_tokens=max_tokens,
                    sampling=greedy,
                    ignore_eos=True,
                    cache_prompt=False,
                )
                engine.submit(request, sink)
        except EngineError as exc:  # context, vocabulary or queue problems
            raise BenchError(str(exc)) from exc
        runs: list[_Run] = []
        for _ in prompts:
            event, end = done.get()
            if event.finish_reason != "length" or event.timings is None:
                raise BenchError(
                    f"generation ended with {event.finish_reason}: {event.error or 'no detail'}"
                )
            t = event.timings
            first = end - t.predicted_ms / 1000
            runs.append(_Run(first - t.prompt_ms / 1000, first, end, t.prompt_n, t.predicted_n))
        return runs

    def close(self) -> None:
        for engine in self.engines.values():
            engine.stop()
        self.engines.clear()


class _MlxLmRunner(_Runner):
    """mlx-lm on the same model object: `stream_generate`, or `BatchGenerator` for a batch."""

    name = MLX_LM

    def __init__(self, loaded: LoadedModel, prefill_chunk: int) -> None:
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        self.model = loaded.model
        self.prefill_chunk = prefill_chunk
        self.tokenizer = TokenizerWrapper(loaded.tokenizer.hf)
        self.tokenizer.eos_token_ids = set()  # the same workload: EOS never ends a run

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[_Run]:
        if len(prompts) == 1:
            return [self._single(prompts[0], max_tokens)]
        return self._batch(prompts, max_tokens)

    def _single(self, prompt: list[int], max_tokens: int) -> _Run:
        from mlx_lm import stream_generate

        start = time.perf_counter()
        first = last = 0.0
        tokens = 0
        for response in stream_generate(
            self.model,
            self.tokenizer,
            prompt,
            max_tokens=max_tokens,
            prefill_step_size=self.prefill_chunk,
        ):
            last = time.perf_counter()
            first = first or last
            tokens = response.generation_tokens
        return _Run(start, first, last, len(prompt), tokens)

    def _batch(self, prompts: list[list[int]], max_tokens: int) -> list[_Run]:
        from mlx_lm.generate import BatchGenerator

        n = len(prompts)
        generator = BatchGenerator(
            self.model,
            completion_batch_size=n,
            prefill_batch_size=n,
            prefill_step_size=self.prefill_chunk,
        )
        start = time.perf_counter()
        uids = generator.insert([list(p) for p in prompts], [max_tokens] * n)
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        count = dict.fromkeys(uids, 0)
        try:
            while responses := generator.next_generated():
                now = time.perf_counter()
                for r in responses:
                    first.setdefault(r.uid, now)
                    last[r.uid] = now
                    count[r.uid] += 1
        finally:
            generator.close()
        return [
            _Run(start, first[u], last[u], len(prompts[i]), count[u]) for i, u in enumerate(uids)
        ]


def _weights(model: Any) -> tuple[int, int]:
    """Bytes of the weights in memory and the parameter count, quantized weights unpacked."""
    from mlx.utils import tree_flatten

    bits = {
        name: int(module.bits)
        for name, module in model.named_modules()
        if isinstance(getattr(module, "bits", None), int) and hasattr(module, "scales")
    }
    # layers the CPU kernel holds in its int8 tiles (cpu_kernels.layers); a tiled embedding
    # keeps MLX's arrays too, which count its parameters
    tiled = {
        name: int(module.out_features) * int(module.in_features) if "weight" not in module else 0
        for name, module in model.named_modules()
        if "packed" in module
    }
    size = 0
    n_params = 0
    leaves: Any = tree_flatten(model.parameters())
    for path, value in leaves:
        size += int(value.nbytes)
        owner, _, leaf = path.rpartition(".")
        if owner in tiled and leaf == "packed":
            n_params += tiled[owner]
        elif owner in bits:
            if leaf == "weight":
                n_params += int(value.size) * 32 // bits[owner]
            elif leaf not in ("scales", "biases", "dense"):  # dense: a float32 copy
                n_params += int(value.size)
        else:
            n_params += int(value.size)
    return size, n_params
