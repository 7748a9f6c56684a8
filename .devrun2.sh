python -m pip install -q --no-deps .whl/gguf-0.19.0-py3-none-any.whl .whl/serve/*.whl 2>&1 | tail -2
export PYTHONPATH=src DS4X_COMMIT=9b534c1
mkdir -p $OUT/r
timeout 200 python -m pytest -q -m gpu tests/test_quant_matmul.py tests/test_branches.py -x > $OUT/r/tests.log 2>&1; echo tests rc=$?; tail -3 $OUT/r/tests.log
timeout 330 python scripts/batched_decode.py --batches 1,8,32 --rounds 2 \
  --variant 'unfused swiglu: ds4x.model.moe.routed_swiglu=lambda *a: None' \
  --variant 'topk 4 warps: ds4x.kernels.select.SMALL_WARPS=4' \
  --variant 'topk 2 warps: ds4x.kernels.select.SMALL_WARPS=2' \
  --variant 'topk 4 warps 4 bits: ds4x.kernels.select.SMALL_WARPS=4; ds4x.kernels.select.SMALL_BITS=4' \
  --ledger $OUT/r/ledger.jsonl > $OUT/r/batched.log 2>&1; echo batched rc=$?
tail -32 $OUT/r/batched.log
timeout 150 python -m ds4x bench frontier --weights q2 --contexts 4096,1048576 --steps 50 --ledger $OUT/r/ledger.jsonl > $OUT/r/frontier.log 2>&1; echo frontier rc=$?
tail -3 $OUT/r/frontier.log
cd $OUT && tar czf r.tgz r && rm -rf r
