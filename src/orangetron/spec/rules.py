"""Every cross-field rule, once: the CLI, the planner and the runtime call these and raise what they raise.

A rule takes plain values, so each caller passes what it holds (the planner's `ModelSpec` and `Job`, the
runtime's `ModelConfig` and `ParallelConfig`, the trainer's flags), and every caller gives the user the same
one line: the field, its value and the rule. `RULES` names them all; tests/test_rules.py walks that list
through the three callers, and scans that no module outside this layer raises `RuleError` itself.
"""

from __future__ import annotations


class LayoutError(ValueError):
    """A layout that cannot run; the message names the field, the value and the rule."""


class RuleError(LayoutError):
    """A combination of options that cannot run (one of `RULES`); the message names the field, the value and
    the rule."""


def _fail(message: str) -> None:
    raise RuleError(message)


# ---- layout against the model -------------------------------------------------------------------------
def _head_splits(heads: int, kv_heads: int) -> str:
    """The degrees that split `heads` evenly, with `kv_heads` split too or replicated, as a refusal lists them."""
    return ", ".join(str(d) for d in range(1, heads + 1)
                     if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0))


def tp_splits_heads(tp: int, heads: int, kv_heads: int) -> None:
    """Attention heads split over tp; kv heads split too, or are replicated when fewer than tp."""
    if heads % tp:
        _fail(f"tp={tp}: n_heads={heads} is not divisible by tp; the heads allow tp {_head_splits(heads, kv_heads)}")
    if kv_heads % tp and tp % kv_heads:
        _fail(f"tp={tp}: n_kv_heads={kv_heads} must divide tp or be divisible by it (kv heads are split, or "
              "replicated across tp ranks)")


def ep_splits_experts(ep: int, experts: int, moe_layers: int = 1) -> None:
    """Routed experts sit in equal blocks per ep rank; ep > 1 needs experts, in some layer."""
    if ep > 1 and experts == 0:
        _fail(f"ep={ep}: the model has no experts (n_experts=0); use ep=1")
    if ep > 1 and moe_layers == 0:
        _fail(f"ep={ep}: no layer of the model has its n_experts={experts} experts (every layer is dense by "
              "first_dense_layers and moe_layer_freq); use ep=1")
    if experts and experts % ep:
        _fail(f"ep={ep}: n_experts={experts} is not divisible by ep")


def ep_divides_dp_cp(ep: int, dp: int, cp: int) -> None:
    """Unfolded experts shard over the dp x cp ranks of a (tp, pp) position."""
    if (dp * cp) % ep:
        _fail(f"ep={ep}: dp*cp={dp * cp} (dp={dp} x cp={cp}) is not divisible by ep; experts shard over the dp x cp "
              f"ranks (a folded expert mesh, planner only, lifts this): give dp x cp a multiple of {ep}")


# ---- layout against the sequence ----------------------------------------------------------------------
def cp_splits_sequence(cp: int, seq_len: int) -> None:
    """Head-tail context parallelism cuts a sequence into 2*cp equal chunks."""
    if cp > 1 and seq_len % (2 * cp):
        _fail(f"cp={cp}: seq_len {seq_len} is not divisible by 2*cp={2 * cp} (head-tail chunks, or slots of packed "
              f"documents)")


def sp_splits_shard(tp: int, cp: int, seq_len: int) -> None:
    """Sequence parallelism splits each cp rank's tokens over tp."""
    if tp > 1 and (seq_len // cp) % tp:
        _fail(f"tp={tp}: sequence_parallel needs seq_len/cp={seq_len // cp} divisible by tp")


# ---- context parallelism ------------------------------------------------------------------------------
def ulysses_degree_only_for_its_modes(ulysses_degree: int, cp_mode: str, takes_degree: bool) -> None:
    """Only a mode that splits cp into Ulysses x ring takes a Ulysses degree."""
    if ulysses_degree != 1 and not takes_degree:
        _fail(f"ulysses_degree={ulysses_degree}: only cp_mode usp takes it, not {cp_mode!r}")


def ulysses_degree_divides_cp(ulysses_degree: int, cp: int) -> None:
    if cp % ulysses_degree:
        _fail(f"ulysses_degree={ulysses_degree}: must divide cp={cp} (usp is Ulysses x ring)")


def heads_split_by_all_to_all(degree: int, heads: int, kv_heads: int, field: str = "cp") -> None:
    """An all-to-all to head shards over `degree` ranks needs this tp rank's heads divisible by it, and its kv
    heads divisible by it or dividing it (replicated up to one per rank). `field` names the option that set the
    degree: cp under cp_mode ulysses, ulysses_degree under usp."""
    if heads % degree or (kv_heads % degree and degree % kv_heads):
        _fail(f"{field}={degree}: the Ulysses all-to-all splits heads over {degree} ranks, and needs heads per tp "
              f"rank ({heads}) divisible by it and kv heads per tp rank ({kv_heads}) divisible by it or dividing "
              f"it; these heads allow {field} {_head_splits(heads, kv_heads)}")


# ---- expert parallelism -------------------------------------------------------------------------------
def overlap_chunks_need_chunked_dispatcher(chunks: int, dispatcher: str, chunked: bool) -> None:
    if chunks > 1 and not chunked:
        _fail(f"ep_overlap_chunks={chunks} with dispatcher={dispatcher!r}: chunked overlap is implemented for "
              "ragged only; use 1")


def node_dispatch_needs_whole_experts(etp: int, dispatcher: str, node_aware: bool) -> None:
    if node_aware and etp > 1:
        _fail(f"etp={etp} with dispatcher {dispatcher!r}: the planner prices DeepEP over the EP group with whole "
              "experts per rank (etp 1)")


def reserved_sms_need_node_dispatch(reserved: bool, dispatcher: str, node_aware: bool) -> None:
    if reserved and not node_aware:
        _fail(f"ep_comm_sms_reserved needs dispatcher='deepep' (the one priced with its SMs), not {dispatcher!r}")


# ---- pipeline -----------------------------------------------------------------------------------------
def virtual_stages_need_chunked_schedule(virtual_stages: int, schedule: str, chunks: bool) -> None:
    if virtual_stages > 1 and not chunks:
        _fail(f"virtual_stages={virtual_stages}: needs pp_schedule 'interleaved' (not {schedule!r})")
    if chunks and virtual_stages < 2:  # one chunk would run 1F1B's order with more micro-batches held in warmup
        _fail(f"pp_schedule={schedule!r} with virtual_stages={virtual_stages}: interleaving needs 2 or more model "
              "chunks per rank; give virtual_stages or choose '1f1b'")


def microbatches_multiple_of_pp(pp: int, microbatches: int) -> None:
    """The interleaved schedule visits micro-batches in groups of pp."""
    if pp > 1 and microbatches % pp:
        _fail(f"microbatches={microbatches}: the interleaved schedule needs a multiple of pp={pp}")


def microbatches_at_least_pp(pp: int, microbatches: int) -> None:
    """zb-h1 fills the drain with deferred weight gradients, pp of them."""
    if pp > 1 and microbatches < pp:
        _fail(f"microbatches={microbatches}: the zb-h1 schedule needs at least pp={pp}")


# ---- data parallelism and precision -------------------------------------------------------------------
def distributed_optimizer_zero_stage(distributed_optimizer: bool, zero_stage: int) -> None:
    if distributed_optimizer and zero_stage not in (0, 1):
        _fail(f"distributed_optimizer with zero_stage={zero_stage}: the distributed optimizer is ZeRO-1 sharding "
              "with an eager all-gather; use zero_stage 0 or 1 with it")


def zero3_reduce_every_microbatch_needs_zero3(every_microbatch: bool, zero_stage: int) -> None:
    if every_microbatch and zero_stage != 3:
        _fail(f"zero3_reduce_every_microbatch with zero_stage={zero_stage}: only ZeRO-3 reduces unit by unit "
              "during backward; use zero_stage 3")


def grad_buckets_not_with_zero3(bucket_numel: int, zero_stage: int) -> None:
    if bucket_numel and zero_stage == 3:
        _fail(f"grad_bucket_numel={bucket_numel} with zero_stage=3: ZeRO-3 reduce-scatters each unit (transformer "
              "block) during backward, its own buckets; use 0")


def recompute_layers_need_full(recompute_layers: int, recompute: str) -> None:
    if recompute_layers and recompute != "full":
        _fail(f"recompute_layers={recompute_layers} needs recompute='full', not {recompute!r}")


def fp8_recipe_needs_fp8(recipe: str, fp8: bool, asked: bool = False) -> None:
    """A recipe prices nothing without FP8: the default one too, when it was asked for (`asked`)."""
    if (recipe != "delayed" or asked) and not fp8:
        _fail(f"fp8_recipe={recipe!r} needs fp8=True")


RULES = (tp_splits_heads, ep_splits_experts, ep_divides_dp_cp, cp_splits_sequence, sp_splits_shard,
         ulysses_degree_only_for_its_modes, ulysses_degree_divides_cp, heads_split_by_all_to_all,
         overlap_chunks_need_chunked_dispatcher, node_dispatch_needs_whole_experts, reserved_sms_need_node_dispatch,
         virtual_stages_need_chunked_schedule, microbatches_multiple_of_pp, microbatches_at_least_pp,
         distributed_optimizer_zero_stage, zero3_reduce_every_microbatch_needs_zero3, grad_buckets_not_with_zero3,
         recompute_layers_need_full, fp8_recipe_needs_fp8)
