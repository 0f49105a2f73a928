"""The models a server's settings name: which of them it runs, and that each can be found.

A server runs a chat model (`-m`, else the embedded default) unless the main model serves
embeddings or ranking only, or no `-m` is given next to an audio or image model. Side models
(`--embedding-model`, `--reranker-model`, `--audio-model`, `--tts-model`, `--image-model`,
`--spec-draft-model`) load whatever else is given. `check_models` refuses, before the port
opens, every one that cannot be found or is of the wrong kind for its flag, reading no
weights: a server never announces a port and then exits over a model reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mlxcel.engine.errors import ModelLoadError

if TYPE_CHECKING:
    from mlxcel.config import Settings


def audio_wanted(settings: Settings) -> bool:
    """Whether `--audio-model` or `--tts-model` asks for an audio worker."""
    return bool(settings.audio_model or settings.tts_model)


def chat_model_wanted(settings: Settings) -> bool:
    """Whether the server runs the text engine on the main model (see the module doc)."""
    from mlxcel.server.embeddings.services import text_engine_wanted

    if not settings.model and (audio_wanted(settings) or settings.image_model):
        return False
    return text_engine_wanted(settings)


def check_models(settings: Settings) -> None:
    """Refuse (ModelLoadError, one line naming the flag) a model reference of the settings
    that cannot be loaded: missing, unreadable, or not the kind its flag needs."""
    from mlxcel.engine.loading.resolve import check_model_ref
    from mlxcel.server.embeddings.services import wanted_models

    if chat_model_wanted(settings):
        check_model_ref(settings.model)  # the main model's errors need no flag name
        _check_not_an_encoder(settings.model)
    want_emb, emb_ref, want_rr, rr_ref = wanted_models(settings)
    if want_emb:
        from mlxcel.engine.embeddings.loader import check_embedding_ref

        flag = "--embedding-model" if settings.embedding_model else "--embedding"
        _check(flag, check_embedding_ref, emb_ref)
    if want_rr:
        from mlxcel.engine.embeddings.loader import check_reranker_ref

        flag = "--reranking" if settings.reranking else "--pooling rank"
        flag = "--reranker-model" if settings.reranker_model else flag
        _check(flag, check_reranker_ref, rr_ref)
    if settings.audio_model:
        from mlxcel.engine.audio.whisper import locate_whisper

        _check("--audio-model", locate_whisper, settings.audio_model)
    if settings.tts_model:
        from mlxcel.engine.audio.tts import locate_kokoro

        _check("--tts-model", locate_kokoro, settings.tts_model)
    if settings.image_model:
        from mlxcel.engine.image.families import detect_family
        from mlxcel.engine.image.pipeline import resolve_image_path

        def image(ref: str | None) -> None:
            detect_family(resolve_image_path(str(ref)))

        _check("--image-model", image, settings.image_model)
    if settings.spec_draft_model:
        _check("--spec-draft-model", check_model_ref, settings.spec_draft_model)


def _check_not_an_encoder(ref: str | None) -> None:
    """Refuse an encoder (BERT-style: embeddings and ranking only) as the chat model."""
    from mlxcel.engine.embeddings.loader import is_encoder_model

    if ref and is_encoder_model(ref):
        raise ModelLoadError(
            f"-m: {ref}: an encoder model (embeddings and ranking only) cannot chat; start it "
            "with --embedding or --reranking, or give a chat model"
        )


def _check(flag: str, check: Callable[[str | None], object], ref: str | None) -> None:
    try:
        check(ref)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{flag}: {str(exc).splitlines()[0]}") from None
