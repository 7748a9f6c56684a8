import pytest

from ds4x.bench.variants import parse_variant, variant_applied
from ds4x.kernels import quant_matmul as qm


def test_a_variant_sets_module_attributes_and_puts_them_back() -> None:
    name, sets = parse_variant("both: ds4x.kernels.quant_matmul.Q2_K_PREPARED_ACTIVATIONS=False; "
                               "ds4x.kernels.quant_matmul.EXPERT_PAIRS_MIN=2 * 3")
    assert name == "both" and [(m, a, v) for m, a, v in sets] == [(qm, "Q2_K_PREPARED_ACTIVATIONS", False),
                                                                  (qm, "EXPERT_PAIRS_MIN", 6)]
    before = (qm.Q2_K_PREPARED_ACTIVATIONS, qm.EXPERT_PAIRS_MIN)
    assert before != (False, 6)  # the variant changes both
    with pytest.raises(RuntimeError), variant_applied(sets):  # restored even when the block fails
        assert (qm.Q2_K_PREPARED_ACTIVATIONS, qm.EXPERT_PAIRS_MIN) == (False, 6)
        raise RuntimeError
    assert (qm.Q2_K_PREPARED_ACTIVATIONS, qm.EXPERT_PAIRS_MIN) == before
    for bad in ("no colon here", "x:", "x: ds4x.kernels.quant_matmul.NO_SUCH_SWITCH=1"):
        with pytest.raises(SystemExit):
            parse_variant(bad)
