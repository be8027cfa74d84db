"""What a wrapper did, seen from outside, for the line under a case's verdict: parity cannot see sharding,
bucketing or overlap, so the check watches for them while the ranks train.

- collectives: every call of torch.distributed's collectives (and point-to-point messages, which rings are
  built of), made through the module (`dist.all_reduce(...)`), during the training steps (the start-up
  broadcast and the final gather are not counted), per op, and how many were issued while autograd was
  running backward (`torch._C._current_autograd_node()` is set inside a gradient hook): those launched
  asynchronously (`async_op=True`, or isend/irecv) can overlap the rest of backward, a blocking one inside a hook
  stops backward until it completes, and the others wait for backward to end; and each call's message (its
  largest tensor argument), so one per tensor, per bucket or one flat shows in the bytes per step and the largest
  message;
- held: after the last step, measured as memory, each storage once and whole (a shard that is a view of the
  whole weight costs the whole weight): the parameters' storages, whatever else the wrapper keeps reachable
  from it beside parameters, gradients, buffers and optimizer state (a dict of gathered weights), and the
  optimizer state (a sharded optimizer's inner state), against the whole model's parameters and a whole
  AdamW's state (two moments per trainable parameter); and which layer classes it holds a shard of (fewer
  elements of one of their parameters than the model had before wrapping) and which it holds whole.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import sysconfig
import types
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_lab.rank.memory import local, model_state_storages, storage_key

COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor",
               "broadcast", "reduce", "all_to_all", "all_to_all_single",
               "send", "recv", "isend", "irecv", "batch_isend_irecv")  # the last: rings built of messages
MAX_DEPTH = 8  # attribute hops from the wrapper a kept tensor is looked for
VIEW_SLACK = 1.5  # a parameter storage this many times its parameters' bytes is more than padding


class Observer:
    """Counts the collectives called through `torch.distributed` while `watching()`; `held()` reads what a
    rank holds. One per case and rank."""

    def __init__(self):
        self.calls, self.in_backward, self.sizes = Counter(), 0, []  # sizes: each call's message, in bytes
        self.blocking = 0  # of those in backward, the ones that did not return until done (no async_op)
        # "forward"; "grad": a parameter's gradient accumulated; "collective": one issued in backward
        self.events: list[str] = []
        self.dtypes: dict | None = None  # each parameter's dtype as the wrapper's first forward ran it

    def track(self, module: torch.nn.Module) -> None:
        """Mark each forward of `module` and each gradient accumulated into one of its parameters (hooks registered
        before the wrapper's, so they run first): a collective issued in backward overlaps something only if a
        gradient is still to come after it in the same backward."""
        module.register_forward_pre_hook(lambda *_: self._forward(module))
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda _: self.events.append("grad"))

    def _forward(self, module: torch.nn.Module) -> None:
        self.events.append("forward")
        if self.dtypes is None:  # what the wrapper runs the model's parameters in (an FSDP casts some of them)
            self.dtypes = {n: p.dtype for n, p in module.named_parameters(remove_duplicate=False)}

    def cast_in(self, dtype: torch.dtype):
        """A function giving the names of the parameters the wrapper's first forward ran in `dtype` (None where it
        ran none in it, or none was seen): what a reference must cast to round as the wrapper does."""
        return lambda: {n for n, d in (self.dtypes or {}).items() if d == dtype} or None

    def overlapping(self) -> int:
        """Collectives issued in backward with a parameter's gradient still to come in that backward."""
        count, pending = 0, 0
        for event in self.events:
            if event == "collective":
                pending += 1
            elif event == "grad":
                count, pending = count + pending, 0
            else:
                pending = 0
        return count

    @contextmanager
    def watching(self):
        originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

        def counted(name, fn):
            signature = inspect.signature(fn)

            def call(*args, **kwargs):
                self.calls[name] += 1
                backward = torch._C._current_autograd_node() is not None
                self.in_backward += backward
                if backward and _blocks(name, signature, args, kwargs):
                    self.blocking += 1  # backward waits for it: it overlaps nothing
                elif backward:
                    self.events.append("collective")
                self.sizes.append(message_bytes(args, kwargs))
                return fn(*args, **kwargs)
            return call

        for name, fn in originals.items():
            setattr(dist, name, counted(name, fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)

    @staticmethod
    def held(wrapper, optimizer, module: torch.nn.Module, before: dict) -> dict:
        """What this rank holds after the last step, measured as memory (each storage once and whole, so a shard
        that is a view of the whole weight costs the whole weight): "params_pct", its parameters' storages, and
        "kept_pct", what else the wrapper keeps reachable from it (not gradients, buffers or optimizer state: a
        dict of gathered weights, a flat copy), of the whole model's parameter bytes, with "kept" (where, percent,
        tensors, how many of them are the size of a whole weight) and "views" (a parameter, its bytes and its
        storage's: a storage larger than the parameters viewing it), largest first;
        "optimizer_pct", of a whole AdamW's state (None for an optimizer that keeps none, plain SGD); and the
        layer classes (of `module`, as `layers(module)` found them before wrapping) it holds a shard of, and those
        holding a matrix it holds whole."""
        storages = model_state_storages(wrapper, optimizer)
        full = sum(numel * size for _, numel, size, _, first in before.values() if first)
        trainable = sum(numel * size for _, numel, size, grad, first in before.values() if grad and first)
        buffers = {storage_key(local(b)) for b in wrapper.buffers()}
        taken = buffers.union(*storages.values())
        whole_sizes = {numel for _, numel, *_ in before.values() if numel > 1}
        kept: dict = {}  # where, but its last indices (`self.full_params`) -> [percent, tensors, whole weights]
        for where, tensor in reachable(wrapper):
            key = storage_key(tensor)
            if key is not None and key not in taken:
                taken.add(key)
                totals = kept.setdefault(re.sub(r"(\[[^\]]*\])+$", "", where), [0.0, 0, 0])
                totals[0] += 100 * tensor.untyped_storage().nbytes() / full
                totals[1] += 1
                totals[2] += tensor.numel() in whole_sizes
        viewed: dict = {}  # a parameter storage -> (its parameters' bytes, their names)
        for name, p in wrapper.named_parameters():
            key = storage_key(local(p))
            if key is not None:
                size, names = viewed.get(key, (0, []))
                viewed[key] = (size + local(p).numel() * local(p).element_size(), [*names, name])
        views = sorted(((names[0], size, storages["params"][key]) for key, (size, names) in viewed.items()
                        if storages["params"][key] > VIEW_SLACK * size  # more than padding, and more than a trifle
                        and storages["params"][key] - size >= full / 100), key=lambda v: v[1] - v[2])
        # by what each layer holds now, whatever its parameters are called (an FSDP may hold `weight_shard`)
        now = {name: sum(p.numel() for p in layer.parameters(recurse=False))
               for name, layer in module.named_modules(remove_duplicate=False)}
        had: dict[str, tuple[str, int]] = {}
        for name, (cls, numel, *_) in before.items():
            layer = name.rpartition(".")[0]
            had[layer] = (cls, had.get(layer, (cls, 0))[1] + numel)
        sharded = {cls for layer, (cls, numel) in had.items() if now.get(layer, 0) < numel}
        whole = {cls for layer, (cls, numel) in had.items()
                 if now.get(layer, 0) >= numel and numel > 1 and cls not in sharded}
        state = sum(storages["optimizer_state"].values())
        return {"params_pct": 100 * sum(storages["params"].values()) / full,
                "kept_pct": sum(pct for pct, *_ in kept.values()),
                "kept": sorted(((where, *totals) for where, totals in kept.items()), key=lambda k: -k[1]),
                "views": views,
                "optimizer_pct": 100 * state / (2 * trainable) if state else None,
                "sharded": sorted(sharded), "whole": sorted(whole)}


def reachable(root) -> list[tuple[str, torch.Tensor]]:
    """(where, tensor) for every tensor reachable from `root` (a wrapper), named as its code would name it
    (`self.gathered['embed.weight']`): through modules (parameters, buffers, submodules, attributes, the hooks
    registered on them), dicts, lists, tuples and sets, a function's closure, a bound method's object, a
    partial's arguments, and the objects of classes defined outside torch and Python's own library (a user's
    bucket), each object once; an optimizer is not entered (its state is counted apart). A DTensor as its
    local shard."""
    paths = ({id(m): f"self.{name}" if name else "self" for name, m in root.named_modules(remove_duplicate=False)}
             if isinstance(root, torch.nn.Module) else {})
    out, seen, todo = [], set(), [("self", root, 0)]
    while todo:
        where, obj, depth = todo.pop()
        if id(obj) in seen or depth > MAX_DEPTH:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append((where, local(obj)))
            continue
        if isinstance(obj, dict):
            children = [(f"{where}[{key_text(k, paths)}]", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = [(f"{where}[{i}]", v) for i, v in enumerate(obj)]
        elif isinstance(obj, torch.nn.Module):
            registered = {**obj._parameters, **obj._buffers, **obj._modules}
            children = [(f"{where}.{k}", v) for k, v in registered.items()] + \
                [(f"{where}.{k}", v) for k, v in vars(obj).items() if k not in _MODULE_OWN or k in _HOOKS]
        elif isinstance(obj, types.FunctionType):  # a hook: what its closure holds (a cache of gathered weights)
            cells = zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=False)
            children = [(f"{where}.{obj.__name__}.{name}", _cell(cell)) for name, cell in cells]
        elif isinstance(obj, types.MethodType):
            children = [(f"{where}.__self__", obj.__self__)]
        elif isinstance(obj, functools.partial):
            children = [(f"{where}.args[{i}]", v) for i, v in enumerate(obj.args)] + \
                [(f"{where}.{k}", v) for k, v in obj.keywords.items()]
        elif _users(obj):
            children = [(f"{where}.{k}", v) for k, v in vars(obj).items()]
        else:
            continue
        todo += [(w, v, depth + 1) for w, v in reversed(children)]
    return out


_PLAIN_KEYS = (str, bytes, int, float, bool, type(None))


def key_text(key, paths: dict) -> str:
    """A dict key as the where of `reachable` shows it, without calling the user's `__repr__` or `extra_repr`
    (a module keyed dict: its repr reads weights an FSDP may have deleted): a plain value's repr, a module by its
    class and its path in the wrapper, any other object by its class and id."""
    if isinstance(key, _PLAIN_KEYS):
        return repr(key)
    if type(key) is tuple and all(isinstance(k, _PLAIN_KEYS) for k in key):
        return repr(key)
    cls = type(key).__name__
    if isinstance(key, torch.nn.Module):
        return f"<{cls} {paths[id(key)]}>" if id(key) in paths else f"<{cls}>"
    return f"<{cls} at {id(key):#x}>"


def unmeasured(exc: BaseException) -> dict:
    """What an observation returns when it raised: the check could not measure, which is no verdict on the code."""
    return {"unmeasured": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")}


_MODULE_OWN = frozenset(vars(torch.nn.Module()))  # what every module has: its registries, hooks and flags
_HOOKS = frozenset(k for k in _MODULE_OWN if k.endswith("hooks"))  # entered: a hook's closure may keep tensors


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return None
_NOT_USERS = (str(Path(torch.__file__).parent), sysconfig.get_paths()["stdlib"])


def _users(obj) -> bool:
    """An object worth entering: one with attributes, of a class defined in a file outside torch and Python's own
    library, not an optimizer."""
    if not hasattr(obj, "__dict__") or isinstance(obj, (type, torch.optim.Optimizer)):
        return False
    path = getattr(sys.modules.get(type(obj).__module__), "__file__", None)
    return path is not None and not path.startswith(_NOT_USERS)


def _blocks(name: str, signature: inspect.Signature, args, kwargs) -> bool:
    """Whether a call returns only once its collective is done: every one but isend/irecv and those given
    `async_op=True` (by keyword or by position)."""
    if name in ("isend", "irecv", "batch_isend_irecv"):
        return False
    try:
        return not signature.bind_partial(*args, **kwargs).arguments.get("async_op", False)
    except TypeError:
        return not kwargs.get("async_op", False)


def message_bytes(args, kwargs) -> int:
    """A collective call's message: the bytes of its largest tensor argument (a list's tensors each)."""
    tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else [a])
               if isinstance(t, torch.Tensor)]
    return max((t.numel() * t.element_size() for t in tensors), default=0)


def layers(module: torch.nn.Module) -> dict:
    """{parameter name: (its layer's class name, numel, element size, trainable, first)} of a model before
    wrapping, under each name a tied weight has (`first` on one of them)."""
    out, seen = {}, set()
    for layer_name, layer in module.named_modules(remove_duplicate=False):
        for name, p in layer.named_parameters(recurse=False, remove_duplicate=False):
            qualified = f"{layer_name}.{name}" if layer_name else name
            out[qualified] = (type(layer).__name__, p.numel(), p.element_size(), p.requires_grad, id(p) not in seen)
            seen.add(id(p))
    return out


def describe(per_rank: list, steps: int) -> str:
    """One line: rank 0's collectives per step by op and how many during backward; what the rank holding
    most holds; the layer classes whose parameters were sharded, where some were. What could not be measured (an
    observation that raised) is said so in its place."""
    seen = per_rank[0][3]
    calls = Counter(seen["calls"])
    total = sum(calls.values())

    def each(n: int) -> str:  # rank 0's count per step: whole, or a mean that says it is one
        return f"{n // steps}" if n % steps == 0 else f"{n / steps:g} (rank 0's mean over {steps} steps)"

    ops = ", ".join(f"{op} {each(n)}" for op, n in calls.most_common())
    overlapping, blocking = seen.get("overlapping", seen["in_backward"]), seen.get("blocking", 0)
    blocked = (f"{'all' if blocking == seen['in_backward'] else each(blocking)} blocking (backward waits "
               "for each), " if blocking else "")
    when = (f"{each(seen['in_backward'])} of them issued during backward, {blocked}{each(overlapping)} "
            "launched asynchronously with gradients still to come (those can overlap it)" if seen["in_backward"]
            else "none during backward (each waits for backward to end)")
    plural = "" if total == steps else "s"
    sizes = seen.get("sizes") or [0]
    messages = f", {_kib(sum(sizes) / steps)} per step, the largest {_kib(max(sizes))}" if total else ""
    collectives = (f"per step {each(total)} collective{plural} ({ops}{messages}), {when}" if total
                   else "no collective seen")
    held = [s["held"] for *_, s in per_rank]
    lost = next((h["unmeasured"] for h in held if "unmeasured" in h), None)
    if lost is not None:
        return (f"{collectives}; what each rank holds could not be measured (the check's own limit, no verdict on "
                f"the code: {lost})")
    params = max(h["params_pct"] for h in held)
    top = max(held, key=lambda h: h.get("kept_pct", 0))
    kept = (f" (and keeps {top['kept_pct']:.0f}% more beside them, in {', '.join(w for w, *_ in top['kept'][:3])})"
            if top.get("kept_pct", 0) >= 1 else "")
    optimizer = [h["optimizer_pct"] for h in held if h["optimizer_pct"] is not None]
    state = f", {max(optimizer):.0f}% of AdamW's state" if optimizer else ""
    sharded = sorted({c for h in held for c in h["sharded"]})
    whole = sorted({c for h in held for c in h["whole"]} - set(sharded))
    kinds = f"; sharded {', '.join(sharded)}" + (f", whole {', '.join(whole)}" if whole else "") if sharded else ""
    return f"{collectives}; the largest rank holds {params:.0f}% of the parameters{kept}{state}{kinds}"


def _kib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
