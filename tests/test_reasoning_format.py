"""`--reasoning-format` and the per-request `reasoning_format`, as llama-server has them."""

from __future__ import annotations

from typing import Any

import pytest
from openai import BadRequestError
from test_server_tools import create, make_app, stream_chunks

TOKENS = ["<think>", "pl", "an", "</think>", "Hi", "!"]
USER = [{"role": "user", "content": "Hello"}]


def _extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {}).get(name)


@pytest.mark.parametrize("fmt", ["auto", "deepseek"])
def test_auto_and_deepseek_split_reasoning(hf_tokenizer: Any, fmt: str) -> None:
    app, _ = make_app(hf_tokenizer, TOKENS, reasoning_format=fmt)
    message = create(app, messages=USER).choices[0].message
    assert (message.content, _extra(message, "reasoning_content")) == ("Hi!", "plan")


def test_deepseek_legacy_keeps_tags_in_content_and_fills_reasoning(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, TOKENS, reasoning_format="deepseek-legacy")
    message = create(app, messages=USER).choices[0].message
    assert message.content == "<think>plan</think>Hi!"
    assert _extra(message, "reasoning_content") == "plan"
    chunks = stream_chunks(app, messages=USER)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "<think>plan</think>Hi!"
    assert not any(_extra(c.choices[0].delta, "reasoning_content") for c in chunks if c.choices)


def test_request_field_overrides_the_server(hf_tokenizer: Any) -> None:
    app, _ = make_app(hf_tokenizer, TOKENS)
    none = create(app, messages=USER, extra_body={"reasoning_format": "none"}).choices[0]
    assert none.message.content == "<think>plan</think>Hi!"
    assert _extra(none.message, "reasoning_content") is None
    legacy = create(app, messages=USER, extra_body={"reasoning_format": "deepseek-legacy"})
    assert _extra(legacy.choices[0].message, "reasoning_content") == "plan"
    with pytest.raises(BadRequestError, match="reasoning_format"):
        create(app, messages=USER, extra_body={"reasoning_format": "bogus"})
