"""The per-ZeRO-stage memory plan against a hand count, and tasks.finetune's refusal naming what would fit."""
import pytest

from nanotrain.core.models import preset
from nanotrain.core.footprint import GIB
from nanotrain.data_parallel.footprint import plan_zero, zero_estimate

# c = 8: a block has 12 c^2 + 13 c = 872 parameters, the embeddings (100 + 16) c = 928, ln_f 2 c = 16,
# so n = 928 + 2 * 872 + 16 = 2688; over 2 ranks a shard is 1344, of which 928 / 2 = 464 are embeddings.
CFG = preset("tiny", n_layer=2, n_embd=8, n_head=2, vocab_size=100, n_ctx=16)
# One sequence of 16 tokens in bf16 (2 bytes) with recompute every: the saved block inputs 2 layers x 2 c x 16
# = 512 bytes, one block recomputed 34 c x 16 = 4352; the LM head: a chunk of 16 tokens x 128 (the padded
# vocabulary) x (4 + 2) = 12288, its fp32 weight gradient 128 x 8 x 4 = 4096, the final hidden 16 x 8 x 2 = 256.
ACTIVATIONS = 512 + 4352 + 12288 + 4096 + 256


def test_each_stage_against_a_hand_count():
    want = {  # (weights, gradients, masters, moments) per GPU, bf16 compute, 32-bit moments, 2 ranks
        0: (2688 * 2, 2688 * 4, 2688 * 4, 2688 * 8),
        1: (2688 * 2 + 2 * 1344 * 2, 2688 * 4, 1344 * 4, 1344 * 8),  # the shard's weights and its gather input
        2: (2688 * 2 + 2 * 1344 * 2, 2688 * 4 + 1344 * 4, 1344 * 4, 1344 * 8),
        # the shard, then gathered: the embeddings, ln_f and a block; gradients: the fp32 shard, the fp32
        # embeddings, ln_f and two blocks being reduced, and the embeddings' gradient in bf16
        3: (1344 * 2 + (928 + 16 + 872) * 2, 1344 * 4 + (928 + 16 + 2 * 872) * 4 + 928 * 2, 1344 * 4, 1344 * 8),
    }
    for zero, (weights, grads, masters, moments) in want.items():
        plan = zero_estimate(CFG, 2, zero, 1, 16, "every", states_on_gpu=True)
        assert (plan.weights, plan.gradients, plan.masters, plan.moments) == want[zero], zero
        assert plan.activations == ACTIVATIONS
        assert plan.total == int((weights + grads + masters + moments + ACTIVATIONS) * 1.10)
        on_host = zero_estimate(CFG, 2, zero, 1, 16, "every")  # --states cpu: not on the GPU
        assert on_host.total == int((weights + grads + ACTIVATIONS) * 1.10)
    # fp16's exact skips keep masters and moments twice; 8-bit moments are 2 bytes + two fp32 scales per 2048 only
    # in leaves of 4096 elements or more that are not embeddings: none here (the largest, the embeddings, is 800),
    # so the engine keeps every moment at 32 bits; a bf16 reduction adds its send buffers
    plan = zero_estimate(CFG, 2, 2, 1, 16, "every", state_bits=8, exact_skip=True, reduce_bytes=2)
    assert (plan.masters, plan.moments) == (2 * 1344 * 4, 2 * 1344 * 8)
    assert plan.gradients == 2688 * 4 + 1344 * 4 + 2688 * 2 + 1344 * 2


def test_a_plan_that_cannot_fit_names_what_would():
    xl = preset("gpt2-xl")
    assert plan_zero(xl, 2, 3, 64, 1024, "every", 11 * GIB).micro_batch == 16
    with pytest.raises(MemoryError, match=r"cannot fit 11.00 GiB per GPU: it needs DDP over 2 GPUs, micro-batch 1, "
                                          r"recompute none: .* would fit: --zero 3 --recompute every \(micro-batch "
                                          r"16\); or --recompute every \(micro-batch 2\)$"):
        plan_zero(xl, 2, 0, 64, 1024, "none", 11 * GIB)
    large = preset("gpt2-large")
    # with masters and moments in host memory, ZeRO-1 and -2 hold more on the GPU than DDP (weights and a
    # shard of them): only ZeRO-3 allows a larger micro-batch
    with pytest.raises(MemoryError, match=r"would fit: --micro-batch 2; or --zero 3 --recompute every \(micro-batch "
                                          r"32\); or --recompute lean \(micro-batch 4\)$"):
        plan_zero(large, 2, 0, 64, 1024, "none", 11 * GIB, 16)
    with pytest.raises(MemoryError, match=r"would fit: --zero 3 --recompute every \(micro-batch 8\); or --states cpu "
                                          r"\(micro-batch 2\)$"):
        plan_zero(large, 2, 1, 64, 1024, "none", 11 * GIB, 16, states_on_gpu=True)
    with pytest.raises(MemoryError, match="nothing at this world size fits: raise --gpu-mem-gib"):
        plan_zero(xl, 2, 3, 64, 1024, "every", GIB)


def test_finetune_refuses_before_loading_anything(tmp_path, monkeypatch):
    from tasks.finetune import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=r"^error: no plan of 64 x 1024 fits 4 GPUs of 11.0 GiB with the settings "
                                         r"given; "
                                         r"the least that works: .*leaving out --zero 1 \(planned: .*--recompute every "
                                         r"--dp 4 --zero 3\)"):
        main(["--model", "gpt2-xl", "--dp", "4", "--zero", "1", "--gpu-mem-gib", "11", "--dtype", "bf16",
              "--data", "no-such-file.txt", "--out", "run"])
    assert not (tmp_path / "run").exists()
