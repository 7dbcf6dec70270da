"""`parallelize`: the one entry that applies every dimension a layout asks for to a reference model."""

from __future__ import annotations

from functools import partial

from torch import nn

from orangetron.mesh import ParallelMesh
from orangetron.parallel import context, pipeline
from orangetron.parallel.config import ParallelConfig
from orangetron.parallel.expert import expert_parallel
from orangetron.parallel.expert.balance import balance_globally
from orangetron.parallel.parallel_model import ParallelModel
from orangetron.parallel.tensor import tensor_parallel
from orangetron.spec.layout import LayoutError


def parallelize(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig | None = None) -> ParallelModel:
    """Apply `mesh.layout` to the reference `model` (an `orangetron.Transformer`, sharded in place).

    Tensor parallelism (with sequence parallelism when `config.sequence_parallel`) first, then context
    parallelism (every attention core attends across the cp ranks in `config.cp_mode`; the caller feeds
    each rank its head-tail shard of the tokens with their global positions, `context.shard` and
    `context.position_ids`), then expert parallelism over ep (routed experts in blocks per ep rank,
    `config.dispatcher`), then pipeline parallelism over pp (this rank keeps its stage's chunks; run a
    step with `pipeline.run_pipeline`), then data parallelism over dp x cp (experts over edp) with the
    ZeRO stage of `config`. Returns the `ParallelModel`: call it like the model, and build the optimizer with
    `.optimizer(lr=...)`. Every rank must build `model` from the same seed. Dimensions the runtime does not
    run yet raise `LayoutError`.
    """
    config = config or ParallelConfig()
    layout = mesh.layout
    layout.validate(getattr(model, "cfg", None), sequence_parallel=config.sequence_parallel)
    pipeline.check_pipeline(model.cfg, layout.pp, config)
    if layout.tp > 1:
        model = tensor_parallel(model, mesh, config.sequence_parallel)
    if layout.cp > 1:
        context_parallel(model, mesh, config.cp_mode, config.ulysses_degree)
    if layout.ep > 1:
        model = expert_parallel(model, mesh, config)
    else:  # the balancing loss over every token of the batch, as one device computes it
        balance_globally(model, mesh, config.sequence_parallel)
    chunks = None
    if layout.pp > 1:  # last: the other dimensions walk every layer of the whole model
        chunks = pipeline.split_stages(model, layout.pp, mesh["pp"].rank, config.virtual_stages)
    return ParallelModel(model, mesh, config, chunks)


def context_parallel(model: nn.Module, mesh: ParallelMesh, mode: str, ulysses_degree: int = 1) -> None:
    """Make every attention block of `model` attend across the cp ranks in `mode`, in place.

    `ulysses_degree` (mode "usp") must divide cp; its process groups are built here, on every rank.
    """
    cp = mesh["cp"].size
    if mode not in context.MODES:
        raise LayoutError(f"cp_mode={mode!r}: must be one of {', '.join(context.MODES)}")
    if mode == "usp" and cp % ulysses_degree:
        raise LayoutError(f"ulysses_degree={ulysses_degree}: must divide cp={cp} (usp is Ulysses x ring)")
    degree = {"ulysses": cp, "usp": ulysses_degree}.get(mode)
    if mode == "usp":
        mesh.split_cp(ulysses_degree)
    for block in model.layers:
        attention = block.attention
        if degree is not None:
            heads = attention.wq.weight.shape[0] // attention.head_dim
            kv_heads = attention.wk.weight.shape[0] // attention.head_dim
            context.ulysses.check_heads(heads, kv_heads, degree)
        attention.core_attention = partial(context.attention, mesh=mesh, mode=mode, causal=True,
                                           ulysses_degree=ulysses_degree if mode == "usp" else None)
