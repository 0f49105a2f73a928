"""Turn text into token ids (and back with --decode)."""

from __future__ import annotations

import json
import re

import typer

from .common import PROFILE_OPTION, fail, load_model_or_exit, resolve, stdin_text, utf8_text


def tokenize(
    text: str | None = typer.Argument(None, help="Text to tokenize; - reads stdin."),
    model: str | None = typer.Option(
        None, "--model", "-m", help="GGUF file, MLX dir or HF repo id."
    ),
    pieces: bool = typer.Option(False, "--pieces", help="Show each token's text piece."),
    count: bool = typer.Option(False, "--count", help="Print only the number of tokens."),
    add_special: bool = typer.Option(False, "--add-special", help="Add BOS/EOS as the model does."),
    decode: str | None = typer.Option(
        None, "--decode", help="Ids (comma- or space-separated) to turn back into text."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    profile: str | None = PROFILE_OPTION,
) -> None:
    """Tokenize text with a model's tokenizer, or decode ids with --decode."""
    settings = resolve(profile, {"model": model}).settings
    if decode is not None:
        ids = _parse_ids(decode)
        tokenizer = load_model_or_exit(
            settings.model, store=settings.model_store, quiet=True
        ).tokenizer
        bad = [i for i in ids if not tokenizer.is_valid_id(i)]
        if bad:
            fail(f"token id {bad[0]} is out of the vocabulary (size {tokenizer.vocab_size})")
        out = tokenizer.decode(ids)
        print(json.dumps({"content": out}, ensure_ascii=False) if as_json else out)
        return
    if text is None:
        fail("no text given (pass TEXT, or - to read stdin, or --decode IDS)")
    text = stdin_text() if text == "-" else utf8_text(text, "TEXT")
    tokenizer = load_model_or_exit(settings.model, store=settings.model_store, quiet=True).tokenizer
    ids = tokenizer.encode(text, add_special=add_special)
    if count:
        print(json.dumps({"count": len(ids)}) if as_json else len(ids))
        return
    if as_json:
        tokens: list[object] = (
            [{"id": i, "piece": tokenizer.piece(i)} for i in ids] if pieces else list(ids)
        )
        print(json.dumps({"tokens": tokens}, ensure_ascii=False))
        return
    if pieces:
        for i in ids:
            print(f"{i}\t{json.dumps(tokenizer.piece(i), ensure_ascii=False)}")
        return
    print(" ".join(str(i) for i in ids))


def _parse_ids(raw: str) -> list[int]:
    """Ids split by commas and/or whitespace, so tokenize's own output decodes as printed."""
    parts = [part for part in re.split(r"[,\s]+", raw) if part]
    bad = next((part for part in parts if not re.fullmatch(r"-?[0-9]+", part)), None)
    if bad is not None:
        fail(f"--decode takes integers separated by commas or spaces, not {bad!r}")
    if not parts:
        fail("--decode needs at least one id")
    return [int(part) for part in parts]
