"""Run `mlxcel serve`: bind the HTTP port, load the model, serve until told to stop.

The port opens first and answers `/health` with "loading model" (503) while the model
loads on a background thread, as llama-server does; the other routes answer 503 until
then. Slots: `--parallel` (-1: 4). Context per slot: `--ctx-size` split across the slots
(llama-server's rule), or the model's own context when `--ctx-size` is 0. With
`--kv-unified` (the default when `--parallel` is auto, as in llama-server) every slot may
use the whole context instead, and the engine keeps the slots' tokens within it together.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from mlxcel.server.app import create_app
from mlxcel.server.connections import (
    ConnectionGuard,
    ConnectionLimits,
    IgnoreClientDisconnect,
    open_file_limit,
    quiet_accept_errors,
)
from mlxcel.server.health import is_draining, set_draining
from mlxcel.server.http11 import guarded_protocol
from mlxcel.server.middleware import MAX_HEADER_BYTES
from mlxcel.server.ops.routes import metrics_app
from mlxcel.server.served_models import audio_wanted, chat_model_wanted, check_models
from mlxcel.server.state import ServerState

if TYPE_CHECKING:
    from mlxcel.config import Settings
    from mlxcel.engine.loading.model import LoadedModel
    from mlxcel.engine.text.sleep import IdleSleep
    from mlxcel.engine.text.speculative import SpeculationConfig

log = logging.getLogger(__name__)

DEFAULT_SLOTS = 4
GRACEFUL_SHUTDOWN_SECONDS = 3
DRAIN_SECONDS = 30.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
LISTENING_PREFIX = "mlxcel: listening on "


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
        except OSError as exc:
            raise SettingsError(
                f"--chat-template-file: cannot read {path.name}: {exc.strerror or exc}"
            ) from None
    else:
        template = settings.chat_template
    if not template:
        return None
    try:
        return override_source(template, jinja=settings.jinja)
    except TemplateError as exc:
        raise SettingsError(f"{label}: {exc}") from None


def check_ssl(settings: Settings) -> None:
    """`--ssl-key-file` needs `--ssl-cert-file`, and both must be readable files."""
    from mlxcel.config import SettingsError

    key, cert = settings.ssl_key_file, settings.ssl_cert_file
    if key and not cert:
        raise SettingsError("--ssl-key-file needs --ssl-cert-file")
    for label, value in (("--ssl-cert-file", cert), ("--ssl-key-file", key)):
        if value and not Path(value).expanduser().is_file():
            raise SettingsError(f"{label}: file not found: {value}")


def start_image_worker(state: ServerState) -> None:
    """Load `--image-model` and start its worker on `state.image` (ModelLoadError on failure)."""
    from mlxcel.engine.image import load_image_model
    from mlxcel.engine.workers.image_worker import ImageWorker

    settings = state.settings
    assert settings.image_model
    model = load_image_model(settings.image_model)
    state.image = ImageWorker(  # type: ignore[attr-defined]
        model, queue_depth=settings.image_queue_depth, timeout=settings.image_timeout
    ).start()
    print(
        f"mlxcel: image model {model.name} ready ({model.family.name})", file=sys.stderr, flush=True
    )


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


def check_memory_budget_setting() -> None:
    """Refuse to start (SettingsError) on an invalid MLXCEL_REQUEST_MEMORY_BUDGET."""
    from mlxcel.config import SettingsError
    from mlxcel.engine.text.memory_budget import configured_budget

    try:
        configured_budget()
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def load_into(state: ServerState) -> None:
    """Load the model and start the engine; fill `state` (ready once `state.client` is set)."""
    from mlxcel.engine.text.prompt_cache import PromptCache
    from mlxcel.engine.text.scheduler import TextEngine
    from mlxcel.server.bridge import EngineClient
    from mlxcel.server.embeddings.services import EmbeddingServices, build_services

    settings = state.settings
    state.embeddings = EmbeddingServices(loading=True)  # the server is loading meanwhile
    if settings.image_model:
        start_image_worker(state)
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
        _load_vision_into(state, vision_path)
        return
    loaded = load_text_model(settings)
    plan = plan_slots(settings, loaded.info.context_length)
    cache = PromptCache.from_settings(settings)
    engine = TextEngine(
        loaded,
        slots=plan.slots,
        context_per_slot=plan.context_per_slot,
        kv_pool=plan.kv_pool,
        prefill_chunk=settings.batch_size,
        max_queue_depth=settings.max_queue_depth,
        prompt_cache=cache,
        speculation=speculation_config(settings, loaded),
        sleep=idle_sleep(settings),
    ).start()
    if settings.warmup:
        _warm_up(engine, loaded)
    state.tokenizer = loaded.tokenizer
    state.model_info = loaded.info
    state.prompt_cache = cache
    state.embeddings = build_services(settings)
    state.client = EngineClient(engine)  # last: the server is ready from here on


def load_text_model(settings: Settings) -> LoadedModel:
    """The text model the settings name (ModelLoadError when it cannot be loaded)."""
    from mlxcel.engine.loading import load_model

    return load_model(
        settings.model,
        store_dir=settings.model_store,
        chat_template=chat_template_text(settings),
        cpu_dtype=settings.cpu_dtype,
        cpu_threads=settings.threads,
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
    """Load the mlx-vlm model in `path` and start its one-slot engine."""
    from mlxcel.engine.vision.engine import VisionEngine
    from mlxcel.engine.vision.loader import load_vision_model
    from mlxcel.server.bridge import EngineClient
    from mlxcel.server.embeddings.services import build_services
    from mlxcel.server.media import MediaPolicy
    from mlxcel.server.media.parts import ModelMedia

    settings = state.settings
    loaded = load_vision_model(path, name=path.name)
    template = chat_template_text(settings)
    if template is not None:
        loaded.tokenizer.chat_template = template
    context = settings.ctx_size if settings.ctx_size > 0 else loaded.info.context_length
    engine = VisionEngine(
        loaded,
        context_per_slot=context,
        max_queue_depth=settings.max_queue_depth,
        sleep=vision_idle_sleep(settings, path),
    ).start()
    state.media = ModelMedia(
        modalities=loaded.modalities,
        native_video=loaded.native_video,
        video_with_audio=loaded.info.architecture == "gemma4_unified",
        video_max_frames=settings.video_max_frames,
    )
    state.media_policy = MediaPolicy.from_environment(settings.media_path)
    state.tokenizer = loaded.tokenizer
    state.model_info = loaded.info
    state.embeddings = build_services(settings)
    state.client = EngineClient(engine)  # last: the server is ready from here on


def _warm_up(engine: Any, loaded: LoadedModel) -> None:
    """One token through the engine, so the first request does not pay for compilation."""
    from mlxcel.engine.text.request import GenerationRequest

    tokenizer = loaded.tokenizer
    first = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0
    request = GenerationRequest(prompt_tokens=[first], max_tokens=1, cache_prompt=False)
    for _ in engine.generate(request):
        pass
    engine.forget_traffic()  # the warm-up is not traffic


def _log_level(settings: Settings) -> str:
    if settings.log_disable:
        return "critical"
    if settings.verbose:
        return "debug"
    return "info" if settings.log_verbosity > 3 else "warning"


def uvicorn_config(
    app: Any,
    settings: Settings,
    *,
    port: int | None = None,
    guard: ConnectionGuard | None = None,
) -> uvicorn.Config:
    """The uvicorn configuration for `app` (h11 with the header cap and the connection
    guard, SSL when given); servers of one process share one `guard` (one file limit)."""
    if guard is None:
        guard = ConnectionGuard(ConnectionLimits.from_settings(settings))
    limits = guard.limits
    return uvicorn.Config(
        IgnoreClientDisconnect(app),
        host=settings.host,
        port=settings.port if port is None else port,
        http=guarded_protocol(guard),
        backlog=limits.backlog,
        timeout_keep_alive=limits.idle_seconds,  # type: ignore[arg-type]
        ws="none",
        lifespan="off",
        log_level=_log_level(settings),
        access_log=settings.verbose,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        ssl_keyfile=settings.ssl_key_file,
        ssl_certfile=settings.ssl_cert_file,
        server_header=False,
    )


def connection_guard(settings: Settings) -> ConnectionGuard:
    """The connection guard for this process, warning when `--max-connections` asks for
    more than the open-file limit can hold."""
    limits = ConnectionLimits.from_settings(settings)
    files = open_file_limit()
    if settings.max_connections and limits.exceeds(files):
        print(
            f"mlxcel: warning: --max-connections {limits.max_connections} is more than the "
            f"open-file limit ({files}) can hold; raise it (ulimit -n) or lower the cap",
            file=sys.stderr,
            flush=True,
        )
    return ConnectionGuard(limits)


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound socket for `host:port` (port 0: any free one); OSError when it cannot bind."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket, settings: Settings) -> str:
    port = sock.getsockname()[1]
    scheme = "https" if settings.ssl_cert_file else "http"
    host = settings.host if ":" not in settings.host else f"[{settings.host}]"
    return f"{scheme}://{host}:{port}"


class _Server:
    """The main uvicorn server plus, with `--metrics-port`, a metrics-only one."""

    def __init__(self, state: ServerState, sockets: list[socket.socket]) -> None:
        self.state = state
        self.sockets = sockets
        settings = state.settings
        guard = connection_guard(settings)
        self.main = _MainServer(uvicorn_config(create_app(state), settings, guard=guard))
        self.main.state = state
        self.metrics: uvicorn.Server | None = None
        if len(sockets) > 1:
            config = uvicorn_config(
                metrics_app(state), settings, port=settings.metrics_port, guard=guard
            )
            self.metrics = _QuietServer(config)
        self.failure: str | None = None

    def _load(self) -> None:
        try:
            load_into(self.state)
        except Exception as exc:  # noqa: BLE001 - reported as one line, then the server stops
            from mlxcel.server.openai_common import scrub_paths

            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.failure = text if _is_user_error(exc) else scrub_paths(text)
            self.main.should_exit = True
            if self.metrics is not None:
                self.metrics.should_exit = True
            return
        client = self.state.client
        if client is not None:
            engine = client.engine
            pool = getattr(engine, "kv_pool", None)
            shared = f", {pool} shared (--kv-unified)" if pool else ""
            print(
                f"mlxcel: model {self.state.model_name} ready: {engine.n_slots} slots x "
                f"{engine.context_per_slot} tokens{shared}",
                file=sys.stderr,
                flush=True,
            )
            if self.state.settings.verbose:
                from mlxcel.engine.blas import blas_in_use
                from mlxcel.engine.cpu_kernels.build import kernel_status

                print(f"mlxcel: CPU matmuls: {blas_in_use()}; {kernel_status()}", file=sys.stderr)
        _announce_sleep(self.state)

    async def serve(self) -> None:
        quiet_accept_errors(asyncio.get_running_loop())
        main = self.main
        tasks = [asyncio.ensure_future(main.serve(sockets=self.sockets[:1]))]
        if self.metrics is not None:
            tasks.append(asyncio.ensure_future(self.metrics.serve(sockets=self.sockets[1:])))
        while not main.started and not tasks[0].done():
            await asyncio.sleep(0.02)
        if main.started:
            url = _url(self.sockets[0], self.state.settings)
            print(LISTENING_PREFIX + url, file=sys.stderr, flush=True)
            threading.Thread(target=self._load, name="mlxcel-load", daemon=True).start()
        await asyncio.gather(tasks[0], return_exceptions=True)
        if self.metrics is not None:
            self.metrics.should_exit = True
            await asyncio.gather(tasks[1], return_exceptions=True)


def _announce_sleep(state: ServerState) -> None:
    """Say when the model will sleep, or that this server's models never do."""
    seconds = state.settings.sleep_idle_seconds
    if seconds < 0:
        return
    engine = state.client.engine if state.client is not None else None
    if engine is not None and hasattr(engine, "wake"):
        text = f"the model sleeps (unloads) after {seconds} s without a request"
    else:
        text = "--sleep-idle-seconds: only a text model sleeps; this server's models stay loaded"
    print(f"mlxcel: {text}", file=sys.stderr, flush=True)


class _MainServer(uvicorn.Server):
    """uvicorn's server, ending with status 0 after SIGINT/SIGTERM (no re-raised signal).

    The first signal drains: while requests are queued or running, `/health` answers 503
    "draining" (a load balancer stops sending), the port stays open and the in-flight
    requests finish (at most DRAIN_SECONDS), then the server stops. A second signal stops
    it at once.
    """

    state: ServerState | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        state = self.state
        if state is not None and is_draining(state):  # a second signal: stop now
            self.should_exit = self.force_exit = True
            return
        if self.should_exit or state is None or not _busy(state):
            super().handle_exit(sig, frame)
            return
        set_draining(state)
        print("mlxcel: draining: finishing in-flight requests", file=sys.stderr, flush=True)
        threading.Thread(target=self._drain, name="mlxcel-drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + DRAIN_SECONDS
        while time.monotonic() < deadline and self.state is not None and _busy(self.state):
            time.sleep(0.05)
        time.sleep(0.2)  # the last events reach their clients
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _busy(state: ServerState) -> bool:
    """Whether the text engine has a request queued or holding a slot."""
    client = state.client
    if client is None:
        return False
    snap = client.engine.snapshot()
    return bool(snap.queued) or any(slot.state != "idle" for slot in snap.slots)


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to the main one."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _is_user_error(exc: BaseException) -> bool:
    from mlxcel.config import SettingsError
    from mlxcel.engine.errors import ModelLoadError

    return isinstance(exc, (ModelLoadError, SettingsError))


def _bind_all(settings: Settings) -> list[socket.socket]:
    """The main socket and, with a distinct `--metrics-port`, the metrics one."""
    ports = [settings.port]
    if settings.metrics_port is not None and settings.metrics_port != settings.port:
        ports.append(settings.metrics_port)
    sockets: list[socket.socket] = []
    for port in ports:
        try:
            sockets.append(listen_socket(settings.host, port))
        except OSError as exc:
            for sock in sockets:
                sock.close()
            reason = exc.strerror or str(exc)
            raise OSError(f"cannot listen on {settings.host}:{port}: {reason}") from None
    return sockets


def run_server(settings: Settings) -> int:
    """Serve until SIGINT/SIGTERM; the exit status (1: cannot listen, 2: cannot load)."""
    from mlxcel.engine.errors import ModelLoadError

    check_ssl(settings)
    chat_template_text(settings)  # fail on an unreadable template file before binding
    check_memory_budget_setting()
    try:
        check_models(settings)  # never announce a port that then disappears
    except ModelLoadError as exc:
        print(f"mlxcel: error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        sockets = _bind_all(settings)
    except OSError as exc:
        print(f"mlxcel: error: {exc}", file=sys.stderr, flush=True)
        return 1
    state = ServerState(settings=settings)
    server = _Server(state, sockets)
    try:
        asyncio.run(server.serve())
    finally:
        client = state.client
        if client is not None:
            client.engine.stop()
        if state.embeddings is not None:
            state.embeddings.stop()
        if state.audio is not None:
            state.audio.stop()
        image = getattr(state, "image", None)
        if image is not None:
            image.stop()
    if server.failure is not None:
        print(f"mlxcel: error: {server.failure}", file=sys.stderr, flush=True)
        return 2
    if not server.main.started:
        return 1
    return 0
