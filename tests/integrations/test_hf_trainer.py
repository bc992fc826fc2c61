"""HF Trainer with fastoptim: losses equal torch.optim's, and a run resumed from a checkpoint equals a straight run;
gradient release (the step inside backward) equals the same run without it, bit for bit."""

from __future__ import annotations

import pytest
import torch

import fastoptim

from .kinds import KIND_NAMES, KINDS, tokens

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 32):
        self.ids = tokens(n)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def train(device, out, make_optimizer=None, cls_and_kwargs=None, max_steps=6, resume=None, schedule=None,
          callbacks=None, **args):
    model = tiny_llama()
    trainer_args = transformers.TrainingArguments(**{
        **dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=max_steps, save_steps=3,
               save_strategy="steps", logging_steps=1, report_to=[], use_cpu=device == "cpu", seed=0,
               learning_rate=1e-3, disable_tqdm=True, dataloader_num_workers=0), **args})
    optimizer = make_optimizer(model) if make_optimizer else None
    optimizers = (optimizer, schedule(optimizer) if schedule else None)
    trainer = transformers.Trainer(model=model, args=trainer_args, train_dataset=Tokens(), optimizers=optimizers,
                                   optimizer_cls_and_kwargs=cls_and_kwargs, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return model, losses, trainer


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_resume_equals_straight_run(kind, tmp_path, device):
    k = KINDS[kind]
    straight, losses, _ = train(device, tmp_path / "a", k.make)
    assert losses[-1] < losses[0]
    resumed, _, _ = train(device, tmp_path / "a", k.make, resume=str(tmp_path / "a" / "checkpoint-3"))
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    if k.torch_twin is not None:
        _, torch_losses, _ = train(device, tmp_path / "t", k.torch_twin)
        assert losses == pytest.approx(torch_losses, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("kind", ["32", "8-flat"])
def test_optimizer_cls_and_kwargs(kind, tmp_path, device):
    """The Trainer builds the optimizer itself (its decay groups), and saves and resumes it."""
    cls, kwargs = KINDS[kind].cls_and_kwargs
    straight, losses, trainer = train(device, tmp_path / "a", cls_and_kwargs=(cls, kwargs))
    assert isinstance(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer, cls)
    resumed, _, _ = train(device, tmp_path / "a", cls_and_kwargs=(cls, kwargs), resume=str(tmp_path / "a" / "checkpoint-3"))
    assert all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()))
    if kind == "32":
        _, torch_losses, _ = train(device, tmp_path / "t", cls_and_kwargs=(torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01,
                                                                                         "foreach": False}))
        assert losses == pytest.approx(torch_losses, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("kind", ["32", "32-flat"])
def test_gradient_accumulation_and_clipping(kind, tmp_path, device):
    """The Trainer's own clipping (max_grad_norm) and accumulation, against torch.optim's AdamW."""
    extra = dict(gradient_accumulation_steps=2, max_grad_norm=0.5)
    _, losses, _ = train(device, tmp_path / "a", KINDS[kind].make, **extra)
    _, torch_losses, _ = train(device, tmp_path / "t", KINDS[kind].torch_twin, **extra)
    assert losses == pytest.approx(torch_losses, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("flat", [False, True])
def test_clipping_in_the_step(flat, tmp_path, device):
    """fastoptim's own max_grad_norm (the Trainer's clipping off) equals the Trainer clipping for torch.optim (SGD:
    Adam's update hardly changes when its grads are scaled, so a wrong clip factor would not show)."""
    ours = lambda model: fastoptim.SGD(model.parameters(), lr=0.5, max_grad_norm=0.5, flat=flat)  # noqa: E731
    theirs = lambda model: torch.optim.SGD(model.parameters(), lr=0.5, foreach=False)  # noqa: E731
    model, _, _ = train(device, tmp_path / "a", ours, max_grad_norm=0.0)
    reference, _, _ = train(device, tmp_path / "t", theirs, max_grad_norm=0.5)
    unclipped, _, _ = train(device, tmp_path / "u", theirs, max_grad_norm=0.0)
    for a, b, c in zip(model.parameters(), reference.parameters(), unclipped.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert max((b - c).abs().max().item() for b, c in zip(reference.parameters(), unclipped.parameters())) > 1e-3


def _released(release: bool):
    return lambda model: fastoptim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, gradient_release=release)


def _decaying(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.8 ** step)


@pytest.mark.parametrize("accumulation", [1, 2, 3])
def test_gradient_release_equals_the_step_after_backward(accumulation, tmp_path, device):
    """gradient_release=True under the Trainer (its clipping off: under release it would clip nothing, see
    test_trainer_clipping_sees_no_grads_under_release): with accumulation, the Trainer's sync_gradients tells the
    release hooks which micro-batch's backward steps (3: an epoch's 8 micro-batches end in a short window, where the
    Trainer steps); params, losses and LRs equal the same run without release, bit for bit, and no grad is left."""
    extra = dict(max_grad_norm=0.0, gradient_accumulation_steps=accumulation, max_steps=4, save_strategy="no")
    released, losses, trainer = train(device, tmp_path / "r", _released(True), schedule=_decaying, **extra)
    ordinary, ordinary_losses, ordinary_trainer = train(device, tmp_path / "o", _released(False),
                                                        schedule=_decaying, **extra)
    for (name, a), b in zip(released.state_dict().items(), ordinary.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert losses == ordinary_losses
    lrs = [[e["learning_rate"] for e in t.state.log_history if "learning_rate" in e]
           for t in (trainer, ordinary_trainer)]
    assert lrs[0] == lrs[1] and len(set(lrs[0])) == 4
    assert [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e] == [0.0] * 4  # (none left)
    opt = trainer.optimizer.optimizer  # (accelerate's wrapper)
    assert opt.gradient_release and opt._release.flushes > 0
    assert all(p.grad is None for p in released.parameters())
    assert opt.state_dict()["state"][0]["step"].item() == 4  # one step per optimizer step, not per micro-batch


def test_gradient_release_in_the_trainers_own_optimizer(tmp_path, device):
    """optimizer_cls_and_kwargs with gradient_release=True: the Trainer builds it (its decay groups), and the run
    equals the same without release."""
    extra = dict(max_grad_norm=0.0, gradient_accumulation_steps=2, max_steps=2, save_strategy="no")
    kwargs = {"lr": 1e-3, "weight_decay": 0.01}
    released, _, trainer = train(device, tmp_path / "r", cls_and_kwargs=(fastoptim.AdamW, {**kwargs,
                                                                                          "gradient_release": True}),
                                 **extra)
    ordinary, _, _ = train(device, tmp_path / "o", cls_and_kwargs=(fastoptim.AdamW, kwargs), **extra)
    assert trainer.optimizer.optimizer.gradient_release and len(trainer.optimizer.param_groups) == 2
    assert all(torch.equal(a, b) for a, b in zip(released.state_dict().values(), ordinary.state_dict().values()))


def test_trainer_clipping_sees_no_grads_under_release(tmp_path, device):
    """What the Trainer's default clipping (max_grad_norm=1.0) does with a released optimizer, as
    docs/integrations.md says: it clips nothing. The Trainer clips after backward, through accelerate's
    clip_grad_norm_ over the model's params, and never calls the optimizer, so the optimizer cannot refuse it; by
    then release has stepped every bucket and freed its grads, torch's clip_grad_norm_ skips None grads, and the
    Trainer logs grad_norm 0.0 (the tell). The run equals the unclipped one, where without release the same
    clipping acts: set max_grad_norm=0 with gradient_release=True."""
    extra = dict(max_steps=3, save_strategy="no")
    clipped, _, trainer = train(device, tmp_path / "c", _released(True), max_grad_norm=1.0, **extra)
    unclipped, _, _ = train(device, tmp_path / "u", _released(True), max_grad_norm=0.0, **extra)
    ordinary, _, ordinary_trainer = train(device, tmp_path / "o", _released(False), max_grad_norm=1.0, **extra)
    norms = [[e["grad_norm"] for e in t.state.log_history if "grad_norm" in e] for t in (trainer, ordinary_trainer)]
    assert norms[0] == [0.0] * 3
    assert min(norms[1]) > 1.0  # without release the same clipping acts on every step
    assert all(torch.equal(a, b) for a, b in zip(clipped.state_dict().values(), unclipped.state_dict().values()))
    assert not all(torch.equal(a, b) for a, b in zip(clipped.state_dict().values(), ordinary.state_dict().values()))


class GradsAtTheStep(transformers.TrainerCallback):
    """The names of the params that hold a grad as each optimizer step comes (after the Trainer's clipping)."""

    def __init__(self):
        self.held = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **_):
        self.held.append([name for name, p in model.named_parameters() if p.grad is not None])


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_release_under_activation_checkpointing(reentrant, tmp_path, device):
    """Activation checkpointing (the new name of gradient_checkpointing). With use_reentrant=True each layer's
    recompute runs a backward inside the Trainer's backward, while the params outside the layers (lm_head, the
    final norm) wait in the bucket. Release steps every param in backward all the same: none holds a grad at the
    optimizer step, the Trainer's default clipping clips nothing and logs 0.0 (as without checkpointing), and the
    run equals the unclipped one without release, bit for bit, with accumulation."""
    extra = dict(max_steps=3, save_strategy="no", gradient_accumulation_steps=2, activation_checkpointing=True,
                 activation_checkpointing_kwargs={"use_reentrant": reentrant})
    seen = GradsAtTheStep()
    released, losses, trainer = train(device, tmp_path / "r", _released(True), max_grad_norm=1.0, callbacks=[seen],
                                      **extra)
    unclipped, unclipped_losses, _ = train(device, tmp_path / "u", _released(False), max_grad_norm=0.0, **extra)
    _, _, clipped_trainer = train(device, tmp_path / "c", _released(False), max_grad_norm=1.0, **extra)
    assert seen.held == [[]] * 3
    norms = [[e["grad_norm"] for e in t.state.log_history if "grad_norm" in e] for t in (trainer, clipped_trainer)]
    assert norms[0] == [0.0] * 3
    assert min(norms[1]) > 1.0  # without release the same clipping acts on every step
    for (name, a), b in zip(released.state_dict().items(), unclipped.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert losses == unclipped_losses
    assert trainer.optimizer.optimizer._release.flushes > 0
