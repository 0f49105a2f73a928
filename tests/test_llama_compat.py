"""Regressions found by running llama.cpp's server test suite against `mlxcel serve`.

Each test pins one HTTP-contract behaviour of llama-server that mlxcel got wrong (see
docs/llama-compat.md): native `logit_bias` forms, JSON-object prompts, `response_fields`,
bodies read as JSON whatever their Content-Type, refused `grammar`/`json_schema`, the
chat input-token count route, `/v1/models` aliases, `/props` fields, `/infill` extra-context
validation and llama-server's CORS rules.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from server_harness import (
    AUTH,
    MESSAGES,
    InProcessServer,
    ServeProcess,
    main_server_args,
    shared_server,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from mlxcel.config import Settings
from mlxcel.server.errors import APIError
from mlxcel.server.llama_native.protocol import InfillRequest, split_prompts
from mlxcel.server.llama_native.serving import NativeServing
from mlxcel.server.middleware import Cors, is_local_origin
from mlxcel.server.models_route import models_payload
from mlxcel.server.ops.routes import model_file_name
from mlxcel.server.state import ServerState

PROMPT = "The cat sat on the"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> ServeProcess:
    return shared_server(main_server_args(tiny_llama_dir))


@pytest.fixture(scope="module")
def http(server: ServeProcess) -> Iterator[httpx.Client]:
    with server.client(headers=AUTH) as client:
        yield client


def greedy(**extra: Any) -> dict[str, Any]:
    return {"temperature": 0, "cache_prompt": False, "ignore_eos": True, **extra}


def complete(http: httpx.Client, **body: Any) -> dict[str, Any]:
    response = http.post("/completion", json={"prompt": PROMPT, "n_predict": 3, **greedy(**body)})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def first_token(http: httpx.Client, **body: Any) -> int:
    return int(complete(http, return_tokens=True, **body)["tokens"][0])


def assert_400(response: httpx.Response, needle: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and needle in error["message"]


# ------------------------------------------------------------------ native /completion


def test_native_logit_bias_forms_ban_the_greedy_token(http: httpx.Client) -> None:
    top = first_token(http)
    piece = http.post("/detokenize", json={"tokens": [top]}).json()["content"]
    piece_ids = http.post("/tokenize", json={"content": piece}).json()["tokens"]
    assert top in piece_ids  # so banning the text bans the token
    for bias in ([[top, False]], [[top, -100]], {str(top): False}, [[piece, False]]):
        result = complete(http, return_tokens=True, logit_bias=bias)
        assert result["tokens"][0] != top, bias
        assert {"bias": None, "token": top} in result["generation_settings"]["logit_bias"]
    boosted = complete(http, return_tokens=True, logit_bias=[[7, 100]])
    assert boosted["tokens"] == [7, 7, 7]
    for bad in ([[top, True]], [[top]], "x", [[1.5, 1]]):
        response = http.post("/completion", json={"prompt": PROMPT, "logit_bias": bad})
        assert_400(response, "logit_bias")


def test_openai_logit_bias_keys_stay_token_ids(http: httpx.Client) -> None:
    body = {"messages": MESSAGES, "max_tokens": 1, "logit_bias": {"abc": 1}}
    assert_400(http.post("/v1/chat/completions", json=body), "logit_bias")


def test_json_object_prompts(http: httpx.Client) -> None:
    plain = complete(http)["content"]
    assert complete(http, prompt={"prompt_string": PROMPT})["content"] == plain
    ids = http.post("/tokenize", json={"content": PROMPT, "add_special": True}).json()["tokens"]
    both = http.post(
        "/completion",
        json={"prompt": [ids, {"prompt_string": PROMPT}], "n_predict": 3, **greedy()},
    ).json()
    assert [r["content"] for r in both] == [plain, plain]
    media = {"prompt_string": "<__media__>", "multimodal_data": ["aGk="]}
    assert_400(http.post("/completion", json={"prompt": media}), "multimodal_data")
    assert_400(http.post("/completion", json={"prompt": {"text": "x"}}), "prompt_string")
    assert split_prompts({"prompt_string": "a"}) == [["a"]]


def test_response_fields_projects_the_result(http: httpx.Client) -> None:
    fields = ["content", "generation_settings/n_predict", "timings/predicted_n", "nope/x"]
    result = complete(http, response_fields=fields)
    assert set(result) == {"content", "generation_settings/n_predict", "timings/predicted_n"}
    assert result["generation_settings/n_predict"] == 3 and result["timings/predicted_n"] == 3
    assert isinstance(result["content"], str)


def test_native_bodies_are_json_whatever_the_content_type(http: httpx.Client) -> None:
    body = json.dumps({"prompt": PROMPT, "n_predict": 2, **greedy()})
    for kind in ("application/x-www-form-urlencoded", "text/plain"):
        response = http.post("/completion", content=body, headers={"Content-Type": kind})
        assert response.status_code == 200, response.text
        assert response.json()["tokens_predicted"] == 2
        tokens = http.post("/tokenize", content='{"content": "hi"}', headers={"Content-Type": kind})
        assert tokens.status_code == 200 and tokens.json()["tokens"]
    assert_400(http.post("/tokenize", content="{nope", headers={"Content-Type": "text/plain"}), "")


def test_truncated_when_the_slot_context_fills(tiny_llama_dir: Path) -> None:
    settings = Settings(model=str(tiny_llama_dir), ctx_size=48, parallel=1, warmup=False)
    with InProcessServer(settings) as small, small.client() as client:
        full = client.post("/completion", json={"prompt": PROMPT, **greedy()}).json()
        assert full["truncated"] is True and full["stop_type"] == "limit"
        assert full["tokens_evaluated"] + full["tokens_predicted"] == 48
        capped = client.post("/completion", json={"prompt": PROMPT, "n_predict": 4, **greedy()})
        assert capped.json()["truncated"] is False


def test_sampling_params_report_adaptive_fields(http: httpx.Client) -> None:
    settings = complete(http)["generation_settings"]
    assert settings["adaptive_target"] == -1.0 and settings["adaptive_decay"] == 0.9
    params = http.get("/props").json()["default_generation_settings"]["params"]
    assert params["adaptive_target"] == -1.0 and params["adaptive_decay"] == 0.9


# --------------------------------------------------------- constraint fields


def test_gbnf_grammar_constrains_every_generation_route(http: httpx.Client) -> None:
    """llama-server's `grammar` field (GBNF) constrains chat, completions and /completion."""
    chat = {"messages": MESSAGES, "max_tokens": 6, "temperature": 1.0, "seed": 3}
    grammar = 'root ::= "a"{5,5}'
    answer = http.post("/v1/chat/completions", json={**chat, "grammar": grammar})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "aaaaa"
    legacy = {"prompt": "x", "max_tokens": 6, "grammar": grammar, "temperature": 1.0}
    assert http.post("/v1/completions", json=legacy).json()["choices"][0]["text"] == "aaaaa"
    native = {"prompt": "x", "n_predict": 16, "grammar": 'root ::= ("yes" | "no") "!"'}
    assert http.post("/completion", json=native).json()["content"] in ("yes!", "no!")
    # The empty forms some clients always send change nothing.
    ok = http.post("/v1/chat/completions", json={**chat, "grammar": "", "json_schema": {}})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    ("grammar", "expected"),
    [
        ('root ::= ("ab"{2}){2}', "abababab"),
        ('root ::= ("a"{2} "b"){2}', "aabaab"),
        ('root ::= (x{3})? "!"\nx ::= "c"', ("ccc!", "!")),
    ],
)
def test_gbnf_group_of_a_repeated_item(http: httpx.Client, grammar: str, expected: Any) -> None:
    """A group repeating one repeated item is valid GBNF; llguidance's translation dropped
    the group's parentheses (`"ab"{2,2}{2,2}`), which its Lark reader refused: a 400."""
    body = {"prompt": "x", "n_predict": 16, "grammar": grammar, "temperature": 1.0, "seed": 5}
    answer = http.post("/completion", json=body)
    assert answer.status_code == 200, answer.text
    content = answer.json()["content"]
    assert content in (expected if isinstance(expected, tuple) else (expected,))


def test_gbnf_unicode_escapes(http: httpx.Client) -> None:
    """`\\uXXXX` and `\\UXXXXXXXX` are GBNF escapes; llguidance's translation dropped
    their leading zeros (`\\u00e9` as `\\ue9`), which its Lark reader refused: a 400."""
    grammar = 'root ::= "\\u00e9" [\\u0041-\\u005A] "\\U0001F600" [\\u4e00-\\u9fff] "\\\\u0041"'
    body = {"prompt": "x", "n_predict": 16, "grammar": grammar, "temperature": 1.0, "seed": 5}
    answer = http.post("/completion", json=body)
    assert answer.status_code == 200, answer.text
    content = answer.json()["content"]
    assert content[0] == "é" and "A" <= content[1] <= "Z" and content[2] == "😀"
    assert "\u4e00" <= content[3] <= "\u9fff" and content[4:] == "\\u0041"


@pytest.mark.parametrize(
    "extra",
    [
        {"grammar": "root ::= foo"},  # an undefined rule
        {"grammar": 'start ::= "a"'},  # no root rule
        {"grammar": 42},
        {"grammar": "root ::= " + "(" * 5000 + '"a"' + ")" * 5000},  # nested too deeply
        {"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}},
    ],
)
def test_bad_gbnf_grammar_is_a_400(http: httpx.Client, extra: dict[str, object]) -> None:
    chat = {"messages": MESSAGES, "max_tokens": 1}
    assert_400(http.post("/v1/chat/completions", json={**chat, **extra}), "grammar")
    assert_400(http.post("/completion", json={"prompt": "x", **extra}), "grammar")


def test_top_level_json_schema_constrains_like_response_format(http: httpx.Client) -> None:
    schema = {"const": "42"}
    chat = {"messages": MESSAGES, "max_tokens": 8, "json_schema": schema, **greedy()}
    answer = http.post("/v1/chat/completions", json=chat)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == '"42"'
    legacy = {"prompt": PROMPT, "max_tokens": 8, "json_schema": schema, **greedy()}
    assert http.post("/v1/completions", json=legacy).json()["choices"][0]["text"] == '"42"'
    both = {**chat, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}
    assert_400(http.post("/v1/chat/completions", json=both), "json_schema")
    # llama-server's own route takes the field too (the spec refused it there).
    native = {"prompt": PROMPT, "n_predict": 8, "json_schema": schema, **greedy()}
    assert http.post("/completion", json=native).json()["content"] == '"42"'


# ------------------------------------------------------------------ chat token count


def test_chat_input_tokens_route(http: httpx.Client) -> None:
    chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
    prompt_tokens = chat.json()["usage"]["prompt_tokens"]
    for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        response = http.post(path, json={"messages": MESSAGES})
        assert response.status_code == 200, response.text
        assert response.json() == {"input_tokens": prompt_tokens, "object": "response.input_tokens"}
    assert_400(http.post("/v1/chat/completions/input_tokens", json={"messages": "x"}), "messages")


# ------------------------------------------------- generation prompt and assistant prefill

USER_ONLY = [{"role": "user", "content": "What is the best book"}]
PREFILL = [*USER_ONLY, {"role": "assistant", "content": "Whill"}]
GENERATION_PROMPT = "<|im_start|>assistant\n"  # the tiny model's ChatML template


def apply_template(http: httpx.Client, **body: Any) -> httpx.Response:
    return http.post("/apply-template", json=body)


def test_trailing_assistant_message_is_continued(http: httpx.Client) -> None:
    prompt = apply_template(http, messages=PREFILL).json()["prompt"]
    assert prompt.endswith(f"What is the best book<|im_end|>\n{GENERATION_PROMPT}Whill")
    same = apply_template(
        http, messages=PREFILL, add_generation_prompt=False, continue_final_message=True
    )
    assert same.json()["prompt"] == prompt
    # the chat route feeds the model that same prompt
    count = http.post("/v1/chat/completions/input_tokens", json={"messages": PREFILL}).json()
    ids = http.post("/tokenize", json={"content": prompt}).json()["tokens"]
    assert count["input_tokens"] == len(ids)


def test_add_generation_prompt_false(http: httpx.Client) -> None:
    with_prompt = apply_template(http, messages=USER_ONLY).json()["prompt"]
    without = apply_template(http, messages=USER_ONLY, add_generation_prompt=False).json()
    assert with_prompt.endswith(GENERATION_PROMPT)
    assert with_prompt == without["prompt"] + GENERATION_PROMPT
    # an assistant turn kept as history, not continued
    history = apply_template(http, messages=PREFILL, add_generation_prompt=False).json()
    assert history["prompt"].endswith("Whill<|im_end|>\n")


def test_prefill_rules_are_400(http: httpx.Client) -> None:
    both = {"add_generation_prompt": True, "continue_final_message": True}
    assert_400(apply_template(http, messages=PREFILL, **both), "cannot both be true")
    alone = apply_template(http, messages=USER_ONLY, continue_final_message=True)
    assert_400(alone, "final assistant message")
    twice = [*PREFILL, {"role": "assistant", "content": "again"}]
    assert_400(apply_template(http, messages=twice), "2 or more assistant messages")
    chat = {"messages": twice, "max_tokens": 1}
    assert_400(http.post("/v1/chat/completions", json=chat), "2 or more assistant messages")


# -------------------------------------------------------------------- models and props


def test_models_entry_has_aliases_and_tags(http: httpx.Client) -> None:
    entry = http.get("/v1/models").json()["data"][0]
    assert entry["aliases"] == [entry["id"]] and entry["tags"] == []


def _state(**settings: Any) -> ServerState:
    return ServerState(settings=Settings(warmup=False, **settings))


def test_comma_separated_alias_lists_every_alias() -> None:
    entry = models_payload(_state(alias="tinyllama-2, fim,code"))["data"][0]
    assert entry["aliases"] == ["code", "fim", "tinyllama-2"]
    assert entry["id"] == "code"  # the first alias in sorted order, as llama-server
    assert models_payload(_state(alias="solo"))["data"][0]["id"] == "solo"


def test_props_model_path_is_the_gguf_file_name_only() -> None:
    state = _state()
    state.model_info = SimpleNamespace(  # type: ignore[assignment]
        path=Path("/models/dir/tiny-llama.Q8_0.gguf"), name="tiny-llama.Q8_0"
    )
    assert model_file_name(state) == "tiny-llama.Q8_0.gguf"
    state.model_info = SimpleNamespace(path=Path("/models/dir/tiny"), name="tiny")  # type: ignore[assignment]
    assert model_file_name(state) == "tiny"


def test_props_model_path_of_the_served_model(http: httpx.Client, tiny_llama_dir: Path) -> None:
    assert http.get("/props").json()["model_path"] == tiny_llama_dir.name


# --------------------------------------------------------------------------- /infill


class _FimTokenizer:
    bos_token_id = None

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        return [ord(c) for c in text]


@pytest.mark.parametrize(
    "extra", [{}, {"filename": "ok"}, {"filename": 123, "text": "abc"}, {"text": 456}]
)
def test_infill_extra_context_needs_a_text_string(extra: dict[str, Any]) -> None:
    serving = NativeServing(_state())
    body = InfillRequest.model_validate(
        {"input_extra": [extra], "input_prefix": "a", "input_suffix": "b"}
    )
    with pytest.raises(APIError) as caught:
        serving._infill_tokens(_FimTokenizer(), {"prefix": 1, "suffix": 2, "middle": 3}, body)  # type: ignore[arg-type]
    assert caught.value.status == 400 and "input_extra[0]" in caught.value.message


def test_infill_extra_context_filename_is_optional() -> None:
    serving = NativeServing(_state())
    body = InfillRequest.model_validate(
        {"input_extra": [{"text": "x"}], "input_prefix": "a", "input_suffix": "b"}
    )
    fim = {"prefix": 1, "suffix": 2, "middle": 3}
    tokens = serving._infill_tokens(_FimTokenizer(), fim, body)  # type: ignore[arg-type]
    assert tokens == [ord("x"), 1, ord("a"), 2, ord("b"), 3]


# ------------------------------------------------------------------------------ CORS


def _cors_client(origins: str, *, credentials: bool = True, headers: str = "*") -> TestClient:
    async def hello(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    inner = Starlette(routes=[Route("/x", hello, methods=["GET", "POST"])])
    app = Cors(
        inner,
        origins=origins,
        methods="GET, POST, DELETE, OPTIONS",
        headers=headers,
        credentials=credentials,
    )
    return TestClient(app)


PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "Authorization",
}


def raw_names(response: Any) -> set[bytes]:
    return {name for name, _ in response.headers.raw}


def test_cors_preflight_answers_every_options_request() -> None:
    client = _cors_client("*")
    response = client.options("/anything", headers={"Origin": "web.mydomain.fr", **PREFLIGHT})
    assert response.status_code == 200 and response.content == b""
    assert response.headers["access-control-allow-origin"] == "web.mydomain.fr"
    assert response.headers["access-control-allow-credentials"] == "true"
    assert response.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert response.headers["access-control-allow-headers"] == "Authorization"
    # llama-server's header spelling, for clients that compare names case-sensitively
    assert b"Access-Control-Allow-Origin" in raw_names(response)
    assert client.options("/x").status_code == 200  # no Origin: still answered here


def test_cors_origins_without_credentials_and_fixed_headers() -> None:
    client = _cors_client("*", credentials=False, headers="X-A")
    response = client.options("/x", headers={"Origin": "http://a", **PREFLIGHT})
    assert response.headers["access-control-allow-origin"] == "*"
    assert response.headers["access-control-allow-credentials"] == "false"
    assert response.headers["access-control-allow-headers"] == "X-A"
    simple = client.get("/x", headers={"Origin": "http://a"})
    assert simple.json() == {"ok": True} and simple.headers["access-control-allow-origin"] == "*"


@pytest.mark.parametrize(
    "origin",
    ["http://localhost", "http://localhost:8080", "http://127.0.0.1:3000", "http://[::1]:3000"],
)
def test_cors_localhost_reflects_local_origins(origin: str) -> None:
    client = _cors_client("localhost")
    response = client.options("/x", headers={"Origin": origin, **PREFLIGHT})
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == origin
    assert client.get("/x", headers={"Origin": origin}).headers["access-control-allow-origin"] == (
        origin
    )


@pytest.mark.parametrize(
    "origin",
    ["http://web.mydomain.fr", "http://notlocalhost", "http://localhost.evil.com", "localhost"],
)
def test_cors_localhost_skips_other_origins(origin: str) -> None:
    client = _cors_client("localhost")
    response = client.options("/x", headers={"Origin": origin, **PREFLIGHT})
    assert response.status_code == 200
    assert "access-control-allow-origin" not in response.headers
    assert not is_local_origin(origin)


def test_cors_listed_origins() -> None:
    client = _cors_client("http://a.example, http://b.example")
    ok = client.get("/x", headers={"Origin": "http://b.example"})
    assert ok.headers["access-control-allow-origin"] == "http://b.example"
    assert (
        "access-control-allow-origin"
        not in client.get("/x", headers={"Origin": "http://c.example"}).headers
    )


def test_cors_preflight_on_the_real_server_needs_no_key(server: ServeProcess) -> None:
    with server.client() as anon:
        response = anon.options("/completions", headers={"Origin": "localhost", **PREFLIGHT})
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "localhost"
    assert response.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
