"""llama.cpp's built-in chat templates (`--chat-template NAME`) as sandboxed Jinja.

The expected texts are what llama.cpp's C++ renders for the same conversation (the one its
own template tests use): spaces, trimming and newlines included.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import API_KEY, AUTH, ServeProcess

from mlxcel.engine.chat.builtin_templates import BUILTIN_NAMES, builtin_template, detect_builtin
from mlxcel.engine.chat.template import ChatTemplate, TemplateError, override_source

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "Who are you"},
    {"role": "assistant", "content": "   I am an assistant   "},
    {"role": "user", "content": "Another question"},
]

SYS, Q1, A1, Q2, A2, Q3 = (m["content"] for m in CONVERSATION)
A2T = A2.strip()

EXPECTED = {
    "chatml": "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONVERSATION)
    + "<|im_start|>assistant\n",
    "llama2": f"[INST] {SYS}\n{Q1} [/INST]{A1}</s>[INST] {Q2} [/INST]{A2}</s>[INST] {Q3} [/INST]",
    "llama2-sys": f"[INST] <<SYS>>\n{SYS}\n<</SYS>>\n\n{Q1} [/INST]{A1}</s>"
    f"[INST] {Q2} [/INST]{A2}</s>[INST] {Q3} [/INST]",
    "llama2-sys-bos": f"[INST] <<SYS>>\n{SYS}\n<</SYS>>\n\n{Q1} [/INST]{A1}</s>"
    f"<s>[INST] {Q2} [/INST]{A2}</s><s>[INST] {Q3} [/INST]",
    "llama2-sys-strip": f"[INST] <<SYS>>\n{SYS}\n<</SYS>>\n\n{Q1} [/INST]{A1}</s>"
    f"[INST] {Q2} [/INST]{A2T}</s>[INST] {Q3} [/INST]",
    "mistral-v1": f" [INST] {SYS}\n\n{Q1} [/INST] {A1}</s> [INST] {Q2} [/INST] {A2}</s>"
    f" [INST] {Q3} [/INST]",
    "mistral-v3": f"[INST] {SYS}\n\n{Q1}[/INST] {A1}</s>[INST] {Q2}[/INST] {A2T}</s>"
    f"[INST] {Q3}[/INST]",
    "mistral-v3-tekken": f"[INST]{SYS}\n\n{Q1}[/INST]{A1}</s>[INST]{Q2}[/INST]{A2}</s>"
    f"[INST]{Q3}[/INST]",
    "mistral-v7": f"[SYSTEM_PROMPT] {SYS}[/SYSTEM_PROMPT][INST] {Q1}[/INST] {A1}</s>"
    f"[INST] {Q2}[/INST] {A2}</s>[INST] {Q3}[/INST]",
    "llama3": "".join(
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
        for m in CONVERSATION
    )
    + "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma": f"<start_of_turn>user\n{SYS}\n\n{Q1}<end_of_turn>\n<start_of_turn>model\n{A1}"
    f"<end_of_turn>\n<start_of_turn>user\n{Q2}<end_of_turn>\n<start_of_turn>model\n{A2T}"
    f"<end_of_turn>\n<start_of_turn>user\n{Q3}<end_of_turn>\n<start_of_turn>model\n",
    "command-r": f"<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{SYS}<|END_OF_TURN_TOKEN|>"
    f"<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{Q1}<|END_OF_TURN_TOKEN|>"
    f"<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{A1}<|END_OF_TURN_TOKEN|>"
    f"<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{Q2}<|END_OF_TURN_TOKEN|>"
    f"<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{A2T}<|END_OF_TURN_TOKEN|>"
    f"<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{Q3}<|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "zephyr": "".join(f"<|{m['role']}|>\n{m['content']}<|endoftext|>\n" for m in CONVERSATION)
    + "<|assistant|>\n",
    "vicuna": f"{SYS}\n\nUSER: {Q1}\nASSISTANT: {A1}</s>\nUSER: {Q2}\nASSISTANT: {A2}</s>\n"
    f"USER: {Q3}\nASSISTANT:",
    "vicuna-orca": f"SYSTEM: {SYS}\nUSER: {Q1}\nASSISTANT: {A1}</s>\nUSER: {Q2}\n"
    f"ASSISTANT: {A2}</s>\nUSER: {Q3}\nASSISTANT:",
    "deepseek3": f"{SYS}\n\n<｜User｜>{Q1}<｜Assistant｜>{A1}<｜end▁of▁sentence｜><｜User｜>{Q2}"
    f"<｜Assistant｜>{A2}<｜end▁of▁sentence｜><｜User｜>{Q3}<｜Assistant｜>",
    "phi3": "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in CONVERSATION)
    + "<|assistant|>\n",
    "openchat": f"{SYS}<|end_of_turn|>GPT4 Correct User: {Q1}<|end_of_turn|>"
    f"GPT4 Correct Assistant: {A1}<|end_of_turn|>GPT4 Correct User: {Q2}<|end_of_turn|>"
    f"GPT4 Correct Assistant: {A2}<|end_of_turn|>GPT4 Correct User: {Q3}<|end_of_turn|>"
    "GPT4 Correct Assistant:",
}


def _render(name: str, messages: list[dict[str, object]], bos: str = "", **kw: object) -> str:
    source = builtin_template(name)
    assert source is not None
    return ChatTemplate(source, bos_token=bos, eos_token="").render(messages, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_builtin_renders_llama_cpp_text(name: str) -> None:
    assert _render(name, CONVERSATION) == EXPECTED[name]


def test_llama_server_names_are_all_built_in() -> None:
    names = set(BUILTIN_NAMES)
    for name in (
        "llama2", "llama2-sys", "llama2-sys-bos", "llama2-sys-strip", "llama3", "llama4",
        "mistral-v1", "mistral-v3", "mistral-v3-tekken", "mistral-v7", "mistral-v7-tekken",
        "chatml", "command-r", "gemma", "phi3", "phi4", "deepseek", "deepseek2", "deepseek3",
        "zephyr", "vicuna", "vicuna-orca", "monarch", "orion", "openchat", "minicpm",
        "exaone3", "granite", "gigachat", "megrez", "yandex", "bailing", "gpt-oss", "kimi-k2",
    ):  # fmt: skip
        assert name in names
    for name in BUILTIN_NAMES:  # each compiles and renders a one-turn chat
        assert _render(name, [{"role": "user", "content": "q7x"}]).count("q7x") == 1


def test_bos_families_open_with_bos_and_others_do_not() -> None:
    user = [{"role": "user", "content": "hi"}]
    for name in ("llama2", "llama3", "mistral-v7", "gemma", "command-r", "deepseek3"):
        assert _render(name, user, bos="<s>").startswith("<s>")
    for name in ("chatml", "phi3", "zephyr", "granite"):
        assert not _render(name, user, bos="<s>").startswith("<s>")
    # A tokenizer that adds no BOS (Qwen, GPT-2 style) gets none from the template either.
    llama3 = ChatTemplate(
        builtin_template("llama3") or "", bos_token="<s>", eos_token="", add_bos=False
    )
    assert llama3.render(user).startswith("<|start_header_id|>user")


def test_content_parts_and_generation_prompt() -> None:
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert _render("llama3", parts) == (
        "<|start_header_id|>user<|end_header_id|>\n\na\nb<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    no_prompt = _render("chatml", [{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\nx<|im_end|>\n"
    tool_call = [{"role": "assistant", "content": None}]
    assert _render("chatml", tool_call, add_generation_prompt=False) == (
        "<|im_start|>assistant\n<|im_end|>\n"
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("{% for m in messages %}{{'<|im_start|>' + m['role'] }}{% endfor %}", "chatml"),
        ("{{ '<|im_start|>' }}{{ '<|im_sep|>' }}", "phi4"),
        ("{{ '<|start_header_id|>' }} x {{ '<|end_header_id|>' }}", "llama3"),
        ("{{ bos_token }}{{ '[INST] ' }}{{ '<<SYS>>' }}", "llama2-sys"),
        ("{{ '[SYSTEM_PROMPT]' }}{{ '[INST]' }}", "mistral-v7"),
        ("<start_of_turn>user", "gemma"),
        ("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>", "command-r"),
        ("USER: x ASSISTANT: y", "vicuna"),
        ("llama3", "llama3"),
        ("no markers here", None),
    ],
)
def test_detection_by_markers(source: str, expected: str | None) -> None:
    assert detect_builtin(source) == expected


def test_override_source_follows_llama_server() -> None:
    assert override_source("llama3") == builtin_template("llama3")
    assert override_source(" gemma\n", jinja=False) == builtin_template("gemma")
    # With --jinja any other text is a Jinja template, even without markup.
    assert override_source("This is not a chat template, it is") == (
        "This is not a chat template, it is"
    )
    # Without, it must be recognisable as a built-in format.
    llama3_like = (
        "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{% endfor %}"
    )
    assert override_source(llama3_like, jinja=False) == builtin_template("llama3")
    with pytest.raises(TemplateError, match="not supported.*without --jinja"):
        override_source("This is not a chat template, it is", jinja=False)
    with pytest.raises(TemplateError, match="did you mean 'llama3'"):
        override_source("lama3")
    with pytest.raises(TemplateError, match="not supported.*does not compile"):
        override_source("{% for %}")


# ------------------------------------------------------------------ through the server


@pytest.fixture(scope="module")
def command_r_server(tiny_llama_dir: Path) -> Iterator[str]:
    args = ["-m", str(tiny_llama_dir), "-c", "1024", "-np", "1", "--api-key", API_KEY, "--no-jinja"]
    with ServeProcess([*args, "--chat_template", "command-r"]).start() as proc:
        yield proc.url


def test_server_renders_the_builtin_template(command_r_server: str) -> None:
    messages = [
        {"role": "system", "content": "You are a test."},
        {"role": "user", "content": "Hi there"},
    ]
    answer = httpx.post(
        f"{command_r_server}/apply-template", json={"messages": messages}, headers=AUTH, timeout=60
    )
    assert answer.status_code == 200
    prompt = answer.json()["prompt"]
    # llama-server's text: the BOS the tokenizer adds is not part of it (llama.cpp's
    # test_apply_chat_template), but the prompt the model reads starts with it.
    assert prompt == (
        "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    )
    tokenized = httpx.post(
        f"{command_r_server}/tokenize",
        json={"content": prompt, "add_special": True, "parse_special": True},
        headers=AUTH,
        timeout=30,
    ).json()["tokens"]
    counted = httpx.post(
        f"{command_r_server}/v1/chat/completions/input_tokens",
        json={"messages": messages},
        headers=AUTH,
        timeout=30,
    ).json()["input_tokens"]
    assert counted == len(tokenized)
    chat = httpx.post(
        f"{command_r_server}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 2, "temperature": 0},
        headers=AUTH,
        timeout=120,
    )
    assert chat.status_code == 200 and chat.json()["choices"][0]["finish_reason"] == "length"


def test_serve_refuses_unrecognised_text_without_jinja(tiny_llama_dir: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "mlxcel", "serve", "-m", str(tiny_llama_dir), "--no-jinja",
         "--chat-template", "This is not a chat template, it is", "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert "--chat-template: the supplied chat template is not supported" in line


def test_thinking_off_closes_a_block_the_template_opens_itself() -> None:
    """DeepSeek-R1-style templates always open `<think>`; with thinking off llama.cpp
    closes it at once, so the model answers directly."""
    r1_like = (
        "{% for m in messages %}<｜User｜>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
    )
    template = ChatTemplate(r1_like, bos_token="", eos_token="")
    user = [{"role": "user", "content": "q"}]
    off = template.render(user, template_kwargs={"enable_thinking": False})
    assert off.endswith("<｜Assistant｜><think>\n</think>")
    assert template.render(user, template_kwargs={"enable_thinking": True}).endswith("<think>\n")
    assert template.render(user).endswith("<think>\n")
    no_prompt = template.render(
        user, add_generation_prompt=False, template_kwargs={"enable_thinking": False}
    )
    assert "</think>" not in no_prompt
    # A template that handles enable_thinking itself is left as it renders.
    qwen3_like = (
        "{% if enable_thinking is defined and not enable_thinking %}"
        "<think>\n\n</think>\n\n{% endif %}"
    )
    assert (
        ChatTemplate(qwen3_like, bos_token="", eos_token="").render(
            user, template_kwargs={"enable_thinking": False}
        )
        == "<think>\n\n</think>\n\n"
    )
