"""Triton row kernels vs the torch reference, bit for bit.

On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1). The variable is
set by a fixture, not at import, so it does not leak into other test modules;
rows_triton builds a separate interpreter copy of its kernels when the mode differs
from the one it was imported under. The ``gpu`` tests run the compiled kernels; on a CUDA
machine the interpreter cases are skipped (Triton loaded compiled cannot interpret them).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from ds4x import formats as F  # noqa: E402
from ds4x.formats import rows_triton as RT  # noqa: E402
from tests.test_formats import (  # noqa: E402 - after the importorskip on purpose
    adversarial_indexer_rows,
    adversarial_kv_rows,
    assert_bits_equal,
    random_kv_rows,
    random_rows,
)


def _skip_on_cuda() -> None:
    # on a CUDA machine Triton has loaded in compiled mode and its interpreter cannot call the kernels' nested
    # helpers ("Cannot call @triton.jit'd outside of the scope of a kernel", H100, 2026-12-06; tests/conftest.py):
    # the gpu tests cover the compiled kernels there
    if torch.cuda.is_available():
        pytest.skip("interpreter case: Triton is loaded in compiled mode on a CUDA machine")


@pytest.fixture(scope="module")
def interp():
    """The interpreter, with programs of 16 rows whatever the row count (the interpreter's cost is per program;
    `test_programs_of_fewer_rows_interpreter` covers the small programs a decode step launches)."""
    _skip_on_cuda()
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    mp.setattr(RT, "rows_per_program", lambda n: (RT.BLOCK_ROWS, 4))
    yield
    mp.undo()


def test_rows_per_program():
    assert RT.rows_per_program(1) == (1, 1)
    assert RT.rows_per_program(32) == (1, 1)
    assert RT.rows_per_program(4096) == (8, 4)
    assert RT.rows_per_program(1 << 20) == (RT.BLOCK_ROWS, 4)


def kv_inputs() -> torch.Tensor:
    # 37 random rows + the adversarial ones: not a multiple of BLOCK_ROWS, so masking is exercised
    return torch.cat((random_kv_rows(37, seed=21), adversarial_kv_rows()))


def indexer_inputs() -> torch.Tensor:
    return torch.cat((random_rows(37, 128, seed=22), adversarial_indexer_rows()))


def test_pack_kv_rows_interpreter(interp):
    x = kv_inputs()
    assert x.shape[0] % RT.BLOCK_ROWS != 0
    assert torch.equal(F.pack_kv_rows_triton(x), F.pack_kv_rows(x))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # junk rows decode to inf
def test_unpack_kv_rows_interpreter(interp):
    x = kv_inputs()
    rows = F.pack_kv_rows(x)
    # also every possible byte in the E4M3 and scale positions (NaN codes, scale 0 and 255)
    junk = torch.randint(0, 256, (19, 583), generator=torch.Generator().manual_seed(23), dtype=torch.int32)
    junk[:, 448:576] = rows[:19, 448:576].to(torch.int32)  # keep the FP16 part meaningful
    junk[0, :256] = torch.arange(256)
    junk[1, 576:583] = torch.tensor([0, 1, 2, 127, 253, 254, 255])
    rows = torch.cat((rows, junk.to(torch.uint8)))
    assert_bits_equal(F.unpack_kv_rows_triton(rows), F.unpack_kv_rows(rows))


def test_pack_indexer_rows_interpreter(interp):
    x = indexer_inputs()
    assert torch.equal(F.pack_indexer_rows_triton(x), F.pack_indexer_rows(x))


@pytest.mark.parametrize("per", [1, 4])
def test_programs_of_fewer_rows_interpreter(monkeypatch, per):
    _skip_on_cuda()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(RT, "rows_per_program", lambda n: (per, 1 if per == 1 else 4))
    kv, idx = kv_inputs()[-19:], indexer_inputs()[-19:]  # the adversarial rows
    assert torch.equal(F.pack_kv_rows_triton(kv), F.pack_kv_rows(kv))
    assert torch.equal(F.pack_indexer_rows_triton(idx), F.pack_indexer_rows(idx))
    assert_bits_equal(F.unpack_indexer_rows_triton(F.pack_indexer_rows(idx)),
                      F.unpack_indexer_rows(F.pack_indexer_rows(idx)))
    finite = idx[:, :64].abs().amax(-1) < 1e30
    assert_bits_equal(RT.rotate_mxfp4_roundtrip_triton(idx[finite]),
                      F.unpack_indexer_rows(F.pack_indexer_rows(F.hadamard128(idx[finite]))))


def test_rotated_indexer_rows_and_round_trip_interpreter(interp):
    x = indexer_inputs()
    rotated = F.hadamard128(x)
    x, rotated = x[rotated.isfinite().all(-1)], rotated[rotated.isfinite().all(-1)]  # 2e38 rows overflow
    assert torch.equal(F.pack_indexer_rows_triton(x, rotate=True), F.pack_indexer_rows(rotated))
    assert_bits_equal(RT.rotate_mxfp4_roundtrip_triton(x), F.unpack_indexer_rows(F.pack_indexer_rows(rotated)))
    ring = torch.zeros(8, 68, dtype=torch.uint8)
    F.pack_indexer_rows_triton(x[:3].bfloat16(), out=ring, at=torch.tensor([9, 2, 7]), validate=False, rotate=True)
    expect = torch.zeros_like(ring)
    expect[[1, 2, 7]] = F.pack_indexer_rows(F.hadamard128(x[:3].bfloat16()))
    assert torch.equal(ring, expect)


def test_pack_into_a_ring_interpreter(interp):
    """With out/at the packed rows land in the ring at at % len(out), the same bytes, other slots untouched."""
    for x, pack, ref in ((kv_inputs(), F.pack_kv_rows_triton, F.pack_kv_rows),
                         (indexer_inputs(), F.pack_indexer_rows_triton, F.pack_indexer_rows)):
        packed = ref(x)
        ring = torch.full((64, packed.shape[1]), 7, dtype=torch.uint8)
        at = (torch.arange(x.shape[0]) + 40).flip(0)  # wraps: slots 40..63 then 0..
        expect = ring.clone()
        expect[at % 64] = packed
        assert pack(x, out=ring, at=at) is ring
        assert torch.equal(ring, expect)
        with pytest.raises(ValueError, match="go together"):
            pack(x, out=ring)
        with pytest.raises(ValueError, match="one integer row index"):
            pack(x, out=ring, at=at[:3])
        with pytest.raises(ValueError, match="contiguous uint8"):
            pack(x, out=ring[:, :5], at=at)


def test_half_precision_rows_read_as_float32_interpreter(interp):
    """Unvalidated half-precision rows go into the kernels as they are and pack like their float32 values."""
    g = torch.Generator().manual_seed(24)
    for dtype in (torch.bfloat16, torch.float16):
        kv, idx = (torch.randn(37, 512, generator=g) * 4).to(dtype), (torch.randn(37, 128, generator=g) * 4).to(dtype)
        assert torch.equal(F.pack_kv_rows_triton(kv, validate=False), F.pack_kv_rows(kv.float()))
        assert torch.equal(F.pack_indexer_rows_triton(idx, validate=False), F.pack_indexer_rows(idx.float()))
        assert_bits_equal(F.hadamard128_triton(idx), F.hadamard128(idx.float()))


def test_write_float_rows_into_a_ring_interpreter(interp):
    """Float rows (any float type) land in a float32 ring at at % len(out) as float32, other slots untouched."""
    for dtype in (torch.float32, torch.bfloat16):
        x = random_rows(21, 40, seed=26).to(dtype)
        ring = torch.full((16, 40), 7.0)
        at = torch.arange(21) + 11  # wraps past the 16 slots: the last 16 rows win their slots
        expect = ring.clone().index_copy_(0, at[5:] % 16, x[5:].float())
        RT.write_float_rows_triton(x[5:], ring, at[5:])
        assert_bits_equal(ring, expect)
    with pytest.raises(ValueError, match="contiguous float32"):
        RT.write_float_rows_triton(x, ring.double(), at)
    with pytest.raises(ValueError, match="one integer row index"):
        RT.write_float_rows_triton(x, ring, at[:3])


def test_write_into_a_batch_of_rings_interpreter(interp):
    """out [N, ring, width] (the rings of a batched decode step): row r lands in ring r at at[r] % ring, the same
    bytes as a write into that ring alone, every other slot untouched."""
    x_kv, x_ix, x_f = kv_inputs()[:5], indexer_inputs()[:5], random_rows(5, 40, seed=27)
    at = torch.tensor([3, 17, 0, 40, 9])
    for x, write, width, dtype in ((x_kv, F.pack_kv_rows_triton, 583, torch.uint8),
                                   (x_ix, F.pack_indexer_rows_triton, 68, torch.uint8),
                                   (x_f, None, 40, torch.float32)):
        rings = torch.full((5, 16, width), 7, dtype=dtype)
        expect = rings.clone()
        for r in range(5):
            if write is None:
                RT.write_float_rows_triton(x[r : r + 1], expect[r], at[r : r + 1])
            else:
                write(x[r : r + 1], out=expect[r], at=at[r : r + 1])
        if write is None:
            RT.write_float_rows_triton(x, rings, at)
        else:
            assert write(x, out=rings, at=at) is rings
        assert torch.equal(rings, expect)
        with pytest.raises(ValueError, match="batch of rings"):
            (RT.write_float_rows_triton(x, rings[:4], at) if write is None else write(x, out=rings[:4], at=at))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_unpack_indexer_rows_interpreter(interp):
    rows = F.pack_indexer_rows(indexer_inputs())
    junk = torch.randint(0, 256, (21, 68), generator=torch.Generator().manual_seed(24), dtype=torch.int32)
    junk[0, :64] = torch.arange(0, 256, 4)
    junk[1, 64:68] = torch.tensor([0, 1, 254, 255])
    rows = torch.cat((rows, junk.to(torch.uint8)))
    assert_bits_equal(F.unpack_indexer_rows_triton(rows), F.unpack_indexer_rows(rows))


def test_shapes_validation_and_nonfinite_interpreter(interp):
    x = random_kv_rows(6, seed=25).view(2, 3, 512)
    assert torch.equal(F.pack_kv_rows_triton(x), F.pack_kv_rows(x))
    assert F.pack_kv_rows_triton(torch.zeros(0, 512)).shape == (0, 583)
    assert F.unpack_indexer_rows_triton(torch.zeros(0, 68, dtype=torch.uint8)).shape == (0, 128)
    bad = torch.ones(2, 512)
    bad[1, 3] = math.nan
    with pytest.raises(ValueError, match="NaN/Inf"):
        F.pack_kv_rows_triton(bad)
    bad[0, 200] = math.inf
    bad[0, 460] = -math.inf
    assert torch.equal(F.pack_kv_rows_triton(bad, validate=False), F.pack_kv_rows(bad, validate=False))
    bi = torch.ones(3, 128)
    bi[2, 77] = -math.inf
    with pytest.raises(ValueError, match="NaN/Inf"):
        F.pack_indexer_rows_triton(bi)
    bi[0, 1] = math.nan
    assert torch.equal(F.pack_indexer_rows_triton(bi, validate=False), F.pack_indexer_rows(bi, validate=False))
    with pytest.raises(ValueError, match="500 values"):
        F.pack_kv_rows_triton(torch.zeros(2, 500))


def test_kv_rows_of_other_widths_interpreter(interp):
    # the embedded model's heads: 128 values = one E4M3 block + 64 RoPE dims -> 193 bytes
    x = torch.randn(21, 128, generator=torch.Generator().manual_seed(24)) * 7
    x[0] = 0.0
    rows = F.pack_kv_rows_triton(x, rope_dim=64)
    assert rows.shape == (21, 193) and torch.equal(rows, F.pack_kv_rows(x, rope_dim=64))
    assert_bits_equal(F.unpack_kv_rows_triton(rows, rope_dim=64), F.unpack_kv_rows(rows, rope_dim=64))
    with pytest.raises(ValueError, match="not supported by the kernel"):
        F.pack_kv_rows_triton(torch.zeros(2, 160), rope_dim=32)


def test_hadamard128_interpreter(interp):
    x = torch.cat((indexer_inputs()[:37], torch.tensor([[3.0e38] * 128, [-0.0] * 128, [1e-40] * 128])))
    assert_bits_equal(F.hadamard128_triton(x), F.hadamard128(x))
    assert F.hadamard128_triton(x.view(5, 8, 128)).shape == (5, 8, 128)


def test_cpu_tensor_needs_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("only meaningful without a GPU")
    with pytest.raises(ValueError, match="CUDA tensor"):
        F.pack_kv_rows_triton(torch.zeros(1, 512))


# ---------------------------------------------------------------------------
# GPU: compiled kernels at real sizes, and the torch path on the device
# ---------------------------------------------------------------------------


@pytest.fixture
def compiled(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.gpu
def test_triton_kv_rows_on_gpu(compiled):
    x = torch.cat((random_kv_rows(8191, seed=31), adversarial_kv_rows()))
    ref = F.pack_kv_rows(x)
    got = F.pack_kv_rows_triton(x.cuda())
    assert torch.equal(got.cpu(), ref)
    for n in (1, 32):
        assert torch.equal(F.pack_kv_rows_triton(x[-n:].cuda()).cpu(), ref[-n:])
    assert_bits_equal(F.unpack_kv_rows_triton(got).cpu(), F.unpack_kv_rows(ref))
    junk = torch.randint(0, 256, (4096, 583), dtype=torch.int32).to(torch.uint8)
    assert_bits_equal(F.unpack_kv_rows_triton(junk.cuda()).cpu(), F.unpack_kv_rows(junk))


@pytest.mark.gpu
def test_triton_indexer_rows_on_gpu(compiled):
    x = torch.cat((random_rows(8191, 128, seed=32), adversarial_indexer_rows()))
    ref = F.pack_indexer_rows(x)
    got = F.pack_indexer_rows_triton(x.cuda())
    assert torch.equal(got.cpu(), ref)
    assert_bits_equal(F.unpack_indexer_rows_triton(got).cpu(), F.unpack_indexer_rows(ref))
    junk = torch.randint(0, 256, (4096, 68), dtype=torch.int32).to(torch.uint8)
    assert_bits_equal(F.unpack_indexer_rows_triton(junk.cuda()).cpu(), F.unpack_indexer_rows(junk))
    for n in (1, 32, 8191):  # one-row programs of a decode step, and 16-row ones
        rotated = F.hadamard128(x[:n])
        ok = rotated.isfinite().all(-1)
        assert torch.equal(F.pack_indexer_rows_triton(x[:n][ok].cuda(), rotate=True).cpu(),
                           F.pack_indexer_rows(rotated[ok]))
        assert_bits_equal(RT.rotate_mxfp4_roundtrip_triton(x[:n][ok].cuda()).cpu(),
                          F.unpack_indexer_rows(F.pack_indexer_rows(rotated[ok])))


@pytest.mark.gpu
def test_pack_into_a_ring_on_gpu(compiled):
    x = random_kv_rows(300, seed=35).cuda()
    ring = torch.zeros(256, 583, dtype=torch.uint8, device="cuda")
    # 256 distinct slots past the ring's length, in shuffled order (duplicate slots would race)
    at = 1000 + torch.randperm(256, device="cuda")
    F.pack_kv_rows_triton(x[:256], out=ring, at=at)
    expect = torch.zeros_like(ring)
    expect[at % 256] = F.pack_kv_rows_triton(x[:256])
    assert torch.equal(ring, expect)


@pytest.mark.gpu
def test_half_precision_rows_and_float_ring_writes_on_gpu(compiled):
    x = random_kv_rows(1000, seed=36)
    assert torch.equal(F.pack_kv_rows_triton(x.bfloat16().cuda(), validate=False).cpu(),
                       F.pack_kv_rows(x.bfloat16().float()))
    ring = torch.zeros(256, 512, device="cuda")
    at = 1000 + torch.randperm(256, device="cuda")
    RT.write_float_rows_triton(x[:256].bfloat16().cuda(), ring, at)
    expect = torch.zeros_like(ring).index_copy_(0, at % 256, x[:256].bfloat16().float().cuda())
    assert torch.equal(ring, expect)


@pytest.mark.gpu
def test_triton_hadamard_and_narrow_kv_rows_on_gpu(compiled):
    x = torch.randn(8191, 128, generator=torch.Generator().manual_seed(34)) * 5
    assert_bits_equal(F.hadamard128_triton(x.cuda()).cpu(), F.hadamard128(x))
    rows = F.pack_kv_rows_triton(x.cuda(), rope_dim=64)
    assert torch.equal(rows.cpu(), F.pack_kv_rows(x, rope_dim=64))
    assert_bits_equal(F.unpack_kv_rows_triton(rows, rope_dim=64).cpu(), F.unpack_kv_rows(rows.cpu(), rope_dim=64))


@pytest.mark.gpu
def test_torch_path_on_gpu_matches_cpu():
    x = torch.cat((random_kv_rows(4096, seed=33), adversarial_kv_rows()))
    assert torch.equal(F.pack_kv_rows(x.cuda()).cpu(), F.pack_kv_rows(x))
    rows = F.pack_kv_rows(x)
    assert_bits_equal(F.unpack_kv_rows(rows.cuda()).cpu(), F.unpack_kv_rows(rows))
    y = torch.cat((random_rows(4096, 128, seed=34), adversarial_indexer_rows()))
    assert torch.equal(F.pack_indexer_rows(y.cuda()).cpu(), F.pack_indexer_rows(y))
    assert_bits_equal(F.hadamard128(y.cuda()).cpu(), F.hadamard128(y))
    assert_bits_equal(F.e4m3_block_roundtrip(x[:, :448].cuda()).cpu(), F.e4m3_block_roundtrip(x[:, :448]))
    assert_bits_equal(F.mxfp4_roundtrip(y.cuda()).cpu(), F.mxfp4_roundtrip(y))
