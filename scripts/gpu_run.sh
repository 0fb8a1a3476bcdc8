#!/usr/bin/env bash
# The prepared GPU measurement of issue #37, in two parts that each fit one call of the device tool (docs/gpu.md):
#
#   bash scripts/gpu_run.sh speed    # ~8 min, the GPU to itself: env, graph_speed (0.5B, 256/128 x 256), grpo_speed
#   bash scripts/gpu_run.sh checks   # ~4.5 min: graphed_decode + mismatch + packed_prefill + sampler_speed |
#                                    # syncs + packed_update + continuous + fused_head (in parallel),
#                                    # then profiles of the compiled graphed step and of a GRPO step's update
#
# Wheels the machine lacks are installed from .whl/ (carried; `bash scripts/gpu_wheels.sh` makes it) into /tmp/site
# once per machine. Results go to $OUT
# (at most 8 files come back: each part writes 8 or fewer). Each part stops its checks in time for them to return.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
if [ ! -d /tmp/site/transformers ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
summary() {  # the PASS / FAIL lines and the bench rows' key numbers, for the call's output tail
  grep -ah "^PASS\|^FAIL\|passed, \|\"profile\"" "$@" | cut -c1-700
}
case "${1:-}" in
  speed)
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
      python3 -c "import torch, triton, transformers; print(torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__)"
    } > "$OUT/smi.txt" 2>&1
    timeout 540 python3 scripts/gpu_check.py --device cuda --out /tmp/speed --only env,graph_speed,grpo_speed \
      > "$OUT/speed.log" 2>&1
    cp /tmp/speed/gpu_check.json "$OUT/speed.json" 2>/dev/null
    cp /tmp/speed/graph_speed.log /tmp/speed/grpo_speed.log "$OUT/" 2>/dev/null
    cat "$OUT/smi.txt"; summary "$OUT/speed.log"
    ;;
  checks)
    # the speed part's out dir holds the 0.5B model the mismatch check and the profile use (else they build one)
    (timeout 200 python3 scripts/gpu_check.py --device cuda --out /tmp/speed \
      --only graphed_decode,mismatch,packed_prefill,sampler_speed \
      > "$OUT/checks_graphs.log" 2>&1) &
    (timeout 200 python3 scripts/gpu_check.py --device cuda --out /tmp/c2 \
      --only syncs,packed_update,continuous,fused_head \
      > "$OUT/checks_update.log" 2>&1) &
    wait
    python3 - "$OUT/checks.json" /tmp/speed/gpu_check.json /tmp/c2/gpu_check.json <<'EOF'
import json, sys
out = {}
for path in sys.argv[2:]:
    try:
        out.update(json.load(open(path)))
    except OSError:
        pass
json.dump(out, open(sys.argv[1], "w"), indent=1)
EOF
    timeout 75 python3 bench/gpu_profile.py --device cuda --engine native-graphs-compiled --rows 256 \
      --new-tokens 64 --model-dir /tmp/speed/work/bench --out "$OUT" > /dev/null 2>&1
    timeout 100 python3 bench/grpo_vs_trl.py --device cuda --shape 0.5B --dtype bfloat16 --prompts 16 --n 8 \
      --max-new 256 --steps 2 --warmup 1 --threads 8 --only tiller --profile /tmp/gprof > "$OUT/grpo_profile.log" 2>&1
    cp /tmp/gprof/update_profile.json /tmp/gprof/step_by_device_time.txt "$OUT/" 2>/dev/null
    summary "$OUT/checks_graphs.log" "$OUT/checks_update.log" "$OUT/grpo_profile.log"
    cat "$OUT/profile.json" 2>/dev/null | head -c 1500
    ;;
  *)
    echo "usage: bash scripts/gpu_run.sh speed|checks" >&2
    exit 2
    ;;
esac
