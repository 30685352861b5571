"""The trainable policy: SmolLM2 (or any causal LM directory), optional LoRA, an
optional PPO value head, per-step choice log-probs and, in generate mode, per-token
log-probs of the replies the engine sampled (`forward_tokens`, learner/token_logprobs.py).

Owns the learner-side model. Log-probs go through `actors.policy.choice_forward` and
`gather_choice_logprobs`, the very functions behind `choice_logprobs`, so the
learner and the behaviour policy compute the same number. Steps whose prompts chain
(a multi-turn trajectory, `actors.policy.pack_prompts`) run as one packed sequence per
trajectory (`packed_forward`); lone prompts run as one padded batch, identical ones once. The reference policy for
the KL penalty is the adapter-free base model under LoRA (no second copy) and a
frozen copy of the initial weights under full fine-tuning (made only if asked for).
The value head reads the last layer's hidden state at the prompt's last position.

Device and precision (learner/precision.py): the model, its value head and the frozen
reference copy live on one device; every forward (the trained one, the no-grad proximal
and PPO value passes, the reference's) runs under the same autocast, so with 'bfloat16'
the matmuls compute in bf16 while the parameters, and so the saved weights, stay fp32.
The value head runs outside autocast, in fp32.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from learner.choice_logprobs import choice_forward, gather_choice_logprobs, pack_prompts, packed_forward
from learner.token_logprobs import TokenSequence, sequence_logprobs
from infra.config import LearnerConfig
from infra.engine.scoring import (TokenTrie, batched_continuation_logprobs, continuation_logprobs, mean_logprobs,
                                  tree_continuation_logprobs)
from infra.engine.models import load_model
from learner.precision import Precision

log = logging.getLogger(__name__)


def scored_logprobs(model: Any, tokenizer: Any, prompts: Sequence[str], candidates: Sequence[Sequence[Sequence[int]]],
                    chosen: Sequence[int], want_hidden: bool = False, layout: str = "padded",
                    temperatures: Sequence[float] | None = None):
    """The learner-side twin of score mode: (log-prob of each chosen candidate [B], differentiable;
    each prompt's last hidden state [B, H] or None; tokens run through the model). Identical prompts (a GRPO group's first step)
    with the same candidates run once.

    `layout` (infra/engine/scoring.py): 'padded' runs every distinct prompt in two forwards, as the
    engine's scoring queue does on a GPU; 'tree' in one forward over the trie of all their tokens
    (shared tokens once, no padding: `tokens` counts the trie); 'per-prompt' a forward pair per
    prompt. On an H200 the per-prompt pairs made a 32-trajectory update take 30 s, host-bound; on the
    2-core CPU padded forward+backward was 1.41x (4 steps) and 1.13x (12 steps) the per-prompt speed,
    and on 21 real TextWorld steps the tree 1.7x the padded one in micro-batches of 8 steps, 2.6x as
    one tree against padded batches of 8 (`benchmarks/learner_update.py --score N`)."""
    keys: dict[tuple, int] = {}
    for prompt, cands in zip(prompts, candidates):
        keys.setdefault((prompt, tuple(tuple(c) for c in cands)), len(keys))
    items = [(tokenizer(prompt, add_special_tokens=False)["input_ids"], [list(c) for c in cands]) for prompt, cands in keys]
    tokens = sum(len(p) + sum(len(c) for c in cands) for p, cands in items)
    if layout == "per-prompt":
        found = [continuation_logprobs(model, prefix, cands, want_hidden) for prefix, cands in items]
    elif layout in ("padded", "tree"):
        if layout == "tree":
            trie = TokenTrie(items)
            per_item, hid = tree_continuation_logprobs(model, items, want_hidden, trie)
            tokens = len(trie.ids)
        else:
            per_item, hid = batched_continuation_logprobs(model, items, want_hidden)
        found = [(lps, hid[i] if want_hidden else None) for i, lps in enumerate(per_item)]
    else:
        raise ValueError(f"score layout must be 'padded', 'tree' or 'per-prompt', got {layout!r}")
    means = [mean_logprobs(lps) for lps, _ in found]
    rows, hidden = [], []
    for j, (prompt, cands, k) in enumerate(zip(prompts, candidates, chosen)):
        i = keys[(prompt, tuple(tuple(c) for c in cands))]
        t = temperatures[j] if temperatures is not None else 1.0  # the row's sampling temperature
        rows.append(torch.log_softmax(means[i] / t if t != 1.0 else means[i], dim=-1)[int(k)])
        hidden.append(found[i][1])
    return torch.stack(rows), (torch.stack(hidden) if want_hidden else None), tokens


def is_scored(choice_token_ids: Sequence) -> bool:
    """Whether a batch is in score mode (candidates as token lists) rather than label mode (label ids)."""
    return bool(choice_token_ids) and bool(choice_token_ids[0]) and isinstance(choice_token_ids[0][0], (list, tuple))


class PolicyModel(nn.Module):
    def __init__(self, model_name: str = "smollm2", lora_rank: int = 0, value_head: bool = False,
                 gradient_checkpointing: bool = False, model=None, tokenizer=None,
                 precision: Precision | None = None, score_layout: str = "auto"):
        super().__init__()
        precision = precision or Precision()
        # Score mode's layout (infra/config.py LearnerConfig.score_layout): the trie on the CPU.
        self.score_layout = ("tree" if precision.device == "cpu" else "padded") if score_layout == "auto" else score_layout
        if model is None:
            model, tokenizer = load_model(model_name, "float32", precision.device)  # fp32 master weights
        self.precision = precision
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.lora_rank = lora_rank
        if lora_rank > 0:
            from peft import LoraConfig, get_peft_model  # only with LoRA

            model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                                                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        if gradient_checkpointing:
            model.gradient_checkpointing_enable()
            if lora_rank > 0:
                model.enable_input_require_grads()
        self.lm = model
        hidden = model.config.hidden_size
        self.value_head = nn.Linear(hidden, 1) if value_head else None
        if self.value_head is not None:
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)
        self._ref: nn.Module | None = None
        self.last_tokens = 0  # tokens the last forward_choice ran through the model (learner tokens/s)
        self.share_prefix = True  # packed trajectories of one group run their common first turn once
        self.to(precision.device)  # a passed-in model and the value head join the loaded weights
        self.lm.train()

    @classmethod
    def for_learner(cls, cfg: LearnerConfig, model_name: str, precision: Precision) -> PolicyModel:
        """The RL learner's policy as `cfg` asks (every FSDP rank builds its own so, learner/fsdp.py)."""
        policy = cls(model_name, cfg.lora_rank, value_head=cfg.algo == "ppo",
                     gradient_checkpointing=cfg.gradient_checkpointing, precision=precision,
                     score_layout=cfg.score_layout)
        if cfg.kl_coef > 0:
            policy.snapshot_reference()
        return policy

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def forward_choice(self, prompts: Sequence[str], choice_token_ids: Sequence[Sequence[int]],
                       chosen_ids: Sequence[int], temperatures: Sequence[float] | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-prob of each chosen label [B], value [B] or None).

        Chained prompts (one multi-turn trajectory) run as one packed sequence. Identical
        lone prompts (a GRPO group's first step: same task, same initial state) go through
        the model once; indexing back keeps the gradient of every copy. `last_tokens` is
        the number of tokens this call ran through the model.

        Score mode (actors/policy.py): each `choice_token_ids` entry is the list of candidates'
        token ids and each `chosen_ids` entry the chosen candidate's index. `temperatures`: each row's
        distribution over its choices at that temperature (the one its rollout sampled at), else 1."""
        if is_scored(choice_token_ids):
            with self.precision.autocast():
                logp, hidden, self.last_tokens = scored_logprobs(self.lm, self.tokenizer, prompts, choice_token_ids,
                                                                 chosen_ids, want_hidden=self.value_head is not None,
                                                                 layout=self.score_layout, temperatures=temperatures)
            values = self.value_head(hidden.float()).squeeze(-1) if self.value_head is not None else None
            return logp, values
        logits, hidden, self.last_tokens = self._choice_logits(self.lm, prompts, chosen_ids,
                                                               self.value_head is not None)
        logp = gather_choice_logprobs(logits, choice_token_ids, chosen_ids, temperatures)
        values = self.value_head(hidden.float()).squeeze(-1) if self.value_head is not None else None
        return logp, values

    def _choice_logits(self, lm: nn.Module, prompts: Sequence[str], chosen_ids: Sequence[int],
                       want_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Label-position logits [B, V] (and hidden states) of `prompts`, in their order; tokens run."""
        with self.precision.autocast():
            return self._choice_logits_of(lm, prompts, chosen_ids, want_hidden)

    def _choice_logits_of(self, lm: nn.Module, prompts: Sequence[str], chosen_ids: Sequence[int],
                          want_hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        segments = pack_prompts(self.tokenizer, prompts, chosen_ids)
        packed = [s for s in segments if len(s.steps) > 1]
        lone = [s for s in segments if len(s.steps) == 1]
        order: list[int] = []
        parts, hparts = [], []
        tokens = 0
        if lone:
            lone_prompts = [prompts[s.steps[0]] for s in lone]
            unique = list(dict.fromkeys(lone_prompts))
            lengths = {prompts[s.steps[0]]: len(s.ids) for s in lone}
            logits, hidden = choice_forward(lm, self.tokenizer, unique, want_hidden=want_hidden)
            if len(unique) < len(lone_prompts):
                where = {p: i for i, p in enumerate(unique)}
                index = torch.tensor([where[p] for p in lone_prompts], device=logits.device)
                logits = logits.index_select(0, index)
                hidden = hidden.index_select(0, index) if hidden is not None else None
            parts.append(logits)
            hparts.append(hidden)
            order += [s.steps[0] for s in lone]
            tokens += sum(lengths[p] for p in unique)
        if packed:
            logits, hidden, n = packed_forward(lm, packed, want_hidden=want_hidden, share_prefix=self.share_prefix)
            parts.append(logits)
            hparts.append(hidden)
            order += [i for s in packed for i in s.steps]
            tokens += n
        logits = torch.cat(parts) if len(parts) > 1 else parts[0]
        hidden = (torch.cat(hparts) if len(hparts) > 1 else hparts[0]) if want_hidden else None
        if order != list(range(len(order))):
            inverse = torch.empty(len(order), dtype=torch.long)
            inverse[torch.tensor(order)] = torch.arange(len(order))
            inverse = inverse.to(logits.device)
            logits = logits.index_select(0, inverse)
            hidden = hidden.index_select(0, inverse) if hidden is not None else None
        return logits, hidden, tokens

    def forward_tokens(self, sequences: Sequence[TokenSequence],
                       temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Generate mode (learner/token_logprobs.py): (log-prob of every trained token [T] at `temperature`,
        value of every trained step [S] or None), one forward per chat; `last_tokens` the tokens run through
        the model."""
        with self.precision.autocast():
            logp, hidden, self.last_tokens = sequence_logprobs(self.lm, sequences, self.value_head is not None,
                                                               self.share_prefix, temperature)
        values = self.value_head(hidden.float()).squeeze(-1) if self.value_head is not None else None
        return logp, values

    @torch.no_grad()
    def reference_token_logprobs(self, sequences: Sequence[TokenSequence], temperature: float = 1.0) -> torch.Tensor:
        """The trained tokens' log-probs under the reference policy, as `forward_tokens` reads them."""
        if self.lora_rank > 0:
            with self.lm.disable_adapter(), self.precision.autocast():
                return sequence_logprobs(self.lm, sequences, share_prefix=self.share_prefix, temperature=temperature)[0]
        self.snapshot_reference()
        with self.precision.autocast():
            return sequence_logprobs(self._ref, sequences, share_prefix=self.share_prefix, temperature=temperature)[0]

    @torch.no_grad()
    def reference_logprobs(self, prompts: Sequence[str], choice_token_ids: Sequence[Sequence[int]],
                           chosen_ids: Sequence[int], temperatures: Sequence[float] | None = None) -> torch.Tensor:
        """Log-probs under the reference policy (the initial weights), packed and tempered like `forward_choice`."""
        if is_scored(choice_token_ids):
            if self.lora_rank > 0:
                with self.lm.disable_adapter(), self.precision.autocast():
                    return scored_logprobs(self.lm, self.tokenizer, prompts, choice_token_ids, chosen_ids,
                                           layout=self.score_layout, temperatures=temperatures)[0]
            self.snapshot_reference()
            with self.precision.autocast():
                return scored_logprobs(self._ref, self.tokenizer, prompts, choice_token_ids, chosen_ids,
                                       layout=self.score_layout, temperatures=temperatures)[0]
        if self.lora_rank > 0:
            with self.lm.disable_adapter():
                logits, _, _ = self._choice_logits(self.lm, prompts, chosen_ids)
        else:
            self.snapshot_reference()
            logits, _, _ = self._choice_logits(self._ref, prompts, chosen_ids)
        return gather_choice_logprobs(logits, choice_token_ids, chosen_ids, temperatures)

    def snapshot_reference(self, force: bool = False) -> None:
        """Full fine-tuning: freeze a copy of the current weights as the reference now.

        Under LoRA the reference is always the adapter-free base model."""
        if self.lora_rank == 0 and (self._ref is None or force):
            ref = copy.deepcopy(self.lm).eval()
            for p in ref.parameters():
                p.requires_grad_(False)
            # Not a submodule: it must stay out of parameters(), state_dict() and checkpoints.
            object.__setattr__(self, "_ref", ref)

    def save_hf(self, path: str | Path, lm_state: dict[str, torch.Tensor] | None = None,
                dtype: str = "float32") -> Path:
        """Write a plain Hugging Face directory an engine can load (LoRA merged), atomically, its
        floating-point tensors (and config.json's dtype) in `dtype`; the model itself is untouched.
        `lm_state`: the language model's full weights, gathered from the FSDP ranks (learner/fsdp.py)."""
        path = Path(path)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        if self.lora_rank > 0:
            merged = copy.deepcopy(self.lm).merge_and_unload()
        else:
            merged = self.lm
        if dtype != "float32":
            cast = getattr(torch, dtype)
            state = lm_state if lm_state is not None else merged.state_dict()
            lm_state = {k: v.detach().to(cast) if v.is_floating_point() else v for k, v in state.items()}
        weights = {"state_dict": lm_state} if lm_state is not None else {}
        merged.save_pretrained(tmp, safe_serialization=True, **weights)
        if dtype != "float32":
            config = json.loads((tmp / "config.json").read_text())
            config["dtype" if "dtype" in config else "torch_dtype"] = dtype  # transformers 5 renamed it
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
        self.tokenizer.save_pretrained(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        return path
