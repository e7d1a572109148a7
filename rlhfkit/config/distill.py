"""The flags of on-policy distillation in train_ppo / train_ppo_ray (docs/distillation.md): the teacher (a local
model placed like the reference, or an HTTP endpoint), the loss and its weight. The rules that read other sections
(the placement of the teacher role) live with the RL config's rules (`rl_resources.py`).

`ServeTeacherConfig`: the flags of `serve_teacher`, which serves a teacher for `--teacher_url`."""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config.base import arg
from rlhfkit.config.names import DISTILL_LOSSES
from rlhfkit.config.serving import is_loopback, server_api_key
from rlhfkit.errors import UserError

#: The teacher server's bearer token when --api_key / --teacher_api_key is not given (server and student read it).
TEACHER_KEY_ENV = "RLHFKIT_TEACHER_API_KEY"


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
    teacher_api_key: str | None = arg(None, "The bearer token sent to --teacher_url (`Authorization: Bearer <key>`; "
                                            "default: env RLHFKIT_TEACHER_API_KEY): the key the teacher server "
                                            "was started with (serve_teacher --api_key).")
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
        if self.teacher_api_key and not self.teacher_url:
            raise UserError("--teacher_api_key is the key of a served teacher: add --teacher_url")
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


@dataclass
class ServeTeacherConfig:
    pretrain: str | None = arg(None, "The teacher model directory (a Hugging Face causal LM with the students' "
                                     "tokenizer).")
    host: str = arg("127.0.0.1", "Address to bind. The default serves this machine only; any other address "
                                 "exposes the teacher to the network and needs --api_key (or --no_auth).")
    port: int = arg(5001, "TCP port (0: pick a free one).")
    api_key: str | None = arg(None, "Require `Authorization: Bearer <key>` on every request (default: env "
                                    "RLHFKIT_TEACHER_API_KEY; an empty value never overrides a set environment "
                                    "key); students pass it with --teacher_api_key. Without a key the server "
                                    "starts only on a loopback --host (or with --no_auth).")
    no_auth: bool = arg(False, "Serve a non-loopback --host without a bearer token (prints a warning): anyone who "
                               "can reach the port can use the model. Refused together with a key.")
    temperature: float = arg(1.0, "The temperature of the log-probs served: the students' sampling --temperature "
                                  "(both sides must score the same distribution).")
    batch_size: int = arg(16, "Most rows of a request scored in one forward pass.")
    bf16: bool = arg(False, "Run the teacher in bfloat16 (default: fp32).")

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise UserError(f"--port {self.port} is not a TCP port; use 1-65535 (or 0 to pick a free one)")
        if not self.temperature > 0:
            raise UserError(f"--temperature must be > 0 (got {self.temperature})")
        if self.batch_size < 1:
            raise UserError(f"--batch_size must be at least 1 (got {self.batch_size})")

    def check_inputs(self) -> None:
        if not self.pretrain:
            raise UserError("--pretrain is required: the teacher model directory")
        self.resolved_api_key()

    def resolved_api_key(self) -> str | None:
        """The bearer token to require (None: none). A loopback --host may serve without one; any other host
        needs a key or an explicit --no_auth, so a model is never exposed by a forgotten flag."""
        return server_api_key(f"serve_teacher on --host {self.host} (reachable from other machines)", self.api_key,
                              self.no_auth, TEACHER_KEY_ENV, need_key=not is_loopback(self.host))
