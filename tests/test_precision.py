"""Learner and SFT device and precision (learner/precision.py, `learner.device` / `learner.dtype`,
`simulator.sft_device` / `simulator.sft_dtype`).

- bf16 mixed precision on CPU: an update of the tiny random Llama (multi-turn packed GRPO, and
  single-step PPO with the KL reference and importance-corrected members) has a finite loss and
  the fp32 update's gradient direction (cosine > 0.99), computed through bf16 logits, while the
  parameters, gradients and AdamW state stay fp32; Mexp SFT's loop does the same;
- `dreamgym train` with learner.dtype=bfloat16 (and the policy warm start) updates and publishes
  fp32 weights an engine loads;
- a device this machine lacks fails at start with a ConfigError naming the setting: `train`, the
  Learner, the policy warm start and Mexp SFT, each before it loads anything;
- cache keys: bf16 SFT gets its own cache, the device and the float32 default change none;
- `gpu` (skipped without CUDA): a bf16 update of a random-init model of Qwen2.5-0.5B's shapes
  on CUDA, its reference and proximal passes on the same device.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from infra.config import ConfigError, LearnerConfig, SimulatorConfig, load_config
from infra.engine.models import load_tokenizer, load_weights
from learner import mexp_sft, policy_sft
from learner.learner import Learner, stream_learner
from learner.policy_model import PolicyModel
from learner.precision import Precision
from learner.update import accumulate_gradients, apply_update, chunks_of, fixed_inputs, rows_of
from learner.weights import published_versions, version_path
from test_packed import units as multi_turn_units
from test_update import units as single_step_units

CUDA = torch.cuda.is_available()
BF16 = Precision("cpu", "bfloat16")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    tok = load_tokenizer("smollm2")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      pad_token_id=tok.pad_token_id)
    return LlamaForCausalLM(cfg).eval(), tok


def policy_of(model, tok, cfg: LearnerConfig, precision: Precision) -> PolicyModel:
    policy = PolicyModel(model=copy.deepcopy(model), tokenizer=tok, value_head=cfg.algo == "ppo", precision=precision)
    if policy.value_head is not None:  # a non-zero head, so the value loss has a gradient everywhere
        torch.manual_seed(1)
        torch.nn.init.normal_(policy.value_head.weight, std=0.1)
    if cfg.kl_coef > 0:
        policy.snapshot_reference()
    return policy.train()


def gradients(model, tok, cfg: LearnerConfig, batch, precision: Precision) -> tuple[torch.Tensor, float]:
    """The flattened gradient of one update's loss (all parameters, in order) and the loss."""
    policy = policy_of(model, tok, cfg, precision)
    rows = rows_of(batch)
    chunks = chunks_of(rows, cfg.micro_batch)
    sums = accumulate_gradients(policy, cfg, rows, chunks, fixed_inputs(policy, cfg, rows, chunks))
    params = [p for p in policy.parameters() if p.requires_grad]
    assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32 for p in params)
    return torch.cat([p.grad.flatten() for p in params]), sums["loss"]


def batch_of(kind: str, model, tok):
    if kind == "multi-turn grpo":
        return multi_turn_units(tok, model), LearnerConfig(micro_batch=4, clip_eps=0.03)
    return single_step_units(tok, "ppo"), LearnerConfig(algo="ppo", kl_coef=0.1, micro_batch=2,
                                                        staleness_mode="importance")


@pytest.mark.parametrize("kind", ["multi-turn grpo", "single-step ppo with kl"])
def test_a_bf16_update_has_a_finite_loss_and_the_fp32_gradient_direction(tiny, kind):
    model, tok = tiny
    batch, cfg = batch_of(kind, model, tok)
    want, loss32 = gradients(model, tok, cfg, batch, Precision())
    got, loss16 = gradients(model, tok, cfg, batch, BF16)
    assert math.isfinite(loss16) and torch.isfinite(got).all()
    assert float(want.norm()) > 1e-4  # a real gradient, not zeros
    assert float(torch.nn.functional.cosine_similarity(got, want, dim=0)) > 0.99
    assert abs(loss16 - loss32) < 0.05 * max(1.0, abs(loss32))
    assert not torch.equal(got, want)  # computed in bf16, not silently in fp32

    policy = policy_of(model, tok, cfg, BF16)
    s = batch[0].trajs[0].steps[0]
    logits, _, _ = policy._choice_logits(policy.lm, [s.policy_prompt], s.action_token_ids)
    assert logits.dtype == torch.bfloat16


def test_a_bf16_optimizer_step_keeps_fp32_master_weights_and_adam_state(tiny):
    model, tok = tiny
    batch, cfg = batch_of("single-step ppo with kl", model, tok)
    policy = policy_of(model, tok, cfg, BF16)
    layers = [p for n, p in policy.named_parameters() if ".layers." in n]  # every entry has a gradient
    before = [p.detach().clone() for p in layers]
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-5, weight_decay=0.0)
    stats = apply_update(policy, opt, cfg, batch, version=0)
    assert math.isfinite(stats.loss) and stats.tokens > 0
    assert all(p.dtype == torch.float32 for p in policy.trainable_parameters())
    # The 1e-5 steps survive: in bf16 weights most of them would round away.
    assert sum(int((a.detach() != b).sum()) for a, b in zip(layers, before)) > 0.9 * sum(b.numel() for b in before)
    assert all(v.dtype == torch.float32 for st in opt.state.values() for k, v in st.items() if k != "step")


def test_mexp_sft_in_bf16_trains_fp32_weights(tiny):
    model, tok = tiny
    ids = tok("<|im_start|>user\nThe door is open.<|im_end|>\n", add_special_tokens=False)["input_ids"]
    data = [mexp_sft.Encoded(ids, [mexp_sft.IGNORE] * 4 + ids[4:], [False] * 4 + [True] * 3 + [False] * (len(ids) - 7),
                             [False] * (len(ids) - 2) + [True] * 2)
            for _ in range(4)]
    net = copy.deepcopy(model)
    report = mexp_sft.train(net, tok, data, data[:2], SimulatorConfig(sft_dtype="bfloat16", sft_batch_size=2, sft_outcome_weight=4.0,
                                                                       sft_lr=1e-3), progress=False)
    assert all(math.isfinite(x) for x in report["train_curve"]) and len(report["train_curve"]) == 2
    assert report["after"]["loss_all"] < report["before"]["loss_all"]
    assert all(p.dtype == torch.float32 for p in net.parameters())


@pytest.mark.slow
async def test_train_in_bf16_updates_and_publishes_weights_an_engine_loads(tiny_run, tmp_path, caplog):
    from infra.run.driver import train

    shared = tmp_path / "shared-weights"
    cfg = load_config(None, [*tiny_run, "learner.dtype=bfloat16", "learner.total_updates=1",
                             "learner.warm_start_steps=2", "learner.warm_start_batch=2",
                             "learner.warm_start_permutations=1", "learner.publish_dtype=bfloat16",
                             f"infra.weights_dir={shared}"])
    with caplog.at_level(logging.ERROR, logger="learner.learner"):
        summary = await train(cfg, "bf16", evaluate=False)
    assert summary["updates"] == 1 and summary["weight_version"] == 1
    # The embedded policy engine accepted the shared path (it only loads from its weights roots).
    assert not [r for r in caplog.records if "publishing weights" in r.getMessage()]
    assert math.isfinite(summary["history"][0]["loss"])
    warm = policy_sft.cache_dir(cfg)
    assert (warm / "warm_start.json").exists()  # the warm start ran too, in bf16 (its own cache key)
    assert warm != policy_sft.cache_dir(dataclasses.replace(cfg, learner=LearnerConfig()))
    run_dir = tmp_path / "runs" / "bf16"
    assert published_versions(run_dir)[-1] == 1
    # Published as bf16 safetensors in the shared directory; the fp32 engine loads them as fp32.
    assert version_path(run_dir, 1).resolve() == (shared / "bf16" / "v1").resolve()
    with safe_open(str(shared / "bf16" / "v1" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    model = load_weights(str(version_path(run_dir, 1)))  # as the CPU engine loads it
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())


def test_publish_dtype_auto_follows_the_engines_and_keeps_the_policy_fp32(tiny, tmp_path):
    """A bf16 publish writes bf16 tensors equal to the fp32 weights rounded, and leaves the policy fp32."""
    policy = policy_of(*tiny, LearnerConfig(), Precision("cpu", "float32"))
    path = policy.save_hf(tmp_path / "v1", dtype="bfloat16")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    own = policy.lm.state_dict()
    assert saved and all(v.dtype == torch.bfloat16 and torch.equal(v, own[k].to(torch.bfloat16))
                         for k, v in saved.items())
    assert all(p.dtype == torch.float32 for p in policy.lm.parameters())
    assert json.loads((path / "config.json").read_text()).get("dtype") == "bfloat16"
    for engines_dtype, want in (("bfloat16", "bfloat16"), ("float32", "float32")):
        cfg = load_config(None, [f"engines.dtype={engines_dtype}", "learner.publish_dtype=auto"])
        learner = stream_learner(cfg, None, "p", tmp_path / engines_dtype, None, str(path))
        assert learner.publisher.dtype == want


# ---- a device this machine lacks ----------------------------------------------------------------

@pytest.mark.parametrize("value", ["gpu", "cuda:x", "CUDA", ""])
def test_a_malformed_device_fails_at_load_time(value):
    for key in ("learner.device", "simulator.sft_device"):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [f"{key}={value}"])
    with pytest.raises(ConfigError, match="learner.dtype"):
        load_config(None, ["learner.dtype=float16"])


@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
def test_cuda_without_cuda_fails_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"learner.device=cuda: CUDA is not available.*set learner.device=cpu"):
        Precision.checked("cuda", "bfloat16", "learner.device", "learner.dtype")
    # Each entry point checks before it loads a model (the model name here does not exist).
    with pytest.raises(ConfigError, match="learner.device=cuda:1"):
        Learner(LearnerConfig(device="cuda:1"), str(tmp_path / "no-model"), tmp_path, consumer=None)
    cfg = load_config(None, [f"infra.run_dir={tmp_path / 'runs'}", f"infra.data_dir={tmp_path / 'data'}",
                             f"engines.model={tmp_path / 'no-model'}", "learner.device=cuda"])
    with pytest.raises(ConfigError, match="learner.device=cuda"):
        policy_sft.warm_start(cfg, [], tmp_path / "warm")
    with pytest.raises(ConfigError, match="simulator.sft_device=cuda"):
        mexp_sft.run_sft(SimulatorConfig(sft_device="cuda"), tmp_path / "no-data", tmp_path / "mexp")


@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
async def test_train_with_a_missing_device_fails_before_starting_anything(tmp_path):
    from infra.run.driver import train

    for key in ("learner.device", "simulator.sft_device"):
        cfg = load_config(None, [f"infra.run_dir={tmp_path / 'runs'}", f"infra.data_dir={tmp_path / 'data'}",
                                 f"{key}=cuda"])
        with pytest.raises(ConfigError, match=f"{key}=cuda"):
            await train(cfg, "no-gpu", evaluate=False)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "data").exists()


def test_the_dtype_shapes_the_sft_caches_and_the_device_does_not():
    sim, learn = SimulatorConfig(), LearnerConfig()
    keys = mexp_sft.cache_settings(sim, "m", "o", 0)
    assert "sft_device" not in keys and "sft_dtype" not in keys  # caches of fp32 SFT made before stay valid
    assert mexp_sft.cache_settings(SimulatorConfig(sft_device="cuda:1"), "m", "o", 0) == keys
    assert mexp_sft.cache_settings(SimulatorConfig(sft_dtype="bfloat16"), "m", "o", 0) == {**keys, "sft_dtype": "bfloat16"}
    keys = policy_sft.cache_settings(learn, "m", "o", 0)
    assert "dtype" not in keys and "device" not in keys
    assert policy_sft.cache_settings(LearnerConfig(device="cuda"), "m", "o", 0) == keys
    assert policy_sft.cache_settings(LearnerConfig(dtype="bfloat16"), "m", "o", 0) == {**keys, "dtype": "bfloat16"}


# ---- on a GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_a_bf16_update_of_a_real_size_model_on_cuda(tiny):
    """Qwen2.5-0.5B's shapes, random weights: GRPO with the KL reference and importance-corrected
    (proximal) members, every pass on the GPU in bf16 autocast, the master weights fp32."""
    _, tok = tiny
    torch.manual_seed(0)
    shapes = Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32_768,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id)
    cfg = LearnerConfig(kl_coef=0.1, staleness_mode="importance", micro_batch=4, device="cuda", dtype="bfloat16")
    precision = Precision.checked(cfg.device, cfg.dtype, "learner.device", "learner.dtype")
    policy = PolicyModel(model=Qwen2ForCausalLM(shapes), tokenizer=tok, precision=precision)
    policy.snapshot_reference()
    assert {p.device.type for p in policy.parameters()} == {"cuda"}
    assert {p.device.type for p in policy._ref.parameters()} == {"cuda"}
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-5, weight_decay=0.0)
    stats = apply_update(policy, opt, cfg, single_step_units(tok, "grpo"), version=0)
    assert math.isfinite(stats.loss) and stats.tokens > 0
    assert all(p.dtype == torch.float32 and p.is_cuda for p in policy.trainable_parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_the_learner_loads_its_policy_on_the_configured_gpu(tiny_dir, tmp_path):
    cfg = LearnerConfig(device="cuda:0", dtype="bfloat16", kl_coef=0.1, algo="ppo")
    learner = Learner(cfg, str(tiny_dir), tmp_path, consumer=None)
    assert {p.device.type for p in learner.policy.parameters()} == {"cuda"}
    assert {p.device.type for p in learner.policy._ref.parameters()} == {"cuda"}
    assert learner.policy.value_head.weight.is_cuda and learner.policy.precision == Precision("cuda:0", "bfloat16")
