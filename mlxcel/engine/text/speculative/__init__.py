"""Speculative decoding for the text engine: prompt lookup or a draft model, verified by one
forward of the target per round on a sequence decoding alone (the "solo lane").

`SpeculationConfig` is all a caller needs (`TextEngine(..., speculation=config)`); the rest
(`lane`, `drafters`, `lookup`, `policy`) is the engine's. Importing this package does not
import MLX.
"""

from mlxcel.engine.text.speculative.config import (
    DRAFT_MODEL,
    PROMPT_LOOKUP,
    SpeculationConfig,
    check_draft_model,
)

__all__ = ["DRAFT_MODEL", "PROMPT_LOOKUP", "SpeculationConfig", "check_draft_model"]
