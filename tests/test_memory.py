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
