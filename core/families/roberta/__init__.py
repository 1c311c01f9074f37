"""RobertaForSequenceClassification: BERT's encoder with position ids counted from
padding_idx + 1 (padding tokens keep padding_idx) and a classification head on the first
token (no pooler) (torch half: stage.py)."""

from ..descriptor import Family, Layout

FAMILY = Family(
    name="roberta",
    hf_classes={"RobertaForSequenceClassification": "transformers.models.roberta.configuration_roberta:RobertaConfig"},
    task="sequence_classification",
    stage="ppdsl.core.families.roberta.stage:RobertaStage",
    attention_classes=("RobertaSelfAttention",),
    attention_wrappers={"RobertaAttention": "self"},
    synthetic_padding=True,
    layout=Layout("roberta.encoder.layer", ("roberta.embeddings",), ("classifier",)),
)
