"""llama-server's native routes of `mlxcel serve`, against a real server on a tiny model.

/completion (+ /completions), /infill, /tokenize, /detokenize and /apply-template, with
the shapes of `shared/spec/llama-server-samples.json`. Greedy and `cache_prompt: false`
where a test compares texts, so results are deterministic.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import ServeProcess, shared_server
from sse_reader import sse_stream_json
from test_server_openai import API_KEY, AUTH, main_server_args

PROMPT = "def f(x):"
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 6  # several cache blocks

RESULT_KEYS = {
    "index",
    "content",
    "tokens",
    "id_slot",
    "stop",
    "model",
    "tokens_predicted",
    "tokens_evaluated",
    "generation_settings",
    "prompt",
    "has_new_line",
    "truncated",
    "stop_type",
    "stopping_word",
    "tokens_cached",
    "timings",
}
TIMING_KEYS = {
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
}


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> ServeProcess:
    return shared_server(main_server_args(tiny_llama_dir))


@pytest.fixture(scope="module")
def http(server: ServeProcess) -> Iterator[httpx.Client]:
    with server.client(headers=AUTH) as client:
        yield client


def fixed(**extra: Any) -> dict[str, Any]:
    """Greedy, no cache, exact token counts."""
    return {"temperature": 0, "cache_prompt": False, "ignore_eos": True, **extra}


def tokenize(http: httpx.Client, text: str, add_special: bool = True) -> list[int]:
    response = http.post("/tokenize", json={"content": text, "add_special": add_special})
    assert response.status_code == 200
    return list(response.json()["tokens"])


def error_of(response: httpx.Response, status: int, type_: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == type_
    assert set(error) >= {"message", "type", "code"}
    return str(error["message"])


# ------------------------------------------------------------------------------ completion


def test_completion_shape(http: httpx.Client, tiny_llama_dir: Path) -> None:
    response = http.post("/completion", json={"prompt": PROMPT, "n_predict": 4, **fixed()})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == RESULT_KEYS
    assert body["index"] == 0 and body["stop"] is True and body["truncated"] is False
    assert isinstance(body["content"], str)
    assert body["tokens"] == []  # only with return_tokens
    assert body["tokens_predicted"] == 4
    assert body["tokens_evaluated"] == len(tokenize(http, PROMPT))
    assert body["stop_type"] == "limit" and body["stopping_word"] == ""
    assert body["has_new_line"] == ("\n" in body["content"])
    assert body["tokens_cached"] == body["tokens_evaluated"] + 4 - 1
    assert body["model"] == tiny_llama_dir.name
    assert isinstance(body["id_slot"], int) and -1 <= body["id_slot"] < 4
    timings = body["timings"]
    assert set(timings) == TIMING_KEYS
    assert timings["predicted_n"] == 4 and timings["cache_n"] == 0
    assert timings["prompt_n"] == body["tokens_evaluated"]
    settings = body["generation_settings"]
    assert settings["n_predict"] == 4 and settings["temperature"] == 0
    assert settings["seed"] == 18446744073709551615  # unset
    assert settings["stream"] is False and settings["ignore_eos"] is True
    assert settings["samplers"] == [  # llama-server's default chain, as mlxcel runs it
        "penalties",
        "dry",
        "top_n_sigma",
        "top_k",
        "typ_p",
        "top_p",
        "min_p",
        "xtc",
        "temperature",
    ]
    assert PROMPT in body["prompt"]


def test_completions_alias_and_max_tokens(http: httpx.Client) -> None:
    one = http.post("/completion", json={"prompt": PROMPT, "n_predict": 3, **fixed()}).json()
    two = http.post("/completions", json={"prompt": PROMPT, "max_tokens": 3, **fixed()}).json()
    assert two["content"] == one["content"] and two["tokens_predicted"] == 3


def test_completion_echoes_model_and_seed(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "n_predict": 1, "model": "whatever", "seed": 7, **fixed()}
    result = http.post("/completion", json=body).json()
    assert result["model"] == "whatever"
    assert result["generation_settings"]["seed"] == 7


def test_token_id_and_mixed_prompts(http: httpx.Client) -> None:
    text = http.post("/completion", json={"prompt": PROMPT, "n_predict": 3, **fixed()}).json()
    ids = tokenize(http, PROMPT)
    by_ids = http.post("/completion", json={"prompt": ids, "n_predict": 3, **fixed()}).json()
    assert by_ids["content"] == text["content"]
    assert by_ids["tokens_evaluated"] == len(ids)
    plain = tokenize(http, " more", add_special=False)
    mixed = http.post("/completion", json={"prompt": [*ids, " more"], "n_predict": 2, **fixed()})
    assert mixed.status_code == 200
    assert mixed.json()["tokens_evaluated"] == len(ids) + len(plain)


def test_return_tokens(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "n_predict": 3, "return_tokens": True, **fixed()}
    result = http.post("/completion", json=body).json()
    assert len(result["tokens"]) == 3
    decoded = http.post("/detokenize", json={"tokens": result["tokens"]}).json()["content"]
    assert decoded == result["content"]


def test_multiple_prompts(http: httpx.Client) -> None:
    response = http.post("/completion", json={"prompt": ["a", "b"], "n_predict": 2, **fixed()})
    assert response.status_code == 200
    results = response.json()
    assert isinstance(results, list) and [r["index"] for r in results] == [0, 1]
    solo = http.post("/completion", json={"prompt": "b", "n_predict": 2, **fixed()}).json()
    assert results[1]["content"] == solo["content"]
    assert all(set(r) == RESULT_KEYS and r["tokens_predicted"] == 2 for r in results)


def test_n_probs(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "n_predict": 3, "n_probs": 2, "return_tokens": True, **fixed()}
    result = http.post("/completion", json=body).json()
    probs = result["completion_probabilities"]
    assert [p["id"] for p in probs] == result["tokens"]
    for entry in probs:
        assert set(entry) >= {"id", "token", "bytes", "logprob", "top_logprobs"}
        assert entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["id"] == entry["id"]  # greedy: the argmax
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]


def test_stop_string(http: httpx.Client) -> None:
    base = {"prompt": PROMPT, "n_predict": 10, **fixed()}
    text = http.post("/completion", json=base).json()["content"]
    stop = text[len(text) // 2 :][:2]
    assert stop
    cut = http.post("/completion", json={**base, "stop": [stop]}).json()
    assert cut["content"] == text[: text.index(stop)]
    assert cut["stop_type"] == "word" and cut["stopping_word"] == stop
    assert cut["generation_settings"]["stop"] == [stop]


def test_streaming(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "n_predict": 5, **fixed()}
    whole = http.post("/completion", json=body).json()
    response = http.post("/completion", json={**body, "stream": True})
    assert response.status_code == 200
    events = sse_stream_json(response, done=False)
    *chunks, last = events
    assert chunks and all(c["stop"] is False for c in chunks)
    for c in chunks:
        assert set(c) >= {"index", "content", "tokens", "stop", "tokens_predicted"}
        assert c["tokens_evaluated"] == whole["tokens_evaluated"]
    assert [c["tokens_predicted"] for c in chunks] == sorted(c["tokens_predicted"] for c in chunks)
    assert "".join(c["content"] for c in events) == whole["content"]
    assert set(last) == RESULT_KEYS and last["stop"] is True
    assert last["tokens_predicted"] == 5 and last["stop_type"] == "limit"
    assert last["generation_settings"]["stream"] is True
    assert last["timings"]["predicted_n"] == 5


def test_streaming_n_probs_and_several_prompts(http: httpx.Client) -> None:
    body = {"prompt": ["a", "b"], "n_predict": 2, "n_probs": 1, "stream": True, **fixed()}
    events = sse_stream_json(http.post("/completion", json=body), done=False)
    finals = [e for e in events if e["stop"]]
    assert sorted(e["index"] for e in finals) == [0, 1]
    for e in events:
        if not e["stop"] and e["tokens"]:
            assert len(e["completion_probabilities"]) == len(e["tokens"])


def test_prompt_cache_reuse(http: httpx.Client) -> None:
    body = {"prompt": LONG_PROMPT, "n_predict": 2, "temperature": 0, "ignore_eos": True}
    stats = http.get("/v1/cache/stats").json()
    first = http.post("/completion", json={**body, "cache_prompt": True}).json()
    second = http.post("/completion", json=body).json()
    n_prompt = first["tokens_evaluated"]
    assert n_prompt > 32
    assert second["timings"]["cache_n"] >= 32  # whole blocks of the first request's prompt
    assert second["timings"]["cache_n"] + second["timings"]["prompt_n"] == n_prompt
    after = http.get("/v1/cache/stats").json()
    assert after["lookups"] == stats["lookups"] + 2
    assert after["hits"] >= stats["hits"] + 1
    # cache_prompt: false neither looks up nor stores
    cold = http.post("/completion", json={**body, "cache_prompt": False}).json()
    assert cold["timings"]["cache_n"] == 0 and cold["timings"]["prompt_n"] == n_prompt
    final = http.get("/v1/cache/stats").json()
    assert (final["lookups"], final["inserts"]) == (after["lookups"], after["inserts"])


def test_response_format(http: httpx.Client) -> None:
    ok = {"prompt": PROMPT, "n_predict": 1, "response_format": {"type": "text"}, **fixed()}
    assert http.post("/completion", json=ok).status_code == 200
    for fmt in ({"type": "json_object", "schema": 1}, {"type": "json_schema", "json_schema": {}}):
        bad = http.post("/completion", json={**ok, "response_format": fmt})
        assert "response_format" in error_of(bad, 400, "invalid_request_error")


def test_thinking_budget_aliases_are_accepted(http: httpx.Client) -> None:
    for key in ("thinking_budget_tokens", "reasoning_budget", "thinking_budget"):
        body = {"prompt": PROMPT, "n_predict": 1, key: 0, **fixed()}
        assert http.post("/completion", json=body).status_code == 200


def test_sampling_fields_are_accepted(http: httpx.Client) -> None:
    body = {
        "prompt": PROMPT,
        "n_predict": 2,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.9,
        "min_p": 0.1,
        "repeat_penalty": 1.1,
        "repeat_last_n": 32,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.1,
        "dry_multiplier": 0.5,
        "dry_base": 1.75,
        "dry_allowed_length": 2,
        "dry_penalty_last_n": 16,
        "p_less": True,
        "seed": 3,
    }
    first = http.post("/completion", json={**body, "cache_prompt": False})
    assert first.status_code == 200, first.text
    settings = first.json()["generation_settings"]
    assert settings["top_k"] == 20 and settings["repeat_penalty"] == 1.1
    assert settings["repeat_last_n"] == 32 and settings["dry_multiplier"] == 0.5
    assert settings["p_less"] is True
    again = http.post("/completion", json={**body, "cache_prompt": False}).json()
    assert again["content"] == first.json()["content"]  # same seed, same text


def test_completion_errors(http: httpx.Client) -> None:
    cases: list[Any] = [
        {"prompt": 5},
        {"prompt": []},
        {"prompt": [{"x": 1}]},
        {"prompt": "x", "n_predict": -7},
        {"prompt": "x", "n_probs": -1},
        {"prompt": "x", "temperature": "hot"},
        {"prompt": [10**9]},  # not a token of this vocabulary
        {"prompt": "word " * 3000},  # longer than a slot's context (1024)
    ]
    for body in cases:
        error_of(http.post("/completion", json=body), 400, "invalid_request_error")
    bad_json = http.post(
        "/completion", content=b'{"prompt": ', headers={"Content-Type": "application/json"}
    )
    error_of(bad_json, 400, "invalid_request_error")
    priority = http.post("/completion", json={"prompt": "x"}, headers={"X-Priority": "urgent"})
    error_of(priority, 400, "invalid_request_error")
    assert http.get("/completion").status_code == 405


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/completion", {"repeat_last_n": -5}, "repeat_last_n must be >= -1, not -5"),
        ("/completion", {"repeat_penalty": 0}, "repeat_penalty must be > 0, not 0.0"),
        ("/completion", {"extra_body": {"repeat_last_n": -3}}, "repeat_last_n must be >= -1"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "repeat_last_n": -2},
            "repeat_last_n must be >= -1, not -2",
        ),
        ("/v1/completions", {"repeat_penalty": -1.5}, "repeat_penalty must be > 0, not -1.5"),
        ("/v1/completions", {"repetition_context_size": -4}, "repetition_context_size must be"),
    ],
)
def test_a_range_error_names_the_field_the_client_sent(
    http: httpx.Client, path: str, body: dict[str, Any], message: str
) -> None:
    # llama-server's names map onto the engine's (repeat_last_n -> repetition_context_size):
    # the error must say the name in the request, not the engine's.
    response = http.post(path, json={"prompt": "x", "n_predict": 1, **body})
    assert error_of(response, 400, "invalid_request_error").startswith(message)


def test_a_non_finite_sampling_value_names_the_field_the_client_sent(
    http: httpx.Client,
) -> None:
    body = b'{"prompt": "x", "n_predict": 1, "repeat_penalty": NaN}'
    response = http.post("/completion", content=body, headers={"Content-Type": "application/json"})
    assert error_of(response, 400, "invalid_request_error") == (
        "repeat_penalty must be finite, not nan"
    )


def test_auth_applies(server: ServeProcess) -> None:
    completion = {"prompt": "x", "n_predict": 1}
    for path, body in (("/completion", completion), ("/tokenize", {"content": "x"})):
        missing = httpx.post(server.url + path, json=body)
        assert missing.status_code == 401
        wrong = httpx.post(server.url + path, json=body, headers={"Authorization": "Bearer no"})
        assert wrong.status_code == 401
        raw = httpx.post(server.url + path, json=body, headers={"Authorization": API_KEY})
        assert raw.status_code == 200


# ------------------------------------------------------------------------------- infill


def test_infill_without_fim_tokens(http: httpx.Client, tiny_llama_dir: Path) -> None:
    vocab = json.loads((tiny_llama_dir / "tokenizer.json").read_text())["model"]["vocab"]
    assert not any("fim" in token for token in vocab)  # the fixture has no FIM tokens
    body = {"input_prefix": "def f(", "input_suffix": "):\n", "n_predict": 4}
    message = error_of(http.post("/infill", json=body), 501, "not_supported_error")
    assert message.startswith("Infill is not supported by this model")
    assert "prefix token is missing" in message and "middle token is missing" in message


FIM_RENAMES = {
    "<think>": "<|fim_prefix|>",
    "</think>": "<|fim_suffix|>",
    "<tool_call>": "<|fim_middle|>",
    "</tool_call>": "<|file_sep|>",
}


@pytest.fixture(scope="module")
def fim_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The tiny model with its four added tokens renamed to Qwen-style FIM tokens."""
    import shutil

    from server_harness import InProcessServer

    from mlxcel.config import Settings

    model = tmp_path_factory.mktemp("fim") / "tiny-fim"
    shutil.copytree(tiny_llama_dir, model)
    spec = json.loads((model / "tokenizer.json").read_text())
    for token in spec["added_tokens"]:
        token["content"] = FIM_RENAMES.get(token["content"], token["content"])
    (model / "tokenizer.json").write_text(json.dumps(spec))
    settings = Settings(model=str(model), parallel=1, ctx_size=512, warmup=False)
    with InProcessServer(settings) as server:
        yield server


def test_infill_with_fim_tokens(fim_server: Any) -> None:
    with fim_server.client() as client:
        ids = {
            name: client.post("/tokenize", json={"content": name}).json()["tokens"][-1]
            for name in FIM_RENAMES.values()
        }

        def encode(text: str) -> list[int]:
            body = {"content": text, "add_special": False}
            return list(client.post("/tokenize", json=body).json()["tokens"])

        body = {
            "input_prefix": "def f(",
            "input_suffix": "):\n",
            "input_extra": [{"filename": "a.py", "text": "x = 1"}],
            "prompt": "x",
            "n_predict": 3,
            "return_tokens": True,
            **fixed(),
        }
        response = client.post("/infill", json=body)
        assert response.status_code == 200, response.text
        result = response.json()
        assert set(result) == RESULT_KEYS
        assert result["tokens_predicted"] == 3 and len(result["tokens"]) == 3
        bos = client.post("/tokenize", json={"content": "", "add_special": True}).json()["tokens"]
        expected = [
            *bos,
            ids["<|file_sep|>"],
            *encode("a.py\nx = 1"),
            ids["<|fim_prefix|>"],
            *encode("def f("),
            ids["<|fim_suffix|>"],
            *encode("):\n"),
            ids["<|fim_middle|>"],
            *encode("x"),
        ]
        assert result["tokens_evaluated"] == len(expected)
        shown = client.post("/detokenize", json={"tokens": expected}).json()["content"]
        assert result["prompt"] == shown
        assert "<|fim_prefix|>def f(<|fim_suffix|>):\n<|fim_middle|>x" in result["prompt"]
        for bad in (
            {"input_prefix": 5},
            {"input_extra": [{"text": 1}]},
            {"input_extra": "nope"},
            {"prompt": [1, 2]},
            {"response_format": {"type": "json_object", "schema": 1}},
        ):
            response = client.post("/infill", json={"n_predict": 1, **bad})
            error_of(response, 400, "invalid_request_error")


# ------------------------------------------------------------------- tokenize/detokenize


def test_tokenize_and_pieces(http: httpx.Client) -> None:
    text = "Hello world"
    plain = http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert plain and all(isinstance(t, int) for t in plain)
    assert http.post("/tokenize", json={"content": text, "add_special": False}).json() == {
        "tokens": plain
    }
    pieces = http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == plain
    assert "".join(p["piece"] for p in pieces) == text
    special = tokenize(http, text, add_special=True)
    assert len(special) >= len(plain) and special[-len(plain) :] == plain
    assert http.post("/tokenize", json={"content": ""}).json() == {"tokens": []}


def test_tokenize_pieces_of_partial_utf8(http: httpx.Client) -> None:
    pieces = http.post("/tokenize", json={"content": "媽", "with_pieces": True}).json()["tokens"]
    joined = b"".join(
        p["piece"].encode("utf-8") if isinstance(p["piece"], str) else bytes(p["piece"])
        for p in pieces
    )
    assert joined == "媽".encode()
    if len(pieces) > 1:  # split inside the character: the pieces are bytes
        assert all(isinstance(p["piece"], list) for p in pieces)


def test_detokenize_round_trip(http: httpx.Client) -> None:
    ids = tokenize(http, "Hello world", add_special=False)
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"content": "Hello world"}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"content": ""}


def test_detokenize_out_of_vocabulary(http: httpx.Client) -> None:
    ok = tokenize(http, "Hi", add_special=False)
    for bad in (-1, 2**40, 2**63 + 5):
        response = http.post("/detokenize", json={"tokens": [*ok, bad, -5]})
        message = error_of(response, 400, "invalid_request_error")
        assert message.startswith(f"token id {bad} is out of vocabulary range (vocab_size ")
        assert "content" not in response.json()
    error_of(http.post("/detokenize", json={"tokens": ["a"]}), 400, "invalid_request_error")


def test_token_ids_are_json_integers(http: httpx.Client) -> None:
    """`true` and `"5"` are no token ids (pydantic's lax mode read them as 1 and 5)."""
    for bad in (True, "5"):
        error_of(http.post("/detokenize", json={"tokens": [bad]}), 400, "invalid_request_error")
    for prompt in ([True], [[True]], [["5"]], [1, "5"]):  # ["5"] is a text prompt
        body = {"prompt": prompt, "max_tokens": 1}
        error_of(http.post("/v1/completions", json=body), 400, "invalid_request_error")
    ok = tokenize(http, "Hi", add_special=False)
    response = http.post("/v1/completions", json={"prompt": ok, "max_tokens": 1})
    assert response.status_code == 200, response.text


def test_tokenize_parse_special(http: httpx.Client) -> None:
    """llama-server's `parse_special` (default true): false tokenizes special-token text as
    plain text. It was ignored, so the text became the special token's one id."""
    eos = http.get("/props").json()["eos_token"]
    text = f"Hi{eos}"

    def ids(**extra: Any) -> list[int]:
        body = {"content": text, "add_special": False, **extra}
        return list(http.post("/tokenize", json=body).json()["tokens"])

    parsed, literal = ids(), ids(parse_special=False)
    assert ids(parse_special=True) == parsed
    (eos_id,) = ids(parse_special=True)[len(tokenize(http, "Hi", add_special=False)) :]
    assert eos_id in parsed and eos_id not in literal and len(literal) > len(parsed)
    assert http.post("/detokenize", json={"tokens": literal}).json() == {"content": text}


def test_tokenize_errors(http: httpx.Client) -> None:
    error_of(http.post("/tokenize", json={}), 400, "invalid_request_error")
    error_of(http.post("/tokenize", json={"content": 12}), 400, "invalid_request_error")


# -------------------------------------------------------------------------- apply-template


def test_apply_template(http: httpx.Client) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    response = http.post("/apply-template", json={"messages": messages})
    assert response.status_code == 200
    prompt = response.json()["prompt"]
    assert list(response.json()) == ["prompt"]
    assert prompt.index("Be brief.") < prompt.index("Hello")
    # The rendered prompt is what the chat route feeds the model.
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 1, **fixed()},
    ).json()
    assert chat["usage"]["prompt_tokens"] == len(tokenize(http, prompt, add_special=False))
    error_of(http.post("/apply-template", json={"messages": "nope"}), 400, "invalid_request_error")
    error_of(http.post("/apply-template", json={}), 400, "invalid_request_error")


def test_text_kinds_of_content_parts(http: httpx.Client) -> None:
    """OpenAI's text parts: an assistant's `refusal` part (chat) and the Responses kinds
    `input_text` / `output_text` are text. A text-only model refused `refusal` and
    `output_text` ("not supported by this model (text only)"), a vision model `refusal`."""
    messages = [
        {"role": "user", "content": [{"type": "input_text", "text": "Say no."}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I refuse."}]},
        {"role": "user", "content": [{"type": "output_text", "text": "Why?"}]},
    ]
    response = http.post("/apply-template", json={"messages": messages})
    assert response.status_code == 200, response.text
    prompt = response.json()["prompt"]
    assert prompt.index("Say no.") < prompt.index("I refuse.") < prompt.index("Why?")
    chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    bad = [{"role": "assistant", "content": [{"type": "refusal", "text": "no key"}]}]
    message = error_of(
        http.post("/v1/chat/completions", json={"messages": bad}), 400, "invalid_request_error"
    )
    assert message == "messages[0].content: a refusal part needs a string 'refusal'"


# ------------------------------------------------------------------------- prompt parsing


def test_split_prompts() -> None:
    from mlxcel.server.errors import APIError
    from mlxcel.server.llama_native.protocol import split_prompts

    assert split_prompts("hi") == [["hi"]]
    assert split_prompts([1, 2, 3]) == [[1, 2, 3]]
    assert split_prompts([1, "a", 2]) == [[1, "a", 2]]  # mixed ids and text: one prompt
    assert split_prompts(["a", "b"]) == [["a"], ["b"]]  # strings only: several prompts
    assert split_prompts([[1, 2], "b", [3, "c"]]) == [[1, 2], ["b"], [3, "c"]]
    for bad in (5, None, [], [True], [[1, [2]]], [{"a": 1}], ["x"] * 65):
        with pytest.raises(APIError) as info:
            split_prompts(bad)
        assert info.value.status == 400
