"""Packed rows (``core.models.documents``, ``data.batches.PackedLoader``): a packed batch's loss and every gradient
equal those of its documents run one by one, for GPT-2 (learned positions) and the Llama class (rotary, grouped
keys and values), plainly and under every recompute policy (bound: ``tests.packed_cases``)."""
from __future__ import annotations

import pytest
import torch

from nanotrain.core.models import init_params, model_spec, preset, run
from nanotrain.core.models.documents import block_diagonal, check_positions
from nanotrain.data.batches import IGNORE_INDEX
from nanotrain.core.recompute import RecomputePolicy
from nanotrain.core.tree import named_leaves
from nanotrain.data.batches import PackedLoader, next_fit, text_documents
from tests.conftest import chain_rtol, rel_err
from tests.packed_cases import documents, examples, one_by_one, packed_batch, packed_rtol

MODELS = {"gpt2": preset("tiny", n_layer=2, vocab_size=128), "llama": preset("tiny-llama", n_layer=2)}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("policy", ["plain", "every", "selective", "lean"])
def test_packed_batch_equals_its_documents_one_by_one(name, policy):
    spec = model_spec(MODELS[name])
    tokens, targets, positions = packed_batch(spec.vocab_size)
    loss_rtol, grad_rtol = packed_rtol(spec, tokens, "loss"), packed_rtol(spec, tokens)
    params = init_params(spec, seed=1)
    want_loss, want = one_by_one(spec, params, tokens, targets, positions)
    for t in want:
        dict(named_leaves(params))[t].grad = None
    denom = int((targets != IGNORE_INDEX).sum())
    unmasked = float(run.run_units(spec, params, tokens, targets, denom=denom))  # documents seeing each other
    assert abs(unmasked - want_loss) > 10 * loss_rtol * want_loss  # a leak of one document is far outside the bound
    block_fn = None if policy == "plain" else RecomputePolicy.parse(policy).block_fn(spec)
    loss = run.run_units(spec, params, tokens, targets, denom=denom, positions=positions, block_fn=block_fn)
    loss.backward()
    assert abs(float(loss) - want_loss) <= loss_rtol * abs(want_loss)
    for path, t in named_leaves(params):
        assert rel_err(t.grad, want[path]) <= grad_rtol, path


def test_unpacked_rows_keep_the_causal_path():
    """Without positions the op set is the very one given (no copy, no mask): today's ``is_causal`` SDPA."""
    from nanotrain.core.models.ops import PLAIN
    assert PLAIN.packed(None) is PLAIN and PLAIN.docs is None
    ops = PLAIN.packed(torch.tensor([[0, 1, 0, 1, 2]]))
    assert ops is not PLAIN and PLAIN.docs is None
    assert ops.docs.mask.tolist() == block_diagonal(torch.tensor([[0, 1, 0, 1, 2]])).tolist()
    assert ops.docs.mask[0, 0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0],
                                                  [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]


def test_bad_positions_are_refused_in_one_line():
    tokens = torch.zeros(1, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="start each row at 0"):
        check_positions(torch.tensor([[1, 2, 0, 1]]), tokens)
    with pytest.raises(ValueError, match="count up by 1"):
        check_positions(torch.tensor([[0, 1, 3, 0]]), tokens)
    with pytest.raises(ValueError, match="tokens' shape"):
        check_positions(torch.tensor([[0, 1, 2]]), tokens)


def test_loader_never_splits_an_example_and_trains_only_answers():
    exs = examples(vocab=100, longest=17, count=40, seed=3)
    loader = PackedLoader(exs, seq=16, batch=2, pad_id=0, seed=3)
    assert sorted(i for row in loader.rows for i in row) == list(range(40))
    for r, row in enumerate(loader.rows):
        assert sum(min(len(loader.examples[i].ids), 17) - 1 for i in row) <= 16
        tok, tgt, pos = loader.take(torch.tensor([r]))
        pieces = list(documents(tok, tgt, pos))
        for i, (t, y) in zip(row, pieces):  # each example whole, in order, answers only as targets
            ex = loader.examples[i]
            n = min(len(ex.ids), 17) - 1
            assert t[0].tolist() == ex.ids[:n].tolist()
            assert y[0].tolist() == torch.where(ex.trained[1:n + 1], ex.ids[1:n + 1], IGNORE_INDEX).tolist()
        assert all(int((y != IGNORE_INDEX).sum()) == 0 for _, y in pieces[len(row):])  # the padding
    text = loader.describe()
    assert "packed into" in text and "padding" in text


def test_next_fit_and_long_text_documents():
    assert next_fit([3, 4, 2, 5, 1], 8) == [[0, 1], [2, 3, 4]]
    eot = 9
    stream = torch.tensor([1, 2, eot] + list(range(10, 30)) + [eot, 5, eot])
    docs = text_documents(stream, eot, seq=8)
    assert [d.ids.tolist() for d in docs][0] == [1, 2, eot]
    long = [d.ids.tolist() for d in docs[1:-1]]  # 21 ids cut into pieces of 9 overlapping by one
    assert long == [list(range(10, 19)), list(range(18, 27)), list(range(26, 30)) + [eot]]
    assert docs[-1].ids.tolist() == [5, eot] and all(d.trained.all() for d in docs)


def test_flex_block_mask_is_the_boolean_one():
    """The block mask a GPU hands FlexAttention, run here by flex's eager (reference) implementation (forward only:
    flex has no CPU backward), gives the boolean mask's SDPA, grouped keys and values. Bound: two fp32 softmax
    attentions over the same keys reduced in another order (16 dims, at most 100 keys a query): 1e-6 relative."""
    from torch.nn.attention.flex_attention import flex_attention
    from nanotrain.core.models.documents import Documents, _block_mask
    positions = torch.cat([torch.arange(n) for n in (40, 100, 7, 1, 64, 44)]).view(2, 128)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 128, 16, generator=g) for h in (6, 2, 2))
    flex = flex_attention(q, k, v, block_mask=_block_mask(positions), enable_gqa=True)
    # two orders of the attention's reductions: scores over 16 dims, the softmax's and the values' over <= 128 keys
    assert rel_err(flex, Documents.of(positions).attention(q, k, v)) <= chain_rtol([16, 128, 128])


def test_a_compiled_block_takes_packed_rows_without_recompiling():
    """``--compile``: the op set carrying the documents enters the compiled block as an argument; a second packed
    batch (other documents, same shape) reuses the graph, and the values are the eager block's (same kernels on
    the CPU, fused elementwise: the bound of ``tests.packed_cases``)."""
    from torch._dynamo.utils import counters
    spec = model_spec(MODELS["llama"])
    params = init_params(spec, seed=1)
    block_fn = RecomputePolicy.parse("none").block_fn(spec, compile=True)
    for seed in (0, 5):
        tokens, targets, positions = packed_batch(spec.vocab_size, seed=seed)
        compiled = float(run.run_units(spec, params, tokens, targets, positions=positions, block_fn=block_fn))
        eager = float(run.run_units(spec, params, tokens, targets, positions=positions))
        assert abs(compiled - eager) <= packed_rtol(spec, tokens, "loss") * eager
        if seed == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs
