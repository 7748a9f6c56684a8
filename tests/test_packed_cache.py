"""The packed persistent cache: memory plan, bit-identity with native-unpacked, rings, rewind, refusal."""

import pytest
import torch

from ds4x.config import flash_config
from ds4x.model.cache import CacheMemoryError, ModelCache, plan_cache
from ds4x.runtime.engine import Engine
from ds4x.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine():
    return Engine.load("tiny", device="cpu")


def _ids(n, seed=0):
    return torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_flash_plan_at_1m_matches_the_design_figure():
    plan = plan_cache(flash_config(), 1_048_576, 32, "packed")
    assert plan["persistent_kv"] == 3_685_757_670
    assert plan["raw_rows"] == 43 * 256 * 583
    assert plan["indexer_rows"] == 21 * (1_048_576 // 4 + 2) * 68


def test_packed_logits_are_bit_identical_to_native_unpacked(engine):
    ids = _ids(300)  # longer than the 256-row raw ring and every frontier ring: they wrap
    out = {}
    for mode in ("native", "packed"):
        s = engine.new_session(ctx=512, cache=mode, prefill_chunk=32)
        prefill = s.prefill(ids)
        decode = [logits for _, logits in s.generate([], 40, SamplingParams(), stop_ids=())]
        out[mode] = torch.stack([prefill, *decode])
    assert torch.equal(out["native"], out["packed"])


def test_packed_storage_is_bytes_of_the_planned_size(engine):
    s = engine.new_session(ctx=1024, cache="packed", prefill_chunk=32)
    st = s.cache.layers[1]  # a CSA layer of the tiny model
    assert st.raw.data.dtype == torch.uint8 and st.raw.data.shape == (256, 193)
    assert st.idx_rows.data.shape == (1024 // 4 + 2, 68)
    assert s.cache.nbytes() == s.cache.plan["total"]


def test_rewind_near_and_far(engine):
    ids = _ids(400, seed=1)
    s = engine.new_session(ctx=512, cache="packed", prefill_chunk=32, prefill_mode="exact")
    s.prefill(ids)
    # frontier rings hold 2*ratio + chunk positions, the one of position 400 maybe written past the length
    # (DecodeSlots): the CSA ratio-4 layers can continue from >= 368, whose oldest frontier position is 364
    assert s.cache.can_rewind(368) and not s.cache.can_rewind(367)
    for target in (395, 50):  # rows still resident / long gone (the prefix is recomputed)
        s.rewind(target)
        assert s.tokens == ids[:target]
        fresh = engine.new_session(ctx=512, cache="packed", prefill_chunk=32, prefill_mode="exact")
        assert torch.equal(s.logits, fresh.prefill(ids[:target]))


def test_exact_prefill_is_bit_identical_to_token_by_token_decode(engine):
    ids = _ids(90, seed=2)
    exact = engine.new_session(ctx=256, cache="packed", prefill_chunk=32, prefill_mode="exact")
    decode = engine.new_session(ctx=256, cache="packed", prefill_chunk=32)
    a = exact.prefill(ids)
    for t in ids:
        b = decode.step(t)
    assert torch.equal(a, b)


def test_a_context_the_device_cannot_hold_is_refused_with_the_plan():
    with pytest.raises(CacheMemoryError, match=r"needs .* GiB \(raw_rows .*\) but cpu has .* GiB free"):
        ModelCache(flash_config(), 1 << 38, "cpu", "packed", 32)


def test_ring_writes_through_the_triton_pack_match_the_torch_path(monkeypatch):
    """RowStore.write_at with the packed codecs: the Triton pack writing straight into the ring (the GPU path,
    here in the interpreter) leaves the same bytes as packing and then index_copy_ (the torch path)."""
    pytest.importorskip("triton")
    import ds4x.model.cache as cache_mod
    from ds4x.formats import rows_triton
    from ds4x.model.cache import PackedIndexerCodec, PackedKVCodec, RowStore

    if torch.cuda.is_available():
        pytest.skip("the GPU tests cover the compiled path")
    for codec, dim in ((PackedKVCodec(512, 64), 512), (PackedIndexerCodec(), 128)):
        stores = {}
        for path in ("torch", "triton"):
            monkeypatch.setattr(cache_mod, "_triton_rows",
                                lambda x, kv_dims=None, p=path: rows_triton if p == "triton" else None)
            store = RowStore(48, codec, torch.device("cpu"))
            for start in (0, 30, 61):  # the last write wraps the ring
                rows = torch.randn(20, dim, generator=torch.Generator().manual_seed(start)) * 3
                store.write_at(torch.arange(start, start + 20), rows)
            stores[path] = store.data
        assert torch.equal(stores["torch"], stores["triton"])


def test_a_second_rewind_sees_the_rows_the_first_one_left_written(engine):
    """Rewinding lowers the length, not the rows written past it: a ring slot a later position overwrote stays
    overwritten, so a second rewind that needs that slot's older row must be refused (it was accepted and
    continued from wrong rows: the server's prefix reuse rewound a stored session twice)."""
    ids = _ids(400, seed=3)
    s = engine.new_session(ctx=512, cache="packed", prefill_chunk=32, prefill_mode="exact")
    s.prefill(ids)
    floor = s.cache.rewind_floor()
    assert floor > 0
    s.rewind(floor + 10)
    assert s.cache.rewind_floor() == floor and not s.cache.can_rewind(floor - 1)
    s.rewind(floor)  # still exact
    fresh = engine.new_session(ctx=512, cache="packed", prefill_chunk=32, prefill_mode="exact")
    assert torch.equal(s.logits, fresh.prefill(ids[:floor]))
