"""Checkpoints that move between strategies and world sizes (`checkpoint.every`, `.keep`, `.load`).

Every rank saves the pieces of the parameters and of the optimizer state it holds, where they lie, with
torch.distributed.checkpoint (DCP): each piece is a chunk of its tensor flattened, at its offset
(strategies/checkpoint_layout.py), so a sharded strategy writes its shards as they are and nothing is
gathered on one rank; a piece every rank holds (a replicated parameter) is written once (DCP's dedup).
A load asks for the pieces the loading strategy holds and DCP reads whatever chunks overlap them:
any strategy's checkpoint loads into any strategy at any world size, optimizer state included (a
parameter's state follows it to its new owner).

What a checkpoint holds, as DCP keys: `model.NAME` and `optim.NAME.KEY` (AdamW's exp_avg, exp_avg_sq,
each parameter's step) as 1-D tensors of the full parameter's size; `rng.R`, rank R's random generator
state, restored where the world size is the same; `state.R.NAME`, a strategy's own state of rank R
(powersgd's error feedback, local SGD's own parameters), given back to it where the world size is the
same. Beside them `checkpoint.json`: the step to run next, the format, the strategy, world size and model
it came from, each parameter's shape, the fp16 loss scaler; launch.py reads it to refuse a checkpoint
that does not fit before any rank starts. The data position is the step: every batch is drawn from
(seed, step).

A checkpoint is complete or absent: DCP writes into `step_N.partial/`, and once its metadata is written
(last, after every rank's files) rank 0 writes checkpoint.json and renames the folder to `step_N/`; a load
takes only a `step_N` folder with its checkpoint.json (jobdir.complete_checkpoints).

A strategy whose spec names an `own_checkpoint` format (DeepSpeed's: its engine's flat partitions are no
DCP pieces) writes its state with `save_own` instead, completed the same way; it loads only into the
same strategy at the same world size (jobdir.own_format_problem), and takes no other's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_read_items, create_read_items_for_chunk_list
from torch.distributed.checkpoint.staging import AsyncStager

from ddp_lab.jobdir import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_META,
    checkpoint_path,
    checkpoint_problem,
    own_format_problem,
    read_checkpoint,
)
from ddp_lab.spec.strategies import own_format
from ddp_lab.strategies.checkpoint_layout import local_view


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded here, said in one line."""


@dataclass
class Flat:
    """A tensor of `numel` elements, flattened, of which this rank holds `pieces`: (offset, 1-D view)."""

    numel: int
    pieces: list


class _SavePlanner(DefaultSavePlanner):
    """DCP's planner, plus a write item per piece of each `Flat` (a chunk at its offset)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self):
        plan = create_default_local_save_plan({k: v for k, v in self.state_dict.items() if not isinstance(v, Flat)},
                                              self.is_coordinator)
        items = list(plan.items)
        for key, flat in self.state_dict.items():
            if isinstance(flat, Flat):
                items += [WriteItem(index=MetadataIndex(key, torch.Size([offset])), type=WriteItemType.SHARD,
                                    tensor_data=TensorWriteData(
                                        chunk=ChunkStorageMetadata(torch.Size([offset]), torch.Size([piece.numel()])),
                                        properties=TensorProperties.create_from_tensor(piece),
                                        size=torch.Size([flat.numel])))
                          for offset, piece in flat.pieces]
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item):
        value = self.state_dict[write_item.index.fqn]
        if isinstance(value, Flat):
            return _piece_at(value, write_item.index.offset[0]).detach().cpu()
        return super().resolve_data(write_item)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's planner, reading into each piece of each `Flat` whatever saved chunks overlap it."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        # DefaultLoadPlanner's would first pass the state dict through _init_state_dict, which replaces
        # every value that is no tensor (a Flat) by None
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self):
        requests = []
        for key, value in self.state_dict.items():
            md = self.metadata.state_dict_metadata[key]
            if isinstance(value, Flat):
                chunks = [ChunkStorageMetadata(torch.Size([o]), torch.Size([p.numel()])) for o, p in value.pieces]
                requests += create_read_items_for_chunk_list(key, md, chunks)
            else:
                requests += _create_read_items(key, md, value)
        return LoadPlan(requests)

    def resolve_tensor(self, read_item):
        value = self.state_dict[read_item.dest_index.fqn]
        if isinstance(value, Flat):
            piece = _piece_at(value, read_item.dest_index.offset[0])
            return piece.narrow(0, read_item.dest_offsets[0], read_item.lengths[0])
        return super().resolve_tensor(read_item)

    def commit_tensor(self, read_item, tensor):
        if not isinstance(self.state_dict[read_item.dest_index.fqn], Flat):
            super().commit_tensor(read_item, tensor)  # a Flat's piece was read into in place


def _every_rank(shapes: dict) -> dict:
    """Every parameter's shape, from every rank's (a pipeline's stages each hold their own layers'). Collective."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, shapes)
    return {name: shape for mine in everyone for name, shape in mine.items()}


def _piece_at(flat: Flat, offset: int) -> torch.Tensor:
    return next(piece for at, piece in flat.pieces if at == offset)


# --- what a checkpoint holds ----------------------------------------------------------------------------

def as_is(name: str, shape, pieces: list) -> tuple:
    """Where a strategy's pieces lie in the whole parameter: the parameter of that name, where the strategy says
    (no tensor parallelism, no pipeline)."""
    return name, shape, pieces


def _model_state(model, place=as_is) -> tuple[dict, dict]:
    """(`model.NAME` Flats, each parameter's full shape). `place(name, shape, pieces)`: the whole model's
    parameter, its shape and the pieces of it that the strategy's pieces of this rank's tensor are (tensor
    parallelism's: a TP rank's tensor is itself a piece; a pipeline's: the copy of a weight tied across stages
    is the weight of the name one process gives it: `Parallelism.place`)."""
    params = {}
    for name, (shape, pieces) in model.checkpoint_params().items():
        whole, shape, pieces = place(name, shape, pieces)
        params[whole] = (shape, pieces)
    shapes = {name: list(shape) for name, (shape, _) in params.items()}
    flats = {f"model.{name}": Flat(math.prod(shape), [(o, p) for o, p in pieces if p.numel()])
             for name, (shape, pieces) in params.items()}
    return flats, shapes


def _optimizer_state(model, optimizer, shapes: dict, names: set | None = None, place=as_is) -> dict:
    """`optim.NAME.KEY` Flats of the optimizer state this rank holds; with `names` (the keys a checkpoint
    has), the optimizer's state is first created (zeros, of the keys the checkpoint has) where it does not exist
    yet, to be read into; `place` as `_model_state`'s."""
    inner, where = model.checkpoint_optimizer(optimizer)
    flats: dict[str, Flat] = {}
    for group in inner.param_groups:
        for tensor in group["params"]:
            if id(tensor) not in where:
                continue
            local, offset = where[id(tensor)]
            name = place(local, None, [])[0]  # the whole model's name for it
            if names is not None and tensor not in inner.state:
                prefix = f"optim.{name}."
                keys = [n[len(prefix):] for n in names if n.startswith(prefix) and "." not in n[len(prefix):]]
                if keys:
                    inner.state[tensor] = _fresh_state(tensor, keys)
            for key, value in inner.state.get(tensor, {}).items():
                if not torch.is_tensor(value):
                    continue
                if key == "step":  # one count per parameter: one optimizer tensor of it per rank (all here)
                    flat = flats.setdefault(f"optim.{name}.step", Flat(1, []))
                    if flat.pieces:
                        raise NotImplementedError(f"two optimizer tensors of {name!r} on one rank")
                    flat.pieces.append((0, value.detach().reshape(1)))
                    continue
                view = local_view(value)
                if view.numel():
                    flat = flats.setdefault(f"optim.{name}.{key}", Flat(math.prod(shapes[name]), []))
                    flat.pieces.extend(place(local, None, [(offset, view)])[2])
    return flats


def _fresh_state(tensor: torch.Tensor, keys: list[str]) -> dict:
    """The optimizer's state of `tensor` as its first step creates it (AdamW's `step`, `exp_avg`, `exp_avg_sq`
    in torch/optim/adamw.py `_init_group`; Muon's `momentum_buffer`), of the keys a checkpoint has, to be read
    into."""
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return {key: torch.tensor(0.0, dtype=dtype) if key == "step" else torch.zeros_like(tensor) for key in keys}


def _rng_key(rank: int) -> str:
    return f"rng.{rank}"


def _state_key(rank: int, name: str) -> str:
    """The DCP key of a strategy's own state of rank `rank` (`checkpoint_rank_state`)."""
    return f"state.{rank}.{name}"


# --- save and load ------------------------------------------------------------------------------------

def save(job_dir: Path, step: int, model, optimizer, precision, about: dict, background=None,
         place=as_is) -> Saving:
    """Save the state after `step` steps to JOB/checkpoints/step_{step} (collective: every rank calls it).
    `about`: the strategy, world size, mesh and model it was written by, for the record and for a load's checks.
    With `background` (a gloo process group of the checkpoints' own) the pieces are copied to host memory and
    written by DCP's `async_save` while training goes on; else written before this returns. `place`: where this
    rank's tensors lie in the whole parameters (`_model_state`): every checkpoint holds the single-process
    layout, whatever the mesh that wrote it."""
    rank = dist.get_rank()
    final = checkpoint_path(job_dir, step)
    partial = final.with_name(final.name + ".partial")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a save that was killed before it completed
    dist.barrier()
    own = own_format(about.get("strategy"))
    if own is not None:
        return _save_own(model, partial, final, {"format": CHECKPOINT_FORMAT, "step": step, **about,
                                                 "own_format": own, "loss_scaler": _scaler_state(precision)})
    rng = torch.get_rng_state()
    mine = {_state_key(rank, name): Flat(t.numel(), [(0, t.detach().reshape(-1))])
            for name, t in model.checkpoint_rank_state().items() if t.numel()}  # before any consensus
    with model.checkpoint_consensus(optimizer):
        flats, shapes = _model_state(model, place)
        state = {**flats, **_optimizer_state(model, optimizer, shapes, place=place), **mine,
                 _rng_key(rank): Flat(rng.numel(), [(0, rng)])}
        meta = {"format": CHECKPOINT_FORMAT, "step": step, **about, "shapes": _every_rank(shapes),
                "loss_scaler": _scaler_state(precision)}
        saving = Saving(partial, final, meta, _SavePlanner())
        writer = FileSystemWriter(partial)
        if background is None:
            dcp.save(state, storage_writer=writer, planner=saving.planner)
        else:
            staged = {key: Flat(flat.numel, [(o, p.detach().to("cpu", copy=True)) for o, p in flat.pieces])
                      for key, flat in state.items()}  # what training changes next is not what is written
    if background is None:
        saving.written(None)
        dist.barrier()
        return saving
    saving.staged_bytes = sum(p.numel() * p.element_size() for flat in staged.values() for _, p in flat.pieces)
    future = dcp.async_save(staged, storage_writer=writer, planner=saving.planner, process_group=background,
                            async_stager=_AlreadyStaged())
    future.add_done_callback(saving.written)
    return saving


def _save_own(model, partial: Path, final: Path, meta: dict) -> Saving:
    """A checkpoint in the strategy's own format (`save_own`, written before this returns, `async_save` or
    not), completed as every checkpoint is: checkpoint.json and the rename, once every rank has written."""
    meta["shapes"] = {name: list(getattr(p, "ds_shape", p.shape)) for name, p in model.module.named_parameters()}
    saving = Saving(partial, final, meta, None)
    saving.own_bytes = model.save_own(partial)
    dist.barrier()  # every rank's files written
    saving.written(None)
    dist.barrier()
    return saving


class _AlreadyStaged(AsyncStager):
    """The state handed to `async_save` is already a copy in host memory (`save`): nothing to stage."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict


class Saving:
    """A save under way or done. Once DCP has written it (its metadata last, after every rank's files), rank 0
    adds checkpoint.json and renames `step_N.partial/` to `step_N/`: the checkpoint now exists. For an
    asynchronous save that happens in DCP's writing thread, as soon as it is written."""

    def __init__(self, partial: Path, final: Path, meta: dict, planner: _SavePlanner | None):
        self.partial, self.final, self.meta, self.planner = partial, final, meta, planner
        self.done, self.error = threading.Event(), None
        self.staged_bytes = 0  # the copy an asynchronous save writes from
        self.own_bytes = 0  # what a save in the strategy's own format wrote of this rank's (no planner)

    def written(self, future) -> None:
        try:
            if future is not None:
                future.result()
            if dist.get_rank() == 0:
                (self.partial / CHECKPOINT_META).write_text(json.dumps(self.meta, indent=1))
                shutil.rmtree(self.final, ignore_errors=True)
                os.replace(self.partial, self.final)
        except BaseException as exc:  # raised again in the training thread, by wait()
            self.error = exc
        finally:
            self.done.set()

    def wait(self) -> int:
        """Block until the checkpoint is complete; the tensor bytes this rank wrote (its items after DCP's
        dedup of the pieces several ranks hold)."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        if self.planner is None:
            return self.own_bytes
        return sum(math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
                   for item in self.planner.plan.items if item.tensor_data is not None)


class Loaded(NamedTuple):
    step: int         # the step to run next
    rank_state: bool  # the strategy's own per-rank state was given back (else started afresh, or none)


def load(path: Path, model, optimizer, precision, about: dict | None = None, place=as_is) -> Loaded:
    """Load the checkpoint at `path` (written by any strategy at any world size, on any mesh) into this rank's
    pieces (`place` as save's). The strategy's per-rank state (`checkpoint_rank_state`) comes back where the
    world size and the mesh are the same. A checkpoint in a strategy's own format (DeepSpeed's) loads only into
    that strategy at its world size (`about`: the loading strategy, as save's). Collective: every rank calls
    it."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    meta = read_checkpoint(path)
    if about is not None:
        problem = own_format_problem(meta, about["strategy"], own_format(about.get("strategy")), world_size)
        if problem is not None:
            raise CheckpointError(f"{path}: {problem}")
    if meta.get("own_format") is not None:
        model.load_own(path)
        _restore_scaler(precision, meta)
        return Loaded(int(meta["step"]), True)
    flats, shapes = _model_state(model, place)
    problem = checkpoint_problem(meta, _every_rank(shapes))
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}")
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    state = {**flats, **_optimizer_state(model, optimizer, shapes, set(saved), place)}
    missing = sorted(k for k in state if k not in saved)
    if missing:
        raise CheckpointError(f"{path}: no {missing[0]} in the checkpoint (it has no optimizer state for it)")
    rng, own = torch.get_rng_state(), {}
    same_mesh = meta.get("mesh", f"{meta.get('world_size')}x1") == (about or {}).get("mesh", f"{world_size}x1")
    if meta.get("world_size") == world_size and same_mesh:
        if _rng_key(rank) in saved:
            state[_rng_key(rank)] = Flat(rng.numel(), [(0, rng)])
        prefix = _state_key(rank, "")
        own = {key[len(prefix):]: torch.zeros(md.size, dtype=md.properties.dtype)
               for key, md in saved.items() if key.startswith(prefix)}
        state.update({prefix + name: Flat(t.numel(), [(0, t)]) for name, t in own.items()})
    dcp.load(state, storage_reader=FileSystemReader(path), planner=_LoadPlanner())
    if _rng_key(rank) in state:
        torch.set_rng_state(rng)
    _restore_scaler(precision, meta)
    return Loaded(int(meta["step"]), model.load_rank_state(own))


def _restore_scaler(precision, meta: dict) -> None:
    if precision.scaler is not None and meta.get("loss_scaler"):
        vars(precision.scaler).update(meta["loss_scaler"])


def _scaler_state(precision) -> dict | None:
    """fp16's loss scaler, where it stands (its settings are the loading run's own)."""
    scaler = precision.scaler
    return None if scaler is None else {k: getattr(scaler, k) for k in ("scale", "clean_steps", "skipped_steps")}
