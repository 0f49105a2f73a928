"""The vision engine is the engine core: continuous batching, one token pipeline, the
prompt cache by media content, media prepared off the caller's thread.

On the tiny random-weight Qwen2-VL (mRoPE) and Gemma 3 checkpoints that mlx-vlm loads
offline."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_vlm", reason="mlx-vlm is part of mlxcel's vision extra")

from fixtures.tiny_vlm import build_tiny_gemma3, build_tiny_qwen2_vl  # noqa: E402

from mlxcel.engine.sampling.params import SamplingParams  # noqa: E402
from mlxcel.engine.text.request import GenerationEvent, GenerationRequest  # noqa: E402
from mlxcel.engine.vision.engine import VisionEngine  # noqa: E402
from mlxcel.engine.vision.inputs import VisionInputs, VisionPrompt  # noqa: E402
from mlxcel.engine.vision.loader import load_vision_model  # noqa: E402

PROMPTS = {
    "qwen2_vl": (
        "<|im_start|>user\n{text}<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\n",
        "<|vision_start|><|image_pad|><|vision_end|>",
    ),
    "gemma3": (
        "<bos><start_of_turn>user\n{text}<start_of_image><end_of_turn>\n<start_of_turn>model\n",
        "<start_of_image>",
    ),
}


@pytest.fixture(scope="module", params=["qwen2_vl", "gemma3"])
def vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    build = build_tiny_qwen2_vl if request.param == "qwen2_vl" else build_tiny_gemma3
    path = build(tmp_path_factory.mktemp(request.param))
    return load_vision_model(path, name=request.param)


def _image(color: tuple[int, int, int], size: tuple[int, int] = (64, 64)) -> Any:
    from PIL import Image

    picture = Image.new("RGB", size, color)
    for x in range(0, size[0], 8):
        for y in range(size[1]):
            picture.putpixel((x, y), (255 - color[0], 255 - color[1], 255 - color[2]))
    return picture


def _request(
    vlm: Any, text: str, images: list[Any], max_tokens: int = 10, **fields: Any
) -> GenerationRequest:
    template, placeholder = PROMPTS[vlm.info.architecture]
    prompt = template.format(text=text)
    if not images:
        prompt = prompt.replace(placeholder, "")
    fields.setdefault("ignore_eos", True)
    return GenerationRequest(
        prompt_tokens=[],
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0),
        media=VisionPrompt(prompt, VisionInputs(images=images)),
        **fields,
    )


def _drain(sink: queue.SimpleQueue[GenerationEvent]) -> list[GenerationEvent]:
    events = [sink.get(timeout=120)]
    while not events[-1].finished:
        events.append(sink.get(timeout=120))
    return events


def _tokens(events: list[GenerationEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def _together(engine: VisionEngine, requests: list[GenerationRequest]) -> list[list[int]]:
    sinks = []
    for request in requests:
        sink: queue.SimpleQueue[GenerationEvent] = queue.SimpleQueue()
        engine.submit(request, sink.put)
        sinks.append(sink)
    out = []
    for sink in sinks:
        events = _drain(sink)
        assert events[-1].finish_reason == "length", events[-1].error
        out.append(_tokens(events))
    return out


def test_text_prompts_of_different_lengths_prefill_together(vlm: Any) -> None:
    """Text-only requests to a vision model prefill in one (right-padded) batch."""
    texts = ("short one", "a much longer prompt about the sea and the mountains", "mid one")
    alone_engine = VisionEngine(vlm, slots=1)
    try:
        alone = [_together(alone_engine, [_request(vlm, t, [], 10)])[0] for t in texts]
    finally:
        alone_engine.stop()
    engine = VisionEngine(vlm, slots=3, prefill_chunk=16)
    try:
        together = _together(engine, [_request(vlm, t, [], 10) for t in texts])
    finally:
        engine.stop()
    assert together == alone


def _mixed(vlm: Any) -> list[GenerationRequest]:
    """Two pictures (one larger: more patch tokens on Qwen2-VL), a text-only request, and
    the first picture again with other text; they finish at different steps."""
    return [
        _request(vlm, "What is in the picture?", [_image((250, 0, 0))], 12),
        _request(vlm, "Describe it.", [_image((0, 0, 250), (96, 80))], 9),
        _request(vlm, "Say something about the sea and the sky.", [], 14),
        _request(vlm, "And now?", [_image((250, 0, 0))], 7),
    ]


def test_batched_vision_is_the_same_as_alone(vlm: Any) -> None:
    alone_engine = VisionEngine(vlm, slots=1)
    try:
        alone = [_together(alone_engine, [r])[0] for r in _mixed(vlm)]
    finally:
        alone_engine.stop()
    engine = VisionEngine(vlm, slots=4)
    try:
        together = _together(engine, _mixed(vlm))
        counters = engine.snapshot().counters
    finally:
        engine.stop()
    assert together == alone
    assert counters.busy_slots_max == 4  # the four decoded in one batch
    assert counters.busy_slots_per_decode_total > counters.decode_steps


def _cancel_one_finish_one(
    engine: Any, long: GenerationRequest, short: GenerationRequest
) -> tuple[str | None, list[int], Any]:
    """Cancel `long` while it decodes, after `short` ran beside it to its end: the
    cancelled one's finish reason, the short one's tokens, the counters."""
    sink: queue.SimpleQueue[GenerationEvent] = queue.SimpleQueue()
    engine.submit(long, sink.put)
    sink.get(timeout=120)
    done = _together(engine, [short])
    engine.cancel(long.request_id)
    events = _drain(sink)
    assert all(slot.state == "idle" for slot in engine.snapshot().slots)
    return events[-1].finish_reason, done[0], engine.snapshot().counters


def test_metrics_and_cancellation_are_the_same_on_both_model_kinds(
    vlm: Any, tiny_llama_dir: Path
) -> None:
    """A cancelled request is not counted; a finished one is, at its finish: the vision
    engine's counters move exactly as the text engine's in the same scenario."""
    from mlxcel.engine.loading import load_model
    from mlxcel.engine.text.scheduler import TextEngine

    vision = VisionEngine(vlm, slots=2)
    try:
        long = _request(vlm, "Tell a long story.", [_image((9, 9, 9))], 400)
        short = _request(vlm, "Short.", [_image((1, 200, 1))], 5)
        seen = _cancel_one_finish_one(vision, long, short)
    finally:
        vision.stop()
    text_model = load_model(str(tiny_llama_dir))
    text = TextEngine(text_model, slots=2, context_per_slot=512)
    try:
        prompt = text_model.tokenizer.encode("tell a long story")
        expected = _cancel_one_finish_one(
            text,
            GenerationRequest(prompt_tokens=prompt, max_tokens=400, ignore_eos=True),
            GenerationRequest(prompt_tokens=prompt, max_tokens=5, ignore_eos=True),
        )
    finally:
        text.stop()
    assert seen[0] == expected[0] == "cancelled"
    assert len(seen[1]) == len(expected[1]) == 5
    fields = (
        "requests_total",
        "sequences_started",
        "sequences_completed",
        "completion_tokens_total",
    )
    assert {f: getattr(seen[2], f) for f in fields} == {f: getattr(expected[2], f) for f in fields}
    assert seen[2].requests_total == 1 and seen[2].sequences_started == 2


def _fail_one_at_insert(
    engine: Any, running: GenerationRequest, broken: GenerationRequest
) -> tuple[list[int], GenerationEvent, Any]:
    """Run `running`; while it decodes, `broken` fails as the engine puts it into the
    batch: `running`'s tokens, `broken`'s last event, the counters."""
    insert = engine._insert

    def failing(generator: Any, job: Any, cache: Any) -> None:
        if job.request is broken:
            raise RuntimeError("no room for this sequence")
        insert(generator, job, cache)

    engine._insert = failing
    sink: queue.SimpleQueue[GenerationEvent] = queue.SimpleQueue()
    engine.submit(running, sink.put)
    first = sink.get(timeout=120)
    failed = _drain(_submitted(engine, broken))
    events = [first, *_drain(sink)]
    assert events[-1].finish_reason == "length", events[-1].error
    assert all(slot.state == "idle" for slot in engine.snapshot().slots)
    return _tokens(events), failed[-1], engine.snapshot().counters


def _submitted(engine: Any, request: GenerationRequest) -> queue.SimpleQueue[GenerationEvent]:
    sink: queue.SimpleQueue[GenerationEvent] = queue.SimpleQueue()
    engine.submit(request, sink.put)
    return sink


def _engine_and_requests(
    kind: str, vlm: Any, tiny_llama_dir: Path
) -> tuple[Any, Callable[[int], GenerationRequest], GenerationRequest]:
    """A two-slot engine of `kind`, a maker of its requests of n tokens, a text-only one."""
    from mlxcel.engine.loading import load_model
    from mlxcel.engine.text.scheduler import TextEngine

    if kind == "vision":

        def picture(n: int) -> GenerationRequest:
            return _request(vlm, "Describe it.", [_image((5, 90, 5))], n)

        return VisionEngine(vlm, slots=2), picture, _request(vlm, "Hello.", [], 8)
    model = load_model(str(tiny_llama_dir))
    prompt = model.tokenizer.encode("tell a long story")

    def text(n: int) -> GenerationRequest:
        greedy = SamplingParams(temperature=0.0)
        return GenerationRequest(
            prompt_tokens=list(prompt), max_tokens=n, sampling=greedy, ignore_eos=True
        )

    return TextEngine(model, slots=2, context_per_slot=512), text, text(8)


def test_a_failed_insert_fails_alone_and_counts_the_same_on_both_kinds(
    vlm: Any, tiny_llama_dir: Path
) -> None:
    """A request failing as it joins the batch fails alone (the running one's tokens are
    those it gets alone), and is a request but no started or completed sequence, on the
    vision engine exactly as on the text engine."""
    counted = ("requests_total", "sequences_started", "sequences_completed")
    results = {}
    for kind in ("vision", "text"):
        engine, make, text_only = _engine_and_requests(kind, vlm, tiny_llama_dir)
        try:
            alone = _tokens(list(engine.generate(make(24))))
            tokens, failed, counters = _fail_one_at_insert(engine, make(24), text_only)
        finally:
            engine.stop()
        assert tokens == alone
        assert failed.finish_reason == "error" and failed.error == "no room for this sequence"
        results[kind] = {f: getattr(counters, f) for f in counted}
    assert (
        results["vision"]
        == results["text"]
        == {
            "requests_total": 3,  # the one alone, the one beside, the failed one
            "sequences_started": 2,
            "sequences_completed": 2,
        }
    )


def test_vision_requests_get_the_whole_token_pipeline(vlm: Any) -> None:
    """Timings per token, prefill progress and loop detection, as on a text model."""
    from mlxcel.engine.text.loop_detection import LoopParams

    engine = VisionEngine(vlm, slots=2)
    try:
        request = _request(
            vlm, "What is it?", [_image((40, 90, 160))], 6, timings_per_token=True, progress=True
        )
        events = list(engine.generate(request))
        loop = LoopParams(max_pattern_size=4, min_pattern_size=1, min_count=4)
        looping = _request(vlm, "Repeat.", [_image((40, 90, 160))], 300, loop=loop)
        looped = list(engine.generate(looping))
    finally:
        engine.stop()
    progress = [e for e in events if e.progress is not None]
    assert progress and progress[-1].progress.processed == events[-1].prompt_tokens
    tokens = [e for e in events if e.token_ids]
    assert tokens and all(e.timings is not None for e in tokens)
    assert events[-1].timings is not None and events[-1].timings.predicted_n == 6
    # the tiny model repeats itself: loop detection stops it long before 300 tokens
    assert looped[-1].finish_reason == "stop" and len(_tokens(looped)) < 300


def test_a_follow_up_turn_about_the_same_picture_reuses_its_prefix(
    vlm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlxcel.engine.vision.engine as vision_engine
    from mlxcel.engine.text.prompt_cache import PromptCache

    towers: list[int] = []  # the media prefills run, by the tokens they start from
    prefill = vision_engine.MediaPrefill

    def spy(step: Any, prepared: Any, cache: Any, start: int) -> Any:
        towers.append(start)
        return prefill(step, prepared, cache, start)

    monkeypatch.setattr(vision_engine, "MediaPrefill", spy)
    picture = _image((200, 120, 30))
    first = _request(vlm, "What is in this picture, in a few words?", [picture], 8)
    engine = VisionEngine(vlm, slots=2, prompt_cache=PromptCache())
    plain = VisionEngine(vlm, slots=2)
    try:
        turn = list(engine.generate(first))
        follow = _follow_up(vlm, first, turn, picture)
        cached = list(engine.generate(follow))
        assert towers == [0]  # the follow-up ran no vision tower: its picture was cached
        other = list(engine.generate(_follow_up(vlm, first, turn, _image((0, 90, 250)))))
        cold = list(plain.generate(_follow_up(vlm, first, turn, picture)))
    finally:
        engine.stop()
        plain.stop()
    prompt = len(first.prompt_tokens)
    assert cached[-1].timings is not None and cached[-1].timings.cache_n >= prompt - 16
    assert _tokens(cached) == _tokens(cold)  # the reused prefix gives the same tokens
    media_at = _first_media(vlm, first)
    assert other[-1].timings is not None and other[-1].timings.cache_n <= media_at


def _follow_up(
    vlm: Any, first: GenerationRequest, turn: list[GenerationEvent], picture: Any
) -> GenerationRequest:
    """The next turn: the first prompt (with `picture`), the answer, a new question."""
    assert isinstance(first.media, VisionPrompt)
    answer = "".join(e.text for e in turn)
    if vlm.info.architecture == "qwen2_vl":
        more = f"{answer}<|im_end|>\n<|im_start|>user\nAnd its colour?<|im_end|>\n"
        more += "<|im_start|>assistant\n"
    else:
        more = f"{answer}<end_of_turn>\n<start_of_turn>user\nAnd its colour?<end_of_turn>\n"
        more += "<start_of_turn>model\n"
    return GenerationRequest(
        prompt_tokens=[],
        max_tokens=6,
        sampling=SamplingParams(temperature=0.0),
        ignore_eos=True,
        media=VisionPrompt(first.media.text + more, VisionInputs(images=[picture])),
    )


def _first_media(vlm: Any, request: GenerationRequest) -> int:
    assert isinstance(request.media, VisionPrompt) and request.media.prepared is not None
    prepared = request.media.prepared
    pairs = zip(prepared.tokens, prepared.cache_key, strict=True)
    return next(i for i, (token, key) in enumerate(pairs) if token != key)


def test_the_disk_tier_serves_a_vision_model_after_a_restart(vlm: Any, tmp_path: Path) -> None:
    """What one engine's prompt cache wrote to its disk tier serves another after a
    restart (mlx-vlm's KV caches are written under mlx-lm's names and read back as
    mlx-vlm's): a picture request batched with a fresh one, then a text-only request, each
    with its cold tokens, nothing discarded as unreadable."""
    from mlxcel.engine.text.prompt_cache import PromptCache
    from mlxcel.engine.text.prompt_disk import DiskTier

    def disk() -> DiskTier:
        return DiskTier(tmp_path, 1 << 30, "tiny-vlm", None)

    picture = _image((30, 160, 90))
    text = "Describe the picture in a few careful words, please."
    other = "A different question entirely, not asked before."

    def cached() -> list[GenerationRequest]:
        return [_request(vlm, text, [picture], 6), _request(vlm, text, [], 6)]

    first = VisionEngine(vlm, slots=2, prompt_cache=PromptCache(disk=disk()))
    try:
        cold = [_tokens(list(first.generate(r))) for r in cached()]
        assert first.prompt_cache is not None and first.prompt_cache.persist() > 0
    finally:
        first.stop()
    alone = VisionEngine(vlm, slots=1)
    try:
        fresh = _tokens(list(alone.generate(_request(vlm, other, [], 6))))
    finally:
        alone.stop()
    tier = disk()
    restarted = VisionEngine(vlm, slots=2, prompt_cache=PromptCache(disk=tier))
    try:  # a row read from disk and a fresh one in one batch, then text only from disk
        together = _together(restarted, [cached()[0], _request(vlm, other, [], 6)])
        text_only = list(restarted.generate(cached()[1]))
    finally:
        restarted.stop()
    assert together == [cold[0], fresh]
    assert _tokens(text_only) == cold[1]
    assert text_only[-1].timings is not None and text_only[-1].timings.cache_n > 0
    assert tier.removed_invalid == 0 and tier.hits >= 2


def test_media_are_prepared_off_the_submitting_thread(vlm: Any) -> None:
    engine = VisionEngine(vlm, slots=2)
    threads: list[str] = []
    prepare = engine.prepare

    def spy(prompt: VisionPrompt) -> Any:
        threads.append(threading.current_thread().name)
        return prepare(prompt)

    engine.prepare = spy  # type: ignore[method-assign]
    try:
        request = _request(vlm, "What is it?", [_image((3, 3, 250))], 4)
        sink: queue.SimpleQueue[GenerationEvent] = queue.SimpleQueue()
        engine.submit(request, sink.put)  # queues it; the processor runs on the engine
        events = _drain(sink)
        bad = _request(vlm, "What is it?", [_image((3, 3, 250))], 4)
        bad.media.inputs.images = [object()]  # type: ignore[union-attr]  # not a picture
        failed: queue.SimpleQueue[GenerationEvent] = queue.SimpleQueue()
        engine.submit(bad, failed.put)
        failure = _drain(failed)
    finally:
        engine.stop()
    assert events[-1].finish_reason == "length" and len(_tokens(events)) == 4
    assert threads and all(name == "mlxcel-engine" for name in threads)
    assert failure[-1].finish_reason == "error" and failure[-1].error


def test_a_request_decodes_as_mlx_vlm_generates_it(vlm: Any) -> None:
    """The core's path (multimodal prefill alone, then the batched step over the language
    model) gives the greedy tokens of mlx-vlm's own `generate_step`, as the one-slot engine
    did."""
    request = _request(vlm, "What is in the picture?", [_image((120, 30, 220), (80, 64))], 12)
    engine = VisionEngine(vlm, slots=2)
    try:
        ours = _tokens(list(engine.generate(request)))
    finally:
        engine.stop()
    assert isinstance(request.media, VisionPrompt) and request.media.prepared is not None
    assert ours == _mlx_vlm_greedy(vlm, request.media.prepared, 12)


def test_gemma4_audio_batches_as_alone_and_from_the_cache(tmp_path: Path) -> None:
    """Audio requests (Gemma 4's audio tower) and a text-only one, batched, give the tokens
    each gives alone; run again through the prompt cache, the same again."""
    import numpy as np
    from fixtures.tiny_vlm import build_tiny_gemma4

    from mlxcel.engine.text.prompt_cache import PromptCache

    loaded = load_vision_model(build_tiny_gemma4(tmp_path / "g4"), name="tiny-gemma4")
    listen = "<bos><start_of_turn>user\nListen<|audio|><end_of_turn>\n<start_of_turn>model\n"
    hello = (
        "<bos><start_of_turn>user\nHello there, how are you?<end_of_turn>\n<start_of_turn>model\n"
    )

    def requests() -> list[GenerationRequest]:
        clips = [(np.sin(np.arange(16000) / p) * 0.3).astype(np.float32) for p in (5.0, 50.0)]
        media = [VisionPrompt(listen, VisionInputs(audio=[c])) for c in clips]
        media.append(VisionPrompt(hello, VisionInputs()))
        return [
            GenerationRequest(
                prompt_tokens=[],
                max_tokens=8,
                ignore_eos=True,
                sampling=SamplingParams(temperature=0.0),
                media=m,
            )
            for m in media
        ]

    alone_engine = VisionEngine(loaded, slots=1)
    try:
        alone = [_together(alone_engine, [r])[0] for r in requests()]
    finally:
        alone_engine.stop()
    engine = VisionEngine(loaded, slots=3, prompt_cache=PromptCache())
    try:
        together = _together(engine, requests())
        again = _together(engine, requests())
        cache = engine.prompt_cache.stats()
    finally:
        engine.stop()
    assert together == alone and again == alone
    assert cache.hits >= 3


def test_running_requests_decode_while_a_new_picture_prefills(vlm: Any) -> None:
    """A media prefill runs a piece between two batch steps: the decoding request gets
    tokens while the new one's prompt is still being prefilled."""
    engine = VisionEngine(vlm, slots=2, prefill_chunk=16)
    order: list[tuple[str, str]] = []  # (request, "token" | "progress"), as the engine sent them
    done = threading.Event()

    def sink(event: GenerationEvent) -> None:
        if event.token_ids:
            order.append((event.request_id, "token"))
        elif event.progress is not None:
            order.append((event.request_id, "progress"))
        if event.finished and event.request_id == "new":
            done.set()

    try:
        running = _request(vlm, "Tell a long story.", [_image((9, 9, 9))], 300, request_id="old")
        first = threading.Event()
        engine.submit(running, lambda e: (sink(e), first.set() if e.token_ids else None))
        assert first.wait(120)
        text = " ".join(f"line {i} of a long question about the picture" for i in range(20))
        new = _request(vlm, text, [_image((200, 9, 9))], 4, request_id="new", progress=True)
        engine.submit(new, sink)
        assert done.wait(120)
        engine.cancel("old")
    finally:
        engine.stop()
    progress = [i for i, (rid, kind) in enumerate(order) if rid == "new" and kind == "progress"]
    assert len(progress) > 5  # the prompt went in many pieces
    between = order[progress[0] : progress[-1]]
    assert ("old", "token") in between


def test_an_encoder_decoder_is_refused_clearly() -> None:
    """florence2-like and nemotron_parse-like models put the prompt through an encoder
    whose states their decoder reads at every step (not through the KV cache the core
    keeps): the request fails with a clear error instead of decoding without them."""
    from types import SimpleNamespace

    import mlx.core as mx

    from mlxcel.engine.errors import InvalidRequestError
    from mlxcel.engine.vision.language_step import LanguageStep, MediaPrefill
    from mlxcel.engine.vision.prepared import PreparedPrompt

    tokens = [1, 2, 3, 4, 5]
    features = SimpleNamespace(
        inputs_embeds=mx.zeros((1, 5, 8)), to_dict=lambda: {"inputs_embeds": None}
    )
    model = SimpleNamespace(
        get_input_embeddings=lambda *a, **k: features,
        language_model=lambda **k: SimpleNamespace(encoder_outputs=mx.zeros((1, 2))),
    )
    prepared = PreparedPrompt(tokens, mx.array([tokens]), None, None, {}, "d", tokens)
    prefill = MediaPrefill(LanguageStep(model), prepared, [], 0)
    assert prefill.advance(16) is False  # the media went through the tower
    with pytest.raises(InvalidRequestError, match="encoder-decoder"):
        prefill.advance(16)


# --------------------------------------------------- cross-attention (Llama 3.2 Vision)

MLLAMA_PROMPT = (
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{images}{text}<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)


@pytest.fixture(scope="module")
def mllama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from fixtures.tiny_vlm import build_tiny_mllama

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = build_tiny_mllama(tmp_path_factory.mktemp("mllama"))
    return load_vision_model(path, name="mllama")


def _mllama_request(text: str, images: list[Any], max_tokens: int = 10) -> GenerationRequest:
    prompt = MLLAMA_PROMPT.format(images="<|image|>" * len(images), text=text)
    return GenerationRequest(
        prompt_tokens=[],
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0),
        media=VisionPrompt(prompt, VisionInputs(images=images)),
        ignore_eos=True,
    )


def _mlx_vlm_greedy(loaded: Any, prepared: Any, max_tokens: int) -> list[int]:
    """The greedy tokens of mlx-vlm's own generate_step (which carries the cross-attention
    states from step to step) for a prepared prompt."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step

    steps = generate_step(
        prepared.input_ids,
        loaded.model,
        prepared.pixel_values,
        prepared.mask,
        max_tokens=max_tokens,
        sampler=lambda logprobs: mx.argmax(logprobs, axis=-1),
        **prepared.extra,
    )
    return [int(token) for token, _ in steps]


def test_mllama_decodes_as_mlx_vlm_generates_it(mllama: Any) -> None:
    """The vision encoder's states reach every decode step of a cross-attention model: the
    core gives mlx-vlm's greedy tokens with a picture and with text only, and two pictures
    give different answers (the states matter). Such a model gets one slot."""
    engine = VisionEngine(mllama, slots=4)
    assert engine.n_slots == 1
    answers = []
    try:
        for images in ([_image((200, 40, 40), (60, 40))], [_image((20, 90, 230), (40, 70))], []):
            request = _mllama_request("What is in the picture?", images, 12)
            ours = _tokens(list(engine.generate(request)))
            assert isinstance(request.media, VisionPrompt) and request.media.prepared is not None
            assert ours == _mlx_vlm_greedy(mllama, request.media.prepared, 12)
            answers.append(ours)
    finally:
        engine.stop()
    assert answers[0] != answers[1]


def test_mllama_requests_run_one_after_another_as_alone(mllama: Any) -> None:
    """Requests sent together to a cross-attention model run one after another in the core
    (no two decode in one step), each with the tokens it gives alone."""
    pictures = [_image((200, 40, 40), (60, 40)), _image((20, 90, 230), (40, 70))]
    texts = ["Describe it.", "What colour is it?", "Hello there"]
    requests = lambda: [  # noqa: E731
        _mllama_request(texts[0], [pictures[0]]),
        _mllama_request(texts[1], [pictures[1]]),
        _mllama_request(texts[2], []),
    ]
    engine = VisionEngine(mllama, slots=4)
    try:
        alone = [_tokens(list(engine.generate(r))) for r in requests()]
        order: list[str] = []
        sinks = []
        for i, request in enumerate(requests()):
            sink: queue.SimpleQueue[GenerationEvent] = queue.SimpleQueue()

            def record(event: GenerationEvent, i: int = i, sink: Any = sink) -> None:
                if event.token_ids:
                    order.append(str(i))
                sink.put(event)

            engine.submit(request, record)
            sinks.append(sink)
        together = [_tokens(_drain(sink)) for sink in sinks]
    finally:
        engine.stop()
    assert together == alone
    runs = "".join(order)
    assert sorted(runs) == list(runs)  # each request's tokens all before the next one's


def test_mllama_follow_up_turn_gives_the_cold_tokens_from_the_prompt_cache(mllama: Any) -> None:
    """A follow-up turn about the same picture, served from the prompt cache, runs the
    vision tower again (its states are not cached) and gives the tokens it gives cold."""
    from mlxcel.engine.text.prompt_cache import PromptCache

    picture = _image((60, 160, 60), (50, 50))
    first = _mllama_request("What is it?", [picture], 6)
    cached = VisionEngine(mllama, slots=1, prompt_cache=PromptCache())
    cold = VisionEngine(mllama, slots=1)
    try:
        answer = _tokens(list(cached.generate(first)))
        assert isinstance(first.media, VisionPrompt)
        text = (
            first.media.text
            + cached.tokenizer.decode(answer)
            + "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAnd its colour?<|eot_id|>"
            + "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )

        def follow_up() -> GenerationRequest:
            request = _mllama_request("", [picture], 8)
            request.media = VisionPrompt(text, VisionInputs(images=[picture]))
            return request

        expected = _tokens(list(cold.generate(follow_up())))
        events = list(cached.generate(follow_up()))
    finally:
        cached.stop()
        cold.stop()
    assert _tokens(events) == expected
    assert events[-1].timings is not None and events[-1].timings.cache_n > 0


def test_mllama_prompt_cache_serves_a_repeated_text_prompt(mllama: Any) -> None:
    """A cross-attention model's caches go into the prompt cache and come back usable: a
    repeated text-only prompt is served from it (a cross-attention layer's cache trims, and
    what comes out of the batch is made one again) with the tokens it gives cold."""
    from mlxcel.engine.text.prompt_cache import PromptCache

    text = "Tell me a long story about the sea and the ships on it."
    engine = VisionEngine(mllama, slots=1, prompt_cache=PromptCache())
    try:
        cold = list(engine.generate(_mllama_request(text, [], 8)))
        warm = [list(engine.generate(_mllama_request(text, [], 8))) for _ in range(2)]
    finally:
        engine.stop()
    for events in warm:
        assert _tokens(events) == _tokens(cold)
        assert events[-1].timings is not None and events[-1].timings.cache_n > 0
