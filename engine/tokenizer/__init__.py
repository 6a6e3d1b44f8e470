"""Tokenizers exact against llama.cpp: SentencePiece and GPT-2 byte-level BPE."""

from .tokenizer import StreamDecoder, Tokenizer, TokenizerError

__all__ = ["StreamDecoder", "Tokenizer", "TokenizerError"]
