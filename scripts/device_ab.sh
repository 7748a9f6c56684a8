#!/usr/bin/env bash
# The GPU measurements pending on main: kernel candidates that landed behind A/B switches, off by default until timed
# (docs/PROFILE.md, "Session of 2026-12-04 (night, fifth)"). One stage per device call (each stays under the 600 s call limit):
#
#   bash scripts/device_ab.sh kernels   # GPU tests of the candidates, routed matvec sweep, Q8_0 MMA probe (~6 min)
#   bash scripts/device_ab.sh step      # batched decode, 1 and 8 sessions, each switch on as a variant (~6 min)
#   bash scripts/device_ab.sh serve     # `ds4x serve -m flash:q2` under `ds4x bench serve` at 1 and 8 streams (~4 min)
#   bash scripts/device_ab.sh step32    # batched decode, 32 sessions, the defaults against every switch on (~4 min)
#
# Run from the repository root on a CUDA machine; logs and ledger rows go to $OUT (default ./ab-out), the ledger
# rows' commit comes from DS4X_COMMIT. Wheels the machine lacks (gguf; fastapi, uvicorn, httpx) are installed from
# .whl/ when that folder is there.
set -uo pipefail  # not -e: a failing piece is reported and the rest still runs
stage=${1:?usage: device_ab.sh kernels|step|serve|step32}
out=${OUT:-ab-out}
mkdir -p "$out"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
if [ -d .whl ]; then
    python -m pip install -q --no-deps .whl/*.whl .whl/serve/*.whl 2>/dev/null || true
fi
qm=ds4x.kernels.quant_matmul
status=0
piece() {  # piece LOG COMMAND...: run it, output to the terminal and $out/LOG, remember a failure
    local log=$1
    shift
    "$@" 2>&1 | tee "$out/$log" || { echo "FAILED ($?): $*" >&2; status=1; }
}
case "$stage" in
kernels)
    piece gpu_tests.log python -m pytest -q -m gpu tests/test_quant_matmul.py tests/test_q8_mma.py tests/test_sampling.py \
        tests/test_serve_batching.py
    piece sweep.log python scripts/routed_matvec_sweep.py --tokens 1,8 --gate-up 8,64,2 --down 8,32,1 16,32,1 4,32,1 \
        --shared 8,128,4 8,64,2 --programs-per-sm 2,4,8 --grid-copies 32,16 --ledger "$out/ledger.jsonl"
    piece q8_mma_probe.log python scripts/q8_mma_probe.py --tokens 2,4,8,16,32 --ledger "$out/ledger.jsonl"
    ;;
step)
    piece batched.log python scripts/batched_decode.py --batches 1,8 --rounds 2 --ledger "$out/ledger.jsonl" \
        --variant "shared tables: $qm.SHARED_TABLES=True" \
        --variant "shared tables 16: $qm.SHARED_TABLES=True; $qm.SHARED_TABLES_GRID_COPIES=16" \
        --variant "prepared down: $qm.Q2_K_PREPARED_ACTIVATIONS=True" \
        --variant "q8 mma: $qm.Q8_MMA=True" \
        --variant "all: $qm.SHARED_TABLES=True; $qm.Q2_K_PREPARED_ACTIVATIONS=True; $qm.Q8_MMA=True"
    ;;
step32)
    piece batched32.log python scripts/batched_decode.py --batches 32 --rounds 2 --ledger "$out/ledger.jsonl" \
        --variant "all: $qm.SHARED_TABLES=True; $qm.Q2_K_PREPARED_ACTIVATIONS=True; $qm.Q8_MMA=True"
    ;;
serve)
    python -m ds4x serve -m "${DS4X_AB_MODEL:-flash:q2}" --port 8765 -q > "$out/server.log" 2>&1 &
    server=$!
    python - <<'PY' || status=1
import time, httpx
for _ in range(300):  # the synthetic model is generated on the device first
    try:
        if httpx.get("http://127.0.0.1:8765/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(1)
else:
    raise SystemExit("the server did not come up")
PY
    piece serve_bench.log python -m ds4x bench serve --url http://127.0.0.1:8765 --concurrency 1,8 --seconds "${DS4X_AB_SECONDS:-30}" \
        --warmup 5 --prompt-tokens 128 --gen-tokens 128 --temperature 0.2 --ignore-eos --ledger "$out/serve_ledger.jsonl"
    kill "$server"
    wait "$server"
    ;;
*)
    echo "unknown stage $stage (kernels, step, serve or step32)" >&2
    exit 2
    ;;
esac
exit $status
