"""The teacher of on-policy distillation (docs/distillation.md): scores every token the student (the actor) sampled.

Two teachers serve one method, `score(batch)` -> {"log_probs": [B, R], and with top-k "topk_ids" / "topk_log_probs"
[B, R, k]}, the teacher's log-probs of the sampled response tokens at the student's sampling temperature:
- `TeacherRole`: a local model (`--teacher_pretrain`), a role like the reference (its own Ray actor group in
  train_ppo_ray, or on the actor's devices with --colocate_actor_ref / --colocate_all_models);
- `HTTPTeacher`: a teacher behind `--teacher_url`, e.g. a `TeacherRole` served by `rlhfkit.rl.teacher_server`.
The loss itself is pure math in `rlhfkit.algorithms.distill_loss`; the actor adds it (`roles.ActorRole`).

Teacher and student must share a tokenizer: the teacher scores the student's token ids. `check_teacher_tokenizer`
compares the vocabularies (a fingerprint over HTTP) before any model loads.
"""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
from typing import Any

import torch

from rlhfkit.algorithms.logprobs import token_logprobs
from rlhfkit.config.distill import TEACHER_KEY_ENV
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.rl_specs import teacher_topk
from rlhfkit.config.serving import key_or_env
from rlhfkit.config.specs import TeacherSpec
from rlhfkit.distributed.ray_groups import dispatch
from rlhfkit.errors import UserError
from rlhfkit.models.loading import check_model_path, load_causal_lm, load_tokenizer_apart
from rlhfkit.rl.experience import Experience, as_experience
from rlhfkit.rl.role_forward import action_logits, per_chunk
from rlhfkit.rl.roles import _attn, _dtype, _Role

INFO_PATH, LOGPROBS_PATH = "/info", "/logprobs"
MAX_FLOAT_ID = 2**24  # token ids travel through per_chunk's float32 results exactly below this


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A digest of the token -> id map: two tokenizers with one fingerprint give the same ids."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def teacher_token_scores(model: Any, exp: Experience, temperature: float, topk: int, packed: bool) -> torch.Tensor:
    """[B, R, 1 + 2k]: the teacher's log-prob of each sampled token, then (k > 0) its top-k log-probs and their
    token ids (as floats, exact below 2**24), at the positions that predict each response token."""
    logits = action_logits(model, exp, packed).float()
    if temperature != 1.0:
        logits = logits / temperature
    sampled = token_logprobs(logits, exp.action_tokens())[..., None]
    if topk == 0:
        return sampled
    top, ids = logits.topk(topk, dim=-1)
    return torch.cat([sampled, top - logits.logsumexp(dim=-1, keepdim=True), ids.float()], dim=-1)


def unpack_scores(scores: torch.Tensor, topk: int) -> dict[str, torch.Tensor]:
    """`teacher_token_scores`' columns as the named tensors of `score`."""
    out = {"log_probs": scores[..., 0]}
    if topk > 0:
        out["topk_log_probs"] = scores[..., 1:1 + topk]
        out["topk_ids"] = scores[..., 1 + topk:].round().long()
    return out


class TeacherRole(_Role):
    """A frozen local teacher model: per-token log-probs (and top-k) of the student's samples."""

    name = "teacher"
    spec: TeacherSpec

    def __init__(self, spec: TeacherSpec):
        super().__init__(spec)
        path = check_model_path(spec.path, "--teacher_pretrain")
        model = load_causal_lm(path, attn_implementation=_attn(spec), dtype=_dtype(spec), flag="--teacher_pretrain")
        if spec.topk and model.config.vocab_size > MAX_FLOAT_ID:
            raise ValueError(f"a vocabulary of {model.config.vocab_size} tokens is too large for top-k ids")
        self.model = self.strategy.prepare_eval(model, shard_fsdp2=True)  # sharded like the reference

    @dispatch("split")
    @torch.no_grad()
    def score(self, batch: Experience | dict[str, Any]) -> dict[str, torch.Tensor]:
        exp = as_experience(batch)
        s = self.spec
        scores = per_chunk(exp, s.batch, self.strategy,
                           lambda e: teacher_token_scores(self.model, e, s.temperature, s.topk, self.packed))
        return unpack_scores(scores, s.topk)


# -- over HTTP --------------------------------------------------------------------------------------------------
def request_rows(exp: Experience) -> dict[str, Any]:
    """The JSON body of POST /logprobs: each row's real token ids (prompt and response) and prompt length."""
    lengths = exp.attention_mask.long().sum(dim=1).tolist()
    return {"input_ids": [row[:n] for row, n in zip(exp.sequences.tolist(), lengths)],
            "prompt_lengths": exp.prompt_lengths.tolist()}


def rows_to_tensor(rows: list[list[Any]], width: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-row lists (one entry per response token, maybe nested) -> [B, width, ...] padded with zeros."""
    tensors = [torch.tensor(r, dtype=dtype)[:width] for r in rows]
    out = torch.zeros((len(rows), width, *tensors[0].shape[1:]) if tensors else (0, width), dtype=dtype)
    for i, t in enumerate(tensors):
        out[i, :len(t)] = t
    return out


class HTTPTeacher:
    """A teacher served over HTTP (`--teacher_url`; protocol in `rlhfkit.rl.teacher_server`), with
    `Authorization: Bearer <api_key>` on every request when a key is given (`--teacher_api_key`)."""

    def __init__(self, url: str, topk: int, timeout: float, api_key: str | None = None):
        self.url, self.topk, self.timeout, self.api_key = url.rstrip("/"), topk, timeout, api_key

    def _call(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                result: dict[str, Any] = json.loads(response.read())
                return result
        except urllib.error.HTTPError as e:
            if e.code == 401:
                raise UserError(self._refused()) from None
            raise UserError(f"--teacher_url {self.url}{path}: {e}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise UserError(f"--teacher_url {self.url}{path}: {e}") from None

    def _refused(self) -> str:
        """The one line of a 401: the server wants a bearer token this student lacks or has wrong."""
        if self.api_key:
            return (f"--teacher_url {self.url}: the teacher refused the bearer token (401): --teacher_api_key "
                    f"(or {TEACHER_KEY_ENV}) must be the key the teacher server was started with")
        return (f"--teacher_url {self.url}: the teacher requires a bearer token (401): pass its key with "
                f"--teacher_api_key (or {TEACHER_KEY_ENV})")

    def info(self) -> dict[str, Any]:
        """The server's GET /info: its tokenizer's fingerprint and, where it says, its temperature."""
        return self._call(INFO_PATH)

    def fingerprint(self) -> str:
        return str(self.info()["tokenizer"])

    def score(self, batch: Experience | dict[str, Any]) -> dict[str, torch.Tensor]:
        exp = as_experience(batch)
        answer = self._call(LOGPROBS_PATH, {**request_rows(exp), "topk": self.topk})
        width = exp.num_actions
        out = {"log_probs": rows_to_tensor(answer["logprobs"], width, torch.float32)}
        if self.topk:
            out["topk_log_probs"] = rows_to_tensor(answer["topk_logprobs"], width, torch.float32)
            out["topk_ids"] = rows_to_tensor(answer["topk_ids"], width, torch.long)
        return out


def check_teacher_tokenizer(teacher_pretrain: str | None, teacher_url: str | None, student: Any,
                            timeout: float = 60.0, api_key: str | None = None,
                            temperature: float | None = None) -> None:
    """Stop (UserError, one line) unless the teacher's tokenizer maps tokens to ids as the student's does, and a
    served teacher that names its temperature serves the student's `temperature` (a local teacher runs at it)."""
    if teacher_pretrain:
        where = f"--teacher_pretrain {teacher_pretrain}"
        # apart: the Ray driver, which loads no model, would otherwise import AutoTokenizer's module here after all
        path = check_model_path(teacher_pretrain, "--teacher_pretrain")
        theirs = tokenizer_fingerprint(load_tokenizer_apart(path, flag="--teacher_pretrain"))
    elif teacher_url:
        info = HTTPTeacher(teacher_url, 0, timeout, api_key).info()
        where, theirs = f"--teacher_url {teacher_url}", str(info["tokenizer"])
        served = info.get("temperature")
        if temperature is not None and served is not None and abs(float(served) - temperature) > 1e-9:
            raise UserError(f"{where}: the teacher serves log-probs at temperature {float(served):g} and this run "
                            f"samples at --temperature {temperature:g}; the distillation target must be the teacher "
                            f"at the student's temperature: restart serve_teacher with --temperature {temperature:g}")
    else:
        return
    if theirs != tokenizer_fingerprint(student):
        raise UserError(f"{where}: the teacher's tokenizer differs from the actor's (--pretrain); on-policy "
                        "distillation scores the student's token ids, so both must share one tokenizer")


def check_distillation(cfg: PPOConfig, student_tokenizer: Any) -> None:
    """The run's distillation teacher, if any, shares the student's tokenizer, and a served one serves log-probs at
    the run's --temperature (UserError, one line)."""
    d = cfg.distill
    check_teacher_tokenizer(d.teacher_pretrain, d.teacher_url, student_tokenizer, d.teacher_timeout,
                            teacher_api_key(cfg), cfg.rollout.temperature)


def http_teacher(cfg: PPOConfig) -> HTTPTeacher | None:
    """The --teacher_url teacher of the run (None without one)."""
    d = cfg.distill
    return HTTPTeacher(d.teacher_url, teacher_topk(cfg), d.teacher_timeout, teacher_api_key(cfg)) \
        if d.teacher_url else None


def teacher_api_key(cfg: PPOConfig) -> str | None:
    """The bearer token for --teacher_url: --teacher_api_key, else env RLHFKIT_TEACHER_API_KEY, else none."""
    return key_or_env(cfg.distill.teacher_api_key, TEACHER_KEY_ENV)
