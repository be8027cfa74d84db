"""Data-parallel wrappers as a CS336 student writes them (no ddp_lab base class), one right and four
wrong, for `python -m ddp_lab.check` to pass and to fail (tests/e2e/test_check.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class AveragingDDP(nn.Module):
    """Right: broadcast every parameter at start, average every gradient after backward."""

    def __init__(self, module: nn.Module, broadcast_frozen: bool = True):
        super().__init__()
        self.module = module
        for p in module.parameters():
            if p.requires_grad or broadcast_frozen:
                dist.broadcast(p.data, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _average(self, params) -> None:
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()

    def finish_gradient_synchronization(self) -> None:
        self._average(self.module.parameters())


class ForgetsToAverage(AveragingDDP):
    """Sums the gradients and never divides by the world size."""

    def finish_gradient_synchronization(self) -> None:
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)


class SkipsFrozenBroadcast(AveragingDDP):
    """Broadcasts only the trainable parameters: a frozen layer keeps each rank's own init."""

    def __init__(self, module: nn.Module):
        super().__init__(module, broadcast_frozen=False)


class DropsABucket(AveragingDDP):
    """Buckets of `bucket_size_mb` in reverse order; the last bucket is never sent when there are several."""

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0):
        super().__init__(module)
        self.buckets, size = [[]], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            if self.buckets[-1] and size + p.numel() * 4 > bucket_size_mb * 2**20:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * 4

    def finish_gradient_synchronization(self) -> None:
        for bucket in self.buckets[:-1] if len(self.buckets) > 1 else self.buckets:
            self._average(bucket)


class WaitsForever(AveragingDDP):
    """Rank 0 waits for a message rank 1 never sends: a hang (until gloo's own timeout)."""

    def finish_gradient_synchronization(self) -> None:
        super().finish_gradient_synchronization()
        if dist.get_rank() == 0:
            dist.recv(torch.zeros(1), src=1)



class TrainsFrozen(AveragingDDP):
    """Turns every parameter trainable (as a wrapper that flattens them and forgets the flags): a frozen layer
    trains."""

    def __init__(self, module: nn.Module):
        super().__init__(module)
        for p in module.parameters():
            p.requires_grad_(True)


class BreaksTheTie(AveragingDDP):
    """Gives every module its own copy of a parameter it shares (as sharding each module apart does): tied
    weights train apart."""

    def __init__(self, module: nn.Module):
        seen = set()
        for sub in module.modules():
            for name, p in list(sub.named_parameters(recurse=False)):
                if id(p) in seen:
                    setattr(sub, name, nn.Parameter(p.detach().clone()))
                seen.add(id(p))
        super().__init__(module)


class CrashesOnTiedWeights(AveragingDDP):
    """A bucket map built per module, so a weight two modules share finds no bucket: its gradient hook raises
    deep in backward (the models without ties train right)."""

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self.buckets, counts = {}, {}
        for sub in module.modules():
            for p in sub.parameters(recurse=False):
                counts[id(p)] = counts.get(id(p), 0) + 1
                self.buckets[id(p)] = torch.zeros(p.numel()) if counts[id(p)] == 1 else None
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p: torch.Tensor) -> None:
        self.buckets[id(p)].view(-1).copy_(p.grad.view(-1))


class RequiresItsBucketSize(DropsABucket):
    """Right with one bucket, and no default for its size (the course's adapter always passes one)."""

    def __init__(self, module: nn.Module, bucket_size_mb: float):
        super().__init__(module, bucket_size_mb)


class TakesADtype(AveragingDDP):
    """Right, and takes its compute dtype as a torch.dtype (a string would fail in torch.empty, as in the
    course's FSDP)."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype):
        super().__init__(module)
        self.probe = torch.empty(1, dtype=compute_dtype)


class ShardedOptimizerOneGroup(torch.optim.Optimizer):
    """A sharded optimizer as a student writes it (each rank steps every N-th parameter, then each owner
    broadcasts), which puts every parameter in one group: a group's own options are lost."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.all = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
        rank, world_size = dist.get_rank(), dist.get_world_size()
        self.optim = optimizer_cls(self.all[rank::world_size], **kwargs)
        super().__init__(self.all, kwargs)

    def step(self, closure=None):
        self.optim.step()
        for i, p in enumerate(self.all):
            dist.broadcast(p.data, src=i % dist.get_world_size())

    def zero_grad(self, set_to_none: bool = True):
        for p in self.all:
            p.grad = None


class GathersFullParams(nn.Module):
    """Right, as the 2026 course's FSDP is read: no full_state_dict(), the whole weights from
    gather_full_params(); its module under another name than `module`, so only that method gives them."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.inner = AveragingDDP(module)

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        self.inner.finish_gradient_synchronization()

    def gather_full_params(self) -> dict:
        return self.inner.module.state_dict()


class GivesUnusedZeros(AveragingDDP):
    """Averages a zero gradient for every parameter backward left without one (as a flat buffer does): AdamW's
    weight decay then moves a parameter no forward uses, which one process leaves alone."""

    def finish_gradient_synchronization(self) -> None:
        for p in self.module.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        super().finish_gradient_synchronization()


class KeepsEveryState(torch.optim.Optimizer):
    """A "sharded" optimizer that steps every parameter on every rank: right, and nothing sharded."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.all = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
        self.optim = optimizer_cls(self.all, **kwargs)
        super().__init__(self.all, kwargs)

    def step(self, closure=None):
        self.optim.step()

    def zero_grad(self, set_to_none: bool = True):
        self.optim.zero_grad(set_to_none)


class CourseFSDP(nn.Module):
    """Right, as a 2026 student writes an FSDP: each Linear and Embedding weight (by the class's name, so the
    course's own classes too) is sharded by rows at rest; every forward gathers them (all_gather) and, with a
    `compute_dtype`, runs on every parameter cast to it; after backward each gradient is widened to fp32,
    averaged, and a sharded weight keeps its rows'. No broadcast at start (every rank must start alike:
    `--same-init`); the whole weights come from gather_full_params()."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.module, self.dtype = module, compute_dtype
        self.rank, self.n = dist.get_rank(), dist.get_world_size()
        self.rows: dict[nn.Parameter, int] = {}  # a sharded weight -> its full rows
        for layer in module.modules():
            weight = getattr(layer, "weight", None)
            if self.shards(layer) and isinstance(weight, nn.Parameter) and weight not in self.rows:
                self.rows[weight] = weight.shape[0]
                weight.data = self._rows_of(weight.data)
        self.master: dict[nn.Parameter, torch.Tensor] = {}

    def shards(self, layer: nn.Module) -> bool:
        return type(layer).__name__.endswith(("Linear", "Embedding"))

    def _rows_of(self, full: torch.Tensor) -> torch.Tensor:
        chunk = -(-full.shape[0] // self.n)
        padded = torch.zeros(chunk * self.n, *full.shape[1:], dtype=full.dtype)
        padded[:full.shape[0]] = full
        return padded[self.rank * chunk:(self.rank + 1) * chunk].clone()

    def _whole(self, p: nn.Parameter) -> torch.Tensor:
        parts = [torch.empty_like(p.data) for _ in range(self.n)]
        dist.all_gather(parts, p.data)
        return torch.cat(parts)[:self.rows[p]]

    def forward(self, *args, **kwargs):
        for p in self.module.parameters():
            self.master[p] = p.data
            full = self._whole(p) if p in self.rows else p.data
            p.data = full.to(self.dtype) if self.dtype is not None else full
        return self.module(*args, **kwargs)

    def _mean(self, grad: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(grad)
        return grad / self.n

    def finish_gradient_synchronization(self) -> None:
        for p in self.module.parameters():
            grad = p.grad.float() if p.grad is not None else None
            p.grad, p.data = None, self.master.pop(p)
            if grad is not None:
                grad = self._mean(grad)
                p.grad = self._rows_of(grad) if p in self.rows else grad

    def gather_full_params(self) -> dict:
        whole = {p: self._whole(p) for p in self.rows}
        state = {name: t.clone() for name, t in self.module.state_dict().items()}
        state.update({name: whole.get(p, p.data).clone()
                      for name, p in self.module.named_parameters(remove_duplicate=False)})
        return state


class KeyedOnTorchLayers(CourseFSDP):
    """Right, but it shards torch's nn.Linear and nn.Embedding only: on a model of the course's own layer
    classes it shards nothing (and still trains right)."""

    def shards(self, layer: nn.Module) -> bool:
        return isinstance(layer, (nn.Linear, nn.Embedding))


class ForgetsToAverageFSDP(CourseFSDP):
    """Sums the gradients and never divides by the world size."""

    def _mean(self, grad: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(grad)
        return grad


class AveragesInItsDtype(CourseFSDP):
    """Right, and rounds where the reference does not: each gradient is divided by the world size and summed in the
    compute dtype (as torch's fp16_compress_hook does), then widened to fp32. A rounding of its own, not a wrong
    average: its fp32 twin (no compute_dtype) is CourseFSDP itself."""

    def finish_gradient_synchronization(self) -> None:
        for p in self.module.parameters():
            grad = p.grad
            p.grad, p.data = None, self.master.pop(p)
            if grad is not None:
                grad = grad / self.n
                dist.all_reduce(grad)
                grad = grad.float()
                p.grad = self._rows_of(grad) if p in self.rows else grad


class IgnoresItsBucketSize(AveragingDDP):
    """Right, and one flat all-reduce of every gradient whatever `bucket_size_mb` says: not the buckets it
    claims."""

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0):
        super().__init__(module)

    def finish_gradient_synchronization(self) -> None:
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        at = 0
        for g in grads:
            g.copy_(flat[at:at + g.numel()].view_as(g))
            at += g.numel()


# --- sharded optimizers and FSDPs as the course's solutions write them (ddp_lab.check, issue "on code written to
# the course's spec"): the inner optimizer under names of their own, whole parameters dealt round-robin ---------

class RoundRobinSharded(torch.optim.Optimizer):
    """Right, as the course's method: every N-th parameter of each group to rank r (whole tensors, round-robin),
    an inner optimizer over this rank's share that keeps every group's own options, named `_local_optimizer`;
    after the step each owner broadcasts its parameters."""

    def __init__(self, params, optimizer_cls, **kwargs):
        groups = [g if isinstance(g, dict) else {"params": [g]} for g in params]
        groups = groups if isinstance(params, list) and params and isinstance(params[0], dict) else \
            [{"params": [p for g in groups for p in g["params"]]}]
        rank, self.n = dist.get_rank(), dist.get_world_size()
        self.owned = []
        mine = []
        for group in groups:
            ps = list(group["params"])
            self.owned += [(p, i % self.n) for i, p in enumerate(ps)]
            mine.append({**group, "params": ps[rank::self.n]})
        self._local_optimizer = optimizer_cls([g for g in mine if g["params"]], **kwargs)
        super().__init__([p for p, _ in self.owned], kwargs)

    def step(self, closure=None):
        self._local_optimizer.step()
        self.share()

    def share(self):
        for p, owner in self.owned:
            dist.broadcast(p.data, src=owner)

    def zero_grad(self, set_to_none: bool = True):
        for p, _ in self.owned:
            p.grad = None


class KeepsEveryStateAsOptimizer(KeepsEveryState):
    """KeepsEveryState with its inner optimizer named `optimizer`, not `optim`: right, and nothing sharded."""

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        self.optimizer = self.__dict__.pop("optim")

    def step(self, closure=None):
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none)


class ShardedInAList(RoundRobinSharded):
    """Right: its inner optimizers in a list, `wrapped_optimizers`, one per param group."""

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        inner = self._local_optimizer
        del self._local_optimizer
        self.wrapped_optimizers = [optimizer_cls([g], **kwargs) for g in inner.param_groups]

    def step(self, closure=None):
        for inner in self.wrapped_optimizers:
            inner.step()
        self.share()


class DropsFirstGroupOptions(RoundRobinSharded):
    """Builds its inner optimizer from the constructor's options alone: every group's own options are lost."""

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        mine = [p for g in self._local_optimizer.param_groups for p in g["params"]]
        self._local_optimizer = optimizer_cls(mine, **kwargs)


class NeverSendsTheLastGroup(RoundRobinSharded):
    """Steps its share, but the owner never broadcasts the parameters of the last param group."""

    def share(self):
        last = {id(p) for p in self.param_groups[-1]["params"]} if len(self.param_groups) > 1 else set()
        skipped = {id(p) for p, _ in self.owned[-3:]} if not last else last
        for p, owner in self.owned:
            if id(p) not in skipped:
                dist.broadcast(p.data, src=owner)


class HeldBackByUnused(AveragingDDP):
    """Buckets of three parameters in reverse order, each averaged only once every gradient in it has arrived (a
    hook on each): a bucket holding a parameter no forward uses is never sent, its other parameter never
    averaged."""

    def __init__(self, module: nn.Module):
        super().__init__(module)
        trainable = list(reversed([p for p in module.parameters() if p.requires_grad]))
        self.buckets = [trainable[i:i + 3] for i in range(0, len(trainable), 3)]
        self.ready: set[int] = set()
        for p in trainable:
            p.register_post_accumulate_grad_hook(self._arrived)

    def _arrived(self, p):
        self.ready.add(id(p))

    def finish_gradient_synchronization(self) -> None:
        for bucket in self.buckets:
            if all(id(p) in self.ready for p in bucket):
                self._average(bucket)
        self.ready.clear()


class GathersNamedParameters(CourseFSDP):
    """Right, and its gather_full_params() is `named_parameters()` made whole, as the course's own test compares:
    a weight shared by two layers is listed once."""

    def gather_full_params(self) -> dict:
        whole = {p: self._whole(p) for p in self.rows}
        return {name: whole.get(p, p.data).clone() for name, p in self.module.named_parameters()}


class RenamesItsShard(CourseFSDP):
    """Right, and it keeps each sharded weight as `weight_shard` on its layer (the whole `weight` gone at rest)."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__(module, compute_dtype)
        self.renamed = []  # (layer, its shard)
        for layer in module.modules():
            weight = layer._parameters.get("weight")
            if weight is not None and weight in self.rows:
                del layer._parameters["weight"]
                layer.weight_shard = weight
                self.renamed.append((layer, weight))

    def forward(self, *args, **kwargs):
        for layer, p in self.renamed:
            layer.weight = p  # under its own name while the forward runs: the gathered weight goes in its place
        out = super().forward(*args, **kwargs)
        for layer, _ in self.renamed:
            del layer.weight
        return out

    def gather_full_params(self) -> dict:
        return {name.replace("weight_shard", "weight"): value for name, value in super().gather_full_params().items()}


class AveragesInTheLastHook(AveragingDDP):
    """Right: every gradient averaged from the hook of the gradient backward computes last (the embedding's), so
    its collectives, launched asynchronously, are issued during backward with nothing left for them to overlap."""

    def __init__(self, module: nn.Module):
        super().__init__(module)
        first = next(p for p in module.parameters() if p.requires_grad)  # the embedding: its gradient comes last
        first.register_post_accumulate_grad_hook(lambda _: self._launch())
        self.works = []

    def _launch(self) -> None:
        self.works = [(p, dist.all_reduce(p.grad, async_op=True)) for p in self.module.parameters()
                      if p.grad is not None]

    def finish_gradient_synchronization(self) -> None:
        for p, work in self.works:
            work.wait()
            p.grad /= dist.get_world_size()


class BlocksInEveryHook(AveragingDDP):
    """Right, as students write an "overlapped" DDP: each gradient all-reduced from its own hook as it is ready,
    but without async_op, so backward stops at each hook until its all-reduce is done: nothing overlaps."""

    def __init__(self, module: nn.Module):
        super().__init__(module)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda q: dist.all_reduce(q.grad))

    def finish_gradient_synchronization(self) -> None:
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad /= dist.get_world_size()


class CastsOnlyItsLayers(CourseFSDP):
    """Right, as the course's FSDP in reduced precision: only the Linear and Embedding weights (the ones it shards)
    are cast to `compute_dtype`; a norm's weight stays fp32, and the course's RMSNorm returns its input's dtype."""

    def forward(self, *args, **kwargs):
        for p in self.module.parameters():
            self.master[p] = p.data
            full = self._whole(p) if p in self.rows else p.data
            p.data = full.to(self.dtype) if self.dtype is not None and p in self.rows else full
        return self.module(*args, **kwargs)


class KeepsGatheredWeights(CourseFSDP):
    """Trains right, as a student's FSDP that caches: every weight it gathers is kept in `self.full_params` by name and
    never freed, so at rest each rank holds its shards and every whole weight beside them."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__(module, compute_dtype)
        self.names = {p: name for name, p in module.named_parameters()}
        self.full_params: dict[str, torch.Tensor] = {}

    def _whole(self, p: nn.Parameter) -> torch.Tensor:
        self.full_params[self.names[p]] = super()._whole(p)
        return self.full_params[self.names[p]]


class ShardIsAView(CourseFSDP):
    """Trains right, and its shard is a slice of the padded whole weight, not a copy: the slice keeps the whole
    weight's storage alive on every rank."""

    def _rows_of(self, full: torch.Tensor) -> torch.Tensor:
        chunk = -(-full.shape[0] // self.n)
        padded = torch.zeros(chunk * self.n, *full.shape[1:], dtype=full.dtype)
        padded[:full.shape[0]] = full
        return padded[self.rank * chunk:(self.rank + 1) * chunk]


class AveragesParametersAfterStep(RoundRobinSharded):
    """Steps its share, then all-reduces every parameter and divides by the world size, where the owner should
    broadcast: the ranks agree, each owner's update averaged with the other ranks' stale copies."""

    def share(self):
        for p, _ in self.owned:
            dist.all_reduce(p.data)
            p.data /= self.n


class UntiesAndSkipsABias(BreaksTheTie):
    """Two faults in one: unties the shared weight, and never averages `hidden.bias` (as a hand-made list of what to
    reduce that misses one)."""

    def finish_gradient_synchronization(self) -> None:
        self._average(p for name, p in self.module.named_parameters() if name != "hidden.bias")


class KeepsGatheredInAHook(CourseFSDP):
    """Trains right, and a forward pre-hook on its module remembers the weights each forward ran with (the gathered
    whole ones) in a dict only the hook's closure holds: nothing on the wrapper names them."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__(module, compute_dtype)
        last_forward = {}

        def remember(layer, args):
            last_forward.update({name: p.data for name, p in layer.named_parameters()})

        module.register_forward_pre_hook(remember)


class WholeWeightLinear(nn.Linear):
    """A layer whose `extra_repr` reads the whole weight an FSDP keeps on it only while it computes (the course's
    Embedding reads `self.weight`, which a student's FSDP deletes between forwards): at rest, printing it raises
    AttributeError."""

    def extra_repr(self) -> str:
        return f"whole weight {tuple(self.whole_weight.shape)}"


class KeysByLayerMovesFrozen(CourseFSDP):
    """As a student's FSDP: it keeps a dict keyed by its layers and a `whole_weight` on each only while it computes
    (so a layer printed at rest raises: WholeWeightLinear), and a real bug: every shard made trainable again (as
    wrapping each in a new nn.Parameter does), so a frozen layer trains."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__(module, compute_dtype)
        for p in module.parameters():
            p.requires_grad_(True)
        self.by_layer = {layer: name for name, layer in module.named_modules() if isinstance(layer, nn.Linear)}

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        for layer in self.by_layer:
            layer.whole_weight = layer.weight.data  # a tensor, not a Parameter: not registered
        return out

    def finish_gradient_synchronization(self) -> None:
        super().finish_gradient_synchronization()
        for layer in self.by_layer:
            del layer.whole_weight
