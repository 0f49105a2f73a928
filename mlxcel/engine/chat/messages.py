"""OpenAI-style chat messages → the plain dicts Hugging Face chat templates expect."""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")

TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
"""Content-part types that carry text, and the key their text is under (OpenAI's chat and
Responses kinds; an assistant's `refusal` part reads as its text)."""
# Content-part types that carry media, and the input kind each one is.
_MEDIA_PARTS = {
    "image_url": "image",
    "input_image": "image",
    "image": "image",
    "video_url": "video",
    "video": "video",
    "input_audio": "audio",
    "audio": "audio",
    "file": "file",
    "input_file": "file",
}

_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
_THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def normalize_messages(
    messages: Sequence[Mapping[str, Any]],
    *,
    allow_media: Collection[str] = (),
    part_separator: str = "\n",
) -> list[dict[str, Any]]:
    """Validate OpenAI-style `messages` and shape them for a chat template.

    Roles must be system/developer/user/assistant/tool (developer becomes system).
    Content-part arrays become text (text parts joined by `part_separator`); a media part
    raises ValueError unless its kind ("image", "audio", "video", "file") is in
    `allow_media`, in which case the message keeps its part list. Assistant `tool_calls`
    get `function.arguments` as a dict, as HF templates expect. Keys set to None are dropped.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of message objects")
    if not messages:
        raise ValueError("messages must not be empty")
    return [_normalize_message(m, i, allow_media, part_separator) for i, m in enumerate(messages)]


def strip_think_blocks(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Apply the rolling-checkpoint rule (used when preserve_thinking is false).

    Scanning from the end, find the most recent user turn that is not a tool response;
    every assistant message before it loses its `<think>...</think>` blocks and its
    `reasoning_content`. Later messages (the turn in progress) keep theirs. The input is
    not modified.
    """
    cut = _last_user_query(messages)
    result: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        out = dict(message)
        if cut is not None and index < cut and out.get("role") == "assistant":
            out.pop("reasoning_content", None)
            content = out.get("content")
            if isinstance(content, str):
                out["content"] = remove_think(content)
            elif isinstance(content, list):
                out["content"] = [_strip_part(part) for part in content]
        result.append(out)
    return result


def remove_think(text: str) -> str:
    """`text` without its reasoning: `<think>` blocks, a lone leading `</think>`, an open tail."""
    close = text.find(_THINK_CLOSE)
    opening = text.find(_THINK_OPEN)
    stripped = text
    if close != -1 and (opening == -1 or close < opening):
        # The generation prompt opened the block, so only its end is in the content.
        stripped = stripped[close + len(_THINK_CLOSE) :].lstrip()
    stripped = _THINK_BLOCK.sub("", stripped)
    unclosed = stripped.find(_THINK_OPEN)
    if unclosed != -1:
        stripped = stripped[:unclosed].rstrip()
    return stripped


def _normalize_message(
    message: Any, index: int, allow_media: Collection[str], separator: str
) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ValueError(f"message {index} must be an object with a role")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(
            f"message {index} has invalid role {role!r}; expected one of {', '.join(ROLES)}"
        )
    out: dict[str, Any] = {k: v for k, v in message.items() if v is not None}
    out["role"] = "system" if role == "developer" else role
    where = f"message {index} ({role})"

    tool_calls = out.pop("tool_calls", None)
    if tool_calls:
        if role != "assistant":
            raise ValueError(f"{where}: only assistant messages may have tool_calls")
        if not isinstance(tool_calls, list):
            raise ValueError(f"{where}: tool_calls must be a list")
        out["tool_calls"] = [
            _normalize_tool_call(c, f"{where} tool call {i}") for i, c in enumerate(tool_calls)
        ]

    content = message.get("content")
    if content is None:
        if role != "assistant":
            raise ValueError(f"{where} has no content")
        if "tool_calls" in out:
            # HF templates are written for tool-call turns without a content key.
            out.pop("content", None)
        else:
            out["content"] = ""
    else:
        out["content"] = _normalize_content(content, where, allow_media, separator)

    if role == "tool" and "tool_call_id" in out and not isinstance(out["tool_call_id"], str):
        raise ValueError(f"{where}: tool_call_id must be a string")
    return out


def _normalize_content(
    content: Any, where: str, allow_media: Collection[str], separator: str
) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: content must be a string or a list of content parts")
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    has_media = False
    for i, part in enumerate(content):
        if isinstance(part, str):
            part = {"type": "text", "text": part}
        if not isinstance(part, Mapping):
            raise ValueError(f"{where}: content part {i} must be an object")
        kind = part.get("type")
        if kind in TEXT_PARTS:
            text = part.get(TEXT_PARTS[kind])
            if not isinstance(text, str):
                raise ValueError(f"{where}: content part {i} ({kind}) has no text")
            texts.append(text)
            parts.append({"type": "text", "text": text})
        elif kind in _MEDIA_PARTS:
            media = _MEDIA_PARTS[kind]
            if media not in allow_media:
                raise ValueError(
                    f"the loaded model does not accept {media} input "
                    f"(content part {kind!r} in {where})"
                )
            has_media = True
            parts.append(dict(part))
        else:
            raise ValueError(f"{where}: unsupported content part type {kind!r}")
    return parts if has_media else separator.join(texts)


def _normalize_tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise ValueError(f"{where} must be an object")
    function = call.get("function")
    if not isinstance(function, Mapping):
        raise ValueError(f"{where} has no function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where} has no function name")
    out = {k: v for k, v in call.items() if v is not None}
    out["type"] = call.get("type") or "function"
    out["function"] = {k: v for k, v in function.items() if v is not None}
    out["function"]["arguments"] = _parse_arguments(function.get("arguments"), where)
    return out


def _parse_arguments(arguments: Any, where: str) -> Any:
    """Arguments as a dict; a string that is not a JSON object stays as it came."""
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if not isinstance(arguments, str):
        raise ValueError(f"{where}: function.arguments must be a JSON string or an object")
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def _last_user_query(messages: Sequence[Mapping[str, Any]]) -> int | None:
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if message.get("role") != "user":
            continue
        content = message.get("content")
        text = content.strip() if isinstance(content, str) else ""
        if text.startswith("<tool_response>") and text.endswith("</tool_response>"):
            continue
        return index
    return None


def _strip_part(part: Any) -> Any:
    if (
        isinstance(part, Mapping)
        and part.get("type") == "text"
        and isinstance(part.get("text"), str)
    ):
        return {**part, "text": remove_think(part["text"])}
    return part
