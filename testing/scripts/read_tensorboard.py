#!/usr/bin/env python3
"""Reads a TensorBoard log directory with TensorBoard's own reader (EventAccumulator) and
prints what it found as JSON: for each run (`train`, `validation`), each scalar tag's
`[step, value]` pairs and each histogram tag's `[step, count]` pairs.

    python3 testing/scripts/read_tensorboard.py LOG_DIR

kandle's `tests/tensorboard.rs` runs it when `python3` (or `$KANDLE_TENSORBOARD_PYTHON`) can import `tensorboard` (`.ci/run`
installs it) and compares its answer with what kandle wrote.
"""
import json
import sys

from tensorboard.backend.event_processing import event_accumulator


def read_run(path):
    acc = event_accumulator.EventAccumulator(
        path,
        size_guidance={
            event_accumulator.SCALARS: 0,
            event_accumulator.HISTOGRAMS: 0,
            event_accumulator.TENSORS: 0,
        },
    )
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [[e.step, e.value] for e in acc.Scalars(t)] for t in tags["scalars"]}
    histograms = {
        t: [[e.step, e.histogram_value.num] for e in acc.Histograms(t)]
        for t in tags["histograms"]
    }
    return {"scalars": scalars, "histograms": histograms}


def main():
    root = sys.argv[1]
    print(json.dumps({run: read_run(f"{root}/{run}") for run in ("train", "validation")}))


if __name__ == "__main__":
    main()
