"""`dreamgym train-mexp`: supervised fine-tuning of the experience model (paper Eq. 5).

Owns Mexp's training on offline real trajectories. The objective is the paper's
joint loss

    L = -log p(reasoning | ctx) - log p(next state, reward, done | ctx, reasoning)

which, for one autoregressive target `reasoning + state/reward/done`, is the summed
token cross-entropy over the target tokens with the prompt masked. It is reported
as its two terms (per-token means over the reasoning tokens and over the rest) as
well as the token-mean total that is optimised. The context is built by
simulator/mexp_data.py exactly as at inference, including the top-k neighbours
retrieved from a buffer of the TRAIN trajectories with the step's own episode
excluded. Held-out tasks (same split as `dreamgym fidelity`) give the validation
loss, measured before and after training.

Departures: the <think> target is the environment-derived rationale the dataset
stores (`Step.reasoning`, e.g. TextWorld fact differences), not a teacher LLM's
reasoning; examples longer than `sft_max_len` tokens are skipped, not truncated;
`sft_outcome_weight` can count the few reward and done tokens more than once in the
mean (they are ~4 of ~150 target tokens, and a 135M Mexp trained on the plain mean
wrote "the goal is reached" and then reward 0); `sft_reward_share` can draw more
rewarded steps than their natural share when examples are capped.
SmolLM2 by default, full fine-tuning or LoRA (peft; adapters merged before saving).
The output directory is a plain Hugging Face model + tokenizer, which the embedded
engine loads through `/update_weights_from_disk`.

It trains on `simulator.sft_device` in `simulator.sft_dtype`, Mexp's own settings rather
than the learner's, since Mexp may train on another node or GPU than the policy.
'bfloat16' is learner/precision.py's mixed precision (fp32 weights and AdamW state, bf16
autocast forwards; the token cross-entropy is taken in fp32), so the checkpoint is fp32.
The device is checked before anything loads.
`simulator.sft_layout` picks how a batch runs (`target_losses`): on a CPU each example alone
at its own length, with the LM head only where a target token is predicted (1.36x a padded
step on the preset's examples, benchmarks/mexp_sft.py); on a GPU the padded batch.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from actors.dataset import offline_settings
from actors.envs.registry import add_family_argument, family_of
from infra.config import SimulatorConfig, add_config_arguments, config_from_args, section_settings, settings_key
from infra.engine.models import load_model
from learner.precision import Precision
from simulator import prompts
from simulator.embedder import Embedder
from simulator.mexp_data import MexpExample, build_examples, load_offline, split_trajectories
from simulator.replay_buffer import EdgeBuffer, seed_buffer

log = logging.getLogger(__name__)
IGNORE = -100
# The version of how examples are drawn, in the Mexp cache key: 2 = the length filter before the sft_max_examples draw
EXAMPLE_DRAW = 2


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]  # IGNORE on prompt tokens
    reasoning: list[bool]  # True on target tokens of the <think> part
    outcome: list[bool]  # True on target tokens of the <reward> and <done> blocks (and EOS)


def encode_example(tokenizer: Any, ex: MexpExample, max_len: int) -> Encoded | None:
    """Prompt + reasoning + rest + EOS; None if longer than max_len.

    The prompt is tokenized on its own, as the engine tokenizes it at inference, and
    the target after it, so training sees the token boundary inference sees. The
    outcome tokens are those whose text reaches into `<reward>…</done>` (a token that
    merges "</state>" into "<reward>" counts).
    """
    p = tokenizer(ex.prompt, add_special_tokens=False)["input_ids"]
    r = tokenizer(ex.reasoning_target, add_special_tokens=False)["input_ids"] if ex.reasoning_target else []
    enc = tokenizer(ex.rest_target, add_special_tokens=False, return_offsets_mapping=True)
    tail = ex.rest_target.rfind("<reward>")
    outcome = [end > tail >= 0 for _start, end in enc["offset_mapping"]] + [True]
    s = list(enc["input_ids"]) + [tokenizer.eos_token_id]
    ids = p + r + s
    if len(ids) > max_len:
        return None
    return Encoded(ids, [IGNORE] * len(p) + r + s, [False] * len(p) + [True] * len(r) + [False] * len(s),
                   [False] * (len(p) + len(r)) + outcome)


def _collate(batch: list[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    n = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), n), IGNORE, dtype=torch.long)
    reas = torch.zeros((len(batch), n), dtype=torch.bool)
    outcome = torch.zeros((len(batch), n), dtype=torch.bool)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, e in enumerate(batch):
        k = len(e.input_ids)
        ids[i, :k] = torch.tensor(e.input_ids)
        labels[i, :k] = torch.tensor(e.labels)
        reas[i, :k] = torch.tensor(e.reasoning)
        outcome[i, :k] = torch.tensor(e.outcome)
        mask[i, :k] = 1
    return {"input_ids": ids, "labels": labels, "reasoning": reas, "outcome": outcome, "attention_mask": mask}


def sft_loss(nll: torch.Tensor, outcome: torch.Tensor, outcome_weight: float) -> torch.Tensor:
    """Eq. 5 as a token mean over the target tokens `nll` (flat, as `target_losses` gives them), with
    the outcome tokens (reward, done) counted `outcome_weight` times: a weighted mean, so 1.0 is the
    paper's unweighted loss."""
    w = torch.where(outcome, outcome_weight, 1.0)
    return (nll * w).sum() / w.sum().clamp(min=1e-8)


@dataclass
class TargetLosses:
    """Per-target-token negative log-likelihoods of a batch, flat in example then token order,
    and which of those tokens are reasoning and which are outcome (reward, done, EOS)."""
    nll: torch.Tensor
    reasoning: torch.Tensor
    outcome: torch.Tensor

    @property
    def rest(self) -> torch.Tensor:
        """The target tokens after the reasoning: next state, reward, done (Eq. 5's second term)."""
        return ~self.reasoning


def resolve_layout(layout: str, device: str) -> str:
    """simulator.sft_layout's 'auto': 'unpadded' on the CPU, 'padded' on a GPU."""
    if layout == "auto":
        return "unpadded" if str(device) == "cpu" else "padded"
    return layout


def target_losses(model: Any, batch: list[Encoded], pad_id: int, precision: Precision | None = None,
                  layout: str = "padded") -> TargetLosses:
    """The batch's per-target-token losses, under `precision`'s autocast, in one of two layouts
    that compute the same numbers (simulator.sft_layout):

    - 'padded': one right-padded forward over the batch, logits at every position (the GPU's: a
      forward there costs about the same whatever its size);
    - 'unpadded': one forward per example at its own length, and only the positions that predict
      a target token reach the LM head (a 49,152-word head and its log-softmax on the ~70 % of
      tokens that are prompt, and the padding, are most of the padded batch's waste on a CPU)."""
    device = next(model.parameters()).device
    if layout == "unpadded":
        nll, reas, outcome = [], [], []
        for e in batch:
            start = next(i for i, t in enumerate(e.labels) if t != IGNORE)  # the first target token
            with (precision or Precision()).autocast():
                # The last len-start+1 positions, less the final one, predict the target tokens.
                logits = model(input_ids=torch.tensor([e.input_ids], device=device),
                               logits_to_keep=len(e.input_ids) - start + 1).logits[0, :-1]
            nll.append(torch.nn.functional.cross_entropy(
                logits.float(), torch.tensor(e.input_ids[start:], device=device), reduction="none"))
            reas += e.reasoning[start:]
            outcome += e.outcome[start:]
        return TargetLosses(torch.cat(nll), torch.tensor(reas, device=device), torch.tensor(outcome, device=device))
    b = {k: v.to(device) for k, v in _collate(batch, pad_id).items()}
    with (precision or Precision()).autocast():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
    labels = b["labels"][:, 1:]
    target = labels != IGNORE
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                            labels.clamp(min=0).reshape(-1), reduction="none")
    return TargetLosses(nll.view(labels.shape)[target], b["reasoning"][:, 1:][target], b["outcome"][:, 1:][target])


def evaluate(model: Any, data: list[Encoded], pad_id: int, batch_size: int = 8,
             precision: Precision | None = None, layout: str = "padded") -> dict[str, float]:
    """Token-mean held-out loss, and its two Eq. 5 terms."""
    tot = {"all": 0.0, "reasoning": 0.0, "state": 0.0}
    cnt = {"all": 0, "reasoning": 0, "state": 0}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for i in range(0, len(data), batch_size):
            t = target_losses(model, data[i:i + batch_size], pad_id, precision, layout)
            for name, m in (("reasoning", t.reasoning), ("state", t.rest), ("all", torch.ones_like(t.reasoning))):
                tot[name] += float(t.nll[m].sum())
                cnt[name] += int(m.sum())
    model.train(was_training)
    return {f"loss_{k}": (tot[k] / cnt[k] if cnt[k] else float("nan")) for k in tot}


def train_step(model: Any, opt: torch.optim.Optimizer, batch: list[Encoded], pad_id: int, outcome_weight: float,
               precision: Precision | None = None, layout: str = "padded") -> float:
    """One AdamW step on the batch's Eq. 5 loss (gradients clipped to norm 1); returns the loss."""
    t = target_losses(model, batch, pad_id, precision, layout)
    loss = sft_loss(t.nll, t.outcome, outcome_weight)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([q for g in opt.param_groups for q in g["params"]], 1.0)
    opt.step()
    return loss.item()


def train(model: Any, tokenizer: Any, train_data: list[Encoded], val_data: list[Encoded], cfg: SimulatorConfig,
          seed: int = 0, progress: bool = True) -> dict[str, Any]:
    """Optimise the Eq. 5 loss; returns losses before/after and the per-step training curve."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rng = random.Random(seed)
    torch.manual_seed(seed)
    device = str(next(model.parameters()).device)
    precision = Precision(device, cfg.sft_dtype)  # autocast where the model is
    layout = resolve_layout(cfg.sft_layout, device)
    before = evaluate(model, val_data, pad, precision=precision, layout=layout) if val_data else {}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.sft_lr, weight_decay=0.0)
    steps_per_epoch = (len(train_data) + cfg.sft_batch_size - 1) // cfg.sft_batch_size
    curve: list[float] = []
    tokens, t0 = 0, time.monotonic()
    model.train()

    with Progress(TextColumn("train-mexp"), BarColumn(), TextColumn("{task.completed}/{task.total} loss {task.fields[loss]}"),
                  TimeRemainingColumn(), disable=not progress) as bar:
        total = steps_per_epoch * cfg.sft_epochs
        job = bar.add_task("sft", total=total, loss="-")
        for _epoch in range(cfg.sft_epochs):
            order = list(range(len(train_data)))
            rng.shuffle(order)
            for i in range(0, len(order), cfg.sft_batch_size):
                batch = [train_data[j] for j in order[i:i + cfg.sft_batch_size]]
                curve.append(train_step(model, opt, batch, pad, cfg.sft_outcome_weight, precision, layout))
                tokens += sum(len(e.input_ids) for e in batch)
                bar.update(job, advance=1, loss=f"{curve[-1]:.3f}")
                if len(curve) % max(1, total // 8) == 0:  # a log line per eighth: a bar is invisible in a log file
                    log.info("Mexp SFT step %d/%d: loss %.3f (%.0f s)", len(curve), total, curve[-1],
                             time.monotonic() - t0)
    seconds = time.monotonic() - t0
    model.eval()
    after = evaluate(model, val_data, pad, precision=precision, layout=layout) if val_data else {}
    return {"before": before, "after": after, "train_curve": curve, "train_seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds else 0.0}


def prepare_model(base: str, lora_rank: int, device: str = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) to train: fp32 weights on `device` (master weights under bf16 autocast), LoRA if asked."""
    model, tokenizer = load_model(base or "smollm2", "float32", device)
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model  # only with LoRA

        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    return model, tokenizer


def save(model: Any, tokenizer: Any, out_dir: Path) -> Path:
    """A plain HF directory (LoRA merged) that `/update_weights_from_disk` and `load_model` accept."""
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def cap_examples(examples: list[MexpExample], n: int, reward_share: float, seed: int) -> list[MexpExample]:
    """At most `n` examples in a seeded random order. With `reward_share` > 0, that share of
    them (rounded, as far as there are enough) comes from rewarded steps and the rest from
    unrewarded ones: outcome rewards are rare, and a uniform draw leaves Mexp few examples of
    a won task to learn the reward from."""
    order = list(examples)
    random.Random(seed).shuffle(order)
    if reward_share <= 0 or len(order) <= n:
        return order[:n]
    won = [e for e in order if e.truth.reward > 0]
    rest = [e for e in order if e.truth.reward <= 0]
    k = min(len(won), round(n * reward_share))
    picked = won[:k] + rest[:n - k]
    picked += won[k:k + n - len(picked)]  # too few unrewarded steps: fill with rewarded ones
    random.Random(seed + 2).shuffle(picked)
    return picked


@dataclass
class SftData:
    """The encoded examples of one Mexp SFT run, and the task counts its report gives."""
    train: list[Encoded]
    heldout: list[Encoded]
    train_tasks: int
    heldout_tasks: int


def sft_data(cfg: SimulatorConfig, data_dir: str | Path, tokenizer: Any, family: str = "textworld",
             seed: int = 0) -> SftData:
    """Load the offline data, split it, build the examples with retrieval from a buffer of the
    train split, cap and encode them (benchmarks/mexp_sft.py times training on exactly these)."""
    trajs = load_offline(data_dir, family)
    train_trajs, held_trajs = split_trajectories(trajs, cfg.heldout_frac, data_dir, family)
    embedder = Embedder(cache_path=Path(data_dir) / ".cache" / "embeddings.sqlite")
    with tempfile.TemporaryDirectory(prefix="mexp-sft-buffer-") as tmp:
        buffer = EdgeBuffer(Path(tmp) / "edge", embedder) if cfg.retrieval else None
        if buffer is not None:
            seed_buffer(buffer, train_trajs)
        train_ex = build_examples(train_trajs, tokenizer, cfg, buffer)
        val_ex = build_examples(held_trajs, tokenizer, cfg, buffer)
        if buffer is not None:
            buffer.close()
    embedder.close()
    # The length filter runs before the draw, so the cap counts examples that are trained on: drawn first, the
    # longer rewarded steps were skipped after it (36 of 480 on textworld_long's 144 games, collection 48)
    encoded = {id(x): e for x in (*train_ex, *val_ex) if (e := encode_example(tokenizer, x, cfg.sft_max_len)) is not None}
    fits_train = [x for x in train_ex if id(x) in encoded]
    fits_val = [x for x in val_ex if id(x) in encoded]
    too_long = (len(train_ex) - len(fits_train), len(val_ex) - len(fits_val))
    if cfg.sft_max_examples:
        fits_train = cap_examples(fits_train, cfg.sft_max_examples, cfg.sft_reward_share, seed)
    if cfg.sft_max_heldout:
        random.Random(seed + 1).shuffle(fits_val)
        fits_val = fits_val[:cfg.sft_max_heldout]
    enc_train = [encoded[id(x)] for x in fits_train]
    enc_val = [encoded[id(x)] for x in fits_val]
    log.info("Mexp SFT: %d train / %d held-out examples drawn (%d / %d skipped first as longer than %d tokens); "
             "%d of the train examples are rewarded steps", len(enc_train), len(enc_val), *too_long, cfg.sft_max_len,
             sum(x.truth.reward > 0 for x in fits_train))
    if not enc_train:
        raise ValueError("no training examples fit sft_max_len; raise simulator.sft_max_len")
    return SftData(enc_train, enc_val, len({t.task_id for t in train_trajs}), len({t.task_id for t in held_trajs}))


def run_sft(cfg: SimulatorConfig, data_dir: str | Path, out_dir: str | Path, family: str = "textworld",
            seed: int = 0, progress: bool = True, base_model: str = "smollm2") -> dict[str, Any]:
    """Load the offline data, build examples with retrieval, train, save; returns the report.
    Training starts from `cfg.checkpoint` when set (continue a Mexp), else from `base_model`."""
    Precision.checked(cfg.sft_device, cfg.sft_dtype, "simulator.sft_device", "simulator.sft_dtype")  # before any loading
    model, tokenizer = prepare_model(cfg.checkpoint or base_model, cfg.sft_lora_rank, cfg.sft_device)
    data = sft_data(cfg, data_dir, tokenizer, family, seed)
    report = train(model, tokenizer, data.train, data.heldout, cfg, seed, progress)
    out = save(model, tokenizer, Path(out_dir))
    report.update({"checkpoint": str(out), "train_examples": len(data.train), "heldout_examples": len(data.heldout),
                   "train_tasks": data.train_tasks, "heldout_tasks": data.heldout_tasks,
                   "mean_prompt_tokens": sum(e.labels.count(IGNORE) for e in data.train) / len(data.train)})
    (out / "sft_report.json").write_text(json.dumps({k: v for k, v in report.items() if k != "train_curve"}, indent=1))
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    add_family_argument(p)
    p.add_argument("--out", default="", help="checkpoint directory (default: the cache that `dreamgym train` "
                   "reuses for this config, <data_dir>/mexp/<family>-<key>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    family = family_of(args, cfg)
    cfg = replace(cfg, actors=replace(cfg.actors, env_family=family))
    out = Path(args.out) if args.out else cache_dir(cfg)
    report = run_sft(cfg.simulator, cfg.infra.data_dir, out, family, cfg.infra.seed, not args.no_progress,
                     base_model(cfg))
    table = Table(title=f"Mexp SFT -> {report['checkpoint']}")
    table.add_column("held-out loss")
    table.add_column("before")
    table.add_column("after")
    for k in ("loss_all", "loss_reasoning", "loss_state"):
        table.add_row(k, f"{report['before'].get(k, float('nan')):.4f}", f"{report['after'].get(k, float('nan')):.4f}")
    Console().print(table)
    Console().print(f"{report['train_examples']} train / {report['heldout_examples']} held-out examples, "
                    f"{report['train_seconds']:.0f} s at {report['tokens_per_second']:.0f} tokens/s")
    return 0


# The simulator settings that shape an SFT checkpoint (the rest only matter at inference).
SHAPING_FIELDS = ("checkpoint", "heldout_frac", "reasoning", "retrieval", "top_k", "history_window", "state_chars",
                  "retrieved_todo")


def cache_settings(cfg: SimulatorConfig, model: str, offline_key: str, seed: int) -> dict:
    """What a cached Mexp SFT checkpoint depends on; the driver keys its cache directory by it.
    The device and the batch layout do not shape the weights (beyond float rounding); bf16 compute does, and float32,
    the default, stays out of the key so the caches written before `sft_dtype` existed still count
    (as do `sft_reward_share`, `sft_outcome_weight` and `retrieved_todo` at their defaults)."""
    shaping = section_settings(cfg, SHAPING_FIELDS, prefixes=("sft_",))
    del shaping["sft_device"], shaping["sft_layout"]  # where and how it computes, not what
    if shaping["sft_dtype"] == "float32":
        del shaping["sft_dtype"]
    if not shaping["sft_reward_share"]:  # the default draw, as before the setting existed
        del shaping["sft_reward_share"]
    if shaping["sft_outcome_weight"] == 1.0:  # the unweighted loss, as before the setting existed
        del shaping["sft_outcome_weight"]
    if shaping["retrieved_todo"]:  # the prompt as before the setting existed
        del shaping["retrieved_todo"]
    return {"offline": offline_key, "model": model, "seed": seed, "prompt_format": prompts.PROMPT_FORMAT,
            "example_draw": EXAMPLE_DRAW, **shaping}


def base_model(cfg: Any) -> str:
    """The model Mexp SFT starts from for the whole config `cfg`: `simulator.mexp_model`, else `engines.model`."""
    return cfg.simulator.mexp_model or cfg.engines.model


def cache_dir(cfg: Any) -> Path:
    """Where `dreamgym train` keeps (and `dreamgym train-mexp` writes by default) this artifact for the
    whole config `cfg`: `<data_dir>/mexp/<family>-<key of cache_settings>`."""
    family = cfg.actors.env_family
    offline = settings_key(offline_settings(family, cfg.data, cfg.infra.seed))
    key = settings_key(cache_settings(cfg.simulator, base_model(cfg), offline, cfg.infra.seed))
    return Path(cfg.infra.data_dir) / "mexp" / f"{family}-{key}"
