#!/usr/bin/env bash
# Launch one of the task files of this folder with the spot switch and the secrets taken from the environment:
#   WANDB_TOKEN=xxx HF_TOKEN=xxx deploy/skypilot/launch.sh sft.yaml [more `sky launch` options]
#   USE_SPOT=0 WANDB_TOKEN=xxx deploy/skypilot/launch.sh ppo.yaml --num-nodes 4
# USE_SPOT (default 1) picks spot or on-demand instances: SkyPilot reads `use_spot` from the task file before any
# env var is substituted, so the switch is its --use-spot/--no-use-spot option. Each of WANDB_TOKEN and HF_TOKEN
# that is set is passed with --secret (never written into the task file or the command line). The cluster is
# named rlhfkit-<task> unless CLUSTER says otherwise. Run it from the repository root: the task files sync `.`.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: [USE_SPOT=0|1] [CLUSTER=name] $0 TASK.yaml [sky launch options...]" >&2
  exit 2
fi
given="$1"
shift
task="${given}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ -f "${task}" ] || task="${here}/${task}"
if [ ! -f "${task}" ]; then
  echo "$0: no task file ${given} (one of: $(cd "${here}" && ls ./*.yaml | tr '\n' ' '))" >&2
  exit 2
fi
case "${USE_SPOT:-1}" in
  1 | true | yes) spot=--use-spot ;;
  0 | false | no) spot=--no-use-spot ;;
  *) echo "$0: USE_SPOT must be 1 or 0 (got ${USE_SPOT})" >&2; exit 2 ;;
esac
name="$(basename "${task}" .yaml)"
args=(launch -c "${CLUSTER:-rlhfkit-${name}}" "${task}" "${spot}")
for secret in WANDB_TOKEN HF_TOKEN; do
  if [ -n "${!secret:-}" ]; then
    args+=(--secret "${secret}")
  fi
done
exec sky "${args[@]}" "$@"
