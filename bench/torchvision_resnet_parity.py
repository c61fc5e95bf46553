"""PyTorch's side of the checks that torchvision's weights load into kandle's ResNet.

Writes two sets of files:

1. `--out DIR` (default `target/torchvision-parity`, not committed: about 240 MB): a
   `torchvision.models.resnet18(weights=None)` built under `torch.manual_seed(0)`, with its
   batch norms' weights, biases and running statistics drawn at random too (a fresh network
   has 1, 0, 0 and 1 there, which would hide a swapped name) and `num_batches_tracked` kept:

   - `resnet18.safetensors`: the state dict as it is (float32, `num_batches_tracked` int64);
   - `resnet18.pth`: `torch.save({"epoch": 0, "state_dict": state_dict})`, a training
     checkpoint with the state dict under a key;
   - `batch.safetensors`: a fixed batch `x` (4x3x64x64), its labels `y` (int64), the
     eval-mode logits of the float32 network (`logits`) and of the same network in float64
     (`logits_f64`), and the loss of the training step in both (`loss`, `loss_f64`);
   - `step_f32.safetensors` and `step_f64.safetensors`: the state dict after one SGD step
     (lr 0.1, momentum 0.9) in train mode on that batch, with mean cross-entropy on the
     labels, in float32 and in float64 (the float64 run starts from the same float32 values,
     so the two differ only by float32 rounding: their difference is the spread a float32
     implementation is judged by). With `--device cuda:0` the float32 logits and step run on
     that GPU, the spread a GPU's float32 is judged by (the GPU check does so);
   - `step_f32_channels_last.safetensors` and `step_f32_native.safetensors`: the same float32
     step in PyTorch's other layouts and kernels: the channels-last layout, and PyTorch's own
     convolutions instead of oneDNN's (cuDNN's on a GPU). They are as right as the default
     run, and on some batches (batch seed 2 of 1 to 4) one of them lands a ReLU input that
     float64 puts within float32's rounding of zero on the other side of the kink, which
     changes every gradient below that layer;
   - `kinks.safetensors`: those ReLU inputs (float64 puts them nearer zero than the largest
     difference of PyTorch's float32 forward passes from float64's at that ReLU; the 8 nearest
     zero), and for each, how float64's step moves when its gradient goes the other way. The
     test finds the kinks a float32 step took and compares it with float64's step so taken,
     PyTorch's three runs included: what remains is arithmetic;
   - with `--kink-sets 1+4,...`, only `step_f64_kinks_1+4.safetensors`, ...: float64's step
     with several of those kinks taken together, which the test asks for when a run takes them
     (two kinks interact: one changes the gradient the other passes).

   `models/tests/torchvision_weights.rs` (the ignored test `resnet18_matches_torchvision`)
   reads them.

2. `--fixture DIR` (default `tests/reference/torchvision_tiny`, committed: about 60 KB): a
   tiny network with torchvision's ResNet names and layout (a 7x7 stride-2 stem, `bn1`, a 3x3
   stride-2 max pool, `layer1.0` a basic block of 8 channels, `layer2.0` one of 16 with stride
   2 and a `downsample`, global average pooling, `fc` of 5 classes), so CI can check names,
   shapes and logits without PyTorch:

   - `tiny.safetensors`: its state dict (float32, `num_batches_tracked` int64);
   - `tiny_checkpoint.pth`: `torch.save({"epoch": 3, "state_dict": ...})` of the same state
     dict in float64 (the int64 counters as they are);
   - `tiny_batch.safetensors`: `x` (2x3x32x32) and the eval-mode logits, float32 (`logits`)
     and float64 (`logits_f64`).

Run it with torch and torchvision installed (CPU is enough), from the repository root:

    python3 bench/torchvision_resnet_parity.py
    KANDLE_TORCHVISION_PARITY=target/torchvision-parity \\
        cargo test --release -p kandle-models --test torchvision_weights -- --ignored

(`gpu/parity.sh` runs such a test command, writes the kink sets it asks for, and runs it again.)

Produced with torch 2.15.0 and torchvision 0.29.2 on the CPU.
"""

import argparse
import contextlib
import copy
import glob
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from safetensors import safe_open
from safetensors.torch import save_file
from torchvision.models.resnet import BasicBlock


def randomize_batch_norms(model: nn.Module) -> None:
    """Draws every BatchNorm's weight, bias and running statistics, and counts 7 batches."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.num_batches_tracked.fill_(7)


def state_dict(model: nn.Module, dtype=None) -> dict:
    """The state dict, contiguous, floats cast to `dtype` if given (int64 counters kept)."""
    out = {}
    for k, v in model.state_dict().items():
        v = v.detach().cpu().clone().contiguous()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        out[k] = v
    return out


class TinyResNet(nn.Module):
    """torchvision's ResNet layout and names, with 8 and 16 channels and two stages."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = nn.Sequential(BasicBlock(8, 8))
        downsample = nn.Sequential(
            nn.Conv2d(8, 16, kernel_size=1, stride=2, bias=False), nn.BatchNorm2d(16)
        )
        self.layer2 = nn.Sequential(BasicBlock(8, 16, stride=2, downsample=downsample))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def one_sgd_step(model: nn.Module, x, y) -> float:
    """One step of SGD (lr 0.1, momentum 0.9) in train mode; returns the loss."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


@contextlib.contextmanager
def channels_last(model: nn.Module):
    """The model and its input in the channels-last layout."""
    model.to(memory_format=torch.channels_last)
    yield lambda x: x.contiguous(memory_format=torch.channels_last)


@contextlib.contextmanager
def native_kernels(model: nn.Module):
    """PyTorch's own convolutions and batch norms: oneDNN off on the CPU, cuDNN off on a GPU."""
    backends = (torch.backends.mkldnn, torch.backends.cudnn)
    saved = [b.enabled for b in backends]
    for b in backends:
        b.enabled = False
    try:
        yield lambda x: x
    finally:
        for b, enabled in zip(backends, saved):
            b.enabled = enabled


@contextlib.contextmanager
def as_it_is(model: nn.Module):
    """PyTorch's defaults: the contiguous layout, oneDNN on the CPU, cuDNN on a GPU."""
    del model
    yield lambda x: x


# PyTorch's float32 configurations of the same step, by file-name suffix (`step_f32{suffix}`).
FLOAT32_CONFIGS = {"": as_it_is, "_channels_last": channels_last, "_native": native_kernels}


class KinkReLU(nn.Module):
    """A ReLU that records its inputs and can send one input's gradient the other way.

    It computes `x * mask`, `mask` being `x > 0` with the positions in `flips` toggled: the
    forward values move by at most that input's own size (float64 puts it near zero), and the
    backward pass passes or stops that one gradient as a float32 run that lands the input on the
    other side of zero does.
    """

    def __init__(self, name: str, calls: list):
        super().__init__()
        self.name, self.calls, self.flips, self.record = name, calls, {}, False

    def forward(self, x):
        index = len(self.calls)
        self.calls.append((self.name, x.detach().clone() if self.record else None))
        mask = (x > 0).to(x.dtype)
        for position in self.flips.get(index, []):
            mask[position] = 1 - mask[position]
        return x * mask


def with_kink_relus(model: nn.Module) -> list:
    """Replaces every ReLU of `model` with a `KinkReLU`; returns the list their calls fill."""
    calls = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.ReLU):
                full = f"{parent_name}.{name}" if parent_name else name
                setattr(parent, name, KinkReLU(full, calls))
    return calls


def relu_inputs(model: nn.Module, x) -> list:
    """The inputs of every ReLU call of one train-mode forward pass of a copy of `model`."""
    model = copy.deepcopy(model)
    calls = with_kink_relus(model)
    for m in model.modules():
        if isinstance(m, KinkReLU):
            m.record = True
    model.train()
    with torch.no_grad():
        model(x)
    return calls


def call_label(calls: list, index: int) -> str:
    """`layer2.0.relu, call 1 of 2`: a ReLU module and which of its calls it was."""
    name = calls[index][0]
    same = [i for i, (n, _) in enumerate(calls) if n == name]
    return f"{name}, call {same.index(index) + 1} of {len(same)}"


def kink_candidates(model, model64, x, device: str, limit: int = 8) -> list:
    """The ReLU inputs a float32 step may land on either side of zero, nearest zero first.

    An input is one when float64 puts it closer to zero than the largest difference between
    PyTorch's float32 forward pass (any of its configurations) and float64's at that ReLU call:
    whichever side a float32 run lands it on is as right as the other. Returns the `limit`
    nearest zero as `(call, position, label)`, and how many there were.
    """
    exact = relu_inputs(model64, x.double())
    errors = [0.0] * len(exact)
    for variant in FLOAT32_CONFIGS.values():
        copied = copy.deepcopy(model)
        with variant(copied) as layout:
            run = relu_inputs(copied, layout(x.to(device)))
        for i, ((_, a), (_, b)) in enumerate(zip(exact, run)):
            errors[i] = max(errors[i], (a - b.double().cpu()).abs().max().item())
    found = []
    for i, (_, a) in enumerate(exact):
        for position in (a.abs() <= errors[i]).nonzero().tolist():
            found.append((abs(a[tuple(position)].item()), i, tuple(position), errors[i]))
    found.sort()
    candidates = []
    for _, call, position, error in found[:limit]:
        value = exact[call][1][position].item()
        label = (
            f"{call_label(exact, call)}: sample {position[0]}, channel {position[1]}, "
            f"at ({position[2]}, {position[3]}): {value:.2e} in float64, float32 errs by up "
            f"to {error:.2e} there"
        )
        candidates.append((call, position, label))
    return candidates, len(found)


def kink_deltas(model64, x, y, candidates: list) -> tuple:
    """For each kink, float64's step with that input's gradient sent the other way, as its
    difference from the plain float64 step (float32: a difference needs no more); and the
    labels, as safetensors metadata."""
    plain = state_dict(stepped_f64(model64, x, y, {}))
    tensors, metadata = {}, {"kinks": str(len(candidates))}
    for k, (call, position, label) in enumerate(candidates):
        flipped = state_dict(stepped_f64(model64, x, y, {call: [position]}))
        for name, t in flipped.items():
            if t.is_floating_point():
                tensors[f"kink{k}.{name}"] = (t - plain[name]).float().contiguous()
        metadata[f"kink{k}"] = label
        metadata[f"kink{k}.at"] = ",".join(str(i) for i in (call, *position))
    return tensors, metadata


def written_kinks(out: str) -> list:
    """The kinks `kinks.safetensors` in `out` lists, as `(call, position)`: a set's step must
    take the kinks the test chose by these indices, whatever a new forward pass would find."""
    with safe_open(os.path.join(out, "kinks.safetensors"), "pt") as f:
        metadata = f.metadata()
    written = []
    for k in range(int(metadata["kinks"])):
        call, *position = (int(i) for i in metadata[f"kink{k}.at"].split(","))
        written.append((call, tuple(position)))
    return written


def kink_set_name(kinks: list) -> str:
    """`step_f64_kinks_1+4.safetensors`: the file of float64's step with those kinks taken."""
    return "step_f64_kinks_" + "+".join(str(k) for k in sorted(kinks)) + ".safetensors"


def stepped_f64(model64: nn.Module, x, y, flips: dict) -> nn.Module:
    """A copy of the float64 model after one SGD step, the inputs `flips` names (positions by
    ReLU call) sent the other way."""
    model = copy.deepcopy(model64)
    with_kink_relus(model)
    for m in model.modules():
        if isinstance(m, KinkReLU):
            m.flips = flips
    one_sgd_step(model, x.double(), y)
    return model


def resnet18_parity(out: str, device: str = "cpu", batch_seed: int = 1, kink_sets=()) -> None:
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None)
    randomize_batch_norms(model)
    model.eval()
    sd = state_dict(model)
    save_file(sd, os.path.join(out, "resnet18.safetensors"))
    torch.save({"epoch": 0, "state_dict": sd}, os.path.join(out, "resnet18.pth"))

    gen = torch.Generator().manual_seed(batch_seed)
    x = torch.randn(4, 3, 64, 64, generator=gen)
    y = torch.tensor([1, 7, 42, 999], dtype=torch.int64)
    model64 = copy.deepcopy(model).double()
    # The float32 run on `device` (a GPU's float32 spread for a GPU's check), in float32 proper
    # (PyTorch's cuDNN convolutions default to TF32); float64 on the CPU.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    model = model.to(device)
    with torch.no_grad():
        logits = model(x.to(device)).cpu()
        logits64 = model64(x.double())

    if kink_sets:
        # Flips that interact (one changes the gradient the other passes or stops) are not
        # the sum of their single differences: the test asks for their float64 step whole.
        written = written_kinks(out)
        for kinks in kink_sets:
            flips = {}
            for k in kinks:
                call, position = written[k]
                flips.setdefault(call, []).append(position)
            stepped = stepped_f64(model64, x, y, flips)
            save_file(state_dict(stepped), os.path.join(out, kink_set_name(kinks)))
            print(f"resnet18: {kink_set_name(kinks)} written")
        return
    for stale in glob.glob(os.path.join(out, kink_set_name(["*"]))):
        os.remove(stale)  # sets of an earlier run's kinks
    candidates, found = kink_candidates(model, model64, x, device)
    tensors, metadata = kink_deltas(model64, x, y, candidates)
    metadata["command"] = f"--only resnet18 --out {out} --batch-seed {batch_seed} --device {device}"
    save_file(tensors, os.path.join(out, "kinks.safetensors"), metadata=metadata)
    print(f"resnet18: {found} ReLU inputs within float32's forward error of zero")
    for k in range(int(metadata["kinks"])):
        print(f"  kink{k}: {metadata[f'kink{k}']}")
    for suffix, variant in FLOAT32_CONFIGS.items():
        stepped = copy.deepcopy(model)
        with variant(stepped) as layout:
            stepped_loss = one_sgd_step(stepped, layout(x.to(device)), y.to(device))
        if not suffix:
            loss = stepped_loss
        save_file(state_dict(stepped), os.path.join(out, f"step_f32{suffix}.safetensors"))
    loss64 = one_sgd_step(model64, x.double(), y)
    save_file(state_dict(model64), os.path.join(out, "step_f64.safetensors"))
    save_file(
        {
            "x": x,
            "y": y,
            "logits": logits.contiguous(),
            "logits_f64": logits64.contiguous(),
            "loss": torch.tensor([loss], dtype=torch.float32),
            "loss_f64": torch.tensor([loss64], dtype=torch.float64),
        },
        os.path.join(out, "batch.safetensors"),
    )
    print(f"resnet18: logits max |f32 - f64| = {(logits.double() - logits64).abs().max():.3e}")
    print(f"resnet18: loss {loss:.6f} (f64 {loss64:.6f}); files in {out}")


def tiny_fixture(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    model = TinyResNet()
    randomize_batch_norms(model)
    model.eval()
    save_file(state_dict(model), os.path.join(out, "tiny.safetensors"))
    torch.save(
        {"epoch": 3, "state_dict": state_dict(model, torch.float64)},
        os.path.join(out, "tiny_checkpoint.pth"),
    )
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 32, 32, generator=gen)
    with torch.no_grad():
        logits = model(x)
        logits64 = copy.deepcopy(model).double()(x.double())
    save_file(
        {"x": x, "logits": logits.contiguous(), "logits_f64": logits64.contiguous()},
        os.path.join(out, "tiny_batch.safetensors"),
    )
    print(f"tiny: logits max |f32 - f64| = {(logits.double() - logits64).abs().max():.3e}")
    print(f"tiny: files in {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="target/torchvision-parity")
    parser.add_argument("--fixture", default="tests/reference/torchvision_tiny")
    parser.add_argument("--only", choices=["resnet18", "fixture"])
    parser.add_argument(
        "--batch-seed",
        type=int,
        default=1,
        help="the seed of ResNet-18's batch (default 1, the batch the README's figures use)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where ResNet-18's float32 logits and step run (e.g. cuda:0, for the GPU's "
        "float32 spread); float64 runs on the CPU",
    )
    parser.add_argument(
        "--kink-sets",
        default="",
        help="with --only resnet18: write only the float64 steps with these sets of kinks "
        "taken (e.g. 1+4,0+2; the indices of kinks.safetensors), which the parity test asks for",
    )
    args = parser.parse_args()
    kink_sets = [[int(k) for k in group.split("+")] for group in args.kink_sets.split(",") if group]
    torch.set_num_threads(1)
    if args.only != "resnet18":
        tiny_fixture(args.fixture)
    if args.only != "fixture":
        resnet18_parity(args.out, args.device, args.batch_seed, kink_sets)


if __name__ == "__main__":
    main()
