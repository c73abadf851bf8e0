"""The Llama-class family against transformers' Llama, Qwen2, Qwen3 and Mistral models (fp32, CPU).

HF's model is built from our ``to_config`` with its own random init, and its tensors are copied into our tree
through the family's name table (``HFName``: q|k|v and gate|up fused along dim 0), so the table and the
config are tested with the math. Bounds: both sides compute in fp32 with the same operations in different
orders (fused vs separate matmuls, GQA by broadcasting vs repeating, chunked vs whole cross-entropy), each
reduction of n terms adding about sqrt(n) 2^-24 in a tensor's norm: ``conftest.chain_rtol`` over the chain
of 2 blocks forward and backward, which still catches any wrong op (those are >= 1e-3).
"""
from dataclasses import replace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from nanotrain.core.models import init_params, logits, loss, model_spec, preset, run
from nanotrain.core.models.llama import PRESETS, RopeScaling
from nanotrain.core.models.llama.hf import LAYOUT, from_config, to_config
from nanotrain.core.models.llama.model import inverse_frequencies, rotary_tables
from nanotrain.core.optim.adam import AdamConfig, adam_step, init_state
from nanotrain.core.tree import get_path
from tests.conftest import adam_over, assert_same_logits, chain_rtol, model_chain, rel_err

TINY = preset("tiny-llama")
T = 32
CONFIGS = {
    "llama-untied-llama3-rope": TINY,
    "llama-tied": replace(TINY, tie_word_embeddings=True, rope_scaling=RopeScaling("linear", 2.0)),
    "qwen2-biases-tied": replace(TINY, architecture="qwen2", tie_word_embeddings=True, rope_scaling=None),
    "qwen3-qk-norm-head-dim-12": replace(TINY, architecture="qwen3", head_dim=12, rope_scaling=None),
    "mistral-window-as-long-as-the-sequence": replace(TINY, architecture="mistral", sliding_window=T,
                                                      rope_scaling=None),
}


def hf_model(cfg):
    hf_cfg = AutoConfig.for_model(**to_config(cfg))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.float32).eval()


def ours_from(hf, cfg) -> dict:
    """Our tree holding HF's tensors, through the name table."""
    sd = dict(hf.named_parameters())
    return run.tree_from(model_spec(cfg), ((e.ours, torch.cat([sd[n].detach() for n in e.hf]).clone().requires_grad_())
                                           for e in LAYOUT.names(model_spec(cfg))))


def hf_grad(hf, entry) -> torch.Tensor:
    sd = dict(hf.named_parameters())
    return torch.cat([sd[n].grad for n in entry.hf])


def shifted(tokens: torch.Tensor) -> torch.Tensor:
    """HF shifts ``labels`` inside its loss; ours takes the shifted targets, -100 where none follows."""
    return torch.cat([tokens[:, 1:], torch.full((tokens.shape[0], 1), -100)], dim=1)


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_loss_and_every_gradient_match_transformers(name):
    cfg = CONFIGS[name]
    hf = hf_model(cfg)
    params = ours_from(hf, cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, T))

    out = hf(input_ids=tokens, labels=tokens)
    out.loss.backward()
    with torch.no_grad():
        assert_same_logits(logits(params, tokens, cfg), out.logits, cfg)
    loss_rtol, grad_rtol = (chain_rtol(model_chain(cfg, T, tokens.numel(), what)) for what in ("loss", "grads"))
    ours = loss(params, tokens, shifted(tokens), cfg, chunk_tokens=23)  # chunks that cut across sequences
    assert abs(ours.item() - out.loss.item()) <= loss_rtol * out.loss.item()
    ours.backward()
    for e in LAYOUT.names(model_spec(cfg)):
        assert rel_err(get_path(params, e.ours).grad, hf_grad(hf, e)) <= grad_rtol, e.ours


@pytest.mark.parametrize("name", ["llama-untied-llama3-rope", "qwen2-biases-tied"])
def test_three_adamw_steps_match_torch_adamw_on_transformers(name):
    """Ours: ``adam_step`` (torch's fused AdamW kernel) on our fused leaves; HF: ``torch.optim.AdamW``.

    Bound, per element: Adam divides each element's moment by its own RMS, so an element's update carries its
    gradient's relative error, which for the smallest gradients is well above what the tensor norms see: each
    weight within what AdamW makes of the gradients each side applied at every step (``conftest.adam_over``).
    A bug (a step missed or doubled, decay or bias correction wrong) moves a weight by >= 1e-2 of its update.
    """
    cfg = CONFIGS[name]
    hf = hf_model(cfg)
    params = ours_from(hf, cfg)
    hp = AdamConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = torch.optim.AdamW(hf.parameters(), lr=hp.lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay)
    table = LAYOUT.names(model_spec(cfg))
    start = {e.ours: get_path(params, e.ours).detach().clone() for e in table}
    states = {e.ours: init_state(get_path(params, e.ours)) for e in table}
    gen, sd = torch.Generator().manual_seed(1), dict(hf.named_parameters())
    applied = {e.ours: ([], []) for e in table}  # every step's gradients: ours, HF's
    for step in range(1, 4):
        tokens = torch.randint(0, cfg.vocab_size, (2, T), generator=gen)
        opt.zero_grad()
        hf(input_ids=tokens, labels=tokens).loss.backward()
        loss(params, tokens, shifted(tokens), cfg).backward()
        for e in table:
            applied[e.ours][1].append(torch.cat([sd[n].grad for n in e.hf]).clone())
        opt.step()
        with torch.no_grad():
            for e in table:
                p = get_path(params, e.ours)
                applied[e.ours][0].append(p.grad.clone())
                adam_step(p, p.grad, states[e.ours], hp, step)
                p.grad = None
    for e in table:
        ours, theirs = get_path(params, e.ours).detach(), torch.cat([sd[n] for n in e.hf]).detach()
        over = adam_over(ours, theirs, start[e.ours], *applied[e.ours], hp)
        assert over.max() <= 1, f"{e.ours}: {over.max():.2f} times its bound"


@pytest.mark.parametrize("name", ["tiny-llama", "llama-3.1-8b", "llama-3.2-1b", "qwen3-8b"])
def test_rotary_tables_equal_transformers_rotary_module(name):
    """The same operations in the same order: equal to the bit, llama3 scaling included, up to the longest context."""
    cfg = preset(name)
    hf_rope = LlamaRotaryEmbedding(AutoConfig.for_model(**to_config(cfg)))
    assert torch.equal(inverse_frequencies(cfg), hf_rope.inv_freq)
    positions = torch.cat([torch.arange(64), torch.arange(64, cfg.n_ctx, 4093)])
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = hf_rope(torch.zeros((), dtype=dtype), positions[None])
        ours = rotary_tables(inverse_frequencies(cfg), positions, dtype)
        assert torch.equal(ours[0], cos[0]) and torch.equal(ours[1], sin[0])


@pytest.mark.parametrize("name", [n for n in PRESETS if n != "tiny-llama"])
def test_preset_sizes_are_the_published_ones(name):
    """The spec's count (no tensor allocated) against the published one and HF's model built on the meta device."""
    published = {"llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248,
                 "llama-3.1-70b": 70_553_706_496, "qwen2.5-32b": 32_763_876_352,
                 "qwen2.5-0.5b": 494_032_768, "qwen2.5-7b": 7_615_616_512, "qwen3-0.6b": 596_049_920,
                 "qwen3-8b": 8_190_735_360, "mistral-7b": 7_248_023_552}
    spec = model_spec(preset(name))
    assert spec.costs.total_params == published[name]
    assert sum(torch.Size(leaf.shape).numel() for leaf in spec.leaves) == published[name]
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**to_config(spec.cfg)))
    assert sum(p.numel() for p in hf.parameters()) == published[name]


@pytest.mark.parametrize("name", list(PRESETS) + list(CONFIGS))
def test_config_json_round_trips(name):
    """Through our file, and through the one transformers 5 writes (``rope_parameters``, ``layer_types``)."""
    cfg = PRESETS.get(name) or CONFIGS[name]
    assert from_config(to_config(cfg)) == cfg
    assert from_config(AutoConfig.for_model(**to_config(cfg)).to_dict()) == cfg


def test_our_random_init_is_transformers_init():
    params, spec = init_params(TINY, seed=0), model_spec(TINY)
    for leaf in spec.leaves:
        t = get_path(params, leaf.path)
        if leaf.init == "normal":
            assert abs(t.std().item() - 0.02) < 0.02 * 0.1, leaf.path  # >= 4800 draws: std within 10%
        else:
            assert torch.equal(t, torch.full_like(t, float(leaf.init == "ones"))), leaf.path


def test_block_compiles_as_one_graph():
    """No graph break (the rotary tables come from the config, not from a per-device cache)."""
    spec = model_spec(TINY)
    params = init_params(TINY, seed=0)
    x = torch.randn(2, T, TINY.n_embd)
    compiled = torch.compile(lambda p, x: run.block(spec, p, x), backend="eager", fullgraph=True)
    assert torch.equal(compiled(params["blocks"][0], x), run.block(spec, params["blocks"][0], x))


def test_a_sequence_longer_than_the_sliding_window_is_refused_naming_the_window(tmp_path, monkeypatch, capsys):
    """The window, not the context (``n_ctx`` is 128), bounds the sequences built here; messages say which."""
    from nanotrain.run.flags import check_args, parse_args

    cfg = CONFIGS["mistral-window-as-long-as-the-sequence"]
    params = init_params(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (1, T + 1))
    window = f"sliding window of {T} tokens \\(longer sequences' windowed attention is not built\\)"
    with pytest.raises(ValueError, match=f"exceeds the model's {window}"):
        loss(params, tokens, shifted(tokens), cfg)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=f"--seq {T + 1} exceeds m's {window}; use --seq {T} or less"):
        check_args(parse_args(["--model", "m", "--seq", str(T + 1), "--batch", "1"]), frozenset(), cfg,
                       torch.device("cpu"))
    assert "context" not in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn' is not supported"),
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "type 'dynamic'"),
    ({"mlp_bias": True}, "mlp_bias is true"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not SwiGLU's silu"),
    ({"attention_bias": True}, "puts a bias on o_proj too"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"model_type": "gemma"}, "model_type 'gemma' is not one of"),
    ({"num_key_value_heads": 4}, "n_head=6 is not a multiple of n_kv_head=4"),
])
def test_config_json_we_cannot_compute_is_refused_in_one_line(change, message):
    with pytest.raises(ValueError, match=message) as info:
        from_config({**to_config(TINY), **change})
    assert "\n" not in str(info.value)
