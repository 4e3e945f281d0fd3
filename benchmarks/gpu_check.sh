#!/usr/bin/env bash
# The GPU checks (issue 30) in one run, on a machine with a CUDA GPU and a CUDA build of torch already installed
# (no network needed): install psd against that torch, the GPU tests, cudaHostRegister of a /dev/shm mapping,
# a real job (benchmarks/gpu_job.py), psd bench's GPU round trip, then the whole suite. Each step has its own
# time limit, so one slow step cannot eat the others' time, and the suite gets what is left of DEADLINE_S
# (default 540) seconds; everything is logged under $OUT (default /tmp/psd-gpu-check).
#
#     bash benchmarks/gpu_check.sh            # from the repository root
#     STEPS="tests job suite" LEARNERS=1,2,8 bash benchmarks/gpu_check.sh   # some steps only (install always)
#
# Steps: tests (tests/test_device.py alone on the machine, then its no-wait step test OVERLAP_RUNS more times
# for a median), stages (the pipeline-stage and example tests with a GPU present: test_partial.py,
# test_stages.py, test_examples.py; the two-GPU pipeline test needs two GPUs), register, job, bench, kernels
# (benchmarks/optim_kernels.py on the GPU host's cores: the server's update bounds a one-learner GPU job; sizes
# KERNEL_SIZES, default 1e7,1e8, threads KERNEL_THREADS, default 1,4,all), cpubench (psd bench's CPU round
# trips and training against Hogwild with a copy, 2 and 8 learners, on cores enough for a learner each and
# the update loop: the 2-core VM has them share; sizes CPUBENCH_SIZES, default "10000 1000000 10000000", time
# limit CPUBENCH_TIMEOUT, default 300 s; then round trips alone and the kernels at CPUBENCH_LARGE, default 1e8,
# limit CPUBENCH_LARGE_TIMEOUT, default 150 s; empty to skip), suite.
set -u
STEPS=" ${STEPS:-tests stages register job bench kernels cpubench suite} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
OUT=${OUT:-/tmp/psd-gpu-check}
PY=${PY:-python3}
mkdir -p "$OUT/results"
exec > >(tee "$OUT/log") 2>&1
export PYTHONUNBUFFERED=1
step() { echo; echo "=== $(date +%T) $*"; }

step machine
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
"$PY" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name())"
echo "RLIMIT_MEMLOCK: $(ulimit -l)   cores: $(nproc)"

step "install psd against this torch (no index, no build isolation)"
timeout 150 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
command -v psd

if want tests; then
step "tests/test_device.py on the GPU"
timeout 120 "$PY" -m pytest -q -p no:cacheprovider --timeout 60 -rA -s tests/test_device.py 2>&1 | tail -25
for i in $(seq "${OVERLAP_RUNS:-3}"); do
    timeout 60 "$PY" -m pytest -q -p no:cacheprovider --timeout 50 -s tests/test_device.py -k does_not_wait 2>&1 \
        | grep -E "step\\(\\)|passed|failed"
done

fi
if want stages; then
step "pipeline stages and the examples with a GPU present (6 workers)"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -n 6 --timeout 200 -rA tests/test_partial.py tests/test_stages.py \
    tests/test_examples.py > "$OUT/stages.log" 2>&1
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/stages.log" | tail -60

fi
if want register; then
step "cudaHostRegister of a /dev/shm mapping: error codes and copy bandwidth"
timeout 120 "$PY" - <<'EOF'
import mmap, os, time, torch
cud = torch.cuda.cudart()
size = 1 << 30
path = f"/dev/shm/psd-gpu-probe-{os.getpid()}"
fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, size)
rw = mmap.mmap(fd, size)
ro = mmap.mmap(fd, size, prot=mmap.PROT_READ)
os.unlink(path)
dev = torch.empty(size // 4, device="cuda")

base_rw = torch.frombuffer(rw, dtype=torch.uint8).data_ptr()
host_rw = torch.frombuffer(rw, dtype=torch.float32)

def gbs(dst, src, n=5):
    dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return n * size / (time.perf_counter() - t) / 1e9

print(f"unregistered shm: d2h {gbs(host_rw, dev):.1f} GB/s, h2d {gbs(dev, host_rw):.1f} GB/s")
for flags, name in ((0, "default"), (8, "read-only"), (1, "portable")):
    rc = int(cud.cudaHostRegister(base_rw, size, flags))
    line = f"register rw mapping, {name}: rc {rc}"
    if rc == 0:  # read-only registered memory can only be copied from
        line += (f"; h2d {gbs(dev, host_rw):.1f} GB/s" if flags & 8 else
                 f"; d2h {gbs(host_rw, dev):.1f} GB/s, h2d {gbs(dev, host_rw):.1f} GB/s")
        rc2 = int(cud.cudaHostRegister(base_rw, size, flags))
        line += f"; registering it again: rc {rc2}; unregister rc {int(cud.cudaHostUnregister(base_rw))}"
    print(line)
# A learner maps the weights read-only (PROT_READ): what does each flag give there?
import numpy as np

base_ro = np.frombuffer(ro, dtype=np.uint8).ctypes.data
for flags, name in ((0, "default"), (8, "read-only")):
    rc = int(cud.cudaHostRegister(base_ro, size, flags))
    line = f"register PROT_READ mapping, {name}: rc {rc}"
    if rc == 0:
        host_ro = torch.from_numpy(np.frombuffer(ro, dtype=np.float32))
        line += f"; h2d {gbs(dev, host_ro):.1f} GB/s; unregister rc {int(cud.cudaHostUnregister(base_ro))}"
    print(line)
try:
    import cupy
    print("cudaDevAttrHostRegisterReadOnlySupported (113):", cupy.cuda.runtime.deviceGetAttribute(113, 0))
except Exception as e:  # cupy absent: not needed by psd
    print("cudaDevAttrHostRegisterReadOnlySupported: not read", e)
pinned = torch.empty(size // 4).pin_memory()
print(f"torch pinned memory: d2h {gbs(pinned, dev):.1f} GB/s, h2d {gbs(dev, pinned):.1f} GB/s")
EOF

fi
if want job; then
step "a real job: psd run --gpus 0 --learners 1,2,4,8 against one process alone"
timeout 240 "$PY" benchmarks/gpu_job.py --learners "${LEARNERS:-1,2,4,8}" --timeout 100 --out "$OUT/results"

fi
if want bench; then
step "psd bench: the GPU round trip"
timeout 120 "$PY" -m psd.cli bench --sizes 1000000 10000000 --learners 1 2 4 8 --no-peers --no-training --reps 1 \
    --pull-modes copy --grad-dtypes float32 --json > "$OUT/results/bench.json" 2> "$OUT/bench.log"
grep -E "gpu round trip|host" "$OUT/bench.log"

fi
if want kernels; then
step "the server's optimizer kernels against torch fused on this host's cores"
timeout 200 "$PY" benchmarks/optim_kernels.py --sizes "${KERNEL_SIZES:-1e7,1e8}" --threads "${KERNEL_THREADS:-1,4,all}" \
    --rounds 3 --reps 5 --no-plot --out "$OUT/results" 2> "$OUT/kernels.log"
grep -E "Worst|rror" "$OUT/kernels.log"; cat "$OUT/results/optim_kernels.md" 2>/dev/null | grep -E "^\| [a-z]"

fi
if want cpubench; then
step "psd bench on the host's cores: round trips and training against Hogwild, 2 and 8 learners"
timeout "${CPUBENCH_TIMEOUT:-300}" "$PY" -m psd.cli bench --sizes ${CPUBENCH_SIZES:-10000 1000000 10000000} \
    --learners 2 8 --batches 1 8 --pull-modes copy \
    --grad-dtypes float32 --reps 3 --json > "$OUT/results/cpu_bench.json" 2> "$OUT/cpu_bench.log"
grep -E "^(round trip|training|limit|idle)" "$OUT/cpu_bench.log"
if [ -n "${CPUBENCH_LARGE:-100000000}" ]; then  # round trips alone at 1e8 (training does not depend on it)
    timeout "${CPUBENCH_LARGE_TIMEOUT:-150}" "$PY" -m psd.cli bench --sizes ${CPUBENCH_LARGE:-100000000} --learners 2 8 \
        --no-training --pull-modes copy --grad-dtypes float32 --reps 3 --optimizer-sizes 100000000 --json \
        > "$OUT/results/cpu_bench_large.json" 2> "$OUT/cpu_bench_large.log"
    grep -E "^(round trip|optimizer|limit)" "$OUT/cpu_bench_large.log"
fi

fi
if want suite; then
step "the whole suite, 14 workers (interrupted, with its summary, at DEADLINE_S)"
timeout -s INT "$(( ${DEADLINE_S:-540} - SECONDS > 30 ? ${DEADLINE_S:-540} - SECONDS : 30 ))" "$PY" -m pytest -v \
    -p no:cacheprovider -p no:benchmark -n 14 --timeout 240 -rfE --maxfail 20 > "$OUT/suite.log" 2>&1
grep -E "FAILED|ERROR|passed|failed" "$OUT/suite.log" | grep -v "^\[gw" | tail -30
fi
step done
