"""One layout against one device and against the planner: the harness the per-dimension tests share.

`layout_run` trains STEPS steps on one rank of a layout through `ot.parallelize` (context-parallel ranks
take their head-tail shard of every sequence); `check_layout` compares every rank's results with the plain
single-device model (F.cross_entropy, torch.optim.AdamW, torch's clipping) in float64 to 1e-9, and each
rank's ledger and memory of one step with `plan.bridge.predicted_step`, record for record and byte for byte.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from orangetron import comm, memory
from orangetron.mesh import init_mesh
from orangetron.model import ModelConfig, Transformer
from orangetron.model.documents import Documents
from orangetron.model.moe import Router
from orangetron.parallel import ParallelConfig, context, parallelize
from orangetron.parallel.expert import update_router_bias
from orangetron.parallel.pipeline import MicroBatch, run_pipeline
from orangetron.plan.bridge import predicted_step
from orangetron.spec.layout import Layout

SEQ, PER_RANK, STEPS, LR, CLIP = 8, 2, 3, 3e-2, 0.5


def batch(step: int, rows: int, vocab: int, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(step))


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), foreach=False)


def packed(rows: int, doc_lengths: tuple[int, ...]) -> Documents | None:
    """Every row packed with documents of `doc_lengths` (None for none)."""
    if not doc_lengths:
        return None
    ids = torch.repeat_interleave(torch.arange(len(doc_lengths)), torch.tensor(doc_lengths))
    return Documents.from_ids(ids.expand(rows, -1))


def reference(cfg: ModelConfig, dp: int, seq: int = SEQ, per_rank: int = PER_RANK, doc_lengths: tuple[int, ...] = ()):
    """One device, the whole batch: losses, gradients by name per step, final parameters by name; each row packed
    with documents of `doc_lengths`, if any."""
    model = Transformer(cfg, seed=0, dtype=torch.float64)
    opt = adamw(model)
    loads = _count_loads(model)
    losses, grads = [], []
    for step in range(STEPS):
        tokens = batch(step, dp * per_rank, cfg.vocab_size, seq)
        # The model's own balancing loss is part of the single-device objective (0 when its coefficient is).
        logits = model(tokens[:, :-1], documents=packed(tokens.shape[0], doc_lengths))
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + model.aux_loss()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=False)
        opt.step()
        _move_biases(model, loads, cfg.router_bias_rate)
        opt.zero_grad()
        losses.append(loss.item())
    # Buffers (the routers' biases) are compared with the parameters.
    return losses, grads, {n: p.detach().clone() for n, p in (*model.named_parameters(), *model.named_buffers())}


def _count_loads(model: torch.nn.Module) -> dict[Router, torch.Tensor]:
    """Per router, the assignments of the step so far, read from the top-k ids each router returns."""
    loads = {}
    for router in (m for m in model.modules() if isinstance(m, Router)):
        loads[router] = torch.zeros(router.n_experts)

        def hook(module, _inputs, outputs):
            loads[module] += torch.bincount(outputs[0].flatten(), minlength=module.n_experts)
        router.register_forward_hook(hook)
    return loads


def _move_biases(model: torch.nn.Module, loads: dict[Router, torch.Tensor], rate: float) -> None:
    """DeepSeek-V3's update, by hand: under-loaded experts' biases up by `rate`, over-loaded down."""
    for router, load in loads.items():
        if router.expert_bias is not None:
            router.expert_bias += rate * torch.sign(load.mean() - load).to(router.expert_bias.dtype)
        load.zero_()


def _forward_loss(dp, rows: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
    """As the trainer: this rank's share of the sequence under cp (head-tail, or balanced over `documents`),
    global positions (within their documents)."""
    inputs, labels, positions = rows[:, :-1], rows[:, 1:], None
    if dp.mesh["cp"].size > 1:
        cuts = None if documents is None else documents.cuts
        positions = context.position_ids(inputs.shape[1], dp.mesh) if documents is None else \
            context.shard(documents.positions(), dp.mesh, cuts=cuts)
        inputs, labels = context.shard(inputs, dp.mesh, cuts=cuts), context.shard(labels, dp.mesh, cuts=cuts)
    logits = dp(inputs, position_ids=positions, token_mask=labels >= 0, documents=documents)
    return dp.module.loss_from_logits(logits, labels)


def _pipeline_loss(dp, rows: torch.Tensor, pc: ParallelConfig) -> torch.Tensor | None:
    """Forward and backward of every micro-batch through `pc.pp_schedule`; the loss on the last stage."""
    inputs, labels = rows[:, :-1], rows[:, 1:]
    positions = torch.arange(inputs.shape[1])
    if dp.mesh["cp"].size > 1:
        positions = context.position_ids(inputs.shape[1], dp.mesh)
        inputs, labels = context.shard(inputs, dp.mesh), context.shard(labels, dp.mesh)
    m = pc.microbatches
    mbs = [MicroBatch(x, y, positions, y >= 0, 1 / m, 1 / m)
           for x, y in zip(inputs.chunk(m), labels.chunk(m), strict=True)]
    loss = run_pipeline(dp, mbs, pc.pp_schedule, pc.virtual_stages)
    return None if loss is None else torch.tensor(loss, dtype=torch.float64)


def layout_run(cfg: ModelConfig, layout: Layout, pc: ParallelConfig, seq: int = SEQ, per_rank: int = PER_RANK,
               doc_lengths: tuple[int, ...] = ()) -> dict:
    """STEPS steps on this rank: losses, whole gradients and parameters (rank 0), step 2's ledger and
    memory, what autograd Functions keep on ctx, and which custom Functions the graph holds. Rows are packed
    with documents of `doc_lengths`, if any (no pipeline)."""
    mesh = init_mesh(layout)
    dp = parallelize(Transformer(cfg, seed=0, dtype=torch.float64), mesh, pc)
    opt = dp.optimizer(lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    g = mesh["dp"]
    out = {"losses": [], "grads": []}
    for step in range(STEPS):
        rows = batch(step, g.size * per_rank, cfg.vocab_size, seq)[g.rank * per_rank:(g.rank + 1) * per_rank]
        with comm.measure() as records, memory.track_activations(dp.module) as meter:
            if layout.pp > 1:
                loss = _pipeline_loss(dp, rows, pc)
                out["kept"] = []
            else:
                loss = _forward_loss(dp, rows, packed(rows.shape[0], doc_lengths))
                if step == 0:  # every tensor kept for backward must be one the activation meter sees
                    out["kept"] = memory.tensors_kept_on_ctx(loss)
                    out["functions"] = {type(node).__name__ for node in memory.custom_function_nodes(loss)}
                loss.backward()
            dp.reduce_gradients()
            with comm.unmeasured():
                out["grads"].append(dp.full_grads())
            opt.clip_grad_norm_(CLIP)
            opt.step()
            update_router_bias(dp.module, mesh, pc.sequence_parallel)
            opt.zero_grad()
        out["losses"].append(None if loss is None else loss.item())
        if step == 1:
            out["ledger"] = sorted((r.op, r.dim, r.payload_bytes, r.bytes_sent, r.bytes_received) for r in records)
            peak = meter.peak_bytes
    out["memory"] = memory.model_state_bytes(dp, opt) | {"activations": peak}
    out["tied"] = _tied_embedding(dp)
    state = dp.full_state(opt)
    out["params"] = state["params"] | state["buffers"]
    if mesh.rank != 0:  # whole tensors are the same on every rank; send them once
        out["grads"] = out["params"] = None
    return out


def _tied_embedding(dp) -> torch.Tensor | None:
    """This stage's whole copy of a tied embedding (first and last pipeline stage), else None: the two must end
    equal (whole tensors name the first stage's only)."""
    from orangetron.parallel.data.whole import _whole

    buffers = dp.dp_buffers
    if buffers.tied is None:
        return None
    mine = {}
    for part in buffers.parts:
        mine |= _whole(buffers, part, part.gather_owned(part.main_params))
    return mine["tok_embeddings.weight"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-300)).item()


def assert_equals_reference(losses: list[float], grads: list[dict], params: dict, cfg: ModelConfig, dp: int,
                            where: str, seq: int = SEQ, rows: int = PER_RANK,
                            doc_lengths: tuple[int, ...] = ()) -> None:
    """Mean losses, whole gradients per step and final parameters against `reference` (1e-9 relative)."""
    ref_losses, ref_grads, ref_params = reference(cfg, dp, seq, rows, doc_lengths)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-9, atol=0, msg=where)
    assert set(params) == set(ref_params), where
    for step in range(STEPS):
        for name, ref in ref_grads[step].items():
            assert _rel(grads[step][name], ref) < 1e-9, f"{where} step {step} grad {name}"
    for name, ref in ref_params.items():
        assert _rel(params[name], ref) < 1e-9, f"{where} param {name}"


def check_layout(per_rank: list[dict], cfg: ModelConfig, layout: Layout, pc: ParallelConfig, where: str,
                 seq: int = SEQ, rows: int = PER_RANK, balanced_routing: bool = False,
                 ep_activations: bool = False, doc_lengths: tuple[int, ...] = ()) -> None:
    """Every rank of one `layout_run` against one device and against the planner. Under ep the dispatch's
    records and activations follow the routing, which the planner takes as balanced: the records are compared
    only when the model routes every token to every expert (`balanced_routing`: top_k = n_experts), and the
    activations only when asked (`ep_activations`, with balanced routing: the two-expert top-2 model of
    tests/test_recompute.py matches to the byte, while the planner counts 8 bytes more per MoE layer for the
    four-expert top-4 model of tests/plugin_checks.py, not yet explained)."""
    # Every rank's loss is the mean over an equal share of the tokens (tp ranks repeat theirs); under pp only
    # the last stage's ranks have one.
    reporting = [r["losses"] for r in per_rank if r["losses"][0] is not None]
    losses = [sum(step) / len(reporting) for step in zip(*reporting, strict=True)]
    assert_equals_reference(losses, per_rank[0]["grads"], per_rank[0]["params"], cfg, layout.dp, where, seq, rows,
                            doc_lengths)
    assert not balanced_routing or cfg.top_k == cfg.n_experts, "balanced routing needs top_k = n_experts"
    copies = [r["tied"] for r in per_rank if r.get("tied") is not None]
    assert all(torch.equal(c, copies[0]) for c in copies), f"{where}: the tied embedding's copies differ"
    assert bool(copies) == (cfg.tied_embeddings and layout.pp > 1), where
    for rank, result in enumerate(per_rank):
        stage = layout.coordinates(rank).pp
        want_records, want_mem = predicted_step(cfg, layout, pc, seq_len=seq, micro_batch=rows // pc.microbatches,
                                                stage=stage, clip_grad=True, doc_lengths=doc_lengths,
                                                cp_rank=layout.coordinates(rank).cp)
        want = sorted((r.op, r.dim, r.payload_bytes, r.bytes_sent, r.bytes_received) for r in want_records)
        got, measured = result["ledger"], result["memory"]
        if layout.ep > 1:  # dispatch sizes follow the routing
            if not balanced_routing:
                got, want = ([r for r in rs if r[1] != "ep" or r[0] == "all_reduce"] for rs in (got, want))
            if not (balanced_routing and ep_activations):
                measured = {k: v for k, v in measured.items() if k != "activations"}
        assert result["kept"] == [], f"{where} rank {rank}"
        assert got == want, f"{where} rank {rank}"
        want_state = {k: want_mem[k] for k in measured}
        assert measured == want_state, f"{where} rank {rank}: {measured} != {want_state}"
