"""Comparing two optimizers' states as they are stored: codes and absmax of a QuantizedState, bf16 tensors,
plain tensors (test_low_bit's level parity)."""

import torch

from conftest import assert_state_close
from fastoptim import storage

# Where two levels may store different state (test_low_bit's level parity): each computes a state's new value in
# its own order (the loop level in torch ops, the CPU kernel fused), so the fp32 values differ by an ulp or so,
# and where one lies within that of a rounding boundary its stored code (or bf16) lands one step apart. That
# happens to an element in some 10^5 per step: at most FLIPS per state tensor, one code (one bf16 ulp) apart. The
# absmax of a block is the largest |value|, which differs by those ulps: ABSMAX_RTOL (8 ulps). A flipped state
# moves the params of the steps after it by lr times the flip's share of the update (3.5e-5 measured, RMSprop
# at 16 bits): FLIPPED_PARAM_ATOL from then on, the fp32 tolerance before.
FLIPS = 2
ABSMAX_RTOL = 1e-6
FLIPPED_PARAM_ATOL = 1e-4


def _one_code_per_element(state):
    codes = state.codes
    if state.fmt.bits == 4:
        codes = storage.quant.unpack4(codes, storage.quant.rows_of(state.shape)[1])
    return codes.reshape(-1).long()


def _flips(actual, expected, where):
    """The elements where two codes (or two bf16 numbers, read as their bits) differ: each must be one step."""
    differ = (actual != expected).nonzero().flatten()
    assert len(differ) <= FLIPS, f"{where}: {len(differ)} elements differ (at most {FLIPS} may flip)"
    steps = (actual[differ] - expected[differ]).abs()
    assert (steps == 1).all(), f"{where}: codes {actual[differ].tolist()} vs {expected[differ].tolist()}"
    return len(differ)


def stored_state_flips(ours, base, ours_p, base_p, step):
    """Compare each stored state of ``ours`` with the loop level's, in its stored form: codes and absmax of a
    QuantizedState, the bf16 tensor itself. Returns how many codes (bf16 numbers) flipped."""
    flips = 0
    for i, (a, b) in enumerate(zip(ours_p, base_p)):
        mine, theirs = ours.state[a], base.state[b]
        assert mine.keys() == theirs.keys(), (i, mine.keys(), theirs.keys())
        for key, expected in theirs.items():
            actual, where = mine[key], f"step {step}, param {i}, {key}"
            assert type(actual) is type(expected), (where, type(actual), type(expected))
            if isinstance(expected, storage.QuantizedState):
                assert actual.fmt == expected.fmt and actual.shape == expected.shape, where
                assert actual.codes.shape == expected.codes.shape, where
                flips += _flips(_one_code_per_element(actual), _one_code_per_element(expected), where)
                torch.testing.assert_close(actual.absmax, expected.absmax, atol=0, rtol=ABSMAX_RTOL,
                                           msg=lambda m: f"{where} absmax: {m}")
            elif not isinstance(expected, torch.Tensor):
                assert actual == expected, (where, actual, expected)
            elif expected.dtype == torch.bfloat16:
                assert actual.dtype == torch.bfloat16 and actual.shape == expected.shape, where
                # bf16 bits as ints: adjacent numbers of one sign are one apart
                flips += _flips(actual.view(torch.int16).reshape(-1).int(),
                                expected.view(torch.int16).reshape(-1).int(), where)
            elif expected.is_floating_point():
                assert actual.dtype == expected.dtype, where
                assert_state_close(actual, expected, where)
            else:
                assert torch.equal(actual, expected), where
    return flips
