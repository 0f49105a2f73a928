"""A Responses answer on the wire: engine events → output items, stored state, typed events.

The request's life is `generation.Job`'s. The chat output deltas go through
`OutputAssembler` into output items: one response object, or the typed SSE events that
build it. A failure mid-stream ends with `response.failed` carrying the error (the
Responses API's own way); the stored response settles however the answer ends.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from mlxcel.engine.text.request import GenerationEvent
from mlxcel.server.errors import APIError, scrub_paths
from mlxcel.server.generation import Encoder, engine_failure
from mlxcel.server.openai_common import new_id, now, reported_model
from mlxcel.server.openai_responses.events import EventWriter
from mlxcel.server.openai_responses.output import OutputAssembler
from mlxcel.server.openai_responses.store import InFlight, StoredResponse

if TYPE_CHECKING:
    from mlxcel.server.chat.admitted import AdmittedChat
    from mlxcel.server.openai_responses.compaction import CompactionResult
    from mlxcel.server.openai_responses.serving import Prepared, ResponsesServing


class ResponseEncoder(Encoder):
    """One admitted create request: its response object, stored state and typed events."""

    def __init__(
        self,
        serving: ResponsesServing,
        prepared: Prepared,
        job: AdmittedChat,
        compaction: CompactionResult | None = None,
    ) -> None:
        self.serving = serving
        self.compaction = compaction
        self.state = serving.state
        self.prepared = prepared
        self.job = job
        self.id = new_id("resp_")
        self.created_at = now()
        self.assembler = OutputAssembler()
        if compaction is not None:  # the output starts with the compaction item
            self.assembler.items.append(dict(compaction.item))
        stores = serving.stores
        self.store = prepared.body.store and stores.responses.enabled
        self.inflight = InFlight(job.stream)
        self.writer = EventWriter()
        self._out = job.plan.stream(self.id)
        self.settled = False
        self.final_response: dict[str, Any] = {}
        if self.store:
            stores.inflight[self.id] = self.inflight
            stores.responses.put(self.id, self._stored(self.response("in_progress"), []))

    def _stored(self, response: dict[str, Any], history: list[dict[str, Any]]) -> StoredResponse:
        body = self.prepared.body
        fields = {"context_management": body.context_management} if body.context_management else {}
        return StoredResponse(response, history, fields, input_items=self.prepared.items)

    # ------------------------------------------------------------ the object

    def response(
        self,
        status: str,
        *,
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        incomplete: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The response object with `status` and the output built so far."""
        body = self.prepared.body
        reasoning = body.reasoning or {}
        text: dict[str, Any] = {**(body.text or {})}
        text.setdefault("format", {"type": "text"})
        out: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "completed_at": now() if status in ("completed", "incomplete") else None,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": (body.model_extra or {}).get("max_tool_calls"),
            "model": reported_model(self.state, body.model),
            "output": [dict(item) for item in self.assembler.items],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "store": self.store,
            "temperature": body.temperature,
            "text": text,
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": list(body.tools or []),
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": (body.model_extra or {}).get("user"),
            "metadata": dict(body.metadata or {}),
            "conversation": (
                {"id": self.prepared.conversation} if self.prepared.conversation else None
            ),
        }
        if body.context_management is not None:
            out["context_management"] = body.context_management
        return out

    def _usage(self, final: GenerationEvent) -> dict[str, Any]:
        reasoning = "".join(
            part.get("text", "")
            for item in self.assembler.items
            if item["type"] == "reasoning"
            for part in item["content"]
        )
        reasoning_tokens = 0
        tokenizer = self.state.tokenizer
        if reasoning and tokenizer is not None:
            reasoning_tokens = min(
                len(tokenizer.encode(reasoning, add_special=False)), final.completion_tokens
            )
        cached = final.timings.cache_n if final.timings is not None else 0
        return {
            "input_tokens": final.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": final.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": final.prompt_tokens + final.completion_tokens,
        }

    def _outcome(
        self, final: GenerationEvent
    ) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
        """(status, incomplete_details, error) for the engine's final event."""
        reason = final.finish_reason
        if self.inflight.cancelled and reason == "cancelled":
            return "cancelled", None, None
        if reason == "length":
            return "incomplete", {"reason": "max_output_tokens"}, None
        if reason == "error":
            message = f"generation failed: {scrub_paths(final.error or 'internal error')}"
            return "failed", None, {"code": "server_error", "message": message}
        if reason == "cancelled":
            return (
                "failed",
                None,
                {"code": "server_error", "message": "the server is shutting down"},
            )
        return "completed", None, None

    def settle(self, response: dict[str, Any]) -> None:
        """Store the final `response`, extend its conversation, release cancel waiters."""
        if self.settled:
            return
        self.settled = True
        stores = self.serving.stores
        prepared = self.prepared
        output = list(response["output"])
        if self.store and not self.inflight.deleted:
            history = prepared.history + prepared.items + output
            stores.responses.put(self.id, self._stored(response, history))
        status = response["status"]
        if prepared.conversation is not None and status in ("completed", "incomplete"):
            stores.extend_conversation(prepared.conversation, prepared.items + output)
        stores.inflight.pop(self.id, None)
        self.inflight.done.set()

    def _abandon(self, status: str) -> None:
        """Settle a run that ended without its final event (client gone, handler error)."""
        if not self.settled:
            self.assembler.finish("incomplete")
            self.settle(self.response(status))

    def _feed(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for delta in self._out.feed(text) if text else ():
            events += self.assembler.feed(delta)
        return events

    def _finish(self, final: GenerationEvent) -> tuple[list[dict[str, Any]], str]:
        """Closing events and the final response for `final`; the lifecycle event type."""
        events: list[dict[str, Any]] = []
        for delta in self._out.finish():
            events += self.assembler.feed(delta)
        status, incomplete, error = self._outcome(final)
        events += self.assembler.finish("completed" if status == "completed" else "incomplete")
        if self._out.result is not None:
            self.job.check_forced(self._out.result)
        response = self.response(
            status, usage=self._usage(final), error=error, incomplete=incomplete
        )
        self.settle(response)
        kind = {"completed": "completed", "failed": "failed"}.get(status, "incomplete")
        self.final_response = response
        return events, kind

    # ------------------------------------------------------------ the Encoder side

    def failure(self, final: GenerationEvent) -> APIError | None:
        if self.inflight.cancelled and final.finish_reason == "cancelled":
            return None  # POST /cancel: a response with status `cancelled`, not an error
        return engine_failure(final)

    def abandoned(self, why: str) -> None:
        self._abandon("cancelled" if why == "disconnected" else "failed")

    def body(self, results: list[list[GenerationEvent]]) -> dict[str, Any]:
        events = results[0]
        self._feed("".join(e.text for e in events))
        self._finish(events[-1])
        return self.final_response

    def _compaction_events(self) -> list[dict[str, Any]]:
        """mlx.compaction.started/completed and the compaction item's own item events."""
        assert self.compaction is not None
        item = dict(self.compaction.item)
        before = self.compaction.input_tokens_before
        return [
            {"type": "mlx.compaction.started", "input_tokens_before": before},
            {"type": "response.output_item.added", "output_index": 0, "item": item},
            {"type": "response.output_item.done", "output_index": 0, "item": item},
            {
                "type": "mlx.compaction.completed",
                "input_tokens_before": before,
                "input_tokens_after": self.compaction.input_tokens_after,
            },
        ]

    def opening(self) -> Iterable[str]:
        writer = self.writer
        lines = [
            writer.lifecycle("created", self.response("in_progress")),
            writer.lifecycle("in_progress", self.response("in_progress")),
        ]
        if self.compaction is not None:
            lines += [writer.sse(event) for event in self._compaction_events()]
        return lines

    def delta(self, index: int, event: GenerationEvent) -> Iterable[str]:
        writer = self.writer
        if event.progress is not None:  # `return_progress`, as llama-server sends it
            return [
                writer.sse(
                    {
                        "type": "response.in_progress",
                        "response": self.response("in_progress"),
                        "prompt_progress": event.progress.to_dict(),
                    }
                )
            ]
        events = self._feed(event.text)
        if event.timings is not None and not event.finished:  # `timings_per_token`
            timings = event.timings.to_dict()
            events = [
                {**e, "timings": timings} if e["type"].endswith(".delta") else e for e in events
            ]
        return [writer.sse(item_event) for item_event in events]

    def finished(self, index: int, final: GenerationEvent) -> Iterable[str]:
        events, kind = self._finish(final)
        lines = [self.writer.sse(item_event) for item_event in events]
        last: dict[str, Any] = {"type": f"response.{kind}", "response": self.final_response}
        if self.job.job.request.timings_per_token and final.timings is not None:
            last["timings"] = final.timings.to_dict()
        return [*lines, self.writer.sse(last)]

    def failed(self, index: int, final: GenerationEvent, error: APIError) -> Iterable[str]:
        return self.finished(index, final)  # `response.failed`, the error in the response
