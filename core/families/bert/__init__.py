"""BertForSequenceClassification: bidirectional encoder, pooler + classifier (torch half: runtime/stage/adapters/bert.py)."""

from ..descriptor import Family, Layout

FAMILY = Family(
    name="bert",
    hf_classes={"BertForSequenceClassification": "transformers.models.bert.configuration_bert:BertConfig"},
    task="sequence_classification",
    stage="ppdsl.runtime.stage.adapters.bert:BertStage",
    attention_classes=("BertSelfAttention",),
    attention_wrappers={"BertAttention": "self"},
    synthetic_padding=True,  # the pooler reads the first token: padded examples exercise the mask
    layout=Layout("bert.encoder.layer", ("bert.embeddings",), ("bert.pooler", "classifier")),
)
