#!/usr/bin/env bash
# Usage (on the GPU machine, repository root, .whl/ from make_wheelhouse.sh carried along):
#   tools/gpu_check/run.sh [MINUTES] [RUNNERS ...]
# One device call: unpack the carried wheels, check imports, a 3-iteration CartPole run with the
# learner on the GPU (skipped with CARTPOLE=0), then `bench gpu` (Pong APPO, workstation-1gpu profile)
# for MINUTES once per RUNNERS count given (default: the profile's own 6 env runners).
set -u
MIN=${1:-3}
shift || true
RUNNERS=("${@:-6}")
start=$(date +%s)
python3 tools/gpu_check/extract.py /tmp/site .whl/*.whl .whl/*.zip || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; df -h /dev/shm | tail -1
python3 -c "import ray, torch, gymnasium, ale_py, pydantic, cv2; print('ray', ray.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'gym', gymnasium.__version__, 'ale', ale_py.__version__)" || exit 4
if [ "${CARTPOLE:-1}" != 0 ]; then
    echo "=== cartpole, GPU learner"
    timeout 150 python3 -m rlplatform train --profile workstation-1gpu --set stop.iterations=3 --set stop.return_mean=null --runs-dir /tmp/runs 2>&1 | tail -25
    echo "rc=$? after $(( $(date +%s) - start )) s"
fi
for n in "${RUNNERS[@]}"; do
    echo "=== bench gpu, $n env runners"
    out=/tmp/bench/r$n
    timeout $(( MIN * 60 + 200 )) python3 -m rlplatform bench gpu --minutes $MIN --warmup-minutes 1 --set scale.env_runners=$n -o $out 2>&1 | tail -30
    echo "rc=$? after $(( $(date +%s) - start )) s"
    d=$(ls -d $out/gpu-* 2>/dev/null | head -1)
    [ -n "$d" ] && cp $d/gpu.json $OUT/gpu_r$n.json 2>/dev/null
    m=$(find $out -name metrics.jsonl | head -1); [ -n "$m" ] && cp "$m" $OUT/pong_metrics_r$n.jsonl
    for s in stdout stderr; do f=$(find $out -name "$s.txt" | head -1); [ -n "$f" ] && tail -40 "$f" > $OUT/${s}_r$n.txt; done
done
ls $OUT
