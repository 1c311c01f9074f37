"""Write specs/data/reviews.jsonl: short product reviews labelled 1 (positive) or 0 (negative).

The data of specs/minilm_finetune.ppspec, generated (not downloaded) so the example runs
offline: `python specs/data/make_reviews.py` rewrites the same file (seeded). Negations ("not
great", "hardly worth it") flip the label, so a bag of words is not enough.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

GOOD = ["great", "excellent", "wonderful", "reliable", "comfortable", "sturdy", "fantastic", "lovely",
        "useful", "impressive", "solid", "delightful"]
BAD = ["terrible", "awful", "flimsy", "useless", "disappointing", "broken", "noisy", "cheap",
       "uncomfortable", "poor", "annoying", "defective"]
THINGS = ["blender", "jacket", "phone case", "lamp", "backpack", "kettle", "keyboard", "chair",
          "headphones", "tent", "coffee maker", "umbrella", "mattress", "watch", "printer", "drill"]
PLAIN = ["The {t} is {a}.", "This {t} was {a}.", "A really {a} {t}.", "My new {t} feels {a}.",
         "Honestly, the {t} is {a}.", "What a {a} {t}!", "I found the {t} {a}.",
         "Overall the {t} seems {a} to me."]
NEGATED = ["The {t} is not {a}.", "This {t} was never {a}.", "I would not call the {t} {a}.",
           "The {t} is hardly {a}.", "Sadly, the {t} is far from {a}."]
ENDINGS = {1: ["I would buy it again.", "Five stars.", "Recommended.", "It exceeded my expectations.", ""],
           0: ["I returned it.", "One star.", "Avoid it.", "It broke within a week.", ""]}


def review(rng: random.Random) -> dict[str, object]:
    positive_word = rng.random() < 0.5
    negated = rng.random() < 0.3
    label = int(positive_word != negated)
    template = rng.choice(NEGATED if negated else PLAIN)
    text = template.format(t=rng.choice(THINGS), a=rng.choice(GOOD if positive_word else BAD))
    ending = rng.choice(ENDINGS[label])
    return {"text": f"{text} {ending}".strip(), "label": label}


def main(count: int = 512, seed: int = 0) -> None:
    rng = random.Random(seed)
    out = Path(__file__).with_name("reviews.jsonl")
    with out.open("w", encoding="utf-8") as fh:
        for _ in range(count):
            fh.write(json.dumps(review(rng)) + "\n")
    print(f"wrote {count} reviews to {out}")


if __name__ == "__main__":
    main()
