#!/usr/bin/env bash
# The GPU check: runs on a machine with an NVIDIA GPU (driver 580 / CUDA 13, PyTorch in python3,
# no Rust toolchain), from the repository root, with gpu-bin/ built by gpu/build.sh carried there.
# One command, at most 7 minutes (the later benchmarks are skipped when time runs out):
#
#   bash gpu/check.sh            # results under $OUT (or ./gpu-out): check.log, results.json,
#                                # bench-*.json (12), epoch.json, timeline.md
#
# In order, each step under its own time limit, every step run whatever the ones before did:
#   1. nvidia-smi; kandle-kernels' cuDNN convolutions (forward, input and kernel gradients)
#      against the CPU kernels and a float64 reference, the algorithm cache, deterministic
#      algorithms (kernels/tests/cuda_conv.rs; when gpu-bin/ has it, built with cudnn);
#      kandle-kernels' own CUDA batch norm (training with its statistics, inference's affine,
#      the fused ReLU) and max and average pooling, outputs and gradients against the CPU
#      kernels, also written into and read from a range of a concatenation's channels
#      (kernels/tests/cuda_batch_norm.rs, cuda_pooling.rs); its CUDA optimizer updates
#      (SGD, Adam, AdamW over several steps) against the CPU kernels and its softmax
#      cross-entropy (loss and gradient) against the CPU path and its dropout masks against the
#      CPU's, bit for bit (cuda_optimizer.rs, cuda_softmax_cross_entropy.rs, cuda_dropout.rs,
#      when gpu-bin/ has them);
#   2. the GPU is found, and hidden by CUDA_VISIBLE_DEVICES= (tests/gpu.rs);
#   3. every layer's outputs and gradients on CUDA against the CPU (kandle's unit tests, the
#      ignored CUDA test included; again with cudnn, Conv2D on kandle's cuDNN ops), the recorded
#      backward pass on the GPU against candle's autograd (replica::tests, also with cudnn), the
#      step captured as a CUDA graph against the eager step, bit for bit (also with cudnn), and
#      the rest of kandle's unit tests on this machine;
#   4. digits to 97% on the GPU (also under mixed_float16 and mixed_bfloat16), 20 steps against
#      the CPU, gradient accumulation, Mirrored with two replicas on the GPU, CentralStorage (and
#      both with their steps as CUDA graphs),
#      training states between GPU and CPU, NCCL with one rank (tests/gpu.rs); ResNet-18 against
#      PyTorch's float64 step on torchvision's weights (parity-files, parity);
#   5. MiniGoogLeNet's training step and inference at batch 64 and 256 against PyTorch on the
#      same GPU (eager, channels_last), and PyTorch's epoch of 50,000 images; kandle's steps
#      with the driver's default memory pool (KANDLE_CUDA_SETTINGS=default), what the pool's
#      setting buys; kandle's steps as CUDA graphs (KANDLE_CUDA_GRAPHS=1, batch 64 and 256,
#      candle's and cuDNN's convolutions), what graphs buy; a timeline of kandle's steps when the machine has Nsight Systems
#      (timeline.md: GPU-busy time against the gaps, gpu/timeline_summary.py); under mixed_float16 and mixed_bfloat16 against PyTorch's autocast at
#      batch 256; ResNet-18 (small-image stem) at batch 64 and 256 against PyTorch;
#   6. one epoch of 50,000 CIFAR-format images (noise, made here) through train_cifar10; the
#      expected scaling on 2, 4 and 8 GPUs from the one-device step measured here and a ring
#      all-reduce of the gradients over NVLink (scaling: scaling.csv, scaling.png);
#   7. PyTorch channels_last + torch.compile at batch 64 (it compiles for a minute or two);
#   8. an Nsight Compute profile of kandle's training step, per kernel; kandle's step and
#      inference with cuDNN convolutions;
#   9. MiniGoogLeNet's per-op tables on the GPU at batch 64 (each distinct convolution, batch
#      norm, pooling and concatenation shape, kandle against PyTorch): candle's convolutions
#      (bench-ops-64) and, when a minute is left, cuDNN's (bench-ops-64-cudnn).
# results.json lists each step with its exit status and seconds; the script exits non-zero when
# any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/check.log") 2>&1

NV=/opt/torch/.venv/lib/python3.12/site-packages/nvidia
if [[ -d $NV ]]; then
  LD_LIBRARY_PATH=$(ls -d "$NV"/*/lib | paste -sd:)
  export LD_LIBRARY_PATH
fi
PYTHON=${PYTHON:-python3}
BIN=${KANDLE_GPU_BIN:-/tmp/kandle-gpu}
mkdir -p "$BIN"
# gpu/build.sh packs every binary into one solid archive.
if command -v xz >/dev/null; then
  tar -C "$BIN" -xJf gpu-bin/gpu-bin.tar.xz
else
  "$PYTHON" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
    gpu-bin/gpu-bin.tar.xz "$BIN"
fi
for path in "$BIN"/*; do
  chmod +x "$path"
  missing=$(ldd "$path" | grep 'not found' || true)
  [[ -z $missing ]] || echo "$(basename "$path"): missing libraries: $missing"
done

STEPS="$OUT/steps.tsv"
: > "$STEPS"
failed=0
# The whole check ends within KANDLE_GPU_CHECK_SECONDS (default 420, seven minutes): a step
# gets at most what is left, and a step with under 15 s left is recorded as skipped (exit 125).
DEADLINE=$((SECONDS + ${KANDLE_GPU_CHECK_SECONDS:-420}))
# KANDLE_GPU_STEPS (a comma-separated list of step names) runs those steps only, for a run
# with little device time left.
# step NAME SECONDS COMMAND...: runs COMMAND under a time limit and records how it ended.
step() {
  local name=$1 limit=$2
  shift 2
  if [[ -n ${KANDLE_GPU_STEPS:-} && ",$KANDLE_GPU_STEPS," != *",$name,"* ]]; then
    return 0
  fi
  local left=$((DEADLINE - SECONDS))
  if ((left < 15)); then
    echo "=== $name: skipped, ${left} s left"
    printf '%s\t%s\t%s\n' "$name" 125 0 >> "$STEPS"
    failed=1
    return 125
  fi
  ((limit <= left)) || limit=$left
  echo
  echo "=== $name (limit ${limit} s)"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  local took=$((SECONDS - start))
  echo "=== $name: exit $rc after $took s"
  printf '%s\t%s\t%s\n' "$name" "$rc" "$took" >> "$STEPS"
  [[ $rc == 0 ]] || failed=1
}

step nvidia-smi 30 nvidia-smi
# First, as the newest code: kandle-kernels' cuDNN convolutions (under a minute).
if [[ -x $BIN/kernels-cuda-conv ]]; then
  step kernels-cudnn-conv 120 "$BIN/kernels-cuda-conv" --nocapture
fi
# Then kandle's own CUDA batch norm and pooling kernels against the CPU kernels (NVRTC compiles
# them at the first launch; seconds).
if [[ -x $BIN/kernels-cuda-bn && -x $BIN/kernels-cuda-pool ]]; then
  step kernels-cuda-bn-pool 60 bash -c \
    '"$1" --include-ignored; bn=$?; "$2" --include-ignored; pool=$?; exit $((bn || pool))' _ \
    "$BIN/kernels-cuda-bn" "$BIN/kernels-cuda-pool"
fi
# kandle's CUDA optimizer updates, softmax cross-entropy, dropout masks and cuBLASLt Dense
# product against the CPU kernels, the CPU path or a float64 reference (seconds; each optimizer
# test says whether its values were the CPU's bit for bit; the masks must be).
if [[ -x $BIN/kernels-cuda-opt && -x $BIN/kernels-cuda-xent ]]; then
  step kernels-cuda-opt-xent 60 bash -c \
    'rc=0; for t in "$@"; do [[ -x $t ]] || continue; "$t" --include-ignored --nocapture || rc=1; done; exit $rc' _ \
    "$BIN/kernels-cuda-opt" "$BIN/kernels-cuda-xent" "$BIN/kernels-cuda-dropout" \
    "$BIN/kernels-cuda-dense"
fi
step gpu-visible 60 env KANDLE_EXPECT_GPUS="${KANDLE_EXPECT_GPUS:-1}" \
  "$BIN/strategies-gpu" --include-ignored --exact the_expected_gpus_are_visible
step gpu-hidden 60 env CUDA_VISIBLE_DEVICES= KANDLE_EXPECT_GPUS=0 \
  "$BIN/strategies-gpu" --include-ignored --exact the_expected_gpus_are_visible
step layers-cuda-vs-cpu 120 "$BIN/kandle-lib" --include-ignored --exact \
  layers::tests::cuda_outputs_and_gradients_match_the_cpu --nocapture
# BatchNormalization and the pools on kandle's CUDA kernels against the same layers built
# device-generic (candle's ops), and against the kernels' own bits; likewise SGD, Adam and AdamW
# (optimizers::cuda) and the sparse cross-entropy (losses) on the kernels against candle's ops.
step layers-cuda-kernels 60 "$BIN/kandle-lib" --include-ignored \
  cuda_kernels_match_the_device_generic_path --nocapture
# A CNN and a functional graph training four steps through the recorded backward pass on the
# GPU against candle's autograd over the same kernels, in float32, mixed_float16 and
# mixed_bfloat16 (seconds).
step replica-recorded-cuda 60 "$BIN/kandle-lib" --include-ignored --exact \
  replica::tests::recorded_steps_on_cuda_match_autograd --nocapture
# The training step captured as a CUDA graph and replayed (KANDLE_CUDA_GRAPHS=1) against the
# eager step, bit for bit with candle's convolutions (seconds; names the reason when the step
# could not be captured).
step replica-graphs-cuda 60 "$BIN/kandle-lib" --include-ignored --exact \
  replica::tests::cuda_graph_steps_are_the_eager_steps --nocapture
# Whole steps (OneDevice's, with CUDA graphs): forward, backward and the gated update (SGD,
# AdamW) captured as one graph, a NaN step skipped by the gate in a replay, against host-decided
# steps without graphs; and the gated updates' kernels against the host-decided ones.
step whole-steps-cuda 90 "$BIN/kandle-lib" --include-ignored \
  _host_decided_steps --nocapture
# The loader's prefetch thread hands over batches copied to the GPU, the host batches' values.
step loader-to-gpu 30 "$BIN/kandle-lib" --include-ignored --exact \
  data::loader::tests::batches_copied_to_a_gpu_are_the_host_batches
# Pinned staging buffers and the copy stream: every dtype, both buffers, a short and an empty batch.
step batch-upload 30 "$BIN/kandle-lib" --include-ignored --exact \
  devices::batch_upload::cuda::tests::batches_arrive_on_the_gpu_as_they_left
# A device kandle opens keeps the memory freed on it in its pool across synchronisations.
step cuda-memory-pool 30 "$BIN/kandle-lib" --include-ignored --exact \
  devices::tests::a_cuda_device_keeps_freed_memory_in_its_pool
if [[ -x $BIN/kandle-lib-cudnn ]]; then
  step layers-cudnn-vs-cpu 120 "$BIN/kandle-lib-cudnn" --include-ignored --exact \
    layers::tests::cuda_outputs_and_gradients_match_the_cpu --nocapture
  # The same recorded steps with Conv2D on cuDNN, its gradients called by the recorded pass.
  step replica-recorded-cudnn 60 "$BIN/kandle-lib-cudnn" --include-ignored --exact \
    replica::tests::recorded_steps_on_cuda_match_autograd --nocapture
  step replica-graphs-cudnn 60 "$BIN/kandle-lib-cudnn" --include-ignored --exact \
    replica::tests::cuda_graph_steps_are_the_eager_steps --nocapture
  step whole-steps-cudnn 90 "$BIN/kandle-lib-cudnn" --include-ignored --exact \
    replica::tests::cuda_graphs_of_whole_steps_train_as_host_decided_steps --nocapture
fi
step gpu-training-and-strategies 240 "$BIN/strategies-gpu" --include-ignored \
  --skip the_expected_gpus_are_visible --test-threads 1 --nocapture

# ResNet-18 against PyTorch on the GPU: PyTorch writes torchvision's ResNet-18 with a fixed seed,
# a batch, its logits and the weights after one SGD step in float32 (on the GPU) and float64 (on
# the CPU); kandle loads the file on cuda:0 and compares (models/tests/torchvision_weights.rs).
PARITY=/tmp/kandle-parity
step parity-files 120 "$PYTHON" bench/torchvision_resnet_parity.py --out "$PARITY" --only resnet18 \
  --device cuda:0
step parity 180 env KANDLE_TORCHVISION_PARITY="$PARITY" KANDLE_PARITY_DEVICE=cuda:0 \
  PYTHON="$PYTHON" bash gpu/parity.sh \
  "$BIN/models-parity" --ignored --exact resnet18_matches_torchvision --nocapture

# The model's step and inference (the per-op tables have their own steps, bench-ops-*).
bench() { # bench NAME LIMIT BINARY ARGS...
  local name=$1 limit=$2 binary=$3
  shift 3
  step "$name" "$limit" "$BIN/$binary" --device cuda:0 --warmup 3 --iters 10 --no-ops \
    --pytorch-script bench/pytorch_minigooglenet.py --python "$PYTHON" \
    --json "$OUT/$name.json" "$@"
}
bench bench-64 120 bench --batch 64 --pytorch-configs eager,channels_last --epoch-images 50000
bench bench-256 120 bench --batch 256 --pytorch-configs eager,channels_last
# What the memory pool's setting buys: kandle's steps with the driver's default pool.
step bench-64-default-pool 60 env KANDLE_CUDA_SETTINGS=default "$BIN/bench" --device cuda:0 \
  --warmup 3 --iters 10 --batch 64 --no-pytorch --no-ops --json "$OUT/bench-64-default-pool.json"
# What CUDA graphs buy: kandle's steps captured after two warm-up steps and replayed (the third
# warm-up step captures), with candle's convolutions and with cuDNN's.
for graphed in bench-64 bench-256 bench-64-cudnn bench-256-cudnn; do
  binary=bench
  [[ $graphed == *-cudnn ]] && binary=bench-cudnn
  [[ -x $BIN/$binary ]] || continue
  batch=${graphed#bench-}
  batch=${batch%-cudnn}
  step "$graphed-graphs" 60 env KANDLE_CUDA_GRAPHS=1 "$BIN/$binary" --device cuda:0 --warmup 3 \
    --iters 10 --batch "$batch" --no-pytorch --no-ops --json "$OUT/$graphed-graphs.json"
done

# Where the step's time goes on the GPU: an Nsight Systems trace of kandle's training steps and
# inference at batch 64, summarised as GPU-busy time against the gaps between operations (the
# host's time the GPU waits for), by gap size, and the operations by total time (timeline.md;
# the report itself when it is under 32 MB).
if command -v nsys >/dev/null; then
  step timeline 60 bash -c '
    nsys profile --trace=cuda --sample=none --cpuctxsw=none --force-overwrite true \
      --output /tmp/kandle-timeline "$1/bench" --device cuda:0 --batch 64 --warmup 2 --iters 5 \
      --no-pytorch --no-ops &&
    nsys stats --report cuda_gpu_trace --format csv --force-overwrite true \
      --output /tmp/kandle-timeline /tmp/kandle-timeline.nsys-rep >/dev/null &&
    "$2" gpu/timeline_summary.py /tmp/kandle-timeline_cuda_gpu_trace.csv "$3/timeline.md" &&
    if (($(stat -c %s /tmp/kandle-timeline.nsys-rep) < 32000000)); then
      cp /tmp/kandle-timeline.nsys-rep "$3/"
    fi' _ "$BIN" "$PYTHON" "$OUT"
else
  echo "=== timeline: left out, no nsys on this machine"
fi

# Mixed precision: kandle's policies against PyTorch's autocast (float16 with a GradScaler, and
# bfloat16) and float32, on the same GPU.
bench bench-256-mixed-float16 120 bench --batch 256 --dtype-policy mixed_float16 \
  --pytorch-configs channels_last,channels_last+amp
bench bench-256-mixed-bfloat16 120 bench --batch 256 --dtype-policy mixed_bfloat16 \
  --pytorch-configs channels_last+bf16

# ResNet-18 with the small-image stem (the other network of the targets) against PyTorch, on
# kandle's cuDNN convolutions where gpu-bin/ has them.
resnet_bench=bench
[[ -x $BIN/bench-cudnn ]] && resnet_bench=bench-cudnn
bench bench-resnet18-64 90 "$resnet_bench" --model resnet18 --batch 64 \
  --pytorch-configs eager,channels_last
bench bench-resnet18-256 90 "$resnet_bench" --model resnet18 --batch 256 \
  --pytorch-configs eager,channels_last

# One epoch through train_cifar10 (candle's own convolutions: its cuDNN build's training step is
# several times slower, see bench-*-cudnn).
FIXTURE=/tmp/kandle-cifar-fixture
step cifar-fixture 60 "$PYTHON" gpu/cifar_fixture.py "$FIXTURE"
step epoch 150 "$BIN/train_cifar10" --epochs 1 --data-dir "$FIXTURE" \
  --output /tmp/kandle-epoch/epoch.png --title "one epoch of noise" &&
  cp /tmp/kandle-epoch/epoch.json "$OUT/epoch.json"

# The expected scaling of data parallelism on 2, 4 and 8 GPUs of this kind: MiniGoogLeNet's
# one-device step (batch 64 per GPU, through fit) measured here, each step then followed by a
# ring all-reduce of its gradients at NVLink's rate (about 3,000 Gbit/s per GPU, 10 us per
# message), without overlap (the `projected_measured_step` rows of scaling.csv).
step scaling 90 "$BIN/scaling" --gpus --replicas 1 --strategies one-device --warmup 2 \
  --steps 10 --bandwidth-gbit 3000 --latency-us 10 --output "$OUT/scaling.png"

# PyTorch's best-known GPU configuration; it compiles for a minute or two.
bench bench-64-compile 180 bench --batch 64 --pytorch-configs channels_last+compile

# Where kandle's GPU step goes: each kernel's time over the first launches of a training step
# (the forward pass and most of the backward), by name.
if command -v ncu >/dev/null; then
  step ncu-profile 90 ncu --clock-control none --metrics gpu__time_duration.sum \
    --launch-count 1500 --print-summary per-kernel --csv "$BIN/bench" --device cuda:0 \
    --batch 64 --warmup 0 --iters 1 --no-pytorch --no-ops
fi

# candle's convolutions through cuDNN.
bench bench-64-cudnn 60 bench-cudnn --batch 64 --no-pytorch
bench bench-256-cudnn 60 bench-cudnn --batch 256 --no-pytorch

# The per-op tables on the GPU (each op timed alone, the device synchronised after every run):
# kandle's CUDA kernels and candle's convolutions, then cuDNN's when a minute is left.
ops() { # ops NAME BINARY
  step "$1" 60 "$BIN/$2" --device cuda:0 --ops-only --batch 64 --warmup 3 --iters 5 \
    --pytorch-script bench/pytorch_minigooglenet.py --python "$PYTHON" --json "$OUT/$1.json"
}
ops bench-ops-64 bench
if ((DEADLINE - SECONDS >= 60)); then
  ops bench-ops-64-cudnn bench-cudnn
else
  echo "=== bench-ops-64-cudnn: left out, $((DEADLINE - SECONDS)) s left"
fi

"$PYTHON" - "$STEPS" "$OUT/results.json" <<'PY'
import json, sys
steps = [dict(zip(("name", "exit", "seconds"), line.rstrip("\n").split("\t")))
         for line in open(sys.argv[1]) if line.strip()]
for s in steps:
    s["exit"], s["seconds"] = int(s["exit"]), int(s["seconds"])
json.dump({"steps": steps, "passed": all(s["exit"] == 0 for s in steps)},
          open(sys.argv[2], "w"), indent=1)
print()
print("| step | exit | seconds |")
print("|---|---|---|")
for s in steps:
    print(f"| {s['name']} | {s['exit']} | {s['seconds']} |")
PY
rm -f "$STEPS"
exit $failed
