"""Tokenizers and chat templates."""

from eagle3_jax.text.tokenizer import END_OF_TURN_TOKENS, ChatTokenizer, TokenizerError

__all__ = ["END_OF_TURN_TOKENS", "ChatTokenizer", "TokenizerError"]
