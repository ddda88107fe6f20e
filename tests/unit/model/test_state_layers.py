"""``anyfit.model.state_layers``: a state layer of a packed row runs on the row's examples as right-padded rows, in
groups of similar lengths, and its output lands back where each example sits in the row."""

from __future__ import annotations

import torch
from torch import nn

from anyfit.model.state_layers import KERNELS, PER_EXAMPLE, SEQ_IDX, Boundaries, _Layout


class ToyMambaMixer(nn.Module):
    """A running sum along the sequence: the simplest state, which packing would carry into the next example."""

    def forward(self, hidden_states, attention_mask=None):
        if attention_mask is not None:
            hidden_states = hidden_states * attention_mask[..., None]
        return hidden_states.cumsum(dim=1)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = ToyMambaMixer()
        self.calls = 0
        self.mixer.register_forward_pre_hook(lambda m, a, k: setattr(self, "calls", self.calls + 1), with_kwargs=True)

    def forward(self, x, packed_lengths=None):
        return self.mixer(hidden_states=x, attention_mask=None) * 2.0


def test_groups_of_the_same_chunk_count():
    """Longest first; a group holds examples of the same number of chunks (100 and 70: two chunks of 64; 60, 5 and 3:
    one), and a new one starts where padding would add more than a quarter of its tokens (5 after 60)."""
    lengths = (3, 100, 5, 60, 70)
    layout = _Layout(lengths, "cpu", chunk=64)
    assert [(g.rows, g.longest) for g in layout.groups] == [(2, 100), (1, 60), (2, 5)]
    row = torch.arange(float(sum(lengths)))[None, :, None]
    assert torch.equal(layout.merge([g.pad(row) for g in layout.groups]), row)
    assert len(_Layout(lengths, "cpu").groups) == 5  # chunks of one position: every length its own group


def test_each_example_starts_from_an_empty_state():
    lengths = (40, 3, 100, 5)  # three groups: (100), (40), (5, 3)
    x = torch.randn(1, sum(lengths), 4, requires_grad=True)
    toy = Toy()
    hooks = Boundaries(toy, PER_EXAMPLE)
    assert hooks.layers == [toy.mixer]
    got = toy(x, packed_lengths=lengths)
    want = torch.cat([part.cumsum(dim=1) * 2.0 for part in x.split(lengths, dim=1)], dim=1)
    assert torch.allclose(got, want) and toy.calls == 1  # the second group runs inside the same call
    got.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert torch.allclose(toy(x), x.cumsum(dim=1) * 2.0)  # no boundaries: the layer as it is
    hooks.remove()
    assert torch.allclose(toy(x, packed_lengths=lengths), x.cumsum(dim=1) * 2.0)


class Recorder(nn.Module):
    """A model that keeps the keywords of its call."""

    def forward(self, x, **kwargs):
        self.seen = kwargs
        return x


def test_the_kernels_ways_hand_the_model_transformers_own_keywords():
    """``KERNELS`` adds the names transformers' FlashAttention and flash-linear-attention paths read, ``SEQ_IDX`` also
    the ``seq_idx`` its Mamba-2 mixers hand their kernels: each as transformers' own DataCollatorWithFlattening lays
    out the same examples."""
    from transformers import DataCollatorWithFlattening

    lengths = (5, 3, 7)
    theirs = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(
        [{"input_ids": list(range(1, n + 1))} for n in lengths])
    cu = torch.tensor([0, 5, 8, 15], dtype=torch.int32)  # anyfit's cu_seq_lens of the same row
    names = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    for way, added in ((KERNELS, names), (SEQ_IDX, names | {"seq_idx"})):
        model = Recorder()
        hooks = Boundaries(model, way)
        model(torch.zeros(1, sum(lengths)), packed_lengths=lengths, cu_seq_lens=cu)
        assert set(model.seen) - {"packed_lengths", "cu_seq_lens"} == added
        for name in added:
            ours, want = torch.as_tensor(model.seen[name]), torch.as_tensor(theirs[name])
            assert torch.equal(ours.to(want.dtype), want), name
        if way == SEQ_IDX:
            assert model.seen["seq_idx"].dtype == theirs["seq_idx"].dtype == torch.int32
        hooks.remove()
        model(torch.zeros(1, sum(lengths)))  # padded rows and generation: nothing added
        assert model.seen == {}
