"""Chat templates, compiled once and rendered in an immutable Jinja sandbox.

Templates come from GGUF files and downloads, so they are untrusted input: they run in
`ImmutableSandboxedEnvironment`, where any reach for Python internals or any mutation of the
objects we pass in raises instead of running. The environment follows the Hugging Face
conventions (`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text,
`trim_blocks`/`lstrip_blocks`, loop controls, `{% generation %}` blocks).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Mapping
from datetime import datetime
from functools import update_wrapper
from types import BuiltinMethodType
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from markupsafe import Markup

from mlxcel.engine.chat.template_limits import (
    BoundedFormatter,
    bounded_concat,
    bounded_filter,
    bounded_iter,
    check_binop,
    check_result,
    check_str_method,
    concat_text,
    printed,
    render_budget,
)
from mlxcel.engine.errors import EngineError

#: Variables the server renders itself; chat_template_kwargs may not set them.
RESERVED_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "documents"}
)

#: Used for models that ship no chat template.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] is iterable %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Exponent past which `**` in a template is refused (a CPU bomb); sizes: template_limits.
_MAX_EXPONENT = 4096
# Widest `tojson` indent accepted (each line repeats it once per nesting level).
_MAX_JSON_INDENT = 1024

# (family, markers that must all appear); the first row that matches wins, so the most
# specific rows come first.
_FAMILY_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("harmony", ("<|channel|>", "<|message|>")),
    ("minimax_m3", ("]<]minimax[>[",)),
    ("minimax_m2", ("<minimax:tool_call>",)),
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("longcat", ("<longcat_tool_call>",)),
    ("glm", ("<arg_key>", "<arg_value>")),
    ("gemma4", ("<|tool_call>",)),
    ("function_gemma", ("<start_function_call>",)),
    ("gemma", ("<start_of_turn>",)),
    ("deepseek", ("<｜tool▁calls▁begin｜>",)),
    ("deepseek", ("<｜Assistant｜>",)),
    ("qwen3_coder", ("<tool_call>", "<function=", "<parameter=")),
    ("functionary_v32", (">>>all",)),
    ("functionary_v31", ("<function=", "<|start_header_id|>")),
    ("llama4", ("<|header_start|>",)),
    ("llama3", ("<|start_header_id|>",)),
    ("granite", ("<|start_of_role|>",)),
    ("command_r", ("<|START_OF_TURN_TOKEN|>",)),
    ("pythonic", ("<|tool_call_start|>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("mistral", ("[INST]",)),
    ("qwen3", ("<|im_start|>", "<think>")),
    ("hermes", ("<tool_call>",)),
    ("phi3", ("<|assistant|>", "<|end|>")),
    ("chatml", ("<|im_start|>",)),
)


class TemplateError(EngineError, ValueError):
    """A chat template failed to compile or render; the message is one line."""


def detect_family(source: str) -> str:
    """A coarse model family from the markers in a chat template; "generic" if none match."""
    for family, markers in _FAMILY_MARKERS:
        if all(marker in source for marker in markers):
            return family
    return "generic"


def override_source(text: str, *, jinja: bool = True) -> str:
    """The Jinja source `--chat-template TEXT` stands for, as llama-server reads it.

    A built-in name (`llama3`, `chatml`, ...; see `BUILTIN_NAMES`) gives that template.
    Other text is a Jinja template as it is (with `jinja`, llama-server's default), or,
    without, must be recognisable as one of the built-in formats by its markers. A lone
    word that is no built-in name is refused (a typo; llama-server would render it as the
    prompt). The result is compiled and tried on one message; TemplateError (one line)
    otherwise.
    """
    from mlxcel.engine.chat.builtin_templates import (
        BUILTIN_NAMES,
        builtin_template,
        detect_builtin,
    )

    name = text.strip()
    source = builtin_template(name)
    if source is None and re.fullmatch(r"[\w.\-]+", name):
        # A lone word is a mistyped name, not a prompt (llama-server would render it).
        close = difflib.get_close_matches(name, BUILTIN_NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TemplateError(
            f"unknown built-in template {name!r}{hint}; built in: {', '.join(BUILTIN_NAMES)}; "
            "or pass Jinja text"
        )
    if source is None and not jinja:
        detected = detect_builtin(text)
        if detected is None:
            raise TemplateError(
                f"the supplied chat template is not supported: {_one_line(text)[:60]!r}; "
                f"without --jinja only the built-in templates are ({', '.join(BUILTIN_NAMES)})"
            )
        source = builtin_template(detected)
    if source is None:
        source = text
    try:
        ChatTemplate(source, bos_token="", eos_token="").render(
            [{"role": "user", "content": "test"}]
        )
    except TemplateError as exc:
        raise TemplateError(f"the supplied chat template is not supported: {exc}") from None
    return source


class ChatTemplate:
    """A chat template compiled once in the sandbox; `render` may be called from any thread."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str | None,
        eos_token: str | None,
        extra_special: dict[str, str] | None = None,
        add_bos: bool = True,
    ) -> None:
        """`add_bos`: whether the model's tokenizer adds a BOS token to a prompt; the
        built-in templates then write it themselves (the prompt is encoded as it is)."""
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos
        special = extra_special or {}
        self.extra_special = {k: v for k, v in special.items() if v is not None}
        self.reserved = RESERVED_VARIABLES | frozenset(special)
        try:
            self._template = _make_environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            message = _one_line(exc.message or "")
            raise TemplateError(
                f"chat template does not compile (line {exc.lineno}): {message}"
            ) from exc
        except Exception as exc:  # noqa: BLE001 - any compile failure of untrusted input
            raise TemplateError(f"chat template does not compile: {_describe(exc)}") from exc

    @property
    def family(self) -> str:
        """The family `detect_family` reads from this template."""
        return detect_family(self.source)

    def check_kwargs(self, kwargs: Mapping[str, Any]) -> None:
        """Raise TemplateError if chat_template_kwargs set a variable the server renders."""
        for key in kwargs:
            if key in self.reserved:
                raise TemplateError(f"chat_template_kwargs may not set {key!r}")

    def render(
        self,
        messages: list[dict[str, Any]],
        /,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages`; `template_kwargs` and extra `kwargs` (chat_template_kwargs)
        reach the template, except the reserved names, which raise TemplateError.

        As llama.cpp, the template also sees today's date (the server's local clock) as
        `date_string` ("05 Dec 2026", which Llama 3.x templates print) and `datetime`
        ("Dec 05 2026"); a chat_template_kwargs value of the same name wins.

        Pass request kwargs as `template_kwargs`: spread with `**`, a key such as "tools"
        would bind to the parameter instead of being refused.
        `tools` and `documents` stay undefined in the template when None or empty.
        """
        extra = {**(template_kwargs or {}), **kwargs}
        self.check_kwargs(extra)
        context: dict[str, Any] = {**_date_context(), **extra}
        context.update(self.extra_special)
        context["messages"] = messages
        context["add_generation_prompt"] = add_generation_prompt
        context["mlxcel_add_bos"] = self.add_bos
        if self.bos_token is not None:
            context["bos_token"] = self.bos_token
        if self.eos_token is not None:
            context["eos_token"] = self.eos_token
        if tools:
            context["tools"] = tools
        if documents:
            context["documents"] = documents
        try:
            with render_budget():
                text = self._template.render(context)
        except TemplateError:
            raise
        except SecurityError as exc:
            raise TemplateError(f"chat template refused: {_describe(exc)}") from exc
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template error: {_describe(exc)}") from exc
        except Exception as exc:  # noqa: BLE001 - untrusted code may fail in any way
            raise TemplateError(
                f"chat template error: {type(exc).__name__}: {_describe(exc)}"
            ) from exc
        if add_generation_prompt and extra.get("enable_thinking") is False:
            text = close_forced_reasoning(text)
        return text


def close_forced_reasoning(prompt: str) -> str:
    """With thinking off, a generation prompt that opens `<think>` itself (DeepSeek-R1,
    QwQ) gets the block closed at once, as llama.cpp does; other prompts are unchanged."""
    if prompt.endswith(("<think>", "<think>\n")):
        return prompt + "</think>"
    return prompt


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles `~` to the sandbox's size-checked `concat_text` and wraps the iterable of
    every `{% for %}` in `bounded_iter` (the render's loop budget)."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            super().visit_Concat(node, frame)
            return
        self.write("environment.concat_text((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        iterable = nodes.Call(
            nodes.EnvironmentAttribute("bounded_iter"), [node.iter], [], None, None
        )
        bounded = nodes.For(node.target, iterable, node.body, node.else_, node.test, node.recursive)
        bounded.set_lineno(node.lineno)
        super().visit_For(bounded, frame)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, made strict: unsafe access raises instead of rendering empty,
    and whatever a template builds is bounded in size (`template_limits`)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCodeGenerator
    concat = staticmethod(bounded_concat)  # type: ignore[assignment]
    concat_text = staticmethod(concat_text)
    bounded_iter = staticmethod(bounded_iter)

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:  # type: ignore[override]
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if (
            operator == "**"
            and isinstance(left, int)
            and isinstance(right, int)
            and abs(left) > 1
            and right > _MAX_EXPONENT
        ):
            raise SecurityError(f"exponent {right} is too large")
        if operator == "+" and _string_and_nothing(left, right):
            # llama.cpp's Jinja runtime adds a string and an undefined value (or None) as if
            # the latter were "" (the Firefunction v2 template adds its undefined `functions`).
            return check_result(_text(left) + _text(right), operator)
        check_binop(operator, left, right)
        return check_result(super().call_binop(context, operator, left, right), operator)

    def call(__self, __context: Any, __obj: Any, /, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "a call")
        if isinstance(owner, str) and isinstance(__obj, BuiltinMethodType):
            args = check_str_method(owner, name, args, kwargs)
        return check_result(super().call(__context, __obj, *args, **kwargs), name)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """`str.format`/`format_map` through BoundedFormatter (each field's width checked)."""
        wrapper = super().wrap_str_format(value)
        text = getattr(value, "__self__", None)
        if wrapper is None or not isinstance(text, str) or isinstance(text, Markup):
            return wrapper
        vformat = BoundedFormatter(self).vformat
        is_map = value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                return str(check_result(vformat(text, (), args[0]), "str.format_map"))
            return str(check_result(vformat(text, args, kwargs), "str.format"))

        return update_wrapper(bounded, value)


def _raise_exception(message: Any = "") -> NoReturn:
    raise TemplateError(_one_line(str(message)) or "chat template raised an exception")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(str(fmt))


def _string_and_nothing(left: Any, right: Any) -> bool:
    """Whether one operand is a string and the other undefined or None."""
    nothing = (jinja2.Undefined, type(None))
    return (isinstance(left, str) and isinstance(right, nothing)) or (
        isinstance(right, str) and isinstance(left, nothing)
    )


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _date_context() -> dict[str, str]:
    """llama.cpp's extra template variables: today's date in its two formats."""
    now = datetime.now()
    return {"date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y")}


def _tojson(
    value: Any,
    indent: int | str | None = None,
    ensure_ascii: bool = False,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # The first positional argument is `indent`, as in Jinja's own filter; the keywords are HF's.
    # Encoded piece by piece, so that a huge result stops at the size limit as it grows.
    width = len(indent) if isinstance(indent, str) else indent or 0
    if isinstance(width, int) and width > _MAX_JSON_INDENT:
        raise SecurityError(f"tojson indent {width} is too large (at most {_MAX_JSON_INDENT})")
    encoder = json.JSONEncoder(
        indent=indent,
        ensure_ascii=ensure_ascii,
        separators=separators,
        sort_keys=sort_keys,
        default=_json_default,
    )
    return bounded_concat(encoder.iterencode(value))


def _json_default(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _make_environment() -> _Sandbox:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: bounded_filter(name, f) for name, f in env.filters.items()}
    env.finalize = printed
    env.globals.pop("lipsum", None)  # paragraphs of filler text: no chat template needs it
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in str(text).strip().splitlines() if line.strip())


def _describe(exc: BaseException) -> str:
    message = getattr(exc, "message", None) or str(exc)
    return _one_line(message) or type(exc).__name__
