#!/usr/bin/env bash
# Usage (on the GPU machine, repository root, .whl/ from make_wheelhouse.sh carried along): tools/gpu_check/run.sh [MINUTES]
# One device call: unpack the carried wheels, check imports, a 3-iteration CartPole run with the
# learner on the GPU, then `bench gpu` (Pong APPO, workstation-1gpu profile) for a few minutes.
set -u
MIN=${1:-3}
start=$(date +%s)
python3 tools/gpu_check/extract.py /tmp/site .whl/*.whl .whl/*.zip || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; df -h /dev/shm | tail -1
python3 -c "import ray, torch, gymnasium, ale_py, pydantic, cv2; print('ray', ray.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'gym', gymnasium.__version__, 'ale', ale_py.__version__)" || exit 4
echo "=== cartpole, GPU learner"
timeout 150 python3 -m rlplatform train --profile workstation-1gpu --set stop.iterations=3 --set stop.return_mean=null --runs-dir /tmp/runs 2>&1 | tail -25
echo "rc=$? after $(( $(date +%s) - start )) s"
echo "=== bench gpu"
timeout $(( MIN * 60 + 200 )) python3 -m rlplatform bench gpu --minutes $MIN --warmup-minutes 1 -o /tmp/bench 2>&1 | tail -30
echo "rc=$? after $(( $(date +%s) - start )) s"
d=$(ls -d /tmp/bench/gpu-* 2>/dev/null | head -1)
[ -n "$d" ] && cp $d/gpu.json $OUT/ 2>/dev/null
m=$(find /tmp/bench -name metrics.jsonl | head -1); [ -n "$m" ] && cp "$m" $OUT/pong_metrics.jsonl
find /tmp/bench -name "std*.txt" -exec sh -c 'tail -40 "$1" > $OUT/$(basename "$1")' _ {} \;
cp $(find /tmp/bench -name manifest.json | head -1) $OUT/ 2>/dev/null
ls $OUT
