"""Small models with the awkward parts a data-parallel wrapper must handle: frozen, tied and unused
parameters, norms, a user's own layer classes. The parity tests and `python -m ddp_lab.check` train them."""

import torch
from torch import nn

from ddp_lab.models import ToyMLP, Transformer
from ddp_lab.models.transformer import RMSNorm

VOCAB = 64
BYTE_VOCAB = 256  # data=text: a token is a byte
CONTEXT = 8


class FrozenLayerNet(nn.Module):
    """An MLP whose middle layer is frozen: its weights must still be broadcast, never reduced."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.hidden = nn.Linear(16, 32)
        self.out = nn.Linear(32, VOCAB)

    def forward(self, tokens):
        return self.out(torch.relu(self.hidden(torch.relu(self.frozen(self.embed(tokens))))))


class TiedNet(nn.Module):
    """Input embedding and output projection share one weight: reduced once, not twice."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.hidden = nn.Linear(16, 16)
        self.out = nn.Linear(16, VOCAB, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.embed(tokens))))


class NormNet(nn.Module):
    """Embedding, linear and norm layers (LayerNorm with bias, RMSNorm): the kinds a Transformer has."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.hidden = nn.Linear(16, 24)
        self.norm = nn.LayerNorm(24)
        self.rms = RMSNorm(24)
        self.out = nn.Linear(24, VOCAB)

    def forward(self, tokens):
        return self.out(self.rms(torch.relu(self.norm(self.hidden(self.embed(tokens))))))


class BranchyNet(nn.Module):
    """`branch` runs only when the caller asks (a per-rank, per-step choice); `never` never runs."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.branch = nn.Linear(16, 16)
        self.never = nn.Linear(16, 16)
        self.out = nn.Linear(16, VOCAB)

    def forward(self, tokens, use_branch):
        x = self.embed(tokens)
        if use_branch:
            x = x + torch.tanh(self.branch(x))
        return self.out(x)


class UnusedNet(nn.Module):
    """`unused` is a parameter no forward uses: a wrapper must not wait for its gradient forever."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.hidden = nn.Linear(16, 16)
        self.unused = nn.Linear(16, 16)
        self.out = nn.Linear(16, VOCAB)

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.embed(tokens))))


class NothingToShard(nn.Module):
    """Takes a model config's arguments but has only a norm: fsdp's default policy finds no unit to shard."""

    def __init__(self, vocab_size: int, context_length: int, d_model: int, **unused):
        super().__init__()
        self.norm = RMSNorm(d_model)

    def forward(self, tokens):
        return self.norm(tokens.float())


class OwnLinear(nn.Module):
    """A linear layer as a CS336 student writes it: its own class, not a subclass of nn.Linear."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)

    def forward(self, x):
        return torch.einsum("...i,oi->...o", x, self.weight)


class OwnEmbedding(nn.Module):
    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, d))

    def forward(self, tokens):
        return self.weight[tokens]


class OwnRMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x):
        """In fp32, the input's dtype out, as the course's RMSNorm."""
        wide = x.float()
        return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-5) * self.gain).to(x.dtype)


class OwnBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = OwnRMSNorm(d)
        self.linear = OwnLinear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.linear(self.norm(x)))


class OwnClassesNet(nn.Module):
    """Every layer a class of the user's own (Linear, Embedding, RMSNorm), in blocks of a ModuleList."""

    def __init__(self):
        super().__init__()
        self.embed = OwnEmbedding(VOCAB, 16)
        self.blocks = nn.ModuleList(OwnBlock(16) for _ in range(2))
        self.norm = OwnRMSNorm(16)
        self.head = OwnLinear(16, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class UnitsNet(nn.Module):
    """fsdp's units laid bare: an embedding, two blocks of one linear layer, a norm (the root), a head."""

    def __init__(self, d: int = 16, context_length: int = CONTEXT):
        super().__init__()
        self.context_length = context_length
        self.embed = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(2))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tiny_transformer(vocab_size: int = VOCAB):
    return Transformer(vocab_size=vocab_size, context_length=CONTEXT, d_model=32, d_ff=64, num_layers=2,
                       num_heads=4)


def deep_transformer():
    """tiny_transformer with 4 blocks: pipelines of 4 stages (pp 4, or pp 2 x 2 virtual stages)."""
    return Transformer(vocab_size=VOCAB, context_length=CONTEXT, d_model=32, d_ff=64, num_layers=4, num_heads=4)


def byte_transformer():
    """tiny_transformer over bytes: the parity proofs on data=text."""
    return tiny_transformer(BYTE_VOCAB)


ODD_VOCAB = VOCAB + 1
"""A vocabulary no TP degree above 1 divides (65: the lab pads it to 66 at tp 2, 68 at tp 4); the data's ids stay
below VOCAB."""


def odd_vocab_transformer():
    """tiny_transformer over ODD_VOCAB ids: tensor parallelism pads (the lab) or splits unevenly (torch)."""
    return tiny_transformer(ODD_VOCAB)


def toy_mlp() -> ToyMLP:
    """The toy MLP at test size: biases on both linears of each pair (a row-parallel bias is added once)."""
    return ToyMLP(vocab_size=VOCAB, context_length=CONTEXT, d_model=16, d_ff=32, num_layers=2)


def frozen_toy() -> ToyMLP:
    """toy_mlp with its first column-parallel pair's first layer frozen (weight and bias)."""
    model = toy_mlp()
    model.mlp[0].requires_grad_(False)
    return model


def tied_toy() -> ToyMLP:
    """toy_mlp with its output head's weight tied to the embedding: one weight, split by vocabulary on both."""
    model = toy_mlp()
    model.out.weight = model.embed.weight
    return model


# --- the user's own layer classes (`python -m ddp_lab.check ... --layers linear=my.Linear,...`) ------------------

LAYER_KINDS = {"linear": (nn.Linear, OwnLinear), "embedding": (nn.Embedding, OwnEmbedding),
               "norm": (RMSNorm, OwnRMSNorm, nn.LayerNorm)}
"""What each kind the user may name replaces in the check's models."""
_user_layers: dict[str, type] = {}


def use_layers(classes: dict[str, type]) -> None:
    """Build every model below of the user's own classes, `{"linear": Linear, "embedding": Embedding, "norm":
    RMSNorm}` (any of them), as the course's models are (an FSDP that picks layers by `isinstance` on them shards
    nothing of torch's). Each is built as the course's are: `Linear(in_features, out_features)` (weight (out, in),
    no bias), `Embedding(num_embeddings, embedding_dim)`, `RMSNorm(d_model)`."""
    _user_layers.clear()
    _user_layers.update(classes)


def _of_user_layers(model: nn.Module) -> nn.Module:
    """`model` with each layer of a kind the user named rebuilt of the user's class (frozen stays frozen, a shared
    weight stays shared): both the ranks' models and the reference are built this way."""
    if not _user_layers:
        return model
    shared: dict[int, nn.Parameter] = {}
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            kind = next((k for k, kinds in LAYER_KINDS.items() if k in _user_layers and isinstance(child, kinds)), None)
            if kind is None:
                continue
            weight = child.weight if hasattr(child, "weight") else child.gain
            args = (weight.shape[1], weight.shape[0]) if kind == "linear" else tuple(weight.shape)
            new = _user_layers[kind](*args)
            mine = next(n for n, p in new.named_parameters() if p.shape == weight.shape)
            if id(weight) in shared:
                setattr(new, mine, shared[id(weight)])
            shared.setdefault(id(weight), getattr(new, mine))
            new.requires_grad_(weight.requires_grad)
            setattr(parent, child_name, new)
    return model


def _built(factory):
    def build():
        return _of_user_layers(factory())
    build.__name__ = getattr(factory, "__name__", "model")
    return build


MODELS = {name: _built(factory) for name, factory in {
    "frozen": FrozenLayerNet, "tied": TiedNet, "norms": NormNet, "transformer": tiny_transformer,
    "own_classes": OwnClassesNet, "unused": UnusedNet, "byte_transformer": byte_transformer,
    "odd_vocab_transformer": odd_vocab_transformer, "toy": toy_mlp, "frozen_toy": frozen_toy,
    "tied_toy": tied_toy, "deep_transformer": deep_transformer}.items()}
"""Every model above by name; the ones with a tensor-parallel plan (`tp_plan()`): transformer,
odd_vocab_transformer, byte_transformer, toy, frozen_toy, tied_toy."""


def mid_mb(model) -> float:
    """A third of the model's gradient bytes: several buckets, some holding several parameters."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / 3 / 2**20
