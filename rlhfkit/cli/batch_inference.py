"""`python -m rlhfkit.cli.batch_inference`: generate over a dataset (Transformers or vLLM, one engine or several on
Ray), score with a reward model / reward function / reward servers, and write samples or training data as JSONL.

    # best-of-4 rejection sampling into an SFT set, scored by a reward model
    python -m rlhfkit.cli.batch_inference --eval_task generate_vllm --pretrain SFT_DIR --dataset prompts.jsonl \\
        --input_key prompt --apply_chat_template --best_of_n 4 --temperature 1.0 --max_new_tokens 512 \\
        --reward_pretrain RM_DIR --post_processor rs --output_path best.jsonl
    # then: train_sft --dataset best.jsonl --input_key input --output_key output --apply_chat_template ...

`--post_processor iter_dpo` writes {"prompt", "chosen", "rejected"} pairs for train_dpo --prompt_key prompt;
`csft` writes every sample with its reward in the prompt. Prompts are written as the records held them: give the
trainer the same --input_template / --apply_chat_template.
"""

from __future__ import annotations

import sys

from rlhfkit.cli.common import cli_main, run_cli
from rlhfkit.config.batch_inference import BatchInferenceConfig

PROG = "rlhfkit.cli.batch_inference"

main = cli_main(BatchInferenceConfig, PROG, __doc__, "rlhfkit.inference.batch:run_batch_inference")


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
