"""Where the learner and the two SFT runs compute, and in what precision.

Owns `learner.device` / `learner.dtype` (the RL learner and the policy warm start) and
`simulator.sft_device` / `simulator.sft_dtype` (Mexp SFT): checking, before any model is
loaded, that the device exists and supports the dtype (a `ConfigError` naming the setting,
rather than a CUDA error from deep inside torch minutes into a run), and the context every
forward pass runs under.

'bfloat16' is mixed precision, not pure bf16. Parameters, gradients and AdamW's moments
stay fp32 (master weights); forward passes run under `torch.autocast(device_type,
bfloat16)`, so the matmuls (linear layers, attention, the LM head) compute in bf16 from
bf16 casts of the weights while autocast keeps its fp32 ops (softmax, norms, losses) in
fp32, and backward follows the forward's dtypes. Where this departs from a pure-bf16 setup
(`model.to(torch.bfloat16)`, bf16 weights and optimizer): with 8 mantissa bits a weight of
0.1 moves in steps of ~5e-4, so most AdamW updates at a learning rate of 1e-5 would round
away; fp32 master weights keep them. The price is memory: 4 bytes per parameter for the
weights and 4 for their gradients (pure bf16: 2 + 2), plus the bf16 copies autocast makes
during a forward. The compute is the bf16 one, the memory that of fp32 training.

Consequences elsewhere: published weights and checkpoints are fp32, so any engine loads them
in its own `engines.dtype`; the label log-probs come from bf16 logits (about 2^-8 relative
rounding before the fp32 log-softmax), so at staleness 0 the learner's log-prob is close to,
not bit-equal to, the behaviour log-prob an fp32 engine recorded, and the PPO ratio is
near 1, not exactly 1. The value head and the losses run in fp32. float16 is not offered: it
needs loss scaling, which nothing here does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from infra.config import ConfigError

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Precision:
    """A torch device and a compute dtype (see the module docstring for what 'bfloat16' means)."""

    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: expected one of {DTYPES}")

    @classmethod
    def checked(cls, device: str, dtype: str, device_key: str, dtype_key: str) -> Precision:
        """The precision of two settings, after checking this machine has the device (ConfigError naming the key)."""
        check_device(device, device_key)
        if dtype == "bfloat16" and device.startswith("cuda") and not torch.cuda.is_bf16_supported():
            raise ConfigError(f"{dtype_key}=bfloat16: {torch.cuda.get_device_name(torch.device(device))} "
                              f"({device_key}={device}) has no bfloat16 support; set {dtype_key}=float32")
        return cls(device, dtype)

    @property
    def device_type(self) -> str:
        return torch.device(self.device).type

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context forward passes run under: bf16 autocast, or nothing for float32."""
        if self.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=torch.bfloat16)


def check_device(device: str, key: str) -> None:
    """Raise ConfigError naming `key` unless `device` ('cpu', 'cuda', 'cuda:N') exists on this machine."""
    if device == "cpu":
        return
    if not device.startswith("cuda"):
        raise ConfigError(f"{key}: got {device!r}; expected 'cpu', 'cuda' or 'cuda:N'")
    if not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(f"{key}={device}: CUDA is not available on this machine (torch {torch.__version__}, "
                          f"{built}); set {key}=cpu")
    index = torch.device(device).index or 0
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError(f"{key}={device}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
