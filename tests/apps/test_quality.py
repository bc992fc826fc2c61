"""Quality on a real small task: the byte-level MLP language model of ``fastoptim curves`` (pydoc text, same
seed and batches), trained with low-bit state or bf16 params against the same run at 32-bit state and fp32
params. Final loss: the mean over the last tenth of the steps (``curves.final_loss``)."""

import pytest
import torch

import fastoptim
from fastoptim import curves

STEPS = 200


def final_loss(seed: int, lr: float, param_dtype=torch.float32, **settings) -> float:
    losses = curves.train("adamw", lambda m: fastoptim.AdamW(m.parameters(), lr=lr, **settings), STEPS, seed,
                          param_dtype=param_dtype)
    return curves.final_loss(losses)


def gap_percent(loss: float, reference: float) -> float:
    return (loss - reference) / reference * 100


@pytest.fixture(scope="module")
def adamw_32_bit():
    return {seed: final_loss(seed, lr=3e-3) for seed in (0, 1, 2)}


# Measured gaps (final loss vs 32-bit state, AdamW lr 3e-3, 200 steps, impl="auto") over seeds 0-7:
#   8-bit: -0.016, +0.026, -0.047, +0.023, +0.018, -0.018, -0.042, +0.031 %  (worst 0.047 %)
#   4-bit: +0.802, +1.274, +0.795, +0.987, +0.973, +1.036, +1.036, +0.925 %  (worst 1.274 %)
#   fp8:   -0.052, +0.042 % (seeds 0-1; worst 0.052 %)
# The bands are about twice the worst (fp8's a little more: two seeds measured).
BANDS = {8: 0.1, 4: 2.5, "fp8_e4m3": 0.15}


@pytest.mark.parametrize("bits", list(BANDS))
def test_low_bit_adamw_ends_within_a_stated_band_of_the_32_bit_loss(adamw_32_bit, bits):
    for seed, reference in adamw_32_bit.items():
        gap = gap_percent(final_loss(seed, lr=3e-3, state_bits=bits), reference)
        assert abs(gap) < BANDS[bits], (bits, seed, gap)


# bf16 params without an fp32 copy, AdamW lr 3e-4 (most updates are below half a bf16 ulp of their weight, so
# rounding to nearest drops them), 200 steps; gaps to the fp32-param run, seeds 0-5:
#   nearest:    +2.985, +4.099, +3.524, +3.877, +3.966, +3.567 %
#   stochastic: +0.024, +0.004, -0.028, -0.014, +0.032, +0.017 %  (worst 0.032 %)
#   kahan:      +0.005, +0.004, +0.010, +0.005, +0.008, +0.004 %  (worst 0.010 %)
ROUNDING_BANDS = {"stochastic": 0.065, "kahan": 0.02}
NEAREST_STALLS_BY_AT_LEAST = 1.5  # percent: half the smallest gap measured, so the setting really tells them apart


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_params_with_stochastic_or_kahan_rounding_end_closer_to_fp32_than_nearest(seed):
    reference = final_loss(seed, lr=3e-4)
    nearest = gap_percent(final_loss(seed, lr=3e-4, param_dtype=torch.bfloat16, rounding="nearest"), reference)
    assert nearest > NEAREST_STALLS_BY_AT_LEAST, nearest
    for rounding, band in ROUNDING_BANDS.items():
        gap = gap_percent(final_loss(seed, lr=3e-4, param_dtype=torch.bfloat16, rounding=rounding), reference)
        assert abs(gap) < band and abs(gap) < nearest / 10, (rounding, gap, nearest)
