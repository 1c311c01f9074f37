"""Training data: the sources of `train.data` (synthetic, token files, corpora, documents, chat, pairs, images, speech, mixtures), their cache and identity, and the prefetch thread."""
