#!/usr/bin/env bash
# Builds, on a machine with cargo, what the GPU run (run.sh) needs into .gpu-kit/ at the
# repository root (ignored): the GPU test binaries, qccl-perf, qccl-gpu-bench and the Python
# wheel, stripped of debug info so the kit travels to a GPU machine that has no Rust
# toolchain (the lent GPU machines take at most 64 MiB with the working tree).
#
#   perf-tests/gpu/pack.sh        # then, on the GPU machine: perf-tests/gpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
kit=.gpu-kit
rm -rf "$kit"
mkdir -p "$kit/bin"

# Test binaries by name, from cargo's JSON messages (their file names carry a hash).
tests=(--test gpu_driver --test gpu_emulated --test kernels_nvrtc --test dense_on_device)
cargo test -p qccl "${tests[@]}" --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        shutil.copy(m["executable"], sys.argv[1] + "/" + m["target"]["name"])
        print("test binary:", m["target"]["name"])
' "$kit/bin"
cargo build --release -p qccl-perf-tests --bin qccl-perf --bin qccl-gpu-bench
cp target/release/qccl-perf target/release/qccl-gpu-bench "$kit/bin/"
strip --strip-debug "$kit"/bin/*

# The Python package (abi3 wheel) for the torch CUDA tests and the gloo comparison.
py=${PYTHON:-.venv/bin/python}
"$py" -m pip wheel -q --no-deps -w "$kit" ./python
ls -la "$kit" "$kit/bin"
du -sh "$kit"
