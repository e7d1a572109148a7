#!/usr/bin/env bash
# Entrypoint of the rlhfkit image: run any rlhfkit command by name.
#   docker run IMAGE train_sft --pretrain ... --save_path /runs/sft       (= rlhfkit train_sft ...)
#   docker run -e RLHFKIT_LAUNCHER=deepspeed IMAGE train_dpo ...          (one process per GPU)
#   docker run -e RLHFKIT_LAUNCHER=torchrun -e NPROC_PER_NODE=4 IMAGE train_sft ...
#   docker run IMAGE ray start --head ...                                 (ray, deepspeed, torchrun, python, bash, sh
#                                                                          and pip run as given)
#   docker run IMAGE list                                                 (the commands, one a line)
#   docker run IMAGE                                                      (usage)
# The commands are rlhfkit's own (rlhfkit/cli/main.py), not a copy kept here, so a new command needs no change.
set -euo pipefail
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"  # tokenizers' threads fight the trainer's

if [ $# -eq 0 ] || [ "$1" = help ] || [ "$1" = --help ] || [ "$1" = -h ]; then
  exec python -m rlhfkit.cli.main --help
fi
case "$1" in
  list) exec python -m rlhfkit.cli.catalog ;;
  ray | deepspeed | torchrun | python | python3 | bash | sh | pip) exec "$@" ;;
esac

command="$1"
shift
module="rlhfkit.cli.${command//-/_}"
case "${RLHFKIT_LAUNCHER:-python}" in
  python) exec python -m rlhfkit.cli.main "${command}" "$@" ;;
  deepspeed) exec deepspeed --module "${module}" "$@" ;;
  torchrun) exec torchrun --nproc_per_node "${NPROC_PER_NODE:-gpu}" -m "${module}" "$@" ;;
  *)
    echo "entrypoint: RLHFKIT_LAUNCHER must be python, deepspeed or torchrun (got ${RLHFKIT_LAUNCHER})" >&2
    exit 2
    ;;
esac
