"""Plant plausible bugs one at a time and check that the tests catch each (a small mutation-testing run).

Each mutant is a list of exact (original, replacement) edits to one file and the pytest selection meant to
catch it. For every mutant the repository is copied to a temporary folder, the edits are applied there
(never to the working tree), and `python -m pytest -q -x <selection>` runs with PYTHONPATH pointing at the
copy's src. A failing selection kills the mutant; a passing one lets it survive. An original snippet that
does not occur exactly once in its file is an error of the list, reported before anything runs.

    python scripts/mutate.py                 # every mutant
    python scripts/mutate.py zero3 comm      # only mutants whose name contains one of these words
    python scripts/mutate.py --list          # names and selections, no runs

First runs every selection on an unmutated copy (the "baseline" line, which must pass). Then prints one
JSON object per mutant and a summary line; exits 1 when any mutant survives (or its selection cannot run),
2 on a bad list or a failing baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "*.egg-info")


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the repository root
    edits: tuple[tuple[str, str], ...]  # (exact original snippet, replacement), applied in order
    tests: tuple[str, ...]  # pytest selection that should fail


MUTANTS = [
    # ---- the five -------------------------------------------------------------------------------
    Mutant("zero3_bf16_masters_never_copied_back", "src/orangetron/parallel/data/strategy.py",
           (("updated this rank's main parameters: bring the model's parameters in line.\"\"\"\n"
             "        self.buffers.copy_main_params()",
             "updated this rank's main parameters: bring the model's parameters in line.\"\"\"\n"
             "        if self.buffers.config.zero_stage != 3:\n            self.buffers.copy_main_params()"),),
           ("tests/test_mixed_precision.py",)),
    Mutant("zero3_gathered_params_never_freed", "src/orangetron/parallel/data/flat.py",
           (("            s.flat.untyped_storage().resize_(0)", "            pass"),),
           ("tests/test_data_parallel.py::test_zero3_gathers_unit_by_unit_frees_after_use_and_overlaps",)),
    Mutant("zero3_unit_never_released_after_backward", "src/orangetron/parallel/data/units.py",
           (("            self.reduce(u)\n        self.release(u)", "            self.reduce(u)"),),
           ("tests/test_data_parallel.py::test_zero3_gathers_unit_by_unit_frees_after_use_and_overlaps",)),
    Mutant("zero3_prefetch_of_the_wrong_unit", "src/orangetron/parallel/data/units.py",
           (("            self.start(u + 1)", "            self.start(u + 2)"),),
           ("tests/test_data_parallel.py::test_zero3_gathers_unit_by_unit_frees_after_use_and_overlaps",)),
    Mutant("zero3_grad_bucket_not_padded", "src/orangetron/parallel/data/units.py",
           (("            wire = torch.zeros(seg.padded, dtype", "            wire = torch.zeros(seg.numel, dtype"),),
           ("tests/test_data_parallel.py::test_every_stage_matches_one_device_with_exact_ledger_and_memory",)),
    Mutant("grads_averaged_over_d_squared", "src/orangetron/parallel/data/buffers.py",
           (("            part.reduce(self.group.size, self.transient, self.param_grads.free)",
             "            part.reduce(self.group.size ** 2, self.transient, self.param_grads.free)"),),
           ("tests/test_mixed_precision.py",)),
    Mutant("zero3_grads_averaged_over_d_squared", "src/orangetron/parallel/data/zero3.py",
           (("            part.main_grads.div_(self.buffers.group.size)\n",
             "            part.main_grads.div_(self.buffers.group.size ** 2)\n"),),
           ("tests/test_train.py::test_two_rank_zero3_training_matches_plain_torch",)),
    Mutant("ring_share_rounds_up", "src/orangetron/spec/collectives.py",
           (("    return full_bytes * (group_size - 1) // group_size",
             "    return -(-full_bytes * (group_size - 1) // group_size)"),),
           ("tests/test_collective_bytes.py", "tests/test_comm.py", "tests/test_plan_traffic.py")),
    Mutant("rmsnorm_keeps_x_on_ctx", "src/orangetron/model/autograd.py",
           (("        ctx.save_for_backward(x, weight)\n        ctx.eps = eps",
             "        ctx.save_for_backward(weight)\n        ctx.x, ctx.eps = x, eps"),
            ("        x, weight = ctx.saved_tensors\n        normed, rstd = _rms_normed(x, ctx.eps)",
             "        (weight,), x = ctx.saved_tensors, ctx.x\n        normed, rstd = _rms_normed(x, ctx.eps)")),
           ("tests/test_plan_activations_exact.py", "tests/test_model.py")),
    # ---- collectives ------------------------------------------------------------------------------------
    Mutant("all_gather_backward_slices_without_summing", "src/orangetron/comm.py",
           (("        return _reduce_scatter_raw(grad, ctx.group, ctx.dim), None, None",
             "        return grad.chunk(ctx.group.size, ctx.dim)[ctx.group.rank].contiguous(), None, None"),),
           ("tests/test_comm.py",)),
    Mutant("copy_to_group_backward_without_all_reduce", "src/orangetron/comm.py",
           (("        return _all_reduce_raw(grad, ctx.group), None\n", "        return grad, None\n"),),
           ("tests/test_comm.py",)),
    # ---- data parallel ----------------------------------------------------------------------------------
    Mutant("lazy_gather_skipped_before_forward", "src/orangetron/parallel/data/sharded.py",
           (("    def before_forward(self) -> None:\n        if self.params_stale:\n            self.gather_params()\n",
             "    def before_forward(self) -> None:\n        pass\n"),),
           ("tests/test_mixed_precision.py",)),
    Mutant("decay_mask_inverted", "src/orangetron/parallel/data/sharded_adamw.py",
           (("    return part.owned_mask(lambda name, p: p.dim() >= 2)",
             "    return part.owned_mask(lambda name, p: p.dim() < 2)"),),
           ("tests/test_mixed_precision.py",)),
    Mutant("clip_norm_of_local_shard_only", "src/orangetron/parallel/data/sharded_adamw.py",
           (("            if part.shards > 1:\n                squares = comm.all_reduce(squares, part.group)\n", ""),),
           ("tests/test_mixed_precision.py",)),
    Mutant("bucketed_grads_summed_not_averaged", "src/orangetron/parallel/data/replicated.py",
           (("            part.owned_grads().div_(self.buffers.group.size)\n", "            pass\n"),),
           ("tests/test_mixed_precision.py",)),
    Mutant("adamw_bias_correction_stuck_at_the_first_step", "src/orangetron/parallel/data/optim.py",
           (("        self._step.fill_(self.steps)", "        self._step.fill_(1)"),),
           ("tests/test_mixed_precision.py",)),
    # ---- memory accounting ------------------------------------------------------------------------------
    Mutant("storage_counted_once_per_tensor", "src/orangetron/memory.py",
           (("        seen[_storage_key(t)] = t.untyped_storage().nbytes()",
             "        seen[(str(t.device), id(t))] = t.untyped_storage().nbytes()"),),
           ("tests/test_memory.py", "tests/test_data_parallel.py")),
    # ---- model functions --------------------------------------------------------------------------------
    Mutant("rmsnorm_eps_outside_the_root", "src/orangetron/model/autograd.py",
           (("    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)",
             "    rstd = 1 / (xf.pow(2).mean(-1, keepdim=True).sqrt() + eps)"),),
           ("tests/test_model.py", "tests/test_plan_activations_exact.py")),
    Mutant("rope_rotates_the_other_way", "src/orangetron/model/layers.py",
           (("    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)",
             "    rotated = torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)"),),
           ("tests/test_model.py",)),
    Mutant("swiglu_gate_grad_drops_silu_derivative_term", "src/orangetron/model/autograd.py",
           (("        grad_gate = dy * u * sig * (1 + g * (1 - sig))", "        grad_gate = dy * u * sig"),),
           ("tests/test_model.py", "tests/test_plan_activations_exact.py")),
    # ---- tensor parallel --------------------------------------------------------------------------------
    Mutant("tp_replicated_params_counted_in_norm_on_every_rank", "src/orangetron/parallel/tensor.py",
           (("        if self.dim is None:\n            return tp_rank == 0",
             "        if self.dim is None:\n            return True"),),
           ("tests/test_tensor_parallel.py",)),
    Mutant("tp_replicated_kv_grads_summed_over_every_rank", "src/orangetron/parallel/tensor.py",
           (("    if placement.copies == 1:\n        return grad.reshape(-1)",
             "    if True:\n        return grad.reshape(-1)"),),
           ("tests/test_tensor_parallel.py",)),
    Mutant("sp_partial_grads_not_summed_over_tp", "src/orangetron/parallel/tensor.py",
           (("            out[name] = Placement(partial_grad=sequence_parallel and tp > 1)",
             "            out[name] = Placement()"),),
           ("tests/test_tensor_parallel.py",)),
    Mutant("sp_backward_input_grad_sliced_not_reduce_scattered", "src/orangetron/parallel/tensor.py",
           (("        return comm.reduce_scatter(grad_x, ctx.group, ctx.dim), None, None, *grad_weights",
             "        return grad_x.chunk(ctx.group.size, ctx.dim)[ctx.group.rank], None, None, *grad_weights"),),
           ("tests/test_tensor_parallel.py",)),
    Mutant("vocab_cross_entropy_shifts_by_the_local_max", "src/orangetron/parallel/tensor.py",
           (("        row_max = comm.all_reduce_max(logits.max(-1, keepdim=True).values, group)  # [N, 1]",
             "        row_max = logits.max(-1, keepdim=True).values  # [N, 1]"),),
           ("tests/test_tensor_parallel.py",)),
    Mutant("plan_tp_grad_sum_forgets_the_kv_slots", "src/orangetron/plan/params.py",
           (("    numel = _kv_slot_params(model, deg.tp) * len(", "    numel = 0 * len("),),
           ("tests/test_plan_traffic.py",)),
    Mutant("plan_moe_layer_without_shared_expert_splits_two_blocks", "src/orangetron/plan/traffic.py",
           (("    return 1 if model.is_moe_layer(index) and not model.num_shared_experts else 2",
             "    return 2"),),
           ("tests/test_plan_traffic.py",)),
    Mutant("plan_ep_hides_behind_its_own_routed_experts", "src/orangetron/plan/timing.py",
           (("    return cost.shared_f + shared_b + (cost.shared_f if",
             "    return cost.experts_f + cost.experts_b + (cost.shared_f if"),),
           ("tests/test_plan_timing.py", "tests/test_plan_validation.py")),
    Mutant("plan_ep_overlap_without_a_second_micro_batch", "src/orangetron/plan/timing.py",
           (("    if job.overlap_ep and job.replica_microbatches(deg) > 1:", "    if job.overlap_ep:"),),
           ("tests/test_plan_timing.py",)),
    Mutant("plan_etp_gathers_nothing", "src/orangetron/plan/traffic.py",
           (("    t = deg.etp\n    if t == 1:\n        return []",
             "    t = deg.etp\n    if t >= 1:\n        return []"),),
           ("tests/test_plan_traffic.py",)),
    Mutant("plan_fp8_saves_16_bit_gemm_inputs", "src/orangetron/plan/activations.py",
           (("job.param_bytes, 1 if job.fp8 else job.param_bytes,", "job.param_bytes, job.param_bytes,"),),
           ("tests/test_plan_memory.py",)),
    Mutant("plan_fp8_blockwise_tiles_unscaled", "src/orangetron/plan/activations.py",
           (("return 4 * elements // ACTIVATION_TILE if self.tiled else 0", "return 0"),),
           ("tests/test_plan_fp8.py",)),
    Mutant("plan_fp8_blockwise_one_weight_copy_scaled", "src/orangetron/plan/fp8.py",
           (("return 2 * params + 2 * 4 * -(-params // WEIGHT_BLOCK)",
             "return 2 * params + 4 * -(-params // WEIGHT_BLOCK)"),),
           ("tests/test_plan_fp8.py",)),
    Mutant("plan_triton_flash_forward_at_flash2_speed", "src/orangetron/plan/timing.py",
           (("return fwd / TRITON_FLASH_GAP[0], bwd / TRITON_FLASH_GAP[1]", "return fwd, bwd / TRITON_FLASH_GAP[1]"),),
           ("tests/test_plan_timing.py",)),
    Mutant("plan_reduction_after_backward_still_hidden", "src/orangetron/plan/timing.py",
           (("    if job.overlap_grad_reduce:\n        rounds = reduce_rounds(",
             "    if True:\n        rounds = reduce_rounds("),),
           ("tests/test_plan_timing.py",)),
    Mutant("plan_folded_experts_placed_as_unfolded", "src/orangetron/plan/timing.py",
           (("for dim, fixed in (_FIXED_FOLDED if deg.expert_fold else _FIXED).items():",
             "for dim, fixed in _FIXED.items():"),),
           ("tests/test_plan_folding.py",)),
    Mutant("folded_expert_ep_ignores_etp", "src/orangetron/spec/layout.py",
           (("ep, edp = (local // self.etp) % self.ep, local // (self.etp * self.ep)",
             "ep, edp = local % self.ep, local // (self.etp * self.ep)"),),
           ("tests/test_layout.py",)),
    Mutant("plan_eager_attention_dropout_output_not_kept", "src/orangetron/plan/activations.py",
           (("total += scores + a * scores  # attention-dropout mask", "total += scores  # attention-dropout mask"),),
           ("tests/test_plan_validation.py::test_peak_memory_within_10_percent_of_megatron_ci",)),
    Mutant("plan_flash2_at_the_best_kernels_speed", "src/orangetron/spec/hardware.py",
           (('        if kernel == "flash2" and self.flash2_fwd_efficiency:', '        if kernel == "fa2":'),),
           ("tests/test_plan_timing.py", "tests/test_plan_validation.py")),
    Mutant("plan_busiest_rank_ignored", "src/orangetron/plan/timing.py",
           (("    return 1.0 + math.sqrt(2.0 * math.log(ranks)",
             "    return 1.0 + 0 * math.sqrt(2.0 * math.log(ranks)"),),
           ("tests/test_plan_timing.py",)),
    # ---- context parallel -------------------------------------------------------------------------------
    Mutant("ring_zigzag_sees_the_earlier_ranks_tail", "src/orangetron/parallel/context/ring.py",
           (("        return everything, slice(0, half), False",
             "        return everything, slice(half, length), False"),),
           ("tests/test_context_attention.py",)),
    Mutant("merge_forgets_to_rescale_the_running_output", "src/orangetron/parallel/context/blocks.py",
           (("    out.mul_(old_w).add_(block_out * new_w)", "    out.add_(block_out * new_w)"),),
           ("tests/test_context_attention.py",)),
    Mutant("ring_gradients_stop_one_hop_short", "src/orangetron/parallel/context/ring.py",
           (("        dkv = grad_ring.wait()\n", "        grad_ring.wait()\n"),),
           ("tests/test_context_attention.py",)),
    Mutant("cp_padding_share_without_cp", "src/orangetron/train/step.py",
           (("        share = int((labels != IGNORE_INDEX).sum()) * cp / max(valid, 1)",
             "        share = int((labels != IGNORE_INDEX).sum()) / max(valid, 1)"),),
           ("tests/test_context_parallel.py::test_padding_to_whole_chunks_never_changes_the_training",)),
    Mutant("cross_entropy_scale_in_float32", "src/orangetron/model/autograd.py",
           (("    return probs.mul_((valid.to(probs.dtype) / n_valid).unsqueeze(-1))",
             "    return probs.mul_((valid / n_valid).to(probs.dtype).unsqueeze(-1))"),),
           ("tests/test_context_parallel.py::test_padding_to_whole_chunks_never_changes_the_training",)),
    Mutant("plan_allgather_keeps_gathered_kv", "src/orangetron/spec/context_modes.py",
           (('    return [gather_record("all_gather", "cp", gathered, c)] * (passes + 1) + \\',
             '    return [gather_record("all_gather", "cp", gathered, c)] * passes + \\'),),
           ("tests/test_plan_traffic.py", "tests/test_context_parallel.py")),
    # ---- expert parallel --------------------------------------------------------------------------------
    Mutant("expert_block_offset_shifted", "src/orangetron/parallel/expert/dispatcher.py",
           (("        self.first_expert = self.group.rank * self.local_experts",
             "        self.first_expert = (self.group.rank + 1) % self.group.size * self.local_experts"),),
           ("tests/test_expert_parallel.py",)),
    Mutant("capacity_keeps_one_slot_too_many", "src/orangetron/parallel/expert/capacity.py",
           (("    keep[order] = rank_in_expert < slots", "    keep[order] = rank_in_expert <= slots"),),
           ("tests/test_expert_dispatch.py",)),
    Mutant("ep_overlap_next_chunk_sent_after_compute", "src/orangetron/parallel/expert/overlap.py",
           (("                dispatches.append(_start_dispatch(",
             "                later = (lambda c=c: _start_dispatch("),
            ("            combines.append(comm.all_to_all_start(out, plan.group,",
             "            if c + 1 < n:\n                dispatches.append(later())\n"
             "            combines.append(comm.all_to_all_start(out, plan.group,")),
           ("tests/test_expert_overlap.py::test_next_chunk_is_in_flight_while_a_chunk_computes",)),
    Mutant("ep_overlap_backward_sends_the_next_chunk_after_this_one", "src/orangetron/parallel/expert/overlap.py",
           (("            if c + 1 < n:  # in flight while chunk c runs its experts' backward\n"
             "                pending.append(start(c + 1))\n", ""),
            ("            grad_params = [_add(total, g) for total, g in zip(grad_params, found[1:], strict=True)]\n",
             "            grad_params = [_add(total, g) for total, g in zip(grad_params, found[1:], strict=True)]\n"
             "            if c + 1 < n:\n                pending.append(start(c + 1))\n")),
           ("tests/test_expert_overlap.py::test_next_chunk_is_in_flight_while_a_chunk_computes",)),
    Mutant("ep_overlap_expert_grads_of_the_last_chunk_only", "src/orangetron/parallel/expert/overlap.py",
           (("            grad_params = [_add(total, g) for total, g in zip(grad_params, found[1:], strict=True)]",
             "            grad_params = list(found[1:])"),),
           ("tests/test_expert_overlap.py::test_overlapped_dispatch_equals_one_device_and_counted_routing",)),
    Mutant("ep_overlap_chunks_lose_the_uneven_remainder", "src/orangetron/spec/sharding.py",
           (("base + (c < extra) for c", "base + (c < extra - 1) for c"),),
           ("tests/test_expert_overlap.py",)),
    Mutant("plan_ep_dispatch_keeps_one_index_per_copy", "src/orangetron/plan/activations.py",
           (("    return 8 * rows + dispatcher.mask_bytes(m, tokens, job, ep, rows) + 16 * copies",
             "    return 8 * rows + dispatcher.mask_bytes(m, tokens, job, ep, rows) + 8 * copies"),),
           ("tests/test_expert_parallel.py",)),
    # ---- planner formulas -------------------------------------------------------------------------------
    Mutant("plan_zero2_grads_not_sharded", "src/orangetron/plan/memory.py",
           (('        "grads": g_bytes * (shard if job.zero_stage >= 2 else full),',
             '        "grads": g_bytes * (shard if job.zero_stage >= 3 else full),'),),
           ("tests/test_plan_memory.py",)),
    # ---- pipeline parallelism --------------------------------------------------------------------------
    Mutant("pipeline_microbatch_activation_freed_before_its_backward",
           "src/orangetron/parallel/pipeline/executor.py",
           (("            self.saved[(chunk.index, i)] = (x, out, aux)",
             "            self.saved[(chunk.index, i)] = (x, out.detach().requires_grad_(), aux)"),),
           ("tests/test_pipeline_parallel.py::test_pipeline_parallel_matches_one_device_and_the_planner[2]",)),
    Mutant("pipeline_gradients_not_accumulated_over_microbatches",
           "src/orangetron/parallel/pipeline/executor.py",
           (("        x, out, aux = self.saved.pop((chunk.index, i))",
             "        self.model.module.zero_grad()\n        x, out, aux = self.saved.pop((chunk.index, i))"),),
           ("tests/test_pipeline_parallel.py::test_pipeline_parallel_matches_one_device_and_the_planner[2]",)),
    Mutant("pipeline_microbatch_loss_not_scaled", "src/orangetron/parallel/pipeline/executor.py",
           (("            ce = module.cross_entropy(out, mb.labels, mb.ignore_index) * mb.loss_scale",
             "            ce = module.cross_entropy(out, mb.labels, mb.ignore_index)"),),
           ("tests/test_pipeline_parallel.py::test_pipeline_parallel_matches_one_device_and_the_planner[2]",)),
    Mutant("pipeline_stage_boundary_one_layer_late", "src/orangetron/parallel/pipeline/stage.py",
           (("    ranges = chunk_layers(len(model.layers), pp * virtual_stages)",
             "    ranges = [range(r.start + (r.start > 0), r.stop + (r.stop < len(model.layers)))\n"
             "              for r in chunk_layers(len(model.layers), pp * virtual_stages)]"),),
           ("tests/test_pipeline_parallel.py::test_pipeline_parallel_matches_one_device_and_the_planner[2]",)),
    Mutant("pipeline_clip_norm_not_summed_over_stages", "src/orangetron/parallel/data/sharded_adamw.py",
           (("        if self.buffers.pp is not None:\n"
             "            total = comm.all_reduce(total, self.buffers.pp)\n", ""),),
           ("tests/test_pipeline_parallel.py::test_pipeline_parallel_matches_one_device_and_the_planner[2]",)),
    Mutant("trainer_accumulation_without_dividing_by_microbatches", "src/orangetron/train/step.py",
           (("            (objective / m if m > 1 else objective).backward()", "            objective.backward()"),),
           ("tests/test_pipeline_parallel.py::test_checkpoints_move_between_pipelined_and_plain_layouts",)),
    Mutant("plan_gpipe_last_stage_holds_one_loss", "src/orangetron/spec/schedules.py",
           (("in_flight=lambda pp, v, m, stage: float(m), held_outputs=lambda pp, m: m))",
             "in_flight=lambda pp, v, m, stage: float(m), held_outputs=lambda pp, m: 1))"),),
           ("tests/test_pipeline_parallel.py::test_pipeline_parallel_matches_one_device_and_the_planner[2]",)),
    # ---- router options ----------------------------------------------------------------------------------
    Mutant("router_z_loss_mean_over_local_tokens", "src/orangetron/parallel/expert/balance.py",
           (("        return totals[0] / n.clamp(min=1)", "        return totals[0] / max(squares.shape[0], 1)"),),
           ("tests/test_router_options.py::test_router_options_match_one_device_and_the_planner[2]",)),
    Mutant("router_z_loss_grad_missing_lse", "src/orangetron/model/autograd.py",
           (("    grad = 2 * lse * (logits - lse).exp() * scale", "    grad = 2 * (logits - lse).exp() * scale"),),
           ("tests/test_router_options.py::test_z_loss_is_the_mean_squared_logsumexp_over_non_padding_tokens",)),
    Mutant("router_groups_chosen_by_min", "src/orangetron/model/moe.py",
           (("experts // n_groups).amax(-1)", "experts // n_groups).amin(-1)"),),
           ("tests/test_router_options.py::test_group_limited_routing_keeps_the_groups_with_the_largest_expert_score",)),
    Mutant("router_bias_in_the_weights_too", "src/orangetron/model/moe.py",
           (("TopKWeights.apply(scores, topk_idx, self.score_func",
             "TopKWeights.apply(scores if self.expert_bias is None else scores + self.expert_bias, topk_idx, "
             "self.score_func"),),
           ("tests/test_router_options.py::test_the_bias_chooses_the_experts_but_the_weights_stay_unbiased",)),
    Mutant("router_bias_local_load", "src/orangetron/parallel/expert/bias.py",
           (("        loads = comm.all_reduce(loads, group)", "        pass"),),
           ("tests/test_router_options.py::test_router_options_match_one_device_and_the_planner[2]",)),
    Mutant("router_bias_not_restored", "src/orangetron/train/resume.py",
           (("    tensors = _tensors(setup)\n",
             "    tensors = {key: value for key, value in _tensors(setup).items() if key != \"buffers\"}\n"),),
           ("tests/test_router_options.py::test_the_trainer_moves_the_bias_and_a_resumed_run_restores_it",)),
    Mutant("shown_loss_is_rank_zeros_share", "src/orangetron/train/step.py",
           (("    return loss, float(grad_norm), mem\n", "    return float(lm_loss), float(grad_norm), mem\n"),),
           ("tests/test_train_outputs.py::test_every_layout_shows_the_global_batch_loss",)),
    Mutant("config_file_overrides_the_command_line", "src/orangetron/cli/__init__.py",
           (("    return parser.parse_args(argv)\n\n\nif", "    parser.parse_args(argv)\n    for dest, value in "
             "read_config_file(args.config, args.command_parser).items():\n        setattr(args, dest, value)\n"
             "    return args\n\n\nif"),),
           ("tests/test_train_outputs.py::test_config_file_sets_options_and_the_command_line_overrides_it",)),
    # ---- sharded checkpoints ----------------------------------------------------------------------------
    Mutant("reshard_box_counted_from_the_parameter_start", "src/orangetron/parallel/state.py",
           (("                begin = at + flat_start - lo\n", "                begin = at + flat_start\n"),),
           ("tests/test_checkpoint_sharded.py::test_every_layout_reshards_onto_the_next_exactly",)),
    Mutant("reshard_tp_offset_by_rank_not_by_slice", "src/orangetron/parallel/state.py",
           (("placement.slice_index(buffers.tp.rank) * local_shape", "buffers.tp.rank * local_shape"),),
           ("tests/test_checkpoint_sharded.py::test_every_layout_reshards_onto_the_next_exactly",)),
    # ---- gradient buckets of the sharded stages -------------------------------------------------------
    Mutant("sharded_bucket_grad_freed_before_its_last_bucket", "src/orangetron/parallel/data/buckets.py",
           (("            if self.pending_buckets[i] == 0:\n                self.buffers.param_grads.free(p)",
             "            if True:\n                self.buffers.param_grads.free(p)"),),
           ("tests/test_data_parallel.py::test_every_stage_matches_one_device_with_exact_ledger_and_memory",)),
    Mutant("sharded_buckets_not_retired_before_the_next", "src/orangetron/parallel/data/buckets.py",
           (("        self.retire()  # one bucket in flight", "        pass  # one bucket in flight"),),
           ("tests/test_data_parallel.py::test_sharded_buckets_are_reduce_scattered_during_backward",)),
    Mutant("pipeline_buckets_started_by_every_backward", "src/orangetron/parallel/pipeline/executor.py",
           (("            with model.no_sync() if at != last_backward[act.chunk] else nullcontext():",
             "            with nullcontext():"),),
           ("tests/test_pipeline_parallel.py::test_pipeline_parallel_matches_one_device_and_the_planner[4]",)),
    Mutant("sharded_bucket_planner_counts_no_wire", "src/orangetron/plan/memory.py",
           (("    wire = job.zero_stage == 2 or", "    wire = job.zero_stage == 3 or"),),
           ("tests/test_plan_bridge.py::test_planner_equals_runtime_ledger_and_memory_for_data_parallel",)),
    # ---- the reduction's transient buffers ----------------------------------------------------------------
    Mutant("ddp_bucket_wire_copies_not_counted", "src/orangetron/parallel/data/buckets.py",
           (("        nbytes = 0 if wire.data_ptr() == region.data_ptr() else wire.numel() * wire.element_size()",
             "        nbytes = 0"),),
           ("tests/test_data_parallel.py::test_reduction_buffers_count_in_grad_buckets_when_dtypes_differ_and_unbucketed",)),
    Mutant("unbucketed_all_reduce_result_not_counted", "src/orangetron/parallel/data/flat.py",
           (("            held += self.padded_numel if self.shards == 1 else self.shard_numel",
             "            held += 0 if self.shards == 1 else self.shard_numel"),),
           ("tests/test_data_parallel.py::test_reduction_buffers_count_in_grad_buckets_when_dtypes_differ_and_unbucketed",)),
    Mutant("unbucketed_planner_counts_no_wire_copy", "src/orangetron/plan/memory.py",
           (("_unbucketed(numel, ranks, job.zero_stage == 2 or copies, sharded)",
             "_unbucketed(numel, ranks, job.zero_stage == 2, sharded)"),),
           ("tests/test_data_parallel.py::test_reduction_buffers_count_in_grad_buckets_when_dtypes_differ_and_unbucketed",)),
    # ---- faults --------------------------------------------------------------------------------------------
    Mutant("nan_checked_after_the_update", "src/orangetron/train/step.py",
           (("    loss = _global_loss_unless_diverged(lm_loss, grad_norm)\n    faults.enter(\"optimizer step\")\n"
             "    optimizer.step()\n",
             "    faults.enter(\"optimizer step\")\n    optimizer.step()\n"
             "    loss = _global_loss_unless_diverged(lm_loss, grad_norm)\n"),),
           ("tests/test_faults.py::test_non_finite_step_stops_before_the_update",)),
    Mutant("nan_decided_on_the_local_loss", "src/orangetron/train/step.py",
           (("comm.all_reduce(verdict, comm.world_group()).tolist()", "verdict.tolist()"),),
           ("tests/test_faults.py::test_nan_on_one_rank_stops_every_rank_at_that_step_keeping_the_last_checkpoint",)),
    Mutant("rank_phase_never_posted", "src/orangetron/train/faults.py",
           (("    _board.post(_step, PHASES.index(phase))", "    pass"),),
           ("tests/test_faults.py::test_a_dead_or_hung_rank_ends_every_rank_naming_it",)),
    # ---- planner search caches --------------------------------------------------------------------------
    Mutant("plan_dp_time_key_drops_the_zero3_micro_batches", "src/orangetron/plan/timing.py",
           (("canonical_job(replace(states, microbatches=microbatches, zero3_reduce_every_microbatch=every))",
             "states"),),
           ("tests/test_plan_search_caches.py",)),
    Mutant("plan_state_key_drops_the_bucket_size", "src/orangetron/spec/options.py",
           (('ep_comm_sms_reserved=False, recompute="none", recompute_layers=0,',
             'ep_comm_sms_reserved=False, recompute="none", recompute_layers=0, grad_bucket_numel=0,'),),
           ("tests/test_plan_search_caches.py",)),
    Mutant("plan_interleaved_masks_counted_per_chunk", "src/orangetron/plan/activations.py",
           (("            masks += (holders[act.microbatch] > 0) - (before > 0)", "            masks += sign"),),
           ("tests/test_plan_search_caches.py",)),
    # ---- per-parameter gradients (param_grads) --------------------------------------------------------------
    Mutant("param_grads_never_uncounted_when_freed", "src/orangetron/parallel/data/param_grads.py",
           (("        self.transient.add(\"param_grads\", -self.counted.pop(id(p), 0))",
             "        self.counted.pop(id(p), 0)"),),
           ("tests/test_data_parallel.py::test_every_stage_matches_one_device_with_exact_ledger_and_memory",)),
    Mutant("planner_in_place_buckets_hold_every_grad", "src/orangetron/plan/param_grads.py",
           (("        return largest * job.param_bytes", "        return total * job.param_bytes"),),
           ("tests/test_data_parallel.py::test_planner_predicts_the_per_parameter_gradients_by_hand",)),
    Mutant("planner_grads_freed_inside_no_sync", "src/orangetron/plan/param_grads.py",
           (("            if not reduces:\n                continue\n", ""),),
           ("tests/test_pipeline_parallel.py",)),
    Mutant("tp_grad_sum_buffers_not_counted", "src/orangetron/parallel/tensor.py",
           (("        transient.add(\"grad_buckets\", nbytes)\n", "        pass\n"),),
           ("tests/test_tensor_parallel.py",)),
    Mutant("planner_tp_grad_sum_not_doubled", "src/orangetron/plan/memory.py",
           (("    return 2 * tp_grad_sum_numel(model, deg, job, stage) * job.param_bytes",
             "    return tp_grad_sum_numel(model, deg, job, stage) * job.param_bytes"),),
           ("tests/test_tensor_parallel.py",)),
    Mutant("zero3_every_microbatch_still_waits_in_no_sync", "src/orangetron/parallel/data/zero3.py",
           (("        if self.buffers.config.zero3_reduce_every_microbatch:", "        if False:"),),
           ("tests/test_data_parallel.py::test_zero3_reduce_every_microbatch_matches_one_device_with_one_unit_of_grads",)),
    Mutant("planner_zero3_reduces_once_per_step_always", "src/orangetron/plan/traffic.py",
           (("        return job.replica_microbatches(deg)\n    return 1", "        return 1\n    return 1"),),
           ("tests/test_plan_cli.py::test_estimate_zero3_reduce_every_microbatch",)),
    Mutant("checkpoint_step_outcome_not_shared", "src/orangetron/train/sharded.py",
           (("    outcomes = [mine] if alone else comm.all_gather_objects(_picklable(mine), group)",
             "    outcomes = [mine]"),),
           ("tests/test_checkpoint_sharded.py::test_a_checkpoint_step_that_fails_on_one_rank_raises_on_every_rank",)),
    Mutant("plan_search_never_reduces_zero3_per_micro_batch", "src/orangetron/plan/search.py",
           (('"zero3", "zero3-mb")', '"zero3")'),),
           ("tests/test_plan_search.py",)),
    Mutant("plan_zero3_rounds_share_one_backward_window", "src/orangetron/plan/timing.py",
           (("        exposed = tail + _hide(reduce - tail, 2 / 3 * t_mb * rounds, eff)",
             "        exposed = tail + _hide(reduce - tail, 2 / 3 * t_mb, eff)"),),
           ("tests/test_plan_timing.py",)),
    Mutant("runtime_silently_ignores_recompute", "src/orangetron/parallel/config.py",
           (("    if config.recompute != \"none\":", "    if False:"),),
           ("tests/test_data_parallel.py::test_the_runtime_refuses_recomputation_it_does_not_do",)),
    Mutant("planner_usp_ring_placed_as_ulysses", "src/orangetron/plan/timing.py",
           (("sum(c.cp % stride == 0 and c.cp < size * stride for c in same)", "sum(c.cp < size for c in same)"),),
           ("tests/test_plan_timing.py::test_usp_groups_follow_the_runtime_split_of_cp",)),
    Mutant("planner_chunked_dispatch_hides_nothing_more", "src/orangetron/plan/timing.py",
           (("        window += min(comm, experts) * (c - 1) / c", "        window += 0.0"),),
           ("tests/test_plan_timing.py::test_chunked_dispatch_hides_all_but_one_chunk_behind_the_other_chunks_experts",)),
    Mutant("planner_chunks_allowed_for_every_dispatcher", "src/orangetron/spec/parallel_config.py",
           (("self.ep_overlap_chunks, self.dispatcher, dispatcher.chunked)",
             "self.ep_overlap_chunks, self.dispatcher, True)"),),
           ("tests/test_plan_timing.py::test_chunked_overlap_is_for_the_ragged_dispatcher",
            "tests/test_expert_overlap.py::test_overlap_configuration_errors")),
    Mutant("planner_chunk_window_forgets_the_replayed_forward", "src/orangetron/plan/timing.py",
           (('cost.experts_f + cost.experts_b + (cost.experts_f if job.recompute == "full" else 0.0)',
             "cost.experts_f + cost.experts_b"),),
           ("tests/test_plan_timing.py::test_chunked_dispatch_hides_all_but_one_chunk_behind_the_other_chunks_experts",)),
    Mutant("planner_fused_grads_accept_another_wire_dtype", "src/orangetron/spec/options.py",
           (("and self.reduce_dtype and self.reduce_dtype != self.main_grad_dtype:", "and False:"),),
           ("tests/test_plan_cli.py::test_grad_accumulation_fusion_needs_a_whole_main_gradient_buffer_reduced_in_its_dtype",)),
    Mutant("planner_chunked_experts_run_as_one_grouped_gemm", "src/orangetron/plan/timing.py",
           (("    chunks = job.ep_overlap_chunks\n", "    chunks = 1\n"),),
           ("tests/test_plan_timing.py::test_chunked_experts_run_as_their_own_grouped_gemms",)),
    Mutant("planner_fused_grads_reduced_in_the_param_dtype", "src/orangetron/spec/options.py",
           (("(self.main_grad_dtype if self.grad_accumulation_fusion else self.param_dtype)", "self.param_dtype"),),
           ("tests/test_plan_cli.py::test_estimate_grad_accumulation_fusion",)),
    Mutant("planner_usp_kernel_calls_span_the_whole_sequence", "src/orangetron/spec/context_modes.py",
           (("    key_blocks=lambda deg, job: deg.cp // job.ulysses_degree,", "    key_blocks=lambda deg, job: 1,"),),
           ("tests/test_plan_timing.py::test_usp_groups_follow_the_runtime_split_of_cp",)),
    # ---- Megatron-Core's gradient path (planner only) ------------------------------------------------------------
    Mutant("planner_fused_grads_still_held_for_tp_sums", "src/orangetron/plan/param_grads.py",
           (("    if job.grad_accumulation_fusion:  # Megatron-Core sums and reduces inside the main-gradient buffer\n"
             "        return False\n", ""),),
           ("tests/test_plan_cli.py::test_estimate_grad_accumulation_fusion",)),
    Mutant("planner_fused_grads_keep_reduction_buffers", "src/orangetron/plan/memory.py",
           (("    if job.grad_accumulation_fusion:\n        return 0\n    segments", "    segments"),),
           ("tests/test_plan_validation.py::test_peak_memory_within_10_percent_of_megatron_ci",)),
    Mutant("deepep_ignores_group_limited_routing", "src/orangetron/plan/node_dispatch.py",
           (("limit = (model.expert_groups, model.groups_per_token) if model.group_limited else (0, 0)",
             "limit = (0, 0)"),),
           ("tests/test_plan_node_dispatch.py::test_group_limited_routing_by_hand",)),
    Mutant("group_limit_ignored_when_a_bin_holds_several_groups", "src/orangetron/plan/node_dispatch.py",
           (("    if not 0 < per_token < groups:\n", "    if not 0 < per_token < groups or groups % bins == 0:\n"),),
           ("tests/test_plan_node_dispatch.py",)),
    Mutant("routed_ranks_unlimited_when_a_rank_holds_several_groups", "src/orangetron/spec/model.py",
           (("        span = 1 + -(-(w - math.gcd(w, b)) // b)\n", "        span = bins if w < b else w // b\n"),),
           ("tests/test_plan_node_dispatch.py::test_balanced_routing_reaches_the_most_ranks_its_groups_allow",)),
    Mutant("routed_ranks_group_span_too_loose_when_straddling", "src/orangetron/spec/model.py",
           (("        span = 1 + -(-(w - math.gcd(w, b)) // b)\n", "        span = 1 + -(-w // b)\n"),),
           ("tests/test_plan_node_dispatch.py::test_balanced_routing_reaches_the_most_ranks_its_groups_allow",)),
    Mutant("runtime_group_names_read_the_wrong_field", "src/orangetron/spec/model.py",
           (('"topk_groups": "groups_per_token"', '"topk_groups": "expert_groups"'),),
           ("tests/test_plan_node_dispatch.py::test_balanced_routing_reaches_the_most_ranks_its_groups_allow",)),
    Mutant("deepep_recompute_replays_nothing", "src/orangetron/plan/node_dispatch.py",
           (("    return [forward, combine] * passes(job) + [backward, combine]",
             "    return [forward, combine] + [backward, combine]"),),
           ("tests/test_plan_node_dispatch.py::test_layer_time_by_hand",)),
    Mutant("deepep_rdma_at_line_rate", "src/orangetron/plan/node_dispatch.py",
           (("f.remote_nodes * row / message_throughput(row, cluster, params=net)",
             "f.remote_nodes * row / (cluster.nic_bytes_per_s * net.inter_efficiency)"),),
           ("tests/test_plan_node_dispatch.py::test_layer_time_by_hand",)),
    Mutant("deepep_nvlink_leg_free", "src/orangetron/plan/node_dispatch.py",
           (("        total += max(rdma, nvlink)", "        total += rdma"),),
           ("tests/test_plan_node_dispatch.py::test_layer_time_by_hand",)),
    Mutant("deepep_full_rate_with_any_sm_count", "src/orangetron/plan/node_dispatch.py",
           (("    return total / min(1.0, job.ep_comm_sms / FULL_RATE_SMS)", "    return total"),),
           ("tests/test_plan_node_dispatch.py::test_fewer_sms_than_saturate_the_links_slow_the_transfers",)),
    Mutant("deepep_sm_share_halved", "src/orangetron/plan/node_dispatch.py",
           (("    return job.ep_comm_sms / cluster.gpu.sms", "    return job.ep_comm_sms / cluster.gpu.sms / 2"),),
           ("tests/test_plan_node_dispatch.py::test_hidden_traffic_costs_the_sms_its_kernels_hold",)),
    Mutant("deepep_tokens_ignore_sequence_parallel", "src/orangetron/plan/timing.py",
           (("node_dispatch.layer_time(model, where, job, routed_tokens(deg, job), cluster, net)",
             "node_dispatch.layer_time(model, where, job, job.seq_len // deg.cp * job.micro_batch, cluster, net)"),),
           ("tests/test_plan_node_dispatch.py::test_exposed_traffic_follows_each_ranks_tokens",)),
    Mutant("deepep_group_priced_as_one_node", "src/orangetron/plan/timing.py",
           (("node_dispatch.layer_time(model, where, job,",
             "node_dispatch.layer_time(model, Placement(where.size, where.size), job,"),),
           ("tests/test_plan_node_dispatch.py::test_hidden_traffic_costs_the_sms_its_kernels_hold",)),
    Mutant("deepep_any_placement_accepted", "src/orangetron/plan/node_dispatch.py",
           (("    if not (whole_nodes or inside_one):", "    if False:"),),
           ("tests/test_plan_node_dispatch.py::test_layouts_deepep_cannot_run_are_refused",)),
    Mutant("deepep_counts_the_own_node_as_remote", "src/orangetron/plan/node_dispatch.py",
           (("Fanout(nodes_reached * (nodes - 1) / nodes,", "Fanout(nodes_reached,"),),
           ("tests/test_plan_node_dispatch.py::test_fanout_by_hand",)),
    Mutant("deepep_legs_run_one_after_the_other", "src/orangetron/plan/node_dispatch.py",
           (("        total += max(rdma, nvlink)", "        total += rdma + nvlink"),),
           ("tests/test_plan_node_dispatch.py::test_layer_time_by_hand",)),
    Mutant("deepep_dispatches_bf16_under_blockwise_fp8", "src/orangetron/plan/node_dispatch.py",
           (('    blockwise_fp8 = job.fp8 and job.fp8_recipe == "blockwise"', "    blockwise_fp8 = False"),),
           ("tests/test_plan_node_dispatch.py::test_bytes_sent_by_hand",)),
    Mutant("deepep_hidden_traffic_costs_the_generic_contention", "src/orangetron/plan/timing.py",
           (("    share = 0.0 if job.ep_comm_sms_reserved else node_dispatch.sm_share(job, cluster)",
             "    share = eff.overlap_contention"),),
           ("tests/test_plan_node_dispatch.py::test_hidden_traffic_costs_the_sms_its_kernels_hold",)),
    # ---- FP8 compute: the tile fill, blockwise efficiency, the 16-bit head --------------------------------------
    Mutant("fp8_tile_fill_at_the_16_bit_rate", "src/orangetron/plan/compute.py",
           (('    k_fill = K_FILL * gpu.peak_flops(dtype) / gpu.peak_flops("bfloat16") if dtype in FP8_FORMATS '
             'else K_FILL', "    k_fill = K_FILL"),),
           ("tests/test_plan_compute.py",)),
    Mutant("blockwise_fp8_at_the_per_tensor_efficiency", "src/orangetron/spec/hardware.py",
           (('        if dtype == "float8-blockwise" and self.fp8_blockwise_gemm_efficiency:', "        if False:"),),
           ("tests/test_plan_compute.py",)),
    Mutant("blockwise_recipe_priced_as_per_tensor", "src/orangetron/plan/timing.py",
           (('        return ("float8-blockwise" if job.fp8_recipe == "blockwise" else "float8"), 1.0',
             '        return "float8", 1.0'),),
           ("tests/test_plan_node_dispatch.py", "tests/test_plan_validation.py")),
    Mutant("fp8_output_head", "src/orangetron/plan/timing.py",
           (("        head = linear_time(*shape)\n",
             "        head = _linear(shape[0], model.hidden_size, model.vocab_size // deg.tp, cluster, job)[:2]\n"),),
           ("tests/test_plan_timing.py::test_fp8_prices_the_output_head_in_16_bit",)),
    Mutant("fp8_head_reads_one_byte_operands", "src/orangetron/plan/timing.py",
           (("deg.tp, cluster.gpu, job.param_dtype, float(job.param_bytes)\n",
             "deg.tp, cluster.gpu, job.param_dtype, _gemm_dtype(job)[1]\n"),),
           ("tests/test_plan_timing.py::test_fp8_prices_the_output_head_in_16_bit",)),
    Mutant("fp8_copies_of_the_head", "src/orangetron/plan/fp8.py",
           (("        params -= head_weights(model, deg.tp, deg.pp)", "        pass"),),
           ("tests/test_plan_fp8.py",)),
    # ---- the stages that bound a pipeline ---------------------------------------------------------------------
    Mutant("pace_from_first_and_last_stage_only", "src/orangetron/plan/timing.py",
           (("    kinds = distinct_stages(model, deg.pp, job.virtual_stages, job.pipeline_layout)",
             "    kinds = tuple(sorted({0, deg.pp - 1}))"),),
           ("tests/test_plan_stages.py",)),
    Mutant("memory_from_first_middle_and_last_stage_only", "src/orangetron/plan/memory.py",
           (("    stages = distinct_stages(model, deg.pp, job.virtual_stages, job.pipeline_layout)",
             "    stages = sorted({0, deg.pp // 2, deg.pp - 1})"),),
           ("tests/test_plan_stages.py",)),
    Mutant("stage_kind_by_layer_counts_only", "src/orangetron/spec/stages.py",
           (("        kinds.setdefault((moe, stage == 0, stage == pp - 1), stage)",
             "        kinds.setdefault((tuple(sorted(sum(moe, ()))), stage == 0, stage == pp - 1), stage)"),),
           ("tests/test_plan_stages.py",)),
    Mutant("stage_kind_ignores_virtual_chunks", "src/orangetron/spec/stages.py",
           (("for i in chunks[stage + v * pp]) for v in range(virtual_stages))",
             "for i in chunks[stage + v * pp]) for v in range(1))"),),
           ("tests/test_plan_stages.py",)),
    Mutant("pace_by_compute_not_total", "src/orangetron/plan/timing.py",
           (("    slow = max(stages, key=lambda st: st.total)", "    slow = max(stages, key=lambda st: st.compute)"),),
           ("tests/test_plan_stages.py",)),
    Mutant("fp8_memory_of_stage_0_for_every_stage", "src/orangetron/plan/memory.py",
           (("    fp8 = fp8_memory_bytes(model, deg, job, stage)\n",
             "    fp8 = fp8_memory_bytes(model, deg, job, 0)\n"),),
           ("tests/test_plan_fp8.py",)),
    # ---- partial full recompute (Megatron's block method) --------------------------------------------------------
    Mutant("partial_recompute_replays_every_layer", "src/orangetron/spec/options.py",
           (('recompute="full" if replayed else "none", recompute_layers=0', 'recompute="full", recompute_layers=0'),),
           ("tests/test_plan_recompute.py",)),
    Mutant("replayed_layers_from_the_chunk_end", "src/orangetron/spec/stages.py",
           (("(chunk if not per_chunk else chunk[:per_chunk])", "(chunk if not per_chunk else chunk[-per_chunk:])"),),
           ("tests/test_plan_recompute.py",)),
    Mutant("partial_hfu_counts_every_layer", "src/orangetron/plan/timing.py",
           (("        flops += tokens * (decoder * replayed + mtp)", "        flops += tokens * (decoder + mtp)"),),
           ("tests/test_plan_recompute.py",)),
    Mutant("partial_records_replay_every_layer", "src/orangetron/plan/traffic.py",
           (("    if not job.partial_recompute:\n        return [(job, layers)]",
             "    if True:\n        return [(job, layers)]"),),
           ("tests/test_plan_recompute.py",)),
    Mutant("partial_activations_keep_inputs_everywhere", "src/orangetron/plan/activations.py",
           (("    if not job.partial_recompute:\n        return _layer_bytes(",
             "    if True:\n        return _layer_bytes("),),
           ("tests/test_plan_recompute.py",)),
    Mutant("search_replays_every_layer", "src/orangetron/plan/search.py",
           (("        scored = _replay_fewer_layers(model, cluster, scored, top, limit, overhead)\n",
             "        pass\n"),),
           ("tests/test_plan_search.py::test_search_replays_as_few_layers_as_the_memory_needs",
            "tests/test_plan_cli.py::test_plan_replays_only_the_layers_memory_needs")),
    Mutant("search_replays_one_layer_too_many", "src/orangetron/plan/search.py",
           (("        while r > 1 and total(r - 1) <= limit:\n            r -= 1\n"
             "        return replace(job, recompute_layers=r)",
             "        return replace(job, recompute_layers=r + 1)"),),
           ("tests/test_plan_search.py::test_search_replays_as_few_layers_as_the_memory_needs",
            "tests/test_plan_cli.py::test_plan_replays_only_the_layers_memory_needs")),
    Mutant("search_refines_nothing_near_the_top", "src/orangetron/plan/search.py",
           (("                if job.recompute == \"full\" and not job.recompute_layers and (deg, job) not in done]",
             "                if False]"),),
           ("tests/test_plan_search.py::test_search_replays_as_few_layers_as_the_memory_needs",
            "tests/test_plan_cli.py::test_plan_replays_only_the_layers_memory_needs")),
    Mutant("search_prunes_by_a_bound_on_replays", "src/orangetron/plan/search.py",
           (("        todo = [i for i, (_, _, deg, job, _) in enumerate(scored)",
             "        todo = [i for i, (t, _, deg, job, _) in enumerate(scored)"),
            ("                if job.recompute == \"full\" and not job.recompute_layers and (deg, job) not in done]",
             "                if job.recompute == \"full\" and not job.recompute_layers and (deg, job) not in done\n"
             "                and t / 1.5 < cutoff]")),
           ("tests/test_plan_search.py::test_partial_recompute_reaches_the_top_from_far_behind",)),
    Mutant("recompute_closes_its_pricing_class", "src/orangetron/plan/search.py",
           (("        key = (cls, job.recompute) if partial and job.recompute != \"none\" else cls",
             "        key = cls"),),
           ("tests/test_plan_search.py::test_partial_recompute_keeps_options_a_uniform_one_would_dominate",)),
    Mutant("search_keeps_the_first_full_recompute_that_fits", "src/orangetron/plan/search.py",
           (("            if cls not in smallest or mem[\"total\"] < smallest[cls][1][\"total\"]:",
             "            if cls not in smallest:"),),
           ("tests/test_plan_search.py::test_partial_recompute_keeps_options_a_uniform_one_would_dominate",)),
    Mutant("replay_transient_ignores_what_kept_layers_freed", "src/orangetron/plan/activations.py",
           (("    return max(0, largest - freed)", "    return largest"),),
           ("tests/test_plan_recompute.py",)),
    Mutant("replay_transient_of_the_first_layer", "src/orangetron/plan/activations.py",
           (("    largest = max(layer_activation_bytes(m, deg, whole, moe) for moe in {m.is_moe_layer(i) for i in "
             "split[True]})",
             "    largest = layer_activation_bytes(m, deg, whole, m.is_moe_layer(layers[0]))"),),
           ("tests/test_plan_recompute.py",)),
    Mutant("replayed_share_by_layer_count", "src/orangetron/plan/timing.py",
           (("    flops = [_layer_forward_flops(model, i, job.seq_len) for i in range(model.num_layers)]",
             "    flops = [1.0] * model.num_layers"),),
           ("tests/test_plan_recompute.py",)),
    # ---- SMs set aside for the deepep kernels for the whole step -------------------------------------------------
    Mutant("reserved_sms_leave_compute_alone", "src/orangetron/plan/timing.py",
           (("        cluster = _with_sms_reserved(cluster, job.ep_comm_sms)", "        pass"),),
           ("tests/test_plan_node_dispatch.py",)),
    Mutant("reserved_sms_still_contend", "src/orangetron/plan/timing.py",
           (("    share = 0.0 if job.ep_comm_sms_reserved else node_dispatch.sm_share(job, cluster)",
             "    share = node_dispatch.sm_share(job, cluster)"),),
           ("tests/test_plan_node_dispatch.py",)),
    Mutant("reserved_sms_keep_every_peak", "src/orangetron/spec/hardware.py",
           (("        return replace(self, sms=self.sms - reserved, bf16_tflops=self.bf16_tflops * left,",
             "        return replace(self, sms=self.sms - reserved, bf16_tflops=self.bf16_tflops,"),),
           ("tests/test_plan_node_dispatch.py",)),
    Mutant("search_drops_the_reserved_sms", "src/orangetron/plan/search.py",
           (("ep_comm_sms_reserved=base.ep_comm_sms_reserved and DISPATCHERS[disp].node_aware",
             "ep_comm_sms_reserved=False"),),
           ("tests/test_plan_node_dispatch.py::test_plan_keeps_the_sms_set_aside",)),
    Mutant("tracing_stopped_after_a_measurement", "src/orangetron/memory.py",
           (("            peak.python_bytes = max(0, tracemalloc.get_traced_memory()[1] - live_before)\n",
             "            peak.python_bytes = max(0, tracemalloc.get_traced_memory()[1] - live_before)\n"
             "            tracemalloc.stop()\n"),),
           ("tests/test_memory.py::test_python_peaks_of_consecutive_blocks_and_tracing_left_on",)),
    Mutant("earlier_blocks_frees_count_against_a_later_block", "src/orangetron/memory.py",
           (("            tracemalloc.clear_traces()\n", "            pass\n"),),
           ("tests/test_memory.py::test_python_peaks_of_consecutive_blocks_and_tracing_left_on",)),
    Mutant("zb_h1_weight_gradient_fills_any_gap", "src/orangetron/spec/schedule.py",
           (("(forward + input_grad - min(weight_grad, forward, input_grad))",
             "(forward + input_grad - weight_grad)"),),
           ("tests/test_plan_schedule.py",)),
    Mutant("zb_h1_weight_gradients_not_deferred", "src/orangetron/spec/schedule.py",
           (("            if len(waiting) > rank:", "            if len(waiting) > 0:"),),
           ("tests/test_plan_schedule.py",)),
    Mutant("zb_h1_holds_what_1f1b_holds", "src/orangetron/spec/schedules.py",
           (("    in_flight=lambda pp, v, m, stage: float(min(pp, m)),",
             "    in_flight=lambda pp, v, m, stage: float(min(pp - stage, m)),"),),
           ("tests/test_plan_schedule.py", "tests/test_plan_timing.py")),
    Mutant("zb_h1_bubble_priced_as_1f1b", "src/orangetron/plan/timing.py",
           (('    if schedule.split_backward:  # exposed', '    if False:  # exposed'),),
           ("tests/test_plan_timing.py",)),
    Mutant("zb_h1_head_weight_gradient_left_out", "src/orangetron/plan/timing.py",
           (("        wgrad += weight_grad_time(*shape)", "        pass"),),
           ("tests/test_plan_timing.py",)),
    Mutant("zb_h1_dgrad_taken_for_wgrad", "src/orangetron/plan/timing.py",
           (("    return fwd, dgrad + wgrad, wgrad", "    return fwd, dgrad + wgrad, dgrad"),),
           ("tests/test_plan_timing.py",)),
    Mutant("zb_h1_w_state_shrinks_with_recompute", "src/orangetron/plan/activations.py",
           (("    return int(waiting_for_b + w_state * stage)",
             "    return int(waiting_for_b + _saved_bytes(m, deg, job, stage, layers) * stage)"),),
           ("tests/test_plan_timing.py",)),
    Mutant("zb_h1_w_state_without_output_gradients", "src/orangetron/plan/activations.py",
           (("    return sum(rows * (x.g * k + x.a * n) for rows, k, n in gemms)",
             "    return sum(rows * x.g * k for rows, k, n in gemms)"),),
           ("tests/test_plan_timing.py",)),
    Mutant("zb_h1_w_state_without_q_projections", "src/orangetron/plan/activations.py",
           (("[(sb, h // rep, m.q_lora_rank), (sb, m.q_lora_rank, heads * m.qk_head_dim)] if m.q_lora_rank",
             "[] if m.q_lora_rank"),),
           ("tests/test_plan_timing.py",)),
    Mutant("zb_h1_shared_w_still_hides_traffic", "src/orangetron/plan/timing.py",
           (("    shared_b = cost.shared_b - (cost.shared_w if SCHEDULES[job.pp_schedule].split_backward else 0.0)",
             "    shared_b = cost.shared_b"),),
           ("tests/test_plan_timing.py",)),
    Mutant("zb_h1_routed_experts_w_dropped", "src/orangetron/plan/timing.py",
           (("    return gemms[0] * chunks, gemms[1] * chunks, gemms[2] * chunks",
             "    return gemms[0] * chunks, gemms[1] * chunks, 0.0"),),
           ("tests/test_plan_timing.py",)),
    Mutant("zb_h1_forward_is_gemms_only", "src/orangetron/plan/timing.py",
           (("            forward += count * cost.forward", "            forward += count * cost.gemm_f"),),
           ("tests/test_plan_timing.py",)),
    Mutant("layout_ignored_by_parameters", "src/orangetron/plan/params.py",
           (("    for i in stage_layers(model.num_layers, pp, virtual_stages, stage, layout):",
             "    for i in stage_layers(model.num_layers, pp, virtual_stages, stage):"),),
           ("tests/test_plan_stages.py",)),
    Mutant("layout_ignored_by_timing", "src/orangetron/plan/timing.py",
           (("stage_layer_counts(model, deg.pp, job.virtual_stages, stage, job.pipeline_layout)\n        yield",
             "stage_layer_counts(model, deg.pp, job.virtual_stages, stage)\n        yield"),),
           ("tests/test_plan_stages.py",)),
    Mutant("layout_ignored_by_activations", "src/orangetron/plan/activations.py",
           (("    layers = stage_layers(m.num_layers, deg.pp, job.virtual_stages, stage, job.pipeline_layout)",
             "    layers = stage_layers(m.num_layers, deg.pp, job.virtual_stages, stage)"),),
           ("tests/test_plan_stages.py", "tests/test_plan_mtp.py")),
    Mutant("mtp_parameters_left_off", "src/orangetron/plan/params.py",
           (("        dense, expert = dense + model.mtp_layers * mtp.dense, expert + model.mtp_layers * mtp.expert",
             "        dense, expert = dense + model.mtp_layers * mtp.dense, expert"),),
           ("tests/test_plan_mtp.py",)),
    Mutant("mtp_head_pass_not_timed", "src/orangetron/plan/timing.py",
           (("    compute = run + proj[0] + proj[1] + sum(head) + loss",
             "    compute = run + proj[0] + proj[1] + loss"),),
           ("tests/test_plan_mtp.py",)),
    Mutant("mtp_head_buffers_not_held", "src/orangetron/plan/activations.py",
           (("(layer + inputs * in_flight(deg, job, stage) + head * head_in_flight(deg, job))",
             "(layer + inputs * in_flight(deg, job, stage))"),),
           ("tests/test_plan_mtp.py",)),
    Mutant("mtp_flops_not_counted", "src/orangetron/plan/timing.py",
           (("attention * model.num_layers + head + mtp)", "attention * model.num_layers + head)"),),
           ("tests/test_plan_mtp.py",)),
    Mutant("mtp_traffic_not_counted", "src/orangetron/plan/traffic.py",
           (("        per_mb += _mtp_records(model, deg, job, ep_where) * model.mtp_layers", "        pass"),),
           ("tests/test_plan_mtp.py",)),
    Mutant("mtp_not_a_zero3_unit", "src/orangetron/plan/params.py",
           (("        layers += [mtp_module_params(model, deg.tp, deg.ep, deg.etp)] * model.mtp_layers",
             "        pass"),),
           ("tests/test_plan_mtp.py",)),
    Mutant("mtp_left_out_of_the_interleaved_peak", "src/orangetron/plan/activations.py",
           (("        weights[-1] += head + m.mtp_layers * (sum(_mtp_layer_bytes(m, deg, job)) + head)",
             "        weights[-1] += head"),),
           ("tests/test_plan_mtp.py",)),
    Mutant("mtp_w_state_not_held_under_zero_bubble", "src/orangetron/plan/activations.py",
           (("weight_grad_state_bytes(m, deg, without_recompute(job), moe) * stage",
             "weight_grad_state_bytes(m, deg, without_recompute(job), moe) * 0"),),
           ("tests/test_plan_mtp.py",)),
    Mutant("mtp_moe_layer_sends_no_tokens", "src/orangetron/plan/traffic.py",
           (("    if model.is_moe_layer(i):\n        out += expert_parallel_records(model, deg, layer_job, ep_where)",
             "    if False:\n        out += expert_parallel_records(model, deg, layer_job, ep_where)"),),
           ("tests/test_plan_mtp.py",)),
    Mutant("mtp_embedding_copy_left_off", "src/orangetron/plan/params.py",
           (("            dense += _ceil_div(model.vocab_size * model.hidden_size, t)\n", "            pass\n"),),
           ("tests/test_plan_mtp.py",)),
    Mutant("layout_ignored_by_replay", "src/orangetron/spec/stages.py",
           (("    chunks = chunk_layers(num_layers, pp * virtual_stages, layout)\n    mine =",
             "    chunks = chunk_layers(num_layers, pp * virtual_stages)\n    mine ="),),
           ("tests/test_plan_stages.py",)),
    Mutant("layout_ignored_by_fp8_copies", "src/orangetron/plan/fp8.py",
           (("    params = stage_params(model, deg, stage, job.virtual_stages, job.pipeline_layout).total",
             "    params = stage_params(model, deg, stage, job.virtual_stages).total"),),
           ("tests/test_plan_stages.py",)),
    Mutant("optimizer_of_stage_0_only", "src/orangetron/plan/timing.py",
           (("    optimizer = _optimizer_time(model, deg, job, cluster, eff, kinds[heavy])",
             "    optimizer = _optimizer_time(model, deg, job, cluster, eff, 0)"),),
           ("tests/test_plan_stages.py",)),
    Mutant("replay_transient_of_the_first_chunk_only", "src/orangetron/plan/activations.py",
           (("    return peak + max(_stage_replay_transient(m, deg, job, stage, layers) for layers in chunks)",
             "    return peak + _stage_replay_transient(m, deg, job, stage, next(chunks))"),),
           ("tests/test_plan_stages.py",)),
    Mutant("mtp_replay_transient_forgotten", "src/orangetron/plan/activations.py",
           (("    return max(mtp, _replay_transient(m, deg, job, stage, layers))",
             "    return _replay_transient(m, deg, job, stage, layers)"),),
           ("tests/test_plan_mtp.py",)),
    # ---- variants registered once (spec/variants.py) and rules once (spec/rules.py) ----------------------
    Mutant("plugins_never_loaded", "src/orangetron/spec/variants.py",
           (("        importlib.import_module(self._builtins)\n        load_plugins()",
             "        importlib.import_module(self._builtins)"),),
           ("tests/test_plugins.py::test_train_help_lists_the_plugins_only_when_the_hook_names_them",)),
    Mutant("planner_only_variant_runs", "src/orangetron/spec/variants.py",
           (("        if record.runtime is None:", "        if False:"),),
           ("tests/test_plan_timing.py::test_zero_bubble_h1_is_priced_not_run",)),
    Mutant("cp_mode_saved_bytes_ignored", "src/orangetron/plan/activations.py",
           (("        total += mode.saved_bytes(m, x, job, heads, kv)", "        total += 0"),),
           ("tests/test_plan_activations_exact.py", "tests/test_context_parallel.py")),
    Mutant("cp_mode_overlaps_nothing", "src/orangetron/spec/variants.py",
           (('    overlapped_ops: tuple[str, ...] = ("send_recv",)', "    overlapped_ops: tuple[str, ...] = ()"),),
           ("tests/test_plan_golden.py",)),
    Mutant("capacity_rows_unpadded", "src/orangetron/spec/dispatchers.py",
           (("    rows=_capacity_rows, pads=True))", "    pads=True))"),),
           ("tests/test_plan_golden.py",)),
    Mutant("schedule_peak_off_by_one", "src/orangetron/spec/schedule.py",
           (("    return peak / virtual_stages", "    return (peak - 1) / virtual_stages"),),
           ("tests/test_plan_schedule.py::test_a_schedule_without_formulas_is_priced_from_its_action_lists",)),
    Mutant("held_outputs_count_every_chunk", "src/orangetron/plan/activations.py",
           (("[a for a in actions(p, m, job.pp_schedule, v)[p - 1] if a.chunk == v - 1]",
             "actions(p, m, job.pp_schedule, v)[p - 1]"),),
           ("tests/test_plan_schedule.py::test_a_schedule_without_formulas_is_priced_from_its_action_lists",)),
    # ---- one options type: the runtime's ParallelConfig inside the planner's Job and the trainer's TrainConfig ----
    Mutant("job_json_publishes_the_shared_names", "src/orangetron/spec/options.py",
           (('PUBLISHED_AS = {"microbatches": "num_microbatches", "grad_bucket_numel": "bucket_numel"}',
             'PUBLISHED_AS: dict[str, str] = {}'),),
           ("tests/test_plan_cli.py::test_estimate_json_job_keeps_its_published_keys", "tests/test_plan_golden.py")),
    Mutant("job_json_prints_null_for_the_params_reduce_dtype", "src/orangetron/spec/options.py",
           (('    if name == "reduce_dtype" and value is None:\n        return ""\n', ""),),
           ("tests/test_plan_cli.py::test_estimate_json_job_keeps_its_published_keys", "tests/test_plan_golden.py")),
    Mutant("runtime_runs_planner_only_dispatchers", "src/orangetron/parallel/config.py",
           (("    DISPATCHERS.runtime_record(config.dispatcher)\n", "    DISPATCHERS[config.dispatcher]\n"),),
           ("tests/test_plan_node_dispatch.py::test_traffic_records_need_the_placement_and_the_runtime_refuses_deepep",)),
    Mutant("runtime_builds_expert_tensor_parallel_layouts", "src/orangetron/mesh.py",
           (("    if layout.expert_fold or layout.etp != 1:", "    if layout.expert_fold:"),),
           ("tests/test_train.py::test_config_rejects_bad_values",)),
    Mutant("train_options_without_flags_never_reach_the_runtime", "src/orangetron/train/config.py",
           (("        return ParallelConfig(**values_of(ParallelConfig, self))",
             "        return ParallelConfig(**{k: v for k, v in values_of(ParallelConfig, self).items()\n"
             "                                 if k not in WITHOUT_FLAGS})"),),
           ("tests/test_train_outputs.py::test_options_train_takes_no_flag_for_still_reach_the_runtime",)),
    Mutant("rule_sp_shard_unchecked", "src/orangetron/spec/rules.py",
           (("    if tp > 1 and (seq_len // cp) % tp:", "    if False:"),),
           ("tests/test_rules.py",)),
    Mutant("train_skips_the_heads_split", "src/orangetron/train/config.py",
           (("        if split > 1:\n            rules.heads_split_by_all_to_all",
             "        if split > 99:\n            rules.heads_split_by_all_to_all"),),
           ("tests/test_rules.py",)),
    # ---- pipeline transfers in one order ------------------------------------------------------------
    Mutant("pipeline_transfers_ordered_by_microbatch_not_by_time", "src/orangetron/spec/transfers.py",
           (("    for t in sorted(transfers):",
             "    for t in sorted(transfers, key=lambda t: (t.microbatch, t.low_stage, t.backward)):"),),
           ("tests/test_pipeline_p2p.py",)),
    Mutant("pipeline_sends_posted_as_soon_as_produced", "src/orangetron/parallel/pipeline/executor.py",
           (("        self.produced[(from_stage, to_stage, microbatch)] = x.detach()\n",
             "        tag = 2 * (min(from_stage, to_stage) * self.m + microbatch) + int(to_stage < from_stage)\n"
             "        self.pending.append(comm.post_p2p([(x.detach(), self._rank_of(to_stage), tag)], [],"
             " self.group))\n"),
            ("            if op == \"send\" and key in self.produced:\n                x = self.produced.pop(key)\n"
             "                self.pending.append(comm.post_p2p([(x, self._rank_of(transfer.target), "
             "self._tag(transfer))], [],\n"
             "                                                  self.group))\n",
             "            if op == \"send\":\n                pass\n")),
           ("tests/test_pipeline_p2p.py",)),
    Mutant("ring_gradients_waited_for_at_once", "src/orangetron/parallel/context/ring.py",
           (("            dkv = torch.zeros_like(kv) if step == 0 else grad_ring.wait()\n",
             "            dkv = torch.zeros_like(kv) if step == 0 else dkv\n"),
            ("            grad_ring.start(dkv)  # on to the next rank, with its K,V; it ends at their owner\n",
             "            dkv = grad_ring.exchange(dkv)\n"),
            ("        dkv = grad_ring.wait()\n", "        dkv = dkv\n")),
           ("tests/test_context_attention.py",)),
    Mutant("fused_adamw_decays_norms_and_biases", "src/orangetron/parallel/data/optim.py",
           (("weight_decay=self.weight_decay if decays else 0.0", "weight_decay=self.weight_decay"),),
           ("tests/test_flat_adamw.py",)),
    Mutant("rendezvous_lets_a_call_meet_the_peers_next_batch", "src/orangetron/spec/rendezvous.py",
           (("    return peer_batch <= current[peer]", "    return peer_batch <= current[peer] + 1"),),
           ("tests/test_pipeline_p2p.py",)),
    # ---- the one model schema -------------------------------------------------------------------------------
    Mutant("runtime_builds_a_gelu_spec_as_swiglu", "src/orangetron/model/config.py",
           (('        ("mlp", spec.mlp == "swiglu",', '        ("mlp", True,'),),
           ("tests/test_model_schema.py::test_the_runtime_refuses_each_field_it_cannot_build_in_one_line",)),
    Mutant("train_config_skips_the_runtime_refusal", "src/orangetron/train/config.py",
           (("        self._check_model()\n", ""),),
           ("tests/test_model_schema.py::test_the_runtime_refuses_each_field_it_cannot_build_in_one_line",)),
    Mutant("old_checkpoint_record_read_as_the_schema", "src/orangetron/model/config.py",
           (('    if "hidden_size" in record:\n', "    if True:\n"),),
           ("tests/test_model_schema.py::test_a_record_in_the_old_runtime_names_is_the_same_model",
            "tests/test_checkpoint.py::test_a_checkpoint_recording_the_old_runtime_names_resumes")),
    Mutant("moe_ffn_dim_defaults_to_half_the_dense_width", "src/orangetron/model/config.py",
           (('        arguments["moe_ffn_dim"] = ffn_dim\n', '        arguments["moe_ffn_dim"] = ffn_dim // 2\n'),),
           ("tests/test_model.py::test_config_defaults_and_presets",
            "tests/test_model_schema.py::test_model_config_is_the_schema_with_the_runtime_defaults")),
    Mutant("dense_model_config_keeps_routing_defaults", "src/orangetron/model/config.py",
           (("    if not n_experts:\n        arguments.update(", "    if False:\n        arguments.update("),),
           ("tests/test_model_schema.py::test_model_config_is_the_schema_with_the_runtime_defaults",)),
    # ---- low precision, checked by value against float64 (tests/test_low_precision.py) --------------------
    Mutant("rope_angles_in_the_model_dtype", "src/orangetron/model/layers.py",
           (("    angles = position_ids.to(torch.float64).unsqueeze(-1) * inv_freq  # [..., S, D/2]",
             "    angles = position_ids.to(dtype).unsqueeze(-1) * inv_freq.to(dtype)  # [..., S, D/2]"),),
           ("tests/test_low_precision.py::test_rotary_tables_past_4096_are_the_float64_angles_rounded_once",)),
    Mutant("cross_entropy_without_its_max_shift", "src/orangetron/model/autograd.py",
           (("        shifted = logits - logits.amax(-1, keepdim=True)  # [N, V], <= 0",
             "        shifted = logits.clone()  # [N, V], <= 0"),),
           ("tests/test_low_precision.py::test_cross_entropy_of_huge_logits_matches_float64",)),
    Mutant("cross_entropy_loss_from_the_logsumexp_at_the_logits_size", "src/orangetron/model/autograd.py",
           (("        loss = ((sums.log() - target_logit).squeeze(-1) * valid).sum() / n_valid",
             "        loss = ((logits.logsumexp(-1, keepdim=True) - logits.gather(-1, target)).squeeze(-1) * valid"
             ").sum() / n_valid"),),
           ("tests/test_low_precision.py::test_cross_entropy_of_huge_logits_matches_float64",)),
    Mutant("vocab_cross_entropy_without_its_max_shift", "src/orangetron/parallel/tensor.py",
           (("        shifted = logits - row_max\n", "        shifted = logits\n"),),
           ("tests/test_low_precision.py",)),
    Mutant("ring_merge_in_the_input_dtype", "src/orangetron/parallel/context/ring.py",
           (("        out = torch.zeros(q.shape, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)",
             "        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)"),),
           ("tests/test_low_precision.py",)),
    Mutant("ring_dq_accumulated_in_the_input_dtype", "src/orangetron/parallel/context/ring.py",
           (("        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)",
             "        dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)"),),
           ("tests/test_low_precision.py",)),
    Mutant("grad_reduction_ignores_the_reduce_dtype", "src/orangetron/parallel/data/flat.py",
           (("        wire = full.to(DTYPES[cfg.wire_dtype])", "        wire = full.to(DTYPES[cfg.param_dtype])"),),
           ("tests/test_low_precision.py",)),
    Mutant("grad_buckets_ignore_the_reduce_dtype", "src/orangetron/parallel/data/buckets.py",
           (("        wire = region.to(DTYPES[self.buffers.config.wire_dtype])  # the region itself",
             "        wire = region.to(DTYPES[self.buffers.config.param_dtype])  # the region itself"),),
           ("tests/test_low_precision.py",)),
    Mutant("main_grads_in_the_param_dtype", "src/orangetron/parallel/data/flat.py",
           (("        main_dtype = torch.float32 if cfg.mixed_precision else DTYPES[cfg.param_dtype]",
             "        main_dtype = DTYPES[cfg.param_dtype]"),),
           ("tests/test_low_precision.py",)),
    Mutant("router_logits_rounded_to_the_model_dtype", "src/orangetron/model/autograd.py",
           (("        return x.to(acc) @ weight.to(acc).t()  # [T, E]",
             "        return (x @ weight.t()).to(acc)  # [T, E]"),),
           ("tests/test_low_precision.py::test_router_logits_are_float32_and_routing_moves_only_at_true_near_ties",)),
    Mutant("router_ties_left_to_topk", "src/orangetron/model/moe.py",
           (("    order = torch.sort(values, dim=-1, descending=True, stable=True).indices  # [..., n]\n"
             "    return order[..., :k].contiguous()",
             "    return torch.topk(values, k, dim=-1).indices"),),
           ("tests/test_low_precision.py::test_equal_scores_go_to_the_lower_expert_id",)),
    # ---- sampling (tests/test_sample.py) ------------------------------------------------------------------
    Mutant("decode_steps_rotated_one_position_too_far", "src/orangetron/model/decode.py",
           (("    positions = torch.arange(start, start + s, device=tokens.device)",
             "    positions = torch.arange(start, start + s, device=tokens.device) + (start > 0)"),),
           ("tests/test_sample.py",)),
    Mutant("top_k_keeps_one_token_too_many", "src/orangetron/model/sampling.py",
           (("        kept = top_indices(scaled, sampling.top_k)",
             "        kept = top_indices(scaled, sampling.top_k + 1)"),),
           ("tests/test_sample.py",)),
    Mutant("sampling_ignores_the_temperature", "src/orangetron/model/sampling.py",
           (("torch.float32)) / sampling.temperature  # [B, V]", "torch.float32))  # [B, V]"),),
           ("tests/test_sample.py",)),
]


def check(mutants: list[Mutant]) -> list[str]:
    """Problems with the list itself: a snippet that is missing or occurs more than once, a missing test file."""
    problems = []
    for m in mutants:
        text = (ROOT / m.file).read_text(encoding="utf-8")
        for original, _ in m.edits:
            count = text.count(original)
            if count != 1:
                problems.append(f"{m.name}: {m.file} holds the original snippet {count} times, not once: "
                                f"{original.strip().splitlines()[0]!r}")
        problems += [f"{m.name}: no test file {t}" for t in m.tests if not (ROOT / t.split("::")[0]).exists()]
    return problems


def plant(m: Mutant, tree: Path) -> None:
    if not m.edits:
        return
    path = tree / m.file
    text = path.read_text(encoding="utf-8")
    for original, replacement in m.edits:
        text = text.replace(original, replacement, 1)
    path.write_text(text, encoding="utf-8")


NO_MUTANT = Mutant("baseline", "", (), ())


def run_one(m: Mutant, timeout: float) -> dict[str, object]:
    """Copy the tree, plant `m`, run its selection; killed when the selection fails or hangs."""
    with tempfile.TemporaryDirectory(prefix="orangetron-mutant-") as tmp:
        tree = Path(tmp) / "repo"
        shutil.copytree(ROOT, tree, ignore=COPY_IGNORE)
        plant(m, tree)
        # The copy's src first, so the installed package (an editable install of the working tree) loses.
        paths = [str(tree / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        _check_imports_from(tree, env)
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
            code, stdout = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired:
            code, stdout = None, f"timed out after {timeout:.0f}s"
    return {"mutant": m.name, "file": m.file, "tests": list(m.tests), "status": _status(code),
            "caught_by": _failed_test(stdout), "pytest": (stdout.strip().splitlines() or [""])[-1],
            "seconds": round(time.monotonic() - start, 1)}


def _check_imports_from(tree: Path, env: dict[str, str]) -> None:
    probe = "import importlib.util; print(importlib.util.find_spec('orangetron').origin)"
    origin = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stdout.strip()
    if not Path(origin).is_relative_to(tree):
        raise RuntimeError(f"the tests would import orangetron from {origin}, not from the mutated copy {tree}")


def _status(code: int | None) -> str:
    # pytest exits 1 when a test fails and 2 when collection fails (the mutant broke an import); a hang
    # (None) is caught too. 3-5 (internal error, bad usage, nothing collected) say nothing about the mutant.
    if code == 0:
        return "SURVIVED"
    return "killed" if code in (1, 2, None) else f"error (pytest exit {code})"


def _failed_test(stdout: str) -> str | None:
    for line in stdout.splitlines():  # "FAILED tests/x.py::test_y[a b] - AssertionError: ..."
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ", 1)[0]
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("words", nargs="*", help="run only mutants whose name contains one of these")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the first run of every selection on the unmutated tree")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant's test run")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.words or any(w in m.name for w in args.words)]
    problems = check(chosen)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            print(json.dumps({"mutant": m.name, "file": m.file, "tests": list(m.tests)}))
        return 0
    if not args.no_baseline:
        # A selection that fails on the unmutated tree would "kill" every mutant it is given.
        selections = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        baseline = run_one(dataclasses.replace(NO_MUTANT, tests=selections), args.timeout)
        baseline["status"] = "passed" if baseline["status"] == "SURVIVED" else "failed"
        print(json.dumps(baseline), flush=True)
        if baseline["status"] != "passed":
            print("the selections fail without any mutant; fix the tests first", file=sys.stderr)
            return 2
    results = []
    for m in chosen:
        results.append(run_one(m, args.timeout))
        print(json.dumps(results[-1]), flush=True)
    survivors = [r["mutant"] for r in results if r["status"] == "SURVIVED"]
    errors = [r["mutant"] for r in results if r["status"].startswith("error")]
    killed = len(results) - len(survivors) - len(errors)
    print(f"mutants: {len(results)}, killed: {killed}, survived: {len(survivors)}, errors: {len(errors)}"
          + (f"; survivors: {', '.join(survivors)}" if survivors else ""))
    return 1 if survivors or errors else 0


if __name__ == "__main__":
    sys.exit(main())
