"""Where synthetic prompts get their tokens, and how text is counted.

A benchmark does not need the served model's tokenizer to send token ids, only
a range of ids the model accepts; it needs one to count the tokens of a text
prompt (ShareGPT) exactly. Without one, text lengths are estimated and the
server's reported usage is what the metrics use.
"""

from __future__ import annotations

import os

import numpy as np

# Without a tokenizer: ids in [_LOW_ID, vocab) skip the special tokens most
# vocabularies keep at the start; 32,000 is the smallest common Llama-family vocabulary.
_LOW_ID = 100
DEFAULT_VOCAB_SIZE = 32_000
# Words that are one token each in common BPE vocabularies, so that text made
# from n of them is roughly n tokens long.
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had "
    "by word but not what all were we when your can said there use an each which she do how their if will "
    "up other about out many then them these so some her would make like him into time has look two more "
    "write go see number no way could people my than first water been call who oil its now find long down "
    "day did get come made may part"
).split()
_CHARS_PER_TOKEN = 4  # the usual English estimate, used only without a tokenizer


class TokenSource:
    """Random token ids in the model's range, their text, and token counts of text."""

    def __init__(self, tokenizer=None, vocab_size: int | None = None):
        self.tokenizer = tokenizer
        if tokenizer is not None:
            size = vocab_size or tokenizer.vocab_size
            skip = set(getattr(tokenizer, "special_ids", ())) | set(tokenizer.eos_token_ids)
            if tokenizer.bos_token_id is not None:
                skip.add(tokenizer.bos_token_id)
            self._ids = np.array([i for i in range(size) if i not in skip], dtype=np.int64)
        else:
            size = vocab_size or DEFAULT_VOCAB_SIZE
            self._ids = np.arange(min(_LOW_ID, size // 2), size, dtype=np.int64)
        if len(self._ids) == 0:
            raise ValueError(f"no usable token ids in a vocabulary of {size}")
        self.vocab_size = size

    @classmethod
    def from_path(cls, path: str | None, vocab_size: int | None = None) -> TokenSource:
        return cls(load_tokenizer(path) if path else None, vocab_size)

    @property
    def exact(self) -> bool:
        """Whether `count` is exact (a tokenizer is loaded) or an estimate."""
        return self.tokenizer is not None

    def random_ids(self, rng: np.random.Generator, n: int) -> list[int]:
        return self._ids[rng.integers(0, len(self._ids), n)].tolist()

    def text(self, ids: list[int]) -> str:
        """Text for ids, for endpoints that take only text (chat)."""
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids)
        return " ".join(_WORDS[i % len(_WORDS)] for i in ids)

    def count(self, text: str) -> int:
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text, add_special_tokens=False))
        return max(1, len(text) // _CHARS_PER_TOKEN)


def load_tokenizer(path: str):
    """pdserve's tokenizer from a Hugging Face directory, a tokenizer.json, or a GGUF file."""
    # imported here: the engine package pulls in torch, which a plain run with token ids never needs
    from pdserve.engine.tokenizer import Tokenizer

    if os.path.isdir(path):
        return Tokenizer.from_hf_dir(path)
    if os.path.basename(path) == "tokenizer.json":
        return Tokenizer.from_hf_dir(os.path.dirname(path) or ".")
    if os.path.isfile(path):
        from pdserve.engine.gguf_file import GGUFFile

        return Tokenizer.from_gguf(GGUFFile(path))
    raise ValueError(f"--tokenizer {path!r}: no such file or directory")
