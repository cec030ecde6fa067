#!/usr/bin/env bash
# The embedded trained default (embedded:small-scene1, docs/training.md section 4), one stage or all of them:
#   scripts/default_model.sh record   100 scripted demonstrations of scene 1, compact layouts (2 recorder processes),
#                                     twice: standard (lossy) videos, and the same episodes with lossless videos; then
#                                     twice as many lossless ones (those layouts and as many more)
#   scripts/default_model.sh train    dreamzero-train in seven stages, small preset from seeded random weights (resumes)
#   scripts/default_model.sh ship     copy the newest checkpoint to dreamzero/assets/models/small-scene1
#   scripts/default_model.sh eval     `serve run serve_config.yaml` + 20 held-out episodes through it, then stop it
#   scripts/default_model.sh all      the four in order
# RUN (default runs/small-scene1), STEPS, EPISODES and EVAL_EPISODES override the defaults. Set NICE=19 on a shared
# machine; the CPU-heavy stages run with one thread each.
# The scene's cube is turned to face the fingers (docs/training.md, "Stage 9"): a rerun records and trains on the
# turned cube throughout; the shipped weights were trained on the earlier square cube and evaluated on the turned one.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=lib/serve_for_eval.sh
source scripts/lib/serve_for_eval.sh
RUN=${RUN:-runs/small-scene1}
STEPS=${STEPS:-2000}
EPISODES=${EPISODES:-100}
EVAL_EPISODES=${EVAL_EPISODES:-20}
BIN=${BIN:-.venv/bin}
export OMP_NUM_THREADS=1 MUJOCO_GL=${MUJOCO_GL:-egl} RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
run() { nice -n "${NICE:-0}" "$@"; }

record() {
    local args=(--seed 0 --workers 2 --image-size 90 160 --layouts compact)
    run "$BIN/dreamzero-record-demos" --out "$RUN/demos" --episodes "$EPISODES" "${args[@]}"
    run "$BIN/dreamzero-record-demos" --out "$RUN/demos-lossless" --episodes "$EPISODES" "${args[@]}" --video lossless
    # twice as many from the same seeds (0.. and 10000..): a superset of the layouts above
    run "$BIN/dreamzero-record-demos" --out "$RUN/demos-lossless-2x" --episodes $((2 * EPISODES)) "${args[@]}" \
        --video lossless
}

train() {
    # docs/training.md section 4: stage 1 learns the task's motion; stages 2-4 keep stage 1's statistics, weight the
    # action term 10x and train on the clip starts serving uses, with the frozen encodings cached; stage 3 trains
    # first chunks only (the one place where nothing but the images says where the cube is), stage 4 the first two;
    # stage 5 switches the actions to min/max bounds (no clamped reach ends) and retrains every chunk, then the first two;
    # stage 6 retrains on lossless videos, which look like the raw frames a simulator sends: the first two chunks, then
    # all; stage 7 goes on with every chunk on twice as many layouts.
    local common=(--dataset "$RUN/demos" --save-every 100 --log-every 1 --cpu-threads 1)
    local tuned=(--metadata "$RUN/train/checkpoint-$(printf %07d "$STEPS")/experiment_cfg/metadata.json"
        --action-loss-weight 10 --cache-encodings)
    run "$BIN/dreamzero-train" "${common[@]}" --out "$RUN/train" --preset small --steps "$STEPS" \
        --batch-size 2 --blocks 4 --lr 5e-4 --warmup-steps 50
    run "$BIN/dreamzero-train" "${common[@]}" "${tuned[@]}" --out "$RUN/stage2" \
        --init "$RUN/train/checkpoint-$(printf %07d "$STEPS")" --steps 3000 --stop-at 1500 \
        --batch-size 4 --blocks 4 --lr 3e-4 --warmup-steps 50 --start-stride 24
    run "$BIN/dreamzero-train" "${common[@]}" "${tuned[@]}" --out "$RUN/stage3" \
        --init "$RUN/stage2/checkpoint-0001500" --steps 4000 --stop-at 2000 \
        --batch-size 16 --blocks 1 --lr 5e-4 --warmup-steps 50 --start-stride 96
    run "$BIN/dreamzero-train" "${common[@]}" "${tuned[@]}" --out "$RUN/stage4" \
        --init "$RUN/stage3/checkpoint-0002000" --steps 1200 --stop-at 1000 \
        --batch-size 8 --blocks 2 --lr 2e-4 --warmup-steps 20 --start-stride 96
    run "$BIN/dreamzero-train" "${common[@]}" "${tuned[@]}" --action-bounds min_max --out "$RUN/stage5a" \
        --init "$RUN/stage4/checkpoint-0001000" --steps 800 \
        --batch-size 4 --blocks 4 --lr 3e-4 --warmup-steps 20 --start-stride 96
    run "$BIN/dreamzero-train" "${common[@]}" "${tuned[@]}" --action-bounds min_max --out "$RUN/stage5b" \
        --init "$RUN/stage5a/checkpoint-0000800" --steps 500 --stop-at 400 \
        --batch-size 8 --blocks 2 --lr 2e-4 --warmup-steps 20 --start-stride 96
    run "$BIN/dreamzero-train" "${common[@]}" "${tuned[@]}" --action-bounds min_max --out "$RUN/stage5c" \
        --init "$RUN/stage5b/checkpoint-0000400" --steps 600 \
        --batch-size 8 --blocks 2 --lr 1.5e-4 --warmup-steps 20 --start-stride 96
    # (the later --dataset wins: stage 6 reads the lossless copy of the same episodes)
    run "$BIN/dreamzero-train" "${common[@]}" "${tuned[@]}" --action-bounds min_max --out "$RUN/stage6a" \
        --dataset "$RUN/demos-lossless" --init "$RUN/stage5c/checkpoint-0000600" --steps 600 \
        --batch-size 8 --blocks 2 --lr 1e-4 --warmup-steps 20 --start-stride 96
    run "$BIN/dreamzero-train" "${common[@]}" "${tuned[@]}" --action-bounds min_max --out "$RUN/stage6b" \
        --dataset "$RUN/demos-lossless" --init "$RUN/stage6a/checkpoint-0000600" --steps 400 \
        --batch-size 4 --blocks 4 --lr 7e-5 --warmup-steps 20 --start-stride 96 --cpu-threads 2
    run "$BIN/dreamzero-train" "${common[@]}" "${tuned[@]}" --action-bounds min_max --out "$RUN/stage7" \
        --dataset "$RUN/demos-lossless-2x" --init "$RUN/stage6b/checkpoint-0000400" --steps 600 \
        --batch-size 4 --blocks 4 --lr 5e-5 --warmup-steps 20 --start-stride 96 --cpu-threads 2
}

ship() {
    # sigma_shift 12: chosen after training with `reach_check --pipeline` (docs/training.md, "Stage 6")
    "$BIN/python" -m dreamzero.train.ship "$RUN/stage7/$(cat "$RUN/stage7/latest")" --name small-scene1 \
        --pipeline '{"sigma_shift": 12.0}'
}

evaluate() {
    # held-out layouts: episode seeds 100000 + 1000 + i, the recording used 0.. and 10000..
    local port=${PORT:-8000} log="$RUN/serve.log"
    mkdir -p "$RUN"
    sed "s/^  port: 8000$/  port: $port/" serve_config.yaml >"$RUN/serve_config.yaml"  # the shipped config, PORT
    serve_for_eval "$RUN/serve_config.yaml" "$log" "$port"
    run "$BIN/dreamzero-eval" --scenes 1 --episodes "$EVAL_EPISODES" --layouts compact --seed 100000 \
        --image-size 90 160 --open-loop-horizon 24 --max-steps 200 --port "$port" --out "$RUN/eval" --no-progress
}

case "${1:-all}" in
    record) record ;;
    train) train ;;
    ship) ship ;;
    eval) evaluate ;;
    all) record && train && ship && evaluate ;;
    *) echo "usage: $0 {record|train|ship|eval|all}" >&2; exit 2 ;;
esac
