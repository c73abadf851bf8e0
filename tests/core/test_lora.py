"""LoRA (``models.lora``) against a hand-written reference: the base with ``W[rows] + scale * B @ A`` merged in.

Bounds: both sides compute in fp32; ours adds ``scale * B (A x)`` to ``x W^T``, the reference multiplies by the
merged ``W + scale B A``: the same sums in other orders, ``conftest.chain_rtol`` of the adapted model's chain (a
pair's rank-r contraction in each block, forward and back: ``model_chain`` of the spec), which catches a wrong row,
scale or transpose (those are >= 1e-2). Recompute policies replay the blocks' ops, ``lean`` and ``selective``
summing a block input's gradient in another order (``test_trainer``): the same chain's bound.
"""
import pytest
import torch

from nanotrain.core.models import init_params, model_spec, preset, run
from nanotrain.core.models.lora import LoraConfig, merge, with_lora
from nanotrain.core.recompute import RecomputePolicy
from nanotrain.core.tree import get_path, named_leaves
from tests.conftest import assert_same_logits, chain_rtol, model_chain, rel_err

GPT2 = preset("tiny", n_layer=2, vocab_size=256)
LLAMA = preset("tiny-llama")
ALL = {"gpt2": (GPT2, ("qkv", "o", "up", "down")), "llama": (LLAMA, ("q", "k", "v", "o", "gate", "up", "down")),
       "llama-q-v": (LLAMA, ("q", "v")), "llama-gate-down": (LLAMA, ("gate", "down"))}


def adapted_params(cfg, targets, rank=4, alpha=8.0, dropout=0.0, seed=0):
    """The base spec's fresh weights and an adapted spec's tree over them, B drawn non-zero (PEFT's zeros would
    give A no gradient to check)."""
    base = model_spec(cfg)
    spec = with_lora(base, LoraConfig(rank, alpha, targets, dropout))
    params = init_params(base, seed=seed)
    adapters = dict(named_leaves(run.init_params(spec, seed=seed + 1)))
    g = torch.Generator().manual_seed(seed + 2)
    leaves = dict(named_leaves(params))
    for path in (leaf.path for leaf in spec.leaves if leaf.trainable):
        t = adapters[path]
        leaves[path] = torch.randn(t.shape, generator=g) * 0.1 if path.endswith("_b") else t
    return spec, base, leaves


def batch(cfg, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    y = x.roll(-1, 1)
    y[:, -1] = -100
    return x, y


@pytest.mark.parametrize("name", ALL)
def test_loss_and_adapter_gradients_equal_the_merged_reference(name):
    cfg, targets = ALL[name]
    spec, base, leaves = adapted_params(cfg, targets)
    trainable = [leaf.path for leaf in spec.leaves if leaf.trainable]
    mine = {p: t.clone().requires_grad_(p in trainable) for p, t in leaves.items()}
    tokens, targets_ = batch(cfg)
    ours = run.loss(spec, run.tree_from(spec, mine.items()), tokens, targets_)
    ours.backward()

    ref = {p: t.clone().requires_grad_(p in trainable) for p, t in leaves.items()}
    base_tree = run.tree_from(base, ((p, t) for p, t in ref.items() if p not in trainable))
    adapters = run.tree_from(spec, ((p, t) for p, t in ref.items() if p in trainable))
    expected = run.loss(base, merge(spec, base_tree, adapters), tokens, targets_)
    expected.backward()
    count = int((targets_ != -100).sum())
    loss_rtol, grad_rtol = (chain_rtol(model_chain(spec, tokens.shape[1], count, what)) for what in ("loss", "grads"))
    assert abs(ours.item() - expected.item()) <= loss_rtol * expected.item()
    for p in trainable:
        assert rel_err(mine[p].grad, ref[p].grad) <= grad_rtol, p
    assert all(mine[p].grad is None for p in leaves if p not in trainable)


def test_pairs_start_as_peft_does_and_leave_the_model_unchanged():
    """B zeros (the adapted model computes the base's function at the start), A uniform in +-1/sqrt(in)."""
    spec = with_lora(model_spec(LLAMA), LoraConfig(4, 8.0, ("q", "down")))
    fresh = dict(named_leaves(run.init_params(spec, seed=0)))
    a_q, a_down, b_q = fresh["blocks.0.lora_q_a"], fresh["blocks.0.lora_down_a"], fresh["blocks.0.lora_q_b"]
    assert a_q.shape == (4, LLAMA.n_embd) and a_down.shape == (4, LLAMA.intermediate_size)
    assert b_q.shape == (LLAMA.heads[0] * LLAMA.heads[2], 4) and not b_q.any()
    for a in (a_q, a_down):
        bound = a.shape[1] ** -0.5
        assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound  # uniform over the whole interval
    tokens, _ = batch(LLAMA)
    base_tree = run.tree_from(model_spec(LLAMA), ((p, t) for p, t in fresh.items() if "lora" not in p))
    assert torch.equal(run.run_units(spec, run.tree_from(spec, fresh.items()), tokens),
                       run.run_units(model_spec(LLAMA), base_tree, tokens))


@pytest.mark.parametrize("policy", ["every", "every-2", "selective", "lean"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_recompute_policies_give_the_same_adapter_gradients_with_lora_dropout(name, policy):
    """Masks per pair from the sublayer's seed: the recomputed block (or MLP) replays them."""
    cfg, targets = ALL[name]
    spec, _, leaves = adapted_params(cfg, targets, dropout=0.25)
    tokens, targets_ = batch(cfg)
    grads = []
    for block_fn in (None, RecomputePolicy.parse(policy).block_fn(spec)):
        tree = run.tree_from(spec, ((p, t.clone().requires_grad_(spec.leaf(p).trainable)) for p, t in leaves.items()))
        loss = run.run_units(spec, tree, tokens, targets_, seed=11, block_fn=block_fn)
        loss.backward()
        grads.append({p: get_path(tree, p).grad for p in leaves if spec.leaf(p).trainable})
    grad_rtol = chain_rtol(model_chain(spec, tokens.shape[1], int((targets_ != -100).sum())))
    for p, g in grads[0].items():
        assert rel_err(grads[1][p], g) <= grad_rtol, p
    # dropout is on: another seed draws other masks
    tree = run.tree_from(spec, leaves.items())
    assert run.run_units(spec, tree, tokens, targets_, seed=12) != run.run_units(spec, tree, tokens, targets_, seed=11)


@pytest.mark.parametrize("policy", ["plain", "every", "lean"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_packed_batch_through_the_pairs_equals_its_documents_one_by_one(name, policy):
    """Packing's document positions pass through the adapted matmuls unchanged (the op set carries them, the pairs
    never read them), also where a recomputed block with pairs takes autograd's path (``recompute.block_grads``).
    Bound: the packed row and its pieces sum the same products in other orders (masked keys add exact zeros; the
    head's chunks), so ``chain_rtol`` of the model's chain, lengthened in each block by a pair's two contractions
    (over the widest input and the rank) forward and back (with pairs GPT-2's gradients were measured 1.09e-6
    apart)."""
    from tests.packed_cases import one_by_one, packed_batch

    cfg, targets = ALL[name]
    spec, _, leaves = adapted_params(cfg, targets)
    tokens, targets_, positions = packed_batch(spec.vocab_size)
    want_loss, want = one_by_one(spec, run.tree_from(spec, ((p, t.clone()) for p, t in leaves.items())),
                                 tokens, targets_, positions)
    tree = run.tree_from(spec, ((p, t.clone().requires_grad_()) for p, t in leaves.items()))
    block_fn = None if policy == "plain" else RecomputePolicy.parse(policy).block_fn(spec)
    denom = int((targets_ != -100).sum())
    loss = run.run_units(spec, tree, tokens, targets_, denom=denom, positions=positions, block_fn=block_fn)
    loss.backward()
    widest = max(cfg.n_embd, getattr(cfg, "intermediate_size", 4 * cfg.n_embd))
    pairs = [widest, 4, 4, widest] * cfg.n_layer
    bound = chain_rtol(model_chain(cfg, tokens.shape[1], denom, "loss") + pairs)
    assert abs(loss.item() - want_loss) <= bound * abs(want_loss)
    bound = chain_rtol(model_chain(cfg, tokens.shape[1], denom) + pairs)
    for path, t in named_leaves(tree):
        assert rel_err(t.grad, want[path]) <= bound, f"{path} (bound {bound:.1e})"


def test_unknown_targets_name_the_known_ones():
    with pytest.raises(ValueError, match="known: qkv, o, up, down"):
        with_lora(model_spec(GPT2), LoraConfig(targets=("q",)))
    with pytest.raises(ValueError, match="rank 0 must be >= 1"):
        LoraConfig(rank=0)


def test_merged_base_saved_as_a_plain_folder_gives_the_adapted_logits_in_transformers(tmp_path):
    """``lora.merge`` is what an export writes: ``transformers`` loads the folder with no adapter and computes the
    adapted model's logits (bound as above: the merged matrix against the pair's separate matmuls)."""
    from transformers import AutoModelForCausalLM

    from weights import save_hf
    from weights.peft import merged_masters, save_adapter

    spec, base, leaves = adapted_params(LLAMA, ("q", "v", "down"))
    tree = run.tree_from(spec, leaves.items())
    base_tree = run.tree_from(base, ((p, t) for p, t in leaves.items() if not spec.leaf(p).trainable))
    merged = merge(spec, base_tree, tree)
    save_adapter(tmp_path / "adapter", spec, tree)  # a LoRA run's export: a PEFT adapter folder
    from_folder = merged_masters(tmp_path / "adapter", LLAMA, base_tree)
    assert all(torch.equal(t, get_path(from_folder, p)) for p, t in named_leaves(merged))
    save_hf(merged, LLAMA, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens, _ = batch(LLAMA)
    with torch.no_grad():
        assert_same_logits(run.logits(spec, tree, tokens), hf(input_ids=tokens).logits, spec)
