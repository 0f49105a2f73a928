"""llama.cpp's GBNF grammars, read through llguidance's GBNF-to-Lark translation.

llama-server's `grammar` request field holds a GBNF grammar (`root ::= ...`). llguidance
ships a translator to its Lark dialect, so a GBNF grammar compiles with `compile_lark`
like any other Lark grammar; only the llguidance backend can do it.
"""

from __future__ import annotations

import re
from typing import Any

from mlxcel.engine.grammar.base import CompiledGrammar, GrammarBackend, short_error
from mlxcel.engine.grammar.limits import MAX_SCHEMA_BYTES, InvalidSchema, SchemaTooLarge

MAX_GBNF_BYTES = MAX_SCHEMA_BYTES
"""The largest GBNF grammar accepted (UTF-8 bytes), the same bound as a JSON schema."""


def _group_nested_repetitions(translator: Any) -> None:
    """llguidance's translator (through 1.9.1) takes a repetition for an atom, so a group
    repeating one repeated item lost its parentheses: `("a"{2}){3}` became `"a"{2,2}{3,3}`
    and `(x+)?` `x+?`, which its own Lark reader refuses (a 400 for a valid grammar). A
    repetition is no atom: the outer one keeps the group."""
    node = getattr(translator, "RepetitionNode", None)
    if node is not None and hasattr(node, "is_atomic"):  # a later release may fix or rename it
        node.is_atomic = lambda self: False


_ESCAPE = re.compile(r"\\(?:\\|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8}))")


def _spell_code_points(grammar: str) -> str:
    """GBNF's `\\uXXXX` and `\\UXXXXXXXX` escapes spelled so the translator keeps them:
    it wrote `\\u00e9` as `\\ue9` and `\\U0001F600` as `\\U1F600`, which Lark reads as
    no escape (a 400 for a valid grammar). Up to U+00FF they become `\\xHH`, which it
    passes on; above, the character itself (never one GBNF gives a meaning). Escaped
    backslashes are skipped whole, and surrogates left to fail as before."""

    def spell(match: re.Match[str]) -> str:
        digits = match.group(1) or match.group(2)
        if digits is None:
            return match.group(0)  # an escaped backslash
        code = int(digits, 16)
        if code <= 0xFF:
            return f"\\x{code:02x}"
        if 0xD800 <= code <= 0xDFFF or code > 0x10FFFF:
            return match.group(0)
        return chr(code)

    return _ESCAPE.sub(spell, grammar)


def lark_from_gbnf(grammar: str) -> str:
    """The Lark text of the GBNF `grammar`; `SchemaTooLarge` / `InvalidSchema` (HTTP 400)."""
    if len(grammar.encode("utf-8", "surrogatepass")) > MAX_GBNF_BYTES:
        raise SchemaTooLarge(f"grammar: larger than {MAX_GBNF_BYTES} bytes")
    from llguidance import gbnf_to_lark as translator

    _group_nested_repetitions(translator)
    try:
        return str(translator.gbnf_to_lark(_spell_code_points(grammar)))
    except RecursionError:
        raise InvalidSchema("grammar: nested too deeply") from None
    except Exception as exc:  # the translator raises plain Exception for grammar errors
        raise InvalidSchema(f"grammar: invalid GBNF grammar: {short_error(exc)}") from None


def compile_gbnf(backend: GrammarBackend, grammar: str) -> CompiledGrammar:
    """Compile the GBNF `grammar` on `backend` (`InvalidSchema` when the backend has no
    Lark front end, or the grammar is rejected)."""
    if not backend.supports_lark:
        raise InvalidSchema(
            f"grammar: GBNF grammars need the llguidance grammar backend, not {backend.name}"
        )
    return backend.compile_lark(lark_from_gbnf(grammar))
