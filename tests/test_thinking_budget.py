"""Thinking budget (`--reasoning-budget`, `thinking_budget_tokens` & co.) and template kwargs.

The processor is checked on its own with hand-made logits; the server path with the real
tiny model behind `mlxcel serve` (the Qwen-style test template opens `<think>` in the
generation prompt when `enable_thinking` is true), and the request mapping with the
scripted stand-in engine of `test_server_tools`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import pytest
from server_harness import API_KEY, AUTH, ServeProcess
from test_server_tools import QWEN_STYLE_TEMPLATE, create, make_app

from mlxcel.engine.text.thinking_budget import ThinkingBudgetProcessor

OPEN, CLOSE = (7,), (8, 9)  # a one-token open tag, a two-token close tag
VOCAB = 16


def _drive(proc: ThinkingBudgetProcessor, prompt: list[int], preferred: list[int]) -> list[int]:
    """Generate with logits that always favour `preferred[i]`; return the tokens taken."""
    tokens = list(prompt)
    out: list[int] = []
    for want in preferred:
        logits = mx.zeros((1, VOCAB))
        logits[0, want] = 5.0
        masked = proc(mx.array(tokens), logits)
        assert masked.shape == logits.shape
        token = int(mx.argmax(masked, axis=-1).item())
        tokens.append(token)
        out.append(token)
    return out


def test_budget_forces_the_close_tag_after_n_tokens() -> None:
    proc = ThinkingBudgetProcessor(3, open_ids=OPEN, close_ids=CLOSE, start_in_reasoning=True)
    out = _drive(proc, [1, 2, 7], [4, 4, 4, 4, 4, 4, 4])
    assert out == [4, 4, 4, 8, 9, 4, 4]
    assert proc.done


def test_budget_zero_closes_at_once_and_counts_only_inside() -> None:
    proc = ThinkingBudgetProcessor(0, open_ids=OPEN, close_ids=CLOSE, start_in_reasoning=False)
    # Outside reasoning nothing is touched; an opened block is closed right away.
    assert _drive(proc, [1], [3, 3, 7, 5, 5, 5]) == [3, 3, 7, 8, 9, 5]


def test_model_closing_itself_ends_the_budget() -> None:
    proc = ThinkingBudgetProcessor(4, open_ids=OPEN, close_ids=CLOSE, start_in_reasoning=True)
    assert _drive(proc, [1], [5, 8, 9, 5, 5, 5, 5]) == [5, 8, 9, 5, 5, 5, 5]
    assert proc.done


# ------------------------------------------------------------------ through the server


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    template = tmp_path_factory.mktemp("tpl") / "qwen.jinja"
    template.write_text(QWEN_STYLE_TEMPLATE, encoding="utf-8")
    args = ["-m", str(tiny_llama_dir), "-np", "2", "-c", "4096", "--api-key", API_KEY]
    with ServeProcess([*args, "--chat-template-file", str(template)]).start() as proc:
        yield proc.url


def _chat(url: str, **body: Any) -> httpx.Response:
    payload = {
        "messages": [{"role": "user", "content": "Think, then answer."}],
        "temperature": 0,
        "max_tokens": 24,
        "logprobs": True,
        "chat_template_kwargs": {"enable_thinking": True},
        **body,
    }
    return httpx.post(f"{url}/v1/chat/completions", json=payload, headers=AUTH, timeout=120)


def _reasoning_tokens(answer: dict[str, Any]) -> int | None:
    """Generated tokens before `</think>` (None: the block never closed)."""
    tokens = [t["token"] for t in answer["choices"][0]["logprobs"]["content"]]
    return tokens.index("</think>") if "</think>" in tokens else None


@pytest.mark.parametrize("field", ["thinking_budget_tokens", "thinking_token_budget"])
def test_request_budget_closes_reasoning(server: str, field: str) -> None:
    answer = _chat(server, **{field: 5}).json()
    assert _reasoning_tokens(answer) == 5
    message = answer["choices"][0]["message"]
    assert message["reasoning_content"] is not None and "</think>" not in (message["content"] or "")


def test_budget_zero_means_no_thinking(server: str) -> None:
    answer = _chat(server, thinking_budget=0).json()
    assert _reasoning_tokens(answer) == 0
    assert not answer["choices"][0]["message"].get("reasoning_content")
    # Without an explicit enable_thinking, budget 0 renders the template with it off.
    rendered = httpx.post(
        f"{server}/apply-template",
        json={"messages": [{"role": "user", "content": "Hi"}], "thinking_budget_tokens": 0},
        headers=AUTH,
        timeout=60,
    ).json()["prompt"]
    assert not rendered.rstrip().endswith("<think>")


def test_unlimited_budget_leaves_reasoning_alone(server: str) -> None:
    answer = _chat(server, thinking_budget_tokens=-1, max_tokens=12).json()
    # The random model never closes its block by itself within 12 tokens (greedy, fixed).
    assert _reasoning_tokens(answer) is None
    assert answer["choices"][0]["finish_reason"] == "length"


def test_bad_budget_and_reserved_template_kwargs_are_400(server: str) -> None:
    bad = _chat(server, thinking_budget_tokens="lots")
    assert bad.status_code == 400 and "thinking_budget_tokens" in bad.json()["error"]["message"]
    for key in ("messages", "tools", "add_generation_prompt", "bos_token"):
        out = _chat(server, chat_template_kwargs={key: "x"})
        assert out.status_code == 400, key
        assert key in out.json()["error"]["message"]
    nested = _chat(
        server,
        chat_template_kwargs=None,
        extra_body={"chat_template_kwargs": {"eos_token": "x"}},
    )
    assert nested.status_code == 400


def test_server_budget_is_the_default(hf_tokenizer: Any) -> None:
    app, engine = make_app(hf_tokenizer, ["Hi"], reasoning_budget=7)
    create(app, messages=[{"role": "user", "content": "Hi"}])
    create(app, messages=[{"role": "user", "content": "Hi"}], extra_body={"thinking_budget": 2})
    assert [r.thinking.tokens for r in engine.requests] == [7, 2]
    app, engine = make_app(hf_tokenizer, ["Hi"])  # -1: no limit, no processor
    create(app, messages=[{"role": "user", "content": "Hi"}])
    assert engine.requests[0].thinking is None
