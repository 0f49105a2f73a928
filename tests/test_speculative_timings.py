"""`timings` with draft counters on the OpenAI routes: present only after a verify round."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from sse_reader import sse_json
from test_server_tools import PLAIN_TEMPLATE, ScriptedEngine, make_app, run

from mlxcel.engine.text.request import GenerationEvent, GenerationRequest, Timings

DRAFT = {"draft_n": 6, "draft_n_accepted": 4, "draft_rounds": 2, "draft_kind": "prompt-lookup"}


class TimedEngine(ScriptedEngine):
    """The scripted engine, whose final event carries `timings`."""

    def __init__(self, tokens: list[str], timings: Timings) -> None:
        super().__init__(tokens)
        self.timings = timings

    def submit(self, request: GenerationRequest, sink: Any) -> None:
        def with_timings(event: GenerationEvent) -> None:
            if event.finished:
                event.timings = self.timings
            sink(event)

        super().submit(request, with_timings)


def _app(hf_tokenizer: Any, timings: Timings) -> Any:
    app, _ = make_app(hf_tokenizer, ["a", "b"], template=PLAIN_TEMPLATE)
    app.state.mlxcel.client.engine = TimedEngine(["a", "b"], timings)
    return app


def _post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async def call(_: Any) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.post(path, json=body)

    return run(app, call)  # type: ignore[no-any-return]


CASES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ("/v1/completions", {"prompt": "x"}),
]


@pytest.mark.parametrize(("path", "body"), CASES)
def test_timings_with_draft_counters_after_a_verify_round(
    hf_tokenizer: Any, path: str, body: dict[str, Any]
) -> None:
    app = _app(hf_tokenizer, Timings(prompt_n=3, predicted_n=2, predicted_ms=10.0, **DRAFT))
    answer = _post(app, path, body).json()
    assert {k: answer["timings"][k] for k in DRAFT} == DRAFT
    assert answer["timings"]["predicted_n"] == 2
    chunks = sse_json(_post(app, path, {**body, "stream": True}).text)
    with_timings = [c for c in chunks if "timings" in c]
    assert len(with_timings) == 1
    assert with_timings[0]["choices"][0]["finish_reason"] == "stop"
    assert with_timings[0]["timings"]["draft_rounds"] == 2


@pytest.mark.parametrize(("path", "body"), CASES)
def test_no_timings_without_speculation(hf_tokenizer: Any, path: str, body: dict[str, Any]) -> None:
    app = _app(hf_tokenizer, Timings(prompt_n=3, predicted_n=2))
    assert "timings" not in _post(app, path, body).json()
    chunks = sse_json(_post(app, path, {**body, "stream": True}).text)
    assert not any("timings" in c for c in chunks)


def test_timings_dict_adds_draft_fields_only_after_a_round() -> None:
    assert "draft_n" not in Timings(prompt_n=1).to_dict()
    assert Timings(**DRAFT).to_dict()["draft_kind"] == "prompt-lookup"


def test_prompt_lookup_through_the_real_server(tiny_llama_dir: Path) -> None:
    """`--spec-type ngram-simple`: same greedy text as without it, and draft timings."""
    from server_harness import ServeProcess

    prompt = " ".join(["a b c d e f g"] * 4)
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0}
    texts = []
    for extra in (["--spec-type", "ngram-simple", "--spec-draft-n-max", "4"], []):
        with ServeProcess(["-m", str(tiny_llama_dir), "-np", "1", *extra]).start() as server:
            answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
        texts.append(answer["choices"][0]["text"])
        if extra:
            assert answer["timings"]["draft_rounds"] >= 1
            assert answer["timings"]["draft_kind"] == "prompt-lookup"
        else:
            assert "timings" not in answer
    assert texts[0] == texts[1]
