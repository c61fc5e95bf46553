#!/usr/bin/env python3
"""PyTorch reference for kandle's `bench` binary.

Times MiniGoogLeNet exactly as the Keras multi-GPU CIFAR-10 tutorial defines it (1,656,250
parameters), or with `--model resnet18` torchvision's ResNet-18 with a small-image stem, on the
CPU or a CUDA GPU (`--device`); with `--image-size` other than 32 (and always for `--model
resnet50`) torchvision's ImageNet ResNet-18 or ResNet-50 (7x7 stem, max pool, 1,000 classes): a
training step (forward, cross-entropy, backward, SGD with momentum 0.9) and inference, at the
same batch and thread count as the kandle side, and with `--frozen-base` the step of transfer
learning's first phase (every layer frozen but the classifier, the frozen batch norms on their
running statistics, as Keras freezes them), in each configuration of
`--configs` (default the float32 ones): the default layout (`eager`), `channels_last`, and both
under `torch.compile`; `channels_last+amp` (autocast to float16 with a GradScaler) and
`channels_last+bf16` (autocast to bfloat16) for mixed precision. A configuration that cannot run here is reported with its error. With `--ops`, it also
times the individual ops listed in a JSON file (or `-` for stdin) written by `bench`: conv
forward, backward-input and backward-weight, batch-norm, pooling and concatenation, measured the
same way kandle's are (forward alone, then forward and backward with the input's gradient off and
on, the passes taken as differences; the fastest of the timed runs, where whole steps report the
median), on the CPU or on `--device`'s GPU. With `--epoch-images N`, it also times N images of
training steps (an epoch of random images already on the device, no input pipeline) in the
configuration whose step was fastest.

On a GPU every timed call ends with the device synchronised: the training step reads the loss and
the accuracy back, inference copies the probabilities to the host, as kandle's side does, and each
op's run ends with torch.cuda.synchronize(); cuDNN runs in benchmark mode (its algorithm search
falls in the warm-up runs) and float32 without TF32.

Prints one JSON object on stdout; progress goes to stderr.

    python3 bench/pytorch_minigooglenet.py --batch 64 --threads 2 --iters 10 --warmup 2
    python3 bench/pytorch_minigooglenet.py --model resnet50 --image-size 224 --batch 16 --frozen-base
"""

import argparse
import json
import statistics
import sys
import time
import warnings

# This torch build warns at import when NumPy is absent; nothing here needs NumPy.
warnings.filterwarnings("ignore", message=".*NumPy.*")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

KERAS_PARAMETERS = 1_656_250
BN_EPS = 1e-3
# Keras's momentum 0.99 keeps 99% of the moving average; PyTorch's momentum is the complement.
BN_MOMENTUM = 0.01


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class ConvModule(nn.Sequential):
    """Conv2D -> BatchNormalization -> ReLU, as the tutorial's conv_module."""

    def __init__(self, cin, filters, k, stride, padding):
        if padding == "same":
            # Keras 'same' with stride 1 and an odd kernel pads k // 2 on every side.
            assert stride == 1 and k % 2 == 1, "only stride-1, odd-kernel 'same' convs occur"
            pad = k // 2
        else:
            pad = 0
        super().__init__(
            nn.Conv2d(cin, filters, k, stride=stride, padding=pad, bias=True),
            nn.BatchNorm2d(filters, eps=BN_EPS, momentum=BN_MOMENTUM),
            nn.ReLU(inplace=True),
        )


class Inception(nn.Module):
    """A 1x1 and a 3x3 'same' conv module, concatenated on channels."""

    def __init__(self, cin, k1x1, k3x3):
        super().__init__()
        self.branch_1x1 = ConvModule(cin, k1x1, 1, 1, "same")
        self.branch_3x3 = ConvModule(cin, k3x3, 3, 1, "same")
        self.out_channels = k1x1 + k3x3

    def forward(self, x):
        return torch.cat([self.branch_1x1(x), self.branch_3x3(x)], 1)


class Downsample(nn.Module):
    """A 3x3 stride-2 'valid' conv module and a 3x3/2 max pool, concatenated on channels."""

    def __init__(self, cin, filters):
        super().__init__()
        self.branch_conv = ConvModule(cin, filters, 3, 2, "valid")
        self.branch_pool = nn.MaxPool2d(3, stride=2)
        self.out_channels = cin + filters

    def forward(self, x):
        return torch.cat([self.branch_conv(x), self.branch_pool(x)], 1)


STAGES = [
    ([(32, 32), (32, 48)], 80),
    ([(112, 48), (96, 64), (80, 80), (48, 96)], 96),
    ([(176, 160), (176, 160)], None),
]


class BasicBlock(nn.Module):
    """torchvision's basic block: two 3x3 convs with batch norms, the first with `stride`, added
    to the input or to a 1x1 projection of it, then a ReLU."""

    def __init__(self, cin, filters, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, filters, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(filters)
        self.conv2 = nn.Conv2d(filters, filters, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(filters)
        self.downsample = None
        if stride != 1 or cin != filters:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, filters, 1, stride=stride, bias=False), nn.BatchNorm2d(filters)
            )

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class CifarResNet18(nn.Module):
    """torchvision's ResNet-18 with the small-image stem kandle_models::ResNet::small_images
    builds: a 3x3 stride-1 convolution and no max pool (11,173,962 parameters for 10 classes)."""

    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        blocks, cin = [], 64
        for stage, filters in enumerate([64, 128, 256, 512]):
            for block in range(2):
                stride = 2 if block == 0 and stage > 0 else 1
                blocks.append(BasicBlock(cin, filters, stride))
                cin = filters
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = self.layers(F.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Bottleneck(nn.Module):
    """torchvision's bottleneck (ResNet v1.5, the stride on the 3x3): 1x1 to `width`, 3x3, 1x1
    to `4 * width`, each with a batch norm, added to the input or to a 1x1 projection of it."""

    def __init__(self, cin, width, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, 4 * width, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(4 * width)
        self.downsample = None
        if stride != 1 or cin != 4 * width:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, 4 * width, 1, stride=stride, bias=False), nn.BatchNorm2d(4 * width)
            )

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class ImageNetResNet(nn.Module):
    """torchvision's ImageNet ResNet: a 7x7 stride-2 stem padded by 3, a 3x3 stride-2 max pool
    padded by 1, four stages of `block`s, global average pooling and the classifier `fc`."""

    def __init__(self, bottleneck, blocks, classes=1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, cin = [], 64
        for stage, (count, width) in enumerate(zip(blocks, [64, 128, 256, 512])):
            for block in range(count):
                stride = 2 if block == 0 and stage > 0 else 1
                if bottleneck:
                    layers.append(Bottleneck(cin, width, stride))
                    cin = 4 * width
                else:
                    layers.append(BasicBlock(cin, width, stride))
                    cin = width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, stride=2, padding=1)
        x = self.layers(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def is_cifar(args):
    """CIFAR-10's networks: 32x32 images, except ResNet-50, always ImageNet's."""
    return args.image_size == 32 and args.model != "resnet50"


# Per model and CIFAR or not: the network, and the parameters (trainable and moving statistics)
# kandle's has.
MODELS = {
    ("mini_googlenet", True): (lambda: MiniGoogLeNet(10), KERAS_PARAMETERS),
    ("resnet18", True): (lambda: CifarResNet18(10), 11_173_962 + 2 * 4_800),
    ("resnet18", False): (lambda: ImageNetResNet(False, [2, 2, 2, 2]), 11_689_512 + 2 * 4_800),
    ("resnet50", False): (lambda: ImageNetResNet(True, [3, 4, 6, 3]), 25_557_032 + 2 * 26_560),
}


def model_entry(args):
    key = (args.model, is_cifar(args))
    if key not in MODELS:
        raise SystemExit(f"--model {args.model} takes 32x32 images only")
    return MODELS[key]


class MiniGoogLeNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        layers = [ConvModule(3, 96, 3, 1, "same")]
        channels = 96
        for modules, downsample in STAGES:
            for k1, k3 in modules:
                layers.append(Inception(channels, k1, k3))
                channels = layers[-1].out_channels
            if downsample is not None:
                layers.append(Downsample(channels, downsample))
                channels = layers[-1].out_channels
        layers += [nn.AvgPool2d(7), nn.Dropout(0.5), nn.Flatten(), nn.Linear(channels, classes)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def parameter_counts(model):
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    statistics_ = sum(
        m.running_mean.numel() + m.running_var.numel()
        for m in model.modules()
        if isinstance(m, nn.BatchNorm2d)
    )
    return trainable, statistics_


def samples(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(iters, 1)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_time(fn, warmup, iters):
    """Whole steps: the median."""
    return statistics.median(samples(fn, warmup, iters))


def fastest_time(fn, warmup, iters):
    """Single ops: the fastest run (a preempted thread stalls a parallel op, adding time only)."""
    return min(samples(fn, warmup, iters))


CONFIGS = {
    # name: (memory format, torch.compile, autocast dtype or None)
    "eager": (torch.contiguous_format, False, None),
    "channels_last": (torch.channels_last, False, None),
    "compile": (torch.contiguous_format, True, None),
    "channels_last+compile": (torch.channels_last, True, None),
    # Mixed precision: autocast to float16 with a GradScaler (what kandle's mixed_float16
    # does), or to bfloat16 without one.
    "channels_last+amp": (torch.channels_last, False, torch.float16),
    "channels_last+bf16": (torch.channels_last, False, torch.bfloat16),
}


def autocast(args, name):
    """The autocast context of configuration `name` (a no-op without one)."""
    dtype = CONFIGS[name][2]
    device_type = torch.device(args.device).type
    return torch.autocast(device_type, dtype=dtype, enabled=dtype is not None)


def time_config(args, name):
    """One configuration's training step and inference, each the median of `--iters` runs, and
    with `--frozen-base` the step with the base frozen."""
    model, net, opt, x, y = setup(args, name)
    compiled = CONFIGS[name][1]
    scaler = torch.amp.GradScaler(enabled=CONFIGS[name][2] == torch.float16)

    def train_step():
        opt.zero_grad(set_to_none=True)
        with autocast(args, name):
            out = net(x)
            loss = F.cross_entropy(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        correct = (out.argmax(1) == y).sum()
        return loss.item(), correct.item()

    def inference():
        with torch.inference_mode(), autocast(args, name):
            return F.softmax(net(x).float(), 1).cpu()

    # Compilation happens in the first calls: more warm-up for compiled configurations.
    warmup = args.warmup + (3 if compiled else 0)
    log(f"pytorch {name}: training step, batch {args.batch}")
    model.train()
    train = median_time(train_step, warmup, args.iters)
    log(f"pytorch {name}: inference, batch {args.batch}")
    model.eval()
    infer = median_time(inference, warmup, args.iters)
    result = {"name": name, "train_step_s": train, "inference_s": infer}
    if args.frozen_base:
        del net, opt
        result["train_step_frozen_base_s"] = time_frozen_base(args, name, warmup)
    return result


def time_frozen_base(args, name, warmup):
    """The step of transfer learning's first phase: every parameter frozen but the classifier's
    (the last module with parameters), the frozen batch norms in eval mode, as Keras runs a frozen
    BatchNormalization. The base runs under autograd as a user's model does; none of its inputs
    needs a gradient, so autograd records nothing there."""
    model, net, _, x, y = setup(args, name)
    head = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))][-1]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in head.parameters():
        p.requires_grad_(True)
    model.eval()
    opt = torch.optim.SGD(head.parameters(), lr=5e-3, momentum=0.9)

    def train_step():
        opt.zero_grad(set_to_none=True)
        with autocast(args, name):
            out = net(x)
            loss = F.cross_entropy(out.float(), y)
        loss.backward()
        opt.step()
        correct = (out.argmax(1) == y).sum()
        return loss.item(), correct.item()

    log(f"pytorch {name}: training step with the base frozen, batch {args.batch}")
    return median_time(train_step, warmup, args.iters)


def setup(args, name):
    """The model on the device in configuration `name`, its SGD and a random batch."""
    memory_format, compiled, _ = CONFIGS[name]
    torch.manual_seed(0)
    model = model_entry(args)[0]().to(args.device).to(memory_format=memory_format)
    size = args.image_size
    x = torch.randn(args.batch, 3, size, size, device=args.device)
    x = x.contiguous(memory_format=memory_format)
    classes = 10 if is_cifar(args) else 1000
    y = torch.randint(0, classes, (args.batch,), device=args.device)
    opt = torch.optim.SGD(model.parameters(), lr=5e-3, momentum=0.9)
    net = torch.compile(model) if compiled else model
    return model, net, opt, x, y


def time_epoch(args, name):
    """Seconds of `--epoch-images` images of training steps in configuration `name`: full
    batches of random images already on the device, then a short last one; the loss is read
    back after every step, as `fit` does."""
    model, net, opt, x, y = setup(args, name)
    model.train()
    full, rest = divmod(args.epoch_images, args.batch)

    def step(xb, yb):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(xb), yb)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(args.warmup + (3 if CONFIGS[name][1] else 0)):
        step(x, y)
    log(f"pytorch {name}: an epoch of {args.epoch_images} images")
    start = time.perf_counter()
    for _ in range(full):
        step(x, y)
    if rest:
        step(x[:rest], y[:rest])
    return {"config": name, "images": args.epoch_images, "seconds": time.perf_counter() - start}


def time_model(args):
    torch.manual_seed(0)
    make, parameters = model_entry(args)
    trainable, moving = parameter_counts(make())
    if trainable + moving != parameters:
        raise SystemExit(
            f"PyTorch's {args.model} has {trainable + moving} parameters, "
            f"kandle's has {parameters}"
        )
    configs = []
    for name in args.configs.split(","):
        if name not in CONFIGS:
            raise SystemExit(f"unknown configuration {name!r}: one of {', '.join(CONFIGS)}")
        try:
            configs.append(time_config(args, name))
        except Exception as e:  # noqa: BLE001 - a configuration that cannot run is reported
            log(f"pytorch {name}: failed: {e}")
            configs.append({"name": name, "error": f"{type(e).__name__}: {e}"[:300]})
    return {
        "trainable_parameters": trainable,
        "non_trainable_parameters": moving,
        "configs": configs,
    }


def synchronized(fn, device):
    """`fn`, then waiting for `device`'s queued work (on a GPU), so that a run's time is the
    device's."""
    if device.type != "cuda":
        return fn

    def run():
        fn()
        torch.cuda.synchronize(device)

    return run


def passes(forward, make_inputs, params, warmup, iters, device, split=False):
    """Forward alone, forward+backward with the inputs' gradients on and, with `split`, off.

    `forward(inputs)` runs the op; `make_inputs(requires_grad)` gives its input tensors. The
    upstream gradient is all ones, as in kandle's measurement. Returns the three times
    (the last is None without `split`).
    """
    plain = make_inputs(False)
    tracked = make_inputs(True)
    with torch.no_grad():
        ones = torch.ones_like(forward(plain))

    def backward(inputs):
        for p in params:
            p.grad = None
        for t in inputs:
            t.grad = None
        forward(inputs).backward(ones)

    def timed(fn):
        return fastest_time(synchronized(fn, device), warmup, iters)

    fwd = timed(lambda: forward(plain))
    with_input = timed(lambda: backward(tracked))
    without_input = timed(lambda: backward(plain)) if split else None
    return fwd, with_input, without_input


def time_op(op, batch, warmup, iters, device):
    kind = op["kind"]
    shape = [batch] + op["input"] if "input" in op else None

    def one(requires_grad, dims=None):
        return [torch.randn(*(dims or shape), device=device).requires_grad_(requires_grad)]

    if kind == "conv":
        pt, pb, pl, pr = op["pad"]
        sh, sw = op["stride"]
        conv = nn.Conv2d(
            op["input"][0],
            op["filters"],
            tuple(op["kernel"]),
            stride=(sh, sw),
            bias=op.get("bias", True),
        ).to(device)
        if pt == pb and pl == pr:
            conv.padding = (pt, pl)
            forward = lambda xs: conv(xs[0])  # noqa: E731
        else:
            forward = lambda xs: conv(F.pad(xs[0], (pl, pr, pt, pb)))  # noqa: E731
        fwd, both, weight = passes(
            forward, one, list(conv.parameters()), warmup, iters, device, split=True
        )
        return {"fwd": fwd, "bwd_weight": weight - fwd, "bwd_input": both - weight}
    if kind == "batch_norm":
        bn = nn.BatchNorm2d(op["input"][0], eps=BN_EPS, momentum=BN_MOMENTUM).to(device).train()
        forward = lambda xs: bn(xs[0])  # noqa: E731
        fwd, both, _ = passes(forward, one, list(bn.parameters()), warmup, iters, device)
        return {"fwd": fwd, "bwd": both - fwd}
    if kind in ("max_pool", "avg_pool"):
        window, stride = tuple(op["window"]), tuple(op["stride"])
        pad = tuple(op.get("pad", [0, 0]))
        pool = F.max_pool2d if kind == "max_pool" else F.avg_pool2d
        forward = lambda xs: pool(xs[0], window, stride, pad)  # noqa: E731
        fwd, both, _ = passes(forward, one, [], warmup, iters, device)
        return {"fwd": fwd, "bwd": both - fwd}
    if kind == "concat":
        parts = [[batch] + p for p in op["parts"]]

        def inputs(requires_grad):
            return [torch.randn(*p, device=device).requires_grad_(requires_grad) for p in parts]

        forward = lambda xs: torch.cat(xs, 1)  # noqa: E731
        fwd, both, _ = passes(forward, inputs, [], warmup, iters, device)
        return {"fwd": fwd, "bwd": both - fwd}
    raise SystemExit(f"unknown op kind {kind!r}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ops", help="JSON list of ops to time (a file, or - for stdin)")
    parser.add_argument("--no-model", action="store_true", help="time only the ops")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    parser.add_argument(
        "--model",
        default="mini_googlenet",
        choices=sorted({m for m, _ in MODELS}),
        help="the model to time (default mini_googlenet)",
    )
    parser.add_argument(
        "--image-size",
        type=int,
        default=32,
        help="height and width of the images (32, CIFAR-10's, by default; other sizes take "
        "ImageNet's ResNets)",
    )
    parser.add_argument(
        "--frozen-base",
        action="store_true",
        help="also time the training step with every layer frozen but the classifier",
    )
    parser.add_argument(
        "--epoch-images",
        type=int,
        default=0,
        help="also time this many images of training steps in the fastest configuration",
    )
    parser.add_argument(
        "--configs",
        default=",".join(name for name, c in CONFIGS.items() if c[2] is None),
        help="comma-separated configurations of the model to time (default: the float32 ones): "
        + ", ".join(CONFIGS),
    )
    args = parser.parse_args()
    args.device = torch.device(args.device)

    torch.set_num_threads(args.threads)
    result = {
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "batch": args.batch,
        "device": str(args.device),
    }
    if args.device.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(args.device)
        result["cudnn"] = torch.backends.cudnn.version()
        # At its best in float32: cuDNN times its algorithms per shape (benchmark mode), and
        # float32 stays float32 (TF32, on by default for convolutions, is a lower precision:
        # kandle's side computes in float32 throughout).
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    if not args.no_model:
        result["model"] = time_model(args)
        timed = [c for c in result["model"]["configs"] if "train_step_s" in c]
        if args.epoch_images and timed:
            fastest = min(timed, key=lambda c: c["train_step_s"])["name"]
            result["epoch"] = time_epoch(args, fastest)
    if args.ops:
        ops = json.load(sys.stdin if args.ops == "-" else open(args.ops))
        timed = []
        for op in ops:
            log(f"pytorch: {op['name']}")
            torch.manual_seed(0)
            times = time_op(op, args.batch, args.warmup, args.iters, args.device)
            timed.append({"name": op["name"], **times})
        result["ops"] = timed
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
