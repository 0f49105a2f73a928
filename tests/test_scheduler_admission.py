"""A request that fails while the engine admits it fails alone: the batch goes on."""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import pytest

from mlxcel.engine.sampling.params import SamplingParams
from mlxcel.engine.text.request import GenerationEvent, GenerationRequest


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama_dir: Path) -> Any:
    from mlxcel.engine.loading import load_model

    return load_model(str(tiny_llama_dir))


class _BrokenThinking:
    """A thinking budget whose logits processor cannot be built (fails in admission)."""

    def processor(self, tokenizer: Any) -> Any:
        raise RuntimeError("no processor for this request\nsecond line")


def _request(loaded: Any, request_id: str, max_tokens: int, **fields: Any) -> GenerationRequest:
    return GenerationRequest(
        prompt_tokens=loaded.tokenizer.encode("the morning train to the sea"),
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0),
        ignore_eos=True,
        cache_prompt=False,
        request_id=request_id,
        **fields,
    )


def _drain(sink: queue.SimpleQueue[GenerationEvent]) -> tuple[list[int], GenerationEvent]:
    tokens: list[int] = []
    while not (event := sink.get(timeout=120)).finished:
        tokens.extend(event.token_ids)
    return tokens, event


def test_a_request_failing_admission_fails_alone(tiny_loaded: Any) -> None:
    from mlxcel.engine.text.scheduler import TextEngine

    alone = TextEngine(tiny_loaded, slots=2, context_per_slot=256)
    try:
        expected = [t for e in alone.generate(_request(tiny_loaded, "a", 24)) for t in e.token_ids]
    finally:
        alone.stop()

    engine = TextEngine(tiny_loaded, slots=2, context_per_slot=256)
    running: queue.SimpleQueue[GenerationEvent] = queue.SimpleQueue()
    broken: queue.SimpleQueue[GenerationEvent] = queue.SimpleQueue()
    try:
        engine.submit(_request(tiny_loaded, "a", 24), running.put)
        first = running.get(timeout=120)  # "a" is decoding when "b" arrives
        engine.submit(_request(tiny_loaded, "b", 8, thinking=_BrokenThinking()), broken.put)
        tokens, end = _drain(running)
        failed_tokens, failed = _drain(broken)
        counters = engine.snapshot().counters
        slots = engine.snapshot().slots
    finally:
        engine.stop()
    assert failed.finish_reason == "error"
    assert failed.error == "no processor for this request"
    assert failed_tokens == []
    assert end.finish_reason == "length", end.error
    assert list(first.token_ids) + tokens == expected  # the batch went on, unchanged
    assert all(slot.state == "idle" for slot in slots)  # no slot is left held
    # "b" never started: counted as a request (an error), not as a started or completed
    # sequence
    assert (counters.requests_total, counters.sequences_started) == (2, 1)
    assert counters.sequences_completed == 1
