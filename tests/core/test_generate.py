"""Generation with the key/value-cache op set: equal to recomputing everything, to transformers' greedy
``generate``, and attention over a cache with fewer key/value heads equal to the full causal attention."""
import pytest
import torch
from transformers import GenerationConfig, GPT2LMHeadModel

from nanotrain.core import models
from nanotrain.core.generate import generate
from nanotrain.core.models import preset
from nanotrain.core.models.cache import CacheOps, KVCache
from nanotrain.core.models.ops import causal_attention
from tests.conftest import chain_rtol, rel_err
from weights import load_hf, random_checkpoint

TINY = preset("tiny")


@pytest.mark.parametrize("cfg", [TINY, preset("tiny-llama"), preset("tiny-llama", architecture="qwen3")],
                         ids=["gpt2", "llama", "qwen3"])
def test_kv_cache_generation_equals_full_recompute(cfg):
    """Also on the Llama class: 6 query heads over 2 cached key/value heads, rotated at their own positions."""
    params = models.init_params(cfg, seed=2)
    prompt = torch.randint(0, cfg.vocab_size, (3, 7))
    out = generate(params, prompt, cfg, max_new_tokens=12, temperature=0.0)
    ids = prompt
    for _ in range(12):
        ids = torch.cat([ids, models.logits(params, ids, cfg)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ids)


def test_sampling_is_reproducible_and_bounded_by_context():
    params = models.init_params(TINY, seed=2)
    prompt = torch.randint(0, TINY.vocab_size, (1, 4))
    a = generate(params, prompt, TINY, 8, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(1))
    b = generate(params, prompt, TINY, 8, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="exceeds the context of 128"):
        generate(params, prompt, TINY, TINY.n_ctx)


def test_greedy_equals_transformers_generate(tmp_path):
    folder = random_checkpoint(TINY, seed=3, root=tmp_path)
    hf = GPT2LMHeadModel.from_pretrained(folder, attn_implementation="sdpa").eval()
    prompt = torch.randint(0, TINY.vocab_size, (2, 9))
    # No end-of-text stop: a random model may pick it, and transformers would pad after it.
    config = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)
    ours = generate(load_hf(folder, TINY), prompt, TINY, max_new_tokens=40, temperature=0.0)
    assert torch.equal(ours, theirs)


def test_cached_attention_with_fewer_kv_heads_equals_full_causal_attention():
    """A prefill of 5 tokens, then one token at a time: 4 query heads sharing 2 key/value heads."""
    b, heads, kv, t, d = 2, 4, 2, 9, 8
    q, k, v = torch.randn(b, heads, t, d), torch.randn(b, kv, t, d), torch.randn(b, kv, t, d)
    full = causal_attention(q, k, v)
    cache = KVCache(torch.empty(b, kv, t, d), torch.empty(b, kv, t, d))
    steps = [(0, 5)] + [(i, i + 1) for i in range(5, t)]
    out = torch.cat([CacheOps(lo, cache).attention(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], 0.0, None)
                     for lo, hi in steps], dim=2)
    assert rel_err(out, full) <= chain_rtol([d, t, t])  # two kernels: scores over d, softmax and values over <= t
