"""Parameters one GPU holds: per stage, per layer, per flat data-parallel buffer and per ZeRO-3 unit (shared by
the memory model and the per-parameter gradient model)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job
from orangetron.spec.stages import stage_layers


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---- model states ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageParams:
    """Parameters one GPU of a stage holds: `dense` replicated over dp x cp, `expert` over edp."""

    dense: int
    expert: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


def stage_params(model: ModelSpec, deg: Degrees, stage: int, virtual_stages: int = 1,
                 layout: tuple[int, ...] = ()) -> StageParams:
    """Parameter counts on one GPU of pipeline `stage` (TP shards projections, MLPs and the vocabulary)."""
    return _stage_params(model, deg.tp, deg.pp, deg.ep, deg.etp, stage, virtual_stages, layout)


@lru_cache(maxsize=8192)
def _stage_params(model: ModelSpec, t: int, pp: int, ep: int, etp: int, stage: int,
                  virtual_stages: int, layout: tuple[int, ...]) -> StageParams:
    dense = expert = 0
    for i in stage_layers(model.num_layers, pp, virtual_stages, stage, layout):
        layer = _layer_params(model, t, ep, etp, i)
        dense, expert = dense + layer.dense, expert + layer.expert
    if stage == 0:
        dense += _ceil_div(model.vocab_size * model.hidden_size, t) if not model.patch_size else 0
        dense += model.embedding_params() - (0 if model.patch_size else model.vocab_size * model.hidden_size)
    if stage == pp - 1:
        dense += model.hidden_size * (2 if model.bias else 1) + head_weights(model, t, pp)
        mtp = mtp_module_params(model, t, ep, etp)
        dense, expert = dense + model.mtp_layers * mtp.dense, expert + model.mtp_layers * mtp.expert
        if model.mtp_layers and pp > 1 and not model.tied_embeddings:
            # MTP embeds the next tokens on the last stage: Megatron-Core keeps a copy of the embedding there (a
            # tied head already is one) and sums its gradient with the first stage's
            dense += _ceil_div(model.vocab_size * model.hidden_size, t)
    return StageParams(dense, expert)


def mtp_module_params(model: ModelSpec, t: int, ep: int, etp: int) -> StageParams:
    """One multi-token-prediction module on one GPU of the last stage: its layer as a decoder layer of its kind,
    the 2h -> h projection split over tp, its three norms whole."""
    layer = _layer_params(model, t, ep, etp, model.mtp_layer_index)
    return StageParams(layer.dense + model.mtp_norm_params() + _ceil_div(2 * model.hidden_size**2, t), layer.expert)


def head_weights(model: ModelSpec, t: int, pp: int) -> int:
    """Output-projection elements on one GPU of the last stage: none when tied to the embedding on the same
    stage; a tied head on a separate last stage keeps its own copy of the embedding (as Megatron does)."""
    head = model.output_params() - model.hidden_size * (2 if model.bias else 1)
    if model.tied_embeddings and pp > 1 and not model.patch_size:
        head = model.vocab_size * model.hidden_size
    return _ceil_div(head, t)


@lru_cache(maxsize=65536)
def _layer_params(model: ModelSpec, t: int, ep: int, etp: int, i: int) -> StageParams:
    # Norm weights, the router and the shared-expert gate are replicated across tp; everything else is split,
    # except kv heads fewer than tp, of which each rank keeps one.
    kv_whole, kv_local = _kv_weights(model, t)
    replicated = model.norm_params() + routing_params(model, i)
    split = model.dense_params_of_layer(i) - replicated - kv_whole
    expert = _ceil_div(model.expert_params_per_layer(), ep * etp) if model.is_moe_layer(i) else 0
    return StageParams(replicated + _ceil_div(split, t) + kv_local, expert)


def routing_params(model: ModelSpec, i: int) -> int:
    """Layer `i`'s router and shared-expert gate weights, which every tp rank holds whole (0 when dense)."""
    return model.num_experts * model.hidden_size + model.shared_gate_params if model.is_moe_layer(i) else 0


def _kv_weights(model: ModelSpec, t: int) -> tuple[int, int]:
    """(whole, per-rank) K and V projection elements of a layer when its kv heads are fewer than tp and so
    replicated, one per rank; (0, 0) when they split evenly like the other heads."""
    if model.kv_lora_rank or model.kv_heads >= t:
        return 0, 0
    per_head = 2 * model.qk_head_dim * (model.hidden_size + (1 if model.has_qkv_bias else 0))
    return model.kv_heads * per_head, per_head


def shard_groups(params: StageParams, deg: Degrees) -> list[tuple[str, int, int]]:
    """(mesh dim, ranks, elements) of each flat data-parallel buffer. With ep = 1 the experts are ordinary
    replicated parameters and share the dense buffer over dp x cp, as in the runtime."""
    if deg.ep == 1:
        return [("dp_cp", deg.dp_cp, params.total)]
    return [("dp_cp", deg.dp_cp, params.dense), ("edp", deg.edp, params.expert)]


def zero3_units(model: ModelSpec, deg: Degrees, stage: int = 0, virtual_stages: int = 1,
                layout: tuple[int, ...] = ()) -> list[StageParams]:
    """Parameters of each ZeRO-3 unit on one GPU, in forward order, as `parallel.data.units` cuts the model: the
    embedding, every layer, the head (final norm and output layer). With tied embeddings (or on a pipeline
    stage that lacks the embedding or the head) the embedding and head form one unit gathered for the whole
    forward, listed first."""
    return [params for params, _ in zero3_unit_contents(model, deg, stage, virtual_stages, layout)]


def zero3_unit_contents(model: ModelSpec, deg: Degrees, stage: int = 0, virtual_stages: int = 1,
                        layout: tuple[int, ...] = ()) -> list[tuple[StageParams, str | int]]:
    """`zero3_units` with what each unit runs: a decoder layer's index, "mtp" (a multi-token-prediction
    module), "embedding", "head", or "rest" (whatever else the stage holds, gathered for its whole forward:
    the embedding and the head where they share a unit)."""
    indices = stage_layers(model.num_layers, deg.pp, virtual_stages, stage, layout)
    layers: list[tuple[StageParams, str | int]] = [(_layer_params(model, deg.tp, deg.ep, deg.etp, i), i)
                                                   for i in indices]
    if stage == deg.pp - 1:  # each MTP module is a unit of its own, after the decoder's
        layers += [(mtp_module_params(model, deg.tp, deg.ep, deg.etp), "mtp")] * model.mtp_layers
    whole = stage_params(model, deg, stage, virtual_stages, layout)
    rest = StageParams(whole.dense - sum(u.dense for u, _ in layers), whole.expert - sum(u.expert for u, _ in layers))
    if deg.pp == 1 and not model.tied_embeddings and not model.patch_size:
        embedding = _ceil_div(model.vocab_size * model.hidden_size, deg.tp) + model.embedding_params() \
            - model.vocab_size * model.hidden_size
        return [(StageParams(embedding, 0), "embedding"), *layers,
                (StageParams(rest.dense - embedding, rest.expert), "head")]
    return [(u, what) for u, what in [(rest, "rest"), *layers] if u.total]


def tp_grad_sum_numel(model: ModelSpec, deg: Degrees, job: Job, stage: int) -> int:
    """Elements of the one all-reduce that sums a stage's partial gradients over tp at the step: with SP every
    parameter replicated over tp (it saw this rank's tokens only), and kv heads replicated over tp ranks, each
    in its slot of all the slices (it saw those ranks' query heads only); with or without SP the QK-norm weights
    (they saw this rank's heads only; with SP they are among the replicated parameters)."""
    if deg.tp == 1:
        return 0
    layers = _layers_with_mtp(model, deg.pp, job.virtual_stages, stage, job.pipeline_layout)
    numel = _kv_slot_params(model, deg.tp) * len(layers)
    if job.sequence_parallel:
        numel += _replicated_params(model, deg, job.virtual_stages, stage, job.pipeline_layout)
    else:
        numel += model.qk_norm_params() * len(layers)
    return numel


def _kv_slot_params(model: ModelSpec, t: int) -> int:
    """Elements of one layer's K and V weights when kv heads are fewer than tp (else 0)."""
    if model.kv_lora_rank or model.kv_heads >= t:
        return 0
    return 2 * model.kv_heads * model.qk_head_dim * (model.hidden_size + (1 if model.has_qkv_bias else 0))


@lru_cache(maxsize=16384)
def _replicated_params(model: ModelSpec, deg: Degrees, virtual_stages: int, stage: int,
                       layout: tuple[int, ...] = ()) -> int:
    """Parameters of a stage that every tp rank holds whole: norms, routers, shared-expert gates, and the routed
    experts on this
    rank when they are neither split over tp (etp = tp) nor folded over their own mesh (replicated over edp)."""
    experts_whole_on_tp = deg.etp == 1 and not deg.expert_fold
    total = 0
    for i in _layers_with_mtp(model, deg.pp, virtual_stages, stage, layout):
        total += model.norm_params()
        if model.is_moe_layer(i):
            total += routing_params(model, i)
            total += model.expert_params_per_layer() // deg.ep if experts_whole_on_tp else 0
    if stage == deg.pp - 1:
        total += model.hidden_size * (2 if model.bias else 1) + model.mtp_norm_params() * model.mtp_layers
    return total


def _layers_with_mtp(model: ModelSpec, pp: int, virtual_stages: int, stage: int,
                     layout: tuple[int, ...]) -> tuple[int, ...]:
    """The decoder layers of `stage`, and on the last stage an index of the MTP layers' kind for each module."""
    layers = stage_layers(model.num_layers, pp, virtual_stages, stage, layout)
    return layers + ((model.mtp_layer_index,) * model.mtp_layers if stage == pp - 1 else ())


def embedding_at_both_ends(model: ModelSpec, pp: int) -> bool:
    """The last pipeline stage holds a copy of the embedding, whose gradient is summed with the first stage's
    once a step: a tied head reads it (`head_weights`), or multi-token-prediction modules embed with it
    (Megatron-Core's embedding group holds both ends in either case)."""
    return pp > 1 and not model.patch_size and (model.tied_embeddings or model.mtp_layers > 0)


def sums_first(model: ModelSpec, deg: Degrees, job: Job) -> bool:
    """Gradients summed before the data-parallel reduction: partial ones over tp (`tp_sums_first`), and a tied
    embedding's two pipeline copies (`embedding_at_both_ends`). The runtime then holds every reduction, and each
    `.grad`, to the step, on every stage. Not where the framework sums them in or after the reduction's own pass
    (`Job.tp_sum_with_reduction`; Megatron-Core sums the embedding's copies after it, in `finalize_model_grads`)."""
    tied = embedding_at_both_ends(model, deg.pp) and not job.tp_sum_with_reduction
    return tp_sums_first(model, deg, job) or tied


def tp_sums_first(model: ModelSpec, deg: Degrees, job: Job) -> bool:
    """Partial gradients must be summed over tp before the data-parallel reduction (SP, kv heads fewer than tp,
    QK-norm): the runtime then reduces everything at the step, after that sum. Not where the framework sums them
    in the reduction's own pass (`Job.tp_sum_with_reduction`)."""
    if job.tp_sum_with_reduction:
        return False
    kv_replicated = not model.kv_lora_rank and model.kv_heads < deg.tp
    return deg.tp > 1 and (job.sequence_parallel or kv_replicated or model.qk_norm)
