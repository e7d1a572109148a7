"""An agent file in OpenRLHF 0.11's style, run by rlhfkit as it is: OpenRLHF's import line, and an executor that
drives the engine itself (vLLM's `generate(token_ids, sampling_params)`) and returns OpenRLHF's `execute()` dict.

Up to two attempts at the prompt's addition: a wrong first answer gets "wrong, try again" as feedback. The reward is
1 for a right answer (0.5 when it took the second attempt), 0 otherwise.

    --agent_func_path examples/agent_openrlhf_dict.py --label_key answer
"""

from copy import deepcopy

from openrlhf.utils.agent import AgentExecutorBase

FEEDBACK = "\nwrong, try again: "


def is_right(text: str, label: str) -> bool:
    words = text.strip().split()
    return bool(words) and words[0].rstrip(".") == str(label).strip()


class AgentExecutor(AgentExecutorBase):
    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine):
        tokens = hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        budget = len(tokens) + max_length
        action_ranges, log_probs, reward = [], [0.0] * len(tokens), 0.0
        for attempt in range(2):
            sampling_params.max_tokens = budget - len(tokens)
            if sampling_params.max_tokens <= 0:
                break
            output = (await llm_engine.generate(tokens, deepcopy(sampling_params))).outputs[0]
            action = list(output.token_ids)
            action_ranges.append((len(tokens), len(tokens) + len(action)))
            tokens = tokens + action
            log_probs += [lp[t].logprob for t, lp in zip(action, output.logprobs)]
            if is_right(output.text, label):
                reward = 1.0 if attempt == 0 else 0.5
                break
            feedback = hf_tokenizer(FEEDBACK, add_special_tokens=False)["input_ids"]
            if attempt == 1 or len(tokens) + len(feedback) >= budget:
                break
            tokens = tokens + feedback
            log_probs += [0.0] * len(feedback)
        return {"prompt": prompt, "label": label, "reward": reward, "scores": reward, "observation_tokens": tokens,
                "action_ranges": action_ranges, "rollout_log_probs": log_probs,
                "extra_logs": {"attempts": len(action_ranges)}}
