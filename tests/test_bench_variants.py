import pytest

from ds4x.bench.variants import parse_variant, variant_applied
from ds4x.kernels import quant_matmul as qm


def test_a_variant_sets_module_attributes_and_puts_them_back() -> None:
    name, sets = parse_variant("both: ds4x.kernels.quant_matmul.SHARED_TABLES=True; "
                               "ds4x.kernels.quant_matmul.SHARED_TABLES_PROGRAMS_PER_SM=2 * 3")
    assert name == "both" and [(m, a, v) for m, a, v in sets] == [(qm, "SHARED_TABLES", True),
                                                                  (qm, "SHARED_TABLES_PROGRAMS_PER_SM", 6)]
    before = (qm.SHARED_TABLES, qm.SHARED_TABLES_PROGRAMS_PER_SM)
    with pytest.raises(RuntimeError), variant_applied(sets):  # restored even when the block fails
        assert (qm.SHARED_TABLES, qm.SHARED_TABLES_PROGRAMS_PER_SM) == (True, 6)
        raise RuntimeError
    assert (qm.SHARED_TABLES, qm.SHARED_TABLES_PROGRAMS_PER_SM) == before
    for bad in ("no colon here", "x:", "x: ds4x.kernels.quant_matmul.NO_SUCH_SWITCH=1"):
        with pytest.raises(SystemExit):
            parse_variant(bad)
