"""A torch.compile backend that counts: aot_eager (Dynamo traces the forward, AOTAutograd the backward, eager kernels
run them), each run of a graph it compiled counted in `CALLS`, so a test can tell a compiled run from one that ran
eager and said nothing."""

from torch._dynamo.backends.registry import lookup_backend

BACKEND = "aot_eager"
CALLS = [0]  # compiled graphs run in this rank process (graphs are cached across runs: count runs, not compiles)


def counted(gm, example_inputs):
    """aot_eager, counting each run of the graph it compiled: a run whose count does not move ran eager."""
    run = lookup_backend(BACKEND)(gm, example_inputs)

    def call(*args):
        CALLS[0] += 1
        return run(*args)
    call._boxed_call = getattr(run, "_boxed_call", False)
    return call
