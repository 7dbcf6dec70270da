"""The planner-only options that price how published frameworks hold gradients and the loss where the runtime
differs (docs/planner.md, 'Framework paths'): each worked by hand against the runtime's default."""

from __future__ import annotations

from dataclasses import replace

from orangetron.plan.activations import stage_activation_bytes
from orangetron.plan.param_grads import _totals, param_grad_bytes
from orangetron.plan.timing import step_time
from orangetron.plan.traffic import reduce_rounds
from orangetron.spec.hardware import make_cluster
from orangetron.spec.model import ModelSpec
from orangetron.spec.options import Degrees, Job

MODEL = ModelSpec(name="t", hidden_size=256, num_layers=4, num_heads=8, vocab_size=1024, ffn_hidden_size=768)
TP2 = Degrees(tp=2, dp=4)


def test_tp_sums_in_the_reduction_free_each_grad_as_it_arrives():
    """Under SP the runtime sums partial gradients over tp first and keeps every `.grad` to the step; a framework
    that sums them in the reduction's own pass frees each into the main buffer at once (ZeRO-1: the largest)."""
    job = Job(seq_len=64, sequence_parallel=True, zero_stage=1, grad_bucket_numel=4096, param_dtype="bfloat16")
    total, largest = _totals(MODEL, TP2, 0, 1)
    assert param_grad_bytes(MODEL, TP2, job) == 2 * total
    assert param_grad_bytes(MODEL, TP2, replace(job, tp_sum_with_reduction=True)) == 2 * largest < 2 * total


def test_tp_sums_in_the_reduction_let_zero3_reduce_every_microbatch():
    job = Job(seq_len=64, sequence_parallel=True, zero_stage=3, zero3_reduce_every_microbatch=True,
              micro_batch=1, global_batch=16)
    assert reduce_rounds(MODEL, TP2, job) == 1  # held to the step, after the tp sum
    assert reduce_rounds(MODEL, TP2, replace(job, tp_sum_with_reduction=True)) == 4  # 16 / (1 x dp 4)


def test_reductions_held_for_the_tp_sum_do_not_overlap_backward():
    """The runtime's held reductions run after the last backward, as with overlap off; summed in the reduction's
    pass they hide behind backward again."""
    cluster = make_cluster("h100", 8)
    job = Job(seq_len=2048, sequence_parallel=True, zero_stage=1, grad_bucket_numel=1 << 20, global_batch=32)
    held = step_time(MODEL, TP2, job, cluster).dp_s
    assert held == step_time(MODEL, TP2, replace(job, overlap_grad_reduce=False), cluster).dp_s
    assert step_time(MODEL, TP2, replace(job, tp_sum_with_reduction=True), cluster).dp_s < held


def test_fsdp2_accumulates_waiting_grads_in_the_reduce_dtype():
    """ZeRO-3 without a reduction per micro-batch: bf16 `.grad`s wait whole (2 bytes each); FSDP2 upcasts them
    to the fp32 reduce dtype (4 bytes). Reduced every micro-batch nothing waits, so nothing changes."""
    deg = Degrees(dp=4)
    job = Job(seq_len=64, zero_stage=3, reduce_dtype="float32", micro_batch=1, global_batch=16)
    total, _ = _totals(MODEL, deg, 0, 1)
    assert param_grad_bytes(MODEL, deg, job) == 2 * total
    assert param_grad_bytes(MODEL, deg, replace(job, accumulate_in_reduce_dtype=True)) == 4 * total
    every = replace(job, zero3_reduce_every_microbatch=True)
    assert param_grad_bytes(MODEL, deg, replace(every, accumulate_in_reduce_dtype=True)) == \
        param_grad_bytes(MODEL, deg, every)


def test_grads_held_to_the_step_also_accumulate_in_the_reduce_dtype():
    """Held to the step for the tp sums, every `.grad` waits across the step's micro-batches too: 4 bytes each
    under the option, 2 without; with one micro-batch nothing accumulates."""
    job = Job(seq_len=64, sequence_parallel=True, zero_stage=1, reduce_dtype="float32", micro_batch=1,
              global_batch=8)
    total, _ = _totals(MODEL, TP2, 0, 1)
    assert param_grad_bytes(MODEL, TP2, job) == 2 * total
    assert param_grad_bytes(MODEL, TP2, replace(job, accumulate_in_reduce_dtype=True)) == 4 * total
    single = replace(job, global_batch=4, accumulate_in_reduce_dtype=True)  # one micro-batch a replica
    assert param_grad_bytes(MODEL, TP2, single) == 2 * total


def test_eager_fp32_loss_holds_two_more_fp32_logit_copies_on_the_last_stage():
    """An upcast, unfused cross-entropy's backward holds the saved log-softmax, nll_loss's gradient and the input
    gradient: 3 float32 [tokens, vocab / tp] tensors where the fused loss holds 1. Only the last stage has it."""
    deg = Degrees(tp=2, pp=2)
    extra = 2 * 4 * 64 * 2 * MODEL.vocab_size // 2  # two fp32 [64 x 2 tokens, vocab / 2] tensors
    for schedule, m, v in (("gpipe", 1, 1), ("gpipe", 8, 1), ("1f1b", 8, 1), ("interleaved", 8, 2)):
        job = Job(seq_len=64, micro_batch=2, sequence_parallel=True, pp_schedule=schedule, microbatches=m,
                  virtual_stages=v)
        eager = replace(job, eager_fp32_loss=True)
        # once, whatever the micro-batches in flight: only the running loss backward holds the two extra copies
        assert stage_activation_bytes(MODEL, deg, eager, 1) - stage_activation_bytes(MODEL, deg, job, 1) == extra
        assert stage_activation_bytes(MODEL, deg, eager, 0) == stage_activation_bytes(MODEL, deg, job, 0)
