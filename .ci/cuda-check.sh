#!/usr/bin/env bash
# CI: compile-check the GPU code (`--features cuda,nccl` with cuDNN, then without it, then
# `cuda,nccl,mpi` for the NCCL path of MultiWorkerMirroredStrategy) on a
# machine with no GPU and no driver, so that it cannot rot. Needs crates.io and PyPI (for the
# CUDA 13.0 toolchain wheels), and for the last check Open MPI (`libopenmpi-dev`) and
# `libclang-dev`, which .ci/run installs before it runs this script.
#
# Usage: .ci/cuda-check.sh
#   KANDLE_CUDA_VENV   where the toolchain venv lives (default ~/.cache/kandle-cuda13). Keep it,
#                      and the target dir below, cached between CI runs: a cold check spends most
#                      of its time in nvcc compiling candle's kernels.
#   CUDA_COMPUTE_CAP   compute capability the kernels are compiled for (default 80)
#   CUDA_CHECK_MPI     set to 0 to skip the `cuda,nccl,mpi` check on a machine without Open MPI
#   CUDA_CHECK_NVCC_FLAGS  extra nvcc flags, default '-Xcicc -O1 -Xptxas -O0': the kernels are
#                      only compiled, never run, and little device optimisation makes nvcc about
#                      3 times faster. Set it to '' to compile them as a release build would.
#
# The check builds in its own target dir, `cuda-check` under CARGO_TARGET_DIR (or ./target),
# because cargo does not track NVCC_APPEND_FLAGS: kernels compiled for this check must never be
# reused by a real `cargo build --features cuda`.
#
# `cargo clippy` is `cargo check` plus lints: it runs build scripts (so nvcc compiles candle's
# kernels) but links nothing, so it needs neither libcuda nor the stub, nor cuDNN (cudarc's
# bindings are pre-generated; only linking a binary needs libcudnn.so, which gpu/build.sh
# installs). Tests and examples are checked too (`--all-targets`), and warnings fail the check,
# as in .ci/run: an unused import behind `#[cfg(feature = "nccl")]` is rot that only this build
# sees.
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

# kandle's own CUDA C modules, which NVRTC compiles at run time on the GPU machine: each is its
# `.cu` file after the shared `common.cuh`, as `kernels/src/cuda/program.rs` hands it to NVRTC,
# compiled to PTX here so that a syntax or type error fails CI, not a rare GPU session.
echo "== kandle's CUDA C modules (nvcc --ptx)"
ptx_dir=$(mktemp -d)
for cu in kernels/src/cuda/*.cu; do
  module=$(basename "$cu" .cu)
  cat kernels/src/cuda/common.cuh "$cu" >"$ptx_dir/$module.cu"
  nvcc --ptx -arch=compute_75 -o "$ptx_dir/$module.ptx" "$ptx_dir/$module.cu"
  echo "   $module: $(grep -c '^.visible .entry' "$ptx_dir/$module.ptx") kernels"
done
rm -rf "$ptx_dir"
elapsed

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}/cuda-check"
export NVCC_APPEND_FLAGS="${CUDA_CHECK_NVCC_FLAGS--Xcicc -O1 -Xptxas -O0}"
# One build of everything with cuDNN too (`cudnn` adds code and removes none), then the same
# crates without cuDNN (kandle-kernels' and kandle's code differs there), with kandle-kernels'
# CUDA tests (`test-support`). The second build selects the same packages as the first, so the
# shared dependencies keep their features and only cudarc, candle and kandle's crates are
# checked again (a build of kandle-kernels alone unified its dependencies' features otherwise
# and rebuilt them, candle's kernels through nvcc included: 5 min of a fresh clone's check).
echo "== cargo clippy --features cuda,nccl,kandle/cudnn (target dir $CARGO_TARGET_DIR, NVCC_APPEND_FLAGS='$NVCC_APPEND_FLAGS')"
cargo clippy --locked --all-targets -p kandle -p kandle-kernels -p kandle-strategies \
  -p kandle-examples --features cuda,nccl,kandle/cudnn -- -D warnings
elapsed

echo "== cargo clippy --features cuda,nccl,kandle-kernels/test-support (without cuDNN)"
cargo clippy --locked --all-targets -p kandle -p kandle-kernels -p kandle-strategies \
  -p kandle-examples --features cuda,nccl,kandle-kernels/test-support -- -D warnings
elapsed

if [[ "${CUDA_CHECK_MPI:-1}" != 0 ]]; then
  if ! command -v mpicc >/dev/null; then
    echo "cuda-check: mpicc not found: install openmpi-bin, libopenmpi-dev and libclang-dev" \
      "(.ci/run does), or set CUDA_CHECK_MPI=0 to skip the cuda,nccl,mpi check" >&2
    exit 1
  fi
  echo "== cargo clippy --features cuda,nccl,mpi (NCCL across workers)"
  # The packages and features of the check before it, plus MPI: only the crates MPI changes are
  # checked again.
  cargo clippy --locked --all-targets -p kandle -p kandle-kernels -p kandle-strategies \
    -p kandle-examples --features cuda,nccl,kandle-kernels/test-support,mpi -- -D warnings
fi
echo "== cuda check passed in $((SECONDS - t0)) s"
