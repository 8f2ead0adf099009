"""Training data: conversations -> chat-template tokens with an assistant loss mask -> draft
vocabulary -> grain batches. CLI: ``python -m eagle3_jax.data prepare|vocab ...``."""

from eagle3_jax.data.pipeline import BATCH_KEYS, make_dataset, make_train_iterator
from eagle3_jax.data.sources import (
    CONVERSATIONS_FILE,
    DataError,
    PrepareStats,
    iter_json_array,
    load_benchmark_prompts,
    normalize_conversation,
    prepare_conversations,
    read_conversations,
    sharegpt_wheel_path,
    write_jsonl,
)
from eagle3_jax.data.tokenize import (
    TokenizedRecords,
    assistant_char_spans,
    load_tokenizer,
    tokenize_conversation,
    tokenize_conversations,
)
from eagle3_jax.data.vocab import (
    build_draft_vocab,
    count_tokens,
    load_vocab,
    load_vocab_map,
    save_vocab,
    select_draft_vocab,
    vocab_arrays,
)

__all__ = [
    "BATCH_KEYS", "CONVERSATIONS_FILE", "DataError", "PrepareStats", "TokenizedRecords",
    "assistant_char_spans", "build_draft_vocab", "count_tokens", "iter_json_array",
    "load_benchmark_prompts", "load_tokenizer", "load_vocab", "load_vocab_map", "make_dataset",
    "make_train_iterator", "normalize_conversation", "prepare_conversations",
    "read_conversations", "save_vocab", "select_draft_vocab", "sharegpt_wheel_path",
    "tokenize_conversation", "tokenize_conversations", "vocab_arrays", "write_jsonl",
]
