"""The cheaper forward passes of SFT and DPO give the same losses and gradients (float64, the tiny demo model) as
scoring every sample alone, unpadded: `dense_rows` (a padded batch in fewer rows) and the LM head run from the first
target position on (`first_target_position`, `forward_logits(.., start)`)."""

from __future__ import annotations

import json

import pytest
import torch

TEMPLATE = "User: {}\nAssistant: "


@pytest.fixture(scope="module")
def model_and_pairs(demo_assets):
    from rlhfkit.data.preference_dataset import PreferenceDataset
    from rlhfkit.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(str(demo_assets.model_dir))
    recs = [json.loads(line) for line in open(demo_assets.pref_eval)][:8]
    data = PreferenceDataset(recs, tok, 64, prompt_key="prompt", input_template=TEMPLATE)
    model = load_causal_lm(str(demo_assets.model_dir), dtype=torch.float64)
    return model, tok, [data[i] for i in range(len(data))]


def alone_logps(model, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Sum of log p over each sample's response tokens, every sample forwarded alone without padding."""
    out = []
    for prompt, response in rows:
        ids = torch.cat([prompt, response])[None]
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], dim=-1)
        start = prompt.numel() - 1
        out.append(logp[torch.arange(start, ids.shape[1] - 1), ids[0, start + 1:]].sum())
    return torch.stack(out)


def grads_of(model, loss: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def test_dense_rows_keep_dpo_loss_and_gradients(model_and_pairs):
    from rlhfkit.algorithms.preference_losses import dpo_loss
    from rlhfkit.data.collate import pair_collate
    from rlhfkit.models.policy import dense_rows
    from rlhfkit.trainers.preference import sequence_logps

    model, tok, pairs = model_and_pairs
    batch = pair_collate(pairs, tok.pad_token_id)
    dense = dense_rows(model, batch)
    assert dense is not batch and dense["input_ids"].numel() < batch["input_ids"].numel()  # the layout is used
    n = len(pairs)
    ref = torch.linspace(-30, -10, 2 * n, dtype=torch.float64)  # fixed reference log-probs
    logps, counts, _ = sequence_logps(model, batch)
    loss = dpo_loss(logps[:n], logps[n:], ref[:n], ref[n:], beta=0.1)[0]
    got = grads_of(model, loss)
    rows = [(p["prompt_ids"], p["chosen_ids"]) for p in pairs] + [(p["prompt_ids"], p["rejected_ids"]) for p in pairs]
    want_logps = alone_logps(model, rows)
    want_loss = dpo_loss(want_logps[:n], want_logps[n:], ref[:n], ref[n:], beta=0.1)[0]
    want = grads_of(model, want_loss)
    torch.testing.assert_close(logps, want_logps, rtol=0, atol=1e-6)
    assert counts.tolist() == [float(r.numel()) for _, r in rows]
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dense", [True, False])
def test_sft_loss_and_gradients_unchanged(model_and_pairs, dense):
    from rlhfkit.algorithms.sft_loss import sft_loss
    from rlhfkit.data.collate import pad_collate
    from rlhfkit.data.tokens import prompt_response_sample
    from rlhfkit.models.policy import dense_rows, first_target_position, forward_logits, from_position

    model, tok, pairs = model_and_pairs
    samples = [prompt_response_sample(p["prompt_ids"], p["chosen_ids"]) for p in pairs]
    batch = pad_collate(samples, tok.pad_token_id)
    targets = int(batch["loss_mask"][:, 1:].sum())
    if dense:  # what SFTTrainer.micro_loss does
        batch = dense_rows(model, batch)
        assert "sample_ids" in batch and batch["input_ids"].shape[0] < len(samples)
    start = first_target_position(batch)
    assert (start == 0) == dense  # padded: the LM head starts at the shortest prompt's last token
    assert start == (0 if dense else min(p["prompt_ids"].numel() for p in pairs) - 1)
    window = from_position(batch, start)
    logits = forward_logits(model, batch, start)
    assert logits.shape[1] == window["input_ids"].shape[1]
    loss = sft_loss(logits, window["input_ids"], window["loss_mask"], sample_ids=window.get("sample_ids"),
                    num_tokens=targets)
    got = grads_of(model, loss)
    want_loss = -alone_logps(model, [(p["prompt_ids"], p["chosen_ids"]) for p in pairs]).sum() / targets
    want = grads_of(model, want_loss)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


def test_prompt_columns_skipped_keep_sequence_logps_and_gradients(model_and_pairs):
    """Chosen and rejected of equal length: no row to save, so the padded batch runs with the LM head from the
    first target position on."""
    from rlhfkit.data.collate import pair_collate
    from rlhfkit.models.policy import dense_rows, first_target_position
    from rlhfkit.trainers.preference import sequence_logps

    model, tok, pairs = model_and_pairs
    pairs = [dict(p, rejected_ids=p["chosen_ids"].flip(0)) for p in pairs[:1]]
    batch = pair_collate(pairs, tok.pad_token_id)
    assert dense_rows(model, batch) is batch and first_target_position(batch) > 0
    logps, _, _ = sequence_logps(model, batch)
    got = grads_of(model, (logps * torch.tensor([1.0, -2.0], dtype=logps.dtype)).sum())
    p = pairs[0]
    want_logps = alone_logps(model, [(p["prompt_ids"], p["chosen_ids"]), (p["prompt_ids"], p["rejected_ids"])])
    want = grads_of(model, (want_logps * torch.tensor([1.0, -2.0], dtype=logps.dtype)).sum())
    torch.testing.assert_close(logps, want_logps, rtol=0, atol=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


def test_dense_rows_leave_packed_batches(model_and_pairs):
    from rlhfkit.data.collate import pair_collate
    from rlhfkit.models.policy import dense_rows

    model, tok, pairs = model_and_pairs
    packed = pair_collate(pairs, tok.pad_token_id, packing=True)
    assert dense_rows(model, packed) is packed
