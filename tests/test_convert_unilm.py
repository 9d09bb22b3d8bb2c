"""unilm V1 state_dicts with and without `subln.weight`, to and from diffjax layers.

Checked against the PyTorch re-statement of unilm's MultiheadFlashDiff1 in tests/test_unilm_attention.py:
an export loads into the PyTorch module with `load_state_dict(strict=True)` and computes what the
original module computes. (Loading, including without subln.weight, is tested there too.)
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from diffjax.convert import load_unilm_attention, unilm_attention_state_dict  # noqa: E402
from test_unilm_attention import SHAPES, UnilmFlashDiff1, make_input, make_module, to_numpy, torch_forward  # noqa: E402

FP32_ATOL = 2e-5


def to_torch(state):
    return {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in state.items()}


@pytest.mark.parametrize("source_has_subln", [True, False])
@pytest.mark.parametrize("target_has_subln", [True, False])
def test_unilm_to_diffjax_to_unilm(source_has_subln, target_has_subln, measured):
    E, H, Hkv = SHAPES["gqa2"]
    original = make_module(UnilmFlashDiff1, E, H, Hkv, 3, subln_affine=source_has_subln)  # random non-unit subln weight
    layer = load_unilm_attention(original.state_dict(), depth=3)
    exported = unilm_attention_state_dict(layer, subln=target_has_subln)
    assert ("subln.weight" in exported) == target_has_subln

    target = UnilmFlashDiff1(E, 3, H, Hkv, subln_affine=target_has_subln).eval()
    target.load_state_dict(to_torch(exported), strict=True)
    x = make_input(E)
    expected, got = torch_forward(original, x), torch_forward(target, x)
    if source_has_subln == target_has_subln or not source_has_subln:
        # Same parameters, or ones folded into out_proj (x * 1 is exact): the very same module.
        for key, value in original.state_dict().items():
            if key in exported:
                np.testing.assert_array_equal(exported[key], to_numpy(value), err_msg=key)
        if not source_has_subln and target_has_subln:
            np.testing.assert_array_equal(exported["subln.weight"], np.ones(E // H, np.float32))
        assert torch.equal(got, expected)
    else:
        # A learned subln weight folded into out_proj's columns: the same function up to rounding.
        err = measured("subln folded into out_proj, max abs diff", float((got - expected).abs().max()), FP32_ATOL)
        assert err <= FP32_ATOL
        assert not np.array_equal(exported["out_proj.weight"], to_numpy(original.out_proj.weight))
