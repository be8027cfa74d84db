"""Our strategy=demo against the authors' DeMo optimizer (bloc97/DeMo's demo.py), same model, data and seed.

The authors' file is not part of ddp-lab: point this at your copy of it (it needs einops, which the deepspeed
extra installs). Two gloo ranks on this machine train the narrowed Transformer (model=tiny at 1/50) on the
built-in text for STEPS steps twice from the same start: with ddp-lab's DeMo (the strategy, through the same
train_step every job runs) and with theirs (their optimizer over the model's parameters, the gradients left
unsynchronized, as their README says to use it). Printed per step: both losses and both byte counts (ours:
what one rank sends; theirs: their `data_transmit`), then the largest relative loss difference.

    python benchmarks/demo_reference.py PATH/TO/demo.py [STEPS]
"""

from __future__ import annotations

import importlib.util
import sys

import torch

LR, WD, TOPK, CHUNK = 3e-3, 0.0, 32, 64
TEXT = {"name": "text", "path": None, "val_path": None, "val_fraction": 0.1}


def _model():
    from ddp_lab.models import Transformer

    return Transformer(vocab_size=256, context_length=16, d_model=64, d_ff=256, num_layers=2, num_heads=4)


class Unsynced(torch.nn.Module):
    """The model as the authors' optimizer wants it: no gradient synchronization (it communicates in its step)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)

    def finish_gradient_synchronization(self) -> None:
        pass


def _train(rank, world_size, reference_path, steps):
    from ddp_lab.check.parity import data_cfg
    from ddp_lab.rank.data import BatchSource
    from ddp_lab.rank.step import train_step
    from ddp_lab.strategies import DeMo

    spec = importlib.util.spec_from_file_location("authors_demo", reference_path)
    authors = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(authors)
    out = {}
    for name in ("ours", "theirs"):
        torch.manual_seed(0)  # one start for both, on every rank
        module = _model()
        if name == "ours":
            model = DeMo(module, topk=TOPK, chunk=CHUNK)
            optimizer = model.make_optimizer(torch.optim.SGD, lr=LR, weight_decay=WD)
            sent = model.facts()["demo"]["bytes_sent_per_step"]
        else:
            model = Unsynced(module)
            optimizer = authors.DeMo(module.parameters(), compression_topk=TOPK, compression_chunk=CHUNK,
                                     weight_decay=WD, lr=LR)
        batches = BatchSource(data_cfg(batch_size=8 * world_size, data=TEXT), rank, world_size, torch.device("cpu"))
        losses, sent_bytes = [], []
        for step in range(steps):
            losses.append(train_step(model, optimizer, list(batches.micro_batches(step))).item())
            sent_bytes.append(sent if name == "ours" else optimizer.data_transmit)
        out[name] = losses, sent_bytes
    return out


def main() -> None:
    from ddp_lab.check.ranks import run_ranks

    path, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 100
    results = run_ranks(_train, 2, path, steps, timeout_s=1800)
    (ours, our_bytes), (theirs, their_bytes) = results[0]["ours"], results[0]["theirs"]
    print("| step | our loss | their loss | our bytes sent | their bytes sent |\n|---|---|---|---|---|")
    for step in range(0, steps, max(1, steps // 10)):
        print(f"| {step} | {ours[step]:.4f} | {theirs[step]:.4f} | {our_bytes[step]} | {their_bytes[step]} |")
    worst = max(abs(a - b) / b for a, b in zip(ours, theirs))
    print(f"largest relative loss difference over {steps} steps: {worst:.2%}; "
          f"final {ours[-1]:.4f} (ours) / {theirs[-1]:.4f} (theirs)")


if __name__ == "__main__":
    main()
