"""DistilBertForSequenceClassification: a BERT-like encoder without token types or pooler; the
head is pre_classifier, ReLU, dropout, classifier on the first token (torch half: stage.py)."""

from ..descriptor import Family, Layout

FAMILY = Family(
    name="distilbert",
    hf_classes={
        "DistilBertForSequenceClassification":
            "transformers.models.distilbert.configuration_distilbert:DistilBertConfig",
    },
    task="sequence_classification",
    stage="ppdsl.core.families.distilbert.stage:DistilBertStage",
    config_keys={"ffn": ("hidden_dim",)},
    # 5.x; then transformers 4.x's eager and sdpa classes
    attention_classes=("DistilBertSelfAttention", "MultiHeadSelfAttention", "DistilBertSdpaAttention"),
    synthetic_padding=True,
    layout=Layout("distilbert.transformer.layer", ("distilbert.embeddings",), ("pre_classifier", "classifier")),
)
