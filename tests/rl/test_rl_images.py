"""RL with image prompts on the tiny Qwen2-VL: the rollout engine and the trainer's forward see the same image prompt
and response alike (log-probs to 1e-4 in fp32), the images matter, the experience keeps them per sample, and a
frozen vision tower leaves the weight sync with the language model's tensors only."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.data.images import RecordImages
from rlhfkit.data.prompt_dataset import PromptDataset
from rlhfkit.data.tokens import encode, with_bos
from rlhfkit.rl.experience import Experience, experience_from_samples
from rlhfkit.rl.role_forward import action_log_probs
from rlhfkit.rl.rollout_source import expand_prompt_images


@pytest.fixture(scope="module")
def vlm(vlm_assets):
    from rlhfkit.models.loading import load_causal_lm, load_tokenizer
    from rlhfkit.models.vision import record_images

    path = str(vlm_assets.model_dir)
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path).eval()
    images: RecordImages = record_images(model.config, path, tokenizer, "images", 1)
    return model, tokenizer, images


def image_prompts(vlm_assets, tokenizer, images, n: int = 4):
    records = vlm_assets.read("rl_train")[:n]
    for r in records:  # relative image paths resolve from the working directory or the data file
        r["images"] = [str(vlm_assets.data_dir / p) for p in r["images"]]
    data = PromptDataset(records, tokenizer, input_key="prompt", label_key="answer", apply_chat_template=True,
                         images=images)
    ids = [expand_prompt_images(with_bos(tokenizer, encode(tokenizer, s["prompt"])), s, 256, i)
           for i, s in enumerate(data.samples)]
    return data, ids


def test_engine_and_trainer_log_probs_of_image_prompts_agree(vlm, vlm_assets):
    from rlhfkit.rollout.hf_engine import HFRolloutEngine

    model, tokenizer, images = vlm
    data, ids = image_prompts(vlm_assets, tokenizer, images)
    engine = HFRolloutEngine(model, tokenizer)
    rows = [s["images"] for s in data.samples for _ in range(2)]  # 2 samples per prompt: one shared prefill each
    prompts = [p for p in ids for _ in range(2)]
    samples = engine.generate(prompts, max_new_tokens=6, temperature=1.0, seed=3, images=rows)
    assert all(s.response_ids for s in samples)
    exp = experience_from_samples(samples, tokenizer.pad_token_id, rows)
    assert exp.images is not None and len(exp.images) == len(exp)
    assert all(exp.sequences[i, :len(p)].tolist() == p for i, p in enumerate(prompts))
    with torch.no_grad():
        trainer = action_log_probs(model, exp, temperature=1.0)
    mask = exp.action_mask
    gap = (trainer - exp.rollout_log_probs).abs()[mask].max()
    assert gap < 1e-4, f"engine vs trainer log-probs differ by {float(gap)}"
    # the images matter: the same ids with another prompt's image give other log-probs
    swapped = Experience(**{**exp.to_dict(), "images": rows[2:] + rows[:2]})
    with torch.no_grad():
        other = action_log_probs(model, swapped, temperature=1.0)
    assert (other - trainer).abs()[mask].max() > 1e-3


def test_experience_keeps_each_samples_images_through_select_split_and_concat(vlm, vlm_assets):
    _, tokenizer, images = vlm
    data, ids = image_prompts(vlm_assets, tokenizer, images, n=3)
    from rlhfkit.rollout.engine import SampledSequence

    samples = [SampledSequence(p, [5, 6], [-1.0, -2.0], "length") for p in ids]
    rows = [s["images"] for s in data.samples]
    exp = experience_from_samples(samples, tokenizer.pad_token_id, rows)
    picked = exp.select([2, 0])
    assert picked.images == [rows[2], rows[0]]
    assert [m.images for m in exp.split(2)] == [rows[:2], rows[2:]]
    text = experience_from_samples(samples[:1], tokenizer.pad_token_id)
    both = Experience.concat([exp, text])
    assert both.images == [*rows, None]
    inputs = both.model_inputs()
    assert inputs["image_grid_thw"].shape[0] == 3  # the three rows' images, in row order
    assert torch.equal(inputs["pixel_values"], torch.cat([r["pixel_values"] for r in rows]))
    assert Experience.from_dict(exp.to_dict()).images == rows


def test_frozen_vision_tower_is_left_out_of_the_weight_sync(vlm_assets):
    from rlhfkit.models.loading import load_causal_lm
    from rlhfkit.models.vision import frozen_vision_names

    model = load_causal_lm(str(vlm_assets.model_dir))
    names = frozen_vision_names(model)
    state = model.state_dict()
    assert names and names <= set(state)
    assert all(name.startswith("model.visual.") for name in names)
    assert not any(p.requires_grad for n, p in model.named_parameters() if n in names)
    assert all(p.requires_grad for n, p in model.named_parameters() if n not in names)


def test_agent_image_feedback_joins_the_context_token_in_token_out(vlm, vlm_assets):
    """An agent's feedback image becomes exact ids (its image-pad token once per vision token, mask 0) and pixels
    that later turns and the trainer see: the trainer's log-probs of the episode equal the engine's."""
    from pathlib import Path

    from rlhfkit.agents.episodes import episodes_to_samples, run_episodes
    from rlhfkit.rollout.hf_engine import HFRolloutEngine

    model, tokenizer, images = vlm
    data, ids = image_prompts(vlm_assets, tokenizer, images, n=2)
    engine = HFRolloutEngine(model, tokenizer)
    agent = str(Path(__file__).with_name("agent_image_feedback.py"))
    requests = [{"prompt": s["prompt"], "prompt_ids": p, "label": s["label"], "images": s["images"]}
                for s, p in zip(data.samples, ids)]
    episodes = run_episodes(engine.generate, tokenizer, agent, requests, max_steps=3, max_length=64, seed=1,
                            temperature=1.0, image_reader=images)
    samples, reward = episodes_to_samples(episodes)
    pad = images.tokens.image_token_id
    for e, s in zip(episodes, samples):
        assert e["finish"] == "done" and e["turns"] == 2, (e["finish"], e["turns"], e["error"])
        assert s.images is not None and s.images["image_grid_thw"].shape[0] == 2  # the prompt's and the feedback's
        feedback = [t for t, m in zip(s.response_ids, s.action_mask) if not m]
        assert feedback.count(pad) == 4 and all(not m for t, m in zip(s.response_ids, s.action_mask) if t == pad)
    exp = experience_from_samples(samples, tokenizer.pad_token_id)
    assert exp.images is not None
    with torch.no_grad():
        trainer = action_log_probs(model, exp, temperature=1.0)
    mask = exp.action_mask
    assert (trainer - exp.rollout_log_probs).abs()[mask].max() < 1e-4


def test_the_engine_never_samples_an_image_placeholder():
    """A sampled image-pad token would not match the trainer's images: it is filtered out like top-k, and the
    reported log-prob stays the unfiltered distribution's."""
    from rlhfkit.rollout.hf_engine import sample_tokens

    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 9.0, 0.0]])
    banned = torch.tensor([1])
    for temperature in (0.0, 1.0):
        tokens, logp = sample_tokens(logits, temperature, 1.0, -1, torch.Generator().manual_seed(0), banned)
        assert not (tokens == 1).any()
        scaled = logits / (temperature or 1.0)
        assert torch.allclose(logp, torch.log_softmax(scaled, -1).gather(-1, tokens[:, None]).squeeze(-1))
