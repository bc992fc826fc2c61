"""State formats as codecs, looked up by name: how one optimizer state is kept, and everything that depends on it.

A codec owns, for its format:

* ``name`` (what ``state_format=`` takes), ``aliases`` and ``bits`` (the ``state_bits=`` number it stands for:
  what ``opt.state_bits``, and a group that sets its own, hold);
* ``format_for``: the ``Format`` a state of a param gets (quantized formats leave small params plain);
* ``make`` (a new state, every element one value), ``load`` (a temporary of the param's dtype, for the staged
  path) and ``store`` (fp32 values back into the state);
* ``tensor_dtype`` (the dtype of a state kept as one tensor; None: kept as several, ``parts``/``assemble``/
  ``tensors``, which flat mode pools and keeps apart from its buffers) and ``adopt`` (a tensor found in
  ``optimizer.state`` converted to it);
* ``entries`` and ``tag``: what ``state_dict()`` writes for a state (``storage.export_entry``) and the tag whose
  id (``Format.id``) ``load_state_dict`` reads back (``Format.from_id``);
* its kernel hooks: ``kernel_format`` (which states a kernel may take in place), the walk over a param
  (``kernel_block``, ``walk``, ``tables``), ``columns``/``cpp`` (the table's columns and the declarations, load
  and store the CPU kernel's template ``native/step_kernel.cpp`` is filled with: ``paths.cpu_kernel.kernels``)
  and ``triton_pointers``/``triton_tables``/``triton_prelude``/``triton_load``/``triton_store`` (the lines of
  the Triton kernel over stored state: ``paths.triton.stored``).

Adding a format is one module here that defines its ``Codec`` (``base``), its line in the list below, and its
kernel hooks (a format the kernels are not offered, ``kernel_format`` None, runs on the staged path, which needs
only ``make``, ``load`` and ``store``). A codec registered beside its width's own (a test's, a user's) is named by
its name only: ``state_format=`` takes it, ``state_bits`` holds the name where it holds a width, and its states'
``Format`` names it. A state kept as one tensor is told apart by its dtype alone (``storage.kernel_format`` asks
each codec in turn), so two such codecs should not keep the same dtype with different kernel hooks.
"""

from __future__ import annotations

from ..registry import (CODECS, for_bits, from_id, from_tag, keys, lookup, names, of, register,  # noqa: F401
                        tag_id, unregister)
from .base import Codec, CppPieces  # noqa: F401
from .bf16 import BF16_CODEC
from .dynamic import DYNAMIC4, DYNAMIC8
from .fp8 import FP8_E4M3
from .plain import PLAIN_CODEC

# the formats, in the order error messages list them
for _codec in (PLAIN_CODEC, BF16_CODEC, DYNAMIC8, DYNAMIC4, FP8_E4M3):
    register(_codec)
