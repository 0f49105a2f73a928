"""Every GGUF architecture mlxcel reads (gguf_arch/): a tiny random-weight file written as
llama.cpp's converter writes it loads through the real loader into mlx-lm's class with
the same logits and greedy tokens as the same weights loaded directly into that class."""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from fixtures.generate_cli import greedy_cli_text
from fixtures.other_thread import on_another_thread
from fixtures.tiny_arch_gguf import (
    ARCHITECTURES,
    converted_tensors,
    tiny_config,
    tiny_reference,
    write_tiny_arch_gguf,
)
from server_harness import ServeProcess

from mlxcel.engine.loading.gguf import load_gguf
from mlxcel.engine.loading.gguf_arch import SUPPORTED_ARCHITECTURES, find_architecture

PROMPT = [5, 40, 41, 42, 60, 70, 80, 90, 100, 110, 120, 130]


@pytest.fixture(scope="module")
def arch_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-arch")


def _greedy(model: object, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        logits = model(mx.array([tokens]))  # type: ignore[operator]
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_tiny_architecture_matches_mlx_lm(name: str, arch_dir: Path) -> None:
    """Names, hyper-parameters and the tricky bits (Gemma's `1 + w` norms and soft-capping,
    expert stacking, Granite's multipliers, SmolLM3's no-RoPE layers, Phi-3's fused
    projections) read back into the mlx-lm class: the same logits and greedy tokens."""
    arch = ARCHITECTURES[name]
    path, reference = write_tiny_arch_gguf(arch, arch_dir / f"tiny-{name}.gguf")
    loaded = load_gguf(path)
    assert loaded.architecture == arch.architecture
    assert loaded.config["model_type"] == arch.config["model_type"]
    inputs = mx.array([PROMPT])
    want = np.array(reference(inputs))
    got = np.array(loaded.model(inputs))
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert _greedy(loaded.model, PROMPT, 6) == _greedy(reference, PROMPT, 6)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_fixture_names_are_llama_cpps(name: str) -> None:
    """The fixtures name each tensor as llama.cpp's converter does: the Hugging Face name
    of every weight (mlx-lm's stacked `switch_mlp` as HF's merged `mlp.experts`) maps to the
    same GGUF name through gguf-py's `TensorNameMap`, llama.cpp's own table. So the loader
    is checked against llama.cpp's names, not against a copy of its own table."""
    import gguf

    arch = ARCHITECTURES[name]
    by_name = {value: key for key, value in gguf.MODEL_ARCH_NAMES.items()}
    config = tiny_config(arch, 100)
    _, weights = tiny_reference(config)
    table = gguf.get_tensor_name_map(by_name[arch.architecture], config["num_hidden_layers"])
    for hf_name, value in weights.items():
        written = [g for g, _ in converted_tensors(arch, config, hf_name, np.array(value))]
        merged = re.sub(r"(block_sparse_moe|mlp)\.switch_mlp\.", "mlp.experts.", hf_name)
        theirs = table.get_name(merged, try_suffixes=(".weight", ".bias"))
        if theirs and not theirs.endswith((".weight", ".bias")):
            theirs += ".weight"  # a bare parameter (gpt-oss's sinks): the converter adds it
        if arch.split_qkv and theirs and theirs.endswith("attn_qkv.weight"):
            theirs = theirs.replace("attn_qkv", "attn_q")  # split on purpose
        assert theirs in written, (hf_name, written, theirs)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_tokenizer_from_the_file(name: str, arch_dir: Path) -> None:
    """Each architecture's tokenizer comes from the file's metadata: SentencePiece (BOS
    first; Gemma without the space prefix) or byte-level BPE, round-tripping the text, with
    the file's chat template and EOS."""
    arch = ARCHITECTURES[name]
    path, _ = write_tiny_arch_gguf(arch, arch_dir / f"tok-{name}.gguf")
    tokenizer = load_gguf(path).tokenizer
    ids = tokenizer.encode("The cat sat on the mat")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "The cat sat on the mat"
    first = tokenizer.convert_ids_to_tokens(ids[:2])
    if arch.spm:
        assert first[0] == "<s>" and tokenizer.eos_token == "</s>"
        assert first[1] == ("T" if name == "gemma2" else "▁The")
    else:
        assert first[0] == "The" and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template


def _max_error(got: object, reference: object) -> float:
    inputs = mx.array([PROMPT])
    want = np.array(reference(inputs))  # type: ignore[operator]
    return float(np.abs(np.array(got(inputs)) - want).max() / np.abs(want).max())  # type: ignore[operator]


@pytest.mark.parametrize(
    ("name", "unlike_the_converter"),
    [
        ("smollm3", {"permuted": False}),
        ("gemma2", {"norm_offset": 0.0}),
        ("mistral3", {"permuted": False}),
    ],
)
def test_a_file_written_otherwise_reads_otherwise(
    name: str, unlike_the_converter: dict[str, object], arch_dir: Path
) -> None:
    """The checks above can fail: Q/K rows not permuted as the converter does, or norms
    without its `1 + w`, give other logits."""
    arch = dataclasses.replace(ARCHITECTURES[name], **unlike_the_converter)  # type: ignore[arg-type]
    path, reference = write_tiny_arch_gguf(arch, arch_dir / f"unlike-{name}.gguf")
    assert _max_error(load_gguf(path).model, reference) > 1e-2


@pytest.mark.parametrize(
    ("name", "broken"),
    [
        ("granite", {"embedding_multiplier": 1.0, "logits_scaling": 1.0}),
        ("granite", {"residual_multiplier": 1.0}),
        ("gemma2", {"final_logit_softcapping": 1e6, "attn_logit_softcapping": 1e6}),
        ("smollm3", {"no_rope_layer_interval": 1000}),
        ("mistral3", {"llama_4_scaling_beta": 0.0}),
        ("mistral3", {"mscale_all_dim": 0.0}),
        ("mistral3", {"rope_type": "default"}),
    ],
)
def test_the_hyper_parameters_matter(name: str, broken: dict[str, float], arch_dir: Path) -> None:
    """The loaded weights in a class whose config lacks one of the mapped hyper-parameters
    (Granite's multipliers, Gemma 2's soft-capping, SmolLM3's no-RoPE layers, Ministral 3's
    attention temperature, YaRN log multiplier and YaRN itself) give other logits than the
    reference."""
    path, reference = write_tiny_arch_gguf(ARCHITECTURES[name], arch_dir / f"{name}.gguf")
    loaded = load_gguf(path)
    if "rope_parameters" in loaded.config:  # Ministral 3's are one nested dict
        config = {
            **loaded.config,
            "rope_parameters": {**loaded.config["rope_parameters"], **broken},
        }
    else:
        config = {**loaded.config, **broken}
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    model.update(loaded.model.parameters())
    assert _max_error(loaded.model, reference) < 1e-4
    assert _max_error(model, reference) > 1e-2


@pytest.mark.parametrize(
    ("name", "quant"),
    [("mixtral", "Q4_0"), ("qwen2moe", "Q8_0"), ("qwen3moe", "Q4_0"), ("granitemoe", "Q5_1")],
)
def test_quantized_experts_stay_quantized(name: str, quant: str, arch_dir: Path) -> None:
    """Stacked expert tensors in a quantized type load into MLX's quantized `SwitchGLU`
    layers (no float copy) and give the logits of the model holding the file's values."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    experts = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    arch = dataclasses.replace(ARCHITECTURES[name], quantized=dict.fromkeys(experts, quant))
    path, reference = write_tiny_arch_gguf(arch, arch_dir / f"tiny-{name}-{quant}.gguf")
    loaded = load_gguf(path)
    kinds = [type(m) for _, m in loaded.model.named_modules()]
    assert kinds.count(QuantizedSwitchLinear) == 3 * loaded.config["num_hidden_layers"]
    assert _max_error(loaded.model, reference) < 1e-4


@pytest.mark.parametrize("name", ["gpt-oss", "phi3-split", "qwen2moe", "smollm3", "gemma2"])
def test_store_round_trip(name: str, arch_dir: Path, tmp_path: Path) -> None:
    """The converted model saved in the model store (renamed, fixed-up weights and the
    config with the architecture's keys) loads back as the same model."""
    from mlxcel.engine.loading.store import ModelStore

    path, reference = write_tiny_arch_gguf(ARCHITECTURES[name], arch_dir / f"store-{name}.gguf")
    store = ModelStore(tmp_path / "store")
    first = load_gguf(path, store=store)
    second = load_gguf(path, store=store)
    assert not first.from_store and second.from_store
    assert second.config == first.config
    assert _max_error(second.model, reference) < 1e-4


def test_gpt_oss_with_mxfp4_experts(arch_dir: Path) -> None:
    """gpt-oss as published: MXFP4 experts (with gguf-py's encoder) load into MLX's own
    `mxfp4` mode, not as a float copy nor an affine approximation, with the logits of the
    same model holding the MXFP4 values; the store keeps them so."""
    from mlxcel.engine.loading.store import ModelStore

    path, reference = write_tiny_arch_gguf(_mxfp4_gpt_oss(), arch_dir / "tiny-gpt-oss-mxfp4.gguf")
    store = ModelStore(arch_dir / "mxfp4-store")
    for loaded in (load_gguf(path, store=store), load_gguf(path, store=store)):
        modules = [m for _, m in loaded.model.named_modules()]
        switches = [m for m in modules if type(m).__name__ == "QuantizedSwitchLinear"]
        assert len(switches) == 3 * loaded.config["num_hidden_layers"]
        for module in switches:
            assert module.mode == "mxfp4" and module.scales.dtype == mx.uint8
            assert "biases" not in module
        assert _max_error(loaded.model, reference) < 1e-4
        assert _greedy(loaded.model, PROMPT, 6) == _greedy(reference, PROMPT, 6)
    assert loaded.from_store


_LONG_FACTORS = [1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 12.0]  # 8 = half of head_dim 16
_SHORT_FACTORS = [1.0, 1.0, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0]


def _phi3_long_rope_keys(writer: Any, config: dict[str, Any], attn_factor: float) -> None:
    """Phi-3 128k as llama.cpp's converter writes it: the factors as two tensors, the
    original context length and the attention factor as metadata (no scaling type)."""
    ARCHITECTURES["phi3"].keys(writer, config)
    writer.add_rope_scaling_attn_factors(attn_factor)
    writer.add_tensor("rope_factors_long.weight", np.array(_LONG_FACTORS, np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(_SHORT_FACTORS, np.float32))


def _phi3_long_rope(attn_factor: float | None = None) -> Any:
    """The tiny phi3 with LongRoPE: trained for 8192 tokens from an original 2048."""
    scale = math.sqrt(1 + math.log(8192 / 2048) / math.log(2048))  # the converter's
    config = {
        "model_type": "phi3",
        "max_position_embeddings": 8192,
        "original_max_position_embeddings": 2048,
        "rope_scaling": {
            "type": "longrope",
            "long_factor": _LONG_FACTORS,
            "short_factor": _SHORT_FACTORS,
        },
    }
    return dataclasses.replace(
        ARCHITECTURES["phi3"],
        name="phi3-longrope",
        gguf_arch="phi3",
        config=config,
        keys=lambda w, c: _phi3_long_rope_keys(w, c, attn_factor or scale),
    )


def test_phi3_long_rope_factors_become_the_class_rope_scaling(
    arch_dir: Path, tmp_path: Path
) -> None:
    """A Phi-3 128k file's `rope_factors_long/short` tensors and lengths give mlx-lm's
    `SuScaledRoPE` the float-weights model has: its logits and greedy tokens, from the
    file and from the store; the same weights without the factors give other logits."""
    from mlx_lm.models.rope_utils import SuScaledRoPE

    from mlxcel.engine.loading.store import ModelStore

    path, reference = write_tiny_arch_gguf(_phi3_long_rope(), arch_dir / "tiny-phi3-long.gguf")
    store = ModelStore(tmp_path / "store")
    for loaded in (load_gguf(path, store=store), load_gguf(path, store=store)):
        assert isinstance(loaded.model.layers[0].self_attn.rope, SuScaledRoPE)
        scaling = loaded.config["rope_scaling"]
        assert scaling["long_factor"] == _LONG_FACTORS
        assert scaling["short_factor"] == pytest.approx(_SHORT_FACTORS)
        assert loaded.config["max_position_embeddings"] == 8192
        assert loaded.config["original_max_position_embeddings"] == 2048
        assert _max_error(loaded.model, reference) < 1e-4
        assert _greedy(loaded.model, PROMPT, 6) == _greedy(reference, PROMPT, 6)
    assert loaded.from_store
    for layer in loaded.model.layers:
        layer.self_attn.rope = nn.RoPE(16, traditional=False, base=10000.0)
    assert _max_error(loaded.model, reference) > 1e-2


@pytest.mark.parametrize("name", ["gpt-oss", "mistral3", "phi3-longrope"])
def test_a_model_with_precomputed_rope_runs_on_another_thread(name: str, arch_dir: Path) -> None:
    """YaRN and LongRoPE keep their frequencies outside the parameters: loaded, the model
    runs on a thread other than the loading one (as the engine runs it) with the reference
    logits; MLX 0.32 refused a graph built on the loading thread there."""
    arch = _phi3_long_rope() if name == "phi3-longrope" else ARCHITECTURES[name]
    path, reference = write_tiny_arch_gguf(arch, arch_dir / f"thread-{name}.gguf")
    loaded = load_gguf(path)
    inputs = mx.array([PROMPT])
    want = np.array(reference(inputs))  # the reference's own RoPE: on this thread
    got = on_another_thread(lambda: np.array(loaded.model(inputs)))
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def _with_phi3_long_rope(writer: Any, config: dict[str, Any]) -> None:
    _phi3_long_rope_keys(writer, config, 1.5)


def _mistral3_with_experts(writer: Any, config: dict[str, Any]) -> None:
    ARCHITECTURES["mistral3"].keys(writer, config)
    writer.add_expert_count(4)


def _without_expert_count(writer: Any, config: dict[str, Any]) -> None:
    writer.add_uint32("qwen3moe.expert_used_count", config["num_experts_per_tok"])
    writer.add_key_length(config["head_dim"])


@pytest.mark.parametrize(
    ("name", "keys", "message"),
    [
        (
            "phi3",
            _with_phi3_long_rope,
            "phi3 LongRoPE attention factor 1.5 is not the 1 that mlx-lm's class "
            "derives from the context lengths 2048 and 2048",
        ),
        ("qwen3moe", _without_expert_count, "GGUF metadata qwen3moe.expert_count is missing"),
        ("mistral3", _mistral3_with_experts, "mistral3 with experts is not supported"),
    ],
)
def test_a_file_the_class_cannot_take_is_one_line(
    name: str, keys: Callable[[Any, dict[str, Any]], None], message: str, arch_dir: Path
) -> None:
    """What an architecture's mapping cannot read (a Phi-3 LongRoPE attention factor other
    than mlx-lm's, a MoE file without its expert count) is one line and exit 2 on
    `mlxcel generate`."""
    arch = dataclasses.replace(ARCHITECTURES[name], keys=keys)
    path, _ = write_tiny_arch_gguf(arch, arch_dir / f"refused-{name}.gguf")
    out = subprocess.run(
        [sys.executable, "-m", "mlxcel", "generate", "-m", str(path), "-n", "1", "hi"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("mlxcel: error: ") and message in line


def test_llama_with_experts_is_mixtral() -> None:
    assert find_architecture("llama").model_type == "llama"
    assert find_architecture("llama", {"llama.expert_count": 8}).model_type == "mixtral"
    assert find_architecture("llama", {"llama.expert_count": 0}).model_type == "llama"


def test_supported_architectures() -> None:
    assert set(SUPPORTED_ARCHITECTURES) >= {
        "llama",
        "qwen2",
        "qwen3",
        "gemma3",
        "gemma2",
        "phi3",
        "qwen2moe",
        "qwen3moe",
        "olmo2",
        "granite",
        "granitemoe",
        "smollm3",
        "gpt-oss",
    }
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'rwkv7'; supported: "):
        find_architecture("rwkv7")


# ------------------------------------------------------------ end to end, a MoE architecture


@pytest.fixture(scope="module")
def tiny_moe(arch_dir: Path) -> tuple[Path, object]:
    """The tiny qwen3moe file and its reference mlx-lm model."""
    return write_tiny_arch_gguf(ARCHITECTURES["qwen3moe"], arch_dir / "tiny-qwen3moe-e2e.gguf")


def test_generate_cli_runs_a_moe_gguf(tiny_moe: tuple[Path, object]) -> None:
    """`mlxcel generate -m tiny.gguf`: the greedy text of the reference model."""
    _generate_cli_matches(*tiny_moe)


def _mxfp4_gpt_oss() -> Any:
    experts = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    return dataclasses.replace(ARCHITECTURES["gpt-oss"], quantized=dict.fromkeys(experts, "MXFP4"))


@pytest.mark.parametrize("name", ["gpt-oss-mxfp4", "mistral3", "phi3-longrope"])
def test_generate_cli_runs_yarn_and_long_rope_ggufs(name: str, arch_dir: Path) -> None:
    """`mlxcel generate` (the engine on its own thread, the CPU kernel on) on gpt-oss with
    MXFP4 experts, Ministral 3 and Phi-3 LongRoPE: the reference model's greedy text."""
    arch = {
        "gpt-oss-mxfp4": _mxfp4_gpt_oss,
        "mistral3": lambda: ARCHITECTURES["mistral3"],
        "phi3-longrope": _phi3_long_rope,
    }[name]()
    _generate_cli_matches(*write_tiny_arch_gguf(arch, arch_dir / f"cli-{name}.gguf"))


def _generate_cli_matches(path: Path, reference: object) -> None:
    tokenizer = load_gguf(path).tokenizer
    prompt = "The cat sat on the mat"
    want = tokenizer.decode(_greedy(reference, tokenizer.encode(prompt), 5))
    assert greedy_cli_text(path, prompt, 5) == want


def test_serve_chat_round_trip_moe(tiny_moe: tuple[Path, object]) -> None:
    """`mlxcel serve -m tiny-qwen3moe.gguf`: a chat completion answers the reference model's
    greedy reply to the file's chat template, and /props names the architecture."""
    path, reference = tiny_moe
    tokenizer = load_gguf(path).tokenizer
    messages = [{"role": "user", "content": "Where is Paris?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    want = tokenizer.decode(_greedy(reference, list(ids), 4), skip_special_tokens=True)
    with ServeProcess(["-m", str(path), "-np", "1", "-c", "512"]) as server:
        body = {"messages": messages, "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        reply = answer.json()
        assert reply["usage"]["completion_tokens"] == 4
        assert reply["choices"][0]["message"]["content"] == want
        props = httpx.get(f"{server.url}/props", timeout=30).json()
        assert props["model_architecture"] == "qwen3moe"
