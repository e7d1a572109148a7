"""Per-token KL estimators between the policy and the reference model, and KL coefficient controllers.

Tokens are sampled from the policy, so with log_ratio = logp - ref_logp (log pi(x) / pi_ref(x)) the three
estimators of KL(pi || pi_ref) from Schulman, "Approximating KL Divergence" (2020) are
    k1 = log_ratio                                unbiased, high variance, can be negative
    k2 = 0.5 * log_ratio ** 2                     biased, low variance, >= 0
    k3 = exp(-log_ratio) - 1 + log_ratio          unbiased, low variance, >= 0
"""

from __future__ import annotations

import torch

from rlhfkit.config.names import KL_ESTIMATORS as KL_ESTIMATORS  # compute_approx_kl dispatches on these


def _log_ratio(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor | None,
               clamp: float | None) -> torch.Tensor:
    dtype = torch.promote_types(torch.promote_types(logp.dtype, ref_logp.dtype), torch.float32)
    log_ratio = logp.to(dtype) - ref_logp.to(dtype)
    if mask is not None:
        # Zero the padding before any exp: where() would hide a NaN in the value but not in the gradient.
        log_ratio = torch.where(mask.bool(), log_ratio, torch.zeros((), dtype=dtype, device=log_ratio.device))
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    return log_ratio


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor | None = None,
          clamp: float | None = None) -> torch.Tensor:
    """k1 = logp - ref_logp per token (Schulman 2020); 0 at masked positions."""
    return _log_ratio(logp, ref_logp, mask, clamp)


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor | None = None,
          clamp: float | None = None) -> torch.Tensor:
    """k2 = 0.5 * (logp - ref_logp)^2 per token (Schulman 2020); 0 at masked positions."""
    return 0.5 * _log_ratio(logp, ref_logp, mask, clamp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor | None = None,
          clamp: float | None = None) -> torch.Tensor:
    """k3 = exp(-r) - 1 + r with r = logp - ref_logp, per token (Schulman 2020); 0 at masked positions.

    Its gradient with respect to logp is 1 - exp(-r), the one GRPO (Shao et al. 2024) uses for its KL loss.
    exp(-r) overflows float32 for r < -88: pass clamp (10 is common) when policy and reference can drift apart.
    """
    log_ratio = _log_ratio(logp, ref_logp, mask, clamp)
    return torch.expm1(-log_ratio) + log_ratio


def compute_approx_kl(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k1",
                      mask: torch.Tensor | None = None, clamp: float | None = None) -> torch.Tensor:
    """Per-token KL estimate [B, T] (at least float32) by name (`k1`, `k2`, `k3`; Schulman 2020).

    clamp, when given, bounds the log-ratio to [-clamp, clamp] before the estimator (exact for |log r| <= clamp).
    Masked positions are 0.
    """
    if estimator == "k1":
        return kl_k1(logp, ref_logp, mask, clamp)
    if estimator == "k2":
        return kl_k2(logp, ref_logp, mask, clamp)
    if estimator == "k3":
        return kl_k3(logp, ref_logp, mask, clamp)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


class FixedKLController:
    """A constant KL coefficient (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences")."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Keeps the coefficient; returns it."""
        return self.value


class AdaptiveKLController:
    """The adaptive KL coefficient of Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences".

    After a batch of n_steps samples with measured KL `current_kl`:
        error = clip(current_kl / target - 1, -0.2, 0.2)
        value <- value * (1 + error * n_steps / horizon)
    so the coefficient grows when the KL exceeds the target and shrinks when it stays below.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL control needs target > 0 and horizon > 0 (got {target} and {horizon})")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Moves the coefficient towards keeping the KL at the target; returns the new value."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value


def make_kl_controller(init_kl_coef: float, target: float | None = None,
                       horizon: float = 10000) -> FixedKLController | AdaptiveKLController:
    """The adaptive controller when a target KL is given, else the fixed one (Ziegler et al. 2019)."""
    if target is None:
        return FixedKLController(init_kl_coef)
    return AdaptiveKLController(init_kl_coef, target, horizon)
