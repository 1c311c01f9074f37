"""Python factories (ppdsl's own decoder and any model ``first -> blocks -> last`` whose blocks
take and return one tensor). Its layout defaults are the generic decoder's; the plan's layout is
taken as given (torch half: runtime/stage/adapters/generic.py)."""

from ..descriptor import Family, Layout

FAMILY = Family(
    name="generic",
    hf_classes={},
    task="causal_lm",
    stage="ppdsl.runtime.stage.adapters.generic:GenericStage",
    ffn_per_hidden=4,  # the decoder's ffn_dim = None
    layout=Layout("layers", ("tok_embeddings", "pos_embeddings"), ("norm", "output")),
    python_factories=True,
)
