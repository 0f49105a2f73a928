"""llama.cpp's GBNF grammars, read through llguidance's GBNF-to-Lark translation.

llama-server's `grammar` request field holds a GBNF grammar (`root ::= ...`). llguidance
ships a translator to its Lark dialect, so a GBNF grammar compiles with `compile_lark`
like any other Lark grammar; only the llguidance backend can do it.
"""

from __future__ import annotations

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
    translator.RepetitionNode.is_atomic = lambda self: False


def lark_from_gbnf(grammar: str) -> str:
    """The Lark text of the GBNF `grammar`; `SchemaTooLarge` / `InvalidSchema` (HTTP 400)."""
    if len(grammar.encode("utf-8", "surrogatepass")) > MAX_GBNF_BYTES:
        raise SchemaTooLarge(f"grammar: larger than {MAX_GBNF_BYTES} bytes")
    from llguidance import gbnf_to_lark as translator

    _group_nested_repetitions(translator)
    try:
        return str(translator.gbnf_to_lark(grammar))
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
