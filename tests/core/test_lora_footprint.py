"""The adapters' byte counts (``core.lora_footprint``) against what the trainer holds; ``tasks.plan``'s LoRA plans."""
import pytest
import torch

from nanotrain.core.frozen import FrozenBase
from nanotrain.core.lora_footprint import adapter_params, adapter_state_bytes, frozen_bytes
from nanotrain.core.models import model_spec, preset, run
from nanotrain.core.models.lora import LoraConfig, with_lora
from nanotrain.core.optim import AdamConfig, OffloadConfig
from nanotrain.core.train.resident import ResidentTrainer, TrainConfig

SPEC = with_lora(model_spec(preset("tiny-llama")), LoraConfig(4, 8.0, ("q", "v", "down")))


@pytest.mark.parametrize("bits", [16, 4])
def test_frozen_and_adapter_bytes_are_what_the_trainer_holds(bits):
    # FrozenBase takes its leaves out of the tree it is given: a tree of its own
    frozen = FrozenBase(SPEC, run.init_params(SPEC, seed=0), torch.device("cpu"), torch.float32, bits)
    params = run.init_params(SPEC, seed=0)
    assert frozen.nbytes == frozen_bytes(SPEC, 4, bits)
    trainer = ResidentTrainer(SPEC, params, TrainConfig(batch=2, micro_batch=2), AdamConfig(),
                              OffloadConfig(device="cpu", dtype=torch.float32, base_bits=bits))
    state = trainer.state_dict()
    held = sum(t.numel() * t.element_size() for k, t in state.items() if k not in ("steps", "skipped_steps"))
    assert held == adapter_state_bytes(SPEC, 32)
    assert adapter_params(SPEC) == sum(t.numel() for k, t in state.items() if k.startswith("master."))
    trainer.close()


def test_task_plan_prints_a_resident_and_a_streamed_adapter_plan(capsys):
    """The one search (``plan.candidates``) plans an adapted spec with the adapters' bytes: the 8B model's LoRA
    resident under 24 GiB (its state pinned to the GPU), its QLoRA streamed under 8 GiB (the base in NF4, 5.31 GiB)."""
    from tasks.plan import main

    common = ["--model", "llama-3.1-8b", "--lora-rank", "16", "--lora-targets", "q,k,v,o,gate,up,down",
              "--batch", "8", "--seq", "2048", "--recompute", "every"]
    main(common + ["--gpu-mem-gib", "24", "--states", "gpu"])  # the pairs' state on the GPU: resident
    main(common + ["--gpu-mem-gib", "8", "--lora-base-bits", "4"])
    out = capsys.readouterr().out
    assert "41.9M trained parameters, the frozen base in 2-byte compute, 14.96 GiB) (8.07B parameters)" in out
    assert "\n  resident (one GPU): micro-batch" in out
    assert "the frozen base in NF4, 5.31 GiB)" in out and "\n  streamed (weights streamed block by block): " in out


def test_flops_count_four_per_frozen_weight_and_six_per_pair_weight():
    """MFU counts what LoRA computes: a frozen weight's forward and input gradient, no weight gradient."""
    base = model_spec(preset("tiny-llama")).costs
    multiplied = base.total_params - base.lookup_params
    assert SPEC.costs.flops_per_token(64) == base.flops_per_token(64) - 2 * multiplied + 6 * adapter_params(SPEC)
