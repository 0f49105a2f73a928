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


def test_the_row_book_follows_the_generator(model: Any) -> None:
    """`BatchRows`' model of the batch (order, joins, chunked prompts, one-token prompts,
    removals, finishes) holds on a real generator, and every row gets the tokens its own
    closure gives it when each sequence samples alone."""
    from mlx_lm.generate import BatchGenerator

    prompts = [list(range(1, 12)), [4], [5, 6], list(range(1, 30)), [3, 3], [9] * 9]

    def run(batched: bool) -> dict[int, list[int]]:
        sampler = BatchSampler()
        book = BatchRows(sampler)
        gen = BatchGenerator(
            model, completion_batch_size=4, prefill_batch_size=4, prefill_step_size=4
        )
        out: dict[int, list[int]] = {}
        which: dict[int, int] = {}
        live: set[int] = set()
        waiting = list(range(len(prompts)))
        removed = False

        def insert(i: int) -> None:
            params = SETTINGS[i % len(SETTINGS)]
            (uid,) = gen.insert(
                [prompts[i]],
                max_tokens=[6 + 2 * i],
                samplers=[sampler if batched else make_sampler(params)],
            )
            book.insert(uid, len(prompts[i]), RowSampling(params, 50))
            which[uid], out[i] = i, []
            live.add(uid)

        for i in waiting[:3]:
            insert(i)
        del waiting[:3]
        for _ in range(500):
            if not live and not waiting:
                break
            if batched:
                book.before_step()
            prompt_responses, responses = gen.next()
            if batched:
                book.after_step(prompt_responses, responses)  # BatchRowsError: the seam moved
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
        return out

    batched = run(batched=True)
    assert batched == run(batched=False)
    assert sum(len(v) for v in batched.values()) > 30
