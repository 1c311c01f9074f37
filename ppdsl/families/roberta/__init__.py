"""RobertaForSequenceClassification: BERT's encoder with position ids counted from
padding_idx + 1 (padding tokens keep padding_idx) and a classification head on the first
token (no pooler) (torch half: stage.py)."""

from ppdsl.families.descriptor import Family

FAMILY = Family(
    name="roberta",
    hf_classes={"RobertaForSequenceClassification": "transformers.models.roberta.configuration_roberta:RobertaConfig"},
    blocks="roberta.encoder.layer",
    first=("roberta.embeddings",),
    last=("classifier",),
    task="sequence_classification",
    stage="ppdsl.families.roberta.stage:RobertaStage",
    attention_classes=("RobertaSelfAttention",),
    attention_wrappers={"RobertaAttention": "self"},
    synthetic_padding=True,
)
