"""The server's services: built from the settings by `mlxcel.server.boot`, typed on
`ServerState`, and read through the engine protocol (`state.engine`), never through an
engine's own attributes; the FIM ids are read once per tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fixtures.stand_in_engine import StandInEngine

from mlxcel.config.settings import Settings
from mlxcel.server import boot
from mlxcel.server.bridge import EngineClient
from mlxcel.server.health import health_payload
from mlxcel.server.llama_native.fim import FimTokens
from mlxcel.server.ops.metrics import metrics_text
from mlxcel.server.state import ServerState


def _metric(text: str, name: str) -> str:
    """The value of the unlabelled sample `name` in a Prometheus text body."""
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return line.split(" ", 1)[1]
    raise AssertionError(f"{name} not in /metrics")


class BusyEngine(StandInEngine):
    """Three slots, one decoding, two requests queued."""

    n_slots = 3
    queued = ("req-7", "req-8")

    def snapshot(self) -> Any:
        snap = super().snapshot()
        first = type(snap.slots[0])(id=0, state="decoding", request_id="req-6", used=True)
        return type(snap)((first, *snap.slots[1:]), snap.queued, snap.counters, 2048)


def test_metrics_and_health_read_the_engine_through_the_protocol() -> None:
    state = ServerState(settings=Settings(warmup=False, metrics=True))
    assert state.engine is None  # loading: no engine yet
    assert _metric(metrics_text(state), "mlxcel_slots_total") == "0"
    engine = BusyEngine()
    state.client = EngineClient(engine)
    assert state.engine is engine
    text = metrics_text(state)
    assert _metric(text, "mlxcel_slots_total") == "3"
    assert _metric(text, "mlxcel_slots_available") == "2"
    assert _metric(text, "mlxcel_queue_depth") == "2"
    assert _metric(text, "llamacpp:requests_deferred") == "2"
    status, body = health_payload(state)
    assert status == 200
    assert body["batch"] == {"active_sequences": 1, "queue_depth": 2, "max_batch_size": 3}


def test_side_models_only_build_services_without_a_text_engine() -> None:
    """`--embedding` without -m: the embedding worker, no engine, no tokenizer."""
    state = ServerState(settings=Settings(warmup=False, embedding=True))
    boot.load_into(state)
    try:
        assert state.text_engine is False
        assert state.engine is None and state.client is None and state.tokenizer is None
        assert state.image is None and state.audio is None
        assert state.embeddings is not None and state.embeddings.embeddings is not None
        assert not state.loading
        assert state.side_model_names == ["all-MiniLM-L6-v2"]
        assert state.model_name == "all-MiniLM-L6-v2"
        status, body = health_payload(state)
        assert status == 200 and body["models"] == ["all-MiniLM-L6-v2"]
    finally:
        boot.stop_services(state)
    assert all(not worker.worker.running for worker in state.embeddings.workers)


def test_text_model_services_are_built_in_one_place(tiny_llama_dir: Path) -> None:
    settings = Settings(model=str(tiny_llama_dir), warmup=False, parallel=2, ctx_size=512)
    state = ServerState(settings=settings)
    boot.load_into(state)
    try:
        engine = state.engine
        assert engine is not None and state.client is not None
        assert (engine.n_slots, engine.context_per_slot) == (2, 256)  # -c 512 split in two
        assert state.tokenizer is not None and state.model_info is not None
        assert state.prompt_cache is not None  # the default --cache-ram
        assert state.media is None  # a text model takes no media
        assert state.embeddings is not None and state.embeddings.embeddings is None
        assert _metric(metrics_text(state), "mlxcel_slots_available") == "2"
        assert not engine.sleeping
    finally:
        boot.stop_services(state)


class CountingVocab:
    """A Hugging Face tokenizer stand-in whose `get_vocab` calls are counted."""

    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab
        self.reads = 0

    def get_vocab(self) -> dict[str, int]:
        self.reads += 1
        return dict(self.vocab)


class VocabTokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.hf = CountingVocab(vocab)


def test_fim_ids_are_read_once_per_tokenizer() -> None:
    fim = FimTokens()
    coder = VocabTokenizer({"<|fim_prefix|>": 5, "<|fim_suffix|>": 6, "<|fim_middle|>": 7})
    plain = VocabTokenizer({"hello": 1})
    expected = {"prefix": 5, "suffix": 6, "middle": 7}
    assert fim.ids(coder) == expected  # type: ignore[arg-type]
    ids = fim.ids(coder)  # type: ignore[arg-type]
    ids["prefix"] = 99  # a copy: the kept ids do not change
    assert fim.ids(coder) == expected  # type: ignore[arg-type]
    assert coder.hf.reads == 1
    assert fim.ids(plain) == {}  # type: ignore[arg-type]
    assert plain.hf.reads == 1
