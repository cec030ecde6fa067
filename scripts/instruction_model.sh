#!/usr/bin/env bash
# A default that reads its instruction (scene 4: the cube and the can, the bowl and the mug, four instructions;
# docs/training.md section 6), one stage or all of them:
#   scripts/instruction_model.sh record   EPISODES scripted demonstrations of scene 4, every instruction balanced,
#                                         lossless video (2 recorder processes: seeds 0.. and 10000..)
#   scripts/instruction_model.sh train    dreamzero-train on two Ray Train workers, from the shipped small-scene1
#                                         weights (its motion on this table), the actions' min/max bounds of scene 4
#   scripts/instruction_model.sh eval     `serve run` of the newest checkpoint + EVAL_EPISODES held-out episodes per
#                                         instruction through the OpenPI WebSocket, then stop it
#   scripts/instruction_model.sh all      the three in order
# RUN (default runs/scene4), EPISODES (200), STEPS (1500), WORKERS (2) and EVAL_EPISODES (20) override the defaults.
# Set NICE=19 on a shared machine. This is the recipe as far as it has run (docs/training.md says which stages ran,
# their times and losses); later sessions add its stages.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib/serve_for_eval.sh
source scripts/lib/serve_for_eval.sh
RUN=${RUN:-runs/scene4}
EPISODES=${EPISODES:-200}
STEPS=${STEPS:-1500}
WORKERS=${WORKERS:-2}
EVAL_EPISODES=${EVAL_EPISODES:-20}
BIN=${BIN:-.venv/bin}
export OMP_NUM_THREADS=1 MUJOCO_GL=${MUJOCO_GL:-egl} RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
run() { nice -n "${NICE:-0}" "$@"; }

record() {
    run "$BIN/dreamzero-record-demos" --out "$RUN/demos-lossless" --scene 4 --instruction all \
        --episodes "$EPISODES" --seed 0 --workers 2 --image-size 90 160 --video lossless
}

train() {
    # stage 1: every instruction's first two chunks (where the words must pick the object before the arm moves),
    # from the shipped scene-1 weights; the statistics are scene 4's own (its targets reach past scene 1's bounds)
    run "$BIN/dreamzero-train" --dataset "$RUN/demos-lossless" --out "$RUN/stage1" \
        --init dreamzero/assets/models/small-scene1 --num-workers "$WORKERS" --cpu-threads 1 \
        --action-bounds min_max --action-loss-weight 10 --cache-encodings \
        --steps "$STEPS" --batch-size 8 --blocks 2 --start-stride 96 --lr 2e-4 --warmup-steps 50 \
        --save-every 100 --log-every 1
}

evaluate() {
    # held-out layouts: episode seeds from 100000 (the recording used 0.. and 10000..)
    local ckpt port=${PORT:-8000} log="$RUN/serve.log"
    ckpt="$RUN/stage1/$(cat "$RUN/stage1/latest")"
    sed -e "s/^  port: 8000$/  port: $port/" -e "s#model_path: .*#model_path: $PWD/$ckpt#" serve_config.yaml \
        >"$RUN/serve_config.yaml"
    serve_for_eval "$RUN/serve_config.yaml" "$log" "$port"
    run "$BIN/dreamzero-eval" --scenes 4 --instruction all --episodes $((4 * EVAL_EPISODES)) --seed 100000 \
        --image-size 90 160 --open-loop-horizon 24 --max-steps 300 --port "$port" --out "$RUN/eval" --no-progress
}

case "${1:-all}" in
    record) record ;;
    train) train ;;
    eval) evaluate ;;
    all) record && train && evaluate ;;
    *) echo "usage: $0 {record|train|eval|all}" >&2; exit 2 ;;
esac
