"""The hand mutations of the mutation sample: wrong math a test must catch (``run.py`` applies them one at a time).

Each is (name, file, exact old text, new text, what it breaks, likely test files, and a ``-k`` filter for them).
The old text must occur once in its file. ``likely`` lists the test files a developer changing that code would
run first: ``run.py --likely`` runs those (with ``select`` as ``-k``) to name the catching test quickly; a
mutation counts as caught only if a test of the whole suite fails.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str
    what: str
    likely: tuple[str, ...]
    select: str = ""


ADAM = "src/fastoptim/rules/adam.py"
CPU_KERNELS = "src/fastoptim/levels/cpu_kernels.py"
PARITY = ("tests/surface/test_parity_regimes.py", "tests/surface/test_parity.py")
LOW_BIT = ("tests/paths/test_cpu_kernels.py", "tests/storage/test_low_bit.py", "tests/storage/test_quant.py")

MUTATIONS = [
    Mutation("adam_weight_decay_dropped", ADAM,
             "            g = g + weight_decay * p\n", "            g = g\n",
             "Adam's L2 weight decay dropped (AdamW's decoupled one kept)", PARITY, "adam"),
    Mutation("rmsprop_eps_inside_sqrt", "src/fastoptim/rules/rmsprop.py",
             "        avg = sqrt(square_avg) + eps\n", "        avg = sqrt(square_avg + eps)\n",
             "RMSprop's eps inside the square root (uncentered)", PARITY, "rmsprop"),
    Mutation("adam_eps_before_bias_correction", ADAM,
             "        denom = sqrt(exp_avg_sq) / bias_correction2_sqrt + eps\n",
             "        denom = (sqrt(exp_avg_sq) + eps) / bias_correction2_sqrt\n",
             "Adam's eps (1e-8) added before the bias correction, not after (known gap: unit grads)", PARITY, "adam"),
    Mutation("radam_eps_inside_sqrt", "src/fastoptim/rules/radam.py",
             "(rectified / (sqrt(exp_avg_sq) + eps + plain) + plain)",
             "(rectified / (sqrt(exp_avg_sq + eps) + plain) + plain)",
             "RAdam's eps (1e-8) inside the square root (known gap: unit grads)", PARITY, "radam"),
    Mutation("adafactor_eps1_not_squared", "src/fastoptim/rules/adafactor.py",
             "        var_estimate.clamp_(min=eps1 * eps1)\n", "        var_estimate.clamp_(min=eps1)\n",
             "Adafactor's floor of the factored variance eps1, not eps1^2", PARITY, "adafactor"),
    Mutation("adam_scalars_eps_wd_swapped", ADAM,
             'group["eps"], wd, 1 - lr * wd,', 'wd, group["eps"], 1 - lr * wd,',
             "Adam's scalars(): eps and weight_decay swapped", PARITY, "adam"),
    Mutation("adam_bias_correction1_off_by_a_step", ADAM,
             "bias_correction1 = 1 - beta1 ** step\n", "bias_correction1 = 1 - beta1 ** (step + 1)\n",
             "Adam's first bias correction one step ahead", PARITY, "adam"),
    Mutation("adam_bias_correction2_frozen_after_50_steps", ADAM,
             "bias_correction2 = 1 - beta2 ** step\n", "bias_correction2 = 1 - beta2 ** min(step, 50)\n",
             "Adam's second bias correction stops following the step after 50 steps (a long run's bug)",
             PARITY, "adam"),
    Mutation("adagrad_maximize_dropped", "src/fastoptim/rules/adagrad.py",
             "    if MAXIMIZE:\n        g = -g\n", "    if False:\n        g = -g\n",
             "Adagrad ignores maximize", PARITY, "adagrad"),
    Mutation("clip_factor_eps", "src/fastoptim/clip.py",
             "torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)",
             "torch.clamp(max_norm / (total_norm + 1e-4), max=1.0)",
             "clip factor max_norm / (norm + 1e-4), torch's is + 1e-6", ("tests/surface/test_clip.py",)),
    Mutation("flat_none_grad_stepped", "src/fastoptim/flat.py",
             "            return len(present) == len(self.params)  # some grads None, the others in place\n",
             "            return True  # some grads None, the others in place\n",
             "flat mode steps a param whose grad is None (reads its zeroed buffer part)",
             ("tests/engine/test_flat_semantics.py",)),
    Mutation("codec8_ties_to_upper_code", "src/fastoptim/storage/quant.py",
             "return ((entry >> 24) & 0xFF) + (low > (entry & self.mask)).to(torch.int32)",
             "return ((entry >> 24) & 0xFF) + (low >= (entry & self.mask)).to(torch.int32)",
             "codec: a value exactly on a boundary gets the upper code (boundaries one ulp off; 8 and 4 bits)",
             ("tests/storage/test_quant.py",)),
    Mutation("codec4_linear_ties_to_upper_code_in_cpu_kernel", CPU_KERNELS,
             "    const __m256i code = _mm256_cvtps_epi32(_mm256_round_ps(t, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC));\n",
             "    const __m256i code = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_round_ps(t, _MM_FROUND_TO_NEG_INF "
             "| _MM_FROUND_NO_EXC)), _mm256_set1_epi32(1));\n",
             "CPU kernel, 4-bit linear map (AVX2): floor(t) + 1 for ceil(t), a boundary value gets the upper code",
             LOW_BIT),
    Mutation("cpu_kernel_store_encodes_with_a_wrong_divisor", CPU_KERNELS,
             "amax == 0.0f ? 1.0f : amax, codec{k}, {codes});",
             "amax == 0.0f ? 1.0f : amax * 1.0001f, codec{k}, {codes});",
             "CPU kernel's in-step store encodes x / (1.0001 absmax): codes near a boundary land one off",
             LOW_BIT),
    Mutation("cpu_kernel_bf16_store_truncates", CPU_KERNELS,
             "const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;",
             "const uint32_t rounded = u >> 16;",
             "CPU kernel stores 16-bit state truncated, not rounded to nearest even", LOW_BIT),
    Mutation("wsd_linear_1_percent", "src/fastoptim/schedules.py",
             '"linear": lambda t: 1 - t,', '"linear": lambda t: 1 - 1.01 * t,',
             "wsd's linear decay 1 % steep (train --schedule wsd's default)", ("tests/surface/test_schedules.py",)),
    Mutation("wsd_cosine_1_percent", "src/fastoptim/schedules.py",
             '"cosine": lambda t: 0.5 * (1 + math.cos(math.pi * t)),',
             '"cosine": lambda t: 0.505 * (1 + math.cos(math.pi * t)),',
             "wsd's cosine decay 1 % high", ("tests/surface/test_schedules.py",)),
    Mutation("flat_version_bump_dropped", "src/fastoptim/optimizer.py",
             "                bulk.bump_versions(bucket.owners)\n", "                pass\n",
             "flat/sharded params written without counting an in-place write (autograd's version; the "
             "level's own write to a flat buffer may count it already: possibly equivalent)",
             ("tests/engine/test_flat_semantics.py", "tests/surface/test_drop_in.py")),
    Mutation("cpu_kernel_version_bump_dropped", "src/fastoptim/levels/fused.py",
             "        took(\"cpu_kernel\")\n        bulk.bump_versions(params)  # written in place, as torch's own kernels count\n",
             "        took(\"cpu_kernel\")\n",
             "the CPU kernel's in-place write not counted for autograd (a stale saved param goes unnoticed)",
             ("tests/paths/test_cpu_kernels.py", "tests/surface/test_drop_in.py")),
    Mutation("grad_scaler_skip_ignored", "src/fastoptim/optimizer.py",
             "if found_inf is not None and not in_kernel and found_inf.item() != 0:",
             "if found_inf is not None and not in_kernel and found_inf.item() != 0 and False:",
             "GradScaler's found_inf ignored where the step reads it on the host", ("tests/engine/test_amp_flag.py",)),
    Mutation("staged_store_on_skipped_step", "src/fastoptim/storage/__init__.py",
             "    if found_inf is not None and found_inf.item() != 0:\n        return\n",
             "    pass\n",
             "a staged (low-bit) bucket steps and stores on a step GradScaler skips",
             ("tests/storage/test_low_bit.py", "tests/engine/test_amp_flag.py")),
    Mutation("muon_newton_schulz_b_c_swapped_tall", "src/fastoptim/rules/muon.py",
             "            x = torch.baddbmm(x, x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), beta=a)\n",
             "            x = torch.baddbmm(x, x, torch.baddbmm(gram, gram, gram, beta=c, alpha=b), beta=a)\n",
             "Muon's Newton-Schulz with b and c swapped, tall matrices only", PARITY + ("tests/surface/test_factory_muon.py",), "muon"),
    Mutation("sgd_first_step_dampening", "src/fastoptim/rules/sgd.py",
             "                1.0 if first else 1.0 - group[\"dampening\"])",
             "                1.0 - group[\"dampening\"])",
             "SGD's first momentum step damped (torch sets the buffer to g undamped)", PARITY, "sgd"),
]
