"""An external agent driving episodes through the OpenAI-compatible endpoint over the policy.

`run_agent` is ordinary client code, as an agent framework would run it against any OpenAI-compatible server: a
two-turn chat over plain HTTP (urllib, loopback only, a timeout on every call). The endpoint (in the rollout
engine, one per episode) records each call's exact prompt and sampled token ids, and those traces train: the
model's replies are the actions, the rendered user turns between them are feedback (masked out of the loss).

    python -m rlhfkit.cli.train_ppo_ray ... --agent_func_path examples/agent_openai_http.py --label_key answer \\
        --generate_max_len 64
"""

from __future__ import annotations

import json
import urllib.request

from rlhfkit.agents import OpenAIAgentExecutor

TIMEOUT_S = 120
FOLLOW_UP = "Check it. Reply with the final answer only."


def chat(base_url: str, messages: list[dict], max_tokens: int) -> dict:
    body = json.dumps({"model": "policy", "messages": messages, "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(f"{base_url}/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        return json.load(response)


class AgentExecutor(OpenAIAgentExecutor):
    def run_agent(self, base_url: str, prompt: str, label) -> float:
        messages = [{"role": "user", "content": prompt}]
        for turn in range(2):  # the answer, then the answer after a request to check it
            reply = chat(base_url, messages, max_tokens=8)
            messages += [reply["choices"][0]["message"]]
            if turn == 0:
                messages += [{"role": "user", "content": FOLLOW_UP}]
        final = messages[-1]["content"].strip().splitlines()
        return 1.0 if final and final[0].strip() == str(label).strip() else 0.0
