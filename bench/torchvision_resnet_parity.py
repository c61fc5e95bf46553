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
     that GPU, the spread a GPU's float32 is judged by (the GPU check does so).

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

Produced with torch 2.15.0 and torchvision 0.29.2 on the CPU.
"""

import argparse
import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
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


def resnet18_parity(out: str, device: str = "cpu", batch_seed: int = 1) -> None:
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

    loss = one_sgd_step(model, x.to(device), y.to(device))
    loss64 = one_sgd_step(model64, x.double(), y)
    save_file(state_dict(model), os.path.join(out, "step_f32.safetensors"))
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
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.only != "resnet18":
        tiny_fixture(args.fixture)
    if args.only != "fixture":
        resnet18_parity(args.out, args.device, args.batch_seed)


if __name__ == "__main__":
    main()
