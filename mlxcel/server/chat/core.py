"""`ChatCore`: the one path from a `ChatRequest` to an admitted engine job.

Per request, once each: the grammar is compiled (`response_format`, llama-server's
`grammar`/`json_schema`, or a forced `tool_choice`), the prompt is rendered
(`render_prompt`, unless the caller already rendered it), the output is planned, `n` is
checked, and the engine request is built (`engine_request`), then admitted. Every 400 and
503 is raised before a response (or SSE header) is sent.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from mlxcel.engine.prompting import without_added_bos
from mlxcel.engine.text.thinking_budget import ThinkingBudget
from mlxcel.engine.vision.inputs import VisionInputs, VisionPrompt
from mlxcel.server.chat.admitted import AdmittedChat
from mlxcel.server.chat.output_plan import OutputPlan, plan_output
from mlxcel.server.chat.prompt import RenderedPrompt, render_prompt
from mlxcel.server.errors import bad_request
from mlxcel.server.generation import Job
from mlxcel.server.media import MediaError
from mlxcel.server.media.parts import prepare_off_loop
from mlxcel.server.sampling_fields import (
    PRIORITY_HEADER,
    parse_priority,
    per_choice,
    to_generation_request,
)
from mlxcel.server.structured import compile_response_format, compile_tool_choice

if TYPE_CHECKING:
    from starlette.requests import HTTPConnection

    from mlxcel.engine.text.request import GenerationRequest, Priority
    from mlxcel.server.chat.request import ChatRequest
    from mlxcel.server.state import ServerState


class ChatCore:
    """Renders and admits chat requests of every family against the server's engine."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def render(self, request: ChatRequest) -> RenderedPrompt:
        """The request's prompt (400 on errors)."""
        return await render_prompt(self.state, request)

    async def prompt_text(self, request: ChatRequest) -> str:
        """The templated prompt as text, without the BOS the tokenizer adds (what POST
        /apply-template answers, as llama-server)."""
        assert self.state.tokenizer is not None
        return without_added_bos(self.state.tokenizer, (await self.render(request)).text)

    async def start(
        self,
        request: ChatRequest,
        raw: HTTPConnection,
        *,
        max_choices: int = 1,
        stream_reports: bool = False,
        prompt: RenderedPrompt | None = None,
    ) -> AdmittedChat:
        """Admit `request`: the engine job (one sequence per choice, `n` up to
        `max_choices`) and how to read its output. `prompt`: the request's prompt when the
        caller rendered it already; `stream_reports`: the answer streams and sends
        llama-server's `timings_per_token` and `return_progress` chunks when asked."""
        state = self.state
        assert state.client is not None and state.tokenizer is not None
        options = request.options
        grammar = await compile_response_format(
            state, options.with_json_schema(request.response_format), options.gbnf_grammar()
        )
        if grammar is not None and request.forced_tool_choice:
            raise bad_request(
                "a forced tool_choice cannot be combined with a json_schema or json_object "
                "response_format or a grammar"
            )
        priority = parse_priority(raw.headers.get(PRIORITY_HEADER))
        choices = options.check_n(max_choices)
        if prompt is None:
            prompt = await self.render(request)
        plan = plan_output(state, prompt.tools, prompt.text, request.reasoning_format)
        forced = request.forced_tool_choice and bool(prompt.tools)
        if forced and grammar is None and plan.tool_format is not None:
            close = plan.reasoning.close_tag if plan.start_in_reasoning and plan.reasoning else None
            single = isinstance(request.tool_choice, dict) or request.parallel_tool_calls is False
            grammar = await compile_tool_choice(
                state,
                plan.tool_format.name,
                prompt.tools,
                reasoning_close=close,
                max_calls=1 if single else 8,
            )
        engine = self.engine_request(
            request, prompt, plan, grammar, priority=priority, stream_reports=stream_reports
        )
        if engine.media is not None and state.media is not None:
            try:  # the processor off the event loop; submit reuses its result
                await prepare_off_loop(state.media, engine.media)
            except MediaError as exc:
                raise bad_request(str(exc)) from None
        job = Job.admit(state, per_choice(engine, choices))  # 400/503 before any SSE header
        return AdmittedChat(job=job, plan=plan, prompt_tokens=len(prompt.tokens), forced=forced)

    def engine_request(
        self,
        request: ChatRequest,
        prompt: RenderedPrompt,
        plan: OutputPlan,
        grammar: Any,
        *,
        priority: Priority,
        stream_reports: bool,
    ) -> GenerationRequest:
        """The engine request of one choice: the request's sampling fields over the
        server's defaults, its grammar, thinking budget and media; special tokens are
        decoded when the output is parsed (tool-call and reasoning markers often are)."""
        state = self.state
        assert state.tokenizer is not None
        options = request.options
        base = to_generation_request(
            options,
            settings=state.settings,
            tokenizer=state.tokenizer,
            family=state.model_info.family if state.model_info else None,
            prompt_tokens=prompt.tokens,
            max_tokens=request.max_tokens,
            priority=priority,
            logprobs=options.logprobs_count(),
        )
        thinking = None
        reasoning = plan.reasoning
        if prompt.thinking_budget >= 0 and reasoning is not None and not reasoning.harmony:
            thinking = ThinkingBudget(
                prompt.thinking_budget,
                open_tag=reasoning.open_tag,
                close_tag=reasoning.close_tag,
                start_in_reasoning=plan.start_in_reasoning,
            )
        media = None
        if state.media is not None:  # a vision engine: the prompt text and its decoded media
            media = VisionPrompt(prompt.text, prompt.media or VisionInputs())
        engine = replace(
            base, grammar=grammar, thinking=thinking, media=media, skip_special=not plan.active
        )
        options.stream_reports(engine, stream=stream_reports)
        return engine
