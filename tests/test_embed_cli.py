"""`mlxcel embed` and `mlxcel rerank` through Typer's CliRunner on the command functions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import typer
from fixtures.tiny_encoders import build_tiny_bert, build_tiny_cross_encoder
from mlxcel.commands import embed, rerank
from typer.testing import CliRunner

FOOD = "A man is eating food."
BREAD = "A man is eating a piece of bread."

app = typer.Typer()
app.command("embed")(embed.embed)
app.command("rerank")(rerank.rerank)
runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_bert(tmp_path_factory.mktemp("cli") / "bert"))


@pytest.fixture(scope="module")
def cross(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_cross_encoder(tmp_path_factory.mktemp("cli") / "ce"))


def run(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args), input=stdin)
    return result.exit_code, result.stdout, result.stderr


def assert_fails(args: list[str], needle: str) -> None:
    code, _, err = run(*args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxcel: error: "), err
    assert needle in lines[0]


# --------------------------------------------------------------------------- embed


def test_embed_default_model_table_shows_dimension_and_cosine() -> None:
    code, out, _ = run("embed", FOOD, BREAD)
    assert code == 0
    assert "all-MiniLM-L6-v2" in out and "dimension 384" in out and "pooling mean" in out
    assert "cosine(0, 1) = 0.755" in out
    assert "A man is eating food." in out


def test_embed_json(tiny: str) -> None:
    code, out, _ = run("embed", "-m", tiny, "a cat", "the dog eats", "--json")
    assert code == 0
    payload = json.loads(out)
    assert payload["dimension"] == 16 and payload["pooling"] == "mean"
    assert [d["text"] for d in payload["data"]] == ["a cat", "the dog eats"]
    assert [d["tokens"] for d in payload["data"]] == [4, 5]
    for item in payload["data"]:
        assert np.isclose(np.linalg.norm(item["embedding"]), 1.0, atol=1e-5)


def test_embed_pooling_normalize_and_dimensions(tiny: str) -> None:
    _, out, _ = run("embed", "-m", tiny, "a cat", "--json", "--normalize", "-1")
    raw = np.array(json.loads(out)["data"][0]["embedding"])
    assert not np.isclose(np.linalg.norm(raw), 1.0, atol=1e-3)
    _, out, _ = run("embed", "-m", tiny, "a cat", "--json", "--pooling", "cls")
    cls = json.loads(out)
    assert cls["pooling"] == "cls"
    assert not np.allclose(cls["data"][0]["embedding"], raw / np.linalg.norm(raw))
    _, out, _ = run("embed", "-m", tiny, "a cat", "--json", "--dimensions", "4")
    assert len(json.loads(out)["data"][0]["embedding"]) == 4


def test_embed_npy(tiny: str, tmp_path: Path) -> None:
    target = tmp_path / "out.npy"
    code, out, err = run("embed", "-m", tiny, "a cat", "a dog", "one", "--npy", str(target))
    assert code == 0 and out == ""
    matrix = np.load(target)
    assert matrix.shape == (3, 16) and matrix.dtype == np.float32
    assert "wrote 3×16 float32" in err


def test_embed_reads_file_and_stdin(tiny: str, tmp_path: Path) -> None:
    texts = tmp_path / "texts.txt"
    texts.write_text("a cat\n\nthe dog eats\n", encoding="utf-8")
    code, out, _ = run("embed", "-m", tiny, "one", "--file", str(texts), "--json")
    assert code == 0
    assert [d["text"] for d in json.loads(out)["data"]] == ["one", "a cat", "the dog eats"]
    code, out, _ = run("embed", "-m", tiny, "-", "--json", stdin="red\nblue green\n")
    assert code == 0
    assert [d["text"] for d in json.loads(out)["data"]] == ["red", "blue green"]


def test_embed_truncation(tiny: str) -> None:
    long = "cat " * 40
    code, out, _ = run("embed", "-m", tiny, long, "--json")
    assert code == 0
    item = json.loads(out)["data"][0]
    assert item["truncated"] is True and item["tokens"] == 24
    assert_fails(["embed", "-m", tiny, long, "--no-truncate"], "42 tokens")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["embed"], "no text given"),
        (["embed", "x", "--json", "--npy", "o.npy"], "cannot be used together"),
        (["embed", "x", "--pooling", "max"], "--pooling must be"),
        (["embed", "x", "--normalize", "-2"], "--normalize must be"),
        (["embed", "x", "-m", "/no/such/model"], "no such file or directory"),
        (["embed", "x", "--file", "/no/such/file.txt"], "cannot read /no/such/file.txt"),
    ],
)
def test_embed_errors(args: list[str], needle: str) -> None:
    assert_fails(args, needle)


def test_embed_dimension_error(tiny: str) -> None:
    assert_fails(["embed", "-m", tiny, "x", "--dimensions", "99"], "between 1 and 16")


# --------------------------------------------------------------------------- rerank


def test_rerank_default_model_ranks_honestly() -> None:
    docs = ["Stock markets fell sharply on Monday.", "Cats enjoy eating fish and chicken."]
    code, out, _ = run("rerank", "-q", "What food do cats like?", *docs, "--json")
    assert code == 0
    payload = json.loads(out)
    assert payload["kind"] == "bi-encoder"
    assert [r["index"] for r in payload["results"]] == [1, 0]
    assert payload["results"][0]["document"] == docs[1]


def test_rerank_table_and_top_n(cross: str) -> None:
    docs = ["the cat eats fish", "stock market fell today", "a dog"]
    code, out, _ = run("rerank", "-m", cross, "-q", "cat food", *docs, "--json")
    assert code == 0
    ranked = json.loads(out)["results"]
    scores = [r["score"] for r in ranked]
    assert scores == sorted(scores, reverse=True) and len(ranked) == 3
    code, out, _ = run("rerank", "-m", cross, "-q", "cat food", *docs, "--top-n", "1")
    assert code == 0
    assert "cross-encoder" in out
    best = docs[ranked[0]["index"]]
    assert best in out and all(d not in out for d in docs if d != best)


def test_rerank_reads_a_file(cross: str, tmp_path: Path) -> None:
    docs = tmp_path / "docs.txt"
    docs.write_text("a dog\nthe cat eats fish\n", encoding="utf-8")
    code, out, _ = run("rerank", "-m", cross, "-q", "cat", "--file", str(docs), "--json")
    assert code == 0
    assert sorted(r["document"] for r in json.loads(out)["results"]) == [
        "a dog",
        "the cat eats fish",
    ]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["rerank", "-q", "q"], "no documents given"),
        (["rerank", "-q", "", "doc"], "query is empty"),
        (["rerank", "-q", "q", "doc", "--top-n", "0"], "--top-n must be at least 1"),
        (["rerank", "-q", "q", "doc", "-m", "/no/such/model"], "no such file or directory"),
    ],
)
def test_rerank_errors(args: list[str], needle: str) -> None:
    assert_fails(args, needle)
