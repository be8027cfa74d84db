"""Every per-step figure a job measures, in one table: the measurement record's one home (torch-free).

A row says once what a figure is: its key (in steps.jsonl, results.json's `steps` and `summary`, and
W&B), its unit, how a step's ranks combine it, whether the job's summary gives its statistics, what W&B's
run summary keeps, when it is present, and what it means. The readers take the table, not lists of
names: the reduction over ranks (rank/timing.py), a training job's summary (arithmetic/stats.py), W&B's
`define_metric` (rank/recorder.py), the flat records the tables and report read (analysis/records.py),
and the per-step section of docs/measurements.md (`figures_markdown`, held to the table by a test).

Adding a per-step figure is the code that emits it and one row here.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA_VERSION = 2
"""results.json's `schema`: 2 since it was written (2026-11-26); a file without one is version 1, the same
layout. A reader refuses a newer version in one line (jobdir.read_results) rather than misread it."""


@dataclass(frozen=True)
class Figure:
    """One per-step figure: its name, and how every reader treats it."""

    key: str
    """Its name in steps.jsonl, results.json's steps and summary, and W&B."""
    unit: str
    meaning: str
    """One line, for the docs' table."""
    ranks: str = "max"
    """How a step's ranks combine it: `max` (a step is as slow as its slowest rank; counters, equal on
    every rank, too), `mean` (a loss, a phase: rank means add up to the average rank's step), `min` (the
    least over ranks of `of`), `one` (already the same on every rank when it is recorded)."""
    of: str | None = None
    """For `ranks="min"`: the figure whose least over ranks this is."""
    summarized: bool = True
    """The job's summary gives its mean, std, p50, p90, p95, min and max over the measured steps."""
    wandb: str | None = None
    """What W&B's run summary keeps of it (mean, last, min); None: W&B's default, the last value."""
    task: str = "train"
    """The task whose steps carry it: train, or allreduce (the collective benchmark's iterations)."""
    when: str = ""
    """When it is present; empty: every step."""
    record: tuple[str, ...] = ()
    """The statistics of it the flat records carry (analysis/records.py), as `{stem}_{stat}{suffix}`."""
    stem: str = ""
    """The flat records' name for it (`step` for step_time_ms: step_p50_ms); empty: the key's."""

    def record_key(self, stat: str) -> str:
        """The flat record's name of one statistic: step_time_ms's p50 is `step_p50_ms`."""
        stem, suffix = (self.stem, "_ms") if self.stem else (self.key, "")
        return f"{stem}_{stat}{suffix}"


STEP_TIME = Figure("step_time_ms", "ms", "wall time of the step, the device synchronized at both ends", wandb="mean",
                   record=("p50", "p90", "min", "mean"), stem="step")
LOSS = Figure("loss", "nats/token", "training loss of the step's own batch (each rank's slice, then the mean)",
              ranks="mean", summarized=False, wandb="last")
VAL_LOSS = Figure("val_loss", "nats/token", "held-out loss: the mean over ranks of train.eval_batches fixed "
                  "batches, outside the step's time", ranks="one", summarized=False, wandb="min",
                  when="train.eval_every steps and the last")
FWD_BWD = Figure("fwd_bwd_ms", "ms", "forward and backward (the step timer's first lap)", ranks="mean", wandb="mean",
                 record=("p50",), stem="fwd_bwd")
SYNC = Figure("sync_ms", "ms", "finish_gradient_synchronization(): the gradient wait backward did not hide",
              ranks="mean", wandb="mean")
OPTIMIZER = Figure("optimizer_ms", "ms", "the optimizer step, a sharded optimizer's own communication included",
                   ranks="mean", wandb="mean", record=("p50",), stem="optimizer")
COMM = Figure("comm_ms", "ms", "the strategy's collectives (the data-parallel axis) in flight: the union of their "
              "[launch, completion] intervals",
              wandb="mean", record=("p50",), stem="comm")
EXPOSED = Figure("exposed_comm_ms", "ms", "time the rank waited for a collective while computing nothing (the "
                 "most-waiting rank)", wandb="mean", record=("p50",), stem="exposed")
EXPOSED_MIN_RANK = Figure("exposed_comm_min_rank_ms", "ms", "the least-waiting rank's exposed comm; the difference "
                          "to the most-waiting rank's is the ranks' skew", ranks="min", of=EXPOSED.key,
                          record=("p50",), stem="exposed_min_rank")
EXPOSED_OPTIMIZER = Figure("exposed_optimizer_comm_ms", "ms", "the part of the exposed comm spent inside the "
                           "optimizer step (zero1's broadcasts)")
COMPRESS = Figure("compress_ms", "ms", "compression arithmetic (PowerSGD's products and QR): compute, not comm",
                  ranks="mean")
COLLECTIVES = Figure("collectives", "count", "collectives launched in the step", summarized=False)
COMM_BYTES = Figure("comm_bytes", "bytes", "bytes handed to the strategy's collectives (the wire dtype's), not bytes "
                    "over a link", summarized=False, wandb="mean")
TP_COMM = Figure("tp_comm_ms", "ms", "the tensor-parallel axis's collectives, each blocking on the critical path of "
                 "forward or backward (all of it exposed), from start to end", wandb="mean", record=("p50",),
                 stem="tp_comm", when="parallel.tp > 1 with parallel.tp_impl=lab")
TP_COLLECTIVES = Figure("tp_collectives", "count", "collectives of the tensor-parallel axis in the step (torch's "
                        "DTensor: counted in step 0 only, summary.mesh.tp_counted)", summarized=False,
                        when="parallel.tp > 1 with parallel.tp_impl=lab")
TP_COMM_BYTES = Figure("tp_comm_bytes", "bytes", "bytes handed to the tensor-parallel axis's collectives (an "
                       "all-gather's output, a reduce-scatter's input)", summarized=False, wandb="mean",
                       when="parallel.tp > 1 with parallel.tp_impl=lab")
PP_BUBBLE = Figure("pp_bubble_pct", "%", "the share of the pipeline's span (the step's start to the last action of "
                   "its longest stage rank) a rank computed nothing: waiting for a neighbour or idle; the published "
                   "bubble is the mean over stages", ranks="mean", wandb="mean", record=("p50",), stem="pp_bubble",
                   when="parallel.pp > 1")
PP_WAIT = Figure("pp_wait_ms", "ms", "a rank's time blocked in the pipeline's receives (activations, gradients)",
                 ranks="mean", wandb="mean", when="parallel.pp > 1 with parallel.pp_impl=lab")
PP_P2P_BYTES = Figure("pp_p2p_bytes", "bytes", "bytes a rank sent to its neighbouring stages (activations forward, "
                      "their gradients backward)", summarized=False, when="parallel.pp > 1 with parallel.pp_impl=lab")
CP_BYTES_FORWARD = Figure("cp_bytes_forward", "bytes", "bytes a rank sent over the context-parallel axis in the "
                          "step's forwards (K/V around the ring, q/k/v/out in Ulysses' all-to-alls; torch's by its "
                          "source's formula)", summarized=False, when="parallel.cp > 1")
CP_BYTES_BACKWARD = Figure("cp_bytes_backward", "bytes", "bytes a rank sent over the context-parallel axis in the "
                           "step's backwards (K/V again and their gradients; the all-to-alls reversed)",
                           summarized=False, when="parallel.cp > 1")
CP_EXPOSED = Figure("cp_exposed_ms", "ms", "the most-waiting rank's time on context-parallel exchanges: a ring's "
                    "receives after the block it computed meanwhile (a less busy rank of a causal ring also waits "
                    "there for its busier peers' blocks; summary.mesh.context has the busiest rank's, the exchange's "
                    "own), Ulysses' whole all-to-alls (torch's: not seen, 0)",
                    wandb="mean", record=("p50",), stem="cp_exposed", when="parallel.cp > 1")
CP_ATTENTION = Figure("cp_attention_ms", "ms", "the busiest rank's time in its attention blocks (forward and "
                      "backward; Ulysses' forward only; torch's: not seen, 0)", wandb="mean", record=("p50",),
                      stem="cp_attention", when="parallel.cp > 1")
CP_PAIRS = Figure("cp_pairs", "pairs", "query-key pairs the busiest rank scored in the step's forwards, times the "
                  "heads it scored them for (torch's: not seen, 0)", summarized=False, when="parallel.cp > 1")
CP_CALLS = Figure("cp_calls", "calls", "context-parallel attention calls in the step's forwards (layers x "
                  "micro-batches)", summarized=False, when="parallel.cp > 1")
EP_BYTES = Figure("ep_bytes", "bytes", "bytes a rank sent to the other expert-parallel ranks in the step: the tokens "
                  "to their experts and back (dispatch, combine), forward and backward; the four parts below add up to "
                  "it", summarized=False, when="parallel.ep > 1")
EP_PARTS = (Figure("ep_bytes_dispatch_forward", "bytes", "ep_bytes' tokens sent to their experts in the forwards",
                   summarized=False, when="parallel.ep > 1"),
            Figure("ep_bytes_dispatch_backward", "bytes", "ep_bytes' gradients of the dispatched tokens sent back in "
                   "the backwards", summarized=False, when="parallel.ep > 1"),
            Figure("ep_bytes_combine_forward", "bytes", "ep_bytes' expert outputs sent back to their tokens' ranks in "
                   "the forwards", summarized=False, when="parallel.ep > 1"),
            Figure("ep_bytes_combine_backward", "bytes", "ep_bytes' gradients of the outputs sent to the experts in "
                   "the backwards", summarized=False, when="parallel.ep > 1"))
EP_EXCHANGE = Figure("ep_exchange_ms", "ms", "a rank's time inside the expert-parallel all-to-alls (counts and rows): "
                     "they block it, so all of it is exposed", wandb="mean", record=("p50",), stem="ep_exchange",
                     when="parallel.ep > 1")
MOE_BUSIEST = Figure("moe_busiest_share", "ratio", "the busiest expert's share of the routed slots in the last "
                     "forward, over this rank's tokens (the worst layer, the worst rank); 1/experts is even",
                     wandb="mean", record=("p50",), when="a mixture-of-experts model")
MOE_MAX_OVER_MEAN = Figure("moe_max_over_mean", "ratio", "the busiest expert's load over the mean expert's, as "
                           "moe_busiest_share (1 is even)", wandb="mean", record=("p50",),
                           when="a mixture-of-experts model")
MOE_DROPPED = Figure("moe_dropped_pct", "%", "routed slots dropped for want of capacity in the last forward (every "
                     "layer, the worst rank)", wandb="mean", record=("mean",), when="model.capacity_factor set")
MOE_AUX = Figure("moe_aux_loss", "nats/token", "the load-balancing loss added to the gradient (coefficient "
                 "included), summed over the layers of the step's last forward; not in `loss`",
                 ranks="mean", summarized=False, when="model.balance=aux_loss")
GRAD_ERROR = Figure("grad_error", "ratio", "relative error of the delivered gradient against the exact mean",
                    when="measure.grad_error=true")
LOSS_SCALE = Figure("loss_scale", "scale", "fp16's loss scale after the step's update", summarized=False,
                    when="train.precision=fp16")
LATENCY = Figure("latency_ms", "ms", "one timed iteration of the collective, its slowest rank", task="allreduce",
                 summarized=False, wandb="mean")
ALGBW = Figure("algbw_GBps", "GB/s", "the message's bytes over the iteration's time", task="allreduce",
               summarized=False)
BUSBW = Figure("busbw_GBps", "GB/s", "algbw times the op's bus factor (nccl-tests'): what each rank's link carried "
               "per second", task="allreduce", summarized=False)
RANK_SPREAD = Figure("rank_spread_ms", "ms", "the slowest rank's time minus the fastest's in the iteration",
                     task="allreduce", summarized=False)
CHECKPOINT_SAVE = Figure("checkpoint_save_ms", "ms", "the loop waiting for a checkpoint after the step, outside the "
                         "step's time: the whole save until complete (every rank's pieces written, then renamed); "
                         "with checkpoint.async_save the copy it writes from, and any earlier save still writing",
                         summarized=False, wandb="mean", when="checkpoint.every steps and the last")
CHECKPOINT_BYTES = Figure("checkpoint_bytes", "bytes", "tensor bytes the most-writing rank wrote into the checkpoint "
                          "(a piece several ranks hold is written by one)", summarized=False,
                          when="checkpoint.every steps and the last; with checkpoint.async_save the last only")
CHECKPOINT_MEMORY = Figure("checkpoint_extra_bytes", "bytes", "host memory the save added at its peak while the loop "
                           "waited, over what the rank held before it (Linux's VmHWM, reset; the copy an async save "
                           "writes from is in it)", summarized=False,
                           when="checkpoint.every steps and the last, on Linux")
CHECKPOINT_STAGED = Figure("checkpoint_staged_bytes", "bytes", "the copy of this rank's pieces an async save writes "
                           "from, held in host memory until written (the most any rank staged)", summarized=False,
                           when="checkpoint.async_save, every save but the last")
INJECTED_DELAY = Figure("injected_delay_ms", "ms", "the time fault.kind=slow added to the slow rank's forward and "
                        "backward this step (the straggler's known truth)", when="fault.kind=slow, from fault.step on")
SKEW = Figure("skew_ms", "ms", "ranks arriving apart at the step's collectives: the union over collectives of [first "
              "rank's entry, last rank's entry] (arithmetic/skew.py)", ranks="one", wandb="mean",
              when="2 ranks or more on one host", record=("p50",), stem="skew")
PEER_WAIT = Figure("peer_wait_ms", "ms", "the most-waiting rank's time inside collectives before their last rank "
                   "entered: waiting for a late peer, not moving data", ranks="one", wandb="mean",
                   when="2 ranks or more on one host")
TRANSFER = Figure("transfer_ms", "ms", "the same rank's time inside collectives once every rank had entered; with "
                  "peer_wait_ms it adds up to that rank's comm_ms", ranks="one", wandb="mean",
                  when="2 ranks or more on one host")

FIGURES: tuple[Figure, ...] = (STEP_TIME, LOSS, VAL_LOSS, FWD_BWD, SYNC, OPTIMIZER, COMM, EXPOSED, EXPOSED_MIN_RANK,
                               EXPOSED_OPTIMIZER, COMPRESS, COLLECTIVES, COMM_BYTES, TP_COMM, TP_COLLECTIVES,
                               TP_COMM_BYTES, PP_BUBBLE, PP_WAIT, PP_P2P_BYTES, CP_BYTES_FORWARD, CP_BYTES_BACKWARD,
                               CP_EXPOSED, CP_ATTENTION, CP_PAIRS, CP_CALLS, EP_BYTES, *EP_PARTS, EP_EXCHANGE,
                               MOE_BUSIEST, MOE_MAX_OVER_MEAN, MOE_DROPPED, MOE_AUX, GRAD_ERROR, LOSS_SCALE,
                               CHECKPOINT_SAVE, CHECKPOINT_BYTES, CHECKPOINT_MEMORY, CHECKPOINT_STAGED,
                               INJECTED_DELAY, SKEW, PEER_WAIT, TRANSFER, LATENCY, ALGBW, BUSBW, RANK_SPREAD)
"""In the order the docs list them."""

BY_KEY = {f.key: f for f in FIGURES}


def figure(key: str) -> Figure:
    """The row of `key`; a figure with no row is refused, so none is recorded that nobody described."""
    try:
        return BY_KEY[key]
    except KeyError:
        raise KeyError(f"per-step figure {key!r} has no row in ddp_lab/spec/figures.py: add one") from None


def training_figures() -> tuple[Figure, ...]:
    return tuple(f for f in FIGURES if f.task == "train")


def figures_markdown() -> str:
    """The per-step section of docs/measurements.md (a test holds the page to it)."""
    lines = ["| key | unit | ranks combine | in summary | W&B summary | when | meaning |",
             "|---|---|---|---|---|---|---|"]
    for f in FIGURES:
        ranks = f"min of {f.of}" if f.ranks == "min" else {"one": "same on every rank"}.get(f.ranks, f.ranks)
        when = f.when or ("every step" if f.task == "train" else "every iteration (task=allreduce)")
        lines.append(f"| `{f.key}` | {f.unit} | {ranks} | {'statistics' if f.summarized else '-'} | "
                     f"{f.wandb or 'last'} | {when} | {f.meaning} |")
    return "\n".join(lines)
