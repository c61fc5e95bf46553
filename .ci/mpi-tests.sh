#!/usr/bin/env bash
# Multi-process tests: builds kandle-strategies with the `mpi` feature and runs the tests that
# launch `mpirun` (testing/tests/multi_worker.rs: `-n 2`; testing/tests/parameter_server.rs:
# `-n 2` to `-n 5`, and one `-n 10` that fails at once), plus the feature's unit and doc tests.
# Installs nothing: it needs Open MPI (`openmpi-bin`, `libopenmpi-dev`) and `libclang-dev`.
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TERM_COLOR=never
# Open MPI refuses to run as root without these (CI runs as root); harmless otherwise.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

if ! command -v mpirun >/dev/null; then
    echo "mpirun not found: install openmpi-bin, libopenmpi-dev and libclang-dev" >&2
    exit 1
fi
echo "== $(mpirun --version | head -n 1)"

# Every command selects the whole workspace with MPI added to the crates that have it, so they
# share one build, and the crates MPI does not change keep the features (and the build) of the
# README's `cargo test --workspace` before it. (Selecting packages with `-p` resolved features
# per selection: three selections, three builds of kandle, 12 minutes on a 2-core machine.)
features=kandle-strategies/mpi,kandle-testing/mpi,kandle-examples/mpi

echo "== cargo test --features mpi: every crate's unit tests (kandle-strategies' with MPI); kandle-testing's multi-worker, parameter-server, resume and pipeline tests"
cargo test --workspace --features "$features" --lib
# The multi-worker tests serialise their mpirun launches themselves; one test thread keeps the
# timings they assert meaningful on a small machine.
cargo test --workspace --features "$features" --test multi_worker --test parameter_server \
  --test mpi_resume --test pipeline_mpi -- --test-threads=1

echo "== quickstart under mpirun (kandle-examples: 3 ranks with a parameter server, 2 pipeline stages)"
cargo test --workspace --features "$features" --test quickstart_parameter_server --test quickstart_pipeline

echo "== kandle-strategies' doc tests with MPI"
cargo test --workspace --features "$features" --doc -- strategies/src/
