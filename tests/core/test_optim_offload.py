"""OffloadAdam on the CPU: against torch.optim.AdamW, 8-bit vs 32-bit, save/resume, skipped steps."""
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanotrain.core.models import init_params, loss, model_spec, preset
from nanotrain.core.optim import AdamConfig, OffloadAdam, OffloadConfig
from nanotrain.core.tree import get_path, named_leaves
from tests.conftest import U32, adam_apart, adam_cap

CFG = preset("tiny", n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_ctx=16)
HP = AdamConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CPU = OffloadConfig(device="cpu", dtype=torch.float32)
UNITS = model_spec(CFG).unit_dict()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CFG.vocab_size, (4, 17), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def gradients(opt: OffloadAdam, step: int) -> tuple[float, dict[str, list[torch.Tensor]]]:
    """One forward/backward on the optimizer's device weights, as a trainer does it."""
    for unit in UNITS:
        opt.weights(unit)
    leaves = dict(named_leaves(opt.params))
    for t in leaves.values():
        t.requires_grad_(True)
    value = loss(opt.params, *batch(step), CFG)
    grads = dict(zip(leaves, torch.autograd.grad(value, list(leaves.values()))))
    for t in leaves.values():
        t.requires_grad_(False)
    return value.item(), {u: [grads[p] for p in paths] for u, paths in UNITS.items()}


def backward_order(grads: dict[str, list[torch.Tensor]]) -> list[tuple[str, list[torch.Tensor]]]:
    return list(reversed(grads.items()))  # ln_f, blocks from the last, embed last: as backward finishes them


def train(opt: OffloadAdam, steps: range, poison: dict[int, str] | None = None) -> list[float]:
    losses = []
    for step in steps:
        value, grads = gradients(opt, step)
        losses.append(value)
        for unit, g in backward_order(grads):
            if poison and poison.get(step) == unit:
                g = [t.clone() for t in g]
                g[0].view(-1)[0] = float("nan")
            opt.update(unit, g)
    opt.synchronize()
    return losses


def snapshot(opt: OffloadAdam) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in opt.state_dict().items()}
    out.update({f"device.{p}": t.clone() for p, t in named_leaves(opt.params)})
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_32bit_offload_matches_torch_adamw():
    params = init_params(CFG, seed=1)
    opt = OffloadAdam(params, UNITS, HP, CPU)
    ref = {p: t.clone().requires_grad_() for p, t in named_leaves(params)}
    start, applied = {p: t.detach().clone() for p, t in ref.items()}, {}
    ref_opt = torch.optim.AdamW(ref.values(), lr=HP.lr, betas=HP.betas, eps=HP.eps,
                                weight_decay=HP.weight_decay, foreach=False)
    for step in range(12):
        _, grads = gradients(opt, step)
        for unit, g in backward_order(grads):
            for path, t in zip(UNITS[unit], g):
                ref[path].grad = t.clone()
                applied.setdefault(path, []).append(t.clone())
            opt.update(unit, g)
        ref_opt.step()
    opt.synchronize()
    assert opt.steps == 12
    sd = opt.state_dict()
    for path, want in ref.items():
        # The same gradients: masters and device weights within each run's rounding (conftest.adam_apart); the
        # second moment within 3 roundings a step on each side, each of at most the last v (beta2^k v_t <= v_T)
        bound = adam_apart(applied[path], [0.0] * 12, start[path], HP)[-1].view_as(want)
        assert ((sd[f"master.{path}"] - want).abs() <= bound).all(), path
        assert ((get_path(opt.params, path) - want).abs() <= bound).all(), path
        v = ref_opt.state[want]["exp_avg_sq"]
        assert ((sd[f"exp_avg_sq.{path}"].view_as(v) - v).abs() <= 2 * 3 * 12 * U32 * v).all(), path
    opt.close()


def test_offload_and_on_device_updates_agree_exactly():
    results = []
    for offload in (True, False):
        opt = OffloadAdam(init_params(CFG, seed=1), UNITS, HP, replace(CPU, offload=offload, state_bits=8, block=256,
                                                                          min_8bit_numel=0))
        train(opt, range(4))
        results.append(snapshot(opt))
    assert_same(*results)


def test_8bit_offload_tracks_32bit():
    curves = []
    for bits in (32, 8):
        cfg = replace(CPU, state_bits=bits, block=256, min_8bit_numel=1024, keep_32bit=("wte",))
        opt = OffloadAdam(init_params(CFG, seed=1), UNITS, HP, cfg)
        curves.append(train(opt, [0, 1, 2, 3] * 10))  # four batches, ten epochs: the loss must fall
        opt.close()
    l32, l8 = curves
    assert l32[-1] < 0.6 * l32[0]
    # Bound: every step's 8-bit loss within 1% of the 32-bit one (measured: 0.08% at worst).
    assert max(abs(a - b) / b for a, b in zip(l8, l32)) < 0.01


@pytest.mark.parametrize("bits,exact", [(32, False), (8, False), (8, True)])
def test_state_dict_round_trip_through_safetensors(tmp_path, bits, exact):
    cfg = replace(CPU, state_bits=bits, block=256, min_8bit_numel=1024, exact_skip=exact)
    a = OffloadAdam(init_params(CFG, seed=1), UNITS, HP, cfg)
    train(a, range(3))
    save_file(a.state_dict(), tmp_path / "opt.safetensors")
    b = OffloadAdam(init_params(CFG, seed=2), UNITS, HP, cfg)  # other weights, overwritten by the load
    b.load_state_dict(load_file(tmp_path / "opt.safetensors"))
    assert_same(snapshot(a), snapshot(b))
    train(a, range(3, 6))
    train(b, range(3, 6))
    assert_same(snapshot(a), snapshot(b))


def test_load_rejects_a_checkpoint_of_another_configuration():
    a = OffloadAdam(init_params(CFG, seed=1), UNITS, HP, CPU)
    b = OffloadAdam(init_params(CFG, seed=1), UNITS, HP, replace(CPU, state_bits=8, min_8bit_numel=0))
    with pytest.raises(ValueError, match="exp_avg_absmax"):
        b.load_state_dict(a.state_dict())


@pytest.mark.parametrize("bits,exact,bad_unit", [(32, False, "ln_f"), (8, False, "ln_f"),
                                                 (32, True, "blocks.0"), (8, True, "embed")])
def test_non_finite_step_is_skipped_exactly(bits, exact, bad_unit):
    """ln_f is the first unit to arrive: skipping in place is exact. Later ones need exact_skip."""
    cfg = replace(CPU, state_bits=bits, block=256, min_8bit_numel=1024, exact_skip=exact)
    clean = OffloadAdam(init_params(CFG, seed=1), UNITS, HP, cfg)
    skipped = OffloadAdam(init_params(CFG, seed=1), UNITS, HP, cfg)
    train(clean, range(2))
    train(skipped, range(2))
    before = snapshot(skipped)
    train(skipped, [2], poison={2: bad_unit})
    assert skipped.skipped_steps == 1 and skipped.steps == 2
    after = snapshot(skipped)
    after["skipped_steps"] = before["skipped_steps"]
    assert_same(before, after)  # weights (masters and device), moments, step count untouched
    train(clean, [3])
    train(skipped, [3])  # the step after a skip is the one a never-skipping run takes
    clean_state, skipped_state = snapshot(clean), snapshot(skipped)
    skipped_state["skipped_steps"] = clean_state["skipped_steps"]
    assert_same(clean_state, skipped_state)


def test_in_place_skip_refuses_a_half_applied_step():
    opt = OffloadAdam(init_params(CFG, seed=1), UNITS, HP, CPU)
    with pytest.raises(RuntimeError, match="exact_skip=True"):
        train(opt, [0], poison={0: "embed"})
    with pytest.raises(RuntimeError, match="cannot be undone"):
        opt.weights("embed")


def test_protocol_errors_name_the_unit():
    opt = OffloadAdam(init_params(CFG, seed=1), UNITS, HP, CPU)
    _, grads = gradients(opt, 0)
    with pytest.raises(KeyError, match="unknown unit 'block.0'"):
        opt.update("block.0", grads["blocks.0"])
    with pytest.raises(ValueError, match="gradient of 'ln_f_b' is \\(3,\\)"):
        opt.update("ln_f", [grads["ln_f"][0], torch.zeros(3)])
    with pytest.raises(ValueError, match="2 parameters"):
        opt.update("ln_f", grads["ln_f"][:1])
    opt.update("ln_f", grads["ln_f"])
    with pytest.raises(RuntimeError, match="'ln_f' already got its gradients"):
        opt.update("ln_f", grads["ln_f"])
    with pytest.raises(ValueError, match="exactly once"):
        OffloadAdam(init_params(CFG, seed=1), {"all": ["wte"]}, HP, CPU)
    with pytest.raises(ValueError, match="keep_32bit names \\['wte.weight'\\]"):
        OffloadAdam(init_params(CFG, seed=1), UNITS, HP, replace(CPU, keep_32bit=("wte.weight",)))


def synthetic_grads(step: int, dtype: torch.dtype) -> list[tuple[str, list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(100 + step)
    shapes = model_spec(CFG).shapes
    return [(u, [torch.randn(shapes[p], generator=gen).to(dtype) for p in UNITS[u]]) for u in reversed(UNITS)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("offload,bits,exact", [(True, 32, False), (True, 8, True), (False, 32, False),
                                                 (False, 8, True)])
def test_cuda_streams_match_the_cpu_run(offload, bits, exact):
    """Gradients made on a busy compute stream and freed at once; the same updates as on the CPU."""
    cfg = replace(CPU, dtype=torch.bfloat16, state_bits=bits, block=256, min_8bit_numel=1024, exact_skip=exact)
    on_cpu = OffloadAdam(init_params(CFG, seed=1), UNITS, HP, cfg)
    on_gpu = OffloadAdam(init_params(CFG, seed=1), UNITS, HP, replace(cfg, device="cuda", offload=offload))
    # CUDA's fused kernel rounds differently: on the same gradients, the masters only each side's rounding apart
    # (conftest.adam_apart with no distance between the gradients, after the 3 applied steps: the most of any step)
    start = dict(named_leaves(init_params(CFG, seed=1)))
    rounding = {p: adam_apart([torch.zeros_like(w)] * 3, [0.0] * 3, w, HP)[-1] for p, w in start.items()}
    for step in range(4):
        for unit in UNITS:
            seen = [t.clone() for t in on_gpu.weights(unit)]  # read on the compute stream
            for path, a, b in zip(UNITS[unit], seen, on_cpu.weights(unit)):
                if offload:
                    assert torch.equal(a.cpu(), b)
                elif bits == 32:  # the masters' distance, and each side's rounding to bf16: half an ulp, 2^-8 of it
                    a, b = a.cpu().double(), b.double()
                    assert ((a - b).abs() <= rounding[path] + 2 ** -8 * (a.abs() + b.abs())).all(), path
        for unit, grads in synthetic_grads(step, torch.bfloat16):
            if step == 2 and unit == ("blocks.0" if exact else "ln_f"):  # a skipped step too
                grads = [torch.full_like(g, float("inf")) for g in grads]
            on_cpu.update(unit, grads)
            on_device = [g.cuda() for g in grads]  # (a copy from pageable memory blocks the host: do it first)
            torch.cuda._sleep(2_000_000)  # the "backward" is still running when update is called:
            on_gpu.update(unit, [g * 1 for g in on_device])  # these are written after the sleep, then freed
    on_cpu.synchronize()
    on_gpu.synchronize()
    torch.cuda.synchronize()
    a, b = on_cpu.state_dict(), on_gpu.state_dict()
    assert int(b["steps"]) == 3 and int(b["skipped_steps"]) == 1
    for key in a:
        if offload:  # the same CPU arithmetic on the same gradients: identical
            assert torch.equal(a[key], b[key].cpu()), key
        elif key.startswith("master"):
            path = key.removeprefix("master.")
            diff = (a[key] - b[key].cpu()).abs().double()
            close = diff <= rounding[path]  # the rounding's distance (above)
            if bits == 32:
                assert bool(close.all()), key
            else:  # that can move a moment across a code midpoint: a different update, within what any steps move
                # (conftest.adam_cap), for a few elements (not derived: at most 2% of a leaf, the share measured rare)
                cap = adam_cap(2 * start[path].abs() + 2 * 3 * HP.lr, 3, HP)
                assert float(close.float().mean()) > 0.98 and bool((diff <= cap).all()), key


def test_copy_false_takes_the_fp32_leaves_over_as_masters():
    given, taken_over = init_params(CFG, seed=1), init_params(CFG, seed=1)
    kept = OffloadAdam(given, UNITS, HP, CPU)
    taken = OffloadAdam(taken_over, UNITS, HP, CPU, copy=False)
    assert kept.state_dict()["master.wte"].data_ptr() != given["wte"].data_ptr()  # the default copies
    assert taken.state_dict()["master.wte"].data_ptr() == taken_over["wte"].data_ptr()  # no second copy
    kept.close()
    taken.close()
