#!/usr/bin/env bash
# ResNet-18's parity test, run again once with the float64 steps it asks for.
#
#   bash gpu/parity.sh TEST_BINARY [TEST ARGS...]
#
# KANDLE_TORCHVISION_PARITY names the directory bench/torchvision_resnet_parity.py wrote. When a
# float32 run takes several ReLU kinks together, the test judges it by the sum of their single
# effects and asks for float64's step with all of them taken (models/tests/torchvision_weights.rs):
# this writes those files with the command the test printed, then runs the test again.
set -uo pipefail
PYTHON=${PYTHON:-python3}
log=$(mktemp)
"$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
command=$(grep -m1 '^  python3 bench/torchvision_resnet_parity.py' "$log")
rm -f "$log"
if [[ $rc == 0 || -z $command ]]; then
  exit "$rc"
fi
echo "=== writing the float64 steps the test asked for"
read -ra words <<< "${command#  python3 }"
"$PYTHON" "${words[@]}" || exit $?
"$@"
