"""`Encoder.abandoned`: told only when the answer did not come (a failed collected answer,
a client gone mid-stream), never after a successful answer or a stream sent to its end."""

from __future__ import annotations

from typing import Any

import pytest
from fixtures.asgi import stand_in_app
from test_generation_job import ScriptedEngine, _drive, _got_a_data_chunk
from test_responses_api import run

from mlxcel.server.openai_responses.encoder import ResponseEncoder


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The `why` of every `ResponseEncoder.abandoned` call from now on."""
    calls: list[str] = []
    original = ResponseEncoder.abandoned

    def spy(self: ResponseEncoder, why: str) -> None:
        calls.append(why)
        original(self, why)

    monkeypatch.setattr(ResponseEncoder, "abandoned", spy)
    return calls


@pytest.mark.parametrize(("finish", "told"), [("stop", []), ("error", ["failed"])])
def test_abandoned_only_when_the_answer_failed(
    finish: str, told: list[str], hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _spy(monkeypatch)
    engine = ScriptedEngine(["Hi"], finish=finish, error="boom" if finish == "error" else None)
    app, _ = stand_in_app(hf_tokenizer, engine)

    async def call(_: Any, http: Any) -> Any:
        return await http.post("/v1/responses", json={"model": "m", "input": "Hello"})

    answer = run(app, call)
    assert answer.status_code == (200 if finish == "stop" else 500), answer.text
    assert calls == told


@pytest.mark.parametrize("finish", ["stop", "error"])
def test_a_stream_sent_to_its_end_is_not_abandoned(
    finish: str, hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream that ends normally (or tells its failure in-stream) was answered: the
    encoder is not told it was abandoned when the response closes."""
    calls = _spy(monkeypatch)
    engine = ScriptedEngine(["Hi"], finish=finish, error="boom" if finish == "error" else None)
    app, _ = stand_in_app(hf_tokenizer, engine)

    async def call(_: Any, http: Any) -> Any:
        body = {"model": "m", "input": "Hello", "stream": True}
        return await http.post("/v1/responses", json=body)

    answer = run(app, call)
    assert answer.status_code == 200, answer.text
    last = "response.completed" if finish == "stop" else "response.failed"
    assert f"event: {last}" in answer.text
    assert calls == []


def test_a_stream_whose_client_went_away_is_abandoned(
    hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _spy(monkeypatch)
    engine = ScriptedEngine(["Hi"], hold=True)
    app, _ = stand_in_app(hf_tokenizer, engine)
    body = {"model": "m", "input": "Hello", "stream": True}
    _drive(app, "/v1/responses", body, _got_a_data_chunk)  # gone after the first chunk
    assert calls == ["disconnected"]
