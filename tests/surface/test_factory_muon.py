"""``create(model, "muon")`` keeps the output layer on AdamW for classifiers too (a ResNet's ``fc``, a ViT's
``head``, an MLP's last Linear), not only for language models, and warns, naming the module, where the choice
is a guess. Conv weights (flattened) and batches of matrices (MoE experts) go to Muon; position tables, class
tokens, layer scales and depthwise filters do not."""

import warnings

import pytest
import torch
from torch import nn

import fastoptim
from fastoptim.train.model import GPT, GPTConfig


def _split(opt_or_groups):
    """(ids of the params Muon steps, ids of those AdamW steps)."""
    groups = opt_or_groups.param_groups if isinstance(opt_or_groups, torch.optim.Optimizer) else opt_or_groups
    muon = {id(p) for g in groups if g.get("use_muon", True) for p in g["params"]}
    adamw = {id(p) for g in groups if g.get("use_muon", True) is False for p in g["params"]}
    return muon, adamw


def _create(model, **kwargs):
    """The optimizer and the warnings its recipe gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = fastoptim.create(model, "muon", lr=0.02, **kwargs)
    return opt, [w for w in caught if issubclass(w.category, UserWarning)]


def _ids(*params):
    return {id(p) for p in params}


def _check(model, opt, on_muon):
    """Exactly ``on_muon`` on Muon; every other param that requires grad on AdamW; conv weights on Muon in a
    group of their own that flattens them, every other Muon param in groups that do not set ``matrices``."""
    muon, adamw = _split(opt)
    assert muon == _ids(*on_muon)
    assert adamw == _ids(*model.parameters()) - muon
    convs = _ids(*(m.weight for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)))
    for g in opt.param_groups:
        if g.get("use_muon", True):
            flatten = g["matrices"] == "flatten"
            assert all((id(p) in convs) == flatten for p in g["params"]), g["matrices"]


# --- models --------------------------------------------------------------------------------------------------

class _Basic(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class _SqueezeExcite(nn.Module):
    """Channel attention with Linears: hidden matrices, for Muon."""
    def __init__(self, c):
        super().__init__()
        self.reduce, self.expand = nn.Linear(c, c // 4), nn.Linear(c // 4, c)

    def forward(self, x):
        s = torch.sigmoid(self.expand(torch.relu(self.reduce(x.mean((2, 3))))))
        return x * s[:, :, None, None]


class ResNetLike(nn.Module):
    """timm's resnet layout: stem, stages, global pool, ``fc`` (registered last)."""
    def __init__(self, classes=10):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.layer1 = nn.Sequential(_Basic(16), _SqueezeExcite(16))
        self.layer2 = nn.Sequential(_Basic(16), _SqueezeExcite(16))
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.layer2(self.layer1(torch.relu(self.bn1(self.conv1(x)))))
        return self.fc(x.mean((2, 3)))


class _Attention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.proj(torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, -1) @ v)


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(d), _Attention(d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential()
        self.mlp.fc1, self.mlp.act, self.mlp.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViTLike(nn.Module):
    """timm's VisionTransformer layout: conv patch embedding, cls token and positions as Parameters (no
    nn.Embedding), blocks, norm, ``head``."""
    def __init__(self, d=32, classes=10):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, d, 4, stride=4)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.zeros(1, 17, d))
        self.blocks = nn.Sequential(_Block(d), _Block(d))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def _mlp():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))


class TextClassifier(nn.Module):
    """An Embedding, and a ``classifier`` narrower than its vocabulary (3 classes)."""
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.encoder = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.classifier = nn.Linear(32, 3)


class VGGLike(nn.Module):
    """torchvision's VGG layout: the ``classifier`` is an MLP (three Linears under one head name)."""
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
        self.classifier = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 5))


# --- the recipe's split -------------------------------------------------------------------------------------------

def test_resnet_fc_goes_to_adamw_without_a_warning():
    model = ResNetLike()
    opt, caught = _create(model)
    se = [m for m in model.modules() if isinstance(m, _SqueezeExcite)]
    convs = [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 5
    _check(model, opt, [w for m in se for w in (m.reduce.weight, m.expand.weight)] + convs)
    assert id(model.fc.weight) in _split(opt)[1]
    assert not caught, [str(w.message) for w in caught]  # named "fc": not a guess


def test_vit_head_goes_to_adamw_without_a_warning():
    model = ViTLike()
    opt, caught = _create(model)
    hidden = [m.weight for b in model.blocks for m in (b.attn.qkv, b.attn.proj, b.mlp.fc1, b.mlp.fc2)]
    _check(model, opt, hidden + [model.patch_embed.weight])  # (the patch embedding: a conv, flattened)
    assert not caught, [str(w.message) for w in caught]
    # cls token and positions (3-D, a leading 1) go with the head's weight to AdamW with weight decay; 1-D
    # params without
    decayed = next(g for g in opt.param_groups if g.get("use_muon", True) is False and g["weight_decay"] != 0)
    assert _ids(*decayed["params"]) == _ids(model.head.weight, model.cls_token, model.pos_embed)


def test_mlp_last_linear_goes_to_adamw_with_a_warning_naming_it():
    model = _mlp()
    opt, caught = _create(model)
    _check(model, opt, [model[0].weight, model[2].weight])
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "last Linear registered, '4'" in message and "head=" in message
    assert caught[0].filename == __file__  # points at the caller's create() line
    with pytest.warns(UserWarning, match="last Linear registered, '4'") as direct:
        assert _split(fastoptim.factory.muon_groups(model)) == _split(opt.param_groups)
    assert direct[0].filename == __file__  # and at a muon_groups() caller's


def test_gpt_with_a_tied_head_keeps_the_embedding_on_adamw_without_a_warning():
    model = GPT(GPTConfig(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_kv_head=1, block_size=16))
    opt, caught = _create(model)
    hidden = [m.weight for m in model.modules() if isinstance(m, nn.Linear) and m is not model.head]
    assert len(hidden) == 8  # qkv, proj, gate_up and down of two blocks
    _check(model, opt, hidden)
    assert id(model.embed.weight) in _split(opt)[1] and model.head.weight is model.embed.weight
    assert not caught, [str(w.message) for w in caught]


def test_text_classifier_with_an_embedding_keeps_its_narrow_classifier_on_adamw():
    model = TextClassifier()
    opt, caught = _create(model)
    _check(model, opt, [model.encoder[0].weight, model.encoder[2].weight])
    assert not caught, [str(w.message) for w in caught]


def test_several_linears_named_like_a_head_all_go_to_adamw_with_a_warning_naming_them():
    model = VGGLike()
    opt, caught = _create(model)
    _check(model, opt, [model.features[0].weight])  # every Linear is in the head: only the conv on Muon
    assert len(caught) == 1  # the guess
    assert "3 layers are named like an output head ('classifier.0', 'classifier.2', 'classifier.4')" \
        in str(caught[0].message)


class SqueezeNetLike(nn.Module):
    """torchvision's SqueezeNet layout: no Linear at all; the ``classifier`` is a 1x1 convolution to the classes."""
    def __init__(self, classes=10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 16, 3), nn.ReLU())
        self.classifier = nn.Sequential(nn.Dropout(), nn.Conv2d(16, classes, 1), nn.ReLU(),
                                        nn.AdaptiveAvgPool2d(1))


def test_a_conv_classifier_named_like_a_head_goes_to_adamw_without_a_warning():
    model = SqueezeNetLike()
    opt, caught = _create(model)
    _check(model, opt, [model.features[0].weight, model.features[2].weight])
    assert not caught, [str(w.message) for w in caught]


class DeepLabLike(nn.Module):
    """torchvision's segmentation layout: a conv backbone, then a ``classifier`` whose first layers (an ASPP and a
    3x3 conv) are hidden and whose last, a 1x1 conv, gives the classes."""
    def __init__(self, classes=5):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
        aspp = nn.Module()
        aspp.convs = nn.ModuleList([nn.Sequential(nn.Conv2d(8, 8, 1)), nn.Sequential(nn.Conv2d(8, 8, 3))])
        aspp.project = nn.Sequential(nn.Conv2d(16, 8, 1))
        self.classifier = nn.Sequential(aspp, nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, classes, 1))


def test_only_the_last_conv_of_a_segmentation_classifier_is_its_head():
    model = DeepLabLike()
    opt, caught = _create(model)
    aspp = model.classifier[0]
    _check(model, opt, [model.backbone[0].weight, aspp.convs[0][0].weight, aspp.convs[1][0].weight,
                        aspp.project[0].weight, model.classifier[1].weight])
    assert not caught, [str(w.message) for w in caught]


def test_hidden_convs_named_out_stay_on_muon_where_a_linear_is_the_last_layer():
    model = nn.Module()
    model.blocks = nn.ModuleList()
    for _ in range(2):
        block = nn.Module()
        block.inp, block.out = nn.Conv2d(4, 4, 3), nn.Conv2d(4, 4, 3)
        model.blocks.append(block)
    model.fc = nn.Linear(4, 3)
    opt, caught = _create(model)
    _check(model, opt, [m.weight for b in model.blocks for m in (b.inp, b.out)])
    assert not caught, [str(w.message) for w in caught]


def test_an_all_conv_net_takes_its_last_conv_as_the_head_with_a_warning_naming_it():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1))
    opt, caught = _create(model)
    _check(model, opt, [model[0].weight, model[2].weight])
    assert len(caught) == 1 and "the last convolution registered, '4', is taken as the output head" in str(
        caught[0].message)


def test_head_says_it_outright_without_a_warning():
    model = _mlp()
    opt, caught = _create(model, head=())  # none: every matrix on Muon
    _check(model, opt, [model[0].weight, model[2].weight, model[4].weight])
    assert not caught
    opt, caught = _create(model, head=model[2])
    _check(model, opt, [model[0].weight, model[4].weight])
    assert not caught


def test_a_single_linear_model_is_its_own_head():
    model = nn.Linear(4, 2)
    opt, caught = _create(model)
    _check(model, opt, [])
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and "the model itself" in messages[0] and "no hidden matrix" in messages[1]


class _DepthwiseNet(nn.Module):
    """Nothing for Muon: a depthwise conv (c, 1, k, k), a layer scale (c, 1, 1), an embedding and the head."""
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.dw = nn.Conv2d(8, 8, 3, groups=8)
        self.gamma = nn.Parameter(torch.ones(8, 1, 1))
        self.head = nn.Linear(8, 10)


def test_a_model_with_nothing_for_muon_says_so():
    """A model whose params of 2+ dims are an embedding, its head, a depthwise filter and a layer scale: Muon
    gets nothing, with a warning; a conv net's filters are Muon's (no such warning)."""
    model = _DepthwiseNet()
    opt, caught = _create(model)
    _check(model, opt, [])
    assert any("no hidden matrix for Muon" in str(w.message) for w in caught)
    conv_net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    opt, caught = _create(conv_net)
    _check(conv_net, opt, [conv_net[0].weight])
    assert not any("no hidden" in str(w.message) for w in caught)


class _Experts(nn.Module):
    """An MoE layer: a router (Linear), experts as (E, M, N) params, and a Conv1d mixing tokens (3-D too)."""
    def __init__(self, d=16, experts=4, hidden=32):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, d, hidden) / d ** 0.5)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, d) / hidden ** 0.5)
        self.mix = nn.Conv1d(d, d, 3, padding=1)

    def forward(self, x):  # (batch, tokens, d)
        gates = torch.softmax(self.router(x), -1)  # (batch, tokens, experts)
        h = torch.einsum("btd,edh->bteh", x, self.w_in).relu()
        y = torch.einsum("bteh,ehd->bted", h, self.w_out)
        y = (gates[..., None] * y).sum(2)
        return self.mix(y.transpose(1, 2)).transpose(1, 2)


class _MoELM(nn.Module):
    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.moe = _Experts(d)
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        return self.lm_head(self.norm(self.moe(self.embed(tokens))))


def test_experts_and_conv1d_weights_go_to_muon():
    """(E, M, N) expert params go to Muon as batches of matrices ("auto"); a Conv1d weight (3-D too) goes in the
    filters' group, flattened; the embedding and the head stay on AdamW. The recipe steps."""
    model = _MoELM()
    opt, caught = _create(model)
    moe = model.moe
    _check(model, opt, [moe.router.weight, moe.w_in, moe.w_out, moe.mix.weight])
    assert not caught, [str(w.message) for w in caught]
    assert next(g for g in opt.param_groups if any(p is moe.w_in for p in g["params"]))["matrices"] == "auto"
    tokens = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(0))
    before = moe.w_in.detach().clone()
    opt.zero_grad()
    model(tokens).logsumexp(-1).mean().backward()
    opt.step()
    assert not torch.equal(moe.w_in, before)


def test_a_stack_of_4_dims_steps_as_its_matrices_not_flattened():
    """A (layers, E, M, N) stack of experts is a batch of matrices: "auto" would flatten it into one (layers,
    E * M * N) matrix (a rank-2 update here), so the recipe gives it a group with matrices="batch". It steps as
    its L * E matrices stepped apart."""
    model = nn.Module()
    model.stack = nn.Parameter(torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(0)))
    model.hidden = nn.Linear(6, 8)
    opt, _ = _create(model, ns_dtype="float32", impl="foreach")
    group = next(g for g in opt.param_groups if any(p is model.stack for p in g["params"]))
    assert group["use_muon"] and group["matrices"] == "batch" and len(group["params"]) == 1
    apart = [nn.Parameter(m.detach().clone()) for m in model.stack.reshape(-1, 8, 6)]
    ref = fastoptim.Muon(apart, lr=0.02, ns_dtype="float32", impl="foreach", weight_decay=group["weight_decay"])
    g = torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(1))
    model.stack.grad = g.clone()
    for p, grad in zip(apart, g.reshape(-1, 8, 6)):
        p.grad = grad.clone()
    opt.step()
    ref.step()
    assert torch.equal(model.stack.detach().reshape(-1, 8, 6), torch.stack([p.detach() for p in apart]))


@pytest.mark.parametrize("make", [ResNetLike, ViTLike])
def test_the_recipe_steps_the_classifier_head_as_adamw(make):
    """The head's weight steps as torch's AdamW steps it (lr adamw_lr, betas (0.9, 0.95), weight decay)."""
    torch.manual_seed(0)
    model = make()
    opt, _ = _create(model, adamw_lr=1e-2, weight_decay=0.1)
    head = model.fc if make is ResNetLike else model.head
    ref_weight = nn.Parameter(head.weight.detach().clone())
    ref = torch.optim.AdamW([ref_weight], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    x = torch.randn(2, 3, 16, 16)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        ref_weight.grad = head.weight.grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(head.weight, ref_weight, atol=1e-6, rtol=1e-5)
