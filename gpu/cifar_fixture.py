#!/usr/bin/env python3
"""Writes CIFAR-10-format binaries of random images for timing an epoch where CIFAR-10 cannot be
downloaded: data_batch_1.bin to data_batch_5.bin (10,000 records each, 50,000 in all) and
test_batch.bin (10,000), each record a label byte (0-9) then 3,072 pixel bytes.

    python3 gpu/cifar_fixture.py DIR [--per-file 10000]

The images are noise and the labels random: the files time an epoch, they teach nothing.
"""

import argparse
import os
import random

RECORD = 1 + 3 * 32 * 32


def write(path, records, rng):
    data = bytearray(os.urandom(records * RECORD))
    data[::RECORD] = bytes(rng.randrange(10) for _ in range(records))
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--per-file", type=int, default=10_000)
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    rng = random.Random(0)
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    for name in names:
        write(os.path.join(args.dir, name), args.per_file, rng)
    print(f"{len(names)} files of {args.per_file} records in {args.dir}")


if __name__ == "__main__":
    main()
