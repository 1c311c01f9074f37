"""Writes the shipped source/target example for encoder-decoder models: specs/data/pairs.jsonl
(rows {"source": ..., "target": ...}) and specs/data/pairs_tokenizer/ (a word-level tokenizer
built with the `tokenizers` library, whose post-processor wraps every text in <s> ... </s> as
BART's does; ids <s> 0, <pad> 1, </s> 2, <unk> 3, BART's defaults). Deterministic: running it
again writes the same bytes.

Each source is 3 to 9 English number words; its target is their German words, word by word,
which the decoder learns only through cross-attention.
Sources differ in length, so batches hold padded sources and targets (-100 label tails).

    python specs/data/make_pairs.py
"""

from __future__ import annotations

import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
SPECIAL = ["<s>", "<pad>", "</s>", "<unk>"]
WORDS = {"zero": "null", "one": "eins", "two": "zwei", "three": "drei", "four": "vier", "five": "fuenf",
         "six": "sechs", "seven": "sieben", "eight": "acht", "nine": "neun", "ten": "zehn", "eleven": "elf"}


def pairs(n: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    english = sorted(WORDS)
    out = []
    for _ in range(n):
        source = [rng.choice(english) for _ in range(rng.randint(3, 9))]
        out.append({"source": " ".join(source), "target": " ".join(WORDS[w] for w in source)})
    return out


def write_tokenizer(directory: str, words: list[str] | None = None) -> None:
    """A word-level tokenizer of ``words`` (default: the English and German number words) after SPECIAL."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = sorted(WORDS) + sorted(WORDS.values()) if words is None else words
    vocab = {t: i for i, t in enumerate(SPECIAL + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    tok.add_special_tokens(SPECIAL)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1024, "clean_up_tokenization_spaces": False,
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def main() -> None:
    with open(os.path.join(HERE, "pairs.jsonl"), "w") as f:
        for row in pairs(384):
            f.write(json.dumps(row, sort_keys=True) + "\n")
    write_tokenizer(os.path.join(HERE, "pairs_tokenizer"))


if __name__ == "__main__":
    main()
