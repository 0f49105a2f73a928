"""A SentencePiece-vocabulary llama GGUF (Llama 2 / Mistral style: `<s>`, `▁` pieces, byte
fallback) served as llama-server serves it: the prompt text and tokens of its chat template,
BOS placement, `/apply-template`, the `__verbose` prompt, GBNF and JSON-object output.

The expected strings are those llama.cpp's server suite (`test_chat_completion.py`) checks on
stories260K, a SentencePiece llama, and that llama-server gives on this model too.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fixtures.tiny_spm import write_tiny_spm_gguf
from server_harness import serve

LLAMA3_PROMPT = (
    "<s> <|start_header_id|>system<|end_header_id|>\n\nBook<|eot_id|><|start_header_id|>user"
    "<|end_header_id|>\n\nWhat is the best book<|eot_id|><|start_header_id|>assistant"
    "<|end_header_id|>\n\n"
)
MESSAGES = [
    {"role": "system", "content": "Book"},
    {"role": "user", "content": "What is the best book"},
]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_spm_gguf(tmp_path_factory.mktemp("spm") / "tiny-spm.Q8_0.gguf")


@pytest.fixture(scope="module")
def http(spm_gguf: Path) -> Iterator[httpx.Client]:
    args = ["-m", str(spm_gguf), "-c", "512", "-np", "2", "--no-jinja", "--chat-template", "llama3"]
    with serve(args) as proc, proc.client() as client:
        yield client


def test_chat_prompt_reads_as_llama_server(http: httpx.Client) -> None:
    """BOS, then `▁` before the template's first text, exactly llama-server's prompt."""
    chat = {"messages": MESSAGES, "max_tokens": 2, "verbose": True}
    answer = http.post("/v1/chat/completions", json=chat).json()
    assert answer["__verbose"]["prompt"] == LLAMA3_PROMPT
    template = http.post("/apply-template", json={"messages": MESSAGES}).json()["prompt"]
    assert template == LLAMA3_PROMPT.removeprefix("<s> ")  # the tokenizer adds the BOS
    tokens = http.post(
        "/tokenize", json={"content": template, "add_special": True, "with_pieces": True}
    ).json()["tokens"]
    assert [t["piece"] for t in tokens[:3]] == ["<s>", " ", "<"]
    assert answer["usage"]["prompt_tokens"] == len(tokens)


def test_text_after_a_special_token_gets_the_space_prefix(http: httpx.Client) -> None:
    """llama.cpp puts `▁` before every text fragment that follows a special token."""
    pieces = http.post(
        "/tokenize", json={"content": "<s>the</s>the", "parse_special": True, "with_pieces": True}
    ).json()["tokens"]
    assert [p["piece"] for p in pieces] == ["<s>", " the", "</s>", " the"]


def test_structured_output_on_a_sentencepiece_vocabulary(http: httpx.Client) -> None:
    """GBNF and JSON-object output work with byte-fallback pieces too."""
    chat = {"messages": MESSAGES, "max_tokens": 6, "grammar": 'root ::= "a"{5,5}'}
    answer = http.post("/v1/chat/completions", json=chat)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "aaaaa"
    schema = {"response_format": {"type": "json_object", "schema": {"const": "42"}}}
    answer = http.post("/v1/chat/completions", json={**chat, "grammar": "", **schema})
    assert answer.status_code == 200, answer.text
    assert json.loads(answer.json()["choices"][0]["message"]["content"]) == "42"
