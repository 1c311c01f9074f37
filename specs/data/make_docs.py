"""Write the documents of specs/parquet_lm.ppspec, in the two layouts `hf_dataset` reads most:

- specs/data/lm_corpus/part-0000{0,1}.parquet: 640 short documents in two Parquet shards (one
  column, "text"), as a corpus downloaded from the Hub in Parquet form looks;
- specs/data/lm_saved/: the same documents as a `datasets.DatasetDict` written with
  `save_to_disk`, split "train" (576 documents) and "validation" (the other 64).

Generated (not downloaded), seeded: `python specs/data/make_docs.py` rewrites the same rows.
Each document is a heading and a few product reviews (the sentences of make_reviews.py), so
a small causal LM learns the vocabulary and the templates within a few dozen steps. Needs
pyarrow (`pip install 'ppdsl[data]'`) and, for lm_saved, the `datasets` library (`pip install
datasets`): ppdsl itself reads both with pyarrow alone.
"""

from __future__ import annotations

import random
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from make_reviews import THINGS, review  # noqa: E402

COUNT, VALIDATION, SHARDS, SEED = 640, 64, 2, 1


def document(rng: random.Random) -> str:
    """A heading and two to four reviews: "Reviews from the {thing} shop. The lamp is great. ..."."""
    sentences = [f"Reviews from the {rng.choice(THINGS)} shop."]
    sentences += [str(review(rng)["text"]) for _ in range(rng.randint(2, 4))]
    return " ".join(sentences)


def main() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(SEED)
    docs = [document(rng) for _ in range(COUNT)]
    corpus = HERE / "lm_corpus"
    shutil.rmtree(corpus, ignore_errors=True)
    corpus.mkdir()
    per = COUNT // SHARDS
    for i in range(SHARDS):
        pq.write_table(pa.table({"text": docs[i * per : (i + 1) * per]}), corpus / f"part-{i:05d}.parquet",
                       compression="zstd")
    print(f"wrote {COUNT} documents to {corpus} ({SHARDS} shards)")
    try:
        import datasets
    except ImportError:
        print("datasets is not installed: lm_saved not written (pip install datasets)")
        return
    datasets.disable_progress_bars()
    saved = HERE / "lm_saved"
    shutil.rmtree(saved, ignore_errors=True)
    split = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": docs[: COUNT - VALIDATION]}),
        "validation": datasets.Dataset.from_dict({"text": docs[COUNT - VALIDATION :]}),
    })
    split.save_to_disk(str(saved))
    print(f"wrote {saved} (save_to_disk: train {COUNT - VALIDATION}, validation {VALIDATION})")


if __name__ == "__main__":
    main()
