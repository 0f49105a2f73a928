"""llama-server fidelity through a real `mlxcel serve`: --reasoning, underscore spellings,
--alias a,b and --tags everywhere, /metrics' Process-Start-Time-Unix, /slots of unused slots.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import API_KEY, AUTH, ServeProcess
from test_server_tools import QWEN_STYLE_TEMPLATE

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    template = tmp_path_factory.mktemp("tpl") / "qwen.jinja"
    template.write_text(QWEN_STYLE_TEMPLATE, encoding="utf-8")
    args = [
        "-m", str(tiny_llama_dir), "--ctx_size", "1024", "--parallel", "2",
        "--api_key", API_KEY, "--metrics", "--alias", "zeta, alpha,zeta", "--tags", "t2,t1",
        "--chat_template_file", str(template), "--reasoning", "off",
    ]  # fmt: skip
    with ServeProcess(args).start() as proc:
        yield proc.url


def _get(url: str, path: str) -> httpx.Response:
    return httpx.get(f"{url}{path}", headers=AUTH, timeout=60)


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=120)


def test_fresh_slots_have_no_task_fields_and_used_ones_do(server: str) -> None:
    fresh = _get(server, "/slots").json()
    assert [s["id"] for s in fresh] == [0, 1]
    for slot in fresh:
        assert "params" not in slot and "id_task" not in slot and "next_token" not in slot
        assert slot["is_processing"] is False and slot["n_ctx"] == 512
    answer = _post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2})
    assert answer.status_code == 200
    used, unused = _get(server, "/slots").json()
    assert "params" in used and used["params"]["temperature"] == pytest.approx(0.8)
    assert "params" not in unused


def test_alias_list_is_split_everywhere_and_tags_are_listed(server: str) -> None:
    models = _get(server, "/v1/models").json()["data"]
    assert len(models) == 1
    assert models[0]["id"] == "alpha"
    assert models[0]["aliases"] == ["alpha", "zeta"]
    assert models[0]["tags"] == ["t1", "t2"]
    assert _get(server, "/props").json()["model_alias"] == "alpha"
    answer = _post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 1}).json()
    assert answer["model"] == "alpha"
    completion = _post(server, "/v1/completions", {"prompt": "a", "max_tokens": 1}).json()
    assert completion["model"] == "alpha"


def test_metrics_has_the_process_start_header(server: str) -> None:
    response = _get(server, "/metrics")
    assert response.status_code == 200
    started = int(response.headers["Process-Start-Time-Unix"])
    assert 0 < time.time() - started < 3600


def test_reasoning_off_renders_thinking_off_and_splits_nothing(server: str) -> None:
    prompt = _post(server, "/apply-template", {"messages": HI}).json()["prompt"]
    assert not prompt.rstrip().endswith("<think>")
    # A request may still turn thinking on for itself: the template then opens the block.
    on = _post(
        server,
        "/apply-template",
        {"messages": HI, "chat_template_kwargs": {"enable_thinking": True}},
    ).json()["prompt"]
    assert on.rstrip().endswith("<think>")
    props = _get(server, "/props").json()
    assert props["default_generation_settings"]["params"]["reasoning_format"] == "none"


def test_wrong_type_errors_say_what_the_field_accepts(server: str) -> None:
    response = _post(server, "/v1/responses", {"input": 5})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] == "input: must be a string or an array"
    assert error["type"] == "invalid_request_error"
    chat = _post(server, "/v1/chat/completions", {"messages": HI, "temperature": "hot"})
    assert chat.status_code == 400
    assert chat.json()["error"]["message"].startswith("temperature: must be a number")
