"""``fastoptim train``: a GPT trained with the whole stack, nanoGPT-shaped: a config at the top, a pure
``get_lr``, a loop that reads top to bottom, and an importable ``main(cfg)``.

CPU by default, on the English text that ships with Python (byte-level tokens); the same code runs on a
GPU, and under ``torchrun`` with ``--ddp`` or ``--fsdp`` (gloo on CPUs, nccl on GPUs).
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch

from .. import data as corpus
from .. import factory, schedules, timing
from ..storage import codecs
from ..storage.rounding import ROUNDINGS
from . import checkpoint
from .model import GPT, GPTConfig


@dataclass
class TrainConfig:
    # data
    data: str | None = None            # a text file or a nanoGPT uint16 .bin; None: Python's pydoc text
    val_fraction: float = 0.1          # the last part of the tokens, held out for validation
    # model
    n_layer: int = 4                   # transformer blocks
    n_head: int = 4                    # query heads
    n_kv_head: int = 2                 # key/value heads (grouped-query attention)
    n_embd: int = 128                  # residual width
    block_size: int = 128              # context length in tokens
    grad_checkpointing: bool = False   # recompute blocks in backward (less memory, more compute)
    # optimisation
    optimizer: str = "adamw"           # any fastoptim optimizer name
    impl: str = "auto"                 # fastoptim level: auto, loop, foreach, fused, compiled
    flat: bool = False                 # params, grads and states in one buffer per group
    state_bits: int = 32               # optimizer state: 32, 16 (bf16), 8 or 4 (block-wise quantized)
    state_format: str | None = None    # optimizer state by name (fp32, bf16, dynamic8, ...); state_bits by width
    lr: float = 3e-3                   # peak learning rate
    min_lr_ratio: float = 0.1          # final lr as a fraction of the peak
    weight_decay: float = 0.1          # decoupled decay on >= 2-D weights (none on norms and biases)
    schedule: str = "warmup_cosine"    # warmup_cosine, wsd, linear, constant
    warmup: int = 100                  # warmup steps
    max_grad_norm: float | None = 1.0  # global-norm clipping inside the step; None: off
    gradient_release: bool = False     # the step inside backward, bucket by bucket (clipping: one more backward)
    release_bucket_mb: float | None = None  # a released bucket's grads in MiB; None: 1/32 of them, 1 to 32 MiB
    batch_size: int = 16               # sequences per micro-batch
    grad_accum_steps: int = 1          # micro-batches per optimizer step
    steps: int = 2000                  # optimizer steps
    # precision and compilation
    dtype: str = "fp32"                # fp32, bf16 (autocast) or fp16 (autocast + GradScaler)
    param_dtype: str | None = None     # params: fp32, bf16, fp16 (no fp32 copy); None: fp32, or --dtype's with a --rounding
    rounding: str = "nearest"          # 16-bit params rounded after a step: nearest, stochastic (bf16), kahan
    compile: bool = False              # torch.compile the model
    compile_mode: str = "default"      # default, reduce-overhead, max-autotune
    fp8: bool = False                  # torchao float8 training (GPUs with compute capability >= 8.9)
    # evaluation, checkpoints, output
    eval_every: int = 250              # steps between validation losses
    eval_batches: int = 8              # micro-batches per validation loss
    out_dir: str = "out"               # checkpoints and the loss log go here
    save_every: int = 500              # steps between checkpoints (and one at the end)
    resume: bool = False               # continue from out_dir/ckpt.pt
    stop_after: int = 0                # stop (with a checkpoint) after this step; 0: run on (schedule spans steps)
    sample_tokens: int = 300           # tokens of generated text at the end; 0: none
    seed: int = 1337                   # model init, data order and sampling
    device: str = "auto"               # auto (cuda if there is one), cpu, cuda
    ddp: bool = False                  # DistributedDataParallel under torchrun
    fsdp: bool = False                 # FSDP2 (fully_shard per block) under torchrun; checkpoints through DCP
    progress: bool = True              # a progress bar (rich) while training


SCHEDULES = ("warmup_cosine", "wsd", "linear", "constant")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# dense bf16 tensor-core peaks, FLOP/s. CPUs have no entry: there the log gives achieved GFLOP/s, not MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def get_lr(step: int, cfg: TrainConfig) -> float:
    """The lr factor at ``step`` (times cfg.lr): a pure function of the step."""
    return lr_schedule(cfg)(step)


def lr_schedule(cfg: TrainConfig) -> schedules.Schedule:
    if cfg.schedule == "warmup_cosine":
        return schedules.warmup_cosine(min(cfg.warmup, cfg.steps - 1), cfg.steps, cfg.min_lr_ratio)
    if cfg.schedule == "wsd":
        decay = max(cfg.steps // 5, 1)
        return schedules.wsd(cfg.warmup, max(cfg.steps - cfg.warmup - decay, 0), decay, cfg.min_lr_ratio)
    if cfg.schedule == "linear":
        return schedules.join([(cfg.warmup, schedules.linear_warmup(cfg.warmup)),
                               (cfg.steps - cfg.warmup, schedules.linear_decay(cfg.steps - cfg.warmup,
                                                                                cfg.min_lr_ratio))])
    return schedules.constant()


def param_dtype(cfg: TrainConfig) -> str:
    """What the params are kept in. ``--dtype`` alone is autocast over fp32 params (nanoGPT's meaning, kept);
    asking for stochastic or Kahan rounding is asking for 16-bit params without an fp32 copy, so with
    ``--rounding stochastic|kahan`` the params take ``--dtype``'s dtype unless ``--param-dtype`` says otherwise."""
    if cfg.param_dtype is not None:
        return cfg.param_dtype
    return cfg.dtype if cfg.rounding != "nearest" else "fp32"


def state_bits(cfg: TrainConfig) -> int | str:
    """The optimizer's ``state_bits``: ``state_format``'s where it is given (a ``state_bits`` other than the
    default must name the same format), else ``state_bits``."""
    if cfg.state_format is None:
        return cfg.state_bits
    bits = codecs.lookup(cfg.state_format).key
    if cfg.state_bits not in (32, bits):
        raise ValueError(f"--state-bits {cfg.state_bits} and --state-format {cfg.state_format} name different state "
                         f"formats; give one of them")
    return bits


def check_config(cfg: TrainConfig) -> None:
    """Every bad setting named before anything is built."""
    state_bits(cfg)
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {cfg.schedule!r}")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {cfg.dtype!r}")
    if cfg.param_dtype is not None and cfg.param_dtype not in DTYPES:
        raise ValueError(f"param_dtype must be one of {tuple(DTYPES)}, got {cfg.param_dtype!r}")
    if cfg.rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {cfg.rounding!r}")
    if cfg.rounding != "nearest" and param_dtype(cfg) == "fp32":
        raise ValueError(f"--rounding {cfg.rounding} rounds 16-bit params after each step, and the params are fp32: "
                         "add --dtype bf16 (or --param-dtype bf16) to keep them in bf16 without an fp32 copy")
    if cfg.rounding == "stochastic" and param_dtype(cfg) == "fp16":
        raise ValueError("--rounding stochastic rounds to bf16; for fp16 params use --rounding kahan")
    if cfg.flat and cfg.rounding != "nearest":
        raise ValueError(f"--flat rounds params to nearest; --rounding {cfg.rounding} needs it off")
    if cfg.ddp and cfg.fsdp:
        raise ValueError("choose one of --ddp and --fsdp")
    if cfg.gradient_release:
        refused = [(cfg.flat, "--flat (flat grads are one buffer: nothing is freed)"),
                   (cfg.dtype == "fp16", "--dtype fp16 (GradScaler checks every grad before a step: use bf16)"),
                   (cfg.ddp and cfg.max_grad_norm is not None,
                    "--ddp and clipping (the norm's measuring backward would run DDP's all-reduce too): add "
                    "--max-grad-norm none"),
                   (cfg.fsdp and cfg.max_grad_norm is not None, "--fsdp and clipping (the measuring backward cannot "
                    "see FSDP2's sharded grads): add --max-grad-norm none"),
                   (cfg.compile and cfg.max_grad_norm is not None, "--compile and clipping (the measuring backward "
                    "keeps the graph, which a compiled model's backward refuses): add --max-grad-norm none")]
        why = [text for bad, text in refused if bad]
        if why:
            raise ValueError("--gradient-release steps inside backward and frees each grad at once; it cannot run "
                             "with " + "; ".join(why))
    if cfg.release_bucket_mb is not None and not (cfg.gradient_release and cfg.release_bucket_mb > 0):
        raise ValueError(f"--release-bucket-mb {cfg.release_bucket_mb} needs --gradient-release and a size > 0")
    if cfg.fsdp and cfg.flat:
        raise ValueError("--flat keeps plain tensors in one buffer; FSDP2 shards them: use one or the other")
    if cfg.stop_after < 0:
        raise ValueError(f"stop_after must be >= 0, got {cfg.stop_after}")
    for name in ("steps", "batch_size", "grad_accum_steps", "eval_every", "eval_batches", "save_every",
                 "block_size"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if not 0 < cfg.val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {cfg.val_fraction}")
    if cfg.data is not None and not os.path.isfile(cfg.data):
        raise FileNotFoundError(f"data file not found: {cfg.data}")
    if cfg.resume and not os.path.isfile(os.path.join(cfg.out_dir, "ckpt.pt")):
        raise FileNotFoundError(f"--resume: no checkpoint at {os.path.join(cfg.out_dir, 'ckpt.pt')}")
    if cfg.fp8:
        if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
            raise RuntimeError("--fp8 needs an NVIDIA GPU with compute capability 8.9 or newer (H100, L4, ...)")


def load_tokens(cfg: TrainConfig) -> torch.Tensor:
    if cfg.data is None:
        return corpus.corpus_tensor().long()
    with open(cfg.data, "rb") as f:
        raw = bytearray(f.read())
    if cfg.data.endswith(".bin"):  # nanoGPT's format: little-endian uint16 token ids
        if len(raw) % 2:
            raise ValueError(f"{cfg.data}: a .bin token file holds uint16 values (an even number of bytes)")
        return torch.frombuffer(raw, dtype=torch.uint16).to(torch.int64)
    return torch.frombuffer(raw, dtype=torch.uint8).long()


def get_batch(tokens: torch.Tensor, cfg: TrainConfig, generator: torch.Generator, device) -> tuple:
    starts = torch.randint(0, len(tokens) - cfg.block_size - 1, (cfg.batch_size,), generator=generator)
    x = torch.stack([tokens[s:s + cfg.block_size] for s in starts.tolist()])
    y = torch.stack([tokens[s + 1:s + 1 + cfg.block_size] for s in starts.tolist()])
    return x.to(device), y.to(device)


def main(cfg: TrainConfig) -> dict:
    check_config(cfg)
    if not (cfg.ddp or cfg.fsdp):
        return _train(cfg, 0, 1)
    import gc

    import torch.distributed as dist
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    summary = _train(cfg, dist.get_rank(), dist.get_world_size())
    # The model, its DDP reducer and their process group references are gone with _train's frame (and cycles with
    # the collection), so the group dies here, through its own handle, which lets go of the GIL while its worker
    # threads finish: a reducer dropping the last reference holds the GIL while it joins threads that may need it
    # to free their last tensors (a deadlock seen under load).
    gc.collect()
    dist.barrier()  # every rank leaves together: a gloo group torn down under a busy peer can abort it
    dist.destroy_process_group()
    return summary


def _train(cfg: TrainConfig, rank: int, world: int) -> dict:
    distributed = cfg.ddp or cfg.fsdp
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                         ("cpu" if cfg.device == "auto" else cfg.device))
    if device.type == "cuda" and distributed:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    master = rank == 0

    # data: the first part trains, the last val_fraction validates
    tokens = load_tokens(cfg)
    split = int(len(tokens) * (1 - cfg.val_fraction))
    train_tokens, val_tokens = tokens[:split], tokens[split:]
    vocab = 256 if cfg.data is None or not cfg.data.endswith(".bin") else int(tokens.max()) + 1
    if min(len(train_tokens), len(val_tokens)) <= cfg.block_size + 1:
        raise ValueError(f"the data ({len(tokens)} tokens) is too short for block_size {cfg.block_size}")

    # model and optimizer
    torch.manual_seed(cfg.seed)
    mcfg = GPTConfig(vocab_size=vocab, block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                     n_kv_head=cfg.n_kv_head, n_embd=cfg.n_embd, grad_checkpointing=cfg.grad_checkpointing)
    model = GPT(mcfg).to(device)
    for p in model.parameters():  # params only: buffers (RoPE tables) stay fp32 and are cast where used
        p.data = p.data.to(DTYPES[param_dtype(cfg)])
    if cfg.fp8:
        from torchao.float8 import convert_to_float8_training
        convert_to_float8_training(model)
    if cfg.fsdp:
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = factory.create(model, cfg.optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay, impl=cfg.impl,
                         flat=cfg.flat, max_grad_norm=cfg.max_grad_norm, state_bits=state_bits(cfg),
                         rounding=cfg.rounding, gradient_release=cfg.gradient_release,
                         release_bucket_mb=cfg.release_bucket_mb)
    scheduler = schedules.Scheduler(opt, lr_schedule(cfg))
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.dtype == "fp16")
    train_model = model
    if cfg.ddp:
        from torch.nn.parallel import DistributedDataParallel
        train_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        if cfg.gradient_release:
            opt.release_with(train_model)  # each DDP bucket steps after its all-reduce, on the reduced grads
    if cfg.compile:
        train_model = torch.compile(train_model, mode=None if cfg.compile_mode == "default" else cfg.compile_mode)
    autocast = (torch.autocast(device.type, dtype=DTYPES[cfg.dtype]) if cfg.dtype != "fp32" else nullcontext())
    data_rng = torch.Generator().manual_seed(cfg.seed + rank)

    # resume: model, optimizer, scheduler, scaler, RNG and data position, as they were
    os.makedirs(cfg.out_dir, exist_ok=True)
    ckpt_path = os.path.join(cfg.out_dir, "ckpt.pt")
    start_step, log = 0, []
    if cfg.resume:
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)
        if master:  # what saves killed mid-way left behind
            checkpoint.remove_stale_temps(ckpt_path)
            if cfg.fsdp:
                checkpoint.remove_dirs(cfg.out_dir, checkpoint.DCP_DIRS, keep=ckpt.get("dcp", "dcp"))
        if cfg.fsdp:
            checkpoint.load_sharded(model, opt, os.path.join(cfg.out_dir, ckpt.get("dcp", "dcp")))
        else:
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scheduler.last_epoch -= 1
        scheduler.step()  # writes the lr of the step it resumes at
        scaler.load_state_dict(ckpt["scaler"])
        torch.set_rng_state(ckpt["torch_rng"])
        data_rng.set_state(ckpt["data_rng"][rank])
        start_step, log = ckpt["step"], ckpt["log"]

    def evaluate() -> float:
        model.eval()
        g = torch.Generator().manual_seed(12345)  # the same validation batches every time
        losses = []
        with torch.no_grad(), autocast:
            for _ in range(cfg.eval_batches):
                x, y = get_batch(val_tokens, cfg, g, device)
                losses.append(model(x, y)[1].item())
        model.train()
        return sum(losses) / len(losses)

    n_params = model.num_params()
    flops_per_token = 6 * n_params + 12 * cfg.n_layer * cfg.n_head * (cfg.n_embd // cfg.n_head) * cfg.block_size
    tokens_per_step = cfg.batch_size * cfg.block_size * cfg.grad_accum_steps * world
    peak = _device_peak(device)
    end_step = min(cfg.stop_after, cfg.steps) if cfg.stop_after else cfg.steps
    progress = _Progress(end_step - start_step, enabled=cfg.progress and master)
    stats = {"step_time": 0.0, "opt_time": 0.0, "steps": 0}
    now = timing.clock([device])  # synchronizes the device: GPU work is timed, not its launch
    with progress:
        for step in range(start_step, end_step):
            t0 = now()
            for micro in range(cfg.grad_accum_steps):
                x, y = get_batch(train_tokens, cfg, data_rng, device)
                sync, last = nullcontext(), micro == cfg.grad_accum_steps - 1
                if cfg.ddp and not last:
                    sync = train_model.no_sync()
                if cfg.fsdp:
                    model.set_requires_gradient_sync(last)
                with sync, autocast:
                    _, loss = train_model(x, y)
                scaled = scaler.scale(loss / cfg.grad_accum_steps)
                if last and cfg.gradient_release and cfg.max_grad_norm is not None:
                    with opt.measure_grad_norm():  # the clip factor needs every grad: measured in a backward first
                        scaled.backward(retain_graph=True)
                with nullcontext() if last else opt.accumulating():  # (--gradient-release: the last backward steps)
                    scaled.backward()
            t_opt = now()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            scheduler.step()
            t1 = now()
            stats["step_time"] += t1 - t0
            stats["opt_time"] += t1 - t_opt
            stats["steps"] += 1
            entry = {"step": step + 1, "loss": loss.item(), "lr": float(opt.param_groups[0]["lr"]),
                     "tokens_per_s": tokens_per_step / (t1 - t0)}
            if (step + 1) % cfg.eval_every == 0 or step + 1 == end_step:
                entry["val_loss"] = evaluate()
            log.append(entry)
            progress.update(entry)
            if (step + 1) % cfg.save_every == 0 or step + 1 == end_step:  # every rank takes part
                data_rngs = _gather_rng(data_rng, distributed)
                state = {"scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                         "torch_rng": torch.get_rng_state(), "data_rng": data_rngs, "step": step + 1, "log": log,
                         "config": asdict(cfg)}
                if cfg.fsdp:
                    state["dcp"] = checkpoint.save_sharded(model, opt, cfg.out_dir, step + 1, master)
                else:
                    state.update(model=model.state_dict(), optimizer=opt.state_dict())
                if master:
                    checkpoint.save(state, ckpt_path)  # the commit point: ckpt.pt names its DCP folder
                    if cfg.fsdp:
                        checkpoint.remove_dirs(cfg.out_dir, checkpoint.DCP_DIRS, keep=state["dcp"])

    mean_step = stats["step_time"] / max(stats["steps"], 1)
    tokens_per_s = tokens_per_step / mean_step if mean_step else 0.0
    summary = {
        "rank": rank, "params": n_params, "param_dtype": param_dtype(cfg),
        "state_format": codecs.for_bits(state_bits(cfg)).name, "steps": end_step,
        "final_loss": log[-1]["loss"] if log else math.nan,
        "val_loss": next((e["val_loss"] for e in reversed(log) if "val_loss" in e), math.nan),
        "tokens_per_s": tokens_per_s, "achieved_gflops": flops_per_token * tokens_per_s / 1e9,
        "mfu": flops_per_token * tokens_per_s / peak if peak else None,
        "optimizer_share": stats["opt_time"] / stats["step_time"] if stats["step_time"] else 0.0,
        "peak_rss_mb": peak_rss_mb(),
        "log": log,
    }
    # FSDP2 gathers each block's params from every rank in a forward: every rank generates (the same tokens,
    # from the same seed) or rank 0 would wait on ranks that have left. Otherwise rank 0 alone.
    if cfg.sample_tokens and (master or cfg.fsdp):
        out = _generate(model, cfg, device)
        if master:
            summary["sample"] = bytes(t % 256 for t in out).decode("utf-8", errors="replace")
    return summary


def peak_rss_mb() -> float:
    """The most resident memory this process has held so far, in MiB (its whole life: imports, data, model)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def _generate(model, cfg: TrainConfig, device) -> list[int]:
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    prompt = torch.tensor([[10]], device=device)  # a newline
    if not cfg.fsdp:
        return model.generate(prompt, cfg.sample_tokens, generator=g)[0].tolist()
    from torch.distributed.fsdp import FSDPModule

    model.set_reshard_after_forward(False)  # gather the params once, not once per token
    try:
        return model.generate(prompt, cfg.sample_tokens, generator=g)[0].tolist()
    finally:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        model.set_reshard_after_forward(True)  # as fully_shard set it: the blocks reshard, the root keeps
        model.set_reshard_after_forward(False, recurse=False)


def _gather_rng(generator: torch.Generator, ddp: bool) -> list:
    """Every rank's data-order state (rank 0 writes them all, so a resume restores each rank's order)."""
    state = generator.get_state()
    if not ddp:
        return [state]
    import torch.distributed as dist
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


def _device_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)


class _Progress:
    """A rich progress bar with the latest loss, or nothing when rich is missing or output is off."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.bar = total, enabled, None

    def __enter__(self):
        if self.enabled:
            try:
                from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
                self.bar = Progress(TextColumn("train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                    TextColumn("{task.description}"), TimeRemainingColumn())
                self.bar.start()
                self.task = self.bar.add_task("", total=self.total)
            except ImportError:
                self.bar = None
        return self

    def update(self, entry: dict) -> None:
        if self.bar is None:
            return
        text = f"loss {entry['loss']:.3f}  {entry['tokens_per_s']:.0f} tok/s"
        if "val_loss" in entry:
            self.val = f"  val {entry['val_loss']:.3f}"
        self.bar.update(self.task, advance=1, description=text + getattr(self, "val", ""))

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
