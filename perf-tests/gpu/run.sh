#!/usr/bin/env bash
# Runs qccl's GPU suite and its GPU figures on a machine with an NVIDIA GPU, from the kit
# pack.sh built (.gpu-kit/ at the repository root; no cargo needed here). Everything lands in
# $OUT (default gpu-out/), three files: suite.log (the ignored GPU tests, QCCL_REQUIRE_GPU=1:
# a missing GPU fails), figures.txt (every table) and json.tgz (the figures as JSON).
#
#   perf-tests/gpu/run.sh suite              # the GPU tests (at most ~5 minutes)
#   perf-tests/gpu/run.sh figures [quick]    # the figures (at most ~10; quick: smaller sizes)
#   perf-tests/gpu/run.sh all [quick]        # both, one after the other
#   perf-tests/gpu/run.sh diagnose           # the known GPU hangs, with short comm timeouts
#   QCCL_GPU_EMULATE=1 perf-tests/gpu/run.sh all smoke   # the script itself, here (no figure)
#
# Each step has its own time limit, so a hung test cannot eat a lent machine's minutes; the
# two parts each fit one call of the device tool (10 minutes).
#
# Figures (issue #22): the kernels against the device's copy bandwidth (qccl-gpu-bench);
# all_reduce busbw on device vs host buffers at 2 and 4 ranks sharing the GPU (qccl-perf),
# dense (staged, and over CUDA IPC) and compressed (SRA; the ring at 4 ranks); across two
# emulated hosts, the dense and the compressed hierarchical all-reduce and HiTopKComm;
# torch.distributed on CUDA tensors, backend gloo vs qccl, same run (perf-tests/peers).
set -uo pipefail
cd "$(dirname "$0")/../.."
kit=$PWD/.gpu-kit
out=${OUT:-$PWD/gpu-out}
json=$out/json
mkdir -p "$json"
part=${1:-all}
quick=${2:-}
case $part in suite | figures | all | diagnose) ;; *) echo "usage: $0 suite|figures|all|diagnose [quick|smoke]" >&2; exit 2 ;; esac
export QCCL_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
log=$out/suite.log
fig=$out/figures.txt

# NVRTC: the CUDA toolkit's, else a pip wheel's (nvidia-cuda-nvrtc).
if [ -z "${QCCL_NVRTC_LIB:-}" ]; then
    lib=$(find /usr/local/cuda*/lib64 /usr/local/cuda*/targets /opt /usr/lib -name 'libnvrtc.so.1[23]*' 2>/dev/null | head -1)
    [ -n "$lib" ] && export QCCL_NVRTC_LIB=$(dirname "$lib")
fi
{
    echo "# $(date -u '+%Y-%m-%d %H:%M UTC') on $(hostname)"
    nvidia-smi --query-gpu=name,pci.bus_id,driver_version,memory.total --format=csv
    echo "QCCL_NVRTC_LIB=${QCCL_NVRTC_LIB:-}"
} | tee "$fig" "$log"

step() { # name, limit (s), command...: runs it, appends its output to the log, notes its status
    local name=$1 limit=$2
    shift 2
    echo "== $name" | tee -a "$log"
    local t0=$SECONDS
    timeout "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$log"
}

if ls "$kit"/qccl-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/qccl-site "$kit"/qccl-*.whl
    export PYTHONPATH=/tmp/qccl-site
fi

# The hangs seen on an H200 and not on the emulated driver (run 3, 2026-11-28), each with a
# comm timeout (QCCL_TIMEOUT_MS) shorter than its step's limit, so that the host side's wait
# fails with a message naming what it waited for (the exchange, the progress word, the
# call's events); a process still alive after 30 s gets its threads' stacks dumped (gdb).
if [ "$part" = diagnose ]; then
    hang_step() { # name, command...
        local name=$1
        shift
        echo "== $name" | tee -a "$log"
        local t0=$SECONDS
        QCCL_TIMEOUT_MS=15000 QCCL_DEBUG=INFO timeout 50 "$@" >>"$log" 2>&1 &
        local pid=$!
        for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null && sleep 0.5; done
        if kill -0 "$pid" 2>/dev/null && command -v gdb >/dev/null; then
            for p in $(pgrep -f "$(basename "$2")"); do
                echo "-- stacks of $p" >>"$log"
                timeout 10 gdb -p "$p" -batch -ex "thread apply all bt 12" >>"$log" 2>&1
            done
        fi
        wait "$pid"
        echo "== $name: rc=$? in $((SECONDS - t0)) s" | tee -a "$log"
    }
    z=qsgd:bits=4,bucket=128
    hang_step "flat qsgd on a stream, 16 MiB" "$kit/bin/qccl-perf" -np 2 --device cuda -Z "$z" \
        -b 16M -e 16M -n 10 -w 10 -c 1
    hang_step "flat qsgd on a stream, 16 MiB, no check" "$kit/bin/qccl-perf" -np 2 --device cuda \
        -Z "$z" -b 16M -e 16M -n 10 -w 10 -c 0
    hang_step "flat qsgd, NULL stream, 16 MiB" "$kit/bin/qccl-perf" -np 2 --device cuda -y 1 \
        -Z "$z" -b 16M -e 16M -n 10 -w 10 -c 1
    for t in "gpu_emulated the_callers_stream_orders_the_call_on_a_real_gpu" \
        "gpu_driver compressed_all_reduce_on_cudarc_slices" "gpu_driver codec_plans_match_rust"; do
        set -- $t
        hang_step "$t" "$kit/bin/$1" --ignored --exact "$2" --nocapture
    done
    exit 0
fi

# The GPU suite, one test at a time (ranks of one test share the GPU).
if [ "$part" != figures ]; then
    for t in kernels_nvrtc gpu_driver gpu_emulated dense_on_device; do
        step "$t --ignored" 75 "$kit/bin/$t" --ignored --test-threads=1
    done
    [ -n "${PYTHONPATH:-}" ] &&
        step "python tests on CUDA tensors" 75 python3 -m pytest -q -x python/tests/test_device.py
fi
if [ "$part" = suite ]; then
    tar czf "$out/json.tgz" -C "$json" . && rm -rf "$json"
    exit 0
fi

# Kernels against the device's copy bandwidth.
size=256M; big=256M; iters=20
[ "$quick" = quick ] && { size=64M; big=64M; iters=10; }
[ "$quick" = smoke ] && { size=64K; big=4M; iters=1; }
step "qccl-gpu-bench" 90 "$kit/bin/qccl-gpu-bench" -b "$size" -n "$iters" -J "$json/gpu_bench.json"
sed -n '/^# qccl-gpu-bench/,/^== qccl-gpu-bench: rc/p' "$log" | grep -v '^==' >>"$fig"

# all_reduce busbw: device buffers vs host buffers, same run, ranks sharing the GPU. As many
# warm-up calls as timed ones: calls enqueued on a stream take page-locked buffers from the
# comm's pool, which pins new ones (milliseconds per MiB) until it holds a timed loop's worth;
# with fewer warm-ups the timed loop paid for that pinning (first H200 run, 2026-11-27).
for np in 2 4; do
    for dev in cuda host; do
        step "qccl-perf -np $np --device $dev" 45 "$kit/bin/qccl-perf" -np "$np" -b 1M -e "$big" \
            -f 4 -n "$iters" -w "$iters" -c 1 --device "$dev" -J "$json/perf_${dev}_np$np.json"
        sed -n "/^== qccl-perf -np $np --device $dev\$/,/rc=/p" "$log" >>"$fig"
    done
done

# The same dense all_reduce on device buffers over CUDA IPC (QCCL_CUDA_IPC=1, since
# 2026-11-27): the ranks reduce through each other's mapped GPU memory, no host staging.
for np in 2 4; do
    step "qccl-perf -np $np --device cuda QCCL_CUDA_IPC=1" 45 env QCCL_CUDA_IPC=1 \
        "$kit/bin/qccl-perf" -np "$np" -b 1M -e "$big" -f 4 -n "$iters" -w "$iters" -c 1 \
        --device cuda -J "$json/perf_ipc_np$np.json"
    sed -n "/^== qccl-perf -np $np --device cuda QCCL_CUDA_IPC=1\$/,/rc=/p" "$log" >>"$fig"
done

# The same dense all_reduce on the NULL stream (-y 1, since 2026-11-28): each call returns
# once done, and the ranks sharing the host go through their shared-memory arena, the GPU
# copying straight into and out of its page-locked segments, the copies overlapping the rounds.
for np in 2 4; do
    step "qccl-perf -np $np --device cuda -y 1" 45 "$kit/bin/qccl-perf" -np "$np" -b 1M \
        -e "$big" -f 4 -n "$iters" -w "$iters" -c 1 --device cuda -y 1 \
        -J "$json/perf_null_np$np.json"
    sed -n "/^== qccl-perf -np $np --device cuda -y 1\$/,/rc=/p" "$log" >>"$fig"
done

# Compressed all_reduce (qsgd 4-bit): on device buffers its codecs run on the GPU and only
# encoded bytes cross PCIe; against the same call on host buffers (CPU codecs), same run.
z=qsgd:bits=4,bucket=128
for np in 2 4; do
    for dev in cuda host; do
        step "qccl-perf -np $np --device $dev -Z $z" 45 "$kit/bin/qccl-perf" -np "$np" -b 1M \
            -e "$big" -f 4 -n "$iters" -w "$iters" -c 1 --device "$dev" -Z "$z" \
            -J "$json/perf_z_${dev}_np$np.json"
        sed -n "/^== qccl-perf -np $np --device $dev -Z $z\$/,/rc=/p" "$log" >>"$fig"
    done
done

# The same codec on the ring, 4 ranks: every hop decodes, adds and re-encodes on the GPU
# (since 2026-11-27; before, the ring was staged through the CPU codecs).
for dev in cuda host; do
    step "qccl-perf -np 4 --device $dev -Z $z -A ring" 45 "$kit/bin/qccl-perf" -np 4 -b 1M \
        -e "$big" -f 4 -n "$iters" -w "$iters" -c 1 --device "$dev" -Z "$z" -A ring \
        -J "$json/perf_zring_${dev}_np4.json"
    sed -n "/^== qccl-perf -np 4 --device $dev -Z $z -A ring\$/,/rc=/p" "$log" >>"$fig"
done

# Across two emulated hosts of two ranks (--hosts 2, since 2026-11-28), against the same
# calls on host buffers, same run (64 MiB at most: these bound the part).
hz=64M
[ "$quick" = smoke ] && hz=4M

# One row across emulated hosts: qccl-perf with the arguments after the JSON file's name,
# 1 MiB to $hz, as step "qccl-perf <arguments>", its log appended to the figures.
hosts_row() {
    local name=$1
    shift
    step "qccl-perf $*" 45 "$kit/bin/qccl-perf" "$@" -b 1M -e "$hz" -f 4 -n "$iters" \
        -w "$iters" -c 1 -J "$json/$name.json"
    sed -n "/^== qccl-perf $*\$/,/rc=/p" "$log" >>"$fig"
}

# The dense all-reduce takes the hierarchical route: device buffers staged piece by piece,
# the copies of one piece overlapping the levels of another (before, staged whole), on
# qccl-perf's stream and on the NULL one.
for how in "" "-y 1"; do
    for dev in cuda host; do
        [ "$dev" = host ] && [ -n "$how" ] && continue
        # shellcheck disable=SC2086 # $how holds the flags
        hosts_row "perf_hosts_dense${how:+_null}_${dev}_np4" -np 4 --hosts 2 --device "$dev" $how
    done
done

# Four hosts of one rank: the dense all-reduce runs SRA over the sockets, on device buffers
# staged in bands of slices (since 2026-11-28; before, staged whole).
for dev in cuda host; do
    hosts_row "perf_hosts4_dense_${dev}_np4" -np 4 --hosts 4 --device "$dev"
done

# Two hosts of one rank: the ring over the sockets, staged in bands of slices (since
# 2026-11-28; before, staged whole).
for dev in cuda host; do
    hosts_row "perf_hosts2_dense_${dev}_np2" -np 2 --hosts 2 --device "$dev"
done

# Reduce-scatter and all-gather across two hosts of two ranks: the ring, staged in bands of
# slices (since 2026-11-28; before, staged whole).
for coll in reduce_scatter all_gather; do
    for dev in cuda host; do
        hosts_row "perf_hosts_${coll}_${dev}_np4" -np 4 --hosts 2 --device "$dev" --coll "$coll"
    done
done

# On qccl-perf's stream, the compressed all-reduce on the hierarchical route has no GPU path:
# staged piece by piece, the CPU codecs encoding (since 2026-11-28; before, staged whole).
hosts_row perf_hosts_zstream_cuda_np4 -np 4 --hosts 2 --device cuda -Z "$z"

# NULL stream: the compressed all-reduce takes the hierarchical route with the codecs on the
# GPU and the intra-host levels through the arena; HiTopKComm runs its top-k and
# scatter-add on the GPU.
for what in "-Z $z" "--coll hitopk --density 0.01"; do
    tag=$(echo "$what" | tr -c 'a-z0-9\n' '_' | tr -s '_' | sed 's/^_//')
    for dev in cuda host; do
        # shellcheck disable=SC2086 # $what holds the flags
        hosts_row "perf_hosts_${tag}_${dev}_np4" -np 4 --hosts 2 --device "$dev" -y 1 $what
    done
done

# torch.distributed on CUDA tensors: gloo vs qccl's backend, same run.
if [ -n "${PYTHONPATH:-}" ]; then
    for np in 2 4; do
        for be in gloo qccl; do
            step "torch $be -np $np cuda" 45 python3 perf-tests/peers/gloo_perf.py -np "$np" \
                -b 1M -e "$big" -f 4 -n "$iters" -w "$iters" -T 0.5 --device cuda --backend "$be" \
                -J "$json/torch_${be}_np$np.json"
            sed -n "/^== torch $be -np $np cuda\$/,/rc=/p" "$log" >>"$fig"
        done
    done
fi
tar czf "$out/json.tgz" -C "$json" . && rm -rf "$json"
echo "# done $(date -u '+%H:%M:%S UTC')" | tee -a "$fig"
