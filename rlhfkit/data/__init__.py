"""The data layer: read records, format prompts, tokenise with loss masks, batch (padded or packed).

Typical use in a trainer:
    train_records, eval_records = load_train_eval(cfg.data, seed)
    train = SFTDataset.from_args(train_records, tokenizer, cfg.data)
    collate = make_collate(tokenizer.pad_token_id, packing=cfg.data.packing_samples)
    for batch_indices in global_batches(len(train), train_batch_size, seed, epoch): ...
"""

from rlhfkit.data.collate import collate_samples, make_collate, pad_collate, pair_collate, unpaired_collate
from rlhfkit.data.packing import pack_collate, unpack_lengths
from rlhfkit.data.preference_dataset import PreferenceDataset, UnpairedDataset
from rlhfkit.data.prompt_dataset import PromptDataset
from rlhfkit.data.readers import Record, load_mixture, load_records, load_train_eval
from rlhfkit.data.sampler import check_batch_sizes, global_batches, micro_batches_for_rank
from rlhfkit.data.sft_dataset import SFTDataset
from rlhfkit.data.templates import PromptFormatter, check_input_template, get_record_field, setup_chat_template

__all__ = [
    "PreferenceDataset", "PromptDataset", "PromptFormatter", "Record", "SFTDataset", "UnpairedDataset",
    "check_batch_sizes", "check_input_template", "collate_samples", "get_record_field", "global_batches",
    "load_mixture", "load_records", "load_train_eval", "make_collate", "micro_batches_for_rank", "pack_collate",
    "pad_collate", "pair_collate", "setup_chat_template", "unpack_lengths", "unpaired_collate",
]
