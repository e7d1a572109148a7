"""A multi-turn agent whose feedback carries images, for a vision-language policy (`--image_key`): the tiny VLM's
image tasks (`rlhfkit/demo/vlm_tasks.py`: count the dots, name the square's colour, read the digit).

Each turn the policy answers the question about the last picture it was shown. A right answer ends the episode
with reward 1 / turn; a wrong one earns 0.1 if it is one word or number alone (the format) and gets
a new picture of the same task, drawn on the spot, with the question again (`environment_images`: the image joins
the context token in token out, its vision tokens with action mask 0), up to `TURNS` turns. Train it with the tiny
VLM's RL data (docs/vlm.md):

    python -m rlhfkit.cli.train_ppo --pretrain vlm/model --prompt_data vlm/data/rl_train.jsonl \\
        --input_key prompt --label_key answer --image_key images --max_images_per_prompt 1 --apply_chat_template \\
        --agent_func_path examples/agent_image_feedback.py --max_steps 3 --advantage_estimator group_norm \\
        --n_samples_per_prompt 4 --generate_max_len 96 --save_path ./vlm_agent

The feedback is a new user turn in the tiny VLM's chat template (`<|user|>` ... `<|assistant|>`); for another model,
write its own turn markers in `TURN`.
"""

import random
import re
import zlib

from rlhfkit.agents import AgentExecutorBase, AgentInstanceBase
from rlhfkit.demo.vlm_tasks import make_image_problem

TURNS = 3  # the most answers an episode gets (pass the same --max_steps)
ANSWER_TOKENS = 6  # one turn's answer is a word or a number: a short cap per turn leaves room for the feedback
TURN = "\n<|user|>\nNo. Look at this one: <image>{question}\n<|assistant|>\n"
QUESTIONS = {"How many dots are there?": "dots", "Which colour is the square?": "colour",
             "Which digit is shown?": "digit"}


def first_word(text):
    words = re.findall(r"[a-z0-9]+", text.lower())
    return words[0] if words else ""


def one_word(text):
    return re.fullmatch(r"\s*[a-z0-9]+\s*", text.lower()) is not None


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0
        self.answer = None  # the answer to the last picture shown (the label until feedback shows another)
        self.question = None
        self.rng = random.Random(0)

    async def reset(self, states, **kwargs):
        prompt = states["observation"]
        self.answer = str(states["label"])
        self.question = next((q for q in QUESTIONS if q in prompt), "How many dots are there?")
        # the episode's pictures follow from its prompt: the same prompt draws the same feedback images
        self.rng = random.Random(zlib.crc32(prompt.encode()))
        return {"observation": prompt}

    async def step(self, states, **kwargs):
        self.turn += 1
        answer = states["action_text"]
        correct = first_word(answer) == self.answer
        done = correct or self.turn >= TURNS
        out = {"rewards": 1.0 / self.turn if correct else 0.1 if one_word(answer) else 0.0, "done": done,
               "extra_logs": {"correct": float(correct), "turn": float(self.turn)}}
        if not done:
            problem = make_image_problem(QUESTIONS[self.question], self.rng)
            self.answer = problem["answer"]
            out["environment_feedback"] = TURN.format(question=self.question)
            out["environment_images"] = [problem["image"]]  # a PIL image; paths, URLs and bytes work too
        return out


class AgentExecutor(AgentExecutorBase):
    def __init__(self, max_steps, max_length, llm_engine, hf_tokenizer, result_queue):
        super().__init__(AgentInstance, max_steps, max_length, llm_engine, hf_tokenizer, result_queue)

    async def execute(self, prompt, label, sampling_params, *args, **kwargs):
        return await super().execute(prompt, label, {**sampling_params, "max_tokens": ANSWER_TOKENS}, *args,
                                     **kwargs)
