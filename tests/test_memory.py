"""Model-state and activation accounting against byte counts worked out by hand."""

import torch
from torch import nn

from orangetron import memory


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 16, dtype=torch.float64))

    def forward(self, x):
        h = x @ self.w  # saves x (4*8 float64 = 256 B) and w (a parameter: excluded)
        r = torch.relu(h)  # saves its result r (4*16 float64 = 512 B)
        return (r * r).sum()  # saves r twice: same storage, counted once


def test_activation_peak_of_a_small_graph():
    model = TwoLayer()
    x = torch.randn(4, 8, dtype=torch.float64)
    with memory.track_activations(model) as meter:
        loss = model(x)
        assert meter.live_bytes == 256 + 512
        loss.backward()
        del loss
    assert meter.peak_bytes == 768
    assert meter.live_bytes == 0  # backward freed every saved tensor
    assert memory.report()["activations"] == 768


def test_saved_views_share_their_storage():
    x = torch.randn(6, 4, requires_grad=True)
    with memory.track_activations() as meter:
        y = x.exp()  # saves its result: 96 B
        z = (y.view(4, 6).sin() * y.view(24)[:1]).sum()  # sin saves a view of y, mul saves two views of it
        assert meter.live_bytes == 96 + 96  # y once, plus sin's output (saved by mul)
        z.backward()
    assert meter.peak_bytes == 192


def test_model_state_bytes_by_category():
    model = nn.Linear(4, 3)  # float32: weight 48 B + bias 12 B
    opt = torch.optim.AdamW(model.parameters())
    assert memory.model_state_bytes(model, opt) == {"params": 60, "grads": 0, "main_params": 0, "optimizer": 0}
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    report = memory.model_state_bytes(model, opt)
    assert report == {"params": 60, "grads": 60, "main_params": 0, "optimizer": 120}  # exp_avg + exp_avg_sq
    main = [p.detach().double() for p in model.parameters()]
    assert memory.model_state_bytes(model, opt, main_params=main)["main_params"] == 120


def test_tied_parameters_count_once():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    assert memory.unique_storage_bytes([emb.weight, head.weight, emb.weight[2:]]) == 160
    assert memory.model_state_bytes(model)["params"] == 160


class Wrapper(nn.Module):
    """Stands for DataParallel: the wrapped model is `.module`."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def linear_step(model):
    with memory.track_activations(model):
        model(torch.ones(2, 4)).sum().backward()  # saves the 2x4 float32 input: 32 B


def test_report_never_returns_a_figure_of_another_model():
    import gc

    a = nn.Linear(4, 3)  # float32: 48 + 12 B of params
    memory.model_state_bytes(a)
    assert memory.report() == {"params": 60, "grads": 0, "main_params": 0, "optimizer": 0, "activations": None}
    linear_step(a)
    assert memory.report()["activations"] == 32 and memory.report()["params"] == 60
    b = nn.Linear(4, 5)  # 80 + 20 B
    memory.model_state_bytes(b)  # another model: a's activations are not b's
    assert memory.report() == {"params": 100, "grads": 0, "main_params": 0, "optimizer": 0, "activations": None}
    with memory.track_activations():  # no model named: a report of activations only
        (torch.ones(3, requires_grad=True) * 2).exp().sum().backward()  # exp saves its 12 B result
    assert memory.report() == {"params": None, "grads": None, "main_params": None, "optimizer": None,
                               "activations": 12}
    wrapped = Wrapper(b)
    linear_step(b)
    memory.model_state_bytes(wrapped)  # the wrapper's state joins the report of the module it wraps
    assert memory.report()["params"] == 100 and memory.report()["grads"] == 100
    assert memory.report()["activations"] == 32
    del wrapped, b
    gc.collect()
    assert memory.report() == dict.fromkeys(["params", "grads", "main_params", "optimizer", "activations"])


# ---- nothing kept on ctx, outside save_for_backward ---------------------------------------------------


class Handle:
    def __init__(self, t):
        self.t = t


class Leaky(torch.autograd.Function):
    """Keeps tensors every way `track_activations` cannot see."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.x = x
        ctx.parts = [1, {"y": y}]
        ctx.handle = Handle(x * 2)
        ctx.scale = 2.0  # not a tensor: fine
        return x * y

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.parts[1]["y"], grad * ctx.x


def test_tensors_kept_on_ctx_finds_attributes_containers_and_objects():
    x, y = torch.ones(3, dtype=torch.float64, requires_grad=True), torch.ones(3, dtype=torch.float64)
    leaky = Leaky.apply(x, y).exp()  # a built-in node first: the walk goes through it
    assert sorted(memory.tensors_kept_on_ctx([leaky])) == [
        "LeakyBackward.handle.t: float64[3]", "LeakyBackward.parts[1]['y']: float64[3]", "LeakyBackward.x: float64[3]"]
    from orangetron.model.autograd import RMSNormFunction

    clean = RMSNormFunction.apply(x.view(1, 3), torch.ones(3), 1e-5)  # saves via save_for_backward only
    assert [type(n).__name__ for n in memory.custom_function_nodes(clean)] == ["RMSNormFunctionBackward"]
    assert memory.tensors_kept_on_ctx(clean) == []


class _TransientNode:
    """A built-in autograd node as torch 2.11 shows it: a fresh Python object on each access to its parent's
    `next_functions`, freed once nothing holds it; `depth` such nodes lead to `leaf`. Whether a freed node's id
    comes back depends on the allocator, so the walk is held to what prevents it: no node it passed is freed
    before it returns (CPython frees an object the moment its last reference goes)."""

    freed = 0

    def __init__(self, depth: int, leaf) -> None:
        self.depth, self.leaf = depth, leaf

    def __del__(self) -> None:
        _TransientNode.freed += 1

    @property
    def next_functions(self):
        assert _TransientNode.freed == 0, "the walk let a node it passed go: its id may come back for another"
        return ((_TransientNode(self.depth - 1, self.leaf) if self.depth else self.leaf, 0),)


def test_the_walk_reaches_a_function_behind_nodes_that_python_frees_as_it_goes():
    """A walk that remembered only the ids of the nodes it passed met a freed node's id again on the next
    fresh object, took it for visited and stopped: the TP check then missed every Function below the head."""
    from orangetron.model.autograd import RMSNormFunction

    x = torch.ones(1, 3, dtype=torch.float64, requires_grad=True)
    out = RMSNormFunction.apply(x, torch.ones(3), 1e-5)  # held: torch 2.11 frees the graph with its output
    _TransientNode.freed = 0
    found = memory._custom_nodes_below([_TransientNode(12, out.grad_fn)])
    assert [type(n).__name__ for n in found] == ["RMSNormFunctionBackward"]


REFERENCE_MODELS = {
    "dense": dict(),
    "moe-shared-tied": dict(n_experts=4, top_k=2, moe_ffn_dim=16, n_shared_experts=1, tied_embeddings=True),
}
MODEL_FUNCTIONS = {"RMSNormFunctionBackward", "SwiGLUActivationBackward", "CPUFlashAttentionBackward",
                   "CrossEntropyBackward"}
MOE_FUNCTIONS = {"ToExpertOrderBackward", "FromExpertOrderBackward", "TopKWeightsBackward",
                 "LoadBalancingLossBackward"}


def reference_loss(extra: dict, seed: int = 0):
    from orangetron.model import ModelConfig, Transformer

    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=48, **extra)
    model = Transformer(cfg, seed=seed)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))
    return model, tokens


def test_reference_models_keep_nothing_on_ctx():
    for name, extra in REFERENCE_MODELS.items():
        model, tokens = reference_loss(extra)
        loss = model.loss(tokens, tokens)
        seen = {type(n).__name__ for n in memory.custom_function_nodes(loss)}
        assert seen >= MODEL_FUNCTIONS | (MOE_FUNCTIONS if extra else set()), name  # the walk reached them
        assert memory.tensors_kept_on_ctx(loss) == [], name


def check_comm_and_zero3_keep_nothing_on_ctx():
    from orangetron import comm
    from orangetron.mesh import init_mesh
    from orangetron.parallel import DataParallel, ParallelConfig
    from orangetron.spec.layout import Layout

    mesh = init_mesh(Layout(dp=2))
    g = mesh["dp"]
    x = torch.ones(4, 3, dtype=torch.float64, requires_grad=True)
    y = comm.reduce_scatter(comm.all_gather(x, g, 0), g, 0)  # [4, 3] again
    y = comm.all_to_all(comm.copy_to_group(comm.all_reduce(y, g), g), g, [2, 2], [2, 2])
    y = comm.RingExchange(g).exchange(comm.broadcast(y, g, 0))
    seen = {type(n).__name__ for n in memory.custom_function_nodes(y)}
    kept = memory.tensors_kept_on_ctx(y)
    y.sum().backward()
    model, tokens = reference_loss(REFERENCE_MODELS["moe-shared-tied"], seed=g.rank)
    dp = DataParallel(model, mesh, ParallelConfig(zero_stage=3))
    loss = model.loss_from_logits(dp(tokens), tokens)
    seen |= {type(n).__name__ for n in memory.custom_function_nodes(loss)}
    kept += memory.tensors_kept_on_ctx(loss)
    loss.backward()
    return seen, kept


def test_collectives_and_zero3_keep_nothing_on_ctx():
    from orangetron.testing import run_distributed

    comm_functions = {"_AllGatherBackward", "_ReduceScatterBackward", "_AllReduceBackward", "_CopyToGroupBackward",
                      "_AllToAllBackward", "_BroadcastBackward", "_RingLinkBackward"}
    for seen, kept in run_distributed(check_comm_and_zero3_keep_nothing_on_ctx, 2):
        assert seen >= comm_functions | MODEL_FUNCTIONS | MOE_FUNCTIONS
        assert kept == []


_PEAKS_IN_A_FRESH_PROCESS = """
import json, tracemalloc
from orangetron import memory
with memory.peak_allocations() as first:
    kept = bytearray(10_000_000)
with memory.peak_allocations() as second:  # tracing is still on; the first block's bytes are freed here
    del kept
    block = bytearray(1_000_000)
    del block
print(json.dumps([first.python_bytes, second.python_bytes, tracemalloc.is_tracing()]))
"""


def test_python_peaks_of_consecutive_blocks_and_tracing_left_on():
    """Each block reports what it allocated: the second frees the first's 10 MB, which must not offset its own
    1 MB. Tracing stays on after a measurement, since stopping it can crash the interpreter while one of gloo's
    threads takes the GIL (CPython gh-128679). Run in a fresh interpreter so the suite's process is never
    traced."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PEAKS_IN_A_FRESH_PROCESS], capture_output=True, text=True,
                         check=True, timeout=120)
    first, second, tracing = json.loads(out.stdout.strip().splitlines()[-1])
    assert 10_000_000 <= first < 10_050_000
    assert 1_000_000 <= second < 1_050_000
    assert tracing
