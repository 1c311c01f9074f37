"""Writes the shipped chat example: specs/data/chat.jsonl (conversations, a `messages` field of
{role, content}) and specs/data/chat_tokenizer/ (a word-level tokenizer built with the
`tokenizers` library, its tokenizer_config.json holding a ChatML chat template whose assistant
turns are marked with {% generation %}). Deterministic: running it again writes the same bytes.

    python specs/data/make_chat.py
"""

from __future__ import annotations

import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
           "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen"]
COLOURS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "sun": "yellow", "blood": "red",
           "sea": "blue", "leaf": "green", "milk": "white", "night": "black", "lemon": "yellow", "rose": "red"}
SYSTEMS = ["you are a helpful assistant .", "answer in one short sentence .", "be brief and exact ."]


def turn(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randrange(10), rng.randrange(9)
        return f"what is {NUMBERS[a]} plus {NUMBERS[b]} ?", f"{NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[a + b]} ."
    if kind == 1:
        thing = rng.choice(sorted(COLOURS))
        return f"what colour is the {thing} ?", f"the {thing} is {COLOURS[thing]} ."
    a = rng.randrange(1, 19)
    return f"what comes after {NUMBERS[a - 1]} ?", f"after {NUMBERS[a - 1]} comes {NUMBERS[a]} ."


def conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
        for _ in range(rng.randrange(1, 4)):
            q, a = turn(rng)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out.append({"messages": messages})
    return out


def words(convs: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for c in convs:
        for m in c["messages"]:
            for w in (m["role"] + " " + m["content"]).split():
                seen.setdefault(w, None)
    return sorted(seen)


def write_tokenizer(directory: str, vocabulary: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIAL + vocabulary)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1024, "clean_up_tokenization_spaces": False,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<pad>", "unk_token": "<unk>",
        "chat_template": TEMPLATE,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def main() -> None:
    convs = conversations(384)
    with open(os.path.join(HERE, "chat.jsonl"), "w") as f:
        for c in convs:
            f.write(json.dumps(c, sort_keys=True) + "\n")
    write_tokenizer(os.path.join(HERE, "chat_tokenizer"), words(convs))


if __name__ == "__main__":
    main()
