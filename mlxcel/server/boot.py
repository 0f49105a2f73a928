"""Build a server's services from its settings: the text engine, the side models' workers.

`check_settings` refuses, before the port opens, what would only fail later (a chat template
file, the memory budget, a model reference). `load_into` then loads every model the settings
ask for and fills the `ServerState` (ready once `state.client` is set); `stop_services`
stops what it started. Slots: `--parallel` (-1: 4). Context per slot: `--ctx-size` split
across the slots (llama-server's rule), or the model's own context when `--ctx-size` is 0.
With `--kv-unified` (the default when `--parallel` is auto, as in llama-server) every slot
may use the whole context instead, and the engine keeps the slots' tokens within it
together. The HTTP side (uvicorn, signals, listening) is `mlxcel.server.runner`'s.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from mlxcel.server.served_models import audio_wanted, chat_model_wanted, check_models

if TYPE_CHECKING:
    from mlxcel.config import Settings
    from mlxcel.engine.distributed.group import Ranks
    from mlxcel.engine.loading.model import LoadedModel, ModelInfo
    from mlxcel.engine.text.kv_types import KVType
    from mlxcel.engine.text.prompt_cache import PromptCache
    from mlxcel.engine.text.prompt_disk import DiskTier
    from mlxcel.engine.text.scheduler import TextEngine
    from mlxcel.engine.text.sleep import IdleSleep
    from mlxcel.engine.text.speculative import SpeculationConfig
    from mlxcel.engine.tokenizer import Tokenizer
    from mlxcel.server.engine_protocol import GenerationEngine
    from mlxcel.server.state import ServerState

DEFAULT_SLOTS = 4
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlotPlan:
    """How many slots the engine runs and the context each one gets."""

    slots: int
    context_per_slot: int
    kv_pool: int | None = None  # the tokens all slots share (`--kv-unified`); None: no pool


def kv_unified(settings: Settings) -> bool:
    """`--kv-unified` as set, else on exactly when the number of slots is auto."""
    return settings.parallel < 0 if settings.kv_unified is None else settings.kv_unified


def plan_slots(settings: Settings, model_context: int) -> SlotPlan:
    """Slots from `parallel` (-1 -> 4); `ctx_size` split across them (0 -> model context),
    or, unified, the whole context for each slot and as the shared pool."""
    slots = DEFAULT_SLOTS if settings.parallel < 0 else max(1, settings.parallel)
    context = settings.ctx_size if settings.ctx_size > 0 else model_context
    if kv_unified(settings):
        return SlotPlan(slots, context, kv_pool=context)
    if settings.ctx_size > 0:
        return SlotPlan(slots, max(1, settings.ctx_size // slots))
    return SlotPlan(slots, model_context)


def chat_template_text(settings: Settings) -> str | None:
    """The chat template override: `--chat-template-file`'s text, else `--chat-template`.

    Read as llama-server reads it (`override_source`): a built-in name (`llama3`,
    `chatml`, ...) or Jinja text; without `--jinja`, text recognised as a built-in format.
    """
    from mlxcel.config import SettingsError
    from mlxcel.engine.chat.template import TemplateError, override_source

    label = "--chat-template"
    if settings.chat_template_file:
        label = "--chat-template-file"
        path = Path(settings.chat_template_file).expanduser()
        try:
            template: str | None = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise SettingsError(
                f"--chat-template-file: cannot read {path.name}: {reason or exc}"
            ) from None
    else:
        template = settings.chat_template
    if not template:
        return None
    try:
        return override_source(template, jinja=settings.jinja)
    except TemplateError as exc:
        raise SettingsError(f"{label}: {exc}") from None


def check_memory_budget_setting() -> None:
    """Refuse to start (SettingsError) on an invalid MLXCEL_REQUEST_MEMORY_BUDGET."""
    from mlxcel.config import SettingsError
    from mlxcel.engine.text.memory_budget import configured_budget

    try:
        configured_budget()
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def check_sampling_defaults(settings: Settings) -> None:
    """Refuse (SettingsError) a sampling option every request would be refused with."""
    from mlxcel.config import SettingsError
    from mlxcel.engine.defaults import check_sampling_settings

    try:
        check_sampling_settings(settings)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def kv_cache_type(settings: Settings, model: object | None = None) -> KVType:
    """The KV cache type of `-ctk`/`-ctv` (SettingsError when they differ, or when `model`'s
    caches cannot take it)."""
    from mlxcel.config import SettingsError
    from mlxcel.engine.text.kv_types import kv_types

    try:
        return kv_types(settings.cache_type_k, settings.cache_type_v, model)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def _check_vision_kv(settings: Settings) -> None:
    from mlxcel.config import SettingsError
    from mlxcel.engine.text.kv_types import check_vision

    try:
        check_vision(settings.cache_type_k, settings.cache_type_v)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def check_kv_cache_for_model(settings: Settings) -> None:
    """Refuse (ModelLoadError, one line) a KV cache type the chat model cannot take, before
    the port opens: another type than the default on a vision model, a quantized one on a
    model with sliding-window or recurrent layers or a head size off the group size (the
    model built from its configuration, no weights read; `load_text_model`'s check after
    the load stays for what this one cannot build)."""
    from mlxcel.engine.errors import ModelLoadError
    from mlxcel.engine.loading.skeleton import model_skeleton
    from mlxcel.engine.text.kv_types import check_model, check_vision, kv_types
    from mlxcel.engine.vision.loader import vision_model_path

    if not chat_model_wanted(settings):
        return
    try:
        if vision_model_path(settings.model) is not None:
            check_vision(settings.cache_type_k, settings.cache_type_v)
            return
        kv = kv_types(settings.cache_type_k, settings.cache_type_v)
        skeleton = model_skeleton(settings.model) if kv.quantized else None
        if skeleton is not None:
            check_model(skeleton, kv)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None


def check_directories(settings: Settings) -> None:
    """Create `--slot-save-path` and `--prompt-cache-dir` if they are missing (SettingsError
    when one cannot be a directory)."""
    from mlxcel.config import SettingsError

    for flag, value in (
        ("--slot-save-path", settings.slot_save_path),
        ("--prompt-cache-dir", settings.prompt_cache_dir),
    ):
        if not value:
            continue
        path = Path(value).expanduser()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SettingsError(f"{flag}: cannot use {path}: {exc.strerror or exc}") from None


def prompt_disk_tier(settings: Settings, loaded: LoadedModel, kv: KVType) -> DiskTier | None:
    """The prompt cache's disk tier of `--prompt-cache-dir` for `loaded` in type `kv`
    (None: not asked for, or no prompt cache)."""
    from mlxcel.config import SettingsError
    from mlxcel.engine.text.prompt_disk import DiskTier, model_identity

    if not settings.prompt_cache_dir or not settings.cache_prompt or settings.cache_ram == 0:
        return None
    directory = Path(settings.prompt_cache_dir).expanduser()
    try:
        identity = model_identity(loaded.info.path)
        return DiskTier(directory, settings.prompt_cache_disk_mib << 20, identity, kv)
    except OSError as exc:
        raise SettingsError(
            f"--prompt-cache-dir: cannot use {directory}: {exc.strerror or exc}"
        ) from None


def check_settings(settings: Settings) -> None:
    """Refuse, reading no weights, what would make loading fail: an unreadable template
    file, an invalid memory budget or sampling option, KV cache types that differ
    (SettingsError), a model reference that cannot be loaded or a KV cache type its model
    cannot take (ModelLoadError, one line naming the flag)."""
    chat_template_text(settings)
    kv_cache_type(settings)
    check_directories(settings)
    check_memory_budget_setting()
    check_sampling_defaults(settings)
    check_models(settings)
    check_kv_cache_for_model(settings)


def speculation_config(settings: Settings, loaded: LoadedModel) -> SpeculationConfig | None:
    """Speculative decoding from `--spec-type` and `--spec-draft-model` (None: off).

    A draft model (`-md`) means draft-model speculation whatever `--spec-type` says (it is
    loaded here, like the main model); `ngram-simple` is prompt lookup. The draft lengths are
    `--spec-draft-n-max` and `--spec-draft-n-min`. `loaded` is the target model: the engine
    checks that a draft model shares its vocabulary.
    """
    from mlxcel.config import SettingsError
    from mlxcel.engine.loading import load_model
    from mlxcel.engine.text.speculative import SpeculationConfig

    spec_type = str(settings.spec_type or "none")
    draft_ref = settings.spec_draft_model
    n_max = int(settings.spec_draft_n_max)
    n_min = int(settings.spec_draft_n_min)
    if not draft_ref and spec_type in ("none", ""):
        return None
    if n_max < 1 or not 0 <= n_min <= n_max:
        raise SettingsError(
            f"--spec-draft-n-max must be >= 1 and --spec-draft-n-min between 0 and it "
            f"(got {n_max} and {n_min})"
        )
    if draft_ref:
        draft = load_model(
            draft_ref,
            store_dir=settings.model_store,
            cpu_dtype=settings.cpu_dtype,
            cpu_threads=settings.threads,
        )
        return SpeculationConfig("draft", n_max=n_max, n_min=n_min, draft=draft)
    if spec_type == "ngram-simple":
        return SpeculationConfig("prompt-lookup", n_max=n_max, n_min=n_min)
    if spec_type == "draft-simple":
        raise SettingsError("--spec-type draft-simple needs a draft model (--spec-draft-model)")
    raise SettingsError(
        f"--spec-type {spec_type}: not supported (none, ngram-simple, draft-simple)"
    )


def load_into(state: ServerState) -> None:
    """Load every model the settings ask for and start its engine or worker, filling
    `state` (ModelLoadError or SettingsError when one cannot be loaded)."""
    from mlxcel.server.embeddings.services import EmbeddingServices, build_services

    settings = state.settings
    state.embeddings = EmbeddingServices(loading=True)  # the server is loading meanwhile
    if settings.image_model:
        _start_image_worker(state)
    if audio_wanted(settings):
        from mlxcel.engine.workers.audio import AudioWorker

        state.audio = AudioWorker(
            stt_model=settings.audio_model,
            tts_model=settings.tts_model,
            store_dir=settings.model_store,
            queue_depth=settings.audio_queue_depth,
            timeout=settings.audio_timeout,
        ).start()
    if not chat_model_wanted(settings):  # side models only: no text engine
        state.text_engine = False
        state.embeddings = build_services(settings)
        return
    from mlxcel.engine.vision.loader import vision_model_path

    vision_path = vision_model_path(settings.model)
    if vision_path is not None:
        _check_vision_kv(settings)
        _load_vision_into(state, vision_path)
    else:
        _load_text_into(state)


def stop_services(state: ServerState) -> None:
    """Stop the engine and every worker `load_into` started (each once, any of them)."""
    engine = state.engine
    if engine is not None:
        engine.stop()
    if state.prompt_cache is not None:
        try:  # the engine has stopped: its prompt cache goes to the disk tier, if any
            state.prompt_cache.persist()
        except Exception:  # noqa: BLE001 - a failed write must not stop the shutdown
            log.exception("writing the prompt cache to disk failed")
    if state.embeddings is not None:
        state.embeddings.stop()
    if state.audio is not None:
        state.audio.stop()
    if state.image is not None:
        state.image.stop()


def _start_image_worker(state: ServerState) -> None:
    """Load `--image-model` and start its worker on `state.image` (ModelLoadError on failure)."""
    from mlxcel.engine.image import load_image_model
    from mlxcel.engine.workers.image_worker import ImageWorker

    settings = state.settings
    assert settings.image_model
    model = load_image_model(settings.image_model)
    state.image = ImageWorker(
        model, queue_depth=settings.image_queue_depth, timeout=settings.image_timeout
    ).start()
    print(
        f"mlxcel: image model {model.name} ready ({model.family.name})", file=sys.stderr, flush=True
    )


class EngineSlots(TypedDict):
    """What a text or vision engine takes from the slot plan and the settings."""

    slots: int
    context_per_slot: int
    kv_pool: int | None
    prefill_chunk: int
    max_queue_depth: int
    prompt_cache: PromptCache | None


def engine_slots(
    state: ServerState, context_length: int, disk: DiskTier | None = None
) -> EngineSlots:
    """The slot plan for a model of `context_length` tokens, and the server's prompt cache
    over `disk` (kept on `state` for the cache routes)."""
    from mlxcel.engine.text.prompt_cache import PromptCache

    settings = state.settings
    plan = plan_slots(settings, context_length)
    state.prompt_cache = PromptCache.from_settings(settings, disk)
    return EngineSlots(
        slots=plan.slots,
        context_per_slot=plan.context_per_slot,
        kv_pool=plan.kv_pool,
        prefill_chunk=settings.batch_size,
        max_queue_depth=settings.max_queue_depth,
        prompt_cache=state.prompt_cache,
    )


def _load_text_into(state: ServerState) -> None:
    """Load the text model and start its batching engine."""
    engine, loaded = build_text_engine(state)
    engine.start()
    if state.settings.warmup:
        _warm_up(engine, loaded)
    _serve(state, engine, loaded.tokenizer, loaded.info)


def build_text_engine(state: ServerState) -> tuple[TextEngine, LoadedModel]:
    """Load the text model (this rank's shard of it in a group of ranks) and build its
    engine, not started."""
    from mlxcel.engine.distributed.lane import lane_for
    from mlxcel.engine.text.scheduler import TextEngine
    from mlxcel.server.distributed import rank_settings

    settings = state.settings
    loaded = load_text_model(settings, state.ranks)
    kv = kv_cache_type(settings, loaded.model)
    disk = prompt_disk_tier(rank_settings(settings, state.ranks), loaded, kv)
    lane = lane_for(state.ranks, settings.distributed_timeout)
    engine = TextEngine(
        loaded,
        **engine_slots(state, loaded.info.context_length, disk),
        speculation=speculation_config(settings, loaded) if lane is None else None,
        sleep=idle_sleep(settings) if lane is None else None,
        kv_type=kv,
        distributed=lane,
    )
    return engine, loaded


def load_text_model(settings: Settings, ranks: Ranks | None = None) -> LoadedModel:
    """The text model the settings name, or this rank's shard of it (ModelLoadError when
    it cannot be loaded)."""
    from mlxcel.engine.loading import load_model

    return load_model(
        settings.model,
        store_dir=settings.model_store,
        chat_template=chat_template_text(settings),
        cpu_dtype=settings.cpu_dtype,
        cpu_threads=settings.threads,
        ranks=ranks,
        pipeline=settings.pipeline,
    )


def idle_sleep(settings: Settings) -> IdleSleep | None:
    """Sleeping on idle from `--sleep-idle-seconds` (None: -1, never): the engine reloads
    the model, and the draft model with speculation, from the settings when it wakes."""
    if settings.sleep_idle_seconds < 0:
        return None
    from mlxcel.engine.text.sleep import IdleSleep, Reloaded

    def reload() -> Reloaded:
        loaded = load_text_model(settings)
        return Reloaded(loaded.model, speculation_config(settings, loaded))

    return IdleSleep(settings.sleep_idle_seconds, reload)


def vision_idle_sleep(settings: Settings, path: Path) -> IdleSleep | None:
    """`idle_sleep` for the mlx-vlm model in `path` (its processor and tokenizer stay)."""
    if settings.sleep_idle_seconds < 0:
        return None
    from mlxcel.engine.text.sleep import IdleSleep, Reloaded
    from mlxcel.engine.vision.loader import load_vision_model

    def reload() -> Reloaded:
        return Reloaded(load_vision_model(path, name=path.name).model)

    return IdleSleep(settings.sleep_idle_seconds, reload)


def _load_vision_into(state: ServerState, path: Path) -> None:
    """Load the mlx-vlm model in `path` and start its batching engine."""
    from mlxcel.engine.vision.engine import VisionEngine
    from mlxcel.engine.vision.loader import load_vision_model
    from mlxcel.server.media import MediaPolicy
    from mlxcel.server.media.parts import ModelMedia

    settings = state.settings
    loaded = load_vision_model(path, name=path.name)
    template = chat_template_text(settings)
    if template is not None:
        loaded.tokenizer.chat_template = template
    engine = VisionEngine(
        loaded,
        **engine_slots(state, loaded.info.context_length),
        sleep=vision_idle_sleep(settings, path),
    ).start()
    state.media = ModelMedia(
        modalities=loaded.modalities,
        native_video=loaded.native_video,
        video_with_audio=loaded.info.architecture == "gemma4_unified",
        video_max_frames=settings.video_max_frames,
        prepare=engine.prepare,
    )
    state.media_policy = MediaPolicy.from_environment(settings.media_path)
    _serve(state, engine, loaded.tokenizer, loaded.info)


def _serve(
    state: ServerState, engine: GenerationEngine, tokenizer: Tokenizer, info: ModelInfo
) -> None:
    """Load the embedding and rerank models, then hand `engine` to the routes."""
    from mlxcel.server.bridge import EngineClient
    from mlxcel.server.embeddings.services import build_services

    state.tokenizer = tokenizer
    state.model_info = info
    state.embeddings = build_services(state.settings)
    state.client = EngineClient(engine)  # last: the server is ready from here on


def _warm_up(engine: TextEngine, loaded: LoadedModel) -> None:
    """One token through the engine, so the first request does not pay for compilation."""
    from mlxcel.engine.text.request import GenerationRequest

    tokenizer = loaded.tokenizer
    first = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0
    request = GenerationRequest(prompt_tokens=[first], max_tokens=1, cache_prompt=False)
    for _ in engine.generate(request):
        pass
    engine.forget_traffic()  # the warm-up is not traffic


def announce(state: ServerState) -> None:
    """Say on stderr that the loaded models are ready (slots and context), the CPU matmul
    backend with `--verbose`, and when the model will sleep."""
    engine = state.engine
    if engine is not None:
        from mlxcel.engine.text.scheduler import TextEngine

        pool = engine.kv_pool if isinstance(engine, TextEngine) else None
        shared = f", {pool} shared (--kv-unified)" if pool else ""
        group = state.model_info.extra.get("distributed") if state.model_info else None
        if group:
            shared += f"; rank 0 of {group['world_size']} ({group['mode']} parallel)"
        print(
            f"mlxcel: model {state.model_name} ready: {engine.n_slots} slots x "
            f"{engine.context_per_slot} tokens{shared}",
            file=sys.stderr,
            flush=True,
        )
        if state.settings.verbose:
            from mlxcel.engine.blas import blas_in_use
            from mlxcel.engine.cpu_kernels.build import kernel_status

            print(f"mlxcel: CPU matmuls: {blas_in_use()}; {kernel_status()}", file=sys.stderr)
    seconds = state.settings.sleep_idle_seconds
    if seconds < 0:
        return
    if engine is not None:
        text = f"the model sleeps (unloads) after {seconds} s without a request"
    else:
        text = "--sleep-idle-seconds: only a text model sleeps; this server's models stay loaded"
    print(f"mlxcel: {text}", file=sys.stderr, flush=True)
