#!/usr/bin/env bash
# GPU A/B measurements of main's quantized-product switches (module attributes of ds4x.kernels.quant_matmul; history
# in docs/PROFILE.md). One stage per device call (each stays under the 600 s call limit):
#
#   bash scripts/device_ab.sh kernels   # GPU tests of the quantized products, routed matvec sweep, the Q8_0 matvecs
#                                       # with and without their weights loaded before the PDL wait (at most ~9 min)
#   bash scripts/device_ab.sh step      # batched decode, 1 and 8 sessions: PRELOAD_WEIGHTS off as the variant (<10 min)
#   bash scripts/device_ab.sh serve     # `ds4x serve -m flash:q2` under `ds4x bench serve` at 1, 8 and 32 streams (~5 min;
#                                       # DS4X_SERVE_OVERLAP=0: the host reads each step's tokens before the next
#                                       # step, the baseline of the overlapped reads; DS4X_SERVE_ARGS: more
#                                       # arguments of `ds4x serve`, e.g. "--prefill-budget 2048"; the ledger
#                                       # rows' server_meta says which ran; the logs come back as serve_logs.tgz,
#                                       # the kernels compiled after the warm-up as compiles.txt, and
#                                       # TRITON_CACHE_DIR=$(mktemp -d) makes a warm machine compile as a fresh one)
#   bash scripts/device_ab.sh step32    # batched decode, 32 sessions: expert-pairs kernel off (<10 min)
#   bash scripts/device_ab.sh routed    # GPU tests and timings of the routed tensor-core kernel's variants (~6 min)
#   bash scripts/device_ab.sh prefill   # the server's prompt calls of 1-8 sessions of 130 tokens, timed and profiled
#   bash scripts/device_ab.sh loop      # GPU tests of the decode slots and the scheduler, then the server's decode loop
#                                       # without HTTP at 1, 8 and 32 streams, a step's tokens read after / before the
#                                       # next step and prefill budgets of 1,024 / 2,048 tokens, alternating in one
#                                       # process (scripts/scheduler_ab.py; ~7 min)
#   bash scripts/device_ab.sh compressed # GPU tests of the sparse kernels, then the compressed layers' kernels per
#                                       # layer kind at 4K / 1M (scripts/compressed_kernels_ab.py: attention on
#                                       # float32 / bf16 queries; the top-k's histograms by tl.histogram or shared-
#                                       # memory atomics, small rows by the packed-count kernel or one program of
#                                       # the histogram select; the merge of the splits by (splits, chunks)), then
#                                       # the step at 1, 8 and 32 sessions with the merge by 64-value chunks as the
#                                       # variant (~9 min)
#   bash scripts/device_ab.sh frontier  # the Hopper attention's GPU tests (the prefill's one-pass launch too), its
#                                       # kernels per case with the online loop as the variant of the two phases, then
#                                       # `ds4x bench frontier --weights q2 --contexts 4096,1048576 --steps 50` (H200),
#                                       # with DS4X_AB_VARIANT (e.g. "global state:
#                                       # ds4x.kernels.attention.TMA_STATE=False"; several: one a line) as the
#                                       # --variant of both the attention kernels (their bits too) and the frontier
#   bash scripts/device_ab.sh candidates # the GPU tests of the newest switches (indexer PIPELINED and the two
#                                       # phases' TWO_PHASE_OVERLAP, on; routed REGISTER_WEIGHTS, off), then the
#                                       # attention and indexer kernels with them flipped as variants (~2 min; an H100
#                                       # will do)
#   bash scripts/device_ab.sh tests [FILE ...]
#                                       # the test suite (or the files named) on the GPU, 6 workers: the tests not
#                                       # marked gpu take the CUDA paths there too (one of them, the prefill's
#                                       # one-pass attention, had failed unseen for two days); at most 480 s, each
#                                       # test's outcome on its own line as it ends (-v), so a run cut short still
#                                       # names its failures
#   bash scripts/device_ab.sh gguf      # issue 4's file target on an H200: the shared-memory tmpfs made 118G (root),
#                                       # `ds4x convert --synthetic flash --mix q2 --device cuda` streamed into it (an
#                                       # 80.76 GiB file; its sha256 in $OUT), `ds4x generate -m` that file (the planned
#                                       # memory printed), the file removed (~5-8 min, not yet run)
#   bash scripts/device_ab.sh ncu [CASE ...]
#                                       # Nsight Compute on each decode kernel of scripts/ncu_cases.py (or the cases
#                                       # named): throughput per unit, the memory tables' warnings (bank conflicts,
#                                       # sector use) and the schedulers' state, the whole report in $OUT/ncu_CASE.txt
#                                       # and its summary lines printed (~20 s a case)
#   bash scripts/device_ab.sh all       # kernels, step and step32 in one call (on 2026-12-05 they took 82, 44 and
#                                       # 26 s: one machine start instead of three)
#
# Run from the repository root on a CUDA machine; logs and ledger rows go to $OUT (default ./ab-out), the ledger
# rows' commit comes from DS4X_COMMIT. The stages that load a model take DS4X_AB_MODEL, by default flash:q2 where
# the GPU holds it (an H200) and flash:q2:128 elsewhere (an H100: 128 of the 256 routed experts). Wheels the machine lacks (gguf; fastapi, uvicorn, httpx) are installed from
# .whl/ when that folder is there; it is git-ignored, so make it here and name it in the device call's carry:
#   pip download -q gguf==0.19.0 --no-deps -d .whl
#   pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       --platform manylinux_2_17_x86_64 -d .whl/serve fastapi uvicorn httpx openai
# and commit first: the device call is then `DS4X_COMMIT=<that commit, short> bash
# scripts/device_ab.sh STAGE` with carry [".whl"]; append $OUT/ledger.jsonl to benchmarks/ledger.jsonl afterwards.
set -uo pipefail  # not -e: a failing piece is reported and the rest still runs
stage=${1:?usage: device_ab.sh kernels|step|serve|step32|prefill|loop|compressed|routed|frontier|candidates|tests|gguf|ncu|all}
out=${OUT:-ab-out}
mkdir -p "$out"
# the model of the stages that load one: DS4X_AB_MODEL, else flash:q2 (80.8 GiB) on a GPU that holds it and
# flash:q2:128 (128 of the 256 routed experts, 44 GiB) on one of less memory (an H100's 80 GB)
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
if [ -n "${DS4X_AB_MODEL:-}" ]; then
    model=$DS4X_AB_MODEL
elif [ "${gpu_mib:-0}" -ge 100000 ] 2>/dev/null; then
    model=flash:q2
else
    model=flash:q2:128
fi
echo "model: $model" >&2
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
if [ "$stage" = all ]; then  # each stage installs the wheels and keeps its pieces' limits; the call's own limit
    # (600 s) bounds the sum
    failed=0
    for part in kernels step step32; do
        bash "$0" "$part" || failed=1
    done
    exit $failed
fi
[ -n "${DS4X_COMMIT:-}" ] || echo "warning: DS4X_COMMIT is not set: the ledger rows say git's commit or 'unknown'" >&2
if [ -d .whl ]; then  # whatever wheels are there (a missing folder's pattern would fail the whole install)
    shopt -s nullglob
    wheels=(.whl/*.whl .whl/serve/*.whl)
    shopt -u nullglob
    if [ ${#wheels[@]} -gt 0 ]; then
        python -m pip install -q --no-deps "${wheels[@]}" > "$out/pip.log" 2>&1 \
            || echo "pip install failed: $out/pip.log" >&2
    fi
fi
qm=ds4x.kernels.quant_matmul
status=0
piece() {  # piece LOG SECONDS COMMAND...: run it for at most SECONDS (so that one slow or stuck piece leaves the
    # stage's others their time), output to the terminal and $out/LOG, remember a failure (124: the time ran out)
    local log=$1 limit=$2
    shift 2
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$out/$log" || { echo "FAILED ($?): $*" >&2; status=1; }
}
case "$stage" in
kernels)
    piece gpu_tests.log 200 python -m pytest -q -m gpu tests/test_quant_matmul.py tests/test_sampling.py \
        tests/test_serve_batching.py tests/test_batch.py
    piece sweep.log 170 python scripts/routed_matvec_sweep.py --tokens 1,8 --gate-up 8,64,2 \
        --down 8,32,1 16,32,1 4,32,1 --ledger "$out/ledger.jsonl"
    # the Q8_0 cases first (wq_a, wq_b, wo_a, wo_b), each split-row tile that covers K also with PRELOAD_WEIGHTS
    piece qm_bench.log 150 python scripts/quant_matmul_bench.py "$out" 60
    ;;
step)
    piece batched.log 560 python scripts/batched_decode.py -m "$model" --batches 1,8 --rounds 2 \
        --ledger "$out/ledger.jsonl" \
        --variant "no preload: $qm.PRELOAD_WEIGHTS=False"
    ;;
step32)
    # (32 sessions' 192 gate / up pairs take the expert-pairs kernel, EXPERT_PAIRS_MIN)
    piece batched32.log 560 python scripts/batched_decode.py -m "$model" --batches 32 --rounds 2 \
        --ledger "$out/ledger.jsonl" \
        --variant "no expert pairs: $qm.EXPERT_PAIRS=False"
    ;;
loop)
    piece loop_tests.log 150 python -m pytest -q -m gpu tests/test_batch.py tests/test_serve_batching.py
    piece scheduler_ab.log 420 python scripts/scheduler_ab.py -m "$model" --concurrency 1,8,32 \
        --gen-tokens 256 --prefill-budgets 1024,2048 --rounds 2 --ledger "$out/ledger.jsonl"
    ;;
compressed)
    # (the GPU tests took 231 s on an H100 at c131be1; the whole file 152 s at be06734)
    # (all of the file: its tests not marked gpu run on CUDA too, the prefill's one-pass Hopper launch among them)
    piece compressed_tests.log 230 python -m pytest -q tests/test_sparse_kernels.py
    piece compressed_ab.log 150 python scripts/compressed_kernels_ab.py --ledger "$out/ledger.jsonl"
    piece batched_compressed.log 200 python scripts/batched_decode.py -m "$model" --batches 1,8,32 --rounds 2 \
        --ledger "$out/ledger.jsonl" \
        --variant "merge by chunks: ds4x.kernels.attention.COMBINE_ROWS_WAVES=0"
    ;;
candidates)
    # the newest switches, first checked on the GPU and then timed: the indexer's PIPELINED tiles and the two phases'
    # TWO_PHASE_OVERLAP (both on since the H100 A/B of 9fded58; each against the bits without it) and the routed
    # kernel's REGISTER_WEIGHTS (off; its products synchronous since 544ad66); then the attention and indexer
    # kernels with them as variants (~2 min on an H100)
    piece candidate_tests.log 150 python -m pytest -q -n 4 tests/test_sparse_kernels.py tests/test_routed_wgmma.py \
        -k "pipelined_indexer or two_phases or regs"
    piece candidates_ab.log 150 python scripts/compressed_kernels_ab.py --parts attention,indexer \
        --ledger "$out/ledger.jsonl"
    ;;
tests)
    # the files given after the stage's name, else all of them (on an H100 on 2026-12-06 the 480 s ran 35% of the
    # suite: name the rest in later calls; three calls of named files took 106, 47 and 38 s); the slowest tests
    # listed last
    shift
    export DS4X_TEST_TIMES="$out/test_times.txt"  # each test phase's seconds as it ends (tests/conftest.py)
    piece tests.log 480 python -m pytest -v -p no:cacheprovider -n 6 --durations=20 "${@:-tests}"
    grep -E "(FAILED|ERROR) " "$out/tests.log" | sort -u
    echo "slowest test phases (s, phase, outcome, test):"
    sort -rn "$out/test_times.txt" 2>/dev/null | head -20
    ;;
ncu)
    shift
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    cases=$(python scripts/ncu_cases.py --list)  # "case kernel  # what", one a line
    for case in ${@:-$(echo "$cases" | cut -d' ' -f1)}; do
        kernel=$(echo "$cases" | awk -v c="$case" '$1 == c {print $2}')
        piece "ncu_$case.txt" 120 "$ncu" --clock-control none --kernel-name "regex:^$kernel\$" --launch-skip 2 \
            --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables \
            --section SchedulerStats --section WarpStateStats --section LaunchStats --section Occupancy \
            --section SourceCounters \
            python scripts/ncu_cases.py "$case" > /dev/null
        echo "== $case ($kernel)"
        grep -E "Duration|Throughput|Busy|Issued Warp|Eligible Warps|Registers Per|Achieved Occupancy|way bank|bytes transmitted|excessive" \
            "$out/ncu_$case.txt" | sed 's/^ *//'
    done
    ;;
frontier)
    # the Hopper attention's tests on the GPU, the prefill's one-pass launch of it included (not marked gpu: it runs
    # on CUDA when there is one) and the blocks in two phases; the attention kernels per case with the online loop
    # (TWO_PHASE_BLOCKS = 0) as the variant; then the compressed layers at model scale on $model (flash:q2 needs an
    # H200)
    # (4 workers: one ran out of the 150 s on a fresh H100 compiling its kernels in turn, 2026-12-07)
    piece attention_tests.log 150 python -m pytest -q -p no:cacheprovider -n 4 tests/test_sparse_kernels.py \
        -k "hopper_attention or bit_identical or hca_sized or many_splits or merge or prefill_attention_kernel"
    variants=()  # DS4X_AB_VARIANT: one --variant spec a line
    while IFS= read -r spec; do
        [ -n "$spec" ] && variants+=(--variant "$spec")
    done <<< "${DS4X_AB_VARIANT:-}"
    piece attention_ab.log 90 python scripts/compressed_kernels_ab.py --parts attention "${variants[@]}" \
        --ledger "$out/ledger.jsonl"
    experts=$(echo "$model" | cut -s -d: -f3)  # flash:q2:128 -> --experts 128
    piece frontier.log 300 python -m ds4x bench frontier --weights q2 ${experts:+--experts "$experts"} \
        --contexts 4096,1048576 --steps 50 "${variants[@]}" \
        --ledger "$out/ledger.jsonl"
    ;;
routed)
    # the tensor-core routed kernel's variants (the activations by cp.async, the weights in the wgmma's registers):
    # bits against the dequantized experts, then us per tile and variant at 130 / 1,024 / 4,096 tokens
    piece routed_tests.log 300 python -m pytest -q -m gpu tests/test_routed_wgmma.py
    piece routed_ab.log 270 python scripts/routed_wgmma_ab.py --ledger "$out/ledger.jsonl"
    ;;
prefill)
    piece prefill_calls.log 400 python scripts/prefill_calls.py -m "$model" --sessions 1,2,4,8 \
        --profile --variant "x async: ds4x.kernels.routed_wgmma.ASYNC_ACTIVATIONS=True" \
        --variant "regs: ds4x.kernels.routed_wgmma.ASYNC_ACTIVATIONS=True; ds4x.kernels.routed_wgmma.REGISTER_WEIGHTS=True"
    ;;
serve)
    python -m ds4x serve -m "$model" --port 8765 -q ${DS4X_SERVE_ARGS:-} > "$out/server.log" 2>&1 &
    server=$!
    # up to 300 s for the server to answer (the synthetic model is generated on the device first); give up at once
    # should it exit
    if SERVER_PID=$server python - <<'PY'
import os, time
import httpx

pid, deadline = int(os.environ["SERVER_PID"]), time.monotonic() + 300
def alive() -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
while time.monotonic() < deadline:
    if not alive():
        raise SystemExit("the server exited (server.log)")
    try:
        if httpx.get("http://127.0.0.1:8765/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(1)
else:
    raise SystemExit("the server did not come up in 300 s")
PY
    then
        # issue 6's harness command (its default prompts), one level at a time, each followed by the server's
        # counters so far (cumulative: a level's own are the difference): its split of a step (model vs the host's
        # drawing and delivering), batch sizes, prefill calls
        for level in $(echo "${DS4X_AB_CONCURRENCY:-1,8,32}" | tr , ' '); do
            piece "serve_bench_c$level.log" 150 python -m ds4x bench serve --url http://127.0.0.1:8765 --concurrency \
                "$level" --seconds "${DS4X_AB_SECONDS:-60}" --gen-tokens 384 --temperature 0.2 --ignore-eos \
                --ledger "$out/serve_ledger.jsonl"
            python -c 'import httpx; print(httpx.get("http://127.0.0.1:8765/metrics", timeout=10).text)' \
                > "$out/metrics_c$level.txt" 2>&1
        done
    else
        status=1
    fi
    kill "$server" 2>/dev/null
    for _ in $(seq 30); do  # a graceful stop, else killed: the device call must not wait on it
        kill -0 "$server" 2>/dev/null || break
        sleep 1
    done
    kill -9 "$server" 2>/dev/null
    wait "$server" 2>/dev/null
    # a device call returns at most 8 files: the kernels compiled after the warm-up (the server's warnings) as one
    # file, the logs and counters in one archive
    grep "compiled while serving" "$out/server.log" > "$out/compiles.txt"
    echo "$(wc -l < "$out/compiles.txt") kernel compiles after the warm-up ($out/compiles.txt)"
    (cd "$out" && tar czf serve_logs.tgz server.log serve_bench_c*.log metrics_c*.txt \
        && rm -f server.log serve_bench_c*.log metrics_c*.txt)
    ;;
gguf)
    file=/dev/shm/synthetic-flash-q2.gguf
    mount -o remount,size=118G /dev/shm || echo "could not grow /dev/shm (not root?)" >&2
    df -h /dev/shm | tee "$out/gguf_shm.txt"
    piece gguf_convert.log 300 python -m ds4x convert --synthetic flash --mix q2 --device cuda --out "$file"
    if [ -f "$file" ]; then
        ls -l "$file" | tee -a "$out/gguf_convert.log"
        # the hash beside the generate (both only read the file), so that the stage stays inside one call
        timeout -k 5 240 sha256sum "$file" > "$out/gguf_sha.log" 2>&1 &
        sha=$!
        piece gguf_generate.log 240 python -m ds4x generate -m "$file" -p "The capital of France is" -n 32 \
            --temp 0 --seed 0
        wait "$sha" || { echo "FAILED: sha256sum" >&2; status=1; }
        cat "$out/gguf_sha.log"
    fi
    rm -f "$file"
    ;;
*)
    echo "unknown stage $stage (kernels, step, serve, step32, prefill, loop, compressed, routed, frontier, candidates," \
        "tests, gguf, ncu or all)" >&2
    exit 2
    ;;
esac
exit $status
