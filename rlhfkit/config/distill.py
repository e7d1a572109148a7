"""The flags of on-policy distillation in train_ppo / train_ppo_ray (docs/distillation.md): the teacher (a local
model placed like the reference, or an HTTP endpoint), the loss and its weight. The rules that read other sections
(the placement of the teacher role) live with the RL config's rules (`rl_resources.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config.base import arg
from rlhfkit.config.names import DISTILL_LOSSES
from rlhfkit.errors import UserError


@dataclass
class DistillArgs:
    teacher_pretrain: str | None = arg(None, "On-policy distillation: the teacher model directory (a Hugging Face "
                                             "causal LM with the actor's tokenizer). It scores every token the "
                                             "actor samples; placed like the reference model (train_ppo_ray: "
                                             "--teacher_num_nodes / --teacher_num_gpus_per_node, or the actor's "
                                             "devices with --colocate_actor_ref / --colocate_all_models). TRL's "
                                             "teacher_model_name_or_path.")
    teacher_url: str | None = arg(None, "On-policy distillation: a teacher served over HTTP instead "
                                        "(http://host:port; rlhfkit.rl.teacher_server serves one). It must answer "
                                        "GET /info with its tokenizer's fingerprint and POST /logprobs with the "
                                        "per-token log-probs of given token ids.")
    teacher_timeout: float = arg(60.0, "Seconds one request to --teacher_url may take.")
    distill_loss: str = arg("reverse_kl", "The distillation loss: reverse_kl (per-token reverse KL of the sampled "
                                          "tokens, Agarwal et al. 2024) or topk_forward_kl (forward KL from the "
                                          "teacher's --distill_topk most likely tokens).", choices=DISTILL_LOSSES)
    distill_topk: int = arg(20, "Teacher tokens per position of --distill_loss topk_forward_kl.")
    distill_coef: float = arg(1.0, "Weight of the distillation loss added to the policy loss (the actor loss is "
                                   "policy loss + coef x distillation loss).")
    distill_only: bool = arg(False, "Train on the distillation loss alone: no policy-gradient term (the reward "
                                    "is still computed, logged and evaluated).")

    @property
    def enabled(self) -> bool:
        return bool(self.teacher_pretrain or self.teacher_url)

    def validate(self) -> None:
        if self.teacher_pretrain and self.teacher_url:
            raise UserError("pass either --teacher_pretrain (a local teacher) or --teacher_url (a served one), "
                            "not both")
        if self.teacher_url is not None and not self.teacher_url.startswith(("http://", "https://")):
            raise UserError(f"--teacher_url {self.teacher_url}: not an http(s) URL")
        if not self.teacher_timeout > 0:
            raise UserError(f"--teacher_timeout must be > 0 seconds (got {self.teacher_timeout})")
        if self.distill_topk < 1:
            raise UserError(f"--distill_topk must be >= 1 (got {self.distill_topk})")
        if self.distill_coef < 0:
            raise UserError(f"--distill_coef must be >= 0 (got {self.distill_coef})")
        if self.enabled:
            return
        changed = [flag for flag, value in (("distill_only", self.distill_only),
                                            ("distill_loss", self.distill_loss != "reverse_kl"),
                                            ("distill_coef", self.distill_coef != 1.0),
                                            ("distill_topk", self.distill_topk != 20)) if value]
        if changed:
            raise UserError(f"--{changed[0]} configures on-policy distillation and needs a teacher: add "
                            "--teacher_pretrain or --teacher_url")
