"""Tool-call formats: parse a model's output into content and calls, whole or while streaming.

    fmt = get_format(detect_format(template_source) or "generic")
    result = fmt.parse(text, tools)              # ParseResult(content, calls, reasoning)
    stream = fmt.stream_filter(tools)            # feed(text) / finish() -> deltas

For serving, `ChatOutputStream` (module `output`) chains the reasoning split, the format's
filter and `StreamingToolCallAssembler` into typed output events, one feed per token.
Nothing here imports MLX.
"""

from __future__ import annotations

from mlxcel.engine.chat.tool_calls.base import (
    ContentDelta,
    Delta,
    ParseResult,
    ReasoningDelta,
    StreamFilter,
    ToolCall,
    ToolCallDelta,
    ToolCallFormat,
    Tools,
    collect,
)
from mlxcel.engine.chat.tool_calls.command_r import CommandRFormat
from mlxcel.engine.chat.tool_calls.function_gemma import FunctionGemmaFormat
from mlxcel.engine.chat.tool_calls.functionary_v31 import FunctionaryV31Format
from mlxcel.engine.chat.tool_calls.functionary_v32 import FunctionaryV32Format
from mlxcel.engine.chat.tool_calls.gemma4 import Gemma4Format
from mlxcel.engine.chat.tool_calls.generic_json import GenericJsonFormat
from mlxcel.engine.chat.tool_calls.glm47 import Glm47Format
from mlxcel.engine.chat.tool_calls.granite import GraniteFormat
from mlxcel.engine.chat.tool_calls.harmony import HarmonyFormat
from mlxcel.engine.chat.tool_calls.hermes import HermesFormat
from mlxcel.engine.chat.tool_calls.kimi_k2 import KimiK2Format
from mlxcel.engine.chat.tool_calls.llama3 import Llama3Format
from mlxcel.engine.chat.tool_calls.longcat import LongcatFormat
from mlxcel.engine.chat.tool_calls.minimax_m2 import MinimaxM2Format
from mlxcel.engine.chat.tool_calls.minimax_m3 import MinimaxM3Format
from mlxcel.engine.chat.tool_calls.mistral_bracketed import MistralBracketedFormat
from mlxcel.engine.chat.tool_calls.mistral_nemo import MistralNemoFormat
from mlxcel.engine.chat.tool_calls.pythonic import PythonicFormat
from mlxcel.engine.chat.tool_calls.qwen3_coder import Qwen3CoderFormat

_FORMATS: dict[str, type[ToolCallFormat]] = {
    cls.name: cls
    for cls in (
        HermesFormat,
        Qwen3CoderFormat,
        MistralNemoFormat,
        MinimaxM2Format,
        FunctionaryV31Format,
        FunctionaryV32Format,
        CommandRFormat,
        GraniteFormat,
        Gemma4Format,
        Llama3Format,
        GenericJsonFormat,
        FunctionGemmaFormat,
        MistralBracketedFormat,
        KimiK2Format,
        MinimaxM3Format,
        PythonicFormat,
        Glm47Format,
        LongcatFormat,
        HarmonyFormat,
    )
}

#: Every format name, in the spec's table order.
FORMAT_NAMES: tuple[str, ...] = tuple(_FORMATS)

# (format, markers that must all appear in the template); the first matching row wins, so
# the more specific rows come first.
_DETECTION: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("harmony", ("<|channel|>", "<|message|>")),
    ("minimax_m3", ("]<]minimax[>[",)),
    ("minimax_m2", ("<minimax:tool_call>",)),
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("longcat", ("<longcat_tool_call>",)),
    ("glm47", ("<arg_key>", "<arg_value>")),
    ("gemma4", ("<|tool_call>",)),
    ("function_gemma", ("<start_function_call>",)),
    ("qwen3_coder", ("<tool_call>", "<function=", "<parameter=")),
    ("functionary_v32", (">>>all",)),
    ("functionary_v31", ("<function=", "<|start_header_id|>")),
    ("command_r", ("<|START_ACTION|>",)),
    ("command_r", ("<|START_OF_TURN_TOKEN|>", "Action:")),
    ("granite", ("<|tool_call|>",)),
    ("granite", ("<|start_of_role|>", "<tool_call>")),
    ("mistral_bracketed", ("[TOOL_CALLS]", "[ARGS]")),
    ("mistral_nemo", ("[TOOL_CALLS]",)),
    ("pythonic", ("<|tool_call_start|>",)),
    ("pythonic", ("[func_name1(",)),
    ("llama3", ("<|python_tag|>",)),
    ("llama3", ("<|start_header_id|>", '"parameters"')),
    ("hermes", ("<tool_call>",)),
)


def detect_format(chat_template_source: str | None) -> str | None:
    """The tool-call format a chat template's markers call for.

    None when the template has no tool support at all (it never mentions `tools`); "generic"
    when it renders tools but uses no known wire format.
    """
    source = chat_template_source or ""
    for name, markers in _DETECTION:
        if all(marker in source for marker in markers):
            return name
    return "generic" if "tools" in source else None


def get_format(name: str) -> ToolCallFormat:
    """A fresh instance of the format called `name` (see `FORMAT_NAMES`); KeyError if unknown."""
    try:
        return _FORMATS[name]()
    except KeyError:
        known = ", ".join(FORMAT_NAMES)
        raise KeyError(f"unknown tool-call format {name!r}; known: {known}") from None


__all__ = [
    "FORMAT_NAMES",
    "ContentDelta",
    "Delta",
    "ParseResult",
    "ReasoningDelta",
    "StreamFilter",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallFormat",
    "Tools",
    "collect",
    "detect_format",
    "get_format",
]
