"""BertForSequenceClassification: bidirectional encoder, pooler + classifier (torch half: stage.py)."""

from ppdsl.families.descriptor import Family

FAMILY = Family(
    name="bert",
    hf_classes={"BertForSequenceClassification": "transformers.models.bert.configuration_bert:BertConfig"},
    blocks="bert.encoder.layer",
    first=("bert.embeddings",),
    last=("bert.pooler", "classifier"),
    task="sequence_classification",
    stage="ppdsl.families.bert.stage:BertStage",
    attention_classes=("BertSelfAttention",),
    attention_wrappers={"BertAttention": "self"},
    synthetic_padding=True,  # the pooler reads the first token: padded examples exercise the mask
)
