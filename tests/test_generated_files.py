"""Files generated from the code (completions, the flag table doc) must match the code."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _generated() -> dict[Path, str]:
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    files: dict[Path, str] = module.generated()
    return files


def test_generated_files_are_up_to_date() -> None:
    stale = [
        str(path.relative_to(ROOT))
        for path, content in _generated().items()
        if not path.exists() or path.read_text() != content
    ]
    assert not stale, f"run `.venv/bin/python scripts/gen_docs.py` to refresh: {stale}"


def test_completions_list_every_subcommand() -> None:
    from mlxcel.completion import command_specs

    root = next(s for s in command_specs() if s.path == ())
    for name in ("generate", "tokenize", "cache", "serve"):
        assert name in root.subcommands
    serve = next(s for s in command_specs() if s.path == ("serve",))
    for option in ("-ngl", "--ctx-size", "-np", "--api-key", "--no-cache-prompt"):
        assert option in serve.options


def test_bash_completion_completes_subcommands_and_options() -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    script = ROOT / "completions" / "mlxcel.bash"
    probe = (
        f"source {script}; COMP_WORDS=(mlxcel cache l); COMP_CWORD=2; _mlxcel; "
        'echo "${COMPREPLY[@]}"; COMP_WORDS=(mlxcel generate --te); COMP_CWORD=2; _mlxcel; '
        'echo "${COMPREPLY[@]}"'
    )
    out = subprocess.run([bash, "-c", probe], capture_output=True, text=True, check=True)
    first, second = out.stdout.splitlines()
    assert first.split() == ["list"]
    assert "--temp" in second.split()
