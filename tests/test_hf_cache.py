"""Hugging Face cache resolution (offline, on a fake cache) and the model-code safety checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlxcel.engine.errors import ModelLoadError
from mlxcel.engine.loading.hf_cache import (
    MODEL_FILE_PATTERNS,
    ModelNotFoundError,
    delete_hf_repo,
    list_hf_cache,
    looks_like_repo_id,
    resolve_hf_repo,
)
from mlxcel.engine.loading.safety import (
    UnsafeModelError,
    check_loader_kwargs,
    check_model_dir,
    model_label,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face hub cache in tmp, offline."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def add_repo(
    cache: Path,
    repo_id: str,
    files: dict[str, str],
    *,
    commit: str = COMMIT,
    ref: str | None = "main",
) -> Path:
    """Lay out a repo as huggingface_hub does: blobs, a snapshot of links, a ref."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, text in files.items():
        blob = repo / "blobs" / f"{commit[:8]}-{name}"
        blob.write_text(text)
        (snapshot / name).symlink_to(blob)
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


MODEL_FILES = {"config.json": '{"model_type": "llama"}', "model.safetensors": "w" * 100}


def test_looks_like_repo_id() -> None:
    for ref in (
        "mlx-community/Qwen3-0.6B-4bit",
        "org/Qwen2.5-7B",
        "a/b",
        "HuggingFaceTB/SmolLM2_1",
    ):
        assert looks_like_repo_id(ref), ref
    for ref in (
        "model.gguf",
        "justname",
        "./org/name",
        "/abs/path",
        "~/models/x",
        "a/b/c",
        "org/model.gguf",
        "org--x/name",
        "org/na..me",
        "org/-name",
        "",
    ):
        assert not looks_like_repo_id(ref), ref


def test_resolves_a_cached_repo_offline(hf_cache: Path) -> None:
    snapshot = add_repo(hf_cache, "org/tiny", MODEL_FILES)
    path = resolve_hf_repo("org/tiny")
    assert path == snapshot
    assert json.loads((path / "config.json").read_text()) == {"model_type": "llama"}
    # A commit hash resolves to its own snapshot, without a ref.
    old = add_repo(hf_cache, "org/tiny", MODEL_FILES, commit=OLD_COMMIT, ref=None)
    assert resolve_hf_repo("org/tiny", revision=OLD_COMMIT) == old
    assert resolve_hf_repo("org/tiny") == snapshot


def test_resolves_sharded_weights(hf_cache: Path) -> None:
    index = {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}
    files = {
        "config.json": "{}",
        "model.safetensors.index.json": json.dumps(index),
        "model-1.safetensors": "1",
    }
    add_repo(hf_cache, "org/sharded", files)
    with pytest.raises(ModelNotFoundError, match="only partly .*model-2.safetensors"):
        resolve_hf_repo("org/sharded")


def test_offline_error_when_not_cached(hf_cache: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_hf_repo("org/missing")
    message = str(info.value)
    assert "\n" not in message
    assert "org/missing is not in the Hugging Face cache" in message
    assert "HF_HUB_OFFLINE" in message and "hf download org/missing" in message
    assert isinstance(info.value, ModelLoadError) and isinstance(info.value, ValueError)


def test_explicit_no_download_and_partial_snapshot(
    hf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    add_repo(hf_cache, "org/partial", {"config.json": "{}"})
    with pytest.raises(ModelNotFoundError, match=r"only partly .*\*\.safetensors weights"):
        resolve_hf_repo("org/partial", allow_download=False)
    with pytest.raises(ModelNotFoundError, match="downloads are off"):
        resolve_hf_repo("org/absent", allow_download=False)
    with pytest.raises(ModelNotFoundError, match="not a Hugging Face repo id"):
        resolve_hf_repo("not-a-repo")


def test_interrupted_download_is_not_used_offline(
    hf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hub's own listing says the snapshot is incomplete: not used, even with the files."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    snapshot = add_repo(hf_cache, "org/cut", MODEL_FILES)

    def incomplete(repo_id: str, **kwargs: Any) -> str:
        error: Any = LocalEntryNotFoundError("1 file(s) are missing (tokenizer.json)")
        error.snapshot_path = str(snapshot)  # as IncompleteSnapshotError has it
        raise error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", incomplete)
    with pytest.raises(ModelNotFoundError, match="only partly .*interrupted download"):
        resolve_hf_repo("org/cut")


def test_download_when_allowed(hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The download branch: only model files are asked for, through our rich progress bar."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    calls: list[dict[str, Any]] = []

    def fake_snapshot_download(repo_id: str, **kwargs: Any) -> str:
        calls.append(kwargs)
        if kwargs.get("local_files_only"):
            raise LocalEntryNotFoundError("not cached")
        snapshot = add_repo(Path(kwargs["cache_dir"]), repo_id, MODEL_FILES)
        bar = kwargs["tqdm_class"](desc="Fetching 2 files", total=2)
        bytes_bar = kwargs["tqdm_class"](desc="Downloading", total=0, unit="B", unit_scale=True)
        bytes_bar.total = 2048
        bytes_bar.update(2048)
        bar.update(2)
        bytes_bar.close()
        bar.close()
        assert bar.n == 2 and bytes_bar.n == 2048
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    path = resolve_hf_repo("org/remote")
    assert (path / "model.safetensors").is_file()
    assert [c.get("local_files_only", False) for c in calls] == [True, False]
    assert calls[1]["allow_patterns"] == list(MODEL_FILE_PATTERNS)
    assert calls[1]["cache_dir"] == str(hf_cache)


def test_download_errors_are_one_line(hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")

    def failing(repo_id: str, **kwargs: Any) -> str:
        if kwargs.get("local_files_only"):
            raise LocalEntryNotFoundError("not cached")
        raise OSError("network unreachable\nmore detail")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_hf_repo("org/remote")
    assert str(info.value) == "could not download org/remote: network unreachable"


def test_list_and_delete(hf_cache: Path) -> None:
    assert list_hf_cache() == []
    b = add_repo(hf_cache, "org/b-model", MODEL_FILES)
    a = add_repo(hf_cache, "Org/a-model", {"config.json": "{}"}, commit=OLD_COMMIT)
    c = add_repo(hf_cache, "org/c-model", {"config.json": "{}"}, commit=OLD_COMMIT)
    repos = list_hf_cache()
    assert [(r.repo_id, r.path) for r in repos] == [
        ("Org/a-model", a),
        ("org/b-model", b),
        ("org/c-model", c),
    ]
    assert repos[1].size_bytes == sum(len(v) for v in MODEL_FILES.values())

    assert delete_hf_repo("org/b-model") == repos[1].size_bytes
    assert [r.repo_id for r in list_hf_cache()] == ["Org/a-model", "org/c-model"]
    assert not (hf_cache / "models--org--b-model").exists()
    with pytest.raises(ModelNotFoundError):
        delete_hf_repo("org/b-model")
    # Two repos holding the same commit: deleting one leaves the other whole.
    assert delete_hf_repo("org/c-model") == 2
    assert [(r.repo_id, r.path) for r in list_hf_cache()] == [("Org/a-model", a)]
    assert (a / "config.json").read_text() == "{}"


def test_list_without_a_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "nowhere"))
    assert list_hf_cache() == []


# --- safety ------------------------------------------------------------------------------


def write_model(path: Path, config: dict[str, Any], **extra: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    for name, text in extra.items():
        (path / name).write_text(text)
    return path


def test_plain_model_passes(tmp_path: Path) -> None:
    model = write_model(
        tmp_path / "m",
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "text_config": {"a": 1}},
        **{"convert.py": "print('unused helper script')", "tokenizer_config.json": "{}"},
    )
    check_model_dir(model)


def test_auto_map_is_refused(tmp_path: Path) -> None:
    config = {"auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}
    model = write_model(tmp_path / "custom", config)
    with pytest.raises(UnsafeModelError) as info:
        check_model_dir(model)
    assert str(info.value) == (
        "model custom needs custom code (auto_map in config.json); "
        "mlxcel never runs code shipped with a model"
    )
    assert isinstance(info.value, ValueError)


def test_other_code_requests_are_refused(tmp_path: Path) -> None:
    tok = write_model(
        tmp_path / "tok",
        {"model_type": "llama"},
        **{"tokenizer_config.json": json.dumps({"auto_map": {"AutoTokenizer": ["t.T", None]}})},
    )
    with pytest.raises(UnsafeModelError, match="auto_map in tokenizer_config.json"):
        check_model_dir(tok)
    trusted = write_model(tmp_path / "trust", {"trust_remote_code": True})
    with pytest.raises(UnsafeModelError, match="trust_remote_code in config.json"):
        check_model_dir(trusted)
    referenced = write_model(
        tmp_path / "ref", {"architectures": ["modeling_mine.MyModel"]}, **{"modeling_mine.py": ""}
    )
    with pytest.raises(UnsafeModelError, match="modeling_mine.MyModel"):
        check_model_dir(referenced)
    py_name = write_model(tmp_path / "py", {"model_file": "my_model.py"})
    with pytest.raises(UnsafeModelError, match="my_model.py"):
        check_model_dir(py_name)


def test_snapshot_label(tmp_path: Path) -> None:
    snapshot = tmp_path / "models--org--name" / "snapshots" / COMMIT
    assert model_label(snapshot) == "org/name"
    write_model(snapshot, {"auto_map": {"AutoConfig": "c.C"}})
    with pytest.raises(UnsafeModelError, match="^model org/name needs custom code"):
        check_model_dir(snapshot)


def test_loader_kwargs() -> None:
    check_loader_kwargs({"trust_remote_code": False, "lazy": True, "model_file": None})
    with pytest.raises(UnsafeModelError, match="trust_remote_code=True is refused"):
        check_loader_kwargs({"trust_remote_code": True})
    with pytest.raises(UnsafeModelError, match="trust_remote_code"):
        check_loader_kwargs({"tokenizer_config": {"trust_remote_code": True}})
    with pytest.raises(UnsafeModelError, match="model_file"):
        check_loader_kwargs({"model_config": {"model_file": "x.py"}})
