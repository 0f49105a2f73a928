"""Speculative decoding: n-gram lookup, the draft policy, and the engine's solo lane.

Greedy output must be the same, token for token and byte for byte, with and without
speculation, whatever ends the sequence (length, EOS, a stop string, loop detection) and
when a second request makes the lane give way. The tiny random-weight models loop a lot,
which gives prompt lookup matches to draft from.
"""

from __future__ import annotations

import copy
import queue
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxcel.engine.errors import ModelLoadError
from mlxcel.engine.sampling.params import SamplingParams
from mlxcel.engine.text.request import GenerationEvent, GenerationRequest, Timings
from mlxcel.engine.text.speculative import SpeculationConfig
from mlxcel.engine.text.speculative.lookup import PromptLookup
from mlxcel.engine.text.speculative.policy import DraftPolicy, RoundCosts

LOOPY = "The cat sat on the mat, the hat sat on the cat. " * 3
PLAIN = "Water boils at 100 degrees"
OTHER = "Numbers such as 3.14, 2.71 and 1.41 appear again"

# ------------------------------------------------------------------------ n-gram lookup


def naive_propose(tokens: Sequence[int], n_max: int, lo: int = 2, hi: int = 4) -> list[int]:
    """The longest suffix n-gram's most recent earlier occurrence, continued (reference)."""
    length = len(tokens)
    for n in range(min(hi, length), lo - 1, -1):
        suffix = list(tokens[length - n :])
        for start in range(length - 1, n - 1, -1):  # continuation start, most recent first
            if list(tokens[start - n : start]) == suffix:
                out: list[int] = []
                for k in range(n_max):
                    at = start + k
                    out.append(tokens[at] if at < length else out[at - length])
                return out
    return []


def test_lookup_prefers_the_longest_and_most_recent_match() -> None:
    lookup = PromptLookup(ngram_max=3, ngram_min=1)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 9, 5, 2, 7, 1, 2, 8, 1, 2]
    # (1, 2) occurred at 0-1 (then 9) and 6-7 (then 8): the most recent wins.
    assert lookup.propose(tokens, 2) == [8, 1]
    # A longer match beats a more recent shorter one.
    lookup = PromptLookup(ngram_max=3, ngram_min=1)
    tokens = [4, 1, 2, 3, 1, 2, 6, 4, 1, 2]
    assert lookup.propose(tokens, 3) == [3, 1, 2]


def test_lookup_continues_a_repeating_pattern_past_the_end() -> None:
    lookup = PromptLookup()
    assert lookup.propose([7, 3, 4, 3, 4], 5) == [3, 4, 3, 4, 3]
    assert lookup.propose([7, 3, 4, 3, 4, 3], 3) == [4, 3, 4]  # incremental extend


def test_lookup_without_a_match_drafts_nothing() -> None:
    lookup = PromptLookup(ngram_max=4, ngram_min=2)
    assert lookup.propose([1, 2, 3, 4, 5], 3) == []
    assert PromptLookup().propose([1], 3) == []
    with pytest.raises(ValueError):
        lookup.propose([1, 2], 3)  # the sequence may only grow
    with pytest.raises(ValueError):
        PromptLookup(ngram_max=1, ngram_min=2)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=40),
    st.integers(1, 6),
    st.integers(1, 8),
)
def test_lookup_matches_a_naive_search_when_grown_in_steps(
    tokens: list[int], n_max: int, step: int
) -> None:
    lookup = PromptLookup(ngram_max=4, ngram_min=2)
    for end in range(1, len(tokens) + 1, step):
        assert lookup.propose(tokens[:end], n_max) == naive_propose(tokens[:end], n_max)
    assert lookup.propose(tokens, n_max) == naive_propose(tokens, n_max)


# ------------------------------------------------------------------------------ policy


def _policy(costs: RoundCosts, **kw: Any) -> DraftPolicy:
    return DraftPolicy(costs, n_max=4, **kw)


def test_policy_measures_a_plain_step_first_then_tries_drafting() -> None:
    costs = RoundCosts()
    policy = _policy(costs)
    assert policy.choose(4, budget=100) == 0
    policy.record(0, 0, 0.1)
    assert policy.choose(4, budget=100) == 4  # untried widths are assumed as cheap as plain
    assert policy.choose(4, budget=3) == 2  # a round yields up to k + 1 tokens
    assert policy.choose(0, budget=100) == 0


def test_policy_keeps_drafting_when_rounds_cost_about_a_plain_step() -> None:
    costs = RoundCosts()
    policy = _policy(costs)
    policy.record(0, 0, 0.10)
    for _ in range(20):  # half the drafts accepted, rounds 10% dearer than a plain step
        k = policy.choose(4, budget=100)
        assert k > 0
        policy.record(k, k // 2, 0.11)


def test_policy_stops_drafting_when_rounds_cost_per_token() -> None:
    costs = RoundCosts()
    policy = _policy(costs)
    policy.record(0, 0, 0.10)
    k = policy.choose(4, budget=100)
    policy.record(k, k, 0.10 * (k + 1))  # even all accepted, nothing gained: never pays
    assert all(policy.choose(4, budget=100) == 0 for _ in range(300))


def test_policy_backs_off_on_rejections_and_probes_less_often() -> None:
    costs = RoundCosts()
    policy = _policy(costs, probe_every=4)
    policy.record(0, 0, 0.10)
    for _ in range(12):
        k = policy.choose(4, budget=100)
        if k:
            policy.record(k, 0, 0.13)
    assert policy.acceptance < 0.2
    picks = [policy.choose(4, budget=100) for _ in range(60)]
    probes = [i for i, k in enumerate(picks) if k]
    assert probes and all(picks[i] == 1 for i in probes)  # a probe drafts one token
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]
    policy.record(1, 1, 0.11)  # a probe that pays
    assert policy.acceptance > 0.15


def test_policy_n_min_and_fixed_mode() -> None:
    costs = RoundCosts()
    costs.record(0, 0.1)
    assert DraftPolicy(costs, n_max=4, n_min=3).choose(2, budget=100) == 0
    fixed = DraftPolicy(RoundCosts(), n_max=4, adaptive=False)
    assert fixed.choose(7, budget=100) == 4 and fixed.choose(2, budget=100) == 2


def test_config_validation(tiny_loaded: Any) -> None:
    assert SpeculationConfig("prompt-lookup").draft_kind == "prompt-lookup"
    assert SpeculationConfig("draft", draft=tiny_loaded).draft_kind == "draft-model"
    for bad in (
        {"kind": "ngram"},
        {"kind": "prompt-lookup", "n_max": 0},
        {"kind": "prompt-lookup", "n_min": 4},
        {"kind": "draft"},
        {"kind": "prompt-lookup", "draft": tiny_loaded},
    ):
        with pytest.raises(ValueError):
            SpeculationConfig(**bad)


# ------------------------------------------------------------------------------ engine


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama_dir: Path) -> Any:
    from mlxcel.engine.loading import load_model

    return load_model(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny llama with the same tokenizer and other weights: its drafts mostly fail."""
    from fixtures.tiny_models import build_tiny_model

    from mlxcel.engine.loading import load_model

    path = build_tiny_model(tmp_path_factory.mktemp("draft") / "tiny-llama-1", "llama", seed=1)
    return load_model(str(path))


def _engine(loaded: Any, speculation: SpeculationConfig | None = None, **kw: Any) -> Any:
    from mlxcel.engine.text.scheduler import TextEngine

    options: dict[str, Any] = {"slots": 1, "context_per_slot": 512}
    options.update(kw)
    return TextEngine(loaded, speculation=speculation, **options).start()


def _request(loaded: Any, text: str, n: int = 80, **kw: Any) -> GenerationRequest:
    options: dict[str, Any] = {"max_tokens": n, "ignore_eos": True, "cache_prompt": False}
    options.update(kw)
    sampling = options.pop("sampling", SamplingParams(temperature=0.0))
    return GenerationRequest(
        prompt_tokens=loaded.tokenizer.encode(text), sampling=sampling, **options
    )


class Run:
    """A request's events, folded."""

    def __init__(self, events: list[GenerationEvent]) -> None:
        self.events = events
        self.final = events[-1]
        self.tokens = [t for e in events for t in e.token_ids]
        self.text = "".join(e.text for e in events)
        timings = self.final.timings
        assert timings is not None
        self.timings: Timings = timings

    def same_output(self, other: Run) -> bool:
        a, b = self.final, other.final
        return (
            self.tokens == other.tokens
            and self.text == other.text
            and (a.finish_reason, a.stop_word, a.completion_tokens)
            == (b.finish_reason, b.stop_word, b.completion_tokens)
        )


def _run(engine: Any, request: GenerationRequest) -> Run:
    return Run(list(engine.generate(copy.deepcopy(request))))


@pytest.fixture(scope="module")
def base(tiny_loaded: Any) -> Any:
    engine = _engine(tiny_loaded)
    yield engine
    engine.stop()


LOOKUP = SpeculationConfig("prompt-lookup", n_max=4, adaptive=False)


def _self_draft(loaded: Any) -> SpeculationConfig:
    """The model drafting for itself: every draft is accepted."""
    return SpeculationConfig("draft", n_max=4, draft=loaded, adaptive=False)


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("text", [LOOPY, PLAIN, OTHER])
def test_prompt_lookup_output_is_identical(
    tiny_loaded: Any, base: Any, text: str, adaptive: bool
) -> None:
    config = SpeculationConfig("prompt-lookup", n_max=4, adaptive=adaptive)
    engine = _engine(tiny_loaded, config)
    try:
        runs = [_run(engine, _request(tiny_loaded, text, n=n)) for n in (120, 7)]
    finally:
        engine.stop()
    for run, n in zip(runs, (120, 7), strict=True):
        assert run.same_output(_run(base, _request(tiny_loaded, text, n=n)))
        assert run.final.finish_reason == "length" and len(run.tokens) == n
    timings = runs[0].timings
    if not adaptive:  # these outputs repeat themselves: lookup finds drafts in all of them
        assert timings.draft_rounds > 0 and timings.draft_n_accepted > 0
        assert timings.draft_kind == "prompt-lookup"
    if timings.draft_rounds:
        assert timings.draft_n_accepted <= timings.draft_n <= 4 * timings.draft_rounds
        assert timings.draft_n_accepted + timings.draft_rounds <= timings.predicted_n
        assert timings.to_dict()["draft_kind"] == "prompt-lookup"


def test_draft_model_output_is_identical_and_counted(
    tiny_loaded: Any, other_draft: Any, base: Any
) -> None:
    n = 100
    for config, all_accepted in (
        (_self_draft(tiny_loaded), True),
        (SpeculationConfig("draft", n_max=3, draft=other_draft, adaptive=False), False),
        (SpeculationConfig("draft", n_max=3, draft=other_draft), False),
    ):
        engine = _engine(tiny_loaded, config)
        try:
            runs = [_run(engine, _request(tiny_loaded, text, n=n)) for text in (LOOPY, OTHER)]
        finally:
            engine.stop()
        for run, text in zip(runs, (LOOPY, OTHER), strict=True):
            assert run.same_output(_run(base, _request(tiny_loaded, text, n=n)))
            t = run.timings
            if not config.adaptive:
                assert t.draft_rounds > 0 and t.draft_kind == "draft-model"
                assert t.draft_n <= config.n_max * t.draft_rounds
            assert t.draft_n_accepted <= t.draft_n
            if all_accepted:
                # One token from the generator, one it had chosen ahead, then full rounds.
                assert t.draft_n_accepted == t.draft_n > 0
                assert t.draft_n_accepted + t.draft_rounds == n - 2


def test_qwen3_lookup_output_is_identical(tiny_qwen3_dir: Path) -> None:
    from mlxcel.engine.loading import load_model

    loaded = load_model(str(tiny_qwen3_dir))
    plain, spec = _engine(loaded), _engine(loaded, LOOKUP)
    try:
        for text in (LOOPY, PLAIN):
            assert _run(spec, _request(loaded, text, n=90)).same_output(
                _run(plain, _request(loaded, text, n=90))
            )
    finally:
        plain.stop()
        spec.stop()


def test_stop_strings_and_max_tokens_inside_accepted_runs(tiny_loaded: Any, base: Any) -> None:
    reference = _run(base, _request(tiny_loaded, LOOPY, n=60))
    text = reference.text
    engine = _engine(tiny_loaded, _self_draft(tiny_loaded))
    try:
        for n in range(2, 13):  # every place a 5-token round can be cut
            run = _run(engine, _request(tiny_loaded, LOOPY, n=n))
            assert run.same_output(_run(base, _request(tiny_loaded, LOOPY, n=n)))
            assert len(run.tokens) == n
        stops = {text[i : i + 3] for i in range(len(text) // 4, len(text) - 3, 7)}
        stops = {s for s in stops if s.strip()}
        assert len(stops) >= 3
        for stop in sorted(stops):
            request = _request(tiny_loaded, LOOPY, n=60, stop=(stop,))
            run = _run(engine, request)
            assert run.same_output(_run(base, request)), stop
            assert run.final.finish_reason == "stop" and run.final.stop_word == stop
            assert stop not in run.text
    finally:
        engine.stop()


def test_eos_inside_an_accepted_run(tiny_loaded: Any, base: Any) -> None:
    from mlxcel.engine.loading.model import LoadedModel

    reference = _run(base, _request(tiny_loaded, LOOPY, n=60)).tokens
    # A token that first appears well after the lane started plays the end of sequence.
    at = next(i for i in range(8, len(reference)) if reference[i] not in reference[:i])
    tokenizer = copy.copy(tiny_loaded.tokenizer)
    tokenizer.eos_token_ids = frozenset({reference[at]})
    loaded = LoadedModel(model=tiny_loaded.model, tokenizer=tokenizer, info=tiny_loaded.info)
    plain = _engine(loaded)
    spec = _engine(loaded, SpeculationConfig("draft", n_max=4, draft=loaded, adaptive=False))
    try:
        request = _request(loaded, LOOPY, n=60, ignore_eos=False)
        expected, run = _run(plain, request), _run(spec, request)
    finally:
        plain.stop()
        spec.stop()
    assert expected.tokens == reference[:at] and expected.final.finish_reason == "stop"
    assert run.same_output(expected)
    assert run.timings.draft_rounds > 0


def test_loop_detection_inside_the_lane(tiny_loaded: Any, base: Any) -> None:
    from mlxcel.engine.text.loop_detection import LoopParams

    loop = LoopParams(max_pattern_size=6, min_pattern_size=1, min_count=3)
    engine = _engine(tiny_loaded, LOOKUP)
    try:
        for text in (LOOPY, PLAIN, OTHER):
            request = _request(tiny_loaded, text, n=150, loop=loop)
            run = _run(engine, request)
            assert run.same_output(_run(base, request))
    finally:
        engine.stop()


def test_logprobs_are_given_from_the_lane(tiny_loaded: Any, base: Any) -> None:
    request = _request(tiny_loaded, LOOPY, n=40, logprobs=2)
    engine = _engine(tiny_loaded, _self_draft(tiny_loaded))
    try:
        run = _run(engine, request)
    finally:
        engine.stop()
    expected = _run(base, request)
    assert run.same_output(expected) and run.timings.draft_rounds > 0
    ours = [lp for e in run.events for lp in e.logprobs]
    theirs = [lp for e in expected.events for lp in e.logprobs]
    assert len(ours) == len(theirs) == 40
    for a, b in zip(ours, theirs, strict=True):
        assert a.token_id == b.token_id
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_sampled_and_processed_requests_stay_in_the_batch(tiny_loaded: Any) -> None:
    engine = _engine(tiny_loaded, LOOKUP)
    plain = _engine(tiny_loaded)
    try:
        for sampling in (
            SamplingParams(temperature=0.8, seed=7),
            SamplingParams(temperature=0.0, repetition_penalty=1.3),
        ):
            request = _request(tiny_loaded, LOOPY, n=40, sampling=sampling)
            run = _run(engine, request)
            assert run.same_output(_run(plain, request))
            assert run.timings.draft_rounds == 0
            assert "draft_n" not in run.timings.to_dict()
        greedy_top1 = SamplingParams(temperature=0.7, top_k=1)
        run = _run(engine, _request(tiny_loaded, LOOPY, n=40, sampling=greedy_top1))
        assert run.timings.draft_rounds > 0
        assert run.same_output(_run(plain, _request(tiny_loaded, LOOPY, n=40)))
    finally:
        engine.stop()
        plain.stop()


def test_the_lane_gives_way_to_a_second_request(
    tiny_loaded: Any, base: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxcel.engine.text.speculative.lane import SoloLane, Speculator

    calls: list[str] = []
    enter, hand_back = Speculator.enter, SoloLane.hand_back

    def spy_enter(self: Any, *args: Any, **kw: Any) -> Any:
        calls.append("enter")
        return enter(self, *args, **kw)

    def spy_hand_back(self: Any, *args: Any, **kw: Any) -> Any:
        calls.append("hand back")
        return hand_back(self, *args, **kw)

    monkeypatch.setattr(Speculator, "enter", spy_enter)
    monkeypatch.setattr(SoloLane, "hand_back", spy_hand_back)
    long = _request(tiny_loaded, LOOPY, n=300)
    short = _request(tiny_loaded, OTHER, n=25)
    engine = _engine(tiny_loaded, LOOKUP, slots=2)
    finished: list[str] = []
    try:
        sinks: dict[str, queue.SimpleQueue[GenerationEvent]] = {}
        for request in (long, short):
            sinks[request.request_id] = queue.SimpleQueue()

        def collect(request: GenerationRequest, until: int | None = None) -> list[Any]:
            events: list[Any] = []
            while until is None or len(events) < until:
                event = sinks[request.request_id].get(timeout=60)
                events.append(event)
                if event.finished:
                    finished.append(request.request_id)
                    break
            return events

        engine.submit(copy.deepcopy(long), sinks[long.request_id].put)
        head = collect(long, until=30)  # the long one is in the lane by now
        engine.submit(copy.deepcopy(short), sinks[short.request_id].put)
        short_run = Run(collect(short))
        long_run = Run(head + collect(long))
    finally:
        engine.stop()
    assert finished == [short.request_id, long.request_id]  # the short one was not held up
    assert short_run.same_output(_run(base, short))
    assert long_run.same_output(_run(base, long))
    assert long_run.timings.draft_rounds > 0
    assert short_run.timings.draft_rounds == 0  # it never ran alone
    # In the lane, back to the batch when the short one came, in again once it was done.
    assert calls[:3] == ["enter", "hand back", "enter"]


def test_the_lane_recomputes_a_step_it_cannot_take_over(tiny_loaded: Any, base: Any) -> None:
    # Sampling per request, the engine does not know the token the generator chose ahead.
    engine = _engine(tiny_loaded, LOOKUP, batched_sampling=False)
    try:
        runs = {text: _run(engine, _request(tiny_loaded, text, n=60)) for text in (LOOPY, OTHER)}
        for text, run in runs.items():
            assert run.same_output(_run(base, _request(tiny_loaded, text, n=60)))
        assert runs[LOOPY].timings.draft_rounds > 0
    finally:
        engine.stop()


def test_cancel_in_the_lane_keeps_the_engine_and_the_cache(tiny_loaded: Any, base: Any) -> None:
    from mlxcel.engine.text.prompt_cache import PromptCache

    cache = PromptCache()
    engine = _engine(tiny_loaded, _self_draft(tiny_loaded), prompt_cache=cache)
    try:
        request = _request(tiny_loaded, LOOPY, n=400, cache_prompt=True)
        events: queue.SimpleQueue[GenerationEvent] = queue.SimpleQueue()
        engine.submit(request, events.put)
        for _ in range(20):
            assert not events.get(timeout=60).finished
        engine.cancel(request.request_id)
        while not (event := events.get(timeout=60)).finished:
            pass
        assert event.finish_reason == "cancelled"
        assert cache.stats().inserts == 1  # the lane's KV cache was kept
        _, n_cached = cache.lookup([*request.prompt_tokens, 1])
        assert n_cached == len(request.prompt_tokens)
        # The engine goes on; a cached prompt through the lane gives the same output.
        again = _request(tiny_loaded, LOOPY, n=50, cache_prompt=True)
        run = _run(engine, again)
        assert run.timings.cache_n > 0 and run.timings.draft_rounds > 0
        assert run.same_output(_run(base, _request(tiny_loaded, LOOPY, n=50)))
        assert engine._spec is not None and engine._spec.lane is None and not engine._running
    finally:
        engine.stop()


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_loaded: Any, tmp_path: Path) -> None:
    from fixtures.tiny_models import build_tiny_model, train_tiny_tokenizer

    from mlxcel.engine.loading import load_model

    path = build_tiny_model(tmp_path / "tiny-other-vocab", "llama", seed=2)
    train_tiny_tokenizer(384).save(str(path / "tokenizer.json"))
    draft = load_model(str(path))
    assert draft.tokenizer.vocab_size != tiny_loaded.tokenizer.vocab_size
    with pytest.raises(ModelLoadError, match="vocabulary"):
        _engine(tiny_loaded, SpeculationConfig("draft", draft=draft))


def test_server_settings_build_the_config(tiny_llama_dir: Path) -> None:
    from types import SimpleNamespace

    from mlxcel.config import SettingsError
    from mlxcel.server.boot import speculation_config

    def config(**kw: Any) -> Any:
        values: dict[str, Any] = {
            "spec_type": "none",
            "spec_draft_model": None,
            "spec_draft_n_max": 3,
            "spec_draft_n_min": 0,
            "model_store": None,
            "cpu_dtype": "keep",
            "threads": -1,
        }
        values.update(kw)
        return speculation_config(cast(Any, SimpleNamespace(**values)), cast(Any, None))

    assert config() is None
    lookup = config(spec_type="ngram-simple", spec_draft_n_max=6, spec_draft_n_min=2)
    assert (lookup.kind, lookup.n_max, lookup.n_min, lookup.draft) == ("prompt-lookup", 6, 2, None)
    draft = config(spec_draft_model=str(tiny_llama_dir))  # a draft model implies draft-simple
    assert draft.kind == "draft" and draft.draft.tokenizer.vocab_size > 0
    for bad in (
        {"spec_type": "draft-simple"},
        {"spec_type": "ngram-simple", "spec_draft_n_max": 0},
        {"spec_type": "ngram-simple", "spec_draft_n_min": 5},
        {"spec_type": "eagle3"},
    ):
        with pytest.raises(SettingsError):
            config(**bad)
