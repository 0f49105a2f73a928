"""What speculation the engine runs: the drafter's kind, draft lengths and the draft model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from mlxcel.engine.errors import ModelLoadError

if TYPE_CHECKING:
    from mlxcel.engine.loading.model import LoadedModel

DrafterKind = Literal["prompt-lookup", "draft"]

PROMPT_LOOKUP = "prompt-lookup"
DRAFT_MODEL = "draft-model"


@dataclass(frozen=True)
class SpeculationConfig:
    """Speculative decoding settings for one `TextEngine`.

    `kind`: "prompt-lookup" (n-gram drafts from the prompt and the output so far) or "draft"
    (greedy drafts from `draft`, a small model sharing the target's vocabulary). `n_max`: the
    most tokens drafted per verify round; `n_min`: fewer drafted tokens than this are not
    verified (a plain step runs instead). `adaptive`: draft only when the measured costs and
    acceptance rate say it pays (see `policy`); False: verify whatever the drafter offers.
    """

    kind: DrafterKind
    n_max: int = 3
    n_min: int = 0
    draft: LoadedModel | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("prompt-lookup", "draft"):
            raise ValueError(f"speculation kind must be prompt-lookup or draft, not {self.kind!r}")
        if self.n_max < 1:
            raise ValueError(f"the draft length n_max must be >= 1, not {self.n_max}")
        if not 0 <= self.n_min <= self.n_max:
            raise ValueError(f"n_min must be between 0 and n_max ({self.n_max}), not {self.n_min}")
        if (self.kind == "draft") != (self.draft is not None):
            raise ValueError("a draft model is required by, and only by, kind 'draft'")

    @property
    def draft_kind(self) -> str:
        """The `timings.draft_kind` label: "prompt-lookup" or "draft-model"."""
        return PROMPT_LOOKUP if self.kind == "prompt-lookup" else DRAFT_MODEL


def check_draft_model(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft model whose vocabulary differs from the target's (ModelLoadError).

    Drafted token ids are verified by the target as they are, so both tokenizers must map the
    same ids to the same tokens: same size, same special tokens, same pieces at sampled ids.
    """
    t, d = target.tokenizer, draft.tokenizer
    name = draft.info.name
    if t.vocab_size != d.vocab_size:
        raise ModelLoadError(
            f"draft model {name}: its vocabulary has {d.vocab_size} tokens, the model's has "
            f"{t.vocab_size}; speculative decoding needs the same tokenizer"
        )
    if t.eos_token_ids != d.eos_token_ids or t.bos_token_id != d.bos_token_id:
        raise ModelLoadError(
            f"draft model {name}: its BOS/EOS tokens differ from the model's; speculative "
            "decoding needs the same tokenizer"
        )
    n = t.vocab_size
    probes = sorted({*range(min(n, 16)), *range(max(0, n - 16), n), *range(0, n, max(1, n // 64))})
    if t.hf.convert_ids_to_tokens(probes) != d.hf.convert_ids_to_tokens(probes):
        raise ModelLoadError(
            f"draft model {name}: its tokens differ from the model's at the same ids; "
            "speculative decoding needs the same tokenizer"
        )
