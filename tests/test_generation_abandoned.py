"""`Encoder.abandoned` on a collected (JSON) answer: told only when the answer did not
come, never after a successful one."""

from __future__ import annotations

from typing import Any

import pytest
from fixtures.asgi import stand_in_app
from test_generation_job import ScriptedEngine
from test_responses_api import run

from mlxcel.server.openai_responses.encoder import ResponseEncoder


@pytest.mark.parametrize(("finish", "told"), [("stop", []), ("error", ["failed"])])
def test_abandoned_only_when_the_answer_failed(
    finish: str, told: list[str], hf_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    original = ResponseEncoder.abandoned

    def spy(self: ResponseEncoder, why: str) -> None:
        calls.append(why)
        original(self, why)

    monkeypatch.setattr(ResponseEncoder, "abandoned", spy)
    engine = ScriptedEngine(["Hi"], finish=finish, error="boom" if finish == "error" else None)
    app, _ = stand_in_app(hf_tokenizer, engine)

    async def call(_: Any, http: Any) -> Any:
        return await http.post("/v1/responses", json={"model": "m", "input": "Hello"})

    answer = run(app, call)
    assert answer.status_code == (200 if finish == "stop" else 500), answer.text
    assert calls == told
