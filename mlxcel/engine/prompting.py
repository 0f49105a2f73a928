"""From user input to prompt tokens: chat templates or raw text."""

from __future__ import annotations

from typing import Any

from mlxcel.engine.errors import InvalidRequestError
from mlxcel.engine.tokenizer import Tokenizer


class PromptError(InvalidRequestError):
    """The prompt could not be built (bad messages, a template error)."""


def chat_template_for(tokenizer: Tokenizer) -> Any:
    """The compiled chat template of `tokenizer` (compiled once, cached on it)."""
    from mlxcel.engine.chat.template import CHATML_TEMPLATE, ChatTemplate

    source = tokenizer.chat_template or CHATML_TEMPLATE
    cached = getattr(tokenizer, "_compiled_template", None)
    if cached is not None and cached[0] == source:
        return cached[1]
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer.encode("a", add_special=True)[:1] == [bos]
    compiled = ChatTemplate(
        source, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token, add_bos=adds_bos
    )
    tokenizer._compiled_template = (source, compiled)  # type: ignore[attr-defined]
    return compiled


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """Render `messages` with the model's chat template (in the Jinja sandbox)."""
    from mlxcel.engine.chat.template import TemplateError

    try:
        return str(
            chat_template_for(tokenizer).render(
                messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools or None,
                template_kwargs=template_kwargs,
            )
        )
    except TemplateError as exc:
        raise PromptError(str(exc)) from exc


def without_added_bos(tokenizer: Tokenizer, text: str) -> str:
    """`text` less a leading BOS token that the tokenizer adds itself: a rendered prompt as
    llama-server shows it (`/apply-template`), whose template output never holds the BOS
    its tokenizer adds. The prompt's tokens are the same either way."""
    template = chat_template_for(tokenizer)
    bos = template.bos_token
    if template.add_bos and bos and text.startswith(bos):
        return text[len(bos) :]
    return text


def chat_tokens(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    **kwargs: Any,
) -> list[int]:
    """Prompt tokens for a chat: the rendered template, encoded without extra specials."""
    return tokenizer.encode(render_chat(tokenizer, messages, **kwargs), add_special=False)


def build_prompt(
    tokenizer: Tokenizer, text: str, *, system: str | None = None, raw: bool = False
) -> list[int]:
    """Prompt tokens for a one-shot prompt: chat-templated unless `raw`."""
    if raw:
        if system:
            text = f"{system}\n\n{text}"
        return tokenizer.encode(text, add_special=True)
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": text})
    return chat_tokens(tokenizer, messages)
