"""Run under torchrun by test_distributed.py: fastoptim under FSDP2 and ZeRO-1 on CPU (gloo) must train
exactly like a single process given the same data on every rank. Writes the max differences as JSON."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

import fastoptim


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))


def wide_model():
    """Weights with rows that split evenly (130) and unevenly (7) over 2 ranks, and rows longer than one
    8-bit block (300): every one quantized at min_quant_size=0."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 130), torch.nn.LayerNorm(130), torch.nn.Linear(130, 7),
                               torch.nn.Linear(7, 300))


def shard(net):
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(net)
    return net


def train(net, opt, steps=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    inputs = net[0].in_features
    for _ in range(steps):
        x = torch.randn(8, inputs, generator=g).to(dtype)  # the same batch on every rank
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in net.parameters()]


def main(out_path):
    dist.init_process_group("gloo")
    single = model()
    reference = train(single, fastoptim.AdamW(single.parameters(), lr=1e-2, impl="loop", max_grad_norm=0.5))
    result = {}
    for impl in ("loop", "foreach", "fused", "compiled"):
        net = model()
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(net)
        params = train(net, fastoptim.AdamW(net.parameters(), lr=1e-2, impl=impl, max_grad_norm=0.5))
        result[f"fsdp2 {impl}"] = max((a - b).abs().max().item() for a, b in zip(params, reference))
    net = model()
    zero = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=fastoptim.AdamW, lr=1e-2)
    params = train(net, zero)
    plain = model()
    plain_params = train(plain, fastoptim.AdamW(plain.parameters(), lr=1e-2))
    result["zero1"] = max((a - b).abs().max().item() for a, b in zip(params, plain_params))
    for bits in (16, 8, 4):  # low-bit state: blocks run along rows, so each rank's rows quantize as one process's
        low = dict(lr=1e-2, state_bits=bits, min_quant_size=0)
        for impl in ("loop", "foreach", "fused", "compiled"):
            single = wide_model()
            reference = train(single, fastoptim.AdamW(single.parameters(), impl=impl, **low))
            net = shard(wide_model())
            params = train(net, fastoptim.AdamW(net.parameters(), impl=impl, **low))
            result[f"fsdp2 {impl} {bits}-bit"] = max((a - b).abs().max().item() for a, b in zip(params, reference))
        net = wide_model()
        params = train(net, ZeroRedundancyOptimizer(net.parameters(), optimizer_class=fastoptim.AdamW, **low))
        plain = wide_model()
        plain_params = train(plain, fastoptim.AdamW(plain.parameters(), **low))
        result[f"zero1 {bits}-bit"] = max((a - b).abs().max().item() for a, b in zip(params, plain_params))
    for rounding in ("stochastic", "kahan"):  # bf16 params: the same random bits and compensation on any ranks
        low = dict(lr=1e-2, rounding=rounding, state_bits=8, min_quant_size=0)
        for impl in ("loop", "fused"):
            single = wide_model().to(torch.bfloat16)
            reference = train(single, fastoptim.AdamW(single.parameters(), impl=impl, **low), dtype=torch.bfloat16)
            net = shard(wide_model().to(torch.bfloat16))
            params = train(net, fastoptim.AdamW(net.parameters(), impl=impl, **low), dtype=torch.bfloat16)
            result[f"fsdp2 {impl} bf16 {rounding}"] = max((a.float() - b.float()).abs().max().item()
                                                          for a, b in zip(params, reference))
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
