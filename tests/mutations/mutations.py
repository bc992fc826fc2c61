"""The hand mutations of the mutation sample: wrong math a test must catch (``run.py`` applies them one at a time).

Each is (name, sites, what it breaks, likely test files, and a ``-k`` filter for them). A site is (file, exact
old text, new text): the same wrong math wherever a tree keeps that code, so the sample applies both before the
engine redesign (3bf95fa: ``levels/``, ``flat.py``, the GradScaler skip in ``optimizer.py``) and after it
(``paths/``, ``engine/``, ``native/``, codec modules). In the tree mutated, exactly one site's old text must
occur exactly once in its file (``run.py`` says so when none or several do). ``likely`` lists the test files a
developer changing that code would run first, by their names in either tree (tests moved from ``tests/`` into
folders mirroring the package): ``run.py --likely`` runs those that exist (with ``select`` as ``-k``) to name
the catching test quickly; a mutation counts as caught only if a test of the whole suite fails.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Site:
    file: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutation:
    name: str
    sites: tuple[Site, ...]
    what: str
    likely: tuple[str, ...]
    select: str = ""


def tests(*names: str) -> tuple[str, ...]:
    """Each test file by its name after the redesign (``surface/test_parity.py``) and before (``test_parity.py``)."""
    return tuple(f"tests/{path}" for name in names for path in (name, name.split("/")[-1]))


ADAM = "src/fastoptim/rules/adam.py"
OLD_CPU_KERNELS = "src/fastoptim/levels/cpu_kernels.py"
PARITY = tests("surface/test_parity_regimes.py", "surface/test_parity.py")
LOW_BIT = tests("paths/test_cpu_kernels.py", "storage/test_low_bit.py", "storage/test_quant.py")
SCHEDULES = tests("surface/test_schedules.py")
FLAT = "src/fastoptim/engine/flat.py"
FLAT_TESTS = tests("engine/test_flat_semantics.py", "surface/test_stateful.py")

MUTATIONS = [
    Mutation("adam_weight_decay_dropped",
             (Site(ADAM, "            g = g + weight_decay * p\n", "            g = g\n"),
              Site(ADAM, "maximize_and_decay(p, g, weight_decay,", "maximize_and_decay(p, g, 0.0,")),
             "Adam's L2 weight decay dropped (AdamW's decoupled one kept)", PARITY, "adam"),
    Mutation("rmsprop_eps_inside_sqrt",
             (Site("src/fastoptim/rules/rmsprop.py", "        avg = sqrt(square_avg) + eps\n",
                   "        avg = sqrt(square_avg + eps)\n"),),
             "RMSprop's eps inside the square root (uncentered)", PARITY, "rmsprop"),
    Mutation("adam_eps_before_bias_correction",
             (Site(ADAM, "        denom = sqrt(exp_avg_sq) / bias_correction2_sqrt + eps\n",
                   "        denom = (sqrt(exp_avg_sq) + eps) / bias_correction2_sqrt\n"),),
             "Adam's eps (1e-8) added before the bias correction, not after (known gap: unit grads)", PARITY, "adam"),
    Mutation("radam_eps_inside_sqrt",
             (Site("src/fastoptim/rules/radam.py", "(rectified / (sqrt(exp_avg_sq) + eps + plain) + plain)",
                   "(rectified / (sqrt(exp_avg_sq + eps) + plain) + plain)"),),
             "RAdam's eps (1e-8) inside the square root (known gap: unit grads)", PARITY, "radam"),
    Mutation("adafactor_eps1_not_squared",
             (Site("src/fastoptim/rules/adafactor.py", "        var_estimate.clamp_(min=eps1 * eps1)\n",
                   "        var_estimate.clamp_(min=eps1)\n"),),
             "Adafactor's floor of the factored variance eps1, not eps1^2", PARITY, "adafactor"),
    Mutation("adam_scalars_eps_wd_swapped",
             (Site(ADAM, 'group["eps"], wd, 1 - lr * wd,', 'wd, group["eps"], 1 - lr * wd,'),  # scalars() tuple
              Site(ADAM, 'eps=group["eps"], weight_decay=wd,', 'eps=wd, weight_decay=group["eps"],')),  # named
             "Adam's scalars: eps and weight_decay swapped", PARITY, "adam"),
    Mutation("adam_bias_correction1_off_by_a_step",
             (Site(ADAM, "bias_correction1 = 1 - beta1 ** step\n", "bias_correction1 = 1 - beta1 ** (step + 1)\n"),),
             "Adam's first bias correction one step ahead", PARITY, "adam"),
    Mutation("adam_bias_correction2_frozen_after_50_steps",
             (Site(ADAM, "bias_correction2 = 1 - beta2 ** step\n",
                   "bias_correction2 = 1 - beta2 ** min(step, 50)\n"),),
             "Adam's second bias correction stops following the step after 50 steps (a long run's bug)",
             PARITY, "adam"),
    Mutation("adagrad_maximize_dropped",
             (Site("src/fastoptim/rules/adagrad.py", "    if MAXIMIZE:\n        g = -g\n",
                   "    if False:\n        g = -g\n"),
              Site("src/fastoptim/rules/adagrad.py", "None, MAXIMIZE, WEIGHT_DECAY", "None, False, WEIGHT_DECAY")),
             "Adagrad ignores maximize", PARITY, "adagrad"),
    Mutation("clip_factor_eps",
             (Site("src/fastoptim/clip.py", "torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)",
                   "torch.clamp(max_norm / (total_norm + 1e-4), max=1.0)"),),
             "clip factor max_norm / (norm + 1e-4), torch's is + 1e-6", tests("surface/test_clip.py")),
    Mutation("flat_none_grad_stepped",
             tuple(Site(file, "            return len(present) == len(self.params)  # some grads None, the others in place\n",
                        "            return True  # some grads None, the others in place\n")
                   for file in ("src/fastoptim/flat.py", "src/fastoptim/engine/flat.py")),
             "flat mode steps a param whose grad is None (reads its zeroed buffer part)",
             tests("engine/test_flat_semantics.py")),
    Mutation("codec8_ties_to_upper_code",
             (Site("src/fastoptim/storage/quant.py",
                   "return ((entry >> 24) & 0xFF) + (low > (entry & self.mask)).to(torch.int32)",
                   "return ((entry >> 24) & 0xFF) + (low >= (entry & self.mask)).to(torch.int32)"),),
             "codec: a value exactly on a boundary gets the upper code (boundaries one ulp off; 8 and 4 bits)",
             tests("storage/test_quant.py")),
    # the CPU kernel's C++ source: generated in one module before the redesign, in native/*.hpp after it
    Mutation("codec4_linear_ties_to_upper_code_in_cpu_kernel",
             tuple(Site(file,
                        "    const __m256i code = _mm256_cvtps_epi32(_mm256_round_ps(t, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC));\n",
                        "    const __m256i code = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_round_ps(t, _MM_FROUND_TO_NEG_INF "
                        "| _MM_FROUND_NO_EXC)), _mm256_set1_epi32(1));\n")
                   for file in (OLD_CPU_KERNELS, "src/fastoptim/native/codec.hpp")),
             "CPU kernel, 4-bit linear map (AVX2): floor(t) + 1 for ceil(t), a boundary value gets the upper code",
             LOW_BIT),
    Mutation("cpu_kernel_store_encodes_with_a_wrong_divisor",
             tuple(Site(file, "amax == 0.0f ? 1.0f : amax, codec{k}, {codes});",
                        "amax == 0.0f ? 1.0f : amax * 1.0001f, codec{k}, {codes});")
                   for file in (OLD_CPU_KERNELS, "src/fastoptim/storage/codecs/dynamic.py")),
             "CPU kernel's in-step store encodes x / (1.0001 absmax): codes near a boundary land one off",
             LOW_BIT),
    Mutation("cpu_kernel_bf16_store_truncates",
             tuple(Site(file, "const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;",
                        "const uint32_t rounded = u >> 16;")
                   for file in (OLD_CPU_KERNELS, "src/fastoptim/native/common.hpp"))
             + (Site("src/fastoptim/native/lanes.hpp", "const LaneBits rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;",
                     "const LaneBits rounded = u >> 16;"),),
             "CPU kernel stores 16-bit state truncated, not rounded to nearest even", LOW_BIT),
    Mutation("wsd_linear_1_percent",
             (Site("src/fastoptim/schedules.py", '"linear": lambda t: 1 - t,', '"linear": lambda t: 1 - 1.01 * t,'),),
             "wsd's linear decay 1 % steep (train --schedule wsd's default)", SCHEDULES),
    Mutation("wsd_cosine_1_percent",
             (Site("src/fastoptim/schedules.py", '"cosine": lambda t: 0.5 * (1 + math.cos(math.pi * t)),',
                   '"cosine": lambda t: 0.505 * (1 + math.cos(math.pi * t)),'),),
             "wsd's cosine decay 1 % high", SCHEDULES),
    # the step's end: in the optimizer before the redesign, in the dispatcher's run_plan after it
    Mutation("flat_version_bump_dropped",
             (Site("src/fastoptim/optimizer.py", "                bulk.bump_versions(bucket.owners)\n",
                   "                pass\n"),
              Site("src/fastoptim/engine/dispatch.py", "            bulk.bump_versions(bucket.owners)\n",
                   "            pass\n"),
              Site("src/fastoptim/engine/dispatch.py", "            written.extend(bucket.owners)\n",
                   "            pass\n")),
             "flat/sharded params written without counting an in-place write (autograd's version; the "
             "level's own write to a flat buffer may count it already: possibly equivalent)",
             tests("engine/test_flat_semantics.py", "surface/test_drop_in.py")),
    # before: the fused level bumped after the CPU kernel ran; after: the path declares its writes uncounted and
    # the dispatcher bumps them, so claiming them counted is the same omission
    Mutation("cpu_kernel_version_bump_dropped",
             (Site("src/fastoptim/levels/fused.py",
                   "        took(\"cpu_kernel\")\n        bulk.bump_versions(params)  # written in place, as torch's own kernels count\n",
                   "        took(\"cpu_kernel\")\n"),
              Site("src/fastoptim/paths/cpu_kernel/__init__.py", "    counted = False\n", "    counted = True\n")),
             "the CPU kernel's in-place write not counted for autograd (a stale saved param goes unnoticed)",
             tests("paths/test_cpu_kernels.py", "surface/test_drop_in.py")),
    Mutation("grad_scaler_skip_ignored",
             tuple(Site(file, "if found_inf is not None and not in_kernel and found_inf.item() != 0:",
                        "if found_inf is not None and not in_kernel and found_inf.item() != 0 and False:")
                   for file in ("src/fastoptim/optimizer.py", "src/fastoptim/engine/dispatch.py",
                                "src/fastoptim/engine/amp.py")),
             "GradScaler's found_inf ignored where the step reads it on the host", tests("engine/test_amp_flag.py")),
    # before: storage.run_staged read the flag for a staged bucket; after: the dispatcher's run_chain reads it
    # before any path that cannot skip in its kernel, the staged path among them: skipped for that one only
    Mutation("staged_store_on_skipped_step",
             (Site("src/fastoptim/storage/__init__.py",
                   "    if found_inf is not None and found_inf.item() != 0:\n        return\n", "    pass\n"),
              Site("src/fastoptim/engine/dispatch.py",
                   "if ctx.found_inf is not None and not path.skips_in_kernel(ctx) and _inf_found(ctx):",
                   "if ctx.found_inf is not None and not path.skips_in_kernel(ctx) and _inf_found(ctx) "
                   "and path is not STAGED:")),
             "a staged (low-bit) bucket steps and stores on a step GradScaler skips (after the redesign only "
             "under in-kernel skipping, CUDA or Triton's interpreter: engine/test_dispatch.py covers it)",
             tests("storage/test_low_bit.py", "engine/test_amp_flag.py", "engine/test_dispatch.py")),
    Mutation("muon_newton_schulz_b_c_swapped_tall",
             (Site("src/fastoptim/rules/muon.py",
                   "            x = torch.baddbmm(x, x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), beta=a)\n",
                   "            x = torch.baddbmm(x, x, torch.baddbmm(gram, gram, gram, beta=c, alpha=b), beta=a)\n"),),
             "Muon's Newton-Schulz with b and c swapped, tall matrices only",
             PARITY + tests("surface/test_factory_muon.py"), "muon"),
    Mutation("sgd_first_step_dampening",
             (Site("src/fastoptim/rules/sgd.py", "                1.0 if first else 1.0 - group[\"dampening\"])",
                   "                1.0 - group[\"dampening\"])"),  # positional before the redesign
              Site("src/fastoptim/rules/sgd.py", "grad_weight=1.0 if first else 1.0 - group[\"dampening\"])",
                   "grad_weight=1.0 - group[\"dampening\"])")),  # by name after it
             "SGD's first momentum step damped (torch sets the buffer to g undamped)", PARITY, "sgd"),
    # flat mode's grad hook (FlatBucket.point_grad): a grad set to None alone, and the memset of the whole buffer
    Mutation("flat_grad_set_to_none_not_rezeroed",
             (Site(FLAT, "        else:\n            view.zero_()\n        p.grad = view\n",
                   "        else:\n            pass\n        p.grad = view\n"),),
             "flat mode: a param whose grad alone was set to None gets its next grad added onto the old values of "
             "its part of the grad buffer", FLAT_TESTS),
    Mutation("flat_first_hook_clears_grads_in_use",
             (Site(FLAT, "            if not with_grads(self.params)[0]:\n                self.grad_buffer.zero_()\n",
                   "            if True:\n                self.grad_buffer.zero_()\n"),),
             "flat mode: the first grad hook of a backward zeroes the whole grad buffer, the grads other params "
             "still hold (and accumulate into) among it", FLAT_TESTS),
    # loading.py's checks became checkpoints.py (97c9906)
    Mutation("loaded_bf16_state_kept_as_the_callers",
             (Site("src/fastoptim/loading.py", "kept.append((index, p, name, value.to(p.device, copy=True)))",
                   "kept.append((index, p, name, value.to(p.device)))"),
              Site("src/fastoptim/checkpoints.py", "kept.append(Kept(index, p, name, value.to(p.device, copy=True)))",
                   "kept.append(Kept(index, p, name, value.to(p.device)))")),
             "a loaded 16-bit state stays the checkpoint's own tensor: the next step writes into the caller's "
             "state_dict", tests("surface/test_state_dict.py")),
    Mutation("amp_flag_reads_the_optimizers_rounding",
             (Site("src/fastoptim/engine/amp.py", 'opt._storage_settings(group)[2] == "stochastic"',
                   'opt.rounding == "stochastic"'),
              Site("src/fastoptim/engine/amp.py", 'settings.storage_of(group).rounding == "stochastic"',
                   'settings.rounding == "stochastic"')),
             "_step_supports_amp_scaling reads the optimizer's rounding, not each group's own",
             tests("engine/test_amp_flag.py")),
    # DDP's reducer scales a grad times 1/world as it copies it into the bucket: x / 3 rounds otherwise
    Mutation("ddp_release_divides_by_the_world_size",
             (Site("src/fastoptim/engine/release_ddp.py", "            buffer.mul_(1.0 / world)\n",
                   "            buffer.div_(world)\n"),),
             "the DDP tie divides the bucket by the world size where DDP multiplies by its reciprocal (equal bit "
             "for bit at 1 and 2 ranks)", tests("engine/test_release_ddp.py", "engine/test_distributed.py")),
    Mutation("ddp_release_in_place_grad_multiplied",
             (Site("src/fastoptim/engine/release_ddp.py",
                   "grad.div_(world) if was_view else grad.mul_(1.0 / world)",
                   "grad.mul_(1.0 / world) if was_view else grad.mul_(1.0 / world)"),),
             "the DDP tie multiplies a grad accumulated in the bucket's view by 1/world where DDP divides it in "
             "place (gradient_as_bucket_view=True; equal bit for bit at 1 and 2 ranks)",
             tests("engine/test_release_ddp.py", "engine/test_distributed.py")),
]
