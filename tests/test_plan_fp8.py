"""FP8 memory (plan/fp8.py): FP8 weight copies and transposes plus scale tensors, worked by hand."""

from orangetron.plan.config import Degrees, Job
from orangetron.plan.fp8 import fp8_memory_bytes, with_fp8
from orangetron.plan.models import ModelSpec


def tiny():
    # 2 layers, hidden 64, 4 heads (MHA), SwiGLU ffn 128, vocab 100, untied, no biases.
    return ModelSpec(name="tiny", hidden_size=64, num_layers=2, num_heads=4, vocab_size=100, ffn_hidden_size=128)


def test_fp8_weight_copies_and_scales_by_hand():
    # Per layer: attention 4 * 64 * 64 = 16384, MLP 3 * 64 * 128 = 24576, two RMSNorm weights 128 -> 41088.
    # One GPU holds 2 layers (82176), the embedding 6400 (excluded: a lookup), final norm 64, head 6400; the
    # norm weights ride along with the linear ones (under 1% of a layer; FP8 copies are per parameter buffer).
    linear_like = 82176 + 64 + 6400
    scales = 2 * 4 * 3 * (2 + 1024) * 4  # layers x GEMMs x operands x (scale, scale_inv, amax history) x fp32
    assert fp8_memory_bytes(tiny(), Degrees(), Job(seq_len=64, fp8=True)) == 2 * linear_like + scales


def test_fp8_off_adds_nothing():
    memory = {"params": 10, "total": 10}
    assert fp8_memory_bytes(tiny(), Degrees(), Job(seq_len=64)) == 0
    assert with_fp8(memory, tiny(), Degrees(), Job(seq_len=64)) is memory
    out = with_fp8(memory, tiny(), Degrees(), Job(seq_len=64, fp8=True))
    assert out["total"] == 10 + out["fp8"]
