"""Multi-token prediction (DeepSeek-V3's MTP modules) on the last pipeline stage: parameters, time, activations,
FLOPs and traffic, each against what one more decoder layer costs on another stage plus the module's own pieces
(a 2h -> h projection, three norms, a second pass through the head and the loss), worked by hand."""

from dataclasses import replace

import pytest

from orangetron.plan.activations import stage_activation_bytes
from orangetron.plan.compute import linear_time
from orangetron.plan.config import Degrees, Job
from orangetron.plan.hardware import make_cluster
from orangetron.plan.models import ModelSpec, load_model
from orangetron.plan.network import NetworkParams
from orangetron.plan.param_grads import stage_tensors
from orangetron.plan.params import stage_params
from orangetron.plan.timing import DEFAULT_EFFICIENCY, _loss_time, _stage_time, model_flops_per_step
from orangetron.plan.traffic import step_records, summarize

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
    """Its layer, the projection (2h x h) and three norms (h each), on the last stage only, not in the total."""
    layer = _one_more_layer(lambda job, s: stage_params(PLAIN, PP2, s, 1, job.pipeline_layout).total)
    extra = stage_params(MTP, PP2, 1).total - stage_params(PLAIN, PP2, 1).total
    assert extra == layer + 2 * H * H + 3 * H
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
    backward) and its head the head's: one all-reduce of its input's gradient and the loss's two."""
    deg, job = Degrees(tp=2, pp=2), Job(seq_len=SEQ, global_batch=4)
    plain, mtp = (summarize(step_records(model, deg, job, 1))["all_reduce/tp"] for model in (PLAIN, MTP))
    m = job.microbatches(deg)
    assert mtp["calls"] - plain["calls"] == m * (4 + 3)
    assert summarize(step_records(MTP, deg, job, 0)) == summarize(step_records(PLAIN, deg, job, 0))
