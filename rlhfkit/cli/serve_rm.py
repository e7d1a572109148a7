"""`python -m rlhfkit.cli.serve_rm --reward_pretrain DIR --port N`: serve a reward model over HTTP.

POST /get_reward {"query": [text, ...]} -> {"rewards": [float, ...]}; GET /health. Use it from PPO with
`--remote_rm_url http://127.0.0.1:N/get_reward`. Binds 127.0.0.1 unless --host says otherwise. Every request needs
`Authorization: Bearer <key>` with the key from --api_key or RLHFKIT_RM_API_KEY; --no_auth serves without one.
SIGTERM (or Ctrl-C) stops it gracefully: requests in flight get their answers first.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlhfkit.cli.common import note_openrlhf_defaults, quiet_libraries, run_cli
from rlhfkit.config.base import parse_config_given, required
from rlhfkit.config.preference import ServeRMConfig
from rlhfkit.config.serving import announce_ready, serve_until_stopped

PROG = "rlhfkit.cli.serve_rm"


def main(argv: Sequence[str] | None = None) -> int:
    quiet_libraries()
    cfg, given = parse_config_given(ServeRMConfig, argv, PROG, __doc__)
    note_openrlhf_defaults(PROG, cfg, given)
    cfg.check_inputs()  # the auth rule included: fails before the model loads
    api_key = cfg.resolved_api_key()  # None only with --no_auth, which is refused while any key is set
    from rlhfkit.models.loading import resolve_attn_implementation
    from rlhfkit.rewards.scorer import load_scorer
    from rlhfkit.rewards.server import RewardServer

    attn = resolve_attn_implementation(cfg.attn_implementation, cfg.flash_attn)
    scorer = load_scorer(required(cfg.reward_pretrain, "reward_pretrain"), value_head_prefix=cfg.value_head_prefix,
                         max_len=cfg.max_len, normalize=cfg.normalize_reward, batch_size=cfg.batch_size, bf16=cfg.bf16,
                         attn_implementation=attn, use_fast_tokenizer=not cfg.disable_fast_tokenizer)
    server = RewardServer(scorer, host=cfg.host, port=cfg.port, api_key=api_key, batch_size=cfg.batch_size,
                          batch_wait_ms=cfg.batch_wait_ms, max_body_bytes=cfg.max_body_bytes,
                          max_queries_per_request=cfg.max_queries_per_request, request_timeout=cfg.request_timeout,
                          client_timeout=cfg.client_timeout, max_concurrent_bodies=cfg.max_concurrent_bodies,
                          max_connections=cfg.max_connections, keep_alive_timeout=cfg.keep_alive_timeout)

    def announce(server: RewardServer) -> None:  # (--no_auth next to a key was refused: api_key is None then)
        announce_ready(PROG, "reward", server.url, f"normalize_reward={scorer.normalize}", bearer=bool(server.api_key),
                       no_auth=cfg.no_auth, reach=f"{cfg.host}:{server.port}")

    serve_until_stopped(server.start, announce, "reward")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
