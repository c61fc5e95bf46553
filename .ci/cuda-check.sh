#!/usr/bin/env bash
# CI: compile-check the GPU code (`--features cuda,nccl`) on a machine with no GPU and no driver,
# so that it cannot rot. Needs only crates.io and PyPI (for the CUDA 13.0 toolchain wheels).
#
# Usage: .ci/cuda-check.sh
#   KANDLE_CUDA_VENV   where the toolchain venv lives (default ~/.cache/kandle-cuda13; keep it
#                      cached between CI runs, and the cargo target dir too: a cold check spends
#                      most of its time in nvcc compiling candle's kernels)
#   CUDA_COMPUTE_CAP   compute capability the kernels are compiled for (default 80)
#
# `cargo clippy` is `cargo check` plus lints: it runs build scripts (so nvcc compiles candle's
# kernels) but links nothing, so it needs neither libcuda nor the stub. Tests and examples are
# checked too (`--all-targets`), and warnings fail the check, as in .ci/run: an unused import
# behind `#[cfg(feature = "nccl")]` is rot that only this build sees.
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TERM_COLOR=never
VENV=${KANDLE_CUDA_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kandle-cuda13}
t0=$SECONDS
elapsed() { echo "   ($((SECONDS - t0)) s so far)"; }

echo "== cargo fetch"
cargo fetch --locked
elapsed

echo "== CUDA 13.0 toolchain in $VENV"
bash .ci/setup-cuda.sh "$VENV"
# shellcheck source=/dev/null
source "$VENV/env.sh"
nvcc --version | tail -n 2
echo "   CUDA_HOME=$CUDA_HOME CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP CUDARC_CUDA_VERSION=$CUDARC_CUDA_VERSION"
elapsed

echo "== cargo clippy --features cuda,nccl"
cargo clippy --locked --all-targets -p kandle -p kandle-strategies -p kandle-examples \
  --features cuda,nccl -- -D warnings
echo "== cuda check passed in $((SECONDS - t0)) s"
