"""`AdmittedChat`: an admitted chat request, its generation job and how its output is split."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlxcel.engine.chat.tool_calls.base import ParseResult
from mlxcel.server.chat.output_plan import OutputPlan
from mlxcel.server.generation import Job

if TYPE_CHECKING:
    from mlxcel.engine.text.request import GenerationEvent
    from mlxcel.server.bridge import EngineStream

log = logging.getLogger(__name__)


@dataclass
class AdmittedChat:
    """An admitted chat request: its generation job and the parsers its output goes through."""

    job: Job
    plan: OutputPlan
    prompt_tokens: int
    forced: bool = False

    @property
    def stream(self) -> EngineStream:
        """The engine stream of the (single) sequence."""
        return self.job.streams[0]

    def parse(self, events: list[GenerationEvent]) -> ParseResult:
        """The whole collected output, split (a forced call that did not come is logged)."""
        result = self.plan.parse("".join(e.text for e in events))
        self.check_forced(result)
        return result

    def check_forced(self, result: ParseResult) -> None:
        """Log at warn when a forced tool_choice ended without a call."""
        if self.forced and not result.calls:
            log.warning(
                "request %s: tool_choice forced a call but the model made none",
                self.job.request.request_id,
            )
