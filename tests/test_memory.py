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
