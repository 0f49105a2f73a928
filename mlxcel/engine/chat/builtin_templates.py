"""llama.cpp's built-in chat templates (`--chat-template NAME`), as sandboxed Jinja.

llama-server knows a list of chat formats by name (`llama3`, `mistral-v7`, `gemma`, ...)
and renders them in C++. Each is written here as a small Jinja template of our own that
renders the same text, so the name works with `--chat-template` and goes through the same
sandbox as any model template. With `--no-jinja`, llama-server also recognises a template
text by its markers and uses the matching built-in; `detect_builtin` does the same.

Where llama-server leaves the beginning-of-sequence token to the tokenizer, mlxcel
tokenizes the rendered prompt as it is: the families whose own templates open with
`bos_token` (llama2, mistral, llama3/4, gemma, command-r, deepseek, monarch) start with it
when the model's tokenizer adds a BOS token, so the tokens are llama-server's.
Message content is a string or a list of parts; text parts are joined by newlines, as
llama-server joins them for these templates.
"""

from __future__ import annotations

from collections.abc import Callable

# The content of message `m` as text: a string, or its text parts joined by newlines.
_PRELUDE = (
    "{%- macro text(m) -%}"
    "{%- if m.content is string -%}{{ m.content }}"
    "{%- elif m.content is iterable and m.content is not mapping -%}"
    "{%- for p in m.content if p is mapping and p.type == 'text' -%}"
    "{{ '\\n' if not loop.first else '' }}{{ p.text }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
)
# The BOS token, where the tokenizer would add one (`mlxcel_add_bos`, set by ChatTemplate).
_BOS = "{{ bos_token if bos_token is defined and mlxcel_add_bos is not false else '' }}"


def _lit(text: str) -> str:
    """`text` as a Jinja string literal."""
    escaped = text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
    return f"'{escaped}'"


def _loop(body: str, *, gen: str = "", head: str = "", bos: bool = False, tail: str = "") -> str:
    """A template: `head`, then `body` once per message (`m`, with `c` its text), then
    `gen` when a generation prompt is wanted, then `tail`."""
    out = _PRELUDE + (_BOS if bos else "") + head
    out += "{%- for m in messages -%}{%- set c = text(m) -%}" + body + "{%- endfor -%}"
    if gen:
        out += "{%- if add_generation_prompt -%}{{ " + _lit(gen) + " }}{%- endif -%}"
    return out + tail


def _by_role(cases: dict[str, str], other: str = "") -> str:
    """A body that emits the expression of the message's role (`other` for the rest)."""
    parts = []
    for i, (role, expr) in enumerate(cases.items()):
        keyword = "if" if i == 0 else "elif"
        parts.append(f"{{%- {keyword} m.role == {_lit(role)} -%}}{{{{ {expr} }}}}")
    if other:
        parts.append(f"{{%- else -%}}{{{{ {other} }}}}")
    return "".join(parts) + "{%- endif -%}"


def _wrap(before: str, mid: str, after: str, *, trim: bool = False) -> str:
    """A body `before` + role + `mid` + content + `after`."""
    content = "(c | trim)" if trim else "c"
    return "{{ " + f"{_lit(before)} + m.role + {_lit(mid)} + {content} + {_lit(after)}" + " }}"


def _llama2(*, system: bool, bos_inside: bool, strip: bool) -> str:
    content = "(c | trim)" if strip else "c"
    again = _lit("<s>[INST] " if bos_inside else "[INST] ")
    sys_expr = (
        f"{_lit('<<SYS>>' + chr(10))} + {content} + {_lit(chr(10) + '<</SYS>>' + chr(10) * 2)}"
        if system
        else f"{content} + {_lit(chr(10))}"
    )
    body = (
        "{%- if not ns.inside -%}{%- set ns.inside = true -%}{{ "
        + again
        + " }}{%- endif -%}"
        + _by_role(
            {"system": sys_expr, "user": f"{content} + ' [/INST]'"},
            other=f"{content} + '</s>'",
        )
        + "{%- if m.role not in ('system', 'user') -%}{%- set ns.inside = false -%}{%- endif -%}"
    )
    return _loop(body, bos=True, head="{%- set ns = namespace(inside=true) -%}{{ '[INST] ' }}")


def _mistral(version: str) -> str:
    lead = " " if version == "v1" else ""
    trail = "" if version == "v3-tekken" else " "
    assistant = "(c | trim)" if version == "v3" else "c"
    body = (
        "{%- if not ns.inside -%}{%- set ns.inside = true -%}{{ "
        + _lit(lead + "[INST]" + trail)
        + " }}{%- endif -%}"
        + _by_role(
            {"system": "c + '\\n\\n'", "user": f"c + {_lit(lead + '[/INST]')}"},
            other=f"{_lit(trail)} + {assistant} + '</s>'",
        )
        + "{%- if m.role not in ('system', 'user') -%}{%- set ns.inside = false -%}{%- endif -%}"
    )
    return _loop(body, bos=True, head="{%- set ns = namespace(inside=false) -%}")


def _mistral_v7(space: str) -> str:
    body = _by_role(
        {
            "system": f"'[SYSTEM_PROMPT]' + {_lit(space)} + c + '[/SYSTEM_PROMPT]'",
            "user": f"'[INST]' + {_lit(space)} + c + '[/INST]'",
        },
        other=f"{_lit(space)} + c + '</s>'",
    )
    return _loop(body, bos=True)


def _gemma() -> str:
    body = (
        "{%- if m.role == 'system' -%}{%- set ns.sys = ns.sys + (c | trim) -%}"
        "{%- else -%}"
        "{%- set role = 'model' if m.role == 'assistant' else m.role -%}"
        "{{ '<start_of_turn>' + role + '\\n' }}"
        "{%- if ns.sys and role != 'model' -%}{{ ns.sys + '\\n\\n' }}{%- set ns.sys = '' -%}"
        "{%- endif -%}"
        "{{ (c | trim) + '<end_of_turn>\\n' }}"
        "{%- endif -%}"
    )
    return _loop(
        body, bos=True, head="{%- set ns = namespace(sys='') -%}", gen="<start_of_turn>model\n"
    )


def _orion() -> str:
    body = (
        "{%- if m.role == 'system' -%}{%- set ns.sys = ns.sys + c -%}"
        "{%- elif m.role == 'user' -%}{{ 'Human: ' }}"
        "{%- if ns.sys -%}{{ ns.sys + '\\n\\n' }}{%- set ns.sys = '' -%}{%- endif -%}"
        "{{ c + '\\n\\nAssistant: </s>' }}"
        "{%- else -%}{{ c + '</s>' }}{%- endif -%}"
    )
    return _loop(body, head="{%- set ns = namespace(sys='') -%}")


def _rwkv() -> str:
    body = _by_role(
        {
            "system": "'System: ' + (c | trim) + '\\n\\n'",
            "user": "'User: ' + (c | trim) + '\\n\\n' + ('Assistant:' if loop.last else '')",
            "assistant": "'Assistant: ' + (c | trim) + '\\n\\n'",
        }
    )
    return _loop(body)


def _gigachat() -> str:
    head = (
        "{%- set has_system = messages and messages[0].role == 'system' -%}"
        "{{ '<s>' + (text(messages[0]) + '<|message_sep|>' if has_system else '') }}"
    )
    body = (
        "{%- if not (loop.first and has_system) -%}"
        + _by_role(
            {
                "user": "'user<|role_sep|>' + c + '<|message_sep|>'"
                " + 'available functions<|role_sep|>[]<|message_sep|>'",
                "assistant": "'assistant<|role_sep|>' + c + '<|message_sep|>'",
            }
        )
        + "{%- endif -%}"
    )
    return _loop(body, head=head, gen="assistant<|role_sep|>")


def _bailing(think: bool) -> str:
    body = "{{ '<role>' + ('HUMAN' if m.role == 'user' else m.role | upper) + '</role>' + c }}"
    return _loop(body, gen="<role>ASSISTANT</role>" + ("<think>" if think else ""))


def _bailing2() -> str:
    head = (
        "{%- if not (messages and messages[0].role == 'system') -%}"
        "{{ '<role>SYSTEM</role>detailed thinking off<|role_end|>' }}{%- endif -%}"
    )
    body = (
        "{{ '<role>' + ('HUMAN' if m.role == 'user' else m.role | upper) + '</role>' + c"
        " + '<|role_end|>' }}"
    )
    return _loop(body, head=head, gen="<role>ASSISTANT</role>")


def _hunyuan_dense() -> str:
    body = (
        "{%- if loop.first and m.role == 'system' -%}{{ c + '<｜hy_place▁holder▁no▁3｜>' }}"
        "{%- endif -%}"
        + _by_role(
            {
                "assistant": "'<｜hy_Assistant｜>' + c + '<｜hy_place▁holder▁no▁2｜>'",
                "user": "'<｜hy_User｜>' + c + '<｜hy_Assistant｜>'",
            }
        )
    )
    return _loop(body)


def _hunyuan_vl() -> str:
    body = (
        "{%- if loop.first and m.role == 'system' -%}{{ c + '<｜hy_place▁holder▁no▁3｜>' }}"
        "{%- else -%}"
        + _by_role({"user": "c + '<｜hy_User｜>'", "assistant": "c + '<｜hy_Assistant｜>'"})
        + "{%- endif -%}"
    )
    return _loop(body, head="{{ '<｜hy_begin▁of▁sentence｜>' }}")


def _pangu() -> str:
    names = {
        "system": "系统",
        "user": "用户",
        "assistant": "助手",
        "tool": "工具",
        "function": "方法",
    }
    body = (
        "{%- if loop.first and m.role != 'system' -%}{{ '[unused9]系统：[unused10]' }}{%- endif -%}"
    )
    body += _by_role(
        {role: f"'[unused9]{name}：' + c + '[unused10]'" for role, name in names.items()}
    )
    return _loop(body, gen="[unused9]助手：")


def _table() -> dict[str, Callable[[], str]]:
    im = "<|im_start|>"
    return {
        "chatml": lambda: _loop(_wrap(im, "\n", "<|im_end|>\n"), gen="<|im_start|>assistant\n"),
        "llama2": lambda: _llama2(system=False, bos_inside=False, strip=False),
        "llama2-sys": lambda: _llama2(system=True, bos_inside=False, strip=False),
        "llama2-sys-bos": lambda: _llama2(system=True, bos_inside=True, strip=False),
        "llama2-sys-strip": lambda: _llama2(system=True, bos_inside=False, strip=True),
        "mistral-v1": lambda: _mistral("v1"),
        "mistral-v3": lambda: _mistral("v3"),
        "mistral-v3-tekken": lambda: _mistral("v3-tekken"),
        "mistral-v7": lambda: _mistral_v7(" "),
        "mistral-v7-tekken": lambda: _mistral_v7(""),
        "phi3": lambda: _loop(_wrap("<|", "|>\n", "<|end|>\n"), gen="<|assistant|>\n"),
        "phi4": lambda: _loop(
            _wrap(im, "<|im_sep|>", "<|im_end|>"), gen=im + "assistant<|im_sep|>"
        ),
        "falcon3": lambda: _loop(_wrap("<|", "|>\n", "\n"), gen="<|assistant|>\n"),
        "zephyr": lambda: _loop(_wrap("<|", "|>\n", "<|endoftext|>\n"), gen="<|assistant|>\n"),
        "monarch": lambda: _loop(
            "{{ ('' if loop.first else '<s>') + m.role + '\\n' + c + '</s>\\n' }}",
            bos=True,
            gen="<s>assistant\n",
        ),
        "gemma": _gemma,
        "orion": _orion,
        "openchat": lambda: _loop(
            _by_role(
                {"system": "c + '<|end_of_turn|>'"},
                other="'GPT4 Correct ' + (m.role[:1] | upper) + m.role[1:] + ': ' + c"
                " + '<|end_of_turn|>'",
            ),
            gen="GPT4 Correct Assistant:",
        ),
        "vicuna": lambda: _loop(
            _by_role(
                {
                    "system": "c + '\\n\\n'",
                    "user": "'USER: ' + c + '\\n'",
                    "assistant": "'ASSISTANT: ' + c + '</s>\\n'",
                }
            ),
            gen="ASSISTANT:",
        ),
        "vicuna-orca": lambda: _loop(
            _by_role(
                {
                    "system": "'SYSTEM: ' + c + '\\n'",
                    "user": "'USER: ' + c + '\\n'",
                    "assistant": "'ASSISTANT: ' + c + '</s>\\n'",
                }
            ),
            gen="ASSISTANT:",
        ),
        "deepseek": lambda: _loop(
            _by_role(
                {
                    "system": "c",
                    "user": "'### Instruction:\\n' + c + '\\n'",
                    "assistant": "'### Response:\\n' + c + '\\n<|EOT|>\\n'",
                }
            ),
            bos=True,
            gen="### Response:\n",
        ),
        "deepseek2": lambda: _loop(
            _by_role(
                {
                    "system": "c + '\\n\\n'",
                    "user": "'User: ' + c + '\\n\\n'",
                    "assistant": "'Assistant: ' + c + '<｜end▁of▁sentence｜>'",
                }
            ),
            bos=True,
            gen="Assistant:",
        ),
        "deepseek3": lambda: _loop(
            _by_role(
                {
                    "system": "c + '\\n\\n'",
                    "user": "'<｜User｜>' + c",
                    "assistant": "'<｜Assistant｜>' + c + '<｜end▁of▁sentence｜>'",
                }
            ),
            bos=True,
            gen="<｜Assistant｜>",
        ),
        "deepseek-ocr": lambda: _loop("{{ c }}"),
        "command-r": lambda: _loop(
            _by_role(
                {
                    role: f"'<|START_OF_TURN_TOKEN|>{token}' + (c | trim) + '<|END_OF_TURN_TOKEN|>'"
                    for role, token in (
                        ("system", "<|SYSTEM_TOKEN|>"),
                        ("user", "<|USER_TOKEN|>"),
                        ("assistant", "<|CHATBOT_TOKEN|>"),
                    )
                }
            ),
            bos=True,
            gen="<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
        ),
        "llama3": lambda: _loop(
            _wrap("<|start_header_id|>", "<|end_header_id|>\n\n", "<|eot_id|>", trim=True),
            bos=True,
            gen="<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        "chatglm3": lambda: _loop(
            _wrap("<|", "|>\n ", ""), head="{{ '[gMASK]sop' }}", gen="<|assistant|>"
        ),
        "chatglm4": lambda: _loop(
            _wrap("<|", "|>\n", ""), head="{{ '[gMASK]<sop>' }}", gen="<|assistant|>\n"
        ),
        "glmedge": lambda: _loop(_wrap("<|", "|>\n", ""), gen="<|assistant|>"),
        "minicpm": lambda: _loop(
            _by_role({"user": "'<用户>' + (c | trim) + '<AI>'"}, other="c | trim")
        ),
        "exaone3": lambda: _loop(
            _by_role(
                {
                    "system": "'[|system|]' + (c | trim) + '[|endofturn|]\\n'",
                    "user": "'[|user|]' + (c | trim) + '\\n'",
                    "assistant": "'[|assistant|]' + (c | trim) + '[|endofturn|]\\n'",
                }
            ),
            gen="[|assistant|]",
        ),
        "exaone4": lambda: _loop(
            _by_role(
                {
                    "system": "'[|system|]' + (c | trim) + '[|endofturn|]\\n'",
                    "user": "'[|user|]' + (c | trim) + '\\n'",
                    "assistant": "'[|assistant|]' + (c | trim) + '[|endofturn|]\\n'",
                    "tool": "'[|tool|]' + (c | trim) + '[|endofturn|]\\n'",
                }
            ),
            gen="[|assistant|]",
        ),
        "exaone-moe": lambda: _loop(
            _by_role(
                {
                    role: f"'<|{role}|>\\n' + (c | trim) + '<|endofturn|>\\n'"
                    for role in ("system", "user", "assistant", "tool")
                }
            ),
            gen="<|assistant|>\n",
        ),
        "rwkv-world": _rwkv,
        "granite": lambda: _loop(
            "{{ '<|start_of_role|>' + m.role + '<|end_of_role|>'"
            " + ('<|tool_call|>' if m.role == 'assistant_tool_call' else '')"
            " + c + '<|end_of_text|>\\n' }}",
            gen="<|start_of_role|>assistant<|end_of_role|>",
        ),
        "granite-4.0": lambda: _granite4(),
        "granite-4.1": lambda: _granite4(),
        "gigachat": _gigachat,
        "megrez": lambda: _loop(
            _wrap("<|role_start|>", "<|role_end|>", "<|turn_end|>"),
            gen="<|role_start|>assistant<|role_end|>",
        ),
        "yandex": lambda: _loop(
            _by_role(
                {
                    "user": "' Пользователь: ' + c + '\\n\\n'",
                    "assistant": "' Ассистент: ' + c + '\\n\\n'",
                }
            ),
            gen=" Ассистент:[SEP]",
        ),
        "bailing": lambda: _bailing(False),
        "bailing-think": lambda: _bailing(True),
        "bailing2": _bailing2,
        "llama4": lambda: _loop(
            _wrap("<|header_start|>", "<|header_end|>\n\n", "<|eot|>", trim=True),
            bos=True,
            gen="<|header_start|>assistant<|header_end|>\n\n",
        ),
        "smolvlm": lambda: _loop(
            _by_role(
                {"system": "c + '\\n\\n'", "user": "'User: ' + c + '<end_of_utterance>\\n'"},
                other="'Assistant: ' + c + '<end_of_utterance>\\n'",
            ),
            head="{{ '<|im_start|>' }}",
            gen="Assistant:",
        ),
        "hunyuan-moe": lambda: _loop(
            _by_role(
                {
                    "system": "'<|startoftext|>' + c + '<|extra_4|>'",
                    "assistant": "c + '<|eos|>'",
                },
                other="'<|startoftext|>' + c + '<|extra_0|>'",
            )
        ),
        "gpt-oss": lambda: _loop(
            "{{ '<|start|>' + m.role + '<|message|>' + c"
            " + ('<|return|>' if m.role == 'assistant' else '<|end|>') }}",
            gen="<|start|>assistant",
        ),
        "hunyuan-dense": _hunyuan_dense,
        "hunyuan-vl": _hunyuan_vl,
        "kimi-k2": lambda: _loop(
            _by_role(
                {
                    "system": "'<|im_system|>system<|im_middle|>' + c + '<|im_end|>'",
                    "user": "'<|im_user|>user<|im_middle|>' + c + '<|im_end|>'",
                    "assistant": "'<|im_assistant|>assistant<|im_middle|>' + c + '<|im_end|>'",
                    "tool": "'<|im_system|>tool<|im_middle|>' + c + '<|im_end|>'",
                },
                other="c + '<|im_end|>'",
            ),
            gen="<|im_assistant|>assistant<|im_middle|>",
        ),
        "seed_oss": lambda: _loop(
            "{{ '<seed:bos>' + m.role + '\\n'"
            " + ((c | trim) if m.role == 'assistant' else c) + '<seed:eos>' }}",
            gen="<seed:bos>assistant\n",
        ),
        "grok-2": lambda: _loop(
            _by_role(
                {
                    "system": "'System: ' + (c | trim) + '<|separator|>\\n\\n'",
                    "user": "'Human: ' + (c | trim) + '<|separator|>\\n\\n'",
                    "assistant": "'Assistant: ' + c + '<|separator|>\\n\\n'",
                }
            ),
            gen="Assistant:",
        ),
        "pangu-embedded": _pangu,
        "solar-open": lambda: _loop(
            _wrap("<|begin|>", "<|content|>", "<|end|>"), gen="<|begin|>assistant"
        ),
    }


def _granite4() -> str:
    return _loop(
        "{{ ('<|start_of_role|>assistant<|end_of_role|><|tool_call|>'"
        " if m.role == 'assistant_tool_call'"
        " else '<|start_of_role|>' + m.role + '<|end_of_role|>')"
        " + c + '<|end_of_text|>\\n' }}",
        gen="<|start_of_role|>assistant<|end_of_role|>",
    )


_BUILDERS = _table()

BUILTIN_NAMES: tuple[str, ...] = tuple(sorted(_BUILDERS))
"""The names `--chat-template` accepts, as llama-server lists them."""


def builtin_template(name: str) -> str | None:
    """The Jinja source of built-in template `name` (None when there is no such name)."""
    build = _BUILDERS.get(name)
    return build() if build else None


def detect_builtin(source: str) -> str | None:
    """The built-in template a template text stands for, by its markers (llama-server's
    rule with `--no-jinja`); None when nothing matches."""
    if source in _BUILDERS:
        return source

    def has(*markers: str) -> bool:
        return all(marker in source for marker in markers)

    if has("<|im_start|>"):
        return "phi4" if has("<|im_sep|>") else "smolvlm" if has("<end_of_utterance>") else "chatml"
    if source.startswith("mistral") or has("[INST]"):
        return _detect_mistral(source, has)
    for name, markers in _MARKERS:
        if has(*markers):
            return name
    return None


def _detect_mistral(source: str, has: Callable[..., bool]) -> str:
    if has("[SYSTEM_PROMPT]"):
        return "mistral-v7"
    if has("' [INST] ' + system_message") or has("[AVAILABLE_TOOLS]"):
        if has(" [INST]"):
            return "mistral-v1"
        return "mistral-v3-tekken" if has('"[INST]"') else "mistral-v3"
    if has("content.strip()"):
        return "llama2-sys-strip"
    if has("bos_token + '[INST]"):
        return "llama2-sys-bos"
    return "llama2-sys" if has("<<SYS>>") else "llama2"


# (name, markers that must all appear), tried in order after chatml and the [INST] family.
_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("phi3", ("<|assistant|>", "<|end|>")),
    ("chatglm4", ("[gMASK]<sop>",)),
    ("exaone-moe", ("<|assistant|>", "<|user|>", "<|tool_declare|>")),
    ("falcon3", ("<|assistant|>", "<|user|>", "</s>")),
    ("glmedge", ("<|assistant|>", "<|user|>")),
    ("glmedge", ("<|{{ item['role'] }}|>", "<|begin_of_image|>")),
    ("zephyr", ("<|user|>", "<|endoftext|>")),
    ("monarch", ("bos_token + message['role']",)),
    ("gemma", ("<start_of_turn>",)),
    ("orion", ("'\\n\\nAssistant: ' + eos_token",)),
    ("openchat", ("GPT4 Correct ",)),
    ("vicuna-orca", ("USER: ", "ASSISTANT: ", "SYSTEM: ")),
    ("vicuna", ("USER: ", "ASSISTANT: ")),
    ("deepseek", ("### Instruction:", "<|EOT|>")),
    ("command-r", ("<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>")),
    ("llama3", ("<|start_header_id|>", "<|end_header_id|>")),
    ("chatglm3", ("[gMASK]sop",)),
    ("minicpm", ("<用户>",)),
    ("deepseek2", ("'Assistant: ' + message['content'] + eos_token",)),
    ("deepseek3", ("<｜Assistant｜>", "<｜User｜>", "<｜end▁of▁sentence｜>")),
    ("exaone4", ("[|system|]", "[|assistant|]", "[|endofturn|]", "[|tool|]")),
    ("exaone3", ("[|system|]", "[|assistant|]", "[|endofturn|]")),
    ("rwkv-world", ("rwkv-world",)),
    ("rwkv-world", ("{{- 'User: ' + message['content']|trim + '\\n\\n' -}}",)),
    ("granite-4.0", ("<|start_of_role|>", "<tool_call>", "g4_default_system_message")),
    ("granite-4.0", ("<|start_of_role|>", "<tools>", "g4_default_system_message")),
    ("granite-4.1", ("<|start_of_role|>", "<tool_call>")),
    ("granite-4.1", ("<|start_of_role|>", "<tools>")),
    ("granite", ("<|start_of_role|>",)),
    (
        "gigachat",
        (
            "message['role'] + additional_special_tokens[0] + message['content']"
            " + additional_special_tokens[1]",
        ),
    ),
    ("megrez", ("<|role_start|>",)),
    ("yandex", (" Ассистент:",)),
    ("bailing", ("<role>ASSISTANT</role>", "'HUMAN'")),
    ("bailing-think", ("<role>ASSISTANT</role>", '"HUMAN"', "<think>")),
    ("bailing2", ("<role>ASSISTANT</role>", "<role>HUMAN</role>", "<|role_end|>")),
    ("llama4", ("<|header_start|>", "<|header_end|>")),
    ("hunyuan-moe", ("<|extra_0|>", "<|extra_4|>")),
    ("gpt-oss", ("<|start|>", "<|channel|>")),
    ("hunyuan-vl", ("<｜hy_Assistant｜>", "<｜hy_begin▁of▁sentence｜>")),
    ("hunyuan-dense", ("<｜hy_Assistant｜>", "<｜hy_place▁holder▁no▁3｜>")),
    ("kimi-k2", ("<|im_assistant|>assistant<|im_middle|>",)),
    ("seed_oss", ("<seed:bos>",)),
    ("grok-2", ("'Assistant: '  + message['content'] + '<|separator|>",)),
    ("pangu-embedded", ("[unused9]系统：[unused10]",)),
    ("solar-open", ("<|begin|>", "<|end|>", "<|content|>")),
)
