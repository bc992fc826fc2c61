"""Blocks of ``update`` math that several rules share, written once.

A helper keeps the ``update`` contract (operators and ``prims`` on tensors, branches on FLAGS only); a rule imports
it by name and its update calls it. The torch levels and the C++ twin run the call as Python; the Triton twin
finds it among the update's globals and jits it as it jits the update, and Triton inlines it.
"""

from __future__ import annotations


def maximize_and_decay(p, g, weight_decay, decay_factor, MAXIMIZE, WEIGHT_DECAY, DECOUPLED):
    """(p, g) after maximize and weight decay: decoupled scales p by ``decay_factor`` (1 - lr wd), coupled adds
    ``weight_decay`` p to the grad. A rule that decays one way only passes that DECOUPLED and None for the other
    scalar."""
    if MAXIMIZE:
        g = -g
    if WEIGHT_DECAY:
        if DECOUPLED:
            p = p * decay_factor
        else:
            g = g + weight_decay * p
    return p, g


def adam_moments(g, exp_avg, exp_avg_sq, one_minus_beta1, beta2, one_minus_beta2):
    """Adam's moments: m <- m + (1 - b1) (g - m), v <- b2 v + (1 - b2) g^2."""
    exp_avg = exp_avg + (g - exp_avg) * one_minus_beta1
    exp_avg_sq = exp_avg_sq * beta2 + g * g * one_minus_beta2
    return exp_avg, exp_avg_sq
