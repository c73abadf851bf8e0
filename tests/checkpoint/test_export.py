"""A fine-tuned run exported as a folder that serves (``tasks.export``, ``tasks.finetune --export``): for GPT-2,
Llama, Qwen2 and Qwen3 folders that ``transformers`` wrote, with a tokenizer of their own and a chat template,
``AutoModelForCausalLM`` and ``AutoTokenizer`` load the export and generate greedily what ``tasks.generate`` and the
library's ``generate`` do on the same checkpoint.

What the bounds rest on. An export changes the weights in one way: each fp32 master is rounded to nearest in the
export's dtype (``Tensor.to``), checked here bit for bit (so ``--dtype fp32`` holds the masters themselves). The
rest is the same computation on the same tensors: ``transformers`` in fp32 against ours in fp32, which
tests/core/test_llama_parity.py bounds by the reductions of the forward (``conftest.assert_same_logits``). So the
exported logits equal ours on the exported weights within that bound, in every dtype; against ours on the unrounded
masters, the difference is the rounding's own effect, which no bound here hides.
"""
import json
from dataclasses import replace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GPT2Config, GPT2LMHeadModel

from nanotrain.checkpoint.export import ExportConfig, checkpoint_in, export_masters, read_masters
from nanotrain.core import models
from nanotrain.core.generate import generate
from nanotrain.core.models import model_spec
from nanotrain.core.models.llama.hf import to_config
from nanotrain.core.models.run import tree_from
from nanotrain.core.tree import get_path
from tests.conftest import SHAKESPEARE, TOKENIZER_DIR, assert_same_logits
from tests.core.test_llama_parity import CONFIGS
from tests.data.test_tokenizer_hf import TEXTS, write_tokenizer
from weights import CheckpointError, load_hf, resolve_model

TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


def gpt2_folder(folder):
    """Without a generation_config.json: the export writes one from the tokenizer's BOS and EOS."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=320, bos_token_id=0, eos_token_id=1)
    GPT2LMHeadModel(config).save_pretrained(folder)
    (folder / "generation_config.json").unlink()


def llama_folder(name):
    """With the generation_config.json transformers writes: the export copies it."""
    def write(folder):
        torch.manual_seed(0)
        config = AutoConfig.for_model(**to_config(replace(CONFIGS[name], bos_token_id=0, eos_token_id=1)))
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return write


FOLDERS = {"gpt2": gpt2_folder, "llama": llama_folder("llama-untied-llama3-rope"),
           "qwen2": llama_folder("qwen2-biases-tied"), "qwen3": llama_folder("qwen3-qk-norm-head-dim-12")}


def model_folder(tmp_path, family):
    """A folder transformers wrote, with a byte-level BPE of 300 tokens and a chat template of its own."""
    folder = tmp_path / family
    FOLDERS[family](folder)
    write_tokenizer(folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


def finetune(tmp_path, folder, *extra):
    from tasks.finetune import main

    data = tmp_path / "text.txt"
    data.write_text(" ".join(TEXTS * 4))
    main(["--model", str(folder), "--weights", str(folder), "--batch", "2", "--seq", "16", "--steps", "2",
          "--lr", "1e-2", "--data", str(data), "--out", str(tmp_path / "run"), "--no-tensorboard", *extra])
    return tmp_path / "run"


def our_tree(cfg, masters, dtype):
    """Our parameters as an export in ``dtype`` holds them: each master rounded to nearest, widened back."""
    return tree_from(model_spec(cfg), ((p, t.to(dtype).float()) for p, t in masters.items()))


def hf_model(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()


def greedy(hf, prompt, n):
    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return hf.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)


def assert_well_posed(params, cfg, out, prompt_len):
    """Greedy choices are compared only where no two logits tie within the fp32 bound: at every step ours takes,
    its best token leads the next by more than the two computations can differ."""
    with torch.no_grad():
        top2 = models.logits(params, out[:, :-1], cfg)[:, prompt_len - 1:].topk(2).values
    gap = (top2[..., 0] - top2[..., 1]).min().item()
    assert gap > 1e-4, f"a near tie ({gap:.1e}) at some greedy step: pick another prompt"


@pytest.mark.parametrize("family", FOLDERS)
def test_a_finetuned_run_exports_a_folder_that_serves(family, tmp_path, capsys):
    from tasks.export import main as export
    from tasks.generate import main as generate_task

    folder = model_folder(tmp_path, family)
    run = finetune(tmp_path, folder, "--export")
    ckpt = checkpoint_in(run)
    served = run / "export"
    assert f"exported {ckpt.name} to {served}" in capsys.readouterr().out
    assert {p.name for p in served.iterdir()} == {"config.json", "generation_config.json", "model.safetensors",
                                                  "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    export([str(run), "--out", str(tmp_path / "fp32"), "--dtype", "fp32"])
    cfg, masters = resolve_model(str(served)).cfg, read_masters(ckpt)
    assert cfg == resolve_model(str(ckpt)).cfg

    # The weights: every master rounded to nearest bf16, bit for bit; in fp32, the masters themselves.
    for exported, dtype in ((served, torch.bfloat16), (tmp_path / "fp32", torch.float32)):
        assert json.loads((exported / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
        files = load_hf(exported, cfg, dtype=dtype)
        for path, t in masters.items():
            assert torch.equal(get_path(files, path), t.to(dtype)), f"{exported.name}: {path}"

    # The tokenizer and its template, as transformers reads them; generation's BOS and EOS are the tokenizer's.
    theirs = AutoTokenizer.from_pretrained(served)
    prompt_text = "The quick brown fox"
    prompt = torch.tensor([theirs(prompt_text)["input_ids"]])
    assert prompt.tolist() == [AutoTokenizer.from_pretrained(folder)(prompt_text)["input_ids"]]
    assert theirs.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<s>user: hi</s>"
    generation = hf_model(served).generation_config
    assert (generation.bos_token_id, generation.eos_token_id) == (0, 1)

    # Logits and greedy tokens: ours on the fp32 export are ours on the checkpoint, exactly; transformers on each
    # export against ours on the same weights.
    with torch.no_grad():
        assert torch.equal(models.logits(load_hf(tmp_path / "fp32", cfg), prompt, cfg),
                           models.logits(our_tree(cfg, masters, torch.float32), prompt, cfg))
    n = 6
    for exported, dtype in ((tmp_path / "fp32", torch.float32), (served, torch.bfloat16)):
        ours, hf = our_tree(cfg, masters, dtype), hf_model(exported)
        with torch.no_grad():
            assert_same_logits(hf(prompt).logits, models.logits(ours, prompt, cfg), cfg)  # two orders of one forward
        out = generate(ours, prompt, cfg, max_new_tokens=n, temperature=0.0)
        assert_well_posed(ours, cfg, out, prompt.shape[1])
        assert torch.equal(greedy(hf, prompt, n), out), exported.name

    # tasks.generate on the export prints what transformers generates from it.
    capsys.readouterr()
    generate_task(["--model", str(served), "--prompt", prompt_text, "--max-new-tokens", str(n), "--temperature", "0"])
    printed = capsys.readouterr().out.split("--- sample 0 ---\n")[1].removesuffix("\n")
    assert printed == theirs.decode(greedy(hf_model(served), prompt, n)[0, 1:])  # from the prompt on: no BOS


def test_gpt2_bpe_becomes_a_tokenizer_json_and_a_run_exports_every_n_steps(offline_files, tmp_path, capsys,
                                                                          monkeypatch):
    """A preset that reads GPT-2's BPE (tiktoken's vocab.bpe and encoder.json) ships it as the tokenizer.json those
    files make: AutoTokenizer encodes as tiktoken does. ``--export-every 2`` exports step 2's checkpoint only."""
    from nanotrain.tokenizer import get_tokenizer
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    main(["--model", "tiny", "--weights", "random", "--batch", "2", "--seq", "16", "--steps", "3", "--save-every", "1",
          "--export-every", "2", "--data", str(SHAKESPEARE), "--tokenizer-dir", str(TOKENIZER_DIR), "--out", "run",
          "--no-tensorboard"])
    out = capsys.readouterr().out
    assert "exported step-000002 to run/export" in out and "exported step-000003" not in out
    text = SHAKESPEARE.read_text()[:5000] + " héllo wörld 日本語 🤖 it's<|endoftext|>  x \n\n"
    theirs = AutoTokenizer.from_pretrained("run/export")
    assert theirs(text)["input_ids"] == get_tokenizer(str(TOKENIZER_DIR)).encode_rendered(text)
    assert theirs.decode(theirs(text)["input_ids"]) == text
    assert (theirs.bos_token_id, theirs.eos_token_id, len(theirs)) == (50256, 50256, 50257)
    masters = read_masters(checkpoint_in("run").parent / "step-000002")
    files = load_hf("run/export", resolve_model("tiny").cfg, dtype=torch.bfloat16)
    assert all(torch.equal(get_path(files, p), t.to(torch.bfloat16)) for p, t in masters.items())


def test_a_sharded_export_loads_and_a_re_export_replaces_it(tmp_path, capsys):
    """Shards of at most --max-shard-gib and their index, which transformers loads; a second export into the same
    folder replaces the first whole, leaving nothing of either beside it."""
    from tasks.export import main as export

    family = "llama"
    run = finetune(tmp_path, model_folder(tmp_path, family))
    out = tmp_path / "sharded"
    export([str(run), "--out", str(out), "--dtype", "fp32"])
    export([str(run / "step-000002"), "--out", str(out), "--max-shard-gib", str(20_000 / 2**30)])
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").is_file()
    assert not (out / "model.safetensors").exists() and [p.name for p in tmp_path.glob(".sharded*")] == []
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    cfg = resolve_model(str(out)).cfg
    prompt = torch.tensor([AutoTokenizer.from_pretrained(out)("To be, or not")["input_ids"]])
    with torch.no_grad():
        theirs = hf_model(out)(prompt).logits
    assert_same_logits(theirs, models.logits(our_tree(cfg, read_masters(run / "step-000002"), torch.bfloat16), prompt,
                                             cfg), cfg)


def refused(main, argv, pattern, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit, match=pattern) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err


def test_what_an_export_refuses_in_one_line(tmp_path, capsys):
    from tasks.export import main as export
    from tasks.finetune import main as finetune_task

    run = finetune(tmp_path, model_folder(tmp_path, "qwen2"))
    refused(export, [str(run), "--out", str(run)], r"--out .*run holds files an export does not write \(config.toml, "
            r"latest, loss.png, ...\); pass a new or empty folder", capsys)
    refused(export, [str(tmp_path / "qwen2"), "--out", str(tmp_path / "x")],
            r"qwen2 is neither a checkpoint \(it has no trainer.json\) nor a run folder \(it has no 'latest'\)", capsys)
    refused(export, [str(run), "--out", str(tmp_path / "x"), "--max-shard-gib", "0"],
            r"--max-shard-gib 0.0 must be above 0", capsys)
    refused(export, [str(run), "--out", str(tmp_path / "x"), "--model", "tiny"],
            r"the checkpoint's weights are not those of a gpt2 model of 2 layers x 64 wide", capsys)
    masters = read_masters(run / "step-000002")
    path = next(iter(masters))
    masters[path][0] = 7e4  # beyond fp16's 65504
    with pytest.raises(CheckpointError, match=rf"{path} holds 7e\+04, beyond float16's largest value 6.55e\+04: "
                                              rf"export in bf16 or fp32"):
        export_masters(masters, resolve_model(str(run / "step-000002")).cfg, tmp_path / "x",
                       ecfg=ExportConfig(torch.float16))
    (run / "step-000002" / "trainer.json").write_text("{}")
    refused(export, [str(run), "--out", str(tmp_path / "x")],
            r"trainer.json does not match its SHA-256 in SHA256SUMS", capsys)
    assert not (tmp_path / "x").exists()
    common = ["--model", "tiny", "--batch", "2", "--seq", "16", "--out", str(tmp_path / "new")]
    refused(finetune_task, common + ["--save-every", "2", "--export-every", "3"],
            r"--export-every 3 exports saved checkpoints: give it a multiple of --save-every 2", capsys)
    refused(finetune_task, common + ["--export-every", "3"],
            r"--export-every 3 exports saved checkpoints: give it with --save-every", capsys)
    refused(finetune_task, common + ["--no-save", "--export"], r"--no-save saves none: drop one", capsys)


def test_a_model_without_a_tokenizer_at_hand_exports_and_says_where_to_copy_it_from(tmp_path, capsys):
    """A run on token files needs no tokenizer; its export has the weights and says in one line what to add. An
    export that fails within a run is one line, and the run goes on."""
    import numpy as np

    from tasks.export import main as export
    from tasks.finetune import main as finetune_task

    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 320, 2000, dtype=np.int64))
    (tmp_path / "run" / "export").mkdir(parents=True)
    (tmp_path / "run" / "export" / "notes.txt").write_text("mine")
    finetune_task(["--model", "tiny-llama", "--weights", "random", "--batch", "2", "--seq", "16", "--steps", "2",
                   "--save-every", "1", "--export-every", "1", "--data", str(tmp_path / "tokens.npy"),
                   "--out", str(tmp_path / "run"), "--no-tensorboard"])
    out = capsys.readouterr().out
    assert out.count("warning: step-000001 is saved, but its export to ") == 1 and "step-000002 is saved" in out
    assert "holds files an export does not write (notes.txt); pass a new or empty folder); training goes on" in out
    export([str(tmp_path / "run"), "--out", str(tmp_path / "hf")])
    note = capsys.readouterr().out.splitlines()[-1]
    assert note == ("note: no tokenizer files written: tiny-llama's tokenizer.json is not at hand; copy "
                    "tokenizer.json, tokenizer_config.json and chat_template.jinja from the model's hub repository "
                    "into the export, or export again with --tokenizer-dir DIR")
    assert {p.name for p in (tmp_path / "hf").iterdir()} == {"config.json", "generation_config.json",
                                                            "model.safetensors"}


def test_a_checkpoint_of_the_old_3d_format_exports_its_masters(tmp_path):
    """A ``layout.json`` of per-(tp, pp) files of masters (nanotrain's 3D format before the one sharded format),
    here two pipeline stages' files: the export holds the masters, whole."""
    from dataclasses import asdict

    from safetensors.torch import save_file

    from nanotrain.core.models import init_params, preset
    from nanotrain.core.tree import named_leaves
    from tasks.export import main as export

    cfg, old = preset("tiny", vocab_size=320), tmp_path / "step-000001"  # a vocabulary the TP plan keeps unpadded
    masters = dict(named_leaves(init_params(cfg, seed=3)))
    old.mkdir()
    paths = list(masters)
    for p, part in enumerate((paths[:2], paths[2:])):
        save_file({f"master.{path}": masters[path] for path in part}, old / f"tp0-pp{p}.safetensors")
    (old / "layout.json").write_text(json.dumps({"family": "gpt2", "config": asdict(cfg), "tp": 1, "pp": 2}))
    export([str(old), "--out", str(tmp_path / "hf"), "--dtype", "fp32"])
    files = load_hf(tmp_path / "hf", cfg)
    assert all(torch.equal(get_path(files, path), t) for path, t in masters.items())
