"""HF Trainer with fastoptim: losses equal torch.optim's, and a run resumed from a checkpoint equals a straight run."""

from __future__ import annotations

import pytest
import torch

import fastoptim

from .kinds import KIND_NAMES, KINDS, tokens

transformers = pytest.importorskip("transformers")


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


def train(device, out, make_optimizer=None, cls_and_kwargs=None, max_steps=6, resume=None, **args):
    model = tiny_llama()
    trainer_args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=max_steps, save_steps=3, save_strategy="steps",
        logging_steps=1, report_to=[], use_cpu=device == "cpu", seed=0, learning_rate=1e-3, disable_tqdm=True,
        dataloader_num_workers=0, **args)
    optimizers = (make_optimizer(model), None) if make_optimizer else (None, None)
    trainer = transformers.Trainer(model=model, args=trainer_args, train_dataset=Tokens(), optimizers=optimizers,
                                   optimizer_cls_and_kwargs=cls_and_kwargs)
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
