"""Mistral bracketed (Ministral 2410 on, Mistral Small 3, Magistral, Devstral):
`[TOOL_CALLS]NAME[ARGS]{json}`, one marker per call.

The reader is shared with Mistral Nemo (`[TOOL_CALLS]` followed by either form); the JSON
arguments stream verbatim while generated.
"""

from __future__ import annotations

from mlxcel.engine.chat.tool_calls.mistral_nemo import MistralNemoFormat


class MistralBracketedFormat(MistralNemoFormat):
    """`[TOOL_CALLS]NAME[ARGS]{json}` calls."""

    name = "mistral_bracketed"
