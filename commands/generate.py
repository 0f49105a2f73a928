"""Generate text from a prompt: streams to stdout, stats to stderr."""

from __future__ import annotations

import inspect
import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from .common import (
    PROFILE_OPTION,
    SETTING_DEFAULTS,
    fail,
    load_model_or_exit,
    resolve,
    settings_actions,
    stdin_text,
    utf8_text,
)

if TYPE_CHECKING:
    from mlxcel.engine.distributed.group import Ranks

_F = TypeVar("_F", bound=Callable[..., Any])


def _with_sampling_options(func: _F) -> _F:
    """`func` with one option per sampling knob of `SAMPLING_KNOBS` that has a setting, in
    place of its `**knobs` (after its `--system`): the setting's llama-server spellings
    (`--top-n-sigma` before `--top-nsigma`), help and default, each value under the
    setting's name."""
    from mlxcel.config import field_meta, flag_for_field
    from mlxcel.engine.sampling.params import SAMPLING_KNOBS

    options = []
    for knob in SAMPLING_KNOBS:
        flag = flag_for_field(knob.setting) if knob.setting else None
        if flag is None:
            continue
        meta = field_meta(knob.setting)
        own = f"--{knob.setting.replace('_', '-')}"
        spellings = sorted(flag.spellings, key=lambda spelling: spelling != own)
        option = typer.Option(None, *spellings, help=meta.help, show_default=str(meta.default))
        options.append(
            inspect.Parameter(
                knob.setting,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                default=option,
                annotation=knob.kind | None,
            )
        )
    signature = inspect.signature(func, eval_str=True)
    params = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    at = [p.name for p in params].index("system") + 1
    params[at:at] = options
    func.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return func


@_with_sampling_options
def generate(
    prompt_arg: str | None = typer.Argument(
        None, metavar="[PROMPT]", help="Prompt; - reads stdin."
    ),
    prompt: str | None = typer.Option(
        None, "--prompt", "-p", help="Prompt (alternative to the argument)."
    ),
    model: str | None = typer.Option(
        None,
        "--model",
        "-m",
        help="GGUF file, MLX dir or HF repo id.",
        show_default="the built-in SmolLM2",
    ),
    n_predict: int | None = typer.Option(
        None,
        "--predict",
        "-n",
        "--n-predict",
        "--max-tokens",
        help="Max tokens to generate (-1: until the context is full).",
        show_default=SETTING_DEFAULTS["n_predict"],
    ),
    system: str | None = typer.Option(None, "--system", help="System message."),
    p_less: bool = typer.Option(False, "--p-less", help="p-less truncation."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    max_pattern_size: int | None = typer.Option(
        None, "--max-pattern-size", help="Loop detection: longest pattern."
    ),
    min_pattern_size: int | None = typer.Option(
        None, "--min-pattern-size", help="Loop detection: shortest pattern."
    ),
    min_count: int | None = typer.Option(
        None, "--min-count", help="Loop detection: repeats that stop generation."
    ),
    ignore_eos: bool = typer.Option(
        False, "--ignore-eos", help="Keep generating past end-of-sequence."
    ),
    no_chat_template: bool = typer.Option(
        False, "--no-chat-template", help="Send the prompt raw, without the chat template."
    ),
    chat_template_file: str | None = typer.Option(
        None, "--chat-template-file", help="Jinja chat template file."
    ),
    cpu_dtype: str | None = typer.Option(
        None,
        "--cpu-dtype",
        help="CPU backend: keep quantized weights packed (keep), or dequantize to float32 "
        "(float32; auto when memory allows).",
        show_default=SETTING_DEFAULTS["cpu_dtype"],
    ),
    threads: int | None = typer.Option(
        None,
        "--threads",
        "-t",
        help="CPU threads for mlxcel's CPU kernel (-1: one per core).",
        show_default=SETTING_DEFAULTS["threads"],
    ),
    pipeline: bool = typer.Option(
        False,
        "--pipeline",
        help="Under mlx.launch: split the model's layers across the ranks (pipeline "
        "parallel) instead of each layer's weights (tensor parallel).",
    ),
    cache_type_k: str | None = typer.Option(
        None,
        "--cache-type-k",
        "-ctk",
        help="KV cache type of the keys: f32, f16, bf16, q8_0 or q4_0 (the same as -ctv).",
        show_default=SETTING_DEFAULTS["cache_type_k"],
    ),
    cache_type_v: str | None = typer.Option(
        None,
        "--cache-type-v",
        "-ctv",
        help="KV cache type of the values (the same as -ctk).",
        show_default=SETTING_DEFAULTS["cache_type_v"],
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object instead of streaming."
    ),
    show_settings: bool = typer.Option(
        False, "--show-settings", help="Print the resolved settings and their sources, then exit."
    ),
    save_profile: str | None = typer.Option(
        None, "--save-profile", help="Write the resolved settings to a TOML profile."
    ),
    image: list[str] = typer.Option(
        [], "--image", help="Image file for a vision model (repeatable)."
    ),
    video: list[str] = typer.Option(
        [], "--video", help="Video file for a vision model (repeatable; needs ffmpeg)."
    ),
    audio: list[str] = typer.Option(
        [], "--audio", help="WAV file for a model that takes audio (repeatable)."
    ),
    profile: str | None = PROFILE_OPTION,
    **knobs: Any,  # one option per sampling knob, by its setting (`_with_sampling_options`)
) -> None:
    """Generate text from a prompt on a local model (the embedded default if none is given)."""
    cli: dict[str, Any] = {
        "model": model,
        "n_predict": n_predict,
        **knobs,
        "chat_template_file": chat_template_file,
        "no_chat_template": no_chat_template or None,
        "ignore_eos": ignore_eos or None,
        "cpu_dtype": cpu_dtype,
        "threads": threads,
        "pipeline": pipeline or None,
        "cache_type_k": cache_type_k,
        "cache_type_v": cache_type_v,
    }
    resolved = resolve(profile, cli)
    if settings_actions(resolved, show_settings, save_profile):
        return
    settings = resolved.settings
    text = _read_prompt(prompt_arg, prompt)
    if system is not None:
        utf8_text(system, "--system")

    from mlxcel.engine.defaults import loop_params, sampling_from_settings
    from mlxcel.engine.distributed.lane import lane_for
    from mlxcel.engine.errors import InvalidRequestError
    from mlxcel.engine.prompting import PromptError, build_prompt
    from mlxcel.engine.text.request import GenerationRequest
    from mlxcel.engine.text.scheduler import TextEngine
    from mlxcel.engine.vision.loader import vision_model_path

    template = _chat_template(settings.chat_template_file, settings.chat_template, settings.jinja)
    vision_dir = vision_model_path(settings.model)
    ranks = _ranks_or_exit(settings, vision=vision_dir is not None)
    media: Any = None
    if vision_dir is not None:
        from .vision_input import load_vision_or_exit, vision_prompt

        _kv_type(settings, None, vision=True)

        loaded = load_vision_or_exit(vision_dir)
    elif image or video or audio:
        fail("--image, --video and --audio need a vision model (-m DIR of an mlx-vlm model)")
    else:
        loaded = load_model_or_exit(
            settings.model,
            store=settings.model_store,
            cpu_dtype=settings.cpu_dtype,
            cpu_threads=settings.threads,
            ranks=ranks,
            pipeline=settings.pipeline,
        )
    if template:
        loaded.tokenizer.chat_template = template
    tokenizer = loaded.tokenizer
    try:
        if vision_dir is not None:
            media = vision_prompt(
                loaded, text, system=system, images=image, videos=video, audio=audio,
                video_max_frames=settings.video_max_frames,
            )  # fmt: skip
            tokens = tokenizer.encode(media.text, add_special=False)
        else:
            tokens = build_prompt(tokenizer, text, system=system, raw=settings.no_chat_template)
        sampling = sampling_from_settings(settings, tokenizer, p_less=p_less or None)
        loop = loop_params(
            settings,
            loaded.info.family,
            max_pattern_size=max_pattern_size,
            min_pattern_size=min_pattern_size,
            min_count=min_count,
        )
    except (PromptError, ValueError) as exc:
        fail(str(exc))
    request = GenerationRequest(
        prompt_tokens=tokens,
        max_tokens=None if settings.n_predict < 0 else settings.n_predict,
        sampling=sampling,
        stop=tuple(stop),
        loop=loop,
        ignore_eos=settings.ignore_eos,
        cache_prompt=False,
        media=media,
    )
    engine: Any
    if vision_dir is not None:
        from mlxcel.engine.vision.engine import VisionEngine

        engine = VisionEngine(loaded)
    else:
        engine = TextEngine(
            loaded,
            slots=1,
            prefill_chunk=settings.batch_size,
            kv_type=_kv_type(settings, loaded.model),
            distributed=lane_for(ranks, settings.distributed_timeout),
        )
        if ranks is not None and not ranks.leader:  # rank 0 prints; this rank follows it
            failure = engine.follow()
            engine.stop()
            if failure is not None:
                fail(f"rank {ranks.rank}: {failure}", code=1)
            return
    pieces: list[str] = []
    start = time.perf_counter()
    try:
        for event in engine.generate(request):
            if event.text:
                pieces.append(event.text)
                if not as_json:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
            if event.finished:
                final = event
    except InvalidRequestError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        raise typer.Exit(130) from None
    finally:
        engine.stop()
    wall = time.perf_counter() - start
    if final.finish_reason == "error":
        fail(f"generation failed: {final.error or 'internal error'}", code=1)
    timings = final.timings
    peak = _peak_memory_gb()
    if as_json:
        print(
            json.dumps(
                {
                    "text": "".join(pieces),
                    "finish_reason": final.finish_reason,
                    "model": loaded.info.name,
                    "usage": {
                        "prompt_tokens": final.prompt_tokens,
                        "completion_tokens": final.completion_tokens,
                        "total_tokens": final.prompt_tokens + final.completion_tokens,
                    },
                    "timings": timings.to_dict() if timings else {},
                    "peak_memory_gb": round(peak, 3),
                },
                ensure_ascii=False,
            )
        )
        return
    sys.stdout.write("\n")
    sys.stdout.flush()  # before the stats on stderr: a shared pipe keeps the order
    if timings is not None:
        if request.max_tokens == 0:  # nothing ran: no rate to tell
            prompt_part = f"prompt: {timings.prompt_n} tokens (not evaluated with -n 0)"
        else:
            prompt_part = _count_and_rate("prompt", timings.prompt_n, timings.prompt_per_second)
        generated = _count_and_rate("generation", timings.predicted_n, timings.predicted_per_second)
        print(
            f"{prompt_part} | {generated} | peak memory: {peak:.3f} GB | "
            f"finish: {final.finish_reason} | {wall:.2f} s",
            file=sys.stderr,
        )


def _ranks_or_exit(settings: Any, *, vision: bool) -> Ranks | None:
    """The group of ranks `mlx.launch` started this process in (None: alone); one line and
    exit 2 when it cannot be joined or the model is a vision model."""
    from mlxcel.engine.distributed.group import join_group
    from mlxcel.engine.errors import ModelLoadError

    try:
        ranks = join_group(required=settings.distributed)
    except ModelLoadError as exc:
        fail(str(exc))
    if ranks is not None and vision:
        fail("a vision model cannot be distributed (text models only)")
    return ranks


def _count_and_rate(what: str, tokens: int, per_second: float) -> str:
    """`what: N tokens, R tok/s`; no rate for zero tokens."""
    if tokens <= 0 or per_second <= 0:
        return f"{what}: {tokens} tokens"
    return f"{what}: {tokens} tokens, {per_second:.1f} tok/s"


def _kv_type(settings: Any, model: Any, *, vision: bool = False) -> Any:
    """The KV cache type of `-ctk`/`-ctv` for `model` (one line and exit 2 when refused);
    a vision model takes only the default."""
    from mlxcel.engine.text.kv_types import check_vision, kv_types

    try:
        if vision:
            check_vision(settings.cache_type_k, settings.cache_type_v)
            return None
        return kv_types(settings.cache_type_k, settings.cache_type_v, model)
    except ValueError as exc:
        fail(str(exc))


def _read_prompt(arg: str | None, option: str | None) -> str:
    if arg is not None and option is not None:
        fail("give the prompt either as an argument or with -p, not both")
    text = option if option is not None else arg
    if text is None:
        fail("no prompt given (pass PROMPT, -p PROMPT, or - to read stdin)")
    text = stdin_text() if text == "-" else utf8_text(text, "the prompt")
    if not text.strip():
        fail("the prompt is empty")
    return text


def _chat_template(path: str | None, text: str | None, jinja: bool) -> str | None:
    """The chat template override (`--chat-template-file`, else the `chat_template` setting),
    read as `mlxcel serve` reads it: a built-in name or Jinja text."""
    from mlxcel.engine.chat.template import TemplateError, override_source

    label = "chat_template"
    if path:
        label = "--chat-template-file"
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            fail(f"cannot read chat template file {path}: {exc.strerror or exc}")
        except UnicodeDecodeError:
            fail(f"cannot read chat template file {path}: not UTF-8 text")
    if not text:
        return None
    try:
        return override_source(text, jinja=jinja)
    except TemplateError as exc:
        fail(f"{label}: {exc}")


def _peak_memory_gb() -> float:
    import mlx.core as mx

    return float(mx.get_peak_memory()) / 1e9
