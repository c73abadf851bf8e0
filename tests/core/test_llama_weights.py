"""The Llama-class family through the generic Hugging Face I/O and the key/value cache (fp32, CPU): folders
transformers wrote (one file and sharded) load in ours, ours load in transformers, a random checkpoint is the
init, greedy generation equals transformers' ``generate(do_sample=False)``."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from nanotrain.core import models
from nanotrain.core.generate import generate
from nanotrain.core.models import model_spec
from nanotrain.core.models.llama.hf import to_config
from nanotrain.core.tree import get_path
from tests.conftest import assert_same_logits
from tests.core.test_llama_parity import CONFIGS
from weights import load_hf, load_weights, random_checkpoint, resolve_model, save_hf


def hf_model(cfg, seed=0):
    torch.manual_seed(seed)
    config = AutoConfig.for_model(**to_config(cfg))
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


@pytest.mark.parametrize("name", CONFIGS)
def test_a_folder_transformers_wrote_loads_in_ours(name, tmp_path):
    cfg = CONFIGS[name]
    hf = hf_model(cfg)
    sharded = name in ("llama-untied-llama3-rope", "qwen3-qk-norm-head-dim-12")
    hf.save_pretrained(tmp_path, **({"max_shard_size": "50KB"} if sharded else {}))
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded
    model = resolve_model(str(tmp_path))
    assert model.cfg == cfg
    params = load_weights(model.cfg, model.weights("hub"))
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    with torch.no_grad():
        assert_same_logits(models.logits(params, tokens, cfg), hf(tokens).logits, cfg)


@pytest.mark.parametrize("name", ["llama-untied-llama3-rope", "qwen2-biases-tied"])
@pytest.mark.parametrize("shard_bytes", [None, 50_000])
def test_our_save_loads_in_transformers(name, shard_bytes, tmp_path):
    cfg = CONFIGS[name]
    params = models.init_params(cfg, seed=1)
    save_hf(params, cfg, tmp_path, max_shard_bytes=shard_bytes)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa", dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    with torch.no_grad():
        assert_same_logits(models.logits(params, tokens, cfg), hf(tokens).logits, cfg)


def test_random_checkpoint_splits_and_rejoins_the_fused_leaves_exactly(tmp_path):
    cfg = CONFIGS["qwen2-biases-tied"]
    loaded = load_hf(random_checkpoint(cfg, seed=2, root=tmp_path), cfg)
    direct = models.init_params(cfg, seed=2)
    for leaf in model_spec(cfg).leaves:
        assert torch.equal(get_path(loaded, leaf.path), get_path(direct, leaf.path)), leaf.path


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_equals_transformers_generate(name, tmp_path):
    """Prompt and new tokens within 32: Mistral's sliding window, so its windowed attention is the causal one."""
    cfg = CONFIGS[name]
    hf = hf_model(cfg, seed=3)
    hf.save_pretrained(tmp_path)
    prompt = torch.randint(0, cfg.vocab_size, (2, 8))
    # No stop at the end-of-sequence token: a random model may pick it, and transformers would pad after it.
    config = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)
    ours = generate(load_hf(tmp_path, cfg), prompt, cfg, max_new_tokens=24, temperature=0.0)
    assert torch.equal(ours, theirs)
