"""Text → phonemes for Kokoro, offline.

Kokoro reads phonemes, not letters. The first available of these is used:

1. misaki (`pip install misaki`), the G2P Kokoro was trained with;
2. the espeak-ng library and data bundled in the `piper-tts` wheel;
3. an `espeak-ng` (or `espeak`) program on PATH.

espeak-ng's IPA is rewritten into Kokoro's symbol set (diphthongs as single letters, and for
American English no length marks and `T` for the flap). None of these download anything at
run time. Text wrapped in `[[...]]` is taken as phonemes as it is.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import threading
from collections.abc import Callable

from mlxcel.engine.errors import InvalidRequestError

PHONEME_BLOCK = re.compile(r"^\s*\[\[(.*)\]\]\s*$", re.DOTALL)
NO_PHONEMIZER = (
    "no phonemizer available for text input: install misaki, piper-tts or espeak-ng, "
    "or pass phonemes ([[...]] in the input, --phonemes on the command line)"
)

# espeak-ng IPA → Kokoro's symbols. Multi-letter keys first; order matters.
_COMMON = (
    ("dʒ", "ʤ"),
    ("tʃ", "ʧ"),
    ("eɪ", "A"),
    ("aɪ", "I"),
    ("aʊ", "W"),
    ("ɔɪ", "Y"),
    ("ɐ", "ə"),
    ("r", "ɹ"),
    ("ɬ", "l"),
    ("x", "k"),
    ("ç", "k"),
    ("\u0361", ""),  # tie bar
    ("^", ""),
)
_AMERICAN = (
    ("oʊ", "O"),
    ("ɜː", "ɜɹ"),
    ("ɚ", "əɹ"),
    ("ɾ", "T"),
    ("ː", ""),
)
_BRITISH = (("əʊ", "Q"),)

_lock = threading.Lock()
_espeak_ready = False


class PhonemizerUnavailable(InvalidRequestError):
    """Text was given but no phonemizer is installed."""


def explicit_phonemes(text: str) -> str | None:
    """The phonemes of an input written as `[[...]]`, else None."""
    match = PHONEME_BLOCK.match(text)
    return match.group(1).strip() if match else None


def espeak_to_kokoro(ipa: str, *, british: bool = False) -> str:
    """espeak-ng IPA rewritten into Kokoro's (misaki's) phoneme symbols."""
    out = ipa
    for old, new in _COMMON + (_BRITISH if british else _AMERICAN):
        out = out.replace(old, new)
    return re.sub(r"\s+", " ", out).strip()


def available_phonemizers() -> list[str]:
    """The phonemizers found, in the order `phonemize` tries them: misaki, piper, espeak-ng."""
    found = [name for name in ("misaki", "piper") if importlib.util.find_spec(name) is not None]
    if _espeak_program() is not None:
        found.append("espeak-ng")
    return found


def phonemize(text: str, *, british: bool = False) -> str:
    """Kokoro phonemes for English `text` (American unless `british`)."""
    backends: dict[str, Callable[[str, bool], str]] = {
        "misaki": _misaki,
        "piper": _piper,
        "espeak-ng": _espeak_cli,
    }
    for name in available_phonemizers():
        try:
            return backends[name](text, british)
        except ImportError:  # a package of that name that is not the one we know
            continue
    raise PhonemizerUnavailable(NO_PHONEMIZER)


def _misaki(text: str, british: bool) -> str:
    from misaki import en

    g2p = en.G2P(trf=False, british=british, fallback=None, unk="")
    phonemes, _ = g2p(text)
    return str(phonemes)


def _piper(text: str, british: bool) -> str:
    global _espeak_ready
    from piper import espeakbridge
    from piper.phonemize_espeak import ESPEAK_DATA_DIR

    with _lock:
        if not _espeak_ready:
            espeakbridge.initialize(str(ESPEAK_DATA_DIR))
            _espeak_ready = True
        _set_voice(espeakbridge.set_voice, british)
        clauses = espeakbridge.get_phonemes(text)
    parts = []
    for phonemes, terminator, _end in clauses:
        phonemes = re.sub(r"\([^)]*\)", "", phonemes)  # language-switch flags
        parts.append(phonemes + terminator)
    return espeak_to_kokoro(" ".join(parts), british=british)


def _set_voice(set_voice: Callable[[str], None], british: bool) -> None:
    names = ("en-gb", "en") if british else ("en-us", "en")
    for name in names:
        try:
            set_voice(name)
            return
        except RuntimeError:
            continue
    raise PhonemizerUnavailable(f"espeak-ng has no English voice ({', '.join(names)})")


def _espeak_program() -> str | None:
    return shutil.which("espeak-ng") or shutil.which("espeak")


def _espeak_cli(text: str, british: bool) -> str:
    program = _espeak_program()
    if program is None:
        raise PhonemizerUnavailable(NO_PHONEMIZER)
    voice = "en-gb" if british else "en-us"
    try:
        done = subprocess.run(
            [program, "-q", "--ipa", "-v", voice, "--", text],
            capture_output=True,
            timeout=60,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise PhonemizerUnavailable(f"espeak-ng failed: {exc}") from exc
    return espeak_to_kokoro(done.stdout.decode("utf-8", "replace"), british=british)
