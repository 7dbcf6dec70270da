"""`parallelize`: the one entry that applies every dimension a layout asks for to a reference model.

One mechanism applies every dimension: `replace_module(model, "layers.3.attention", new)`
(`orangetron/parallel/replace.py`) puts a module at a named submodule of the model, and parameters are
sharded in place (their `.data` becomes this rank's slice). The root stays the reference `Transformer`, no
`__init__` is skipped and no method is overwritten on an instance; parameter names stay the reference's.
The model offers these named seams (`orangetron/parallel/contract.py` lists them; `parallelize` checks them
on entry):

- tensor (and sequence) parallelism: `tok_embeddings`, `io` (logits, cross entropy, sequence layout), each
  block's `attention` and dense `feed_forward`, each MoE's `shared_expert`;
- context parallelism: each block's `attention.core_attention`, the attention core seam (q, k, v) -> out;
- expert parallelism: each MoE's `dispatcher` and `router.aux_losses`, the routed experts' parameters sliced;
- the balancing loss without ep: each MoE's `router.aux_losses` (the losses over the global batch);
- activation recompute: each replayed block's `recompute` (keeps the block's inputs, replays it in backward);
- pipeline parallelism: `layers` (this rank's only, by global index), and `tok_embeddings`, `norm`, `output`
  emptied on the stages that do not run them;
- data parallelism: nothing; `DataParallel` wraps the model.
"""

from __future__ import annotations

import torch
from torch import nn

from orangetron.mesh import ParallelMesh
from orangetron.parallel import context, pipeline
from orangetron.parallel.config import ParallelConfig, ParallelConfigError, check_runnable
from orangetron.parallel.contract import check_model
from orangetron.parallel.expert import expert_parallel
from orangetron.parallel.expert.balance import balance_globally
from orangetron.parallel.parallel_model import ParallelModel
from orangetron.parallel.recompute import apply_recompute
from orangetron.parallel.replace import replace_module
from orangetron.parallel.tensor import tensor_parallel
from orangetron.spec import rules
from orangetron.spec.variants import CONTEXT_MODES


def parallelize(model: nn.Module, mesh: ParallelMesh, config: ParallelConfig | None = None) -> ParallelModel:
    """Apply `mesh.layout` to the reference `model` (an `orangetron.Transformer`, sharded in place).

    Tensor parallelism (with sequence parallelism when `config.sequence_parallel`) first, then context parallelism
    (every attention core attends across the cp ranks in `config.cp_mode`; the caller feeds each rank its shard of
    the tokens with their global positions, `context.shard` and `context.position_ids`: head-tail, or balanced
    within packed documents), then expert parallelism over ep (routed experts in blocks per ep rank,
    `config.dispatcher`), then activation recompute (`config.recompute`, `config.recompute_layers`: the blocks that
    replay their forward in backward), then pipeline parallelism over pp (this rank keeps its stage's chunks; run a
    step with `pipeline.run_pipeline`), then data parallelism over dp x cp (experts over edp) with the ZeRO stage of
    `config`. Returns the `ParallelModel`: call it like the model, and build the optimizer with
    `.optimizer(lr=...)`. Every rank must build `model` from the same seed, and a fresh one for each call (a model
    parallelized before, or a float64 one `config.param_dtype` would round down, raises ParallelConfigError;
    `_check_fresh`). Under tp a token id or label outside the vocabulary raises IndexError, as on one rank
    (`tensor.refuse_outside_vocab`). A model that lacks what the parallel
    code relies on raises `ModelContractError`; dimensions the runtime does not run yet raise `LayoutError`, and
    options it does not run (`parallel.config.check_runnable`) `ParallelConfigError` or `RuleError`.
    """
    check_model(model)
    config = config or ParallelConfig()
    check_runnable(config)
    _check_fresh(model, config)
    layout = mesh.layout
    layout.validate(model.cfg, sequence_parallel=config.sequence_parallel)
    pipeline.check_pipeline(model.cfg, layout.pp, config)
    model.orangetron_parallelized = True  # checked: from here on it is sharded (`_check_fresh`)
    if layout.tp > 1:
        model = tensor_parallel(model, mesh, config.sequence_parallel)
    if layout.cp > 1:
        context_parallel(model, mesh, config.cp_mode, config.ulysses_degree)
    if layout.ep > 1:
        model = expert_parallel(model, mesh, config)
    else:  # the balancing loss over every token of the batch, as one device computes it
        balance_globally(model, mesh, config.sequence_parallel)
    apply_recompute(model, layout.pp, config.virtual_stages, config.recompute, config.recompute_layers)
    chunks = None
    if layout.pp > 1:  # last: the other dimensions walk every layer of the whole model
        chunks = pipeline.split_stages(model, layout.pp, mesh["pp"].rank, config.virtual_stages)
    return ParallelModel(model, mesh, config, chunks)


def _check_fresh(model: nn.Module, config: ParallelConfig) -> None:
    """Refuse a model parallelized before (its layers are sharded in place: a second pass shards the shards and
    breaks the first `ParallelModel` too), and a float64 model that `config.param_dtype` would round down unsaid.
    A float32 model trained in bfloat16 is cast by the flat buffers, as the trainer asks."""
    if getattr(model, "orangetron_parallelized", False):
        raise ParallelConfigError("this model was parallelized already (its layers are sharded in place): build "
                                  "a new one from the same seed for another layout")
    dtype = next(model.parameters()).dtype
    if dtype == torch.float64 and config.param_dtype != "float64":
        raise ParallelConfigError(f"param_dtype={config.param_dtype!r}: the model's parameters are float64 and would "
                                  "be rounded to it; pass ParallelConfig(param_dtype='float64'), or build the model "
                                  "in float32")


def context_parallel(model: nn.Module, mesh: ParallelMesh, mode: str, ulysses_degree: int = 1) -> None:
    """Make every attention block of `model` attend across the cp ranks in `mode`, in place.

    `ulysses_degree` (mode "usp") must divide cp; its process groups are built here, on every rank.
    """
    cp = mesh["cp"].size
    record = CONTEXT_MODES.runtime_record(mode)
    rules.ulysses_degree_only_for_its_modes(ulysses_degree, mode, record.takes_ulysses_degree)
    rules.ulysses_degree_divides_cp(ulysses_degree, cp)
    degree = record.head_split(cp, ulysses_degree)
    runtime = record.load()
    if hasattr(runtime, "cp_group"):
        runtime.cp_group(mesh, ulysses_degree)  # its process groups, built on every rank now
    for i, block in enumerate(model.layers):
        attention = block.attention
        if degree > 1:
            heads = attention.wq.weight.shape[0] // attention.head_dim
            kv_heads = attention.wk.weight.shape[0] // attention.head_dim
            rules.heads_split_by_all_to_all(degree, heads, kv_heads, record.head_split_field)
        core = context.ContextParallelAttention(mesh, mode, ulysses_degree if record.takes_ulysses_degree else None,
                                                impl=attention.core_attention.impl)
        replace_module(model, f"layers.{i}.attention.core_attention", core)
