"""A session's conversation: its items in OpenAI's Realtime item shape, and the chat turns
they become for the chat core.

Items are `message` (system, user or assistant, with text or audio content; audio carries
its transcript), `function_call` and `function_call_output`. `conversation.item.create`
bodies are checked here (`parse_item`); audio content is returned apart for transcription.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxcel.server.chat.request import ChatTurn
from mlxcel.server.realtime.protocol import ClientEventError, new_id

MAX_ITEMS = 1000
"""Items a conversation keeps; the oldest go first (their tokens would not fit anyway)."""
MAX_TEXT_CHARS = 100_000
MAX_CONVERSATION_CHARS = 1_000_000
"""Text a conversation keeps (its items' text, transcripts, call arguments and outputs);
the oldest items go first past it, and one item larger than it is refused."""

_TEXT_PARTS = {"input_text", "output_text", "text"}
_AUDIO_PARTS = {"input_audio", "output_audio", "audio"}


@dataclass
class PendingAudio:
    """Audio content of a created item, to transcribe into its `transcript`."""

    item: dict[str, Any]
    content_index: int
    audio: str  # base64 in the session's input format


def message_item(
    role: str, content: list[dict[str, Any]], *, status: str = "completed"
) -> dict[str, Any]:
    """A `message` item with a fresh id."""
    return {
        "id": new_id("item"),
        "object": "realtime.item",
        "type": "message",
        "status": status,
        "role": role,
        "content": content,
    }


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise ClientEventError(f"{param} must be a string", param=param)
    if len(value) > MAX_TEXT_CHARS:
        raise ClientEventError(f"{param} is longer than {MAX_TEXT_CHARS} characters", param=param)
    return value


def parse_item(body: Any) -> tuple[dict[str, Any], list[PendingAudio]]:
    """The item of a `conversation.item.create` (fresh id unless it has one), and its audio
    parts to transcribe."""
    if not isinstance(body, dict):
        raise ClientEventError("item must be an object", param="item")
    kind = body.get("type")
    item_id = body.get("id")
    if item_id is not None:
        item_id = _text(item_id, "item.id")[:64]
    if kind == "function_call_output":
        item = {
            "id": item_id or new_id("item"),
            "object": "realtime.item",
            "type": "function_call_output",
            "status": "completed",
            "call_id": _text(body.get("call_id"), "item.call_id")[:128],
            "output": _text(body.get("output"), "item.output"),
        }
        return item, []
    if kind == "function_call":
        item = {
            "id": item_id or new_id("item"),
            "object": "realtime.item",
            "type": "function_call",
            "status": "completed",
            "call_id": _text(body.get("call_id") or new_id("call"), "item.call_id")[:128],
            "name": _text(body.get("name"), "item.name")[:64],
            "arguments": _text(body.get("arguments", ""), "item.arguments"),
        }
        return item, []
    if kind != "message":
        raise ClientEventError(
            "item.type must be message, function_call or function_call_output",
            param="item.type",
        )
    role = body.get("role")
    if role not in ("user", "system", "assistant"):
        raise ClientEventError("item.role must be user, system or assistant", param="item.role")
    parts = body.get("content")
    if not isinstance(parts, list) or not parts or len(parts) > 64:
        raise ClientEventError("item.content must be a list of 1 to 64 parts", param="item.content")
    content: list[dict[str, Any]] = []
    audio: list[PendingAudio] = []
    item = message_item(str(role), content)
    if item_id:
        item["id"] = item_id
    for index, part in enumerate(parts):
        where = f"item.content[{index}]"
        if not isinstance(part, dict):
            raise ClientEventError(f"{where} must be an object", param=where)
        part_type = part.get("type")
        if part_type in _TEXT_PARTS:
            text_type = "output_text" if role == "assistant" else "input_text"
            content.append({"type": text_type, "text": _text(part.get("text"), f"{where}.text")})
        elif part_type in _AUDIO_PARTS and role == "user":
            data = part.get("audio")
            transcript = part.get("transcript")
            entry: dict[str, Any] = {"type": "input_audio", "transcript": None}
            if transcript is not None:
                entry["transcript"] = _text(transcript, f"{where}.transcript")
            elif isinstance(data, str) and data:
                audio.append(PendingAudio(item, index, data))
            else:
                raise ClientEventError(
                    f"{where} needs base64 `audio` or a `transcript`", param=f"{where}.audio"
                )
            content.append(entry)
        elif part_type in _AUDIO_PARTS and role == "assistant":
            transcript = _text(part.get("transcript", ""), f"{where}.transcript")
            content.append({"type": "output_audio", "transcript": transcript})
        else:
            raise ClientEventError(
                f"{where}.type {str(part_type)[:40]!r} is not supported for role {role}",
                param=f"{where}.type",
            )
    if item_chars(item) > MAX_CONVERSATION_CHARS:
        raise ClientEventError(
            f"item.content holds more than {MAX_CONVERSATION_CHARS} characters",
            param="item.content",
        )
    return item, audio


def item_text(item: dict[str, Any]) -> str:
    """The text of a message item: its text parts and audio transcripts, joined."""
    pieces = []
    for part in item.get("content") or []:
        value = part.get("text") if "text" in part else part.get("transcript")
        if value:
            pieces.append(str(value))
    return " ".join(pieces)


def item_chars(item: dict[str, Any]) -> int:
    """The characters of text `item` holds (what MAX_CONVERSATION_CHARS counts)."""
    if item["type"] == "function_call":
        return len(item["arguments"]) + len(item["name"])
    if item["type"] == "function_call_output":
        return len(item["output"])
    return sum(
        len(part.get("text") or part.get("transcript") or "") for part in item.get("content") or []
    )


def chat_turns(instructions: str, items: list[dict[str, Any]]) -> list[ChatTurn]:
    """The chat messages of a conversation, after the session's instructions: consecutive
    function calls become one assistant message with `tool_calls`."""
    turns = [ChatTurn({"role": "system", "content": instructions}, "session.instructions")]
    for item in items:
        where = f"item {item['id']}"
        kind = item["type"]
        if kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"] or "{}"},
            }
            last = turns[-1].message
            if last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                turns.append(
                    ChatTurn({"role": "assistant", "content": "", "tool_calls": [call]}, where)
                )
        elif kind == "function_call_output":
            message = {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            turns.append(ChatTurn(message, where))
        else:
            text = item_text(item)
            if text or item["role"] != "assistant":
                turns.append(ChatTurn({"role": item["role"], "content": text}, where))
    return turns
