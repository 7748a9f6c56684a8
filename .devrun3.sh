python -m pip install -q --no-deps .whl/gguf-0.19.0-py3-none-any.whl .whl/serve/*.whl 2>&1 | tail -2
export PYTHONPATH=src
H=$(git rev-parse --short HEAD 2>/dev/null || echo unknown); echo head=$H
export DS4X_COMMIT=b4ace01
mkdir -p $OUT/r
timeout 240 python -m pytest -q -m gpu tests/test_quant_matmul.py tests/test_branches.py tests/test_batch.py -x > $OUT/r/tests.log 2>&1; echo tests rc=$?; tail -3 $OUT/r/tests.log
timeout 120 python -m ds4x bench frontier --weights q2 --contexts 4096,1048576 --steps 50 --ledger $OUT/r/ledger.jsonl > $OUT/r/frontier.log 2>&1; echo frontier rc=$?
(cd devrun/prev && DS4X_COMMIT=c825f43 timeout 120 python -m ds4x bench frontier --weights q2 --contexts 4096,1048576 --steps 50 --ledger $OUT/r/ledger.jsonl > $OUT/r/frontier_prev.log 2>&1; echo frontier prev rc=$?)
timeout 120 python -m ds4x bench frontier --weights q2 --contexts 4096 --steps 50 > $OUT/r/frontier2.log 2>&1; echo frontier2 rc=$?
timeout 250 python scripts/batched_decode.py --batches 1,8,32 --rounds 2 \
  --variant 'topk 16 warps: ds4x.kernels.select.SMALL_WARPS=16' \
  --variant 'topk 32 warps: ds4x.kernels.select.SMALL_WARPS=32' \
  --ledger $OUT/r/ledger.jsonl > $OUT/r/batched.log 2>&1; echo batched rc=$?
tail -19 $OUT/r/batched.log
timeout 150 python -m ds4x bench prefill -m flash:q2 --contexts 4096,16384 --ledger $OUT/r/ledger.jsonl > $OUT/r/prefill.log 2>&1; echo prefill rc=$?
for f in frontier frontier_prev frontier2; do echo == $f; grep -A3 "context  top-k" $OUT/r/$f.log | head -3; done
tail -3 $OUT/r/prefill.log
cd $OUT && tar czf r.tgz r && rm -rf r
