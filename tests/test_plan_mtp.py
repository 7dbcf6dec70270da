"""Multi-token prediction (DeepSeek-V3's MTP modules) on the last pipeline stage: parameters, time, activations,
FLOPs and traffic, each against what one more decoder layer costs on another stage plus the module's own pieces
(a 2h -> h projection, three norms, a second pass through the head and the loss), worked by hand."""

from dataclasses import replace

import pytest

from orangetron.plan.activations import stage_activation_bytes
from orangetron.plan.compute import linear_time
from orangetron.plan.network import NetworkParams
from orangetron.plan.param_grads import stage_tensors
from orangetron.plan.params import stage_params
from orangetron.plan.timing import DEFAULT_EFFICIENCY, _loss_time, _stage_time, model_flops_per_step
from orangetron.plan.traffic import step_records, summarize
from orangetron.spec.hardware import make_cluster
from orangetron.spec.model import ModelSpec, load_model
from orangetron.spec.options import Degrees, Job

H, VOCAB, SEQ = 512, 4096, 1024
PLAIN = ModelSpec(name="gpt", hidden_size=H, num_layers=4, num_heads=8, vocab_size=VOCAB, ffn_hidden_size=4 * H,
                  mlp="gelu")
MTP = replace(PLAIN, mtp_layers=1)
PP2 = Degrees(pp=2)


def _one_more_layer(measure) -> float:
    """What one more decoder layer adds to stage 0 (layouts 3 + 1 against 2 + 2)."""
    return measure(Job(seq_len=SEQ, global_batch=4, pipeline_layout=(3, 1)), 0) - \
        measure(Job(seq_len=SEQ, global_batch=4, pipeline_layout=(2, 2)), 0)


def test_parameters_of_a_module():
    """Its layer, the projection (2h x h) and three norms (h each), on the last stage only, not in the total;
    and, as Megatron-Core keeps, a copy of the embedding (vocab x h) where it is not the first stage."""
    layer = _one_more_layer(lambda job, s: stage_params(PLAIN, PP2, s, 1, job.pipeline_layout).total)
    extra = stage_params(MTP, PP2, 1).total - stage_params(PLAIN, PP2, 1).total
    assert extra == layer + 2 * H * H + 3 * H + VOCAB * H
    one = Degrees()
    assert stage_params(MTP, one, 0).total - stage_params(PLAIN, one, 0).total == layer + 2 * H * H + 3 * H
    assert stage_params(MTP, PP2, 0) == stage_params(PLAIN, PP2, 0) and MTP.total_params() == PLAIN.total_params()
    assert sum(t.numel for t in stage_tensors(MTP, PP2, 1)) == stage_params(MTP, PP2, 1).total
    moe = replace(PLAIN, mlp="swiglu", num_experts=4, top_k=2, moe_ffn_hidden_size=256)
    deg = Degrees(pp=2, dp=2, ep=2)
    extra = stage_params(replace(moe, mtp_layers=1), deg, 1).expert - stage_params(moe, deg, 1).expert
    assert extra == 4 * 3 * H * 256 // 2  # the module's MoE layer: 4 SwiGLU experts over ep 2
    v3 = load_model("deepseek-v3")
    assert v3.mtp_layers == 1 and v3.mtp_module_params() == pytest.approx(11.6e9, rel=0.01)  # 14B less the shared
    # embedding and head (DeepSeek-V3's model card: 671B main model, 14B MTP module)


def test_time_of_a_module():
    """Its layer, the projection's and the head's forward and backward (16-bit), and the loss again."""
    cluster, net = make_cluster("h100", 2), NetworkParams()

    def compute(model: ModelSpec, job: Job, stage: int) -> float:
        return _stage_time(model, PP2, job, cluster, stage, net, DEFAULT_EFFICIENCY).compute

    job = Job(seq_len=SEQ, global_batch=4)
    layer = _one_more_layer(lambda j, s: compute(PLAIN, j, s))
    proj = sum(linear_time(SEQ, 2 * H, H, cluster.gpu, "bfloat16", 2.0))
    head = sum(linear_time(SEQ, H, VOCAB, cluster.gpu, "bfloat16", 2.0))
    loss = _loss_time(PLAIN, PP2, job, cluster, DEFAULT_EFFICIENCY)
    assert compute(MTP, job, 1) - compute(PLAIN, job, 1) == pytest.approx(layer + proj + head + loss, rel=1e-12)
    assert compute(MTP, job, 0) == compute(PLAIN, job, 0)


def test_activations_of_a_module():
    """1F1B's last stage holds one micro-batch: the module's layer, its 2h projection input and two norm
    inputs, and its head's buffers (the head input twice and the fp32 logits' gradient), 2 bytes else."""
    job = Job(seq_len=SEQ, global_batch=4)
    layer = _one_more_layer(lambda j, s: stage_activation_bytes(PLAIN, PP2, j, s)) / 2  # stage 0 holds two
    inputs = 2 * SEQ * 2 * H + 2 * 2 * SEQ * H
    head = 2 * 2 * SEQ * H + 4 * SEQ * VOCAB
    extra = stage_activation_bytes(MTP, PP2, job, 1) - stage_activation_bytes(PLAIN, PP2, job, 1)
    assert extra == layer + inputs + head


def test_flops_of_a_module():
    """Forward and backward (3x) of the layer's weights, the projection, the attention and the head per token."""
    tokens = 4 * SEQ
    attention = 2 * tokens * SEQ * 8 * (64 + 64)  # QK^T and AV, full s x s
    forward = 2 * tokens * (PLAIN.layer_params(3) + 2 * H * H) + attention + 2 * tokens * H * VOCAB
    job = Job(seq_len=SEQ)
    assert model_flops_per_step(MTP, job, 4) - model_flops_per_step(PLAIN, job, 4) == pytest.approx(3 * forward)


def test_traffic_of_a_module():
    """Under tp 2 without SP the module's layer adds a decoder layer's all-reduces (attention and MLP, forward and
    backward) and its head the head's: one all-reduce of its input's gradient and the loss's two; both ends of the
    pipeline sum the embedding's gradient with the modules' copy."""
    deg, job = Degrees(tp=2, pp=2), Job(seq_len=SEQ, global_batch=4)
    plain, mtp = (summarize(step_records(model, deg, job, 1))["all_reduce/tp"] for model in (PLAIN, MTP))
    m = job.replica_microbatches(deg)
    assert mtp["calls"] - plain["calls"] == m * (4 + 3)
    # the first stage's embedding gradient is summed with the modules' copy on the last stage, once a step
    # (Megatron-Core's embedding group): this rank's vocabulary half, in bfloat16, between the two stages
    copy = VOCAB * H // 2 * 2
    for stage in (0, 1):
        assert summarize(step_records(MTP, deg, job, stage))["all_reduce/pp"] == \
            {"calls": 1, "payload": copy, "sent": copy, "received": copy}
    first = summarize(step_records(MTP, deg, job, 0))
    del first["all_reduce/pp"]
    assert first == summarize(step_records(PLAIN, deg, job, 0))


def test_module_under_interleaving_zero_bubble_and_zero3():
    """The module sits in the last chunk of an interleaved last stage (held as often as that chunk's
    micro-batches); under zb-h1 the last stage holds it for one micro-batch waiting for its B and pp - 1 whose W
    waits (its GEMMs' inputs and output gradients: QKV h + 3h, output h + h, fc1 h + 4h, fc2 4h + h per token),
    its inputs and head for pp; under ZeRO-3 it is a unit of its own."""
    from orangetron.plan.activations import weight_grad_state_bytes
    from orangetron.plan.params import mtp_module_params, zero3_units

    layer = _one_more_layer(lambda j, s: stage_activation_bytes(PLAIN, PP2, j, s)) / 2
    inputs, head = 2 * SEQ * 2 * H + 2 * 2 * SEQ * H, 2 * 2 * SEQ * H + 4 * SEQ * VOCAB
    zb = Job(seq_len=SEQ, global_batch=4, pp_schedule="zb-h1")
    w_state = weight_grad_state_bytes(PLAIN, PP2, zb, False)
    assert w_state == 2 * SEQ * 16 * H
    extra = stage_activation_bytes(MTP, PP2, zb, 1) - stage_activation_bytes(PLAIN, PP2, zb, 1)
    assert extra == layer + w_state + 2 * (inputs + head)
    deep = replace(PLAIN, num_layers=8)
    interleaved = Job(seq_len=SEQ, global_batch=4, virtual_stages=2, pp_schedule="interleaved")
    extra = stage_activation_bytes(replace(deep, mtp_layers=1), PP2, interleaved, 1) - \
        stage_activation_bytes(deep, PP2, interleaved, 1)
    assert extra > 0 and extra % (layer + inputs + head) == 0
    units = zero3_units(MTP, PP2, 1)
    assert mtp_module_params(MTP, 1, 1, 1) in units and len(units) == len(zero3_units(PLAIN, PP2, 1)) + 1


def test_traffic_of_a_moe_module():
    """A MoE module's layer adds a MoE layer's expert all-to-alls (as one more MoE layer on stage 0 does)."""
    moe = replace(PLAIN, mlp="swiglu", num_experts=4, top_k=2, moe_ffn_hidden_size=256)
    deg = Degrees(pp=2, dp=2, ep=2)

    def calls(model: ModelSpec, job: Job, stage: int) -> int:
        return summarize(step_records(model, deg, job, stage))["all_to_all/ep"]["calls"]

    one_layer = _one_more_layer(lambda j, s: calls(moe, j, s))
    job = Job(seq_len=SEQ, global_batch=4)
    assert one_layer > 0 and calls(replace(moe, mtp_layers=1), job, 1) - calls(moe, job, 1) == one_layer


def test_replay_of_a_module_whose_chunk_has_no_decoder_layer():
    """Megatron's layouts give the MTP module and the loss a last chunk of their own: under full recompute its
    layer's replay still needs that layer's whole activations for a moment."""
    from orangetron.plan.activations import layer_activation_bytes

    job = Job(seq_len=SEQ, global_batch=4, recompute="full", pipeline_layout=(4, 0))
    without = stage_activation_bytes(PLAIN, PP2, job, 1)
    with_mtp = stage_activation_bytes(MTP, PP2, job, 1)
    inputs, head = 2 * SEQ * 2 * H + 2 * 2 * SEQ * H, 2 * 2 * SEQ * H + 4 * SEQ * VOCAB
    checkpoint = 2 * SEQ * H
    assert with_mtp - without == checkpoint + inputs + head + layer_activation_bytes(PLAIN, PP2, Job(seq_len=SEQ),
                                                                                     False)
