"""The mlx-lm seam: the public names, signatures and behaviour mlxcel builds on.

When mlx-lm moves any of these, this module fails first and says what moved, instead of
the engine misbehaving somewhere downstream. It also checks that the installed mlx-lm is
inside the range pyproject.toml pins (the range these checks were last run on).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from packaging.requirements import Requirement

from mlxcel.engine.sampling.batched import BatchSampler, RowSampling
from mlxcel.engine.sampling.params import SamplingParams
from mlxcel.engine.sampling.samplers import make_sampler
from mlxcel.engine.text.batch_rows import BatchRows
from mlxcel.engine.text.decode_batch import DecodeBatch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def _params(func: Any) -> list[str]:
    return list(inspect.signature(func).parameters)


def test_installed_mlx_lm_is_in_the_pinned_range() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (pin,) = [Requirement(d) for d in project["dependencies"] if Requirement(d).name == "mlx-lm"]
    assert pin.specifier, "pyproject.toml must pin a range of mlx-lm"
    installed = version("mlx-lm")
    assert pin.specifier.contains(installed), (
        f"mlx-lm {installed} is outside the pinned range {pin.specifier}: run this module, "
        "fix what moved, then widen the pin"
    )


def test_batch_generator_signatures() -> None:
    from mlx_lm.generate import BatchGenerator

    init = _params(BatchGenerator.__init__)
    for name in ("model", "completion_batch_size", "prefill_batch_size", "prefill_step_size"):
        assert name in init, f"BatchGenerator() lost {name!r}"
    assert _params(BatchGenerator.insert)[1:] == [
        "prompts",
        "max_tokens",
        "caches",
        "all_tokens",
        "samplers",
        "logits_processors",
        "stop_sequences",
    ]
    assert _params(BatchGenerator.remove)[1:] == ["uids", "return_prompt_caches"]
    assert _params(BatchGenerator.next)[1:] == []
    assert callable(BatchGenerator.stats)


def test_the_batch_classes_decode_batch_builds_on() -> None:
    from mlx_lm.generate import GenerationBatch, PromptProcessingBatch, generation_stream
    from mlx_lm.sample_utils import greedy_sampler
    from mlx_lm.utils import maybe_set_recommended_wired_limit

    init = _params(PromptProcessingBatch.__init__)
    for name in (
        "model", "uids", "caches", "tokens", "prefill_step_size", "samplers",
        "fallback_sampler", "logits_processors", "stop_sequences", "max_tokens",
    ):  # fmt: skip
        assert name in init, f"PromptProcessingBatch() lost {name!r}"
    for cls, methods in (
        (PromptProcessingBatch, ("empty", "extend", "split", "filter", "prompt", "generate")),
        (GenerationBatch, ("empty", "extend", "filter", "next")),
    ):
        for method in (*methods, "extract_cache", "__len__"):
            assert callable(getattr(cls, method, None)), f"{cls.__name__} lost {method!r}"
    assert _params(PromptProcessingBatch.generate)[1:] == ["tokens"]
    with mx.stream(generation_stream):  # a stream (thread-local) to run the batches on
        assert mx.array([1]).item() == 1
    assert callable(greedy_sampler) and callable(maybe_set_recommended_wired_limit)


def test_response_fields() -> None:
    from mlx_lm.generate import GenerationBatch, PromptProcessingBatch

    gen = {f.name for f in dataclasses.fields(GenerationBatch.Response)}
    assert {"uid", "token", "logprobs", "finish_reason", "prompt_cache", "all_tokens"} <= gen
    prompt = {f.name for f in dataclasses.fields(PromptProcessingBatch.Response)}
    assert {"uid", "progress", "end_of_prompt"} <= prompt


def test_stop_sequences_and_other_public_names() -> None:
    from mlx_lm import stream_generate
    from mlx_lm.generate import StopSequences
    from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, make_prompt_cache
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from mlx_lm.utils import load

    matcher = StopSequences([[7], [1, 2]]).matcher()
    assert [matcher.advance(t) for t in (1, 2, 7, 3)] == [False, True, True, False]
    assert not StopSequences(None).matcher().advance(7)
    assert "return_config" in _params(load)
    for name in ("model", "tokenizer", "prompt", "max_tokens", "kwargs"):
        assert name in _params(stream_generate)
    cache = KVCache()
    for attr in ("keys", "values", "offset", "state", "nbytes", "trim", "is_trimmable"):
        assert hasattr(cache, attr), f"KVCache lost {attr!r}"
    assert callable(make_prompt_cache) and callable(can_trim_prompt_cache)
    assert callable(TokenizerWrapper)


def test_the_cache_classes_the_kv_types_build_on() -> None:
    """`engine/text/kv_types.py` subclasses these and `slot_files.py` saves with them."""
    from mlx_lm.models import base
    from mlx_lm.models.cache import (
        BatchKVCache,
        BatchRotatingKVCache,
        QuantizedKVCache,
        RotatingKVCache,
        create_causal_mask,
        dynamic_roll,
        load_prompt_cache,
        save_prompt_cache,
    )

    for cls in (BatchKVCache, BatchRotatingKVCache):
        for method in ("merge", "extract", "filter", "extend", "prepare", "finalize"):
            assert callable(getattr(cls, method, None)), f"{cls.__name__} lost {method!r}"
    assert callable(RotatingKVCache.merge)
    quantized = QuantizedKVCache(group_size=32, bits=8)
    assert (quantized.group_size, quantized.bits) == (32, 8)
    assert _params(base.quantized_scaled_dot_product_attention) == [
        "queries", "q_keys", "q_values", "scale", "mask", "group_size", "bits",
    ]  # fmt: skip
    assert "left_padding" in _params(create_causal_mask)
    assert _params(dynamic_roll) == ["x", "shifts", "axis"]
    assert _params(save_prompt_cache) == ["file_name", "cache", "metadata"]
    assert _params(load_prompt_cache) == ["file_name", "return_metadata"]


# -- behaviour ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> Any:
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=16,
        num_hidden_layers=1,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=50,
        tie_word_embeddings=True,
    )
    mx.random.seed(0)
    return llama.Model(args)


def test_one_shared_sampler_samples_the_batch_in_one_call(model: Any) -> None:
    from mlx_lm.generate import BatchGenerator

    sizes: list[int] = []

    def sampler(logprobs: mx.array) -> mx.array:
        sizes.append(logprobs.shape[0])
        return mx.argmax(logprobs, axis=-1)

    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    gen.insert([[1, 2, 3]] * 4, max_tokens=[3] * 4, samplers=[sampler] * 4)
    with gen.stats() as stats:
        while gen.next_generated():
            pass
    gen.close()
    assert sizes and all(n == 4 for n in sizes)
    assert stats.generation_steps >= 2 and stats.prompt_tokens >= 4
    for name in ("prompt_tokens", "prompt_time", "decode_time", "generation_steps"):
        assert hasattr(stats, name), f"BatchStats lost {name!r}"


SETTINGS = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.2, seed=2, top_k=5),
    SamplingParams(temperature=1.0, seed=3, top_k=0, top_p=0.7),
)


def test_decode_batch_steps_as_the_batch_generator_and_names_every_sampled_row(
    model: Any,
) -> None:
    """`DecodeBatch` schedules as mlx-lm's `BatchGenerator` (the same responses, step for
    step: joins, chunked prompts, one-token prompts, removals, finishes), and the rows it
    names before each sampler call are the call's: every row of a shared `BatchSampler`
    gets the tokens its own sampler gives it."""
    from mlx_lm.generate import BatchGenerator

    prompts = [list(range(1, 12)), [4], [5, 6], list(range(1, 30)), [3, 3], [9] * 9]

    def run(kind: str) -> list[Any]:
        sampler = BatchSampler()
        book = BatchRows(sampler)
        sizes = dict(completion_batch_size=4, prefill_batch_size=4, prefill_step_size=4)
        gen: Any
        if kind == "mlx-lm":
            gen = BatchGenerator(model, **sizes)
        else:
            before = book.before_sampling if kind == "batched" else None
            gen = DecodeBatch(model, **sizes, before_sampling=before)
        steps: list[Any] = []
        out: dict[int, list[int]] = {}
        which: dict[int, int] = {}
        live: set[int] = set()
        waiting = list(range(len(prompts)))
        removed = False

        def insert(i: int) -> None:
            params = SETTINGS[i % len(SETTINGS)]
            row = RowSampling(params, 50)
            (uid,) = gen.insert(
                [prompts[i]],
                max_tokens=[6 + 2 * i],
                samplers=[sampler if kind == "batched" else make_sampler(params)],
            )
            book.insert(uid, row)
            which[uid], out[i] = i, []
            live.add(uid)

        for i in waiting[:3]:
            insert(i)
        del waiting[:3]
        for _ in range(500):
            if not live and not waiting:
                break
            prompt_responses, responses = gen.next()
            book.after_step(responses)
            steps.append(
                (
                    [
                        (p.uid, tuple(p.progress), p.end_of_segment, p.end_of_prompt)
                        for p in prompt_responses
                    ],
                    [(r.uid, int(r.token), r.finish_reason) for r in responses],
                )
            )
            for r in responses:
                out[which[r.uid]].append(int(r.token))
                if r.finish_reason is not None:
                    live.discard(r.uid)
            two = [
                r.uid for r in responses if r.finish_reason is None and len(out[which[r.uid]]) == 2
            ]
            if not removed and two:
                gen.remove([two[0]])  # taken out mid-decode, as a stop word does
                book.remove(two[0])
                live.discard(two[0])
                removed = True
            while waiting and len(live) < 4:
                insert(waiting.pop(0))
        gen.close()
        assert removed and not live and not waiting
        assert not book.rows  # every finished or removed row forgotten
        assert sum(len(v) for v in out.values()) > 30
        return steps

    reference = run("mlx-lm")
    assert run("per-request") == reference
    assert run("batched") == reference


def test_decode_batch_returns_caches_and_counts_its_work(model: Any) -> None:
    gen = DecodeBatch(model, completion_batch_size=2, prefill_batch_size=2, prefill_step_size=4)
    with pytest.raises(ValueError, match="empty prompt"):
        gen.insert([[]], max_tokens=[3])
    a, b, c = gen.insert([[1, 2, 3, 4, 5, 6], [7, 8], [9]], max_tokens=[5, 5, 5])
    assert (a, b, c) == (0, 1, 2)
    with gen.stats() as stats:
        for _ in range(3):  # a and b prefill (4 + 1 tokens, then 1) and join; then c joins
            gen.next()
    assert stats.prompt_tokens == 6 and stats.generation_steps == 1
    caches = gen.remove([a, c], return_prompt_caches=True)
    assert set(caches) == {a, c}
    assert caches[c][1] == [9] and caches[a][1] == [1, 2, 3, 4, 5, 6]  # what each cache holds
    while gen.next()[1]:
        pass
    gen.close()
