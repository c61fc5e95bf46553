#!/usr/bin/env bash
# Builds, on a machine without a GPU, everything `gpu/check.sh` runs on a GPU machine, and packs
# it into gpu-bin/ (xz, about 30 MiB in all) to be carried there with the working tree.
#
# Usage: bash gpu/build.sh            (from anywhere; about 40 minutes cold on 2 cores, most of it
#                                      nvcc compiling candle's kernels, then a few per change)
#   CUDA_COMPUTE_CAP   default 90: sm_90a, for the H100 and H200 only
#   KANDLE_CUDA_VENV   the CUDA 13.0 toolchain venv (default ~/.cache/kandle-cuda13)
#   KANDLE_GPU_CUDNN   0 skips the cudnn builds (another compilation of candle's kernels)
#
# What it builds, with the CUDA 13.0 toolchain of .ci/setup-cuda.sh (the sonames the GPU machine's
# PyTorch brings) plus cuDNN 9 to link against:
#   - kandle-lib: kandle's unit tests with `cuda` (the layers on CUDA against the CPU);
#   - strategies-gpu: kandle-strategies' `tests/gpu.rs` with `cuda,nccl`;
#   - models-parity: kandle-models' `tests/torchvision_weights.rs` with `cuda` (ResNet-18 against
#     PyTorch on the GPU);
#   - kernels-cuda-bn, kernels-cuda-pool: kandle-kernels' `tests/cuda_batch_norm.rs` and
#     `tests/cuda_pooling.rs` with `cuda` (kandle's own CUDA batch norm and pooling kernels against
#     the CPU kernels), in the same cargo run, so candle is not compiled again, and likewise
#     kernels-cuda-opt, kernels-cuda-xent, kernels-cuda-dropout and kernels-cuda-dense (its
#     optimizer updates, softmax cross-entropy, dropout masks and cuBLASLt Dense product);
#   - bench, train_cifar10, scaling: the example binaries with `cuda,nccl`;
#   - kernels-cuda-conv: kandle-kernels' `tests/cuda_conv.rs` with `cudnn` (its cuDNN
#     convolutions against the CPU kernels);
#   - kandle-lib-cudnn: kandle's unit tests with `cudnn` (Conv2D on kandle-kernels' cuDNN ops);
#   - bench-cudnn, train_cifar10-cudnn: the same with `cudnn` (Conv2D through kandle-kernels'
#     cuDNN ops instead of candle's im2col and cuBLAS).
# Binaries are stripped (CARGO_PROFILE_RELEASE_STRIP) and built in target/gpu, apart from the
# CPU build's artifacts.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
VENV=${KANDLE_CUDA_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kandle-cuda13}
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
t0=$SECONDS

cargo fetch --locked
bash .ci/setup-cuda.sh "$VENV"
# shellcheck source=/dev/null
source "$VENV/env.sh"
# cuDNN, to link the `cudnn` builds against (the GPU machine brings its own libcudnn.so.9).
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [[ ! -e "$SITE/nvidia/cudnn/lib/libcudnn.so.9" ]]; then
  "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps 'nvidia-cudnn-cu13==9.13.0.50'
fi
ln -sf "$SITE/nvidia/cudnn/lib/libcudnn.so.9" "$CUDA_HOME/lib/libcudnn.so"

export CARGO_TARGET_DIR=$REPO/target/gpu CARGO_PROFILE_RELEASE_STRIP=true
mkdir -p gpu-bin
rm -f gpu-bin/*.xz

# Builds with `cargo $@ --message-format=json` and prints "package:target path" for each
# executable made.
executables() {
  cargo "$@" --message-format=json-render-diagnostics \
    | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        # path+file:///repo/strategies#kandle-strategies@0.1.0, or .../kandle#0.1.0 when the
        # folder has the package'"'"'s name
        url, fragment = m["package_id"].rsplit("#", 1)
        package = fragment.split("@")[0] if "@" in fragment else url.rsplit("/", 1)[-1]
        print(package + ":" + m["target"]["name"], m["executable"])'
}

# Each binary is staged under its name; `seal` packs them all into one solid archive.
STAGE=$CARGO_TARGET_DIR/gpu-stage
rm -rf "$STAGE"
mkdir -p "$STAGE"
pack() { # pack NAME PATH
  echo "== $1 ($(du -h "$2" | cut -f1) stripped)"
  cp "$2" "$STAGE/$1"
}

# The device machine takes 64 MiB of working tree in all, the sources included: the binaries
# go as one solid xz archive, whose dictionary spans a whole binary, so the code every binary
# shares (candle's kernels above all) is stored once (about 20 MiB for all of them, where
# compressing each alone makes 110).
LIMIT_MIB=56
seal() {
  echo "== gpu-bin/gpu-bin.tar.xz"
  tar -C "$STAGE" --sort=name -cf - . | xz -T1 --lzma2=preset=6,dict=192MiB > gpu-bin/gpu-bin.tar.xz
  local mib=$(( $(stat -c %s gpu-bin/gpu-bin.tar.xz) / 1048576 ))
  echo "$mib MiB for $(ls "$STAGE" | wc -l) binaries"
  if ((mib > LIMIT_MIB)); then
    echo "gpu-bin/gpu-bin.tar.xz is $mib MiB: over the $LIMIT_MIB MiB the device machine's working tree leaves for it" >&2
    exit 1
  fi
}

echo "== tests and binaries with cuda,nccl"
# One feature set for all of them (candle-core with cuda and nccl), so it is compiled once.
# kandle-kernels' CUDA batch norm, pooling, optimizer, cross-entropy, dropout and Dense tests come in the same run (their `test-support`
# is on already, through kandle's dev-dependency); `--lib` builds its unit tests too, unpacked.
built=$(executables test --profile release --locked --no-run -p kandle -p kandle-strategies \
  -p kandle-models -p kandle-kernels \
  --features kandle/cuda,kandle-strategies/nccl,kandle-kernels/test-support --lib --test gpu \
  --test torchvision_weights --test cuda_batch_norm --test cuda_pooling --test cuda_optimizer \
  --test cuda_softmax_cross_entropy --test cuda_dropout --test cuda_dense)
echo "$built"
pack kandle-lib "$(awk '$1 == "kandle:kandle" { print $2 }' <<<"$built")"
pack strategies-gpu "$(awk '$1 == "kandle-strategies:gpu" { print $2 }' <<<"$built")"
pack models-parity "$(awk '$1 == "kandle-models:torchvision_weights" { print $2 }' <<<"$built")"
pack kernels-cuda-bn "$(awk '$1 == "kandle-kernels:cuda_batch_norm" { print $2 }' <<<"$built")"
pack kernels-cuda-pool "$(awk '$1 == "kandle-kernels:cuda_pooling" { print $2 }' <<<"$built")"
pack kernels-cuda-opt "$(awk '$1 == "kandle-kernels:cuda_optimizer" { print $2 }' <<<"$built")"
pack kernels-cuda-xent "$(awk '$1 == "kandle-kernels:cuda_softmax_cross_entropy" { print $2 }' <<<"$built")"
pack kernels-cuda-dropout "$(awk '$1 == "kandle-kernels:cuda_dropout" { print $2 }' <<<"$built")"
pack kernels-cuda-dense "$(awk '$1 == "kandle-kernels:cuda_dense" { print $2 }' <<<"$built")"
executables build --release --locked -p kandle-examples --features cuda,nccl \
  --bin bench --bin train_cifar10 --bin scaling >/dev/null
pack bench "$CARGO_TARGET_DIR/release/bench"
pack train_cifar10 "$CARGO_TARGET_DIR/release/train_cifar10"
pack scaling "$CARGO_TARGET_DIR/release/scaling"

if [[ ${KANDLE_GPU_CUDNN:-1} == 0 ]]; then
  seal
  echo "== gpu/build.sh done in $((SECONDS - t0)) s (without the cudnn builds)"
  exit 0
fi

echo "== kandle-kernels' cuDNN convolution tests and binaries with cudnn"
# Another feature set: candle-core and the crates above it are compiled again (once for both:
# candle-core has `cuda,cudnn` in each), and these binaries replace the ones packed above in the
# release folder.
built=$(executables test --profile release --locked --no-run -p kandle-kernels --features cudnn \
  --test cuda_conv)
echo "$built"
pack kernels-cuda-conv "$(awk '$1 == "kandle-kernels:cuda_conv" { print $2 }' <<<"$built")"
# kandle's unit tests with Conv2D on kandle's cuDNN ops (the layer against the CPU); candle-core
# has the same features as above, so it is not compiled again.
built=$(executables test --profile release --locked --no-run -p kandle --features cudnn --lib)
echo "$built"
pack kandle-lib-cudnn "$(awk '$1 == "kandle:kandle" { print $2 }' <<<"$built")"
executables build --release --locked -p kandle-examples --features cuda,cudnn \
  --bin bench --bin train_cifar10 >/dev/null
pack bench-cudnn "$CARGO_TARGET_DIR/release/bench"
pack train_cifar10-cudnn "$CARGO_TARGET_DIR/release/train_cifar10"

seal
echo "== gpu/build.sh done in $((SECONDS - t0)) s: carry gpu-bin/ and run gpu/check.sh there"
