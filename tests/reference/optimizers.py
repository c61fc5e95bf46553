"""Reference values for `tests/optimizers.rs`, computed by PyTorch's `torch.optim`.

Runs five steps of each optimizer configuration on two small parameter tensors with fixed,
hard-coded gradients (no randomness), in float64 on the CPU, and prints the parameters after
every step as Rust constants. Paste the output into the generated block of
`tests/optimizers.rs`.

    pip install torch
    python3 tests/reference/optimizers.py > /tmp/reference.rs

The values in `tests/optimizers.rs` were produced with torch 2.15.0 (the PyPI wheel, run on
the CPU).

Each row of an expected-value table is one step: the six values of `w` (shape (2, 3),
row-major) followed by the three values of `b` (shape (3,)).
"""

import torch

torch.set_default_dtype(torch.float64)

W0 = [[0.5, -1.0, 2.0], [0.0, 1.5, -0.25]]
B0 = [0.1, -0.2, 0.3]

# One gradient per step, written out so that the Rust test uses exactly the same numbers.
GRADS_W = [
    [[0.1, -0.2, 0.3], [-0.4, 0.5, 0.0]],
    [[0.2, 0.1, -0.3], [0.05, -0.5, 1.0]],
    [[-0.3, 0.4, 0.25], [0.0, 0.3, -0.6]],
    [[0.15, -0.05, 0.0], [0.7, -0.2, 0.4]],
    [[-0.1, 0.2, -0.35], [0.25, 0.1, -0.15]],
]
GRADS_B = [
    [0.5, -0.5, 0.05],
    [-0.25, 0.75, 0.0],
    [0.125, -0.1, 0.2],
    [0.3, 0.0, -0.4],
    [-0.6, 0.2, 0.1],
]

# Learning rates per step for the "schedule" configurations; the others use one rate throughout.
SCHEDULE = [0.1, 0.05, 0.025, 0.0125, 0.00625]

SGD = torch.optim.SGD
ADAM = torch.optim.Adam
ADAMW = torch.optim.AdamW

# (Rust constant name, description, optimizer factory, learning rate per step)
CONFIGS = [
    ("SGD", "SGD, lr 0.1", lambda p: SGD(p, lr=0.1), None),
    ("SGD_MOMENTUM", "SGD, lr 0.1, momentum 0.9", lambda p: SGD(p, lr=0.1, momentum=0.9), None),
    (
        "SGD_NESTEROV",
        "SGD, lr 0.1, momentum 0.9, Nesterov",
        lambda p: SGD(p, lr=0.1, momentum=0.9, nesterov=True),
        None,
    ),
    (
        "SGD_MOMENTUM_WD",
        "SGD, lr 0.1, momentum 0.9, weight decay 1e-2",
        lambda p: SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2),
        None,
    ),
    (
        "SGD_NESTEROV_WD",
        "SGD, lr 0.1, momentum 0.9, Nesterov, weight decay 1e-2",
        lambda p: SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
        None,
    ),
    (
        "SGD_MOMENTUM_SCHEDULE",
        "SGD, momentum 0.9, lr per step from SCHEDULE",
        lambda p: SGD(p, lr=SCHEDULE[0], momentum=0.9),
        SCHEDULE,
    ),
    (
        "ADAM",
        "Adam, lr 0.1, betas (0.9, 0.999), eps 1e-7",
        lambda p: ADAM(p, lr=0.1, betas=(0.9, 0.999), eps=1e-7),
        None,
    ),
    (
        "ADAM_BETAS_EPS",
        "Adam, lr 0.1, betas (0.8, 0.99), eps 1e-2 (large, so where eps is added matters)",
        lambda p: ADAM(p, lr=0.1, betas=(0.8, 0.99), eps=1e-2),
        None,
    ),
    (
        "ADAM_WD",
        "Adam, lr 0.1, betas (0.9, 0.999), eps 1e-7, weight decay (L2) 1e-2",
        lambda p: ADAM(p, lr=0.1, betas=(0.9, 0.999), eps=1e-7, weight_decay=1e-2),
        None,
    ),
    (
        "ADAM_SCHEDULE",
        "Adam, betas (0.9, 0.999), eps 1e-7, lr per step from SCHEDULE",
        lambda p: ADAM(p, lr=SCHEDULE[0], betas=(0.9, 0.999), eps=1e-7),
        SCHEDULE,
    ),
    (
        "ADAMW",
        "AdamW, lr 0.1, betas (0.9, 0.999), eps 1e-7, decoupled weight decay 1e-2",
        lambda p: ADAMW(p, lr=0.1, betas=(0.9, 0.999), eps=1e-7, weight_decay=1e-2),
        None,
    ),
    (
        "ADAMW_DEFAULT_WD",
        "AdamW, lr 0.1, betas (0.9, 0.999), eps 1e-7, decoupled weight decay 0.004 (Keras default)",
        lambda p: ADAMW(p, lr=0.1, betas=(0.9, 0.999), eps=1e-7, weight_decay=0.004),
        None,
    ),
    (
        "ADAMW_SCHEDULE",
        "AdamW, betas (0.9, 0.999), eps 1e-7, weight decay 1e-2, lr per step from SCHEDULE",
        lambda p: ADAMW(p, lr=SCHEDULE[0], betas=(0.9, 0.999), eps=1e-7, weight_decay=1e-2),
        SCHEDULE,
    ),
]


def lit(x):
    """A float as a Rust literal that parses back to the same f64."""
    s = repr(float(x))
    return s if ("." in s or "e" in s or "inf" in s or "nan" in s) else s + ".0"


def row(values):
    return "[" + ", ".join(lit(v) for v in values) + "]"


def table(name, rows, width, doc):
    lines = [f"/// {doc}", "#[rustfmt::skip]", f"const {name}: [[f64; {width}]; {len(rows)}] = ["]
    lines += [f"    {row(r)}," for r in rows]
    lines.append("];")
    return "\n".join(lines)


def run(factory, lrs):
    w = torch.tensor(W0, requires_grad=True)
    b = torch.tensor(B0, requires_grad=True)
    opt = factory([w, b])
    out = []
    for step, (gw, gb) in enumerate(zip(GRADS_W, GRADS_B)):
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[step]
        w.grad = torch.tensor(gw)
        b.grad = torch.tensor(gb)
        opt.step()
        out.append(w.detach().flatten().tolist() + b.detach().tolist())
    return out


def main():
    flat = lambda rows: [sum(r, []) for r in rows]
    print(f"// Generated by tests/reference/optimizers.py with torch {torch.__version__}, float64.")
    print("// Do not edit by hand: rerun the script and paste its output.")
    print()
    print(table("W0", [sum(W0, [])], 6, "Initial `w`, shape (2, 3), row-major.")
          .replace("[[f64; 6]; 1] = [\n    ", "[f64; 6] = ").replace(",\n];", ";"))
    print(table("B0", [B0], 3, "Initial `b`, shape (3,).")
          .replace("[[f64; 3]; 1] = [\n    ", "[f64; 3] = ").replace(",\n];", ";"))
    print(table("GRADS_W", flat(GRADS_W), 6, "Gradient of `w` at each step, row-major."))
    print(table("GRADS_B", GRADS_B, 3, "Gradient of `b` at each step."))
    print(f"/// Learning rate at each step for the `*_SCHEDULE` configurations.")
    print("#[rustfmt::skip]")
    print(f"const SCHEDULE: [f64; {len(SCHEDULE)}] = {row(SCHEDULE)};")
    for name, doc, factory, lrs in CONFIGS:
        print(table(name, run(factory, lrs), 9, f"{doc}: `w` (6 values) then `b` (3) after each step."))


if __name__ == "__main__":
    main()
