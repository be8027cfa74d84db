"""Expert parallelism said without torch: its implementations, the all-to-all's bytes, and why a layout or a
mixture cannot run (the launcher asks before any rank starts).

`parallel.ep` ranks split a mixture's experts; they are borrowed from the data-parallel region (dp x cp), as
torchtitan borrows them from dp_shard x cp, so `world_size` stays pp x dp x cp x tp (spec/parallel.py's MeshLayout
lays the groups out). Bytes per MoE layer per rank per step (T tokens a rank, top-k, width d, b bytes an element, P
ranks of ep): each of the T·k routed rows leaves its rank unless its expert is there (a share 1/P of them under an
even load), four times (dispatch and combine, forward and backward): about 4·T·k·d·b·(P−1)/P. docs/experts.md
derives it; the runtime counts what it sends and a test holds the count to it.
"""

from __future__ import annotations

from ddp_lab.spec.choices import Choice


class EPImpl(Choice):
    lab = "lab"
    """The lab's exchange by hand (ddp_lab/expert_parallel/exchange.py): counts first, an all-to-all in an autograd
    Function of its own, the permutation and its inverse, the experts one matmul chain each (any dtype)."""
    torch = "torch"
    """torchtitan's recipe from torch's parts: `_functional_collectives.all_to_all_single_autograd` and
    `torch._grouped_mm` (fp32 and bf16 only; every row's bytes a multiple of 16)."""


ROUTERS = ("softmax", "sigmoid")
BALANCES = ("aux_loss", "bias", "none")


def all_to_all_bytes(tokens: int, top_k: int, d_model: int, element_bytes: int, ep: int) -> float:
    """The expected bytes one rank sends per MoE layer per step (dispatch and combine, forward and backward) under
    an even load: 4·T·k·d·b·(P−1)/P."""
    return 4 * tokens * top_k * d_model * element_bytes * (ep - 1) / ep


def moe_problem(model, ep: int, replicas: int) -> str | None:
    """Why a model's mixture (its config node: experts, top_k, ...) cannot run at `ep` over `replicas` (dp x cp)
    data-parallel ranks, or None. A dense model (no `experts` key) takes only ep = 1."""
    experts = model.get("experts") if hasattr(model, "get") else None
    if ep < 1:
        return f"parallel.ep must be >= 1, got {ep}"
    if experts is None:
        return None if ep == 1 else (f"parallel.ep={ep} splits a mixture's experts, and model={model.get('name')} "
                                     "has none: use model=tiny_moe or small_moe")
    top_k, capacity = int(model.get("top_k")), model.get("capacity_factor")
    if experts < 1:
        return f"model.experts must be >= 1, got {experts}"
    if model.get("d_ff") is not None:
        return (f"model.d_ff={model.get('d_ff')}: a mixture has no dense feed-forward; each expert's width is "
                "model.expert_d_ff")
    if top_k < 1 or top_k > experts:
        return f"model.top_k={top_k} must be between 1 and model.experts={experts}"
    if int(model.get("expert_d_ff")) < 1:
        return f"model.expert_d_ff must be >= 1, got {model.get('expert_d_ff')}"
    for key in ("balance_coeff", "bias_rate"):
        value = float(model.get(key))
        if not 0 <= value < float("inf"):
            return f"model.{key} must be a finite number >= 0, got {model.get(key)}"
    if str(model.get("router")) not in ROUTERS:
        return f"model.router must be one of {', '.join(ROUTERS)}, got {model.get('router')}"
    if str(model.get("balance")) not in BALANCES:
        return f"model.balance must be one of {', '.join(BALANCES)}, got {model.get('balance')}"
    if capacity is not None and not float(capacity) > 0:
        return f"model.capacity_factor must be > 0 (or null: dropless), got {capacity}"
    if int(model.get("shared_experts", 0)) not in (0, 1):
        return f"model.shared_experts must be 0 or 1, got {model.get('shared_experts')}"
    if replicas % ep:
        return (f"parallel.ep={ep} borrows its ranks from the data-parallel ones (dp x cp = {replicas}): it must "
                "divide them")
    if experts % ep:
        return f"parallel.ep={ep} must divide model.experts={experts}: each rank holds experts / ep of them"
    return None
