#!/usr/bin/env bash
# Build the separate virtual environment in which `hpsray bench peers` runs its TorchRec peer
# (benchmarks/torchrec_peer.py). TorchRec lives apart from hpsray's own environment because its
# kernels (FBGEMM) are built against one exact torch release.
#
#   bash benchmarks/torchrec_env.sh            # -> benchmarks/.torchrec-venv
#   TORCHREC_VENV=/path bash benchmarks/torchrec_env.sh
#
# What it installs, and why:
#   * torch ${TORCH_VERSION}+cpu — a CPU-only build. PyPI's Linux x86-64 torch wheels are CUDA
#     builds whose dependencies (nvidia-*) weigh several GB, and PyPI has no "+cpu" wheel; the
#     local version label makes pip fail fast instead of pulling CUDA. The wheel comes from pip's
#     find-links / extra indexes (the development machines carry torch 2.13.0+cpu) or from
#     TORCH_INDEX_URL (e.g. PyTorch's CPU wheel index, where reachable).
#   * fbgemm-gpu-cpu ${FBGEMM_VERSION} with --no-deps — torchrec depends on `fbgemm-gpu`, the CUDA
#     build, which fails to load without NVIDIA libraries; the CPU build provides the same
#     `fbgemm_gpu` module. FBGEMM 1.8 is built against torch 2.13, 1.9 against torch 2.14.
#   * torchrec ${TORCHREC_VERSION} with --no-deps, then its pure-Python dependencies under a
#     constraint that pins torch, so nothing can replace the CPU build.
#   * hpsray itself (editable, --no-deps) plus numpy, numba and pyarrow: the peer imports
#     hpsray's data generator, model and metrics so that it trains exactly the same thing.
#
# Defaults: torch 2.13.0, fbgemm-gpu-cpu 1.8.0, torchrec 1.8.0 (the newest trio whose torch has a
# CPU wheel here). torchrec 1.9.2 needs torch 2.14 with fbgemm-gpu-cpu 1.9.0: set TORCH_VERSION=2.14.1
# FBGEMM_VERSION=1.9.0 TORCHREC_VERSION=1.9.2 where a torch 2.14 CPU wheel is reachable.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
VENV="${TORCHREC_VENV:-$HERE/.torchrec-venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
FBGEMM_VERSION="${FBGEMM_VERSION:-1.8.0}"
TORCHREC_VERSION="${TORCHREC_VERSION:-1.8.0}"

say() { echo "[torchrec_env] $*" >&2; }

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import torchrec, fbgemm_gpu, hpsray" 2>/dev/null; then
    say "$VENV already works (torchrec $("$VENV/bin/python" -c 'import torchrec; print(torchrec.__version__)' 2>/dev/null || echo '?')); remove it to rebuild"
    exit 0
fi

say "creating $VENV with $($PYTHON --version 2>&1)"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install --quiet --upgrade pip

CONSTRAINTS="$VENV/constraints.txt"
echo "torch==${TORCH_VERSION}+cpu" > "$CONSTRAINTS"

say "torch ${TORCH_VERSION}+cpu (CPU-only build; never the CUDA wheel)"
torch_index=()
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then torch_index=(--extra-index-url "$TORCH_INDEX_URL"); fi
if ! "${PIP[@]}" install --no-deps "${torch_index[@]}" "torch==${TORCH_VERSION}+cpu"; then
    say "FAILED: no CPU wheel of torch ${TORCH_VERSION} is reachable."
    say "PyPI only has the CUDA build of torch for Linux x86-64 (it pulls several GB of nvidia-* wheels);"
    say "set TORCH_INDEX_URL to an index with '+cpu' wheels, or TORCH_VERSION to one that is at hand."
    rm -rf "$VENV"
    exit 1
fi

say "fbgemm-gpu-cpu ${FBGEMM_VERSION} and torchrec ${TORCHREC_VERSION} (--no-deps: torchrec names the CUDA fbgemm-gpu)"
"${PIP[@]}" install --no-deps "fbgemm-gpu-cpu==${FBGEMM_VERSION}" "torchrec==${TORCHREC_VERSION}"

say "their Python dependencies, torch pinned by $CONSTRAINTS"
"${PIP[@]}" install -c "$CONSTRAINTS" \
    filelock typing-extensions sympy networkx jinja2 fsspec \
    tensordict "torchmetrics==1.0.3" tqdm pyre-extensions \
    "numpy>=1.26" "numba>=0.60" "pyarrow>=15" psutil

say "hpsray (editable, --no-deps) for the shared data generator, model and metrics"
"${PIP[@]}" install --no-deps --no-build-isolation -e "$REPO" \
    || "${PIP[@]}" install --no-deps -e "$REPO"

say "checking the import and one CPU embedding lookup"
"$VENV/bin/python" - <<'EOF'
import torch, fbgemm_gpu, torchrec
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])])
kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
assert ebc(kjt)["f"].shape == (2, 4)
import hpsray.data
print(f"torch {torch.__version__}, torchrec {torchrec.__version__}, fbgemm_gpu {getattr(fbgemm_gpu, '__version__', '?')}: ok")
EOF
say "done: $VENV"
