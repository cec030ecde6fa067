# Sourced by the model recipes (default_model.sh, instruction_model.sh): `serve_for_eval CONFIG LOG PORT` starts
# `serve run CONFIG` in the background with a private Ray session, stops it when the calling script exits, and
# returns once /health answers on PORT (or exits 1 with the log's tail when the server died first).
serve_for_eval() {
    local config=$1 log=$2 port=$3
    export RAY_TMPDIR=${RAY_TMPDIR:-$(mktemp -d /tmp/rayXXXX)}  # a private Ray session, stopped with the server
    setsid nice -n "${NICE:-0}" "$BIN/serve" run "$config" >"$log" 2>&1 &
    serve_pid=$!
    # SIGTERM: `serve run` shuts its Ray session down (a backgrounded one ignores SIGINT); bounded wait, then SIGKILL
    trap 'kill -TERM -- "-$serve_pid" 2>/dev/null; timeout 90 tail --pid="$serve_pid" -f /dev/null || kill -KILL -- "-$serve_pid" 2>/dev/null || true' EXIT
    for _ in $(seq 300); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
        kill -0 "$serve_pid" 2>/dev/null || { tail -50 "$log"; exit 1; }
        sleep 1
    done
    echo "serve run $config: no /health on port $port within 300 s (log: $log)" >&2
    exit 1
}
