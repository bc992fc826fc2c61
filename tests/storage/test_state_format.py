"""``state_format=``: the state formats by name (``storage.codecs``), with ``state_bits=`` as its alias.

Both spellings make the same optimizer: the same steps, the same state_dict and param groups (``opt.state_bits``
holds the width, as before, so checkpoints and torch.optim interchange do not change). A name that is no format,
or two settings that disagree, are refused with an error naming them, and nothing is made."""

import zlib

import pytest
import torch

import fastoptim
from fastoptim.levels import record_paths
from fastoptim.storage import codecs

SPELLINGS = [(32, "fp32"), (32, "plain"), (16, "bf16"), (8, "dynamic8"), (8, "int8"), (4, "dynamic4"), (4, "int4")]


def _steps(impl, **setting):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 80), torch.nn.Linear(80, 8))
    opt = fastoptim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, impl=impl, min_quant_size=0, **setting)
    with record_paths() as paths:
        for _ in range(4):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            opt.step()
    return model, opt, paths


def _assert_same(a, b, ordered=True):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b) if ordered else sorted(a, key=str) == sorted(b, key=str)
        for k in a:
            _assert_same(a[k], b[k], ordered)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y, ordered)
    else:
        assert a == b


@pytest.mark.parametrize("impl", ["loop", "fused"])
@pytest.mark.parametrize("bits,name", SPELLINGS)
def test_a_format_by_name_steps_and_saves_as_its_state_bits(bits, name, impl):
    by_bits, opt_bits, paths_bits = _steps(impl, state_bits=bits)
    by_name, opt_name, paths_name = _steps(impl, state_format=name)
    assert paths_name == paths_bits  # the same paths ran
    for p, q in zip(by_bits.parameters(), by_name.parameters()):
        assert torch.equal(p, q)
    _assert_same(opt_bits.state_dict(), opt_name.state_dict())
    assert opt_name.state_bits == bits  # what the optimizer (and a group that sets its own) carries
    # both given and agreeing is the same optimizer too
    _, opt_both, _ = _steps(impl, state_bits=bits, state_format=name)
    _assert_same(opt_bits.state_dict(), opt_both.state_dict())


def test_a_checkpoint_saved_with_state_bits_loads_into_state_format():
    _, saved, _ = _steps("loop", state_bits=8)
    _, fresh, _ = _steps("loop", state_format="dynamic8")
    fresh.load_state_dict(saved.state_dict())
    _assert_same(saved.state_dict(), fresh.state_dict(), ordered=False)  # a load puts ``step`` first


def test_an_unknown_name_is_refused_naming_the_valid_ones():
    model = torch.nn.Linear(4, 4)
    for bad in ("int3", "fp4", 8, "dynamic16"):
        with pytest.raises(ValueError, match=r"Invalid state_format: .*'fp32'.*'bf16'.*'dynamic8'.*'dynamic4'.*'fp8'"):
            fastoptim.Adam(model.parameters(), state_format=bad)


def test_state_bits_and_state_format_that_disagree_are_refused_naming_both():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"state_bits=8 and state_format='bf16'"):
        fastoptim.SGD(model.parameters(), state_bits=8, state_format="bf16")
    with pytest.raises(ValueError, match=r"state_bits=32 and state_format='int4'"):
        fastoptim.SGD(model.parameters(), state_bits=32, state_format="int4")


@pytest.mark.parametrize("name", [spec for spec in fastoptim.OPTIMIZERS])
def test_every_optimizer_takes_state_format(name):
    cls = fastoptim.OPTIMIZERS[name].cls
    opt = cls([torch.nn.Parameter(torch.zeros(4, 4))], state_format="bf16")
    assert opt.state_bits == 16


def test_each_codec_names_its_bits_and_is_found_by_its_names():
    for bits, name in SPELLINGS:
        assert codecs.lookup(name).bits == bits
        assert codecs.for_bits(bits) is codecs.lookup(name)


# --- a format added by one module: a codec registered here, used at every level -----------------------------

from fastoptim.paths.cpu_kernel import kernels as cpu_kernels  # noqa: E402
from fastoptim.storage import PLAIN  # noqa: E402
from fastoptim.storage.codecs import Codec, CppPieces  # noqa: E402


class FP16(Codec):
    """fp16 state (a format fastoptim does not ship): the param's shape, stored rounded to nearest even, as
    ``Tensor.to(torch.float16)`` rounds. No kernel hooks: the fused level runs it staged."""
    name, bits = "fp16-test", 16

    def format_for(self, p, state, min_quant_size, unsigned_states):
        return PLAIN if p.is_complex() or not p.is_floating_point() else self.format()

    def make(self, p, fmt, value):
        return torch.full_like(p, value, dtype=torch.float16, memory_format=torch.contiguous_format)

    def tensor_dtype(self, param_dtype):
        return torch.float16


class FP16Kernels(FP16):
    """The same format with kernel hooks: the CPU kernel's load and store (C++'s ``_Float16`` conversions round
    to nearest even, as torch does) and the Triton kernel's."""
    name = "fp16-kernels-test"

    def kernel_format(self, state, p):
        if isinstance(state, torch.Tensor) and state.dtype == torch.float16 and state.is_contiguous() \
                and state.shape == p.shape and state.device == p.device:
            return self.format()
        return None

    def cpp(self, k, fmt, col):
        ptr = f"(reinterpret_cast<_Float16*>(row[{col[f's{k}']}]) + at)"
        return CppPieces(load=f"for (int64_t i = 0; i < n; ++i) S{k}[i] = (float){ptr}[i];",
                         store=f"for (int64_t i = 0; i < n; ++i) {ptr}[i] = (_Float16)S{k}[i];")

    def triton_pointers(self, i, fmt):
        return [(f"s{i}_ptr", "tl.float16", True)]

    def triton_load(self, i, fmt, whole):
        return [f"s{i} = tl.load(s{i}_ptr + offs, mask=mask, other=0.0).to(tl.float32)"]

    def triton_store(self, i, fmt, out):
        return [f"tl.store(s{i}_ptr + offs, {out}.to(tl.float16), mask=mask)"]


@pytest.fixture
def fp16(request):
    """A test codec registered for the test only (``codecs.register``), taken back after it."""
    codec = codecs.register(getattr(request, "param", FP16)())
    yield codec
    codecs.unregister(codec)


SHAPES = [(48, 80), (80,), (3, 5, 7)]


def _fp16_run(impl, fmt=None, flat=False, steps=4, round_states=False):
    """AdamW (amsgrad: three states) on fixed params and grads at ``impl``, its state in ``fmt``. With
    ``round_states`` (and plain state) each state is rounded to fp16 after each step: what fp16 state holds."""
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    opt = fastoptim.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=True, impl=impl, flat=flat,
                          state_format=fmt)
    paths = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        with record_paths() as ran:
            opt.step()
        paths += ran
        if round_states:
            for p in params:
                for name, value in opt.state[p].items():
                    if isinstance(value, torch.Tensor) and value.is_floating_point():
                        value.copy_(value.half())
    return params, opt, paths


@pytest.mark.parametrize("impl", ["loop", "foreach", "fused"])
def test_a_codec_registered_by_its_module_alone_keeps_state_at_every_level(fp16, impl):
    """The codec is all there is to the new format: ``state_format=`` takes its name, groups carry it, each
    state is kept in fp16, and the steps are the 32-bit steps with the states rounded to fp16 after each, bit
    for bit (the staged path loads exactly and stores rounded to nearest). With no kernel hooks the fused
    level runs it staged."""
    params, opt, paths = _fp16_run(impl, fp16.name)
    want, ref, _ = _fp16_run(impl, round_states=True)
    assert opt.state_bits == fp16.name == fp16.key  # beside bf16, 16 bits' own format: named by its name
    assert "cpu_kernel" not in paths and "triton_stored" not in paths, paths
    for p, q in zip(params, want):
        assert torch.equal(p, q)
        for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert opt.state[p][name].dtype == torch.float16
            assert torch.equal(opt.state[p][name].float(), ref.state[q][name])


def test_a_registered_codec_is_no_format_once_taken_back(fp16):
    codecs.unregister(fp16)
    try:
        with pytest.raises(ValueError, match="Invalid state_format: 'fp16-test'"):
            fastoptim.Adam([torch.nn.Parameter(torch.zeros(2))], state_format=fp16.name)
        assert codecs.for_bits(16) is codecs.lookup("bf16")
    finally:
        codecs.register(fp16)  # (the fixture takes it back)


def test_a_registered_codecs_state_survives_flat_mode_and_a_checkpoint(fp16):
    """flat=True keeps its states as views of an fp16 buffer (its ``tensor_dtype``), stepping as without flat
    mode; a checkpoint holds them in fp16 and loads back into an optimizer of that format as they were."""
    params, opt, _ = _fp16_run("foreach", fp16.name)
    flat_params, flat, _ = _fp16_run("foreach", fp16.name, flat=True)
    for p, q in zip(params, flat_params):
        assert torch.equal(p, q)
        assert flat.state[q]["exp_avg"].dtype == torch.float16
        assert torch.equal(flat.state[q]["exp_avg"], opt.state[p]["exp_avg"])
    saved = opt.state_dict()
    assert saved["state"][0]["exp_avg"].dtype == torch.float16
    fresh = fastoptim.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=True, state_format=fp16.name)
    fresh.load_state_dict(saved)
    for p in params:
        assert fresh.state[p]["exp_avg_sq"].dtype == torch.float16
        assert torch.equal(fresh.state[p]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])


@pytest.mark.parametrize("fp16", [FP16Kernels], indirect=True)
def test_a_registered_codec_with_cpu_kernel_hooks_runs_in_the_kernel(fp16):
    """Its hooks give the CPU kernel's table, walk and load/store: the fused level steps every param in the
    kernel and stores what the staged loop level stores (up to the ulp torch's CPU sqrt may differ by)."""
    if cpu_kernels.available() is not None:
        pytest.skip(f"no CPU kernel here: {cpu_kernels.available()}")
    params, opt, paths = _fp16_run("fused", fp16.name)
    want, ref, _ = _fp16_run("loop", fp16.name)
    assert set(paths) == {"cpu_kernel"}, paths
    for p, q in zip(params, want):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            got, exp = opt.state[p][name], ref.state[q][name]
            assert got.dtype == torch.float16
            # fp16 bit patterns of values of one sign are ordered: at most one ulp apart, in few elements
            apart = (got.view(torch.int16).int() - exp.view(torch.int16).int()).abs()
            assert int(apart.max()) <= 1 and int((apart != 0).sum()) <= max(1, apart.numel() // 100)


class FP16WithoutCpp(FP16Kernels):
    """Offered to the kernels (``kernel_format``) but with no C++ (``cpp`` None): the CPU kernel refuses it."""
    name = "fp16-no-cpp-test"

    def cpp(self, k, fmt, col):
        return None


@pytest.mark.parametrize("fp16", [FP16WithoutCpp], indirect=True)
def test_a_codec_without_cpu_kernel_hooks_runs_staged_with_a_warning_naming_it(fp16):
    if cpu_kernels.available() is not None:
        pytest.skip(f"no CPU kernel here: {cpu_kernels.available()}")
    with pytest.warns(RuntimeWarning, match="fp16-no-cpp-test gives no CPU kernel hooks"):
        params, opt, paths = _fp16_run("fused", fp16.name)
    want, ref, _ = _fp16_run("fused", round_states=True)
    assert "cpu_kernel" not in paths, paths
    for p, q in zip(params, want):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg"].float(), ref.state[q]["exp_avg"])


@pytest.mark.parametrize("fp16", [FP16Kernels], indirect=True)
def test_a_registered_codec_with_triton_hooks_runs_in_the_stored_state_kernel(fp16, monkeypatch):
    """The Triton kernel over stored state (under Triton's interpreter) takes its pointers, loads and stores from
    the codec: one launch, nothing staged, the staged loop level's numbers."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    params, opt, paths = _fp16_run("fused", fp16.name, steps=2)
    want, ref, _ = _fp16_run("loop", fp16.name, steps=2)
    assert set(paths) == {"triton_stored"}, paths
    for p, q in zip(params, want):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            got, exp = opt.state[p][name], ref.state[q][name]
            apart = (got.view(torch.int16).int() - exp.view(torch.int16).int()).abs()
            assert int(apart.max()) <= 1 and int((apart != 0).sum()) <= max(1, apart.numel() // 100)


# a quantized format of its own: the dynamic codec's layout and kernels, through another map

from fastoptim.storage import quant  # noqa: E402
from fastoptim.storage.codecs.dynamic import Dynamic  # noqa: E402

LINEAR8_SIGNED = quant.QuantMap("linear8s-test", 8, tuple((k - 128) / 128 for k in range(256)))


class Linear8(Dynamic):
    """8-bit block-wise state through a linear map (signed: k/128 for k in [-128, 127]; unsigned: the linear map
    without zero), which fastoptim does not ship: only ``qmap`` differs from the dynamic codec."""

    def __init__(self):
        super().__init__(8, ())
        self.name = "linear8-test"

    def qmap(self, fmt):
        return LINEAR8_SIGNED if fmt.signed else quant.linear_no_zero(8)


@pytest.fixture
def linear8():
    codec = codecs.register(Linear8())
    yield codec
    codecs.unregister(codec)


class Tagged(Linear8):
    """The linear codec under another name and tag (its signed format's; the unsigned one's adds a "u")."""

    def __init__(self, name, tag):
        super().__init__()
        self.name, self.own_tag = name, tag

    def tag(self, fmt):
        return self.own_tag + ("" if fmt.signed else "u")


def test_a_checkpoint_names_a_format_by_its_tags_id_and_no_two_formats_share_one(linear8):
    """``Format.id`` is ``zlib.crc32`` of the tag, whatever else is registered; ``Format.from_id`` finds it back
    and refuses an id no format has, naming it. A codec with a taken id (the same tag, or another tag of the
    same crc32) is refused at registration, and nothing is registered."""
    from fastoptim.storage import Format
    for codec in codecs.CODECS.values():
        for fmt in codec.formats():
            assert fmt.id == zlib.crc32(codec.tag(fmt).encode()) and Format.from_id(fmt.id) == fmt
    assert linear8.format(signed=True).id == zlib.crc32(b"linear8s-test/256")
    with pytest.raises(ValueError, match="unknown quantized state format id 7 .*dynamic8s/256"):
        Format.from_id(7)
    plumless = codecs.register(Tagged("plumless-test", "plumless"))
    try:
        for clash, taken in (("buckeroo", "plumless"), ("dynamic8s/256", "dynamic8s/256")):  # crc32 1306201125
            codec = Tagged(f"{clash}-test", clash)
            with pytest.raises(ValueError, match=f"tag '{clash}' has the id {zlib.crc32(clash.encode())} of "
                                                 f".*'s tag '{taken}'"):
                codecs.register(codec)
            assert codec.name not in codecs.CODECS and not hasattr(codec, "key")
    finally:
        codecs.unregister(plumless)


LINEAR_SHAPES = [(48, 80), (16, 300), (80,)]  # 300: a ragged last block per row; (80,): 1-D, kept plain


def _linear8_run(impl, fmt=None, round_to=None, steps=3):
    """AdamW (amsgrad) on fixed params and grads; with ``round_to`` (and plain state) each state of a >= 2-D
    param is quantized and dequantized through that codec's map after each step: what the codec keeps."""
    g = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in LINEAR_SHAPES]
    opt = fastoptim.AdamW(params, lr=1e-2, weight_decay=0.1, amsgrad=True, impl=impl, state_format=fmt,
                          min_quant_size=0)
    paths = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        with record_paths() as ran:
            opt.step()
        paths += ran
        for p in params if round_to is not None else ():
            for name, value in opt.state[p].items():
                if isinstance(value, torch.Tensor) and p.dim() >= 2:
                    fmt = round_to.format(signed=name == "exp_avg")
                    codes, absmax = quant.quantize(value, fmt.qmap, fmt.block)
                    value.copy_(quant.dequantize(codes, absmax, fmt.qmap, fmt.block, value.shape))
    return params, opt, paths


@pytest.mark.parametrize("impl", ["loop", "foreach"])
def test_a_quantized_codec_registered_by_its_module_alone_keeps_state_through_its_map(linear8, impl):
    """The codec's map is what its states are quantized with (``Format.qmap`` asks the codec): the steps are
    the 32-bit steps with each state quantized and dequantized through that map after each, bit for bit."""
    params, opt, _ = _linear8_run(impl, linear8.name)
    want, ref, _ = _linear8_run(impl, round_to=linear8)
    for p, q in zip(params, want):
        assert torch.equal(p, q)
        for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            state = opt.state[p][name]
            if p.dim() < 2:
                assert state.dtype == torch.float32
                continue
            assert state.fmt.qmap.name == ("linear8s-test" if name == "exp_avg" else "linear8")
            assert torch.equal(state.dequantize(), ref.state[q][name])


def test_a_quantized_codec_registered_alone_runs_in_the_cpu_kernel_and_through_a_checkpoint(linear8):
    """The dynamic codec's kernel hooks take the codec's map: the fused level steps its states in the CPU
    kernel, storing the staged loop level's codes (up to one code where torch's sqrt is an ulp away); a
    checkpoint tags the map, and loads back into an optimizer of that format as it was."""
    if cpu_kernels.available() is not None:
        pytest.skip(f"no CPU kernel here: {cpu_kernels.available()}")
    params, opt, paths = _linear8_run("fused", linear8.name)
    want, ref, _ = _linear8_run("loop", linear8.name)
    assert "cpu_kernel" in paths, paths
    for p, q in zip(params, want):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        if p.dim() >= 2:
            got, exp = opt.state[p]["exp_avg"], ref.state[q]["exp_avg"]
            apart = (got.codes.int() - exp.codes.int()).abs()
            assert int(apart.max()) <= 1 and int((apart != 0).sum()) <= max(1, apart.numel() // 100)
    saved = ref.state_dict()
    assert saved["state"][0]["exp_avg.format"] == zlib.crc32(b"linear8s-test/256")
    fresh = fastoptim.AdamW(want, lr=1e-2, weight_decay=0.1, amsgrad=True, state_format=linear8.name,
                            min_quant_size=0)
    fresh.load_state_dict(saved)
    for q in want[:2]:
        for name in ("exp_avg", "exp_avg_sq"):
            got, exp = fresh.state[q][name], ref.state[q][name]
            assert got.fmt == exp.fmt and torch.equal(got.codes, exp.codes) and torch.equal(got.absmax, exp.absmax)
